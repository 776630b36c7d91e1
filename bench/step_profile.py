"""Where an optimizer step of zerofit's planned config spends its time (issue 7: the cost
model misses zerofit's steps by 36-44%, bench/results/README.md).

Runs `zerofit train` (the Python function) on a speed_bench case with the planner's choice,
and around its steps:
- every step: wall seconds of forward, backward and optimizer step, each ended by a
  torch.cuda.synchronize() (ZeRO-3's hooks run inside forward and backward; DeepSpeed's
  optimizer step holds the gradient norm, the unscale, CPU-Adam and the copy of the 16-bit
  parameters back);
- every step: what the allocators and the host did during it (`StepCounters`): CUDA
  segments and device allocations, reserved bytes, torch's pinned host allocations and their
  time, the process's page faults and CPU seconds, the time in Python's garbage collector;
- the steps of --cprofile-steps (default: --profile-step) under cProfile: the Python functions
  with the most cumulative time (DeepSpeed's stage-3 functions by name);
- the steps of --torch-profile-steps (default: the one after --profile-step) under
  torch.profiler (CPU and CUDA): the operators with the most self time.
Two steps of each kind side by side (e.g. `--cprofile-steps 2,4`) show what one has that the
other lacks: zerofit's second step is slow at one micro batch per step (bench/results/README.md).

GPU machine (~4 min for 3.6b):
    source .whl/prelude.sh || exit; python bench/step_profile.py --case 3.6b
    python bench/step_profile.py --case 0.5b-8 --steps 6 --cprofile-steps 2,4 --torch-profile-steps "" --tag step2
Here (CPU):  python bench/step_profile.py --smoke
Writes $OUT/step_profile-<case>.json and .txt (or --out).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import speed_cases  # noqa: E402 (after the path above)
import speed_workers  # noqa: E402

TOP = 40


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class PhaseClock:
    """Wraps the engine's backward and step (instance attributes) so each one's wall time,
    synchronized at its end, is recorded; forward is the rest of the micro step."""

    def __init__(self, ds_engine):
        self.seconds = {"backward": 0.0, "optimizer_step": 0.0}
        for name, key in (("backward", "backward"), ("step", "optimizer_step")):
            setattr(ds_engine, name, self._timed(getattr(ds_engine, name), key))

    def _timed(self, method, key):
        def timed(*args, **kwargs):
            synchronize()
            started = time.perf_counter()
            out = method(*args, **kwargs)
            synchronize()
            self.seconds[key] += time.perf_counter() - started
            return out
        return timed

    def take(self) -> dict:
        taken, self.seconds = self.seconds, {k: 0.0 for k in self.seconds}
        return taken


def torch_profile_table(run, sort_by: str) -> tuple[list[dict], str]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        run()
    averages = prof.key_averages()
    rows = []
    for e in sorted(averages, key=lambda e: getattr(e, sort_by, 0), reverse=True)[:TOP]:
        rows.append({"name": e.key, "count": e.count, "self_cpu_s": round(e.self_cpu_time_total / 1e6, 4),
                     "cpu_total_s": round(e.cpu_time_total / 1e6, 4),
                     "self_device_s": round(getattr(e, "self_device_time_total", 0) / 1e6, 4)})
    return rows, averages.table(sort_by=sort_by, row_limit=TOP)


class StepCounters:
    """What the allocators and the host did during one step: the differences of cumulative
    counters between `start` and `stop`, and the reserved bytes at the end. Page faults count
    first touches of host memory; pinned allocations (cudaHostAlloc) are torch's caching
    host allocator's; a device allocation is a cudaMalloc (or, with expandable segments, a
    mapping grown)."""

    def __init__(self):
        import gc

        self.gc_seconds, self._gc_started, self.oldest_collections = 0.0, None, 0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            self.gc_seconds += time.perf_counter() - self._gc_started
            if info.get("generation") == 2:
                self.oldest_collections += 1

    @staticmethod
    def _cumulative() -> dict:
        import resource

        import torch

        usage = resource.getrusage(resource.RUSAGE_SELF)
        now = {"minor_page_faults": usage.ru_minflt, "major_page_faults": usage.ru_majflt,
               "cpu_seconds": usage.ru_utime + usage.ru_stime}
        if torch.cuda.is_available():
            stats = torch.cuda.memory_stats()
            now.update(cuda_segments_allocated=stats.get("segment.all.allocated", 0),
                       cuda_device_allocs=stats.get("num_device_alloc", 0),
                       cuda_alloc_retries=stats.get("num_alloc_retries", 0))
            host = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
            now.update(pinned_host_allocs=host.get("num_host_alloc", 0),
                       pinned_host_alloc_seconds=host.get("host_alloc_time.total", 0) / 1e6)  # microseconds
        return now

    def start(self) -> None:
        self._before, self._gc_before, self._oldest_before = self._cumulative(), self.gc_seconds, self.oldest_collections

    def stop(self) -> dict:
        import torch

        after = self._cumulative()
        delta = {k: round(after[k] - self._before.get(k, 0), 3) for k in after}
        delta["gc_seconds"] = round(self.gc_seconds - self._gc_before, 3)
        delta["gc_oldest_generation_collections"] = self.oldest_collections - self._oldest_before
        if torch.cuda.is_available():
            delta["cuda_reserved_gib_at_end"] = round(torch.cuda.memory_reserved() / 2**30, 3)
        return delta


def worker(spec: dict, out: Path) -> None:
    from zerofit.config.load import validate
    from zerofit.train import loop as train_module

    speed_workers.cap_gpu(spec["cap_gib"])
    original = train_module.train_step
    record = {"steps": [], "cprofile": {}, "torch_profile": {}, "torch_profile_table": {}}
    clock, counters = None, StepCounters()

    def profiled_step(ds_engine, *args, **kwargs):
        nonlocal clock
        clock = clock or PhaseClock(ds_engine)
        n = len(record["steps"]) + 1
        run = lambda: original(ds_engine, *args, **kwargs)  # noqa: E731
        if n == 1:
            import gc

            record["gc_tracked_objects_at_start"] = len(gc.get_objects())
            if spec.get("gc_freeze"):  # what the run has built so far leaves the collector's generations
                gc.collect()
                gc.freeze()
                record["gc_frozen_objects"] = gc.get_freeze_count()
        synchronize()
        counters.start()
        started = time.perf_counter()
        if n in spec["cprofile_steps"]:
            profiler = cProfile.Profile()
            loss = profiler.runcall(run)
            text = io.StringIO()
            stats = pstats.Stats(profiler, stream=text)
            stats.sort_stats("cumulative").print_stats(2 * TOP)
            stats.sort_stats("tottime").print_stats(TOP)
            record["cprofile"][str(n)] = text.getvalue()
        elif n in spec["torch_profile_steps"]:
            holder = {}
            rows, table = torch_profile_table(lambda: holder.setdefault("loss", run()), spec["sort_by"])
            loss, record["torch_profile"][str(n)], record["torch_profile_table"][str(n)] = holder["loss"], rows, table
        else:
            loss = run()
        synchronize()
        total = time.perf_counter() - started
        phases = clock.take()
        phases["forward_and_rest"] = total - sum(phases.values())
        record["steps"].append({"step": n, "seconds": round(total, 3),
                                "profiled": n in spec["cprofile_steps"] or n in spec["torch_profile_steps"],
                                **{k: round(v, 3) for k, v in phases.items()}, "counters": counters.stop()})
        print(f"step {n}: {record['steps'][-1]}", flush=True)
        (out / "record.json").write_text(json.dumps(record))
        return loss

    train_module.train_step = profiled_step
    train_module.train(validate(spec["config"]), resume=False)


def step_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="3.6b", choices=sorted(speed_cases.CASES))
    parser.add_argument("--smoke", action="store_true", help="the tiny preset on the CPU accelerator")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--profile-step", type=int, default=5,
                        help="cProfile this step, torch.profiler the next (unless the two below say otherwise)")
    parser.add_argument("--cprofile-steps", help="steps under cProfile, comma separated (\"\": none)")
    parser.add_argument("--torch-profile-steps", help="steps under torch.profiler, comma separated (\"\": none)")
    parser.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results")))
    parser.add_argument("--gc-freeze", action="store_true",
                        help="gc.collect() and gc.freeze() before step 1: the objects built so far are never traversed again")
    parser.add_argument("--tag", default="", help="appended to the result's name (step_profile-<case>-<tag>)")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        spec_path, out = args.worker
        worker(json.loads(Path(spec_path).read_text()), Path(out))
        return

    import torch

    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    case = dict(speed_cases.CASES[args.case])
    if args.smoke:
        case.update(model="tiny", seq_len=64, global_batch=4)
    work = Path(f"/tmp/zerofit-step-profile-{args.case}")
    work.mkdir(parents=True, exist_ok=True)
    config = speed_cases.zerofit_config(case, work / "run", args.steps, accelerator)
    spec = {"config": config, "cap_gib": case["cap_gib"] if accelerator == "cuda" else None,
            "cprofile_steps": step_list(str(args.profile_step) if args.cprofile_steps is None else args.cprofile_steps),
            "torch_profile_steps": step_list(str(args.profile_step + 1) if args.torch_profile_steps is None
                                             else args.torch_profile_steps),
            "sort_by": "self_cpu_time_total", "gc_freeze": args.gc_freeze}
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec))
    started = time.perf_counter()
    # a process of its own, as speed_bench runs every config: the parent stays clean
    code = subprocess_run([sys.executable, __file__, "--worker", str(spec_path), str(work)])
    record = json.loads((work / "record.json").read_text()) if (work / "record.json").exists() else {"steps": []}
    plan = json.loads((work / "run" / "plan.json").read_text()) if (work / "run" / "plan.json").exists() else {}
    result = {"command": "python " + " ".join(sys.argv), "device": speed_workers.gpu_name(), "case": case,
              "exit_code": code, "wall_s": round(time.perf_counter() - started, 1),
              "chosen": plan.get("chosen"), "estimated_step_seconds": plan.get("estimated_step_seconds"),
              "estimated_terms": plan.get("step_terms"),
              "steps": record["steps"], "gc_freeze": args.gc_freeze,
              "gc_tracked_objects_at_start": record.get("gc_tracked_objects_at_start"),
              "gc_frozen_objects": record.get("gc_frozen_objects"), "torch_profile_sorted_by": spec["sort_by"],
              "torch_profile": record.get("torch_profile"), "cprofile_top": record.get("cprofile")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"step_profile-{args.case}" + ("-smoke" if args.smoke else "") + (f"-{args.tag}" if args.tag else "")
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    profiles = [f"==== step {n}: cProfile\n{text}" for n, text in record.get("cprofile", {}).items()] + \
        [f"==== step {n}: torch.profiler\n{text}" for n, text in record.get("torch_profile_table", {}).items()]
    if profiles:
        (out / f"{name}.txt").write_text("\n".join(profiles))
    print(json.dumps(result["steps"], indent=1))
    print(f"-> {out / name}.json" + (" and .txt" if profiles else ""))


def subprocess_run(argv: list[str]) -> int:
    import subprocess

    return subprocess.run(argv, check=False).returncode


if __name__ == "__main__":
    main()
