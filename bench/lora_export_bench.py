"""Export a LoRA run whose base was drawn on the GPU, merged under a RAM cap and as an adapter
directory, then generate from both -> $OUT/lora_export.json.

The run: one `zerofit train` step of LoRA on a random-init preset (default llama-1.5b,
zero.Init on the GPU, so the base's values come from the CUDA RNG), checkpoint at the end.
Then, each in its own process with its peak RSS as the kernel counted it (os.wait4):
  merged        `zerofit export RUN --out merged --max-ram CAP`: the base replayed module by
                module on the GPU (reinit.py), its fingerprint checked against the checkpoint's
  verify        the same with --verify (peft's merge_and_unload of the same weights; holds the
                model three times in RAM, so it is measured apart from the capped export)
  adapter_only  `zerofit export RUN --out adapter --adapter-only`
  generate_*    `zerofit generate` on the merged directory and on the adapter directory (the
                base rebuilt on the GPU and checked, PeftModel on top): tokens/s, text
What matters first: "fingerprint checked" in the merged export (the CUDA replay reproduced
the training base bit for bit) and verify ok.

GPU machine (one H200), about 4-6 minutes with llama-1.5b:
    source .whl/prelude.sh || exit; python bench/lora_export_bench.py
This machine, same code path with the tiny preset on CPU (well under a minute):
    python bench/lora_export_bench.py --smoke
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PROMPT = "Write one sentence about the sea."


def child_env() -> dict:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "PYTHONUNBUFFERED": "1"}


def measured(name: str, args: list[str], work: Path) -> dict:
    """`python -m zerofit ARGS` in a child: exit code, seconds, peak RSS, the log's tail."""
    log = work / f"{name}.log"
    started = time.perf_counter()
    with open(log, "w") as out:
        child = subprocess.Popen([sys.executable, "-m", "zerofit", *args], cwd=ROOT, env=child_env(), stdout=out,
                                 stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)
    text = log.read_text()
    record = {"step": name, "exit_code": os.waitstatus_to_exitcode(status),
              "seconds": round(time.perf_counter() - started, 2), "peak_rss_bytes": usage.ru_maxrss * 1024,
              "log_tail": text[-1500:]}
    print(json.dumps({k: v for k, v in record.items() if k != "log_tail"}), flush=True)
    return record


def train_config(preset: str, smoke: bool, work: Path) -> Path:
    import yaml

    config = {
        "run_dir": str(work / "run"),
        "model": {"config": preset, "gradient_checkpointing": True},
        "lora": {"enabled": True},
        "data": {"path": "synthetic", "synthetic_samples": 16, "eval_fraction": 0.0},
        "train": {"seq_len": 64 if smoke else 512, "micro_batch_size": 1, "max_steps": 1, "lr": 1e-3,
                  "warmup_steps": 0, "seed": 0},
        "zero": {"stage": 3, "offload_optimizer": "cpu"},
        "eval": {"at_end": False},
        "checkpoint": {"every_steps": 0, "save_final": True, "keep_last": 1},
        "log": {"progress": False},
    }
    path = work / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def generation(record: dict) -> dict:
    """tokens/s and the text from a `zerofit generate` log."""
    found = re.search(r"(\d+) new tokens in ([\d.]+) s: ([\d.]+) tokens/s", record["log_tail"])
    return {"new_tokens": int(found.group(1)), "tokens_per_s": float(found.group(3))} if found else {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny preset on CPU, same code path")
    parser.add_argument("--preset", default="llama-1.5b", help="random-init preset to train (default llama-1.5b)")
    parser.add_argument("--max-ram", default="4GiB", help="--max-ram of the merged export (default 4GiB)")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/zerofit-lora-export-bench/out"),
                        help="directory for lora_export.json (default $OUT)")
    args = parser.parse_args()
    preset = "tiny" if args.smoke else args.preset
    work = Path("/tmp/zerofit-lora-export-bench")
    if work.exists():
        import shutil

        shutil.rmtree(work)
    work.mkdir(parents=True)
    import torch

    steps = [measured("train", ["train", "--config", str(train_config(preset, args.smoke, work))], work)]
    run = work / "run"
    if steps[-1]["exit_code"] == 0:
        steps.append(measured("merged", ["export", str(run), "--out", str(work / "merged"), "--max-ram",
                                         args.max_ram], work))
        steps.append(measured("verify", ["export", str(run), "--out", str(work / "verified"), "--verify"], work))
        steps.append(measured("adapter_only", ["export", str(run), "--out", str(work / "adapter"),
                                               "--adapter-only"], work))
        for name, directory in (("generate_merged", "merged"), ("generate_adapter", "adapter")):
            record = measured(name, ["generate", str(work / directory), "--prompt", PROMPT, "--max-new-tokens", "48",
                                     "--min-new-tokens", "48"], work)
            record.update(generation(record))
            steps.append(record)
    merged = next((s for s in steps if s["step"] == "merged"), {})
    verify = next((s for s in steps if s["step"] == "verify"), {})
    report = {
        "bench": "lora_export", "smoke": args.smoke, "preset": preset, "max_ram": args.max_ram,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "fingerprint_checked": "fingerprint checked" in merged.get("log_tail", ""),
        "verify_ok": verify.get("exit_code") == 0 and ": ok" in verify.get("log_tail", ""),
        "merged_bytes": sum(p.stat().st_size for p in (work / "merged").glob("*.safetensors"))
        if (work / "merged").is_dir() else None,
        "steps": steps,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lora_export.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / 'lora_export.json'}: fingerprint checked {report['fingerprint_checked']}, "
          f"verify ok {report['verify_ok']}")
    return 0 if all(s["exit_code"] == 0 for s in steps) and report["fingerprint_checked"] else 1


if __name__ == "__main__":
    sys.exit(main())
