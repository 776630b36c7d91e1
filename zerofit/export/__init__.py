"""`zerofit export`: a ZeRO-3 checkpoint streamed into Hugging Face safetensors under a RAM cap
(checkpoint), LoRA merged into the base (merge), the shards, and --verify.
"""
