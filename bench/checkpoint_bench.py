"""Checkpoint bench: DeepSpeed's synchronous engine.save_checkpoint vs zerofit's async save,
side by side in one run, on one model, against the disk's own sequential write speed.

GPU machine (~5 min; writes $OUT/checkpoint.json):
    source .whl/prelude.sh || exit; python bench/checkpoint_bench.py
CPU smoke test of the same code path with the tiny model (< 1 min):
    python bench/checkpoint_bench.py --smoke

Measured (issue 4 targets: async stall <= 20% of the sync save, write >= 70% of the disk):
- disk_write_gbps: one file written sequentially from memory in 64 MiB pieces, then fsync,
  through the page cache and with O_DIRECT: the faster of the two (both in disk_write_modes).
- sync_save_seconds: stock `engine.save_checkpoint` (DeepSpeed's TorchCheckpointEngine), as a
  training loop would call it; sync_durable_seconds adds the os.sync() that makes it durable.
- async saves through zerofit.train.checkpointer (the path `zerofit train` takes), training on:
  async_stall_seconds = the training time lost per save = wall time from the save call to
  its publish minus the steady step time of the steps run meanwhile (it includes the save
  call, the snapshot wait at the next optimizer step, contention and the publish);
  write_gbps = checkpoint bytes / the writer's write phase (after the snapshot), and where
  that phase went (write_parts: xxh3 hash, copies into the O_DIRECT stages and the waits
  for the disk, fsync; the rest is torch.save's pickling and zip CRC-32).
  The async saves run with torch.save's zip CRC-32 on and then off (checkpoint.zip_crc32);
  the headline figures are those of zerofit's default.
Checkpoints are deleted between measurements (the disk holds ~3 of them).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU: the same code path in seconds")
    parser.add_argument("--preset", default="llama-1.5b")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--saves", type=int, default=2, help="async saves measured in each zip CRC mode")
    parser.add_argument("--crc-modes", default="true,false",
                        help="torch.save's zip CRC-32 in the async saves, in order")
    parser.add_argument("--dir", default="/tmp/zerofit-checkpoint-bench", help="where checkpoints go (the disk measured)")
    parser.add_argument("--out", default=None, help="result directory (default $OUT, else bench/results)")
    args = parser.parse_args()
    if args.smoke:
        args.preset, args.seq_len, args.micro_batch = "tiny", 64, 2
    return args


def bench_config(args, run_dir: Path):
    from zerofit.config.load import validate

    return validate({
        "run_dir": str(run_dir),
        "model": {"config": args.preset, "gradient_checkpointing": True},
        "data": {"path": "synthetic", "synthetic_samples": 512, "eval_fraction": 0.0},
        "train": {"seq_len": args.seq_len, "micro_batch_size": args.micro_batch, "max_steps": 10**6,
                  "lr": 1e-5, "precision": "bf16"},
        "zero": {"stage": 3, "offload_optimizer": "cpu"},
        "checkpoint": {"async_save": True, "keep_last": 1, "on_error": "stop"},
        "log": {"progress": False},
    })


def disk_write_gbps(directory: Path, nbytes: int) -> dict[str, float]:
    """Sequential write of nbytes from memory in 64 MiB pieces, fsync included, through the
    page cache and with O_DIRECT (where the filesystem takes it): GB/s of each."""
    import mmap

    piece = mmap.mmap(-1, 64 << 20)  # page-aligned, as O_DIRECT needs
    piece[:] = os.urandom(1 << 20) * 64
    rates = {}
    for mode, flags in (("buffered", 0), ("direct", getattr(os, "O_DIRECT", 0))):
        if mode == "direct" and not flags:
            continue
        path = directory / f"disk-probe-{mode}.bin"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o644)
        except OSError:
            continue  # O_DIRECT refused here
        started = time.perf_counter()
        for _ in range(max(1, nbytes // len(piece))):
            os.write(fd, piece)
        os.fsync(fd)
        seconds = time.perf_counter() - started
        os.close(fd)
        rates[mode] = path.stat().st_size / 1e9 / seconds
        path.unlink()
    return rates


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> int:
    args = parse_args()
    out_dir = Path(args.out or os.environ.get("OUT") or (tempfile.mkdtemp() if args.smoke else "bench/results"))
    work = Path(args.dir) if not args.smoke else Path(tempfile.mkdtemp(prefix="zerofit-ckpt-smoke-"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)

    from zerofit import models
    from zerofit.checkpoint import files as checkpoint
    from zerofit.core import timeline as memory
    from zerofit.data import pipeline as data
    from zerofit.machine import procenv
    from zerofit.plan import deepspeed
    from zerofit.train import checkpointer, engine, ranks
    from zerofit.train.loop import train_step
    from zerofit.train.setup import fresh_state

    config = bench_config(args, work / "run")
    procenv.apply_cpu_threads(config)  # what train() does: the writer's core is kept free of CPU-Adam
    dist = ranks.init_distributed()
    import torch

    hf_config = models.hf_config(config.model)
    ds_config = deepspeed.build(config, dist.world_size, dist.on_gpu)
    init_started = time.perf_counter()
    ds_engine = engine.build_engine(engine.build_model(config, ds_config), config, ds_config, 10**6)
    init_seconds = time.perf_counter() - init_started
    sequences = data.synthetic_sequences(512, args.seq_len, hf_config.vocab_size, seed=0)
    batches = data.Batches(sequences, args.micro_batch, dist.rank, dist.world_size, seed=0)
    Path(config.run_dir).mkdir(parents=True, exist_ok=True)
    timeline = memory.Timeline(Path(config.run_dir), dist.rank, dist.on_gpu)
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in ds_engine.module.parameters())

    steps_done = 0

    def step() -> float:
        nonlocal steps_done
        steps_done += 1
        started = time.perf_counter()
        train_step(ds_engine, batches, 1, timeline, dist, steps_done)
        if dist.on_gpu:
            torch.cuda.synchronize()
        return time.perf_counter() - started

    for _ in range(2):
        step()
    steady = statistics.median(step() for _ in range(3))
    print(f"{args.preset}: {n_params / 1e9:.2f}B parameters, steady step {steady:.2f} s", flush=True)

    # --- disk, then the stock synchronous save
    predicted = checkpoint.checkpoint_bytes(n_params, 3)
    disk_modes = disk_write_gbps(work, min(4 * 10**9, max(64 << 20, predicted // 2)))
    disk_gbps = max(disk_modes.values())
    print(f"disk sequential write {disk_gbps:.2f} GB/s", flush=True)
    sync_dir = work / "sync"
    started = time.perf_counter()
    ds_engine.save_checkpoint(str(sync_dir), tag="stock", save_latest=False)
    sync_seconds = time.perf_counter() - started
    os.sync()
    sync_durable = time.perf_counter() - started
    sync_bytes = dir_bytes(sync_dir / "stock")
    shutil.rmtree(sync_dir)
    print(f"sync save {sync_bytes / 1e9:.2f} GB in {sync_seconds:.1f} s ({sync_durable:.1f} s with sync)", flush=True)

    # --- zerofit's async save, training on
    saver = checkpointer.Checkpointer(ds_engine, config, dist, timeline)
    started = time.perf_counter()
    saver.io.arena.reserve(0)  # waits for the start-up prewarm (in a run it overlaps the first steps)
    prewarm_seconds = time.perf_counter() - started
    state = fresh_state(config, dist)
    saves = []
    crc_modes = [mode == "true" for mode in args.crc_modes.split(",")]
    for crc in crc_modes:
        saver.io.zip_crc32 = crc
        for _ in range(args.saves):
            state.step += 1
            started = time.perf_counter()
            saver.save(state)
            call_seconds = time.perf_counter() - started
            steps = 0
            while saver.in_flight:
                step()
                steps += 1
                state.step += 1
                poll_started = time.perf_counter()
                saver.poll(state.step)
                publish_seconds = time.perf_counter() - poll_started
            window = time.perf_counter() - started
            published = checkpoint.published(saver.root)[0]
            total = dir_bytes(published)
            saves.append({"zip_crc32": crc, "checkpoint_bytes": total, "window_seconds": round(window, 3),
                          "steps_during": steps, "save_call_seconds": round(call_seconds, 3),
                          "commit_wait_seconds": round(saver.io.commit_wait_seconds, 3),
                          "publish_seconds": round(publish_seconds, 3),
                          "snapshot_seconds": round(saver.io.snapshot_seconds, 3),
                          "write_seconds": round(saver.io.write_seconds, 3),
                          "write_parts": {k: round(v, 3) for k, v in saver.io.write_parts.items()},
                          "write_gbps": round(total / 1e9 / saver.io.write_seconds, 3),
                          "stall_seconds": round(max(0.0, window - steps * steady), 3)})
            print(f"async save {len(saves)}: {saves[-1]}", flush=True)
            shutil.rmtree(published)
    saver.close(state.step)

    def mean_of(key: str, crc: bool) -> float:
        return statistics.mean(s[key] for s in saves if s["zip_crc32"] == crc)

    default_crc = config.checkpoint.zip_crc32 if config.checkpoint.zip_crc32 in crc_modes else crc_modes[0]
    stall, write_gbps = mean_of("stall_seconds", default_crc), mean_of("write_gbps", default_crc)
    result = {
        "command": "python " + " ".join(sys.argv),
        "device": torch.cuda.get_device_name() if dist.on_gpu else "cpu",
        "preset": args.preset, "parameters": n_params, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
        "checkpoint_bytes": sync_bytes, "checkpoint_gib": round(sync_bytes / 2**30, 2),
        "engine_init_seconds": round(init_seconds, 1), "steady_step_seconds": round(steady, 3),
        "disk_write_gbps": round(disk_gbps, 3),
        "disk_write_modes": {mode: round(rate, 3) for mode, rate in disk_modes.items()},
        "direct_io": config.checkpoint.direct_io,
        "sync_save_seconds": round(sync_seconds, 3), "sync_durable_seconds": round(sync_durable, 3),
        "sync_write_gbps": round(sync_bytes / 1e9 / sync_seconds, 3),
        "async_host_buffer_bytes": saver.io.arena.capacity, "async_host_prewarm_seconds": round(prewarm_seconds, 3),
        "zip_crc32": default_crc,
        "async_stall_seconds": round(stall, 3), "write_gbps": round(write_gbps, 3), "async_saves": saves,
        "by_zip_crc32": {str(crc).lower(): {"async_stall_seconds": round(mean_of("stall_seconds", crc), 3),
                                            "write_gbps": round(mean_of("write_gbps", crc), 3)}
                         for crc in crc_modes},
        "stall_vs_sync": round(stall / sync_seconds, 3), "write_vs_disk": round(write_gbps / disk_gbps, 3),
        "targets": {"stall_vs_sync_max": 0.2, "write_vs_disk_min": 0.7},
    }
    result["meets_targets"] = result["stall_vs_sync"] <= 0.2 and result["write_vs_disk"] >= 0.7
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "checkpoint.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "async_saves"}, indent=1))
    print(f"-> {out_dir / 'checkpoint.json'}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
