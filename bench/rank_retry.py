"""The OOM retry with several ranks (`memory.on_oom: retry` under `torchrun --max-restarts 1`):
does torchrun's restart bring every rank back with the failed rank's safer settings, and how
long does the way back take? Then the same with torch's default keys for the restarted
process group (elastic.process_group_store off): what a restart meets without zerofit's; and
without the watcher that ends the surviving rank on torchrun's SIGTERM
(peerwatch.leave_at_once_when_a_peer_is_gone off: torchrun SIGKILLs it after 30 s).

Two ranks train a speed_bench case (zerofit's plan, synthetic data) with a checkpoint every
`--save-every` steps; rank 1 runs out of memory in the forward of step `--oom-step` (the drill
ZEROFIT_FAULT=oom@step:N with ZEROFIT_FAULT_RANKS=1: the error a CUDA OOM raises, so the
post-mortem, the hand-over, torchrun's restart, the NCCL re-initialisation and the resume are
all real). Recorded per variant: exit code, wall time, the steps trained and their micro batch,
the hand-over, and from the timelines the seconds from the OOM to the restarted ranks' start
and from there to the end of the first resumed step.

GPU machine (2 GPUs, NCCL, ~2 min a run):  python bench/rank_retry.py --case 0.5b-8 --timeout-s 200
(--nodes 2: two torchrun agents of one GPU each, rendezvous c10d: the several-node path on one host)
Here (CPU, gloo, ~2 min):            python bench/rank_retry.py --smoke
--drill kill: rank 1 is SIGKILLed at that step instead (in every attempt, so the restart fails
too): how soon the other rank, waiting in NCCL, leaves (zerofit/recovery/lastword.py, the watcher).
Writes $OUT/rank_retry-<case>[-<variants>].json (or --out); each run's log stays in
/tmp/zerofit-rank_retry-*-<variant>-<repeat>/log.txt (and log-node1.txt).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import speed_cases  # noqa: E402 (after the path above)
import speed_workers  # noqa: E402

from zerofit.core.files import (
    read_json,  # noqa: E402
    read_jsonl,  # noqa: E402
)
from zerofit.train.ranks import free_port  # noqa: E402

VARIANTS = ("zerofit", "default_store")  # the default --variants; also: no_peer_watch
LOG_MARKS = ("memory.on_oom=retry", "retry:", "resumed from", "done:", "connectFullMesh", "NCCL error", "Timeout",
             "zerofit: error", "leaving now", "forcefully exiting", "exitcode", "closing signal")


def entry_without(variant: str, argv: list[str]) -> int:
    """`zerofit ARGV` with one of zerofit's parts off: `default_store`, the restarted attempt's
    process group on torch's default keys; `no_peer_watch`, no watcher for torchrun's SIGTERM."""
    import contextlib

    from zerofit.cli import main
    from zerofit.recovery import elastic, peerwatch

    if variant == "default_store":
        elastic.process_group_store = lambda: None
    elif variant == "no_peer_watch":
        peerwatch.leave_at_once_when_a_peer_is_gone = contextlib.nullcontext
    else:
        raise SystemExit(f"unknown variant {variant}")
    return main(argv)


def run_variant(variant: str, config: dict, work: Path, env: dict, timeout_s: int, nodes: int = 1) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    config = {**config, "run_dir": str(work / "run")}
    (work / "c.yaml").write_text(yaml.safe_dump(config))
    entry = ["-m", "zerofit"] if variant == "zerofit" else [__file__, "--entry-without", variant]
    train = [*entry, "train", "--config", str(work / "c.yaml")]
    port = free_port()
    if nodes == 1:
        launches = [(["--nproc_per_node", "2", "--master_port", str(port)], env)]
    else:  # two torchrun agents of one GPU each: two nodes on one host, rendezvous c10d
        launches = [(["--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                      f"127.0.0.1:{port}", "--rdzv-id", work.name], {**env, "CUDA_VISIBLE_DEVICES": str(node)})
                    for node in range(2)]
    started = time.perf_counter()
    logs = [open(work / ("log.txt" if n == 0 else f"log-node{n}.txt"), "w") for n in range(len(launches))]
    launchers = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *launch, "--max-restarts", "1",
                                   *train], cwd=ROOT, env=launch_env, stdout=log, stderr=subprocess.STDOUT)
                 for (launch, launch_env), log in zip(launches, logs)]
    codes = []
    for launcher in launchers:
        try:
            codes.append(launcher.wait(timeout=max(1.0, timeout_s - (time.perf_counter() - started))))
        except subprocess.TimeoutExpired:  # the workers too (each in a session of its own): else they hang on
            for process in [*psutil.Process(launcher.pid).children(recursive=True), launcher]:
                process.kill()
            launcher.wait()
            codes.append("timeout")
    for log in logs:
        log.close()
    code = codes[0] if len(set(map(str, codes))) == 1 else codes
    run = work / "run"
    steps = [{k: s.get(k) for k in ("step", "loss", "step_seconds")} for s in read_jsonl(run / "metrics.jsonl")]
    handover = read_json(run / "postmortem" / "rank1" / "retry-handover.json") or {}
    handover.pop("config", None)
    final = sorted((run / "checkpoints").glob("step-*/loop_state.json"))
    micro_batch_at_end = (read_json(final[-1]) or {}).get("micro_batch_size") if final else None
    log_lines = [line for log in sorted(work.glob("log*.txt")) for line in log.read_text(errors="replace").splitlines()]
    shutil.rmtree(run / "checkpoints", ignore_errors=True)  # a 0.5B run's are 12 GB; its log stays
    return {"variant": variant, "exit_code": code, "wall_s": round(time.perf_counter() - started, 1),
            "steps_trained": steps, "handover": handover, "micro_batch_at_end": micro_batch_at_end,
            "ds_config_micro_batch": (read_json(run / "ds_config.json") or {}).get("train_micro_batch_size_per_gpu"),
            "way_back_s": way_back(run),
            "log_marks": [line[:300] for line in log_lines if any(mark in line for mark in LOG_MARKS)][:20]}


def way_back(run: Path) -> dict:
    """Seconds from rank 1's OOM (or, with the kill drill, its last record before it was
    killed) to rank 0's restarted start, and from there to the end of the first step it trained
    again (the times of the timelines' records)."""
    rank1 = read_jsonl(run / "memory-rank1.jsonl")
    oom = next((r for r in rank1 if r["phase"] == "oom"), None)
    starts = [i for i, r in enumerate(rank1) if r["phase"] == "start"]
    if oom is None and len(starts) > 1 and starts[1] > 0:  # killed: no record of its end, its last one
        oom = {**rank1[starts[1] - 1], "step": rank1[starts[1] - 1]["step"] + 1}
    rank0 = read_jsonl(run / "memory.jsonl")
    if oom is None:
        return {}
    start = next((r for r in rank0 if r["phase"] == "start" and r["time"] > oom["time"]), None)
    if start is None:
        return {"oom_step": oom["step"]}
    first = [r for r in rank0 if r["time"] > start["time"] and r["step"] == start["step"] + 1]
    return {"oom_step": oom["step"], "resumed_at_step": start["step"],
            "oom_to_restarted_start_s": round(start["time"] - oom["time"], 1),
            "start_to_first_step_end_s": round(first[-1]["time"] - start["time"], 1) if first else None}


def main() -> None:
    if sys.argv[1:2] == ["--entry-without"]:
        raise SystemExit(entry_without(sys.argv[2], sys.argv[3:]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="0.5b-8", choices=sorted(speed_cases.CASES))
    parser.add_argument("--smoke", action="store_true", help="preset tiny on the CPU (gloo)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--oom-step", type=int, default=5)
    parser.add_argument("--drill", default="oom", choices=("oom", "kill"), help="kill: rank 1 SIGKILLed at the "
                        "start of --oom-step (as the kernel's OOM killer ends it), in every attempt, instead of "
                        "its OOM")
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="of zerofit, default_store, no_peer_watch")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each variant, interleaved (the default "
                        "keys' failure is a race)")
    parser.add_argument("--nodes", type=int, default=1, choices=(1, 2), help="2: two torchrun agents of one "
                        "GPU each, rendezvous c10d (two nodes on one host)")
    parser.add_argument("--timeout-s", type=int, default=240, help="per variant; a hung one is killed after it")
    parser.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results")))
    args = parser.parse_args()

    import torch

    accelerator = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    case = dict(speed_cases.CASES[args.case])
    env = {**os.environ, "ZEROFIT_FAULT": f"{args.drill}@step:{args.oom_step}", "ZEROFIT_FAULT_RANKS": "1",
           "PYTHONUNBUFFERED": "1", "COLUMNS": "300"}
    if args.smoke:
        case.update(model="tiny", seq_len=64, global_batch=8)
        env.update(DS_ACCELERATOR="cpu")
    config = speed_cases.zerofit_config(case, Path("unset"), args.steps, accelerator)
    config["checkpoint"] = {"every_steps": args.save_every, "keep_last": 2, "save_final": False}
    config["memory"] = {"on_oom": "retry"}
    config["train"]["micro_batch_size"] = case["global_batch"] // 2  # per rank, so the retry has one to halve
    stem = (f"rank_retry-{'smoke' if args.smoke else args.case}{'-2nodes' if args.nodes == 2 else ''}"
            f"{'-kill' if args.drill == 'kill' else ''}")
    name = stem if args.variants == ",".join(VARIANTS) else f"{stem}-{args.variants.replace(',', '_')}"
    results = [dict(run_variant(variant, config, Path(f"/tmp/zerofit-{stem}-{variant}-{n + 1}"), env, args.timeout_s,
                                args.nodes), repeat=n + 1)
               for n in range(args.repeat) for variant in args.variants.split(",")]
    result = {"command": "python " + " ".join(sys.argv), "device": speed_workers.gpu_name() if accelerator == "cuda"
              else "cpu", "gpus": torch.cuda.device_count() if accelerator == "cuda" else 0,
              "torch": torch.__version__, "nodes": args.nodes, "case": case, "drill": args.drill,
              "oom_step": args.oom_step,
              "save_every": args.save_every,
              "finished": {v: f"{sum(r['exit_code'] == 0 for r in results if r['variant'] == v)} of "
                           f"{sum(r['variant'] == v for r in results)}" for v in args.variants.split(",")},
              "variants": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    for entry in results:
        shown = ("variant", "repeat", "exit_code", "wall_s", "micro_batch_at_end", "way_back_s")
        print(json.dumps({k: entry[k] for k in shown}))
    print(f"finished: {result['finished']}\n-> {out / name}.json")


if __name__ == "__main__":
    main()
