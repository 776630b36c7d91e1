"""Where a run goes on from: the newest checkpoint that verifies and this config can load
(converted to a universal checkpoint when the rank count changed), what a resume changes
(the global batch, an adapter's scale), and the command that continues a run, as every
message names it. Start-up runs `choose_resume` before the engine is built and before the
run's files are rewritten; the Checkpointer loads what it chose.
"""
from __future__ import annotations

import os
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from zerofit.checkpoint import files as checkpoint
from zerofit.checkpoint import universal, zerofiles
from zerofit.checkpoint.files import CheckpointError, LoopState
from zerofit.config.schema import Config, changed_settings, short
from zerofit.core.console import say, warn
from zerofit.core.errors import ConfigError
from zerofit.core.files import write_atomic
from zerofit.data import pipeline as data
from zerofit.lora import resume as loraresume
from zerofit.recovery import elastic
from zerofit.train import runfiles


@dataclass
class ResumePoint:
    """What start-up resumes from: the published step directory, and the directory
    DeepSpeed loads (the same, or its universal conversion when the world size changed)."""
    directory: str | None = None
    load_dir: str | None = None
    universal: bool = False
    skipped: list = field(default_factory=list)
    error: str | None = None
    step: int = 0  # the checkpoint's
    base_checked: bool = False  # a LoRA run's base (model.path files, a replayed random init) compared before the build


def resume_command(config: Config, resume: bool = True) -> str:
    """The command that continues this run, as messages name it: the run's own config.yaml,
    whose relative paths (run_dir, data) hold from the directory it was started in."""
    command = (f"`{elastic.running_launcher()} train --config {shlex.quote(str(Path(config.run_dir) / 'config.yaml'))}"
               f"{' --resume' if resume else ''}`")
    return command if Path(config.run_dir).is_absolute() else f"{command} (from {os.getcwd()})"


def checkpoints_root(config: Config) -> Path:
    return Path(config.run_dir) / "checkpoints"


def where_to_go_on(config: Config) -> str:
    """What a run that stopped early (SIGTERM, Ctrl-C) can go on from, and the command."""
    published = checkpoint.published(checkpoints_root(config))
    if not published and not (Path(config.run_dir) / "config.yaml").is_file():  # stopped before the run's files
        return "no checkpoint was saved; the same command starts again"
    if not published:
        return f"no checkpoint was saved; {resume_command(config, resume=False)} starts again"
    return f"the newest checkpoint is {published[0].name}; {resume_command(config)} continues from it"


def choose_resume(config: Config, dist, resume: bool | None, fresh: LoopState, retry: bool = False) -> ResumePoint:
    """Rank 0 settles the `.tmp-*` a kill left (settle_leftovers), picks the newest checkpoint that verifies (reporting
    each one skipped and why), refuses one this config cannot load (`unloadable_changes`) and
    converts it to a universal checkpoint when it was written by another number of ranks;
    every rank gets the answer. Runs before the engine is built (loading a universal
    checkpoint is a DeepSpeed config switch) and before the run's files are rewritten. A new run
    sets an earlier run's checkpoints (--no-resume) and records aside first; an OOM `retry` in
    this process or torchrun's restart of the job is the same run, whose records go on."""
    import torch.distributed as torch_dist

    root = checkpoints_root(config)
    point = ResumePoint(error=latest_problem(root)) if dist.is_main else ResumePoint()
    if dist.is_main and point.error is None:
        same_run = elastic.restarted() or retry  # counted at every torchrun attempt's start
        for line in checkpoint.settle_leftovers(root, hashes=config.checkpoint.verify == "full").said(root):
            say(line)
        if resume is not False:
            point = _pick(root, config, dist.world_size, dist.on_gpu, fresh)
            if point.directory is None and point.error is None and resume is None:
                say_new_run(root, None if same_run else set_aside_earlier_run(root))
        elif earlier := set_aside_earlier_run(root):
            warn(f"--no-resume: moved the earlier run's {earlier.what()} to {earlier.path}, with a copy of its "
                 f"model/ and config; delete that directory when you no longer need them")
    if dist.world_size > 1:
        box = [point]
        torch_dist.broadcast_object_list(box, src=0)
        point = box[0]
    if point.error:
        raise CheckpointError(point.error)
    return point


def say_new_run(root: Path, earlier: EarlierRun | None) -> None:
    """`new run in DIR: why`, and where the earlier run's records went: run_dir is read from the working
    directory, so a resume started from another one would otherwise train from step 0 into a new
    directory that looks like the old one."""
    why = "none of its checkpoints can be resumed from (above)" if checkpoint.published(root) else \
        "no checkpoint there to resume from"
    kept = f"; the earlier run's {earlier.what()} are kept in {earlier.path} (`zerofit doctor` reads them there)" \
        if earlier else ""
    say(f"new run in {root.parent.resolve()}: {why}{kept}")


def name_latest_newest(root: Path, found: Path) -> None:
    """`latest` names `found`, the newest checkpoint that verifies, on every start: a crash between a
    save's rename and its `latest` write left it one step behind (DeepSpeed's zero_to_fp32.py reads
    it), and one naming a checkpoint skipped here would point its tools at a damaged one."""
    latest = root / checkpoint.LATEST
    named = latest.read_text().strip() if latest.is_file() else None
    if named != found.name:
        write_atomic(latest, found.name)


def latest_problem(root: Path) -> str | None:
    """`latest` must be a file: it is replaced atomically by one at every save."""
    latest = root / checkpoint.LATEST
    if latest.exists() and not latest.is_file():
        return (f"{latest} is a directory where zerofit keeps the name of the newest checkpoint (a file, replaced "
                f"at every save); move it out of {root}")
    return None


# What a run records as it trains (metrics, every rank's memory timeline, tensorboard's events, the
# post-mortems of its OOMs and kills): a new run in the same directory would write over or add to them.
RUN_RECORDS = ("metrics.jsonl", "memory*.jsonl", "tensorboard", "postmortem")


@dataclass
class EarlierRun:
    """An earlier run set aside in checkpoints/earlier-TIME/: its checkpoints and its records."""
    path: Path
    checkpoints: list[str]
    records: list[str]

    def what(self) -> str:
        """`checkpoints (step-000004) and records (metrics.jsonl, memory.jsonl)`, as they were moved."""
        parts = [f"checkpoints ({', '.join(self.checkpoints)})"] if self.checkpoints else []
        parts += [f"records ({', '.join(self.records)})"] if self.records else []
        return " and ".join(parts)


def earlier_records(run_dir: Path) -> list[Path]:
    """The RUN_RECORDS an earlier run left in run_dir; an empty file or directory holds nothing to keep."""
    found = [path for pattern in RUN_RECORDS for path in sorted(run_dir.glob(pattern))]
    return [path for path in found
            if (path.is_dir() and any(path.iterdir())) or (path.is_file() and path.stat().st_size)]


def set_aside_earlier_run(root: Path) -> EarlierRun | None:
    """The earlier run's checkpoints (checkpoint.set_aside) and the records the new run would write
    over into checkpoints/earlier-TIME/, with a copy of what describes them, so that `zerofit
    doctor` and `zerofit export` read that directory as the earlier run. None when it left neither
    (a first start)."""
    records = earlier_records(root.parent)
    moved = checkpoint.set_aside(root)
    if moved is None and not records:
        return None
    target = moved.path if moved else checkpoint.earlier_directory(root)
    for record in records:  # they go with their checkpoints, or stand for a run that saved none
        os.replace(record, target / record.name)
    for kept in runfiles.RUN_DESCRIPTION:  # rewritten by the new run: copied, so an export of these reads their own
        source = root.parent / kept
        if source.is_dir():
            shutil.copytree(source, target / kept)
        elif source.is_file():
            shutil.copy2(source, target / kept)
    return EarlierRun(target, moved.names if moved else [], [record.name for record in records])


def refuse_resume_without_checkpoint(config: Config, resume: bool | None) -> None:
    """--resume where nothing was ever published: refused by rank 0 before the run directory is
    made (its lock, the data cache). With something published, `choose_resume` resumes from it
    or, none verifying, refuses there."""
    root = checkpoints_root(config)
    if resume is True and not checkpoint.published(root):
        raise ConfigError(f"--resume: no checkpoint under {root}; run without --resume to start fresh")


# What a checkpoint's files are made of. Under other values DeepSpeed's load fails (missing keys,
# another optimizer file name, another partitioning), and failed only after the run's files had
# been rewritten for the new config (config.yaml, model/ that an export reads).
SHAPING_SETTINGS = (("train", "precision"), ("zero", "stage"), ("lora", "enabled"), ("lora", "r"),
                    ("lora", "target_modules"), ("lora", "modules_to_save"), ("lora", "bias"))


def batch_shape(state: LoopState) -> data.BatchShape:
    """What `state`'s data position counts in."""
    return data.BatchShape(state.world_size, state.micro_batch_size, state.epoch_sequences)


def damaged_file_error(error: Exception) -> bool:
    """What torch.load raises on a torch.save file whose bytes were changed (a checkpoint
    read without its hashes, `--verify sizes`), as against every other failure of a load."""
    import pickle
    import zipfile

    if isinstance(error, (pickle.UnpicklingError, EOFError, UnicodeDecodeError, zipfile.BadZipFile)):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        sign in text for sign in ("PytorchStreamReader", "hasRecord", "zip archive", "invalid header"))


def global_batch_change(saved: LoopState, fresh: LoopState) -> str | None:
    """`16 sequences per optimizer step, this run 8 (...)` when a resume changes the global
    batch (another rank count with the micro batch and accumulation fixed); None when it
    keeps it (an OOM retry's halved micro batch doubles the accumulation)."""
    (w0, m0, a0), (w1, m1, a1) = batch_split(saved), batch_split(fresh)
    if w0 * m0 * a0 == w1 * m1 * a1:
        return None
    return (f"{w0 * m0 * a0} sequences per optimizer step, this run {w1 * m1 * a1} (ranks {w0} -> {w1}, micro batch "
            f"{m0} -> {m1}, accumulation {a0} -> {a1})")


def batch_split(state: LoopState) -> tuple[int, int, int]:
    """(ranks, micro batch, accumulation) a loop state trained with."""
    return state.world_size, state.micro_batch_size, state.config_values["train"]["grad_accum_steps"]


def keep_batch_advice(saved: LoopState, fresh: LoopState) -> str:
    """How to keep the checkpoint's global batch on this run's ranks: the accumulation that
    makes it with this micro batch (the run's config.yaml pins both, as the planner chose them
    for the old rank count, so "leave them to the planner" cannot be followed with it)."""
    world, micro, accum = batch_split(saved)
    batch = world * micro * accum
    accum, rest = divmod(batch, fresh.world_size * fresh.micro_batch_size)
    if accum and not rest:
        return f"To keep the checkpoint's {batch} sequences a step: --set train.grad_accum_steps={accum}"
    return (f"No whole number of micro batches of {fresh.micro_batch_size} on {fresh.world_size} rank(s) makes the "
            f"checkpoint's {batch} sequences a step; set train.micro_batch_size and train.grad_accum_steps so that "
            f"their product x ranks is {batch}")


def unloadable_changes(saved: LoopState, fresh: LoopState) -> list[str]:
    """`what old -> new` for each difference a load cannot bridge: the model's architecture
    (models.SHAPE_FIELDS; a moved model directory is no change) and SHAPING_SETTINGS."""
    changes = [f"{'lora targets' if name == 'lora_targets' else 'model ' + name} {short(saved.model_shape[name])} -> "
               f"{short(new)}" for name, new in fresh.model_shape.items()
               if name in saved.model_shape and saved.model_shape[name] != new]  # what it did not record: not judged
    resolved = "lora_targets" in saved.model_shape and "lora_targets" in fresh.model_shape
    for section, key in SHAPING_SETTINGS:
        if (section, key) == ("lora", "target_modules") and resolved:  # [q_proj, v_proj] is [v_proj, q_proj]
            continue
        old = saved.config_values.get(section, {}).get(key)
        new = fresh.config_values.get(section, {}).get(key)
        if old != new:
            changes.append(f"{section}.{key} {short(old)} -> {short(new)}")
    old, new = (values.get("zero", {}).get("offload_optimizer") for values in (saved.config_values, fresh.config_values))
    if old != new and "nvme" in (old, new):  # DeepSpeed's load neither reads nor writes them
        changes.append(f"zero.offload_optimizer {old} -> {new} (the NVMe optimizer state is swap files beside the "
                       f"optimizer file, which a load under the other device cannot convert)")
    return changes


def changed_on_resume(config: Config, point: ResumePoint, fresh: LoopState) -> str | None:
    """Every setting a resume from `point` changes, in one list, old -> new: what its checkpoint
    records (Config.fingerprinted: model, data, train.seed, ...) against its loop state; how the run
    saves, evaluates, logs and watches memory (config.UNRECORDED), which no checkpoint records,
    against the run's config.yaml of its last start. Said before the engine is built and the
    checkpoint loaded, ahead of what the changes bring about (another data order, batch or LR):
    the two were said apart, the checkpoint's after the load, so a changed train.seed came after
    the warning about the training tokens it changed. None when nothing changed."""
    saved = checkpoint.read_loop_state(Path(point.directory))
    changes = sorted(recorded_changes(saved, fresh) + runfiles.changed_unrecorded(Path(config.run_dir), config))
    if not changes:
        return None
    return (f"resuming {Path(point.directory).name} under a different config ({', '.join(changes)}); continuing "
            f"with the current one{adapter_rescaled(saved.config_values, fresh.config_values)}")


def recorded_changes(saved: LoopState, fresh: LoopState) -> list[str]:
    """`section.key old -> new` for what a checkpoint's loop state recorded and this run changes."""
    if saved.config_fingerprint == fresh.config_fingerprint:
        return []
    return changed_settings(saved.config_values, fresh.config_values)  # none: a key added since, left unset


def adapter_rescaled(before: dict, after: dict) -> str:
    """What a change of lora.alpha does to the adapter already trained (a clause, or ""): peft
    multiplies its output by alpha / r (LoraConfig.lora_alpha), so the update learned so far
    counts new/old times as much from the first step on; the loss jumps there."""
    old, new = (values.get("lora", {}) for values in (before, after))
    if not (old.get("enabled") and new.get("enabled")) or old.get("alpha") == new.get("alpha") \
            or not old.get("alpha") or not new.get("alpha"):
        return ""
    return (f" (lora.alpha scales the adapter trained so far: its update now counts {new['alpha'] / old['alpha']:.3g}x "
            f"what it did; keep {old['alpha']} to continue the same training)")


def _pick(root: Path, config: Config, world_size: int, on_gpu: bool, fresh: LoopState) -> ResumePoint:
    found, skipped = checkpoint.find_latest_valid(root, hashes=config.checkpoint.verify == "full")
    for name, reason in skipped:
        warn(f"skipping checkpoint {name}: {reason}")
    if found is None and skipped:  # starting over would publish over them: refuse, keep them as they are
        return ResumePoint(skipped=skipped, error=(
            f"none of the {len(skipped)} checkpoint(s) under {root} verifies ({skipped[0][0]}: {skipped[0][1]}); "
            f"they are left as they are. Start over with --no-resume (it moves them aside, not deletes), or "
            f"restore a good copy"))
    if found is None:
        return ResumePoint(skipped=skipped)
    name_latest_newest(root, found)
    point = ResumePoint(str(found), str(found), False, skipped, step=checkpoint.step_of(found))
    manifest = checkpoint.read_manifest(found)
    changes = unloadable_changes(checkpoint.read_loop_state(found), fresh)
    # LoRA: the frozen base compared before anything is rewritten or built (the load cannot tell)
    base_refused, point.base_checked = (None, False) if changes else \
        loraresume.base_refusal(config, found, point.step, on_gpu)
    if changes:
        point.error = (f"{found.name} cannot be loaded under this config ({'; '.join(changes)}): resume with "
                       f"the run's own ({resume_command(config, resume=False)}), or start "
                       f"over here with --no-resume (the checkpoints are moved aside, not deleted); the run's "
                       f"config.yaml, model/ and checkpoints are as they were")
    elif base_refused:
        point.error = base_refused
    elif manifest["world_size"] != world_size and (found / zerofiles.NVME_COPIES).is_dir():
        point.error = (f"{found.name} was written by {manifest['world_size']} rank(s) with the optimizer on NVMe; "
                       f"its optimizer state lives in {zerofiles.NVME_COPIES}/ per rank, which DeepSpeed cannot convert "
                       f"to {world_size} rank(s) (ds_to_universal reads only the optimizer files): resume with "
                       f"{manifest['world_size']} rank(s)")
    elif manifest["world_size"] != world_size and manifest.get("zero_stage", 3) > 0:
        say(f"{found.name} was written by {manifest['world_size']} rank(s), this run has {world_size}: "
            f"converting it to a universal checkpoint")
        try:
            point.load_dir, point.universal = str(universal.convert(found, config.checkpoint.verify == "full")), True
        except CheckpointError as e:
            point.error = str(e)
    if not point.error:
        newer = [(name, why) for name, why in skipped if checkpoint.step_of(root / name) > checkpoint.step_of(found)]
        if moved := checkpoint.set_aside_unusable(root, newer):
            warn(f"set aside {', '.join(moved)} under {root} (newer than {found.name}, not verifying): kept for "
                 f"inspection, out of the way of this run's saves and retention")
    return point
