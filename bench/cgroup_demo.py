"""`zerofit train` in a real memory cgroup, planned against the machine and against the group.

    python bench/cgroup_demo.py BEFORE_TREE [--limit-gib 3] > bench/results/cgroup-3gib.txt

BEFORE_TREE is a checkout that planned against the machine's RAM (`git worktree add /tmp/wt
52d97aa~1`); the other run is this checkout. Each runs as a process of a fresh cgroup v1 memory
group below this process's own (root and cgroup v1 needed: a v2 group with processes cannot
delegate its memory controller), with swap off for the group, then the group is removed.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from zerofit.core import cgroup  # noqa: E402

HERE = Path(__file__).resolve().parent.parent
COMMAND = ("python -m zerofit train --run-dir {run} --set model.config=llama-0.5b --set train.max_steps=2 "
           "--set train.seq_len=128 --set checkpoint.every_steps=0")


def in_group(group: Path, tree: Path, run_dir: Path) -> tuple[int, float, list[str]]:
    (group / "memory.failcnt").write_text("0")
    start = time.monotonic()
    done = subprocess.run(["bash", "-c", f"echo $$ > {group}/cgroup.procs; exec env PYTHONPATH={tree} "
                           + COMMAND.format(run=run_dir)], cwd=tree, capture_output=True, text=True)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if not line.startswith("[20")]  # DeepSpeed's
    return done.returncode, time.monotonic() - start, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before_tree", type=Path)
    parser.add_argument("--limit-gib", type=float, default=3.0)
    args = parser.parse_args()
    own = cgroup.group_dirs("memory")
    if own is None or own.v2:
        sys.exit("needs a cgroup v1 memory hierarchy this process can write to (root)")
    group = own.levels[0] / f"zerofit-demo-{os.getpid()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(int(args.limit_gib * 2**30)))
        (group / "memory.swappiness").write_text("0")
        head = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
        before = subprocess.run(["git", "-C", str(args.before_tree), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True).stdout.strip()
        print(f"`zerofit train` in a real cgroup v1 memory group of {args.limit_gib:g} GiB (swappiness 0) on a "
              f"machine with {cgroup.psutil.virtual_memory().available / 2**30:.1f} GiB available.")
        print(f"Command: python bench/cgroup_demo.py {args.before_tree} --limit-gib {args.limit_gib:g}; each run:")
        print("  " + COMMAND.format(run="RUN_DIR") + "\n")
        for tree, label in ((args.before_tree, f"before: {before}, host RAM probed from the machine (psutil)"),
                            (HERE, f"after: {head}, host RAM within the group's limit (zerofit/core/cgroup.py)")):
            subprocess.run(["rm", "-rf", "/tmp/cgroup-demo-run"])
            status, took, lines = in_group(group, tree, Path("/tmp/cgroup-demo-run"))
            killed = " (SIGKILL: the kernel's OOM killer, at the group's limit)" if status == -9 else ""
            print(f"== {label}", *lines, sep="\n")
            print(f"-- exit status {status}{killed}, {took:.1f} s, the group hit its limit "
                  f"{(group / 'memory.failcnt').read_text().strip()} times\n")
    finally:
        group.rmdir()


if __name__ == "__main__":
    main()
