"""zerofit/hostalloc.py: inside heap_temporaries a large host temporary freed and allocated
again comes back without page faults; with glibc's default each one is a fresh mmap.
Each case runs in a fresh interpreter: malloc's state (heap size, thresholds) is per process
and outlives the context manager on purpose."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT
from zerofit import hostalloc, planner

SIZE = 256 << 20  # above glibc's largest mmap threshold (32 MiB): always mmapped by default

# Twelve "steps", each allocating, filling and freeing one temporary; the faults of the last
# three, and the resident bytes at the end. On the heap the first steps still grow it (small
# allocations land in a freed temporary's space, which then no longer fits the next one),
# until it holds enough holes (planner.HEAP_TEMPORARIES_HELD).
MEASURE = """
import json, resource, sys, torch
from zerofit import hostalloc
SIZE = int(sys.argv[1])
def step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(SIZE, dtype=torch.uint8).fill_(1)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
with hostalloc.heap_temporaries(enabled=sys.argv[2] == "heap"):
    faults = sum([step() for _ in range(12)][-3:])
print(json.dumps([faults, int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()]))
"""


def faults(mode: str) -> list[int]:
    """[minor page faults of the last three of twelve steps' temporaries, resident bytes]."""
    out = subprocess.run([sys.executable, "-c", MEASURE, str(SIZE), mode], cwd=ROOT, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not hostalloc.available(), reason="mallopt is glibc's")
def test_heap_temporaries_are_reused_without_page_faults():
    (fresh, rss_fresh), (reused, rss_heap) = faults("default"), faults("heap")
    assert fresh >= 3 * SIZE // (2 << 20)  # 65,536 pages of 4 KiB each (fewer where huge pages back them)
    assert reused < max(fresh // 20, 16)
    # what the heap holds for it is bounded, and the planner counts as much
    assert SIZE <= rss_heap - rss_fresh <= planner.HEAP_TEMPORARIES_HELD * SIZE
