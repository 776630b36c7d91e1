"""A killed DeepSpeed op build leaves torch's lock file; zerofit must not wait on it forever."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_zerofit, tiny_config, write_config

from zerofit.machine import opbuild

HOUR = 3600


def _lock(root, op: str, age_s: float):
    path = root / op / "lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    stamp = time.time() - age_s
    os.utime(path, (stamp, stamp))
    return path


def test_only_locks_nobody_holds_are_cleared(tmp_path):
    """On a local filesystem every process that could hold a lock is seen here: one nobody
    holds open is stale however young (it waited 5 minutes for its age before)."""
    stale = _lock(tmp_path, "cpu_adam", HOUR)
    fresh = _lock(tmp_path / "py311_cpu", "deepspeed_shm_comm", 5)
    held = _lock(tmp_path, "async_io", HOUR)
    fd = os.open(held, os.O_RDONLY)  # what FileBaton does while ninja runs
    try:
        by_path = {lock.path: lock for lock in opbuild.build_locks(tmp_path)}
        assert set(by_path) == {stale, fresh, held}
        assert [by_path[p].stale for p in (stale, fresh, held)] == [True, True, False]
        assert "build in progress" in by_path[held].describe()
        cleared = opbuild.clear_stale_build_locks(tmp_path)
    finally:
        os.close(fd)
    assert sorted(lock.path for lock in cleared) == sorted([stale, fresh])
    assert not stale.exists() and not fresh.exists() and held.exists()


@pytest.mark.e2e
def test_a_lock_left_by_a_killed_build_is_stale_at_once(tmp_path):
    """kill -9 during the op load: the lock torch's FileBaton made stays, and the next start
    waited 5 minutes for its age. Its holder is gone, so it is stale at once."""
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from torch.utils.file_baton import FileBaton; "
                               "assert FileBaton(sys.argv[1]).try_acquire(); print('held', flush=True); time.sleep(600)",
                               str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        time.sleep(opbuild.SCAN_SLACK_S + 0.1)
        assert [(found.held_open, found.stale) for found in opbuild.build_locks(tmp_path)] == [(True, False)]
        assert opbuild.clear_stale_build_locks(tmp_path) == [] and lock.exists()
    finally:
        holder.kill()
        holder.wait()
    cleared = opbuild.clear_stale_build_locks(tmp_path)
    assert [found.path for found in cleared] == [lock] and not lock.exists()
    assert "left by a build whose process is gone" in cleared[0].describe()


def test_a_young_lock_on_a_shared_filesystem_waits_for_its_age():
    """On NFS a build on another node holds its lock where /proc cannot see it: the age rule."""
    mounts = "/dev/sda1 / ext4 rw 0 0\nserver:/home /home nfs4 rw 0 0\n/dev/sdb1 /home/me/local ext4 rw 0 0\n"
    assert opbuild.filesystem_type(Path("/home/me/.cache/torch_extensions/cpu_adam/lock"), mounts) == "nfs4"
    assert opbuild.filesystem_type(Path("/home/me/local/x/lock"), mounts) == "ext4"
    assert opbuild.filesystem_type(Path("/tmp/lock"), mounts) == "ext4"
    young = opbuild.BuildLock(Path("/home/me/lock"), age_s=5, held_open=False, holder_visible=False)
    assert not young.stale and opbuild.BuildLock(Path("/x"), opbuild.STALE_AFTER_S + 1, False, False).stale


def test_a_lock_left_while_waiting_is_cleared_too(tmp_path, monkeypatch):
    """A build that dies while this process waits on its lock (FileBaton.wait) leaves the
    same trap: the sweeper clears it within one sweep."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(opbuild, "SWEEP_EVERY_S", 0.05)
    cleared = []
    with opbuild.stale_locks_cleared(cleared.append):
        assert cleared == []
        lock = _lock(tmp_path, "cpu_adam", HOUR)
        deadline = time.time() + 10
        while lock.exists() and time.time() < deadline:
            time.sleep(0.05)
    assert not lock.exists() and [c.path for c in cleared] == [lock]
    again = _lock(tmp_path, "cpu_adam", HOUR)
    with opbuild.stale_locks_cleared(cleared.append, enabled=False):  # not the node's first rank
        time.sleep(0.2)
    assert again.exists()


@pytest.mark.e2e
def test_training_goes_on_past_a_killed_build(tmp_path):
    """The CI failure this guards against: a build killed at 13:18 left cpu_adam/lock and
    every later `zerofit train` hung in FileBaton.wait()."""
    extensions = tmp_path / "torch_extensions"
    root = opbuild.build_root()  # reuse this machine's builds: no minute-long compile
    for op in ("cpu_adam", "deepspeed_shm_comm"):  # ROOT/py311_cpu/op by default, ROOT/op with TORCH_EXTENSIONS_DIR
        built = next((d for d in (root / "py311_cpu" / op, root / op) if d.is_dir()), None)
        if built is not None:
            shutil.copytree(built, extensions / op, ignore=shutil.ignore_patterns("lock"))
    lock = _lock(extensions, "cpu_adam", HOUR)
    config = tiny_config(tmp_path / "run", train={"max_steps": 1}, eval={"every_steps": 0},
                         checkpoint={"every_steps": 0, "save_final": False})
    done = run_zerofit(["train", "--config", str(write_config(tmp_path / "c.yaml", config))],
                       env={"TORCH_EXTENSIONS_DIR": str(extensions)}, timeout=400)
    assert "removed DeepSpeed's op build lock" in done.stdout + done.stderr
    assert str(lock) in (done.stdout + done.stderr).replace("\n", "")
    assert not lock.exists() and (tmp_path / "run" / "metrics.jsonl").exists()
    assert "building DeepSpeed's" not in done.stderr  # both ops are there: nothing to announce
    assert "built successfully" not in done.stdout  # DeepSpeed's print at every start: stdout is the verb's


def test_a_first_build_is_announced(tmp_path, monkeypatch, capsys):
    """A first cpu_adam build is minutes without a word (7 min on the 2-core CI machine, read as a
    hang): said before it starts, and only while the op's library is not there."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert not opbuild.built("cpu_adam")
    with opbuild.ops_unblocked(("cpu_adam",)):
        pass
    assert "building DeepSpeed's cpu_adam op (first use" in capsys.readouterr().err
    (tmp_path / "cpu_adam").mkdir()
    (tmp_path / "cpu_adam" / "cpu_adam.so").write_bytes(b"")
    assert opbuild.built("cpu_adam")
    with opbuild.ops_unblocked(("cpu_adam",)):
        pass
    assert "building" not in capsys.readouterr().err
