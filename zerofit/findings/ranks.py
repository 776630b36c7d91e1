"""Findings across a run's ranks (pure, as findings.py): every rank's findings as one list,
ranks that peak unevenly, and a rank killed outright (its last word's record beside its
memory timeline). `zerofit doctor` feeds them the ranks' timelines and peaks.
"""
from __future__ import annotations

from dataclasses import replace

from zerofit.findings.facts import EVENT_KINDS, SEVERITY_ORDER, Finding, RunFacts, gib, significant_bytes


def across_ranks(per_rank: dict[int, list[Finding]]) -> list[Finding]:
    """One list from every rank's findings. A finding of the same kind on the same device
    on several ranks is listed once (the lowest rank's numbers), its evidence naming the
    ranks; one that only some ranks of several show says which in its title."""
    ranks = sorted(per_rank)
    grouped: dict[tuple[str, str], list[tuple[int, Finding]]] = {}
    for rank in ranks:
        for finding in per_rank[rank]:
            occurrence = finding.step if finding.kind in EVENT_KINDS else None  # each OOM is its own
            grouped.setdefault((finding.kind, finding.device, occurrence), []).append((rank, finding))
    merged = []
    for seen in grouped.values():
        first = seen[0][1]
        on = sorted({rank for rank, _ in seen})
        if len(ranks) == 1:
            merged.append(first)
            continue
        title = first.title if on == ranks else f"rank{'s' * (len(on) > 1)} {', '.join(map(str, on))}: {first.title}"
        merged.append(replace(first, title=title, evidence={**first.evidence, "ranks": on}))
    return sorted(merged, key=lambda f: (SEVERITY_ORDER[f.severity], f.kind != "oom"))


def rank_imbalance(peaks: list[dict], facts: RunFacts, uneven: float = 0.10) -> list[Finding]:
    """`peaks`: one row per rank with gpu_peak and host_peak (measured.rank_peaks). ZeRO-3
    gives every rank an equal share of the model states, so ranks of one run should peak
    alike; one peaking over `uneven` above the lowest (and by a significant amount) is
    the one that will run out first, and the planner's per-rank prediction does not cover it."""
    found = []
    for device, key in (("gpu", "gpu_peak"), ("host", "host_peak")):
        readings = [(row["rank"], row[key]) for row in peaks if row[key]]
        if len(readings) < 2:
            continue
        (low_rank, low), (high_rank, high) = min(readings, key=lambda r: r[1]), max(readings, key=lambda r: r[1])
        if high - low <= significant_bytes(facts, device) or high <= low * (1 + uneven):
            continue
        fix = ["pad or pack every micro batch to train.seq_len so that all ranks run the same shapes",
               f"look for other processes on rank {high_rank}'s {'GPU' if device == 'gpu' else 'node'} "
               f"({'nvidia-smi' if device == 'gpu' else 'top'})",
               "plan with the highest rank's peak: leave the difference as extra plan.headroom"]
        found.append(Finding("rank_imbalance", "warning", device,
                             f"rank {high_rank}'s {'GPU' if device == 'gpu' else 'host'} memory peaks at {gib(high)}, "
                             f"{high / low - 1:.0%} above rank {low_rank}'s ({gib(low)})",
                             "ranks hold equal shares of the ZeRO-3 states, so the difference is per-rank work: "
                             "longer sequences or larger batches on one rank, or memory held outside the "
                             "training loop (another process, a rank-0-only task)", fix, None,
                             {"ranks": [row["rank"] for row in peaks], "peak_bytes": high, "lowest_bytes": low,
                              "high_rank": high_rank, "low_rank": low_rank}))
    return found


def killed_outright(rank: int, died_at: float, timeline: list[dict], short: float = 0.10,
                    resumed: bool = False) -> Finding | None:
    """A rank its last word (zerofit/recovery/lastword.py) found dead without Python's knowing: SIGKILL
    or a crash in native code. Its last memory record before it says whether host RAM was short
    then (under `short` of the machine available): the kernel's OOM killer is then the likely
    hand, the one OOM no process can catch. A kill the run started again after (`resumed`, or
    this rank's records going on) stays listed as history, at info level, as an OOM a retry went
    past does; None without a record before it."""
    before = [r for r in timeline if r["time"] <= died_at]
    last = before[-1] if before else None
    if last is None:
        return None
    resumed = resumed or len(before) < len(timeline)
    avail = last.get("host_avail") or 0
    total = next((r["host_total"] for r in timeline if r.get("host_total")), 0)  # the start record's
    host_short = bool(total) and avail < short * total
    where = f"step {last['step']}, {last['phase']}"
    title = (f"rank {rank} was killed outright {died_at - last['time']:.1f} s after its last memory record ({where}): "
             f"SIGKILL or a crash in native code, nothing Python could catch"
             + ("; the run started again after it" if resumed else ""))
    cause = (f"host RAM was short at that record ({gib(avail)} available of {gib(total)}, this rank's RSS "
             f"{gib(last.get('host_rss') or 0)}): the kernel's OOM killer is the likely hand" if host_short else
             f"host RAM was not short at that record ({gib(avail)} available of {gib(total)}): a kill from outside "
             "(a person, a scheduler's limit) or a crash in native code")
    fix = ["`dmesg | grep -i 'killed process'` (or `journalctl -k`) names what the kernel's OOM killer ended"]
    if host_short:
        fix += ["lower the host peak: `zerofit plan --host-mem SIZE` with what the machine can spare, or fewer "
                "ranks per node", "arm memory.watchdog_threshold with watchdog_action save or stop, which acts "
                "before the kernel does"]
    return Finding("killed", "info" if resumed else "error", "host", title, cause, fix, last["step"],
                   {"rank": rank, "died_at": died_at, "last_record_time": last["time"], "host_avail": avail,
                    "host_total": total})


def killed_after(findings: list[Finding]) -> int | None:
    """The step a kill the run did not start again after came at (the earliest rank's)."""
    return min((f.step for f in findings if f.kind == "killed" and f.severity == "error"), default=None)
