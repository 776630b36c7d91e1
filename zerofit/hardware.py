"""What the machine has: GPU memory per rank, host RAM, the pinned-memory limit, free disk.

Every figure is probed and every figure can be overridden (`--gpu-mem 24GiB`,
`plan.gpu_mem`), so a plan for a 24 GiB card can be made on any machine. On a machine
without a GPU the "device" is the CPU (DeepSpeed's CPU accelerator): everything lives in
host RAM and the plan is made against it.

The rates the step-time model uses are named constants here, each with its source.
"""
from __future__ import annotations

import os
import resource
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from zerofit.memory import parse_bytes

GIB = 2**30

# ------------------------------------------------------------------------- rates
# Measured on the GPU machine (one H200, 16 cores; /work/shared/device/README.md, bench of
# 2026-11-29). They calibrate the cost model; the choice only needs them to rank candidates.
BF16_MATMUL_FLOPS = 810e12          # bf16 8192^3 matmul peak
PCIE_BYTES_PER_S = 55e9             # pinned host<->device, each way
# The offloaded step's copy of the updated parameters to 16-bit ones on the GPU: converted on
# the host into a temporary, then a pageable (unpinned) copy. What was left of the llama-3.6b
# step's time beyond the other terms, bench/results/speed-3.6b.json (2026-11-29, late night):
# 7.2 GB in 0.71 s with zerofit's heap temporaries, 1.68 s with a fresh mmap per sub-group.
COPY_BACK_BYTES_PER_S = {True: 10.1e9, False: 4.3e9}  # by train.heap_step_temporaries
CPU_ADAM_SECONDS_PER_PARAM = 0.23 / 1e9   # DeepSpeedCPUAdam, per parameter per step ...
CPU_ADAM_CORES = 16                        # ... on this many cores (scaled linearly with cores)
DISK_WRITE_BYTES_PER_S = 1.5e9      # sequential write with fsync (/tmp)
DISK_READ_BYTES_PER_S = 2.2e9       # sequential read
# Not measured there; from vendor data sheets (H200: 4.8 TB/s HBM3e, NVLink 900 GB/s
# bidirectional), discounted to what streaming kernels and NCCL reach in practice.
GPU_MEMORY_BYTES_PER_S = 0.7 * 4.8e12
NVLINK_BYTES_PER_S = 0.5 * 450e9
# Fraction of matmul peak a training step reaches (model FLOPs utilisation). The README's
# 1.5B/3.6B offload runs are dominated by transfers and CPU-Adam, so this is an assumption
# (typical 35-50% for dense decoder training), to be refined by bench/planner_accuracy.py.
MODEL_FLOPS_UTILISATION = 0.4
# ZeRO-3 hook work per visit of a module that fetches and releases parameters. With the
# forward/backward as max(GPU compute, parameter fetches + hooks) (planner.step_seconds),
# the single-H200 steps leave per fetching visit: README stock runs (micro batch 2, seq 1024)
# 2.0 ms (1.5B, 1.43 s/step, 340 visits) and 1.07 ms (3.6B, 2.34 s, 592); the stock config at
# micro 8 x 2 on 3.6B, bench/results/speed-3.6b.json, 1.07 ms (3.85 s, 1184). 1.4 ms predicts
# these and zerofit's offloaded-parameter step there (2.85 s) within -13% .. +12%.
ZERO3_SECONDS_PER_MODULE_VISIT = 1.4e-3
# A visit whose parameters are all persistent fetches and releases nothing: only the hook
# bookkeeping (trace, prefetch queue) is left. Not measured yet; an assumption (a seventh of
# a fetching visit) that bench/speed_bench.py's per-config step times are there to refine.
ZERO3_SECONDS_PER_IDLE_VISIT = 0.1e-3
# Each flush of the gradient reduce bucket (stage3.py __reduce_and_partition_ipg_grads: a
# stream wait, the reduce, per-parameter partition copies) costs fixed work whatever its
# size. On the H200 every 1.5B config paid ~0.6 s per micro batch with params on the GPU or
# not, with ~360 flushes per micro batch at HF's hidden^2 bucket (bench/results/speed.json):
# the flushes are the suspect. The per-flush seconds are not isolated yet: 0.2 ms is an
# assumed floor that only ranks bucket sizes; speed_bench's reduce_bucket lever (the plan's
# bucket vs hidden^2) measures it on the GPU.
ZERO_SECONDS_PER_REDUCE_FLUSH = 0.2e-3


@dataclass(frozen=True)
class Hardware:
    accelerator: str                 # "cuda" or "cpu" (DeepSpeed's CPU accelerator)
    device_name: str
    gpu_count: int                   # GPUs on this node (0: none, or unknown for a planned-as-given GPU)
    gpu_total_bytes: int             # per GPU, probed (0 on a CPU machine)
    gpu_budget_bytes: int            # what one rank may use: --gpu-mem, or probed free memory
    host_total_bytes: int
    host_budget_bytes: int           # --host-mem, or probed available RAM
    pinned_limit_bytes: int | None   # ulimit -l; None = unlimited
    cpu_cores: int
    disk_path: str                   # where checkpoints go (the run directory)
    disk_free_bytes: int
    nvme_path: str | None
    nvme_free_bytes: int | None
    overridden: tuple[str, ...] = ()
    nvme_read_bytes_per_s: float | None = None    # measured by the aio sweep (zerofit.nvme cache)
    nvme_write_bytes_per_s: float | None = None

    @property
    def on_gpu(self) -> bool:
        return self.accelerator == "cuda"

    def to_json(self) -> dict:
        return asdict(self)


def probe(disk_path: str | Path = ".", nvme_path: str | None = None, gpu_mem: str | None = None,
          host_mem: str | None = None, accelerator: str | None = None) -> Hardware:
    """The machine as it is now, with overrides applied. accelerator: "cuda"/"cpu" to plan
    for one regardless of what is here (a --gpu-mem given on a CPU machine means cuda)."""
    import psutil

    gpu = _probe_gpu() if gpu_mem is None else None  # a given budget needs no CUDA context here
    vm = psutil.virtual_memory()
    overridden = []
    if accelerator is None:
        accelerator = "cuda" if gpu or gpu_mem else "cpu"
    name, count, total, free = gpu or ("(as given)" if accelerator == "cuda" else "cpu", _gpu_count(), 0, 0)
    gpu_budget = free
    if gpu_mem is not None:
        gpu_budget = parse_bytes(gpu_mem, "gpu_mem")
        overridden.append("gpu_mem")
    host_budget = vm.available
    if host_mem is not None:
        host_budget = parse_bytes(host_mem, "host_mem")
        overridden.append("host_mem")
    if accelerator == "cpu":
        name, count, total, gpu_budget = "cpu", 0, 0, 0
    disk = _existing_parent(Path(disk_path))
    measured = _nvme_rates(nvme_path)
    return Hardware(
        accelerator=accelerator, device_name=name, gpu_count=count,
        gpu_total_bytes=total, gpu_budget_bytes=gpu_budget,
        host_total_bytes=vm.total, host_budget_bytes=host_budget,
        pinned_limit_bytes=_memlock_limit(), cpu_cores=_cpu_cores(),
        disk_path=str(disk), disk_free_bytes=shutil.disk_usage(disk).free,
        nvme_path=nvme_path,
        nvme_free_bytes=shutil.disk_usage(_existing_parent(Path(nvme_path))).free if nvme_path else None,
        overridden=tuple(overridden), nvme_read_bytes_per_s=measured.get("read_bytes_per_s"),
        nvme_write_bytes_per_s=measured.get("write_bytes_per_s"))


def with_overrides(hw: Hardware, **changes) -> Hardware:
    return replace(hw, **changes)


def _probe_gpu() -> tuple[str, int, int, int] | None:
    """(name, count, total bytes, free bytes) of the current CUDA device, None without one."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available() or os.environ.get("DS_ACCELERATOR") == "cpu":
        return None
    device = torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(device)
    return torch.cuda.get_device_name(device), torch.cuda.device_count(), total, free


def _gpu_count() -> int:
    """GPUs visible here, without creating a CUDA context."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _nvme_rates(nvme_path: str | None) -> dict:
    """What `zerofit doctor --system --nvme-path` measured there with DeepSpeed's aio (cached)."""
    if not nvme_path:
        return {}
    from zerofit import aiotune

    return aiotune.read_tuning(nvme_path) or {}


def _memlock_limit() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def _cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
