"""The write path of every checkpoint file: a DeepSpeed CheckpointEngine zerofit installs.

DeepSpeed's engine.save_checkpoint hands each file's state dict to
`engine.checkpoint_engine.save(state_dict, path)` (deepspeed/runtime/checkpoint_engine/).
ZerofitCheckpointEngine writes it through CheckedFile: bytes counted and xxh3-hashed on the
way out (so the manifest needs no second read), fsynced on close, faults injected for
drills. (Starting the kernel's writeback early, posix_fadvise DONTNEED every 64 MiB, was
measured and removed: it made no difference to durable throughput.) An error is recorded, not raised:
DeepSpeed's save has barriers after the writes, and a rank that raised out of it would
leave the others waiting; the Checkpointer agrees on the outcome across ranks afterwards.

Async (checkpoint.async_save) follows the contract of DeepSpeed's DecoupledCheckpointEngine:
the engine says it is decoupled, save() only queues, and DeepSpeed itself calls commit()
at the next optimizer-step boundary (engine.step -> _commit_decoupled_checkpoint), before
the optimizer changes any state. `launch()` (after save_checkpoint) hands the queued files
to a writer thread, which first copies the large tensors into a reused host buffer (the
snapshot) and then serializes and writes them; commit() waits only for the snapshot,
never for the disk. The Checkpointer publishes the tag once every rank's writer is done.
"""
from __future__ import annotations

import contextlib
import copy
import errno
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from zerofit.checkpoint.directio import DirectWriter, open_direct
from zerofit.checkpoint.files import HASH, load_torch_file
from zerofit.core import faults

SMALL_TENSOR_BYTES = 64 << 10  # copied at once in save(); larger ones go through the arena
FAULT_AFTER_BYTES = 64 << 10   # injected ENOSPC / kill strike once a save wrote this much
ALIGN = 64
CHUNK_BYTES = 64 << 20         # hash and write a record in pieces of this size


class CheckedFile:
    """A file being written: counted, hashed, fsynced on close, failing on an injected fault.
    direct=True writes it through a DirectWriter where the filesystem takes O_DIRECT, else
    through the page cache."""

    def __init__(self, path: Path, fault: str | None, written_before: int, direct: bool = False):
        import xxhash

        self.path, self.fault, self.bytes, self.error = path, fault, 0, None
        # seconds spent here, by part; the rest of a torch.save is its pickling and CRC
        self.seconds = {"hash": 0.0, "stage": 0.0, "disk_wait": 0.0, "fsync": 0.0}
        self._before = written_before
        self._digest = xxhash.xxh3_128()
        fd = open_direct(path) if direct else None
        self.direct = fd is not None
        # O_DIRECT: the writer hashes its staged buffers on a thread of their own
        self._file = DirectWriter(fd, self._digest) if self.direct else open(path, "wb", buffering=1 << 20)

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if self.fault and self._before + self.bytes + len(view) > FAULT_AFTER_BYTES:
            self._strike(view)
        for start in range(0, len(view), CHUNK_BYTES):  # chunks: the GIL is free between them
            chunk = view[start: start + CHUNK_BYTES]
            if not self.direct:  # (DirectWriter hashes on its own thread)
                started = time.perf_counter()
                self._digest.update(chunk)
                self.seconds["hash"] += time.perf_counter() - started
            started = time.perf_counter()
            self._file.write(chunk)
            self.seconds["stage"] += time.perf_counter() - started
        self.bytes += len(view)
        return len(view)

    def _strike(self, view: memoryview) -> None:
        upto = max(0, FAULT_AFTER_BYTES - self._before - self.bytes)
        self._file.write(view[:upto])
        self._file.flush()
        if self.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        self.error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        raise self.error

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        try:
            if self.error is None:
                started = time.perf_counter()
                self._file.flush()
                os.fsync(self._file.fileno())
                self.seconds["fsync"] += time.perf_counter() - started
        finally:
            self._file.close()
            if self.direct:  # its stages' waits for the disk and the hash (inside "stage"), the hash thread's time
                self.seconds["disk_wait"] += self._file.wait_seconds
                self.seconds["hash"] += self._file.hash_seconds

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


class HostArena:
    """One host buffer the async snapshots copy into, reused by every save: a fresh
    allocation faults its pages in at ~0.7 GB/s on the CI machine while a copy into warm
    pages runs at ~25 GB/s, so the pages are faulted once (`reserve`, in the background
    at start) and the host RAM held is bounded by `max_bytes`."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._buffer = None
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return 0 if self._buffer is None else len(self._buffer)

    def reserve(self, nbytes: int) -> bool:
        """Hold at least nbytes (touched, so the copies find warm pages); False over budget."""
        import numpy as np

        with self._lock:
            if nbytes > self.max_bytes:
                return False
            if self.capacity < nbytes:
                self._buffer = None  # release the old one first: the budget holds one buffer
                buffer = np.empty(nbytes, dtype=np.uint8)
                buffer[::4096] = 0  # fault every page in now, not during a snapshot
                self._buffer = buffer
            return True

    def views(self, sizes: list[int]) -> list[memoryview]:
        """Disjoint aligned views of the buffer; each becomes its own tensor storage, so
        torch.save writes only its bytes."""
        if not sizes:
            return []
        whole, offset, out = memoryview(self._buffer), 0, []
        for size in sizes:
            out.append(whole[offset: offset + size])
            offset += -(-size // ALIGN) * ALIGN
        return out


def arena_bytes(sizes: list[int]) -> int:
    return sum(-(-s // ALIGN) * ALIGN for s in sizes)


@dataclass
class _Slot:
    index: int


@dataclass
class _File:
    """One queued file: its structure with large tensors replaced by slots."""
    path: Path
    skeleton: object
    sources: list = field(default_factory=list)


def _detach(obj, sources: list, memo: dict):
    """obj with large tensors replaced by _Slot(i) (sources[i] is the live tensor), small
    tensors copied to host now, containers rebuilt and other objects deep-copied, so the
    structure no longer changes when training goes on. Shared storage stays shared."""
    import torch

    if isinstance(obj, torch.Tensor):
        key = (obj.untyped_storage().data_ptr(), obj.storage_offset(), tuple(obj.shape), tuple(obj.stride()),
               obj.dtype, obj.device)
        if key in memo:
            return memo[key]
        if obj.nbytes < SMALL_TENSOR_BYTES:
            out = _like(obj, obj.detach().to("cpu", copy=True))
        else:
            sources.append(obj)
            out = _Slot(len(sources) - 1)
        memo[key] = out
        return out
    if isinstance(obj, dict):
        rebuilt = copy.copy(obj)  # keeps the type (OrderedDict, ...)
        for k, v in obj.items():
            rebuilt[k] = _detach(v, sources, memo)
        return rebuilt
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_detach(v, sources, memo) for v in obj)
    return copy.deepcopy(obj)


def _fill(obj, tensors: list):
    if isinstance(obj, _Slot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        rebuilt = copy.copy(obj)
        for k, v in obj.items():
            rebuilt[k] = _fill(v, tensors)
        return rebuilt
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_fill(v, tensors) for v in obj)
    return obj


def _like(source, tensor):
    import torch

    if isinstance(source, torch.nn.Parameter):
        return torch.nn.Parameter(tensor, requires_grad=source.requires_grad)
    return tensor


class ZerofitCheckpointEngine(CheckpointEngine):
    """Installed as `ds_engine.checkpoint_engine` (see install); sync or async."""

    def __init__(self, zipfile_serialization: bool, async_save: bool, host_max_bytes: int, direct_io: bool = False,
                 zip_crc32: bool = False):
        super().__init__()
        self.direct_io, self.zip_crc32 = direct_io, zip_crc32
        self.name = "ZerofitCheckpointEngine"
        self.zipfile_serialization, self.async_save = zipfile_serialization, async_save
        self.arena = HostArena(host_max_bytes)
        self.commit_info: CheckpointCommitInfo | None = None
        self.tag_dir: Path | None = None
        self.written: dict[str, dict] = {}
        self.error: str | None = None
        self.fallback_reason: str | None = None
        self.snapshot_seconds = self.write_seconds = self.commit_wait_seconds = 0.0
        self.write_parts: dict[str, float] = {}  # where write_seconds went (CheckedFile.seconds, summed)
        self._queued: list[_File] = []
        self._fault: str | None = None
        self._slow = False
        self._snapshot_done = threading.Event()
        self._written_done = threading.Event()
        self._snapshot_done.set()
        self._written_done.set()
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------- DeepSpeed's contract
    def create(self, info: CheckpointCommitInfo) -> None:
        self.wait()  # at most one checkpoint in flight
        n = faults.count("save")
        self._fault = "enospc" if faults.armed("enospc", "save", n) else \
            "kill" if faults.armed("kill", "save", n) else None
        self._slow = faults.armed("slow", "save", n)
        self.commit_info, self.tag_dir = info, Path(info.save_dir) / info.tag
        self.written, self.error, self.fallback_reason = {}, None, None
        self.snapshot_seconds = self.write_seconds = self.commit_wait_seconds = 0.0
        self.write_parts = {}

    def makedirs(self, path, exist_ok=False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict, path: str) -> None:
        if self.error:
            return  # this checkpoint already failed; the rest is not worth writing
        if not self.async_save:
            self._write(state_dict, Path(path))
            return
        sources: list = []
        try:
            skeleton = _detach(state_dict, sources, {})
        except Exception as e:  # noqa: BLE001 - recorded like a write error
            self.error = f"copying the state of {Path(path).name}: {type(e).__name__}: {e}"
            return
        self._queued.append(_File(Path(path), skeleton, sources))

    def load(self, path: str, map_location=None):
        """DeepSpeed's reads of a checkpoint: tensors, plain containers and its few classes only
        (checkpoint.load_torch_file): a file carrying other pickled objects is refused, not run."""

        return load_torch_file(path, map_location)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Async: called by DeepSpeed before the next optimizer step changes the state:
        wait until the snapshot holds its own copy (not until it is on disk)."""
        started = time.perf_counter()
        self._snapshot_done.wait()
        self.commit_wait_seconds = time.perf_counter() - started
        self.commit_info = None
        return True

    def is_decoupled(self) -> bool:
        return self.async_save

    def get_commit_info(self):
        return self.commit_info if self.async_save else None

    def cleanup(self) -> None:
        self.wait()

    # ------------------------------------------------------------------ async
    def snapshot_fits(self) -> bool:
        """Whether the queued files' snapshot fits the host RAM budget (reserving it if so)."""
        needed = arena_bytes([t.nbytes for f in self._queued for t in f.sources])
        try:
            if self.arena.reserve(needed):
                return True
            problem = f"over checkpoint.async_host_max_gib={self.arena.max_bytes / 2**30:.2f}"
        except MemoryError:
            problem = "the allocation failed"
        self.fallback_reason = f"the snapshot needs {needed / 2**30:.2f} GiB of host RAM, {problem}"
        return False

    def launch(self, background: bool) -> None:
        """Every file of the checkpoint is queued: start the snapshot and the writes in the
        writer thread, or (background=False: sync mode, or no room for a snapshot) write
        them here and now from the live tensors."""
        if not self.async_save:
            return
        files, self._queued = self._queued, []
        if self.error:
            return
        if not background:
            for f in files:
                self._write(_fill(f.skeleton, f.sources), f.path)
            return
        sizes = [t.nbytes for f in files for t in f.sources]
        event = None
        if any(t.is_cuda for f in files for t in f.sources):
            import torch

            event = torch.cuda.Event()
            event.record()  # the copies wait for the work that produced the values
        self._snapshot_done.clear()
        self._written_done.clear()
        self._start_thread()
        self._jobs.put((files, sizes, event))

    def wait(self) -> None:
        """Until the checkpoint in flight (if any) is on disk or failed."""
        self._written_done.wait()

    @property
    def writing(self) -> bool:
        return not self._written_done.is_set()

    def _start_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            # daemon: a crash of the training process must not wait for a write that
            # would never be published; the `.tmp-` it leaves is removed at the next start
            self._thread = threading.Thread(target=self._writer, name="zerofit-checkpoint-writer", daemon=True)
            self._thread.start()

    def _writer(self) -> None:
        while True:
            files, sizes, event = self._jobs.get()
            started = time.perf_counter()
            try:
                tensors = self._snapshot(files, sizes, event)
            except Exception as e:  # noqa: BLE001 - any failure fails this checkpoint, not the run
                self.error = f"snapshot to host memory failed: {type(e).__name__}: {e}"
                tensors = None
            finally:
                self.snapshot_seconds = time.perf_counter() - started
                self._snapshot_done.set()
            if tensors is not None:
                if self._slow:
                    time.sleep(2)
                for f in files:
                    self._write(_fill(f.skeleton, tensors[f.path]), f.path)
            self.write_seconds = time.perf_counter() - started - self.snapshot_seconds
            self._written_done.set()

    def _snapshot(self, files: list[_File], sizes: list[int], event) -> dict:
        import torch

        views = iter(self.arena.views(sizes))
        stream = torch.cuda.Stream() if event is not None else None
        out = {}
        for f in files:
            copies = []
            for source in f.sources:
                target = torch.frombuffer(next(views), dtype=torch.uint8) if source.nbytes else \
                    torch.empty(0, dtype=torch.uint8)
                target = target.view(source.dtype).view(source.shape)
                if source.is_cuda:
                    with torch.cuda.stream(stream):
                        stream.wait_event(event)
                        target.copy_(source.detach())
                else:
                    target.copy_(source.detach())
                copies.append(_like(source, target))
            out[f.path] = copies
        if stream is not None:
            stream.synchronize()
        return out

    # ------------------------------------------------------------------ writing
    def _write(self, state_dict, path: Path) -> None:
        import torch

        if self.error:
            return
        checked = None
        try:
            checked = CheckedFile(path, self._fault, sum(e["bytes"] for e in self.written.values()), self.direct_io)
            with zip_crc32(self.zip_crc32):
                torch.save(state_dict, checked, _use_new_zipfile_serialization=self.zipfile_serialization)
            checked.close()
            for part, seconds in checked.seconds.items():
                self.write_parts[part] = self.write_parts.get(part, 0.0) + seconds
            self.written[str(path.relative_to(self.tag_dir))] = {"bytes": checked.bytes, HASH: checked.hexdigest()}
        except Exception as e:  # noqa: BLE001 - recorded; the Checkpointer decides across ranks
            if checked is not None:
                checked.close()
            cause = checked.error if checked is not None and checked.error else e
            self.error = f"writing {path.name}: {cause}"


@contextlib.contextmanager
def zip_crc32(compute: bool):
    """torch.save's zip CRC-32 on or off for the saves inside (a process-wide torch
    setting, restored after; zerofit has at most one save in flight)."""
    from torch.serialization import set_crc32_options
    from torch.utils.serialization import config

    before = config.save.compute_crc32
    set_crc32_options(compute)
    try:
        yield
    finally:
        set_crc32_options(before)


def install(ds_engine, async_save: bool, host_max_bytes: int, direct_io: bool = False,
            zip_crc32: bool = False) -> ZerofitCheckpointEngine:
    """Replace the engine's checkpoint engine (built in DeepSpeedEngine._configure_checkpointing)
    with zerofit's, keeping DeepSpeed's configured serialization format."""
    from deepspeed.runtime.model_checkpointing.constants import CHECKPOINT_SERIALIZATION

    zipfile = ds_engine._config.checkpoint_config.get(CHECKPOINT_SERIALIZATION, True)
    engine = ZerofitCheckpointEngine(zipfile, async_save, host_max_bytes, direct_io, zip_crc32)
    ds_engine.checkpoint_engine = engine
    return engine
