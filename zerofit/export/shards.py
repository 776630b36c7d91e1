"""The exported model's safetensors shards, written tensor by tensor in blocks of whole rows:
the list of output tensors and where their elements come from, their split into shard files
as save_pretrained names them, and the writer that reads each block (fp32), applies a LoRA
merge's transform, casts it and appends it to its shard while the next block is read. Peak
RAM is two (fp32, cast) block pairs whatever the model's size; export.py sizes the blocks
under --max-ram and decides what is read."""
from __future__ import annotations

import json
import math
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from zerofit.checkpoint import zerofiles
from zerofit.core.console import ByteProgress
from zerofit.core.errors import ConfigError

BlockTransform = Callable[[int, int, torch.Tensor], torch.Tensor]


class ExportError(ConfigError):
    """An export that cannot proceed; the message says why and what to do."""


@dataclass
class OutputTensor:
    """One tensor of the exported model and where its elements come from."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    source: zerofiles.StoredTensor
    transform: BlockTransform | None = None
    """(first_row, end_row, fp32 rows shaped (rows, *shape[1:])) -> the rows to write."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:]) if self.shape else 1


@dataclass
class Shard:
    filename: str
    tensors: list[OutputTensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def plan_shards(tensors: list[OutputTensor], shard_bytes: int) -> list[Shard]:
    """Consecutive tensors per file up to `shard_bytes` (a larger tensor gets a file of its
    own); names as save_pretrained writes them."""
    shards = [Shard("")]
    for tensor in tensors:
        if shards[-1].tensors and shards[-1].nbytes + tensor.nbytes > shard_bytes:
            shards.append(Shard(""))
        shards[-1].tensors.append(tensor)
    for i, shard in enumerate(shards):
        shard.filename = "model.safetensors" if len(shards) == 1 else \
            f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    return shards


def write_model(directory: Path, shards: list[Shard], block: int, progress: bool = True) -> None:
    """Every shard, then the index (several shards) as save_pretrained writes it."""
    reader = zerofiles.TensorReader()
    buffers = BlockBuffers(block)
    try:
        with ByteProgress("export", sum(s.nbytes for s in shards), progress) as bar:
            for shard in shards:
                write_shard(directory / shard.filename, shard, reader, buffers, bar)
    finally:
        reader.close()
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(s.nbytes for s in shards),
                              "total_parameters": sum(math.prod(t.shape) for s in shards for t in s.tensors)},
                 "weight_map": {t.name: s.filename for s in shards for t in s.tensors}}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def safetensors_header(tensors: list[OutputTensor]) -> bytes:
    """The 8-byte little-endian length and the JSON header of the safetensors format
    (huggingface/safetensors, docs "Format"): offsets relative to the data, padded to 8."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for t in tensors:
        header[t.name] = {"dtype": zerofiles.SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


class BlockBuffers:
    """Two (fp32 block, cast block) pairs handed out in turn, across tensors and shards:
    block k+2 reuses block k's memory, and OverlappedWriter has finished writing block k
    before it accepts block k+1, which is before block k+2 is filled."""

    def __init__(self, elements: int):
        self.elements = elements
        self._pairs = [(torch.empty(elements, dtype=torch.float32), torch.empty(elements * 4, dtype=torch.uint8))
                       for _ in range(2)]
        self._turn = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._turn ^= 1
        return self._pairs[self._turn]


class OverlappedWriter:
    """Appends blocks to a file on a background thread, at most one in flight, so the disk
    writes while the caller reads and casts the next block (file writes release the GIL)."""

    def __init__(self, f):
        self.f, self._pending = f, None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerofit-export-writer")

    def write(self, data) -> None:
        self.wait()
        self._pending = self._pool.submit(self.f.write, data)

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown()


def write_shard(path: Path, shard: Shard, reader: zerofiles.TensorReader, buffers: BlockBuffers,
                bar: ByteProgress) -> None:
    with open(path, "wb") as f:
        writer = OverlappedWriter(f)
        try:
            writer.write(safetensors_header(shard.tensors))
            blocks = (b for tensor in shard.tensors for b in tensor_blocks(tensor, reader, buffers))
            for data in blocks:
                writer.write(data)
                bar.advance(len(data))
        finally:
            writer.close()
        f.flush()
        os.fsync(f.fileno())
        # Drop the written pages from the page cache: under a cgroup memory limit they count.
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def tensor_blocks(tensor: OutputTensor, reader: zerofiles.TensorReader, buffers: BlockBuffers):
    """One tensor's bytes in blocks of whole rows: read fp32, transform, cast."""
    numel = math.prod(tensor.shape)
    if not tensor.dtype.is_floating_point:  # integer buffers: small, copied as stored
        data = torch.empty(numel, dtype=tensor.dtype)
        reader.read(tensor.source, 0, numel, data)
        yield _bytes(data)
        return
    row = tensor.row_numel
    rows = tensor.shape[0] if tensor.shape else 1
    per_block = max(1, buffers.elements // row)
    for first in range(0, rows, per_block):
        work, cast = buffers.next()
        end = min(rows, first + per_block)
        count = (end - first) * row
        block = work[:count]
        reader.read(tensor.source, first * row, end * row, block)
        if not torch.isfinite(block).all():  # a model with NaN in it is never what anyone wants published
            where = tensor.source.pieces[0].path.parent.name if tensor.source.pieces else "the checkpoint"
            raise ExportError(f"{tensor.name} holds NaN or Inf in {where}: its bytes are "
                              f"damaged (export checks the files' hashes unless --no-hashes) or training diverged "
                              f"(see the run's loss); export an earlier checkpoint; nothing was written")
        if tensor.transform is not None:
            block = tensor.transform(first, end, block.view(end - first, *tensor.shape[1:])).reshape(-1)
        if tensor.dtype != torch.float32:
            converted = cast[:count * tensor.dtype.itemsize].view(tensor.dtype)
            converted.copy_(block)
            if tensor.dtype == torch.float16 and torch.isinf(converted).any():
                raise ExportError(f"{tensor.name} holds values beyond float16's range (+-65504); "
                                  f"export with --dtype bf16 or fp32")
            block = converted
        yield _bytes(block)


def _bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.view(torch.uint8).numpy())
