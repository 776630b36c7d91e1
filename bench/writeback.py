"""Time to durable for one checkpoint file written through zerofit's CheckedFile (the write
path of every checkpoint file), with its early writeback (posix_fadvise DONTNEED every
checkpoint_io.WRITEBACK_BYTES) and without it (the threshold set past the file's size, so
everything waits for the fsync at close). torch.save of one fp32 tensor of --gib GiB, then
close (flush + fsync); each case in its own process, the two cases alternating --repeats times.
    python bench/writeback.py [--dir /tmp] [--gib 2]     # writes $OUT/writeback.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def case(path: Path, gib: float, writeback: bool) -> float:
    """Seconds from the first byte to durable."""
    sys.path.insert(0, str(ROOT))
    import torch

    from zerofit import checkpoint_io

    if not writeback:
        checkpoint_io.WRITEBACK_BYTES = 1 << 62
    tensor = torch.arange(int(gib * 2**30) // 4, dtype=torch.float32)
    started = time.perf_counter()
    checked = checkpoint_io.CheckedFile(path, None, 0)
    torch.save({"t": tensor}, checked)
    checked.close()
    seconds = time.perf_counter() - started
    path.unlink()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp")
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--case", choices=("on", "off"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    path = Path(args.dir) / f"zerofit-writeback-{os.getpid()}.pt"
    if args.case:
        print(json.dumps(case(path, args.gib, args.case == "on")))
        return
    seconds: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(args.repeats):
        for mode in ("off", "on"):
            done = subprocess.run([sys.executable, __file__, "--case", mode, "--dir", args.dir, "--gib", str(args.gib)],
                                  capture_output=True, text=True, check=True)
            seconds[mode].append(float(done.stdout.strip().splitlines()[-1]))
    nbytes = args.gib * 2**30
    record = {"command": "python bench/writeback.py " + " ".join(sys.argv[1:]), "dir": args.dir, "gib": args.gib,
              "cores": len(os.sched_getaffinity(0)),
              "gb_per_s_to_durable": {mode: [round(nbytes / s / 1e9, 2) for s in runs] for mode, runs in seconds.items()},
              "median_gb_per_s": {mode: round(nbytes / statistics.median(runs) / 1e9, 2)
                                  for mode, runs in seconds.items()},
              "pairs_faster_with_writeback": sum(on < off for on, off in zip(seconds["on"], seconds["off"]))}
    out = Path(os.environ.get("OUT") or Path(__file__).parent / "results") / "writeback.json"
    out.write_text(json.dumps(record, indent=1))
    print(json.dumps(record["median_gb_per_s"]), "->", out)


if __name__ == "__main__":
    main()
