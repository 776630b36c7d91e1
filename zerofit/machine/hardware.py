"""What the machine has: GPU memory per rank, host RAM, the pinned-memory limit, free disk.

Every figure is probed and every figure can be overridden (`--gpu-mem 24GiB`,
`plan.gpu_mem`), so a plan for a 24 GiB card can be made on any machine. On a machine
without a GPU the "device" is the CPU (DeepSpeed's CPU accelerator): everything lives in
host RAM and the plan is made against it.

The rates the step-time model uses are named constants here, each with its source.
"""
from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from zerofit.core import cgroup
from zerofit.core.errors import ConfigError
from zerofit.core.timeline import human_bytes, parse_bytes
from zerofit.machine import hostalloc

GIB = 2**30

# ------------------------------------------------------------------------- rates
# Calibrated on the benchmark GPU host (bench/results/README.md). They calibrate the cost
# model; the choice only needs them to rank candidates.
BF16_MATMUL_FLOPS = 810e12          # bf16 8192^3 matmul peak
PCIE_BYTES_PER_S = 55e9             # pinned host<->device, each way
# The offloaded step's copy of the updated parameters to 16-bit ones on the GPU: converted on
# the host into a temporary, then a pageable (unpinned) copy: the step's time left beyond the
# other terms, with zerofit's heap temporaries and with a fresh mmap per sub-group.
COPY_BACK_BYTES_PER_S = {True: 10.1e9, False: 4.3e9}  # by train.heap_step_temporaries
# The other way, with a partial optimizer offload and the parameters offloaded: the sub-groups
# stepped on the GPU copy their fp32 masters into the host's 16-bit parameters, and torch moves
# the fp32 to a pageable host temporary first (the conversion runs on the CPU), a blocking
# cudaMemcpy. Fp32 bytes/s beyond the rest of the cost model, over three partial-offload steps.
COPY_OUT_BYTES_PER_S = 1.1e9
CPU_ADAM_SECONDS_PER_PARAM = 0.23 / 1e9   # DeepSpeedCPUAdam, per parameter per step ...
CPU_ADAM_CORES = 16                        # ... on this many cores; with more or fewer, x (16 / cores)^0.5:
# Adam streams ~16 bytes per parameter, so memory bandwidth, not cores, runs out: twice the
# cores is far from twice the speed (rates.cpu_adam_seconds_per_param).
CPU_ADAM_CORE_EXPONENT = 0.5
DISK_WRITE_BYTES_PER_S = 1.5e9      # sequential write with fsync (/tmp)
DISK_READ_BYTES_PER_S = 2.2e9       # sequential read
# From vendor data sheets (HBM3e 4.8 TB/s, NVLink 900 GB/s bidirectional), discounted to what
# streaming kernels and NCCL reach in practice.
GPU_MEMORY_BYTES_PER_S = 0.7 * 4.8e12
NVLINK_BYTES_PER_S = 0.5 * 450e9


@dataclass(frozen=True)
class StepRates:
    """The cost model's fitted constants (steptime.step_time_terms, steptime.step_seconds).

    Fitted together by `python bench/cost_fit.py --fit` to every step measured on the GPU
    hosts (models of 0.5B to 8B, CPU, partial and NVMe offload, the stock config and zerofit's
    choices); the fit's error and its leave-one-out error are in bench/results/README.md. Each
    is what its mechanism costs on those hosts, not a measurement of it alone: a new kind of
    step can miss by more."""
    # Model FLOPs utilisation of the forward/backward (6N + recompute per token over the
    # matmul peak), as fitted across all steps.
    model_flops_utilisation: float = 0.5
    # ZeRO-3 hook work per visit of a module that fetches and releases parameters (the Python
    # thread: fetch, wait, release), and per visit of one whose parameters are all persistent
    # (the hooks, ZeRO-3's autograd wrappers and the launches around the module, with nothing
    # to fetch): the CPU time of a step whose every parameter is persistent over its visits.
    # The fit keeps a fetching visit no cheaper than an idle one (it does all the idle one does);
    # the two are close.
    seconds_per_fetching_visit: float = 1.0e-3
    seconds_per_idle_visit: float = 0.8e-3
    # Each flush of the gradient reduce bucket (stage3.py __reduce_and_partition_ipg_grads: a
    # stream wait, the reduce, per-parameter partition copies), whatever its size.
    seconds_per_reduce_flush: float = 0.1e-3
    # The accumulation boundary's fp32 gradients of the host-stepped elements (4 bytes each:
    # stage3.py partition_grads at the boundary, its copy into the optimizer's fp32 gradient
    # buffer with the norm and overflow check over it), bytes/s. A third of pinned PCIe: the
    # copy is the host's, not the link's. Without this term, a one-micro-batch step and a step
    # of 64 cost the same per micro batch, which the 3.6B runs contradict.
    boundary_grad_bytes_per_s: float = 20e9


STEP_RATES = StepRates()


@dataclass(frozen=True)
class Hardware:
    accelerator: str                 # "cuda" or "cpu" (DeepSpeed's CPU accelerator)
    device_name: str
    gpu_count: int                   # GPUs on this node (0: none, or unknown for a planned-as-given GPU)
    gpu_total_bytes: int             # per GPU, probed (0 on a CPU machine)
    gpu_budget_bytes: int            # what one rank may use: --gpu-mem, or probed free memory
    host_total_bytes: int
    host_budget_bytes: int           # --host-mem, or probed available RAM (the cgroup's where tighter)
    pinned_limit_bytes: int | None   # ulimit -l; None = unlimited
    cpu_cores: int
    disk_path: str                   # where checkpoints go (the run directory)
    disk_free_bytes: int
    nvme_path: str | None
    nvme_free_bytes: int | None
    overridden: tuple[str, ...] = ()
    nvme_shares_disk: bool = False   # nvme_path on disk_path's filesystem: one free space for both
    nvme_read_bytes_per_s: float | None = None    # measured by the aio sweep (zerofit.nvme.preflight cache)
    nvme_write_bytes_per_s: float | None = None
    glibc_heap: bool = True          # glibc's mallopt is there: train.heap_step_temporaries can work (hostalloc)
    host_limit: str | None = None    # what capped host RAM below the machine's: a cgroup memory limit

    @property
    def on_gpu(self) -> bool:
        return self.accelerator == "cuda"

    def to_json(self) -> dict:
        return asdict(self)


def probe(disk_path: str | Path = ".", nvme_path: str | None = None, gpu_mem: str | None = None,
          host_mem: str | None = None, accelerator: str | None = None) -> Hardware:
    """The machine as it is now, with overrides applied. accelerator: "cuda"/"cpu" to plan
    for one regardless of what is here (a --gpu-mem given on a CPU machine means cuda)."""
    gpu = _probe_gpu() if gpu_mem is None else None  # a given budget needs no CUDA context here
    host = cgroup.host_memory()
    overridden = []
    if accelerator is None:
        accelerator = "cuda" if gpu or gpu_mem else "cpu"
    if accelerator == "cuda" and gpu is None and gpu_mem is None:
        raise ConfigError("planning for CUDA on a machine without a GPU needs the GPU's memory: give --gpu-mem "
                          "(plan.gpu_mem), e.g. 24GiB")
    name, count, total, free = gpu or ("a GPU (budget given)" if accelerator == "cuda" else "cpu", _gpu_count(), 0, 0)
    gpu_budget = free
    if gpu_mem is not None:
        gpu_budget = parse_bytes(gpu_mem, "gpu_mem")
        overridden.append("gpu_mem")
    host_budget = host.available
    if host_mem is not None:
        host_budget = parse_bytes(host_mem, "host_mem")
        overridden.append("host_mem")
    if accelerator == "cpu":
        name, count, total, gpu_budget = "cpu", 0, 0, 0
    disk = _existing_parent(Path(disk_path))
    nvme_dir = _existing_parent(Path(nvme_path)) if nvme_path else None
    measured = _nvme_rates(nvme_path)
    return Hardware(
        accelerator=accelerator, device_name=name, gpu_count=count,
        gpu_total_bytes=total, gpu_budget_bytes=gpu_budget,
        host_total_bytes=host.total, host_budget_bytes=host_budget, host_limit=host.limit,
        pinned_limit_bytes=memlock_limit(), cpu_cores=cpu_cores(),
        disk_path=str(disk), disk_free_bytes=shutil.disk_usage(disk).free,
        nvme_path=nvme_path,
        nvme_free_bytes=shutil.disk_usage(nvme_dir).free if nvme_dir else None,
        nvme_shares_disk=bool(nvme_dir) and os.stat(nvme_dir).st_dev == os.stat(disk).st_dev,
        overridden=tuple(overridden), nvme_read_bytes_per_s=measured.get("read_bytes_per_s"),
        nvme_write_bytes_per_s=measured.get("write_bytes_per_s"), glibc_heap=hostalloc.available())


def host_mem_beyond_reach(hw: Hardware) -> str | None:
    """plan.host_mem above what this machine lets the run take (its RAM, or its cgroup's limit):
    the plan counts on memory the kernel will not give, and kills the run at the lower figure."""
    if "host_mem" not in hw.overridden or hw.host_budget_bytes <= hw.host_total_bytes:
        return None
    reach = hw.host_limit or f"{human_bytes(hw.host_total_bytes)} of RAM"
    return (f"plan.host_mem {human_bytes(hw.host_budget_bytes)} is more than this machine lets the run take "
            f"({reach}): the plan counts on memory the kernel will not give, and its OOM killer ends the run "
            f"there; leave plan.host_mem unset to plan against what is here")


def with_overrides(hw: Hardware, **changes) -> Hardware:
    return replace(hw, **changes)


def ranks_on_this_node(hw: Hardware, world_size: int) -> int:
    """Ranks sharing this host's RAM and cores: one per GPU here; all of them on the CPU
    accelerator or when the GPU count is unknown (planned from elsewhere)."""
    return min(world_size, hw.gpu_count) if hw.on_gpu and hw.gpu_count else world_size


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
    return read_tuning(nvme_path) or {}


def memlock_limit() -> int | None:
    """What this process may lock; None when unbounded: no limit, or CAP_IPC_LOCK, which lets
    mlock go past RLIMIT_MEMLOCK (root in most containers)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY or has_ipc_lock() else soft


CAP_IPC_LOCK = 14  # linux/capability.h: mlock beyond RLIMIT_MEMLOCK


def has_ipc_lock() -> bool:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
    except OSError:
        pass
    return False


def cpu_cores() -> int:
    """The cores this process may run on: its affinity (taskset, cgroup cpusets), else all,
    no more than its cgroup's CPU quota (docker --cpus, a Kubernetes CPU limit)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return min(cores, cgroup.cpu_limit() or cores)


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


CACHE_VERSION = 1


CACHE_VARIABLE = "ZEROFIT_CACHE_DIR"


def cache_root() -> Path:
    """zerofit's cache of machine measurements. ZEROFIT_CACHE_DIR moves only zerofit's cache
    (XDG_CACHE_HOME also moves torch's extension builds, so DeepSpeed would rebuild its ops there)."""
    return Path(os.environ.get(CACHE_VARIABLE) or
                Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "zerofit")


def cache_path(nvme_path: str | Path) -> Path:
    key = hashlib.sha256(str(Path(nvme_path).resolve()).encode()).hexdigest()[:16]
    return cache_root() / f"aio-{key}.json"


def read_tuning(nvme_path: str | Path) -> dict | None:
    """The cached sweep of this path, or None (never measured, or unreadable)."""
    try:
        cached = json.loads(cache_path(nvme_path).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if cached.get("version") != CACHE_VERSION or cached.get("path") != str(Path(nvme_path).resolve()):
        return None
    return cached
