"""One training process per run directory. Two `zerofit train` on one run_dir overwrite each
other's checkpoints and metrics (the second even removed the first's save in progress as a
stale leftover). Global rank 0 holds an flock on RUN_DIR/.zerofit.lock for its lifetime; the
kernel releases it when the process ends, however it ends, so a crash leaves nothing to clean up.

The pid written into the file is read only while the lock is held (`holder`). A start refused
before it changes the run (a checkpoint it may not resume) gives the file back as it found it
(`give_back`): the refusal leaves no trace of itself in the run, not even its pid."""
from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from zerofit.core.errors import ConfigError

LOCK_FILE = ".zerofit.lock"


@dataclass(frozen=True)
class Found:
    """A lock file as `hold` found it, to be put back by `give_back`."""
    content: bytes | None                # None: there was no lock file (hold made it)
    times_ns: tuple[int, int] = (0, 0)   # its (atime, mtime)


_held: dict[Path, int] = {}  # lock file -> the open descriptor holding it (kept open until exit)
_found: dict[Path, Found] = {}  # lock file -> what it was before this process took it, until the start keeps it


NO_FOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC  # a .zerofit.lock link is refused, never written through


def _lock_path(run_dir: Path) -> Path:
    """The lock file's path, its directory resolved (the same lock however run_dir is named); the
    file itself is never resolved: a link there is refused (_open_or_make)."""
    return Path(run_dir).resolve() / LOCK_FILE


def hold(run_dir: Path) -> None:
    """Take run_dir's lock, or refuse naming the process that holds it."""
    path = _lock_path(run_dir)
    if path in _held:  # this process holds it already (an in-process OOM retry)
        return
    fd, made = _open_or_make(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(f"{run_dir} is in use by another zerofit train (pid {holder}): two runs in one run_dir "
                          f"overwrite each other's checkpoints and metrics; wait for it to end, stop it, or set "
                          f"another run_dir (--run-dir)") from None
    _found[path] = Found(None) if made else _read_found(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[path] = fd


def _open_or_make(path: Path) -> tuple[int, bool]:
    """The lock file opened for writing, and whether this call made it (give_back removes it then).
    A symbolic link in its place is refused: truncating and writing the pid through it would
    clobber whatever file it points at."""
    while True:
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | NO_FOLLOW, 0o644), True
        except FileExistsError:
            pass
        try:
            return os.open(path, os.O_RDWR | NO_FOLLOW), False
        except FileNotFoundError:  # a refused start removed the one it had made in between: make it
            continue
        except OSError:
            if not path.is_symlink():
                raise
            raise ConfigError(f"{path} is a symbolic link (to {os.readlink(path)}), not zerofit's lock file: "
                              f"taking the lock would overwrite what it points at; remove the link") from None


def _read_found(fd: int) -> Found:
    stat = os.fstat(fd)
    return Found(os.pread(fd, stat.st_size, 0), (stat.st_atime_ns, stat.st_mtime_ns))


def keep(run_dir: Path) -> None:
    """The start goes on to change the run (rank 0 rewrites its files): from here the lock file
    and its pid are the run's, however the start ends."""
    _found.pop(_lock_path(run_dir), None)


def give_back(run_dir: Path) -> None:
    """Release the lock this process took on run_dir and leave its file as `hold` found it (the
    earlier start's pid, with its times, or no file): for a start refused before it changed the
    run, which would otherwise leave its pid behind. Nothing when this process holds no lock
    there (another live process does: a start refused because the run is in use), or when the
    start has changed the run (`keep`)."""
    path = _lock_path(run_dir)
    if path not in _held or path not in _found:
        return
    found, fd = _found.pop(path), _held.pop(path)
    if found.content is None:
        path.unlink(missing_ok=True)  # before the lock is released: no other start has taken it meanwhile
    else:
        os.ftruncate(fd, 0)
        os.pwrite(fd, found.content, 0)
        os.utime(fd, ns=found.times_ns)
    os.close(fd)


def holder(run_dir: Path) -> int | None:
    """The pid of the zerofit train that holds run_dir's lock now (the run is still going), else None."""
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | NO_FOLLOW)
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


def leave_as_found(run_dir: Path, made: Path | None) -> None:
    """What a start that found a config error leaves: its lock given back (`give_back`), then
    the run directory and the directories above it up to `made` (the topmost the start made),
    where empty: what it made before it found the error (a model path that is not there). A
    lock another process holds (a start refused because the run is in use) is never touched,
    nor the directory holding it."""
    give_back(run_dir)
    if made is None:
        return
    path = Path(run_dir).absolute()
    for directory in [path, *path.parents]:
        if not directory.is_dir() or any(directory.iterdir()):
            return
        directory.rmdir()
        if directory == Path(made).absolute():
            return
