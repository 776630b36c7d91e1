"""Checkpoint file writer: through the page cache vs O_DIRECT (zerofit.checkpoint.writer's
DirectWriter, two staging buffers, one written while the other fills), with a thread beside
it that keeps taking the GIL the way a training loop does (small torch ops), as during an
async save.

    python bench/direct_writer.py [--dir /tmp] [--gib 2] [--repeats 2]   # writes $OUT/direct_writer.json

Per case: GB/s of torch.save of one tensor through CheckedFile until durable (fsync), and
the busy thread's microseconds per op meanwhile (its slowdown is what the training loop
would feel). Cases alternate, `--repeats` rounds; medians reported.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = {"buffered": (False, None), "direct_8MiB_stages": (True, 8 << 20), "direct_64MiB_stages": (True, 64 << 20)}


def one(path: Path, tensor, direct: bool, stage_bytes: int | None) -> dict:
    import torch

    from zerofit.checkpoint import directio
    from zerofit.checkpoint import writer as checkpoint_io

    if stage_bytes:
        directio.STAGE_BYTES = stage_bytes
    busy, done, result = torch.zeros(16), threading.Event(), {}

    def write() -> None:
        started = time.perf_counter()
        checked = checkpoint_io.CheckedFile(path, None, 0, direct=direct)
        torch.save({"t": tensor}, checked)
        checked.close()
        result["gb_per_s"] = tensor.nbytes / 1e9 / (time.perf_counter() - started)
        result["direct"] = checked.direct
        done.set()

    writer = threading.Thread(target=write)
    writer.start()
    ops, started = 0, time.perf_counter()
    while not done.is_set():
        busy.add_(1)
        ops += 1
    result["busy_us_per_op"] = (time.perf_counter() - started) / max(ops, 1) * 1e6
    writer.join()
    path.unlink()
    return result


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp")
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tensor = torch.randn(int(args.gib * 2**30) // 4)
    path = Path(args.dir) / f"zerofit-direct-writer-{os.getpid()}.pt"
    runs = {name: [] for name in CASES}
    for _ in range(args.repeats):
        for name, (direct, stage) in CASES.items():
            runs[name].append(one(path, tensor, direct, stage))
    record = {"command": "python bench/direct_writer.py " + " ".join(sys.argv[1:]), "dir": args.dir, "gib": args.gib,
              "cores": len(os.sched_getaffinity(0)),
              "median_gb_per_s": {n: round(statistics.median(r["gb_per_s"] for r in rs), 2) for n, rs in runs.items()},
              "median_busy_us_per_op": {n: round(statistics.median(r["busy_us_per_op"] for r in rs), 2)
                                        for n, rs in runs.items()},
              "direct_taken": {n: all(r["direct"] for r in rs) for n, rs in runs.items()},
              "runs": {n: [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()} for r in rs]
                       for n, rs in runs.items()}}
    out = Path(os.environ.get("OUT") or Path(__file__).parent / "results") / "direct_writer.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: record[k] for k in ("median_gb_per_s", "median_busy_us_per_op")}), "->", out)


if __name__ == "__main__":
    main()
