"""tokens/s of `zerofit generate` (zerofit.infer: accelerate device map within a GPU budget,
the rest of the layers offloaded to CPU RAM) for an 8B model under 24 GiB and 12 GiB.

The model is preset llama-8b with random weights, saved once as bf16 safetensors under
/tmp (~16 GB): speed does not depend on what the weights say. Every budget runs in its
own process (the allocator cap, torch.cuda.set_per_process_memory_fraction, is per
process): load, a 4-token warm-up, then greedy decoding of --tokens tokens with EOS
barred so every run decodes the same count.

GPU machine:  source .whl/prelude.sh || exit; python bench/generate_bench.py
CPU smoke:    python bench/generate_bench.py --smoke
Writes $OUT/generate.json: per budget tokens_per_s, seconds, load_seconds, placement
(bytes of weights on GPU / CPU), GPU peak allocated/reserved, host peak RSS.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PROMPT = "Write a short story about a robot who learns to paint."


def build_model(model_dir: Path, preset: str) -> dict:
    """Random-init `preset` in bf16 (on the GPU when there is one: seconds, not minutes)
    and save it with the demo tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from zerofit.demo import build_tokenizer
    from zerofit.models import config_from_name

    started = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config_from_name(preset), dtype=torch.bfloat16)
    parameters = sum(p.numel() for p in model.parameters())
    model.save_pretrained(model_dir, max_shard_size="5GB")
    build_tokenizer().save_pretrained(model_dir)
    return {"preset": preset, "parameters": parameters, "seconds": round(time.perf_counter() - started, 1),
            "bytes": sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))}


def measure_one(model_dir: Path, gpu_mem: str | None, tokens: int) -> dict:
    """What one budget gives: the same calls `zerofit generate` makes."""
    import psutil
    import torch

    from zerofit.infer import Sampling, describe, generate, load
    from zerofit.core.timeline import peak_rss_bytes

    started = time.perf_counter()
    loaded = load(model_dir, gpu_mem=gpu_mem)
    load_seconds = time.perf_counter() - started
    generate(loaded, PROMPT, Sampling(max_new_tokens=4, min_new_tokens=4))  # warm-up: kernels, caches
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    result = generate(loaded, PROMPT, Sampling(max_new_tokens=tokens, min_new_tokens=tokens))
    return {"gpu_mem": gpu_mem, "new_tokens": result.new_tokens, "prompt_tokens": result.prompt_tokens,
            "seconds": round(result.seconds, 3), "tokens_per_s": round(result.tokens_per_s, 2),
            "load_seconds": round(load_seconds, 1), "placement": loaded.placement, "described": describe(loaded),
            "gpu_peak_allocated_bytes": torch.cuda.max_memory_allocated() if on_gpu else 0,
            "gpu_peak_reserved_bytes": torch.cuda.max_memory_reserved() if on_gpu else 0,
            "host_peak_rss_bytes": peak_rss_bytes(), "host_rss_bytes": psutil.Process().memory_info().rss}


def run_child(args: list[str], out_json: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, __file__, *args, "--json", str(out_json)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}: {done.stderr[-2000:]}"}
    return json.loads(out_json.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU (same code path)")
    parser.add_argument("--preset", default=None, help="model preset (default llama-8b; tiny with --smoke)")
    parser.add_argument("--budgets", default="24GiB,12GiB", help="GPU budgets, comma separated")
    parser.add_argument("--tokens", type=int, default=None, help="tokens decoded per budget (48; 8 with --smoke)")
    parser.add_argument("--model-dir", default=None, help="where the random model is saved (reused if present)")
    parser.add_argument("--build", action="store_true", help=argparse.SUPPRESS)   # child: build the model
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)            # child: measure one budget
    parser.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    preset = args.preset or ("tiny" if args.smoke else "llama-8b")
    tokens = args.tokens or (8 if args.smoke else 48)
    model_dir = Path(args.model_dir or f"/tmp/zerofit-generate-bench-{preset}")

    if args.build:
        Path(args.json).write_text(json.dumps(build_model(model_dir, preset)))
        return
    if args.one is not None:
        Path(args.json).write_text(json.dumps(measure_one(model_dir, args.one or None, tokens)))
        return

    out_dir = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="generate-bench-out-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="generate-bench-"))
    common = ["--preset", preset, "--tokens", str(tokens), "--model-dir", str(model_dir)]
    results: dict = {"smoke": args.smoke, "prompt": PROMPT, "tokens": tokens}
    if (model_dir / "config.json").is_file():
        results["model"] = {"preset": preset, "reused": str(model_dir)}
    else:
        model_dir.mkdir(parents=True, exist_ok=True)
        results["model"] = run_child(["--build", *common], scratch / "build.json")
    print(f"model: {results['model']}", flush=True)
    budgets = [] if args.smoke else [b.strip() for b in args.budgets.split(",") if b.strip()]
    results["runs"] = {}
    for budget in budgets or [""]:
        label = budget or "cpu"
        results["runs"][label] = run_child(["--one", budget, *common], scratch / f"{label}.json")
        (out_dir / "generate.json").write_text(json.dumps(results, indent=2) + "\n")
        run = results["runs"][label]
        print(f"{label}: {run.get('tokens_per_s')} tokens/s, {run.get('described') or run.get('error')}", flush=True)
    print(f"-> {out_dir / 'generate.json'}")


if __name__ == "__main__":
    main()
