"""LoRA on a ZeRO-3 model: which modules get adapters (attach), the adapter tensors, the frozen
base and proof it is the same, an exact resume, and replaying a random init. Imports the
floors below it: core, config, machine, data, checkpoint, models.
"""
