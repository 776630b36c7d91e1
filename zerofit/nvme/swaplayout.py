"""What DeepSpeed's NVMe optimizer swapper will write, byte by byte (pure arithmetic).

With `offload_optimizer: nvme`, ZeRO-3 keeps each optimizer sub group's fp32 master
partition, Adam's exp_avg and exp_avg_sq, and its fp32 gradient fragments in files under
`nvme_path/zero_stage_3/optimizer/rankN/` and streams them through a few page-locked
buffers with libaio. The rules below are DeepSpeed 0.19.8's (deepspeed/runtime/swap_tensor/):

- a sub group is swapped only when its fp32 bytes reach `max(MIN_AIO_BYTES, aio.block_size)`
  (optimizer_utils.py `is_swappable_tensor`, stage3.py `_swappable_optimizer_subgroup`);
  smaller ones stay in host RAM like a CPU offload;
- every transfer is padded to `AIO_ALIGNED_BYTES x intra_op_parallelism` bytes
  (`_io_aligned_numel`), split evenly over `intra_op_parallelism` threads
  (csrc/aio/py_lib/deepspeed_cpu_op.cpp `run`), and each thread's share is cut into
  `block_size` pieces at block-size offsets, the last one shorter (deepspeed_aio_utils.cpp);
- gradients are written per parameter fragment, each cut down to the same alignment, the
  remainder kept in RAM (`_adjust_for_misaligned_lengths`), one file per fragment;
- the buffer pool holds `buffer_count` buffers of the largest sub group, padded
  (`SwapBufferManager(num_elems=largest_numel, count=buffer_count)`), mlock'ed;
- with `pipeline_read`/`pipeline_write` (zero.nvme_pipeline) the PipelinedOptimizerSwapper
  reads sub group i+1 and finishes writing i-1 while i steps (swap_in_optimizer_state's
  `async_parameter`, swap_out_optimizer_state's `async_swap`): three sub groups hold their
  four buffers at once, so it needs `buffer_count` 12 (with 4 it asserts "ran out of swap
  buffers" at the third sub group; measured on the CPU accelerator with 10 sub groups).

The files are opened with O_DIRECT and DeepSpeed never looks at the result of an I/O
(`_do_io_complete` counts events, not their `res`): a piece whose length is not a whole
number of the filesystem's direct-I/O blocks fails with EINVAL, a full disk with ENOSPC,
and either leaves the file short without a word. The next read of that file then aborts
the process in `is_valid_bytes_to_read`: "file_offset + buffer nbytes > file bytes".
`transfer_problems` finds the first kind before training starts; zerofit.nvme.preflight checks
free space for the second and the file sizes after every step for anything else.
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zerofit.plan.spec import ModelSpec

# deepspeed/runtime/swap_tensor/utils.py and offload_config.py / constants.py defaults
MIN_AIO_BYTES = 1024**2
AIO_ALIGNED_BYTES = 1024
FP32_BYTES = 4
OPTIMIZER_BUFFER_COUNT = 4      # offload_optimizer.buffer_count: param, grad, exp_avg, exp_avg_sq
SWAPPED_TENSORS = 3             # files per sub group: fp32 master, exp_avg, exp_avg_sq
PIPELINED_SUB_GROUPS = 3        # reading the next, stepping the current, writing the previous
PIPELINED_BUFFER_COUNT = PIPELINED_SUB_GROUPS * OPTIMIZER_BUFFER_COUNT
# The one-at-a-time swap's time as a share of its bytes at the doctor's sequential rates
# (read bytes / read rate + written bytes / write rate): swap seconds (the NVMe step less the
# CPU-offload step of the same config) over that sum, in two llama-3.6b runs on one disk
# (bench/results/README.md). Not isolated which overlap buys it: the gradients are written
# during the boundary micro batch's backward, and a sub group's tensors are read as concurrent
# aio requests the one-stream sweep does not issue.
SERIAL_SWAP_FRACTION = (60.9 / 78.5 + 56.4 / 74.9) / 2
# The pipelined swapper's share of the one-at-a-time swap time. Its reads and writes overlap
# each other, but on one disk they share its bandwidth: the pipelined swap's seconds over the
# one-at-a-time swap's, one llama-3.6b run on one disk (bench/results/README.md).
PIPELINED_SWAP_FRACTION = 53.7 / 60.9
# The largest block zerofit raises aio.block_size to, to keep a misaligned small sub group in RAM.
MAX_BLOCK_SIZE = 64 * 2**20


@dataclass(frozen=True)
class Aio:
    """DeepSpeed's `aio` section (runtime/swap_tensor/aio_config.py), its defaults."""
    block_size: int = 1_048_576
    queue_depth: int = 8
    intra_op_parallelism: int = 1
    single_submit: bool = False
    overlap_events: bool = True

    def to_json(self) -> dict:
        return asdict(self)


def padded_numel(numel: int, aio: Aio) -> int:
    """optimizer_utils.py `_io_aligned_numel`: up to a multiple of 1024 x threads bytes."""
    align = AIO_ALIGNED_BYTES * aio.intra_op_parallelism // FP32_BYTES
    return -(-numel // align) * align


def min_swap_bytes(aio: Aio) -> int:
    """`OptimizerSwapper.min_aio_bytes`: smaller tensors are never swapped."""
    return max(MIN_AIO_BYTES, aio.block_size)


def is_swapped(numel: int, aio: Aio) -> bool:
    return FP32_BYTES * numel >= min_swap_bytes(aio)


@dataclass(frozen=True)
class SwapLayout:
    """One rank's NVMe optimizer swap, from its sub groups (element counts of the members)."""
    swapped: tuple[int, ...]          # element counts of the swapped sub groups
    resident: tuple[int, ...]         # sub groups too small to swap: they stay in host RAM
    state_bytes: int                  # fp32 master + exp_avg + exp_avg_sq files
    gradient_bytes: int               # fp32 gradient fragment files (at most)
    pinned_buffer_bytes: int          # the swapper's mlock'ed buffer pool
    read_bytes_per_step: int          # master, moments and gradients in, per optimizer step
    write_bytes_per_step: int         # master and moments out, gradients out (once per step)
    pipelined: bool = False           # reads and writes overlap the neighbouring sub groups' steps

    @property
    def swapped_numel(self) -> int:
        return sum(self.swapped)

    @property
    def nvme_bytes(self) -> int:
        return self.state_bytes + self.gradient_bytes


def layout(groups: tuple[tuple[int, ...], ...], aio: Aio, pipelined: bool = False) -> SwapLayout:
    """`groups`: each sub group's member partition sizes (zerostates.sub_group_members)."""
    totals = [sum(members) for members in groups]
    swapped = tuple(n for n in totals if is_swapped(n, aio))
    resident = tuple(n for n in totals if not is_swapped(n, aio))
    file_bytes = [FP32_BYTES * padded_numel(n, aio) for n in swapped]
    largest = padded_numel(max(totals, default=0), aio)  # stage3.py: max over all sub groups
    states = SWAPPED_TENSORS * sum(file_bytes)
    grads = sum(file_bytes)
    # Each step reads master, moments and gradients and writes master and moments back;
    # gradients go out once per step, at the accumulation boundary (stage3.py
    # _offload_grad_partition_at_boundary -> _swap_out_offload_fp32_gradients): accumulation amortizes it all.
    buffers = PIPELINED_BUFFER_COUNT if pipelined else OPTIMIZER_BUFFER_COUNT
    return SwapLayout(swapped=swapped, resident=resident, state_bytes=states, gradient_bytes=grads,
                      pinned_buffer_bytes=buffers * FP32_BYTES * largest if swapped else 0,
                      read_bytes_per_step=states + grads, write_bytes_per_step=states + grads,
                      pipelined=pipelined)


# ----------------------------------------------------------------- alignment
def transfers(groups: tuple[tuple[int, ...], ...], aio: Aio) -> list[tuple[str, int]]:
    """(what, bytes one I/O thread transfers) for every file the swapper writes."""
    out = []
    align = AIO_ALIGNED_BYTES * aio.intra_op_parallelism // FP32_BYTES
    for index, members in enumerate(groups):
        total = sum(members)
        if not is_swapped(total, aio):
            continue
        out.append((f"sub group {index} ({total:,} elements)",
                    FP32_BYTES * padded_numel(total, aio) // aio.intra_op_parallelism))
        for numel in members:  # gradient fragments: cut down to the alignment, the rest stays in RAM
            fragment = FP32_BYTES * (numel // align) * align
            if fragment >= min_swap_bytes(aio):
                out.append((f"a {numel:,}-element gradient fragment of sub group {index}",
                            fragment // aio.intra_op_parallelism))
    return out


def transfer_problems(groups: tuple[tuple[int, ...], ...], aio: Aio, dio_align: int) -> list[str]:
    """Transfers that O_DIRECT on a filesystem with `dio_align`-byte blocks rejects (EINVAL):
    a thread's share must be whole blocks (its pieces start at multiples of block_size,
    so block_size must be whole blocks too, and then only the share's length matters)."""
    problems = []
    if aio.block_size % dio_align:
        problems.append(f"aio block_size {aio.block_size} is not a multiple of the path's {dio_align}-byte "
                        f"direct-I/O block")
    for what, nbytes in transfers(groups, aio):
        if nbytes % dio_align:
            problems.append(f"{what}: {nbytes:,} bytes per I/O thread, not a multiple of {dio_align}")
    return problems


def aligned_aio(groups: tuple[tuple[int, ...], ...], aio: Aio, dio_align: int) -> tuple[Aio, list[str]]:
    """`aio`, or the nearest settings whose every transfer is whole direct-I/O blocks, and
    what was changed. Tried in order: one I/O thread (its share is the whole, padded
    transfer); then a block size above the misaligned sub groups, which keeps them (and
    their fragments) in RAM, as DeepSpeed does with anything under one block. Returns the
    remaining problems when neither helps; the caller refuses to start."""
    changes: list[str] = []
    if aio.block_size % dio_align:
        fixed = -(-aio.block_size // dio_align) * dio_align
        changes.append(f"aio block_size {aio.block_size} -> {fixed} (whole {dio_align}-byte blocks)")
        aio = replace(aio, block_size=fixed)
    if not transfer_problems(groups, aio, dio_align):
        return aio, changes
    if aio.intra_op_parallelism > 1:
        single = replace(aio, intra_op_parallelism=1)
        if not transfer_problems(groups, single, dio_align):
            return single, changes + [f"aio intra_op_parallelism {aio.intra_op_parallelism} -> 1 (each thread's "
                                      f"share of a transfer must be whole {dio_align}-byte blocks)"]
        aio = single
    block = aio.block_size
    while block <= MAX_BLOCK_SIZE:
        bigger = replace(aio, block_size=block)
        if not transfer_problems(groups, bigger, dio_align):
            kept = [sum(m) for m in groups if is_swapped(sum(m), aio) and not is_swapped(sum(m), bigger)]
            return bigger, changes + [f"aio block_size {aio.block_size} -> {block}: {len(kept)} sub group(s) "
                                      f"of {', '.join(f'{n:,}' for n in kept)} elements stay in host RAM "
                                      f"(their sizes are not whole {dio_align}-byte blocks)"]
        block *= 2
    return aio, transfer_problems(groups, aio, dio_align)


def nvme_seconds(swap: SwapLayout, read_bytes_per_s: float, write_bytes_per_s: float) -> float:
    """Time one step spends waiting on the swap files. DeepSpeed's default swapper does one
    thing at a time, sub group by sub group: swap in, step, swap out, at the rates the doctor
    measured less the overlap measured on the GPU host (SERIAL_SWAP_FRACTION). The
    pipelined one reads the next sub group on one aio handle while the other writes the
    previous one, but both streams share the disk: what it saved once is its measured
    fraction, not the max(read, write) two independent disks would give."""
    serial = SERIAL_SWAP_FRACTION * (swap.read_bytes_per_step / read_bytes_per_s
                                     + swap.write_bytes_per_step / write_bytes_per_s)
    if swap.pipelined and len(swap.swapped) > 1:
        return serial * PIPELINED_SWAP_FRACTION
    return serial


def bandwidth_to_hide(swap: SwapLayout, other_seconds: float) -> float:
    """Bytes/s read plus write the path needs so the swap takes no longer than the rest of
    the step (what `zerofit plan` asks of a disk it proposes)."""
    moved = swap.read_bytes_per_step + swap.write_bytes_per_step
    return moved / max(other_seconds, 1e-9)


@functools.lru_cache(maxsize=64)
def sub_group_members(spec: ModelSpec, world: int, sub_group_size: int) -> tuple[tuple[int, ...], ...]:
    """The optimizer sub groups of one rank, each as its members' partition sizes.

    zerofit passes two param groups of the trainable parameters (engine.param_groups: >=2-D
    weights decay, the rest do not); stage3.py `_create_fp16_sub_groups` cuts each group, in
    parameter order, into runs that close once they reach sub_group_size elements."""
    groups: list[tuple[int, ...]] = []
    for decay in (True, False):
        members = [-(-p.numel // world) for p in spec.params if p.trainable and (p.ndim >= 2) == decay]  # padded (partition_parameters.py)
        if not members:
            continue
        if sub_group_size >= sum(members):
            groups.append(tuple(members))
            continue
        run: list[int] = []
        run_numel = 0
        for i, numel in enumerate(members):
            run.append(numel)
            run_numel += numel
            if run_numel >= sub_group_size or i == len(members) - 1:
                groups.append(tuple(run))
                run, run_numel = [], 0
    return tuple(groups)
