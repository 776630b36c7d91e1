"""One measured config's record in speed.json: the warm-up rule and the steady step, what a run
left behind (zerofit's metrics and plan, HF Trainer's step clock), the planner's prediction for
it, the roofline at the measured rates, a case's speedup, and speed.md."""
from __future__ import annotations

import json
from pathlib import Path

from speed_cases import GIB, stock_candidate

from zerofit.core.files import read_jsonl

# ZeRO-3 records the order its modules fetch parameters in during the first forward; the second
# is the first pass over the complete trace, where DeepSpeed builds, once, the cached set of
# parameters each module may release (partitioned_param_coordinator.py, `__params_to_release`:
# 5.1 s of a cProfiled 6.4 s step, bench/results/step_profile-0.5b-8-step2.*). So the optimizer
# steps that hold the first two micro batches are warm-up, for every config alike: two steps at
# accumulation 1 (zerofit's 16 x 1 ran its second step 1.4x its later ones on llama-3.6b, 3x on
# llama-0.5b), one step otherwise.
WARMUP_MICRO_BATCHES = 2
WARMUP_RULE = "the steps holding the first two micro batches excluded (two steps at accumulation 1, else one)"


def warmup_steps(grad_accum: int) -> int:
    return -(-WARMUP_MICRO_BATCHES // grad_accum)


def steady(step_seconds: list[float], tokens_per_step: int, grad_accum: int) -> dict:
    """Tokens/s over the steps after the warm-up (WARMUP_MICRO_BATCHES)."""
    warmup = warmup_steps(grad_accum)
    measured = step_seconds[warmup:]
    record = {"warmup_steps": warmup,
              "warmup_step_seconds": [round(s, 3) for s in step_seconds[:warmup]] or None}
    if not measured:
        return {"tokens_per_s": None, "steady_step_seconds": None, "measured_steps": 0, **record}
    mean = sum(measured) / len(measured)
    return {"tokens_per_s": round(tokens_per_step / mean, 1), "steady_step_seconds": round(mean, 3),
            "measured_steps": len(measured), **record}


def roofline(work: dict, rates: dict) -> dict:
    """Bound terms of one config at the measured rates; which one binds."""
    terms = {}
    if rates.get("matmul_flops_per_s"):
        terms["compute"] = work["flops"] / rates["matmul_flops_per_s"]
    if rates.get("h2d_bytes_per_s"):
        pcie = min(rates["h2d_bytes_per_s"], rates["d2h_bytes_per_s"])
        moved = work["pcie_param_bytes"] + work["pcie_grad_bytes"] + work["boundary_grad_bytes"] \
            + work["copy_back_bytes"] + work["copy_out_bytes"]
        terms["pcie"] = moved / pcie
    if rates.get("cpu_adam_seconds_per_param"):
        terms["cpu_adam"] = work["adam_host_params"] * rates["cpu_adam_seconds_per_param"]
    terms = {k: round(v, 4) for k, v in terms.items()}
    binds = max(terms, key=terms.get) if terms else None
    return {"bound_terms_s": terms, "bound_s": terms.get(binds), "binds": binds}


def complete(entry: dict, result: dict, spec, hw, rates: dict, case: dict) -> dict:
    """A measured config's record: the run's outcome, the planner's prediction for it, the
    step's work and its roofline at the measured rates."""
    from zerofit.plan.estimate import Shape
    from zerofit.plan.steptime import step_seconds, step_time_terms, step_work

    entry.update({k: v for k, v in result.items() if k != "dir"})
    shape = Shape(seq_len=case["seq_len"], micro_batch=entry["micro_batch"],
                  grad_accum=case["global_batch"] // entry["micro_batch"],
                  gradient_checkpointing=entry.get("gradient_checkpointing", True))
    cand = entry.pop("candidate", None) or stock_candidate(spec)
    work = step_work(spec, shape, cand)
    terms = step_time_terms(spec, hw, shape, cand, work=work)
    entry.setdefault("predicted_step_seconds", step_seconds(terms))
    if entry.get("predicted_gpu_peak") and entry.get("gpu_peak"):
        entry["gpu_peak_error_pct"] = round(100 * (entry["predicted_gpu_peak"] / entry["gpu_peak"] - 1), 1)
    entry.setdefault("predicted_terms_s", terms)
    entry["work"] = {k: int(v) for k, v in work.items()}
    entry.update(roofline(work, rates))
    return against_steady(entry)


def against_steady(entry: dict) -> dict:
    """The roofline fraction and the prediction's error, both against the steady step."""
    if entry.get("steady_step_seconds") and entry.get("bound_s"):
        entry["roofline_fraction"] = round(entry["bound_s"] / entry["steady_step_seconds"], 3)
        entry["prediction_error_pct"] = round(100 * (entry["predicted_step_seconds"] - entry["steady_step_seconds"])
                                              / entry["steady_step_seconds"], 1)
    return entry


def zerofit_entry(run_dir: Path, tokens_per_step: int) -> dict:
    from zerofit.plan.estimate import Candidate

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    timeline = read_jsonl(run_dir / "memory.jsonl")
    plan = json.loads((run_dir / "plan.json").read_text()) if (run_dir / "plan.json").exists() else {}
    grad_accum = plan["shape"]["grad_accum"] if plan else 1
    entry = steady([m["step_seconds"] for m in metrics], tokens_per_step, grad_accum) | {"grad_accum": grad_accum}
    entry["step_seconds"] = [round(m["step_seconds"], 3) for m in metrics]
    entry["gpu_peak"] = max((r.get("gpu_peak") or 0 for r in timeline), default=None)
    entry["gpu_peak_reserved"] = max((r.get("gpu_peak_reserved") or 0 for r in timeline), default=None)
    entry["loss"] = [round(m["loss"], 4) for m in metrics]
    if plan:
        shape, cand = plan["shape"], plan["candidate"]
        entry.update(chosen=plan["chosen"], chosen_fields=plan["chosen_fields"], micro_batch=shape["micro_batch"],
                     gradient_checkpointing=shape["gradient_checkpointing"], candidate=Candidate(**cand),
                     predicted_step_seconds=plan["estimated_step_seconds"], predicted_terms_s=plan["step_terms"],
                     predicted_gpu_peak=plan["predicted_gpu_peak"], predicted_host_rss=plan["predicted_host_rss"],
                     deepspeed_config=plan["deepspeed_config"]["zero_optimization"])
    else:
        entry.update(micro_batch=1)
    return entry


def hf_entry(out: Path, tokens_per_step: int, micro: int, grad_accum: int) -> dict:
    steps = read_jsonl(out / "steps.jsonl")
    entry = steady([s["step_seconds"] for s in steps], tokens_per_step, grad_accum) | {"grad_accum": grad_accum}
    entry.update(step_seconds=[round(s["step_seconds"], 3) for s in steps], micro_batch=micro,
                 gpu_peak=max((s.get("gpu_peak") or 0 for s in steps), default=None),
                 gpu_peak_reserved=max((s.get("gpu_peak_reserved") or 0 for s in steps), default=None),
                 chosen=f"LLaMA-Factory ds_z3_offload, micro batch {micro}")
    return entry


def summarise_case(record: dict) -> None:
    tps = record["tokens_per_s"]
    stock = max((tps.get(n) or 0 for n in ("stock_lf", "stock_tuned")), default=0)
    record["faster_stock"] = max(("stock_lf", "stock_tuned"), key=lambda n: tps.get(n) or 0) if stock else None
    record["speedup_vs_stock"] = round(tps["zerofit"] / stock, 2) if stock and tps.get("zerofit") else None
    z = record["configs"].get("zerofit", {})
    record["roofline_fraction"] = z.get("roofline_fraction")
    record["bound_terms_s"], record["binds"] = z.get("bound_terms_s"), z.get("binds")


def collected_from(case: dict) -> list[str]:
    """Where a case of a collected speed.json was measured (`--collect`)."""
    if "source" not in case:
        return []
    return [f"from `{case['source']}` ({case['device']}, {case['host']}): `{case['command']}`; "
            f"rates {json.dumps(case['rates'])}"]


def steps_column(config: dict) -> str:
    """warm-up + measured steps (runs before WARMUP_RULE recorded no warm-up count: one step)."""
    return f"{config.get('warmup_steps', 1)} + {config['measured_steps']}" if "measured_steps" in config else "-"


def write_markdown(path: Path, result: dict) -> None:
    lines = [f"# Speed: zerofit vs stock ZeRO-3 offload ({result['device']})", "",
             f"Command: `{result['command']}`", "",
             f"Steady step: {result.get('warmup', 'the first step excluded')}; steps = warm-up + measured.", ""]
    if result.get("rates"):
        lines += [f"Rates measured first: {json.dumps(result['rates'])}", ""]
    for case in result["cases"]:
        if case.get("skipped"):
            lines += [f"## {case['model']} @ {case.get('gpu_cap_gib')} GiB: skipped ({case['skipped']})", ""]
            continue
        lines += [f"## {case['model']} @ {case['gpu_cap_gib']} GiB, seq {case['seq_len']}, "
                  f"{case['global_batch']} sequences per step", *collected_from(case),
                  f"speedup vs the faster stock ({case.get('faster_stock')}): {case.get('speedup_vs_stock')}; "
                  f"zerofit roofline fraction {case.get('roofline_fraction')} (binds: {case.get('binds')})", "",
                  "| config | chosen | tokens/s | steady step s | steps | predicted s | GPU peak GiB | host RSS GiB "
                  "| bound s (binds) | roofline fraction | status |", "|---" * 11 + "|"]
        for name, c in case["configs"].items():
            gib = (lambda b: f"{b / GIB:.2f}" if b else "-")
            lines.append(f"| {name} | {c.get('chosen', '-')} | {c.get('tokens_per_s')} | {c.get('steady_step_seconds')} "
                         f"| {steps_column(c)} | {c.get('predicted_step_seconds')} | {gib(c.get('gpu_peak'))} "
                         f"| {gib(c.get('host_rss_peak'))} | {c.get('bound_s')} ({c.get('binds')}) "
                         f"| {c.get('roofline_fraction')} | {c.get('status')} |")
        lines.append("")
    path.write_text("\n".join(lines) + "\n")
