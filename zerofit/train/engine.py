"""Model and DeepSpeed engine construction: the model under zero.Init (with LoRA's adapters),
deepspeed.initialize with zerofit's parameter groups and schedule, and the engine's release.
The process group it runs in is ranks.py's; the process's threads and allocator, procenv.py's.
"""
from __future__ import annotations

import math
from pathlib import Path

from zerofit.checkpoint import zerofiles
from zerofit.config.schema import Config
from zerofit.core.errors import ConfigError
from zerofit.lora import adapters
from zerofit.lora import attach as lora
from zerofit.machine import opbuild
from zerofit.models import enable_checkpointing, hf_config
from zerofit.plan import spec
from zerofit.plan.deepspeed import DS_DEFAULT_REDUCE_BUCKET


def check_precision(precision: str, on_gpu: bool) -> None:
    """Refused before the build: DeepSpeed's CPU accelerator has no fp16 (its supported_dtypes are
    fp32 and bf16), and its sanity check raised only once the model was built, a traceback."""
    if precision == "fp16" and not on_gpu:
        raise ConfigError("train.precision fp16 needs a GPU: DeepSpeed's CPU accelerator trains in bf16 or fp32; "
                          "set train.precision: bf16 (or fp32)")


def torch_dtype(precision: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]


def builds_under_zero_init(ds_config: dict) -> bool:
    """Whether the model is partitioned as it is built (deepspeed.zero.Init): under ZeRO-3,
    except with DeepSpeed's ZenFlow. ZenFlow's ZeRO-3 keeps every 2-D weight transposed: it
    transposes `p.data` when the engine starts (zenflow/engine_stage3.py,
    _initialize_zenflow_stage3_prologue) and back around every gathered use
    (parameter_offload.py). A model built under zero.Init is partitioned by then (its data
    empty and 1-D), so nothing is transposed and its first forward fails ("mat1 and mat2
    shapes cannot be multiplied"). Built whole, the engine partitions it after the transpose;
    each rank holds the whole 16-bit model on the host until then, and draws a random init
    there (minutes on the CPU for a model of billions of parameters)."""
    zero = ds_config.get("zero_optimization") or {}
    return zero.get("stage") == 3 and not zero.get("zenflow")


def zenflow_refusal(config: Config, ds_config: dict) -> str | None:
    """What keeps DeepSpeed 0.19.8's ZenFlow (ZeRO-3) from training this model, with the fix;
    None when nothing does or ZenFlow is off. Checked before the model is built whole
    (builds_under_zero_init), which takes minutes for a model of billions of parameters.

    - Activation checkpointing: ZenFlow's fetch hooks transpose every gathered 2-D weight
      around each forward, the recompute's too, and the recompute's matmul fails ("mat1 and
      mat2 shapes cannot be multiplied").
    - A 2-D weight larger than reduce_bucket_size: ZenFlow transposes a gradient back only
      as it is copied into the contiguous reduce bucket (stage3.py __add_grad_to_ipg_bucket);
      a larger one is reduced where it lies, transposed, and reduce_scatter_coalesced's
      `view(-1)` fails ("view size is not compatible with input tensor's size and stride")."""
    zero = ds_config.get("zero_optimization") or {}
    if zero.get("stage") != 3 or not zero.get("zenflow"):
        return None
    if config.model.gradient_checkpointing:
        return ("DeepSpeed's ZenFlow transposes the gathered weights around every forward, activation "
                "checkpointing's recompute too, where the matmul then fails; set model.gradient_checkpointing: "
                "false (a smaller micro batch fits the activations)")

    largest = spec.from_config(config).largest_trained_matrix  # read on the meta device
    bucket = int(zero.get("reduce_bucket_size", DS_DEFAULT_REDUCE_BUCKET))
    if largest is not None and largest.numel > bucket:
        return (f"DeepSpeed's ZenFlow reduces a gradient larger than reduce_bucket_size ({bucket:,} elements) "
                f"where it lies, transposed, and fails in the first backward; the largest 2-D weight, {largest.name}, "
                f"has {largest.numel:,}: set zero.reduce_bucket_size: {largest.numel} or more (a GPU buffer of that many "
                "16-bit elements, which the plan counts)")
    return None


def build_model(config: Config, ds_config: dict):
    """The HF model, partitioned as it is built when ZeRO-3 is on (builds_under_zero_init).

    HfDeepSpeedConfig must stay alive while from_pretrained/from_config run: transformers
    checks it (is_deepspeed_zero3_enabled) to wrap construction in deepspeed.zero.Init,
    so no rank ever holds the whole model. The returned holder keeps it referenced.
    With lora.enabled the result is a peft model whose base is frozen (zerofit/lora/attach.py)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig


    # Resolved on the meta device first: a bad target pattern fails in a second, not after the build.
    lora_targets = lora.resolve(config, hf_config(config.model)) if config.lora.enabled else None
    refusal = zenflow_refusal(config, ds_config)
    if refusal:
        raise ConfigError(refusal)
    holder = HfDeepSpeedConfig(ds_config) if builds_under_zero_init(ds_config) else None
    dtype = torch_dtype(config.train.precision)
    torch.manual_seed(config.train.seed)
    common = dict(dtype=dtype, attn_implementation=config.model.attn_implementation,
                  trust_remote_code=config.model.trust_remote_code)
    if config.model.path:
        model = AutoModelForCausalLM.from_pretrained(config.model.path, local_files_only=True, **common)
    else:
        model = AutoModelForCausalLM.from_config(hf_config(config.model), **common)
    model.config.use_cache = False
    if config.model.gradient_checkpointing:
        enable_checkpointing(model)
    model._zerofit_ds_holder = holder  # keeps the weakref'd HfDeepSpeedConfig alive
    if lora_targets:
        model = lora.attach(model, config, lora_targets)
    # from_pretrained returns the model in eval mode, where transformers skips gradient checkpointing
    # (it checks self.training) and dropout: a model.path run trained without either until its first
    # eval turned training on, and peaked far above its plan
    return model.train()



def release_gathered(ds_engine) -> None:
    """Partition every ZeRO-3 parameter a forward left gathered (DeepSpeed's
    empty_partition_cache, without its gc and cache flush). `ds_engine` is the engine or
    anything holding its ZeRO optimizer as `.optimizer` (accelerate's DeepSpeedOptimizerWrapper,
    what HF Trainer hands its callbacks).

    A forward with no backward (an eval batch) keeps what the recorded training trace reuses
    within max_reuse_distance (its recompute and backward, which never come), and the next
    forward's reset_step counts none of it: that forward gathers a whole live window on top,
    and the step after an eval peaks well above the others (bench/results/README.md)."""
    partition = getattr(getattr(ds_engine, "optimizer", None), "empty_partition_cache", None)  # ZeRO-3 only
    if partition is not None:
        partition()


def param_groups(model, weight_decay: float) -> list[dict]:
    """AdamW groups: no decay on biases and norm weights (1-D tensors; under ZeRO-3 a
    partitioned parameter is flat, so its original shape is read from ds_shape)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        shape = getattr(p, "ds_shape", p.shape)
        (decay if len(shape) >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_steps(train, total_steps: int) -> int:
    """train.warmup_steps, or train.warmup_ratio of the run's steps rounded up (as transformers'
    TrainingArguments.get_warmup_steps does)."""
    return math.ceil(train.warmup_ratio * total_steps) if train.warmup_ratio is not None else train.warmup_steps


def lr_lambda(config: Config, total_steps: int):
    """Multiplier of the peak LR at optimizer step s: linear warmup, then cosine or linear
    decay to min_lr_ratio at total_steps (the schedule of Loshchilov & Hutter, SGDR)."""
    train = config.train
    warmup, floor = warmup_steps(train, total_steps), train.min_lr_ratio

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if train.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        if train.lr_schedule == "linear":
            return floor + (1 - floor) * (1 - progress)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def apply_hyperparameters(ds_engine, config: Config) -> None:
    """After a checkpoint's load, this config's optimizer settings and LR schedule. DeepSpeed
    restores the saved param groups (lr, betas, eps, weight_decay) and the scheduler's
    base_lrs, so a changed train.lr or weight_decay was ignored, and a raised max_steps ran its
    first step at the old schedule's LR, then jumped. The schedule's multipliers are already
    this config's (lr_lambda: functions are not saved); its position (last_epoch) is kept."""
    train, scheduler = config.train, ds_engine.lr_scheduler
    scheduler.base_lrs = [train.lr] * len(scheduler.base_lrs)
    groups = ds_engine.optimizer.param_groups
    for index, (group, factor) in enumerate(zip(groups, scheduler.lr_lambdas)):
        group.update(lr=train.lr * factor(scheduler.last_epoch), betas=tuple(train.adam_betas), eps=train.adam_eps,
                     weight_decay=train.weight_decay if index == 0 else 0.0)  # param_groups: decay first
    scheduler._last_lr = [group["lr"] for group in groups]


def loaded_ops(ds_config: dict) -> tuple[str, ...]:
    """The ops deepspeed.initialize loads for `ds_config`: CPU-Adam for an offloaded optimizer,
    async_io for anything on NVMe."""
    zero = ds_config.get("zero_optimization", {})
    optimizer, params = ((zero.get(name) or {}).get("device") for name in ("offload_optimizer", "offload_param"))
    return (("cpu_adam",) if optimizer in ("cpu", "nvme") else ()) + \
        (("async_io",) if "nvme" in (optimizer, params) else ())


def build_engine(model, config: Config, ds_config: dict, total_steps: int):
    """deepspeed.initialize with our param groups and LR schedule; DeepSpeed builds the
    optimizer from ds_config (CPU-Adam when offloaded) and saves the schedule with it."""
    import deepspeed
    from torch.optim.lr_scheduler import LambdaLR

    def scheduler(optimizer):
        return LambdaLR(optimizer, lr_lambda(config, total_steps))

    with opbuild.ops_unblocked(loaded_ops(ds_config)):  # CPU-Adam and async_io load here
        engine, *_ = deepspeed.initialize(model=model, config=ds_config, lr_scheduler=scheduler,
                                          model_parameters=param_groups(model, config.train.weight_decay))
    return engine


# ------------------------------------------------------------------- attach peft
def check_base_files(config) -> None:
    """Refuse, before training, a LoRA run whose adapters could not be exported: the export
    reads the base's safetensors files by the model's parameter names, and transformers 5
    renames or fuses some models' weights on load (Mixtral's files hold
    block_sparse_moe.experts.N.w1, the loaded model mlp.experts.gate_up_proj), so those names
    are not in the files. A base built from a config (no files) is recorded in the run."""
    if not config.lora.enabled or not config.model.path:
        return

    try:
        stored = zerofiles.safetensors_tensors(Path(config.model.path))
    except zerofiles.ZeroCheckpointError as e:
        raise ConfigError(f"LoRA: {e}; the adapters' export reads the base from them") from None
    frozen = [adapters.base_name(p.name) for p in spec.from_config(config).params if not p.trainable]
    missing = [name for name in frozen if name not in stored]
    if missing:
        raise ConfigError(f"LoRA on {config.model.path}: its files do not hold {len(missing)} of the weights the "
                          f"model has once loaded (e.g. {missing[0]}: transformers converts this model's weights on "
                          f"load), and the adapters' export reads the base by those names, so it could not be "
                          f"exported or merged. Fine-tune it fully instead (lora.enabled: false)")
