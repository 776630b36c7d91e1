"""Config -> the fully resolved DeepSpeed dict. The only place one is built.

Every value is explicit (no "auto"): what DeepSpeed gets is what ds_config.json shows.
Key names follow DeepSpeed's config models (deepspeed/runtime/zero/config.py,
deepspeed/runtime/zero/offload_config.py, deepspeed/runtime/config.py).
"""
from __future__ import annotations

import copy

from zerofit.config.schema import Config
from zerofit.nvme import preflight as nvme
from zerofit.nvme.swaplayout import PIPELINED_BUFFER_COUNT

# DeepSpeed's dynamic loss scaler, as its docs recommend for fp16 (runtime/fp16/loss_scaler.py).
FP16_LOSS_SCALE = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                   "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}


def build(config: Config, world_size: int, on_gpu: bool, load_universal: bool = False) -> dict:
    """load_universal: the resume loads a universal checkpoint (written by another number
    of ranks, converted by zerofit.checkpoint.universal); DeepSpeed reads it only with this switch."""
    train, zero = config.train, config.zero
    ds = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.grad_accum_steps,
        "train_batch_size": train.micro_batch_size * train.grad_accum_steps * world_size,
        "gradient_clipping": train.grad_clip,
        "steps_per_print": 10**9,  # zerofit prints progress itself
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        "optimizer": optimizer_section(config, on_gpu),
        "zero_optimization": zero_section(config),
    }
    if train.precision == "bf16":
        ds["bf16"] = {"enabled": True}
    elif train.precision == "fp16":
        ds["fp16"] = dict(FP16_LOSS_SCALE)
    if "nvme" in (zero.offload_optimizer, zero.offload_param):
        ds["aio"] = aio_section(config)
    if load_universal:
        ds["checkpoint"] = {"load_universal": True}
    return ds


def optimizer_section(config: Config, on_gpu: bool) -> dict:
    """AdamW, built by DeepSpeed: DeepSpeedCPUAdam when states are offloaded, FusedAdam on
    GPU otherwise, torch's AdamW on a CPU-only machine (no fused kernel there)."""
    train = config.train
    params = {"lr": train.lr, "betas": list(train.adam_betas), "eps": train.adam_eps,
              "weight_decay": train.weight_decay}
    if config.zero.offload_optimizer == "none" or config.zero.stage == 0:
        params["torch_adam"] = not on_gpu
    return {"type": "AdamW", "params": params}


def zero_section(config: Config) -> dict:
    zero = config.zero
    section = {"stage": zero.stage}
    if zero.stage == 0:
        return section
    section.update(overlap_comm=zero.overlap_comm, contiguous_gradients=True,
                   reduce_bucket_size=zero.reduce_bucket_size, sub_group_size=zero.sub_group_size)
    if zero.offload_optimizer != "none":
        section["offload_optimizer"] = offload_section(zero.offload_optimizer, config, ratio=zero.offload_optimizer_ratio)
        if zero.offload_optimizer == "nvme" and zero.nvme_pipeline:
            section["offload_optimizer"].update(pipeline_read=True, pipeline_write=True,
                                                buffer_count=PIPELINED_BUFFER_COUNT)
    if zero.stage == 3:
        section.update(
            stage3_prefetch_bucket_size=zero.prefetch_bucket_size,
            stage3_param_persistence_threshold=zero.param_persistence_threshold,
            stage3_max_live_parameters=zero.max_live_parameters,
            stage3_max_reuse_distance=zero.max_reuse_distance,
            stage3_gather_16bit_weights_on_model_save=zero.gather_16bit_weights_on_save,
        )
        if zero.offload_param != "none":
            section["offload_param"] = offload_section(zero.offload_param, config)
            if zero.offload_param == "nvme":
                section["offload_param"]["buffer_size"] = zero.param_buffer_size
    return section


def offload_section(device: str, config: Config, ratio: float = 1.0) -> dict:
    section = {"device": device, "pin_memory": config.zero.pin_memory}
    if device == "nvme":
        section["nvme_path"] = nvme.swap_root(config)  # the run's own folder under zero.nvme_path
    if ratio < 1.0:
        section["ratio"] = ratio
    return section


def aio_section(config: Config) -> dict:
    """DeepSpeed async I/O settings for NVMe swap (runtime/swap_tensor/aio_config.py): the
    zero.aio_* fields as resolved by nvme.resolve_aio, DeepSpeed's defaults where unset."""
    return nvme.aio_of(config).to_json()


# The keys HF Trainer fills from TrainingArguments and refuses to see differ from them
# (transformers integrations/deepspeed.py, HfTrainerDeepSpeedConfig.trainer_config_process).
TRAINER_TOP_LEVEL = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                     "gradient_clipping")
TRAINER_OPTIMIZER_PARAMS = ("lr", "betas", "eps", "weight_decay")


def for_hf_trainer(ds: dict) -> dict:
    """`ds` as HF Trainer / LLaMA-Factory take it (deepspeed=FILE): the keys the Trainer fills
    from its arguments are "auto" (a number there that differs from the arguments is an error,
    e.g. betas [0.9, 0.95] against adam_beta2's default 0.999); the ZeRO section keeps the plan's."""
    out = copy.deepcopy(ds)
    out.update({key: "auto" for key in TRAINER_TOP_LEVEL})
    params = out.get("optimizer", {}).get("params", {})
    params.update({key: "auto" for key in TRAINER_OPTIMIZER_PARAMS if key in params})
    for section in ("bf16", "fp16"):
        if section in out:
            out[section]["enabled"] = "auto"
    return out


DS_DEFAULT_REDUCE_BUCKET = 500_000_000
