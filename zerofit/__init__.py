"""zerofit: fine-tune language models many times larger than the GPU on DeepSpeed ZeRO-3
with CPU/NVMe offload, and never die of memory.

Each CLI verb is also a function: `zerofit.train.loop.train(config)`,
`zerofit.config.load.load(path)`, `zerofit.export.checkpoint.export(run_dir, out)`,
`zerofit.infer.generate.generate(loaded, prompt)` and `zerofit.infer.generate.chat(model)`.
The packages, bottom to top: core, config, machine, data, checkpoint, models, lora, nvme, plan,
findings, recovery, train and infer, doctor/export/lint, integrations, commands, cli
(pyproject.toml's import-linter contracts check that an import only goes down).
"""
__version__ = "0.1.0"
