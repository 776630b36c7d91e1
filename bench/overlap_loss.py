"""DeepSpeed's SuperOffload and ZenFlow: their loss curves and their checkpoints (issue 7, item 4).

DeepSpeed's SuperOffload (offload_optimizer.super_offload, runtime/superoffload/) overlaps
the CPU optimizer step with the backward only when gradient clipping is off. This trains the
embedded demo (`zerofit train`'s model and data, 200 steps, optimizer and parameters
offloaded to the CPU, sub groups of 100,000 elements so that the demo has several) four
times, each in its own process:
  clip                  zerofit as configured (grad_clip 1.0);
  no_clip               grad_clip 0;
  superoffload_no_clip  grad_clip 0 with super_offload (the overlapping path);
  superoffload_clip     grad_clip 1.0 with super_offload (steps after the backward).
and reports each run's losses, how far the SuperOffload runs are from their twin without
it, and what the final checkpoint holds of Adam's moments (DeepSpeed's optimizer state
files: every `exp_avg` / `exp_avg_sq` tensor, counted and summed). SuperOffload's CPU-Adam
lives in a worker process with its own moments (superoffload_utils.py), so a checkpoint
written from the main process may not hold them. `--runs clip,zenflow_clip` trains with
ZenFlow (speed_bench's `zenflow` lever) instead: zerofit builds the model whole for it
(engine.builds_under_zero_init; under zero.Init its first forward failed), and the demo trains
(bench/results/README.md, 2026-12-01).

GPU machine:  source .whl/prelude.sh || exit; python bench/overlap_loss.py
Here (CPU):   python bench/overlap_loss.py --smoke   (SuperOffload asserts CUDA: the two
              runs without it, 20 steps)
Writes $OUT/overlap_loss.json and overlap_loss.png (or --out; --smoke without either: a
temporary directory).
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

from speed_levers import LEVERS, SUPER_OFFLOAD  # noqa: E402 (after the path above)
from speed_workers import Runner, gpu_name  # noqa: E402

from zerofit.core.files import read_jsonl  # noqa: E402

ZENFLOW = LEVERS["zenflow"]["deepspeed_changes"]
RUNS = {  # name: (grad_clip, DeepSpeed changes)
    "clip": (1.0, None),
    "no_clip": (0.0, None),
    "superoffload_no_clip": (0.0, SUPER_OFFLOAD),
    "superoffload_clip": (1.0, SUPER_OFFLOAD),
    "zenflow_clip": (1.0, ZENFLOW),
}
TWIN = {"superoffload_no_clip": "no_clip", "superoffload_clip": "clip", "zenflow_clip": "clip"}
DEFAULT_RUNS = "clip,no_clip,superoffload_no_clip,superoffload_clip"


def demo_config(run_dir: Path, grad_clip: float, steps: int) -> dict:
    import yaml

    from zerofit.config.load import DEMO_CONFIG

    raw = yaml.safe_load(DEMO_CONFIG.read_text())
    raw["run_dir"] = str(run_dir)
    raw["train"].update(max_steps=steps, grad_clip=grad_clip)
    raw["zero"].update(offload_optimizer="cpu", offload_param="cpu", sub_group_size=100_000)
    raw["checkpoint"].update(every_steps=0, save_final=True)
    raw["log"] = {"progress": False}
    return raw


def moments(run_dir: Path) -> dict:
    """Adam's moments in the newest checkpoint's DeepSpeed optimizer state files."""
    import torch

    files = sorted((run_dir / "checkpoints").glob("step-*/**/*optim_states.pt"))
    found = {"files": [str(f.relative_to(run_dir)) for f in files], "tensors": 0, "elements": 0, "abs_sum": 0.0}

    def walk(node, key=""):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, str(k))
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v, key)
        elif torch.is_tensor(node) and key in ("exp_avg", "exp_avg_sq"):
            found["tensors"] += 1
            found["elements"] += node.numel()
            found["abs_sum"] += float(node.double().abs().sum())

    for f in files:
        walk(torch.load(f, map_location="cpu", weights_only=False))
    return found


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, run in result["runs"].items():
        if run.get("loss"):
            ax.plot(range(1, len(run["loss"]) + 1), run["loss"], label=name,
                    linestyle="--" if RUNS[name][1] else "-")
    ax.set(xlabel="optimizer step", ylabel="training loss", yscale="log",
           title="embedded demo: clipping, DeepSpeed SuperOffload and ZenFlow")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU accelerator, the runs without SuperOffload")
    parser.add_argument("--out", default=None)
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 200; smoke 20)")
    parser.add_argument("--deadline-s", type=float, default=400)
    parser.add_argument("--runs", default=DEFAULT_RUNS, help=f"which of {', '.join(RUNS)}, in order (the twin of "
                        "a run with a DeepSpeed change must come before it); another list writes overlap_loss-RUNS.*")
    args = parser.parse_args()
    out = Path(args.out or os.environ.get("OUT") or (tempfile.mkdtemp(prefix="overlap-smoke-") if args.smoke
                                                     else ROOT / "bench" / "results"))
    out.mkdir(parents=True, exist_ok=True)
    steps = args.steps or (20 if args.smoke else 200)
    accelerator = "cpu" if args.smoke else "cuda"
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")  # device README: the arch autodetection fails there
    started = time.time()
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"overlap-loss-{os.getpid()}"
    runner = Runner(work, accelerator, started, args.deadline_s)
    names = [n for n in args.runs.split(",") if not (args.smoke and RUNS[n][1])]
    stem = "overlap_loss" if args.runs == DEFAULT_RUNS else f"overlap_loss-{args.runs.replace(',', '_')}"
    result = {"device": "CPU accelerator (smoke)" if args.smoke else gpu_name(),
              "command": "python bench/overlap_loss.py" + (" --smoke" if args.smoke else "")
              + (f" --steps {args.steps}" if args.steps else "")
              + (f" --runs {args.runs}" if args.runs != DEFAULT_RUNS else ""), "steps": steps, "runs": {}}
    for name in names:
        grad_clip, changes = RUNS[name]
        run_dir = work / name / "run"
        outcome = runner.run(name, "zerofit", {"cap_gib": 1000, "config": demo_config(run_dir, grad_clip, steps),
                                               "deepspeed_changes": changes}, args.deadline_s)
        metrics = read_jsonl(run_dir / "metrics.jsonl")  # none when the run died before its first step
        run = {"grad_clip": grad_clip, "deepspeed_changes": changes, "status": outcome["status"],
               "loss": [m["loss"] for m in metrics],
               "step_seconds": [round(m["step_seconds"], 4) for m in metrics],
               "eval_loss": {m["step"]: m["eval_loss"] for m in metrics if "eval_loss" in m},
               "checkpoint_moments": moments(run_dir) if outcome["status"] == "done" else None}
        if outcome.get("log_tail"):
            run["log_tail"] = outcome["log_tail"]
        twin = result["runs"].get(TWIN.get(name, ""), {})
        if run["loss"] and twin.get("loss"):
            pairs = list(zip(run["loss"], twin["loss"]))
            run["vs_twin"] = {"twin": TWIN[name], "steps": len(pairs),
                              "max_abs_loss_diff": max(abs(a - b) for a, b in pairs),
                              "identical_steps": sum(a == b for a, b in pairs)}
        result["runs"][name] = run
        (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    plot(result, out / f"{stem}.png")
    result["elapsed_s"] = round(time.time() - started, 1)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({n: {k: r.get(k) for k in ("status", "vs_twin")} | {
        "final_loss": r["loss"][-1] if r["loss"] else None,
        "moments": (r["checkpoint_moments"] or {}).get("tensors")} for n, r in result["runs"].items()}), flush=True)


if __name__ == "__main__":
    main()
