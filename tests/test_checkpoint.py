"""Crash-safe checkpoints (checkpoint.py): the file rules, runs killed or out of disk against an unbroken run."""
import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import ROOT, child_env, config_for, read_jsonl, run_zerofit, valid_steps, wait_for, zerofit_command

from zerofit.checkpoint import files as checkpoint
from zerofit.core import faults
from zerofit.doctor.run import diagnose


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
    from zerofit.plan.estimate import CHECKPOINT_OVERHEAD_BYTES as overhead  # metadata, model_states, rng

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


# ------------------------------------------------------------------- real runs
@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("async")
    done = run_zerofit(["train", "--config", str(config_for(base, "run", async_save=True))])
    return base / "run", done


@pytest.mark.e2e
def test_sync_run_publishes_verified_checkpoints(reference):
    ckpts = reference / "checkpoints"
    assert (ckpts / "latest").read_text() == "step-000006"
    assert valid_steps(reference) == [4, 6]  # keep_last=2 removed step 2
    manifest = json.loads((ckpts / "step-000006" / "MANIFEST.json").read_text())
    assert manifest["world_size"] == 1 and manifest["zero_stage"] == 3 and manifest["config_fingerprint"]
    saves = [r for r in read_jsonl(reference / "memory.jsonl") if r["phase"] == "save"]
    assert [r["step"] for r in saves] == [2, 4, 6]
    assert all(r["mode"] == "sync" and r["residue_bytes"] == 0 and r["seconds"] > 0 for r in saves)


@pytest.mark.e2e
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


@pytest.mark.e2e
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


@pytest.mark.e2e
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


@pytest.mark.e2e
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


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_a_nan_loss_stops_the_run_before_it_saves_or_rotates_a_checkpoint(reference, tmp_path):
    """Masters damaged in place (size unchanged) and a resume that checks sizes only: the loss
    is NaN from the first step. The run stops there, exit 1, naming it; no NaN step is logged
    or saved, and the older good checkpoint is not rotated out (keep_last 2)."""
    from zerofit.checkpoint import zerofiles

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


# ------------------------------------------------------------------- kill -9 stress
KILL_POINTS = ["kill@save:{n}", "kill@publish:{n}", "kill@rename:{n}", "kill@latest:{n}", "kill@retention:{n}"]


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_a_second_process_on_the_same_run_dir_is_refused(tmp_path):
    """Two trains in one run_dir overwrote each other's checkpoints and metrics, and the second
    removed the first's save in progress as stale: the second now refuses, naming the first."""
    import subprocess
    import sys

    from zerofit.core import runlock
    from zerofit.core.errors import ConfigError

    holder = subprocess.Popen([sys.executable, "-c", f"from zerofit.core import runlock; runlock.hold({str(tmp_path)!r}); "
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
