"""NVMe bench: the optimizer state on NVMe (ZeRO-Infinity) side by side with CPU offload,
one model, each trained a few steps by `zerofit train` in its own process (the path users
take: plan, NVMe preflight, swap guard, crash-safe checkpoint).

GPU machine (at most ~6 min including builds and model init; writes $OUT/nvme.json):
    source .whl/prelude.sh || exit; python bench/nvme_bench.py
CPU smoke test of the same code path with preset `mini` (under a minute):
    python bench/nvme_bench.py --smoke

Order: `zerofit doctor --system --nvme-path DIR` (builds DeepSpeed's async_io op, measures the
disk, runs and caches the aio sweep the NVMe run then uses), the NVMe run, the CPU-offload run.
`--stages` picks among them and `nvme_pipelined` (the NVMe run with zero.nvme_pipeline: the
swap overlapped with the neighbouring sub groups' steps; `nvme` is DeepSpeed's one-at-a-time
swapper). `--keep-work` continues in the work dir of an earlier invocation on the same
machine (its doctor cache and result file), so one comparison can span two commands of the
GPU machine's 10-minute limit:
    python bench/nvme_bench.py --stages doctor,cpu --keep-work ...; then --stages nvme --keep-work ...
Per run: host_rss_bytes = the rank's peak RSS (the largest memory.jsonl host_peak; the
ru_maxrss that os.wait4 reports is kept too but can be lower: zerofit resets VmHWM per phase
through clear_refs, which resets the kernel's high-water mark ru_maxrss reads; the pipelined
3.6B run: 77.3 GB in memory.jsonl, 48.6 GB by ru_maxrss), tokens_per_s = median over the
steps after the first, save_seconds = the training stall of the final checkpoint (sync save: DeepSpeed's
files, for NVMe its copy of the swap files, fsync, manifest, publish). Targets (issue 8):
NVMe host RSS <= 50% of CPU offload's, tokens/s >= 60% of it.

Model: --preset (llama-3.6b) when zerofit's planner says its NVMe run fits the disk and the
time left after the doctor (swap files x 1.1 + one checkpoint; builds, init, steps and the
save at the disk's measured rates); else the largest of FALLBACK_PRESETS that does, the
reason recorded as `requested_preset_refused` (on the GPU machine's 64 GiB disk the 3.6B
model's ~58 GB of swap files and ~43 GB checkpoint do not fit together).

A deadline (--deadline-s, default 345 s) bounds the whole bench: each run gets what is left
(less a reserve for the runs after it), is sent SIGTERM when its time is up (zerofit stops at
the next step boundary) and SIGKILL 20 s later; nvme.json is rewritten after each stage, so
a cut-short bench still leaves every figure it measured ("complete": false).
Disk: the NVMe run needs the swap files (~16 bytes per parameter: 3.6B -> ~58 GB) plus the
checkpoint's copy of the moments (~12 bytes per parameter) on the same disk; zerofit's
preflight and checkpoint space checks refuse, with the numbers, when that is not there,
and the refusal is recorded.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zerofit.core.files import read_jsonl  # noqa: E402 (after the path above)

TERM_GRACE_S = 20
FALLBACK_PRESETS = ("llama-1.5b", "llama-0.5b")
# A run's time beyond its steps and save: process start, imports, zero.Init and the engine's
# fp32 partitions (about 15 s per 1e9 parameters on the GPU machine; cpu_adam is built once).
START_SECONDS, INIT_SECONDS_PER_PARAM, CPU_ADAM_BUILD_SECONDS = 20.0, 15e-9, 45.0
NVME_SHARE = 0.55  # of the time left after the doctor: the CPU-offload baseline gets the rest
STAGES = ("doctor", "nvme", "nvme_pipelined", "cpu")
RUNS = STAGES[1:]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="preset mini on CPU: the same code path in seconds")
    parser.add_argument("--preset", default="llama-3.6b")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=8,
                        help="micro batches per step (default: 16 sequences per step at micro 2, the shape of the "
                             "speed bench); the swap I/O is once per step, so this amortizes it")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run (a checkpoint after the last)")
    parser.add_argument("--nvme-dir", default="/tmp/zerofit-nvme-bench", help="NVMe path (a local disk) and work dir")
    parser.add_argument("--deadline-s", type=float, default=345.0, help="the whole bench, builds and init included")
    parser.add_argument("--out", default=None, help="result directory (default $OUT, else bench/results)")
    parser.add_argument("--name", default="nvme.json", help="result file name")
    parser.add_argument("--stages", default="doctor,nvme,cpu",
                        help=f"which of {','.join(STAGES)} to run, in that order (an NVMe stage runs the doctor "
                             f"first when no sweep is cached)")
    parser.add_argument("--no-fallback", action="store_true",
                        help="run --preset even when its NVMe run is predicted not to fit the time left "
                             "(the prediction is recorded; a run cut by the deadline keeps what it measured)")
    parser.add_argument("--keep-work", action="store_true",
                        help="continue an earlier invocation's work dir: its cached sweep and its results")
    args = parser.parse_args()
    unknown = set(args.stages.split(",")) - set(STAGES)
    if unknown:
        parser.error(f"unknown stage(s) {', '.join(sorted(unknown))}; choose from {', '.join(STAGES)}")
    if args.smoke:
        args.preset, args.seq_len, args.micro_batch, args.steps, args.grad_accum = "mini", 64, 2, 3, 2
        if not args.keep_work:
            args.nvme_dir = tempfile.mkdtemp(prefix="zerofit-nvme-smoke-")
    return args


def run_config(args, mode: str, run_dir: Path, nvme_path: Path) -> dict:
    zero = {"stage": 3, "offload_optimizer": mode.split("_")[0], "offload_param": "cpu", "offload_optimizer_ratio": 1.0}
    if mode.startswith("nvme"):
        zero.update(nvme_path=str(nvme_path), nvme_pipeline=mode == "nvme_pipelined")
    return {
        "run_dir": str(run_dir),
        "model": {"config": args.preset, "gradient_checkpointing": True},
        "data": {"path": "synthetic", "synthetic_samples": 64, "eval_fraction": 0.0},
        "train": {"seq_len": args.seq_len, "micro_batch_size": args.micro_batch, "grad_accum_steps": args.grad_accum,
                  "max_steps": args.steps, "warmup_steps": 0, "lr": 1e-5,
                  **({} if args.smoke else {"precision": "bf16"})},
        "zero": zero,
        "checkpoint": {"every_steps": 0, "save_final": True, "keep_last": 1},
        "eval": {"at_end": False},
        "log": {"progress": False},
        "plan": {"enabled": False},  # the config as given: both runs alike but for the optimizer's device
    }


def refusal(args, preset: str, nvme_path: Path, seconds: float) -> str | None:
    """None when the NVMe run of `preset` fits the free disk and `seconds`, by zerofit's own
    prediction (plan.json's figures, the measured disk rates when the doctor cached them)."""
    from zerofit.config.load import validate
    from zerofit.nvme import preflight as nvme
    from zerofit.plan import render

    config = validate(run_config(argparse.Namespace(**{**vars(args), "preset": preset}), "nvme",
                                 Path(args.nvme_dir) / "probe", nvme_path))
    decision, spec, hw = render.plan_config(config, 1)
    plan = decision.plan
    swap = plan.devices["nvme"].total_bytes
    disk_needed = swap * nvme.FREE_SPACE_FACTOR + plan.checkpoint_bytes
    free = shutil.disk_usage(nvme_path.parent).free
    if disk_needed > free:
        return (f"{preset}: swap files {swap / 1e9:.1f} GB (+10%) and a checkpoint {plan.checkpoint_bytes / 1e9:.1f} GB "
                f"need {disk_needed / 1e9:.1f} GB, {free / 1e9:.1f} GB free under {nvme_path.parent}")
    write_rate = hw.nvme_write_bytes_per_s or 1.5e9
    predicted = (START_SECONDS + CPU_ADAM_BUILD_SECONDS + INIT_SECONDS_PER_PARAM * spec.total_params
                 + args.steps * plan.step_seconds + 2 * plan.checkpoint_bytes / write_rate)
    if predicted > seconds:
        return (f"{preset}: predicted {predicted:.0f} s for the NVMe run ({plan.step_seconds:.1f} s per step, "
                f"{plan.step_terms.get('nvme', 0):.1f} s of it on the disk), {seconds:.0f} s left")
    return None


def run_process(cmd: list[str], seconds: float, log: Path, env: dict | None = None) -> dict:
    """Run cmd with a time limit (SIGTERM, then SIGKILL); exit code, wall time, peak RSS."""
    started = time.perf_counter()
    with open(log, "w") as out:
        child = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        termed = None
        while True:
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                break
            now = time.perf_counter()
            if termed is None and now - started > seconds:
                child.send_signal(signal.SIGTERM)
                termed = now
            elif termed is not None and now - termed > TERM_GRACE_S:
                child.kill()
            time.sleep(0.5)
    return {"exit_code": os.waitstatus_to_exitcode(status), "wall_seconds": round(time.perf_counter() - started, 1),
            "cut_by_deadline": termed is not None, "ru_maxrss_bytes": usage.ru_maxrss * 1024}


def measured(run_dir: Path, proc: dict, log: Path) -> dict:
    """The run's figures from its own files (whatever it got to before it ended)."""
    steps = read_jsonl(run_dir / "metrics.jsonl")
    phases = read_jsonl(run_dir / "memory.jsonl")
    rss = [max(p.get("host_peak", 0), p.get("host_rss", 0)) for p in phases]
    saves = [p for p in phases if p.get("phase") == "save"]
    steady = [s["tokens_per_s"] for s in steps[1:]] or [s["tokens_per_s"] for s in steps]
    plan = json.loads((run_dir / "plan.json").read_text()) if (run_dir / "plan.json").is_file() else {}
    result = {
        "host_rss_bytes": max(rss) if rss else None,
        "tokens_per_s": round(statistics.median(steady), 1) if steady else None,
        "save_seconds": saves[-1]["seconds"] if saves else None,
        "steps_done": len(steps), "step_seconds": [round(s["step_seconds"], 2) for s in steps],
        "tokens_per_s_from": "steps 2+" if len(steps) > 1 else ("step 1 (includes warm-up)" if steps else None),
        "predicted_host_rss_bytes": plan.get("predicted_host_rss"),
        "predicted_step_seconds": plan.get("estimated_step_seconds"), "predicted_nvme": plan.get("nvme"),
        "nvme_swap_bytes_seen": max((p.get("nvme_swap", 0) for p in phases), default=0),
        **proc,
    }
    if proc["exit_code"] != 0:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        result["error_tail"] = lines[-8:]
    return result


def ratio(result: dict, key: str, of: str, to: str) -> float | None:
    a, b = (result.get(of) or {}).get(key), (result.get(to) or {}).get(key)
    return round(a / b, 3) if a and b else None


def judge(result: dict) -> None:
    """The targets for `nvme` against `cpu`; `nvme_pipelined`'s figures against both."""
    for name, value in {"host_rss_vs_cpu": ratio(result, "host_rss_bytes", "nvme", "cpu"),
                        "tokens_per_s_vs_cpu": ratio(result, "tokens_per_s", "nvme", "cpu"),
                        "pipelined_host_rss_vs_cpu": ratio(result, "host_rss_bytes", "nvme_pipelined", "cpu"),
                        "pipelined_tokens_per_s_vs_cpu": ratio(result, "tokens_per_s", "nvme_pipelined", "cpu"),
                        "pipelined_tokens_per_s_vs_nvme": ratio(result, "tokens_per_s", "nvme_pipelined", "nvme")
                        }.items():
        if value is not None:
            result[name] = value
    if "host_rss_vs_cpu" in result and "tokens_per_s_vs_cpu" in result:
        result["meets_targets"] = result["host_rss_vs_cpu"] <= 0.5 and result["tokens_per_s_vs_cpu"] >= 0.6


def main() -> int:
    args = parse_args()
    began = time.perf_counter()
    stages = [s for s in STAGES if s in args.stages.split(",")]
    runs = [s for s in stages if s in RUNS]
    out_dir = Path(args.out or os.environ.get("OUT") or (tempfile.mkdtemp() if args.smoke else "bench/results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(args.nvme_dir)
    earlier = work / args.name
    if not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    nvme_path = work / "swap"
    env = {"ZEROFIT_CACHE_DIR": str(work / "cache"),  # the sweep this bench runs, not an older one
           "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}  # one GPU on a larger host
    result = json.loads(earlier.read_text()) if args.keep_work and earlier.is_file() else {}
    commands = result.get("commands", [result["command"]] if "command" in result else [])
    result.update({"command": "python " + " ".join(sys.argv), "commands": commands + ["python " + " ".join(sys.argv)],
                   "preset": args.preset, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
                   "grad_accum": args.grad_accum, "steps": args.steps, "nvme_path": str(nvme_path),
                   "deadline_s": args.deadline_s, "complete": False,
                   "targets": {"host_rss_vs_cpu_max": 0.5, "tokens_per_s_vs_cpu_min": 0.6}})

    def left() -> float:
        return args.deadline_s - (time.perf_counter() - began)

    def write() -> None:
        result["elapsed_s"] = round(time.perf_counter() - began, 1)
        for folder in (out_dir, work):
            (folder / args.name).write_text(json.dumps(result, indent=1))

    write()
    zerofit = [sys.executable, "-m", "zerofit"]
    nvme_runs = [r for r in runs if r.startswith("nvme")]
    cached = list((work / "cache").glob("aio-*.json"))
    if "doctor" in stages or (nvme_runs and not cached):
        # 1. the disk and DeepSpeed's aio there: builds async_io, measures, caches the sweep
        log = work / "doctor.log"
        proc = run_process(zerofit + ["doctor", "--system", "--nvme-path", str(nvme_path), "--nvme-mib",
                                      "64" if args.smoke else "1024"], min(left() * 0.3, 120), log,
                           {**env, "COLUMNS": "300"})
        cache = list((work / "cache").glob("aio-*.json"))
        tuned = json.loads(cache[0].read_text()) if cache else {}
        result["disk"] = {"doctor_exit_code": proc["exit_code"], "doctor_seconds": proc["wall_seconds"],
                          "aio": tuned.get("aio"), "read_bytes_per_s": tuned.get("read_bytes_per_s"),
                          "write_bytes_per_s": tuned.get("write_bytes_per_s"), "dio_alignment": tuned.get("dio_alignment"),
                          "sweep_settings_tried": len(tuned.get("tried", [])),
                          "free_bytes": shutil.disk_usage(work).free}
        write()
        print(f"disk: {result['disk']}", flush=True)

    # 2. the model: the requested one if its NVMe run fits the disk and the time, else smaller
    os.environ.update(env)  # the planner reads the sweep just cached
    share = (NVME_SHARE if "cpu" in runs else 1.0) / max(len(nvme_runs), 1)  # of the time left, per NVMe run
    weights = {m: (1 - NVME_SHARE if m == "cpu" else share) for m in runs}
    if nvme_runs:
        refused = []
        for preset in [args.preset] + ([] if args.smoke else [p for p in FALLBACK_PRESETS if p != args.preset]):
            why = refusal(args, preset, nvme_path, left() * share)
            if why is not None and args.no_fallback and "predicted" in why:
                result["predicted_over_time"] = why
                why = None
            if why is None:
                args.preset = preset
                break
            refused.append(why)
            print(f"not {why}", flush=True)
        result["preset"] = args.preset
        if refused:
            result["requested_preset_refused"] = refused
        write()

    # 3. the runs, in order; the last keeps the rest of the time (the CPU baseline when it runs)
    for index, mode in enumerate(runs):
        run_dir = work / mode
        shutil.rmtree(run_dir, ignore_errors=True)
        config_file = work / f"{mode}.yaml"
        config_file.write_text(yaml.safe_dump(run_config(args, mode, run_dir, nvme_path)))
        log = work / f"{mode}.log"
        budget = left() * weights[mode] / sum(weights[m] for m in runs[index:])
        if budget < 10:
            result[mode] = {"skipped": f"deadline: {budget:.0f} s left"}
            write()
            continue
        proc = run_process(zerofit + ["train", "--config", str(config_file)], budget, log, env)
        result[mode] = measured(run_dir, proc, log)
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the disk holds one run's files
        judge(result)
        write()
        print(f"{mode}: {json.dumps(result[mode])}", flush=True)

    result["complete"] = all((result.get(m) or {}).get("exit_code") == 0 for m in ("cpu", "nvme"))
    write()
    print(json.dumps({k: v for k, v in result.items() if k not in RUNS}, indent=1))
    print(f"-> {out_dir / args.name}")
    if args.smoke and not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all((result.get(m) or {}).get("exit_code") == 0 for m in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
