"""What a run's timelines measured, beside what plan.json predicted (pure: the doctor and the
post-mortem read the files): the peaks per device, per phase and per rank, the saves'
outcomes, and plan vs measured, one row per device with its components and phases.
"""
from __future__ import annotations

import statistics

from zerofit.core.timeline import EVENT_PHASES
from zerofit.findings.facts import WARMUP_STEPS, RunFacts
from zerofit.plan.loadpeak import LOADING


def measured_peaks(records: list[dict]) -> dict[str, int]:
    return {"gpu": max((r.get("gpu_peak_reserved", 0) for r in records), default=0),
            "gpu_alloc": max((r.get("gpu_peak", 0) for r in records), default=0),
            "host": max((r.get("host_peak", r.get("host_rss", 0)) for r in records), default=0),
            "pinned": max((r.get("pinned", 0) for r in records), default=0),
            "nvme": max((r.get("nvme_swap", 0) for r in records), default=0)}


def measured_component(device: str, name: str, peaks: dict, checkpoint_bytes: int) -> int | None:
    """The few components a timeline measures on its own, matched by name."""
    lowered = name.lower()
    if "pinned" in lowered:
        return peaks["pinned"]
    if device == "disk" and ("nvme" in lowered or "swap" in lowered):
        return peaks["nvme"]
    if device == "disk" and "checkpoint" in lowered and checkpoint_bytes:
        return checkpoint_bytes
    return None


NOT_WRITTEN = ("save_margin",)  # plan components that are room asked for, not bytes the run uses


def checkpoints_at_once(plan: dict) -> int:
    """The checkpoints the plan counts on disk at once (keep_last + the one being written)."""
    planned = ((plan.get("devices", {}).get("disk") or {}).get("components") or {}).get("checkpoints", 0)
    return max(round(planned / plan["checkpoint_bytes"]) if plan.get("checkpoint_bytes") else 1, 1)


def plan_vs_measured(plan: dict | None, per_rank: dict[int, list[dict]], checkpoint_bytes: int = 0) -> list[dict]:
    """One row per device of plan.json (`devices` -> gpu/host/disk -> total_bytes,
    budget_bytes, components) with the measured peak next to the prediction, and per
    phase where the records carry the planner's predicted_gpu_peak / predicted_host_rss.

    The GPU's and the swap files' figures are per rank; the host's are for the ranks that
    share it (plan.json `ranks_on_host`): compared with the sum of the given ranks' peaks,
    scaled to those ranks (a post-mortem gives one rank's timeline)."""
    if not plan:
        return []
    records = [record for timeline in per_rank.values() for record in timeline]
    peaks = measured_peaks(records)
    for key in ("host", "pinned"):
        peaks[key] = sum(measured_peaks(timeline)[key] for timeline in per_rank.values())
    share = len(per_rank) / (plan.get("ranks_on_host") or plan.get("shape", {}).get("world_size") or 1)
    # the plan counts every checkpoint on disk at once (keep_last + the one being written):
    # the newest one measured stands for each of them
    on_disk = checkpoint_bytes * checkpoints_at_once(plan)
    measured = {"gpu": peaks["gpu"], "host": peaks["host"], "disk": peaks["nvme"] + on_disk}
    rows = []
    for device, entry in plan.get("devices", {}).items():
        scale = share if device == "host" else 1
        components = [{"name": name, "predicted_bytes": int(value * scale),
                       "measured_bytes": measured_component(device, name, peaks, on_disk)}
                      for name, value in (entry.get("components") or {}).items()]
        key = {"gpu": ("predicted_gpu_peak", "gpu_peak_reserved"), "host": ("predicted_host_rss", "host_peak")}
        phases = []
        if device in key:
            predicted_key, measured_key = key[device]
            for phase in dict.fromkeys(r["phase"] for r in records if predicted_key in r):
                mine = [r for r in records if r["phase"] == phase and predicted_key in r]
                phases.append({"phase": phase, "predicted_bytes": max(r[predicted_key] for r in mine),
                               "measured_bytes": max(r.get(measured_key, 0) for r in mine)})
        if device == "host" and (loading := loading_row(plan, per_rank, share)):
            phases.insert(0, loading)
        predicted = entry.get("total_bytes") or sum(c["predicted_bytes"] for c in components)
        # the engine's start can be the host's peak (NVMe offload: planner.Plan.start_peak), a save's
        # staging another (the plan's save and first-step-after peaks: counted where the run saved)
        predicted = int(scale * max([predicted] + [((plan.get(peak) or {}).get(device) or {}).get("total_bytes", 0)
                                                   for peak in peaks_run(records)]))
        # free space the plan holds for a save (planner.save_margin_bytes) is asked of the disk, never written
        predicted -= sum(c["predicted_bytes"] for c in components if c["name"] in NOT_WRITTEN)
        rows.append({"device": device, "predicted_bytes": predicted, "measured_bytes": measured.get(device, 0),
                     "budget_bytes": entry.get("budget_bytes"), "usable_bytes": entry.get("usable_bytes"),
                     "error": relative_error(predicted, measured.get(device)),
                     "components": components, "phases": phases})
    return rows


def loading_row(plan: dict, per_rank: dict[int, list[dict]], share: float) -> dict | None:
    """The host's peak while the data was loaded and tokenized, predicted (plan.json
    data_load_peak, for the ranks on the host) against the start records' data_load_host_peak
    (each rank's VmHWM then, summed as the host's are); None where nothing was predicted."""
    predicted = ((plan.get("data_load_peak") or {}).get("host") or {}).get("total_bytes")
    if not predicted:
        return None
    measured = sum(max((r.get("data_load_host_peak", 0) for r in timeline if r["phase"] == "start"), default=0)
                   for timeline in per_rank.values())
    return {"phase": LOADING, "predicted_bytes": int(predicted * share), "measured_bytes": measured}


def peaks_run(records: list[dict]) -> tuple[str, ...]:
    """The plan's peaks besides training's that this run went through (plan.json keys)."""
    saved = any(r.get("phase") == "save" for r in records)
    return ("start_peak",) + (("save_peak", "first_step_after_save_peak") if saved else ())


def relative_error(predicted: int | None, measured: int | None) -> float | None:
    if not predicted or not measured:
        return None
    return round((predicted - measured) / measured, 4)


def phase_peaks(records: list[dict]) -> list[dict]:
    """Per phase: how often, the highest GPU and host peaks and where."""
    rows: dict[str, dict] = {}
    for r in records:
        if r["phase"] == "start":
            continue
        row = rows.setdefault(r["phase"], {"phase": r["phase"], "count": 0, "gpu_peak": 0, "gpu_peak_reserved": 0,
                                           "host_peak": 0, "gpu_step": None, "host_step": None})
        row["count"] += 1
        if r.get("gpu_peak", 0) > row["gpu_peak"]:
            row["gpu_peak"], row["gpu_step"] = r["gpu_peak"], r["step"]
        row["gpu_peak_reserved"] = max(row["gpu_peak_reserved"], r.get("gpu_peak_reserved", 0))
        host = r.get("host_peak", r.get("host_rss", 0))
        if host > row["host_peak"]:
            row["host_peak"], row["host_step"] = host, r["step"]
    return list(rows.values())


def rank_peaks(per_rank: dict[int, list[dict]], facts: RunFacts) -> list[dict]:
    """Per rank: the steps it recorded and its GPU / host high-water marks (summarize's)."""
    rows = []
    for rank, timeline in sorted(per_rank.items()):
        summary = summarize(timeline, facts)
        rows.append({"rank": rank, **{key: summary[key] for key in ("steps", "gpu_peak", "gpu_peak_reserved",
                                                                      "host_peak")}})
    return rows


def summarize(records: list[dict], facts: RunFacts, every_rank: list[dict] | None = None) -> dict:
    """Counts from `records` (rank 0's timeline), peaks from every rank's when given."""
    phases = [r["phase"] for r in records]
    peaks = measured_peaks(every_rank or records)
    training = [r for r in records if r["phase"] not in EVENT_PHASES]
    saves = save_outcomes(records)
    return {"steps": max((r["step"] for r in training), default=0), **saves,
            "evals": phases.count("eval"), "ooms": phases.count("oom"), "watchdog": phases.count("watchdog"),
            "resumes": max(0, phases.count("start") - 1), "on_gpu": any(r.get("gpu_reserved") for r in records),
            "gpu_peak_reserved": peaks["gpu"], "gpu_peak": peaks["gpu_alloc"], "host_peak": peaks["host"],
            "pinned": peaks["pinned"], "nvme_swap": peaks["nvme"], "gpu_budget": facts.gpu_budget,
            "host_budget": facts.host_budget,
            "data_load_host_peak": max((r.get("data_load_host_peak", 0) for r in records if r["phase"] == "start"),
                                       default=0)}


def save_outcomes(records: list[dict]) -> dict:
    """Saves that were published, that failed, and that never finished. A "save" record marks
    the training's stall (checkpointer.save): a sync save is published by then, unless its
    checkpoint_failed came just before it; an async one is published at its later
    checkpoint_written or lost at a checkpoint_failed, and with neither it was still being
    written when the timeline ends (the run killed mid-write, or still running).
    HF Trainer's timelines mark saves without a mode: published."""
    published = failed = 0
    in_flight: set[str] = set()
    failed_since_save: set[str] = set()
    for record in records:
        phase, name = record.get("phase"), record.get("checkpoint")
        if phase == "checkpoint_failed":
            failed += 1
            if name in in_flight:
                in_flight.discard(name)
            else:
                failed_since_save.add(name)
        elif phase == "checkpoint_written" and name in in_flight:
            in_flight.discard(name)
            published += 1
        elif phase == "save":
            if record.get("mode") == "async":
                in_flight.add(name)
            elif name not in failed_since_save:
                published += 1
            failed_since_save.clear()
    return {"saves": published, "saves_failed": failed, "saves_unfinished": len(in_flight)}


def step_time(plan: dict | None, metrics: list[dict], records: list[dict]) -> dict | None:
    """Predicted (plan.json's estimated_step_seconds) against measured step seconds: the median
    of the steady steps in metrics.jsonl (the first WARMUP_STEPS left out: they build caches
    and optimizer states), with what the timeline says of the machine while they ran (the
    cores the run got, the load average; steady_cpu). None without a plan or a steady step."""
    predicted = (plan or {}).get("estimated_step_seconds")
    seconds = [m["step_seconds"] for m in metrics if m.get("step_seconds") and m.get("step", 0) > WARMUP_STEPS]
    if not predicted or not seconds:
        return None
    start = next((r for r in reversed(records) if r.get("phase") == "start"), {})
    measured = statistics.median(seconds)
    return {"predicted_s": predicted, "measured_s": measured, "ratio": measured / predicted, "steps": len(seconds),
            "on_gpu": bool((plan or {}).get("accelerator", "cpu") != "cpu"), "cpu_cores": start.get("cpu_cores"),
            "cpu_threads": start.get("cpu_threads"), **steady_cpu(records)}


def steady_cpu(records: list[dict]) -> dict:
    """The cores the run's process got (CPU seconds over wall seconds, step to step) and the
    machine's load average, medians over the steady steps; {} without two steady steps."""
    ends = {r["step"]: r for r in records if r.get("phase") not in EVENT_PHASES and "cpu_s" in r and "time" in r}
    steps = [s for s in sorted(ends) if s > WARMUP_STEPS and s - 1 in ends]
    used = [(ends[s]["cpu_s"] - ends[s - 1]["cpu_s"]) / (ends[s]["time"] - ends[s - 1]["time"])
            for s in steps if ends[s]["time"] > ends[s - 1]["time"]]
    if not used:
        return {}
    return {"cores_used": round(statistics.median(used), 2),
            "load_avg": round(statistics.median(ends[s]["load_avg"] for s in steps), 2)}
