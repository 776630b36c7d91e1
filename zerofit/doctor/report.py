"""Rendering for `zerofit doctor`: a self-contained report.html (matplotlib PNGs embedded as
base64, inline CSS, no scripts, nothing fetched) and a terminal summary (rich). Only
presentation here; doctor.py and the detectors (detectors.py) decide what is said."""
from __future__ import annotations

import base64
import html
import io
import sys
from pathlib import Path

from zerofit.core.console import counted
from zerofit.findings.facts import gib
from zerofit.findings.measured import NOT_WRITTEN
from zerofit.findings.ranks import killed_after
from zerofit.plan.loadpeak import LOADING
from zerofit.recovery.oomreport import directory_of, explanation

PHASE_OFFSET = {"start": 0.0, "forward": 0.3, "forward_backward": 0.5, "backward": 0.6, "optimizer_step": 0.9,
                "eval": 0.95, "save": 1.0, "watchdog": 1.0, "checkpoint_failed": 1.0, "end": 1.0}
MARKERS = {"save": ("#2e7d32", "-", "save"), "eval": ("#1565c0", ":", "eval"), "oom": ("#c62828", "-", "OOM"),
           "watchdog": ("#ef6c00", "--", "watchdog"), "start": ("#757575", "-.", "start / resume"),
           "checkpoint_written": ("#81c784", ":", "async save published"),
           "checkpoint_failed": ("#6a1b9a", "-", "save failed"), "end": ("#212121", "-", "end")}
PLAN_ERROR = "error (planned - measured) / measured"  # + : the plan counted more than the run used
SEVERITY_COLOUR = {"error": "#c62828", "warning": "#ef6c00", "info": "#1565c0"}
RANK_COLOURS = ("#00897b", "#f9a825", "#5e35b1", "#6d4c41", "#d81b60", "#546e7a", "#7cb342")
MAX_POINTS = 3000  # beyond this the timeline is drawn per step (the step's highest reading)
PLOTTED_KEYS = ("gpu_alloc", "gpu_peak", "gpu_peak_reserved", "host_rss", "host_peak", "pinned", "nvme_swap",
                "host_avail", "predicted_gpu_peak", "predicted_host_rss")


# ---------------------------------------------------------------------------- plots
def x_of(record: dict) -> float:
    if record["phase"] == "oom":
        return record["step"] - 1 + PHASE_OFFSET.get(record.get("failed_phase", "forward"), 0.5)
    if record["phase"] == "start":
        return record["step"]
    return record["step"] - 1 + PHASE_OFFSET.get(record["phase"], 0.5)


def per_step(records: list[dict], keys: tuple[str, ...]) -> list[dict]:
    """Long runs: one point per step holding the step's largest readings."""
    merged: dict[int, dict] = {}
    for r in records:
        row = merged.setdefault(r["step"], {"step": r["step"], "phase": "optimizer_step"})
        for key in keys:
            if key in r:
                row[key] = max(row.get(key, 0), r[key])
    return list(merged.values())


def png(figure) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(figure)
    return base64.b64encode(buffer.getvalue()).decode()


def timeline_png(diagnosis) -> str:
    """GPU and host memory over the run, with saves, evals, OOMs and the watchdog marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records, facts, on_gpu = diagnosis.records, diagnosis.facts, diagnosis.summary["on_gpu"]
    training = plotted(records)
    panels = [("gpu", "GPU")] if on_gpu else []
    panels.append(("host", "host"))
    figure, axes = plt.subplots(len(panels), 1, figsize=(12, 3.6 * len(panels)), sharex=True, squeeze=False)
    xs = [x_of(r) for r in training]
    for ax, (device, label) in zip(axes[:, 0], panels):
        if device == "gpu":
            series = [("gpu_peak_reserved", "reserved at the peak", "#8e24aa", "-"),
                      ("gpu_peak", "allocated, peak", "#c62828", "-"), ("gpu_alloc", "allocated, end of phase",
                                                                       "#1e88e5", "-"),
                      ("predicted_gpu_peak", "planned peak", "#424242", ":")]
            budget = facts.gpu_budget
        else:
            series = [("host_peak", "RSS, peak", "#c62828", "-"), ("host_rss", "RSS, end of phase", "#1e88e5", "-"),
                      ("pinned", "pinned", "#43a047", "-"), ("nvme_swap", "NVMe swap files (disk)", "#6d4c41", "--"),
                      ("predicted_host_rss", "planned RSS", "#424242", ":")]
            if facts.host_budget_is_machine and facts.host_total:
                used = f"in use in the cgroup ({facts.host_limit})" if facts.host_limit else "machine-wide in use"
                series.append(("machine_used", used, "#9e9e9e", "-"))
            budget = facts.host_budget
        top = 0.0
        for key, name, colour, style in series:
            values = [reading(r, key, facts) for r in training]
            if any(values):
                name = f"rank 0: {name}" if diagnosis.other_ranks and key != "machine_used" else name
                # a record without the reading (no prediction for it) is a gap, not a fall to zero
                ax.plot(xs, [v / 2**30 if v is not None else float("nan") for v in values], style, color=colour,
                        label=name, linewidth=1.4)
                top = max(top, max(v or 0 for v in values) / 2**30)
        for rank, (rank_xs, peaks) in other_rank_peaks(diagnosis, device).items():
            ax.plot(rank_xs, peaks, "-", color=RANK_COLOURS[rank % len(RANK_COLOURS)], linewidth=1.1,
                    label=f"rank {rank}, peak")
            top = max(top, max(peaks, default=0))
        top = top * 1.3 or 1.0
        if draw_budget(ax, budget, top * 2**30):
            top = max(top, budget / 2**30 * 1.08)
        ax.set_ylim(0, top)
        draw_markers(ax, records + kill_marks(diagnosis))
        ax.set_ylabel(f"{label} memory (GiB)")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, framealpha=0.9)
    axes[-1, 0].set_xlabel("optimizer step")
    figure.suptitle("Memory timeline", fontsize=12)
    figure.tight_layout()
    return png(figure)


def draw_budget(ax, budget_bytes: int, reach_bytes: float, name: str = "budget") -> bool:
    """The budget as a dashed line when it is within 1.6x of what the chart reaches, else only
    named in the legend (a far line would flatten what is drawn to nothing); True when drawn.
    The timeline's is what the watchdog measures against (the machine's RAM or plan.host_mem),
    the plan chart's what the planner counted free of it."""
    if not budget_bytes:
        return False
    if budget_bytes <= 1.6 * reach_bytes:
        ax.axhline(budget_bytes / 2**30, color="#b71c1c", linestyle="--", linewidth=1,
                   label=f"{name} {gib(budget_bytes)}")
        return True
    ax.plot([], [], " ", label=f"{name} {gib(budget_bytes)} (above the chart)")
    return False


def plotted(records: list[dict]) -> list[dict]:
    """A timeline's training phases in plot order, one point per step on long runs."""
    training = [r for r in records if r["phase"] not in MARKERS]
    if len(training) > MAX_POINTS:
        training = per_step(training, PLOTTED_KEYS)
    return sorted(training, key=x_of)


def other_rank_peaks(diagnosis, device: str) -> dict[int, tuple[list[float], list[float]]]:
    """Per rank > 0: x positions and its peak readings in GiB (GPU allocated, or host RSS), so
    a rank that behaves differently from rank 0 shows in the same panel."""
    key = "gpu_peak" if device == "gpu" else "host_peak"
    drawn = {}
    for rank, records in diagnosis.other_ranks.items():
        training = plotted(records)
        drawn[rank] = ([x_of(r) for r in training], [r.get(key, 0) / 2**30 for r in training])
    return drawn


def reading(record: dict, key: str, facts) -> int | None:
    if key == "machine_used":  # what the watchdog counts when the budget is the machine
        return facts.host_total - record["host_avail"] if record.get("host_avail") else None
    return record.get(key)


def kill_marks(diagnosis) -> list[dict]:
    """A kill leaves no `end` record: marked as one where its finding places it."""

    step = killed_after(diagnosis.findings)
    return [] if step is None else [{"phase": "end", "reason": "killed outright", "step": step}]


def draw_markers(ax, records: list[dict]) -> None:
    labelled = set()
    for r in records:
        if r["phase"] not in MARKERS or (r["phase"] == "start" and r["step"] == 0):
            continue
        colour, style, name = MARKERS[r["phase"]]
        width = 2.2 if r["phase"] == "oom" else 1
        ax.axvline(x_of(r), color=colour, linestyle=style, linewidth=width, alpha=0.8,
                   label=None if name in labelled else name)
        labelled.add(name)
        if r["phase"] == "oom":
            ax.annotate(f"OOM ({r.get('failed_phase', '?')})", (x_of(r), ax.get_ylim()[1] * 0.92),
                        color=colour, fontsize=9, ha="right", fontweight="bold")
        elif r["phase"] == "end" and r.get("reason") != "completed":
            ax.annotate(r.get("reason", "end")[:40], (x_of(r), ax.get_ylim()[1] * 0.92), color=colour, fontsize=9,
                        ha="right")


def stacked(row: dict) -> list[dict]:
    """The components the plan chart stacks: the planned figure the table gives, without the
    free space a save asks of the disk (measured.NOT_WRITTEN), which is never written."""

    return [c for c in row["components"] if c["name"] not in NOT_WRITTEN]


def plan_png(diagnosis) -> str:
    """Per device: the plan's components stacked, next to the measured peak."""
    return png(plan_figure(diagnosis))


def plan_figure(diagnosis):
    """plan_png's figure. Each legend sits below its chart: inside, it covered the planned bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = plan_rows(diagnosis)
    figure, axes = plt.subplots(1, len(rows), figsize=(4 * len(rows), 3.6), squeeze=False)
    for ax, row in zip(axes[0], rows):
        bottom = 0.0
        # the stack is the planned bar the table gives: room a save asks of the disk is not in it
        for component in stacked(row):
            height = component["predicted_bytes"] / 2**30
            tall = height > 0.07 * max(row["predicted_bytes"] or 1, row["measured_bytes"] or 1) / 2**30
            ax.bar(0, height, bottom=bottom, width=0.6, edgecolor="white", linewidth=0.5,
                   label=None if tall else component["name"])  # a segment too thin to name is in the legend
            if tall:
                ax.text(0, bottom + height / 2, component["name"], ha="center", va="center", fontsize=7)
            bottom += height
        if not row["components"]:
            ax.bar(0, (row["predicted_bytes"] or 0) / 2**30, width=0.6, color="#90a4ae")
        ax.bar(1, (row["measured_bytes"] or 0) / 2**30, width=0.6, color="#455a64")
        tallest = max(row["predicted_bytes"] or 0, row["measured_bytes"] or 0)
        draw_budget(ax, row.get("budget_bytes") or 0, tallest, "the planner's budget")
        ax.set_xticks([0, 1], ["planned", "measured"])
        ax.set_title(row["device"])
        ax.set_ylabel("GiB")
    figure.tight_layout()  # before the legends: laid out with them, the charts shrank to a strip
    for ax in axes[0]:
        if ax.get_legend_handles_labels()[0]:  # below the chart (savefig's tight box takes it in)
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, frameon=False)
    return figure


# ---------------------------------------------------------------------------- HTML
CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1280px;color:#212121;
  padding:0 16px}
h1{font-size:24px;margin-bottom:4px} h2{font-size:18px;border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:28px}
.sub{color:#616161;margin-top:0} .cards{display:flex;flex-wrap:wrap;gap:10px;margin:14px 0}
.card{border:1px solid #e0e0e0;border-radius:6px;padding:8px 14px;min-width:130px;background:#fafafa}
.card b{display:block;font-size:18px} .card span{color:#616161;font-size:12px}
.finding{border-left:5px solid;padding:6px 12px;margin:10px 0;background:#fafafa}
.finding h3{margin:2px 0 6px;font-size:15px} .finding p{margin:4px 0} .finding ul{margin:4px 0 4px 18px;padding:0}
.sev{font-size:11px;text-transform:uppercase;font-weight:bold;margin-right:6px}
table{border-collapse:collapse;margin:8px 0;font-size:13px} th,td{border:1px solid #e0e0e0;padding:4px 10px}
th{background:#f5f5f5;text-align:left} td.n{text-align:right;font-variant-numeric:tabular-nums}
img{max-width:100%;border:1px solid #eee} pre{background:#f5f5f5;padding:10px;white-space:pre-wrap;font-size:12px}
.ok{color:#2e7d32;font-weight:bold} footer{color:#9e9e9e;font-size:12px;margin-top:30px}
"""


def esc(text) -> str:
    return html.escape(str(text))


def host_budget_kind(diagnosis) -> str:
    """What the host budget the watchdog measured against is: the machine's RAM, unless
    plan.host_mem set one or the run's cgroup capped it (the plan table's budget is what the
    planner counted free)."""
    if not diagnosis.facts.host_budget_is_machine:
        return "plan.host_mem"
    return diagnosis.facts.host_limit or "machine RAM"


def host_budgets_note(diagnosis) -> str:
    """The report's host budgets, each named: the one the watchdog and the findings measure
    against, and the planner's (what it counted free when it planned, less plan.headroom)."""
    s = diagnosis.summary
    host = next((row for row in diagnosis.plan if row["device"] == "host" and row.get("budget_bytes")), None)
    if not s["host_budget"] or not host:
        return ""
    counted = "machine-wide use" if diagnosis.facts.host_budget_is_machine else "this run's RSS"
    usable = f" ({gib(host['usable_bytes'])} usable after plan.headroom)" if host.get("usable_bytes") else ""
    return (f"host budgets: the watchdog and the findings count {counted} against the {host_budget_kind(diagnosis)}, "
            f"{gib(s['host_budget'])}; the planner's budget is the {gib(host['budget_bytes'])} it counted free when it "
            f"planned{usable}")


def step_time_line(diagnosis) -> str:
    """Predicted against measured step time, with how busy the machine was ("" without both)."""
    step = diagnosis.step_time
    if not step:
        return ""
    machine = ""
    if step.get("load_avg") is not None:
        machine = f"; load average {step['load_avg']:.1f} on {step['cpu_cores']} core(s)"
        machine += f", the run got {step['cores_used']:.2f} cores' worth of CPU" if step.get("cores_used") else ""
    return (f"step time: predicted {step['predicted_s']:.2f} s (plan.json), measured {step['measured_s']:.2f} s "
            f"(median of {step['steps']} steady steps, metrics.jsonl): {step['ratio']:.1f}x{machine}")


def saves_phrase(summary: dict) -> str:
    """`4 saves`, `3 saves (1 failed, 1 unfinished: being written when the timeline ends)`."""
    extra = [f"{summary['saves_failed']} failed"] if summary["saves_failed"] else []
    if summary["saves_unfinished"]:
        extra.append(f"{summary['saves_unfinished']} unfinished: being written when the timeline ends")
    return counted(summary["saves"], "save") + (f" ({', '.join(extra)})" if extra else "")


def cards(diagnosis) -> str:
    s = diagnosis.summary
    items = [(s["steps"], "steps"), (s["saves"], "saves")]
    items += [(s[key], label) for key, label in (("saves_failed", "saves failed"),
                                                 ("saves_unfinished", "saves unfinished")) if s[key]]
    items.append((s["evals"], "evals"))
    if s["on_gpu"]:
        budget = f" / {gib(s['gpu_budget'])}" if s["gpu_budget"] else ""
        items.append((gib(s["gpu_peak_reserved"]) + budget, "GPU peak reserved"))
    budget = f" / {gib(s['host_budget'])}" if s["host_budget"] else ""
    items.append((gib(s["host_peak"]) + budget, "host peak RSS / " + host_budget_kind(diagnosis)))
    if s["pinned"]:
        items.append((gib(s["pinned"]), "pinned"))
    if s["nvme_swap"]:
        items.append((gib(s["nvme_swap"]), "NVMe swap"))
    if s["ooms"]:
        items.append((s["ooms"], "OOM"))
    errors = sum(f.severity == "error" for f in diagnosis.findings)
    items.append((f"{len(diagnosis.findings)} ({counted(errors, 'error')})", "findings"))
    return "<div class=cards>" + "".join(f"<div class=card><b>{esc(v)}</b><span>{esc(k)}</span></div>"
                                         for v, k in items) + "</div>"


def findings_html(findings) -> str:
    if not findings:
        return "<p class=ok>No findings: no residue after saves, no growth, no fragmentation, within budget.</p>"
    parts = []
    for f in findings:
        colour = SEVERITY_COLOUR[f.severity]
        fixes = "".join(f"<li>{esc(fix)}</li>" for fix in f.fix)
        parts.append(f"<div class=finding style='border-color:{colour}'><h3><span class=sev style='color:{colour}'>"
                     f"{esc(f.severity)}</span>{esc(f.title)}</h3><p><b>Likely cause:</b> {esc(f.cause)}</p>"
                     f"<p><b>Fix:</b></p><ul>{fixes}</ul></div>")
    return "".join(parts)


def table(headers: list[str], rows: list[list], numeric: set[int] = frozenset()) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td class=n>{esc(c)}</td>" if i in numeric else f"<td>{esc(c)}</td>"
                                    for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def phases_html(diagnosis) -> str:
    on_gpu = diagnosis.summary["on_gpu"]
    headers = ["phase", "records"] + (["GPU peak allocated", "GPU peak reserved", "at step"] if on_gpu else []) + \
        ["host peak RSS", "at step"]
    rows = []
    for p in diagnosis.phases:
        gpu = [gib(p["gpu_peak"]), gib(p["gpu_peak_reserved"]), p["gpu_step"]] if on_gpu else []
        rows.append([p["phase"], p["count"], *gpu, gib(p["host_peak"]), p["host_step"]])
    return table(headers, rows, set(range(1, len(headers))))


def ranks_html(diagnosis) -> str:
    """One row per rank; the findings, plan and peaks above them cover every rank's timeline
    (the plot and the per-phase table are rank 0's)."""
    on_gpu = diagnosis.summary["on_gpu"]
    headers = ["rank", "steps"] + (["GPU peak allocated", "GPU peak reserved"] if on_gpu else []) + ["host peak RSS"]
    rows = [[r["rank"], r["steps"], *([gib(r["gpu_peak"]), gib(r["gpu_peak_reserved"])] if on_gpu else []),
             gib(r["host_peak"])] for r in diagnosis.ranks]
    return table(headers, rows, set(range(1, len(headers))))


def plan_rows(diagnosis) -> list[dict]:
    """The plan's devices that hold anything (a CPU-only run's GPU row is all zeros)."""
    return [row for row in diagnosis.plan if row["predicted_bytes"] or row["measured_bytes"]] or diagnosis.plan


def plan_html(diagnosis) -> str:
    if not diagnosis.plan:
        return f"<p>{esc(' '.join(diagnosis.notes) or 'no plan')}</p>"
    rows = []
    for row in plan_rows(diagnosis):
        error = f"{row['error']:+.0%}" if row["error"] is not None else "-"
        rows.append([row["device"], "total", gib(row["predicted_bytes"] or 0), gib(row["measured_bytes"] or 0), error,
                     gib(row["budget_bytes"]) if row.get("budget_bytes") else "-"])
        for c in row["components"]:
            measured = gib(c["measured_bytes"]) if c["measured_bytes"] is not None else "not measured alone"
            rows.append(["", c["name"], gib(c["predicted_bytes"]), measured, "", ""])
        for phase in (p for p in row["phases"] if p["predicted_bytes"] or p["measured_bytes"]):
            rows.append(["", f"phase {phase['phase']}", gib(phase["predicted_bytes"]), gib(phase["measured_bytes"]),
                         "", ""])
    return f"<img alt='plan vs measured' src='data:image/png;base64,{plan_png(diagnosis)}'>" + table(
        ["device", "component", "planned", "measured", PLAN_ERROR, "planner's budget"], rows, {2, 3, 4, 5}) + \
        "".join(f"<p class='note'>{esc(note)}</p>" for note in [*diagnosis.notes, host_budgets_note(diagnosis)] if note)


def postmortem_html(report: dict | None) -> str:
    if not report:
        return "<p>No out-of-memory error in this run.</p>"
    event = report["event"]
    snapshot = event.get("snapshot") or "none:"
    changes = "".join(f"<li><code>{esc(c)}</code></li>" for c in report["changes"]) or "<li>none left to try</li>"
    return (f"<pre>{esc(explanation(report))}</pre><p><b>Error:</b></p><pre>{esc(event['message'])}</pre>"
            f"<p><b>Emergency checkpoint:</b> {esc(report['emergency_checkpoint'] or '-')} "
            f"({esc(report['emergency_note'])})</p><p><b>Would fit:</b></p><ul>{changes}</ul>"
            f"<p><b>Allocator snapshot:</b> {esc(snapshot)} {esc(event.get('snapshot_note', ''))}</p>"
            f"<p>Full report: <code>{esc(directory_of(Path(report['run_dir']), event.get('rank', 0)) / 'report.md')}"
            f"</code></p>")


def render_html(diagnosis) -> str:
    source = {"zerofit": "zerofit run", "hf-trainer": "HF Trainer run (MemoryGuardCallback)"}[diagnosis.source]
    device = "GPU" if diagnosis.summary["on_gpu"] else "CPU only"
    return f"""<!doctype html>
<html lang=en><head><meta charset=utf-8><title>zerofit doctor: {esc(diagnosis.run_dir.name)}</title>
<style>{CSS}</style></head><body>
<h1>zerofit doctor: {esc(diagnosis.run_dir.name)}</h1>
<p class=sub>{esc(source)} in <code>{esc(diagnosis.run_dir)}</code>, {esc(device)}</p>
{f"<p class=sub>{esc(diagnosis.running_note)}</p>" if diagnosis.running_note else ""}
{f"<p class=sub>ended: {esc(diagnosis.ending)}</p>" if diagnosis.ending else ""}
{cards(diagnosis)}
{f"<p>{esc(step_time_line(diagnosis))}</p>" if diagnosis.step_time else ""}
<h2>Findings</h2>{findings_html(diagnosis.findings)}
<h2>Memory timeline</h2>
<img alt='memory timeline' src='data:image/png;base64,{timeline_png(diagnosis)}'>
<p class=sub>Peaks are per phase (the allocator's and the kernel's high-water marks, reset at every phase).
Vertical lines: saves, evals, resumes, watchdog actions, the OOM and where the run ended.</p>
<h2>Peaks per phase{" (rank 0)" if diagnosis.other_ranks else ""}</h2>{phases_html(diagnosis)}
{f"<h2>Ranks</h2>{ranks_html(diagnosis)}" if len(diagnosis.ranks) > 1 else ""}
<h2>Plan vs measured</h2>{plan_html(diagnosis)}
<h2>Out-of-memory post-mortem</h2>{postmortem_html(diagnosis.postmortem)}
<footer>zerofit doctor {esc(diagnosis.run_dir)} &middot; memory.jsonl: {len(diagnosis.records)} records</footer>
</body></html>
"""


# ---------------------------------------------------------------------------- terminal
def print_summary(diagnosis, html_path: str, console=None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    # piped into a file or grep: one line per line, not wrapped at 80 columns mid-figure
    console = console or Console(highlight=False, soft_wrap=not sys.stdout.isatty())
    s = diagnosis.summary
    gpu = f"GPU peak {gib(s['gpu_peak_reserved'])} reserved" + (f" of {gib(s['gpu_budget'])}" if s["gpu_budget"]
                                                                 else "") + ", " if s["on_gpu"] else ""
    console.print(f"[bold]zerofit doctor[/] {diagnosis.run_dir} ({diagnosis.source}): {s['steps']} steps, "
                  f"{saves_phrase(s)}, {counted(s['evals'], 'eval')}, {gpu}host peak {gib(s['host_peak'])}"
                  + (f" of {gib(s['host_budget'])} ({host_budget_kind(diagnosis)})" if s["host_budget"] else ""))
    loading = next((phase for row in diagnosis.plan if row["device"] == "host" for phase in row["phases"]
                    if phase["phase"] == LOADING), None)
    if loading or s.get("data_load_host_peak", 0) > s["host_peak"]:
        planned = f"planned {gib(loading['predicted_bytes'])}" if loading else "not in plan.json"
        console.print(f"before training: loading the data peaked at {gib(s['data_load_host_peak'])} host ({planned}; "
                      f"each example's token lists while tokenizing, before they are packed)")
    if step_time_line(diagnosis):
        console.print(escape(step_time_line(diagnosis)))
    if diagnosis.running_note:
        console.print(f"[yellow]{escape(diagnosis.running_note)}[/]")
    if diagnosis.ending:
        console.print(f"ended: {escape(diagnosis.ending)}")
    if len(diagnosis.ranks) > 1:
        console.print("ranks: " + "; ".join(
            f"{r['rank']}: " + (f"GPU {gib(r['gpu_peak_reserved'])} reserved, " if s["on_gpu"] else "")
            + f"host {gib(r['host_peak'])}" for r in diagnosis.ranks))
    colour = {"error": "red", "warning": "yellow", "info": "blue"}
    for f in diagnosis.findings:
        console.print(f"[bold {colour[f.severity]}]{f.severity}[/] {escape(f.title)}")
        console.print(f"  [dim]cause:[/] {escape(f.cause)}")
        for fix in f.fix:
            console.print(f"  [green]fix:[/] {escape(fix)}")
    if not diagnosis.findings:
        console.print("[green]no findings[/]: no residue after saves, no growth, no fragmentation, within budget")
    if diagnosis.plan:
        plan = Table(title="plan vs measured", title_justify="left")
        for column in ("device", "planned", "measured", PLAN_ERROR):
            plan.add_column(column, justify="right" if column != "device" else "left")
        for row in plan_rows(diagnosis):
            plan.add_row(row["device"], gib(row["predicted_bytes"] or 0), gib(row["measured_bytes"] or 0),
                         f"{row['error']:+.0%}" if row["error"] is not None else "-")
        console.print(plan)
    for note in [*diagnosis.notes, host_budgets_note(diagnosis)]:  # also without a plan: the note that there is none
        if note:
            console.print(f"[dim]note: {escape(note)}[/]")
    if diagnosis.postmortem:
        console.print("[bold red]out-of-memory post-mortem[/]")
        console.print(explanation(diagnosis.postmortem), markup=False)
    console.print(f"report: {html_path}")
