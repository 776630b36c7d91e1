"""DeepSpeed's just-in-time ops (cpu_adam, the CPU accelerator's shm comm, async_io) and the
lock their build leaves behind when it is killed.

torch.utils.cpp_extension builds each op under a FileBaton: it creates `BUILD_DIR/NAME/lock`
with O_CREAT|O_EXCL, keeps it open while ninja runs, and deletes it when done. A build that
is killed (Ctrl-C in the first minute of a first run, an OOM kill, a job's time limit)
leaves the file, and every later process that loads the op waits for it in
`FileBaton.wait()`, forever and without a word (torch/utils/file_baton.py). zerofit clears
such a lock before DeepSpeed starts and while it loads its ops (a build that dies while
another process waits on it leaves the same trap): a lock no process on this machine holds
open is stale at once where every process that could hold it is seen here (a local
filesystem, a lock of this user's); elsewhere (a network filesystem another node may build
on, another user's lock) only once it is older than any build.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from zerofit.core.console import say, warn

# A lock younger than this may belong to a build on another node sharing this home
# directory (its open file is invisible here); DeepSpeed's CPU ops build in 1-3 minutes.
STALE_AFTER_S = 300
SWEEP_EVERY_S = 10.0
# A lock made this soon before the scan of open files may have been opened after it began
SCAN_SLACK_S = 1.0
# Filesystems other machines may write to (/proc/mounts' type): a holder there may be elsewhere
SHARED_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs",
                      "fuse.sshfs", "fuse.glusterfs", "fuse.cephfs", "fuse.juicefs", "fuse.gcsfuse", "9p", "afs",
                      "ocfs2", "gfs2", "wekafs")


@dataclass(frozen=True)
class BuildLock:
    path: Path
    age_s: float
    held_open: bool
    holder_visible: bool = False  # any process that could hold it would be seen in this machine's /proc

    @property
    def stale(self) -> bool:
        if self.held_open:
            return False
        return self.age_s > (SCAN_SLACK_S if self.holder_visible else STALE_AFTER_S)

    def describe(self) -> str:
        minutes = self.age_s / 60
        if self.held_open:
            return f"{self.path}: a build in progress ({minutes:.0f} min old)"
        if self.holder_visible:
            return f"{self.path}: left by a build whose process is gone (no process holds it open)"
        return f"{self.path}: left by a build that stopped {minutes:.0f} min ago"


def build_root() -> Path:
    """Where torch builds extensions: TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def build_locks(root: Path | None = None) -> list[BuildLock]:
    """Every op build lock under `root` (ROOT/op/lock with TORCH_EXTENSIONS_DIR set,
    ROOT/py311_cpu/op/lock by default)."""
    root = root or build_root()
    paths = sorted({*root.glob("*/lock"), *root.glob("*/*/lock")})
    if not paths:
        return []
    scan_started = time.time()  # ages count from here: a lock made during the scan is never judged stale
    open_files = _files_open_on_this_machine()
    locks = []
    for path in paths:
        try:
            status = path.stat()
        except FileNotFoundError:  # its build just finished
            continue
        locks.append(BuildLock(path, scan_started - status.st_mtime, str(path.resolve()) in open_files,
                               holder_visible(path, status.st_uid)))
    return locks


def holder_visible(path: Path, owner_uid: int) -> bool:
    """Whether a process holding `path` open would be among those /proc shows us: the lock is on
    a filesystem no other machine writes to, and its maker was this user (or we are root)."""
    if owner_uid != os.getuid() and os.getuid() != 0:
        return False
    try:
        mounts = Path("/proc/mounts").read_text()
    except OSError:
        return False
    return filesystem_type(path.resolve(), mounts) not in (None, *SHARED_FILESYSTEMS)


def filesystem_type(path: Path, mounts: str) -> str | None:
    """The type /proc/mounts gives the mount holding `path` (the longest mount point above it)."""
    best, kind = -1, None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = Path(fields[1].replace("\\040", " "))
        if (path == point or point in path.parents) and len(point.parts) > best:
            best, kind = len(point.parts), fields[2]
    return kind


def clear_stale_build_locks(root: Path | None = None) -> list[BuildLock]:
    """Delete the stale locks under `root`; returns what was deleted, for the caller to say."""
    cleared = []
    for lock in build_locks(root):
        if lock.stale:
            try:
                lock.path.unlink()
            except FileNotFoundError:
                continue
            cleared.append(lock)
    return cleared


@contextmanager
def stale_locks_cleared(on_clear: Callable[[BuildLock], None], enabled: bool = True) -> Iterator[None]:
    """Clear stale locks now and every SWEEP_EVERY_S while the block runs. `enabled`: one
    process per machine sweeps (the node's first rank), so no two race on one lock."""
    if not enabled:
        yield
        return
    for lock in clear_stale_build_locks():
        on_clear(lock)
    done = threading.Event()

    def sweep() -> None:
        while not done.wait(SWEEP_EVERY_S):
            for lock in clear_stale_build_locks():
                on_clear(lock)

    sweeper = threading.Thread(target=sweep, name="zerofit-build-locks", daemon=True)
    sweeper.start()
    try:
        yield
    finally:
        done.set()
        sweeper.join()


@contextmanager
def ops_unblocked(ops: tuple[str, ...] = ()) -> Iterator[None]:
    """DeepSpeed's op loads (engine build, NVMe preflight, aio sweep), with build locks left
    by killed builds cleared and reported, and the first build of each op in `ops` announced
    (a first cpu_adam build is minutes of silence on a few cores)."""

    def on_clear(lock: BuildLock) -> None:
        warn(f"removed DeepSpeed's op build lock {lock.describe()} (a load would wait on it forever)")

    first_rank = int(os.environ.get("LOCAL_RANK", 0)) == 0
    unbuilt = [op for op in ops if not built(op)] if first_rank else []
    if unbuilt:
        say(f"building DeepSpeed's {', '.join(unbuilt)} op{'s' * (len(unbuilt) > 1)} (first use with this torch: "
            f"one to several minutes, more on few cores; cached under {build_root()} for every later run)")
    with stale_locks_cleared(on_clear, enabled=first_rank):
        yield


def built(op: str) -> bool:
    """Whether loading `op` finds it built: installed with DeepSpeed (DS_BUILD_OPS), or a
    just-in-time build's library under build_root() (ROOT/op or ROOT/py311_cpu/op)."""
    from deepspeed.git_version_info import installed_ops

    if installed_ops.get(op, False):
        return True
    root = build_root()
    return any(root.glob(f"{op}/{op}*.so")) or any(root.glob(f"*/{op}/{op}*.so"))


def _files_open_on_this_machine() -> set[str]:
    """Paths every readable process has open (/proc/PID/fd). Processes we may not read
    (another user's, without root) are skipped: the age rule covers them."""
    open_files = set()
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            links = list(fd_dir.iterdir())
        except OSError:
            continue
        for link in links:
            try:
                open_files.add(os.readlink(link))
            except OSError:
                continue
    return open_files
