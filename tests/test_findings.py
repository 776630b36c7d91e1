"""The detectors on synthetic timelines: each pathology found, with its cause and fix,
and nothing found on a healthy run."""
from timelines import GiB, MiB, ds_config, synthetic_run

from zerofit.core.timeline import effective_records
from zerofit.findings.detectors import detect, fragmentation
from zerofit.findings.facts import RunFacts, facts_from
from zerofit.findings.fixes import phase_advice
from zerofit.findings.ranks import across_ranks


def findings_of(records, **ds):
    return detect(records, facts_from(records, ds_config(**ds), {"model": {"gradient_checkpointing": True}}))


def kinds(found):
    return {(f.kind, f.device) for f in found}


def test_healthy_run_has_no_findings():
    assert findings_of(synthetic_run()) == []


def test_post_save_residue_is_measured_per_save():
    found = findings_of(synthetic_run(residue_per_save=1 * GiB))
    assert kinds(found) == {("post_save_residue", "gpu")}
    residue = found[0]
    assert residue.evidence["residue_bytes"] == {5: GiB, 10: GiB, 15: GiB}  # the save at 20 has no step after it
    assert "3 save(s)" in residue.title and "3,072 MiB in all" in residue.title
    assert any("torch.cuda.empty_cache()" in fix for fix in residue.fix)
    assert not any("stage3_gather_16bit" in fix for fix in residue.fix)


def test_residue_names_16bit_gather_when_it_is_on():
    found = findings_of(synthetic_run(residue_per_save=1 * GiB), gather=True)
    residue = next(f for f in found if f.kind == "post_save_residue")
    assert "stage3_gather_16bit_weights_on_model_save" in residue.cause
    assert any("gather_16bit_weights_on_save: false" in fix for fix in residue.fix)


def test_small_residue_is_below_the_floor():
    assert findings_of(synthetic_run(residue_per_save=32 * MiB)) == []


def test_growth_is_a_leak_not_a_residue():
    found = findings_of(synthetic_run(leak_per_step=200 * MiB, steps=30))
    assert kinds(found) == {("growth", "gpu"), ("near_budget", "gpu")}  # 21.3 of 24 GiB at step 30
    leak = next(f for f in found if f.kind == "growth")
    assert leak.evidence["bytes_per_step"] == 200 * MiB
    assert leak.evidence["rising_fraction"] == 1.0
    # peak at step 30: 10 GiB + 30 x 200 MiB + 5 GiB (backward) + 256 MiB reserved slack
    assert 0 < leak.evidence["steps_to_budget"] < 40
    assert "reached near step" in leak.title


def test_host_growth():
    found = findings_of(synthetic_run(host_leak_per_step=512 * MiB))
    assert ("growth", "host") in kinds(found)
    assert "host objects" in next(f for f in found if f.device == "host").cause


def test_spike_after_save_with_large_sub_group_names_sub_group_size():
    found = findings_of(synthetic_run(spike_after_save=3 * GiB), sub_group_size=1_000_000_000)
    spike = next(f for f in found if f.kind == "after_save_spike")
    assert spike.evidence["phase"] == "optimizer_step"
    assert spike.evidence["peak_bytes"] - spike.evidence["typical_bytes"] == 3 * GiB
    assert "sub_group_size=1e+09" in spike.cause
    assert spike.fix[0].startswith("zero_optimization.sub_group_size 1e9 -> 1e8")
    assert "memory.expandable_segments: true" in spike.fix


def test_spike_after_save_with_small_sub_group_blames_the_cache():
    found = findings_of(synthetic_run(spike_after_save=3 * GiB), sub_group_size=100_000_000)
    spike = next(f for f in found if f.kind == "after_save_spike")
    assert "reshaped" in spike.cause and "sub_group_size" not in spike.fix[0]


def test_spike_after_an_eval_names_the_gathered_parameters_under_zero3():
    """A ZeRO-3 run whose evals left parameters gathered: the first step after each peaks higher
    in its forward and backward (the H200's 2.78 -> 4.48 GiB, engine.release_gathered)."""
    run = synthetic_run(eval_every=4, spike_after_eval=1536 * MiB)
    spike = next(f for f in findings_of(run) if f.kind == "after_eval_spike")
    assert spike.device == "gpu" and spike.step == 5 and spike.evidence["phase"] == "forward"
    assert spike.evidence["peak_bytes"] - spike.evidence["typical_bytes"] == 1536 * MiB
    # forward and backward after each of the evals at 4, 8, 12, 16: the backward's 1.5 GiB is 10% of its
    # peak, which counts when the evals left parameters gathered (a known cause)
    assert spike.evidence["spikes"] == 8
    assert "stage3_max_reuse_distance" in spike.cause and spike.fix[0].startswith("update zerofit")
    hf_facts = facts_from(run, ds_config(), {}, source="hf-trainer")
    hf_spike = next(f for f in detect(run, hf_facts) if f.kind == "after_eval_spike")
    assert hf_spike.fix[0].startswith("zerofit.integrations.hf_trainer.MemoryGuardCallback()")
    assert "empty_partition_cache()" in hf_spike.fix[1]


def test_spike_after_an_eval_that_released_its_parameters_blames_the_cache():
    run = synthetic_run(eval_every=4, spike_after_eval=1536 * MiB, eval_released=True)
    spike = next(f for f in findings_of(run) if f.kind == "after_eval_spike")
    assert spike.evidence["released_gathered"] and "reshaped" in spike.cause
    assert spike.evidence["spikes"] == 4  # an unknown cause needs 10% of the peak: the backward's is not above
    assert spike.fix == ["memory.expandable_segments: true"]
    assert findings_of(synthetic_run(eval_every=4)) == []  # evals alone are no finding
    assert findings_of(synthetic_run(eval_every=4, spike_after_eval=32 * MiB)) == []  # below the floor


def test_a_step_after_both_a_save_and_an_eval_is_named_once():
    """Evals and saves at the same steps (LLaMA-Factory's eval_steps = save_steps): a spike is the
    eval's when the eval left parameters gathered, else the save's."""
    gathered = findings_of(synthetic_run(eval_every=5, spike_after_eval=3 * GiB))
    assert "after_eval_spike" in {f.kind for f in gathered} and "after_save_spike" not in {f.kind for f in gathered}
    released = findings_of(synthetic_run(eval_every=5, spike_after_save=3 * GiB, eval_released=True))
    assert "after_save_spike" in {f.kind for f in released} and "after_eval_spike" not in {f.kind for f in released}


def test_fragmentation_suggests_expandable_segments_unless_set():
    found = findings_of(synthetic_run(frag=4 * GiB, inactive_split=2 * GiB))
    frag = next(f for f in found if f.kind == "fragmentation")
    assert frag.evidence == {"reserved_beyond_peak_bytes": 4 * GiB, "inactive_split_bytes": 2 * GiB}
    assert frag.fix[0].startswith("memory.expandable_segments: true")  # a zerofit run: its own key
    hf_run = synthetic_run(frag=4 * GiB, inactive_split=2 * GiB)
    # as `zerofit doctor` reads an HF Trainer run: a config holding what the advice reads
    hf_facts = facts_from(hf_run, ds_config(), {"model": {"gradient_checkpointing": False}}, source="hf-trainer")
    frag_hf = next(f for f in detect(hf_run, hf_facts) if f.kind == "fragmentation")
    assert frag_hf.fix[0].startswith("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")  # HF Trainer's: the variable
    cause, fix = phase_advice("forward", "gpu", hf_facts)  # the Trainer's and DeepSpeed's names, not zerofit's
    assert fix[0].startswith("halve per_device_train_batch_size") and "gradient_accumulation_steps" in fix[0]
    assert fix[1].startswith("gradient_checkpointing=True (TrainingArguments)")
    assert not any("train." in f or "model." in f or "zero." in f for f in fix)
    already = findings_of(synthetic_run(frag=4 * GiB, inactive_split=2 * GiB,
                                        alloc_conf="expandable_segments:True"))
    frag = next(f for f in already if f.kind == "fragmentation")
    assert not any("expandable_segments" in fix for fix in frag.fix)
    assert "even with expandable segments" in frag.cause


def test_near_budget_names_the_phase_and_activation_fixes():
    found = findings_of(synthetic_run(base=16 * GiB), micro_batch=4)
    near = next(f for f in found if f.kind == "near_budget")
    assert near.device == "gpu" and near.evidence["phase"] == "backward"
    assert near.severity == "warning" and 0.85 <= near.evidence["fraction"] < 0.95
    assert near.fix[0].startswith("halve train.micro_batch_size (4 -> 2)")
    assert any("offload_param: cpu" in fix for fix in near.fix)


def test_oom_event_is_an_error_with_advice():
    found = findings_of(synthetic_run(oom_at=7), micro_batch=1, offload_param="cpu")
    oom = found[0]
    assert oom.kind == "oom" and oom.severity == "error" and oom.step == 7
    assert "backward of step 7, tried to allocate 2.00 GiB" in oom.title
    assert not any("micro_batch" in fix for fix in oom.fix)  # already 1
    assert not any("offload_param" in fix for fix in oom.fix)  # already offloaded


def test_watchdog_event():
    records = synthetic_run(steps=6) + [{"step": 6, "phase": "watchdog", "device": "host", "fraction": 0.93,
                                          "threshold": 0.9, "action": "save"}]
    found = findings_of(records)
    assert [f.kind for f in found] == ["watchdog"]
    assert "93%" in found[0].title and "action save" in found[0].title


def test_findings_sorted_by_severity():
    found = findings_of(synthetic_run(base=15 * GiB, residue_per_save=512 * MiB, oom_at=18))
    assert found[0].severity == "error"
    order = {"error": 0, "warning": 1, "info": 2}
    assert [order[f.severity] for f in found] == sorted(order[f.severity] for f in found)


def test_budgets_come_from_plan_without_start_record():
    records = [r for r in synthetic_run() if r["phase"] != "start"]
    plan = {"devices": {"gpu": {"budget_bytes": 16 * GiB}, "host": {"budget_bytes": 64 * GiB}}}
    facts = facts_from(records, {}, {}, plan)
    assert (facts.gpu_budget, facts.host_budget) == (16 * GiB, 64 * GiB)
    assert ("near_budget", "gpu") in kinds(detect(records, facts))  # 17.25 GiB reserved of 16 GiB
    assert detect(records, RunFacts()) == []  # no budget: nothing to be near


def test_cpu_run_is_judged_on_host_memory_only():
    records = [dict(r, gpu_alloc=0, gpu_peak=0, gpu_reserved=0, gpu_peak_reserved=0, gpu_inactive_split=0)
               for r in synthetic_run(residue_per_save=GiB, host_leak_per_step=256 * MiB)]
    assert kinds(findings_of(records)) == {("growth", "host")}


def test_resume_drops_rolled_back_records_but_keeps_events():
    first = synthetic_run(steps=8, save_every=5, oom_at=8)
    resumed = [r for r in synthetic_run(steps=10, save_every=5) if r["step"] > 5 or r["phase"] == "start"]
    resumed[0] = dict(resumed[0], step=5)
    effective = effective_records(first + resumed)
    steps = [(r["step"], r["phase"]) for r in effective]
    assert (8, "oom") in steps
    assert steps.count((6, "forward")) == 1  # the rolled-back step 6 is gone, the replayed one stays


def test_findings_across_ranks_name_the_ranks_that_show_them():
    from zerofit.findings.measured import rank_peaks
    from zerofit.findings.ranks import rank_imbalance

    per_rank = {0: synthetic_run(residue_per_save=GiB), 1: synthetic_run(residue_per_save=GiB, leak_per_step=256 * MiB)}
    facts = facts_from(per_rank[0], ds_config(), {"model": {"gradient_checkpointing": True}})
    merged = across_ranks({rank: detect(records, facts) for rank, records in per_rank.items()})
    by_kind = {(f.kind, f.device): f for f in merged}
    residue, growth = by_kind[("post_save_residue", "gpu")], by_kind[("growth", "gpu")]
    assert residue.evidence["ranks"] == [0, 1] and not residue.title.startswith("rank")
    assert growth.evidence["ranks"] == [1] and growth.title.startswith("rank 1: ")
    assert len(merged) == len(by_kind)  # one finding per kind and device, not one per rank

    peaks = rank_peaks(per_rank, facts)
    assert [p["rank"] for p in peaks] == [0, 1] and peaks[0]["steps"] == peaks[1]["steps"] == 20
    uneven = rank_imbalance(peaks, facts)
    assert [(f.kind, f.device) for f in uneven] == [("rank_imbalance", "gpu")]
    assert uneven[0].evidence["high_rank"] == 1 and uneven[0].title.startswith("rank 1's GPU memory peaks")
    assert rank_imbalance(rank_peaks({0: per_rank[0], 1: per_rank[0]}, facts), facts) == []


def test_a_cpu_optimizer_on_one_thread_is_flagged():
    """torchrun's OMP_NUM_THREADS=1 with the optimizer on the CPU: flagged with the cores to use;
    not when the rank had its share of cores, or few cores to begin with."""
    def with_threads(threads, cores, ranks):
        records = synthetic_run()
        records[0].update(cpu_threads=threads, cpu_cores=cores, local_world_size=ranks)
        return {f.kind: f for f in findings_of(records)}

    starved = with_threads(1, 32, 2)["cpu_threads"]
    assert starved.evidence["cores_per_rank"] == 16 and "export OMP_NUM_THREADS=16" in starved.fix[0]
    assert "1 thread per rank with 16 cores per rank" in starved.title
    assert "cpu_threads" not in with_threads(16, 32, 2) and "cpu_threads" not in with_threads(1, 2, 1)
    records = synthetic_run()
    records[0].update(cpu_threads=1, cpu_cores=32, local_world_size=1)
    facts = facts_from(records, {"zero_optimization": {"stage": 3}}, {})  # optimizer on the GPU: no CPU-Adam
    assert not [f for f in detect(records, facts) if f.kind == "cpu_threads"]
    facts = facts_from(records, ds_config(), {"train": {"cpu_threads": 1}})  # chosen in the config: no advice
    assert not [f for f in detect(records, facts) if f.kind == "cpu_threads"]


def test_oom_with_the_space_in_pieces_is_called_fragmentation():
    """The H200's headline without expandable segments (bench/results/oom_retry-3.6b-headline.json):
    1.86 GiB asked with 2.36 allocated and 3.68 reserved under 5.3 GiB."""
    from zerofit.findings.detectors import events

    oom = {"step": 1, "phase": "oom", "device": "gpu", "failed_phase": "backward", "requested_bytes": int(1.86 * GiB),
           "gpu_alloc": int(2.36 * GiB), "gpu_reserved": int(3.68 * GiB)}
    zerofit_run = {"model": {"gradient_checkpointing": True}}
    found = events([oom], facts_from([], ds_config(), zerofit_run, {"devices": {"gpu": {"budget_bytes": int(5.3 * GiB)}}}))
    assert found[0].cause.startswith("fragmentation: 1.86 GiB asked beside 2.36 GiB allocated fits the 5.30 GiB budget")
    assert found[0].fix[0].startswith("memory.expandable_segments: true")
    # a budget the request could not fit beside what was allocated: the phase's own advice
    tight = events([oom], facts_from([], ds_config(), zerofit_run, {"devices": {"gpu": {"budget_bytes": int(4 * GiB)}}}))
    assert not tight[0].cause.startswith("fragmentation") and "expandable" not in tight[0].fix[0]


def test_fragmentation_is_measured_per_step_not_per_phase():
    """A micro batch's no-op optimizer step allocates little while the step's other phases
    keep their reservation: that is cache. The retry's timeline on the H200
    (bench/results/oom_retry-3.6b-headline-run2-report.md) read "4.72 GiB reserved beyond the
    allocated peak (optimizer_step of step 1)" per phase; per step it is reserved 5.28 - 4.28."""
    def phase(step, name, peak, reserved):
        return {"step": step, "phase": name, "gpu_alloc": int(0.16 * GiB), "gpu_peak": int(peak * GiB),
                "gpu_reserved": int(reserved * GiB), "gpu_peak_reserved": int(reserved * GiB),
                "gpu_inactive_split": 0, "host_rss": 30 * GiB, "host_peak": 30 * GiB}
    records = [phase(step, name, peak, reserved) for step in (1, 2, 3)
               for name, peak, reserved in (("forward", 2.62, 5.26), ("backward", 4.28, 5.28),
                                            ("optimizer_step", 0.16, 5.14))]
    frag = fragmentation(records, RunFacts(gpu_budget=int(5.3 * GiB)))[0]
    assert frag.evidence["reserved_beyond_peak_bytes"] == int(5.28 * GiB) - int(4.28 * GiB)
    assert "allocated peak of step" in frag.title and "reserved peaks in its backward" in frag.title


def test_optimizer_step_advice_names_expandable_segments_only_when_off():
    from zerofit.findings.fixes import phase_advice

    zerofit_run = {"model": {"gradient_checkpointing": True}}
    off = phase_advice("optimizer_step", "gpu", facts_from([], ds_config(), zerofit_run))[1]
    assert "memory.expandable_segments: true" in off
    on = phase_advice("optimizer_step", "gpu", facts_from([{"step": 0, "phase": "start",
                                                            "alloc_conf": "expandable_segments:True"}],
                                                          ds_config(), zerofit_run))[1]
    assert not any("expandable" in fix for fix in on)


def test_each_oom_is_a_finding_advised_from_its_own_settings():
    """Three OOMs in one run (a retry that ran out of memory again, twice): one finding each,
    each advised from the micro batch it ran out of memory with, and one a retry went past
    says what the retry changed."""
    records = synthetic_run(steps=8)
    settings = [{"train.micro_batch_size": m, "train.grad_accum_steps": 16 // m} for m in (16, 8, 4)]
    at = {5: settings[0], 6: settings[1], 7: settings[2]}
    out = []
    for record in records:
        out.append(record)
        step = record["step"]
        if record["phase"] == "optimizer_step" and step + 1 in at:
            out.append({**record, "step": step + 1, "phase": "oom", "failed_phase": "forward", "device": "gpu",
                        "settings": at[step + 1]})
            if step + 1 < 7:  # retried; the last one stopped the run
                out.append({**records[0], "step": step, "settings": settings[[5, 6].index(step + 1) + 1]})
    ooms = [f for f in detect(out, facts_from(out, ds_config(micro_batch=2), {"model": {}})) if f.kind == "oom"]
    assert sorted(f.step for f in ooms) == [5, 6, 7]
    by_step = {f.step: f for f in ooms}
    assert by_step[5].severity == "warning" and by_step[5].title.endswith(
        "the run resumed afterwards with train.micro_batch_size 16 -> 8, train.grad_accum_steps 1 -> 2")
    assert by_step[5].fix[0].startswith("halve train.micro_batch_size (16 -> 8)")
    assert by_step[7].severity == "error" and by_step[7].fix[0].startswith("halve train.micro_batch_size (4 -> 2)")
    merged = across_ranks({0: ooms})  # one rank: every OOM stays
    assert len(merged) == 3


def test_the_h200s_hf_trainer_timelines_with_and_without_the_release():
    """The doctor on real timelines: HF Trainer + LLaMA-Factory's ds_z3_offload, llama-1.5b under
    a 24 GiB cap on the H200, an eval every 2 steps (bench/hf_eval_leftovers.py). Without the
    release each step after an eval peaked 469 MiB (5.6%) higher; with it, none did."""
    from conftest import ROOT

    from zerofit.doctor.run import diagnose

    runs = ROOT / "bench" / "results" / "hf_eval_leftovers-s30"
    kept = {f.kind: f for f in diagnose(runs / "kept").findings}
    assert set(kept) == {"after_eval_spike"}
    spike = kept["after_eval_spike"]
    assert spike.step == 3 and spike.evidence["spikes"] == 3 and not spike.evidence["released_gathered"]
    assert spike.evidence["peak_bytes"] - spike.evidence["typical_bytes"] == 491_782_144
    assert diagnose(runs / "released").findings == []


def test_a_step_time_far_from_the_plan_names_the_busy_machine():
    """measured.step_time's figures: the issue's shared 2-core machine (3.9 s against 0.21 s,
    load 9) blames the other processes and suggests one thread; an idle machine blames the model;
    within 2x nothing is said."""
    from zerofit.findings.detectors import step_time_gap
    from zerofit.findings.measured import step_time

    metrics = [{"step": s, "step_seconds": 3.9} for s in range(1, 13)]
    records = [{"step": 0, "phase": "start", "cpu_cores": 2, "cpu_threads": 2}]
    records += [{"step": s, "phase": "backward", "time": 100.0 + 3.9 * s, "cpu_s": 10.0 + 0.9 * 3.9 * s, "load_avg": 9.1}
                for s in range(1, 13)]
    busy = step_time({"estimated_step_seconds": 0.21, "accelerator": "cpu"}, metrics, records)
    assert busy["measured_s"] == 3.9 and busy["steps"] == 10 and busy["cores_used"] == 0.9 and busy["load_avg"] == 9.1
    [gap] = step_time_gap(busy)
    assert gap.kind == "step_time" and gap.severity == "warning" and "18.6x the 0.21 s" in gap.title
    assert "load average 9.1 on 2 core(s)" in gap.cause and "0.90 cores' worth of CPU for its 2 thread(s)" in gap.cause
    assert any("train.cpu_threads: 1" in fix for fix in gap.fix)
    idle = [{**r, "load_avg": 0.3, "cpu_s": 10.0 + 1.9 * 3.9 * r["step"]} if r["phase"] != "start" else r for r in records]
    [model] = step_time_gap(step_time({"estimated_step_seconds": 0.21, "accelerator": "cpu"}, metrics, idle))
    assert model.severity == "info" and "steptime.py" in model.cause and "not busy" in model.cause
    close = step_time({"estimated_step_seconds": 2.5}, metrics, records[:1])
    assert step_time_gap(close) == [] and "load_avg" not in close  # one record: no steady steps
    assert step_time(None, metrics, records) is None and step_time({"estimated_step_seconds": 1}, [], records) is None
