"""`zerofit doctor RUN_DIR`: read a run directory (zerofit's, or an HF Trainer output_dir
written by zerofit.hf.MemoryGuardCallback) and explain its memory: the timeline with
saves, evals and OOMs, plan vs measured, findings with fixes, the post-mortem.

Reading files happens in `diagnose`; everything it computes comes from pure functions
(findings.detect, plan_vs_measured, phase_peaks, summarize); report.py renders.
"""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from zerofit import checkpoint, runlock
from zerofit.config import ConfigError
from zerofit.detectors import detect
from zerofit.findings import Finding, RunFacts, facts_from
from zerofit.loadpeak import LOADING
from zerofit.rankfindings import across_ranks, killed_outright, rank_imbalance
from zerofit.memory import EVENT_PHASES, effective_records, human_bytes, read_timeline, timeline_path, timeline_ranks
from zerofit.oomreport import rank_files

HF_RUN_FILE = "memory_run.json"  # what MemoryGuardCallback writes next to memory.jsonl


@dataclass
class Diagnosis:
    run_dir: Path
    source: str                   # zerofit | hf-trainer
    records: list[dict]           # rank 0's effective timeline (resumes applied)
    facts: RunFacts
    findings: list[Finding]
    plan: list[dict]              # plan_vs_measured rows; [] without plan.json
    phases: list[dict]            # per phase peaks
    summary: dict
    postmortem: dict | None = None
    checkpoint_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    ranks: list[dict] = field(default_factory=list)  # per rank: steps, GPU / host peaks (rank_peaks)
    other_ranks: dict[int, list[dict]] = field(default_factory=dict)  # ranks > 0: their effective timelines
    running_pid: int | None = None  # the zerofit train still holding the run's lock
    ending: str = ""              # how the run ended and what it left to go on from (how_it_ended)

    @property
    def running_note(self) -> str:
        return "" if self.running_pid is None else \
            f"the run is still going (zerofit train, pid {self.running_pid}): figures up to its newest record"


# ---------------------------------------------------------------------------- reading
def diagnose(run_dir: str | Path, hashes: bool = True) -> Diagnosis:
    """What RUN_DIR's files say; its checkpoints verified as a resume verifies them (every
    file's xxh3 hash, until the newest intact one), or with `hashes` off by their sizes only."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} {'is not a directory' if run_dir.exists() else 'does not exist'}; point "
                          f"`zerofit doctor` at a zerofit run directory "
                          f"(run_dir of the config) or an HF Trainer output_dir")
    per_rank = rank_timelines(run_dir)
    if 0 not in per_rank:
        raise ConfigError(no_timeline(run_dir))
    records = per_rank[0]
    hf_run = read_json(run_dir / HF_RUN_FILE)
    if hf_run:
        source, ds_config = "hf-trainer", hf_run.get("ds_config") or {}
        config = {"model": {"gradient_checkpointing": hf_run.get("args", {}).get("gradient_checkpointing")}}  # advice reads it
    else:
        source, ds_config, config = "zerofit", read_json(run_dir / "ds_config.json") or {}, read_yaml(
            run_dir / "config.yaml")
    plan = read_json(run_dir / "plan.json")
    facts = facts_from(records, ds_config, config, plan, source)
    ranks = rank_peaks(per_rank, facts)
    findings = across_ranks({rank: detect(timeline, facts) for rank, timeline in per_rank.items()})
    running_pid = runlock.holder(run_dir)
    # a run that goes on may remove the checkpoint being hashed (keep_last): sizes only while it runs
    by_hash = hashes and running_pid is None
    newest, damaged = checkpoint.find_latest_valid(checkpoints_of(run_dir), hashes=by_hash)
    findings += rank_imbalance(ranks, facts) + killed_ranks(run_dir, per_rank)
    findings += checkpoint_findings(run_dir, newest, damaged, running_pid is not None) + unusable_checkpoints(run_dir)
    every_rank = [record for timeline in per_rank.values() for record in timeline]
    checkpoint_bytes = newest_checkpoint_bytes(run_dir)
    notes = ([] if plan else [plan_missing_note(run_dir / "plan.json")]) + \
        ([] if hf_run else unreadable_run_files(run_dir, {"config.yaml": config, "ds_config.json": ds_config}))
    if not by_hash and newest is not None:
        why = "--no-hashes" if not hashes else "the run goes on, and its retention may remove one being read"
        notes.append(f"checkpoints checked by their files' sizes only ({why}): a file changed in place is not "
                     f"seen, and a resume, which checks hashes, may still skip the one named intact")
    if plan and checkpoint_bytes:
        notes.append(f"disk's measured figure is the newest checkpoint's size on disk ({human_bytes(checkpoint_bytes)}) "
                     f"times the {checkpoints_at_once(plan)} the plan holds at once (keep_last and the one being "
                     f"written): the run does not sample its disk use")

    report = newest_postmortem(run_dir)
    if report and resumed_after(per_rank.get(report["event"].get("rank", 0), records), report["event"].get("step")):
        report["resumed_afterwards"] = True  # its retry line would ask for what has happened
    return Diagnosis(run_dir, source, records, facts, findings,
                     plan_vs_measured(plan, per_rank, checkpoint_bytes), phase_peaks(records),
                     summarize(records, facts, every_rank), report,
                     checkpoint_bytes, notes, ranks, {rank: t for rank, t in per_rank.items() if rank},
                     running_pid, "" if running_pid is not None or source != "zerofit" else
                     how_it_ended(records, newest, killed_after(findings)))


def checkpoints_of(run_dir: Path) -> Path:
    """Where a run's checkpoints are: RUN_DIR/checkpoints, or for an earlier run set aside in
    checkpoints/earlier-TIME/ (resume.set_aside_earlier_run) that directory itself."""
    return run_dir if checkpoint.is_earlier_run(run_dir.absolute()) else run_dir / "checkpoints"


def killed_after(findings: list[Finding]) -> int | None:
    """The step a kill the run did not start again after came at (the earliest rank's)."""
    return min((f.step for f in findings if f.kind == "killed" and f.severity == "error"), default=None)


ENDINGS = {"completed": "completed", "sigterm": "stopped by SIGTERM", "interrupted": "interrupted (Ctrl-C)",
           "memory stop": "stopped by the memory watchdog (memory.watchdog_action: stop)"}


def how_it_ended(records: list[dict], newest: Path | None, killed_after: int | None = None) -> str:
    """`stopped by SIGTERM at step 8; newest intact checkpoint step-000008`: the `end` record the
    loop leaves (train.end_recorded; none after an OOM, whose post-mortem says it, or a kill,
    `killed_after` the step of its last record, which a finding explains), and what a resume or
    an export would take."""
    last_start = max((i for i, r in enumerate(records) if r.get("phase") == "start"), default=-1)
    end = next((r for r in reversed(records[last_start + 1:]) if r.get("phase") == "end"), None)
    trained = max((r["step"] for r in records if r.get("phase") not in EVENT_PHASES), default=0)
    parts = []
    if end is not None:
        reason = end.get("reason", "")
        said = ENDINGS.get(reason) or (f"stopped by an {reason}" if reason.startswith("error") else reason)
        parts.append(f"{said} at step {end['step']}")
    elif killed_after is not None:
        parts.append(f"killed outright after step {killed_after} (no end record; see the finding)")
    saved = checkpoint.step_of(newest) if newest is not None else 0
    last = end["step"] if end is not None else trained
    unsaved = f" (steps {saved + 1}-{last} in no intact checkpoint)" if last > saved + 1 else \
        f" (step {last} in no intact checkpoint)" if last == saved + 1 else ""
    parts.append(f"{f'newest intact checkpoint {newest.name}' if newest is not None else 'no intact checkpoint'}"
                 f"{unsaved}")
    return "; ".join(parts)


def checkpoint_findings(run_dir: Path, newest: Path | None, damaged: list[tuple[str, str]],
                        running: bool) -> list[Finding]:
    """Checkpoints newer than the newest intact one that cannot be loaded, and a save's
    partial write left by a process that ended while writing it (not while the run goes on)."""
    fallback = f"a resume and `zerofit export` take {newest.name}" if newest is not None else \
        ("no intact checkpoint is left: a resume refuses to start over them; start over "
         "with --no-resume (it moves them aside, not deletes), or restore a good copy") if damaged else \
        "no intact checkpoint is left: a resume starts over"
    found = [Finding("checkpoint_damaged", "warning", "disk", f"checkpoint {name} cannot be loaded: {reason}",
                     "a save cut short, or a file changed or lost after it was written", [fallback],
                     checkpoint.step_of(Path(name)))
             for name, reason in damaged]
    partial = sorted(checkpoints_of(run_dir).glob(f"{checkpoint.TMP_PREFIX}step-*")) if not running else []
    for path in partial:
        if (final := checkpoint.whole_save(path, hashes=False)) is not None:  # what the next start puts in place
            found.append(Finding("save_cut_short", "info", "disk", f"a save was killed before its rename: "
                                 f"checkpoints/{path.name} is whole (every file its manifest lists, at its size)",
                                 "the process ended between the save's manifest and its rename",
                                 [f"nothing to do: the next `zerofit train` verifies it, puts it in place as "
                                  f"{final.name} and resumes from it"]))
        else:
            found.append(Finding("save_cut_short", "info", "disk", f"a save was cut short: checkpoints/{path.name} is "
                                 f"a partial write", "the process ended while writing it (killed, or the machine "
                                 "went down)", [f"nothing to do: the next `zerofit train` removes it; {fallback}"]))
    return found


def unusable_checkpoints(run_dir: Path) -> list[Finding]:
    """Checkpoints a resume set aside as `unusable-step-N` (checkpoint.set_aside_unusable): why
    they did not verify, as recorded then, and the disk they hold, which no retention frees."""
    found = []
    for path in checkpoint.unusable(checkpoints_of(run_dir)):
        reason = (read_json(path / checkpoint.UNUSABLE_RECORD) or {}).get("reason") or \
            "why was not recorded (set aside by an older zerofit)"
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        step = checkpoint.step_of(Path(path.name.removeprefix(checkpoint.UNUSABLE_PREFIX)))
        found.append(Finding("checkpoint_unusable", "warning", "disk",
                             f"checkpoints/{path.name} ({human_bytes(size)} on disk) cannot be loaded: {reason}",
                             "a resume set it aside: it was newer than the checkpoint it resumed from and did not "
                             "verify; no resume, export or retention reads or deletes it",
                             [f"inspect it if you need to know what damaged it, then delete it to free "
                              f"{human_bytes(size)}: rm -r {shlex.quote(str(path))}"],
                             step if step >= 0 else None, {"bytes": size}))
    return found


def resumed_after(records: list[dict], oom_step: int | None) -> bool:
    """Whether the run started again after its OOM at `oom_step` (a retry, or a resume by hand)."""
    ooms = [i for i, r in enumerate(records) if r.get("phase") == "oom" and r.get("step") == oom_step]
    return bool(ooms) and any(r.get("phase") == "start" for r in records[ooms[-1] + 1:])


def newest_postmortem(run_dir: Path) -> dict | None:
    """The newest post-mortem report of any rank (postmortem/report.json is rank 0's,
    postmortem/rankN/ rank N's): with several ranks the one that ran out of memory may be any."""
    found = rank_files(run_dir, "report.json")
    return read_json(max(found, key=lambda p: p.stat().st_mtime)) if found else None


def killed_ranks(run_dir: Path, per_rank: dict[int, list[dict]]) -> list[Finding]:
    """Ranks that died without a word (zerofit/lastword.py left its record) after their last
    memory record: read in the rank's whole timeline, as written (a resume's effective timeline
    has dropped the steps it rolled back, so the last record before the kill moved to the save
    it resumed from: "killed 12.5 s after step 10, save" for a kill at step 12)."""
    from zerofit.lastword import RECORD

    found = []
    for path in rank_files(run_dir, RECORD):
        record = read_json(path) or {}
        rank = int(record.get("rank", 0))
        died_at = float(record.get("time", 0))
        went_on = any(r["time"] > died_at for timeline in per_rank.values() for r in timeline)
        written = read_timeline(run_dir, rank) or read_timeline(run_dir, 0)
        finding = killed_outright(rank, died_at, written, resumed=went_on)
        if finding:
            found.append(finding)
    return found


def no_timeline(run_dir: Path) -> str:
    """Why there is nothing to read: a memory.jsonl that holds no record (the run died before its
    first, or the file was emptied), a run that stopped before it was written, or no run at all."""
    timeline = timeline_path(run_dir)
    if timeline.is_file():
        return (f"{timeline} holds no memory record ({timeline.stat().st_size} bytes): the run stopped before "
                f"its first record was written, or the file was emptied; `zerofit train` writes one at its start "
                f"and at every step, so run it again (its log says why it stopped)")
    if (run_dir / "config.yaml").is_file():  # a zerofit run that ended before training began
        return (f"{run_dir} holds a run that stopped before training began (its config.yaml, no memory.jsonl: "
                f"the timeline starts when the engine is built); nothing to diagnose: its own output says why it "
                f"stopped, and `zerofit train --config {run_dir / 'config.yaml'}` starts it again")
    return (f"{run_dir} has no memory.jsonl: point `zerofit doctor` at a zerofit run directory, "
            f"or at an HF Trainer output_dir trained with zerofit.hf.MemoryGuardCallback()")


def rank_timelines(run_dir: Path) -> dict[int, list[dict]]:
    """Every rank's effective timeline: memory.jsonl is rank 0's, memory-rankN.jsonl rank N's."""
    ranks = timeline_ranks(run_dir)
    timelines = {rank: read_timeline(run_dir, rank) for rank in ranks}
    # a rank of an earlier attempt on more ranks (the run resumed on fewer) is history, not this run
    newest = next((r for r in reversed(timelines.get(0, [])) if r.get("phase") == "start"), {})
    world = newest.get("world_size") or len(ranks)
    return {rank: effective_records(raw) for rank, raw in timelines.items() if raw and rank < world}


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):  # JSONDecodeError and UnicodeDecodeError alike: a damaged file is unread
        return None


def plan_missing_note(path: Path) -> str:
    """Why there is no prediction to compare with: no plan.json, or one that does not read
    (a write cut short: train writes it again at the run's next start)."""
    if not path.exists():
        return "no plan.json in the run directory: nothing predicted to compare with"
    return unread_note("plan.json", "not JSON", "nothing predicted to compare with")


def unread_note(name: str, how: str, cost: str) -> str:
    """A run file there but unread: what the doctor does without it, and that a start writes it again."""
    return (f"{name} in the run directory cannot be read ({how}: a write cut short, or the file changed since): "
            f"{cost}; a start of the run that trains on writes it anew")


# what the doctor does without a run file it cannot read (plan.json: plan_missing_note)
UNREAD_COSTS = {"config.yaml": "the fixes name zerofit's defaults, not the run's settings",
                "ds_config.json": "the fixes that read DeepSpeed's settings (sub_group_size, offload) assume "
                                  "DeepSpeed's defaults"}


def unreadable_run_files(run_dir: Path, read: dict[str, dict]) -> list[str]:
    """Notes for the run's config.yaml and ds_config.json where they are there but `diagnose`
    read them as empty (`read`: what it read, by file name), which said nothing."""
    return [unread_note(name, "empty or damaged", cost) for name, cost in UNREAD_COSTS.items()
            if (run_dir / name).exists() and not read[name]]


def read_yaml(path: Path) -> dict:
    try:
        return yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, ValueError, yaml.YAMLError):
        return {}


def newest_checkpoint_bytes(run_dir: Path) -> int:
    """Size on disk of the newest checkpoint (zerofit's step-N or HF's checkpoint-N)."""
    candidates = [p for p in checkpoints_of(run_dir).glob("step-*") if p.is_dir()] + \
                 [p for p in run_dir.glob("checkpoint-*") if p.is_dir()]
    if not candidates:
        return 0
    newest = max(candidates, key=lambda p: int(p.name.rsplit("-", 1)[-1]) if p.name.rsplit("-", 1)[-1].isdigit() else -1)
    return sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())


# ---------------------------------------------------------------------------- pure analysis
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
                     "budget_bytes": entry.get("budget_bytes"), "error": relative_error(predicted, measured.get(device)),
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


# ---------------------------------------------------------------------------- the verb
def doctor(run_dir: str | Path, html: str | Path | None = None, console=None, hashes: bool = True) -> Diagnosis:
    """Diagnose RUN_DIR, print the terminal summary, write report.html (default:
    RUN_DIR/report.html)."""
    from zerofit import report

    diagnosis = diagnose(run_dir, hashes)
    page = report.render_html(diagnosis)
    out = Path(html) if html else Path(run_dir) / "report.html"
    if html:
        write_out(out, page)
        written = str(out)
    else:
        try:
            out.write_text(page)
            written = str(out)
        except OSError as e:  # someone else's run on a shared disk, a read-only mount: the summary still helps
            written = f"not written ({out}: {e.strerror or e}); --out FILE writes it elsewhere"
    report.print_summary(diagnosis, written, console)
    return diagnosis


def write_out(path: Path, text: str) -> None:
    """The file --out names (the report, or --repro's script), its missing folders made as
    `zerofit export --out` makes its own: a path for a new folder was a usage error. Written
    after the run was read, so a run that cannot be diagnosed leaves no folder behind."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as e:  # mkdir says "File exists" for a file where a folder would go: named as such
        in_the_way = next((parent for parent in path.parents if parent.is_file()), None)
        why = f"{in_the_way} is a file" if in_the_way else e.strerror or str(e)
        raise ConfigError(f"cannot write {path} ({why}); give --out a writable path") from None
