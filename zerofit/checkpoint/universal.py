"""Resume on a different number of ranks through DeepSpeed's universal checkpoint.

A ZeRO checkpoint holds each rank's partition of the flat fp32 weights and Adam moments,
so it loads only on the world size that wrote it (DeepSpeed raises ZeRORuntimeException
otherwise). DeepSpeed's `ds_to_universal` (deepspeed/checkpoint/ds_to_universal.py)
rewrites it per parameter (`zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt`), which any
world size loads with `"checkpoint": {"load_universal": true}` (dsconfig.build).

The conversion is cached next to its source as `checkpoints/universal-step-N/`, published
like a checkpoint (written into `.tmp-universal-step-N/`, manifest last, renamed), and
deleted by retention with its source.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from zerofit.checkpoint import files as checkpoint
from zerofit.checkpoint.files import CheckpointError

PREFIX = "universal-"


def universal_dir(step_dir: Path) -> Path:
    return step_dir.parent / f"{PREFIX}{step_dir.name}"


def cached(step_dir: Path, hashes: bool) -> Path | None:
    """The published conversion of step_dir, if it verifies and was made from this very
    checkpoint (same manifest creation time)."""
    target = universal_dir(step_dir)
    source, converted = checkpoint.read_manifest(step_dir), checkpoint.read_manifest(target)
    if converted is None or checkpoint.verify(target, hashes) is not None:
        return None
    return target if converted.get("source_created") == source.get("created") else None


def convert(step_dir: Path, hashes: bool = True) -> Path:
    """Rank 0: the universal form of step_dir, converted now unless cached. DeepSpeed's
    converter runs as its own process: it forks worker pools and prints freely."""
    if hit := cached(step_dir, hashes):
        return hit
    source = checkpoint.read_manifest(step_dir)
    root, target = step_dir.parent, universal_dir(step_dir)
    tmp = root / f"{checkpoint.TMP_PREFIX}{target.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    workers = max(1, min(8, (os.cpu_count() or 2) // 2))
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(step_dir),
               "--output_folder", str(tmp), "--num_extract_workers", str(workers),
               "--num_merge_workers", str(max(1, workers // 2)), "--inject_missing_state"]
    done = subprocess.run(command, capture_output=True, text=True)
    (root / "latest_universal").unlink(missing_ok=True)  # the converter points it at our .tmp- name
    if done.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise CheckpointError(f"converting {step_dir.name} to a universal checkpoint for a new number of ranks "
                              f"failed: {' | '.join(tail)}; resume on {source['world_size']} rank(s) instead")
    checkpoint.write_manifest(tmp, {}, step=source["step"], source=step_dir.name, source_world_size=source["world_size"],
                              source_created=source.get("created"), zero_stage=source.get("zero_stage"))
    return checkpoint.rename_into_place(tmp, target)
