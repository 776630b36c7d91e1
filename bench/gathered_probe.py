"""What DeepSpeed keeps gathered, module by module, against the planner's replay of it.

The planner replays ZeRO-3's parameter coordinator over the model's module trace
(zerofit/zerotrace.gathered_numel) to say how many parameter elements are gathered on the
GPU at each moment of a step. This runs a real `zerofit train` (planner_accuracy.py's cell
configuration) with DeepSpeed's PartitionedParameterCoordinator wrapped: after every
fetch_sub_module and release_sub_module of every hooked module (parameterless ones too: each
fetch call prefetches) it records the elements of every parameter not NOT_AVAILABLE, per step
(reset_step). Written to
gathered_probe-<model>-<mode>-s<seq>.json with the replay's numbers for the same trace, so a
divergence shows at the module where it starts.

    python bench/gathered_probe.py --model llama-1.5b --mode optimizer_param_cpu --seq-len 512 --steps 3
    python bench/gathered_probe.py --model llama-1.5b --mode optimizer_param_cpu --seq-len 512 --steps 3 --lora
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]


def probe(model_name: str, mode: str, seq_len: int, steps: int, work: Path, zero: dict, lora: bool,
          evaluate: bool = False) -> dict:
    """Train one cell with the coordinator wrapped; the events of every step."""
    import planner_accuracy
    from deepspeed.runtime.zero import partitioned_param_coordinator as ppc
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from zerofit.config.load import validate
    from zerofit.train import engine
    from zerofit.train.loop import train

    built: dict = {}
    build_model = engine.build_model

    def capture(config, ds_config):
        built["model"] = build_model(config, ds_config)
        return built["model"]

    engine.build_model = capture
    steps_seen: list[list] = [[]]
    coordinator = ppc.PartitionedParameterCoordinator

    def gathered() -> int:
        return sum(p.ds_numel for p in built["params"] if p.ds_status != ZeroParamStatus.NOT_AVAILABLE and not p.ds_persist)

    def wrap(name: str):
        original = getattr(coordinator, name)

        def wrapped(self, module, *args, **kwargs):
            result = original(self, module, *args, **kwargs)
            if "params" not in built:
                model = built["model"]
                built["params"] = list(model.parameters())
                built["names"] = {id(m): n for n, m in model.named_modules()}
            forward = args[0] if args else kwargs.get("forward", False)  # every hooked module: each call prefetches
            steps_seen[-1].append([name.split("_")[0], bool(forward), built["names"].get(id(module), "?"),
                                   gathered()])
            return result
        setattr(coordinator, name, wrapped)

    wrap("fetch_sub_module")
    wrap("release_sub_module")
    reset_step = coordinator.reset_step

    def reset(self):  # at the start of each forward: what the last one left gathered opens the next
        steps_seen.append([["reset", True, "", gathered()]] if "params" in built else [])
        return reset_step(self)
    coordinator.reset_step = reset

    cell = planner_accuracy.Cell(model=model_name, mode=mode, seq_len=seq_len, cap_gib=8, lora=lora, evaluate=evaluate)
    config = planner_accuracy.run_config(cell, work / "run", steps, "64GiB")
    config["zero"].update(zero)
    train(validate(config), resume=False)
    return {"steps": [s for s in steps_seen if s]}


def replay(seq_len: int, work: Path) -> dict:
    """The planner's replay for the candidate the run chose (read back from plan.json), on the
    model the run trained (its config.yaml: the peft model with lora.enabled)."""
    from zerofit.config.load import load
    from zerofit.plan import spec as modelspec
    from zerofit.plan import trace as zerotrace
    from zerofit.plan.activations import nvme_parameters
    from zerofit.plan.estimate import Candidate, Shape

    plan = json.loads((work / "run" / "plan.json").read_text())
    cand = Candidate(**plan["candidate"])
    spec = modelspec.from_config(load(work / "run" / "config.yaml"))
    nvme = nvme_parameters(spec, Shape(seq_len=seq_len, micro_batch=1, world_size=1), cand)
    trace, n_forward, numel = zerotrace.zero3_trace(spec, True, cand.param_persistence_threshold)
    result = zerotrace.gathered_numel(spec, True, cand.prefetch_bucket_size, cand.max_live_parameters,
                                       cand.max_reuse_distance, cand.param_persistence_threshold,
                                       cand.reduce_bucket_size, nvme)
    return {"candidate": plan["candidate"], "trace": [list(t) for t in trace], "n_forward": n_forward,
            "nvme": sorted(nvme), "gathered": result._asdict()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1.5b")
    parser.add_argument("--mode", default="optimizer_param_cpu")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--zero", action="append", default=[], metavar="KEY=INT",
                        help="a zero section setting for the run (the planner takes it as given), e.g. "
                             "max_live_parameters=20000")
    parser.add_argument("--lora", action="store_true", help="LoRA adapters (the lora section's defaults)")
    parser.add_argument("--eval", action="store_true", help="an eval of 4 sequences after every step (each of its "
                        "forwards is a list of its own)")
    parser.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results")))
    args = parser.parse_args()
    zero = {key: int(value) for key, value in (item.split("=", 1) for item in args.zero)}
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"gathered-probe-{os.getpid()}"
    measured = probe(args.model, args.mode, args.seq_len, args.steps, work, zero, args.lora, args.eval)
    record = {"command": "python " + " ".join(sys.argv), "model": args.model, "mode": args.mode,
              "seq_len": args.seq_len, "lora": args.lora, **measured, "replay": replay(args.seq_len, work)}
    settings = "".join(f"-{key}{value}" for key, value in zero.items()) + ("-lora" if args.lora else "") + \
        ("-eval" if args.eval else "")
    out = Path(args.out) / f"gathered_probe-{args.model}-{args.mode}-s{args.seq_len}{settings}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record))
    print(f"wrote {out}: {[len(s) for s in measured['steps']]} events per step")


if __name__ == "__main__":
    main()
