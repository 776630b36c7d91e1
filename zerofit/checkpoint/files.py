"""Crash-safe checkpoint files: atomic publish, manifest, verification, retention.

A checkpoint is written into `checkpoints/.tmp-step-N/` (DeepSpeed's per-rank files, the
per-rank RNG states), every file fsynced as it is closed; then rank 0 writes
loop_state.json and MANIFEST.json (every rank's files with sizes and xxh3 hashes, step,
world size, versions, config hash) last, fsyncs the directory, renames it to `step-N/`
and replaces `latest` atomically. A directory without a manifest that verifies is never
loaded, and retention never deletes the newest valid checkpoint.

Only files and policy live here; the DeepSpeed write path is checkpoint_io.py, the
loop's side (sync/async save, resume, errors) checkpointer.py.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from zerofit import __version__
from zerofit.checkpoint import size
from zerofit.core import faults
from zerofit.core.errors import ConfigError
from zerofit.core.files import TMP_PREFIX, fsync_dir, fsync_file, step_name, step_of, write_atomic

MANIFEST = "MANIFEST.json"
LOOP_STATE = "loop_state.json"
LATEST = "latest"
# xxh3_128 hashes 25.8 GB/s on one core of the 2-core CI machine (1 GiB in memory; sha256
# there: 1.7 GB/s); reading a file back and hashing it runs at 3.4-4.3 GB/s from the page
# cache, i.e. the check is bound by the disk read (2.2 GB/s on the GPU machine), which the
# load repeats anyway. So full verification is affordable by default: ~8 s per 18 GB.
HASH = "xxh3_128"


class CheckpointError(ConfigError):
    """A checkpoint could not be written or read; the message says what, and what still stands."""


@dataclass
class LoopState:
    """Where the loop is; with DeepSpeed's files and the RNG states, all a resume needs."""
    step: int = 0
    micro_batches: int = 0      # global micro batches consumed (data position at world_size)
    tokens_seen: int = 0
    world_size: int = 1
    micro_batch_size: int = 0   # with world_size, what a micro batch was (0: unknown)
    epoch_sequences: int = 0    # training sequences an epoch held, what the position counts in (0: unknown)
    data_fingerprint: str = ""  # data.fingerprint of the training tokens ("": unknown)
    config_fingerprint: str = ""
    config_values: dict = field(default_factory=dict)  # Config.fingerprinted(): what a resume compares
    model_shape: dict = field(default_factory=dict)  # models.shape_of: the architecture the tensors are of
    extra: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- files
def file_hash(path: Path) -> str:
    import xxhash

    digest, buffer = xxhash.xxh3_128(), bytearray(1 << 24)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def versions() -> dict:
    import deepspeed
    import torch


    return {"zerofit": __version__, "deepspeed": deepspeed.__version__, "torch": torch.__version__}


# ------------------------------------------------------------------------ manifest
def write_manifest(directory: Path, written: dict[str, dict], **header) -> dict:
    """MANIFEST.json, the last file of a checkpoint: `header` (step, world size, ...),
    versions and every file with its size and hash. `written` holds {name: {bytes, hash}}
    for the files the writers hashed on the way out (checkpoint_io.CheckedFile); any other
    file (the loop state, DeepSpeed's NVMe copies) is fsynced and hashed here."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        name = str(path.relative_to(directory))
        entry = written.get(name)
        if entry is None or entry["bytes"] != path.stat().st_size:
            fsync_file(path)
            entry = {"bytes": path.stat().st_size, HASH: file_hash(path)}
        files[name] = {"bytes": entry["bytes"], HASH: entry[HASH]}
    manifest = {**header, "versions": versions(), "hash": HASH, "created": round(time.time(), 3),
                "total_bytes": sum(e["bytes"] for e in files.values()), "files": files}
    write_atomic(directory / MANIFEST, json.dumps(manifest, indent=1))
    return manifest


def read_manifest(directory: Path) -> dict | None:
    try:
        return json.loads((directory / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def verify(directory: Path, hashes: bool) -> str | None:
    """None when the checkpoint is whole; otherwise why it must not be loaded.
    Sizes are always checked; hashes re-read every byte."""
    if not (directory / MANIFEST).is_file():
        return "no MANIFEST.json (its save did not finish, or the file was deleted since)"
    manifest = read_manifest(directory)
    if manifest is None or not isinstance(manifest.get("files"), dict) or not manifest["files"]:
        return "MANIFEST.json is corrupt"
    for name, entry in manifest["files"].items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != entry["bytes"]:
            return f"{name} has {size} bytes, the manifest says {entry['bytes']} (truncated or overwritten)"
    if hashes:
        algorithm = manifest.get("hash")
        for name, entry in manifest["files"].items():
            if algorithm and file_hash(directory / name) != entry[algorithm]:
                return f"{name} does not match its {algorithm} hash (corrupt)"
    if (directory / LOOP_STATE).is_file():  # what a resume reads first: under --verify sizes, at least parsed
        try:
            json.loads((directory / LOOP_STATE).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return f"{LOOP_STATE} is not valid JSON (corrupt)"
    return None


def published(root: Path) -> list[Path]:
    """Published checkpoint directories (`step-N`), newest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and step_of(p) >= 0), key=step_of, reverse=True)


def find_latest_valid(root: Path, hashes: bool = True) -> tuple[Path | None, list[tuple[str, str]]]:
    """The newest checkpoint that verifies, and (name, reason) for each newer one skipped."""
    skipped = []
    for candidate in published(root):
        reason = verify(candidate, hashes)
        if reason is None:
            return candidate, skipped
        skipped.append((candidate.name, reason))
    return None, skipped


@dataclass
class Leftovers:
    """What `settle_leftovers` did with the `.tmp-*` a kill left."""
    completed: list[str] = field(default_factory=list)  # whole saves killed before their rename, put in place
    saves: list[str] = field(default_factory=list)      # saves cut short, deleted
    deletions: list[str] = field(default_factory=list)  # retention's (or a re-save's) deletions cut short, finished

    def said(self, root: Path) -> list[str]:
        return ([f"completed the save of {', '.join(self.completed)} under {root}: killed after its manifest, "
                 f"before its rename; every file verifies"] if self.completed else []) + \
            ([f"removed {len(self.saves)} unfinished save(s) under {root}: {', '.join(self.saves)}"]
             if self.saves else []) + \
            ([f"finished {len(self.deletions)} deletion(s) a kill interrupted under {root}: "
              f"{', '.join(self.deletions)}"] if self.deletions else [])


def whole_save(tmp: Path, hashes: bool) -> Path | None:
    """The `step-N` a `.tmp-step-N` would be put in place as, when only its rename was left: its
    manifest written, every file verifying, no checkpoint of that step published. None otherwise."""
    final = tmp.with_name(tmp.name.removeprefix(TMP_PREFIX))
    if tmp.is_dir() and step_of(final) >= 0 and not final.exists() and verify(tmp, hashes) is None:
        return final
    return None


def settle_leftovers(root: Path, hashes: bool) -> Leftovers:
    """The `.tmp-*` of saves and deletions a kill cut short, at start. A save whose manifest was
    written and whose every file verifies lost only its rename: it is put in place (a kill
    between the two lost a whole checkpoint, up to checkpoint.every_steps of training). Any
    other save is never loadable and is deleted; a deletion is finished."""
    settled = Leftovers()
    for tmp in sorted(root.glob(f"{TMP_PREFIX}*")) if root.is_dir() else []:
        if (final := whole_save(tmp, hashes)) is not None:
            rename_into_place(tmp, final)
            settled.completed.append(final.name)
            continue
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        (settled.deletions if tmp.name.startswith(f"{TMP_PREFIX}delete-") else settled.saves).append(tmp.name)
    if settled.completed:  # `latest` names the newest, not the last put in place
        write_atomic(root / LATEST, published(root)[0].name)
    return settled


@dataclass
class SetAside:
    path: Path
    names: list[str]


def set_aside(root: Path) -> SetAside | None:
    """Move the published checkpoints (and their universal copies) into
    `earlier-<time>/`: a run that starts over must neither resume from them later nor
    have its own checkpoints deleted by retention in their favour, and nothing saved is lost."""
    found = published(root) + sorted(root.glob("universal-step-*"))
    if not found:
        return None
    target = earlier_directory(root)
    for path in found:
        os.replace(path, target / path.name)
    (root / LATEST).unlink(missing_ok=True)
    fsync_dir(root)
    return SetAside(target, [p.name for p in found])


EARLIER_PREFIX = "earlier-"


def earlier_directory(root: Path) -> Path:
    """A new `earlier-<time>/` under `root` (made, with `root` if need be) for what an earlier run left."""
    target = unused(root / time.strftime(f"{EARLIER_PREFIX}%Y%m%d-%H%M%S"))
    target.mkdir(parents=True)
    return target


def is_earlier_run(path: Path) -> bool:
    """Whether `path` is an earlier run set aside in a run's checkpoints/ (`earlier-<time>/`)."""
    return path.name.startswith(EARLIER_PREFIX) and path.parent.name == "checkpoints"


UNUSABLE_PREFIX = "unusable-"
UNUSABLE_RECORD = "UNUSABLE.json"  # in an unusable-step-N: why it did not verify (the doctor says it)


def set_aside_unusable(root: Path, skipped: list[tuple[str, str]]) -> list[str]:
    """Published checkpoints a resume skipped (newer than the one it loads, but they do not
    verify: (name, why)) renamed `unusable-step-N`: out of `published`, so retention never keeps
    one in place of a good checkpoint (with keep_last 1 it deleted every good one) and the resumed
    run's save of that step does not meet it. Kept for inspection, with UNUSABLE_RECORD saying
    why; returns the new names."""
    moved = []
    for name, reason in skipped:
        path = root / name
        if path.is_dir() and step_of(path) >= 0:
            target = unused(root / f"{UNUSABLE_PREFIX}{name}")
            os.replace(path, target)
            try:
                write_atomic(target / UNUSABLE_RECORD, json.dumps({"reason": reason, "set_aside": round(time.time())}))
            except OSError:  # a full disk: the record only explains, the rename is what matters
                pass
            moved.append(target.name)
    if moved:
        fsync_dir(root)
    return moved


def unusable(root: Path) -> list[Path]:
    """The checkpoints set aside as `unusable-*` under root, by name."""
    return sorted(p for p in root.glob(f"{UNUSABLE_PREFIX}*") if p.is_dir()) if root.is_dir() else []


def unused(path: Path) -> Path:
    """`path`, or `path-2`, `path-3`... where one of that name exists."""
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


# ------------------------------------------------------------------------ publish
def publish(tmp: Path, state: LoopState, written: dict[str, dict], zero_stage: int, milestone: bool = False) -> Path:
    """Rank 0, once every rank's files are closed and fsynced: loop state, manifest (last),
    rename to step-N, `latest`. A kill at any point leaves the previous checkpoints whole
    and at most a `.tmp-*` that the next start removes, or puts in place when only the
    rename was left (settle_leftovers). A `milestone` (a checkpoint.keep_every step) says so in
    its manifest: retention keeps it whatever keep_every a later resume sets."""

    root, name = tmp.parent, step_name(state.step)
    write_atomic(tmp / LOOP_STATE, json.dumps(state.__dict__, indent=1))
    faults.kill_if_armed("publish")
    write_manifest(tmp, written, step=state.step, world_size=state.world_size, zero_stage=zero_stage,
                   config_fingerprint=state.config_fingerprint, **({"milestone": True} if milestone else {}))
    faults.kill_if_armed("rename")
    return rename_into_place(tmp, root / name)


def rename_into_place(tmp: Path, final: Path) -> Path:
    """fsync the finished directory, rename it to its final name, fsync the parent."""
    root, name = final.parent, final.name
    for sub in [p for p in tmp.rglob("*") if p.is_dir()] + [tmp]:
        fsync_dir(sub)
    if final.exists():  # a re-save of the same step: set the old one aside, never half-delete it
        doomed = root / f"{TMP_PREFIX}delete-{name}"
        shutil.rmtree(doomed, ignore_errors=True)
        os.replace(final, doomed)
    os.replace(tmp, final)
    fsync_dir(root)
    if step_of(final) >= 0:
        write_atomic(root / LATEST, name)
    shutil.rmtree(root / f"{TMP_PREFIX}delete-{name}", ignore_errors=True)
    return final


def is_milestone(step: int, keep_every: int) -> bool:
    """A checkpoint.keep_every step: kept by retention, and marked so in its manifest."""
    return bool(keep_every) and step % keep_every == 0


def apply_retention(root: Path, keep_last: int, keep_every: int = 0) -> list[str]:
    """Delete published checkpoints beyond the newest `keep_last`, but for milestones: multiples
    of `keep_every`, and those saved as milestones under an earlier keep_every (their manifest
    says so; a resume that lowered or dropped keep_every deleted them). The newest checkpoint
    whose sizes verify is always kept, even when newer (broken) directories push it out of the
    last K: there is always one to resume."""

    checkpoints = published(root)
    newest_valid = next((p for p in checkpoints if verify(p, hashes=False) is None), None)
    removed = []
    for i, path in enumerate(checkpoints):
        if i < keep_last or path == newest_valid or is_milestone(step_of(path), keep_every):
            continue
        if (read_manifest(path) or {}).get("milestone"):
            continue
        doomed = root / f"{TMP_PREFIX}delete-{path.name}"
        os.replace(path, doomed)  # a crash mid-delete leaves a .tmp-*, never a half step dir
        faults.kill_if_armed("retention")
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(path.name)
    for universal in root.glob("universal-step-*"):  # converted copies of deleted checkpoints
        if not (root / universal.name.removeprefix("universal-")).exists():
            shutil.rmtree(universal, ignore_errors=True)
    return removed


def rotated_out_credit(root: Path, keep_last: int, keep_every: int, saves_at_once: int) -> int:
    """Bytes of the checkpoints already under `root` that retention deletes while the run's next
    `saves_at_once` saves are written: the disk they need beyond what is free now is that many
    checkpoints less this credit. A resume on the disk a run was killed on was refused for room for
    keep_last + 1 new checkpoints while the ones there would be rotated out. Save j (from 1) finds
    the existing ones at index keep_last - (j - 1) and beyond (newest first) deleted by the saves
    before it, milestones kept; the new ones are sized as the newest existing one."""
    existing = published(root)
    if not existing or saves_at_once < 1:
        return 0
    sizes = [on_disk_bytes(path) for path in existing]
    stays = [is_milestone(step_of(path), keep_every) or bool((read_manifest(path) or {}).get("milestone"))
             for path in existing]
    new = sizes[0]
    need = 0
    for j in range(1, saves_at_once + 1):  # no retention runs before the first save
        deleted = 0 if j == 1 else sum(size for i, (size, kept) in enumerate(zip(sizes, stays))
                                       if i >= keep_last - (j - 1) and not kept)
        need = max(need, j * new - deleted)
    return saves_at_once * new - need


def on_disk_bytes(directory: Path) -> int:
    """A checkpoint's bytes: its manifest's total, else the sizes of its files."""
    total = (read_manifest(directory) or {}).get("total_bytes")
    if total:
        return int(total)
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


# ------------------------------------------------------------------- disk space
def checkpoint_bytes(n_params: int, zero_stage: int) -> int:
    """Predicted bytes of one ZeRO checkpoint (all ranks) of a model with n_params trainable
    parameters: the planner's formula (planner.checkpoint_bytes: 12 bytes per parameter of
    fp32 master weights and Adam moments, plus the 16-bit model below stage 3)."""
    return size.checkpoint_bytes(n_params, world_size=1, stage=zero_stage)


def predicted_save_bytes(root: Path, n_params: int, zero_stage: int, gathered_bytes: int = 0) -> int:
    """The newest manifest's total (what a save of this run really wrote), else the formula
    plus `gathered_bytes` (a consolidated 16-bit model written beside the states)."""
    for path in published(root):
        manifest = read_manifest(path)
        if manifest and manifest.get("total_bytes"):
            return int(manifest["total_bytes"])
    return checkpoint_bytes(n_params, zero_stage) + gathered_bytes


def free_space_problem(root: Path, needed_bytes: int, free_bytes: int | None = None) -> str | None:
    """None when `root`'s filesystem can take a checkpoint of needed_bytes, else why not."""
    if free_bytes is None:
        free_bytes = shutil.disk_usage(root).free
    want = needed_bytes + size.save_margin_bytes(needed_bytes)
    if free_bytes >= want:
        return None
    return (f"{free_bytes / 1e9:.2f} GB free under {root}, a checkpoint needs ~{needed_bytes / 1e9:.2f} GB "
            f"and {want / 1e9:.2f} GB are asked (+{size.SAVE_FREE_FACTOR - 1:.0%} and {size.SAVE_FREE_SLACK / 2**20:.0f} MiB of slack for the "
            f"filesystem); free disk space, set run_dir on a larger disk"
            f"{', or lower checkpoint.keep_last' if published(root) else ''}")  # nothing kept yet: nothing to drop


# --------------------------------------------------------------------------- RNG
def rng_state() -> dict:
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


class UnsafeFileError(CheckpointError):
    """A checkpoint file pickles something beyond tensors, plain containers and the few classes
    DeepSpeed's own files hold: loading it could run code."""


def safe_globals() -> list:
    """What zerofit's and DeepSpeed's checkpoint files pickle beyond tensors and plain containers
    (torch.serialization.get_unsafe_globals_in_checkpoint of ZeRO-3 checkpoints): numpy's RNG
    state (an array) in rng_state_rank*.pt; DeepSpeed's ZeRO stage enum and loss scalers in its
    optim_states files. Each is rebuilt from data alone; nothing else is loaded."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    numpy_core = getattr(np, "_core", None) or np.core
    return [numpy_core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32)),
            ZeroStageEnum, LossScaler, DynamicLossScaler]


def load_torch_file(path, map_location="cpu"):
    """torch.load with weights_only=True and exactly safe_globals() allowed: a checkpoint that
    carries any other pickled object (code that would run on load) is refused, naming it."""
    import pickle

    import torch

    try:
        with torch.serialization.safe_globals(safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        said = next((line for line in str(e).splitlines() if "GLOBAL" in line or "Unsupported" in line),
                    str(e).splitlines()[0])
        raise UnsafeFileError(f"{path} holds a pickled object zerofit does not load ({said.strip()[:200]}): loading "
                              f"it could run code, and zerofit's and DeepSpeed's own checkpoint files hold none; use a "
                              f"checkpoint you or zerofit wrote") from None


def refuse_unsafe(paths) -> None:
    """Before a loader that is not zerofit's reads them (DeepSpeed's zero_to_fp32 loads with
    weights_only=False): refuse any file that pickles more than safe_globals(), found by reading
    its pickle's opcodes (nothing is executed)."""
    import torch

    allowed = {f"{g.__module__}.{g.__qualname__}" for g in safe_globals()}
    for path in paths:
        extra = sorted(set(torch.serialization.get_unsafe_globals_in_checkpoint(str(path))) - allowed)
        if extra:
            raise UnsafeFileError(f"{path} holds pickled objects zerofit does not load ({', '.join(extra[:3])}): "
                                  f"loading it could run code, and zerofit's and DeepSpeed's own checkpoint files "
                                  f"hold none; use a checkpoint you or zerofit wrote")


def set_rng_state(state: dict) -> None:
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def read_loop_state(directory: Path) -> LoopState:
    known = set(LoopState.__dataclass_fields__)
    raw = json.loads((directory / LOOP_STATE).read_text())
    return LoopState(**{k: v for k, v in raw.items() if k in known})


def newest_checkpoint_bytes(run_dir: Path) -> int:
    """Size on disk of the newest checkpoint (zerofit's step-N or HF's checkpoint-N)."""
    candidates = [p for p in checkpoints_of(run_dir).glob("step-*") if p.is_dir()] + \
                 [p for p in run_dir.glob("checkpoint-*") if p.is_dir()]
    if not candidates:
        return 0
    newest = max(candidates, key=lambda p: int(p.name.rsplit("-", 1)[-1]) if p.name.rsplit("-", 1)[-1].isdigit() else -1)
    return sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())


def checkpoints_of(run_dir: Path) -> Path:
    """Where a run's checkpoints are: RUN_DIR/checkpoints, or for an earlier run set aside in
    checkpoints/earlier-TIME/ (resume.set_aside_earlier_run) that directory itself."""
    return run_dir if is_earlier_run(run_dir.absolute()) else run_dir / "checkpoints"
