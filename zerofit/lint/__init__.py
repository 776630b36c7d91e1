"""`zerofit lint`: a DeepSpeed JSON checked the way DeepSpeed reads it (check), its optimizer
and scheduler sections (optim), and the values that run until the worst step (risk).
"""
