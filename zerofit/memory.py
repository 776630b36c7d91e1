"""Memory timeline: one JSON line per phase of a step (forward, backward, optimizer step,
save, eval) with GPU allocated / reserved / peak since the previous mark and host RSS.

Peaks come from the caching allocator's own counters (torch.cuda.max_memory_allocated,
reset at every mark), so recording needs no device synchronisation.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import psutil


def host_rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def gpu_bytes(on_gpu: bool) -> dict:
    """Allocator counters since the last reset; zeros on a CPU-only machine."""
    if not on_gpu:
        return {"gpu_alloc": 0, "gpu_reserved": 0, "gpu_peak": 0, "gpu_peak_reserved": 0}
    import torch

    return {"gpu_alloc": torch.cuda.memory_allocated(), "gpu_reserved": torch.cuda.memory_reserved(),
            "gpu_peak": torch.cuda.max_memory_allocated(), "gpu_peak_reserved": torch.cuda.max_memory_reserved()}


class Timeline:
    """Appends phase records to RUN_DIR/memory.jsonl (rank 0) or memory-rankN.jsonl.

    `observe(phase)` closes a peak window; with gradient accumulation a phase recurs in
    one optimizer step, so `flush(step)` writes one line per phase with the largest peak."""

    def __init__(self, run_dir: Path, rank: int, on_gpu: bool):
        name = "memory.jsonl" if rank == 0 else f"memory-rank{rank}.jsonl"
        self.path = Path(run_dir) / name
        self.rank, self.on_gpu = rank, on_gpu
        self._file = self.path.open("a", buffering=1)
        self._pending: dict[str, dict] = {}
        self.last: dict = {}

    def observe(self, phase: str) -> dict:
        reading = {**gpu_bytes(self.on_gpu), "host_rss": host_rss_bytes()}
        if self.on_gpu:
            import torch

            torch.cuda.reset_peak_memory_stats()
        seen = self._pending.get(phase)
        if seen:
            reading = {k: max(v, seen[k]) if k.endswith(("peak", "peak_reserved", "rss")) else v
                       for k, v in reading.items()}
        self._pending[phase] = reading
        return reading

    def flush(self, step: int, **extra) -> list[dict]:
        records = [{"step": step, "phase": phase, "time": round(time.time(), 3), **reading, **extra}
                   for phase, reading in self._pending.items()]
        for record in records:
            self._file.write(json.dumps(record) + "\n")
        self._pending.clear()
        if records:
            self.last = records[-1]
        return records

    def mark(self, step: int, phase: str, **extra) -> dict:
        """Record a phase that just ended on its own (save, eval) right away."""
        self.observe(phase)
        return self.flush(step, **extra)[-1]

    def close(self) -> None:
        self._file.close()


def read_timeline(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "memory.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def gib(n: float) -> str:
    return f"{n / 2**30:.1f}GiB"


def budget_summary(on_gpu: bool) -> str:
    """`gpu 5.3/24.0GiB host 36.1GiB` for the progress line."""
    host = gib(host_rss_bytes())
    if not on_gpu:
        return f"host {host}"
    import torch

    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return f"gpu {gib(torch.cuda.max_memory_allocated())}/{gib(total)} host {host}"



# Decimal units as Hugging Face writes shard sizes ("5GB"), binary ones as GPUs are sold ("24GiB").
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30, "t": 2**40, "tib": 2**40}


def parse_bytes(text: str | int, what: str) -> int:
    """`24GiB`, `5GB`, `512MiB`, `1.5g` (k/m/g/t alone are binary) or a plain byte count."""
    from zerofit.config import ConfigError

    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if unit not in _UNITS:
        raise ConfigError(f"{what}={text!r} is not a size; write e.g. 24GiB, 5GB, 512MiB or a byte count")
    return int(float(match.group(1)) * _UNITS[unit])


def human_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{int(n)}B"


def peak_rss_bytes() -> int:
    """This process's high-water RSS since it started (the kernel's ru_maxrss, KiB on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
