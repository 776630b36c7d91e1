"""Crash-safe checkpoints: the file rules on their own, then real runs (DeepSpeed ZeRO-3 on
CPU) killed, starved of disk, stopped and resumed on fewer ranks, compared weight by weight
with an uninterrupted run."""
import json
import os
import random
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import (ROOT, child_env, read_jsonl, run_zerofit, tiny_config, trained_run, wait_for, write_config,
                      write_jsonl, zerofit_command)
from zerofit import checkpoint, checkpointer, data, faults
from zerofit.resume import resume_command
from zerofit.doctor import diagnose

# Six steps, a checkpoint every two: saves 1, 2, 3 are steps 2, 4, 6.
SHAPE = dict(eval={"every_steps": 0, "at_end": False})


def config_for(base: Path, name: str, max_steps: int = 6, **checkpoint_settings) -> Path:
    settings = {"every_steps": 2, "keep_last": 2, **checkpoint_settings}
    return write_config(base / f"{name}.yaml", tiny_config(base / name, train={"max_steps": max_steps},
                                                           checkpoint=settings, **SHAPE))


def fp32_weights(run: Path, step: int) -> dict:
    """A checkpoint's fp32 master weights, as DeepSpeed's own zero_to_fp32 reads them."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(run / "checkpoints"), tag=checkpoint.step_name(step))


def assert_same_weights(run: Path, reference: Path, step: int = 6) -> None:
    import torch

    got, want = fp32_weights(run, step), fp32_weights(reference, step)
    assert got.keys() == want.keys()
    different = [name for name in want if not torch.equal(got[name], want[name])]
    assert not different, different


def valid_steps(run: Path) -> list[int]:
    return sorted(checkpoint.step_of(p) for p in checkpoint.published(run / "checkpoints")
                  if checkpoint.verify(p, hashes=True) is None)


# ------------------------------------------------------------------- file rules
def make_checkpoint(root: Path, step: int, payload: bytes = b"x" * 1000, milestone: bool = False) -> Path:
    tmp = root / f".tmp-{checkpoint.step_name(step)}"
    tmp.mkdir(parents=True)
    (tmp / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(payload)
    (tmp / "rng_state_rank0.pt").write_bytes(b"rng")
    return checkpoint.publish(tmp, checkpoint.LoopState(step=step), {}, zero_stage=3, milestone=milestone)


def test_manifest_catches_truncated_missing_and_corrupt_files(tmp_path):
    root = tmp_path / "checkpoints"
    good = [make_checkpoint(root, step) for step in (2, 4, 6, 8)]
    manifest = json.loads((good[0] / "MANIFEST.json").read_text())
    assert manifest["step"] == 2 and manifest["hash"] == "xxh3_128" and manifest["total_bytes"] > 1000
    assert set(manifest["versions"]) == {"zerofit", "deepspeed", "torch"}
    assert set(manifest["files"]) == {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "rng_state_rank0.pt",
                                      "loop_state.json"}
    shard = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    os.truncate(good[3] / shard, 10)
    (good[2] / "rng_state_rank0.pt").unlink()
    (good[1] / shard).write_bytes(b"y" * 1000)  # same size, other bytes
    assert "truncated" in checkpoint.verify(good[3], hashes=False)
    assert "missing" in checkpoint.verify(good[2], hashes=False)
    assert checkpoint.verify(good[1], hashes=False) is None  # sizes cannot see it ...
    assert "hash" in checkpoint.verify(good[1], hashes=True)  # ... the full check does
    found, skipped = checkpoint.find_latest_valid(root, hashes=True)
    assert found == good[0]
    assert [name for name, _ in skipped] == ["step-000008", "step-000006", "step-000004"]
    (root / ".tmp-step-000010").mkdir()  # a save that never finished is not a checkpoint
    assert checkpoint.published(root)[0].name == "step-000008"
    settled = checkpoint.settle_leftovers(root, hashes=True)
    assert (settled.saves, settled.completed) == ([".tmp-step-000010"], [])


def test_retention_keeps_the_newest_valid_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4, 5, 6):
        make_checkpoint(root, step)
    assert checkpoint.apply_retention(root, keep_last=2, keep_every=4) == ["step-000003", "step-000002",
                                                                             "step-000001"]
    assert [p.name for p in checkpoint.published(root)] == ["step-000006", "step-000005", "step-000004"]
    (root / "step-000006" / "loop_state.json").unlink()  # the newest is broken:
    checkpoint.apply_retention(root, keep_last=1)  # keep_last=1 alone would leave no valid one
    assert [p.name for p in checkpoint.published(root)] == ["step-000006", "step-000005"]
    assert checkpoint.find_latest_valid(root)[0].name == "step-000005"
    assert (root / "latest").read_text() == "step-000006"
    assert not list(root.glob(".tmp-*"))
    moved = checkpoint.set_aside(root)  # --no-resume: out of the way, not deleted
    assert moved.names == ["step-000006", "step-000005"] and not checkpoint.published(root)
    assert checkpoint.verify(moved.path / "step-000005", hashes=True) is None


def test_milestones_outlive_a_resume_that_drops_keep_every(tmp_path):
    """checkpoint.keep_every kept steps 4 and 8; a resume without it deleted both at its first
    save, without a word. Saved as milestones, they stay whatever keep_every is now."""
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8, 10):
        make_checkpoint(root, step, milestone=step % 4 == 0)
    assert checkpoint.read_manifest(root / "step-000004")["milestone"] is True
    assert "milestone" not in checkpoint.read_manifest(root / "step-000006")
    assert checkpoint.apply_retention(root, keep_last=1) == ["step-000006", "step-000002"]
    assert [p.name for p in checkpoint.published(root)] == ["step-000010", "step-000008", "step-000004"]


def test_free_space_check_and_size_prediction(tmp_path):
    from zerofit.planner import CHECKPOINT_OVERHEAD_BYTES as overhead  # metadata, model_states, rng

    assert checkpoint.checkpoint_bytes(1_500_000_000, zero_stage=3) == 18_000_000_000 + overhead  # measured 16.7 GiB
    assert checkpoint.checkpoint_bytes(1000, zero_stage=2) == 14000 + overhead
    assert checkpoint.predicted_save_bytes(tmp_path, 1000, 3) == 12000 + overhead  # no checkpoint yet: the formula
    make_checkpoint(tmp_path, 2, payload=b"z" * 5000)
    assert checkpoint.predicted_save_bytes(tmp_path, 1000, 3) > 5000  # then what a save really wrote
    assert checkpoint.free_space_problem(tmp_path, 10**9, free_bytes=2 * 10**9) is None
    problem = checkpoint.free_space_problem(tmp_path, 10**9, free_bytes=10**9)
    assert "1.00 GB free" in problem and "keep_last" in problem
    # before the first save nothing is kept: fewer kept would not help
    assert "keep_last" not in checkpoint.free_space_problem(tmp_path / "none", 10**9, free_bytes=10**9)


def test_the_resume_command_says_where_relative_paths_hold(monkeypatch, tmp_path):
    from zerofit.configfile import validate

    monkeypatch.chdir(tmp_path)
    relative = validate(tiny_config(Path("runs/x")))
    assert resume_command(relative) == f"`zerofit train --config runs/x/config.yaml --resume` (from {tmp_path})"
    absolute = validate(tiny_config(tmp_path / "x"))
    assert resume_command(absolute, resume=False) == f"`zerofit train --config {tmp_path / 'x' / 'config.yaml'}`"
    spaced = validate(tiny_config(Path("runs/my run ü")))  # pasted unquoted: "unrecognized arguments: run ü/..."
    assert resume_command(spaced).startswith("`zerofit train --config 'runs/my run ü/config.yaml' --resume`")


def test_printed_commands_start_the_run_as_it_ran():
    from zerofit.elastic import launcher, running_launcher

    assert launcher(1) == "zerofit" and launcher(2) == "torchrun --nproc_per_node 2 -m zerofit"
    assert launcher(16, 8) == "torchrun --nnodes 2 <rendezvous flags> --nproc_per_node 8 -m zerofit"
    assert running_launcher({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}) == launcher(4)
    assert running_launcher({}) == "zerofit"


def test_a_resume_that_changes_the_global_batch_is_named():
    from zerofit.resume import global_batch_change, keep_batch_advice

    def state(world, micro, accum):
        return checkpoint.LoopState(world_size=world, micro_batch_size=micro,
                                    config_values={"train": {"grad_accum_steps": accum}})

    assert global_batch_change(state(1, 4, 2), state(2, 4, 2)).startswith("8 sequences per optimizer step, this run 16")
    assert global_batch_change(state(1, 4, 1), state(1, 2, 2)) is None  # an OOM retry's split keeps it
    assert global_batch_change(state(2, 4, 1), state(1, 4, 2)) is None  # the planner's split of global_batch_size
    assert global_batch_change(checkpoint.LoopState(), state(1, 4, 1)) is None  # older checkpoints recorded less
    # advice a run's own config.yaml can follow (it pins micro batch and accumulation: "leave them to the
    # planner" ended in "global_batch_size=4 cannot be split as micro_batch_size=2 x grad_accum_steps=1 x 1")
    assert keep_batch_advice(state(2, 2, 1), state(1, 2, 1)).endswith("--set train.grad_accum_steps=2")
    assert keep_batch_advice(state(1, 3, 1), state(2, 2, 1)).startswith("No whole number of micro batches of 2 on 2 rank(s) makes the checkpoint's 3")


def test_data_position_on_another_number_of_ranks():
    # 4 steps on 2 ranks of 4 sequences = 32 sequences = 8 micro batches of 4 on one rank
    two_ranks, one_rank = data.BatchShape(2, 4, 4035), data.BatchShape(1, 4, 4035)
    assert data.carried_position(4, two_ranks, one_rank) == 8
    assert data.carried_position(8, one_rank, two_ranks) == 4
    assert data.carried_position(3, one_rank, two_ranks) == 2  # rounded up: nothing twice
    # a whole first epoch on 2 ranks is a whole first epoch on one
    assert data.carried_position(two_ranks.per_epoch, two_ranks, one_rank) == one_rank.per_epoch
    assert data.carried_position(1, one_rank, data.BatchShape(1, 2, 4035)) == 2  # an OOM retry's halved micro batch


def test_data_position_when_the_training_set_changed():
    """seq_len doubled: half the sequences; the same share of the same epoch carries over."""
    short, long = data.BatchShape(1, 4, 4000), data.BatchShape(1, 4, 2000)  # 1000 and 500 micro batches an epoch
    assert data.carried_position(400, short, long) == 200     # 40% of epoch 1 is 40% of epoch 1
    assert data.carried_position(1401, short, long) == 701    # 40.1% of epoch 2, rounded up to a micro batch
    assert data.carried_position(999, short, long) == 500     # the epoch's last micro batch: the next epoch begins
    assert data.carried_position(250, long, short) == 500


def _cpu_adam_after(steps_before: int, steps_after: int, replay: bool):
    """A parameter after DeepSpeedCPUAdam steps on fixed gradients; with steps_after, the
    optimizer is rebuilt from its state dict in between (a resume), replayed or not."""
    from types import SimpleNamespace

    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    grads = torch.randn(steps_before + steps_after, 4096, generator=torch.Generator().manual_seed(0)) * 0.01
    param = torch.nn.Parameter(torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 0.1)
    optimizer = DeepSpeedCPUAdam([param], lr=5e-2, betas=(0.9, 0.95))
    for grad in grads[:steps_before]:
        param.grad = grad.clone()
        optimizer.step()
    if steps_after:
        state = optimizer.state_dict()
        optimizer = DeepSpeedCPUAdam([param], lr=5e-2, betas=(0.9, 0.95))
        optimizer.load_state_dict(state)
        if replay:
            assert checkpointer.replay_cpu_adam_steps(SimpleNamespace(optimizer=SimpleNamespace(optimizer=optimizer))) \
                == steps_before
        for grad in grads[steps_before:]:
            param.grad = grad.clone()
            optimizer.step()
    return param.detach().clone()


def test_cpu_adam_resumes_bit_exactly_after_the_step_replay():
    """DeepSpeedCPUAdam's C++ bias-correction powers: a resumed optimizer drifts from the
    uninterrupted one unless its step state is replayed (checkpointer.replay_cpu_adam_steps)."""
    import torch

    straight = _cpu_adam_after(12, 0, replay=False)
    assert not torch.equal(_cpu_adam_after(6, 6, replay=False), straight)  # DeepSpeed's own resume drifts
    assert torch.equal(_cpu_adam_after(6, 6, replay=True), straight)


def test_injected_enospc_and_the_snapshot_arena(tmp_path, monkeypatch):
    import torch

    from zerofit import checkpoint_io

    arena = checkpoint_io.HostArena(max_bytes=1 << 20)
    assert not arena.reserve(2 << 20)  # over budget: refused, nothing held
    assert arena.reserve(1 << 16) and arena.capacity == 1 << 16
    first, second = arena.views([4000, 8000])
    tensor = torch.frombuffer(second, dtype=torch.uint8).view(torch.float32)
    tensor.copy_(torch.arange(2000, dtype=torch.float32))
    path = tmp_path / "one.pt"
    torch.save({"t": tensor}, path)
    assert path.stat().st_size < 4000 + 8000  # its own bytes, not the whole arena
    assert torch.equal(torch.load(path)["t"], torch.arange(2000, dtype=torch.float32))

    monkeypatch.setenv(faults.VARIABLE, f"enospc@save:{faults.tick('save')}")
    engine = checkpoint_io.ZerofitCheckpointEngine(True, async_save=False, host_max_bytes=1 << 20)
    engine.create(checkpoint_io.CheckpointCommitInfo(tag="t", save_dir=str(tmp_path), save_latest=False))
    (tmp_path / "t").mkdir()
    engine.save({"x": torch.zeros(100_000)}, str(tmp_path / "t" / "x.pt"))
    assert "No space left on device" in engine.error and "x.pt" in engine.error
    assert (tmp_path / "t" / "x.pt").stat().st_size == checkpoint_io.FAULT_AFTER_BYTES  # half written
    engine.save({"y": torch.zeros(10)}, str(tmp_path / "t" / "y.pt"))
    assert not (tmp_path / "t" / "y.pt").exists()  # a failed checkpoint writes nothing more


@pytest.mark.parametrize("direct", [True, False])
def test_checked_file_writes_every_byte(tmp_path, monkeypatch, direct):
    """Odd sizes across the staging buffer, a flush mid-stream (a partial O_DIRECT block
    written padded, then rewritten whole), torch.save through it, an injected ENOSPC: the
    bytes on disk are the bytes given, the hash is theirs."""
    import numpy as np
    import torch
    import xxhash

    from zerofit import checkpoint_io, directio

    monkeypatch.setattr(directio, "STAGE_BYTES", 64 << 10)
    pieces = [np.random.default_rng(i).integers(0, 255, size=n, dtype=np.uint8).tobytes()
              for i, n in enumerate([1, 4095, (64 << 10) + 3, 10_000, 5])]
    checked = checkpoint_io.CheckedFile(tmp_path / "f.bin", None, 0, direct=direct)
    for i, piece in enumerate(pieces):
        checked.write(piece)
        if i in (1, 3):  # partial blocks kept staged: rewritten whole later, hashed once
            checked.flush()
    checked.close()
    content = b"".join(pieces)
    assert (tmp_path / "f.bin").read_bytes() == content
    assert checked.bytes == len(content) and checked.hexdigest() == xxhash.xxh3_128(content).hexdigest()

    state = {"w": torch.randn(3000), "step": 7}
    saved = checkpoint_io.CheckedFile(tmp_path / "s.pt", None, 0, direct=direct)
    torch.save(state, saved)
    saved.close()
    loaded = torch.load(tmp_path / "s.pt", weights_only=False)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 7

    failing = checkpoint_io.CheckedFile(tmp_path / "e.bin", "enospc", 0, direct=direct)
    with pytest.raises(OSError, match="No space left"):
        failing.write(bytes(checkpoint_io.FAULT_AFTER_BYTES + 100))
    failing.close()
    assert (tmp_path / "e.bin").stat().st_size == checkpoint_io.FAULT_AFTER_BYTES
    if direct and not checked.direct:
        pytest.skip(f"O_DIRECT refused on {tmp_path}: written through the page cache (checked above)")
    assert checked.direct is direct


@pytest.mark.parametrize("crc", [True, False])
def test_zip_crc32_on_or_off_the_file_loads_and_its_hash_holds(tmp_path, crc):
    """checkpoint.zip_crc32: the records carry their CRC-32 or zero; torch.load reads both,
    the manifest's xxh3 hash is the file's, and the process-wide torch setting is restored."""
    import zipfile
    import zlib

    import torch
    from torch.utils.serialization import config as torch_serialization

    from zerofit import checkpoint_io

    before = torch_serialization.save.compute_crc32
    engine = checkpoint_io.ZerofitCheckpointEngine(True, async_save=False, host_max_bytes=1 << 20, zip_crc32=crc)
    engine.create(checkpoint_io.CheckpointCommitInfo(tag="t", save_dir=str(tmp_path), save_latest=False))
    (tmp_path / "t").mkdir()
    state = {"w": torch.randn(5000), "step": 3}
    engine.save(state, str(tmp_path / "t" / "s.pt"))
    assert engine.error is None and torch_serialization.save.compute_crc32 == before
    path = tmp_path / "t" / "s.pt"
    loaded = torch.load(path, weights_only=False)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3
    assert engine.written["s.pt"][checkpoint.HASH] == checkpoint.file_hash(path)
    with zipfile.ZipFile(path) as archive:
        record = next(i for i in archive.infolist() if i.filename.endswith("data/0"))
        stored = record.CRC
        raw = archive.open(record) if crc else None
        if raw is not None:
            assert zlib.crc32(raw.read()) == stored
    assert (stored != 0) is crc
    assert set(engine.write_parts) >= {"hash", "stage", "fsync"}
    # export's lazy reader (zerofit/torchfile.py) reads the records either way
    from zerofit import torchfile

    archive = torchfile.TorchFile(path)
    lazy = archive.load()
    assert lazy["step"] == 3 and lazy["w"].shape == (5000,)
    values = torch.empty(5000)
    with open(path, "rb") as f:
        torchfile.read_into(f.fileno(), archive.offset(lazy["w"]), values, path)
    assert torch.equal(values, state["w"])
    if crc:  # a stored CRC is still checked
        pickle_record = archive._members[archive.prefix + "data.pkl"]
        start = archive._data_start(pickle_record)
        with open(path, "r+b") as f:
            f.seek(start + 2)
            byte = f.read(1)
            f.seek(start + 2)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(torchfile.TorchFileError, match="CRC-32"):
            torchfile.TorchFile(path).load()
    # a flipped byte in the archive's directory (a member's UTF-8 name): said, not a UnicodeDecodeError
    raw = path.read_bytes()
    name_at = raw.rindex(b"data.pkl")
    path.write_bytes(raw[:name_at] + b"\xff" + raw[name_at + 1:])
    with pytest.raises(torchfile.TorchFileError, match="damaged or truncated"):
        torchfile.TorchFile(path)


def test_direct_writer_hashes_every_byte_once_across_random_writes_and_flushes(tmp_path, monkeypatch):
    """The hash thread sees each stage once; bytes that flush() kept staged are not hashed
    twice: random piece sizes (within and across 64 KiB stages) and random flushes."""
    import random as rng_module

    import xxhash

    from zerofit import checkpoint_io, directio

    monkeypatch.setattr(directio, "STAGE_BYTES", 64 << 10)
    rng = rng_module.Random(7)
    for trial in range(5):
        content = bytearray()
        checked = checkpoint_io.CheckedFile(tmp_path / f"r{trial}.bin", None, 0, direct=True)
        for _ in range(40):
            piece = rng.randbytes(rng.choice([1, 7, 4096, 5000, 65536, 70000, 200_000]))
            checked.write(piece)
            content += piece
            if rng.random() < 0.3:
                checked.flush()
        checked.close()
        assert (tmp_path / f"r{trial}.bin").read_bytes() == bytes(content)
        assert checked.hexdigest() == xxhash.xxh3_128(bytes(content)).hexdigest()
    if not checked.direct:
        pytest.skip(f"O_DIRECT refused on {tmp_path}: written through the page cache (checked above)")


def test_checked_file_falls_back_where_o_direct_is_refused(tmp_path, monkeypatch):
    """A filesystem that refuses O_DIRECT (EINVAL at open, as NFS or an older tmpfs do):
    the file is written through the page cache, whole."""
    import errno

    from zerofit import checkpoint_io

    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    checked = checkpoint_io.CheckedFile(tmp_path / "f.bin", None, 0, direct=True)
    checked.write(b"x" * 5000)
    checked.close()
    assert not checked.direct and (tmp_path / "f.bin").read_bytes() == b"x" * 5000


# ------------------------------------------------------------------- real runs
@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted synchronous run every other run is compared with."""
    base = tmp_path_factory.mktemp("reference")
    run_zerofit(["train", "--config", str(config_for(base, "run"))])
    return base / "run"


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("async")
    done = run_zerofit(["train", "--config", str(config_for(base, "run", async_save=True))])
    return base / "run", done


def test_sync_run_publishes_verified_checkpoints(reference):
    ckpts = reference / "checkpoints"
    assert (ckpts / "latest").read_text() == "step-000006"
    assert valid_steps(reference) == [4, 6]  # keep_last=2 removed step 2
    manifest = json.loads((ckpts / "step-000006" / "MANIFEST.json").read_text())
    assert manifest["world_size"] == 1 and manifest["zero_stage"] == 3 and manifest["config_fingerprint"]
    saves = [r for r in read_jsonl(reference / "memory.jsonl") if r["phase"] == "save"]
    assert [r["step"] for r in saves] == [2, 4, 6]
    assert all(r["mode"] == "sync" and r["residue_bytes"] == 0 and r["seconds"] > 0 for r in saves)


def test_async_save_writes_what_sync_writes(async_run, reference):
    run, done = async_run
    assert valid_steps(run) == [4, 6]
    for step in (4, 6):
        assert_same_weights(run, reference, step)
    records = read_jsonl(run / "memory.jsonl")
    saves = [r for r in records if r["phase"] == "save"]
    written = [r for r in records if r["phase"] == "checkpoint_written"]
    assert [r["mode"] for r in saves] == ["async"] * 3
    assert all(r["host_buffer_bytes"] > 0 for r in saves)  # the snapshot went through the host buffer
    assert [r["checkpoint"] for r in written] == ["step-000002", "step-000004", "step-000006"]
    assert all(r["bytes"] > 10**6 and r["write_gbps"] > 0 for r in written)
    assert [m["loss"] for m in read_jsonl(run / "metrics.jsonl")] == \
        [m["loss"] for m in read_jsonl(reference / "metrics.jsonl")]


def test_async_snapshot_cap_is_half_the_plans_host_budget(tmp_path):
    """The run caps its snapshot buffer as the planner did: half of plan.host_mem (it took half
    the RAM available, so a plan made for a 100 MiB budget reserved gigabytes at run time)."""
    config = tiny_config(tmp_path / "run", train={"max_steps": 2}, checkpoint={"every_steps": 2, "async_save": True},
                         plan={"host_mem": "100MiB", "enabled": False}, **SHAPE)
    run, _, done = trained_run(tmp_path, config)
    assert "snapshots (at most 50.0MiB: checkpoint.async_host_max_gib" in done.stderr.replace("\n", " ")
    assert valid_steps(run) == [2]
    # run_dir is read from the working directory: a fresh start says where it trains, so that a resume
    # started from another directory is not mistaken for one
    assert f"new run in {run.resolve()}: no checkpoint there to resume from" in done.stderr.replace("\n", "")


@pytest.mark.parametrize("fault, async_save", [("kill@save:2", False), ("kill@rename:2", True)])
def test_killed_save_resumes_to_the_same_weights(fault, async_save, reference, tmp_path):
    """SIGKILL mid-write of save 2 / between the manifest and the rename of save 2 (step 4): the
    next start removes the partial write and resumes from the newest valid checkpoint, or puts
    the whole save in place and resumes from it (it deleted it, and trained its steps again),
    and ends with the uninterrupted run's weights."""
    config = config_for(tmp_path, "run", async_save=async_save)
    killed = run_zerofit(["train", "--config", str(config)], env={faults.VARIABLE: fault}, check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    run = tmp_path / "run"
    assert valid_steps(run) == [2]
    assert list((run / "checkpoints").glob(".tmp-step-*"))  # the killed save's leftovers
    summary = diagnose(run).summary  # the async save cut short is counted as such, not as a save
    assert (summary["saves"], summary["saves_unfinished"]) == (1, 1 if async_save else 0)
    done = run_zerofit(["train", "--config", str(config)])
    said = done.stderr.replace("\n", "")
    resumed = 2 if fault.startswith("kill@save") else 4
    assert f"resumed from {run / 'checkpoints' / checkpoint.step_name(resumed)}" in said and "new run" not in said
    if resumed == 2:
        assert "removed 1 unfinished save" in said
    else:
        assert "completed the save of step-000004 under" in said and "unfinished save" not in said
    assert "train rows: tokenized by an earlier start of this run" in said  # not tokenized again
    assert_same_weights(run, reference)
    assert valid_steps(run) == [4, 6]


def test_a_latest_that_is_a_directory_is_named_not_a_traceback(reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    (run / "checkpoints" / "latest").unlink()
    (run / "checkpoints" / "latest").mkdir()
    refused = run_zerofit(["train", "--config", str(config_for(tmp_path, "run", max_steps=8))], check=False)
    said = refused.stderr.replace("\n", "")
    assert refused.returncode == 1 and "Traceback" not in said, said[-2000:]
    assert f"{run / 'checkpoints' / 'latest'} is a directory where zerofit keeps the name of the newest checkpoint" in said
    assert valid_steps(run) == [4, 6]


def test_truncated_shard_is_skipped(reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    os.truncate(run / "checkpoints" / "step-000006" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", 1000)
    config = config_for(tmp_path, "run", max_steps=6)
    done = run_zerofit(["train", "--config", str(config), "--verify", "sizes"])
    stderr = done.stderr.replace("\n", "")
    assert "skipping checkpoint step-000006: bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt has 1000 bytes" in stderr
    assert "resumed from" in stderr and "at step 4" in stderr
    assert_same_weights(run, reference)


def test_enospc_keeps_the_previous_checkpoint(reference, tmp_path):
    """on_error=stop: the run stops with the reason, step 2 stays loadable and the resume
    ends where the uninterrupted run ends."""
    config = config_for(tmp_path, "run")
    failed = run_zerofit(["train", "--config", str(config)], env={faults.VARIABLE: "enospc@save:2"}, check=False)
    assert failed.returncode == 1
    message = failed.stderr.replace("\n", "")
    assert "checkpoint step-000004 was not saved" in message and "No space left on device" in message
    assert "the previous checkpoint step-000002 is intact" in message
    run = tmp_path / "run"
    assert valid_steps(run) == [2] and not list((run / "checkpoints").glob(".tmp-*"))
    assert (run / "checkpoints" / "latest").read_text() == "step-000002"
    failed_save = [f for f in diagnose(run).findings if f.kind == "checkpoint_failed"]  # the doctor says why it stopped
    assert len(failed_save) == 1 and failed_save[0].severity == "error" and failed_save[0].step == 4
    assert "step-000004 of step 4 was not saved" in failed_save[0].title and "No space left" in failed_save[0].title
    run_zerofit(["train", "--config", str(config), "--resume"])
    assert_same_weights(run, reference)


def test_save_failures_with_on_error_continue(tmp_path):
    """ENOSPC in save 2, too little free space before save 3: both reported, training
    goes on, step 2 stays the newest checkpoint."""
    config = config_for(tmp_path, "run", on_error="continue")
    done = run_zerofit(["train", "--config", str(config)], env={faults.VARIABLE: "enospc@save:2,nospace@save:3"})
    message = done.stderr.replace("\n", "")
    assert "checkpoint step-000004 was not saved" in message and "No space left on device" in message
    assert "checkpoint step-000006 was not saved" in message and "GB free under" in message
    assert "training continues" in message and "done: step 6" in message
    run = tmp_path / "run"
    assert valid_steps(run) == [2] and (run / "checkpoints" / "latest").read_text() == "step-000002"
    failures = [r for r in read_jsonl(run / "memory.jsonl") if r["phase"] == "checkpoint_failed"]
    assert [r["checkpoint"] for r in failures] == ["step-000004", "step-000006"]
    summary = diagnose(run).summary  # save 2 failed writing after its stall was marked: not counted as a save
    assert (summary["saves"], summary["saves_failed"], summary["saves_unfinished"]) == (1, 2, 0)


def sigterm_once_there(args: list[str], path: Path, env: dict, nproc: int = 1) -> tuple[int, str, str]:
    """Start zerofit ARGS on `nproc` ranks, SIGTERM it (torchrun, for several) once `path` exists
    (or it ended, or 300 s passed); its exit code, stdout and stderr."""
    process = subprocess.Popen(zerofit_command(args, nproc), cwd=ROOT, env=child_env(env), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    wait_for(path, process)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=300)
    return process.returncode, stdout, stderr


def test_sigterm_drains_the_save_in_flight(tmp_path):
    """SIGTERM while an async save is being written (the writer is slowed by 2 s): the
    loop stops at the next step boundary, the save is finished and published, exit 143.
    Saves are 20 steps apart: the signal lands well before another save is due, however
    late this poll sees the first one start (tiny steps take a few ms)."""
    config = config_for(tmp_path, "run", max_steps=60, async_save=True, every_steps=20)
    code, _, stderr = sigterm_once_there(["train", "--config", str(config)],
                                         tmp_path / "run" / "checkpoints" / ".tmp-step-000020",
                                         {faults.VARIABLE: "slow@save:1"})
    assert code == 143, stderr[-3000:]
    run = tmp_path / "run"
    stopped_at = read_jsonl(run / "metrics.jsonl")[-1]["step"]
    assert 20 <= stopped_at < 40
    # and the step it stopped at saved (checkpoint.save_on_sigterm), the hint naming the run's config
    assert valid_steps(run) == sorted({20, stopped_at}) and not list((run / "checkpoints").glob(".tmp-*"))
    assert (f"stopped by SIGTERM at step {stopped_at}, the newest checkpoint is {checkpoint.step_name(stopped_at)}; "
            f"`zerofit train --config {run / 'config.yaml'} --resume` continues from it") in stderr.replace("\n", "")
    # the doctor tells how the run ended too (it said nothing: no findings, "N steps")
    assert diagnose(run).ending == f"stopped by SIGTERM at step {stopped_at}; newest intact checkpoint " \
                                   f"{checkpoint.step_name(stopped_at)}"


def test_sigterm_while_starting_ends_by_way_of_python(tmp_path):
    """SIGTERM during start-up (the run's files written, the engine being built): exit 143 with
    a message, not a silent death that the last word then records as unexplained."""
    config = config_for(tmp_path, "run", max_steps=60)
    code, _, stderr = sigterm_once_there(["train", "--config", str(config)], tmp_path / "run" / "config.yaml", {})
    run = tmp_path / "run"
    assert not (run / "metrics.jsonl").exists(), "the SIGTERM came after step 1: the test's premise failed"
    assert code == 143, stderr[-3000:]
    assert "zerofit: stopped by SIGTERM outside the training loop (start-up or wind-down)" in stderr
    time.sleep(1)  # a last word would have written by now
    assert not list(run.glob("postmortem/**/*.json"))


def test_a_rank_killed_in_a_save_leaves_its_peer_a_message_not_a_traceback(tmp_path):
    """Rank 1 killed outright in the save of step 4: rank 0, inside the save's collective, got
    gloo's "Connection closed by peer" as a 60-line traceback. Now one line: a peer is gone,
    the published checkpoints stand, and the command that resumes on both ranks."""
    config = config_for(tmp_path, "run", max_steps=8)
    done = run_zerofit(["train", "--config", str(config)], nproc=2, check=False,
                       env={faults.VARIABLE: "kill@save:2", "ZEROFIT_FAULT_RANKS": "1", "COLUMNS": "400"})
    assert done.returncode != 0
    said = " ".join((done.stdout + done.stderr).split())
    assert "[rank0]: Traceback" not in said and "[rank0]:" not in said, said[-3000:]
    # gloo says closed or reset, as the kill lands; the peer watcher may see it first and say so
    assert re.search(r'zerofit: error: rank 0: another rank of this run is gone \("Connection (closed|reset) by peer" '
                     r'in a collective\)', said) or "leaving now" in said, said[-3000:]
    assert valid_steps(tmp_path / "run") == [2]


def test_sigterm_to_torchrun_stops_both_ranks_at_a_step_boundary(tmp_path):
    """Preemption under torchrun: the agent passes SIGTERM on to both ranks, both alive, so
    neither leaves early (that is for a rank whose peer has exited): they stop together at a
    step boundary and the newest checkpoint is whole."""
    config = config_for(tmp_path, "run", max_steps=400, every_steps=5)
    _, stdout, stderr = sigterm_once_there(["train", "--config", str(config)],
                                           tmp_path / "run" / "checkpoints" / "step-000005", {"COLUMNS": "400"}, nproc=2)
    out = stdout + stderr
    assert "stopped by SIGTERM at step" in out, out[-3000:]
    assert "leaving now" not in out and "forcefully exiting" not in out
    # the command it names resumes on the same two ranks (one process would halve the batch)
    assert f"`torchrun --nproc_per_node 2 -m zerofit train --config {tmp_path / 'run' / 'config.yaml'} --resume`" in out
    stopped_at = read_jsonl(tmp_path / "run" / "metrics.jsonl")[-1]["step"]
    assert 5 <= stopped_at < 400
    assert valid_steps(tmp_path / "run")[-1] == stopped_at  # saved where both stopped


def test_resume_with_another_config_names_what_changed(tmp_path):
    """A resume under changed settings names each one, old -> new, in one list said first: what
    the checkpoint records against it, how the run saves, evaluates and logs against the run's
    config.yaml. They were two messages, the checkpoint's after the load: a changed train.seed
    came after the warning about the training tokens it had changed (another eval split), apart
    from checkpoint.keep_last. The checkpoints it saves then carry the settings they were trained
    with, so the next resume compares with those."""
    config = config_for(tmp_path, "run", max_steps=4)
    run_zerofit(["train", "--config", str(config)])
    for before, after, changed in ((4, 6, "checkpoint.keep_last 2 -> 3, train.max_steps 4 -> 6, train.seed 7 -> 8"),
                                   (6, 8, "train.max_steps 6 -> 8")):
        done = run_zerofit(["train", "--config", str(config), "--set", f"train.max_steps={after}", "--resume",
                            "--set", "checkpoint.keep_last=3", "--set", "train.seed=8"], env={"COLUMNS": "400"})
        said = done.stderr.splitlines()
        listed = [i for i, line in enumerate(said) if "under a different config" in line]
        assert len(listed) == 1 and said[listed[0]] == (f"warning: resuming step-{before:06d} under a different config "
                                                        f"({changed}); continuing with the current one"), done.stderr
        assert "settings changed since" not in done.stderr and done.stderr.count("train.seed 7 -> 8") == (before == 4)
        tokens = [i for i, line in enumerate(said) if "the training data's tokens differ" in line]
        assert tokens == [] if before == 6 else listed[0] < tokens[0]  # the seed drew another eval split
    unchanged = run_zerofit(["train", "--config", str(config), "--set", "train.max_steps=8", "--resume",
                             "--set", "checkpoint.keep_last=3", "--set", "train.seed=8"])
    assert "different config" not in unchanged.stderr and "is complete at step 8" in unchanged.stderr.replace("\n", " ")


def test_a_resume_on_data_changed_under_the_same_path_is_named(tmp_path):
    """The same file, rows reordered and rewritten, the same number of sequences: the
    position carried over no longer means the rows trained (and the eval split may hold
    trained rows). Named once; the checkpoints then carry the new data's fingerprint.
    Another eval set leaves the training position as it was: nothing to say."""
    rows = [{"instruction": f"spell {i}", "output": "x" * (i % 5 + 3)} for i in range(64)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    held = [write_jsonl(tmp_path / f"e{n}.jsonl", rows[n::9]) for n in (1, 2)]
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "run", data_path=str(path),
                                                           train={"max_steps": 2}, checkpoint={"every_steps": 2},
                                                           data={"packing": False, "eval_path": str(held[0]),
                                                                 "alpaca_template": "alpaca"}))
    first = run_zerofit(["train", "--config", str(config)], env={"COLUMNS": "400"})
    assert "model/: the tokenizer's chat template is now the layout the data trains (alpaca)" in first.stderr
    write_jsonl(path, [{"instruction": r["instruction"].upper(), "output": r["output"]} for r in reversed(rows)])
    changed = run_zerofit(["train", "--config", str(config), "--set", "train.max_steps=4", "--resume"],
                          env={"COLUMNS": "400"})
    assert "the training data's tokens differ from those step-000002 trained on" in changed.stderr
    assert "chat template is now" not in changed.stderr  # model/ holds it already: said once
    again = run_zerofit(["train", "--config", str(config), "--set", "train.max_steps=6", "--resume",
                         "--set", f"data.eval_path={held[1]}"])
    assert "tokens differ" not in again.stderr and "resumed from" in again.stderr


def test_a_resume_the_checkpoint_cannot_take_is_refused_before_anything_is_rewritten(reference, tmp_path):
    """Another architecture or precision cannot load the run's checkpoint (DeepSpeed fails with
    missing keys or another optimizer file, after the run's config.yaml and model/ had been
    rewritten for the new config, which an export then used): refused first, naming the
    change and the fix, the run dir as it was. So are checkpoints none of which verifies:
    starting over would publish over them."""
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    config = config_for(tmp_path, "run", max_steps=8)
    kept = [run / "config.yaml", run / "plan.json", run / "model" / "config.json",
            *sorted((run / "checkpoints").rglob("*.*"))]
    before = [path.read_bytes() for path in kept]
    deeper, relu = tmp_path / "deeper.json", tmp_path / "relu.json"
    deeper.write_text(json.dumps({**json.loads((run / "model" / "config.json").read_text()), "num_hidden_layers": 3}))
    relu.write_text(json.dumps({**json.loads((run / "model" / "config.json").read_text()), "hidden_act": "relu"}))
    for changes, said in (([f"model.config={deeper}", f"model.tokenizer={run / 'model'}"],
                           "model num_hidden_layers 2 -> 3"),
                          ([f"model.config={relu}", f"model.tokenizer={run / 'model'}"],  # same shapes, other function
                           "model hidden_act silu -> relu"),
                          (["train.precision=fp32"], "train.precision bf16 -> fp32")):
        settings = [arg for change in changes for arg in ("--set", change)]
        refused = run_zerofit(["train", "--config", str(config), *settings], check=False, env={"COLUMNS": "400"})
        message = refused.stderr.replace("\n", "")
        assert refused.returncode == 1 and "Traceback" not in message, message[-3000:]
        assert f"step-000006 cannot be loaded under this config ({said})" in message
        assert f"`zerofit train --config {run / 'config.yaml'}`" in message and "--no-resume" in message
    assert [path.read_bytes() for path in kept] == before

    for manifest in (run / "checkpoints").glob("step-*/MANIFEST.json"):
        os.truncate(manifest, 100)
    refused = run_zerofit(["train", "--config", str(config)], check=False, env={"COLUMNS": "400"})
    message = refused.stderr.replace("\n", "")
    assert refused.returncode == 1 and "none of the 2 checkpoint(s) under" in message, message[-3000:]
    assert "MANIFEST.json is corrupt" in message and "--no-resume" in message
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-000004", "step-000006"]
    assert not (run / "metrics.jsonl").read_text().count('"step": 7')

    # starting over moves them aside with the records that go with them: nothing is written over
    run_zerofit(["train", "--config", str(config), "--no-resume", "--set", "train.max_steps=2"])
    earlier = next((run / "checkpoints").glob("earlier-*"))
    assert {"step-000004", "step-000006", "metrics.jsonl", "model", "config.yaml"} <= {p.name for p in earlier.iterdir()}
    from zerofit.export import run_model_dir  # the new run rewrites model/: the earlier one's is its copy
    assert run_model_dir(earlier) == earlier / "model" and (earlier / "model" / "config.json").is_file()
    assert max(r["step"] for r in read_jsonl(earlier / "metrics.jsonl")) == 6
    assert max(r["step"] for r in read_jsonl(run / "metrics.jsonl")) == 2
    # the doctor reads the directory as that run, its checkpoints too (it looked for earlier-*/checkpoints/)
    assert {f.step for f in diagnose(earlier).findings if f.kind == "checkpoint_damaged"} == {4, 6}


def test_a_new_run_keeps_the_records_of_an_earlier_one_that_saved_no_checkpoint(tmp_path):
    """A run killed in step 2, before its first save (every 2 steps, kill before step 2's forward),
    leaves metrics.jsonl, memory.jsonl and its last word, no checkpoint. The next start rewrote
    metrics.jsonl, appended its timeline to the old one (the doctor counted a resume) and the
    kill stayed in postmortem/ as this run's history: the evidence of what ended the earlier run
    was gone. Now they are set aside in checkpoints/earlier-TIME/ as --no-resume sets a run aside,
    the start's line says where, and the doctor reads each run on its own."""
    from zerofit.lastword import RECORD

    config = config_for(tmp_path, "run", max_steps=4)
    killed = run_zerofit(["train", "--config", str(config)], env={faults.VARIABLE: "kill@step:2"}, check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    run = tmp_path / "run"
    deadline = time.monotonic() + 30  # the last word imports zerofit before it writes
    while not (run / "postmortem" / RECORD).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    written = {name: (run / name).read_bytes() for name in ("metrics.jsonl", "memory.jsonl", f"postmortem/{RECORD}")}
    assert not (run / "checkpoints").exists() and [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1]

    done = run_zerofit(["train", "--config", str(config)])
    earlier = next((run / "checkpoints").glob("earlier-*"))
    assert (f"new run in {run.resolve()}: no checkpoint there to resume from; the earlier run's records "
            f"(metrics.jsonl, memory.jsonl, postmortem) are kept in {earlier} (`zerofit doctor` reads them "
            f"there)") in " ".join(done.stderr.split())
    assert {name: (earlier / name).read_bytes() for name in written} == written  # as the killed run left them
    assert (earlier / "config.yaml").is_file() and (earlier / "plan.json").is_file()
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4]
    assert [r["phase"] for r in read_jsonl(run / "memory.jsonl")].count("start") == 1
    assert not (run / "postmortem").exists()
    before = diagnose(earlier)
    assert before.ending == ("killed outright after step 1 (no end record; see the finding); no intact checkpoint "
                             "(step 1 in no intact checkpoint)")
    assert [f.severity for f in before.findings if f.kind == "killed"] == ["error"]
    after = diagnose(run)
    assert after.ending == "completed at step 4; newest intact checkpoint step-000004"
    assert after.summary["resumes"] == 0 and not [f for f in after.findings if f.kind == "killed"]
    again = run_zerofit(["train", "--config", str(config), "--set", "train.max_steps=6"])  # a resume: nothing moved
    assert "resumed from" in again.stderr and len(list((run / "checkpoints").glob("earlier-*"))) == 1


def test_a_resume_trains_with_the_current_lr_schedule_and_weight_decay(tmp_path):
    """DeepSpeed's load restores the saved param groups and scheduler base LRs over the current
    config's: a resume with a new train.lr, weight_decay or a raised max_steps trains with
    them (the warning says "continuing with the current one"), from the schedule's position."""
    import torch

    from zerofit.configfile import load
    from zerofit.engine import lr_lambda

    config = config_for(tmp_path, "run", max_steps=4)
    run_zerofit(["train", "--config", str(config)])
    changes = ["train.max_steps=8", "train.lr=0.01", "train.weight_decay=0.1"]
    run_zerofit(["train", "--config", str(config), *[arg for change in changes for arg in ("--set", change)]])
    factor = lr_lambda(load(config, changes), 8)
    logged = {record["step"]: record["lr"] for record in read_jsonl(tmp_path / "run" / "metrics.jsonl")}
    assert [logged[step] for step in range(5, 9)] == pytest.approx([0.01 * factor(step - 1) for step in range(5, 9)])
    saved = torch.load(next((tmp_path / "run" / "checkpoints" / "step-000008").glob("*optim_states.pt")),
                       weights_only=False)["optimizer_state_dict"]["optimizer_state_dict"]["param_groups"]
    assert [group["weight_decay"] for group in saved] == [0.1, 0.0]
    assert [group["lr"] for group in saved] == pytest.approx([0.01 * factor(8)] * 2)


def test_a_nan_loss_stops_the_run_before_it_saves_or_rotates_a_checkpoint(reference, tmp_path):
    """Masters damaged in place (size unchanged) and a resume that checks sizes only: the loss
    is NaN from the first step. The run stops there, exit 1, naming it; no NaN step is logged
    or saved, and the older good checkpoint is not rotated out (keep_last 2)."""
    from zerofit import zerofiles

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    newest = run / "checkpoints" / "step-000006"
    for tensor in zerofiles.open_checkpoint(newest).tensors:
        if tensor.kind == "trainable":
            piece = tensor.pieces[0]
            with open(piece.path, "r+b") as f:
                f.seek(piece.offset)
                f.write(b"\xff" * 4 * piece.numel)
    config = config_for(tmp_path, "run", max_steps=8)
    stopped = run_zerofit(["train", "--config", str(config), "--verify", "sizes"], check=False, env={"COLUMNS": "400"})
    message = stopped.stderr.replace("\n", "")
    assert stopped.returncode == 1 and "the loss is nan at step 7" in message, message[-3000:]
    assert "the newest checkpoint, step-000006, is as it was" in message and "--verify full" in message
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-000004", "step-000006"]
    assert valid_steps(run) == [4]  # step 6's hashes no longer hold: step 4 is the good one left
    assert max(r["step"] for r in read_jsonl(run / "metrics.jsonl")) == 6


def test_resume_on_fewer_ranks(tmp_path):
    """A 2-rank run (async saves) dies in its last save; the run resumes on 1 rank through
    a universal checkpoint: same data position, the loss goes on from where it was."""
    config = config_for(tmp_path, "run", async_save=True)
    killed = run_zerofit(["train", "--config", str(config)], nproc=2, env={faults.VARIABLE: "kill@save:3"},
                         check=False)
    assert killed.returncode != 0
    run = tmp_path / "run"
    assert valid_steps(run) == [2, 4]
    assert json.loads((run / "checkpoints" / "step-000004" / "MANIFEST.json").read_text())["world_size"] == 2
    before = {m["step"]: m["loss"] for m in read_jsonl(run / "metrics.jsonl")}
    done = run_zerofit(["train", "--config", str(config), "--resume"])
    stderr = done.stderr.replace("\n", "")
    assert "converting it to a universal checkpoint" in stderr
    assert "data position: 4 micro batches of 4 on 2 rank(s) -> 8 of 4 on 1" in stderr
    # micro batch and accumulation fixed: one rank trains half the batch per step, and says so
    assert "step-000004 trained 8 sequences per optimizer step, this run 4 (ranks 2 -> 1" in stderr
    assert "--set train.grad_accum_steps=2" in stderr
    universal = run / "checkpoints" / "universal-step-000004"
    assert checkpoint.verify(universal, hashes=True) is None
    assert json.loads((universal / "MANIFEST.json").read_text())["source_world_size"] == 2
    after = {m["step"]: m["loss"] for m in read_jsonl(run / "metrics.jsonl")}
    assert [after[s] for s in (1, 2, 3, 4)] == [before[s] for s in (1, 2, 3, 4)]
    assert after[5] < before[1] - 0.15 and abs(after[5] - before[4]) < 0.4, after  # continues, not restarted
    state = checkpoint.read_loop_state(run / "checkpoints" / "step-000006")
    assert state.world_size == 1 and state.micro_batches == 8 + 2  # 32 sequences on 2 ranks, then 2 x 4


# ------------------------------------------------------------------- kill -9 stress
KILL_POINTS = ["kill@save:{n}", "kill@publish:{n}", "kill@rename:{n}", "kill@latest:{n}", "kill@retention:{n}"]


def test_kill_at_random_moments(reference, tmp_path):
    """SIGKILL at a random fault point of a random save, or from outside at a random moment
    while a save is in flight, sync and async; every resume succeeds and ends with the
    uninterrupted run's weights, and a valid checkpoint always survives. 3 trials in the suite
    (~2 min; under the default seed one of each kind: kill@latest sync, kill@retention async, a
    kill from outside), more with ZEROFIT_KILL_TRIALS (12 for the full stress) and ZEROFIT_TEST_SEED."""
    rng = random.Random(int(os.environ.get("ZEROFIT_TEST_SEED", "1234")))
    for trial in range(int(os.environ.get("ZEROFIT_KILL_TRIALS", "3"))):
        async_save = rng.random() < 0.5
        config = config_for(tmp_path, f"run{trial}", async_save=async_save, keep_last=1)
        run = tmp_path / f"run{trial}"
        if trial % 3 == 2:
            kill_from_outside(config, run, rng)
        else:
            fault = rng.choice(KILL_POINTS).format(n=rng.choice([2, 3]))
            killed = run_zerofit(["train", "--config", str(config)], env={faults.VARIABLE: fault}, check=False)
            assert killed.returncode == -signal.SIGKILL, (fault, killed.stderr[-2000:])
            assert valid_steps(run), fault  # keep_last=1 and still one to resume from
        run_zerofit(["train", "--config", str(config)])
        assert_same_weights(run, reference)


def kill_from_outside(config: Path, run: Path, rng: random.Random) -> None:
    process = subprocess.Popen(zerofit_command(["train", "--config", str(config)]), cwd=ROOT, env=child_env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(run / "checkpoints" / f".tmp-step-00000{rng.choice([2, 4])}", process, poll_s=0.002)
    time.sleep(rng.uniform(0, 0.05))
    process.kill()
    process.wait()


def test_a_corrupt_newer_checkpoint_is_set_aside_not_kept_by_retention(tmp_path):
    """step-000008 has a flipped byte (its size unchanged); the resume from step 6 with
    keep_last 1 saved 7 and 8, and retention once kept the corrupt 8 (it judged by sizes) and
    deleted every good checkpoint. Now the resume sets it aside and the good ones stay."""
    config = config_for(tmp_path, "run", max_steps=8)
    run_zerofit(["train", "--config", str(config)])
    run = tmp_path / "run"
    target = run / "checkpoints" / "step-000008" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    done = run_zerofit(["train", "--config", str(config), "--resume", "--set", "checkpoint.every_steps=1",
                        "--set", "checkpoint.keep_last=1"])
    said = " ".join(done.stderr.split())
    assert "resumed from" in said and "step 6" in said and "set aside unusable-step-000008" in said
    assert valid_steps(run) == [8] and (run / "checkpoints" / "latest").read_text() == "step-000008"
    assert (run / "checkpoints" / "unusable-step-000008").is_dir()
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == list(range(1, 9))


def test_a_damaged_file_read_without_hashes_is_named_with_the_fix(tmp_path):
    """--verify sizes cannot see a changed byte: DeepSpeed's load then failed with a traceback
    ("Expected hasRecord(version)"). Now the error names the checkpoint and --verify full, which
    sets it aside and resumes from the one before."""
    config = config_for(tmp_path, "run", max_steps=4)
    run_zerofit(["train", "--config", str(config)])
    target = tmp_path / "run" / "checkpoints" / "step-000004" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    raw = target.read_bytes()
    name_at = raw.rindex(b"data.pkl")  # in the archive's directory, where torch.load looks first
    target.write_bytes(raw[:name_at - 3] + bytes([raw[name_at - 3] ^ 0xFF]) + raw[name_at - 2:])
    more = ["--set", "train.max_steps=5", "--resume"]
    failed = run_zerofit(["train", "--config", str(config), "--verify", "sizes", *more], check=False)
    said = " ".join(failed.stderr.split())
    assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr[-2000:]
    assert "step-000004 cannot be read on rank 0" in said and "Resume with --verify full" in said
    done = run_zerofit(["train", "--config", str(config), "--verify", "full", *more])
    assert "set aside unusable-step-000004" in " ".join(done.stderr.split())


def test_verify_sizes_skips_a_checkpoint_whose_loop_state_is_not_json(tmp_path):
    """Under --verify sizes a loop_state.json with a changed byte (its size the same) crashed
    the resume with a traceback instead of falling back to the checkpoint before."""
    root = tmp_path / "checkpoints"
    older, newer = make_checkpoint(root, 2), make_checkpoint(root, 4)
    assert checkpoint.verify(newer, hashes=False) is None
    text = (newer / checkpoint.LOOP_STATE).read_text()
    (newer / checkpoint.LOOP_STATE).write_text("!" + text[1:])
    assert "loop_state.json is not valid JSON" in checkpoint.verify(newer, hashes=False)
    found, skipped = checkpoint.find_latest_valid(root, hashes=False)
    assert found == older and skipped[0][0] == "step-000004"


def test_a_second_process_on_the_same_run_dir_is_refused(tmp_path):
    """Two trains in one run_dir overwrote each other's checkpoints and metrics, and the second
    removed the first's save in progress as stale: the second now refuses, naming the first."""
    import subprocess
    import sys

    from zerofit import runlock
    from zerofit.config import ConfigError

    holder = subprocess.Popen([sys.executable, "-c", f"from zerofit import runlock; runlock.hold({str(tmp_path)!r}); "
                               f"print('held', flush=True); import time; time.sleep(60)"],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=rf"in use by another zerofit train \(pid {holder.pid}\)"):
            runlock.hold(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    runlock.hold(tmp_path)  # released with the process that held it
    runlock.hold(tmp_path)  # and this process may take it again (an in-process OOM retry)


def test_metrics_stay_one_curve_after_a_kill_at_publish_and_a_torn_line(tmp_path):
    """A kill after step 4's checkpoint was published but before its metrics line was written
    left step 4 out for good; a torn last line (a crash mid-write, a full disk) made every
    resume fail parsing metrics.jsonl."""
    config = config_for(tmp_path, "run", max_steps=6)
    killed = run_zerofit(["train", "--config", str(config)], env={faults.VARIABLE: "kill@latest:2"}, check=False)
    assert killed.returncode != 0
    run = tmp_path / "run"
    metrics = run / "metrics.jsonl"
    metrics.write_bytes(metrics.read_bytes() + b'{"step": 5, "loss": 4.')  # a torn line after the kill
    run_zerofit(["train", "--config", str(config), "--resume"])
    assert [m["step"] for m in read_jsonl(metrics)] == [1, 2, 3, 4, 5, 6]
    assert all(line.startswith("{") and line.endswith("}") for line in metrics.read_text().splitlines())


def test_ctrl_c_names_the_checkpoint_to_go_on_from(tmp_path):
    """Ctrl-C said only "zerofit: interrupted": the steps since the newest checkpoint are lost,
    and which one that is, and the command that continues from it, were left to find."""
    config = config_for(tmp_path, "run", max_steps=400)
    process = subprocess.Popen(zerofit_command(["train", "--config", str(config)]), cwd=ROOT, env=child_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(tmp_path / "run" / "checkpoints" / "step-000002", process)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=300)
    said = " ".join(stderr.split())
    assert process.returncode == 130, stderr[-2000:]
    assert "zerofit: interrupted; the newest checkpoint is step-0000" in said
    run = tmp_path / "run"
    end = read_jsonl(run / "memory.jsonl")[-1]
    newest = checkpoint.find_latest_valid(run / "checkpoints")[0]
    unsaved = end["step"] - checkpoint.step_of(newest)
    assert end["phase"] == "end" and diagnose(run).ending == (
        f"interrupted (Ctrl-C) at step {end['step']}; newest intact checkpoint {newest.name}"
        + {0: "", 1: f" (step {end['step']} in no intact checkpoint)"}.get(unsaved, f" (steps {end['step'] - unsaved + 1}-"
                                                                     f"{end['step']} in no intact checkpoint)"))
    assert f"`zerofit train --config {tmp_path / 'run' / 'config.yaml'} --resume` continues from it" in said


def test_ctrl_c_under_torchrun_says_it_once(tmp_path):
    """A terminal's Ctrl-C reaches every rank (the foreground process group): each printed the
    "interrupted" line, so two ranks said the same thing twice."""
    config = config_for(tmp_path, "run", max_steps=400)
    process = subprocess.Popen(zerofit_command(["train", "--config", str(config)], nproc=2), cwd=ROOT,
                               env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    wait_for(tmp_path / "run" / "checkpoints" / "step-000002", process)
    os.killpg(process.pid, signal.SIGINT)  # as a terminal sends it: torchrun and both ranks
    _, stderr = process.communicate(timeout=300)
    said = [line for line in stderr.splitlines() if "zerofit: interrupted" in line]
    assert process.returncode != 0, stderr[-2000:]
    assert len(said) == 1 and "the newest checkpoint is step-0000" in said[0], stderr[-3000:]
