"""The OOM post-mortem in words, from its report dict alone (postmortem.conclude writes it as
report.json): the headline, the one-screen explanation a run exits with, the retry line and
command, the message a retry starts with, why a retry was not handed over, report.md; and
where each rank's post-mortem lies (postmortem/, postmortem/rankN/). Pure but for reading
that layout: the doctor, its report and repro render a post-mortem through this module
without importing the capture (postmortem.py imports the doctor).
"""
from __future__ import annotations

import shlex
from pathlib import Path

from zerofit.config.schema import Config
from zerofit.findings.facts import gib, label
from zerofit.recovery import elastic

MAX_RETRIES = 2  # memory.on_oom=retry's retries in one process (postmortem.run_with_oom_policy)


def directory_of(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / "postmortem" / ("" if rank == 0 else f"rank{rank}")


def rank_files(run_dir: Path, name: str) -> list[Path]:
    """`name` in every rank's post-mortem directory that holds one: rank 0's first, then by rank."""
    root = Path(run_dir) / "postmortem"
    ranked = sorted(root.glob(f"rank*/{name}"), key=lambda p: int(p.parent.name.removeprefix("rank") or 0))
    return [p for p in [root / name, *ranked] if p.is_file()]


def headline(event: dict) -> str:
    where = {"forward": "the forward pass", "backward": "the backward pass", "optimizer_step": "the optimizer step",
             "eval": "evaluation", "save": "the checkpoint save"}.get(event["phase"], event["phase"])
    asked = f", tried to allocate {gib(event['requested_bytes'])}" if event.get("requested_bytes") else ""
    return f"{label(event['device'])} out of memory in {where} of step {event['step']}{asked}"


def explanation(report: dict) -> str:
    """One screen: what, where it went, why, what to do."""
    event = report["event"]
    gpu = event.get("gpu", {})
    lines = [headline(event)]
    held = f"held: host RSS {gib(event['host_rss'])}"
    if gpu.get("gpu_reserved"):
        held = (f"held: GPU {gib(gpu['gpu_alloc'])} allocated, {gib(gpu['gpu_reserved'])} reserved; " +
                held.removeprefix("held: "))
    lines.append("  " + held)
    for row in report["plan"]:
        if row.get("predicted_bytes") and row.get("measured_bytes"):
            lines.append(f"  plan: {row['device']} predicted {gib(row['predicted_bytes'])}, "
                         f"measured {gib(row['measured_bytes'])} at the peak")
    oom = next((f for f in report["findings"] if f["kind"] == "oom"), None)
    if oom:
        lines.append(f"  likely cause: {oom['cause']}")
    for finding in [f for f in report["findings"] if f["kind"] != "oom"][:3]:
        lines.append(f"  finding: {finding['title']}")
    lines.append(f"  emergency checkpoint: {report['emergency_checkpoint'] or '-'} ({report['emergency_note']})")
    if report["changes"]:
        lines.append(f"  would fit: {' '.join(report['changes'])}")
        lines.append(retry_line(report))
    elif oom and oom["fix"]:
        lines.append(f"  fix: {'; '.join(oom['fix'][:2])}")
    directory = directory_of(Path(report["run_dir"]), event.get("rank", 0))
    lines.append(f"  details: {directory / 'report.md'}; `zerofit doctor {shlex.quote(str(report['run_dir']))}` "
                 f"renders the timeline")
    if event.get("snapshot"):
        lines.append(f"  allocator snapshot: {event['snapshot']} ({event['snapshot_note']})")
    return "\n".join(lines)


def retry_command(report: dict) -> str:
    """The command that runs the retry config, on as many ranks as the run had."""
    config = shlex.quote(str(report["retry_config"]))
    return f"{elastic.launcher(report['event']['world_size'])} train --config {config}"


def retry_line(report: dict) -> str:
    if report.get("resumed_afterwards"):  # set by the doctor, which reads the timeline after the OOM
        return "  retry: the run started again after this OOM (the doctor's OOM finding says with which settings)"
    if report.get("handed_over"):
        return f"  retry: {report['handed_over']}"
    command = retry_command(report)
    if report.get("retries_used_up") and report["event"]["world_size"] == 1:
        return (f"  retry: the {MAX_RETRIES} retries memory.on_oom=retry allows are used up; "
                f"{command} goes one step safer again")
    how = "memory.on_oom: retry / --on-oom retry" if report["event"]["world_size"] == 1 else \
        "with several ranks: memory.on_oom: retry under torchrun --max-restarts 1 or more"
    return f"  retry: {command}   (or {how})"


def retry_message(report: dict, retries_left: int) -> str:
    """What happened and what the retry does: the OOM, its post-mortem, where it restarts."""
    directory = directory_of(Path(report["run_dir"]), report["event"].get("rank", 0))
    start = f"the newest checkpoint ({Path(report['resume_from']).name})" if report.get("resume_from") else \
        "step 0 (no checkpoint was saved)"
    return (f"{headline(report['event'])} (post-mortem: {directory / 'report.md'})\n"
            f"[bold]memory.on_oom=retry[/]: restarting from {start} with {', '.join(report['changes'])} "
            f"({retries_left} more retr{'y' if retries_left == 1 else 'ies'} allowed)")


def why_not_retried(config: Config, safer: dict | None) -> str:
    if config.memory.on_oom == "retry":
        return "no safer settings are known (see the post-mortem's findings)"
    if safer:
        return "memory.on_oom is stop (--on-oom retry, or the retry-config.yaml there, trains on with safer settings)"
    return "memory.on_oom is stop"


def render_markdown(report: dict) -> str:
    event = report["event"]
    out = [f"# Out of memory: {headline(event)}", "", f"Run: `{report['run_dir']}`, {report['time']}, "
           f"rank {event['rank']} of {event['world_size']}", "", "```", event["message"], "```", ""]
    out += ["## Memory when it failed", "", "| | bytes | GiB |", "|---|---:|---:|"]
    gpu = event.get("gpu", {}) if event.get("gpu", {}).get("gpu_reserved") else {}  # zeros on a CPU run
    for key, value in {**gpu, "host_rss": event["host_rss"], "requested": event.get("requested_bytes") or 0}.items():
        out.append(f"| {key} | {value:,} | {value / 2**30:.2f} |")
    out += ["", "## Plan vs measured", ""]
    if report["plan"]:
        out += ["| device | predicted | measured peak | budget |", "|---|---:|---:|---:|"]
        out += [f"| {r['device']} | {gib(r.get('predicted_bytes') or 0)} | {gib(r.get('measured_bytes') or 0)} | "
                f"{gib(r.get('budget_bytes') or 0)} |" for r in report["plan"]]
    else:
        out.append("No plan.json in the run directory: nothing predicted to compare with.")
    out += ["", "## Findings", ""]
    for f in report["findings"] or [{"severity": "info", "title": "none", "cause": "", "fix": []}]:
        out.append(f"- **{f['severity']}**: {f['title']}")
        if f["cause"]:
            out.append(f"  - cause: {f['cause']}")
        out += [f"  - fix: {fix}" for fix in f["fix"]]
    out += ["", "## What would fit", ""]
    if report["changes"]:
        out += [f"- `{c}`" for c in report["changes"]]
        out += ["", f"Retry with `{retry_command(report)}`, or set `memory.on_oom: retry`."]
    else:
        out.append("No safer setting is left to try automatically; see the findings' fixes.")
    out += ["", "## Emergency checkpoint", "", f"{report['emergency_checkpoint'] or '-'}: {report['emergency_note']}",
            "", "## Allocator snapshot", "", f"{event.get('snapshot') or '-'}: {event.get('snapshot_note', '')}", "",
            "## The last steps' phases", "", "| step | phase | gpu_alloc | gpu_peak | gpu_reserved | host_rss |",
            "|---:|---|---:|---:|---:|---:|"]
    out += [f"| {r['step']} | {r['phase']} | {gib(r.get('gpu_alloc', 0))} | {gib(r.get('gpu_peak', 0))} | "
            f"{gib(r.get('gpu_reserved', 0))} | {gib(r.get('host_rss', 0))} |" for r in report["last_step"]]
    return "\n".join(out) + "\n"
