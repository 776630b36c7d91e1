"""The processes of a speed run. The parent's Runner starts one worker at a time (this file,
`--worker KIND DIR`, DIR/spec.json its input), samples its host RSS peak and kills it at its
deadline; a worker measures the roofline's rates, trains a zerofit config, or runs HF Trainer
with the stock DeepSpeed config, under a simulated smaller card (cap_gpu)."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from speed_cases import BETAS, EPS, GIB, GRAD_CLIP, LR, WEIGHT_DECAY  # noqa: E402 (after the path above)


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


# The standalone CPU-Adam rate is timed on at most this many fp32 elements (worker_roofline).
ADAM_RATE_ELEMENTS = 4_000_000_000


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
    from zerofit.config.load import validate
    from zerofit.train.loop import train

    cap_gpu(spec["cap_gib"])
    with deepspeed_changes(spec.get("deepspeed_changes")):
        train(validate(spec["config"]), resume=False)


@contextlib.contextmanager
def deepspeed_changes(changes: dict | None):
    """Bench only: DeepSpeed settings that zerofit does not offer (SuperOffload), merged into
    the DeepSpeed config zerofit builds, to measure what they would buy. The run's
    ds_config.json and plan.json's deepspeed_config show them (both come from dsconfig.build);
    the plan's predictions do not model them."""
    from zerofit.plan import deepspeed

    build = deepspeed.build
    if changes:
        deepspeed.build = lambda *args, **kwargs: merged(build(*args, **kwargs), changes)
    try:
        yield
    finally:
        deepspeed.build = build


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

    from zerofit.config.schema import ModelConfig
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


def gpu_name() -> str:
    return subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0))"],
                          capture_output=True, text=True).stdout.strip() or "cuda"


if __name__ == "__main__":  # one worker, as Runner.run starts it
    _, flag, worker_kind, worker_dir = sys.argv
    assert flag == "--worker", sys.argv
    WORKERS[worker_kind](json.loads((Path(worker_dir) / "spec.json").read_text()), Path(worker_dir))
