"""Planner accuracy: predicted vs measured GPU peak and host RSS over a matrix of real runs.

Matrix (issue 3 item 6): llama-0.5b / 1.5b / 3.6b presets x offload modes {none, optimizer
cpu, optimizer+params cpu} x seq len {512, 2048} x GPU caps {8, 24 GiB}; micro batch 1,
gradient checkpointing on, bf16, synthetic data, 2 optimizer steps of real `zerofit train`
(step 1 holds the first-step peaks, step 2 the steady state with Adam's moments allocated).
A cap is simulated with torch.cuda.set_per_process_memory_fraction(cap / total) and given
to the planner as plan.gpu_mem. Cells the planner says do not fit are recorded, not run.
Two caps of one configuration allocate the same tensors (the cap only bounds the cache),
so such a pair is measured once, under the smaller cap, and the record says so.

Measured: GPU peak = max over the phase lines of memory.jsonl of max_memory_allocated;
host = max over phases of the peak RSS (VmHWM, reset at every phase mark); both leave out
step 1's forward line, whose window also spans the build (kept as *_incl_init). Predicted: the
plan.json the run itself wrote (predicted_gpu_peak, predicted_host_rss).

Several cells run at once as separate processes (host RAM, GPU memory and cores shared by
predicted need), so the whole matrix fits one command; results are rewritten after every
cell, so a timeout still leaves them.

GPU machine:  source .whl/prelude.sh || exit; python bench/planner_accuracy.py
Outside the matrix: --modes param_nvme,optimizer_param_nvme (swap files in the cell's directory),
--attn eager (eager attention's s x s activations), with --models / --seq-lens to pick cells.
Here (CPU):   python bench/planner_accuracy.py --smoke
Writes $OUT/planner_accuracy.json (or --out).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GIB = 2**30
MODES = {"none": ("none", "none"), "optimizer_cpu": ("cpu", "none"), "optimizer_param_cpu": ("cpu", "cpu"),
         # outside the matrix, by --modes: swap files under the cell's own directory
         "param_nvme": ("cpu", "nvme"), "optimizer_param_nvme": ("nvme", "nvme")}
FULL = dict(models=["llama-0.5b", "llama-1.5b", "llama-3.6b"], seq_lens=[512, 2048], caps_gib=[8, 24],
            modes=["none", "optimizer_cpu", "optimizer_param_cpu"], steps=2, accelerator="cuda")
SMOKE = dict(models=["tiny"], seq_lens=[64], caps_gib=[8], modes=["none", "optimizer_cpu", "optimizer_param_cpu"],
             steps=2, accelerator="cpu")


@dataclass(eq=False)
class Cell:
    model: str
    mode: str
    seq_len: int
    cap_gib: int
    micro_batch: int = 1
    attn: str = "sdpa"   # model.attn_implementation
    lora: bool = False   # LoRA adapters (lora section's defaults) on the frozen base
    evaluate: bool = False  # an eval of 4 held-out sequences after every step, measured apart
    record: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return (f"{self.model}-{self.mode}-s{self.seq_len}-cap{self.cap_gib}"
                f"{'-' + self.attn if self.attn != 'sdpa' else ''}{'-lora' if self.lora else ''}"
                f"{'-eval' if self.evaluate else ''}")

    def key(self) -> tuple:
        """What decides the allocations: everything but the cap."""
        return self.model, self.mode, self.seq_len, self.micro_batch, self.attn, self.lora, self.evaluate


def run_config(cell: Cell, run_dir: Path, steps: int, host_budget: str) -> dict:
    optimizer, params = MODES[cell.mode]
    zero = {"stage": 3, "offload_optimizer": optimizer, "offload_param": params, "offload_optimizer_ratio": 1.0}
    if "nvme" in (optimizer, params):
        zero["nvme_path"] = str(run_dir.parent / "swap")
    return {
        "run_dir": str(run_dir),
        "model": {"config": cell.model, "gradient_checkpointing": True, "attn_implementation": cell.attn},
        "data": {"path": "synthetic", "synthetic_samples": 64, "eval_fraction": 0.1 if cell.evaluate else 0.0},
        "train": {"seq_len": cell.seq_len, "micro_batch_size": cell.micro_batch, "grad_accum_steps": 1,
                  "max_steps": steps, "precision": "bf16", "warmup_steps": 0},
        "zero": zero,
        "checkpoint": {"save_final": False},
        "eval": {"every_steps": 1, "max_sequences": 4} if cell.evaluate else {"at_end": False},
        "log": {"progress": False},
        "plan": {"gpu_mem": f"{cell.cap_gib}GiB", "host_mem": host_budget},
        "lora": {"enabled": cell.lora},
    }


# ------------------------------------------------------------------------ worker
def worker(cell_file: Path) -> None:
    """One cell, in its own process: cap the allocator, train, read the records back."""
    spec = json.loads(cell_file.read_text())
    import psutil
    import torch

    from zerofit.config.load import validate
    from zerofit.core import timeline
    from zerofit.train.loop import train

    on_gpu = spec["accelerator"] == "cuda"
    baseline = {}
    if on_gpu:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec["cap_gib"] * GIB / total), 0)
        torch.zeros(1, device="cuda")
        baseline["host_rss_after_cuda_init"] = psutil.Process().memory_info().rss
    started = time.time()
    if spec.get("trace_peak"):
        import peak_trace
        peak_trace.start()
    train(validate(spec["config"]), resume=False)
    traced = peak_trace.live_at_peak() if spec.get("trace_peak") else None
    run_dir = Path(spec["config"]["run_dir"])
    every = [r for r in timeline.read_timeline(run_dir) if r["phase"] in ("forward", "backward", "optimizer_step")]
    # The first window (step 1's forward) also spans the model build and deepspeed.initialize.
    rows = [r for r in every if (r["step"], r["phase"]) != (1, "forward")]
    evals = [r for r in timeline.read_timeline(run_dir) if r["phase"] == "eval"]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    metrics = [m for m in metrics if "step_seconds" in m]  # an eval's own line has none
    plan = json.loads((run_dir / "plan.json").read_text())
    result = {
        "measured_gpu_peak": max(r["gpu_peak"] for r in rows),
        "measured_gpu_peak_reserved": max(r["gpu_peak_reserved"] for r in rows),
        "measured_host_rss": max(r.get("host_peak", r["host_rss"]) for r in rows),
        "measured_host_rss_sampled": max(r["host_rss"] for r in rows),
        "measured_host_maxrss_incl_init": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "measured_gpu_peak_incl_init": max(r["gpu_peak"] for r in every),
        "measured_host_peak_incl_init": max(r["host_peak"] for r in every),
        "measured_step_seconds": metrics[-1]["step_seconds"],
        "predicted_gpu_peak": plan["predicted_gpu_peak"], "predicted_host_rss": plan["predicted_host_rss"],
        "predicted_step_seconds": plan["estimated_step_seconds"],
        "per_phase": {f'{r["step"]}:{r["phase"]}': {k: r.get(k) for k in ("gpu_peak", "host_peak", "host_rss",
                                                                          "predicted_gpu_peak", "predicted_host_rss")}
                      for r in rows},
        "predicted_components": {"gpu": plan["devices"]["gpu"]["components"],
                                 "host": plan["devices"]["host"]["components"]},
        "chosen": plan["chosen"], "seconds": round(time.time() - started, 1), **baseline,
    }
    if evals:  # measured apart: the matrix's GPU peak stays the training's
        result.update(measured_eval_gpu_peak=max(r["gpu_peak"] for r in evals),
                      predicted_eval_gpu_peak=plan["phases"]["eval"]["gpu"])
    if traced:
        result["peak_trace"] = traced
    (cell_file.parent / "result.json").write_text(json.dumps(result))


# ------------------------------------------------------------------------ parent
SPECS: dict = {}
CONTEXT_PER_PROCESS = GIB   # CUDA context and workspaces, outside the allocator's cap


def predict(cell: Cell, setup: dict, cores: int, host_budget: str) -> dict:
    """The plan for a cell, made here without touching the GPU (decides fit and scheduling)."""
    from zerofit.config.load import validate
    from zerofit.machine import hardware
    from zerofit.plan import render
    from zerofit.plan import spec as modelspec

    config = validate(run_config(cell, Path("/tmp/unused"), setup["steps"], host_budget))
    if (cell.model, cell.lora) not in SPECS:
        SPECS[cell.model, cell.lora] = modelspec.from_config(config)
    spec = SPECS[cell.model, cell.lora]
    hw = hardware.probe(disk_path=ROOT, nvme_path=config.zero.nvme_path, gpu_mem=config.plan.gpu_mem if setup["accelerator"] == "cuda" else None,
                        host_mem=host_budget, accelerator=setup["accelerator"])
    hw = hardware.with_overrides(hw, cpu_cores=cores, disk_free_bytes=10**13)
    decision, _, _ = render.plan_config(config, 1, hw=hw, spec=spec, dataset_bytes=0)
    return {"fits": decision.plan.fits, "predicted_gpu_peak": decision.plan.gpu_allocated_peak,
            "predicted_host_rss": decision.plan.host_rss_peak, "advice": decision.advice}


def prebuild_ops(accelerator: str, nvme: bool) -> None:
    """Compile DeepSpeed's cpu_adam (and fused_adam on a GPU: the optimizer of the "none"
    cells; async_io for NVMe modes) once, in parallel, before the workers start. TORCH_CUDA_ARCH_LIST is pinned
    because the arch autodetection there fails on "9.0a" (device README); the workers
    inherit it, so they load these builds instead of rebuilding."""
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    builders = ["CPUAdamBuilder"] + (["FusedAdamBuilder"] if accelerator == "cuda" else []) + \
        (["AsyncIOBuilder"] if nvme else [])
    started = time.time()
    procs = [subprocess.Popen([sys.executable, "-c", f"from deepspeed.ops.op_builder import {b}; {b}().load()"],
                              env={**os.environ, "DS_ACCELERATOR": accelerator}, stdout=subprocess.DEVNULL)
             for b in builders]
    if any(p.wait() for p in procs):
        raise SystemExit("building DeepSpeed's ops failed (see above)")
    print(f"ops {', '.join(builders)} ready in {time.time() - started:.0f}s", flush=True)


def error_pct(predicted: int, measured: int) -> float | None:
    return round(100 * (predicted - measured) / measured, 1) if measured else None


def write(out: Path, cells: list[Cell]) -> None:
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps([c.record for c in cells], indent=1))
    tmp.replace(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="2-3 tiny cells on the CPU accelerator")
    parser.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results")))
    parser.add_argument("--deadline-s", type=float, default=430,
                        help="stop here: cells still running are killed and recorded as timed out")
    parser.add_argument("--cell-timeout-s", type=float, default=300)
    parser.add_argument("--max-procs", type=int, default=6)
    parser.add_argument("--host-gib", type=float, default=None, help="host RAM to share (default: 85%% available)")
    parser.add_argument("--models", help="comma-separated subset of the matrix's models (a second run's remainder)")
    parser.add_argument("--modes", help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--seq-lens", help="comma-separated subset of the matrix's sequence lengths")
    parser.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa", help="model.attn_implementation of every cell")
    parser.add_argument("--lora", action="store_true", help="LoRA adapters (the lora section's defaults) in every cell")
    parser.add_argument("--eval", action="store_true", help="an eval after every step, its GPU peak measured apart")
    parser.add_argument("--steps", type=int, help="optimizer steps per cell (default 2; DeepSpeed's parameter trace "
                        "is recorded in step 2 and prefetches and reuses from step 3)")
    parser.add_argument("--trace-peak", action="store_true",
                        help="record the allocator's trace and list what is live at the GPU peak (bench/peak_trace.py)")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)

    import psutil

    started = time.time()
    setup = dict(SMOKE if args.smoke else FULL)
    if args.models:
        setup["models"] = args.models.split(",")
    if args.modes:
        setup["modes"] = args.modes.split(",")
    if args.seq_lens:
        setup["seq_lens"] = [int(s) for s in args.seq_lens.split(",")]
    setup["trace_peak"] = args.trace_peak
    if args.steps:
        setup["steps"] = args.steps
    subset = (args.models or args.modes or args.seq_lens or args.trace_peak or args.attn != "sdpa" or args.steps
              or args.lora or args.eval)
    out = Path(args.out) / ("planner_accuracy.json" if not subset else
                            f"planner_accuracy-{args.models or 'all'}-{args.modes or 'all'}"
                            f"{'-s' + args.seq_lens if args.seq_lens else ''}{'-trace' if args.trace_peak else ''}"
                            f"{'-' + args.attn if args.attn != 'sdpa' else ''}{f'-{args.steps}steps' if args.steps else ''}"
                            f"{'-lora' if args.lora else ''}{'-eval' if args.eval else ''}"
                            ".json".replace(",", "_"))
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"planner-accuracy-{os.getpid()}"
    host_share = int((args.host_gib or 0.85 * psutil.virtual_memory().available / GIB) * GIB)
    host_budget = f"{int(psutil.virtual_memory().available * 0.95) // 2**20}MiB"
    cores = os.cpu_count() or 1
    per_proc_cores = max(1, cores // args.max_procs)
    nvme_modes = any("nvme" in MODES[mode] for mode in setup["modes"])
    if setup["accelerator"] == "cuda" or nvme_modes:
        prebuild_ops(setup["accelerator"], nvme_modes)
    if setup["accelerator"] == "cuda":
        gpu_total = int(subprocess.run([sys.executable, "-c", "import torch;print(torch.cuda.get_device_properties(0)"
                                        ".total_memory)"], capture_output=True, text=True, check=True).stdout)
    else:
        gpu_total = 0

    cells = [Cell(m, mode, s, cap, attn=args.attn, lora=args.lora, evaluate=args.eval) for m in setup["models"] for mode in setup["modes"] for s in setup["seq_lens"]
             for cap in setup["caps_gib"]]
    todo: list[Cell] = []
    first_of: dict[tuple, Cell] = {}
    for cell in cells:
        p = predict(cell, setup, per_proc_cores, host_budget)
        cell.record = {"model": cell.model, "offload_mode": cell.mode, "seq_len": cell.seq_len, "attn": cell.attn,
                       "micro_batch": cell.micro_batch, "cap_gib": cell.cap_gib, "gradient_checkpointing": True,
                       "lora": cell.lora, "eval": cell.evaluate,
                       "fits": p["fits"], "predicted_gpu_peak": p["predicted_gpu_peak"],
                       "predicted_host_rss": p["predicted_host_rss"], "status": "pending"}
        if not p["fits"]:
            cell.record.update(status="does not fit (planner): not run", advice=p["advice"])
        elif cell.key() in first_of:  # the same allocations under a larger cap
            cell.record.update(status="shared", measured_under_cap_gib=first_of[cell.key()].cap_gib)
        else:
            first_of[cell.key()] = cell
            todo.append(cell)
    write(out, cells)
    todo.sort(key=lambda c: -c.record["predicted_host_rss"])  # the big ones first: they set the wall time
    print(f"{len(cells)} cells, {len(todo)} to run, {sum(c.record['fits'] is False for c in cells)} do not fit",
          flush=True)

    running: dict[Cell, tuple[subprocess.Popen, float]] = {}
    while todo or running:
        late = time.time() - started > args.deadline_s
        for cell, (proc, t0) in list(running.items()):
            if proc.poll() is None and time.time() - t0 < args.cell_timeout_s and not late:
                continue
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                cell.record["status"] = f"timeout after {time.time() - t0:.0f}s"
            finish(cell, proc.returncode, work / cell.name, cells)
            del running[cell]
            write(out, cells)
        host_used = sum(c.record["predicted_host_rss"] for c in running)
        gpu_used = sum(c.cap_gib * GIB + CONTEXT_PER_PROCESS for c in running)
        for cell in list(todo):
            if len(running) >= args.max_procs:
                break
            if time.time() - started + expected_seconds(cell) > args.deadline_s:
                cell.record["status"] = "not run: would not finish before the deadline"
                todo.remove(cell)
                continue
            fits_host = host_used + cell.record["predicted_host_rss"] <= host_share or not running
            fits_gpu = gpu_used + cell.cap_gib * GIB + CONTEXT_PER_PROCESS <= 0.95 * gpu_total or not gpu_total
            if fits_host and fits_gpu:
                threads = min(cores, max(per_proc_cores, round(cores * cell.record["predicted_host_rss"] / host_share)))
                running[cell] = (launch(cell, work, setup, threads, host_budget), time.time())
                todo.remove(cell)
                host_used += cell.record["predicted_host_rss"]
                gpu_used += cell.cap_gib * GIB + CONTEXT_PER_PROCESS
        time.sleep(1)
    for cell in cells:
        if cell.record["status"] == "shared":
            source = first_of[cell.key()].record
            cell.record.update({k: v for k, v in source.items() if k.startswith(("measured", "error"))},
                               status=f"shared: {source['status']}")
    write(out, cells)
    summarise(cells, time.time() - started)


def expected_seconds(cell: Cell) -> float:
    """Rough wall time of a cell: start-up, then building its host state (zeroing and
    pinning) at ~1.6 GiB/s, and two steps."""
    return 20 + 0.6 * cell.record["predicted_host_rss"] / GIB


def launch(cell: Cell, work: Path, setup: dict, cores: int, host_budget: str) -> subprocess.Popen:
    cell_dir = work / cell.name
    cell_dir.mkdir(parents=True, exist_ok=True)
    spec = {"cap_gib": cell.cap_gib, "accelerator": setup["accelerator"], "trace_peak": setup.get("trace_peak"),
            "config": run_config(cell, cell_dir / "run", setup["steps"], host_budget)}
    (cell_dir / "cell.json").write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": str(cores), "PYTHONUNBUFFERED": "1",
           "DS_ACCELERATOR": setup["accelerator"]}
    cell.record["status"] = "running"
    print(f"start {cell.name}", flush=True)
    log = open(cell_dir / "log.txt", "w")
    return subprocess.Popen([sys.executable, __file__, "--worker", str(cell_dir / "cell.json")], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT)


def finish(cell: Cell, returncode: int | None, cell_dir: Path, cells: list[Cell]) -> None:
    result_file = cell_dir / "result.json"
    if returncode == 0 and result_file.exists():
        result = json.loads(result_file.read_text())
        cell.record.update(result, status="measured")
        cell.record["error_gpu_peak_pct"] = error_pct(result["predicted_gpu_peak"], result["measured_gpu_peak"])
        cell.record["error_host_rss_pct"] = error_pct(result["predicted_host_rss"], result["measured_host_rss"])
        cell.record["error_step_seconds_pct"] = error_pct(result["predicted_step_seconds"],
                                                          result["measured_step_seconds"])
        if "measured_eval_gpu_peak" in result:
            cell.record["error_eval_gpu_peak_pct"] = error_pct(result["predicted_eval_gpu_peak"],
                                                               result["measured_eval_gpu_peak"])
    elif not cell.record["status"].startswith("timeout"):
        log = (cell_dir / "log.txt").read_text()[-3000:] if (cell_dir / "log.txt").exists() else ""
        cell.record.update(status=f"failed (exit {returncode})", log_tail=log)
    print(f"done {cell.name}: {cell.record['status']} gpu {cell.record.get('error_gpu_peak_pct')}% "
          f"host {cell.record.get('error_host_rss_pct')}%", flush=True)


def summarise(cells: list[Cell], seconds: float) -> None:
    measured = [c.record for c in cells if c.record["status"].endswith("measured")]
    within = [r for r in measured if abs(r["error_gpu_peak_pct"] or 0) <= 10 and abs(r["error_host_rss_pct"]) <= 10]
    print(f"{len(measured)} measured cells, {len(within)} within 10% on both; {seconds:.0f}s", flush=True)
    for r in measured:
        print(f"  {r['model']:11s} {r['offload_mode']:20s} s{r['seq_len']:<5d} cap {r['cap_gib']:>2d}: gpu "
              f"{r['measured_gpu_peak'] / GIB:6.2f} GiB ({r['error_gpu_peak_pct']}%), host "
              f"{r['measured_host_rss'] / GIB:6.2f} GiB ({r['error_host_rss_pct']}%)"
              + (f", eval gpu {r['measured_eval_gpu_peak'] / GIB:6.2f} GiB ({r['error_eval_gpu_peak_pct']}%)"
                 if "measured_eval_gpu_peak" in r else ""), flush=True)


if __name__ == "__main__":
    main()
