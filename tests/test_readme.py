"""The README's test command is the one CI runs."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_the_readme_opens_with_the_commands_ci_runs():
    opening = README.split("```bash", 1)[1].split("```", 1)[0]
    commands = [line for line in opening.splitlines() if line and not line.startswith("#")]
    assert commands[0].endswith("zerofit train") and commands[0].startswith("pip install torch==2.13.0")
    ci_last = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert commands[1] == ci_last == 'pip install torch==2.13.0 && pip install -e ".[dev]" && lint-imports && python -m pytest -q -n auto --dist loadfile'
