"""Export a real ZeRO-3 checkpoint of a >= 1.5B model two ways, side by side:
`zerofit export` (bf16) and DeepSpeed's own zero_to_fp32.py (its lazy mode, the only one
its command line has in 0.19.8: it writes fp32, --safe_serialization for safetensors).

The checkpoint comes from one `zerofit train` step (preset llama-1.5b, synthetic data,
optimizer offloaded to CPU): the cheapest honest way to get DeepSpeed's real per-rank
files at that size. Each converter runs in its own process; its peak RSS is the kernel's
ru_maxrss for that child (os.wait4), which counts the file pages it maps, as `ps` does.
The page cache holds the checkpoint for both (training just wrote it) unless dropping
caches is allowed, which the JSON records.

GPU machine:  source .whl/prelude.sh || exit; python bench/export_bench.py
CPU smoke:    python bench/export_bench.py --smoke
Writes $OUT/export.json: zerofit / zero_to_fp32 entries with peak_rss_bytes, seconds,
output_bytes, plus the checkpoint build, ratios against the targets and a tensor-by-tensor
comparison of the two outputs.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def child_env() -> dict:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "PYTHONUNBUFFERED": "1"}


def measured(cmd: list[str], log: Path) -> dict:
    """Run `cmd`; wall seconds and the child's peak RSS as the kernel counted it."""
    started = time.perf_counter()
    with open(log, "w") as out:
        child = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - started
    code = os.waitstatus_to_exitcode(status)
    tail = log.read_text()[-3000:]
    if code != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {code}:\n{tail}")
    return {"seconds": round(seconds, 2), "peak_rss_bytes": usage.ru_maxrss * 1024, "log_tail": tail[-600:]}


def tree_bytes(directory: Path, pattern: str = "*") -> int:
    return sum(p.stat().st_size for p in directory.rglob(pattern) if p.is_file())


def drop_page_cache() -> bool:
    """Evict cached file pages so each converter reads from disk (needs root; best effort)."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def build_checkpoint(work: Path, preset: str, seq_len: int, smoke: bool) -> tuple[Path, dict]:
    import yaml

    config = {
        "run_dir": str(work / "run"),
        "model": {"config": preset, "gradient_checkpointing": not smoke},
        "data": {"path": "synthetic", "synthetic_samples": 8, "eval_fraction": 0.0},
        "train": {"seq_len": seq_len, "micro_batch_size": 1, "max_steps": 1, "lr": 1e-5},
        "zero": {"stage": 3, "offload_optimizer": "cpu"},
        "eval": {"at_end": False},
        "checkpoint": {"verify": "sizes"},
        "log": {"progress": False},
    }
    (work / "train.yaml").write_text(yaml.safe_dump(config))
    result = measured([sys.executable, "-m", "zerofit", "train", "--config", str(work / "train.yaml")],
                      work / "train.log")
    checkpoint = work / "run" / "checkpoints" / "step-000001"
    if not (checkpoint / "MANIFEST.json").is_file():
        raise SystemExit(f"no checkpoint written:\n{result['log_tail']}")
    return checkpoint, {"preset": preset, "seconds": result["seconds"], "bytes": tree_bytes(checkpoint),
                        "files": sorted(p.name for p in checkpoint.iterdir())}


def compare_outputs(ours: Path, theirs: Path, budget_s: float) -> dict:
    """Every tensor of ours equals theirs (fp32) cast to bf16, one tensor in memory at a time."""
    import torch
    from safetensors import safe_open

    def index(directory: Path) -> dict:
        found = {}
        for path in sorted(directory.glob("*.safetensors")):
            with safe_open(path, "pt") as f:
                found.update({name: path for name in f.keys()})
        return found

    ours_at, theirs_at = index(ours), index(theirs)
    mismatched, compared, started = [], 0, time.perf_counter()
    for name, path in ours_at.items():
        if time.perf_counter() - started > budget_s:
            break
        if name not in theirs_at:
            mismatched.append(f"{name} (missing in zero_to_fp32's output)")
            continue
        with safe_open(path, "pt") as a, safe_open(theirs_at[name], "pt") as b:
            if not torch.equal(a.get_tensor(name), b.get_tensor(name).to(torch.bfloat16)):
                mismatched.append(name)
        compared += 1
    only_theirs = sorted(set(theirs_at) - set(ours_at))
    return {"tensors": len(ours_at), "compared": compared, "mismatched": mismatched[:20],
            "only_in_zero_to_fp32": only_theirs, "identical": compared == len(ours_at) and not mismatched}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU (same code path)")
    parser.add_argument("--preset", default=None, help="model preset (default llama-1.5b; tiny with --smoke)")
    parser.add_argument("--work", default=None, help="scratch directory (default: a new one under /tmp)")
    args = parser.parse_args()
    preset = args.preset or ("tiny" if args.smoke else "llama-1.5b")
    out_dir = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="export-bench-out-"))
    work = Path(args.work or tempfile.mkdtemp(prefix="export-bench-", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"smoke": args.smoke}
    try:
        checkpoint, results["checkpoint"] = build_checkpoint(work, preset, 64 if args.smoke else 512, args.smoke)
        print(f"checkpoint: {results['checkpoint']['bytes'] / 1e9:.2f} GB in {results['checkpoint']['seconds']} s",
              flush=True)

        results["zerofit_cold_cache"] = drop_page_cache()
        ours = measured([sys.executable, "-m", "zerofit", "export", str(checkpoint), "--out", str(work / "zerofit"),
                         "--dtype", "bf16"], work / "zerofit.log")
        results["zerofit"] = {**ours, "output_bytes": tree_bytes(work / "zerofit", "*.safetensors"), "dtype": "bf16"}
        print(f"zerofit export: {ours['seconds']} s, peak RSS {ours['peak_rss_bytes'] / 2**30:.2f} GiB", flush=True)

        results["zero_to_fp32_cold_cache"] = drop_page_cache()
        # DeepSpeed copies the script next to the checkpoints (engine._copy_recovery_script); users run
        # that copy: checkpoint_dir (holding `latest`) output_dir [--safe_serialization] [-t TAG]
        zero_to_fp32 = checkpoint.parent / "zero_to_fp32.py"
        theirs = measured([sys.executable, str(zero_to_fp32), str(checkpoint.parent), str(work / "zero_to_fp32"),
                           "--safe_serialization", "-t", checkpoint.name], work / "zero_to_fp32.log")
        results["zero_to_fp32"] = {**theirs, "output_bytes": tree_bytes(work / "zero_to_fp32", "*.safetensors"),
                                   "dtype": "fp32", "command": "zero_to_fp32.py CHECKPOINTS OUT --safe_serialization "
                                                              "-t TAG (lazy mode, 5GB shards)"}
        print(f"zero_to_fp32: {theirs['seconds']} s, peak RSS {theirs['peak_rss_bytes'] / 2**30:.2f} GiB", flush=True)

        z, d = results["zerofit"], results["zero_to_fp32"]
        results["ratios"] = {"peak_rss": round(z["peak_rss_bytes"] / d["peak_rss_bytes"], 4),
                             "seconds": round(z["seconds"] / d["seconds"], 4),
                             "output_bytes": round(z["output_bytes"] / d["output_bytes"], 4)}
        results["targets_met"] = {"peak_rss_le_25pct": results["ratios"]["peak_rss"] <= 0.25,
                                  "seconds_le_zero_to_fp32": results["ratios"]["seconds"] <= 1.0,
                                  "output_half": abs(results["ratios"]["output_bytes"] - 0.5) < 0.01}
        results["comparison"] = compare_outputs(work / "zerofit", work / "zero_to_fp32", budget_s=90)
    finally:
        (out_dir / "export.json").write_text(json.dumps(results, indent=2) + "\n")
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({k: results.get(k) for k in ("ratios", "targets_met")}, indent=1))
    print(f"comparison identical: {results['comparison']['identical']} -> {out_dir / 'export.json'}")


if __name__ == "__main__":
    main()
