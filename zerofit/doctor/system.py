"""`zerofit doctor --system`: is this machine ready for ZeRO-3 with offload? Each check is
pass / warn / fail with the fix: GPU, driver and CUDA, host RAM, the pinned-memory
limit, libaio and DeepSpeed's async_io op, op build locks left by a killed build
(opbuild.py); with an NVMe path, its direct-I/O bandwidth and a short sweep of DeepSpeed's
aio settings there, cached for the runs that use it."""
from __future__ import annotations

import ctypes.util
import mmap
import os
import resource
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from zerofit.core import cgroup
from zerofit.core.timeline import gib
from zerofit.machine import hardware, opbuild
from zerofit.nvme import aiotune
from zerofit.nvme import preflight as nvme

SWEEP_MIB, SWEEP_SECONDS = 64, 10.0  # the aio sweep: file size, time budget (a few seconds on a fast disk)
GOOD_NVME_GBPS = 1.0  # below this, NVMe offload makes each step I/O-bound (ZeRO-Infinity, Rajbhandari et al. 2021)
NVME_ENABLE_FIX = ("to enable NVMe offload: {fix}; DeepSpeed's async_io op then builds on the first NVMe run "
                   "(`zerofit doctor --system --nvme-path DIR` builds it now and measures the disk)")


@dataclass(frozen=True)
class Check:
    name: str
    status: str      # pass | warn | fail
    detail: str
    fix: str = ""


def check_system(nvme_path: str | None = None, nvme_mib: int = 256) -> list[Check]:
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if _cuda() else "cpu")  # before any deepspeed import, as train
    nvme_wanted = bool(nvme_path)  # NVMe offload asked for: without libaio it cannot run
    libaio = nvme.libaio_problem()
    checks = [check_gpu(), check_driver(), check_host_ram(), check_cpu_cores(), check_memlock(),
              check_libaio(libaio, nvme_wanted), check_async_io(libaio, nvme_wanted), check_op_build_locks()]
    if nvme_path:
        checks += check_direct_io(Path(nvme_path), nvme_mib)
        if all(c.status != "fail" for c in checks):
            checks.append(check_aio_sweep(Path(nvme_path), min(nvme_mib, SWEEP_MIB)))
    return checks


def check_gpu() -> Check:
    import torch

    if not torch.cuda.is_available():
        return Check("GPU", "warn", "no CUDA device visible: training runs on DeepSpeed's CPU accelerator (slow)",
                     "install the torch build for your CUDA version and check CUDA_VISIBLE_DEVICES / nvidia-smi")
    names = [f"{torch.cuda.get_device_name(i)} {gib(torch.cuda.get_device_properties(i).total_memory)}"
             for i in range(torch.cuda.device_count())]
    return Check("GPU", "pass", f"{len(names)} device(s): {', '.join(names)}")


def check_driver() -> Check:
    import torch

    cuda = torch.version.cuda
    if not cuda:
        return Check("driver / CUDA", "warn", f"torch {torch.__version__} is a CPU build",
                     "on a GPU machine install torch built for its CUDA (pip install torch --index-url "
                     "https://download.pytorch.org/whl/cuXXX)")
    driver = "unknown"
    if shutil.which("nvidia-smi"):
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
        driver = done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else driver
    if not torch.cuda.is_available():
        return Check("driver / CUDA", "fail", f"torch built for CUDA {cuda}, driver {driver}, but CUDA is unusable",
                     "the driver is older than this CUDA needs: update the NVIDIA driver or install a torch "
                     "built for an older CUDA")
    return Check("driver / CUDA", "pass", f"driver {driver}, torch {torch.__version__} built for CUDA {cuda}")


def check_host_ram() -> Check:
    memory = cgroup.host_memory()
    detail = f"{gib(memory.total)} total, {gib(memory.available)} available" + (f" ({memory.limit})" if memory.limit else "")
    if memory.available < 0.25 * memory.total:
        return Check("host RAM", "warn", detail + " (other processes hold most of it)",
                     "CPU offload keeps ~12 bytes per parameter in RAM: stop other jobs or offload to NVMe")
    return Check("host RAM", "pass", detail)


def check_cpu_cores(enough: int = 4) -> Check:
    """The cores CPU-Adam and the tokenizing workers get: the affinity, within a cgroup quota.
    Under `enough` an offloaded optimizer step is bound by them (detectors.starved_cpu_optimizer)."""
    cores, machine = hardware.cpu_cores(), os.cpu_count() or 1
    quota = cgroup.cpu_quota(cgroup.group_dirs("cpu"))
    detail = f"{cores} for this process of {machine} on the machine" + (
        f" (cgroup CPU quota {quota:g})" if quota is not None and quota < machine else "")
    if cores < enough:
        return Check("CPU cores", "warn", detail, "an offloaded optimizer steps on the CPU (CPU-Adam): give the job "
                     "more cores (docker --cpus, a pod's limits.cpu, Slurm --cpus-per-task, taskset)")
    return Check("CPU cores", "pass", detail)


def check_memlock() -> Check:
    """Pinned (page-locked) memory: cudaHostAlloc is not limited by RLIMIT_MEMLOCK, but
    mlock is, and DeepSpeed's async I/O buffers and its native pin backend mlock."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return Check("pinned-memory limit (ulimit -l)", "pass", "unlimited")
    if hardware.has_ipc_lock():
        return Check("pinned-memory limit (ulimit -l)", "pass", f"{soft // 1024} KiB, but this process has "
                     f"CAP_IPC_LOCK: mlock is not limited by it")
    fix = ("raise it: `ulimit -l unlimited` in the launching shell, `* - memlock unlimited` in "
           "/etc/security/limits.conf, or `docker run --ulimit memlock=-1`")
    if soft < 2**30:
        return Check("pinned-memory limit (ulimit -l)", "warn", f"{soft // 1024} KiB: NVMe offload's mlock'ed "
                     f"I/O buffers (aio block size x queue depth x buffers) will fail", fix)
    return Check("pinned-memory limit (ulimit -l)", "pass", f"{gib(soft)}")


def check_libaio(problem: str | None, nvme_wanted: bool) -> Check:
    """libaio's header and library, which DeepSpeed's JIT build of async_io needs; `problem` is
    nvme.libaio_problem()'s answer. Only NVMe offload needs them: a fail when NVMe is asked
    for (--nvme-path), else a warn that says NVMe offload is unavailable and how to enable it."""
    if not problem:
        return Check("libaio", "pass", ctypes.util.find_library("aio") or "libaio.h and libaio.so found")
    what, fix = _what_and_fix(problem)
    if nvme_wanted:
        return Check("libaio", "fail", what + ": NVMe offload fails", fix)
    return Check("libaio", "warn", what + ": NVMe offload (zero.offload_optimizer / zero.offload_param: nvme) is "
                 "unavailable; CPU offload does not need it", NVME_ENABLE_FIX.format(fix=fix))


def check_async_io(libaio: str | None, nvme_wanted: bool) -> Check:
    """Builds (or loads the cached build of) DeepSpeed's async_io op, as a run with NVMe
    offload would: a first build takes about a minute. Without libaio (`libaio`: its problem)
    nothing is built; a fail only when NVMe offload is asked for, as check_libaio."""
    if libaio:
        if nvme_wanted:
            return Check("DeepSpeed async_io", "fail", *_what_and_fix(libaio))
        return Check("DeepSpeed async_io", "warn", "not built: it needs libaio (above)", "")
    changed = nvme.fix_arch_list() if _cuda() else None
    with opbuild.ops_unblocked(("async_io",)):  # a first build is minutes of silence on a few cores: said
        problem = nvme.async_io_problem(on_gpu=False)
    if problem:
        what, fix = _what_and_fix(problem)
        if nvme_wanted:
            return Check("DeepSpeed async_io", "fail", what, fix)
        return Check("DeepSpeed async_io", "warn", what + ": NVMe offload is unavailable", fix)
    note = f" (TORCH_CUDA_ARCH_LIST set to {changed} for the build: DeepSpeed parses only major.minor)" if changed else ""
    return Check("DeepSpeed async_io", "pass", f"built and loaded: NVMe offload available{note}")


def _what_and_fix(problem: str) -> tuple[str, str]:
    """zerofit.nvme.preflight's problems read "WHAT. Fix: HOW" (HOW empty when there is none)."""
    what, _, fix = problem.partition(". Fix: ")
    return what, fix


def check_aio_sweep(path: Path, mib: int) -> Check:
    """A short sweep of aio settings with DeepSpeed's own handle (aiotune.sweep), cached for
    the runs that use this path."""
    name = f"NVMe path {path} aio tuning"
    locked = nvme.memlock_problem(mib << 20)
    if locked:
        return Check(name, "warn", "sweep skipped: " + locked.split(":")[0], locked.split(": ", 1)[1])
    try:
        result = aiotune.sweep(path, file_mib=mib, budget_s=SWEEP_SECONDS)
    except OSError as e:
        return Check(name, "fail", f"DeepSpeed's aio failed there: {e}",
                     "use a local ext4/xfs NVMe drive for zero.nvme_path")
    aio = result["aio"]
    detail = (f"block {aio['block_size'] // 1024} KiB, queue depth {aio['queue_depth']}, {aio['intra_op_parallelism']} "
              f"thread(s): read {result['read_bytes_per_s'] / 1e9:.2f} GB/s, write "
              f"{result['write_bytes_per_s'] / 1e9:.2f} GB/s ({len(result['tried'])} settings in {result['seconds']} s; "
              f"direct-I/O block {result['dio_alignment']} B); cached in {aiotune.cache_path(path)} for later runs")
    slow = min(result["read_bytes_per_s"], result["write_bytes_per_s"]) / 1e9 < GOOD_NVME_GBPS
    return Check(name, "warn" if slow else "pass", detail,
                 f"below {GOOD_NVME_GBPS} GB/s each step waits on the disk: a local NVMe drive, or several in RAID 0"
                 if slow else "")


def check_op_build_locks() -> Check:
    locks = opbuild.build_locks()
    stale = [lock for lock in locks if lock.stale]
    if stale:
        return Check("DeepSpeed op builds", "warn", "; ".join(lock.describe() for lock in stale)
                     + ": DeepSpeed would wait on it forever", "zerofit train removes it; elsewhere `rm` it")
    if locks:
        return Check("DeepSpeed op builds", "pass", "; ".join(lock.describe() for lock in locks))
    return Check("DeepSpeed op builds", "pass", f"no build lock under {opbuild.build_root()}")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def check_direct_io(path: Path, mib: int) -> list[Check]:
    """Sequential O_DIRECT write (with fsync) and read of `mib` MiB in 8 MiB blocks: what
    DeepSpeed's async I/O sees, the page cache bypassed."""
    name = f"NVMe path {path} direct I/O"
    try:
        nvme.make_swap_dir(path)
    except OSError as e:
        return [Check(name, "fail", f"cannot create it: {e.strerror}", "a writable directory on a local NVMe drive")]
    free = shutil.disk_usage(path).free
    file = path / f".zerofit-dio-{os.getpid()}"
    block = 8 * 2**20
    blocks = max(1, mib * 2**20 // block)
    buffer = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT requires
    buffer.write(os.urandom(2**20) * (block // 2**20))
    try:
        fd = os.open(file, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError as e:
        return [Check(name, "fail", f"cannot open with O_DIRECT: {e.strerror}",
                      "use a directory on a local ext4/xfs NVMe drive (tmpfs and some overlay or network "
                      "filesystems do not support direct I/O)")]
    try:
        started = time.perf_counter()
        for _ in range(blocks):
            os.write(fd, buffer)
        os.fsync(fd)
        write_gbps = blocks * block / (time.perf_counter() - started) / 1e9
        os.close(fd)
        fd = -1  # closed: a failed reopen must not close it again (or a file that took its number)
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        started = time.perf_counter()
        for _ in range(blocks):
            os.readv(fd, [buffer])
        read_gbps = blocks * block / (time.perf_counter() - started) / 1e9
    except OSError as e:
        return [Check(name, "fail", f"direct I/O failed: {e.strerror}",
                      "use a local ext4/xfs NVMe drive for zero.nvme_path")]
    finally:
        if fd >= 0:
            os.close(fd)
        file.unlink(missing_ok=True)
    fix = (f"below {GOOD_NVME_GBPS} GB/s NVMe offload makes each step wait on the disk: use a local NVMe drive, "
           f"or several in RAID 0")
    detail = f"{{:.2f}} GB/s over {blocks * block // 2**20} MiB; {gib(free)} free on {nvme.mount_point(path)}"
    checks = [Check(f"{name} write", "pass" if write_gbps >= GOOD_NVME_GBPS else "warn", detail.format(write_gbps),
                    "" if write_gbps >= GOOD_NVME_GBPS else fix),
              Check(f"{name} read", "pass" if read_gbps >= GOOD_NVME_GBPS else "warn", detail.format(read_gbps),
                    "" if read_gbps >= GOOD_NVME_GBPS else fix)]
    kind = nvme.ram_filesystem(path)
    if kind:  # fast because it is RAM: the numbers above say nothing about a disk
        checks.append(Check(f"NVMe path {path} filesystem", "warn", f"{kind}: held in host RAM",
                            nvme.RAM_BACKED_FIX))
    return checks


def print_checks(checks: list[Check], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(highlight=False)
    table = Table(title="zerofit doctor --system", title_justify="left", show_lines=True)
    for column in ("check", "status", "detail", "fix"):
        table.add_column(column, overflow="fold")
    colour = {"pass": "green", "warn": "yellow", "fail": "red"}
    for c in checks:
        table.add_row(c.name, f"[{colour[c.status]}]{c.status}[/]", c.detail, c.fix)
    console.print(table)
