"""The memory and time model: pure functions of (ModelSpec, Hardware, Shape, Candidate).

`predict()` returns a Plan: bytes per device (gpu, host, disk) as named components, per
training phase (forward, backward, optimizer step, eval, save), the checkpoint-save peak,
the first step after a save, the checkpoint size and the export peak, and a step time with
its terms. Nothing here touches a GPU, a file or a clock.

The parts, each citing its sources where a formula is used:
- zerostates.py: parameters, gradients and optimizer states per device (ZeRO, ZeRO-Offload,
  ZeRO-Infinity papers; DeepSpeed's stage3.py buffers; torch's pinned-memory rounding);
- zerotrace.py: ZeRO-3's fetch trace and the parameters gathered through a step (DeepSpeed's
  partitioned_param_coordinator.py replayed);
- activations.py: activations, logits and gradient transients per phase (Korthikanti et al.);
- steptime.py: the step-time model (FLOPs, bytes moved, optimizer elements at measured rates);
- here: checkpoint and export sizes, fragmentation and the fit test.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from zerofit.checkpoint.size import CHECKPOINT_OVERHEAD_BYTES, checkpoint_bytes, save_margin_bytes  # noqa: F401
from zerofit.config.schema import DEFAULT_HEADROOM, ZeroConfig
from zerofit.machine.hardware import Hardware, ranks_on_this_node
from zerofit.nvme.swaplayout import Aio
from zerofit.plan.activations import BACKWARD_MOMENTS, device_phases
from zerofit.plan.spec import ModelSpec
from zerofit.plan.states import engine_start_host, model_states, optimizer_groups, optimizer_step_host
from zerofit.plan.steptime import step_seconds, step_time_notes, step_time_terms

GIB = 2**30
# Process RSS before any model state: python, torch, transformers, deepspeed and its
# cpu_adam op (measured on the CPU test machine: 0.49-0.50 GiB through a tiny run on
# synthetic data whose model states take ~2 MB).
HOST_PROCESS_BYTES = int(0.5 * GIB)
# HF datasets and pyarrow, loaded when data comes from files (0.59-0.61 GiB for the same
# tiny run on the demo data).
DATASETS_LIBRARY_BYTES = int(0.1 * GIB)
# Host RSS a CUDA process adds: driver, CUDA runtime, cuBLAS/cuDNN kernels mapped in; the
# largest rest above HOST_PROCESS_BYTES and the planned states seen on the GPU host (it grows
# with LoRA and the sequence, not traced; bench/results/README.md).
CUDA_HOST_CONTEXT_BYTES = int(1.9 * GIB)
# Device memory outside torch's allocator counters: CUDA context and cuBLAS workspaces.
CUDA_DEVICE_CONTEXT_BYTES = int(0.5 * GIB)
# `zerofit export` streams fp32 master rows in blocks under --max-ram, 2 GiB by default
# (this constant): its peak RSS is the process plus two read/cast block pairs.
EXPORT_MAX_RAM_BYTES = 2 * GIB
PHASES = ("forward", "backward", "optimizer_step", "eval")
# The heap holds freed step temporaries fragmented: a 30-step loop of one 256 MiB temporary
# per step on the CI machine settled at 2.27 GiB of process RSS, about eight temporaries'
# worth (glibc 2.35); 9 bounds that, and tests/test_hostalloc.py checks a 24-step loop by it.
HEAP_TEMPORARIES_HELD = 9


@dataclass(frozen=True)
class Shape:
    """The training shape: what one optimizer step computes."""
    seq_len: int
    micro_batch: int
    grad_accum: int = 1
    world_size: int = 1
    precision: str = "bf16"
    gradient_checkpointing: bool = True
    chunked_loss: bool = True        # zerofit.loss instead of HF's (logits memory)
    eager_attention: bool = False    # eager attention keeps s x s weights per head (activations)
    packed_mask: bool = False        # data.neat_packing: a micro x s x s mask lives through forward and backward
    heap_step_temporaries: bool = False  # the optimizer step's host temporaries stay resident (hostalloc)
    dataset_bytes: int = 0           # tokenized data held in host RAM per rank
    checkpoints_on_disk: int = 3     # most checkpoints on disk at once (keep_last + the one being written)
    async_snapshot_max: int | None = 0  # host bytes an async save's snapshot may hold per rank:
    #                                     0 = saves are synchronous, None = half the host budget

    @property
    def tokens_per_micro(self) -> int:
        return self.seq_len * self.micro_batch

    @property
    def element_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2


def zero_default(key: str):
    """zero.<key>'s default (the config holds them; a Candidate built without one takes it)."""
    return ZeroConfig.model_fields[key].default


def auto_buckets(spec: ModelSpec) -> dict[str, int]:
    """HF Trainer's "auto" values (transformers integrations/deepspeed.py,
    HfTrainerDeepSpeedConfig.trainer_config_finalize): hidden^2, 0.9 hidden^2, 10 hidden."""
    h = spec.hidden_size
    return {"reduce_bucket_size": h * h, "prefetch_bucket_size": int(0.9 * h * h),
            "param_persistence_threshold": 10 * h}


def all_persistent(spec: ModelSpec) -> int:
    """A stage3_param_persistence_threshold that makes every parameter persistent.

    One rank whose 16-bit parameters stay on the GPU holds each one whole already: ZeRO-3's
    fetch there is a view of the partition (partition_parameters.py `_no_gather_coalesced`,
    NoGatherHandle), so persistence costs no memory (zerostates: (W - 1) / W copies) and
    spares every module visit its fetch and release (partitioned_param_coordinator.py)."""
    return max(p.numel for p in spec.params)


@dataclass(frozen=True)
class Candidate:
    """The DeepSpeed knobs one configuration sets (names as in zerofit's zero section; the
    defaults are its defaults, DeepSpeed's for the aio settings zerofit leaves unset)."""
    stage: int = zero_default("stage")
    offload_optimizer: str = zero_default("offload_optimizer")
    offload_optimizer_ratio: float = zero_default("offload_optimizer_ratio")
    offload_param: str = zero_default("offload_param")
    param_buffer_size: int = zero_default("param_buffer_size")  # NVMe parameters: elements per swap buffer
    pin_memory: bool = zero_default("pin_memory")
    reduce_bucket_size: int = zero_default("reduce_bucket_size")
    prefetch_bucket_size: int = zero_default("prefetch_bucket_size")
    param_persistence_threshold: int = zero_default("param_persistence_threshold")
    max_live_parameters: int = zero_default("max_live_parameters")
    max_reuse_distance: int = zero_default("max_reuse_distance")
    sub_group_size: int = zero_default("sub_group_size")
    gather_16bit_weights_on_save: bool = zero_default("gather_16bit_weights_on_save")
    aio_block_size: int = Aio.block_size     # NVMe: sub groups under one block stay in RAM
    aio_intra_op_parallelism: int = Aio.intra_op_parallelism
    nvme_pipeline: bool = zero_default("nvme_pipeline")  # NVMe: swap overlapped with the neighbouring sub groups' steps


@dataclass
class Device:
    total_bytes: int
    budget_bytes: int
    components: dict[str, int]
    usable_bytes: int = 0            # budget less headroom

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.usable_bytes

    def to_json(self) -> dict:
        return {"total_bytes": self.total_bytes, "budget_bytes": self.budget_bytes,
                "usable_bytes": self.usable_bytes, "fits": self.fits, "components": dict(self.components)}


@dataclass
class Plan:
    fits: bool
    params: int
    trainable_params: int
    shape: Shape
    candidate: Candidate
    accelerator: str
    devices: dict[str, Device]                  # gpu, host, disk (+ nvme when used)
    gpu_allocated_peak: int                     # what torch.cuda.max_memory_allocated should show
    host_rss_peak: int                          # what psutil's RSS should show at the peak
    phases: dict[str, dict[str, int]]           # phase -> {"gpu": allocated peak, "host": rss}
    save_peak: dict[str, Device]
    start_peak: dict[str, Device]               # while deepspeed.initialize builds the engine
    first_step_after_save_peak: dict[str, Device]
    checkpoint_bytes: int
    export_peak: dict[str, Device]
    step_seconds: float
    step_terms: dict[str, float]
    notes: list[str] = field(default_factory=list)
    ranks_on_host: int = 1                      # the host device's figures are for this many ranks
    data_load_peak: dict[str, Device] = field(default_factory=dict)  # host, loading and tokenizing the
    #                                             data files before the model is built (loadpeak); {} without files

    @property
    def binding(self) -> list[str]:
        """Devices over their usable budget."""
        return [name for name, d in self.devices.items() if not d.fits]

    def to_json(self) -> dict:
        return {
            "fits": self.fits, "params": self.params, "trainable_params": self.trainable_params,
            "accelerator": self.accelerator,
            "shape": asdict(self.shape), "candidate": asdict(self.candidate),
            "devices": {k: d.to_json() for k, d in self.devices.items()},
            "predicted_gpu_peak": self.gpu_allocated_peak, "predicted_host_rss": self.host_rss_peak,
            "phases": self.phases,
            "save_peak": {k: d.to_json() for k, d in self.save_peak.items()},
            "start_peak": {k: d.to_json() for k, d in self.start_peak.items()},
            "first_step_after_save_peak": {k: d.to_json() for k, d in self.first_step_after_save_peak.items()},
            "checkpoint_bytes": self.checkpoint_bytes,
            "export_peak": {k: d.to_json() for k, d in self.export_peak.items()},
            "estimated_step_seconds": self.step_seconds, "step_terms": self.step_terms,
            "notes": self.notes, "ranks_on_host": self.ranks_on_host,
            "data_load_peak": {k: d.to_json() for k, d in self.data_load_peak.items()},
        }


# --------------------------------------------------------------- checkpoint, export
ASYNC_HOST_SHARE = 0.5  # checkpoint.async_host_max_gib's default: this share of the host budget


def snapshot_buffer_bytes(rank_checkpoint_bytes: int) -> int:
    """The async-save snapshot buffer for one rank's share of a checkpoint: 2% and 64 MiB over
    it, for partition padding and headers the byte count misses (a buffer found short is
    reallocated at the save, a spike)."""
    return int(rank_checkpoint_bytes * 1.02) + (64 << 20)


def async_snapshot_cap(async_snapshot_max: int | None, host_budget_bytes: int) -> int:
    """The most host RAM one rank's snapshot may hold (Shape.async_snapshot_max):
    checkpoint.async_host_max_gib, else ASYNC_HOST_SHARE of the host budget (plan.host_mem, or
    the RAM available). A snapshot over it is not taken: that save is synchronous."""
    return int(host_budget_bytes * ASYNC_HOST_SHARE) if async_snapshot_max is None else async_snapshot_max


def async_snapshot_bytes(ckpt_bytes: int, shape: Shape, hw: Hardware) -> int:
    """Host RAM one rank's async-save snapshot buffer holds for the whole run (checkpoint_io.
    HostArena: reserved at start, reused by every save), 0 when saves are synchronous or the
    snapshot would pass its cap (the run then saves synchronously, with a warning): the
    rank's share of the checkpoint, `snapshot_buffer_bytes`, as Checkpointer reserves it."""
    if shape.async_snapshot_max == 0:
        return 0
    needed = snapshot_buffer_bytes(ckpt_bytes // shape.world_size)
    return needed if needed <= async_snapshot_cap(shape.async_snapshot_max, hw.host_budget_bytes) else 0


def export_bytes(total_params: int, element_bytes: int = 2) -> int:
    """A safetensors export: every parameter once, in the export dtype."""
    return element_bytes * total_params


# ------------------------------------------------------------------------ predict
def predict(spec: ModelSpec, hw: Hardware, shape: Shape, cand: Candidate, headroom: float = DEFAULT_HEADROOM,
            data_load: dict[str, int] | None = None) -> Plan:
    """The whole prediction for one candidate configuration; `data_load`: one rank's host peak
    of loading the data, by component (loadpeak.load_peak), the same for every candidate."""
    on_gpu = hw.on_gpu
    gpu_states, host_states, nvme_states = model_states(spec, shape, cand, on_gpu)
    phases = device_phases(spec, shape, cand, on_gpu)
    backward_at = phases.pop("backward_peak_at")
    host_step = optimizer_step_host(spec, shape, cand)
    host_base = {"process": HOST_PROCESS_BYTES}
    if shape.heap_step_temporaries and on_gpu:  # kept on the heap after the first step (zerofit/machine/hostalloc.py)
        host_base.update({f"{name}_kept": HEAP_TEMPORARIES_HELD * size for name, size in host_step.items()})
        host_step = {}
    if on_gpu:
        host_base["cuda_host_context"] = CUDA_HOST_CONTEXT_BYTES
    if shape.dataset_bytes:
        host_base["dataset"] = shape.dataset_bytes
    ranks_here = ranks_on_this_node(hw, shape.world_size)
    # LoRA checkpoints leave the frozen base out (checkpoint.save exclude_frozen)
    ckpt_bytes = checkpoint_bytes(spec.trainable_params, shape.world_size, cand.stage, shape.element_bytes)
    if cand.gather_16bit_weights_on_save:  # the consolidated model each checkpoint holds too, frozen base and all
        ckpt_bytes += shape.element_bytes * spec.total_params
    snapshot = async_snapshot_bytes(ckpt_bytes, shape, hw)
    if snapshot:
        host_base["async_snapshot"] = snapshot

    if not on_gpu:  # the CPU accelerator: the "device" is host RAM
        host_states = {**host_states, **{f"device:{k}": v for k, v in gpu_states.items()}}
        gpu_states = {}
    resident_gpu, resident_host = sum(gpu_states.values()), sum(host_base.values()) + sum(host_states.values())
    per_phase = {}
    for name in PHASES:
        transient = phases[name]
        host_extra = sum(host_step.values()) if name == "optimizer_step" else 0
        if on_gpu:
            per_phase[name] = {"gpu": resident_gpu + sum(transient.values()), "host": resident_host + host_extra}
        else:
            per_phase[name] = {"gpu": 0, "host": resident_host + sum(transient.values()) + host_extra}
    peak_name = max(PHASES, key=lambda p: per_phase[p]["gpu" if on_gpu else "host"])
    notes = [f"the device peaks in the {peak_name} phase" + (f" (at {BACKWARD_MOMENTS[backward_at]})"
                                                              if peak_name == "backward" else "")]
    transients = sorted((sum(phases[p].values()) for p in ("backward", "optimizer_step")), reverse=True)
    # Fragmentation: blocks cached for one phase's tensors are not reused by another's of
    # other sizes, so reserved memory holds the two largest phase transients (as an HF Trainer
    # + ZeRO-3 run showed), plus 5% of the largest for rounding.
    fragmentation = transients[1] + int(0.05 * transients[0])

    def gpu_device(extra: dict[str, int], frag: int) -> Device:
        comps = {**gpu_states, **extra, "fragmentation": frag, "cuda_context": CUDA_DEVICE_CONTEXT_BYTES} if on_gpu else {}
        return _device(comps, hw.gpu_budget_bytes, headroom)

    def host_device(extra: dict[str, int], states: dict[str, int] = host_states) -> Device:
        comps = {**host_base, **states, **extra}
        return _device({k: v * ranks_here for k, v in comps.items() if v}, hw.host_budget_bytes, headroom)

    peak_transient = {f"{peak_name}:{k}": v for k, v in phases[peak_name].items()}
    host_peak_extra = {f"optimizer_step:{k}": v for k, v in host_step.items()}
    if not on_gpu:
        host_peak_extra = {**peak_transient, **(host_peak_extra if peak_name == "optimizer_step" else {})}
    devices = {"gpu": gpu_device(peak_transient, fragmentation), "host": host_device(host_peak_extra),
               "disk": _device({"checkpoints": ckpt_bytes * shape.checkpoints_on_disk,
                                "save_margin": save_margin_bytes(ckpt_bytes)}, hw.disk_free_bytes, headroom)}
    if nvme_states:
        # on the checkpoints' filesystem the swap files get what the checkpoints leave; every
        # rank on this host writes its own swap files under the one zero.nvme_path
        shared = ckpt_bytes * shape.checkpoints_on_disk if hw.nvme_shares_disk else 0
        devices["nvme"] = _device({k: v * ranks_here for k, v in nvme_states.items()},
                                  max(0, (hw.nvme_free_bytes or 0) - shared), headroom)

    save_gpu, save_host = save_components(spec, shape, cand, on_gpu)
    save_peak = {"gpu": gpu_device(save_gpu, 0), "host": host_device(save_host if on_gpu else {**save_host, **{
        f"device:{k}": v for k, v in save_gpu.items()}}),
        "disk": devices["disk"]}
    start_peak = {"host": host_device({}, engine_start_host(host_states, spec, shape, cand, on_gpu))}
    # First step after a save: the save's freed blocks stay cached in the allocator
    # (fragmentation), on top of the usual step peak.
    residue = save_gpu.get("gathered_module", 0)
    first_step = {"gpu": gpu_device(peak_transient, fragmentation + residue), "host": devices["host"]}
    pinned_total = sum(v for k, v in host_states.items() if "pinned" in k) * ranks_here
    if on_gpu and hw.pinned_limit_bytes is not None and pinned_total > hw.pinned_limit_bytes:
        notes.append(f"{pinned_total / GIB:.1f} GiB pinned exceeds ulimit -l ({hw.pinned_limit_bytes / GIB:.2f} GiB); "
                     f"fine with torch's pinning (cudaHostAlloc), fatal with DS_PIN_MEMORY_BACKEND=native")
    terms = step_time_terms(spec, hw, shape, cand)
    seconds = step_seconds(terms)
    notes += step_time_notes(terms, seconds, on_gpu)
    load_peak = data_load_devices(data_load, hw, headroom, ranks_here)
    fits = all(d.fits for peak in (devices, save_peak, start_peak, first_step, load_peak) for d in peak.values())
    host_rss_peak = max(max(p["host"] for p in per_phase.values()), start_peak["host"].total_bytes // ranks_here)
    return Plan(fits=fits, params=spec.total_params, trainable_params=spec.trainable_params, shape=shape, candidate=cand, accelerator=hw.accelerator,
                devices=devices, gpu_allocated_peak=max(p["gpu"] for p in per_phase.values()),
                host_rss_peak=host_rss_peak, phases=per_phase, save_peak=save_peak, start_peak=start_peak,
                first_step_after_save_peak=first_step, checkpoint_bytes=ckpt_bytes,
                export_peak=export_peak(spec, hw, headroom),
                step_seconds=seconds, step_terms=terms, notes=notes, ranks_on_host=ranks_here, data_load_peak=load_peak)


def data_load_devices(data_load: dict[str, int] | None, hw: Hardware, headroom: float,
                      ranks_here: int = 1) -> dict[str, Device]:
    """Loading the data (loadpeak.load_peak, one rank's), on a host where `ranks_here` load it."""
    if not data_load:
        return {}
    return {"host": _device({k: v * ranks_here for k, v in data_load.items()}, hw.host_budget_bytes, headroom)}


def save_components(spec: ModelSpec, shape: Shape, cand: Candidate, on_gpu: bool) -> tuple[dict, dict]:
    """(GPU, host) bytes a checkpoint save adds, between steps (no activations). torch.save copies
    device-resident storages to the host one at a time (largest: an fp32 sub-group tensor); a
    consolidated 16-bit model (gather_16bit_weights_on_save) gathers module by module on the
    GPU (engine._zero3_consolidated_16bit_state_dict) and holds the whole model on the host."""
    save_gpu, save_host = {}, {}
    if on_gpu and cand.offload_optimizer == "none":
        save_host["torch_save_staging"] = 4 * max(optimizer_groups(spec, shape, cand))
    if cand.gather_16bit_weights_on_save:
        save_gpu["gathered_module"] = shape.element_bytes * spec.largest_module.numel
        save_host["consolidated_16bit_model"] = shape.element_bytes * spec.total_params
    return save_gpu, save_host


def export_peak(spec: ModelSpec, hw: Hardware, headroom: float) -> dict[str, Device]:
    """`zerofit export`: its streaming reader within its default RAM cap, and the safetensors on disk."""
    return {"host": _device({"process": HOST_PROCESS_BYTES,
                             "read_and_cast_blocks": EXPORT_MAX_RAM_BYTES - HOST_PROCESS_BYTES},
                            hw.host_budget_bytes, headroom),
            "disk": _device({"safetensors": export_bytes(spec.total_params)}, hw.disk_free_bytes, headroom)}


def _device(components: dict[str, int], budget: int, headroom: float) -> Device:
    components = {k: int(v) for k, v in components.items() if v}
    return Device(total_bytes=sum(components.values()), budget_bytes=int(budget), components=components,
                  usable_bytes=int(budget * (1 - headroom)))
