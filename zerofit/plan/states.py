"""ZeRO model states: where DeepSpeed keeps parameters, gradients and optimizer states,
byte by byte, per rank (pure arithmetic).

Sources: ZeRO (Rajbhandari et al., arXiv:1910.02054) for 2 + 2 + 12 bytes per parameter and
what each stage partitions; ZeRO-Offload/Infinity (arXiv:2101.06840, arXiv:2104.07857) for
what moves to CPU/NVMe; DeepSpeed 0.19's runtime/zero/stage3.py for the buffers it really
allocates (named in each function); torch's CachingHostAllocator
(ATen/core/CachingHostAllocator.h), which rounds pinned blocks up to a power of two and
keeps them cached after free. The ZeRO-3 fetch trace and the parameters gathered through a
step are zerotrace.py's.
"""
from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

from zerofit.nvme.swaplayout import Aio, SwapLayout, layout, sub_group_members
from zerofit.plan.spec import ModelSpec

if TYPE_CHECKING:
    from zerofit.plan.estimate import Candidate, Shape

# DeepSpeed defaults of the parameter swap buffers (runtime/zero/offload_config.py).
PARAM_SWAP_BUFFERS, PARAM_SWAP_BUFFER_NUMEL, PARAM_MAX_IN_CPU = 5, 100_000_000, 1_000_000_000


def largest_partition_numel(spec: ModelSpec, world_size: int) -> int:
    """The largest parameter partition: NVMe parameters need a swap buffer that holds it.
    zero.Init gives every partition of at least 1 MiB a buffer of offload_param.buffer_size
    elements (partition_parameters.py `_partition_param`, partitioned_param_swapper.py
    `get_buffer` asserts "More elements than buffer size"): llama-0.5b's embedding,
    128,256 x 1024 = 131M elements, is over DeepSpeed's default 1e8."""
    return max((partition_numel(p.numel, world_size) for p in spec.params), default=0)


def param_buffer_numel(spec: ModelSpec, world_size: int) -> int:
    """The offload_param.buffer_size zerofit sets: the largest partition, never below
    DeepSpeed's default."""
    return max(PARAM_SWAP_BUFFER_NUMEL, largest_partition_numel(spec, world_size))


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
def nvme_resident(spec: ModelSpec, world: int, sub_group_size: int, min_swap_bytes: int,
                  element_bytes: int) -> frozenset[str]:
    """The parameters whose partitions stay on NVMe under offload_param nvme, read into a swap
    buffer for each use. zero.Init puts every partition of at least `min_swap_bytes`
    (max(1 MiB, aio.block_size)) there (partition_parameters.py `_partition_param`); the
    optimizer then copies whole sub groups, group by group, into CPU flat buffers of
    offload_param.max_in_cpu elements in all (stage3.py `_create_param_groups_fp16_flat_cpu_
    memory`, `_move_to_flat_buffer`). The rest, and a frozen base (in no optimizer group),
    stay on NVMe."""
    swappable = {p.name for p in spec.params if element_bytes * partition_numel(p.numel, world) >= min_swap_bytes}
    names = iter(p.name for decay in (True, False) for p in spec.params if p.trainable and (p.ndim >= 2) == decay)
    resident = {p.name for p in spec.params if not p.trainable} & swappable
    groups = sub_group_members(spec, world, sub_group_size)
    held = 0  # elements in the flat buffers of the groups before
    for group in _per_param_group(spec, groups):
        in_group = sum(sum(members) for members in group)
        flat = in_group if held + in_group <= PARAM_MAX_IN_CPU else max(1, PARAM_MAX_IN_CPU - held)
        held += in_group
        offset = 0
        for members in group:
            offset += sum(members)
            sub_group = [next(names) for _ in members]
            if offset > flat:
                resident.update(name for name in sub_group if name in swappable)
    return frozenset(resident)


def _per_param_group(spec: ModelSpec, groups: tuple[tuple[int, ...], ...]) -> list[list[tuple[int, ...]]]:
    """sub_group_members' sub groups split back into the two param groups (decay first)."""
    decay_members = sum(1 for p in spec.params if p.trainable and p.ndim >= 2)
    split, seen = [[], []], 0
    for members in groups:
        split[seen >= decay_members].append(members)
        seen += len(members)
    return [group for group in split if group]


def sub_groups(spec: ModelSpec, world: int, sub_group_size: int) -> tuple[int, ...]:
    """Element counts of the optimizer sub groups of one rank."""
    return tuple(sum(members) for members in sub_group_members(spec, world, sub_group_size))


def optimizer_groups(spec: ModelSpec, shape: Shape, cand: Candidate) -> tuple[int, ...]:
    """What the optimizer steps at once: ZeRO-3's sub groups, else the trainable shard."""
    if cand.stage == 3:
        return sub_groups(spec, shape.world_size, cand.sub_group_size) or (0,)
    return (spec.trainable_params // (shape.world_size if cand.stage >= 1 else 1),)


def persistent_numel(spec: ModelSpec, threshold: int) -> int:
    return sum(p.numel for p in spec.params if p.numel <= threshold)


# ------------------------------------------------------------------ model states
def model_states(spec: ModelSpec, shape: Shape, cand: Candidate, on_gpu: bool) -> tuple[dict, dict, dict]:
    """(gpu, host, nvme) resident bytes per rank of parameters, gradients and optimizer
    states, named by what holds them in DeepSpeed."""
    W, a = shape.world_size, shape.element_bytes
    gpu: dict[str, int] = {}
    host: dict[str, int] = {}
    nvme: dict[str, int] = {}
    if cand.stage < 3:
        return _model_states_stage012(spec, shape, cand, on_gpu)
    n_rank = sum(partition_numel(p.numel, W) for p in spec.params)
    trainable = [p for p in spec.params if p.trainable]
    t_rank = sum(partition_numel(p.numel, W) for p in trainable)
    groups = sub_groups(spec, W, cand.sub_group_size) or (0,)
    # Partial offload (offload_optimizer.ratio): stage3.py `_create_fp32_partitions` keeps the
    # first int((1 - ratio) * n_sub_groups) sub groups on the GPU, the rest on the CPU.
    on_device = len(groups) if cand.offload_optimizer == "none" else int((1 - cand.offload_optimizer_ratio) * len(groups))
    device_groups, offloaded_groups = groups[:on_device], groups[on_device:]
    dev_numel, off_numel = sum(device_groups), sum(offloaded_groups)

    # 16-bit parameter partitions: the trainable ones in one flat buffer on the GPU
    # (`lp_param_buffer`, defragment) or, offloaded, one pinned flat buffer per param group
    # (`_create_param_groups_fp16_flat_cpu_memory`); frozen ones (a LoRA base) stay where
    # zero.Init put them, each partition its own (pinned, when offloaded) block.
    if cand.offload_param == "none":
        gpu["params_16bit"] = a * n_rank
    else:
        group_numels = [sum(partition_numel(p.numel, W) for p in trainable if (p.ndim >= 2) == d) for d in (True, False)]
        in_cpu = t_rank if cand.offload_param == "cpu" else min(t_rank, PARAM_MAX_IN_CPU)
        host["params_16bit_pinned"] = sum(pinned(a * g, cand, on_gpu) for g in group_numels if g) \
            if in_cpu == t_rank else pinned(a * in_cpu, cand, on_gpu)
        frozen = [partition_numel(p.numel, W) for p in spec.params if not p.trainable]
        if frozen:
            host["frozen_params_16bit_pinned"] = sum(pinned(a * n, cand, on_gpu) for n in frozen)
        if cand.offload_param == "nvme":
            nvme["params_16bit_swap"] = a * n_rank
            host["param_swap_buffers_pinned"] = PARAM_SWAP_BUFFERS * pinned(a * cand.param_buffer_size, cand, on_gpu)
        # zero.Init pins each parameter's partition on its own; moving the trainable ones into
        # the flat buffer frees those blocks into the CachingHostAllocator's cache, which keeps them.
        # On NVMe it puts them in the swap buffers instead (`_partition_param`): no cache.
        if on_gpu and cand.pin_memory and cand.offload_param == "cpu":
            host["zero_init_pinned_cache"] = sum(pow2_ceil(a * partition_numel(p.numel, W)) for p in trainable)
        # Persistent (small) parameters stay on the GPU, gathered (parameter_offload.py).
        gpu["params_persistent"] = a * persistent_numel(spec, cand.param_persistence_threshold)
    if W > 1 and cand.offload_param == "none":
        gpu["params_persistent"] = a * persistent_numel(spec, cand.param_persistence_threshold) * (W - 1) // W

    # Gradient partitions, one flat buffer in the accumulation dtype (= model dtype) on the
    # optimizer's device, pinned there (`_setup_for_real_optimizer`).
    if cand.offload_optimizer == "none":
        gpu["grads_16bit"] = a * t_rank
    else:
        host["grads_16bit_pinned"] = pinned(a * t_rank, cand, on_gpu)

    # fp32 master weights and Adam moments (ZeRO: 12 bytes per parameter), partitioned.
    if dev_numel:
        gpu["master_fp32"] = 4 * dev_numel
        gpu["adam_moments_fp32"] = 8 * dev_numel
    if off_numel:
        swap = swap_layout(spec, shape, cand) if cand.offload_optimizer == "nvme" else None
        if swap:
            nvme.update(_nvme_optimizer_states(swap, host))
        else:
            host["master_fp32"] = 4 * off_numel              # `.to(cpu, fp32).clone()`: pageable
            host["adam_moments_fp32"] = 8 * off_numel        # cpu_adam.py: zeros_like at the first step
            # One pinned fp32 gradient buffer per sub group (`initialize_optimizer_states`);
            # GPU sub groups of a partial offload get theirs via .to(gpu), leaving the pinned
            # block cached on the host.
        if cand.offload_optimizer == "cpu" or dev_numel:
            host["fp32_grads_pinned"] = sum(pinned(4 * g, cand, on_gpu) for g in groups)
        elif swap:  # sub groups too small to swap: pinned grads like a CPU offload
            host["fp32_grads_pinned"] = sum(pinned(4 * g, cand, on_gpu) for g in swap.resident)
    if dev_numel and cand.offload_optimizer != "none":
        gpu["fp32_grads"] = 4 * dev_numel
    # The reduce bucket (contiguous_gradients), on the device (`_setup_for_real_optimizer`).
    gpu["reduce_bucket"] = a * cand.reduce_bucket_size
    if cand.offload_optimizer == "none":
        # `initialize_optimizer_states` hangs every sub group's .grad on one fp32 buffer of the
        # largest sub group; it lives until the first optimizer step releases them.
        gpu["fp32_grad_buffer_until_first_step"] = 4 * max(groups)
    return gpu, host, nvme


def swap_layout(spec: ModelSpec, shape: Shape, cand: Candidate) -> SwapLayout:
    """What DeepSpeed's NVMe optimizer swapper writes for this candidate (swaplayout.py)."""
    aio = Aio(block_size=cand.aio_block_size, intra_op_parallelism=cand.aio_intra_op_parallelism)
    return layout(sub_group_members(spec, shape.world_size, cand.sub_group_size), aio, cand.nvme_pipeline)


# Host RAM created by the first optimizer step, not there while the engine is built.
FIRST_STEP_HOST = ("adam_moments_fp32", "first_step_moments_pipelined")


def engine_start_host(host_states: dict[str, int], spec: ModelSpec, shape: Shape, cand: Candidate,
                      on_gpu: bool) -> dict[str, int]:
    """Host RAM while deepspeed.initialize builds the engine: the resident states less what
    the first step creates, plus a second copy of the rank's trainable 16-bit parameters when
    they are offloaded (the optimizer's flat 16-bit buffers, filled from the partitions:
    stage3._create_fp16_partitions_with_defragmentation; a frozen base is not in them). With
    the optimizer on the CPU the moments of the first step hide it; on NVMe it is the run's
    host peak."""
    start = {k: v for k, v in host_states.items() if k not in FIRST_STEP_HOST}
    if on_gpu and cand.offload_param != "none":
        start["engine_init_16bit_params_copy"] = shape.element_bytes * partition_numel(spec.trainable_params,
                                                                                     shape.world_size)
    return start


def _nvme_optimizer_states(swap: SwapLayout, host: dict[str, int]) -> dict[str, int]:
    """ZeRO-Infinity optimizer offload (stage3.py `_create_fp32_partitions`,
    `initialize_optimizer_states`; swap_tensor/): swapped sub groups live in files and pass
    through the swapper's mlock'ed buffer pool (never rounded up: posix_memalign, not torch's
    caching allocator) and one pageable fp32 gradient buffer of the largest sub group;
    sub groups under one aio block stay in host RAM with their master weights and moments."""
    resident = sum(swap.resident)
    if resident:
        host["master_fp32"] = 4 * resident
        host["adam_moments_fp32"] = 8 * resident
    if swap.swapped:
        host["optimizer_swap_buffers_locked"] = swap.pinned_buffer_bytes
        host["fp32_grad_buffer"] = 4 * max(swap.swapped + swap.resident)
    if swap.pipelined:
        # Adam's first step creates every swapped sub group's moments in pageable RAM; the
        # pipelined swapper copies them into its buffers but keeps the tensors until zerofit
        # releases them after the step (nvme.release_swapped_views): step 1's host peak only.
        host["first_step_moments_pipelined"] = 8 * swap.swapped_numel
    return {"optimizer_swap": swap.state_bytes, "gradient_swap": swap.gradient_bytes}


def _model_states_stage012(spec: ModelSpec, shape: Shape, cand: Candidate, on_gpu: bool):
    """ZeRO stages 0-2 (arXiv:1910.02054 fig. 1): 16-bit params whole on every rank; grads
    partitioned from stage 2, optimizer states from stage 1; ZeRO-Offload moves the fp32
    states (and the grads they step on) to the CPU; only trainable parameters have them."""
    W, a, N, T = shape.world_size, shape.element_bytes, spec.total_params, spec.trainable_params
    shard = T // W if cand.stage >= 1 else T
    gpu = {"params_16bit": a * N, "grads_16bit": a * (T // W if cand.stage >= 2 else T),
           "reduce_bucket": a * cand.reduce_bucket_size}
    host: dict[str, int] = {}
    if cand.offload_optimizer == "none":
        gpu.update(master_fp32=4 * shard, adam_moments_fp32=8 * shard)
    else:
        host.update(master_fp32=4 * shard, adam_moments_fp32=8 * shard, fp32_grads_pinned=pinned(4 * shard, cand, on_gpu))
    return gpu, host, {}



def optimizer_step_device(spec: ModelSpec, shape: Shape, cand: Candidate, on_gpu: bool) -> dict[str, int]:
    """Device temporaries of the optimizer step. For sub groups stepped on the device,
    `_prepare_fp32_grad_for_sub_group` flattens the 16-bit grads (a bytes) and converts
    them to fp32 (4 bytes): (a + 4) x the largest sub group, so sub_group_size 1e9 makes
    this multi-GB. torch's AdamW (the CPU accelerator; a partial offload's device part)
    adds foreach temporaries (sqrt(exp_avg_sq) and the denominator: 2 x 4 bytes)."""
    a = shape.element_bytes
    groups = optimizer_groups(spec, shape, cand)
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
    groups = optimizer_groups(spec, shape, cand)
    return {"step_16bit_copy": shape.element_bytes * max(groups)}
