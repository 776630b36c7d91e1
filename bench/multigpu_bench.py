"""Multi-GPU validation (issue 10): ZeRO-3 over two GPUs with real `zerofit train` ranks.

Part `scaling`: preset llama-3.6b, optimizer states on the CPU (the planner chooses the rest),
seq 1024, micro batch 2, 16 sequences per optimizer step, bf16, each rank's allocator capped
at --cap-gib (torch.cuda.set_per_process_memory_fraction on its own GPU). Trained on 1 GPU,
then on 2 (torchrun, NCCL): steady tokens/s (the first step excluded), scaling efficiency =
tokens/s(2) / (2 x tokens/s(1)), each rank's GPU peak (its memory.jsonl / memory-rank1.jsonl,
step 1's forward window left out: it also spans the build) against the planner's per-rank
prediction in the run's plan.json, each rank's host RSS peak.

Part `resume`: preset --resume-preset (llama-0.5b: three checkpoints, a universal conversion
and two exports must fit the command's 10 minutes), same shape, 2 GPUs, async saves:
  1. train 2 steps, save step 2, exit;  export step-2 (bf16) -> export A (before any kill)
  2. resume and train on towards step 6; when rank 1's save of step 4 is under way, SIGKILL
     rank 1 from outside (its PID found among torchrun's children by LOCAL_RANK)
  3. resume on 1 GPU: zerofit must skip the half-written step 4, take step 2 (the newest
     valid), convert it to a universal checkpoint, and train on to step 4
  4. export universal-step-2 -> export B; A and B must hold equal tensors and give equal logits.

GPU machine (nvidia-h200-x2; MemTotal there reads low until memory is touched, so the host
budget is given):
    source .whl/prelude.sh || exit; python bench/multigpu_bench.py --host-mem 240GiB
CPU smoke of the same code path (2 gloo ranks, preset tiny, about 2 minutes on 2 cores):
    python bench/multigpu_bench.py --smoke
Writes $OUT/multigpu.json (or --out DIR), rewritten after every stage; `--previous FILE` starts
from an earlier result (parts run in separate commands), `--parts` picks the parts.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GIB = 2**30
KILL_STEP, RESUME_FROM = 4, 2


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="preset tiny, 2 gloo ranks on CPU")
    parser.add_argument("--parts", default="scaling,resume")
    parser.add_argument("--preset", default="llama-3.6b")
    parser.add_argument("--resume-preset", default="llama-0.5b")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per scaling run")
    parser.add_argument("--cap-gib", type=float, default=24.0, help="GPU allocator cap per rank")
    parser.add_argument("--host-mem", default=None, help="plan.host_mem (default: what the machine reports)")
    parser.add_argument("--work", default="/tmp/zerofit-multigpu")
    parser.add_argument("--run-timeout-s", type=float, default=300.0)
    parser.add_argument("--out", default=None, help="result directory (default $OUT, else bench/results)")
    parser.add_argument("--previous", default=None, help="an earlier multigpu.json to extend")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-resume", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.preset = args.resume_preset = "tiny"
        args.seq_len, args.global_batch, args.steps, args.cap_gib = 64, 8, 3, 0
        args.work, args.run_timeout_s = "/tmp/zerofit-multigpu-smoke", 400.0
    return args


# ------------------------------------------------------------------------ one rank
def worker(config_file: str, resume: bool) -> None:
    """A rank of a run (under torchrun): cap this rank's allocator, then zerofit's own train()."""
    import torch

    from zerofit.config.load import validate
    from zerofit.train.loop import train

    spec = json.loads(Path(config_file).read_text())
    if torch.cuda.is_available() and spec["cap_gib"]:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        total = torch.cuda.get_device_properties(local_rank).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec["cap_gib"] * GIB / total), local_rank)
    train(validate(spec["config"]), resume=resume)


def run_config(args, preset: str, run_dir: Path, max_steps: int, every: int, async_save: bool) -> dict:
    on_gpu = not args.smoke
    return {
        "run_dir": str(run_dir),
        "model": {"config": preset, "gradient_checkpointing": True},
        "data": {"path": "synthetic", "synthetic_samples": 256, "eval_fraction": 0.0},
        "train": {"seq_len": args.seq_len, "micro_batch_size": args.micro_batch,
                  "global_batch_size": args.global_batch, "max_steps": max_steps, "warmup_steps": 0, "lr": 1e-5,
                  **({"precision": "bf16"} if on_gpu else {})},
        "zero": {"stage": 3, "offload_optimizer": "cpu"},
        "checkpoint": {"every_steps": every, "keep_last": 3, "save_final": every > 0, "async_save": async_save},
        "eval": {"at_end": False},
        "log": {"progress": False},
        "plan": {**({"gpu_mem": f"{args.cap_gib:g}GiB"} if on_gpu else {}),
                 **({"host_mem": args.host_mem} if args.host_mem else {})},
    }


def launch(args, config: dict, nproc: int, log: Path, resume: bool = False) -> subprocess.Popen:
    spec_file = log.with_suffix(".json")
    spec_file.write_text(json.dumps({"config": config, "cap_gib": args.cap_gib}))
    worker_args = [str(Path(__file__).resolve()), "--worker", str(spec_file)] + (["--worker-resume"] if resume else [])
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port",
           str(29500 + os.getpid() % 1000), *worker_args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if args.smoke:
        env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def finish(process: subprocess.Popen, seconds: float) -> int:
    try:
        return process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return process.wait()


def log_tail(log: Path, lines: int = 12) -> list[str]:
    return [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-lines:]


# ------------------------------------------------------------------------ reading a run
def measured(run_dir: Path, world_size: int) -> dict:
    """Steady tokens/s and each rank's GPU / host peaks from the run's own records, with the
    planner's per-rank predictions from the plan.json the run wrote."""
    from zerofit.core.files import read_jsonl
    from zerofit.core.timeline import read_timeline

    steps = read_jsonl(run_dir / "metrics.jsonl")
    steady = [s["tokens_per_s"] for s in steps[1:]]
    plan = json.loads((run_dir / "plan.json").read_text()) if (run_dir / "plan.json").is_file() else {}
    ranks = []
    for rank in range(world_size):
        timeline = read_timeline(run_dir, rank)
        rows = [r for r in timeline if r["phase"] in ("forward", "backward", "optimizer_step")
                and (r["step"], r["phase"]) != (1, "forward")]
        start = next((r for r in timeline if r["phase"] == "start"), {})
        gpu = max((r.get("gpu_peak") or 0 for r in rows), default=0)
        host = max((max(r.get("host_peak", 0), r.get("host_rss", 0)) for r in rows), default=0)
        predicted_gpu, predicted_host = plan.get("predicted_gpu_peak"), plan.get("predicted_host_rss")
        ranks.append({"rank": rank, "alloc_conf": start.get("alloc_conf"), "gpu_peak_bytes": gpu, "host_rss_peak_bytes": host,
                      "predicted_gpu_peak_bytes": predicted_gpu, "gpu_error_pct": error_pct(predicted_gpu, gpu),
                      "predicted_host_rss_bytes": predicted_host, "host_error_pct": error_pct(predicted_host, host)})
    return {"world_size": world_size, "steps_done": len(steps),
            "tokens_per_s": round(statistics.median(steady), 1) if steady else None,
            "step_seconds": [round(s["step_seconds"], 2) for s in steps],
            "loss": [round(s["loss"], 4) for s in steps], "ranks": ranks,
            "host_rss_total_bytes": sum(r["host_rss_peak_bytes"] for r in ranks),
            "chosen": plan.get("chosen"), "micro_batch": (plan.get("shape") or {}).get("micro_batch"),
            "grad_accum": (plan.get("shape") or {}).get("grad_accum"),
            "predicted_step_seconds": plan.get("estimated_step_seconds")}


def error_pct(predicted: int | None, measured: int | None) -> float | None:
    return round(100 * (predicted - measured) / measured, 1) if predicted and measured else None


# ------------------------------------------------------------------------ part: scaling
def part_scaling(args, work: Path, record: dict, save) -> None:
    part = record.setdefault("scaling", {"model": args.preset, "gpu_cap_gib_per_rank": args.cap_gib,
                                         "seq_len": args.seq_len, "micro_batch": args.micro_batch,
                                         "global_batch": args.global_batch, "optimizer_offload": "cpu"})
    for world_size in (1, 2):
        run_dir = work / f"scaling-{world_size}gpu"
        log = work / f"scaling-{world_size}gpu.log"
        started = time.perf_counter()
        exit_code = finish(launch(args, run_config(args, args.preset, run_dir, args.steps, 0, False), world_size, log),
                           args.run_timeout_s)
        entry = {"exit_code": exit_code, "wall_seconds": round(time.perf_counter() - started, 1)}
        entry.update(measured(run_dir, world_size) if (run_dir / "metrics.jsonl").exists() else {})
        if exit_code != 0:
            entry["log_tail"] = log_tail(log)
        part[f"gpus_{world_size}"] = entry
        save()
    one, two = part.get("gpus_1", {}).get("tokens_per_s"), part.get("gpus_2", {}).get("tokens_per_s")
    if one and two:
        part["scaling_efficiency"] = round(two / (2 * one), 3)
    errors = [r["gpu_error_pct"] for r in part.get("gpus_2", {}).get("ranks", []) if r["gpu_error_pct"] is not None]
    if errors:
        part["per_rank_gpu_error_pct_max_abs"] = max(abs(e) for e in errors)
        part["per_rank_gpu_within_10pct"] = all(abs(e) <= 10 for e in errors)
    save()


# ------------------------------------------------------------------------ part: resume
def part_resume(args, work: Path, record: dict, save) -> None:
    from zerofit.checkpoint import files as checkpoint

    run_dir = work / "resume-run"
    part = record.setdefault("resume", {"model": args.resume_preset, "gpu_cap_gib_per_rank": args.cap_gib})
    ckpts = run_dir / "checkpoints"

    # 1. two ranks, one checkpoint, a clean exit; export it before anything is killed
    config = run_config(args, args.resume_preset, run_dir, RESUME_FROM, RESUME_FROM, True)
    part["first_run_exit"] = finish(launch(args, config, 2, work / "resume-1.log"), args.run_timeout_s)
    part["export_before_kill"] = export(ckpts / checkpoint.step_name(RESUME_FROM), work / "export-A", work)
    save()

    # 2. resume on two ranks towards step 6; SIGKILL rank 1 while its save of step 4 is being written
    config = run_config(args, args.resume_preset, run_dir, 6, 2, True)
    process = launch(args, config, 2, work / "resume-2.log", resume=True)
    part["kill"] = kill_rank_mid_save(process, ckpts / f"{checkpoint.TMP_PREFIX}{checkpoint.step_name(KILL_STEP)}",
                                      rank=1, seconds=args.run_timeout_s)
    part["kill"]["launcher_exit"] = finish(process, 120)
    found, skipped = checkpoint.find_latest_valid(ckpts, hashes=True)
    part["after_kill"] = {"newest_valid": found.name if found else None, "skipped": skipped,
                          "left_in_checkpoints": sorted(p.name for p in ckpts.iterdir())}
    killed_losses = {m["step"]: m["loss"] for m in read_metrics(run_dir)}
    save()

    # 3. resume on one GPU: newest valid (step 2), through a universal checkpoint, on to step 4
    config = run_config(args, args.resume_preset, run_dir, KILL_STEP, 2, True)
    log = work / "resume-3.log"
    part["one_gpu_resume_exit"] = finish(launch(args, config, 1, log, resume=True), args.run_timeout_s)
    text = log.read_text(errors="replace")
    part["one_gpu_resume_said"] = [ln.strip() for ln in text.splitlines()
                                   if any(k in ln for k in ("skipping", "universal", "data position", "resum"))][:12]
    resumed = {m["step"]: m["loss"] for m in read_metrics(run_dir)}
    part["loss_after_resume"] = {str(s): {"two_gpus_before_kill": killed_losses.get(s), "one_gpu_resumed": resumed.get(s)}
                                 for s in range(RESUME_FROM + 1, KILL_STEP + 1)}
    if part["one_gpu_resume_exit"] != 0:
        part["one_gpu_resume_log_tail"] = log_tail(log)
    save()

    # 4. export the universal conversion of the same step and compare with the export made before the kill
    universal = ckpts / f"universal-{checkpoint.step_name(RESUME_FROM)}"
    part["universal_checkpoint"] = {"exists": universal.is_dir(),
                                    "verify": checkpoint.verify(universal, hashes=True) if universal.is_dir() else None}
    part["export_after_resume"] = export(universal, work / "export-B", work)
    if part["export_before_kill"].get("exit_code") == 0 and part["export_after_resume"].get("exit_code") == 0:
        part["comparison"] = compare_exports(work / "export-A", work / "export-B")
    save()


def read_metrics(run_dir: Path) -> list[dict]:
    from zerofit.core.files import read_jsonl

    return read_jsonl(run_dir / "metrics.jsonl")


def kill_rank_mid_save(process: subprocess.Popen, save_dir: Path, rank: int, seconds: float) -> dict:
    """Wait until `rank`'s files of the save in `save_dir` are being written, then SIGKILL
    that rank's process (not the launcher): what a node losing one GPU process looks like."""
    import psutil

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and process.poll() is None:
        if save_dir.is_dir() and any(f"rank_{rank}_" in p.name or f"rank{rank}" in p.name for p in save_dir.iterdir()):
            break
        time.sleep(0.01)
    else:
        return {"killed": False, "why": "the save never started" if process.poll() is None else
                f"the run ended first (exit {process.returncode})"}
    target = next((p for p in psutil.Process(process.pid).children(recursive=True)
                   if p.environ().get("LOCAL_RANK") == str(rank) and "--worker" in " ".join(p.cmdline())), None)
    if target is None:
        return {"killed": False, "why": f"no process of rank {rank} found"}
    files = {p.name: p.stat().st_size for p in save_dir.iterdir() if p.is_file()}
    target.send_signal(signal.SIGKILL)
    return {"killed": True, "rank": rank, "pid": target.pid, "save_dir": save_dir.name, "files_at_kill": files}


def export(source: Path, out: Path, work: Path) -> dict:
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    log = work / f"{out.name}.log"
    started = time.perf_counter()
    with open(log, "w") as sink:
        done = subprocess.run([sys.executable, "-m", "zerofit", "export", str(source), "--out", str(out)], cwd=ROOT,
                              stdout=sink, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    entry = {"source": source.name, "exit_code": done.returncode, "seconds": round(time.perf_counter() - started, 1)}
    if done.returncode != 0:
        entry["log_tail"] = log_tail(log)
    else:
        entry["output_bytes"] = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    return entry


def compare_exports(a: Path, b: Path) -> dict:
    """Tensor by tensor, then the logits of one prompt through from_pretrained (on a GPU when
    there is one, each model in its stored dtype)."""
    import torch
    from transformers import AutoModelForCausalLM

    from zerofit.export.verify import load_export_tensors, prompt_ids

    tensors_a, tensors_b = load_export_tensors(a), load_export_tensors(b)
    different = sorted(k for k in tensors_a if k not in tensors_b or not torch.equal(tensors_a[k], tensors_b[k]))
    result = {"tensors": len(tensors_a), "tensors_only_in_b": sorted(set(tensors_b) - set(tensors_a)),
              "tensors_different": different[:20], "tensors_equal": not different and tensors_a.keys() == tensors_b.keys()}
    del tensors_a, tensors_b
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = []
    for directory in (a, b):
        model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype="auto").to(device).eval()
        ids = prompt_ids(directory, model.config.vocab_size).to(device)
        with torch.no_grad():
            logits.append(model(ids).logits.float().cpu())
        del model
    result.update(logits_equal=bool(torch.equal(*logits)),
                  logits_max_abs_diff=float((logits[0] - logits[1]).abs().max()), prompt_tokens=int(ids.numel()),
                  device=device)
    return result


# ------------------------------------------------------------------------ main
def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args.worker, args.worker_resume)
        return
    import shutil

    import torch

    out_dir = Path(args.out or os.environ.get("OUT") or ROOT / "bench" / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    result_file = out_dir / "multigpu.json"
    record = json.loads(Path(args.previous).read_text()) if args.previous else {}
    gpus = torch.cuda.device_count()
    record.setdefault("runs", []).append({
        "command": "python bench/multigpu_bench.py " + " ".join(sys.argv[1:]),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "gpus": gpus,
        "gpu": torch.cuda.get_device_name(0) if gpus else platform.processor() or "cpu",
        "parts": args.parts, "smoke": args.smoke})
    save = lambda: result_file.write_text(json.dumps(record, indent=1))  # noqa: E731
    if gpus < 2 and not args.smoke:
        record["runs"][-1]["refused"] = f"{gpus} GPU(s) visible; this bench needs 2"
        save()
        raise SystemExit(record["runs"][-1]["refused"])
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    parts = {"scaling": part_scaling, "resume": part_resume}
    for name in args.parts.split(","):
        record.pop(name, None)
        parts[name](args, work, record, save)
    save()
    print(json.dumps({k: v for k, v in record.items() if k != "runs"}, indent=1)[:6000])


if __name__ == "__main__":
    main()
