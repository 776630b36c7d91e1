"""Where each tensor of a model lies inside a DeepSpeed *universal* checkpoint, the form
zerofit.checkpoint.universal converts a checkpoint into when a run resumes on another number of ranks.

DeepSpeed's `ds_to_universal` (deepspeed/checkpoint/ds_to_universal.py, 0.19.8, ZeRO-3
path of `main`) writes:
  zero/<param name>/fp32.pt     the whole fp32 master parameter, flattened: ZeRO-3's
      per-rank partitions cut of their padding and concatenated (`merge_zero3_slices`);
      stage 1-2 conversions save {"param": tensor} instead, which DeepSpeed's loader
      (`load_hp_checkpoint_state` in runtime/zero/stage3.py) also accepts
  zero/<param name>/exp_avg.pt, exp_avg_sq.pt   Adam's moments (an export needs neither)
  zero/optimizer_state.pt       rank 0's optimizer pickle without per-parameter state
  zero_pp_rank_R_mp_rank_00_model_states.pt   the source's files, copied unchanged:
      param_shapes, the module's buffers, frozen fragments, shared_params, ds_config
So the trainable tensors come from the fp32.pt files (one piece each, its offset found by
torchfile without loading it), and everything else from the copied model states exactly as
for a per-rank checkpoint (zerofiles.assemble). world_size is the source's.
"""
from __future__ import annotations

import math
from pathlib import Path

from zerofit.checkpoint import files as checkpoint
from zerofit.checkpoint.torchfile import TensorRef, TorchFile, TorchFileError
from zerofit.checkpoint.zerofiles import (
    LORA_LAYERS,
    OPTIM_FILE,
    Piece,
    StoredTensor,
    ZeroCheckpoint,
    ZeroCheckpointError,
    assemble,
    model_files,
)

ZERO_DIR = "zero"
FP32_FILE = "fp32.pt"
PARAM = "param"                       # deepspeed/checkpoint/constants.py
EXPERT_PARAM = "is_expert_param"      # AutoEP's sliced expert tensors (constants.EP_IS_EXPERT_PARAM)


def is_universal(directory: Path) -> bool:
    """ds_to_universal's layout: a zero/ folder of per-parameter states and no per-rank
    optimizer files (a per-rank checkpoint has those and no zero/)."""
    return (directory / ZERO_DIR).is_dir() and not any(OPTIM_FILE.match(p.name) for p in directory.iterdir())


def open_universal(directory: Path) -> ZeroCheckpoint:
    directory = Path(directory)
    paths = model_files(directory)
    files = {path: TorchFile(path) for path in paths}
    model_states = [files[p].load() for p in paths]
    shapes = {name: tuple(shape) for group in model_states[0]["param_shapes"] for name, shape in group.items()}
    if any(f".{layer}." in name for name in shapes for layer in LORA_LAYERS):
        raise ZeroCheckpointError(f"{directory.name} is a universal copy of a LoRA checkpoint; export "
                                  f"{_source_hint(directory)} instead (the same weights, with the base and "
                                  f"the adapter settings the LoRA merge needs)")
    trainable = [fp32_tensor(directory, name, shape) for name, shape in shapes.items()]
    ds_config = model_states[0].get("ds_config") or {}
    precision = "bf16" if (ds_config.get("bf16") or {}).get("enabled") else \
        "fp16" if (ds_config.get("fp16") or {}).get("enabled") else "fp32"
    return assemble(directory, model_states, files, trainable, precision)


def fp32_tensor(directory: Path, name: str, shape: tuple[int, ...]) -> StoredTensor:
    """The parameter `name` as stored in zero/<name>/fp32.pt."""
    path = directory / ZERO_DIR / name / FP32_FILE
    fix = f"export {_source_hint(directory)}, or delete {directory.name} so that the next resume converts again"
    if not path.is_file():
        raise ZeroCheckpointError(f"{directory.name}: {path.relative_to(directory)} is missing, the universal "
                                  f"conversion is incomplete; {fix}")
    try:
        stored = TorchFile(path)
        ref = stored.load()
        if isinstance(ref, dict):
            if ref.get(EXPERT_PARAM):
                raise ZeroCheckpointError(f"{path}: AutoEP expert parameters are not supported by zerofit export; "
                                          f"{fix}")
            ref = ref.get(PARAM)
        if not isinstance(ref, TensorRef) or not ref.contiguous:
            raise ZeroCheckpointError(f"{path} holds no contiguous tensor; {fix}")
        if ref.numel != math.prod(shape):
            raise ZeroCheckpointError(f"{path} holds {ref.numel} elements but {name} has shape {list(shape)}; "
                                      f"the files do not belong together; {fix}")
        piece = Piece(path, stored.offset(ref), ref.numel, ref.dtype)
    except TorchFileError as e:
        raise ZeroCheckpointError(f"{e}; {fix}") from None
    return StoredTensor(name, shape, ref.dtype, [piece], "trainable")


def _source_hint(directory: Path) -> str:
    """The checkpoint a zerofit conversion was made from (its MANIFEST names it), in words."""
    source = (checkpoint.read_manifest(directory) or {}).get("source")
    return str(directory.parent / source) if source else "the per-rank checkpoint it was converted from"
