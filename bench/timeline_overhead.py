"""Timeline overhead bench: what recording memory.jsonl costs a training step (issue 5
target: <= 2% of the step time), on a >= 0.5B model on the GPU.

GPU machine (~2-3 min including DeepSpeed's cpu_adam build; writes $OUT/timeline_overhead.json):
    source .whl/prelude.sh || exit; python bench/timeline_overhead.py
CPU smoke test of the same code path with the tiny model (< 1 min):
    python bench/timeline_overhead.py --smoke

Measured:
- A/B steps: zerofit.train.loop.train_step on one engine, in interleaved blocks of steps with
  no timeline (a no-op recorder), with the Timeline, and with the Timeline plus the
  allocator history the OOM post-mortem keeps (torch.cuda.memory._record_memory_history,
  Python stacks, memory.history_max_entries); median step seconds per variant.
- Microbench: the cost of one Timeline.observe and one flush, timed over many calls
  on the same device, and the overhead it implies per step
  (3 x grad_accum observes + 1 flush) / median step time: the robust figure, since
  A/B differences of a few milliseconds are within step-time noise.
- Pinned-memory accounting: after pinning 256 MiB through torch, how much of it shows in
  torch.cuda.host_memory_stats and in VmLck (does `pinned` count it once or twice?).
- GPU-only paths the CPU tests cannot reach, checked once: the budgets and the watchdog's
  reading, a real CUDA OOM (under a tightened per-process cap) parsed by the post-mortem,
  and the allocator snapshot dumped and loaded back.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU: the same code path in seconds")
    parser.add_argument("--preset", default="llama-0.5b")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--steps-per-block", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=3, help="rounds of (off, timeline, timeline+history)")
    parser.add_argument("--gpu-cap-gib", type=float, default=None, help="simulate a smaller GPU")
    parser.add_argument("--out", default=None, help="result directory (default $OUT, else bench/results)")
    args = parser.parse_args()
    if args.smoke:
        args.preset, args.seq_len, args.micro_batch, args.steps_per_block, args.blocks = "tiny", 64, 2, 3, 2
    return args


class NoTimeline:
    """The loop's recorder with nothing recorded: the A/B baseline."""
    last_phase = None

    def observe(self, phase):
        return {}

    def flush(self, step, **extra):
        return []


class RandomBatches:
    """Random token micro batches of the run's shape (what train_step pulls)."""

    def __init__(self, vocab: int, micro_batch: int, seq_len: int):
        import numpy as np

        self.rng, self.shape, self.vocab = np.random.default_rng(0), (micro_batch, seq_len), vocab
        self.position = 0

    def step_targets(self, accum: int):
        """Every token after each row's first is learned (zerofit.data.pipeline.Batches.step_targets); one rank."""
        per_batch = self.shape[0] * (self.shape[1] - 1)
        return [per_batch] * accum, per_batch * accum

    def next(self):
        from zerofit.data.pipeline import MicroBatch

        ids = self.rng.integers(0, self.vocab, size=self.shape, dtype="int64")
        self.position += 1
        return MicroBatch(ids, ids.copy())


def build(args, run_dir: Path):
    from zerofit.config.load import validate
    from zerofit.models import hf_config
    from zerofit.plan import deepspeed as dsconfig
    from zerofit.train import engine, ranks

    config = validate({
        "run_dir": str(run_dir), "model": {"config": args.preset, "gradient_checkpointing": True},
        "data": {"path": "synthetic"},
        "train": {"seq_len": args.seq_len, "micro_batch_size": args.micro_batch, "grad_accum_steps": args.grad_accum,
                  "max_steps": 10**6, "lr": 1e-5, "precision": "bf16"},
        "zero": {"stage": 3, "offload_optimizer": "cpu"}, "log": {"progress": False}})
    dist = ranks.init_distributed()
    if dist.on_gpu and args.gpu_cap_gib:
        import torch

        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_cap_gib * 2**30 / total))
    ds_config = dsconfig.build(config, dist.world_size, dist.on_gpu)
    model = engine.build_model(config, ds_config)
    params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    ds_engine = engine.build_engine(model, config, ds_config, total_steps=10**6)
    return config, dist, ds_engine, params, hf_config(config.model).vocab_size


def timed_steps(ds_engine, batches, recorder, dist, accum: int, steps: int, first_step: int) -> list[float]:
    from zerofit.train.loop import train_step

    seconds = []
    for step in range(first_step, first_step + steps):
        started = time.perf_counter()
        train_step(ds_engine, batches, accum, recorder, dist, step)  # returns a float: the step is synced
        recorder.flush(step)
        seconds.append(time.perf_counter() - started)
    return seconds


def history_unusable(config, on_gpu: bool) -> str | None:
    """Why the allocator-history variant cannot run here, as zerofit itself decides for a
    run (postmortem.start_recording): pytorch#179536 under activation checkpointing."""
    import torch

    from zerofit.recovery import postmortem

    if on_gpu and config.model.gradient_checkpointing and postmortem.history_breaks_checkpointing(torch.__version__):
        return (f"torch {torch.__version__}: allocator history breaks DeepSpeed's ZeRO-3 linear under activation "
                "checkpointing (pytorch#179536, SystemError on the H200 run); zerofit keeps it off there too")
    return None


def set_history(on: bool, on_gpu: bool, entries: int) -> None:
    if not on_gpu:
        return
    import torch

    if on:
        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=entries)
    else:
        torch.cuda.memory._record_memory_history(enabled=None)


def microbench(run_dir: Path, on_gpu: bool, calls: int) -> dict:
    from zerofit.core.timeline import Timeline

    timeline = Timeline(run_dir / "micro", 0, on_gpu)
    started = time.perf_counter()
    for i in range(calls):
        timeline.observe(("forward", "backward", "optimizer_step")[i % 3])
    observe_s = (time.perf_counter() - started) / calls
    flushes = max(10, calls // 20)
    started = time.perf_counter()
    for step in range(flushes):
        timeline.observe("forward")
        timeline.flush(step)
    flush_s = (time.perf_counter() - started) / flushes - observe_s
    timeline.close()
    return {"observe_us": round(observe_s * 1e6, 2), "flush_us": round(flush_s * 1e6, 2), "calls": calls}


def pinned_accounting(on_gpu: bool) -> dict:
    if not on_gpu:
        return {"note": "no CUDA: nothing is pinned on CPU"}
    import torch

    from zerofit.core.timeline import proc_status

    def torch_pinned():
        return torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)

    before_torch, before_locked = torch_pinned(), proc_status()["VmLck"]
    buffer = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=True)
    result = {"pinned_bytes": buffer.numel(), "torch_host_stats_delta": torch_pinned() - before_torch,
              "vmlck_delta": proc_status()["VmLck"] - before_locked}
    del buffer
    result["double_counted"] = result["torch_host_stats_delta"] > 0 and result["vmlck_delta"] > 0
    return result


def gpu_paths(run_dir: Path, on_gpu: bool, step_records: list[dict]) -> dict:
    if not on_gpu:
        return {"note": "no CUDA: the GPU-only paths are not exercised on CPU"}
    import pickle

    import torch

    from zerofit.core.timeline import budgets
    from zerofit.findings.facts import RunFacts
    from zerofit.recovery import postmortem
    from zerofit.train.watchdog import Watchdog

    found = {"budgets": budgets(True)}
    facts = RunFacts(gpu_budget=found["budgets"]["gpu_budget"], host_budget=found["budgets"]["host_budget"],
                     host_total=found["budgets"]["host_total"])
    dog = Watchdog(facts, 0.0001, "warn", on_gpu=True)
    crossing = dog.check(0, step_records)
    found["watchdog"] = crossing.record() if crossing else None
    total = torch.cuda.get_device_properties(0).total_memory
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    before = getter() if getter else 1.0
    torch.cuda.empty_cache()  # cached free blocks would serve the request below (the 2026-11-29 run: no OOM)
    cap = min(total, torch.cuda.memory_reserved() + 2**30)
    torch.cuda.set_per_process_memory_fraction(cap / total)
    asked = cap - torch.cuda.memory_allocated() + 2**30  # 1 GiB more than the cap leaves
    try:
        torch.empty(asked, dtype=torch.uint8, device="cuda")
        found["oom"] = "no OOM raised under the tightened cap"
    except torch.OutOfMemoryError as error:
        found["oom"] = {"message": str(error)[:400], "is_oom": postmortem.is_oom(error),
                        "device": postmortem.oom_device(error, True),
                        "requested_bytes": postmortem.parse_requested_bytes(str(error)), "asked_bytes": asked}
    finally:
        torch.cuda.set_per_process_memory_fraction(before)
    set_history(True, True, 10_000)
    torch.ones(2**20, device="cuda").sum()
    path, note = postmortem.dump_snapshot(run_dir, True)  # also stops the recording
    found["snapshot"] = {"path_written": path is not None, "note": note}
    if path:
        snapshot = pickle.loads(Path(path).read_bytes())
        found["snapshot"].update(bytes=Path(path).stat().st_size, segments=len(snapshot.get("segments", [])),
                                 trace_entries=sum(len(t) for t in snapshot.get("device_traces", [])))
    return found


def main() -> None:
    args = parse_args()
    out = Path(args.out or os.environ.get("OUT") or Path(__file__).parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="zerofit-timeline-bench-"))
    from zerofit.core.timeline import Timeline

    config, dist, ds_engine, params, vocab = build(args, run_dir)
    batches = RandomBatches(vocab, args.micro_batch, args.seq_len)
    accum, steps = args.grad_accum, args.steps_per_block
    entries = config.memory.history_max_entries
    timed_steps(ds_engine, batches, NoTimeline(), dist, accum, 2, 1)  # warm-up: optimizer states, caches
    variants = {"off": [], "timeline": [], "timeline+history": []}
    history_skipped = history_unusable(config, dist.on_gpu)
    if history_skipped:
        del variants["timeline+history"]
    step = 3
    timeline = Timeline(run_dir, 0, dist.on_gpu)
    for _ in range(args.blocks):
        for name in variants:
            set_history(name == "timeline+history", dist.on_gpu, entries)
            recorder = NoTimeline() if name == "off" else timeline
            variants[name] += timed_steps(ds_engine, batches, recorder, dist, accum, steps, step)
            step += steps
    set_history(False, dist.on_gpu, entries)
    timeline.close()
    medians = {name: statistics.median(s) for name, s in variants.items()}
    micro = microbench(run_dir, dist.on_gpu, 300 if args.smoke else 3000)
    per_step_s = (3 * accum * micro["observe_us"] + micro["flush_us"]) / 1e6
    result = {
        "model": args.preset, "params": params, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
        "grad_accum": accum, "device": device_name(dist.on_gpu), "gpu_cap_gib": args.gpu_cap_gib,
        "steps_per_variant": len(variants["off"]), "median_step_seconds": {k: round(v, 4) for k, v in medians.items()},
        "ab_overhead_pct": {name: round(100 * (medians[name] / medians["off"] - 1), 2)
                            for name in variants if name != "off"},
        "history_skipped": history_skipped,
        "microbench": micro, "timeline_seconds_per_step": round(per_step_s, 6),
        "timeline_overhead_pct": round(100 * per_step_s / medians["off"], 3),
        "target_pct": 2.0, "pinned_accounting": pinned_accounting(dist.on_gpu),
        "gpu_paths": gpu_paths(run_dir, dist.on_gpu, [timeline.last]),
        "history_max_entries": entries, "versions": versions(), "smoke": args.smoke,
        "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
    }
    result["meets_target"] = result["timeline_overhead_pct"] <= 2.0 and result["ab_overhead_pct"]["timeline"] <= 2.0
    path = out / "timeline_overhead.json"
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    print(f"wrote {path}")


def device_name(on_gpu: bool) -> str:
    if not on_gpu:
        return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    import torch

    return torch.cuda.get_device_name(0)


def versions() -> dict:
    import deepspeed
    import torch
    import transformers

    return {"torch": torch.__version__, "deepspeed": deepspeed.__version__, "transformers": transformers.__version__}


if __name__ == "__main__":
    main()
