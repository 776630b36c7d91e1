"""DeepSpeed's DeepCompile with `compile.offload_opt_states`: a lever for issue 7 or not.

DeepCompile (deepspeed/compile/, `"compile": {"deepcompile": true}` and `engine.compile()`)
can move the fp32 master weights and Adam moments to pinned host memory during the forward
and backward and bring them back for the optimizer step, which then runs on the GPU. Read in
0.19.8 (compile/passes/offload_adam_states.py, offload_opt_states_inc): every state offloaded
in the forward is reloaded by the end of the backward (the last graph's `reload_opt` nodes
before its output), so the step holds all 16 bytes a parameter on the GPU; the pass plans
against `accelerator.total_memory()`, not a process's memory fraction; and ZeRO's CPU
optimizer offload is refused beside it (compile/init_z3.py). This measures that on the GPU:
per step, the forward+backward peak, the peak of the optimizer step, and the time, for

  plain     ZeRO-3, everything on the GPU, no compile (the same optimizer: torch AdamW)
  dc        DeepCompile, nothing offloaded
  dc_offload  DeepCompile with offload_opt_states, its budget set to --budget-gb
              (DS_DC_OFFLOAD_OPT_BUDGET_GB, the pass's own override) so that it offloads

each under --cap-gib when given (torch's per-process fraction, a smaller card).

Measured (bench/results/README.md, thirty-fourth session, H100): DeepCompile's schedule starts the
offload at step 1 (compile/init_z3.py), so step 0 holds every state on the GPU and OOMs under a cap
below 16 bytes a parameter; from step 1 the forward+backward peak falls and the step's does not.

GPU machine:  source .whl/prelude.sh || exit; python bench/deepcompile_probe.py --runs plain,dc_offload
Writes $OUT/deepcompile_probe-TAG.json (one entry per run: steps, peaks, the error if any).
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
GIB = 1024 ** 3
RUNS = ("plain", "dc", "dc_offload")


def ds_config(run: str, micro: int) -> dict:
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
              "bf16": {"enabled": True}, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": 3},
              # torch's AdamW on the GPU: no fused_adam JIT build, the same in every run
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": True}},
              "steps_per_print": 10 ** 9}
    if run != "plain":
        config["compile"] = {"deepcompile": True, "offload_opt_states": run == "dc_offload"}
    return config


def worker(args) -> dict:
    import deepspeed
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from zerofit.models import PRESETS

    on_gpu = torch.cuda.is_available()
    if on_gpu and args.cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GIB / total), 0)
    deepspeed.init_distributed()
    config = ds_config(args.run, args.micro)
    shape = {k: v for k, v in PRESETS[args.model].items()}
    # built whole and then partitioned by deepspeed.initialize: small models only
    model = LlamaForCausalLM(LlamaConfig(**shape)).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    compile_s = None
    if args.run != "plain":
        started = time.perf_counter()
        engine.compile()
        compile_s = time.perf_counter() - started
    generator = torch.Generator().manual_seed(0)
    record = {"run": args.run, "model": args.model, "parameters": params, "micro_batch": args.micro,
              "seq_len": args.seq, "cap_gib": args.cap_gib, "budget_gb": args.budget_gb,
              "sixteen_bytes_per_parameter_gib": 16 * params / GIB, "compile_call_s": compile_s,
              "deepspeed": deepspeed.__version__, "torch": torch.__version__, "steps": []}
    for step in range(args.steps):
        ids = torch.randint(0, shape["vocab_size"], (args.micro, args.seq), generator=generator).to(engine.device)
        if on_gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        row = {"step": step, "loss": float(loss)}
        if on_gpu:
            torch.cuda.synchronize()
            row["fwd_bwd_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
            row["before_step_allocated_gib"] = torch.cuda.memory_allocated() / GIB
            torch.cuda.reset_peak_memory_stats()
        engine.step()
        if on_gpu:
            torch.cuda.synchronize()
            row["step_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
            row["after_step_allocated_gib"] = torch.cuda.memory_allocated() / GIB
        row["seconds"] = time.perf_counter() - started
        record["steps"].append(row)
        print(json.dumps(row), flush=True)
    return record


def run_one(run: str, args, out: Path) -> dict:
    """One run in its own process (DeepCompile patches torch and DeepSpeed process-wide)."""
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + RUNS.index(run)),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if run == "dc_offload" and args.budget_gb:
        env["DS_DC_OFFLOAD_OPT_BUDGET_GB"] = str(args.budget_gb)
    result_file = out / f"deepcompile_probe-{args.tag}-{run}.part.json"
    command = [sys.executable, __file__, "--worker", run, "--result", str(result_file),
               *sys.argv[1:]]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout_s)
        rc, tail = done.returncode, (done.stdout + done.stderr)[-4000:]
    except subprocess.TimeoutExpired as stopped:
        rc, tail = "timeout", str(stopped.stdout or "")[-4000:]
    (out / f"deepcompile_probe-{args.tag}-{run}.log").write_text(tail)
    entry = json.loads(result_file.read_text()) if result_file.exists() else {"run": run}
    entry.update(rc=rc, wall_s=round(time.perf_counter() - started, 1))
    if rc != 0:
        entry["error_tail"] = tail[-1500:]
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--model", default="llama-0.5b")
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cap-gib", type=float, default=None)
    parser.add_argument("--budget-gb", type=float, default=None, help="DS_DC_OFFLOAD_OPT_BUDGET_GB for dc_offload")
    parser.add_argument("--timeout-s", type=int, default=440,
                        help="per run: DeepCompile compiles step 0 (~76 s on an H100) and again at step 1 (~89 s)")
    parser.add_argument("--tag", default="0.5b")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.run = args.worker
        record = worker(args)
        Path(args.result).write_text(json.dumps(record, indent=1))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"command": "python bench/deepcompile_probe.py " + " ".join(sys.argv[1:]), "runs": []}
    for run in args.runs.split(","):
        results["runs"].append(run_one(run, args, out))
        (out / f"deepcompile_probe-{args.tag}.json").write_text(json.dumps(results, indent=1))
        print(json.dumps({k: v for k, v in results["runs"][-1].items() if k != "error_tail"})[:600], flush=True)


if __name__ == "__main__":
    main()
