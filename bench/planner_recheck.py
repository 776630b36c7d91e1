"""The current planner's GPU-peak and host-RSS predictions for every cell measured so far, against what was measured.

Each committed bench/results/planner_accuracy*.json cell (a real run on the GPU machine) is
planned again here, on any machine, with planner_accuracy.predict (the cell's own config, the
GPU machine's cores and a 100 GiB host budget); a cell measured in several files counts once,
from the first file in name order. Nothing runs on a GPU: this says how the planner's accuracy
moves when the planner changes, against measurements that do not.

`--hook-order transformers-5.17`: the GPU machine's transformers (5.17) checkpoints a decoder
layer's `__call__`, so the layer's own pre-hook fires again at the start of each recompute; a
newer one checkpoints its `forward`. zerofit/plan/hookorder.py takes the order from the transformers
installed here, so this option replays the GPU machine's for its measurements.

    python bench/planner_recheck.py --hook-order transformers-5.17 --out bench/results/planner_recheck.json
"""
from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]


def with_layer_hook_at_recompute() -> None:
    """hookorder's events as transformers 5.17 fires them: the decoder layer's pre-hook again
    before each block's recompute."""
    from zerofit.plan import hookorder

    own = hookorder._cached_events.__wrapped__

    def events(config_json: str, adapter_json: str | None):
        found = own(config_json, adapter_json)
        if found is None:
            return None
        out, previous = [], None
        for kind, name in found:
            if kind == "recompute" and previous == "backward":
                out.append(("recompute", re.match(r"(.*\.layers\.\d+)\.", name).group(1)))
            out.append((kind, name))
            previous = kind
        return tuple(out)

    hookorder._cached_events = functools.lru_cache(maxsize=32)(events)


def recheck() -> list[dict]:
    import planner_accuracy

    cells, seen = [], set()
    for path in sorted((ROOT / "bench" / "results").glob("planner_accuracy*.json")):
        found = json.loads(path.read_text())
        for c in found.get("cells", []) if isinstance(found, dict) else found:
            if c.get("status") != "measured" or "measured_gpu_peak" not in c:
                continue
            cell = planner_accuracy.Cell(model=c["model"], mode=c["offload_mode"], seq_len=c["seq_len"],
                                         cap_gib=c["cap_gib"], micro_batch=c.get("micro_batch", 1),
                                         attn=c.get("attn", "sdpa"), lora=c.get("lora", False),
                                         evaluate=c.get("eval", False))
            if cell.key() in seen:
                continue
            seen.add(cell.key())
            predicted = planner_accuracy.predict(cell, {"steps": 2, "accelerator": "cuda"}, 2, "100GiB")
            cells.append({"file": path.name, "model": cell.model, "mode": cell.mode, "seq_len": cell.seq_len,
                          "micro_batch": cell.micro_batch, "attn": cell.attn, "lora": cell.lora,
                          # a cell with evals: the plan's peak is over its eval phase too
                          "measured_gpu_peak": max(c["measured_gpu_peak"], c.get("measured_eval_gpu_peak", 0)),
                          "predicted_gpu_peak": predicted["predicted_gpu_peak"],
                          # the process's peak RSS through its steps (VmHWM, reset after loading)
                          "measured_host_rss": c.get("measured_host_rss"),
                          "predicted_host_rss": predicted["predicted_host_rss"],
                          "eval": cell.evaluate})
            cells[-1]["error_pct"] = error_pct(cells[-1]["predicted_gpu_peak"], cells[-1]["measured_gpu_peak"])
            cells[-1]["host_error_pct"] = error_pct(cells[-1]["predicted_host_rss"], cells[-1]["measured_host_rss"])
    return cells


def error_pct(predicted: int, measured: int | None) -> float | None:
    return None if not measured else round(100 * (predicted - measured) / measured, 1)


def spread(errors: list[float | None]) -> dict:
    known = [e for e in errors if e is not None]
    return {"min_error_pct": min(known), "max_error_pct": max(known), "within_3_pct": sum(abs(e) <= 3 for e in known),
            "measured": len(known)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hook-order", choices=["installed", "transformers-5.17"], default="installed")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.hook_order == "transformers-5.17":
        with_layer_hook_at_recompute()
    cells = recheck()
    summary = {"cells": len(cells), "gpu": spread([c["error_pct"] for c in cells]),
               "host": spread([c["host_error_pct"] for c in cells])}
    for c in cells:
        host = "" if c["measured_host_rss"] is None else (
            f"; host {c['measured_host_rss'] / 2**30:6.2f} GiB, predicted {c['predicted_host_rss'] / 2**30:6.2f} "
            f"({c['host_error_pct']:+.1f}%)")
        print(f"{c['model']:16s} {c['mode']:22s} s{c['seq_len']:<5d} {c['attn']:5s}{' lora' if c['lora'] else ''}{' eval' if c['eval'] else ''} GPU "
              f"{c['measured_gpu_peak'] / 2**30:6.2f} GiB, predicted {c['predicted_gpu_peak'] / 2**30:6.2f} "
              f"({c['error_pct']:+.1f}%){host}")
    print(summary)
    if args.out:
        args.out.write_text(json.dumps({"command": "python " + " ".join(sys.argv), "summary": summary,
                                        "cells": cells}, indent=1))


if __name__ == "__main__":
    main()
