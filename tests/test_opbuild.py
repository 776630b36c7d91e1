"""A killed DeepSpeed op build leaves torch's lock file; zerofit must not wait on it forever."""
from __future__ import annotations

import os
import shutil
import time

from conftest import run_zerofit, tiny_config, write_config
from zerofit import opbuild

HOUR = 3600


def _lock(root, op: str, age_s: float):
    path = root / op / "lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    stamp = time.time() - age_s
    os.utime(path, (stamp, stamp))
    return path


def test_only_old_locks_nobody_holds_are_cleared(tmp_path):
    stale = _lock(tmp_path, "cpu_adam", HOUR)
    fresh = _lock(tmp_path / "py311_cpu", "deepspeed_shm_comm", 5)
    held = _lock(tmp_path, "async_io", HOUR)
    fd = os.open(held, os.O_RDONLY)  # what FileBaton does while ninja runs
    try:
        by_path = {lock.path: lock for lock in opbuild.build_locks(tmp_path)}
        assert set(by_path) == {stale, fresh, held}
        assert [by_path[p].stale for p in (stale, fresh, held)] == [True, False, False]
        assert "build in progress" in by_path[held].describe()
        cleared = opbuild.clear_stale_build_locks(tmp_path)
    finally:
        os.close(fd)
    assert [lock.path for lock in cleared] == [stale]
    assert not stale.exists() and fresh.exists() and held.exists()


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
