"""`zerofit doctor --repro RUN_DIR`: a standalone reproduction script for a bug report.

The script needs only torch, transformers and deepspeed (not zerofit): the run's model
config, its exact DeepSpeed config, random tokens of the run's shape, and a loop that
trains and saves, printing memory after every step and save. Maintainers can run it
as is; `--layers N` shrinks the model while keeping every other setting.
"""
from __future__ import annotations

import json
import shlex
import time
from pathlib import Path

from zerofit.config.load import validate
from zerofit.core.errors import ConfigError
from zerofit.core.files import read_json, write_atomic
from zerofit.core.timeline import read_timeline
from zerofit.doctor.run import HF_RUN_FILE, diagnose, read_yaml, write_out
from zerofit.lora.attach import resolve, resolve_modules_to_save
from zerofit.recovery.oomreport import headline

TEMPLATE = '''#!/usr/bin/env python
"""Memory reproduction written by `zerofit doctor --repro` on {date}
from the run {run_dir} ({source}).

    python {name} [--steps N] [--save-every K] [--layers L] [--out DIR]
    torchrun --nproc_per_node {world_size} {name} ...     (the run had {world_size} rank(s))

It needs torch, transformers and deepspeed only{peft_note}. It ran with: {versions}.
{differences}{observed}
"""
import argparse
import json
import os
import socket
import warnings

# DeepSpeed calls collectives torch 2.13 deprecated, one warning per step otherwise
warnings.filterwarnings("ignore", message=r"`torch\\.distributed\\.\\w+` is deprecated", category=FutureWarning)
warnings.filterwarnings("ignore", message=r"barrier\\(\\): using the device under current context", category=UserWarning)

MODEL_CONFIG = json.loads(r"""{model_config}""")

DS_CONFIG = json.loads(r"""{ds_config}""")

SEQ_LEN = {seq_len!r}
GRADIENT_CHECKPOINTING = {gradient_checkpointing!r}
# the Trainer built its own optimizer at this LR where DS_CONFIG names none
CLIENT_OPTIMIZER_LR = {client_optimizer_lr!r}
# peft LoRA adapters on the base (the run's lora.* settings), or None for full fine-tuning
LORA = {lora}


def memory_line(torch, on_gpu):
    rss = 0
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                rss = int(line.split()[1]) * 1024
    gib = 2 ** 30
    text = f"host RSS {{rss / gib:.2f}} GiB"
    if on_gpu:
        text = (f"GPU allocated {{torch.cuda.memory_allocated() / gib:.2f}} GiB, "
                f"peak {{torch.cuda.max_memory_allocated() / gib:.2f}} GiB, "
                f"reserved {{torch.cuda.memory_reserved() / gib:.2f}} GiB; " + text)
        torch.cuda.reset_peak_memory_stats()
    return text


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps")
    parser.add_argument("--save-every", type=int, default=2, help="save a checkpoint every K steps")
    parser.add_argument("--layers", type=int, default=None, help="shrink the model to L layers")
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN)
    parser.add_argument("--out", default="repro-checkpoints", help="where checkpoints go")
    args = parser.parse_args()

    import torch
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = os.environ["DS_ACCELERATOR"] == "cuda"
    if "RANK" not in os.environ:  # one process without a launcher
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    world = int(os.environ["WORLD_SIZE"])
    ds = dict(DS_CONFIG)
    micro, accum = ds["train_micro_batch_size_per_gpu"], ds.get("gradient_accumulation_steps", 1)
    ds["train_batch_size"] = micro * accum * world
    fields = dict(MODEL_CONFIG)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    if args.layers:
        config.num_hidden_layers = args.layers
    keep_alive = HfDeepSpeedConfig(ds) if ds.get("zero_optimization", {{}}).get("stage") == 3 else None  # noqa: F841
    dtype = torch.bfloat16 if ds.get("bf16", {{}}).get("enabled") else (
        torch.float16 if ds.get("fp16", {{}}).get("enabled") else torch.float32)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config.use_cache = False
    if GRADIENT_CHECKPOINTING and hasattr(model, "activation_checkpointing_enable"):  # transformers 5's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={{"use_reentrant": False}})
    elif GRADIENT_CHECKPOINTING:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={{"use_reentrant": False}})
    if LORA:  # after the base's partitioned build, as the run did
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", **LORA), autocast_adapter_dtype=False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = None
    if "optimizer" not in ds:  # the Trainer's AdamW; accelerate swaps in CPU-Adam when the optimizer is offloaded
        offloaded = ds.get("zero_optimization", {{}}).get("offload_optimizer", {{}}).get("device", "none") != "none"
        if offloaded and ds.get("zero_force_ds_cpu_optimizer", True):
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            optimizer = DeepSpeedCPUAdam(trainable, lr=CLIENT_OPTIMIZER_LR or 1e-5)
        else:
            optimizer = torch.optim.AdamW(trainable, lr=CLIENT_OPTIMIZER_LR or 1e-5)
        ds.setdefault("zero_allow_untested_optimizer", True)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, optimizer=optimizer, config=ds)
    print(f"model built: {{memory_line(torch, on_gpu)}}", flush=True)
    for step in range(1, args.steps + 1):
        for _ in range(accum):
            ids = torch.randint(0, config.vocab_size, (micro, args.seq_len), device=engine.device)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        print(f"step {{step}} loss {{loss.item():.4f}}: {{memory_line(torch, on_gpu)}}", flush=True)
        if args.save_every and step % args.save_every == 0:
            engine.save_checkpoint(args.out, tag=f"step{{step}}")
            print(f"saved step {{step}}: {{memory_line(torch, on_gpu)}}", flush=True)


if __name__ == "__main__":
    main()
'''


def repro_inputs(run_dir: Path) -> dict:
    """Model config, DeepSpeed config and shape of the run, from its files."""
    hf_run = read_json(run_dir / HF_RUN_FILE)
    lora, differences = None, []
    if hf_run:
        model_config, ds_config = hf_run.get("model_config"), hf_run.get("ds_config")
        args = hf_run.get("args", {})
        seq_len = hf_run.get("seq_len") or 512
        if not hf_run.get("seq_len"):
            differences.append("the run recorded no sequence length: 512 here (--seq-len to change it)")
        checkpointing = bool(args.get("gradient_checkpointing"))
        client_lr = args.get("learning_rate") if ds_config and "optimizer" not in ds_config else None
        source = "HF Trainer"
    else:
        model_config, ds_config = read_json(run_dir / "model" / "config.json"), read_json(run_dir / "ds_config.json")
        config = read_yaml(run_dir / "config.yaml")
        seq_len = config.get("train", {}).get("seq_len", 512)
        checkpointing = bool(config.get("model", {}).get("gradient_checkpointing", True))
        client_lr, source = None, "zerofit"
        if config.get("lora", {}).get("enabled") and model_config:
            lora = lora_settings(config, model_config)
        if config.get("train", {}).get("chunked_loss", True):
            differences.append("the loss here is transformers' (the whole logits at once); the run's "
                               "train.chunked_loss held them a chunk of rows at a time, so this needs more memory "
                               "for logits than the run did")
    if not model_config or "model_type" not in model_config:
        missing = "does not exist" if not run_dir.exists() else "holds no model config"
        raise ConfigError(f"{run_dir} {missing} (model/config.json, or model_config in {HF_RUN_FILE}); "
                          f"a reproduction needs the model's shape")
    if not ds_config:
        raise ConfigError(f"{run_dir} holds no DeepSpeed config (ds_config.json, or ds_config in {HF_RUN_FILE}); "
                          f"the reproduction replays the run's DeepSpeed settings")
    for key in ("transformers_version", "architectures", "_name_or_path", "torch_dtype", "dtype"):
        model_config.pop(key, None)
    return {"model_config": model_config, "ds_config": ds_config, "seq_len": seq_len,
            "gradient_checkpointing": checkpointing, "source": source, "client_optimizer_lr": client_lr,
            "lora": lora, "differences": differences}


def lora_settings(raw_config: dict, model_config: dict) -> dict:
    """peft.LoraConfig's arguments for the run's lora.* settings, its target modules resolved
    as the run resolved them."""
    from transformers import AutoConfig


    config = validate(raw_config)
    fields = {k: v for k, v in model_config.items() if k not in ("model_type", "transformers_version")}
    hf_config = AutoConfig.for_model(model_config["model_type"], **fields)
    lora = config.lora
    return {"r": lora.r, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "bias": lora.bias,
            "target_modules": resolve(config, hf_config), "modules_to_save": resolve_modules_to_save(config, hf_config) or None}


def observed(run_dir: Path) -> str:
    """What the doctor saw, for the script's docstring."""
    try:
        diagnosis = diagnose(run_dir, hashes=False)  # its findings, not which checkpoint is intact
    except ConfigError:
        return "No memory timeline was recorded."
    lines = ["What zerofit doctor saw:"] + [f"  - {f.severity}: {f.title}" for f in diagnosis.findings[:6]]
    if diagnosis.postmortem:
        lines.append(f"  - {headline(diagnosis.postmortem['event'])}; DS_CONFIG is the one the run had last "
                     f"(a retry's safer settings, if it retried: postmortem/report.json holds the one that failed)")
    return "\n".join(lines) if len(lines) > 1 else "zerofit doctor found nothing unusual."


def write_repro(run_dir: str | Path, out: str | Path | None = None) -> Path:
    from importlib.metadata import version  # deepspeed's, without importing it: its import talks

    import torch
    import transformers

    run_dir = Path(run_dir)
    inputs = repro_inputs(run_dir)
    path = Path(out) if out else run_dir / "repro.py"
    start = next((r for r in read_timeline(run_dir) if r.get("phase") == "start"), {})
    world_size = start.get("world_size")
    world_size = world_size if type(world_size) is int and world_size > 0 else 1  # noqa: E721 (not a bool)
    name = in_docstring(shlex.quote(path.name))
    text = TEMPLATE.format(
        date=time.strftime("%Y-%m-%d"), run_dir=in_docstring(repr(str(run_dir))), source=inputs["source"],
        name=name, world_size=world_size,
        versions=in_docstring(f"torch {torch.__version__}, deepspeed {version('deepspeed')}, "
                              f"transformers {transformers.__version__}"),
        observed=in_docstring(observed(run_dir)), model_config=pretty(inputs["model_config"]),
        ds_config=pretty(inputs["ds_config"]), seq_len=number(inputs["seq_len"], "the sequence length", int),
        gradient_checkpointing=inputs["gradient_checkpointing"],
        client_optimizer_lr=number(inputs["client_optimizer_lr"], "the learning rate", float), lora=repr(inputs["lora"]),
        peft_note=" (and peft: the run trained LoRA adapters)" if inputs["lora"] else "",
        differences=in_docstring("".join(f"Unlike the run: {d}.\n" for d in inputs["differences"])))
    if out:
        write_out(path, text)
    else:  # in the run directory: a link planted at repro.py is replaced, never written through
        write_atomic(path, text)
    return path


def in_docstring(text: str) -> str:
    """`text` as it may stand in the script's docstring (a plain triple-quoted literal): its
    backslashes and quotes escaped, control characters but newlines as escapes. A run directory's
    name holding triple quotes then a line of code ends the literal otherwise, and runs."""
    return "".join(_escaped(c) for c in text)


def _escaped(c: str) -> str:
    if c in '\\"':
        return "\\" + c
    return c if c == "\n" or c.isprintable() else ascii(c)[1:-1]  # \t, \x00, \u2028


def number(value, what: str, kind: type):
    """A recorded int or float as the script's constant (None stays None); anything else refused."""
    if value is None and kind is float:
        return None
    if type(value) is bool or not isinstance(value, (int, float)) or (kind is int and int(value) != value):
        raise ConfigError(f"the run records {what} as {value!r}, not a number; fix the run's config or "
                          f"memory_run.json, or write the script by hand")
    return kind(value)


def pretty(value: dict) -> str:
    """A dict as JSON for json.loads in the script: HF's configs hold Infinity
    (steps_per_print), which pprint would write as the bare name `inf`. It stands in a raw
    triple-quoted literal: JSON writes every quote in a string as \\" and no string ends in three
    quotes, so no value can end the literal."""
    return json.dumps(value, indent=1)
