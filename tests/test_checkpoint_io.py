"""The checkpoint write path (checkpoint_io.py, directio.py, torchfile.py): bytes, hashes, O_DIRECT, CRC-32."""
import os

import pytest

from zerofit.checkpoint import files as checkpoint
from zerofit.core import faults


def test_injected_enospc_and_the_snapshot_arena(tmp_path, monkeypatch):
    import torch

    from zerofit.checkpoint import writer

    arena = writer.HostArena(max_bytes=1 << 20)
    assert not arena.reserve(2 << 20)  # over budget: refused, nothing held
    assert arena.reserve(1 << 16) and arena.capacity == 1 << 16
    first, second = arena.views([4000, 8000])
    tensor = torch.frombuffer(second, dtype=torch.uint8).view(torch.float32)
    tensor.copy_(torch.arange(2000, dtype=torch.float32))
    path = tmp_path / "one.pt"
    torch.save({"t": tensor}, path)
    assert path.stat().st_size < 4000 + 8000  # its own bytes, not the whole arena
    assert torch.equal(torch.load(path)["t"], torch.arange(2000, dtype=torch.float32))

    monkeypatch.setenv(faults.VARIABLE, f"enospc@save:{faults.tick('save')}")
    engine = writer.ZerofitCheckpointEngine(True, async_save=False, host_max_bytes=1 << 20)
    engine.create(writer.CheckpointCommitInfo(tag="t", save_dir=str(tmp_path), save_latest=False))
    (tmp_path / "t").mkdir()
    engine.save({"x": torch.zeros(100_000)}, str(tmp_path / "t" / "x.pt"))
    assert "No space left on device" in engine.error and "x.pt" in engine.error
    assert (tmp_path / "t" / "x.pt").stat().st_size == writer.FAULT_AFTER_BYTES  # half written
    engine.save({"y": torch.zeros(10)}, str(tmp_path / "t" / "y.pt"))
    assert not (tmp_path / "t" / "y.pt").exists()  # a failed checkpoint writes nothing more


@pytest.mark.parametrize("direct", [True, False])
def test_checked_file_writes_every_byte(tmp_path, monkeypatch, direct):
    """Odd sizes across the staging buffer, a flush mid-stream (a partial O_DIRECT block
    written padded, then rewritten whole), torch.save through it, an injected ENOSPC: the
    bytes on disk are the bytes given, the hash is theirs."""
    import numpy as np
    import torch
    import xxhash

    from zerofit.checkpoint import directio, writer

    monkeypatch.setattr(directio, "STAGE_BYTES", 64 << 10)
    pieces = [np.random.default_rng(i).integers(0, 255, size=n, dtype=np.uint8).tobytes()
              for i, n in enumerate([1, 4095, (64 << 10) + 3, 10_000, 5])]
    checked = writer.CheckedFile(tmp_path / "f.bin", None, 0, direct=direct)
    for i, piece in enumerate(pieces):
        checked.write(piece)
        if i in (1, 3):  # partial blocks kept staged: rewritten whole later, hashed once
            checked.flush()
    checked.close()
    content = b"".join(pieces)
    assert (tmp_path / "f.bin").read_bytes() == content
    assert checked.bytes == len(content) and checked.hexdigest() == xxhash.xxh3_128(content).hexdigest()

    state = {"w": torch.randn(3000), "step": 7}
    saved = writer.CheckedFile(tmp_path / "s.pt", None, 0, direct=direct)
    torch.save(state, saved)
    saved.close()
    loaded = torch.load(tmp_path / "s.pt", weights_only=False)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 7

    failing = writer.CheckedFile(tmp_path / "e.bin", "enospc", 0, direct=direct)
    with pytest.raises(OSError, match="No space left"):
        failing.write(bytes(writer.FAULT_AFTER_BYTES + 100))
    failing.close()
    assert (tmp_path / "e.bin").stat().st_size == writer.FAULT_AFTER_BYTES
    if direct and not checked.direct:
        pytest.skip(f"O_DIRECT refused on {tmp_path}: written through the page cache (checked above)")
    assert checked.direct is direct


@pytest.mark.parametrize("crc", [True, False])
def test_zip_crc32_on_or_off_the_file_loads_and_its_hash_holds(tmp_path, crc):
    """checkpoint.zip_crc32: the records carry their CRC-32 or zero; torch.load reads both,
    the manifest's xxh3 hash is the file's, and the process-wide torch setting is restored."""
    import zipfile
    import zlib

    import torch
    from torch.utils.serialization import config as torch_serialization

    from zerofit.checkpoint import writer

    before = torch_serialization.save.compute_crc32
    engine = writer.ZerofitCheckpointEngine(True, async_save=False, host_max_bytes=1 << 20, zip_crc32=crc)
    engine.create(writer.CheckpointCommitInfo(tag="t", save_dir=str(tmp_path), save_latest=False))
    (tmp_path / "t").mkdir()
    state = {"w": torch.randn(5000), "step": 3}
    engine.save(state, str(tmp_path / "t" / "s.pt"))
    assert engine.error is None and torch_serialization.save.compute_crc32 == before
    path = tmp_path / "t" / "s.pt"
    loaded = torch.load(path, weights_only=False)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3
    assert engine.written["s.pt"][checkpoint.HASH] == checkpoint.file_hash(path)
    with zipfile.ZipFile(path) as archive:
        record = next(i for i in archive.infolist() if i.filename.endswith("data/0"))
        stored = record.CRC
        raw = archive.open(record) if crc else None
        if raw is not None:
            assert zlib.crc32(raw.read()) == stored
    assert (stored != 0) is crc
    assert set(engine.write_parts) >= {"hash", "stage", "fsync"}
    # export's lazy reader (zerofit/checkpoint/torchfile.py) reads the records either way
    from zerofit.checkpoint import torchfile

    archive = torchfile.TorchFile(path)
    lazy = archive.load()
    assert lazy["step"] == 3 and lazy["w"].shape == (5000,)
    values = torch.empty(5000)
    with open(path, "rb") as f:
        torchfile.read_into(f.fileno(), archive.offset(lazy["w"]), values, path)
    assert torch.equal(values, state["w"])
    if crc:  # a stored CRC is still checked
        pickle_record = archive._members[archive.prefix + "data.pkl"]
        start = archive._data_start(pickle_record)
        with open(path, "r+b") as f:
            f.seek(start + 2)
            byte = f.read(1)
            f.seek(start + 2)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(torchfile.TorchFileError, match="CRC-32"):
            torchfile.TorchFile(path).load()
    # a flipped byte in the archive's directory (a member's UTF-8 name): said, not a UnicodeDecodeError
    raw = path.read_bytes()
    name_at = raw.rindex(b"data.pkl")
    path.write_bytes(raw[:name_at] + b"\xff" + raw[name_at + 1:])
    with pytest.raises(torchfile.TorchFileError, match="damaged or truncated"):
        torchfile.TorchFile(path)


def test_direct_writer_hashes_every_byte_once_across_random_writes_and_flushes(tmp_path, monkeypatch):
    """The hash thread sees each stage once; bytes that flush() kept staged are not hashed
    twice: random piece sizes (within and across 64 KiB stages) and random flushes."""
    import random as rng_module

    import xxhash

    from zerofit.checkpoint import directio, writer

    monkeypatch.setattr(directio, "STAGE_BYTES", 64 << 10)
    rng = rng_module.Random(7)
    for trial in range(5):
        content = bytearray()
        checked = writer.CheckedFile(tmp_path / f"r{trial}.bin", None, 0, direct=True)
        for _ in range(40):
            piece = rng.randbytes(rng.choice([1, 7, 4096, 5000, 65536, 70000, 200_000]))
            checked.write(piece)
            content += piece
            if rng.random() < 0.3:
                checked.flush()
        checked.close()
        assert (tmp_path / f"r{trial}.bin").read_bytes() == bytes(content)
        assert checked.hexdigest() == xxhash.xxh3_128(bytes(content)).hexdigest()
    if not checked.direct:
        pytest.skip(f"O_DIRECT refused on {tmp_path}: written through the page cache (checked above)")


def test_checked_file_falls_back_where_o_direct_is_refused(tmp_path, monkeypatch):
    """A filesystem that refuses O_DIRECT (EINVAL at open, as NFS or an older tmpfs do):
    the file is written through the page cache, whole."""
    import errno

    from zerofit.checkpoint import writer

    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    checked = writer.CheckedFile(tmp_path / "f.bin", None, 0, direct=True)
    checked.write(b"x" * 5000)
    checked.close()
    assert not checked.direct and (tmp_path / "f.bin").read_bytes() == b"x" * 5000
