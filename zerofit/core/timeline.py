"""Memory timeline: one JSON line per phase of a step (forward, backward, optimizer step,
save, eval) in RUN_DIR/memory.jsonl, read back by `zerofit doctor`.

What one record holds (bytes unless named otherwise):
  step, phase, time     the optimizer step the phase belongs to; `after_save: true` marks
                        the records of the first step after a checkpoint save
  gpu_alloc             torch.cuda.memory_allocated at the end of the phase
  gpu_reserved          torch.cuda.memory_reserved (what the caching allocator holds)
  gpu_peak              max_memory_allocated within the phase (peaks reset at every phase)
  gpu_peak_reserved     max_memory_reserved within the phase
  gpu_frag              gpu_reserved - gpu_alloc: cached but unused
  gpu_inactive_split    memory_stats()["inactive_split_bytes.all.current"]: free pieces of
                        split blocks, the fragmentation that makes a large request fail
  host_rss, host_peak   VmRSS, and VmHWM since the previous phase (/proc/self/status; the
                        high-water mark is reset through /proc/self/clear_refs, see proc(5))
  host_avail            RAM available machine-wide (or in the run's cgroup, where tighter), once per step
  pinned                page-locked host memory, once per step: the CUDA caching host
                        allocator's bytes (torch.cuda.host_memory_stats, where
                        `tensor.pin_memory()` and DeepSpeed's default pinning land) plus
                        VmLck (mlock'ed: DeepSpeed's native pin backend, AIO buffers)
  nvme_swap             bytes of DeepSpeed swap files under zero.nvme_path, once per step
  cpu_s, load_avg       this process's CPU seconds so far (user + system, all its threads) and
                        the machine's 1-minute load average, once per step: with `time`, the
                        cores the run got and how busy the machine was

All GPU figures come from one torch.cuda.memory_stats() call (memory_allocated and its
siblings each call it too), so recording needs no device synchronisation; the bench
`bench/timeline_overhead.py` measures what it costs.
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import psutil

from zerofit.core import cgroup
from zerofit.core.console import warn
from zerofit.core.errors import ConfigError
from zerofit.core.files import open_unlinked, read_jsonl, step_of

GPU_KEYS = ("gpu_alloc", "gpu_reserved", "gpu_peak", "gpu_peak_reserved", "gpu_frag", "gpu_inactive_split")
PEAK_KEYS = ("gpu_peak", "gpu_peak_reserved", "host_peak")  # kept as the max when a phase recurs
# marked on their own, not per micro batch
EVENT_PHASES = ("start", "save", "eval", "oom", "watchdog", "checkpoint_written", "checkpoint_failed", "end")


# ---------------------------------------------------------------------------- readings
def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM and VmLck of this process in bytes (0 where /proc is missing)."""
    found = {"VmRSS": 0, "VmHWM": 0, "VmLck": 0}
    try:
        with open("/proc/self/status") as status:
            for line in status:
                key = line[:5]
                if key in found:
                    found[key] = int(line.split()[1]) * 1024
    except OSError:
        found["VmRSS"] = found["VmHWM"] = psutil.Process().memory_info().rss
    return found


def reset_host_peak() -> None:
    """Reset VmHWM to the current RSS ("5" in proc(5) clear_refs), so the next reading is
    the peak of the phase in between. Not permitted everywhere; then VmHWM is lifetime."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def host_rss_bytes() -> int:
    return proc_status()["VmRSS"] or psutil.Process().memory_info().rss


def gpu_bytes(on_gpu: bool) -> dict:
    """Allocator counters since the last peak reset; zeros on a CPU-only machine."""
    if not on_gpu:
        return dict.fromkeys(GPU_KEYS, 0)
    import torch

    stats = torch.cuda.memory_stats()
    alloc, reserved = stats.get("allocated_bytes.all.current", 0), stats.get("reserved_bytes.all.current", 0)
    return {"gpu_alloc": alloc, "gpu_reserved": reserved, "gpu_peak": stats.get("allocated_bytes.all.peak", 0),
            "gpu_peak_reserved": stats.get("reserved_bytes.all.peak", 0), "gpu_frag": reserved - alloc,
            "gpu_inactive_split": stats.get("inactive_split_bytes.all.current", 0)}


def pinned_bytes(mlocked: int) -> int:
    """CUDA caching host allocator bytes (active + cached) plus mlock'ed bytes."""
    try:
        import torch

        torch_pinned = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    except (AttributeError, RuntimeError):
        torch_pinned = 0
    return torch_pinned + mlocked


def nvme_swap_bytes(nvme_path: str | Path | None) -> int:
    """Bytes in DeepSpeed's swap files (`*.swp` under nvme_path/zero_stage_3/...)."""
    if not nvme_path or not Path(nvme_path).is_dir():
        return 0
    total = 0
    for root, _, files in os.walk(nvme_path):
        for name in files:
            if name.endswith(".swp"):
                try:
                    total += os.stat(os.path.join(root, name)).st_size
                except OSError:  # a swap file removed while we walk
                    pass
    return total


def gpu_total_bytes() -> int:
    import torch

    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def gpu_budget_bytes() -> int:
    """The device memory this process may use: the total, times the per-process fraction
    when one is set (torch.cuda.set_per_process_memory_fraction, how a smaller card is
    simulated)."""
    import torch

    total = gpu_total_bytes()
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    fraction = getter() if getter else 1.0
    return int(total * min(1.0, fraction))


def budgets(on_gpu: bool, gpu_mem: str | None = None, host_mem: str | None = None) -> dict:
    """What the watchdog and the doctor measure against. GPU: plan.gpu_mem, else the
    device (times the per-process fraction); host: plan.host_mem, else the machine's RAM
    (`host_budget_is_machine` tells the watchdog to count machine-wide use), or the cgroup's
    memory limit where that is tighter (`host_limit` says so)."""
    host = cgroup.host_memory()
    found = {"host_total": host.total, "host_budget": parse_bytes(host_mem, "plan.host_mem") or host.total,
             "host_budget_is_machine": host_mem is None, "host_limit": host.limit, "gpu_total": 0, "gpu_budget": 0}
    if on_gpu:
        found["gpu_total"] = gpu_total_bytes()
        found["gpu_budget"] = parse_bytes(gpu_mem, "plan.gpu_mem") or gpu_budget_bytes()
    return found


# ---------------------------------------------------------------------------- timeline
class Timeline:
    """Appends phase records to RUN_DIR/memory.jsonl (rank 0) or memory-rankN.jsonl.

    `observe(phase)` closes a peak window; with gradient accumulation a phase recurs in
    one optimizer step, so `flush(step)` writes one line per phase with the largest
    peak. `mark(step, phase, **extra)` records a phase that ended on its own (save,
    eval) right away; extra fields go into its record. `predictions` (phase ->
    {"predicted_gpu_peak", "predicted_host_rss"}, from the plan) go on each phase's
    record, next to what was measured."""

    def __init__(self, run_dir: Path, rank: int, on_gpu: bool, nvme_path: str | None = None,
                 predictions: dict[str, dict] | None = None):

        self.path = timeline_path(run_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank, self.on_gpu, self.nvme_path = rank, on_gpu, nvme_path
        self.predictions = predictions or {}
        self._file = open_unlinked(self.path, append=True)  # a link planted there is refused
        self._pending: dict[str, dict] = {}
        self._after_save = False
        self._unwritable = False
        self.last: dict = {}
        self.last_phase: str | None = None  # the phase observed most recently (post-mortem reads it)

    def observe(self, phase: str) -> dict:
        status = proc_status()
        reading = {**gpu_bytes(self.on_gpu), "host_rss": status["VmRSS"], "host_peak": status["VmHWM"]}
        if self.on_gpu:
            import torch

            torch.cuda.reset_peak_memory_stats()
        reset_host_peak()
        seen = self._pending.get(phase)
        if seen:
            reading = {k: max(v, seen[k]) if k in PEAK_KEYS else v for k, v in reading.items()}
        self._pending[phase] = reading
        self.last_phase = phase
        return reading

    def flush(self, step: int, **extra) -> list[dict]:
        """Write the pending phases of `step`; the per-step readings (pinned, NVMe, host
        available) are taken once here and go into each of its records."""
        if not self._pending:
            return []
        cpu = os.times()
        per_step = {"host_avail": cgroup.host_memory().available,
                    "pinned": pinned_bytes(proc_status()["VmLck"]), "nvme_swap": nvme_swap_bytes(self.nvme_path),
                    "cpu_s": round(cpu.user + cpu.system, 3), "load_avg": round(os.getloadavg()[0], 2)}
        flags = {"after_save": True} if self._after_save and not set(self._pending) & set(EVENT_PHASES) else {}
        now = round(time.time(), 3)
        records = [{"step": step, "phase": phase, "time": now, **reading, **per_step, **flags,
                    **self.predictions.get(phase, {}), **extra}
                   for phase, reading in self._pending.items()]
        self._write(records)
        self._pending.clear()
        if "save" in (r["phase"] for r in records):
            self._after_save = True
        elif flags:
            self._after_save = False
        self.last = records[-1]
        return records

    def _write(self, records: list[dict]) -> None:
        """Append the records; a disk that refuses (full) costs the timeline, not the run: a
        failed save with checkpoint.on_error continue must go on, and the watchdog reads
        `last`, not the file."""
        if self._unwritable:
            return
        try:
            self._file.write("".join(json.dumps(record) + "\n" for record in records))
        except OSError as e:
            self._unwritable = True
            warn(f"{self.path} can no longer be written ({e.strerror or e}); the run goes on without its memory "
                 f"timeline from here (`zerofit doctor` reads what was written)")

    def mark(self, step: int, phase: str, **extra) -> dict:
        """Record a phase that just ended on its own (save, eval) right away."""
        self.observe(phase)
        return self.flush(step, **extra)[-1]

    def end(self, step: int, reason: str) -> None:
        """The run's last record, saying how it ended (the doctor reads it). The readings of a
        step it cut short are dropped, not written under a step they do not belong to."""
        self._pending.clear()
        self.mark(step, "end", reason=reason)

    def close(self) -> None:
        try:
            self._file.close()
        except OSError:  # what a full disk would not take: said in _write already
            pass


# ---------------------------------------------------------------------------- reading back
RANK_TIMELINE_PREFIX = "memory-rank"


def timeline_path(run_dir: Path, rank: int = 0) -> Path:
    """A rank's timeline: memory.jsonl for rank 0 (the one a single-rank run has), memory-rankN.jsonl."""
    return Path(run_dir) / ("memory.jsonl" if rank == 0 else f"{RANK_TIMELINE_PREFIX}{rank}.jsonl")


def timeline_ranks(run_dir: Path) -> list[int]:
    """The ranks with a timeline file under run_dir: 0, then the others in order."""
    found = (p.stem.removeprefix(RANK_TIMELINE_PREFIX) for p in run_dir.glob(f"{RANK_TIMELINE_PREFIX}*.jsonl"))
    return [0] + sorted(int(rank) for rank in found if rank.isdigit())


def read_timeline(run_dir: Path, rank: int = 0) -> list[dict]:
    """The records of a rank's timeline (timeline_path), in order."""
    return read_jsonl(timeline_path(run_dir, rank))


def effective_records(records: list[dict]) -> list[dict]:
    """The timeline as the run's model saw it: a `start` record at step s (a resume)
    drops the earlier records of steps after s, which the resume rolled back. OOM and
    watchdog events are kept: they happened, whatever came after. An async save's outcome
    counts at its checkpoint's step, not at the later step it was stamped with: the
    publication of step-s is kept when the resume starts from s (or later)."""
    kept: list[dict] = []
    for record in records:
        if record.get("phase") == "start":
            kept = [r for r in kept if record_step(r) <= record["step"] or r["phase"] in ("oom", "watchdog")]
        kept.append(record)
    return kept


def record_step(record: dict) -> int:
    """The step a record belongs to: its own, or for an async save's outcome its checkpoint's."""
    saved = step_of(Path(record.get("checkpoint") or "")) if record.get("phase") in (
        "checkpoint_written", "checkpoint_failed") else -1
    return saved if saved >= 0 else record["step"]


def gib(n: float) -> str:
    return f"{n / 2**30:.1f}GiB"


def budget_summary(step_records: list[dict], on_gpu: bool, gpu_budget: int) -> str:
    """`gpu 5.3/24.0GiB host 36.1GiB` for the progress line: the step's allocated GPU peak
    (its phases' records: the allocator's own peak is reset at every phase) against the
    budget the run plans and watches (plan.gpu_mem, else the device), and host RSS now."""
    host = gib(host_rss_bytes())
    if not on_gpu:
        return f"host {host}"
    peak = max((r.get("gpu_peak", 0) for r in step_records), default=0)
    return f"gpu {gib(peak)}/{gib(gpu_budget or gpu_total_bytes())} host {host}"


# Decimal units as Hugging Face writes shard sizes ("5GB"), binary ones as GPUs are sold ("24GiB").
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30, "t": 2**40, "tib": 2**40}


def parse_bytes(text: str | int | None, what: str = "size") -> int | None:
    """`24GiB`, `5GB`, `512MiB`, `1.5g` (k/m/g/t alone are binary), `1e9` or a plain byte
    count -> bytes; None stays None. `what` names the setting in the error."""

    if text is None or isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if unit not in _UNITS:
        raise ConfigError(f"{what}={text!r} is not a size; write e.g. 24GiB, 5GB, 512MiB or a byte count")
    return int(float(match.group(1)) * _UNITS[unit])


def human_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{int(n)}B"


def human_count(n: int) -> str:
    """A count of elements or parameters as DeepSpeed's docs write them: 5e8 -> 500M,
    3_774_873 -> 3.77M, 8_030_261_248 -> 8.03B, 82_496 -> 82.5K."""
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def peak_rss_bytes() -> int:
    """This process's high-water RSS since it started (the kernel's ru_maxrss, KiB on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
