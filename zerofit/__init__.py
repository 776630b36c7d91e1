"""zerofit: fine-tune language models many times larger than the GPU on DeepSpeed ZeRO-3
with CPU/NVMe offload, and never die of memory.

Each CLI verb is also a function: `zerofit.train.loop(config)`, `zerofit.load_config(...)`,
`zerofit.export.checkpoint(run_dir, out)`, `zerofit.generate(model_dir, prompt)`, `zerofit.chat(model_dir)`.
Heavy imports (torch, deepspeed) happen only when a verb runs.
"""
__version__ = "0.1.0"


def __getattr__(name):
    if name == "train":
        from zerofit.train.loop import train

        return train
    if name == "export":
        from zerofit.export.checkpoint import export

        return export
    if name in ("generate", "chat"):
        from zerofit import infer

        return getattr(infer, name)
    if name == "load_config":
        from zerofit.config.load import load

        return load
    raise AttributeError(f"module 'zerofit' has no attribute {name!r}")
