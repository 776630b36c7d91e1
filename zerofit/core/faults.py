"""Fault injection for tests and drills: ZEROFIT_FAULT="kind@where:N[,kind@where:N...]".

Examples: `enospc@save:2` (the 2nd save's writes fail with ENOSPC), `oom@step:5`
(torch.OutOfMemoryError in the forward pass of step 5), `kill@save:1` (SIGKILL mid-save),
`residue@step:3` / `leak@step:2` (memory kept alive after step 3 / every step from 2).
ZEROFIT_FAULT_RANKS="1" (comma separated) limits every fault to those ranks: one bad rank;
`kind@where:N/R` limits one fault to rank R (`oom@step:5/1,stall@step:5/0`: two ranks, two faults).
Code that can fail asks `armed(kind, where, n)` at the matching moment; nothing is
injected unless the variable is set.

Checkpoint faults (n = the n-th save of this process, counted by `tick("save")`):
`enospc@save:N` and `kill@save:N` strike mid-write of a checkpoint file;
`kill@publish:N` after every file is written, before the manifest; `kill@rename:N`
after the manifest, before the rename; `kill@latest:N` after the publish, before
retention; `kill@retention:N` while deleting an old checkpoint; `nospace@save:N` makes the free-space check see a full disk;
`slow@save:N` makes the writer sleep 2 s (to catch a save in flight).

`stall@step:N` stops the rank at the start of step N for good, as a rank waiting in a collective
for a peer that died never comes back (SIGTERM's Python handler runs, the wait goes on).
`kill@step:N` SIGKILLs the rank at the start of step N, as the kernel's OOM killer ends one.

`nospace@nvme:1` makes the NVMe preflight see a full disk under zero.nvme_path;
`shortswap@step:N` cuts 4 KiB off the largest NVMe optimizer swap file after step N: what a
write DeepSpeed's async I/O failed without noticing (disk full, I/O error) leaves behind.
"""
from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

VARIABLE = "ZEROFIT_FAULT"
RANKS_VARIABLE = "ZEROFIT_FAULT_RANKS"  # e.g. "1": only those ranks (torchrun's RANK) are struck


@dataclass(frozen=True)
class Fault:
    kind: str
    where: str
    n: int
    rank: int | None = None  # kind@where:N/R: only rank R

    def __str__(self) -> str:
        return f"{self.kind}@{self.where}:{self.n}" + ("" if self.rank is None else f"/{self.rank}")


def parse(text: str) -> list[Fault]:
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, at, rest = item.partition("@")
        where, colon, count_and_rank = rest.partition(":")
        number, slash, rank = count_and_rank.partition("/")
        if not (at and colon and kind and where and number.isdigit()) or (slash and not rank.isdigit()):
            raise ValueError(f"{VARIABLE}={text!r}: expected kind@where:N or kind@where:N/RANK, e.g. enospc@save:2")
        faults.append(Fault(kind, where, int(number), int(rank) if slash else None))
    return faults


def armed(kind: str, where: str, n: int) -> bool:
    """True when ZEROFIT_FAULT asks for `kind` at the n-th `where` (1-based) of this rank."""
    return Fault(kind, where, n) in here()


def here() -> list[Fault]:
    """The faults ZEROFIT_FAULT sets for this rank, their rank dropped."""
    text = os.environ.get(VARIABLE, "")
    if not text or not this_rank_struck():
        return []
    rank = int(os.environ.get("RANK", "0"))
    return [Fault(f.kind, f.where, f.n) for f in parse(text) if f.rank in (None, rank)]


def this_rank_struck() -> bool:
    ranks = os.environ.get(RANKS_VARIABLE, "").strip()
    return not ranks or os.environ.get("RANK", "0") in {r.strip() for r in ranks.split(",")}


_counts: dict[str, int] = {}


def tick(where: str) -> int:
    """Count one more `where` event of this process (1-based) and return the count."""
    _counts[where] = _counts.get(where, 0) + 1
    return _counts[where]


def count(where: str) -> int:
    return _counts.get(where, 0)


def kill_if_armed(point: str, counter: str = "save") -> None:
    """SIGKILL this process when `kill@point:N` is set and N is the current `counter` count:
    the crash a kill -9 at exactly this point would be, without the timing luck."""
    if armed("kill", point, count(counter)):
        os.kill(os.getpid(), signal.SIGKILL)


def disarm(kind: str, where: str, n: int) -> None:
    """Remove one fault from ZEROFIT_FAULT in this process (and what it starts): an OOM
    retry runs with safer settings, under which the injected OOM stands for nothing."""
    text = os.environ.get(VARIABLE, "")
    if not text:
        return
    kept = [str(f) for f in parse(text) if (f.kind, f.where, f.n) != (kind, where, n)]
    if kept:
        os.environ[VARIABLE] = ",".join(kept)
    else:
        os.environ.pop(VARIABLE)


# Memory drills: real allocations, so the doctor's detectors can be checked on real runs.
# `residue@step:N` keeps 192 MiB alive after step N (put a save at N: post-save residue);
# `leak@step:N` keeps 48 MiB more at every step from N on (growth); `spike@step:N`
# touches 256 MiB and frees it after step N, a peak the next step's first phase records
# (put a save at N: the first-step-after-save spike).
RESIDUE_BYTES, LEAK_BYTES_PER_STEP, SPIKE_BYTES = 192 * 2**20, 48 * 2**20, 256 * 2**20
_held: list = []


MOMENTS = ("forward", "after_step", "after_save")


def strike(moment: str, step: int, device=None, swapper=None) -> None:
    """The training loop's one fault hook, called at the three moments the drills strike:
    "forward" (each micro batch of step `step`: oom, stall, kill), "after_step" (before the
    NVMe swap files are checked: shortswap) and "after_save" (residue, leak, spike). Nothing
    happens unless ZEROFIT_FAULT is set."""
    assert moment in MOMENTS, moment
    if not os.environ.get(VARIABLE):
        return
    if moment == "forward":
        _oom_if_armed(step)
        _stall_or_kill_if_armed(step)
    elif moment == "after_step":
        _shorten_swap_if_armed(step, swapper)
    else:
        _hold_memory_if_armed(step, device)


def _oom_if_armed(step: int) -> None:
    """oom@step:K: the forward pass of step K fails as a real CUDA OOM would, with PyTorch's own
    message format."""
    if armed("oom", "step", step):
        import torch  # a drill's cost: only when one is armed

        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.99 GiB of which "
            "1.21 GiB is free. Including non-PyTorch memory, this process has 22.77 GiB memory in use. Of the "
            "allocated memory 20.13 GiB is allocated by PyTorch, and 1.94 GiB is reserved by PyTorch but "
            "unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation. (injected by "
            f"{VARIABLE}=oom@step:{step})")


def _hold_memory_if_armed(step: int, device) -> None:
    drills = here()
    if not drills:
        return
    import torch  # a drill's cost: only when one is armed

    if Fault("residue", "step", step) in drills:
        _held.append(torch.ones(RESIDUE_BYTES, dtype=torch.uint8, device=device))
    if any(f.kind == "leak" and f.where == "step" and step >= f.n for f in drills):
        _held.append(torch.ones(LEAK_BYTES_PER_STEP, dtype=torch.uint8, device=device))
    if Fault("spike", "step", step) in drills:
        _held.append(torch.ones(SPIKE_BYTES, dtype=torch.uint8, device=device))  # filled: pages touched
        _held.pop()  # and freed: only the high-water mark remembers it


def _stall_or_kill_if_armed(step: int) -> None:
    if armed("stall", "step", step):
        threading.Event().wait()  # never set: signal handlers run, the wait goes on
    if armed("kill", "step", step):
        os.kill(os.getpid(), signal.SIGKILL)


def _shorten_swap_if_armed(step: int, swapper) -> None:
    if swapper is None or not armed("shortswap", "step", step):
        return
    files = sorted(Path(swapper.swap_folder).glob("*.tensor.swp"), key=lambda p: p.stat().st_size)
    os.truncate(files[-1], files[-1].stat().st_size - 4096)
