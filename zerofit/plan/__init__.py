"""Planning is arithmetic: the model's shape (spec), ZeRO's states, fetch trace and
activations, the memory and step-time model (estimate, steptime), the choice of the fastest
configuration that fits (choose), the DeepSpeed dict (deepspeed) and the plan's rendering.
Never imports train, recovery or doctor.
"""
