"""tokens/s of `zerofit generate` against the stock way (`from_pretrained(device_map="auto",
max_memory=...)`) and DeepSpeed ZeRO-Inference for llama-8b under GPU budgets of 24, 12 and
6 GiB, batch 1 and 8, each case beside its bandwidth bound, in one run on one GPU.

The model is preset llama-8b with random weights, saved once as bf16 safetensors under /tmp
(~16 GB): speed does not depend on what the weights say. Each (budget, method) runs in its
own process (the allocator cap, torch.cuda.set_per_process_memory_fraction, is per process).
zerofit: load, one short warm-up generate per batch size (said: it compiles the decode step
of a whole model), then greedy decoding of --tokens tokens after the 54-token prompt with EOS
barred, timed end to end (prefill included). Stock with layers offloaded is too slow to
decode 128 tokens in the time a run has: its decode rate is (b - a) tokens over t(b) - t(a),
two generates of a and b tokens, which leaves its prefill out (in its favour); ZeRO-Inference,
every layer offloaded, is timed the same way.

The bound of a case (bench/results/README.md): one decode step reads every weight from HBM
and every streamed weight across PCIe; seconds per step >= max(streamed bytes / pinned H2D
bytes/s measured here, all weight bytes / the GPU's HBM bytes/s as specified); tokens/s <=
batch / that.

GPU machine:  source .whl/prelude.sh || exit; python bench/generate_bench.py
CPU smoke:    python bench/generate_bench.py --smoke
Writes $OUT/generate.json.
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
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100": 2.0e12}


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


def probe_links() -> dict:
    """The GPU's name, pinned host->device bytes/s (1 GiB copies, best of 5) and HBM bytes/s:
    as specified for the card, and a device-to-device copy's (reads + writes) for reference."""
    import torch

    if not torch.cuda.is_available():
        return {"gpu": "none"}
    name = torch.cuda.get_device_name(0)
    n = 1 << 30
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev, dev2 = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")

    def best(copy) -> float:
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            started = time.perf_counter()
            copy()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        return min(times)

    h2d = n / best(lambda: dev.copy_(host, non_blocking=True))
    d2d = 2 * n / best(lambda: dev2.copy_(dev))
    spec = next((bw for key, bw in HBM_BYTES_PER_S.items() if key in name), None)
    return {"gpu": name, "gpu_total_bytes": torch.cuda.get_device_properties(0).total_memory,
            "pinned_h2d_bytes_per_s": round(h2d), "hbm_copy_bytes_per_s": round(d2d),
            "hbm_spec_bytes_per_s": spec, "hbm_bytes_per_s": spec or d2d,
            "hbm_source": "the card's specification" if spec else "measured device copy (no specification known)"}


def gpu_peaks() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {}
    return {"gpu_peak_allocated_bytes": torch.cuda.max_memory_allocated(),
            "gpu_peak_reserved_bytes": torch.cuda.max_memory_reserved()}


def reset_peaks() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def measure_zerofit(model_dir: Path, gpu_mem: str | None, tokens: int, batches: list[int]) -> dict:
    """What `zerofit generate --prompts-file` does with `batch` copies of the prompt."""
    from zerofit.core.timeline import peak_rss_bytes
    from zerofit.infer.generate import Sampling, generate_many
    from zerofit.infer.load import describe, load

    started = time.perf_counter()
    loaded = load(model_dir, gpu_mem=gpu_mem)
    result = {"load_seconds": round(time.perf_counter() - started, 1), "described": describe(loaded),
              "placement": loaded.placement, "batches": {}}
    for batch in batches:
        prompts = [PROMPT] * batch
        started = time.perf_counter()
        generate_many(loaded, prompts, Sampling(max_new_tokens=4, min_new_tokens=4), batch)  # warm-up, compiles
        warm = time.perf_counter() - started
        reset_peaks()
        generations, seconds = generate_many(loaded, prompts, Sampling(max_new_tokens=tokens, min_new_tokens=tokens),
                                             batch)
        new = sum(g.new_tokens for g in generations)
        result["batches"][str(batch)] = {"tokens_per_s": round(new / seconds, 2), "seconds": round(seconds, 3),
                                         "new_tokens": new, "prompt_tokens": generations[0].prompt_tokens,
                                         "warm_up_seconds": round(warm, 1), "static_cache": loaded.static_cache,
                                         "fast_decode": loaded.static_cache and loaded.fast_decode,
                                         **gpu_peaks()}
        print(f"  zerofit {gpu_mem} batch {batch}: {new / seconds:.2f} tokens/s", file=sys.stderr, flush=True)
    result["host_peak_rss_bytes"] = peak_rss_bytes()
    return result


def decode_rates(model, pad: int, ids: list[int], tokens: int, batches: list[int], short: tuple[int, int],
                 offloaded: bool, label: str) -> dict:
    """tokens/s of `model.generate` (greedy, EOS barred) per batch: end to end over `tokens`, or
    where layers are offloaded (too slow for that) the decode rate (b - a) / (t(b) - t(a))."""
    import torch

    def timed(batch: int, new: int) -> float:
        input_ids = torch.tensor([ids] * batch, device=model.device)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        begun = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=pad)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - begun

    rows = {}
    for batch in batches:
        timed(batch, 2)  # warm-up
        reset_peaks()
        if offloaded:
            a, b = short
            ta, tb = timed(batch, a), timed(batch, b)
            rate, how = batch * (b - a) / (tb - ta), f"decode rate: {b - a} tokens over t({b}) - t({a})"
            row = {"seconds_a": round(ta, 3), "seconds_b": round(tb, 3)}
        else:
            seconds = timed(batch, tokens)
            rate, how = batch * tokens / seconds, f"{tokens} tokens end to end"
            row = {"seconds": round(seconds, 3)}
        rows[str(batch)] = {"tokens_per_s": round(rate, 2), "measured": how, **row, **gpu_peaks()}
        print(f"  {label} batch {batch}: {rate:.2f} tokens/s ({how})", file=sys.stderr, flush=True)
    return rows


def cap_gpu(gpu_mem: str | None) -> int | None:
    """The allocator cap zerofit sets for --gpu-mem, for the other methods too; the budget in bytes."""
    import torch

    from zerofit.core.timeline import parse_bytes

    if not torch.cuda.is_available():
        return None
    total = torch.cuda.get_device_properties(0).total_memory
    budget = parse_bytes(gpu_mem) if gpu_mem else total
    torch.cuda.set_per_process_memory_fraction(budget / total)
    return budget


def measure_stock(model_dir: Path, gpu_mem: str | None, tokens: int, batches: list[int], short: tuple[int, int]) -> dict:
    """`from_pretrained(device_map="auto", max_memory={0: budget, "cpu": ...})` and its
    `generate`, as a user gets it, under the same allocator cap as zerofit."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zerofit.data.tokenize import text_ids

    started = time.perf_counter()
    options = {"dtype": torch.bfloat16}
    budget = cap_gpu(gpu_mem)
    if budget is not None:
        options.update(device_map="auto", max_memory={0: budget, "cpu": 100 << 30})
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, **options).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    devices = sorted({str(d) for d in getattr(model, "hf_device_map", {"": "cpu"}).values()})
    offloaded = "cpu" in devices and len(devices) > 1
    result = {"load_seconds": round(time.perf_counter() - started, 1), "devices": devices}
    result["batches"] = decode_rates(model, tokenizer.eos_token_id, text_ids(tokenizer, PROMPT), tokens, batches,
                                     short, offloaded, f"stock {gpu_mem}")
    return result


def measure_zero_inference(model_dir: Path, gpu_mem: str | None, tokens: int, batches: list[int],
                           short: tuple[int, int]) -> dict:
    """DeepSpeed ZeRO-Inference: ZeRO-3 with every parameter offloaded to (pinned) CPU memory
    and fetched, two layers' worth prefetched, as each module runs; built under zero.Init
    (HfDeepSpeedConfig) so the model never sits whole anywhere, then the engine's module's
    `generate`. The budget caps the allocator as for the others."""
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations import HfDeepSpeedConfig

    from zerofit.data.tokenize import text_ids
    from zerofit.train.ranks import init_distributed

    started = time.perf_counter()
    on_gpu = init_distributed().on_gpu
    cap_gpu(gpu_mem)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": on_gpu},
              "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": on_gpu},
                                    "stage3_prefetch_bucket_size": 500_000_000,
                                    "stage3_param_persistence_threshold": 100_000}}
    holder = HfDeepSpeedConfig(config)  # noqa: F841 - alive while from_pretrained builds under zero.Init
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=dtype)
    engine = deepspeed.initialize(model=model, config=config)[0]
    engine.module.eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    result = {"load_seconds": round(time.perf_counter() - started, 1), "deepspeed": deepspeed.__version__}
    result["batches"] = decode_rates(engine.module, tokenizer.eos_token_id, text_ids(tokenizer, PROMPT), tokens,
                                     batches, short, True, f"zero_inference {gpu_mem}")
    return result


def bound(link: dict, placement: dict, batch: int) -> dict:
    """Decode tokens/s no placement of these bytes can beat (see the module docstring)."""
    streamed = placement.get("streamed_bytes", 0)
    total = placement.get("gpu_weight_bytes", 0) + streamed  # the host embedding's few rows are not weights read
    pcie_s = streamed / link["pinned_h2d_bytes_per_s"] if streamed else 0.0
    hbm_s = total / link["hbm_bytes_per_s"]
    return {"tokens_per_s": round(batch / max(pcie_s, hbm_s), 2), "streamed_bytes": streamed, "weight_bytes": total,
            "pcie_bytes_per_s": link["pinned_h2d_bytes_per_s"], "hbm_bytes_per_s": link["hbm_bytes_per_s"],
            "pcie_seconds_per_step": round(pcie_s, 5), "hbm_seconds_per_step": round(hbm_s, 5), "batch": batch,
            "formula": "batch / max(streamed_bytes / pcie_bytes_per_s, weight_bytes / hbm_bytes_per_s)"}


def cases(results: dict, batches: list[int]) -> list[dict]:
    """The side-by-side list: one entry per (budget, batch)."""
    link, out = results.get("link") or {}, []
    for budget, methods in results["runs"].items():
        ours = methods.get("zerofit") or {}
        for batch in batches:
            case = {"model": results["model"].get("preset"), "gpu": link.get("gpu"), "gpu_mem": budget,
                    "batch": batch, "new_tokens": results["tokens"], "tokens_per_s": {}}
            for method, run in methods.items():
                row = (run.get("batches") or {}).get(str(batch))
                case["tokens_per_s"][method] = row["tokens_per_s"] if row else None
                if not row:
                    case.setdefault("errors", {})[method] = (run.get("error") or "not run")[-400:]
            if ours.get("placement") and link.get("pinned_h2d_bytes_per_s"):
                case["bound"] = bound(link, ours["placement"], batch)
                if case["tokens_per_s"].get("zerofit"):
                    case["fraction_of_bound"] = round(case["tokens_per_s"]["zerofit"] / case["bound"]["tokens_per_s"], 3)
            if case["tokens_per_s"].get("zerofit") and case["tokens_per_s"].get("stock"):
                case["zerofit_over_stock"] = round(case["tokens_per_s"]["zerofit"] / case["tokens_per_s"]["stock"], 2)
            case["placement"] = ours.get("described")
            out.append(case)
    return out


def run_child(args: list[str], out_json: Path, timeout: int) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    try:
        done = subprocess.run([sys.executable, __file__, *args, "--json", str(out_json)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    sys.stderr.write("".join(line + "\n" for line in done.stderr.splitlines() if line.startswith(("  ", "compil"))))
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}: {done.stderr[-2000:]}"}
    return json.loads(out_json.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU (same code path)")
    parser.add_argument("--preset", default=None, help="model preset (default llama-8b; tiny with --smoke)")
    parser.add_argument("--budgets", default="24GiB,12GiB,6GiB", help="GPU budgets, comma separated")
    parser.add_argument("--methods", default="zerofit,stock,zero_inference",
                        help="zerofit, stock, zero_inference (DeepSpeed ZeRO-3 parameter offload); comma separated")
    parser.add_argument("--batches", default="1,8", help="batch sizes, comma separated")
    parser.add_argument("--tokens", type=int, default=None, help="tokens decoded per case (128; 8 with --smoke)")
    parser.add_argument("--stock-short", default="4,12", help="a,b: token counts of stock's two offloaded runs")
    parser.add_argument("--child-timeout", type=int, default=400, help="seconds one (budget, method) may take")
    parser.add_argument("--model-dir", default=None, help="where the random model is saved (reused if present)")
    parser.add_argument("--build", action="store_true", help=argparse.SUPPRESS)   # child: build the model
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)   # child: measure the links
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)            # child: one budget ...
    parser.add_argument("--method", default=None, help=argparse.SUPPRESS)         # ... and one method
    parser.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    preset = args.preset or ("tiny" if args.smoke else "llama-8b")
    tokens = args.tokens or (8 if args.smoke else 128)
    batches = [int(b) for b in args.batches.split(",")]
    short = tuple(int(n) for n in args.stock_short.split(","))
    model_dir = Path(args.model_dir or f"/tmp/zerofit-generate-bench-{preset}")

    if args.build:
        Path(args.json).write_text(json.dumps(build_model(model_dir, preset)))
        return
    if args.probe:
        Path(args.json).write_text(json.dumps(probe_links()))
        return
    if args.one is not None:
        if args.method == "zerofit":
            measure = measure_zerofit(model_dir, args.one or None, tokens, batches)
        else:
            method = {"stock": measure_stock, "zero_inference": measure_zero_inference}[args.method]
            measure = method(model_dir, args.one or None, tokens, batches, short)
        Path(args.json).write_text(json.dumps(measure))
        return

    out_dir = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="generate-bench-out-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="generate-bench-"))
    common = ["--preset", preset, "--tokens", str(tokens), "--model-dir", str(model_dir), "--batches", args.batches,
              "--stock-short", args.stock_short]
    results: dict = {"smoke": args.smoke, "prompt": PROMPT, "tokens": tokens, "batches": batches}
    if (model_dir / "config.json").is_file():
        results["model"] = {"preset": preset, "reused": str(model_dir)}
    else:
        model_dir.mkdir(parents=True, exist_ok=True)
        results["model"] = run_child(["--build", *common], scratch / "build.json", 900)
    results["link"] = run_child(["--probe"], scratch / "probe.json", 120)
    print(f"model: {results['model']}\nlink: {results['link']}", flush=True)
    budgets = [""] if args.smoke else [b.strip() for b in args.budgets.split(",") if b.strip()]
    results["runs"] = {}
    for budget in budgets:
        label = budget or "cpu"
        for method in args.methods.split(","):
            run = run_child(["--one", budget, "--method", method, *common], scratch / f"{label}-{method}.json",
                            args.child_timeout)
            results["runs"].setdefault(label, {})[method] = run
            results["cases"] = cases(results, batches)
            (out_dir / "generate.json").write_text(json.dumps(results, indent=2) + "\n")
            print(f"{label} {method}: {run.get('described') or run.get('devices') or run.get('error')}", flush=True)
    for case in results["cases"]:
        print(f"{case['gpu_mem']} batch {case['batch']}: {case['tokens_per_s']} bound "
              f"{(case.get('bound') or {}).get('tokens_per_s')} fraction {case.get('fraction_of_bound')}")
    print(f"-> {out_dir / 'generate.json'}")


if __name__ == "__main__":
    main()
