"""What a finding is and what the detectors (detectors.py) read: Finding, RunFacts (the run's
budgets from its start record or plan.json, its configs), the timeline series, the thresholds
and the units findings are written in. No I/O here: `zerofit doctor`, the post-mortem, the
watchdog and the HF callback share them.

Thresholds: a change counts when it exceeds `significant_bytes` for its device
(GPU: max(64 MiB, 0.5% of the budget); host: max(128 MiB, 0.5%)). The allocator's
counters are exact, so GPU growth of one byte per step is real; host RSS jitters by a
few MiB, hence the larger floor.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from zerofit.core.timeline import EVENT_PHASES

MiB, GiB = 2**20, 2**30
WARMUP_STEPS = 2  # the first steps allocate optimizer states and caches: not a leak
SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}
EVENT_KINDS = ("oom", "watchdog", "checkpoint_failed")  # findings of one record each, not of a trend


@dataclass(frozen=True)
class Finding:
    kind: str          # post_save_residue | growth | fragmentation | near_budget | after_save_spike
                       # | after_eval_spike | oom | watchdog
                       # | checkpoint_failed | rank_imbalance | cpu_threads | killed | checkpoint_damaged
                       # | save_cut_short | checkpoint_unusable
    severity: str      # error | warning | info
    device: str        # gpu | host | disk
    title: str         # what was seen, with the numbers
    cause: str
    fix: list[str]
    step: int | None = None
    evidence: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RunFacts:
    """What the detectors need to know about the run besides the timeline."""
    gpu_budget: int = 0
    host_budget: int = 0
    host_total: int = 0
    host_budget_is_machine: bool = True
    host_limit: str | None = None  # a cgroup memory limit below the machine's RAM, as the start record said it
    alloc_conf: str = ""
    ds_config: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)   # zerofit's resolved config, {} for HF runs
    source: str = "zerofit"                      # or hf-trainer: fixes name Trainer / DeepSpeed keys
    params: int = 0                              # the model's parameters (plan.json), 0 when unknown

    @property
    def zero(self) -> dict:
        return self.ds_config.get("zero_optimization", {})

    def sub_group_size(self) -> int:
        return int(self.zero.get("sub_group_size", 1_000_000_000))  # DeepSpeed's default

    def gathers_on_save(self) -> bool:
        return bool(self.zero.get("stage3_gather_16bit_weights_on_model_save", False))

    def offloaded(self, what: str) -> str:
        return (self.zero.get(f"offload_{what}") or {}).get("device", "none")

    @property
    def expandable_segments_on(self) -> bool:
        """The allocator setting the run started with (its `start` record's PYTORCH_CUDA_ALLOC_CONF
        and PYTORCH_ALLOC_CONF)."""
        return "expandable_segments:True" in self.alloc_conf

    def gradient_checkpointing(self) -> bool | None:
        return self.config.get("model", {}).get("gradient_checkpointing")


def facts_from(records: list[dict], ds_config: dict | None = None, config: dict | None = None,
               plan: dict | None = None, source: str = "zerofit") -> RunFacts:
    """Budgets from the newest `start` record, else from plan.json."""
    start = next((r for r in reversed(records) if r.get("phase") == "start"), {})
    devices = (plan or {}).get("devices", {})
    return RunFacts(
        gpu_budget=start.get("gpu_budget") or devices.get("gpu", {}).get("budget_bytes") or 0,
        host_budget=start.get("host_budget") or devices.get("host", {}).get("budget_bytes") or 0,
        host_total=start.get("host_total") or 0,
        host_budget_is_machine=start.get("host_budget_is_machine", True), host_limit=start.get("host_limit"),
        alloc_conf=start.get("alloc_conf", ""), ds_config=ds_config or {}, config=config or {}, source=source,
        params=(plan or {}).get("params") or 0)


# ------------------------------------------------------------------------ series
def significant_bytes(facts: RunFacts, device: str) -> int:
    if device == "gpu":
        return max(64 * MiB, int(0.005 * facts.gpu_budget))
    return max(128 * MiB, int(0.005 * facts.host_budget))


def training(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("phase") not in EVENT_PHASES]


def end_of_step(records: list[dict], device: str) -> dict[int, int]:
    """What is held at the end of each step (the last training phase's reading):
    allocated for the GPU, RSS for the host."""
    key = "gpu_alloc" if device == "gpu" else "host_rss"
    return {r["step"]: r[key] for r in training(records)}


def peaks(records: list[dict], device: str) -> list[tuple[dict, int]]:
    key = "gpu_peak" if device == "gpu" else "host_peak"
    return [(r, r.get(key, 0)) for r in records]


def save_steps(records: list[dict]) -> set[int]:
    return {r["step"] for r in records if r.get("phase") == "save"}


def steady_deltas(series: dict[int, int], saves: set[int]) -> list[int]:
    """Step-to-step changes after warm-up, leaving out those across a save."""
    steps = [s for s in sorted(series) if s > WARMUP_STEPS]
    return [series[b] - series[a] for a, b in zip(steps, steps[1:]) if b == a + 1 and a not in saves]


# ------------------------------------------------------------------------ shared with the watchdog and reports
def host_in_use(record: dict, facts: RunFacts) -> int:
    """Machine-wide use when the budget is the machine (what the kernel's OOM killer sees),
    else this process's peak RSS."""
    if facts.host_budget_is_machine and facts.host_total and record.get("host_avail"):
        return max(facts.host_total - record["host_avail"], record.get("host_peak", 0))
    return record.get("host_peak", record.get("host_rss", 0))


def label(device: str) -> str:
    return {"gpu": "GPU", "host": "Host"}.get(device, device)


def mib(n: float) -> str:
    return f"{n / MiB:,.0f} MiB"


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"
