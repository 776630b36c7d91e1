"""Speed: zerofit's planned config vs LLaMA-Factory's ZeRO-3 offload config, side by side.

Case (issue 7): llama-1.5b preset (random init), seq 1024, 16 sequences per optimizer step,
AdamW (DeepSpeedCPUAdam wherever states are on the CPU), bf16, under an 8 GiB cap simulated
with torch.cuda.set_per_process_memory_fraction(cap / total). Each config runs in its own
process, one after the other (never two at once: they would share cores and PCIe):
  zerofit        `zerofit train` (the Python function) with the planner's choice, given
                 plan.gpu_mem = the cap and the machine's real available RAM;
  stock_lf       LLaMA-Factory's examples/deepspeed/ds_z3_offload_config.json values through
                 HF Trainer (deepspeed=dict), micro batch 1 x accumulation 16;
  stock_tuned    the same config at the largest micro batch the planner predicts to fit the
                 cap with its 10% headroom (planner.predict on the stock candidate; no probe
                 run: a probe would cost a model build). An OOM there is retried once at the
                 next smaller micro batch if the deadline allows.
The shipped file has no optimizer section, so HF Trainer would hand DeepSpeed torch's AdamW,
which then steps on the CPU ~4x slower than DeepSpeedCPUAdam (device README). For the same
optimizer everywhere the stock runs get {"optimizer": {"type": "AdamW", ...}} with zerofit's
hyper-parameters: DeepSpeed then builds DeepSpeedCPUAdam, as for zerofit.

Per config: step times of every optimizer step (the warm-up excluded: the steps holding the
first two micro batches, WARMUP_MICRO_BATCHES; `--collect` applies the same rule to earlier
runs' recorded steps), steady tokens/s, GPU peak (max_memory_allocated / reserved), host RSS peak (VmHWM, sampled by this
parent), the planner's predicted step seconds and terms for that config, and its roofline:
the bound is max(FLOPs / measured bf16 matmul rate, PCIe bytes / measured pinned rate,
CPU-Adam elements x measured DeepSpeedCPUAdam seconds per element) with FLOPs, bytes and
elements from steptime.step_work; roofline_fraction = bound / measured step seconds.
The rates are measured in the same command, first (roofline worker).

Deadlines: every config has its own, and the whole command stops at --deadline-s (default
390 s); results are rewritten after every config, so a timeout still leaves them. A second
case (3.6B @ 24 GiB) runs only when enough time is left (`--cases 1.5b,3.6b`); else it is
recorded as skipped with the reason.

GPU machine:  source .whl/prelude.sh || exit; python bench/speed_bench.py
Here (CPU):   python bench/speed_bench.py --smoke
Writes $OUT/speed.json and $OUT/speed.md (or --out; --smoke without either: a temporary directory); `--cases 3.6b` alone writes speed-3.6b.*.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from zerofit.memory import read_jsonl  # noqa: E402 (after the path above)

GIB = 2**30
CASES = {
    "1.5b": dict(model="llama-1.5b", cap_gib=8, seq_len=1024, global_batch=16, measured_steps=(5, 3, 3),
                 budgets_s=(110, 100, 140)),
    "3.6b": dict(model="llama-3.6b", cap_gib=24, seq_len=1024, global_batch=16, measured_steps=(4, 3, 3),
                 budgets_s=(170, 150, 200)),
    # needs ~190 GB of host RAM (the 2 x H200 host; the 1 x H200 one has 125 GiB)
    "8b": dict(model="llama-8b", cap_gib=24, seq_len=1024, global_batch=16, measured_steps=(3, 2, 0),
               budgets_s=(230, 200, 0), configs=("zerofit", "stock_tuned")),
    # issue 7's headline: 16-byte training states >= 10x the GPU budget (57.7 GB in 5.3 GiB), zerofit
    # alone; 5% headroom: with 10% the plan's 4.79 GiB (context and fragmentation included) misses
    # the 4.77 usable by a hair
    "3.6b-headline": dict(model="llama-3.6b", cap_gib=5.3, seq_len=1024, global_batch=16, measured_steps=(3, 0, 0),
                          budgets_s=(330, 0, 0), configs=("zerofit",), headroom=0.05),
    # where the planner chose a partial optimizer offload (ratio 0.75: predicted 2.52 s against
    # 3.01 for the whole optimizer on the CPU, and 1.02 against 1.25 s for 1.5B) until its
    # copy-out was measured (hardware.COPY_OUT_BYTES_PER_S): 6.07 s and 2.65 s
    "3.6b-40": dict(model="llama-3.6b", cap_gib=40, seq_len=1024, global_batch=16, measured_steps=(4, 0, 0),
                    budgets_s=(170, 0, 0), configs=("zerofit",)),
    "1.5b-24": dict(model="llama-1.5b", cap_gib=24, seq_len=1024, global_batch=16, measured_steps=(5, 0, 0),
                    budgets_s=(110, 0, 0), configs=("zerofit",)),
    # where it chose one with the parameters on the GPU (ratio 0.75, micro 4 x 4: 1.77 s, as fast
    # as the whole optimizer on the CPU); since the refit over that step, micro 16 x 1 with the
    # parameters offloaded: 0.69 s from step 3 on, but step 2 took 1.99 s, a third of five
    # measured steps' time (speed-3.6b-headline_0.5b-8.json): ten measured steps
    "0.5b-8": dict(model="llama-0.5b", cap_gib=8, seq_len=1024, global_batch=16, measured_steps=(10, 0, 0),
                   budgets_s=(90, 0, 0), configs=("zerofit",)),
}
# The smoke: the same path, smaller (each process's imports take ~15 s on 2 shared cores).
SMOKE_CASE = dict(model="tiny", cap_gib=8, seq_len=32, global_batch=4, measured_steps=(2, 2, 2),
                  budgets_s=(60, 60, 60))
DEFAULT_CASES = "1.5b,3.6b"
ADAM_RATE_ELEMENTS = 4_000_000_000
CONFIGS = ("zerofit", "stock_tuned", "stock_lf")   # run order: the slowest last
# zerofit's defaults (config.TrainConfig), given to every config.
LR, BETAS, EPS, WEIGHT_DECAY, GRAD_CLIP = 2e-5, (0.9, 0.95), 1e-8, 0.0, 1.0

# LLaMA-Factory examples/deepspeed/ds_z3_offload_config.json (hiyouga/LLaMA-Factory, read at
# commit 1d6e8b21), less its comms_config (verbose off) and monitor_config (a DeepSpeedMonitor
# tag with every writer off): neither changes a step. tests/test_lint.py lints the same file.
LF_Z3_OFFLOAD = json.loads((ROOT / "bench" / "configs" / "llama_factory_ds_z3_offload.json").read_text())


def stock_ds_config() -> dict:
    return {**LF_Z3_OFFLOAD, "optimizer": {"type": "AdamW", "params": {
        "lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY}}}


# ----------------------------------------------------------------------- workers
def cap_gpu(cap_gib: float) -> bool:
    """Cap this process's allocator (a smaller card); False on the CPU accelerator."""
    import torch

    if os.environ.get("DS_ACCELERATOR") == "cpu" or not torch.cuda.is_available():
        return False
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GIB / total), 0)
    torch.zeros(1, device="cuda")
    return True


def worker_roofline(spec: dict, out: Path) -> None:
    """The bound's rates: bf16 matmul, pinned host<->device copies, DeepSpeedCPUAdam."""
    import torch

    on_gpu = spec["accelerator"] == "cuda"
    result: dict = {}
    n = 8192 if on_gpu else 256
    device = "cuda" if on_gpu else "cpu"
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    reps, t0 = 20, time.perf_counter()
    for _ in range(reps):
        a @ b
    sync()
    result["matmul_flops_per_s"] = 2 * n**3 * reps / (time.perf_counter() - t0)
    result["matmul_shape"] = f"bf16 {n}^3 on {device}"
    del a, b
    nbytes = (1 * GIB) if on_gpu else 64 * 2**20
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=on_gpu)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for name, dst, src in (("h2d_bytes_per_s", dev, host), ("d2h_bytes_per_s", host, dev)):
        dst.copy_(src, non_blocking=True)
        sync()
        t0 = time.perf_counter()
        for _ in range(5):
            dst.copy_(src, non_blocking=True)
        sync()
        result[name] = 5 * nbytes / (time.perf_counter() - t0)
    result["copy_note"] = "pinned host <-> GPU, 1 GiB" if on_gpu else "no device here: a host memcpy of 64 MiB"
    del host, dev
    (out / "roofline.json").write_text(json.dumps(result))  # the rest may still time out

    from deepspeed.ops.adam import DeepSpeedCPUAdam

    # a per-element rate: memory-bound far beyond the caches, so 4e9 elements (64 GB with the
    # moments) measure an 8B model's as well as all of them would, in half the time
    numel, chunk = min(spec["adam_params"], ADAM_RATE_ELEMENTS), 100_000_000
    params = []
    for start in range(0, numel, chunk):
        p = torch.nn.Parameter(torch.full((min(chunk, numel - start),), 0.01))
        p.grad = torch.full_like(p, 1e-3)
        params.append(p)
    adam = DeepSpeedCPUAdam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, adamw_mode=True)
    adam.step()  # allocates the moments
    t0 = time.perf_counter()
    for _ in range(3):
        adam.step()
    result["cpu_adam_seconds_per_param"] = (time.perf_counter() - t0) / 3 / numel
    result["cpu_adam"] = f"DeepSpeedCPUAdam, {numel} fp32 elements, {torch.get_num_threads()} threads"
    (out / "roofline.json").write_text(json.dumps(result))


def worker_zerofit(spec: dict, out: Path) -> None:
    from zerofit.configfile import validate
    from zerofit.train import train

    cap_gpu(spec["cap_gib"])
    with deepspeed_changes(spec.get("deepspeed_changes")):
        train(validate(spec["config"]), resume=False)


@contextlib.contextmanager
def deepspeed_changes(changes: dict | None):
    """Bench only: DeepSpeed settings that zerofit does not offer (SuperOffload), merged into
    the DeepSpeed config zerofit builds, to measure what they would buy. The run's
    ds_config.json and plan.json's deepspeed_config show them (both come from dsconfig.build);
    the plan's predictions do not model them."""
    from zerofit import dsconfig

    build = dsconfig.build
    if changes:
        dsconfig.build = lambda *args, **kwargs: merged(build(*args, **kwargs), changes)
    try:
        yield
    finally:
        dsconfig.build = build


def merged(base: dict, changes: dict) -> dict:
    """base with changes laid over it, nested dicts merged key by key."""
    out = dict(base)
    for key, value in changes.items():
        out[key] = merged(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def worker_hf(spec: dict, out: Path) -> None:
    """HF Trainer + DeepSpeed as a LLaMA-Factory run drives it: TrainingArguments(deepspeed=)
    before the model, so transformers builds it under zero.Init; gradient checkpointing on."""
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from zerofit.config import ModelConfig
    from zerofit.models import hf_config

    on_gpu = cap_gpu(spec["cap_gib"])
    steps_file = out / "steps.jsonl"

    class StepClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if on_gpu:
                torch.cuda.synchronize()
            now = time.perf_counter()
            record = {"step": state.global_step, "step_seconds": now - self.last}
            if on_gpu:
                record.update(gpu_peak=torch.cuda.max_memory_allocated(),
                              gpu_peak_reserved=torch.cuda.max_memory_reserved())
            with steps_file.open("a") as f:
                f.write(json.dumps(record) + "\n")
            self.last = now

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n: int, seq: int, vocab: int):
            self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    micro, accum = spec["micro_batch"], spec["grad_accum"]
    args = TrainingArguments(
        output_dir=str(out / "hf"), per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
        max_steps=spec["steps"], learning_rate=LR, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=EPS,
        weight_decay=WEIGHT_DECAY, max_grad_norm=GRAD_CLIP, lr_scheduler_type="constant", bf16=True,
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
        deepspeed=spec["ds_config"], save_strategy="no", logging_steps=10**6, report_to="none",
        disable_tqdm=True, dataloader_num_workers=0, use_cpu=not on_gpu, seed=42)
    config = hf_config(ModelConfig(config=spec["model"]))
    torch.manual_seed(42)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.config.use_cache = False
    data = Tokens(micro * accum * spec["steps"], spec["seq_len"], config.vocab_size)
    Trainer(model=model, args=args, train_dataset=data, callbacks=[StepClock()]).train()


WORKERS = {"roofline": worker_roofline, "zerofit": worker_zerofit, "hf": worker_hf}


# ------------------------------------------------------------------------ parent
class Runner:
    """Starts one worker process at a time, samples its host RSS peak, kills it at its deadline."""

    def __init__(self, work: Path, accelerator: str, started: float, deadline_s: float):
        self.work, self.accelerator, self.started, self.deadline_s = work, accelerator, started, deadline_s

    def left(self) -> float:
        return self.deadline_s - (time.time() - self.started)

    def run(self, name: str, kind: str, spec: dict, budget_s: float) -> dict:
        out = self.work / name
        out.mkdir(parents=True, exist_ok=True)
        (out / "spec.json").write_text(json.dumps({**spec, "accelerator": self.accelerator}))
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "DS_ACCELERATOR": self.accelerator,
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000),
               "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
        budget = max(0.0, min(budget_s, self.left()))
        t0 = time.time()
        print(f"start {name} (budget {budget:.0f}s)", flush=True)
        with (out / "log.txt").open("w") as log:
            proc = subprocess.Popen([sys.executable, __file__, "--worker", kind, str(out)], cwd=ROOT, env=env,
                                    stdout=log, stderr=subprocess.STDOUT)
            host_peak, status = 0, "done"
            while proc.poll() is None:
                host_peak = max(host_peak, vm_hwm(proc.pid))
                if time.time() - t0 > budget:
                    proc.kill()
                    status = f"stopped at its deadline ({budget:.0f}s)"
                    break
                time.sleep(0.5)
            proc.wait()
        if status == "done" and proc.returncode:
            status = f"failed (exit {proc.returncode})"
        tail = (out / "log.txt").read_text()[-2500:] if status.startswith("failed") else None
        print(f"  {name}: {status} in {time.time() - t0:.0f}s", flush=True)
        return {"status": status, "wall_s": round(time.time() - t0, 1), "host_rss_peak": host_peak or None,
                "dir": out, **({"log_tail": tail} if tail else {})}


def vm_hwm(pid: int) -> int:
    """Peak RSS of a live process (VmHWM), 0 when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# ZeRO-3 records the order its modules fetch parameters in during the first forward; the second
# is the first pass over the complete trace, where DeepSpeed builds, once, the cached set of
# parameters each module may release (partitioned_param_coordinator.py, `__params_to_release`:
# 5.1 s of a cProfiled 6.4 s step, bench/results/step_profile-0.5b-8-step2.*). So the optimizer
# steps that hold the first two micro batches are warm-up, for every config alike: two steps at
# accumulation 1 (zerofit's 16 x 1 ran its second step 1.4x its later ones on llama-3.6b, 3x on
# llama-0.5b), one step otherwise.
WARMUP_MICRO_BATCHES = 2
WARMUP_RULE = "the steps holding the first two micro batches excluded (two steps at accumulation 1, else one)"


def warmup_steps(grad_accum: int) -> int:
    return -(-WARMUP_MICRO_BATCHES // grad_accum)


def steady(step_seconds: list[float], tokens_per_step: int, grad_accum: int) -> dict:
    """Tokens/s over the steps after the warm-up (WARMUP_MICRO_BATCHES)."""
    warmup = warmup_steps(grad_accum)
    measured = step_seconds[warmup:]
    record = {"warmup_steps": warmup,
              "warmup_step_seconds": [round(s, 3) for s in step_seconds[:warmup]] or None}
    if not measured:
        return {"tokens_per_s": None, "steady_step_seconds": None, "measured_steps": 0, **record}
    mean = sum(measured) / len(measured)
    return {"tokens_per_s": round(tokens_per_step / mean, 1), "steady_step_seconds": round(mean, 3),
            "measured_steps": len(measured), **record}


def zerofit_config(case: dict, run_dir: Path, steps: int, accelerator: str) -> dict:
    return {"run_dir": str(run_dir), "model": {"config": case["model"]},
            "data": {"path": "synthetic", "synthetic_samples": case["global_batch"] * (steps + 1),
                     "eval_fraction": 0.0},
            "train": {"seq_len": case["seq_len"], "global_batch_size": case["global_batch"], "max_steps": steps,
                      "precision": "bf16", "warmup_steps": 0, "lr": LR, "adam_betas": list(BETAS), "adam_eps": EPS,
                      "weight_decay": WEIGHT_DECAY, "grad_clip": GRAD_CLIP},
            "checkpoint": {"save_final": False}, "eval": {"at_end": False}, "log": {"progress": False},
            "plan": {"gpu_mem": f"{case['cap_gib']}GiB", "headroom": case.get("headroom", 0.1)}
            if accelerator == "cuda" else {}}


def planning(case: dict, accelerator: str):
    """(spec, hw) the planner sees for this case here: the cap and the real available RAM."""
    from zerofit import hardware, modelspec
    from zerofit.configfile import validate

    config = validate(zerofit_config(case, Path("/tmp/unused"), 2, accelerator))
    hw = hardware.probe(disk_path=ROOT, gpu_mem=config.plan.gpu_mem, accelerator=accelerator)
    return modelspec.from_config(config), hardware.with_overrides(hw, disk_free_bytes=10**13)


def stock_candidate(spec):
    """The LLaMA-Factory config in the planner's terms ("auto" = HF Trainer's formulas)."""
    from zerofit.planner import auto_buckets
    from zerofit.planner import Candidate

    return replace(Candidate(offload_optimizer="cpu", offload_param="cpu", sub_group_size=10**9,
                             gather_16bit_weights_on_save=True), **auto_buckets(spec))


def stock_micro_batches(case: dict, spec, hw) -> list[tuple[int, dict]]:
    """Micro batches dividing the global batch, largest first, with the planner's verdict."""
    from zerofit.planner import Shape, predict

    out = []
    for micro in sorted((m for m in range(1, case["global_batch"] + 1) if case["global_batch"] % m == 0), reverse=True):
        plan = predict(spec, hw, Shape(seq_len=case["seq_len"], micro_batch=micro, grad_accum=case["global_batch"] // micro,
                                       chunked_loss=False), stock_candidate(spec))  # HF Trainer's loss
        out.append((micro, plan))
    return out


def roofline(work: dict, rates: dict) -> dict:
    """Bound terms of one config at the measured rates; which one binds."""
    terms = {}
    if rates.get("matmul_flops_per_s"):
        terms["compute"] = work["flops"] / rates["matmul_flops_per_s"]
    if rates.get("h2d_bytes_per_s"):
        pcie = min(rates["h2d_bytes_per_s"], rates["d2h_bytes_per_s"])
        moved = work["pcie_param_bytes"] + work["pcie_grad_bytes"] + work["boundary_grad_bytes"] \
            + work["copy_back_bytes"] + work["copy_out_bytes"]
        terms["pcie"] = moved / pcie
    if rates.get("cpu_adam_seconds_per_param"):
        terms["cpu_adam"] = work["adam_host_params"] * rates["cpu_adam_seconds_per_param"]
    terms = {k: round(v, 4) for k, v in terms.items()}
    binds = max(terms, key=terms.get) if terms else None
    return {"bound_terms_s": terms, "bound_s": terms.get(binds), "binds": binds}


def run_case(label: str, case: dict, runner: Runner, rates: dict, record: dict, save,
             configs: tuple = CONFIGS, levers: tuple | None = None) -> None:
    accelerator = runner.accelerator
    spec, hw = planning(case, accelerator)
    tokens_per_step = case["global_batch"] * case["seq_len"]
    record.update(model=case["model"], params=spec.total_params, gpu_cap_gib=case["cap_gib"], seq_len=case["seq_len"],
                  global_batch=case["global_batch"], tokens_per_step=tokens_per_step,
                  host_ram_available_gib=round(hw.host_budget_bytes / GIB, 1), configs={}, tokens_per_s={})
    save()
    options = stock_micro_batches(case, spec, hw)
    tuned = [m for m, plan in options if plan.devices["gpu"].fits] or [1]
    record["stock_tuned_choice"] = {
        "how": "planner.predict on the stock candidate for every micro batch dividing the global batch; the largest "
               "whose GPU peak fits the cap less 10% headroom (no probe run)",
        "predicted_gpu_gib": {m: round(p.devices["gpu"].total_bytes / GIB, 2) for m, p in options}}
    record["states_to_gpu_budget"] = round(16 * spec.total_params / (case["cap_gib"] * GIB), 2)
    for index, name in enumerate(CONFIGS):
        if name not in configs or name not in case.get("configs", CONFIGS):
            record["configs"][name] = {"status": "not run: left out by --configs or by the case"}
            continue
        measured_steps, budget = case["measured_steps"][index], case["budgets_s"][index]
        if name == "zerofit":  # its accumulation is the planner's: room for the longest warm-up
            steps = warmup_steps(1) + measured_steps
            run_dir = runner.work / f"{label}-zerofit" / "run"
            result = runner.run(f"{label}-zerofit", "zerofit", {
                "cap_gib": case["cap_gib"], "config": zerofit_config(case, run_dir, steps, accelerator)}, budget)
            entry = zerofit_entry(run_dir, tokens_per_step)
        else:
            micros = tuned[:2] if name == "stock_tuned" else [1]
            if name == "stock_tuned" and micros[0] == 1:
                record["configs"][name] = {"status": "same as stock_lf: micro batch 1 is the largest that fits"}
                continue
            for attempt, micro in enumerate(micros):
                grad_accum = case["global_batch"] // micro
                result = runner.run(f"{label}-{name}-m{micro}", "hf", {
                    "cap_gib": case["cap_gib"], "model": case["model"], "seq_len": case["seq_len"],
                    "micro_batch": micro, "grad_accum": grad_accum, "steps": warmup_steps(grad_accum) + measured_steps,
                    "ds_config": stock_ds_config()}, budget)
                entry = hf_entry(result["dir"], tokens_per_step, micro, grad_accum)
                oom = "OutOfMemoryError" in (result.get("log_tail") or "") or "out of memory" in (result.get(
                    "log_tail") or "")
                if not oom or attempt == len(micros) - 1:
                    break
                record["configs"][f"{name}_m{micro}"] = {**entry, **result, "dir": None, "status": "OOM"}
        record["configs"][name] = complete(entry, result, spec, hw, rates, case)
        record["tokens_per_s"][name] = entry.get("tokens_per_s")
        summarise_case(record)
        save()
    run_levers(label, case, runner, rates, record, spec, hw, save, tuple(LEVERS) if levers is None else levers)


# DeepSpeed's SuperOffload (runtime/superoffload/superoffload_stage3.py) steps each optimizer
# sub group with DeepSpeedCPUAdam in a worker process as soon as the backward has its
# gradients, but only when clipping is off (`not self.clip_grad`); with clipping it steps the
# sub groups one by one after the backward. Not a zerofit option (see the README): measured
# through deepspeed_changes, here and in bench/overlap_loss.py.
SUPER_OFFLOAD = {"zero_optimization": {"offload_optimizer": {"super_offload": True}}}


def zenflow_shape(spec) -> dict:
    """What DeepSpeed 0.19.8's ZenFlow needs of a step (engine.zenflow_refusal): no activation
    checkpointing, so micro batch 4 x 4 (llama-3.6b's activations then fit 24 GiB: the
    planner's 20.3 GB, bench/results/zenflow_probe-3.6b-micro4-plan.json), and a reduce bucket
    as large as the largest trained 2-D weight."""
    return {"train.micro_batch_size": 4, "train.grad_accum_steps": 4, "model.gradient_checkpointing": False,
            "zero.reduce_bucket_size": spec.largest_trained_matrix.numel}


# One lever at a time, measured when time is left after the configs: zerofit's choice with
# one setting changed. "gain" = tokens/s of the lever on / off.
LEVERS = {
    "chunked_loss": dict(
        what="zerofit.loss (16-bit logits and a fixed fp32 chunk) vs HF's loss (fp32 copies of the logits): "
             "larger micro batches fit, fewer per step; the planner chooses again for HF's loss",
        needs=None, lever_on_in_choice=True, replan=True,
        change=lambda spec: {"train.chunked_loss": False}),
    "persistence": dict(
        what="every parameter persistent (one rank, parameters on the GPU) vs HF's auto threshold 10 x hidden",
        needs="zero.param_persistence_threshold", lever_on_in_choice=True,
        change=lambda spec: {"zero.param_persistence_threshold": 10 * spec.hidden_size}),
    "reduce_bucket": dict(
        what="the plan's larger gradient reduce bucket vs HF's auto hidden^2: fewer bucket flushes per micro "
             "batch (speed.json of 2026-11-29: every config paid ~0.6 s per micro batch, params on GPU or not)",
        needs="zero.reduce_bucket_size", lever_on_in_choice=True,
        change=lambda spec: {"zero.reduce_bucket_size": spec.hidden_size ** 2}),
    "heap_step_temporaries": dict(
        what="the optimizer step's host temporaries reused on glibc's heap (zerofit/hostalloc.py) vs a fresh "
             "mmap per sub-group and step (glibc's default above 32 MiB)",
        needs=None, lever_on_in_choice=False,
        change=lambda spec: {"train.heap_step_temporaries": True}),
    "params_on_gpu": dict(
        what="the plan's 16-bit parameters kept on the GPU vs offloaded to pinned host memory with HF's auto "
             "persistence threshold 10 x hidden (the stock config's choices), everything else as planned",
        needs=None, lever_on_in_choice=True,
        change=lambda spec: {"zero.offload_param": "cpu", "zero.param_persistence_threshold": 10 * spec.hidden_size}),
    # The planner refuses ratio 0.95 for 3.6B @ 24 GiB at the choice's micro batch 16 (21.9 GiB
    # of 21.6 usable: speed-3.6b-levers-run3.json) and predicts its only fitting alternative,
    # micro 8 x 2, slower than the choice (3.5 s against 3.0): the lever runs the choice as given
    # with the ratio changed, the planner off, so that the GPU says whether it fits and what it buys.
    "partial_offload": dict(
        what="offload_optimizer ratio 0.95 (DeepSpeed's partial offload: the first 5% of the optimizer sub groups, "
             "the embedding's among them, keep their fp32 states on the GPU and step there) vs the whole optimizer "
             "on the CPU; the rest of the choice as given, the planner's fit test off (plan.enabled false)",
        needs=None, lever_on_in_choice=False,
        change=lambda spec: {"zero.offload_optimizer_ratio": 0.95, "plan.enabled": False}),
    "whole_offload": dict(
        what="the plan's partial optimizer offload vs the whole optimizer on the CPU (ratio 1.0), the rest of "
             "the choice as given",
        needs=None, lever_on_in_choice=True,
        change=lambda spec: {"zero.offload_optimizer_ratio": 1.0}),
    "expandable_segments_off": dict(
        what="the CUDA allocator's fixed segments (memory.expandable_segments false) vs zerofit's expandable ones: "
             "whether freed pieces between activations strand a late large request under the cap",
        needs=None, lever_on_in_choice=True,
        change=lambda spec: {"memory.expandable_segments": False}),
    "grad_clip_off": dict(
        what="no gradient clipping (train.grad_clip 0) vs zerofit's 1.0, everything else as planned: what the "
             "clip costs, and the baseline SuperOffload is measured against",
        needs=None, lever_on_in_choice=False,
        change=lambda spec: {"train.grad_clip": 0.0}),
    "superoffload": dict(
        what="DeepSpeed SuperOffload (offload_optimizer.super_offload) without clipping, so that CPU-Adam runs "
             "during the backward; 'without' is grad_clip_off (the same step, no clipping, no SuperOffload)",
        needs=None, lever_on_in_choice=False, off_config="zerofit_grad_clip_off",
        change=lambda spec: {"train.grad_clip": 0.0},
        deepspeed_changes=SUPER_OFFLOAD),
    "superoffload_clipped": dict(
        what="DeepSpeed SuperOffload with zerofit's clipping (1.0): its sub groups then step after the backward",
        needs=None, lever_on_in_choice=False,
        change=lambda spec: {},
        deepspeed_changes=SUPER_OFFLOAD),
    # DeepSpeed's ZenFlow (runtime/zenflow/): each step Adam updates on the GPU only the top-k
    # gradient columns of every 2-D weight; the rest accumulate and the CPU steps them every
    # update_interval steps in its own process, overlapping the next steps: another optimizer.
    # Values of DeepSpeed's ZenFlow tutorial (docs/_tutorials/zenflow.md). zerofit builds the
    # model whole for it (engine.builds_under_zero_init) and refuses what 0.19.8 cannot run
    # (engine.zenflow_refusal): activation checkpointing, and a reduce bucket smaller than the
    # largest weight. Without checkpointing llama-3.6b's activations fit at micro batch 4 under
    # 24 GiB (the planner: 20.3 GB, bench/results/zenflow_probe-3.6b-micro4-plan.json), so its
    # "without" is the same step without ZenFlow (no_checkpointing_micro4), not the choice.
    "no_checkpointing_micro4": dict(
        what="micro batch 4 x 4 without activation checkpointing and a reduce bucket as large as the largest "
             "weight (ZenFlow's shape) vs the choice",
        needs=None, lever_on_in_choice=False,
        change=zenflow_shape),
    "zenflow": dict(
        what="DeepSpeed ZenFlow (zero_optimization.zenflow: top 5% of gradient columns updated on the GPU every "
             "step, the rest by the CPU every 4 steps, overlapped; not the same optimizer) vs the same step "
             "without it (no_checkpointing_micro4)",
        needs=None, lever_on_in_choice=False, off_config="zerofit_no_checkpointing_micro4",
        budget_s=330,  # the whole 16-bit model drawn on the host: 90-180 s for llama-3.6b
        change=zenflow_shape,
        deepspeed_changes={"zero_optimization": {"zenflow": {
            "topk_ratio": 0.05, "select_strategy": "auto", "select_interval": "auto", "update_interval": 4,
            "full_warm_up_rounds": 0, "overlap_step": True}}}),
}


# a lever runs about as long as the choice did (3.6B on 2026-11-30: 82-120 s against the
# choice's 85-102), well inside its budget: this much of the choice's wall time lets one start
LEVER_WALL_FACTOR = 1.5


def run_levers(label: str, case: dict, runner: Runner, rates: dict, record: dict, spec, hw, save,
               names: tuple) -> None:
    record["levers"] = {}
    for name in names:
        lever = LEVERS[name]
        record["levers"][name] = measure_lever(name, lever, label, case, runner, rates, record, spec, hw)
        save()


def measure_lever(name: str, lever: dict, label: str, case: dict, runner: Runner, rates: dict, record: dict,
                  spec, hw):
    choice = record["configs"].get("zerofit", {})
    chosen = choice.get("chosen_fields") or {}
    budget = lever.get("budget_s", case["budgets_s"][0])
    need = min(budget, LEVER_WALL_FACTOR * choice["wall_s"]) if choice.get("wall_s") else budget
    why_not = ("no zerofit plan" if not chosen else
               f"the plan did not choose {lever['needs']}" if lever["needs"] and lever["needs"] not in chosen else
               f"{runner.left():.0f}s left, {need:.0f}s needed" if runner.left() < need else None)
    if why_not:
        return f"not measured: {why_not}"
    run_name = f"{label}-zerofit-{name}"
    run_dir = runner.work / run_name / "run"
    config = zerofit_config(case, run_dir, warmup_steps(1) + case["measured_steps"][0], runner.accelerator)
    replan = lever.get("replan", False)  # the planner chooses again with the change, else its choice is kept
    for dotted, value in {**({} if replan else chosen), **lever["change"](spec)}.items():
        section, key = dotted.split(".")
        config.setdefault(section, {})[key] = value
    if not replan:
        config["train"].pop("global_batch_size")  # micro batch x accumulation are now given
    changes = lever.get("deepspeed_changes")
    result = runner.run(run_name, "zerofit", {"cap_gib": case["cap_gib"], "config": config,
                                              "deepspeed_changes": changes}, budget)
    entry = complete(zerofit_entry(run_dir, case["global_batch"] * case["seq_len"]), result, spec, hw, rates, case)
    if changes:
        entry["deepspeed_changes"] = changes
    record["configs"][f"zerofit_{name}"] = entry
    return lever_summary(name, record)


def lever_summary(name: str, record: dict) -> dict:
    """What a measured lever bought: its run against zerofit's choice, or against the lever's
    own baseline run when it has one (`off_config`)."""
    lever = LEVERS[name]
    baseline_tps = record["configs"].get(lever.get("off_config", "zerofit"), {}).get("tokens_per_s")
    changed_tps = record["configs"][f"zerofit_{name}"].get("tokens_per_s")
    choice_tps = record["configs"].get("zerofit", {}).get("tokens_per_s")
    on, off = (baseline_tps, changed_tps) if lever["lever_on_in_choice"] else (changed_tps, baseline_tps)
    return {"what": lever["what"], "tokens_per_s_with": on, "tokens_per_s_without": off,
            "gain": round(on / off, 2) if on and off else None,
            "gain_vs_choice": round(changed_tps / choice_tps, 2) if changed_tps and choice_tps else None}


def complete(entry: dict, result: dict, spec, hw, rates: dict, case: dict) -> dict:
    """A measured config's record: the run's outcome, the planner's prediction for it, the
    step's work and its roofline at the measured rates."""
    from zerofit.planner import Shape
    from zerofit.steptime import step_seconds, step_time_terms, step_work

    entry.update({k: v for k, v in result.items() if k != "dir"})
    shape = Shape(seq_len=case["seq_len"], micro_batch=entry["micro_batch"],
                  grad_accum=case["global_batch"] // entry["micro_batch"],
                  gradient_checkpointing=entry.get("gradient_checkpointing", True))
    cand = entry.pop("candidate", None) or stock_candidate(spec)
    work = step_work(spec, shape, cand)
    terms = step_time_terms(spec, hw, shape, cand, work=work)
    entry.setdefault("predicted_step_seconds", step_seconds(terms))
    if entry.get("predicted_gpu_peak") and entry.get("gpu_peak"):
        entry["gpu_peak_error_pct"] = round(100 * (entry["predicted_gpu_peak"] / entry["gpu_peak"] - 1), 1)
    entry.setdefault("predicted_terms_s", terms)
    entry["work"] = {k: int(v) for k, v in work.items()}
    entry.update(roofline(work, rates))
    return against_steady(entry)


def against_steady(entry: dict) -> dict:
    """The roofline fraction and the prediction's error, both against the steady step."""
    if entry.get("steady_step_seconds") and entry.get("bound_s"):
        entry["roofline_fraction"] = round(entry["bound_s"] / entry["steady_step_seconds"], 3)
        entry["prediction_error_pct"] = round(100 * (entry["predicted_step_seconds"] - entry["steady_step_seconds"])
                                              / entry["steady_step_seconds"], 1)
    return entry


def under_warmup_rule(case: dict) -> dict:
    """A case of an earlier run with its steady figures derived again from its recorded step
    times under WARMUP_RULE (runs before the twelfth session excluded the first step only)."""
    for name, entry in case["configs"].items():
        if entry.get("step_seconds") and entry.get("micro_batch"):
            grad_accum = entry.get("grad_accum") or case["global_batch"] // entry["micro_batch"]  # one GPU
            entry.update(steady(entry["step_seconds"], case["tokens_per_step"], grad_accum))
            against_steady(entry)
    case["tokens_per_s"] = {name: case["configs"].get(name, {}).get("tokens_per_s") for name in case["tokens_per_s"]}
    for name, summary in case.get("levers", {}).items():
        if isinstance(summary, dict) and name in LEVERS:
            case["levers"][name] = lever_summary(name, case)
    summarise_case(case)
    return case


def zerofit_entry(run_dir: Path, tokens_per_step: int) -> dict:
    from zerofit.planner import Candidate

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    timeline = read_jsonl(run_dir / "memory.jsonl")
    plan = json.loads((run_dir / "plan.json").read_text()) if (run_dir / "plan.json").exists() else {}
    grad_accum = plan["shape"]["grad_accum"] if plan else 1
    entry = steady([m["step_seconds"] for m in metrics], tokens_per_step, grad_accum) | {"grad_accum": grad_accum}
    entry["step_seconds"] = [round(m["step_seconds"], 3) for m in metrics]
    entry["gpu_peak"] = max((r.get("gpu_peak") or 0 for r in timeline), default=None)
    entry["gpu_peak_reserved"] = max((r.get("gpu_peak_reserved") or 0 for r in timeline), default=None)
    entry["loss"] = [round(m["loss"], 4) for m in metrics]
    if plan:
        shape, cand = plan["shape"], plan["candidate"]
        entry.update(chosen=plan["chosen"], chosen_fields=plan["chosen_fields"], micro_batch=shape["micro_batch"],
                     gradient_checkpointing=shape["gradient_checkpointing"], candidate=Candidate(**cand),
                     predicted_step_seconds=plan["estimated_step_seconds"], predicted_terms_s=plan["step_terms"],
                     predicted_gpu_peak=plan["predicted_gpu_peak"], predicted_host_rss=plan["predicted_host_rss"],
                     deepspeed_config=plan["deepspeed_config"]["zero_optimization"])
    else:
        entry.update(micro_batch=1)
    return entry


def hf_entry(out: Path, tokens_per_step: int, micro: int, grad_accum: int) -> dict:
    steps = read_jsonl(out / "steps.jsonl")
    entry = steady([s["step_seconds"] for s in steps], tokens_per_step, grad_accum) | {"grad_accum": grad_accum}
    entry.update(step_seconds=[round(s["step_seconds"], 3) for s in steps], micro_batch=micro,
                 gpu_peak=max((s.get("gpu_peak") or 0 for s in steps), default=None),
                 gpu_peak_reserved=max((s.get("gpu_peak_reserved") or 0 for s in steps), default=None),
                 chosen=f"LLaMA-Factory ds_z3_offload, micro batch {micro}")
    return entry


def summarise_case(record: dict) -> None:
    tps = record["tokens_per_s"]
    stock = max((tps.get(n) or 0 for n in ("stock_lf", "stock_tuned")), default=0)
    record["faster_stock"] = max(("stock_lf", "stock_tuned"), key=lambda n: tps.get(n) or 0) if stock else None
    record["speedup_vs_stock"] = round(tps["zerofit"] / stock, 2) if stock and tps.get("zerofit") else None
    z = record["configs"].get("zerofit", {})
    record["roofline_fraction"] = z.get("roofline_fraction")
    record["bound_terms_s"], record["binds"] = z.get("bound_terms_s"), z.get("binds")


def collected_from(case: dict) -> list[str]:
    """Where a case of a collected speed.json was measured (`--collect`)."""
    if "source" not in case:
        return []
    return [f"from `{case['source']}` ({case['device']}, {case['host']}): `{case['command']}`; "
            f"rates {json.dumps(case['rates'])}"]


def collect(files: list[str], out: Path) -> None:
    """speed.json and speed.md from the newest runs of each case: every case keeps the
    command, device, host and rates of the run it came from (one run per case is the
    side-by-side comparison; different cases may come from different runs and machines)."""
    cases = []
    for name in files:
        path, _, host = name.partition("@")
        run = json.loads(Path(path).read_text())
        for case in run["cases"]:
            if not case.get("skipped"):
                cases.append({**under_warmup_rule(case), "source": Path(path).name, "device": run["device"], "command": run["command"],
                              "host": host or "1 x H200 host: 16 cores 128 GiB", "rates": run["rates"]})
    result = {"device": ", ".join(sorted({c["device"] for c in cases})),
              "command": "python bench/speed_bench.py --collect " + ",".join(files), "warmup": WARMUP_RULE,
              "cases": cases}
    (out / "speed.json").write_text(json.dumps(result, indent=1, default=str))
    write_markdown(out / "speed.md", result)


def steps_column(config: dict) -> str:
    """warm-up + measured steps (runs before WARMUP_RULE recorded no warm-up count: one step)."""
    return f"{config.get('warmup_steps', 1)} + {config['measured_steps']}" if "measured_steps" in config else "-"


def write_markdown(path: Path, result: dict) -> None:
    lines = [f"# Speed: zerofit vs stock ZeRO-3 offload ({result['device']})", "",
             f"Command: `{result['command']}`", "",
             f"Steady step: {result.get('warmup', 'the first step excluded')}; steps = warm-up + measured.", ""]
    if result.get("rates"):
        lines += [f"Rates measured first: {json.dumps(result['rates'])}", ""]
    for case in result["cases"]:
        if case.get("skipped"):
            lines += [f"## {case['model']} @ {case.get('gpu_cap_gib')} GiB: skipped ({case['skipped']})", ""]
            continue
        lines += [f"## {case['model']} @ {case['gpu_cap_gib']} GiB, seq {case['seq_len']}, "
                  f"{case['global_batch']} sequences per step", *collected_from(case),
                  f"speedup vs the faster stock ({case.get('faster_stock')}): {case.get('speedup_vs_stock')}; "
                  f"zerofit roofline fraction {case.get('roofline_fraction')} (binds: {case.get('binds')})", "",
                  "| config | chosen | tokens/s | steady step s | steps | predicted s | GPU peak GiB | host RSS GiB "
                  "| bound s (binds) | roofline fraction | status |", "|---" * 11 + "|"]
        for name, c in case["configs"].items():
            gib = (lambda b: f"{b / GIB:.2f}" if b else "-")
            lines.append(f"| {name} | {c.get('chosen', '-')} | {c.get('tokens_per_s')} | {c.get('steady_step_seconds')} "
                         f"| {steps_column(c)} | {c.get('predicted_step_seconds')} | {gib(c.get('gpu_peak'))} "
                         f"| {gib(c.get('host_rss_peak'))} | {c.get('bound_s')} ({c.get('binds')}) "
                         f"| {c.get('roofline_fraction')} | {c.get('status')} |")
        lines.append("")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the tiny preset on the CPU accelerator")
    parser.add_argument("--out", default=None,
                        help="result directory (default $OUT, else bench/results; a temporary one for --smoke)")
    parser.add_argument("--deadline-s", type=float, default=390)
    parser.add_argument("--cases", default=DEFAULT_CASES, help="in order; a later case runs only if time is left "
                        "(another list than the default writes speed-CASES.json)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="which of the configs to run")
    parser.add_argument("--levers", default=",".join(LEVERS), help="which levers to measure, in order")
    parser.add_argument("--collect", help="FILE[@HOST],...: write speed.json and speed.md from these runs' cases "
                                          "(no measuring); HOST says which machine a file was measured on")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, out = args.worker[0], Path(args.worker[1])
        return WORKERS[kind](json.loads((out / "spec.json").read_text()), out)
    # as nvme_bench: a smoke run never writes over the GPU machine's committed results
    args.out = args.out or os.environ.get("OUT") or (tempfile.mkdtemp(prefix="speed-smoke-") if args.smoke
                                                     else str(ROOT / "bench" / "results"))
    if args.collect:
        return collect(args.collect.split(","), Path(args.out))

    started = time.time()
    accelerator = "cpu" if args.smoke else "cuda"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"speed-bench-{os.getpid()}"
    runner = Runner(work, accelerator, started, args.deadline_s)
    cases = [("tiny", SMOKE_CASE)] if args.smoke else [(c, CASES[c]) for c in args.cases.split(",")]
    result = {"device": "CPU accelerator (smoke)" if args.smoke else gpu_name(),
              "command": "python bench/speed_bench.py" + (" --smoke" if args.smoke else "")
              + (f" --cases {args.cases}" if args.cases != DEFAULT_CASES else "")
              + (f" --configs {args.configs}" if args.configs != ",".join(CONFIGS) else "")
              + (f" --levers {args.levers}" if args.levers != ",".join(LEVERS) else ""),
              "deadline_s": args.deadline_s, "warmup": WARMUP_RULE, "cases": []}

    stem = "speed" if args.cases == DEFAULT_CASES or args.smoke else f"speed-{args.cases.replace(',', '_')}"

    def save() -> None:
        result["elapsed_s"] = round(time.time() - started, 1)
        tmp = out / f"{stem}.json.tmp"
        tmp.write_text(json.dumps(result, indent=1, default=str))
        tmp.replace(out / f"{stem}.json")
        write_markdown(out / f"{stem}.md", result)

    from zerofit import modelspec
    from zerofit.configfile import validate

    first = cases[0][1]
    params = modelspec.from_config(validate(zerofit_config(first, Path("/tmp/unused"), 2, accelerator))).total_params
    # The roofline worker measures the GPU first, then builds DeepSpeed's cpu_adam (JIT, once:
    # the config workers load that build) and times it. TORCH_CUDA_ARCH_LIST: the arch
    # autodetection fails on "9.0a" there (device README); the workers inherit it.
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    rates_run = runner.run("roofline", "roofline", {"adam_params": params}, 60 if args.smoke else 150)
    if rates_run["status"] != "done":  # killed mid-build: its lock would hang every later worker
        from zerofit import opbuild

        for lock in opbuild.build_locks():
            if not lock.held_open:
                lock.path.unlink(missing_ok=True)
    rates_file = rates_run["dir"] / "roofline.json"
    result["rates"] = json.loads(rates_file.read_text()) if rates_file.exists() else {}
    result["rates"]["status"] = rates_run["status"]
    save()
    for label, case in cases:
        need = sum(case["budgets_s"]) * (0.6 if result["cases"] else 0)
        if runner.left() < max(need, 60):
            result["cases"].append({"model": case["model"], "gpu_cap_gib": case["cap_gib"],
                                    "skipped": f"{runner.left():.0f}s left of the {args.deadline_s:.0f}s deadline; "
                                               f"it needs ~{need:.0f}s: run `--cases {label}` on its own"})
            save()
            continue
        record: dict = {}
        result["cases"].append(record)
        run_case(label, case, runner, result["rates"], record, save, tuple(args.configs.split(",")),
                 tuple(filter(None, args.levers.split(","))))
    save()
    print(json.dumps({f'{c.get("model")} @ {c.get("gpu_cap_gib")} GiB': {
        "tokens_per_s": c.get("tokens_per_s"), "speedup": c.get("speedup_vs_stock"),
        "roofline_fraction": c.get("roofline_fraction")} for c in result["cases"]}), flush=True)
    print(f"wrote {out / stem}.json in {time.time() - started:.0f}s", flush=True)


def gpu_name() -> str:
    return subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0))"],
                          capture_output=True, text=True).stdout.strip() or "cuda"


if __name__ == "__main__":
    main()
