"""LLaMA-Factory's training YAML (config), its dataset_info.json datasets (data) and the keys
its argument dataclasses accept (keys), read as zerofit's config.
"""
