"""Watchdog: after each optimizer step, compare the step's memory peaks with the budgets
and act before the allocator or the kernel's OOM killer does: warn, save a checkpoint
pre-emptively, or save and stop cleanly (memory.watchdog_threshold / watchdog_action).

What counts as "in use":
  GPU   the step's peak reserved bytes (what the caching allocator held at its worst)
        plus memory on the device outside PyTorch's allocator (CUDA context, NCCL,
        other processes: torch.cuda.mem_get_info's used minus memory_reserved)
  host  machine-wide use (total - available, what the OOM killer sees) when the budget
        is the machine's RAM; this process's peak RSS when plan.host_mem sets a budget
On a CPU-only machine only the host is watched. One crossing acts once: the watchdog
re-arms when use falls back below the threshold, so a run that stays high is not saved
every step.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from zerofit.core.errors import ConfigError
from zerofit.core.timeline import budgets, gib
from zerofit.findings.facts import RunFacts, host_in_use
from zerofit.machine.procenv import allocator_variables, node_cores_and_ranks


class MemoryStop(ConfigError):
    """The watchdog saved a checkpoint and stopped the run (watchdog_action: stop): exit 1."""


@dataclass(frozen=True)
class Crossing:
    device: str          # gpu | host
    in_use_bytes: int
    budget_bytes: int
    threshold: float
    action: str          # warn | save | stop
    step: int

    @property
    def fraction(self) -> float:
        return self.in_use_bytes / self.budget_bytes

    def message(self) -> str:
        verb = {"warn": "", "save": "; saving a checkpoint now",
                "stop": "; saving a checkpoint and stopping"}[self.action]
        return (f"watchdog: {self.device} memory {gib(self.in_use_bytes)} is {self.fraction:.0%} of the "
                f"{gib(self.budget_bytes)} budget at step {self.step} (memory.watchdog_threshold "
                f"{self.threshold:.0%}){verb}")

    def record(self) -> dict:
        return {"device": self.device, "in_use_bytes": self.in_use_bytes, "budget_bytes": self.budget_bytes,
                "fraction": round(self.fraction, 4), "threshold": self.threshold, "action": self.action}


def usage(step_records: list[dict], facts: RunFacts, gpu_outside_torch: int = 0) -> dict[str, tuple[int, int]]:
    """{device: (in use, budget)} for one step's records (pure)."""
    found = {}
    if facts.gpu_budget:
        gpu = max((max(r.get("gpu_peak_reserved", 0), r.get("gpu_reserved", 0)) for r in step_records), default=0)
        found["gpu"] = (gpu + gpu_outside_torch, facts.gpu_budget)
    if facts.host_budget:
        found["host"] = (max((host_in_use(r, facts) for r in step_records), default=0), facts.host_budget)
    return found


def crossings(step: int, use: dict[str, tuple[int, int]], threshold: float, action: str) -> list[Crossing]:
    """The devices whose use is at or above threshold x budget (pure)."""
    return [Crossing(device, in_use, budget, threshold, action, step)
            for device, (in_use, budget) in use.items() if budget and in_use >= threshold * budget]


def any_rank(flag: bool, on_gpu: bool, world_size: int) -> bool:
    """True on every rank when it is True on one: a pre-emptive save is collective."""
    if world_size == 1:
        return flag
    import torch
    import torch.distributed as torch_dist

    value = torch.tensor([int(flag)], device="cuda" if on_gpu else "cpu")
    torch_dist.all_reduce(value, op=torch_dist.ReduceOp.MAX)
    return bool(value.item())


class Watchdog:
    """Stateful part: re-arming per device, and the GPU reading outside PyTorch."""

    def __init__(self, facts: RunFacts, threshold: float, action: str, on_gpu: bool):
        self.facts, self.threshold, self.action, self.on_gpu = facts, threshold, action, on_gpu
        self._tripped: set[str] = set()

    def check(self, step: int, step_records: list[dict]) -> Crossing | None:
        """The first new crossing of this step, or None."""
        found = crossings(step, usage(step_records, self.facts, self._gpu_outside_torch()), self.threshold,
                          self.action)
        over = {c.device for c in found}
        self._tripped &= over  # re-arm the devices that fell back below
        fresh = [c for c in found if c.device not in self._tripped]
        self._tripped |= over
        return fresh[0] if fresh else None

    def _gpu_outside_torch(self) -> int:
        if not self.on_gpu:
            return 0
        import torch

        free, total = torch.cuda.mem_get_info()
        return max(0, (total - free) - torch.cuda.memory_reserved())


def arm(timeline, step: int, on_gpu: bool, threshold: float, action: str, gpu_mem: str | None = None,
        host_mem: str | None = None, world_size: int = 1, **start_extra) -> Watchdog:
    """Write the timeline's `start` record (the budgets, the allocator settings, the CPU
    threads the rank runs with: what the doctor measures against; `start_extra` too) and
    return the armed watchdog."""
    import torch

    found = budgets(on_gpu, gpu_mem, host_mem)
    cores, local_ranks = node_cores_and_ranks()
    timeline.mark(step, "start", **found, alloc_conf=allocator_variables(os.environ),
                  world_size=world_size, threshold=threshold, action=action, cpu_threads=torch.get_num_threads(),
                  cpu_cores=cores, local_world_size=local_ranks, **start_extra)
    facts = RunFacts(gpu_budget=found["gpu_budget"], host_budget=found["host_budget"], host_total=found["host_total"],
                     host_budget_is_machine=found["host_budget_is_machine"], host_limit=found["host_limit"])
    return Watchdog(facts, threshold, action, on_gpu)
