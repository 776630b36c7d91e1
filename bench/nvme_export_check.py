"""An NVMe-offloaded run exported: train a real model with the optimizer on NVMe, then
`zerofit export --verify` its checkpoint, whose swapped fp32 masters are empty tensors in
DeepSpeed's optim files (the export reads them from the checkpoint's swap-file copies, by
the record zerofit writes at each save: zerofiles.SUB_GROUPS_FILE).

GPU machine (llama-0.5b, optimizer on /tmp/nvme, ~3 min; writes $OUT/nvme_export.json):
    source .whl/prelude.sh || exit; python bench/nvme_export_check.py
CPU smoke test of the same path with the `mini` preset (< 1 min; needs libaio):
    python bench/nvme_export_check.py --smoke

Recorded: the run's steps and its progress lines (the step's GPU peak against the budget),
the sub groups swapped per rank, the export (tensors, seconds, peak RSS under --max-ram) and
--verify's logits differences against the reference built from the optim files and the
swap files (exportcheck.nvme_state_dict; DeepSpeed's zero_to_fp32 cannot read such a
checkpoint).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the `mini` preset on CPU: the same path in seconds")
    parser.add_argument("--preset", default="llama-0.5b")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nvme-path", default="/tmp/nvme")
    parser.add_argument("--dir", default="/tmp/zerofit-nvme-export")
    parser.add_argument("--out", default=None, help="result directory (default $OUT, else bench/results)")
    args = parser.parse_args()
    if args.smoke:
        args.preset = "mini"
    return args


def run_config(args, run_dir: Path) -> dict:
    seq_len = 64 if args.smoke else 1024
    return {"run_dir": str(run_dir), "model": {"config": args.preset},
            "data": {"path": "synthetic", "synthetic_samples": 16 * 50, "eval_fraction": 0.0},
            "train": {"seq_len": seq_len, "global_batch_size": 16, "max_steps": args.steps, "lr": 1e-4,
                      "warmup_steps": 1},
            "zero": {"offload_optimizer": "nvme", "nvme_path": args.nvme_path},
            "eval": {"every_steps": 0, "at_end": False},
            "checkpoint": {"every_steps": args.steps}, "log": {"progress": False}}


def main() -> None:
    import yaml

    from zerofit.checkpoint import zerofiles
    from zerofit.export.checkpoint import export

    args = parse_args()
    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    run_dir = work / "run"
    config_file = work / "config.yaml"
    config_file.write_text(yaml.safe_dump(run_config(args, run_dir)))
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "zerofit", "train", "--config", str(config_file)], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    train_seconds = time.perf_counter() - started
    result = {"preset": args.preset, "steps": args.steps, "train_exit": done.returncode,
              "train_seconds": round(train_seconds, 1),
              "progress_lines": [line for line in done.stderr.splitlines() if line.startswith("step ")]}
    if done.returncode != 0:
        result["train_stderr_tail"] = done.stderr[-3000:]
    else:
        step = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
        records = {rank.name: json.loads((rank / zerofiles.SUB_GROUPS_FILE).read_text())["sub_groups"]
                   for rank in sorted((step / zerofiles.NVME_COPIES).iterdir())}
        result["sub_groups"] = {rank: {"total": len(groups), "swapped": sum(1 for g in groups if g["file"]),
                                       "swapped_elements": sum(g["numel"] for g in groups if g["file"])}
                                for rank, groups in records.items()}
        exported = export(run_dir, work / "model", dtype="bf16", verify=True, progress=False)
        result["export"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(exported).items()}
    out = Path(args.out or os.environ.get("OUT") or ROOT / "bench" / "results")
    out.mkdir(parents=True, exist_ok=True)
    name = "nvme_export-smoke.json" if args.smoke else "nvme_export.json"
    (out / name).write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: v for k, v in result.items() if k != "progress_lines"}, indent=1, default=str)[:4000])
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
