"""One training process per run directory. Two `zerofit train` on one run_dir overwrite each
other's checkpoints and metrics (the second even removed the first's save in progress as a
stale leftover). Global rank 0 holds an flock on RUN_DIR/.zerofit.lock for its lifetime; the
kernel releases it when the process ends, however it ends, so a crash leaves nothing to clean up."""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from zerofit.config import ConfigError

LOCK_FILE = ".zerofit.lock"
_held: dict[Path, int] = {}  # lock file -> the open descriptor holding it (kept open until exit)


def hold(run_dir: Path) -> None:
    """Take run_dir's lock, or refuse naming the process that holds it."""
    path = (Path(run_dir) / LOCK_FILE).resolve()
    if path in _held:  # this process holds it already (an in-process OOM retry)
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(f"{run_dir} is in use by another zerofit train (pid {holder}): two runs in one run_dir "
                          f"overwrite each other's checkpoints and metrics; wait for it to end, stop it, or set "
                          f"another run_dir (--run-dir)") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[path] = fd


def holder(run_dir: Path) -> int | None:
    """The pid of the zerofit train that holds run_dir's lock now (the run is still going), else None."""
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        return int(text) if text.isdigit() else -1
    finally:
        os.close(fd)  # closing drops the shared lock taken when nobody held it
    return None


def remove_if_only_locked(run_dir: Path, made: Path) -> None:
    """A run directory that holds nothing but the lock file this process holds, removed with it,
    and the directories above it up to `made` (the topmost the start made) where empty: what a
    start made before it found a config error (a model path that is not there) and left behind.
    A lock another process holds (a start refused because the run is in use) is never touched."""
    path = Path(run_dir).absolute()
    if not path.is_dir() or [entry.name for entry in path.iterdir()] != [LOCK_FILE]:
        return
    fd = _held.pop((path / LOCK_FILE).resolve(), None)
    if fd is None:
        return
    (path / LOCK_FILE).unlink()
    os.close(fd)
    for directory in [path, *path.parents]:
        if any(directory.iterdir()):
            return
        directory.rmdir()
        if directory == Path(made).absolute():
            return
