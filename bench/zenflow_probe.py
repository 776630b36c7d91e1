"""DeepSpeed's ZenFlow on a speed_bench case: does it step, and where do its minutes go.

speed_bench's `zenflow` lever records only "stopped at its deadline" when a run makes no
step in its budget. This runs the same thing in this process, with its output kept: a
speed_bench case (default 3.6b: llama-3.6b, 24 GiB cap, 16 x 1024 tokens per step) with the
lever's ZenFlow settings laid over the DeepSpeed config zerofit builds, the model built whole
(engine.builds_under_zero_init), and every thread's stack dumped every 45 s (faulthandler),
so that a slow phase or a hang names its place.

GPU machine:  source .whl/prelude.sh || exit; python bench/zenflow_probe.py --case 3.6b
  --fields '{"train.micro_batch_size": 2, ...}'    laid over the shape ZenFlow needs
                                                    (speed_levers.zenflow_shape: micro 4 x 4, no
                                                    checkpointing, the reduce bucket); the
                                                    planner checks the fit
  --zenflow '{"update_interval": 1}'               laid over the lever's ZenFlow settings
  --tag T                                          names the outputs zenflow_probe-CASE-T*
Writes $OUT/zenflow_probe-CASE.log (the run's output) and the run's metrics.jsonl and
plan.json as zenflow_probe-CASE-*.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from speed_cases import CASES, zerofit_config  # noqa: E402 (after the path above)
from speed_levers import LEVERS, zenflow_shape  # noqa: E402
from speed_workers import cap_gpu, deepspeed_changes, merged  # noqa: E402

STACK_EVERY_S = 45


def probe_config(case: dict, run_dir: Path, steps: int, fields: dict) -> dict:
    from zerofit.config.load import validate
    from zerofit.plan import spec

    config = zerofit_config(case, run_dir, steps, "cuda")
    fields = {**zenflow_shape(spec.from_config(validate(config))), **fields}
    for dotted, value in fields.items():
        section, key = dotted.split(".")
        config.setdefault(section, {})[key] = value
    config["train"].pop("global_batch_size")  # micro batch x accumulation are given
    config["log"] = {"progress": True}
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="3.6b", choices=sorted(CASES))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--fields", default="{}", help="JSON: dotted zerofit fields, as speed_bench records them")
    parser.add_argument("--zenflow", default="{}", help="JSON laid over the lever's ZenFlow settings")
    parser.add_argument("--tag", default="", help="appended to the output files' names")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = Path(args.out or os.environ["OUT"])
    out.mkdir(parents=True, exist_ok=True)
    stem = f"zenflow_probe-{args.case}" + (f"-{args.tag}" if args.tag else "")
    log = open(out / f"{stem}.log", "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    faulthandler.dump_traceback_later(STACK_EVERY_S, repeat=True, file=log)

    from zerofit.config.load import validate
    from zerofit.train.loop import train

    case = CASES[args.case]
    run_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"{stem}-{os.getpid()}" / "run"
    config = probe_config(case, run_dir, args.steps, json.loads(args.fields))
    changes = merged(LEVERS["zenflow"]["deepspeed_changes"],
                     {"zero_optimization": {"zenflow": json.loads(args.zenflow)}})
    print("config", json.dumps(config), "\ndeepspeed changes", json.dumps(changes), flush=True)
    cap_gpu(case["cap_gib"])
    started = time.time()
    try:
        with deepspeed_changes(changes):
            train(validate(config), resume=False)
    finally:
        print(f"train returned after {time.time() - started:.1f}s", flush=True)
        for name in ("metrics.jsonl", "plan.json"):
            if (run_dir / name).exists():
                (out / f"{stem}-{name}").write_bytes((run_dir / name).read_bytes())


if __name__ == "__main__":
    main()
