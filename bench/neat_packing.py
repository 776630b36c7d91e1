"""data.neat_packing on the GPU: what the block-diagonal attention mask costs, and whether the
planner's GPU peak holds with it.

Per case (model, seq_len, micro batch), two real `zerofit train` runs of one shape, one after
the other, under one simulated GPU cap: packed rows whose examples see each other (data.packing)
and rows whose examples attend only to themselves (data.neat_packing). The data is the same
text file of examples of 100-3000 characters (the presets' character tokenizer: one token each),
so a row holds several. SDPA with an explicit mask cannot take the flash kernel (is_causal), so
the speed cost is the kernel's as much as the mask's.

Measured per run: steady tokens/s (the median over steps 3..N), the GPU peak (max over the phase
lines of memory.jsonl, step 1's forward left out: its window spans the build), the plan's
predicted peak and its attention_mask component (plan.json), the last loss.

GPU machine:  source .whl/prelude.sh || exit; python bench/neat_packing.py
Here (CPU):   python bench/neat_packing.py --smoke
Writes $OUT/neat_packing.json (or --out).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

from zerofit.core.files import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GIB = 2**30
CASES = [("llama-0.5b", 4096, 2), ("llama-1.5b", 2048, 4)]
SMOKE_CASES = [("tiny", 256, 2)]


def write_examples(path: Path, rows: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz "
    with path.open("w") as f:
        for _ in range(rows):
            f.write(json.dumps({"text": "".join(rng.choices(letters, k=rng.randint(100, 3000)))}) + "\n")


def run_config(model: str, seq_len: int, micro: int, neat: bool, run_dir: Path, data: Path, steps: int,
               cap_gib: int) -> dict:
    return {
        "run_dir": str(run_dir),
        "model": {"config": model, "gradient_checkpointing": True},
        "data": {"path": str(data), "eval_fraction": 0.0, "neat_packing": neat},
        "train": {"seq_len": seq_len, "micro_batch_size": micro, "grad_accum_steps": 1, "max_steps": steps,
                  "precision": "bf16", "warmup_steps": 0, "lr": 1e-4},
        "zero": {"stage": 3, "offload_optimizer": "cpu"},
        "checkpoint": {"save_final": False, "every_steps": 0},
        "eval": {"at_end": False, "every_steps": 0},
        "log": {"progress": False},
        "plan": {"gpu_mem": f"{cap_gib}GiB"},
    }


def worker(spec_file: Path) -> None:
    """One run in its own process: cap the allocator, train, read the records back."""
    spec = json.loads(spec_file.read_text())
    import torch

    from zerofit.config.load import validate
    from zerofit.core import timeline
    from zerofit.train.loop import train

    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec["cap_gib"] * GIB / total), 0)
    train(validate(spec["config"]), resume=False)
    run_dir = Path(spec["config"]["run_dir"])
    rows = [r for r in timeline.read_timeline(run_dir)
            if r["phase"] in ("forward", "backward", "optimizer_step") and (r["step"], r["phase"]) != (1, "forward")]
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    plan = json.loads((run_dir / "plan.json").read_text())
    gpu = plan["devices"]["gpu"]
    result = {
        "tokens_per_s": round(statistics.median(m["tokens_per_s"] for m in metrics[2:]), 1),
        "measured_gpu_peak": max(r["gpu_peak"] for r in rows),
        "predicted_gpu_peak": plan["predicted_gpu_peak"],
        "planned_attention_mask": max((v for k, v in gpu["components"].items() if k.endswith(":attention_mask")),
                                      default=0),
        "gpu_components": gpu["components"],
        "last_loss": metrics[-1]["loss"],
        "chosen": plan["chosen"],
    }
    result["gpu_peak_error_pct"] = None if not result["measured_gpu_peak"] else round(100 * (result["predicted_gpu_peak"] - result["measured_gpu_peak"])
                                         / result["measured_gpu_peak"], 1)
    (spec_file.parent / "result.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="one tiny case on the CPU accelerator")
    parser.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results")))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--cap-gib", type=int, default=24)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)
    out = Path(args.out)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "neat_packing"
    work.mkdir(parents=True, exist_ok=True)
    data = work / "examples.jsonl"
    write_examples(data, 200 if args.smoke else 2000)
    results = []
    for model, seq_len, micro in SMOKE_CASES if args.smoke else CASES:
        case = {"model": model, "seq_len": seq_len, "micro_batch": micro, "gpu_cap_gib": args.cap_gib,
                "command": "python bench/neat_packing.py " + " ".join(sys.argv[1:])}
        for neat in (False, True):
            name = f"{model}-s{seq_len}-m{micro}-{'neat' if neat else 'packed'}"
            spec_file = work / name / "spec.json"
            spec_file.parent.mkdir(exist_ok=True)
            config = run_config(model, seq_len, micro, neat, work / name / "run", data, args.steps, args.cap_gib)
            spec_file.write_text(json.dumps({"config": config, "cap_gib": args.cap_gib}))
            done = subprocess.run([sys.executable, __file__, "--worker", str(spec_file)], capture_output=True, text=True)
            case["neat" if neat else "packed"] = json.loads((spec_file.parent / "result.json").read_text()) \
                if done.returncode == 0 else {"failed": done.returncode, "stderr": done.stderr[-3000:]}
            print(name, json.dumps({k: v for k, v in case["neat" if neat else "packed"].items()
                                    if k not in ("gpu_components", "stderr")}), flush=True)
        if "tokens_per_s" in case["packed"] and "tokens_per_s" in case["neat"]:
            case["neat_speed_vs_packed"] = round(case["neat"]["tokens_per_s"] / case["packed"]["tokens_per_s"], 3)
            case["neat_extra_gpu_peak"] = case["neat"]["measured_gpu_peak"] - case["packed"]["measured_gpu_peak"]
        results.append(case)
        out.mkdir(parents=True, exist_ok=True)
        (out / ("neat_packing-smoke.json" if args.smoke else "neat_packing.json")).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
