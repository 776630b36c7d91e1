"""Same behaviour across a refactor: the demo's curve and `zerofit plan --json` of every preset,
run from two checkouts on this machine, compared.

    python bench/same_behaviour.py --before /path/to/old/checkout --after . \
        --out bench/results/same_behaviour.json

The demo's metrics.jsonl (step, loss, eval loss) must match bit for bit. The plans must match
as JSON once the live disk readings are set aside (disk_path, disk_free_bytes and the disk
budgets and free space derived from them): the checkouts sit on one disk whose free space moves between runs.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

DISK_KEYS = ("disk_path", "disk_free_bytes")
DISK_WORDS = re.compile(r"(disk[^;]*? of |disk: [^;]*?\(have )[\d.]+GiB")


def without_disk_readings(value, key: str = ""):
    """The plan with the live disk readings replaced by a marker."""
    if isinstance(value, dict):
        return {k: "<disk reading>" if k in DISK_KEYS or (key == "disk" and k in ("budget_bytes", "usable_bytes"))
                else without_disk_readings(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [without_disk_readings(v, key) for v in value]
    return DISK_WORDS.sub(r"\1<free>GiB", value) if isinstance(value, str) else value


def zerofit(checkout: Path, args: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    return subprocess.run([sys.executable, "-m", "zerofit", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, check=check)


def demo_curve(checkout: Path) -> list[list]:
    with tempfile.TemporaryDirectory() as work:
        zerofit(checkout, ["train"], Path(work))
        lines = (Path(work) / "runs" / "demo" / "metrics.jsonl").read_text().splitlines()
        return [[r["step"], r["loss"], r.get("eval_loss")] for r in map(json.loads, lines)]


def plans(checkout: Path) -> dict[str, str]:
    presets = [line.split()[0] for line in zerofit(checkout, ["plan", "--presets"], checkout).stdout.splitlines()]
    planned = {}
    for name in presets:  # exit 1 where nothing fits: the JSON says why, and the code is compared too
        done = zerofit(checkout, ["plan", "--model", name, "--json", "--gpu-mem", "24GiB", "--host-mem", "64GiB"],
                       checkout, check=False)
        planned[name] = f"exit {done.returncode} " + json.dumps(without_disk_readings(json.loads(done.stdout)))
    return planned


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    before, after = args.before.resolve(), args.after.resolve()
    curves = {"before": demo_curve(before), "after": demo_curve(after)}
    plan_before, plan_after = plans(before), plans(after)
    result = {
        "command": " ".join(["python", *sys.argv]),
        "commits": {name: subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=path, capture_output=True, check=True,
                                         text=True).stdout.strip() for name, path in (("before", before), ("after", after))},
        "demo_steps": len(curves["after"]),
        "demo_final": curves["after"][-1],
        "demo_curve_identical": curves["before"] == curves["after"],
        "plans_identical": {name: plan_before.get(name) == text for name, text in plan_after.items()},
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    if not (result["demo_curve_identical"] and all(result["plans_identical"].values())):
        sys.exit(1)


if __name__ == "__main__":
    main()
