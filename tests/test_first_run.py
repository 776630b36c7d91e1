"""A new user's first hour, as the README says it: install into a fresh virtual environment
that sees nothing of the dev extras, train the demo, export it and ask it something."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The fresh venv's own torch builds DeepSpeed's ops against its own headers: kept apart from
# the dev environment's builds (each would make ninja rebuild the other's) and kept between runs.
FRESH_OP_BUILDS = Path.home() / ".cache" / "zerofit-tests" / "fresh-venv-torch-extensions"


def clean_env(venv: Path) -> dict[str, str]:
    """This environment without what points into the dev install (PYTHONPATH, a venv, pytest's
    own variables); pip's configuration and cache stay, so installs reuse downloaded wheels."""
    dropped = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTEST_CURRENT_TEST", "PYTEST_ADDOPTS")
    env = {key: value for key, value in os.environ.items() if key not in dropped}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["TORCH_EXTENSIONS_DIR"] = str(FRESH_OP_BUILDS)
    return env


def run(command: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done


@pytest.mark.e2e
@pytest.mark.timeout(1800)
def test_the_readme_first_command_works_in_a_fresh_venv(tmp_path):
    """`pip install torch==2.13.0 && pip install -e . && zerofit train`, exactly (no extras),
    in a venv without the system's site-packages: every runtime import must be declared."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    env = clean_env(venv)
    run([str(venv / "bin" / "pip"), "install", "torch==2.13.0"], env, tmp_path, 1200)
    run([str(venv / "bin" / "pip"), "install", "-e", str(ROOT)], env, tmp_path, 1200)
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import peft"], env=env, capture_output=True)
    assert probe.returncode != 0, "the fresh venv sees peft: it would hide an undeclared dependency"
    work = tmp_path / "work"
    work.mkdir()
    done = run([str(venv / "bin" / "zerofit"), "train", "--set", "train.max_steps=3"], env, work, 900)
    assert (work / "runs" / "demo" / "checkpoints" / "step-000003" / "MANIFEST.json").is_file(), done.stdout


@pytest.mark.e2e
def test_the_demo_learns_and_its_export_answers(tmp_path):
    """The README's walkthrough: `zerofit train` (the demo as shipped), `zerofit doctor`,
    `zerofit export`, then `zerofit chat` asked one of the demo's tasks in the layout it
    trained answers it; eval loss falls by a third or more from the first eval to the last."""
    from conftest import read_jsonl, run_zerofit

    run = tmp_path / "runs" / "demo"
    run_zerofit(["train", "--run-dir", str(run)])
    evals = [m["eval_loss"] for m in read_jsonl(run / "metrics.jsonl") if "eval_loss" in m]
    assert evals[-1] <= 0.7 * evals[0], evals
    run_zerofit(["doctor", str(run), "--out", str(tmp_path / "report.html")])
    run_zerofit(["export", str(run), "--out", str(tmp_path / "models" / "demo")])
    answer = run_zerofit(["chat", str(tmp_path / "models" / "demo")], input_text="length: zerofit\n").stdout.strip()
    assert answer.isdigit(), f"the demo's model answered {answer!r} to 'length: zerofit'"
