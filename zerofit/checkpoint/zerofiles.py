"""Where each tensor of a model lies inside a DeepSpeed ZeRO-3 checkpoint's per-rank files.

A ZeRO-3 checkpoint directory holds, per data-parallel rank R:
  zero_pp_rank_R_mp_rank_00_model_states.pt   param_shapes (per param group, in optimizer
      order), buffer_names + the module's buffers, frozen_param_shapes/_fragments, shared_params
  [bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt   optimizer_state_dict.fp32_flat_groups:
      the rank's fp32 master partitions, one flat tensor per sub group ("bf16_" when
      training ran in bf16; no prefix for fp16 and fp32)
ZeRO-3 splits every parameter of N elements into world_size partitions of
ceil(N / world_size) elements, the last padded with zeros (DeepSpeed's
`zero3_partitioned_param_info` in deepspeed/utils/zero_to_fp32.py and
`_partition_param` in runtime/zero/partition_parameters.py). Rank R's flat groups,
concatenated, hold its partition of every parameter, in param_shapes order; the full
parameter is the ranks' partitions end to end, cut to N. This module only works out
those byte positions (`Piece`s); `TensorReader` copies a range of elements into a buffer.
Key names are DeepSpeed's (deepspeed/checkpoint/constants.py); nothing imports DeepSpeed.

A Hugging Face model directory's safetensors files are laid out the same way here
(`safetensors_tensors`): one piece per tensor, from the file headers alone, read with the
same reader (nothing memory-mapped), so a LoRA merge streams its base like a checkpoint.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zerofit.checkpoint.torchfile import TensorRef, TorchFile, read_into
from zerofit.core.errors import ConfigError

MODEL_FILE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
OPTIM_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
# safetensors' dtype names (safetensors/src/tensor.rs, Dtype)
SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}
SAFETENSORS_INDEX = "model.safetensors.index.json"
# DeepSpeed's copy of each rank's NVMe swap files in a checkpoint (engine.save_checkpoint:
# offloaded_tensors/"rank" + dp_index_to_str(rank)), and beside them zerofit's record of which
# swap file holds which optimizer sub group's fp32 masters: DeepSpeed names them by the
# parameters' ds_ids (`{first}_{last}.tensor.swp`, stage3._create_fp32_partitions), which
# nothing in the checkpoint maps to a sub group (written by nvme.record_sub_groups).
NVME_COPIES = "offloaded_tensors"
SUB_GROUPS_FILE = "zerofit-sub-groups.json"


class ZeroCheckpointError(ConfigError):
    """Files that do not form a readable ZeRO-3 checkpoint."""


@dataclass(frozen=True)
class Piece:
    """`numel` consecutive elements of a tensor, stored at `offset` bytes into `path`."""
    path: Path
    offset: int
    numel: int
    dtype: torch.dtype


@dataclass
class StoredTensor:
    """One model tensor: its full shape and the pieces holding its flattened elements in
    order (ZeRO-3 padding may run past `numel`; readers stop at `numel`)."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[Piece]
    kind: str  # "trainable" (fp32 master), "frozen" (16-bit fragments), "buffer"; "base" (safetensors)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class ZeroCheckpoint:
    directory: Path
    world_size: int
    precision: str                    # what training ran in: bf16 | fp16 | fp32
    ds_version: str
    tensors: list[StoredTensor]       # model order
    shared: dict[str, str] = field(default_factory=dict)  # alias -> name it shares storage with


# ------------------------------------------------------------------------- reading
def open_checkpoint(directory: Path) -> ZeroCheckpoint:
    """A per-rank ZeRO-3 checkpoint, or a universal one (universalfiles.py)."""
    from zerofit.checkpoint import universalfiles  # a cycle by design: it reads with this module's readers

    directory = Path(directory)
    if universalfiles.is_universal(directory):
        return universalfiles.open_universal(directory)
    model_paths, optim_paths, bf16 = rank_files(directory)
    world_size = len(model_paths)
    files = {path: TorchFile(path) for path in model_paths + optim_paths}
    model_states = [files[p].load() for p in model_paths]
    optim_pickles = [files[p].load() for p in optim_paths]
    optim_states = [pickle["optimizer_state_dict"] for pickle in optim_pickles]

    first = optim_states[0]
    stage = _plain(first.get("zero_stage"))
    if stage != 3:
        raise ZeroCheckpointError(f"{directory} is a ZeRO stage {stage} checkpoint; zerofit export reads "
                                  f"ZeRO-3 (use DeepSpeed's zero_to_fp32.py for stages 1-2)")
    partitions = _plain(first.get("partition_count"))
    partitions = max(partitions) if isinstance(partitions, list) else partitions
    if partitions != world_size:
        raise ZeroCheckpointError(f"{directory}: the optimizer was partitioned over {partitions} ranks but "
                                  f"{world_size} ranks' files are present; the checkpoint is incomplete")

    trainable = trainable_tensors(model_states[0], optim_states, world_size, files, directory)
    ds_config = optim_pickles[0].get("ds_config") or {}
    precision = "bf16" if bf16 else "fp16" if (ds_config.get("fp16") or {}).get("enabled") else "fp32"
    return assemble(directory, model_states, files, trainable, precision)


def assemble(directory: Path, model_states: list[dict], files: dict[Path, TorchFile],
             trainable: list[StoredTensor], precision: str) -> ZeroCheckpoint:
    """The checkpoint from its trainable tensors and every rank's model states (frozen
    fragments, buffers, module order, shared parameters, DeepSpeed version)."""
    tensors = trainable + frozen_tensors(model_states, files) + buffer_tensors(model_states[0], files)
    order = {name: i for i, name in enumerate(model_states[0].get("module", {}))}
    tensors.sort(key=lambda t: order.get(t.name, len(order)))
    return ZeroCheckpoint(directory, len(model_states), precision, str(model_states[0].get("ds_version", "?")),
                          tensors, dict(model_states[0].get("shared_params") or {}))


def rank_files(directory: Path) -> tuple[list[Path], list[Path], bool]:
    """Every rank's model-states and optim-states file, in rank order; True for bf16 names."""
    models = model_files(directory)
    optims, prefixes = {}, set()
    for path in directory.iterdir():
        if m := OPTIM_FILE.match(path.name):
            _check_mp(m.group(3), path)
            optims[int(m.group(2))] = path
            prefixes.add(m.group(1) or "")
    if not optims:
        raise ZeroCheckpointError(f"{directory} holds no DeepSpeed ZeRO optimizer files (*_optim_states.pt)")
    if len(prefixes) > 1:
        raise ZeroCheckpointError(f"{directory} mixes bf16_ and plain optimizer files from different runs")
    ranks = set(range(len(models)))
    if set(optims) != ranks:
        kind, missing = ("model_states", set(optims) - ranks) if set(optims) - ranks else \
            ("optim_states", ranks - set(optims))
        raise ZeroCheckpointError(f"{directory}: {kind} files of rank(s) {sorted(missing)} are missing; "
                                  f"the checkpoint is incomplete")
    return models, [optims[r] for r in sorted(optims)], prefixes == {"bf16_"}


def model_files(directory: Path) -> list[Path]:
    """Every rank's model-states file, in rank order."""
    models = {}
    for path in directory.iterdir():
        if m := MODEL_FILE.match(path.name):
            _check_mp(m.group(2), path)
            models[int(m.group(1))] = path
    if not models:
        raise ZeroCheckpointError(f"{directory} holds no DeepSpeed ZeRO files "
                                  f"(zero_pp_rank_*_mp_rank_00_model_states.pt / *_optim_states.pt)")
    missing = sorted(set(range(max(models) + 1)) - set(models))
    if missing:
        raise ZeroCheckpointError(f"{directory}: model_states files of rank(s) {missing} are missing; "
                                  f"the checkpoint is incomplete")
    return [models[r] for r in sorted(models)]


def _check_mp(mp_rank: str, path: Path) -> None:
    if int(mp_rank) != 0:
        raise ZeroCheckpointError(f"{path.name}: tensor/model-parallel checkpoints (mp_rank > 0) are not "
                                  f"supported; export one written by pure data parallelism")


def _plain(value):
    """An Opaque enum placeholder (ZeroStageEnum(3)) to its value."""
    return value.args[0] if hasattr(value, "args") and value.args else value


def trainable_tensors(model_state: dict, optim_states: list[dict], world_size: int, files: dict[Path, TorchFile],
                      directory: Path) -> list[StoredTensor]:
    """fp32 master weights: parameter i spans, on every rank, elements
    [offset_i, offset_i + ceil(N_i / world_size)) of that rank's concatenated flat groups."""
    shapes = {name: tuple(shape) for group in model_state["param_shapes"] for name, shape in group.items()}
    streams = [rank_stream(state["fp32_flat_groups"], files, directory, rank)
               for rank, state in enumerate(optim_states)]
    available = sum(segment.numel for segment in streams[0])
    tensors, offset = [], 0
    for name, shape in shapes.items():
        partition = math.ceil(math.prod(shape) / world_size)
        pieces = [p for stream in streams for p in _slice_stream(stream, offset, partition)]
        tensors.append(StoredTensor(name, shape, torch.float32, pieces, "trainable"))
        offset += partition
    if offset != available:  # DeepSpeed's own sanity check in _zero3_merge_trainable_params
        raise ZeroCheckpointError(f"{directory}: parameters need {offset} elements per rank but the fp32 "
                                  f"groups hold {available}; the files do not belong together")
    return tensors


@dataclass(frozen=True)
class Segment:
    """One sub group's fp32 masters in a rank's stream: elements [start, start + numel),
    stored at `offset` bytes into `path` (the optim file, or an NVMe swap file)."""
    start: int
    numel: int
    path: Path
    offset: int
    dtype: torch.dtype


def rank_stream(groups: list[TensorRef], files: dict[Path, TorchFile], directory: Path, rank: int) -> list[Segment]:
    """A rank's flat groups laid end to end. A sub group DeepSpeed swapped to NVMe is an
    empty tensor in the optim file; its masters are in offloaded_tensors/rankRR/, in the
    swap file zerofit recorded for it at the save (SUB_GROUPS_FILE)."""
    swapped = swapped_sub_groups(directory, rank) if any(ref.numel == 0 for ref in groups) else {}
    out, start = [], 0
    for index, ref in enumerate(groups):
        if ref.numel == 0 and index in swapped:
            path, numel = swapped[index]
            out.append(Segment(start, numel, path, 0, torch.float32))
        else:
            if not ref.contiguous:
                raise ZeroCheckpointError(f"{ref.storage.path}: a flat fp32 group is not contiguous")
            out.append(Segment(start, ref.numel, ref.storage.path, files[ref.storage.path].offset(ref), ref.dtype))
        start += out[-1].numel
    return out


def nvme_copies(directory: Path, rank: int) -> Path:
    """A rank's folder of DeepSpeed's NVMe swap-file copies in a checkpoint."""
    return directory / NVME_COPIES / f"rank{rank:0>2d}"


def swapped_sub_groups(directory: Path, rank: int) -> dict[int, tuple[Path, int]]:
    """{sub group: (swap file, elements)} of a rank's NVMe-offloaded optimizer; none when the
    checkpoint has no NVMe copies."""
    rank_dir = nvme_copies(directory, rank)
    if not rank_dir.is_dir():
        return {}
    record = rank_dir / SUB_GROUPS_FILE
    if not record.is_file():
        raise ZeroCheckpointError(f"{directory}: the fp32 masters of rank {rank}'s NVMe-offloaded sub groups are in "
                                  f"{rank_dir.relative_to(directory)}/, named by DeepSpeed parameter ids, and the "
                                  f"checkpoint does not record which holds which ({SUB_GROUPS_FILE}, written by zerofit "
                                  f"from this release on); load it in DeepSpeed and save with save_16bit_model, or "
                                  f"resume it in zerofit for one step and export that checkpoint")
    swapped = {}
    for index, group in enumerate(json.loads(record.read_text())["sub_groups"]):
        if group["file"] is None:
            continue
        path = rank_dir / group["file"]
        if not path.is_file() or path.stat().st_size < 4 * group["numel"]:
            raise ZeroCheckpointError(f"{path} is missing or shorter than sub group {index}'s {group['numel']:,} fp32 "
                                      f"elements; the checkpoint is incomplete")
        swapped[index] = (path, group["numel"])
    return swapped


def _slice_stream(stream: list[Segment], start: int, numel: int) -> list[Piece]:
    """Pieces covering elements [start, start + numel) of a rank's stream (a partition may
    straddle two sub groups, as DeepSpeed's GatheredTensor allows)."""
    pieces, stop = [], start + numel
    for segment in stream:
        a, b = max(start, segment.start), min(stop, segment.start + segment.numel)
        if a < b:
            pieces.append(Piece(segment.path, segment.offset + (a - segment.start) * segment.dtype.itemsize, b - a,
                                segment.dtype))
    if sum(p.numel for p in pieces) != numel:
        raise ZeroCheckpointError("the fp32 groups end before the last parameter's partition")
    return pieces


def frozen_tensors(model_states: list[dict], files: dict[Path, TorchFile]) -> list[StoredTensor]:
    """Parameters with requires_grad=False: each rank's model states hold its 16-bit partition."""
    shapes = model_states[0].get("frozen_param_shapes") or {}
    tensors = []
    for name, shape in shapes.items():
        refs = [state["frozen_param_fragments"][name] for state in model_states]
        pieces = [_whole(r, files) for r in refs]
        tensors.append(StoredTensor(name, tuple(shape), refs[0].dtype, pieces, "frozen"))
    return tensors


def buffer_tensors(model_state: dict, files: dict[Path, TorchFile]) -> list[StoredTensor]:
    """Persistent buffers, saved whole in rank 0's module state dict."""
    module = model_state.get("module") or {}
    tensors = []
    for name in model_state.get("buffer_names") or []:
        ref = module.get(name)
        if isinstance(ref, TensorRef):
            tensors.append(StoredTensor(name, ref.shape, ref.dtype, [_whole(ref, files)], "buffer"))
    return tensors


def _whole(ref: TensorRef, files: dict[Path, TorchFile]) -> Piece:
    if not ref.contiguous:
        raise ZeroCheckpointError(f"{ref.storage.path}: a stored tensor is not contiguous")
    return Piece(ref.storage.path, files[ref.storage.path].offset(ref), ref.numel, ref.dtype)


# ------------------------------------------------------------------ safetensors
def _safetensors_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header and its length, checked against the file's size: a file cut
    short or overwritten is named here, not by a deserializer's traceback inside a build."""
    damaged = f"{path} is damaged or cut short"
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length)) if length <= size - 8 else None
        ends = [entry["data_offsets"][1] for name, entry in (header or {}).items() if name != "__metadata__"]
    except FileNotFoundError:
        raise ZeroCheckpointError(f"{path} is missing (the index lists it)") from None
    except (struct.error, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise ZeroCheckpointError(f"{damaged}: its header cannot be read ({type(e).__name__})") from None
    if header is None:
        raise ZeroCheckpointError(f"{damaged}: its header claims {length} bytes of a {size}-byte file")
    if 8 + length + max(ends, default=0) > size:
        raise ZeroCheckpointError(f"{damaged}: it holds {size} bytes, its tensors end at {8 + length + max(ends)}")
    return header, length


def safetensors_tensors(directory: Path) -> dict[str, StoredTensor]:
    """Every tensor of a model directory's safetensors files (the index's files, else every
    *.safetensors), from the headers: an 8-byte little-endian length, a JSON header, then
    the data, offsets relative to its start (huggingface/safetensors, docs "Format")."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ZeroCheckpointError(f"{directory} is not a directory; the base model of a LoRA run is read "
                                  f"from its model.path (or --base DIR)")
    index = directory / SAFETENSORS_INDEX
    files = sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()}) \
        if index.is_file() else sorted(directory.glob("*.safetensors"))
    if not files:
        raise ZeroCheckpointError(f"{directory} holds no safetensors weights (*.safetensors); save the base with "
                                  f"save_pretrained(safe_serialization=True) first")
    dtypes = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
    tensors = {}
    for path in files:
        header, length = _safetensors_header(path)
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if entry["dtype"] not in dtypes:
                raise ZeroCheckpointError(f"{path.name}: {name} is {entry['dtype']}, which zerofit cannot read")
            dtype, (start, stop) = dtypes[entry["dtype"]], entry["data_offsets"]
            numel = math.prod(entry["shape"])
            if stop - start != numel * dtype.itemsize:
                raise ZeroCheckpointError(f"{path.name}: {name}'s offsets do not match its shape; the file is damaged")
            piece = Piece(path, 8 + length + start, numel, dtype)
            tensors[name] = StoredTensor(name, tuple(entry["shape"]), dtype, [piece], "base")
    return tensors


# ------------------------------------------------------------------------- copying
class TensorReader:
    """Copies element ranges of stored tensors into caller-owned buffers, converting
    16-bit pieces on the way; keeps one descriptor per file open."""

    def __init__(self):
        self._fds: dict[Path, int] = {}

    def read(self, tensor: StoredTensor, start: int, stop: int, out: torch.Tensor) -> None:
        """out[:] = tensor.flatten()[start:stop]; `out` is contiguous with stop - start elements.
        A source that is not in files (merge.ReplayedTensor) reads itself."""
        if not isinstance(tensor, StoredTensor):
            tensor.read(start, stop, out)
            return
        position = 0
        for piece in tensor.pieces:
            a, b = max(start, position), min(stop, position + piece.numel)
            if a < b:
                target = out[a - start:b - start]
                offset = piece.offset + (a - position) * piece.dtype.itemsize
                if piece.dtype == out.dtype:
                    read_into(self._fd(piece.path), offset, target, piece.path)
                else:
                    staged = torch.empty(b - a, dtype=piece.dtype)
                    read_into(self._fd(piece.path), offset, staged, piece.path)
                    target.copy_(staged)
            position += piece.numel
            if position >= stop:
                return
        if position < stop:
            raise ZeroCheckpointError(f"{tensor.name}: the checkpoint holds {position} elements, {stop} needed")

    def _fd(self, path: Path) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


LORA_LAYERS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")
