"""Read a `torch.save` file without loading its tensors: the pickled structure comes back
with every tensor replaced by a `TensorRef` (file, byte offset, dtype, shape), and
`read_into` copies exactly the bytes asked for into a buffer the caller owns.

Why not torch.load(mmap=True): its pages count in the process's RSS for as long as the
tensors live, so reading a 20 GB optimizer file that way "uses" 20 GB; and torch.load
without mmap reads all of it, Adam moments included. Here nothing is mapped and only
the fp32 master partitions an export needs are ever read.

The format (torch/serialization.py, `_save` and `_load`): an uncompressed zip archive
holding `<prefix>/data.pkl`, the pickled object whose tensors are persistent ids
('storage', storage_type, key, location, numel), and one record `<prefix>/data/<key>`
per storage with its raw little-endian bytes. Tensors are rebuilt by
torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...).

Only an allowlist of globals is resolved for real (containers, torch dtypes and sizes,
the tensor rebuild functions); every other class the pickle names (DeepSpeed's enums, its
loss scaler, anything a crafted file might smuggle in) becomes an inert `Opaque`
placeholder. So reading needs no DeepSpeed import, and unlike torch.load(weights_only=
False) no checkpoint can run code through this reader.
"""
from __future__ import annotations

import io
import math
import os
import pickle
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from zerofit.core.errors import ConfigError

# Globals resolved for real; anything else becomes an Opaque placeholder.
_SAFE_GLOBALS = {("collections", "OrderedDict"), ("collections", "defaultdict"), ("copyreg", "_reconstructor"),
                 ("_codecs", "encode"), ("torch", "Size"), ("torch", "device")} | \
    {("builtins", name) for name in ("object", "set", "frozenset", "slice", "range", "complex", "bytearray")}
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # zip local file header (APPNOTE 4.3.7), 30 bytes


class TorchFileError(ConfigError):
    """A .pt file that cannot be read as a torch.save zip archive."""


@dataclass(frozen=True)
class StorageRef:
    path: Path
    key: str
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True)
class TensorRef:
    """A tensor as stored on disk; `numel` elements from `storage_offset` (contiguous)."""
    storage: StorageRef
    storage_offset: int
    shape: tuple[int, ...]
    contiguous: bool

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class Opaque:
    """Stands in for a class the export does not need (keeps its constructor arguments
    and state, e.g. `ZeroStageEnum(3)` -> args == (3,))."""
    qualname = "?"

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.state = state

    def __repr__(self) -> str:
        return f"Opaque({self.qualname}{self.args})"


def _opaque(module: str, name: str) -> type:
    return type(name, (Opaque,), {"qualname": f"{module}.{name}"})


def _rebuild_tensor(storage, storage_offset, size, stride, *_ignored):
    expected, step = [], 1
    for dim in reversed(tuple(size)):
        expected.append(step)
        step *= dim
    contiguous = tuple(stride) == tuple(reversed(expected)) or math.prod(size) <= 1
    return TensorRef(storage, int(storage_offset), tuple(int(s) for s in size), contiguous)


def _storage_type(name: str):
    """What torch.load maps a pickled `torch.FloatStorage`-style name to (has .dtype)."""
    storage_type = getattr(torch.serialization, "StorageType", None)
    try:
        return storage_type(name) if storage_type else getattr(torch, name)
    except (KeyError, AttributeError):
        raise TorchFileError(f"unknown storage type torch.{name} in the file") from None


def _rebuild_parameter(data, *_ignored):
    return data


def _rebuild_from_type(func, _new_type, args, _state):
    # torch._tensor._rebuild_from_type_v2: a Tensor subclass or a tensor with attributes
    # (DeepSpeed's flat groups); the stored tensor is what `func(*args)` rebuilds.
    return func(*args)


class _LazyUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, path: Path):
        super().__init__(io.BytesIO(data))
        self.path = path

    def find_class(self, module: str, name: str):
        module = {"__builtin__": "builtins", "copy_reg": "copyreg"}.get(module, module)  # protocol 2 names
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor
        if module == "torch._utils" and name in ("_rebuild_parameter", "_rebuild_parameter_with_state"):
            return _rebuild_parameter
        if module in ("torch._tensor", "torch.tensor") and name == "_rebuild_from_type_v2":
            return _rebuild_from_type
        if module == "torch" and name.endswith("Storage"):
            return _storage_type(name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        return _opaque(module, name)

    def persistent_load(self, saved_id):
        kind, storage_type, key, _location, numel = saved_id
        if (kind.decode() if isinstance(kind, bytes) else kind) != "storage":
            raise TorchFileError(f"{self.path}: unknown persistent id {kind!r}")
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        return StorageRef(self.path, str(key), dtype, int(numel))


class TorchFile:
    """One torch.save archive: `load()` the structure, `offset(ref)` the file position of
    a stored tensor's first byte."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            with zipfile.ZipFile(self.path) as archive:
                members = archive.infolist()
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:  # ValueError: a damaged name's UTF-8
            raise TorchFileError(f"{self.path} is not a readable torch.save archive ({type(e).__name__}: {e}); the "
                                 f"file is damaged or truncated (its checkpoint's hashes would have caught it: "
                                 f"export without --no-hashes), or was written by torch < 1.6") from None
        pickles = [m for m in members if m.filename.endswith("/data.pkl") and m.filename.count("/") == 1]
        if not pickles:
            raise TorchFileError(f"{self.path} holds no data.pkl; it is not a torch.save file")
        self.prefix = pickles[0].filename[: -len("data.pkl")]
        self._members = {m.filename: m for m in members}
        order = self._members.get(self.prefix + "byteorder")
        if order is not None and self._read_member(order) != b"little":
            raise TorchFileError(f"{self.path} was saved big-endian; export reads little-endian files only")
        self._data_offsets: dict[str, int] = {}

    def load(self):
        import pickle

        try:
            return _LazyUnpickler(self._read_member(self._members[self.prefix + "data.pkl"]), self.path).load()
        except (pickle.UnpicklingError, EOFError, ValueError, KeyError, IndexError) as e:  # damaged bytes, said plainly
            raise TorchFileError(f"{self.path.name} cannot be read ({type(e).__name__}: {e}): the file is damaged; "
                                 f"its checkpoint's hashes (checkpoint.verify full, export's default) would have "
                                 f"caught it") from None

    def offset(self, ref: TensorRef) -> int:
        """Byte position in the file of `ref`'s first element."""
        key = ref.storage.key
        if key not in self._data_offsets:
            member = self._members.get(f"{self.prefix}data/{key}")
            if member is None:
                raise TorchFileError(f"{self.path} lacks the record of storage {key} (truncated?)")
            if member.compress_type != zipfile.ZIP_STORED:
                raise TorchFileError(f"{self.path}: storage {key} is compressed; torch.save never does that")
            self._data_offsets[key] = self._data_start(member)
        return self._data_offsets[key] + ref.storage_offset * ref.storage.dtype.itemsize

    def _data_start(self, member: zipfile.ZipInfo) -> int:
        # The central directory's extra field can differ from the local one (torch pads the
        # local header to align storages), so the data start is read from the local header.
        with open(self.path, "rb") as f:
            f.seek(member.header_offset)
            header = f.read(_LOCAL_HEADER.size)
        if len(header) < _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
            raise TorchFileError(f"{self.path}: bad zip local header for {member.filename} (corrupt file)")
        *_, name_len, extra_len = _LOCAL_HEADER.unpack(header)
        return member.header_offset + _LOCAL_HEADER.size + name_len + extra_len

    def _read_member(self, member: zipfile.ZipInfo) -> bytes:
        """A small record's bytes. torch.save stores records uncompressed; with its CRC-32
        off (zerofit's checkpoint.zip_crc32: false) the CRC field is 0, which zipfile would
        reject: checked here only when present (the manifest's hash covers the whole file)."""
        if member.compress_type != zipfile.ZIP_STORED:
            raise TorchFileError(f"{self.path}: {member.filename} is compressed; torch.save never does that")
        with open(self.path, "rb") as f:
            f.seek(self._data_start(member))
            data = f.read(member.file_size)
        if len(data) < member.file_size:
            raise TorchFileError(f"{self.path} ends inside {member.filename} (truncated)")
        if member.CRC and zlib.crc32(data) != member.CRC:
            raise TorchFileError(f"{self.path}: {member.filename} fails its CRC-32 (corrupt file)")
        return data


def read_into(fd: int, offset: int, buffer: torch.Tensor, path: Path) -> None:
    """Fill the contiguous CPU tensor `buffer` with its nbytes from the open file `fd`
    at `offset`, straight into its memory: no intermediate copy, nothing mapped."""
    view = memoryview(buffer.view(torch.uint8).numpy()).cast("B")
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise TorchFileError(f"{path} ends at byte {offset + done}, before the {len(view)} bytes "
                                 f"expected at {offset} (truncated)")
        done += got
