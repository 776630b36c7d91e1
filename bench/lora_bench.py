"""LoRA on an 8B-class model under a 24 GiB and a 12 GiB GPU cap -> $OUT/lora.json.

Preset llama-8b (8.0e9 parameters, random init under zero.Init), synthetic tokens, default
LoRA (r 16 on q,k,v,o,gate,up,down), seq 1024, micro-batch 2, gradient checkpointing,
optimizer states on CPU. Cases (cap, where the frozen base lives):
  24GiB  offload_param none  the 16 GB bf16 base stays on the GPU
  12GiB  offload_param cpu   the base streams from pinned host memory every pass
If the base-on-GPU case runs out of memory, the same cap is retried with the base on CPU
(what the planner would pick), time permitting. Per case: tokens/s and step time (median
of the steps after the first two), GPU peak allocated/reserved in the steps (memory.jsonl)
and over the whole process (a 20 Hz sampler, build included), host RSS peak, set-up time
(build + engine + base fingerprint), the adapter-only save (seconds, bytes) and the
trainable parameter count read back from the checkpoint.

GPU machine (one H200), whole script about 5-7 minutes:
    source .whl/prelude.sh || exit; python bench/lora_bench.py
This machine, same code path with the tiny model on CPU (well under a minute):
    python bench/lora_bench.py --smoke

Each case runs in its own process (DeepSpeed keeps global state) through zerofit's own
train(), so what is measured is what users run. The GPU cap is
torch.cuda.set_per_process_memory_fraction(cap / total), set before anything is built.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GiB = 1 << 30
CASES = [("24GiB", 24, "none"), ("12GiB", 12, "cpu")]
WARMUP_STEPS = 2
RESERVE_S = 170  # kept back for each case still queued: an 8B build + 6 steps with the base on CPU


def case_config(name: str, offload_param: str, smoke: bool, work: Path) -> dict:
    """The zerofit config of one case (a plain dict, validated by the child)."""
    return {
        "run_dir": str(work / name),
        "model": {"config": "tiny" if smoke else "llama-8b", "gradient_checkpointing": True},
        "lora": {"enabled": True},
        "data": {"path": "synthetic", "synthetic_samples": 32 if smoke else 64, "eval_fraction": 0.0},
        "train": {"seq_len": 64 if smoke else 1024, "micro_batch_size": 2, "max_steps": 4 if smoke else 6,
                  "lr": 1e-4, "warmup_steps": 0, "seed": 0},
        "zero": {"stage": 3, "offload_optimizer": "cpu", "offload_param": offload_param},
        "eval": {"at_end": False},
        "checkpoint": {"every_steps": 0, "save_final": True, "keep_last": 1},
        "log": {"progress": False},
    }


def planner_prediction(config) -> dict | None:
    """The planner's prediction for `config`, planned as train plans it (zerofit/plan/render.py):
    the GPU peak as the allocator would reserve it (allocated peak + fragmentation, without
    the CUDA context) and the host RSS peak."""
    from zerofit.plan import render

    decision, _, _ = render.plan_config(config, world_size=1)
    gpu = decision.plan.devices["gpu"]
    return {"gpu_peak_bytes": gpu.total_bytes - gpu.components.get("cuda_context", 0),
            "host_peak_bytes": decision.plan.host_rss_peak}


# ------------------------------------------------------------------- one case
class PeakSampler(threading.Thread):
    """Largest GPU reserved bytes and host RSS seen, sampled every 50 ms from a thread:
    catches the build, which the per-phase memory timeline does not cover. Reserved
    memory only shrinks on empty_cache, so sampling it misses little."""

    def __init__(self, on_gpu: bool):
        super().__init__(daemon=True)
        import psutil

        self.process, self.on_gpu = psutil.Process(), on_gpu
        self.gpu_reserved = self.host_rss = 0
        self.stopped = threading.Event()

    def run(self) -> None:
        import torch

        while not self.stopped.wait(0.05):
            self.host_rss = max(self.host_rss, self.process.memory_info().rss)
            if self.on_gpu:
                self.gpu_reserved = max(self.gpu_reserved, torch.cuda.memory_reserved())


def run_case(spec: dict) -> dict:
    """Child process: cap the GPU, train, measure; returns the case's record."""
    import torch

    from zerofit.config.load import validate
    from zerofit.train.loop import train

    on_gpu = torch.cuda.is_available()
    record = {"case": spec["name"], "gpu_cap_gib": spec["cap_gib"], "offload_param": spec["offload_param"]}
    if on_gpu:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec["cap_gib"] * GiB / total), 0)
        record.update(gpu=torch.cuda.get_device_name(0), gpu_total_bytes=total)
    config = validate(spec["config"])
    predicted = planner_prediction(config)
    sampler = PeakSampler(on_gpu)
    sampler.start()
    started = time.perf_counter()
    train(config, resume=False)
    wall = time.perf_counter() - started
    sampler.stopped.set()
    sampler.join()
    record.update(measure_run(Path(config.run_dir), wall))
    record.update(gpu_reserved_process_peak_bytes=sampler.gpu_reserved,
                  host_rss_peak_bytes=max(sampler.host_rss, record.pop("host_rss_steps_peak_bytes")))
    record.update(planner_errors(predicted, record))
    return record


def measure_run(run_dir: Path, wall: float) -> dict:
    """Step speed, step-phase GPU peaks, save cost and trainable count from the run's files."""
    import torch

    def read(name):
        return [json.loads(line) for line in (run_dir / name).read_text().splitlines() if line.strip()]

    metrics, phases = read("metrics.jsonl"), read("memory.jsonl")
    steady = metrics[WARMUP_STEPS:] or metrics
    saves = [p for p in phases if p["phase"] == "save"]
    steps = [p for p in phases if p["phase"] in ("forward", "backward", "optimizer_step")]
    checkpoint = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    states = torch.load(next(checkpoint.glob("*model_states.pt")), map_location="cpu", weights_only=False)
    trainable = sum(shape.numel() for group in states["param_shapes"] for shape in group.values())
    save_seconds = sum(p.get("seconds", 0.0) for p in saves)
    return {
        "steps": len(metrics),
        "tokens_per_s": statistics.median(m["tokens_per_s"] for m in steady),
        "step_seconds": statistics.median(m["step_seconds"] for m in steady),
        "setup_seconds": round(wall - sum(m["step_seconds"] for m in metrics) - save_seconds, 1),
        "loss_first_last": [metrics[0]["loss"], metrics[-1]["loss"]],
        "gpu_peak_alloc_steps_bytes": max(p["gpu_peak"] for p in steps),
        "gpu_peak_reserved_steps_bytes": max(p["gpu_peak_reserved"] for p in steps),
        "host_rss_steps_peak_bytes": max(p["host_rss"] for p in phases),
        "save_seconds": save_seconds,
        "checkpoint_bytes": sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file()),
        "trainable_params": trainable,
    }


def planner_errors(predicted: dict | None, record: dict) -> dict:
    if predicted is None:
        return {"planner": None, "planner_note": "planner not integrated yet (bench/lora_bench.py planner_prediction)"}
    measured = {"gpu_peak_bytes": record["gpu_reserved_process_peak_bytes"],
                "host_peak_bytes": record["host_rss_peak_bytes"]}
    return {"planner": predicted,
            "planner_error": {k: measured[k] / v - 1 for k, v in predicted.items() if k in measured and v}}


# --------------------------------------------------------------------- driver
def spawn(spec: dict, work: Path, timeout: float) -> dict:
    """One case in a child process; a failure or timeout is a record too."""
    spec_file, result_file = work / f"{spec['name']}.spec.json", work / f"{spec['name']}.result.json"
    spec_file.write_text(json.dumps(spec))
    result_file.unlink(missing_ok=True)
    started = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(spec_file),
                               str(result_file)],
                              cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired:
        return {"case": spec["name"], "gpu_cap_gib": spec["cap_gib"], "offload_param": spec["offload_param"],
                "ok": False, "error": f"timed out after {timeout:.0f} s"}
    if done.returncode == 0 and result_file.is_file():
        return {**json.loads(result_file.read_text()), "ok": True,
                "process_seconds": round(time.perf_counter() - started, 1)}
    tail = (done.stdout + done.stderr)[-3000:]
    return {"case": spec["name"], "gpu_cap_gib": spec["cap_gib"], "offload_param": spec["offload_param"],
            "ok": False, "oom": "OutOfMemoryError" in tail or "out of memory" in tail, "error": tail}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU, same code path")
    parser.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget for all cases")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/zerofit-lora-bench/out"),
                        help="directory for lora.json (default $OUT)")
    parser.add_argument("--child", nargs=2, metavar=("SPEC", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(Path(args.child[0]).read_text())
        Path(args.child[1]).write_text(json.dumps(run_case(spec)))
        return 0

    deadline = time.perf_counter() + args.budget_s
    work = Path("/tmp/zerofit-lora-bench")
    work.mkdir(parents=True, exist_ok=True)
    queue = [{"name": name, "cap_gib": cap, "offload_param": offload} for name, cap, offload in CASES]
    results = []
    while queue:
        spec = queue.pop(0)
        spec["config"] = case_config(spec["name"], spec["offload_param"], args.smoke, work)
        left = deadline - time.perf_counter()
        timeout = max(left - RESERVE_S * len(queue), left / (len(queue) + 1))
        if left < 30:
            results.append({"case": spec["name"], "gpu_cap_gib": spec["cap_gib"], "ok": False,
                            "error": "not run: time budget spent"})
            continue
        result = spawn(spec, work, timeout)
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "error"}), flush=True)
        if not result["ok"] and result.get("oom") and spec["offload_param"] == "none":
            # What the planner would do: keep the cap, move the frozen base to CPU.
            queue.insert(0, {"name": spec["name"] + "-base-on-cpu", "cap_gib": spec["cap_gib"], "offload_param": "cpu"})
    report = {"bench": "lora", "smoke": args.smoke, "model": "tiny" if args.smoke else "llama-8b",
              "versions": versions(), "cases": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lora.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / 'lora.json'}")
    measured_caps = {r["gpu_cap_gib"] for r in results if r["ok"]}
    return 0 if measured_caps == {cap for _, cap, _ in CASES} else 1


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "deepspeed", "transformers", "peft"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


if __name__ == "__main__":
    sys.exit(main())
