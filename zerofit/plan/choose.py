"""Choose the fastest DeepSpeed configuration that fits, or say what would fit.

Fields the user set (pydantic's `model_fields_set` on `config.zero`, `config.train`,
`config.model`) are constraints; unset ones are free. The candidates are every
combination of the free choices (offload devices, partial offload ratio, micro batch x
accumulation for a fixed `train.global_batch_size`, gradient checkpointing); bucket sizes
left unset take HF Trainer's "auto" formulas, except that one rank keeping its parameters on
the GPU makes them all persistent (`all_persistent`) and the reduce bucket is also tried
larger (`REDUCE_BUCKETS`: fewer flushes per micro batch, its memory in the prediction).
Each candidate is predicted by `planner.predict`; among those that fit with
`plan.headroom`, the fastest wins (ties go to the one using less GPU memory); when none
does, fitadvice.py says what would. Pure: a Config, a ModelSpec and a Hardware in, a Decision out.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from zerofit.config.schema import DECIDED, Config
from zerofit.core.errors import ConfigError
from zerofit.core.timeline import human_bytes
from zerofit.machine.hardware import Hardware
from zerofit.plan.activations import NORM_BUFFER_NUMEL
from zerofit.plan.estimate import Candidate, Plan, Shape, all_persistent, auto_buckets, predict, zero_default
from zerofit.plan.fitadvice import what_would_fit
from zerofit.plan.loadpeak import LOADING
from zerofit.plan.spec import ModelSpec
from zerofit.plan.states import largest_partition_numel, param_buffer_numel
from zerofit.plan.trace import DEEPSPEED_LIVE_WINDOW

PARTIAL_OFFLOAD_RATIOS = (1.0, 0.75, 0.5, 0.25)
# Reduce-bucket sizes tried beside HF's hidden^2 when the user set none, in elements: zerofit's
# default and a larger one, short of DeepSpeed's own default (5e8).
REDUCE_BUCKETS = (zero_default("reduce_bucket_size"), 200_000_000)
MAX_MICRO_BATCH = 64


class PlanError(ConfigError):
    """Nothing fits: the message holds the breakdown of the closest candidate and the fixes."""


@dataclass
class Decision:
    config: Config                       # the input with the chosen values filled in
    plan: Plan                           # the chosen (or, when nothing fits, the closest) plan
    considered: list[Plan]
    chosen_fields: dict[str, object]     # what the planner decided (free fields)
    advice: list[str]                    # when nothing fits: what would, with numbers
    nvme_problems: list[str] = field(default_factory=list)  # NVMe settings that cannot work (nvme.resolve_aio)
    record: dict | None = None           # plan.json's content (planview.plan_run), written with the run's files


# ---------------------------------------------------------------- config <-> plan
def shape_of(config: Config, world_size: int, dataset_bytes: int = 0, glibc_heap: bool = True) -> Shape:
    """The config's shape; heap temporaries only where the planned machine has glibc (Hardware.glibc_heap)."""
    train = config.train
    return Shape(seq_len=train.seq_len, micro_batch=train.micro_batch_size, grad_accum=train.grad_accum_steps,
                 world_size=world_size, precision=train.precision,
                 gradient_checkpointing=config.model.gradient_checkpointing, chunked_loss=config.train.chunked_loss,
                 eager_attention=config.model.attn_implementation == "eager",
                 packed_mask=config.data.packing and config.data.neat_packing,
                 heap_step_temporaries=config.train.heap_step_temporaries and glibc_heap,
                 dataset_bytes=dataset_bytes,
                 checkpoints_on_disk=checkpoints_on_disk(config), async_snapshot_max=async_snapshot_max(config))


def async_snapshot_max(config: Config) -> int | None:
    """The async snapshot's host cap in the planner's terms (planner.Shape)."""
    ckpt = config.checkpoint
    if not ckpt.async_save:
        return 0
    return None if ckpt.async_host_max_gib is None else int(ckpt.async_host_max_gib * 2**30)


def checkpoints_on_disk(config: Config) -> int:
    """Most checkpoints on disk at once: keep_last plus the one being written, or fewer
    when the run saves fewer times (a run with an epoch count may save keep_last + 1; the
    clock's schedule, checkpoint.every_minutes, may save at any step)."""
    ckpt, steps = config.checkpoint, config.train.max_steps
    if ckpt.every_minutes:
        saves = steps  # at most one a step
    elif ckpt.every_steps:
        saves = None if steps is None else steps // ckpt.every_steps + int(ckpt.save_final)
    else:  # the final save, if any, whatever the run's length
        saves = int(ckpt.save_final)
    return ckpt.keep_last + 1 if saves is None else min(ckpt.keep_last + 1, saves)


def candidate_of(config: Config, spec: ModelSpec, world_size: int) -> Candidate:
    """The config's own knobs; NVMe parameters' swap buffers, unless set, sized to the model
    (not a trade-off: smaller ones fail at start-up), with the planner on or off."""
    zero = config.zero
    buffer = zero.param_buffer_size if "param_buffer_size" in zero.model_fields_set else \
        param_buffer_numel(spec, world_size)
    needed = largest_partition_numel(spec, world_size)
    if zero.offload_param == "nvme" and buffer < needed:
        raise ConfigError(f"zero.param_buffer_size={buffer:,} is smaller than the largest parameter partition "
                          f"({needed:,} elements): DeepSpeed stops at start-up with \"More elements than buffer "
                          f"size\"; set zero.param_buffer_size to at least {needed:,} or leave it unset")
    return Candidate(stage=zero.stage, offload_optimizer=zero.offload_optimizer,
                     offload_optimizer_ratio=zero.offload_optimizer_ratio, offload_param=zero.offload_param,
                     param_buffer_size=buffer,
                     pin_memory=zero.pin_memory, reduce_bucket_size=zero.reduce_bucket_size,
                     prefetch_bucket_size=zero.prefetch_bucket_size,
                     param_persistence_threshold=zero.param_persistence_threshold,
                     max_live_parameters=zero.max_live_parameters, max_reuse_distance=zero.max_reuse_distance,
                     sub_group_size=zero.sub_group_size, gather_16bit_weights_on_save=zero.gather_16bit_weights_on_save,
                     aio_block_size=zero.aio_block_size or Candidate.aio_block_size,
                     aio_intra_op_parallelism=zero.aio_intra_op_parallelism or Candidate.aio_intra_op_parallelism,
                     nvme_pipeline=zero.nvme_pipeline)


def apply(config: Config, shape: Shape, cand: Candidate) -> Config:
    """A copy of `config` carrying the shape's batch split and the candidate's zero knobs."""
    zero = config.zero.model_copy(update={
        "stage": cand.stage, "offload_optimizer": cand.offload_optimizer,
        "offload_optimizer_ratio": cand.offload_optimizer_ratio, "offload_param": cand.offload_param,
        "param_buffer_size": cand.param_buffer_size,
        "reduce_bucket_size": cand.reduce_bucket_size, "prefetch_bucket_size": cand.prefetch_bucket_size,
        "param_persistence_threshold": cand.param_persistence_threshold,
        "max_live_parameters": cand.max_live_parameters, "max_reuse_distance": cand.max_reuse_distance,
        "nvme_pipeline": cand.nvme_pipeline})
    train = config.train.model_copy(update={"micro_batch_size": shape.micro_batch,
                                            "grad_accum_steps": shape.grad_accum})
    model = config.model.model_copy(update={"gradient_checkpointing": shape.gradient_checkpointing})
    return config.model_copy(update={"zero": zero, "train": train, "model": model})


# -------------------------------------------------------------------- candidates
def batch_splits(config: Config, world_size: int) -> list[tuple[int, int]]:
    """(micro batch, accumulation) pairs allowed by the config."""
    train = config.train
    fixed = train.model_fields_set
    if train.global_batch_size is None:
        return [(train.micro_batch_size, train.grad_accum_steps)]
    per_rank, rest = divmod(train.global_batch_size, world_size)
    if rest:
        raise ConfigError(f"train.global_batch_size={train.global_batch_size} is not a multiple of the world size "
                          f"{world_size}; pick a multiple of {world_size}")
    micros = [m for m in range(1, min(per_rank, MAX_MICRO_BATCH) + 1) if per_rank % m == 0]
    if "micro_batch_size" in fixed:
        micros = [m for m in micros if m == train.micro_batch_size]
    if "grad_accum_steps" in fixed:
        micros = [m for m in micros if per_rank // m == train.grad_accum_steps]
    if not micros:
        raise ConfigError(f"train.global_batch_size={train.global_batch_size} cannot be split as micro_batch_size="
                          f"{train.micro_batch_size} x grad_accum_steps={train.grad_accum_steps} x {world_size} "
                          f"ranks; unset micro_batch_size/grad_accum_steps and the planner picks them")
    return [(m, per_rank // m) for m in micros]


def candidates(config: Config, spec: ModelSpec, hw: Hardware, world_size: int,
               dataset_bytes: int = 0) -> list[tuple[Shape, Candidate]]:
    zero_set, model_set = config.zero.model_fields_set, config.model.model_fields_set
    base_shape, base = shape_of(config, world_size, dataset_bytes, hw.glibc_heap), candidate_of(config, spec, world_size)
    base = replace(base, **{k: v for k, v in auto_buckets(spec).items() if k not in zero_set})
    # NVMe under stage 3 only: stages 1 and 2 keep an "nvme" optimizer in CPU memory (config.ZeroConfig)
    devices = ["none", "cpu"] + (["nvme"] if config.zero.nvme_path and base.stage == 3 else []) \
        if hw.on_gpu else ["none"]
    opt_devices = [base.offload_optimizer] if "offload_optimizer" in zero_set else devices
    param_devices = [base.offload_param] if "offload_param" in zero_set or base.stage != 3 else devices
    checkpointing = [base_shape.gradient_checkpointing] if "gradient_checkpointing" in model_set else [False, True]
    out = []
    for opt, par, ckpt, (micro, accum) in itertools.product(opt_devices, param_devices, checkpointing,
                                                            batch_splits(config, world_size)):
        ratios = [base.offload_optimizer_ratio]
        # A partial offload is the planner's only when the offload itself is: a user who
        # wrote offload_optimizer: cpu meant the whole optimizer.
        if opt == "cpu" and base.stage == 3 and hw.on_gpu and not {"offload_optimizer", "offload_optimizer_ratio"} & zero_set:
            ratios = list(PARTIAL_OFFLOAD_RATIOS)
        persistence = base.param_persistence_threshold
        if par == "none" and world_size == 1 and base.stage == 3 and "param_persistence_threshold" not in zero_set:
            persistence = all_persistent(spec)
        windows = live_windows(base, spec, zero_set, par) if par != "none" else [(base.max_live_parameters,
                                                                                  base.max_reuse_distance)]
        pipelines = [False, True] if opt == "nvme" and "nvme_pipeline" not in zero_set else [base.nvme_pipeline]
        for ratio, bucket, (live, reuse), pipelined in itertools.product(
                ratios if opt != "none" else [1.0], reduce_buckets(base, spec, zero_set), windows, pipelines):
            shape = replace(base_shape, micro_batch=micro, grad_accum=accum, gradient_checkpointing=ckpt)
            out.append((shape, replace(base, offload_optimizer=opt, offload_param=par, offload_optimizer_ratio=ratio,
                                       param_persistence_threshold=persistence, reduce_bucket_size=bucket,
                                       max_live_parameters=live, max_reuse_distance=reuse, nvme_pipeline=pipelined)))
    return out


def live_windows(base: Candidate, spec: ModelSpec, zero_set: set[str], device: str) -> list[tuple[int, int]]:
    """(stage3_max_live_parameters, stage3_max_reuse_distance) to try for offloaded
    parameters: the user's, else DeepSpeed's default and the narrowest, one module.

    DeepSpeed's (DEEPSPEED_LIVE_WINDOW) is a window of 1e9 gathered elements that keeps what
    forward fetched until backward reuses it. With the GPU short, the planner may narrow it
    to the largest module (nothing kept for reuse). Parameters are then fetched again for
    recompute and backward, which the cost model counts in any case (steptime.step_work: 3
    passes with recompute).

    Parameters on NVMe are released at once (reuse distance 0): each one swapped in holds one
    of offload_param's 5 swap buffers until released, and with DeepSpeed's reuse distance
    (1e9) a forward keeps them all and stops with "Not enough buffers 0 for swapping 1"."""
    if {"max_live_parameters", "max_reuse_distance"} & zero_set:
        return [(base.max_live_parameters, base.max_reuse_distance)]
    largest_module = max(m.numel for m in spec.modules)  # what ZeRO-3 fetches for one module
    if device == "nvme":
        return [(DEEPSPEED_LIVE_WINDOW[0], 0), (largest_module, 0)]
    return [DEEPSPEED_LIVE_WINDOW, (largest_module, 0)]


NARROWED_WINDOW_STEP_NOTE = (
    "the step time is least certain with a narrowed live window: the one measured (llama-3.6b under "
    "5.3 GiB, micro 1 x 16) took 16.8 s where 27.2 s was predicted (bench/results/speed-3.6b-headline.json)")


def narrowed_window(plan: Plan) -> bool:
    return plan.candidate.max_live_parameters != DEEPSPEED_LIVE_WINDOW[0]


def reduce_buckets(base: Candidate, spec: ModelSpec, zero_set: set[str]) -> list[int]:
    """The user's bucket, else HF's hidden^2 and the larger REDUCE_BUCKETS, none beyond the
    trainable elements (a bucket that never fills flushes once per micro batch anyway)."""
    if "reduce_bucket_size" in zero_set:
        return [base.reduce_bucket_size]
    return sorted({min(size, spec.trainable_params) for size in (base.reduce_bucket_size, *REDUCE_BUCKETS)})


# ------------------------------------------------------------------------ choose
def decide(config: Config, spec: ModelSpec, hw: Hardware, world_size: int, dataset_bytes: int = 0,
           data_load: dict[str, int] | None = None) -> Decision:
    """The fastest fitting configuration. When plan.enabled is false, the config as given.
    `data_load`: the host peak of loading the data (loadpeak), the same for every candidate."""
    headroom = config.plan.headroom
    options = candidates(config, spec, hw, world_size, dataset_bytes) if config.plan.enabled else \
        [(shape_of(config, world_size, dataset_bytes, hw.glibc_heap), candidate_of(config, spec, world_size))]
    plans = [predict(spec, hw, shape, cand, headroom, data_load) for shape, cand in options]
    fitting = [p for p in plans if p.fits]
    if fitting:
        # a narrowed live window only where nothing fits with DeepSpeed's own (what its
        # re-fetches cost is not priced apart from the passes every offloaded candidate pays)
        pool = [p for p in fitting if not narrowed_window(p)] or fitting
        best = min(pool, key=lambda p: (p.step_seconds, p.devices["gpu"].total_bytes, p.devices["host"].total_bytes))
        advice = []
        if narrowed_window(best):
            best.notes.append(NARROWED_WINDOW_STEP_NOTE)
    else:
        # short of disk alone (checkpoints, the same size whatever the candidate): still the fastest
        # of those the GPU and host hold, so the configuration shown does not depend on this disk
        memory_fits = [p for p in plans if not overflow(p, exclude=("disk",))]
        best = min(memory_fits, key=lambda p: p.step_seconds) if memory_fits else min(plans, key=overflow)
        advice = what_would_fit(best, spec, hw, config.plan.headroom)
    if hw.on_gpu and not config.memory.expandable_segments:
        best.notes += [note for note in [fixed_segments_note(best, spec)] if note]
    if spec.experts > 1:
        best.notes.append(MIXTURE_OF_EXPERTS_NOTE.format(experts=spec.experts))
    chosen = apply(config, best.shape, best.candidate)
    return Decision(config=chosen, plan=best, considered=plans, chosen_fields=free_choices(config, chosen),
                    advice=advice)


MIXTURE_OF_EXPERTS_NOTE = (
    "a mixture of experts ({experts} experts a layer): its parameters, gradients, optimizer states and checkpoints "
    "are counted exactly, but activations and compute are priced as one dense MLP of intermediate_size per token "
    "(the routed experts' working set and the router are not modelled, and the step estimate counts every "
    "expert's FLOPs): leave more headroom (plan.headroom) and read the step time as a rough figure")


def fixed_segments_note(plan: Plan, spec: ModelSpec) -> str | None:
    """With fixed segments (memory.expandable_segments false) one large request needs one free
    block: DeepSpeed's fp64 copy of an offloaded gradient partition for its norm (up to 250M
    elements, activations.NORM_BUFFER_NUMEL). When the plan leaves less than that under the
    budget, it must come from cached memory, which activations may have split."""
    if plan.candidate.offload_optimizer == "none":
        return None
    request = 8 * min(max(p.numel for p in spec.params), NORM_BUFFER_NUMEL)
    gpu = plan.devices["gpu"]
    margin = gpu.budget_bytes - gpu.total_bytes
    if margin >= request:
        return None
    return (f"fixed GPU segments (memory.expandable_segments: false): the gradient norm's fp64 copy asks "
            f"{human_bytes(request)} in one block with {human_bytes(max(margin, 0))} left under the budget, so it must "
            f"fit in cached pieces the activations may have split (llama-3.6b under 5.3 GiB failed so on the H200); "
            f"expandable segments, zerofit's default, avoid it")


def overflow(plan: Plan, exclude: tuple[str, ...] = ()) -> float:
    """How far over their budgets the devices are, summed (0 = everything fits); `exclude`
    leaves those devices out."""
    peaks = (plan.devices, plan.save_peak, plan.start_peak, plan.first_step_after_save_peak, plan.data_load_peak)
    devices = [device for peak in peaks for name, device in peak.items() if name not in exclude]
    return sum(max(0.0, d.total_bytes / max(d.usable_bytes, 1) - 1) for d in devices)


def free_keys(config: Config) -> dict[str, set[str]]:
    """Per section, the DECIDED keys this config leaves to the planner: unset, under plan.enabled."""
    if not config.plan.enabled:
        return {}
    return {section: {key for key in keys if key not in getattr(config, section).model_fields_set}
            # micro batch and accumulation are the planner's only to split a global batch
            for section, keys in DECIDED.items() if section != "train" or config.train.global_batch_size}


def free_choices(before: Config, after: Config) -> dict[str, object]:
    """The fields the planner was free to set, with the values it set (those that matter to
    what it chose: no ratio for an optimizer kept on the GPU, no NVMe settings without NVMe)."""
    out = {}
    for section, keys in free_keys(before).items():
        new = getattr(after, section)
        for key in sorted(keys, key=DECIDED[section].index):
            if (key == "offload_optimizer_ratio" and new.offload_optimizer == "none"
                    or key == "nvme_pipeline" and new.offload_optimizer != "nvme"
                    or key == "param_buffer_size" and new.offload_param != "nvme"):
                continue
            out[f"{section}.{key}"] = getattr(new, key)
    return out


def refuse(decision: Decision) -> PlanError:
    """The error train raises when nothing fits: the breakdown and the fixes."""
    plan = decision.plan
    lines = [f"no configuration fits; the closest ({describe(plan)}) needs:"]
    moments = (("checkpoint save", plan.save_peak), ("engine start", plan.start_peak),
               ("first step after a save", plan.first_step_after_save_peak),
               (LOADING, plan.data_load_peak))  # the peaks `predict` fits besides
    over = [(name, d) for name, d in plan.devices.items() if not d.fits] or [
        (f"{name} ({when})", d) for when, peak in moments for name, d in peak.items() if not d.fits]
    for name, device in over:
        top = sorted(device.components.items(), key=lambda kv: -kv[1])[:6]
        lines.append(f"  {name}: {human_bytes(device.total_bytes)} of {human_bytes(device.usable_bytes)} usable "
                     f"({human_bytes(device.budget_bytes)} less {decision.config.plan.headroom:.0%} headroom): "
                     + ", ".join(f"{k} {human_bytes(v)}" for k, v in top))
    lines.append("what would fit:")
    lines += [f"  - {a}" for a in decision.advice] or ["  - nothing zerofit can change; more memory is needed"]
    return PlanError("\n".join(lines))


def describe(plan: Plan) -> str:
    c, s = plan.candidate, plan.shape
    ratio = f" ratio {c.offload_optimizer_ratio}" if c.offload_optimizer != "none" and c.offload_optimizer_ratio < 1 else ""
    ratio += " (pipelined swap)" if c.offload_optimizer == "nvme" and c.nvme_pipeline else ""
    return (f"ZeRO-{c.stage}, optimizer on {c.offload_optimizer if c.offload_optimizer != 'none' else 'device'}{ratio}, "
            f"params on {c.offload_param if c.offload_param != 'none' else 'device'}"
            f"{f' (live window {c.max_live_parameters:,})' if narrowed_window(plan) else ''}, micro batch {s.micro_batch} x "
            f"{s.grad_accum}, seq {s.seq_len}, checkpointing {'on' if s.gradient_checkpointing else 'off'}")
