"""Crash-safe checkpoints: atomic publish, manifest, retention, newest-valid resume.

A checkpoint is written into `checkpoints/.tmp-step-N/` (DeepSpeed's per-rank files, the
per-rank RNG states, loop_state.json), every file fsynced, MANIFEST.json (files, sizes,
hashes, step, world size, versions) written last, then the directory renamed to
`step-N/` and `latest` replaced atomically. A directory without a manifest that verifies
is never loaded, and retention never deletes the newest valid checkpoint.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

MANIFEST = "MANIFEST.json"
LOOP_STATE = "loop_state.json"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
HASH = "xxh3_128"  # ~10 GB/s on one core: affordable on every save and resume


@dataclass
class LoopState:
    """Where the loop is; with DeepSpeed's files and the RNG states, all a resume needs."""
    step: int = 0
    micro_batches: int = 0      # global micro batches consumed (data position)
    tokens_seen: int = 0
    world_size: int = 1
    config_fingerprint: str = ""
    extra: dict = field(default_factory=dict)


class CheckpointError(RuntimeError):
    pass


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def step_of(path: Path) -> int:
    return int(path.name.split("-")[-1])


# --------------------------------------------------------------------------- files
def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Write, fsync, rename over: readers see the old or the new content, never half."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def file_hash(path: Path) -> str:
    import xxhash

    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def versions() -> dict:
    import deepspeed
    import torch

    from zerofit import __version__

    return {"zerofit": __version__, "deepspeed": deepspeed.__version__, "torch": torch.__version__}


# ------------------------------------------------------------------------ manifest
def write_manifest(directory: Path, state: LoopState, hashes: bool = True) -> dict:
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        fsync_file(path)
        entry = {"bytes": path.stat().st_size}
        if hashes:
            entry[HASH] = file_hash(path)
        files[str(path.relative_to(directory))] = entry
    manifest = {"step": state.step, "world_size": state.world_size, "config_fingerprint": state.config_fingerprint,
                "versions": versions(), "hash": HASH if hashes else None, "files": files}
    write_atomic(directory / MANIFEST, json.dumps(manifest, indent=1))
    return manifest


def verify(directory: Path, hashes: bool) -> str | None:
    """None when the checkpoint is whole; otherwise why it must not be loaded."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        return "no MANIFEST.json (the save did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError:
        return "MANIFEST.json is corrupt"
    for name, entry in manifest["files"].items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != entry["bytes"]:
            return f"{name} has {size} bytes, the manifest says {entry['bytes']} (truncated or overwritten)"
        if hashes and manifest.get("hash") and file_hash(path) != entry[manifest["hash"]]:
            return f"{name} does not match its {manifest['hash']} hash (corrupt)"
    return None


def published(root: Path) -> list[Path]:
    """Published checkpoint directories, newest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.glob("step-*") if p.is_dir()), key=step_of, reverse=True)


def find_latest_valid(root: Path, hashes: bool = True) -> tuple[Path | None, list[tuple[str, str]]]:
    """The newest checkpoint that verifies, and (name, reason) for each newer one skipped."""
    skipped = []
    for candidate in published(root):
        reason = verify(candidate, hashes)
        if reason is None:
            return candidate, skipped
        skipped.append((candidate.name, reason))
    return None, skipped


def remove_stale_tmp(root: Path) -> list[str]:
    """Leftovers of saves that were killed; never loadable, safe to delete at start."""
    removed = []
    for tmp in root.glob(f"{TMP_PREFIX}*") if root.is_dir() else []:
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        removed.append(tmp.name)
    return removed


# --------------------------------------------------------------------------- RNG
def rng_state() -> dict:
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ------------------------------------------------------------------ save and load
def save(engine, root: Path, state: LoopState, rank: int, hashes: bool = True, exclude_frozen: bool = False) -> Path:
    """Every rank calls this; rank 0 publishes after all ranks' files are on disk.
    exclude_frozen: leave frozen parameters out (LoRA: the base is rebuilt at resume)."""
    import torch
    import torch.distributed as dist

    name = step_name(state.step)
    tmp = root / f"{TMP_PREFIX}{name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    engine.save_checkpoint(str(root), tag=tmp.name, save_latest=False, exclude_frozen_parameters=exclude_frozen)
    torch.save(rng_state(), tmp / f"rng_state_rank{rank}.pt")
    dist.barrier()
    final = root / name
    if rank == 0:
        write_atomic(tmp / LOOP_STATE, json.dumps(asdict(state), indent=1))
        write_manifest(tmp, state, hashes)
        fsync_dir(tmp)
        if final.exists():  # a re-save of the same step (e.g. after resuming from it)
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)
        write_atomic(root / LATEST, name)
    dist.barrier()
    return final


def load(engine, directory: Path, rank: int, custom_load_fn=None) -> LoopState:
    """custom_load_fn(src, dst) replaces DeepSpeed's strict module load (lora.load_trainable_only)."""
    import torch

    _, client = engine.load_checkpoint(str(directory.parent), tag=directory.name, load_optimizer_states=True,
                                       load_lr_scheduler_states=True, custom_load_fn=custom_load_fn)
    if client is None:
        raise CheckpointError(f"DeepSpeed could not load {directory}")
    rng_file = directory / f"rng_state_rank{rank}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return LoopState(**json.loads((directory / LOOP_STATE).read_text()))


def apply_retention(root: Path, keep_last: int, keep_every: int = 0) -> list[str]:
    """Delete published checkpoints beyond the newest `keep_last` (and multiples of
    `keep_every`). Only called right after a publish, so the newest stays."""
    removed = []
    for i, path in enumerate(published(root)):
        if i < keep_last or (keep_every and step_of(path) % keep_every == 0):
            continue
        doomed = root / f"{TMP_PREFIX}delete-{path.name}"
        os.replace(path, doomed)  # a crash mid-delete leaves a .tmp-*, never a half step dir
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(path.name)
    return removed
