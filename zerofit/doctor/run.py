"""`zerofit doctor RUN_DIR`: read a run directory (zerofit's, or an HF Trainer output_dir
written by zerofit.integrations.hf_trainer.MemoryGuardCallback) and explain its memory: the timeline with
saves, evals and OOMs, plan vs measured, findings with fixes, the post-mortem.

Reading files happens in `diagnose`; everything it computes comes from pure functions
(detectors.detect, and measured.py's plan_vs_measured, phase_peaks, summarize); report.py renders.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from zerofit.checkpoint import files as checkpoint
from zerofit.checkpoint.files import checkpoints_of, newest_checkpoint_bytes
from zerofit.core import runlock
from zerofit.core.errors import ConfigError
from zerofit.core.files import read_json, read_jsonl, write_atomic
from zerofit.core.timeline import (
    EVENT_PHASES,
    effective_records,
    human_bytes,
    read_timeline,
    timeline_path,
    timeline_ranks,
)
from zerofit.doctor import report
from zerofit.findings.detectors import detect, step_time_gap
from zerofit.findings.facts import Finding, RunFacts, facts_from
from zerofit.findings.measured import (
    checkpoints_at_once,
    phase_peaks,
    plan_vs_measured,
    rank_peaks,
    step_time,
    summarize,
)
from zerofit.findings.ranks import across_ranks, killed_after, killed_outright, rank_imbalance
from zerofit.recovery.oomreport import rank_files
from zerofit.recovery.peerwatch import RECORD

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
    step_time: dict | None = None  # predicted vs measured step seconds (measured.step_time)

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
    steps = step_time(plan, read_jsonl(run_dir / "metrics.jsonl"), records)
    findings += step_time_gap(steps)
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
                     how_it_ended(records, newest, killed_after(findings)), steps)




ENDINGS = {"completed": "completed", "sigterm": "stopped by SIGTERM", "ctrl-c": "stopped by Ctrl-C",
           "interrupted": "interrupted (Ctrl-C)",
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
            "why was not recorded (the disk was full when it was set aside)"
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
    """Ranks that died without a word (zerofit/recovery/lastword.py left its record) after their last
    memory record: read in the rank's whole timeline, as written (a resume's effective timeline
    has dropped the steps it rolled back, so the last record before the kill moved to the save
    it resumed from: "killed 12.5 s after step 10, save" for a kill at step 12)."""

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
            f"or at an HF Trainer output_dir trained with zerofit.integrations.hf_trainer.MemoryGuardCallback()")


def rank_timelines(run_dir: Path) -> dict[int, list[dict]]:
    """Every rank's effective timeline: memory.jsonl is rank 0's, memory-rankN.jsonl rank N's."""
    ranks = timeline_ranks(run_dir)
    timelines = {rank: read_timeline(run_dir, rank) for rank in ranks}
    # a rank of an earlier attempt on more ranks (the run resumed on fewer) is history, not this run
    newest = next((r for r in reversed(timelines.get(0, [])) if r.get("phase") == "start"), {})
    world = newest.get("world_size") or len(ranks)
    return {rank: effective_records(raw) for rank, raw in timelines.items() if raw and rank < world}


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



# ---------------------------------------------------------------------------- the verb
def doctor(run_dir: str | Path, html: str | Path | None = None, console=None, hashes: bool = True) -> Diagnosis:
    """Diagnose RUN_DIR, print the terminal summary, write report.html (default:
    RUN_DIR/report.html)."""

    diagnosis = diagnose(run_dir, hashes)
    page = report.render_html(diagnosis)
    out = Path(html) if html else Path(run_dir) / "report.html"
    if html:
        write_out(out, page)
        written = str(out)
    else:
        try:
            write_atomic(out, page)  # a link planted at report.html is replaced, never written through
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
