"""HF Trainer + LLaMA-Factory's ds_z3_offload config with an eval every few steps, twice in one
run: MemoryGuardCallback partitioning what each eval batch left gathered (its default) and not
(HF Trainer's own behaviour). Per run: each step's forward_backward GPU peak from memory.jsonl,
the evals' peaks, seconds per phase, and what `zerofit doctor` finds (under a --gpu-cap-gib
budget, 24 by default). Result: $OUT/hf_eval_leftovers-MODEL.json.

    python bench/hf_eval_leftovers.py [--model llama-1.5b --seq-len 1024 --micro-batch 4 --steps 8]
    python bench/hf_eval_leftovers.py --model tiny --seq-len 64 --steps 6   # CPU smoke
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
LF_Z3_OFFLOAD = json.loads((ROOT / "bench" / "configs" / "llama_factory_ds_z3_offload.json").read_text())
EVAL_EVERY = 2
EVAL_ROWS_PER_BATCH = 4  # an eval of 4 batches


def worker(args, out: Path, release: bool) -> None:
    """One Trainer run (its own process: DeepSpeed's engine and process group are per process)."""
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from zerofit.config.schema import ModelConfig
    from zerofit.integrations.hf_trainer import MemoryGuardCallback
    from zerofit.models import hf_config

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n: int, seq: int, vocab: int, seed: int):
            self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    on_gpu = torch.cuda.is_available()
    if on_gpu:  # a smaller card: the allocator capped, and the doctor's floor from that budget
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_cap_gib * 2**30 / total), 0)
    training = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=args.micro_batch, per_device_eval_batch_size=args.micro_batch,
        max_steps=args.steps, eval_strategy="steps", eval_steps=EVAL_EVERY, save_strategy="no", learning_rate=2e-5,
        lr_scheduler_type="constant", bf16=on_gpu, gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False}, deepspeed=LF_Z3_OFFLOAD, logging_steps=10**6,
        report_to="none", disable_tqdm=True, use_cpu=not on_gpu, seed=42)
    config = hf_config(ModelConfig(config=args.model))
    torch.manual_seed(42)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if on_gpu else torch.float32,
                                             attn_implementation="sdpa")
    model.config.use_cache = False
    train = Tokens(args.micro_batch * args.steps, args.seq_len, config.vocab_size, 0)
    held_out = Tokens(args.micro_batch * EVAL_ROWS_PER_BATCH, args.seq_len, config.vocab_size, 1)
    Trainer(model=model, args=training, train_dataset=train, eval_dataset=held_out,
            callbacks=[MemoryGuardCallback(release_after_eval=release,
                                           gpu_mem=f"{args.gpu_cap_gib}GiB" if on_gpu else None)]).train()


def summary(out: Path) -> dict:
    from zerofit.core.files import read_jsonl
    from zerofit.doctor.run import diagnose

    records = read_jsonl(out / "memory.jsonl")
    found = diagnose(out).findings
    since_previous = {(r["step"], r["phase"]): round(r["time"] - before["time"], 3)
                      for before, r in zip(records, records[1:])}
    return {"forward_backward_gpu_peak": {r["step"]: r.get("gpu_peak") for r in records
                                          if r["phase"] == "forward_backward"},
            "eval_gpu_peak": {r["step"]: r.get("gpu_peak") for r in records if r["phase"] == "eval"},
            "eval_released_gathered": [r.get("released_gathered") for r in records if r["phase"] == "eval"],
            "seconds": {f"{step} {phase}": t for (step, phase), t in since_previous.items()
                        if phase in ("forward_backward", "eval")},
            "findings": [{"kind": f.kind, "device": f.device, "title": f.title, "fix": f.fix} for f in found]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1.5b")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--gpu-cap-gib", type=float, default=24.0)
    parser.add_argument("--worker", choices=["released", "kept"], help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args, Path(args.work), args.worker == "released")
    results = Path(os.environ.get("OUT", ROOT / "bench" / "results"))
    work = results / "hf_eval_leftovers-runs"
    record = {"command": "python bench/hf_eval_leftovers.py " + " ".join(sys.argv[1:]), "model": args.model,
              "gpu_cap_gib": args.gpu_cap_gib,
              "seq_len": args.seq_len, "micro_batch": args.micro_batch, "steps": args.steps, "eval_every": EVAL_EVERY,
              "eval_batches": EVAL_ROWS_PER_BATCH, "ds_config": "bench/configs/llama_factory_ds_z3_offload.json",
              "runs": {}}
    for name in ("released", "kept"):
        out = work / name
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + len(record["runs"])),
               "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        started = time.perf_counter()
        done = subprocess.run([sys.executable, __file__, "--worker", name, "--work", str(out), "--model", args.model,
                               "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
                               "--steps", str(args.steps), "--gpu-cap-gib", str(args.gpu_cap_gib)], env=env, capture_output=True, text=True)
        entry = {"rc": done.returncode, "seconds": round(time.perf_counter() - started, 1)}
        entry.update(summary(out) if done.returncode == 0 else {"stderr_tail": done.stderr[-3000:]})
        record["runs"][name] = entry
        print(name, json.dumps(entry)[:2000], flush=True)
    (results / f"hf_eval_leftovers-{args.model}.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
