"""Sequential O_DIRECT writes of a checkpoint file (checkpoint_io.CheckedFile's fast path):
the bytes go from two aligned staging buffers to the disk by DMA, bypassing the page cache,
while the caller fills the other buffer. Where the filesystem refuses O_DIRECT, `open_direct`
says so and the caller writes through the page cache."""
from __future__ import annotations

import errno
import mmap
import os
import time
from pathlib import Path

STAGE_BYTES = 64 << 20         # each of DirectWriter's two O_DIRECT staging buffers: one write per chunk
DIRECT_ALIGN = 4096            # O_DIRECT offsets and lengths: the largest common logical block size


class DirectWriter:
    """Sequential O_DIRECT writes through two aligned staging buffers: one is filled while an
    I/O thread writes the other and a hash thread hashes it (when given a digest), so copying,
    hashing and the disk overlap. The hash covers the file's bytes once each, in order: a
    partial last block that flush() writes and keeps staged is not hashed again.

    The bytes go from the buffer to the disk by DMA: no copy into the page cache and no
    kernel writeback threads competing with the training loop's CPU optimizer for cores (an
    OpenMP loop is held back by its slowest thread), so an async save stalls training far
    less than through the page cache. Large stages (64 MiB) mean fewer times this thread must
    win the GIL back from the training loop (bench/direct_writer.py; bench/results/README.md)."""

    def __init__(self, fd: int, digest=None):
        from concurrent.futures import ThreadPoolExecutor

        import numpy as np

        self._fd, self._digest = fd, digest
        self._stages = [mmap.mmap(-1, STAGE_BYTES) for _ in range(2)]
        # copies through numpy, which lets go of the GIL while it copies: the training loop's
        # thread needs it, and every time this thread waits to take it back costs up to
        # sys.getswitchinterval() (5 ms)
        self._arrays = [np.frombuffer(stage, dtype=np.uint8) for stage in self._stages]
        self._filling, self._staged, self._on_disk = 0, 0, 0
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerofit-direct-io")
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerofit-hash") if digest else None
        self._in_flight: list = []  # the futures of the stage not being filled: its write and hash
        self._hashed = 0                # bytes of the file hashed so far
        self.wait_seconds = self.hash_seconds = 0.0

    def fileno(self) -> int:
        return self._fd

    def write(self, chunk: memoryview) -> None:
        import numpy as np

        while len(chunk):
            stage = self._stages[self._filling]
            n = min(len(chunk), STAGE_BYTES - self._staged)
            np.copyto(self._arrays[self._filling][self._staged: self._staged + n], np.frombuffer(chunk[:n], dtype=np.uint8))
            self._staged, chunk = self._staged + n, chunk[n:]
            if self._staged == STAGE_BYTES:
                self._wait()
                self._in_flight = [self._io.submit(pwrite_all, self._fd, stage, STAGE_BYTES, self._on_disk)]
                if self._hasher:
                    self._in_flight.append(self._hasher.submit(self._hash_staged, stage, self._on_disk, STAGE_BYTES))
                self._filling, self._staged, self._on_disk = 1 - self._filling, 0, self._on_disk + STAGE_BYTES

    def flush(self) -> None:
        """Everything on disk (before fsync). O_DIRECT writes whole aligned blocks: a last
        partial block is written padded with zeros, the file cut back to its length, and
        the block stays staged so that later bytes rewrite it whole."""
        self._wait()
        if not self._staged:
            return
        stage, length = self._stages[self._filling], self._on_disk + self._staged
        if self._digest is not None:
            self._hash_staged(stage, self._on_disk, self._staged)
        whole = self._staged // DIRECT_ALIGN * DIRECT_ALIGN
        padded = -(-self._staged // DIRECT_ALIGN) * DIRECT_ALIGN
        stage[self._staged: padded] = bytes(padded - self._staged)
        pwrite_all(self._fd, stage, padded, self._on_disk)
        if padded == whole:
            self._staged, self._on_disk = 0, length
            return
        os.ftruncate(self._fd, length)
        tail = self._staged - whole
        stage[:tail] = stage[whole: self._staged]
        self._staged, self._on_disk = tail, self._on_disk + whole

    def close(self) -> None:
        try:
            self._wait()
        finally:
            self._io.shutdown()
            if self._hasher:
                self._hasher.shutdown()
            os.close(self._fd)
            self._arrays = []  # numpy's views first: an mmap with views cannot close
            for stage in self._stages:
                stage.close()

    def _hash_staged(self, stage, offset: int, end: int) -> None:
        """Hash stage[:end], which holds the file's bytes from `offset`, less those hashed
        already (a partial block flush() kept staged). Calls come in file order: one hash
        thread, and flush() waits for it first."""
        started = time.perf_counter()
        skip = max(0, self._hashed - offset)
        if end > skip:
            self._digest.update(memoryview(stage)[skip:end])
        self._hashed = max(self._hashed, offset + end)
        self.hash_seconds += time.perf_counter() - started

    def _wait(self) -> None:
        """Until the stage in flight is written and hashed (an error raised here)."""
        if self._in_flight:
            in_flight, self._in_flight = self._in_flight, []
            started = time.perf_counter()
            try:
                for future in in_flight:
                    future.result()
            finally:
                self.wait_seconds += time.perf_counter() - started


def pwrite_all(fd: int, buffer, nbytes: int, offset: int) -> None:
    view = memoryview(buffer)[:nbytes]
    while len(view):
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def open_direct(path: Path) -> int | None:
    """A write descriptor with O_DIRECT, or None where the filesystem refuses it (at open,
    or, on some, at the first write: one aligned block is tried and cut off again)."""
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return None
        raise
    probe = mmap.mmap(-1, DIRECT_ALIGN)
    try:
        os.pwrite(fd, probe, 0)
        os.ftruncate(fd, 0)
        return fd
    except OSError as e:
        os.close(fd)
        if e.errno == errno.EINVAL:
            return None
        raise
    finally:
        probe.close()
