"""The memory and time model: pure functions of (ModelSpec, Hardware, Shape, Candidate).

`predict()` returns a Plan: bytes per device (gpu, host, disk) as named components, per
training phase (forward, backward, optimizer step, eval, save), the checkpoint-save peak,
the first step after a save, the checkpoint size and the export peak, and a step time with
its terms. Nothing here touches a GPU, a file or a clock.

Sources of the formulas (each cited where used):
- ZeRO (Rajbhandari et al., arXiv:1910.02054): 2+2+12 bytes per parameter for mixed-precision
  Adam and how stages 1-3 partition them over Nd ranks.
- ZeRO-Offload / ZeRO-Infinity (arXiv:2101.06840, arXiv:2104.07857): what moves to CPU/NVMe.
- DeepSpeed 0.19 source, which allocates the real buffers: runtime/zero/stage3.py
  (`_create_fp16_partitions_with_defragmentation`, `_create_fp32_partitions`,
  `initialize_optimizer_states`, `_setup_for_real_optimizer`, `_prepare_fp32_grad_for_sub_group`,
  `partition_grads`), partition_parameters.py (`_no_gather_coalesced`, all_gather_coalesced),
  partitioned_param_coordinator.py (prefetch and reuse distance), ops/adam/cpu_adam.py.
- Korthikanti et al. (arXiv:2205.05198) for how activations are counted per layer; the
  tensors themselves are those HF transformers' Llama-style layers save.
- torch's CachingHostAllocator (ATen/core/CachingHostAllocator.h): pinned host blocks are
  rounded up to a power of two and kept cached after free.
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field

from zerofit import hardware as hw_rates
from zerofit.hardware import Hardware
from zerofit.modelspec import ModelSpec

GIB = 2**30
# Process RSS before any model state: python, torch, transformers, datasets, deepspeed and
# its cpu_adam op (measured on the CPU test machine: 0.49 GiB after the imports, 0.59-0.61
# GiB through a tiny run whose model states take ~2 MB).
HOST_PROCESS_BYTES = int(0.6 * GIB)
# Host RSS a CUDA process adds: driver, CUDA runtime, cuBLAS/cuDNN kernels mapped in
# (1-2 GiB on the H200 machine; /work/shared/device/README.md).
CUDA_HOST_CONTEXT_BYTES = int(1.5 * GIB)
# Device memory outside torch's allocator counters: CUDA context and cuBLAS workspaces.
CUDA_DEVICE_CONTEXT_BYTES = int(0.5 * GIB)
# DeepSpeed defaults of the NVMe swap buffers (runtime/zero/offload_config.py).
OPTIMIZER_SWAP_BUFFERS = 4
PARAM_SWAP_BUFFERS, PARAM_SWAP_BUFFER_NUMEL, PARAM_MAX_IN_CPU = 5, 100_000_000, 1_000_000_000
# Per-rank checkpoint bytes besides the tensors: pickled metadata, model_states.pt,
# rng state (measured: 27 KB for the tiny model).
CHECKPOINT_OVERHEAD_BYTES = 64 * 1024
# HF writes safetensors shards of at most 5 GB (PreTrainedModel.save_pretrained max_shard_size).
EXPORT_SHARD_BYTES = 5 * 10**9
PHASES = ("forward", "backward", "optimizer_step", "eval")


@dataclass(frozen=True)
class Shape:
    """The training shape: what one optimizer step computes."""
    seq_len: int
    micro_batch: int
    grad_accum: int = 1
    world_size: int = 1
    precision: str = "bf16"
    gradient_checkpointing: bool = True
    dataset_bytes: int = 0           # tokenized data held in host RAM per rank
    checkpoints_on_disk: int = 3     # most checkpoints on disk at once (keep_last + the one being written)

    @property
    def tokens_per_micro(self) -> int:
        return self.seq_len * self.micro_batch

    @property
    def element_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2


@dataclass(frozen=True)
class Candidate:
    """The DeepSpeed knobs one configuration sets (names as in zerofit's zero section)."""
    stage: int = 3
    offload_optimizer: str = "cpu"
    offload_optimizer_ratio: float = 1.0
    offload_param: str = "none"
    pin_memory: bool = True
    reduce_bucket_size: int = 50_000_000
    prefetch_bucket_size: int = 50_000_000
    param_persistence_threshold: int = 100_000
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    sub_group_size: int = 100_000_000
    gather_16bit_weights_on_save: bool = False


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
    shape: Shape
    candidate: Candidate
    accelerator: str
    devices: dict[str, Device]                  # gpu, host, disk (+ nvme when used)
    gpu_allocated_peak: int                     # what torch.cuda.max_memory_allocated should show
    host_rss_peak: int                          # what psutil's RSS should show at the peak
    phases: dict[str, dict[str, int]]           # phase -> {"gpu": allocated peak, "host": rss}
    save_peak: dict[str, Device]
    first_step_after_save_peak: dict[str, Device]
    checkpoint_bytes: int
    export_peak: dict[str, Device]
    step_seconds: float
    step_terms: dict[str, float]
    notes: list[str] = field(default_factory=list)

    @property
    def binding(self) -> list[str]:
        """Devices over their usable budget."""
        return [name for name, d in self.devices.items() if not d.fits]

    def to_json(self) -> dict:
        return {
            "fits": self.fits, "params": self.params, "accelerator": self.accelerator,
            "shape": asdict(self.shape), "candidate": asdict(self.candidate),
            "devices": {k: d.to_json() for k, d in self.devices.items()},
            "predicted_gpu_peak": self.gpu_allocated_peak, "predicted_host_rss": self.host_rss_peak,
            "phases": self.phases,
            "save_peak": {k: d.to_json() for k, d in self.save_peak.items()},
            "first_step_after_save_peak": {k: d.to_json() for k, d in self.first_step_after_save_peak.items()},
            "checkpoint_bytes": self.checkpoint_bytes,
            "export_peak": {k: d.to_json() for k, d in self.export_peak.items()},
            "estimated_step_seconds": self.step_seconds, "step_terms": self.step_terms,
            "notes": self.notes,
        }


# ------------------------------------------------------------------- small helpers
def pow2_ceil(n: int) -> int:
    """torch's CachingHostAllocator rounds every pinned block up to a power of two."""
    return 1 << max(0, math.ceil(n) - 1).bit_length() if n > 0 else 0


def pinned(nbytes: int, cand: Candidate, on_gpu: bool) -> int:
    """Bytes one pinned allocation really takes. DeepSpeed's CPU accelerator does not pin."""
    return pow2_ceil(nbytes) if on_gpu and cand.pin_memory else nbytes


def partition_numel(numel: int, world: int) -> int:
    """ZeRO-3 pads each parameter to a multiple of the world size (partition_parameters.py)."""
    return -(-numel // world)


@functools.lru_cache(maxsize=64)
def sub_groups(spec: ModelSpec, world: int, sub_group_size: int) -> tuple[int, ...]:
    """Element counts of the optimizer sub groups of one rank.

    zerofit passes two param groups (engine.param_groups: >=2-D weights decay, the rest do
    not); stage3.py `_create_fp16_sub_groups` cuts each group, in parameter order, into runs
    that close once they reach sub_group_size elements."""
    groups: list[int] = []
    for decay in (True, False):
        run = 0
        members = [partition_numel(p.numel, world) for p in spec.params if (p.ndim >= 2) == decay]
        total = sum(members)
        if not members:
            continue
        if sub_group_size >= total:
            groups.append(total)
            continue
        for i, numel in enumerate(members):
            run += numel
            if run >= sub_group_size or i == len(members) - 1:
                groups.append(run)
                run = 0
    return tuple(groups)


@functools.lru_cache(maxsize=64)
def gathered_peak_numel(spec: ModelSpec, checkpointing: bool, prefetch: int, max_live: int,
                        reuse_distance: int, persistence_threshold: int) -> int:
    """Most parameter elements gathered at once, by replaying ZeRO-3's fetch/release.

    Trace: forward in module order, then backward in reverse with each decoder block
    recomputed (forward order) before its backward when checkpointing. At each module the
    coordinator (partitioned_param_coordinator.py) fetches the module's parameters, prefetches
    the next ones up to min(prefetch_bucket_size, max_live_parameters - available), and on
    release keeps a parameter whose next use is within max_reuse_distance elements.
    Parameters of at most param_persistence_threshold elements stay gathered (ds_persist)
    and are counted elsewhere."""
    numel = {p.name: p.numel for p in spec.params}
    module_params = [tuple(n for n in m.params if numel[n] > persistence_threshold) for m in spec.modules]
    order = list(range(len(spec.modules)))
    trace = list(order)
    layers: dict[int, list[int]] = {}
    for i, m in enumerate(spec.modules):
        if m.layer is not None:
            layers.setdefault(m.layer, []).append(i)
    tail = [i for i in order if spec.modules[i].layer is None and i > max(sum(layers.values(), [-1]))]
    head = [i for i in order if spec.modules[i].layer is None and i not in tail]
    trace += list(reversed(tail))
    for layer in sorted(layers, reverse=True):
        trace += (layers[layer] if checkpointing else []) + list(reversed(layers[layer]))
    trace += list(reversed(head))
    trace = [i for i in trace if module_params[i]]
    sizes = [sum(numel[n] for n in module_params[i]) for i in trace]
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    next_use: list[dict[str, int]] = [{} for _ in trace]
    last_seen: dict[str, int] = {}
    for t in range(len(trace) - 1, -1, -1):
        for n in module_params[trace[t]]:
            if n in last_seen:
                next_use[t][n] = last_seen[n]
            last_seen[n] = t

    available: set[str] = set()
    live = peak = 0
    for t, i in enumerate(trace):
        for n in module_params[i]:
            if n not in available:
                available.add(n)
                live += numel[n]
        room, fetched, j = min(prefetch, max_live - live), 0, t + 1
        while j < len(trace) and fetched < room:
            for n in module_params[trace[j]]:
                if n not in available:
                    available.add(n)
                    live += numel[n]
                    fetched += numel[n]
            j += 1
        peak = max(peak, live)
        for n in module_params[i]:
            nxt = next_use[t].get(n)
            if nxt is None or prefix[nxt] - prefix[t + 1] >= reuse_distance:
                available.discard(n)
                live -= numel[n]
    return peak


def persistent_numel(spec: ModelSpec, threshold: int) -> int:
    return sum(p.numel for p in spec.params if p.numel <= threshold)


# ------------------------------------------------------------------ model states
def model_states(spec: ModelSpec, shape: Shape, cand: Candidate, on_gpu: bool) -> tuple[dict, dict, dict]:
    """(gpu, host, nvme) resident bytes per rank of parameters, gradients and optimizer
    states, named by what holds them in DeepSpeed."""
    W, a, N = shape.world_size, shape.element_bytes, spec.total_params
    gpu: dict[str, int] = {}
    host: dict[str, int] = {}
    nvme: dict[str, int] = {}
    if cand.stage < 3:
        return _model_states_stage012(spec, shape, cand, on_gpu)
    n_rank = sum(partition_numel(p.numel, W) for p in spec.params)
    groups = sub_groups(spec, W, cand.sub_group_size)
    # Partial offload (offload_optimizer.ratio): stage3.py `_create_fp32_partitions` keeps the
    # first int((1 - ratio) * n_sub_groups) sub groups on the GPU, the rest on the CPU.
    on_device = len(groups) if cand.offload_optimizer == "none" else int((1 - cand.offload_optimizer_ratio) * len(groups))
    device_groups, offloaded_groups = groups[:on_device], groups[on_device:]
    dev_numel, off_numel = sum(device_groups), sum(offloaded_groups)

    # 16-bit parameter partitions: one flat buffer on the GPU (`lp_param_buffer`, defragment)
    # or, offloaded, one pinned flat buffer per param group (`_create_param_groups_fp16_flat_cpu_memory`).
    if cand.offload_param == "none":
        gpu["params_16bit"] = a * n_rank
    else:
        group_numels = [sum(partition_numel(p.numel, W) for p in spec.params if (p.ndim >= 2) == d) for d in (True, False)]
        in_cpu = n_rank if cand.offload_param == "cpu" else min(n_rank, PARAM_MAX_IN_CPU)
        host["params_16bit_pinned"] = sum(pinned(a * g, cand, on_gpu) for g in group_numels if g) \
            if in_cpu == n_rank else pinned(a * in_cpu, cand, on_gpu)
        if cand.offload_param == "nvme":
            nvme["params_16bit_swap"] = a * n_rank
            host["param_swap_buffers_pinned"] = PARAM_SWAP_BUFFERS * pinned(a * PARAM_SWAP_BUFFER_NUMEL, cand, on_gpu)
        # zero.Init pins each parameter's partition on its own; moving them into the flat
        # buffer frees those blocks into the CachingHostAllocator's cache, which keeps them.
        if on_gpu and cand.pin_memory:
            host["zero_init_pinned_cache"] = sum(pow2_ceil(a * partition_numel(p.numel, W)) for p in spec.params)
        # Persistent (small) parameters stay on the GPU, gathered (parameter_offload.py).
        gpu["params_persistent"] = a * persistent_numel(spec, cand.param_persistence_threshold)
    if W > 1 and cand.offload_param == "none":
        gpu["params_persistent"] = a * persistent_numel(spec, cand.param_persistence_threshold) * (W - 1) // W

    # Gradient partitions, one flat buffer in the accumulation dtype (= model dtype) on the
    # optimizer's device, pinned there (`_setup_for_real_optimizer`).
    if cand.offload_optimizer == "none":
        gpu["grads_16bit"] = a * n_rank
    else:
        host["grads_16bit_pinned"] = pinned(a * n_rank, cand, on_gpu)

    # fp32 master weights and Adam moments (ZeRO: 12 bytes per parameter), partitioned.
    if dev_numel:
        gpu["master_fp32"] = 4 * dev_numel
        gpu["adam_moments_fp32"] = 8 * dev_numel
    if off_numel:
        if cand.offload_optimizer == "nvme":
            nvme["optimizer_swap"] = 16 * off_numel           # fp32 params, grads, exp_avg, exp_avg_sq
            largest = max(offloaded_groups)
            host["optimizer_swap_buffers_pinned"] = OPTIMIZER_SWAP_BUFFERS * pinned(4 * largest, cand, on_gpu)
        else:
            host["master_fp32"] = 4 * off_numel              # `.to(cpu, fp32).clone()`: pageable
            host["adam_moments_fp32"] = 8 * off_numel        # cpu_adam.py: zeros_like at the first step
            # One pinned fp32 gradient buffer per sub group (`initialize_optimizer_states`);
            # GPU sub groups of a partial offload get theirs via .to(gpu), leaving the pinned
            # block cached on the host.
        if cand.offload_optimizer == "cpu" or dev_numel:
            host["fp32_grads_pinned"] = sum(pinned(4 * g, cand, on_gpu) for g in groups)
    if dev_numel and cand.offload_optimizer != "none":
        gpu["fp32_grads"] = 4 * dev_numel
    # The reduce bucket (contiguous_gradients), on the device (`_setup_for_real_optimizer`).
    gpu["reduce_bucket"] = a * cand.reduce_bucket_size
    if cand.offload_optimizer == "none":
        # `initialize_optimizer_states` hangs every sub group's .grad on one fp32 buffer of the
        # largest sub group; it lives until the first optimizer step releases them.
        gpu["fp32_grad_buffer_until_first_step"] = 4 * max(groups)
    return gpu, host, nvme


def _model_states_stage012(spec: ModelSpec, shape: Shape, cand: Candidate, on_gpu: bool):
    """ZeRO stages 0-2 (arXiv:1910.02054 fig. 1): 16-bit params whole on every rank; grads
    partitioned from stage 2, optimizer states from stage 1; ZeRO-Offload moves the fp32
    states (and the grads they step on) to the CPU."""
    W, a, N = shape.world_size, shape.element_bytes, spec.total_params
    shard = N // W if cand.stage >= 1 else N
    gpu = {"params_16bit": a * N, "grads_16bit": a * (N // W if cand.stage >= 2 else N),
           "reduce_bucket": a * cand.reduce_bucket_size}
    host: dict[str, int] = {}
    if cand.offload_optimizer == "none":
        gpu.update(master_fp32=4 * shard, adam_moments_fp32=8 * shard)
    else:
        host.update(master_fp32=4 * shard, adam_moments_fp32=8 * shard, fp32_grads_pinned=pinned(4 * shard, cand, on_gpu))
    return gpu, host, {}


# ------------------------------------------------------------------- activations
def layer_activation_bytes_per_token(spec: ModelSpec, a: int) -> int:
    """Bytes one decoder block saves for backward per token, without recompute.

    The method is Korthikanti et al. (arXiv:2205.05198, sec. 4.1: sum the tensors each op
    keeps for backward); the tensors are those of HF's Llama-style block with SDPA:
    - each RMSNorm computes in fp32 (LlamaRMSNorm): keeps the fp32 input (4h), the 16-bit
      normalised tensor its weight multiplies (a*h), and its output, which the next
      projections keep as their input (a*h);
    - attention keeps q and k after RoPE, v, the SDPA output (flash/efficient kernels keep
      no s x s matrix, only a fp32 logsumexp per head);
    - the SwiGLU MLP keeps gate, up, silu(gate) and their product (4 x intermediate);
      a 2-matrix MLP keeps the fc1 output and the activation (2 x intermediate)."""
    h, i = spec.hidden_size, spec.intermediate_size
    norm = 4 * h + 2 * a * h
    attention = a * (2 * spec.q_dim + 2 * spec.kv_dim) + 4 * spec.num_heads
    mlp = a * (4 * i if spec.gated_mlp else 2 * i)
    return 2 * norm + attention + mlp


def layer_backward_working_per_token(spec: ModelSpec, a: int) -> int:
    """Gradients alive inside one block's backward: at the MLP, grad of the product, of
    silu and of up (3 x intermediate) plus the incoming and outgoing hidden gradients."""
    i = spec.intermediate_size
    return a * ((3 if spec.gated_mlp else 2) * i + 2 * spec.hidden_size)


def loss_bytes_per_token(spec: ModelSpec, a: int, backward: bool) -> int:
    """Logits at vocab size and the loss. HF's ForCausalLMLoss upcasts the 16-bit logits to
    fp32 (logits.float()), and cross_entropy keeps its fp32 log_softmax for backward.
    Forward peak: 16-bit logits + fp32 copy + log_softmax. Backward of log_softmax holds
    its saved output, the incoming and the outgoing fp32 gradient (3 x 4 bytes)."""
    V = spec.vocab_size
    if backward:
        return 12 * V
    return a * V + (4 * V if a != 4 else 0) + 4 * V


def reduce_transient_bytes(numel: int, cand: Candidate, shape: Shape, several: bool) -> int:
    """GPU bytes in flight while ZeRO-3 reduces `numel` gradient elements (stage3.py):
    reduce_scatter_coalesced concatenates several tensors into one buffer
    (comm/coalesced_collectives.py); with the optimizer offloaded `partition_grads` copies
    the pinned partition back to the GPU (.to(device)) and, at the accumulation boundary,
    `_offload_grad_partition_at_boundary` converts it to fp32 before the copy to the host."""
    a, W = shape.element_bytes, shape.world_size
    part = partition_numel(numel, W)
    total = a * numel if several else 0
    if cand.offload_optimizer != "none":
        total += a * part + 4 * part
    return total


# -------------------------------------------------------------------- the phases
def device_phases(spec: ModelSpec, shape: Shape, cand: Candidate, on_gpu: bool) -> dict[str, dict[str, int]]:
    """Transient device bytes per phase as named components, on top of the resident
    states. The backward entry is its largest sub-phase, named in `backward_peak_at`."""
    a, T, W = shape.element_bytes, shape.tokens_per_micro, shape.world_size
    h, V, L = spec.hidden_size, spec.vocab_size, spec.num_layers
    ckpt = shape.gradient_checkpointing
    layer_full = layer_activation_bytes_per_token(spec, a)
    # Saved for backward: with checkpointing only each block's input (HF's non-reentrant
    # checkpoint per decoder layer), else every block's tensors; the rotary cos/sin are
    # shared by all blocks; the final norm keeps its own (see layer_activation_bytes_per_token).
    blocks_saved = T * ((a * h if ckpt else layer_full) * L + 2 * a * spec.head_dim)
    final_norm = T * (4 * h + 2 * a * h)
    gathered = 0
    if cand.stage == 3 and (cand.offload_param != "none" or W > 1):
        # Offloaded partitions are copied to the GPU one parameter at a time
        # (_no_gather_coalesced); with W > 1 the all-gather fills new flat buffers.
        gathered = a * gathered_peak_numel(spec, ckpt, cand.prefetch_bucket_size, cand.max_live_parameters,
                                           cand.max_reuse_distance, cand.param_persistence_threshold)
    head_numel = V * h
    block_modules = [m.numel for m in spec.modules if m.layer is not None] or [0]
    bucket = min(cand.reduce_bucket_size, spec.layer_params or cand.reduce_bucket_size)

    forward = {"activations_saved": blocks_saved + final_norm,
               "logits_and_loss": T * loss_bytes_per_token(spec, a, backward=False), "gathered_params": gathered}
    backward_options = {
        "loss": {"activations_saved": blocks_saved + final_norm,
                 "logits_grad": T * loss_bytes_per_token(spec, a, backward=True), "gathered_params": gathered},
        "lm_head": {"activations_saved": blocks_saved + final_norm, "logits_grad": T * a * V,
                    "param_grad": a * head_numel,
                    "grad_reduce": reduce_transient_bytes(head_numel, cand, shape, several=False),
                    "gathered_params": gathered},
        "last_block": {"activations_saved": blocks_saved,
                       "block_recompute": T * layer_full if ckpt else 0,
                       "block_grads": T * layer_backward_working_per_token(spec, a),
                       "param_grad": a * max(block_modules),
                       "grad_reduce": reduce_transient_bytes(bucket, cand, shape, several=True),
                       "gathered_params": gathered},
        "embedding": {"param_grad": a * spec.embedding_params,
                      "grad_reduce": reduce_transient_bytes(spec.embedding_params, cand, shape, several=False),
                      "gathered_params": gathered},
    }
    at, backward = max(backward_options.items(), key=lambda kv: sum(kv[1].values()))
    # Evaluation runs forward under no_grad: nothing is saved, one block's tensors at a time.
    evaluation = {"logits_and_loss": T * loss_bytes_per_token(spec, a, backward=False),
                  "block_working": T * layer_full, "gathered_params": gathered}
    phases = {"forward": forward, "backward": backward,
              "optimizer_step": optimizer_step_device(spec, shape, cand, on_gpu), "eval": evaluation}
    return {name: {k: v for k, v in comps.items() if v} for name, comps in phases.items()} | {"backward_peak_at": at}


def optimizer_step_device(spec: ModelSpec, shape: Shape, cand: Candidate, on_gpu: bool) -> dict[str, int]:
    """Device temporaries of the optimizer step. For sub groups stepped on the device,
    `_prepare_fp32_grad_for_sub_group` flattens the 16-bit grads (a bytes) and converts
    them to fp32 (4 bytes): (a + 4) x the largest sub group, so sub_group_size 1e9 makes
    this multi-GB. torch's AdamW (the CPU accelerator; a partial offload's device part)
    adds foreach temporaries (sqrt(exp_avg_sq) and the denominator: 2 x 4 bytes)."""
    a = shape.element_bytes
    groups = sub_groups(spec, shape.world_size, cand.sub_group_size) if cand.stage == 3 else (spec.total_params,)
    n_device = len(groups) if cand.offload_optimizer == "none" else int((1 - cand.offload_optimizer_ratio) * len(groups))
    if not n_device:
        return {}
    largest = max(groups[:n_device])
    out = {"step_fp32_grad_flatten": (a + 4) * largest}
    if cand.offload_optimizer != "none" or not on_gpu:
        out["torch_adamw_temporaries"] = 8 * largest
    return out


def optimizer_step_host(spec: ModelSpec, shape: Shape, cand: Candidate) -> dict[str, int]:
    """Host temporaries of an offloaded step: copying the updated fp32 partition into the
    16-bit one on the GPU (`_reassign_or_swap_out_partitioned_parameters`) converts it on
    the host first (torch's cross-device copy_ with a dtype change)."""
    if cand.offload_optimizer == "none" or cand.offload_param != "none":
        return {}
    groups = sub_groups(spec, shape.world_size, cand.sub_group_size) if cand.stage == 3 else (spec.total_params,)
    return {"step_16bit_copy": shape.element_bytes * max(groups)}


# --------------------------------------------------------------- checkpoint, export
def checkpoint_bytes(total_params: int, world_size: int = 1, stage: int = 3, element_bytes: int = 2) -> int:
    """Bytes a DeepSpeed checkpoint takes on disk, all ranks together.

    Each rank writes its optimizer file: the fp32 master partition and Adam's exp_avg and
    exp_avg_sq (stage3.py `_rigid_state_dict`: 12 bytes per element); ZeRO-3 model files
    hold only shapes, stages 0-2 hold the 16-bit module too. Measured on the tiny model:
    1,090,117 bytes of optimizer file for 90,432 parameters (12.05 per parameter)."""
    per_rank = 12 * partition_numel(total_params, world_size) + CHECKPOINT_OVERHEAD_BYTES
    model_file = element_bytes * total_params if stage < 3 else 0
    return per_rank * world_size + model_file


def export_bytes(total_params: int, element_bytes: int = 2) -> int:
    """A safetensors export: every parameter once, in the export dtype."""
    return element_bytes * total_params


# ---------------------------------------------------------------------- step time
# CPU accelerator (tests, CPU-only machines): a rough fp32/bf16 matmul rate per core.
CPU_FLOPS_PER_CORE = 30e9


def step_time_terms(spec: ModelSpec, hw: Hardware, shape: Shape, cand: Candidate) -> dict[str, float]:
    """Seconds one optimizer step spends per term (summed: overlap is not assumed).

    - compute: 6 x params x tokens (Kaplan et al. arXiv:2001.08361; forward 2, backward 4)
      plus attention 12 x layers x hidden x seq per token (PaLM, arXiv:2204.02311 app. B),
      x 4/3 with recompute, at the calibrated matmul rate x utilisation;
    - pcie_params: offloaded 16-bit parameters copied to the GPU for forward, recompute and
      backward (ZeRO-Infinity, arXiv:2104.07857 sec. 5);
    - pcie_grads: offloaded gradient partitions to the host each micro batch (a round trip
      when accumulating), fp32 at the boundary, updated 16-bit parameters back (stage3.py
      partition_grads, _offload_grad_partition_at_boundary, _reassign_or_swap_out...);
    - cpu_adam / device_adam: DeepSpeedCPUAdam at its measured rate; a device Adam streams
      ~36 bytes per parameter (fp32 param, grad, moments read and written, 16-bit copy);
    - nvme: swapped optimizer states (16 bytes per element in and out) and parameters;
    - zero3_hooks: ZeRO-3's per-module fetch/release work, per module visit;
    - collectives: all-gather of parameters per pass and reduce-scatter of gradients
      across W ranks (ZeRO paper sec. 7: 3 x the data-parallel volume for stage 3)."""
    a, W, T = shape.element_bytes, shape.world_size, shape.tokens_per_micro
    accum, ckpt = shape.grad_accum, shape.gradient_checkpointing
    N = spec.total_params
    n_rank = -(-N // W) if cand.stage == 3 else N
    passes = 3 if ckpt else 2
    ranks_here = max(1, min(W, hw.gpu_count)) if hw.on_gpu else W
    cores = max(1, hw.cpu_cores // ranks_here)
    flops = (6 * N + 12 * spec.num_layers * spec.hidden_size * shape.seq_len) * T * (4 / 3 if ckpt else 1)
    rate = hw_rates.BF16_MATMUL_FLOPS * hw_rates.MODEL_FLOPS_UTILISATION if hw.on_gpu else CPU_FLOPS_PER_CORE * cores
    terms = {"compute": accum * flops / rate}
    groups = sub_groups(spec, W, cand.sub_group_size) if cand.stage == 3 else (n_rank,)
    n_device_groups = len(groups) if cand.offload_optimizer == "none" else int((1 - cand.offload_optimizer_ratio) * len(groups))
    on_device, offloaded = sum(groups[:n_device_groups]), sum(groups[n_device_groups:])
    if hw.on_gpu:
        pcie = hw_rates.PCIE_BYTES_PER_S
        if cand.offload_param != "none":
            terms["pcie_params"] = accum * passes * a * n_rank / pcie
        if cand.offload_optimizer != "none":
            per_micro = a * n_rank * (1 + 2 * (accum - 1) / accum)
            terms["pcie_grads"] = (accum * per_micro + 4 * offloaded + a * n_rank) / pcie
    if offloaded:
        terms["cpu_adam"] = offloaded * hw_rates.CPU_ADAM_SECONDS_PER_PARAM * hw_rates.CPU_ADAM_CORES / cores
    if on_device:
        terms["device_adam"] = on_device * 36 / (hw_rates.GPU_MEMORY_BYTES_PER_S if hw.on_gpu else 5e9 * cores)
    nvme_bytes = (16 * offloaded if cand.offload_optimizer == "nvme" else 0)
    if nvme_bytes:
        terms["nvme"] = nvme_bytes / hw_rates.DISK_READ_BYTES_PER_S + nvme_bytes / hw_rates.DISK_WRITE_BYTES_PER_S
    if cand.offload_param == "nvme" and n_rank > PARAM_MAX_IN_CPU:
        swapped = a * (n_rank - PARAM_MAX_IN_CPU)
        terms["nvme"] = terms.get("nvme", 0) + accum * passes * swapped / hw_rates.DISK_READ_BYTES_PER_S \
            + swapped / hw_rates.DISK_WRITE_BYTES_PER_S
    if cand.stage == 3:
        terms["zero3_hooks"] = accum * passes * len(spec.modules) * hw_rates.ZERO3_SECONDS_PER_MODULE_VISIT
    if W > 1:
        volume = a * N * (W - 1) / W
        gathers = passes if cand.stage == 3 else 0
        terms["collectives"] = accum * (gathers + 1) * volume / hw_rates.NVLINK_BYTES_PER_S
    return {k: round(v, 4) for k, v in terms.items()}


# ------------------------------------------------------------------------ predict
def predict(spec: ModelSpec, hw: Hardware, shape: Shape, cand: Candidate, headroom: float = 0.1) -> Plan:
    """The whole prediction for one candidate configuration."""
    on_gpu = hw.on_gpu
    gpu_states, host_states, nvme_states = model_states(spec, shape, cand, on_gpu)
    phases = device_phases(spec, shape, cand, on_gpu)
    backward_at = phases.pop("backward_peak_at")
    host_step = optimizer_step_host(spec, shape, cand)
    host_base = {"process": HOST_PROCESS_BYTES}
    if on_gpu:
        host_base["cuda_host_context"] = CUDA_HOST_CONTEXT_BYTES
    if shape.dataset_bytes:
        host_base["dataset"] = shape.dataset_bytes
    ranks_here = max(1, min(shape.world_size, hw.gpu_count)) if on_gpu else shape.world_size
    notes = [f"backward peaks at the {backward_at} backward"]

    if not on_gpu:  # the CPU accelerator: the "device" is host RAM
        host_states = {**host_states, **{f"device:{k}": v for k, v in gpu_states.items()}}
        gpu_states = {}
    resident_gpu, resident_host = sum(gpu_states.values()), sum(host_base.values()) + sum(host_states.values())
    per_phase, phase_peak = {}, {}
    for name in PHASES:
        transient = phases[name]
        host_extra = sum(host_step.values()) if name == "optimizer_step" else 0
        if on_gpu:
            per_phase[name] = {"gpu": resident_gpu + sum(transient.values()), "host": resident_host + host_extra}
        else:
            per_phase[name] = {"gpu": 0, "host": resident_host + sum(transient.values()) + host_extra}
    peak_name = max(PHASES, key=lambda p: per_phase[p]["gpu" if on_gpu else "host"])
    transients = sorted((sum(phases[p].values()) for p in ("backward", "optimizer_step")), reverse=True)
    # Fragmentation: blocks cached for one phase's tensors are not reused by another's of
    # other sizes, so reserved memory holds the two largest phase transients (measured with
    # HF Trainer + ZeRO-3, 1.5B: reserved 35.7 GiB vs allocated peak 28.0 = steady 22.4 +
    # step 5.6; /work/shared/device/README.md), plus 5% of the largest for rounding.
    fragmentation = transients[1] + int(0.05 * transients[0])

    def gpu_device(extra: dict[str, int], frag: int) -> Device:
        comps = {**gpu_states, **extra, "fragmentation": frag, "cuda_context": CUDA_DEVICE_CONTEXT_BYTES} if on_gpu else {}
        return _device(comps, hw.gpu_budget_bytes, headroom)

    def host_device(extra: dict[str, int]) -> Device:
        comps = {**host_base, **host_states, **extra}
        return _device({k: v * ranks_here for k, v in comps.items() if v}, hw.host_budget_bytes, headroom)

    peak_transient = {f"{peak_name}:{k}": v for k, v in phases[peak_name].items()}
    host_peak_extra = {f"optimizer_step:{k}": v for k, v in host_step.items()}
    if not on_gpu:
        host_peak_extra = {**peak_transient, **(host_peak_extra if peak_name == "optimizer_step" else {})}
    ckpt_bytes = checkpoint_bytes(spec.total_params, shape.world_size, cand.stage, shape.element_bytes)
    disk_free = hw.disk_free_bytes
    devices = {"gpu": gpu_device(peak_transient, fragmentation), "host": host_device(host_peak_extra),
               "disk": _device({"checkpoints": ckpt_bytes * shape.checkpoints_on_disk}, disk_free, headroom)}
    if nvme_states:
        devices["nvme"] = _device(nvme_states, hw.nvme_free_bytes or 0, headroom)

    # Checkpoint save: between steps (no activations). torch.save copies device-resident
    # storages to the host one at a time (largest: an fp32 sub-group tensor); a consolidated
    # 16-bit model (gather_16bit_weights_on_save) gathers module by module on the GPU
    # (engine._zero3_consolidated_16bit_state_dict) and holds the whole model on the host.
    largest_group = max(sub_groups(spec, shape.world_size, cand.sub_group_size)) if cand.stage == 3 else spec.total_params
    save_gpu, save_host = {}, {}
    if on_gpu and cand.offload_optimizer == "none":
        save_host["torch_save_staging"] = 4 * largest_group
    if cand.gather_16bit_weights_on_save:
        save_gpu["gathered_module"] = shape.element_bytes * spec.largest_module.numel
        save_host["consolidated_16bit_model"] = shape.element_bytes * spec.total_params
    save_peak = {"gpu": gpu_device(save_gpu, 0), "host": host_device(save_host if on_gpu else {**save_host, **{
        f"device:{k}": v for k, v in save_gpu.items()}}),
        "disk": devices["disk"]}
    # First step after a save: the save's freed blocks stay cached in the allocator
    # (fragmentation), on top of the usual step peak.
    residue = save_gpu.get("gathered_module", 0)
    first_step = {"gpu": gpu_device(peak_transient, fragmentation + residue), "host": devices["host"]}
    # Export: one rank's optimizer file read whole (torch.load) plus one output shard.
    n_rank = partition_numel(spec.total_params, shape.world_size)
    export = {"host": _device({"process": HOST_PROCESS_BYTES, "optimizer_file_of_one_rank": 12 * n_rank,
                               "output_shard": min(EXPORT_SHARD_BYTES, export_bytes(spec.total_params))},
                              hw.host_budget_bytes, headroom),
              "disk": _device({"safetensors": export_bytes(spec.total_params)}, disk_free, headroom)}

    pinned_total = sum(v for k, v in host_states.items() if "pinned" in k) * ranks_here
    if on_gpu and hw.pinned_limit_bytes is not None and pinned_total > hw.pinned_limit_bytes:
        notes.append(f"{pinned_total / GIB:.1f} GiB pinned exceeds ulimit -l ({hw.pinned_limit_bytes / GIB:.2f} GiB); "
                     f"fine with torch's pinning (cudaHostAlloc), fatal with DS_PIN_MEMORY_BACKEND=native")
    terms = step_time_terms(spec, hw, shape, cand)
    fits = all(d.fits for d in devices.values()) and all(d.fits for d in save_peak.values()) \
        and all(d.fits for d in first_step.values())
    host_rss_peak = max(p["host"] for p in per_phase.values())
    return Plan(fits=fits, params=spec.total_params, shape=shape, candidate=cand, accelerator=hw.accelerator,
                devices=devices, gpu_allocated_peak=max(p["gpu"] for p in per_phase.values()),
                host_rss_peak=host_rss_peak, phases=per_phase, save_peak=save_peak,
                first_step_after_save_peak=first_step, checkpoint_bytes=ckpt_bytes, export_peak=export,
                step_seconds=round(sum(terms.values()), 4), step_terms=terms, notes=notes)


def _device(components: dict[str, int], budget: int, headroom: float) -> Device:
    components = {k: int(v) for k, v in components.items() if v}
    return Device(total_bytes=sum(components.values()), budget_bytes=int(budget), components=components,
                  usable_bytes=int(budget * (1 - headroom)))
