"""Host temporaries of the optimizer step kept on glibc's heap, reused step after step.

With the optimizer offloaded and the 16-bit parameters on the GPU, DeepSpeed copies each
updated fp32 sub-group back with a blocking `fp16_flat.copy_(fp32_flat)`
(stage3._reassign_or_swap_out_partitioned_parameters). torch converts the dtype on the host
first (ATen/native/cuda/Copy.cu, copy_requires_temporaries: blocking copies convert on the
CPU), into a fresh tensor of the sub-group's size. glibc serves every allocation above 32 MiB
(its mmap threshold can go no higher) with a new mmap, so each step page-faults and zeroes
2 bytes per parameter again: fresh mmaps make the conversion several times slower than
reused memory, and the copy-back can be half of an offloaded step (bench/results/README.md).

During the optimizer step zerofit turns glibc's mmap off (mallopt M_MMAP_MAX=0), so the
temporaries come from the heap, and raises the heap's trim threshold, so a freed temporary
stays there for the next sub-group and the next step. The price is resident host memory:
freed temporaries stay on the heap, fragmented by small allocations made while each was
live (a request of the same size no longer fits the hole), until enough holes exist: about
eight 256 MiB temporaries' worth in a 30-step loop on the CI machine. The
planner counts that bound (planner.HEAP_TEMPORARIES_HELD) in every phase, and
tests/test_hostalloc.py checks it; train.heap_step_temporaries is off by default.
mallopt is glibc's; elsewhere this does nothing.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import platform

# glibc malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
DEFAULT_MMAP_MAX = 65536
# free heap above this is kept (mallopt takes an int): the largest step temporary of an 8B
# model is 1 GiB (its embedding, 2 bytes per element)
TRIM_THRESHOLD_BYTES = 2**31 - 1


@functools.cache
def _glibc():
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def available() -> bool:
    return _glibc() is not None


@contextlib.contextmanager
def heap_temporaries(enabled: bool = True):
    """Allocations inside come from the heap and stay there when freed."""
    libc = _glibc() if enabled else None
    if libc is None:
        yield
        return
    libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)  # setting it also ends glibc's dynamic thresholds
    libc.mallopt(M_MMAP_MAX, 0)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)


def return_freed_heap() -> None:
    """Give the heap's free memory back to the system (malloc_trim): tokenizing leaves the Python
    lists of every example freed on it, which glibc keeps (112 of 244 MiB of resident growth
    for 100k alpaca rows on the CI machine), resident for the whole run beside the packed arrays
    the planner counts. Python's own collection first, so that the lists are free."""
    import gc

    gc.collect()
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
