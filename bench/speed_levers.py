"""Issue 7's levers, one at a time: zerofit's choice with one setting changed (or DeepSpeed
settings zerofit does not offer, laid over its config), run when time is left after the
configs, and what each bought against the choice or its own baseline run."""
from __future__ import annotations

from speed_cases import zerofit_config
from speed_record import complete, warmup_steps, zerofit_entry
from speed_workers import Runner

# DeepSpeed's SuperOffload (runtime/superoffload/superoffload_stage3.py) steps each optimizer
# sub group with DeepSpeedCPUAdam in a worker process as soon as the backward has its
# gradients, but only when clipping is off (`not self.clip_grad`); with clipping it steps the
# sub groups one by one after the backward. Not a zerofit option (see the README): measured
# through deepspeed_changes, here and in bench/overlap_loss.py.
SUPER_OFFLOAD = {"zero_optimization": {"offload_optimizer": {"super_offload": True}}}


def zenflow_shape(spec) -> dict:
    """What DeepSpeed 0.19.8's ZenFlow needs of a step (engine.zenflow_refusal): no activation
    checkpointing, so micro batch 4 x 4 (llama-3.6b's activations then fit 24 GiB: the
    planner's 20.3 GB, bench/results/zenflow_probe-3.6b-micro4-plan.json), and a reduce bucket
    as large as the largest trained 2-D weight."""
    return {"train.micro_batch_size": 4, "train.grad_accum_steps": 4, "model.gradient_checkpointing": False,
            "zero.reduce_bucket_size": spec.largest_trained_matrix.numel}


# One lever at a time, measured when time is left after the configs: zerofit's choice with
# one setting changed. "gain" = tokens/s of the lever on / off.
LEVERS = {
    "chunked_loss": dict(
        what="zerofit.loss (16-bit logits and a fixed fp32 chunk) vs HF's loss (fp32 copies of the logits): "
             "larger micro batches fit, fewer per step; the planner chooses again for HF's loss",
        needs=None, lever_on_in_choice=True, replan=True,
        change=lambda spec: {"train.chunked_loss": False}),
    "persistence": dict(
        what="every parameter persistent (one rank, parameters on the GPU) vs HF's auto threshold 10 x hidden",
        needs="zero.param_persistence_threshold", lever_on_in_choice=True,
        change=lambda spec: {"zero.param_persistence_threshold": 10 * spec.hidden_size}),
    "reduce_bucket": dict(
        what="the plan's larger gradient reduce bucket vs HF's auto hidden^2: fewer bucket flushes per micro "
             "batch (speed.json of 2026-11-29: every config paid ~0.6 s per micro batch, params on GPU or not)",
        needs="zero.reduce_bucket_size", lever_on_in_choice=True,
        change=lambda spec: {"zero.reduce_bucket_size": spec.hidden_size ** 2}),
    "heap_step_temporaries": dict(
        what="the optimizer step's host temporaries reused on glibc's heap (zerofit/machine/hostalloc.py) vs a fresh "
             "mmap per sub-group and step (glibc's default above 32 MiB)",
        needs=None, lever_on_in_choice=False,
        change=lambda spec: {"train.heap_step_temporaries": True}),
    "params_on_gpu": dict(
        what="the plan's 16-bit parameters kept on the GPU vs offloaded to pinned host memory with HF's auto "
             "persistence threshold 10 x hidden (the stock config's choices), everything else as planned",
        needs=None, lever_on_in_choice=True,
        change=lambda spec: {"zero.offload_param": "cpu", "zero.param_persistence_threshold": 10 * spec.hidden_size}),
    # The planner refuses ratio 0.95 for 3.6B @ 24 GiB at the choice's micro batch 16 (21.9 GiB
    # of 21.6 usable: speed-3.6b-levers-run3.json) and predicts its only fitting alternative,
    # micro 8 x 2, slower than the choice (3.5 s against 3.0): the lever runs the choice as given
    # with the ratio changed, the planner off, so that the GPU says whether it fits and what it buys.
    "partial_offload": dict(
        what="offload_optimizer ratio 0.95 (DeepSpeed's partial offload: the first 5% of the optimizer sub groups, "
             "the embedding's among them, keep their fp32 states on the GPU and step there) vs the whole optimizer "
             "on the CPU; the rest of the choice as given, the planner's fit test off (plan.enabled false)",
        needs=None, lever_on_in_choice=False,
        change=lambda spec: {"zero.offload_optimizer_ratio": 0.95, "plan.enabled": False}),
    "whole_offload": dict(
        what="the plan's partial optimizer offload vs the whole optimizer on the CPU (ratio 1.0), the rest of "
             "the choice as given",
        needs=None, lever_on_in_choice=True,
        change=lambda spec: {"zero.offload_optimizer_ratio": 1.0}),
    "expandable_segments_off": dict(
        what="the CUDA allocator's fixed segments (memory.expandable_segments false) vs zerofit's expandable ones: "
             "whether freed pieces between activations strand a late large request under the cap",
        needs=None, lever_on_in_choice=True,
        change=lambda spec: {"memory.expandable_segments": False}),
    "grad_clip_off": dict(
        what="no gradient clipping (train.grad_clip 0) vs zerofit's 1.0, everything else as planned: what the "
             "clip costs, and the baseline SuperOffload is measured against",
        needs=None, lever_on_in_choice=False,
        change=lambda spec: {"train.grad_clip": 0.0}),
    "superoffload": dict(
        what="DeepSpeed SuperOffload (offload_optimizer.super_offload) without clipping, so that CPU-Adam runs "
             "during the backward; 'without' is grad_clip_off (the same step, no clipping, no SuperOffload)",
        needs=None, lever_on_in_choice=False, off_config="zerofit_grad_clip_off",
        change=lambda spec: {"train.grad_clip": 0.0},
        deepspeed_changes=SUPER_OFFLOAD),
    "superoffload_clipped": dict(
        what="DeepSpeed SuperOffload with zerofit's clipping (1.0): its sub groups then step after the backward",
        needs=None, lever_on_in_choice=False,
        change=lambda spec: {},
        deepspeed_changes=SUPER_OFFLOAD),
    # DeepSpeed's ZenFlow (runtime/zenflow/): each step Adam updates on the GPU only the top-k
    # gradient columns of every 2-D weight; the rest accumulate and the CPU steps them every
    # update_interval steps in its own process, overlapping the next steps: another optimizer.
    # Values of DeepSpeed's ZenFlow tutorial (docs/_tutorials/zenflow.md). zerofit builds the
    # model whole for it (engine.builds_under_zero_init) and refuses what 0.19.8 cannot run
    # (engine.zenflow_refusal): activation checkpointing, and a reduce bucket smaller than the
    # largest weight. Without checkpointing llama-3.6b's activations fit at micro batch 4 under
    # 24 GiB (the planner: 20.3 GB, bench/results/zenflow_probe-3.6b-micro4-plan.json), so its
    # "without" is the same step without ZenFlow (no_checkpointing_micro4), not the choice.
    "no_checkpointing_micro4": dict(
        what="micro batch 4 x 4 without activation checkpointing and a reduce bucket as large as the largest "
             "weight (ZenFlow's shape) vs the choice",
        needs=None, lever_on_in_choice=False,
        change=zenflow_shape),
    "zenflow": dict(
        what="DeepSpeed ZenFlow (zero_optimization.zenflow: top 5% of gradient columns updated on the GPU every "
             "step, the rest by the CPU every 4 steps, overlapped; not the same optimizer) vs the same step "
             "without it (no_checkpointing_micro4)",
        needs=None, lever_on_in_choice=False, off_config="zerofit_no_checkpointing_micro4",
        budget_s=330,  # the whole 16-bit model drawn on the host: 90-180 s for llama-3.6b
        change=zenflow_shape,
        deepspeed_changes={"zero_optimization": {"zenflow": {
            "topk_ratio": 0.05, "select_strategy": "auto", "select_interval": "auto", "update_interval": 4,
            "full_warm_up_rounds": 0, "overlap_step": True}}}),
}


# a lever runs about as long as the choice did (3.6B on 2026-11-30: 82-120 s against the
# choice's 85-102), well inside its budget: this much of the choice's wall time lets one start
LEVER_WALL_FACTOR = 1.5


def run_levers(label: str, case: dict, runner: Runner, rates: dict, record: dict, spec, hw, save,
               names: tuple) -> None:
    record["levers"] = {}
    for name in names:
        lever = LEVERS[name]
        record["levers"][name] = measure_lever(name, lever, label, case, runner, rates, record, spec, hw)
        save()


def measure_lever(name: str, lever: dict, label: str, case: dict, runner: Runner, rates: dict, record: dict,
                  spec, hw):
    choice = record["configs"].get("zerofit", {})
    chosen = choice.get("chosen_fields") or {}
    budget = lever.get("budget_s", case["budgets_s"][0])
    need = min(budget, LEVER_WALL_FACTOR * choice["wall_s"]) if choice.get("wall_s") else budget
    why_not = ("no zerofit plan" if not chosen else
               f"the plan did not choose {lever['needs']}" if lever["needs"] and lever["needs"] not in chosen else
               f"{runner.left():.0f}s left, {need:.0f}s needed" if runner.left() < need else None)
    if why_not:
        return f"not measured: {why_not}"
    run_name = f"{label}-zerofit-{name}"
    run_dir = runner.work / run_name / "run"
    config = zerofit_config(case, run_dir, warmup_steps(1) + case["measured_steps"][0], runner.accelerator)
    replan = lever.get("replan", False)  # the planner chooses again with the change, else its choice is kept
    for dotted, value in {**({} if replan else chosen), **lever["change"](spec)}.items():
        section, key = dotted.split(".")
        config.setdefault(section, {})[key] = value
    if not replan:
        config["train"].pop("global_batch_size")  # micro batch x accumulation are now given
    changes = lever.get("deepspeed_changes")
    result = runner.run(run_name, "zerofit", {"cap_gib": case["cap_gib"], "config": config,
                                              "deepspeed_changes": changes}, budget)
    entry = complete(zerofit_entry(run_dir, case["global_batch"] * case["seq_len"]), result, spec, hw, rates, case)
    if changes:
        entry["deepspeed_changes"] = changes
    record["configs"][f"zerofit_{name}"] = entry
    return lever_summary(name, record)


def lever_summary(name: str, record: dict) -> dict:
    """What a measured lever bought: its run against zerofit's choice, or against the lever's
    own baseline run when it has one (`off_config`)."""
    lever = LEVERS[name]
    baseline_tps = record["configs"].get(lever.get("off_config", "zerofit"), {}).get("tokens_per_s")
    changed_tps = record["configs"][f"zerofit_{name}"].get("tokens_per_s")
    choice_tps = record["configs"].get("zerofit", {}).get("tokens_per_s")
    on, off = (baseline_tps, changed_tps) if lever["lever_on_in_choice"] else (changed_tps, baseline_tps)
    return {"what": lever["what"], "tokens_per_s_with": on, "tokens_per_s_without": off,
            "gain": round(on / off, 2) if on and off else None,
            "gain_vs_choice": round(changed_tps / choice_tps, 2) if changed_tps and choice_tps else None}
