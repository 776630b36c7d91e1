"""zerofit/machine/hostalloc.py: inside heap_temporaries a large host temporary freed and allocated
again comes back without page faults; with glibc's default each one is a fresh mmap.
Each case runs in a fresh interpreter: malloc's state (heap size, thresholds) is per process
and outlives the context manager on purpose."""
import json
import subprocess
import sys

import pytest
from conftest import ROOT

from zerofit.machine import hostalloc
from zerofit.plan import estimate

SIZE = 256 << 20  # above glibc's largest mmap threshold (32 MiB): always mmapped by default

# Twenty-four "steps", each allocating, filling and freeing one temporary: the minor page
# faults of each, and the resident bytes at the end. On the heap the first steps still grow
# it (small allocations land in a freed temporary's space, which then no longer fits the next
# one), until it holds enough holes: how many steps that takes varies from run to run (a CI
# simulation saw one more growth within steps 10-12), the bound on them is what the planner
# counts (planner.HEAP_TEMPORARIES_HELD).
STEPS = 24
MEASURE = """
import json, resource, sys, torch
from zerofit.machine import hostalloc
SIZE, STEPS = int(sys.argv[1]), int(sys.argv[3])
def step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(SIZE, dtype=torch.uint8).fill_(1)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
with hostalloc.heap_temporaries(enabled=sys.argv[2] == "heap"):
    faults = [step() for _ in range(STEPS)]
print(json.dumps([faults, int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()]))
"""


def faults(mode: str) -> tuple[list[int], int]:
    """(minor page faults of each step's temporary, resident bytes at the end)."""
    out = subprocess.run([sys.executable, "-c", MEASURE, str(SIZE), mode, str(STEPS)], cwd=ROOT, check=True,
                         capture_output=True, text=True)
    return tuple(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.e2e
@pytest.mark.skipif(not hostalloc.available(), reason="mallopt is glibc's")
def test_heap_temporaries_are_reused_without_page_faults():
    (fresh, rss_fresh), (reused, rss_heap) = faults("default"), faults("heap")
    least = SIZE // (2 << 20)  # a temporary's pages: 65,536 of 4 KiB (fewer where huge pages back them)
    assert all(f >= least for f in fresh)  # glibc's default: every temporary a fresh mapping
    growths = [f for f in reused if f >= least]
    assert len(growths) <= estimate.HEAP_TEMPORARIES_HELD, reused
    assert sum(f < 16 for f in reused) >= STEPS - estimate.HEAP_TEMPORARIES_HELD, reused  # the rest come back
    # what the heap holds for it is bounded, and the planner counts as much; the two processes'
    # other resident bytes differ by a few pages (a CI simulation: 9 temporaries and 72 KiB)
    noise = 16 << 20
    assert SIZE <= rss_heap - rss_fresh <= estimate.HEAP_TEMPORARIES_HELD * SIZE + noise
