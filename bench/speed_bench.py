"""Speed: zerofit's planned config vs LLaMA-Factory's ZeRO-3 offload config, side by side.

Case (issue 7): llama-1.5b preset (random init), seq 1024, 16 sequences per optimizer step,
AdamW (DeepSpeedCPUAdam wherever states are on the CPU), bf16, under an 8 GiB cap simulated
with torch.cuda.set_per_process_memory_fraction(cap / total). Each config runs in its own
process, one after the other (never two at once: they would share cores and PCIe):
  zerofit        `zerofit train` (the Python function) with the planner's choice, given
                 plan.gpu_mem = the cap and the machine's real available RAM;
  stock_lf       LLaMA-Factory's examples/deepspeed/ds_z3_offload_config.json values through
                 HF Trainer (deepspeed=dict), micro batch 1 x accumulation 16;
  stock_tuned    the same config at the largest micro batch the planner predicts to fit the
                 cap with its 10% headroom (planner.predict on the stock candidate; no probe
                 run: a probe would cost a model build). An OOM there is retried once at the
                 next smaller micro batch if the deadline allows.
The shipped file has no optimizer section, so HF Trainer would hand DeepSpeed torch's AdamW,
which then steps on the CPU ~4x slower than DeepSpeedCPUAdam (device README). For the same
optimizer everywhere the stock runs get {"optimizer": {"type": "AdamW", ...}} with zerofit's
hyper-parameters: DeepSpeed then builds DeepSpeedCPUAdam, as for zerofit.

Per config: step times of every optimizer step (the warm-up excluded: the steps holding the
first two micro batches, WARMUP_MICRO_BATCHES; `--collect` applies the same rule to earlier
runs' recorded steps), steady tokens/s, GPU peak (max_memory_allocated / reserved), host RSS peak (VmHWM, sampled by this
parent), the planner's predicted step seconds and terms for that config, and its roofline:
the bound is max(FLOPs / measured bf16 matmul rate, PCIe bytes / measured pinned rate,
CPU-Adam elements x measured DeepSpeedCPUAdam seconds per element) with FLOPs, bytes and
elements from steptime.step_work; roofline_fraction = bound / measured step seconds.
The rates are measured in the same command, first (roofline worker).

Deadlines: every config has its own, and the whole command stops at --deadline-s (default
390 s); results are rewritten after every config, so a timeout still leaves them. A second
case (3.6B @ 24 GiB) runs only when enough time is left (`--cases 1.5b,3.6b`); else it is
recorded as skipped with the reason.

GPU machine:  source .whl/prelude.sh || exit; python bench/speed_bench.py
Here (CPU):   python bench/speed_bench.py --smoke
Writes $OUT/speed.json and $OUT/speed.md (or --out; --smoke without either: a temporary directory); `--cases 3.6b` alone writes speed-3.6b.*.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from speed_cases import (
    CASES,
    CONFIGS,
    DEFAULT_CASES,
    GIB,
    SMOKE_CASE,
    planning,
    stock_ds_config,
    stock_micro_batches,  # noqa: E402 (after the path above)
    zerofit_config,
)
from speed_levers import LEVERS, lever_summary, run_levers  # noqa: E402
from speed_record import (
    WARMUP_RULE,
    against_steady,
    complete,
    hf_entry,
    steady,
    summarise_case,
    warmup_steps,
    write_markdown,  # noqa: E402
    zerofit_entry,
)
from speed_workers import Runner, gpu_name  # noqa: E402


def run_case(label: str, case: dict, runner: Runner, rates: dict, record: dict, save,
             configs: tuple = CONFIGS, levers: tuple | None = None) -> None:
    accelerator = runner.accelerator
    spec, hw = planning(case, accelerator)
    tokens_per_step = case["global_batch"] * case["seq_len"]
    record.update(model=case["model"], params=spec.total_params, gpu_cap_gib=case["cap_gib"], seq_len=case["seq_len"],
                  global_batch=case["global_batch"], tokens_per_step=tokens_per_step,
                  host_ram_available_gib=round(hw.host_budget_bytes / GIB, 1), configs={}, tokens_per_s={})
    save()
    options = stock_micro_batches(case, spec, hw)
    tuned = [m for m, plan in options if plan.devices["gpu"].fits] or [1]
    record["stock_tuned_choice"] = {
        "how": "planner.predict on the stock candidate for every micro batch dividing the global batch; the largest "
               "whose GPU peak fits the cap less 10% headroom (no probe run)",
        "predicted_gpu_gib": {m: round(p.devices["gpu"].total_bytes / GIB, 2) for m, p in options}}
    record["states_to_gpu_budget"] = round(16 * spec.total_params / (case["cap_gib"] * GIB), 2)
    for index, name in enumerate(CONFIGS):
        if name not in configs or name not in case.get("configs", CONFIGS):
            record["configs"][name] = {"status": "not run: left out by --configs or by the case"}
            continue
        measured_steps, budget = case["measured_steps"][index], case["budgets_s"][index]
        if name == "zerofit":  # its accumulation is the planner's: room for the longest warm-up
            steps = warmup_steps(1) + measured_steps
            run_dir = runner.work / f"{label}-zerofit" / "run"
            result = runner.run(f"{label}-zerofit", "zerofit", {
                "cap_gib": case["cap_gib"], "config": zerofit_config(case, run_dir, steps, accelerator)}, budget)
            entry = zerofit_entry(run_dir, tokens_per_step)
        else:
            micros = tuned[:2] if name == "stock_tuned" else [1]
            if name == "stock_tuned" and micros[0] == 1:
                record["configs"][name] = {"status": "same as stock_lf: micro batch 1 is the largest that fits"}
                continue
            for attempt, micro in enumerate(micros):
                grad_accum = case["global_batch"] // micro
                result = runner.run(f"{label}-{name}-m{micro}", "hf", {
                    "cap_gib": case["cap_gib"], "model": case["model"], "seq_len": case["seq_len"],
                    "micro_batch": micro, "grad_accum": grad_accum, "steps": warmup_steps(grad_accum) + measured_steps,
                    "ds_config": stock_ds_config()}, budget)
                entry = hf_entry(result["dir"], tokens_per_step, micro, grad_accum)
                oom = "OutOfMemoryError" in (result.get("log_tail") or "") or "out of memory" in (result.get(
                    "log_tail") or "")
                if not oom or attempt == len(micros) - 1:
                    break
                record["configs"][f"{name}_m{micro}"] = {**entry, **result, "dir": None, "status": "OOM"}
        record["configs"][name] = complete(entry, result, spec, hw, rates, case)
        record["tokens_per_s"][name] = entry.get("tokens_per_s")
        summarise_case(record)
        save()
    run_levers(label, case, runner, rates, record, spec, hw, save, tuple(LEVERS) if levers is None else levers)


def under_warmup_rule(case: dict) -> dict:
    """A case of an earlier run with its steady figures derived again from its recorded step
    times under WARMUP_RULE (runs before the twelfth session excluded the first step only)."""
    for name, entry in case["configs"].items():
        if entry.get("step_seconds") and entry.get("micro_batch"):
            grad_accum = entry.get("grad_accum") or case["global_batch"] // entry["micro_batch"]  # one GPU
            entry.update(steady(entry["step_seconds"], case["tokens_per_step"], grad_accum))
            against_steady(entry)
    case["tokens_per_s"] = {name: case["configs"].get(name, {}).get("tokens_per_s") for name in case["tokens_per_s"]}
    for name, summary in case.get("levers", {}).items():
        if isinstance(summary, dict) and name in LEVERS:
            case["levers"][name] = lever_summary(name, case)
    summarise_case(case)
    return case


def collect(files: list[str], out: Path) -> None:
    """speed.json and speed.md from the newest runs of each case: every case keeps the
    command, device, host and rates of the run it came from (one run per case is the
    side-by-side comparison; different cases may come from different runs and machines)."""
    cases = []
    for name in files:
        path, _, host = name.partition("@")
        run = json.loads(Path(path).read_text())
        for case in run["cases"]:
            if not case.get("skipped"):
                cases.append({**under_warmup_rule(case), "source": Path(path).name, "device": run["device"], "command": run["command"],
                              "host": host or "1 x H200 host: 16 cores 128 GiB", "rates": run["rates"]})
    result = {"device": ", ".join(sorted({c["device"] for c in cases})),
              "command": "python bench/speed_bench.py --collect " + ",".join(files), "warmup": WARMUP_RULE,
              "cases": cases}
    (out / "speed.json").write_text(json.dumps(result, indent=1, default=str))
    write_markdown(out / "speed.md", result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the tiny preset on the CPU accelerator")
    parser.add_argument("--out", default=None,
                        help="result directory (default $OUT, else bench/results; a temporary one for --smoke)")
    parser.add_argument("--deadline-s", type=float, default=390)
    parser.add_argument("--cases", default=DEFAULT_CASES, help="in order; a later case runs only if time is left "
                        "(another list than the default writes speed-CASES.json)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="which of the configs to run")
    parser.add_argument("--levers", default=",".join(LEVERS), help="which levers to measure, in order")
    parser.add_argument("--collect", help="FILE[@HOST],...: write speed.json and speed.md from these runs' cases "
                                          "(no measuring); HOST says which machine a file was measured on")
    args = parser.parse_args()
    # as nvme_bench: a smoke run never writes over the GPU machine's committed results
    args.out = args.out or os.environ.get("OUT") or (tempfile.mkdtemp(prefix="speed-smoke-") if args.smoke
                                                     else str(ROOT / "bench" / "results"))
    if args.collect:
        return collect(args.collect.split(","), Path(args.out))

    started = time.time()
    accelerator = "cpu" if args.smoke else "cuda"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"speed-bench-{os.getpid()}"
    runner = Runner(work, accelerator, started, args.deadline_s)
    cases = [("tiny", SMOKE_CASE)] if args.smoke else [(c, CASES[c]) for c in args.cases.split(",")]
    result = {"device": "CPU accelerator (smoke)" if args.smoke else gpu_name(),
              "command": "python bench/speed_bench.py" + (" --smoke" if args.smoke else "")
              + (f" --cases {args.cases}" if args.cases != DEFAULT_CASES else "")
              + (f" --configs {args.configs}" if args.configs != ",".join(CONFIGS) else "")
              + (f" --levers {args.levers}" if args.levers != ",".join(LEVERS) else ""),
              "deadline_s": args.deadline_s, "warmup": WARMUP_RULE, "cases": []}

    stem = "speed" if args.cases == DEFAULT_CASES or args.smoke else f"speed-{args.cases.replace(',', '_')}"

    def save() -> None:
        result["elapsed_s"] = round(time.time() - started, 1)
        tmp = out / f"{stem}.json.tmp"
        tmp.write_text(json.dumps(result, indent=1, default=str))
        tmp.replace(out / f"{stem}.json")
        write_markdown(out / f"{stem}.md", result)

    from zerofit.config.load import validate
    from zerofit.plan import spec as modelspec

    first = cases[0][1]
    params = modelspec.from_config(validate(zerofit_config(first, Path("/tmp/unused"), 2, accelerator))).total_params
    # The roofline worker measures the GPU first, then builds DeepSpeed's cpu_adam (JIT, once:
    # the config workers load that build) and times it. TORCH_CUDA_ARCH_LIST: the arch
    # autodetection fails on "9.0a" there (device README); the workers inherit it.
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    rates_run = runner.run("roofline", "roofline", {"adam_params": params}, 60 if args.smoke else 150)
    if rates_run["status"] != "done":  # killed mid-build: its lock would hang every later worker
        from zerofit.machine import opbuild

        for lock in opbuild.build_locks():
            if not lock.held_open:
                lock.path.unlink(missing_ok=True)
    rates_file = rates_run["dir"] / "roofline.json"
    result["rates"] = json.loads(rates_file.read_text()) if rates_file.exists() else {}
    result["rates"]["status"] = rates_run["status"]
    save()
    for label, case in cases:
        need = sum(case["budgets_s"]) * (0.6 if result["cases"] else 0)
        if runner.left() < max(need, 60):
            result["cases"].append({"model": case["model"], "gpu_cap_gib": case["cap_gib"],
                                    "skipped": f"{runner.left():.0f}s left of the {args.deadline_s:.0f}s deadline; "
                                               f"it needs ~{need:.0f}s: run `--cases {label}` on its own"})
            save()
            continue
        record: dict = {}
        result["cases"].append(record)
        run_case(label, case, runner, result["rates"], record, save, tuple(args.configs.split(",")),
                 tuple(filter(None, args.levers.split(","))))
    save()
    print(json.dumps({f'{c.get("model")} @ {c.get("gpu_cap_gib")} GiB': {
        "tokens_per_s": c.get("tokens_per_s"), "speedup": c.get("speedup_vs_stock"),
        "roofline_fraction": c.get("roofline_fraction")} for c in result["cases"]}), flush=True)
    print(f"wrote {out / stem}.json in {time.time() - started:.0f}s", flush=True)


if __name__ == "__main__":
    main()
