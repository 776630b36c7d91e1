"""What a checkpoint takes on disk, and the free space a save asks for beyond it.

The planner predicts the disk peak with these; the save checks the disk with them before it
writes, so a plan that passes never stops at its first save.
"""
from __future__ import annotations

# Per-rank checkpoint bytes besides the tensors: pickled metadata, model_states.pt,
# rng state (measured: 27 KB for the tiny model).
CHECKPOINT_OVERHEAD_BYTES = 64 * 1024


def checkpoint_bytes(total_params: int, world_size: int = 1, stage: int = 3, element_bytes: int = 2) -> int:
    """Bytes a DeepSpeed checkpoint takes on disk, all ranks together.

    Each rank writes its optimizer file: the fp32 master partition and Adam's exp_avg and
    exp_avg_sq (stage3.py `_rigid_state_dict`: 12 bytes per element); ZeRO-3 model files
    hold only shapes, stages 0-2 hold the 16-bit module too. Measured on the tiny model:
    1,090,117 bytes of optimizer file for 90,432 parameters (12.05 per parameter)."""
    partition = -(-total_params // world_size)  # ZeRO pads to a multiple of the world size
    per_rank = 12 * partition + CHECKPOINT_OVERHEAD_BYTES
    model_file = element_bytes * total_params if stage < 3 else 0
    return per_rank * world_size + model_file


# Before each save checkpoint.free_space_problem asks for the checkpoint plus 10% and 64 MiB
# (filesystem metadata, files a little over the planned bytes): the disk plan holds that margin
# too, or a plan that passes stops at its first save.
SAVE_FREE_FACTOR, SAVE_FREE_SLACK = 1.10, 64 << 20


def save_margin_bytes(checkpoint_bytes: int) -> int:
    """What a save asks to be free beyond the checkpoint's own bytes."""
    return int(checkpoint_bytes * (SAVE_FREE_FACTOR - 1)) + SAVE_FREE_SLACK
