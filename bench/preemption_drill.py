"""Preemption drill: SIGTERM in the middle of a run, as a spot or preemptible scheduler sends
it, then the resume with a changed learning rate; on the GPU machine with a real model.

GPU machine (llama-0.5b planned for 8 GiB, ~3 min; writes $OUT/preemption.json):
    source .whl/prelude.sh || exit; python bench/preemption_drill.py
CPU smoke test of the same path with the tiny model (< 1 min):
    python bench/preemption_drill.py --smoke

Measured: the seconds from the SIGTERM to the process's exit (what a grace window must cover:
the step in flight, the save of the step it stops at (checkpoint.save_on_sigterm), exit 143),
the step it stopped at against the newest checkpoint (the same, or steps were lost), and the
checkpoint's bytes; then `zerofit train --config RUN/config.yaml --resume` with train.lr
doubled and a few more steps: the step it resumed at, and the LR logged for its steps against
the schedule's (engine.lr_lambda under the new settings: DeepSpeed restores the saved LR over
the config's, zerofit sets the config's again).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU: the same path in seconds")
    parser.add_argument("--preset", default="llama-0.5b")
    parser.add_argument("--gpu-mem", default="8GiB", help="the budget the planner plans for")
    parser.add_argument("--sigterm-at", type=int, default=6, help="send SIGTERM once this step is logged")
    parser.add_argument("--more-steps", type=int, default=3, help="steps the resume trains")
    parser.add_argument("--dir", default="/tmp/zerofit-preemption-drill")
    parser.add_argument("--out", default=None, help="result directory (default $OUT, else bench/results)")
    args = parser.parse_args()
    if args.smoke:
        args.preset, args.gpu_mem = "tiny", None
    return args


def drill_config(args, run_dir: Path) -> dict:
    seq_len = 64 if args.smoke else 1024
    return {"run_dir": str(run_dir), "model": {"config": args.preset},
            "data": {"path": "synthetic", "synthetic_samples": 16 * 200, "eval_fraction": 0.0},
            "train": {"seq_len": seq_len, "global_batch_size": 16, "max_steps": 200, "lr": 1e-4, "warmup_steps": 2},
            "eval": {"every_steps": 0, "at_end": False},
            "checkpoint": {"every_steps": 10_000, "save_final": False},  # the only save: SIGTERM's
            "plan": {"gpu_mem": args.gpu_mem}, "log": {"progress": False}}


def logged(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def zerofit(*args: str) -> list[str]:
    return [sys.executable, "-m", "zerofit", "train", *args]


def preempt(config_path: Path, run_dir: Path, at_step: int) -> dict:
    """Train until `at_step` is logged, SIGTERM, time the exit."""
    process = subprocess.Popen(zerofit("--config", str(config_path)), cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    while process.poll() is None and not any(r["step"] >= at_step for r in logged(run_dir)):
        time.sleep(0.05)
    sent = time.perf_counter()
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=600)
    exited = time.perf_counter()
    said = [line for line in output.splitlines() if "stopped by SIGTERM" in line or line.startswith("checkpoint ")]
    return {"exit_code": process.returncode, "sigterm_to_exit_s": round(exited - sent, 2), "said": said,
            "output_tail": output[-1500:] if process.returncode != 143 else None}


def resume(run_dir: Path, stopped_at: int, lr: float, more: int) -> dict:
    """The resume command the stop names, with the LR changed and `more` steps to train."""
    from zerofit.config.load import load
    from zerofit.train.engine import lr_lambda

    changes = [f"train.lr={lr}", f"train.max_steps={stopped_at + more}"]
    done = subprocess.run(zerofit("--config", str(run_dir / "config.yaml"), "--resume",
                                  *[arg for change in changes for arg in ("--set", change)]),
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    records = [r for r in logged(run_dir) if r["step"] > stopped_at]
    factor = lr_lambda(load(run_dir / "config.yaml", changes), stopped_at + more)
    expected = [lr * factor(r["step"] - 1) for r in records]  # the LR a step applies: the schedule at step - 1
    errors = [abs(got["lr"] - want) / want for got, want in zip(records, expected)]
    resumed = [line for line in done.stderr.splitlines() if "resumed from" in line]
    return {"exit_code": done.returncode, "resumed": resumed, "steps": [r["step"] for r in records],
            "lr_logged": [r["lr"] for r in records], "lr_expected": expected,
            "lr_max_relative_error": max(errors) if errors else None,
            "loss": [round(r["loss"], 4) for r in records],
            "output_tail": done.stderr[-1500:] if done.returncode else None}


def main() -> None:
    args = parse_args()
    import yaml

    from zerofit.checkpoint import files as checkpoint

    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    run_dir = work / "run"
    config_path = work / "drill.yaml"
    work.mkdir(parents=True)
    config = drill_config(args, run_dir)
    config_path.write_text(yaml.safe_dump(config))

    stop = preempt(config_path, run_dir, args.sigterm_at)
    before = logged(run_dir)
    stopped_at = before[-1]["step"] if before else 0
    published = checkpoint.published(run_dir / "checkpoints")
    newest = published[0] if published else None
    saved_bytes = checkpoint.read_manifest(newest)["total_bytes"] if newest else None
    after = resume(run_dir, stopped_at, 2 * config["train"]["lr"], args.more_steps) if newest else {}
    result = {
        "command": "python bench/preemption_drill.py" + (" --smoke" if args.smoke else ""),
        "device": "CPU accelerator (smoke)" if args.smoke else gpu_name(),
        "preset": args.preset, "gpu_mem": args.gpu_mem, "seq_len": config["train"]["seq_len"],
        "sequences_per_step": config["train"]["global_batch_size"],
        "sigterm_after_step": args.sigterm_at, "stopped_at_step": stopped_at,
        "newest_checkpoint": newest.name if newest else None, "checkpoint_bytes": saved_bytes,
        "steps_lost": stopped_at - checkpoint.step_of(newest) if newest else stopped_at,
        "loss_before_stop": [round(r["loss"], 4) for r in before[-3:]],
        **{f"stop_{k}": v for k, v in stop.items()}, **{f"resume_{k}": v for k, v in after.items()},
    }
    result["ok"] = (stop["exit_code"] == 143 and result["steps_lost"] == 0 and after.get("exit_code") == 0
                    and after.get("steps", [None])[0] == stopped_at + 1
                    and after.get("lr_max_relative_error") is not None and after["lr_max_relative_error"] < 1e-6)
    out = Path(args.out or os.environ.get("OUT") or ROOT / "bench" / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "preemption.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("ok", "stopped_at_step", "newest_checkpoint", "stop_sigterm_to_exit_s",
                                             "checkpoint_bytes", "resume_steps", "resume_lr_max_relative_error")
                      if k in result}))


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    main()
