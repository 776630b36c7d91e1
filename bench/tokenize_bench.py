"""Tokenizing time by data.num_workers: N short alpaca rows (rendered by the demo tokenizer's
chat template, as a run reads them) through tokenizing.read_examples, in a process that has
set up torch.distributed (and CUDA, on a GPU host) as `zerofit train` has when it reads the
data, so that the workers fork from what they fork from there. Each count's examples are
checked equal to one process's.
  python bench/tokenize_bench.py [ROWS] [OUT.json]      # bench/results/tokenize*.json"""
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from zerofit.config.data import DataConfig  # noqa: E402
from zerofit.data import workers as tokenworkers  # noqa: E402
from zerofit.data.tokenize import read_examples  # noqa: E402
from zerofit.demo import build_tokenizer  # noqa: E402
from zerofit.machine.hardware import cpu_cores  # noqa: E402
from zerofit.train import ranks


def write_rows(path: Path, rows: int) -> None:
    with path.open("w") as f:
        for i in range(rows):
            f.write(json.dumps({"instruction": f"Say something about the number {i} and why it matters.",
                                "input": "" if i % 3 else f"context {i}", "output": f"The number {i} is " +
                                "interesting " * (5 + i % 40)}) + "\n")


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else None
    path = Path("/tmp/tokenize_bench.jsonl")
    write_rows(path, rows)
    dist = ranks.init_distributed()  # gloo on CPU; NCCL and a CUDA context on a GPU: the fork's parent as in train
    tokenizer = build_tokenizer()
    cores = cpu_cores()
    auto = tokenworkers.worker_count(None, rows, cores, 1)
    cases, reference = [], None
    for workers in [1] + [n for n in (2, 4, 8, 16) if n <= cores] + ([None] if auto not in (2, 4, 8, 16) else []):
        started = time.perf_counter()
        read = read_examples([path], DataConfig(path=str(path), num_workers=workers), tokenizer)
        seconds = time.perf_counter() - started
        reference = read.examples if reference is None else reference
        cases.append({"num_workers": workers if workers is not None else f"auto ({auto})",
                      "seconds": round(seconds, 2), "rows_per_s": round(rows / seconds),
                      "same_examples_as_one_process": read.examples == reference})
        print(cases[-1], flush=True)
    result = {"rows": rows, "cores": cores, "on_gpu": dist.on_gpu, "auto_workers": auto,
              "speedup_best": round(cases[0]["seconds"] / min(c["seconds"] for c in cases), 2),
              "cases": cases, "command": "python bench/tokenize_bench.py " + " ".join(sys.argv[1:])}
    if out:
        out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "cases"}))
    os._exit(0)  # the process group of init_distributed: nothing to wind down for a measurement


if __name__ == "__main__":
    main()
