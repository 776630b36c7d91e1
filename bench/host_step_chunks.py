"""Does a smaller ZeRO-3 sub group make the host's optimizer step cheaper? (issue 7)

DeepSpeed 0.19.8's stage-3 step (stage3.py `step`) walks the sub groups one by one, and per
sub group makes three passes over host memory: the unscale `grad.mul_(1/scale)`, CPU-Adam,
and the copy of the fp32 masters into the 16-bit parameters. On the 3.6B step these took
0.24 + 0.84 + 0.30 s (bench/results/step_profile-3.6b-offloaded.txt), all memory-bound.
With a sub group small enough for the last-level cache, the gradient that the unscale wrote
and the masters that Adam wrote would still be in cache for the next pass. This times the
three passes, in DeepSpeed's order, over the same elements cut into sub groups of several
sizes (zero.sub_group_size), so one run says whether the lever is worth a training run.

GPU machine (~1 min):  source .whl/prelude.sh || exit; python bench/host_step_chunks.py --out $OUT
Here (CPU):            python bench/host_step_chunks.py --elements 20000000 --sizes 10000000,1000000
Writes host_step_chunks.json (or --out).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
# zerofit's default sub group first (config.ZeroConfig.sub_group_size); Llama-3.6B's largest
# tensors are the embedding (394M) and the MLP projections (25M), each a sub group of its own
# below that size: DeepSpeed does not split a parameter across sub groups.
DEFAULT_SIZES = "100000000,25000000,10000000,4000000"


def sub_groups(elements: int, size: int, pin: bool) -> list[dict]:
    """Host tensors of one step's sub groups: fp32 master + gradient, 16-bit parameter."""
    out = []
    for start in range(0, elements, size):
        n = min(size, elements - start)
        master = torch.nn.Parameter(torch.full((n,), 0.01))
        master.grad = torch.full_like(master, 1e-3)
        out.append(dict(master=master, half=torch.empty(n, dtype=torch.bfloat16, pin_memory=pin)))
    return out


def timed_step(groups: list[dict], adam) -> dict[str, float]:
    """One step in DeepSpeed's per-sub-group order; seconds per pass, summed over sub groups."""
    seconds = dict(unscale=0.0, adam=0.0, copy=0.0)
    for group in groups:
        t0 = time.perf_counter()
        group["master"].grad.mul_(1.0)                  # stage3.py unscale_and_clip_grads
        t1 = time.perf_counter()
        adam.param_groups[0]["params"] = [group["master"]]   # stage3.py _optimizer_step
        adam.step()
        t2 = time.perf_counter()
        group["half"].copy_(group["master"].data)       # _reassign_or_swap_out_partitioned_parameters
        t3 = time.perf_counter()
        seconds["unscale"] += t1 - t0
        seconds["adam"] += t2 - t1
        seconds["copy"] += t3 - t2
    seconds["total"] = sum(seconds.values())
    return seconds


def measure(elements: int, size: int, repeats: int, pin: bool) -> dict:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    groups = sub_groups(elements, size, pin)
    adam = DeepSpeedCPUAdam([g["master"] for g in groups], lr=2e-5, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.0, adamw_mode=True)
    timed_step(groups, adam)  # allocates the moments
    steps = [timed_step(groups, adam) for _ in range(repeats)]
    best = min(steps, key=lambda s: s["total"])
    return dict(sub_group_size=size, sub_groups=len(groups), best=best,
                ns_per_element={k: v / elements * 1e9 for k, v in best.items()},
                totals=[round(s["total"], 4) for s in steps])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--elements", type=int, default=1_200_000_000, help="fp32 elements stepped (16 B each)")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="sub group sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    pin = torch.cuda.is_available()  # the offloaded 16-bit parameters are pinned
    runs = []
    for size in (int(s) for s in args.sizes.split(",")):
        runs.append(measure(args.elements, size, args.repeats, pin))
        print(json.dumps(runs[-1]), flush=True)
    baseline = runs[0]["best"]["total"]
    result = dict(command="python bench/host_step_chunks.py " + " ".join(
                      f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
                  elements=args.elements, threads=torch.get_num_threads(), pinned_half=pin, runs=runs,
                  vs_first={r["sub_group_size"]: round(baseline / r["best"]["total"], 3) for r in runs})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_step_chunks.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["vs_first"]))


if __name__ == "__main__":
    main()
