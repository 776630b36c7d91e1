"""Files zerofit writes and reads in a run directory: durable (fsynced, renamed into place),
never through a symbolic link planted in their place, and read back without a traceback when
damaged (a damaged file reads as absent)."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from zerofit.core.errors import ZerofitError

TMP_PREFIX = ".tmp-"
STEP_DIR = re.compile(r"^step-(\d+)$")  # a published checkpoint: checkpoints/step-000200


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def step_of(path: Path) -> int:
    """The step a published directory holds; -1 for any other name."""
    match = STEP_DIR.match(path.name)
    return int(match.group(1)) if match else -1


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (new files, renames) durable: fsync(2) on the directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LinkedFileError(ZerofitError):
    """A file zerofit writes in a run directory is a symbolic link (planted to make it write elsewhere)."""


def open_unlinked(path: Path, append: bool = False):
    """`path` opened for writing text (truncated, or for appending) where it is a file of its own:
    a symbolic link in its place is refused (O_NOFOLLOW), never written through to its target."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_APPEND if append else os.O_TRUNC)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError:
        if os.path.islink(path):
            raise LinkedFileError(f"{path} is a symbolic link (to {os.readlink(path)}); zerofit writes its run files "
                                  f"only as files of their own, never through a link: remove the link") from None
        raise
    return os.fdopen(fd, "a" if append else "w", buffering=1)


def write_atomic(path: Path, text: str) -> None:
    """Write, fsync, rename over: readers see the old or the new content, never half. The
    temporary is made anew (a symbolic link planted in its place is removed, never written
    through) and the rename replaces a link at `path` itself, not what it points at."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}")
    tmp.unlink(missing_ok=True)
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644), "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):  # JSONDecodeError and UnicodeDecodeError alike: a damaged file is unread
        return None


def read_jsonl(path: Path) -> list[dict]:
    """The JSON lines of a run file (memory.jsonl, metrics.jsonl), in order; none when it is
    missing, and a torn line (the process died mid-write) skipped."""
    if not Path(path).exists():
        return []
    records = []
    for line in Path(path).read_text(errors="replace").splitlines():  # a torn write's bytes are no UTF-8
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
