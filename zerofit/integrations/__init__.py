"""zerofit for runs it does not drive: the memory guard callback for HF Trainer (hf_trainer)
and LLaMA-Factory's YAML, datasets and keys (llamafactory).
"""
