"""Detectors: pure functions from a memory timeline (memory.jsonl records) and the run's
configs (findings.RunFacts) to findings, each naming what was seen (with the numbers), the
likely cause and the fix; `detect` runs them all on one timeline. No I/O here: `zerofit
doctor`, the post-mortem and the HF callback feed them. A change counts when it exceeds
findings.significant_bytes for its device.
"""
from __future__ import annotations

import copy
import statistics
from dataclasses import replace

from zerofit.findings.facts import (
    SEVERITY_ORDER,
    WARMUP_STEPS,
    Finding,
    RunFacts,
    end_of_step,
    gib,
    host_in_use,
    label,
    mib,
    peaks,
    save_steps,
    significant_bytes,
    steady_deltas,
    training,
)
from zerofit.findings.fixes import (
    expandable_segments_setting,
    host_budget_name,
    others_memory_advice,
    phase_advice,
    setting,
)


def detect(records: list[dict], facts: RunFacts) -> list[Finding]:
    """Every detector on one timeline, the most severe first."""
    found: list[Finding] = []
    on_gpu = any(r.get("gpu_reserved") for r in records)
    for device in ("gpu", "host") if on_gpu else ("host",):
        found += post_save_residue(records, facts, device)
        found += growth(records, facts, device)
        found += after_save_spike(records, facts, device)
        found += after_eval_spike(records, facts, device)
        found += near_budget(records, facts, device)
    if on_gpu:
        found += fragmentation(records, facts)
    found += events(records, facts)
    found += starved_cpu_optimizer(records, facts)
    return sorted(found, key=lambda f: (SEVERITY_ORDER[f.severity], f.kind != "oom"))


def starved_cpu_optimizer(records: list[dict], facts: RunFacts, enough_cores: int = 4) -> list[Finding]:
    """The optimizer steps on the CPU (DeepSpeedCPUAdam, an OpenMP loop; also with NVMe
    offload) but the rank ran with one thread while it had several cores: what torchrun's
    default OMP_NUM_THREADS=1 for more than one rank per node does (enough to make two GPUs
    slower than one). A cost, not a memory finding, but the
    timeline is where it shows."""
    start = next((r for r in reversed(records) if r.get("phase") == "start"), {})
    ranks_here = start.get("local_world_size") or 1
    share = (start.get("cpu_cores") or 0) // ranks_here
    chosen = facts.config.get("train", {}).get("cpu_threads")  # set on purpose in zerofit's config: no advice
    if facts.offloaded("optimizer") not in ("cpu", "nvme") or start.get("cpu_threads") != 1 or share < enough_cores \
            or chosen:
        return []
    return [Finding("cpu_threads", "warning", "host",
                    f"the CPU optimizer ran on 1 thread per rank with {share} cores per rank available "
                    f"({start['cpu_cores']} cores, {ranks_here} rank(s) on the node)",
                    "OMP_NUM_THREADS=1 (torchrun sets it whenever it starts more than one rank) limits "
                    "DeepSpeedCPUAdam's OpenMP loop to one core, so every optimizer step takes several times longer",
                    [f"export OMP_NUM_THREADS={share} before torchrun (the node's cores divided by its ranks)",
                     "zerofit train sets it per rank by default (train.cpu_threads)"], start.get("step"),
                    {"cpu_threads": 1, "cpu_cores": start["cpu_cores"], "cores_per_rank": share})]


# ------------------------------------------------------------------------ detectors
def post_save_residue(records: list[dict], facts: RunFacts, device: str) -> list[Finding]:
    """Held memory after a save above the pre-save baseline: end of the first step after
    the save minus end of the step before it, less the run's usual step-to-step drift."""
    series, saves = end_of_step(records, device), save_steps(records)
    drift = max(0, statistics.median(steady_deltas(series, saves) or [0]))
    residues = {s: series[s + 1] - series[s] - drift for s in sorted(saves) if s in series and s + 1 in series}
    reported = {r["step"]: r["residue_bytes"] for r in records if r.get("phase") == "save" and "residue_bytes" in r}
    # a save with no step after it (the last) is judged by what the save itself measured
    residues.update({s: b for s, b in reported.items() if s not in residues})
    bad = {s: b for s, b in sorted(residues.items()) if b > significant_bytes(facts, device)}
    if not bad:
        return []
    total, worst = sum(bad.values()), max(bad, key=bad.get)
    budget = facts.gpu_budget if device == "gpu" else facts.host_budget
    severity = "error" if budget and total > 0.1 * budget else "warning"
    gathered = 2 * facts.params  # the 16-bit model a gathering save builds
    blames_gathering = facts.gathers_on_save() and (not gathered or bad[worst] >= 0.5 * gathered)
    if blames_gathering:
        cause = ("stage3_gather_16bit_weights_on_model_save is on: each save gathers the full 16-bit model"
                 + (f" ({mib(gathered)})" if gathered else "") + ", and what it gathered is still referenced afterwards")
    else:
        cause = ("tensors made during the save (gathered parameters, state-dict copies, serialisation "
                 "buffers) are still referenced after it, so the allocator cannot reuse that memory")
        if facts.gathers_on_save():
            cause += (f" (more than the whole 16-bit model, {mib(gathered)}, that "
                      f"stage3_gather_16bit_weights_on_model_save gathers: something else holds it)")
    released = all(r.get("released_cache") for r in records if r.get("phase") == "save")
    if released:
        cause += "; it survives gc.collect() and torch.cuda.empty_cache(), so a live reference holds it"
        fix = ["find what keeps a reference after the save: a callback or hook that stores tensors, a "
               "state dict kept for logging or a copy for upload"]
    else:
        fix = ["release after each save: gc.collect() then torch.cuda.empty_cache() "
               "(for HF Trainer, zerofit.integrations.hf_trainer.MemoryGuardCallback() does it)"]
    if blames_gathering:
        fix.append(f"{setting(facts, 'zero.gather_16bit_weights_on_save: false')} (no 16-bit model gathered at "
                   f"each save) and export at the end with `zerofit export`")
    fix.append("find the holder in the allocator snapshot (torch.cuda.memory._record_memory_history, viewed at "
               "pytorch.org/memory_viz)" if device == "gpu" else
               "find the holder with tracemalloc or memray around the save")
    steps = ", ".join(f"{s} (+{mib(b)})" for s, b in bad.items())
    return [Finding("post_save_residue", severity, device,
                    f"{label(device)} memory held after {len(bad)} save(s) stays above the pre-save baseline: "
                    f"{mib(total)} in all, worst after step {worst} ({mib(bad[worst])}); saves at {steps}",
                    cause, fix, worst, {"residue_bytes": bad, "reported_residue_bytes": reported,
                                        "drift_bytes_per_step": drift})]


def growth(records: list[dict], facts: RunFacts, device: str) -> list[Finding]:
    """Held memory climbing step after step (a leak), apart from jumps at saves."""
    series, saves = end_of_step(records, device), save_steps(records)
    deltas = steady_deltas(series, saves)
    if len(deltas) < 4:
        return []
    total = sum(deltas)
    rising = sum(d > 0 for d in deltas) / len(deltas)
    if total <= significant_bytes(facts, device) or rising < 0.6:
        return []
    per_step = total / len(deltas)
    budget = facts.gpu_budget if device == "gpu" else facts.host_budget
    last_step = max(series)
    evidence = {"bytes_per_step": int(per_step), "growth_bytes": total, "steps": len(deltas),
                "rising_fraction": round(rising, 2)}
    title = (f"{label(device)} memory grows {mib(per_step)} per step ({mib(total)} over {len(deltas)} steps, "
             f"rising in {rising:.0%} of them)")
    if budget:
        _, peak = max(peaks(records, device), key=lambda p: p[1])
        steps_left = int(max(0, budget - peak) / per_step)
        evidence["steps_to_budget"] = steps_left
        title += f"; at this rate the {gib(budget)} budget is reached near step {last_step + steps_left}"
    if device == "gpu":
        cause = ("something keeps a reference to device tensors every step: a loss or output kept as a tensor "
                 "(not .item()), a list that collects activations, a hook that stores them")
        fix = ["find the blocks allocated every step and never freed in the allocator snapshot "
               "(pytorch.org/memory_viz); keep logged values as Python floats (.item(), .detach().cpu())"]
    else:
        cause = ("the process keeps host objects every step: CPU tensors or Python objects collected per "
                 "step, or pinned/offload buffers re-created instead of reused")
        fix = ["look for per-step lists, caches or logging that keep tensors; "
               "tracemalloc or memray on the host shows which line allocates"]
    return [Finding("growth", "error" if rising > 0.9 and budget and total > 0.05 * budget else "warning",
                    device, title, cause, fix, last_step, evidence)]


def first_step_spikes(records: list[dict], facts: RunFacts, device: str, follows_event,
                      min_fraction: float = 0.1) -> list[tuple[dict, int, int]]:
    """(record, peak, typical) for each phase of a first step after an event (`follows_event(record)`)
    that peaks above the same phase in its neighbours (the step before the event and the step
    after), so steady growth is not mistaken for it: by more than the device's floor and than
    `min_fraction` of the neighbours' peak."""
    by_phase: dict[str, dict[int, int]] = {}
    after: list[tuple[dict, int]] = []
    for record, peak in peaks(training(records), device):
        by_phase.setdefault(record["phase"], {})[record["step"]] = peak
        if follows_event(record):
            after.append((record, peak))
    spikes = []
    for record, peak in after:
        same = by_phase[record["phase"]]
        neighbours = [same[s] for s in (record["step"] - 1, record["step"] + 1) if s in same]
        if not neighbours:
            continue
        typical = max(neighbours)
        excess = peak - typical
        if excess > significant_bytes(facts, device) and excess > min_fraction * typical:
            spikes.append((record, peak, typical))
    return spikes


def evals_by_step(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in records if r.get("phase") == "eval"}


def left_gathered(eval_record: dict, facts: RunFacts) -> bool:
    """A ZeRO-3 eval whose batches' gathered parameters were not partitioned after it (HF Trainer
    without MemoryGuardCallback's release, zerofit before it released them)."""
    return facts.zero.get("stage") == 3 and not eval_record.get("released_gathered", False)


def after_save_spike(records: list[dict], facts: RunFacts, device: str) -> list[Finding]:
    """The first step after a save peaks above the same phase in the steps around it. A step
    that also follows an eval which left parameters gathered is that eval's (after_eval_spike)."""
    gathering_evals = {step for step, record in evals_by_step(records).items() if left_gathered(record, facts)}
    spikes = first_step_spikes(records, facts, device,
                               lambda record: record.get("after_save") and record["step"] - 1 not in gathering_evals)
    if not spikes:
        return []
    record, peak, typical = max(spikes, key=lambda s: s[1] - s[2])
    phase = record["phase"]
    sub_group = facts.sub_group_size()
    if device == "gpu" and phase == "optimizer_step" and sub_group >= 500_000_000:
        cause = (f"sub_group_size={sub_group:.0e}: the optimizer step allocates fp32 temporaries per sub group, "
                 f"and right after a save the allocator has no cached block of that size left to reuse")
        fix = ["zero_optimization.sub_group_size 1e9 -> 1e8 (zero.sub_group_size: 100000000)"]
    elif device == "gpu":
        cause = ("the save left the allocator's cache reshaped (freed gather/serialisation buffers split into "
                 "pieces), so the next step's requests need fresh memory on top of what is held")
        fix = []
    else:
        cause = ("host memory is allocated again right after the save (state-dict copies, serialisation or "
                 "pinned staging buffers) on top of what the step needs")
        fix = ["find what the first step after a save allocates on the host (tracemalloc or memray)"]
    if device == "gpu":
        fix.append(expandable_segments_setting(facts) if not facts.expandable_segments_on
                   else "torch.cuda.empty_cache() right after each save")
    if facts.gathers_on_save():
        fix.append("turn off stage3_gather_16bit_weights_on_model_save and export at the end (`zerofit export`)")
    return [Finding("after_save_spike", "warning", device,
                    f"The first step after a save peaks {mib(peak - typical)} higher in {phase} "
                    f"({gib(peak)} at step {record['step']} vs {gib(typical)} in the steps around it), in {len(spikes)} "
                    f"phase(s) after saves", cause, fix or ["empty the cache after each save"], record["step"],
                    {"peak_bytes": peak, "typical_bytes": int(typical), "phase": phase, "spikes": len(spikes)})]


def after_eval_spike(records: list[dict], facts: RunFacts, device: str) -> list[Finding]:
    """The first step after an eval peaks above the same phase in the steps around it. Under
    ZeRO-3 an eval's forward (no backward) leaves gathered what the training trace would reuse
    within stage3_max_reuse_distance, and the next training forward gathers a whole live window
    on top of it (engine.release_gathered). A
    step that also follows a save is the save's (after_save_spike) unless the eval left them."""
    evals = evals_by_step(records)

    def follows_eval(record: dict) -> bool:
        before = evals.get(record["step"] - 1)
        return before is not None and (left_gathered(before, facts) or not record.get("after_save"))

    # with a known cause any rise above the floor counts, however small
    known_cause = any(left_gathered(record, facts) for record in evals.values())
    spikes = first_step_spikes(records, facts, device, follows_eval, 0.0 if known_cause else 0.1)
    if not spikes:
        return []
    record, peak, typical = max(spikes, key=lambda s: s[1] - s[2])
    eval_record = evals[record["step"] - 1]
    released = eval_record.get("released_gathered", False)  # runs from before the release did not
    if left_gathered(eval_record, facts):
        cause = ("ZeRO-3: an eval's forward has no backward, so it leaves gathered the parameters the training "
                 "trace would reuse (stage3_max_reuse_distance); the next training forward gathers its whole "
                 "window on top of them")
        fix = (["zerofit.integrations.hf_trainer.MemoryGuardCallback() partitions them after each eval batch (release_after_eval, "
                "its default)", "or call trainer.model_wrapped.empty_partition_cache() after each evaluation"]
               if facts.source == "hf-trainer" else
               ["update zerofit: it partitions them after each eval batch (this run's evals did not); the run "
                "resumes from its last checkpoint"])
    elif device == "gpu":
        cause = ("the eval's activations and logits left the allocator's cache reshaped, so the next step's "
                 "requests need fresh memory on top of what is held")
        fix = [expandable_segments_setting(facts) if not facts.expandable_segments_on
               else "torch.cuda.empty_cache() right after each eval"]
    else:
        cause = "host memory is allocated again after the eval (its outputs or metrics) on top of what the step needs"
        fix = ["find what the first step after an eval allocates on the host (tracemalloc or memray)"]
    return [Finding("after_eval_spike", "warning", device,
                    f"The first step after an eval peaks {mib(peak - typical)} higher in {record['phase']} "
                    f"({gib(peak)} at step {record['step']} vs {gib(typical)} in the steps around it), in "
                    f"{len(spikes)} phase(s) after evals", cause, fix, record["step"],
                    {"peak_bytes": peak, "typical_bytes": int(typical), "phase": record["phase"],
                     "spikes": len(spikes), "released_gathered": released})]


def near_budget(records: list[dict], facts: RunFacts, device: str, near: float = 0.85) -> list[Finding]:
    """The highest peak against the budget; the phase where it happened names the fix."""
    if device == "gpu":
        budget = facts.gpu_budget
        readings = [(r, max(r.get("gpu_peak_reserved", 0), r.get("gpu_reserved", 0))) for r in records]
    else:
        budget = facts.host_budget
        readings = [(r, host_in_use(r, facts)) for r in records]
    readings = [(r, v) for r, v in readings if r.get("phase") not in ("start", "oom")]  # an OOM is its own finding
    if not budget or not readings:
        return []
    record, peak = max(readings, key=lambda p: p[1])
    fraction = peak / budget
    if fraction < near:
        return []
    cause, fix = phase_advice(record["phase"], device, facts)
    title = (f"{label(device)} peak {gib(peak)} is {fraction:.0%} of the {gib(budget)} budget "
             f"({record['phase']} of step {record['step']})")
    evidence = {"peak_bytes": peak, "budget_bytes": budget, "fraction": round(fraction, 3), "phase": record["phase"]}
    own = record.get("host_peak", record.get("host_rss", 0))
    if device == "host" and peak > own:  # machine-wide use: this run's RSS and everyone else's apart
        others = peak - own
        title = (f"Host memory in use {gib(peak)} is {fraction:.0%} of the {gib(budget)} {host_budget_name(facts)} "
                 f"({record['phase']} of step {record['step']}): this run's RSS {gib(own)}, other processes "
                 f"{gib(others)}")
        evidence.update(run_rss_bytes=own, other_processes_bytes=others)
        if others > own:
            cause, fix = others_memory_advice(own, others, budget, facts)
    return [Finding("near_budget", "error" if fraction >= 0.95 else "warning", device, title, cause, fix,
                    record["step"], evidence)]


def fragmentation(records: list[dict], facts: RunFacts) -> list[Finding]:
    """Reserved but unusable GPU memory: cached beyond the peak, and free pieces of split
    blocks (inactive_split) that a large request cannot use."""
    steady = [r for r in training(records) if r["step"] > WARMUP_STEPS] or training(records)
    if not steady:
        return []
    budget = facts.gpu_budget or max(r.get("gpu_peak_reserved", 0) for r in steady)
    # per step, not per phase: a phase that allocates little (a micro batch's no-op optimizer
    # step) still holds what the step's other phases reserved, which is cache, not waste
    steps: dict[int, dict] = {}
    for record in steady:
        step = steps.setdefault(record["step"], {"step": record["step"], "reserved": 0, "peak": 0, "phase": ""})
        step["peak"] = max(step["peak"], record.get("gpu_peak", 0))
        if record.get("gpu_peak_reserved", 0) >= step["reserved"]:
            step.update(reserved=record.get("gpu_peak_reserved", 0), phase=record["phase"])
    worst_gap = max(steps.values(), key=lambda s: s["reserved"] - s["peak"])
    gap = worst_gap["reserved"] - worst_gap["peak"]
    worst_split = max(steady, key=lambda r: r.get("gpu_inactive_split", 0))
    split = worst_split.get("gpu_inactive_split", 0)
    floor = significant_bytes(facts, "gpu")
    if not (gap > max(floor, 0.1 * budget) or split > max(floor, 0.05 * budget)):
        return []
    expandable = facts.expandable_segments_on
    fix = [f"{expandable_segments_setting(facts)} (segments grow in place instead of splitting)"] \
        if not expandable else []
    fix += ["keep request sizes uniform: zero.reduce_bucket_size / prefetch_bucket_size equal, "
            "sub_group_size 1e8", "torch.cuda.empty_cache() after saves and evals"]
    return [Finding("fragmentation", "warning", "gpu",
                    f"GPU fragmentation: {gib(gap)} reserved beyond the allocated peak of step {worst_gap['step']} "
                    f"(reserved peaks in its {worst_gap['phase']}), up to {gib(split)} in free pieces of "
                    f"split blocks", "the caching allocator splits large blocks; freed pieces of odd sizes stay "
                    "reserved but too small for the next large request" +
                    (" (even with expandable segments on)" if expandable else ""), fix, worst_gap["step"],
                    {"reserved_beyond_peak_bytes": gap, "inactive_split_bytes": split})]


def fragmented_request(requested: int | None, allocated: int, reserved: int, budget: int) -> bool:
    """A GPU request that failed although it fit the budget beside what was allocated, while
    the allocator held reserved memory it could not hand out: the space was there, in cached
    pieces too small for it (fixed segments: memory.expandable_segments false)."""
    return bool(requested and budget and allocated + requested <= budget and reserved > allocated)


def fragmented_oom_advice(record: dict, facts: RunFacts, phase_fixes: list[str]) -> tuple[str, list[str]]:
    cause = (f"fragmentation: {gib(record['requested_bytes'])} asked beside {gib(record['gpu_alloc'])} allocated fits "
             f"the {gib(facts.gpu_budget)} budget, but the allocator's {gib(record['gpu_reserved'])} reserved were "
             f"split into pieces too small for it, and the budget left no room for a new segment")
    if facts.expandable_segments_on:
        return cause + " (even with expandable segments on)", phase_fixes
    return cause, [f"{expandable_segments_setting(facts)} (segments grow in place instead of splitting; "
                   f"nothing else need give)"] + phase_fixes


def events(records: list[dict], facts: RunFacts) -> list[Finding]:
    """OOM, watchdog and failed-save records written by the post-mortem, the watchdog and
    the checkpointer: one finding each."""
    found = []
    for i, r in enumerate(records):
        if r.get("phase") == "oom":
            found.append(oom_finding(r, records[i + 1:], facts))
        elif r.get("phase") == "watchdog":
            found.append(Finding("watchdog", "warning", r.get("device", "?"),
                                 f"watchdog at step {r['step']}: {r.get('device', '?')} memory at "
                                 f"{r.get('fraction', 0):.0%} of its budget (threshold {r.get('threshold', 0):.0%}), "
                                 f"action {r.get('action', '?')}", "memory use crossed memory.watchdog_threshold",
                                 ["the timeline's peaks per phase show where it comes from; lower that phase's "
                                  "memory (see `zerofit plan --explain`) or raise the budget"], r["step"],
                                 {k: r[k] for k in r if k != "time"}))
        elif r.get("phase") == "checkpoint_failed":
            found.append(failed_save(r, facts))
    return found


def failed_save(record: dict, facts: RunFacts) -> Finding:
    stopped = facts.config.get("checkpoint", {}).get("on_error", "stop") == "stop"
    then = "the run stopped there (checkpoint.on_error: stop)" if stopped else \
        "training went on without it (checkpoint.on_error: continue)"
    return Finding("checkpoint_failed", "error" if stopped else "warning", "disk",
                   f"the checkpoint {record.get('checkpoint', '')} of step {record['step']} was not saved: "
                   f"{record.get('error', '?')}", f"{then}; the checkpoints published before it are intact",
                   ["free disk space (or lower checkpoint.keep_last), then resume: "
                    "`zerofit train --config RUN_DIR/config.yaml --resume`"], record["step"],
                   {k: record[k] for k in record if k != "time"})


def oom_finding(record: dict, later: list[dict], facts: RunFacts) -> Finding:
    """An OOM, advised from the settings that ran out of memory (the record's, when it has
    them: a retry changes the run's files afterwards); one a retry went past is a warning
    that says what the retry changed."""
    device, phase = record.get("device", "gpu"), record.get("failed_phase", "?")
    then = record.get("settings") or {}
    cause, fix = phase_advice(phase, device, facts_with(facts, then))
    if device == "gpu" and fragmented_request(record.get("requested_bytes"), record.get("gpu_alloc", 0),
                                              record.get("gpu_reserved", 0), facts.gpu_budget):
        cause, fix = fragmented_oom_advice(record, facts, fix)
    asked = f", tried to allocate {gib(record['requested_bytes'])}" if record.get("requested_bytes") else ""
    restart = next((r for r in later if r.get("phase") == "start"), None)
    went_on = ""
    if restart is not None:
        changed = [f"{k} {then[k]} -> {v}" for k, v in (restart.get("settings") or {}).items()
                   if k in then and then[k] != v]
        went_on = "; the run resumed afterwards" + (f" with {', '.join(changed)}" if changed else "")
    return Finding("oom", "warning" if restart else "error", device,
                   f"{label(device)} out of memory in {phase} of step {record['step']}{asked}{went_on}",
                   cause, fix, record["step"], {k: record[k] for k in record if k != "time"})


def facts_with(facts: RunFacts, settings: dict) -> RunFacts:
    """`facts` with the zerofit settings of an OOM record (postmortem.MEMORY_SETTINGS) laid
    over the DeepSpeed config and the config the advice reads."""
    if not settings:
        return facts
    ds = copy.deepcopy(facts.ds_config)
    zero = ds.setdefault("zero_optimization", {})
    if "train.micro_batch_size" in settings:
        ds["train_micro_batch_size_per_gpu"] = settings["train.micro_batch_size"]
    for what in ("param", "optimizer"):
        if f"zero.offload_{what}" in settings:
            zero[f"offload_{what}"] = {**(zero.get(f"offload_{what}") or {}), "device": settings[f"zero.offload_{what}"]}
    if "zero.sub_group_size" in settings:
        zero["sub_group_size"] = settings["zero.sub_group_size"]
    if "zero.gather_16bit_weights_on_save" in settings:
        zero["stage3_gather_16bit_weights_on_model_save"] = settings["zero.gather_16bit_weights_on_save"]
    config = {**facts.config, "model": {**facts.config.get("model", {}),
                                        "gradient_checkpointing": settings.get("model.gradient_checkpointing")}}
    return replace(facts, ds_config=ds, config=config)


def step_time_gap(step: dict | None, far: float = 2.0) -> list[Finding]:
    """Measured step time far from plan.json's (`step`: measured.step_time), with the likely
    cause: a busy machine (load average above the cores, or the run got fewer cores than its
    threads), else the step-time model (steptime.py) missing this model or host."""
    if not step or 1 / far < step["ratio"] < far:
        return []
    title = (f"Steps take {step['measured_s']:.2f} s (median of {step['steps']} steady steps), "
             f"{step['ratio']:.1f}x the {step['predicted_s']:.2f} s plan.json predicted")
    cores, threads = step.get("cpu_cores") or 0, step.get("cpu_threads") or 0
    load, used = step.get("load_avg"), step.get("cores_used")
    evidence = {k: step.get(k) for k in ("predicted_s", "measured_s", "ratio", "load_avg", "cores_used", "cpu_cores")}
    starved = used is not None and threads and used < 0.75 * threads
    if step["ratio"] > 1 and cores and load is not None and (load > cores or starved):
        got = f"; the run's process got {used:.2f} cores' worth of CPU for its {threads} thread(s)" if used else ""
        cause = (f"other processes were using the CPU: load average {load:.1f} on {cores} core(s) while it ran{got}. "
                 f"The prediction is for cores the run has to itself")
        fix = ["run when the machine is idle (`uptime`, `top` show the load and who makes it), or give the run "
               "cores of its own (taskset, docker --cpus, Slurm --cpus-per-task)"]
        if threads > 1:  # each parallel region waits for its slowest thread, and a busy machine stalls some
            fix.append("on a machine others keep busy, train.cpu_threads: 1 (threads that wait for each other "
                       "lose most when the cores are shared)")
        return [Finding("step_time", "warning", "cpu" if not step["on_gpu"] else "gpu", title, cause, fix,
                        None, evidence)]
    busy = f" (load average {load:.1f} on {cores} core(s): the machine was not busy)" if load is not None else ""
    cause = ("the step-time model (zerofit/plan/steptime.py) misses this model, shape or machine" + busy)
    fix = ["nothing to change in the run: plan.json's step time only ranks the configurations the planner "
           "compares; tokens/s in metrics.jsonl is what this machine does"]
    return [Finding("step_time", "info", "cpu" if not step["on_gpu"] else "gpu", title, cause, fix, None, evidence)]
