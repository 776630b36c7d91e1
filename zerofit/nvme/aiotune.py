"""The NVMe path as DeepSpeed's async I/O sees it: its direct-I/O block, and the aio
settings that move data fastest there, found by a short sweep with DeepSpeed's own handle
(`AsyncIOBuilder().load().aio_handle`) and cached per path in
`~/.cache/zerofit/aio-<hash>.json` (ZEROFIT_CACHE_DIR, else XDG_CACHE_HOME/zerofit), which
later runs read.
"""
from __future__ import annotations

import errno
import itertools
import json
import mmap
import os
import time
from pathlib import Path

from zerofit.machine import opbuild
from zerofit.machine.hardware import CACHE_VARIABLE, CACHE_VERSION, cache_path, read_tuning  # noqa: F401 (the probe reads the cache too)

DIO_SIZES = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
# The sweep: block size x queue depth x I/O threads, single_submit off and overlap_events on
# (DeepSpeed's defaults; its own ds_nvme_tune sweeps the same axes). Ordered so that the
# defaults come first: a sweep cut short by its time budget still holds them.
SWEEP_BLOCKS = (1 << 20, 256 << 10, 4 << 20)
SWEEP_DEPTHS = (8, 32, 128)
SWEEP_THREADS = (1, 4)



def probe_dio_alignment(directory: Path) -> int:
    """The smallest O_DIRECT write (from a page-aligned buffer, at offset 0) the filesystem
    under `directory` accepts: its logical block size, which every piece DeepSpeed writes
    must be a multiple of. Raises OSError when the directory takes no direct I/O at all."""
    probe = directory / f".zerofit-dio-probe-{os.getpid()}"
    buffer = mmap.mmap(-1, max(DIO_SIZES))
    fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o600)
    try:
        for size in DIO_SIZES:
            try:
                if os.pwrite(fd, memoryview(buffer)[:size], 0) == size:
                    return size
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
        raise OSError(errno.EINVAL, f"no O_DIRECT write up to {max(DIO_SIZES)} bytes succeeded", str(directory))
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


def load_aio_op():
    """DeepSpeed's async_io op (built just in time on first use, then cached by torch)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.op_builder import AsyncIOBuilder

    with opbuild.ops_unblocked(("async_io",)):
        return AsyncIOBuilder().load(verbose=False)


def sweep(nvme_path: str | Path, file_mib: int = 64, budget_s: float = 10.0) -> dict:
    """Write then read a `file_mib` MiB file with every setting of the sweep through
    DeepSpeed's aio handle, until `budget_s` seconds are spent; cache and return the result:
    the fastest setting (least write + read time: a step writes and reads the swap files
    once each) with its bandwidths, every setting tried, and the direct-I/O block."""
    import torch

    directory = Path(nvme_path)
    directory.mkdir(parents=True, exist_ok=True)
    dio = probe_dio_alignment(directory)
    op = load_aio_op()
    nbytes = file_mib << 20
    target = directory / f".zerofit-aio-sweep-{os.getpid()}.swp"
    tried, started = [], time.perf_counter()
    handle = op.aio_handle(1 << 20, 8, False, True, 1)
    buffer = handle.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
    try:
        buffer.copy_(torch.randint(0, 255, (nbytes,), dtype=torch.uint8))
        for block, depth, threads in itertools.product(SWEEP_BLOCKS, SWEEP_DEPTHS, SWEEP_THREADS):
            if tried and time.perf_counter() - started > budget_s:
                break
            if block % dio or (nbytes // threads) % dio:
                continue
            tried.append(_measure(op, buffer, target, block, depth, threads))
    finally:
        handle.free_cpu_locked_tensor(buffer)
        target.unlink(missing_ok=True)
    best = min(tried, key=lambda t: nbytes / t["write_bytes_per_s"] + nbytes / t["read_bytes_per_s"])
    result = {"version": CACHE_VERSION, "path": str(directory.resolve()), "dio_alignment": dio,
              "file_bytes": nbytes, "measured_at": round(time.time()), "seconds": round(time.perf_counter() - started, 2),
              "aio": best["aio"], "read_bytes_per_s": best["read_bytes_per_s"],
              "write_bytes_per_s": best["write_bytes_per_s"], "tried": tried}
    path = cache_path(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)
    return result


def _measure(op, buffer, target: Path, block: int, depth: int, threads: int) -> dict:
    """One setting: a write (file created anew) and a read of the whole buffer, each
    checked for its length: DeepSpeed's handle does not report a failed piece."""
    handle = op.aio_handle(block, depth, False, True, threads)
    target.unlink(missing_ok=True)
    began = time.perf_counter()
    assert handle.async_pwrite(buffer, str(target), 0) == 0 and handle.wait() == 1
    write_s = time.perf_counter() - began
    if target.stat().st_size != buffer.numel():
        raise OSError(errno.EIO, f"aio wrote {target.stat().st_size} of {buffer.numel()} bytes", str(target))
    began = time.perf_counter()
    assert handle.async_pread(buffer, str(target), 0) == 0 and handle.wait() == 1
    read_s = time.perf_counter() - began
    aio = {"block_size": block, "queue_depth": depth, "intra_op_parallelism": threads,
           "single_submit": False, "overlap_events": True}
    return {"aio": aio, "write_bytes_per_s": round(buffer.numel() / write_s), "read_bytes_per_s": round(buffer.numel() / read_s)}
