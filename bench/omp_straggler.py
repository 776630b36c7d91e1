"""Does a busy background thread (what the async checkpoint writer is) slow DeepSpeedCPUAdam
more when CPU-Adam uses every core than when it leaves one free? An OpenMP loop runs at the
pace of its slowest thread, so one thread sharing a core with the writer holds back all of
them. This is why zerofit keeps a core for the writer when checkpoint.async_save is on
(procenv.cpu_threads_per_rank).

Each case runs in its own process (OMP_NUM_THREADS is read once, when the op loads):
CPU-Adam on --params fp32 elements with all cores or one fewer, the writer idle or busy
(zlib.crc32 over 256 MiB in a loop: releases the GIL, like torch.save's CRC and the copies).
One more case checks the mechanism zerofit relies on: a process launched with
OMP_NUM_THREADS=1 (torchrun's default) whose threads procenv.apply_cpu_threads sets to all
cores before the op loads (`set_by_zerofit`) should step as fast as one launched with them.
    python bench/omp_straggler.py            # any machine; writes $OUT/omp_straggler.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path


def case(threads: int, load: str, params: int, steps: int) -> float:
    """Median seconds of one CPU-Adam step (in this process)."""
    import threading
    import zlib

    os.environ["DS_ACCELERATOR"] = "cpu"
    import torch

    if load == "set_by_zerofit":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from zerofit.config.load import validate
        from zerofit.machine import procenv

        procenv.apply_cpu_threads(validate({"model": {"config": "tiny"},
                                            "train": {"max_steps": 1, "cpu_threads": threads}}))
    else:
        torch.set_num_threads(threads)
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    param = torch.nn.Parameter(torch.zeros(params))
    param.grad = torch.ones_like(param)
    optimizer = DeepSpeedCPUAdam([param], lr=1e-3)
    optimizer.step()
    stop = threading.Event()

    def writer():
        buffer = bytes(256 << 20)
        while not stop.is_set():
            zlib.crc32(buffer)

    if load == "busy":
        threading.Thread(target=writer, daemon=True).start()
        time.sleep(0.5)
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        optimizer.step()
        seconds.append(time.perf_counter() - started)
    stop.set()
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=40_000_000)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--case", nargs=2, help=argparse.SUPPRESS)  # child: THREADS idle|busy|set_by_zerofit
    args = parser.parse_args()
    if args.case:
        print(json.dumps(case(int(args.case[0]), args.case[1], args.params, args.steps)))
        return
    cores = len(os.sched_getaffinity(0))
    results = {}
    for repeat in range(args.repeats):
        runs = [(threads, load, str(threads)) for threads in (cores, max(1, cores - 1)) for load in ("idle", "busy")]
        runs.append((cores, "set_by_zerofit", "1"))  # launched as torchrun launches several ranks
        for threads, load, launched_with in runs:
            done = subprocess.run([sys.executable, __file__, "--case", str(threads), load, "--params",
                                   str(args.params), "--steps", str(args.steps)], capture_output=True, text=True,
                                  env={**os.environ, "OMP_NUM_THREADS": launched_with}, check=True)
            name = f"{threads}_threads_set_by_zerofit_launched_with_1" if load == "set_by_zerofit" else \
                f"{threads}_threads_writer_{load}"
            results.setdefault(name, []).append(float(done.stdout.strip().splitlines()[-1]))
    medians = {k: round(statistics.median(v) * 1000, 2) for k, v in results.items()}
    record = {"command": "python bench/omp_straggler.py " + " ".join(sys.argv[1:]), "cores": cores,
              "cpu": platform.processor() or platform.machine(), "params": args.params,
              "ms_per_step_median": medians, "ms_per_step_runs": {k: [round(x * 1000, 2) for x in v]
                                                                  for k, v in results.items()}}
    out = Path(os.environ.get("OUT") or Path(__file__).parent / "results") / "omp_straggler.json"
    out.write_text(json.dumps(record, indent=1))
    print(json.dumps(medians, indent=1), "->", out)


if __name__ == "__main__":
    main()
