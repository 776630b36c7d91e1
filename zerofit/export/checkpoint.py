"""`zerofit export`: a ZeRO-3 training checkpoint -> a Hugging Face model directory
(sharded safetensors, config.json, generation_config.json, tokenizer files) that
`from_pretrained` loads, written tensor by tensor under a host-RAM cap.

How it stays small: the fp32 master partitions are read straight from the per-rank
optimizer files (zerofiles.py, torchfile.py; a universal checkpoint's per-parameter
fp32.pt files, universalfiles.py) in blocks of whole rows, cast to the
output dtype and appended to the shard file whose safetensors header was written first
(all names, shapes and dtypes are known before any data is read). Peak RAM is the
process itself plus two blocks, whatever the model's size.

A LoRA checkpoint (merge.py) goes through the same writer: its list of `OutputTensor`s
reads the base (its safetensors files, or a replayed random init) and carries a
`transform(first_row, end_row, fp32_block) -> fp32_block`, applied to every block before
the cast, that adds the adapters' product; `--adapter-only` writes a peft directory instead.
"""
from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from zerofit.checkpoint import files as checkpoint
from zerofit.checkpoint import universal, zerofiles
from zerofit.core.console import say, warn
from zerofit.core.files import fsync_dir, fsync_file
from zerofit.core.timeline import host_rss_bytes, human_bytes, parse_bytes, peak_rss_bytes
from zerofit.export import merge
from zerofit.export import verify as exportcheck
from zerofit.export.shards import ExportError, OutputTensor, plan_shards, write_model
from zerofit.lora import base as basemodel
from zerofit.plan.estimate import EXPORT_MAX_RAM_BYTES

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_SHARD_SIZE = "5GB"      # what Hugging Face's hub tooling and zero_to_fp32 default to
MAX_BLOCK_ELEMENTS = 1 << 23    # 32 MiB of fp32 per read: syscalls and Python cost nothing next to the copy
WORKING_SLACK = 32 << 20        # Python objects, the progress bar, allocator rounding
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.index.json", "*.gguf")

@dataclass
class ExportResult:
    out_dir: Path
    checkpoint: Path
    world_size: int
    training_precision: str
    dtype: str
    tensors: int
    shards: int
    output_bytes: int
    parameters: int
    seconds: float
    baseline_rss_bytes: int
    peak_rss_bytes: int
    max_ram_bytes: int
    verify: dict | None = None
    lora: str | None = None           # what a LoRA export did, in words


# ----------------------------------------------------------------------------- verb
def export(source: str | Path, out: str | Path, dtype: str = "bf16", max_ram: str | int | None = None,
           shard_size: str | int | None = None, verify: bool = False, overwrite: bool = False,
           model_dir: str | Path | None = None, hashes: bool = True, progress: bool = True,
           adapter_only: bool = False, base: str | Path | None = None,
           trust_remote_code: bool = False) -> ExportResult:
    """Export the checkpoint at `source` (a run directory: its newest complete checkpoint;
    or one checkpoint directory) into the model directory `out`. A LoRA checkpoint's adapters
    are merged into its base (merge.py; `base` overrides where the base's files are), or
    with `adapter_only` written as a peft adapter directory. The model's own code (auto_map)
    runs only with `trust_remote_code`, the person's --trust-remote-code: never because the
    run's files recorded it."""
    with basemodel.remote_code_asked(source):
        return _export(source, out, dtype, max_ram, shard_size, verify, overwrite, model_dir, hashes, progress,
                       adapter_only, base, trust_remote_code)


def _export(source, out, dtype: str, max_ram, shard_size, verify: bool, overwrite: bool, model_dir, hashes: bool,
            progress: bool, adapter_only: bool, base, trust_remote_code: bool) -> ExportResult:
    started = time.perf_counter()
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    max_ram_bytes = parse_bytes(max_ram, "--max-ram") if max_ram else EXPORT_MAX_RAM_BYTES
    shard_bytes = parse_bytes(shard_size or DEFAULT_SHARD_SIZE, "--shard-size")
    if shard_bytes <= 0:
        raise ExportError(f"--shard-size {shard_size}: give a positive size (5GB, save_pretrained's default, "
                          f"when left out)")
    out = Path(out)
    checkpoint_dir, config_dir = locate(Path(source), Path(model_dir) if model_dir else None, hashes)
    model_config = read_model_config(config_dir)
    zero = zerofiles.open_checkpoint(checkpoint_dir)  # first: it refuses a universal copy of a LoRA checkpoint
    lora = merge.is_lora_checkpoint(checkpoint_dir)
    base_read = base or (basemodel.read_recipe(checkpoint_dir).path if lora else None)  # a merge's base files
    check_destination(out, overwrite,
                      reads=(Path(source), checkpoint_dir, config_dir, Path(base_read) if base_read else None))
    if (adapter_only or base) and not lora:
        raise ExportError(f"--adapter-only and --base are for LoRA runs; {checkpoint_dir} is a full fine-tuning "
                          f"checkpoint (drop them)")
    if adapter_only:
        return export_adapter(zero, config_dir, out, dtype, base, verify, started, max_ram_bytes, trust_remote_code)
    merging = merge.plan(zero, checkpoint_dir, config_dir, model_config, DTYPES[dtype],
                         Path(base) if base else None, trust_remote_code) if lora else None
    tensors = merging.tensors if merging else output_tensors(zero, DTYPES[dtype], ties_embeddings(model_config))
    if not merging:  # (a merge plans against the base's own names)
        check_against_config(tensors, model_config, config_dir, checkpoint_dir)
    shards = plan_shards(tensors, shard_bytes)
    baseline = host_rss_bytes()
    block = block_elements(tensors, max_ram_bytes, baseline, DTYPES[dtype], merging)

    staging = out.parent / f"{checkpoint.TMP_PREFIX}export-{out.name}"
    shutil.rmtree(staging, ignore_errors=True)
    check_free_space(out, sum(s.nbytes for s in shards))
    try:
        if merging:  # a base from files is checked before anything is written
            merging.check_base_files(block)
        staging.mkdir(parents=True)
        write_model(staging, shards, block, progress)
        if merging:  # a replayed base once it has streamed
            merging.check_replayed_base()
        write_model_files(staging, config_dir, merging.model_config if merging else model_config, dtype)
        export_peak = peak_rss_bytes()  # what --max-ram bounds; --verify loads the model whole on top
        verified = check_before_publishing(staging, checkpoint_dir, config_dir, base, merging,
                                           trust_remote_code) if verify else None
        publish(staging, out)
    except OSError as e:  # a full disk, a directory that takes no files (/proc): the reason, not a traceback
        shutil.rmtree(staging, ignore_errors=True)
        full = " (the disk is full: free space there or choose --out on another disk)" \
            if e.errno == errno.ENOSPC else ""
        raise ExportError(f"writing the export beside --out {out} failed: {e.strerror or e}{full}; nothing was "
                          f"published and the staging directory is removed") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        if merging:
            merging.close()
    result = ExportResult(out, checkpoint_dir, zero.world_size, zero.precision, dtype, len(tensors), len(shards),
                          sum(s.nbytes for s in shards), sum(math.prod(t.shape) for t in tensors),
                          time.perf_counter() - started, baseline, export_peak, max_ram_bytes)
    if merging:
        result.lora = (f"merged {merging.adapters_merged} LoRA adapter(s) into {merging.base}"
                       f"{' (fingerprint checked)' if merging.verified else ''}")
    say(summary(result))
    if result.peak_rss_bytes > max_ram_bytes:
        warn(f"peak RSS {human_bytes(result.peak_rss_bytes)} passed --max-ram {human_bytes(max_ram_bytes)}")
    result.verify = verified
    return result


def check_before_publishing(staging: Path, checkpoint_dir: Path, config_dir: Path, base, merging,
                            trust_remote_code: bool = False):
    """--verify on the staged model: one that does not reproduce the checkpoint is never published."""

    return exportcheck.verify_lora_export(staging, checkpoint_dir, config_dir, base, trust_remote_code) if merging \
        else exportcheck.verify_export(staging, checkpoint_dir, trust_remote_code)


def export_adapter(zero: zerofiles.ZeroCheckpoint, config_dir: Path, out: Path, dtype: str, base, verify: bool,
                   started: float, max_ram_bytes: int, trust_remote_code: bool = False) -> ExportResult:
    """--adapter-only: a peft adapter directory (merge.write_adapter_dir), published atomically."""
    checkpoint_dir = zero.directory
    baseline = host_rss_bytes()
    staging = out.parent / f"{checkpoint.TMP_PREFIX}export-{out.name}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        record = merge.write_adapter_dir(checkpoint_dir, config_dir, staging, dtype, Path(base) if base else None,
                                         trust_remote_code)
        mode = (staging / "adapter_config.json").stat().st_mode & 0o777  # safetensors writes its file 0600
        for path in staging.iterdir():
            path.chmod(mode)
            fsync_file(path)
        verified = None
        if verify:  # on the staged directory: an adapter that fails it is never published

            verified = exportcheck.verify_adapter_export(staging, checkpoint_dir, config_dir, trust_remote_code)
        publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    written = zerofiles.safetensors_tensors(out)
    result = ExportResult(out, checkpoint_dir, zero.world_size, zero.precision, dtype, len(written), 1,
                          (out / "adapter_model.safetensors").stat().st_size,
                          sum(t.numel for t in written.values()), time.perf_counter() - started, baseline,
                          peak_rss_bytes(), max_ram_bytes)
    recipe = record["recipe"]
    result.lora = (f"peft adapter directory for the base {recipe['path']}" if recipe["path"] else
                   f"peft adapter directory for the random-init base (seed {recipe['seed']}, rebuilt by zerofit chat)")
    say(summary(result))
    result.verify = verified
    return result


def summary(result: ExportResult) -> str:
    return (f"exported {result.checkpoint.name} ({result.world_size} rank(s), {result.training_precision} "
            f"training) -> {result.out_dir}: {result.tensors} tensors, {result.parameters:,} parameters, "
            f"{result.shards} shard(s), {human_bytes(result.output_bytes)} {result.dtype} in {result.seconds:.1f} s; "
            f"peak RSS {human_bytes(result.peak_rss_bytes)} (cap {human_bytes(result.max_ram_bytes)})"
            + (f"; {result.lora}" if result.lora else ""))


# -------------------------------------------------------------------- what to read
def locate(source: Path, model_dir: Path | None, hashes: bool) -> tuple[Path, Path]:
    """(checkpoint directory, directory with config.json and the tokenizer). A run directory
    gives its newest complete step-N; a checkpoint directory may also be its universal
    conversion (universal-step-N, made for a resume on another number of ranks)."""
    if not source.is_dir():
        raise ExportError(f"{source} is not a directory; give a run directory or a checkpoint directory")
    root = source / "checkpoints" if (source / "checkpoints").is_dir() else \
        source if any(source.glob("step-*")) else None
    if root is not None:  # a run directory (or its checkpoints/): the newest complete checkpoint
        found, skipped = checkpoint.find_latest_valid(root, hashes)
        for name, reason in skipped:
            warn(f"skipping {name}: {reason}")
        if found is None:
            why = "; ".join(f"{name}: {reason}" for name, reason in skipped) or "none was saved"
            raise ExportError(f"{root} holds no complete checkpoint ({why}); export one whose save finished")
        return found, model_dir or run_model_dir(root)
    if (source / checkpoint.MANIFEST).exists() or (source / checkpoint.LOOP_STATE).exists() \
            or source.name.startswith(("step-", universal.PREFIX, checkpoint.TMP_PREFIX)):
        reason = checkpoint.verify(source, hashes)
        if reason is not None:
            raise ExportError(f"{source} is not a complete checkpoint: {reason}; export the run directory "
                              f"instead to take the newest complete one")
        return source, model_dir or run_model_dir(source.parent)
    tag_file = source / "latest"  # DeepSpeed's own layout, e.g. HF Trainer's checkpoint-N/global_stepN
    if tag_file.is_file() and (source / tag_file.read_text().strip()).is_dir():
        source = source / tag_file.read_text().strip()
    if any(source.glob("*_model_states.pt")):
        warn(f"{source} has no zerofit MANIFEST.json; only that every rank's files are present and readable "
             f"is checked")
        parent_has_config = (source.parent / "config.json").is_file()
        return source, model_dir or (source.parent if parent_has_config else source)
    raise ExportError(f"{source} is neither a run directory (with checkpoints/), a checkpoint directory "
                      f"(checkpoints/step-N) nor a DeepSpeed checkpoint (*_model_states.pt)")


def run_model_dir(checkpoints: Path) -> Path:
    """RUN_DIR/model for checkpoints in RUN_DIR/checkpoints; for those in checkpoints/earlier-TIME/
    (where --no-resume set an earlier run's aside: resume.set_aside_earlier_run) the copy of that
    run's model/ kept there."""
    if checkpoint.is_earlier_run(checkpoints):
        return checkpoints / "model"
    return checkpoints.parent / "model"


def read_model_config(config_dir: Path) -> dict:
    path = config_dir / "config.json"
    if not path.is_file():
        raise ExportError(f"no config.json in {config_dir}; pass --model-dir DIR with the model's config.json "
                          f"and tokenizer files")
    return json.loads(path.read_text())


def ties_embeddings(model_config: dict) -> bool:
    # PretrainedConfig's default is True; text_config for multimodal wrappers.
    return bool(model_config.get("tie_word_embeddings", (model_config.get("text_config") or {})
                                 .get("tie_word_embeddings", True)))


def output_tensors(zero: zerofiles.ZeroCheckpoint, dtype: torch.dtype, tied: bool) -> list[OutputTensor]:
    """The tensors to write, in model order: floating ones cast to `dtype`, integer
    buffers as they are (DeepSpeed's to_torch_tensor does the same). A parameter DeepSpeed
    saw shared (shared_params: alias -> owner, e.g. lm_head.weight -> embed_tokens.weight)
    is written once when the config ties embeddings, as save_pretrained does:
    from_pretrained ties it again; otherwise it is written under both names."""
    def out_dtype(stored: zerofiles.StoredTensor) -> torch.dtype:
        return dtype if stored.dtype.is_floating_point else stored.dtype

    tensors = [OutputTensor(t.name, t.shape, out_dtype(t), t) for t in zero.tensors]
    by_name = {t.name: t for t in zero.tensors}
    for alias, owner in zero.shared.items():
        if owner in by_name and alias not in by_name and not tied:
            tensors.append(OutputTensor(alias, by_name[owner].shape, out_dtype(by_name[owner]), by_name[owner]))
    return tensors


def check_against_config(tensors: list[OutputTensor], model_config: dict, config_dir: Path,
                         checkpoint_dir: Path) -> None:
    """The model config.json describes must be the checkpoint's: as many layers, the same
    vocabulary and width (read off the tensors' names and the embedding's shape; building the
    model, even on the meta device, would cost the RAM --max-ram bounds). A --model-dir of
    another model exported without a word and loaded truncated, with only transformers' note
    of unexpected keys."""
    config = {**(model_config.get("text_config") or {}), **model_config}
    layers = {int(m.group(1)) for t in tensors if (m := re.search(r"\.layers\.(\d+)\.", t.name))}
    embedding = next((t for t in tensors if t.name.endswith(("embed_tokens.weight", "wte.weight"))), None)
    problems = []
    if layers and config.get("num_hidden_layers") not in (None, max(layers) + 1):
        problems.append(f"{max(layers) + 1} layers in the checkpoint, num_hidden_layers {config['num_hidden_layers']}")
    if embedding is not None and len(embedding.shape) == 2:
        for name, size in (("vocab_size", embedding.shape[0]), ("hidden_size", embedding.shape[1])):
            if config.get(name) not in (None, size):
                problems.append(f"{embedding.name} has {name} {size} in the checkpoint, {config[name]} in the config")
    if problems:
        raise ExportError(f"{checkpoint_dir.name} is not the model {config_dir / 'config.json'} describes "
                          f"({'; '.join(problems)}); give --model-dir the run's own model directory (RUN_DIR/model)")


def block_elements(tensors: list[OutputTensor], max_ram: int, baseline_rss: int, dtype: torch.dtype,
                   merging: merge.MergePlan | None = None) -> int:
    """Elements per read block: two (fp32 block, cast copy) pairs and a 16-bit staging
    buffer (frozen pieces, a 16-bit base) must fit in what --max-ram leaves beside the
    process itself; a LoRA merge adds the delta rows and what it holds whole (merge.py)."""
    per_element = 2 * (4 + dtype.itemsize) + 2 + (merging.extra_bytes_per_element if merging else 0)
    held = merging.held_bytes if merging else 0
    room = max_ram - baseline_rss - WORKING_SLACK - held
    elements = min(MAX_BLOCK_ELEMENTS, max(0, room) // per_element)
    needed = max(t.row_numel for t in tensors)
    if elements < needed:
        least = baseline_rss + WORKING_SLACK + held + needed * per_element
        holds = f", the merge holds {human_bytes(held)} whole (the base's init walk, one adapter)" if held else ""
        raise ExportError(f"--max-ram {human_bytes(max_ram)} is too small: the process itself holds "
                          f"{human_bytes(baseline_rss)}{holds} and one row of the widest tensor needs "
                          f"{human_bytes(needed * per_element)}; give at least {human_bytes(least)}")
    return int(elements)


def check_destination(out: Path, overwrite: bool, reads: tuple = ()) -> None:
    """`out` may be replaced (--overwrite): never by what the export reads or what holds it
    (the run, its checkpoints, the model directory), nor inside a checkpoints directory
    (a resume would take the model files for a checkpoint)."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; give a directory")
    target = out.resolve()
    if target == Path.cwd().resolve() or os.path.ismount(target):  # before the work, not at its publish
        raise ExportError(f"--out {out} is {'the current directory' if target == Path.cwd().resolve() else 'a mount point'}"
                          f": the export is published by renaming the finished directory into place, which cannot "
                          f"replace it; give a directory inside it, e.g. --out {out / 'model'}")
    for path in (Path(p).resolve() for p in reads if p is not None):
        if target == path or target in path.parents:
            raise ExportError(f"--out {out} is or holds {path}, which this export reads: writing there would "
                              f"replace it; choose a directory of its own")
        if path.parent.name == "checkpoints" and path.parent in target.parents:
            raise ExportError(f"--out {out} is inside the run's checkpoints ({path.parent}); choose a directory "
                              f"outside them")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ExportError(f"--out {out} exists and is not empty; choose a new directory or pass --overwrite")
        check_replaceable(out)
    existing = staging_parent(out)
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise ExportError(f"--out {out}: {existing} is not a directory you can write (a read-only filesystem, "
                          f"another user's directory, or a file); choose a directory you can write")


def check_replaceable(out: Path) -> None:
    """--overwrite replaces an earlier export whole: a model or adapter directory (config.json or
    adapter_config.json, no folders). Anything else (a folder of the user's files, `--out ~/models`
    for `--out ~/models/x`) is refused rather than deleted."""
    folders = sorted(p.name for p in out.iterdir() if p.is_dir())
    is_model = any((out / name).is_file() for name in ("config.json", "adapter_config.json"))
    if folders or not is_model:
        what = f"folders ({', '.join(folders[:3])}{', ...' if len(folders) > 3 else ''})" if folders else \
            "no config.json or adapter_config.json"
        raise ExportError(f"--out {out} is not an earlier export (it holds {what}): --overwrite replaces a model "
                          f"directory whole and would delete what is there; choose a new directory")


def staging_parent(out: Path) -> Path:
    """The nearest existing directory above `out`: the staging directory goes beside out, made there."""
    return next(parent for parent in out.resolve().parents if parent.exists())


def check_free_space(out: Path, needed_bytes: int) -> None:
    """Refuse before writing where the weights alone would not fit beside `out` (the staging
    directory is written there, then renamed into place)."""
    existing = staging_parent(out)
    free = shutil.disk_usage(existing).free
    if free < needed_bytes:
        raise ExportError(f"--out {out}: the export's weights take {human_bytes(needed_bytes)} and {existing} has "
                          f"{human_bytes(free)} free; free space there or choose --out on another disk "
                          f"(--dtype bf16 halves an fp32 export)")


# What an HF Trainer checkpoint-N/ holds beside the model's files that WEIGHT_PATTERNS does not
# already leave out (training_args.bin, rng_state*.pth, scheduler.pt): training state, not
# model; `latest` in a model directory would make DeepSpeed's loaders take it for a checkpoint.
TRAINING_STATE_PATTERNS = ("latest", "trainer_state.json", "zero_to_*.py")


def write_model_files(directory: Path, config_dir: Path, model_config: dict, dtype: str) -> None:
    """config.json (dtype set to the export's), generation_config.json, and every
    tokenizer/chat-template file of the run's model directory."""
    config = dict(model_config)
    config["dtype"] = str(DTYPES[dtype]).removeprefix("torch.")
    if "torch_dtype" in config:  # transformers 4 reads this key
        config["torch_dtype"] = config["dtype"]
    config["use_cache"] = True
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if not (config_dir / "generation_config.json").is_file():
        generation = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")
                      if config.get(key) is not None}
        (directory / "generation_config.json").write_text(json.dumps({"_from_model_config": True, **generation},
                                                                     indent=2) + "\n")
    skipped = {p.name for pattern in WEIGHT_PATTERNS + TRAINING_STATE_PATTERNS for p in config_dir.glob(pattern)}
    for path in config_dir.iterdir():
        if path.is_file() and path.name != "config.json" and path.name not in skipped:
            shutil.copy2(path, directory / path.name)
    for path in directory.iterdir():
        fsync_file(path)


def publish(staging: Path, out: Path) -> None:
    """Rename the finished directory into place; an old one at `out` (--overwrite) goes
    only once the new one is complete."""
    fsync_dir(staging)
    if out.exists():
        old = out.parent / f"{checkpoint.TMP_PREFIX}old-{out.name}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(staging, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, out)
    fsync_dir(out.parent)
