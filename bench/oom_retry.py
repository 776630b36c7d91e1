"""The in-process OOM retry (`memory.on_oom: retry`) on the GPU: does the second attempt find
the memory the first one held? (bench/results/README.md, sixth session: it found 65.6 of
125.9 GiB available, the failed attempt's engine still alive, and the planner refused.)

Runs a speed_bench case through `zerofit.train.loop.train` in one process (the bench's zerofit
worker: the GPU cap, then train) with `memory.on_oom: retry` and
`memory.expandable_segments: false`, the setting under which the headline's plan (llama-3.6b
under 5.3 GiB, micro 4 x 4) meets fragmentation in step 1's backward
(speed-3.6b-headline-expandable.json). Each planning call (`planview.plan_run`, one per
attempt) records the host's available memory, this process's RSS and the GPU allocator's
bytes when it starts, the micro batch and accumulation its config gave the planner (1 x 1 where
the planner chooses: the first attempt) and what the planner chose; the result adds the
post-mortem's event and changes, the steps the run trained and how it ended.

GPU machine (~3 min for 3.6b-headline):
    source .whl/prelude.sh || exit; python bench/oom_retry.py --case 3.6b-headline
Here (CPU, ~1 min): python bench/oom_retry.py --smoke   (preset tiny; ZEROFIT_FAULT=oom@step:2
stands for the OOM, and the retry's smaller micro batch trains on)
Writes $OUT/oom_retry-<case>.json (or --out).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import speed_cases  # noqa: E402 (after the path above)
import speed_workers  # noqa: E402

from zerofit.core.files import (
    read_json,  # noqa: E402
    read_jsonl,  # noqa: E402
)

GIB = 2**30


def memory_now() -> dict:
    import psutil
    import torch

    from zerofit.core.timeline import host_rss_bytes

    sample = {"host_available_gib": round(psutil.virtual_memory().available / GIB, 2),
              "host_total_gib": round(psutil.virtual_memory().total / GIB, 2),
              "rss_gib": round(host_rss_bytes() / GIB, 2)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        sample.update(gpu_allocated_gib=round(torch.cuda.memory_allocated() / GIB, 3),
                      gpu_reserved_gib=round(torch.cuda.memory_reserved() / GIB, 3))
    return sample


def worker(spec: dict, out: Path) -> None:
    from zerofit.config.load import validate
    from zerofit.plan import render
    from zerofit.plan.choose import describe
    from zerofit.train.loop import train

    speed_workers.cap_gpu(spec["cap_gib"])
    attempts, plan_run = [], render.plan_run

    def recorded_plan_run(config, *args, **kwargs):
        attempts.append({"attempt": len(attempts) + 1, "at_plan": memory_now(),
                         "micro_batch": config.train.micro_batch_size, "grad_accum": config.train.grad_accum_steps})
        (out / "attempts.json").write_text(json.dumps(attempts))
        planned, decision = plan_run(config, *args, **kwargs)
        attempts[-1].update(chosen=describe(decision.plan), fits=decision.plan.fits)
        (out / "attempts.json").write_text(json.dumps(attempts))
        return planned, decision

    render.plan_run = recorded_plan_run
    result = train(validate(spec["config"]), resume=False)
    (out / "result.json").write_text(json.dumps({"step": result.step, "train_loss": result.train_loss,
                                                 "at_end": memory_now()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="3.6b-headline", choices=sorted(speed_cases.CASES))
    parser.add_argument("--smoke", action="store_true", help="preset tiny on the CPU, an injected OOM")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout-s", type=int, default=420)
    parser.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results")))
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        spec_path, out = args.worker
        worker(json.loads(Path(spec_path).read_text()), Path(out))
        return

    import torch

    accelerator = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    case = dict(speed_cases.CASES[args.case])
    env = dict(os.environ)
    if args.smoke:
        case.update(model="tiny", seq_len=64, global_batch=4)
        env.update(ZEROFIT_FAULT="oom@step:2", DS_ACCELERATOR="cpu")
    name = f"oom_retry-{'smoke' if args.smoke else args.case}"
    work = Path(f"/tmp/zerofit-{name}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    config = speed_cases.zerofit_config(case, work / "run", args.steps, accelerator)
    config["memory"] = {"on_oom": "retry", "expandable_segments": False}
    if args.smoke:  # the tiny plan's micro batch is the global batch: 4 x 1, so the retry has one to halve
        config["train"]["micro_batch_size"] = 4
    spec = {"config": config, "cap_gib": case["cap_gib"] if accelerator == "cuda" else None}
    (work / "spec.json").write_text(json.dumps(spec))
    started = time.perf_counter()
    with open(work / "log.txt", "w") as log:
        try:
            code = subprocess.run([sys.executable, __file__, "--worker", str(work / "spec.json"), str(work)],
                                  cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=args.timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    report = read_json(work / "run" / "postmortem" / "report.json") or {}
    steps = read_jsonl(work / "run" / "metrics.jsonl")
    log_lines = (work / "log.txt").read_text().splitlines()
    result = {"command": "python " + " ".join(sys.argv), "device": speed_workers.gpu_name() if accelerator == "cuda"
              else "cpu", "case": case, "memory": config["memory"], "exit_code": code,
              "wall_s": round(time.perf_counter() - started, 1), "attempts": read_json(work / "attempts.json") or [],
              "oom_event": {k: report.get("event", {}).get(k) for k in ("step", "phase", "device", "requested_bytes")},
              "retry_changes": report.get("changes"), "run_result": read_json(work / "result.json"),
              "steps_trained": [{k: s.get(k) for k in ("step", "loss", "step_seconds")} for s in steps
                                if "loss" in s],
              "log_tail": [line for line in log_lines if "warning" not in line.lower()][-25:]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("exit_code", "wall_s", "attempts", "oom_event", "retry_changes",
                                             "run_result")}, indent=1))
    print(f"-> {out / name}.json")


if __name__ == "__main__":
    main()
