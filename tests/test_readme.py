"""The README keeps the picture true: its layout names every module of the package and every
bench, and nothing that is gone; its test command is the one CI runs."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def layout_part(first: str, last: str | None) -> str:
    """The lines of README's "Layout of the code" block from the one opening with `first` up to
    the one opening with `last` (or the block's end)."""
    block = README.split("## Layout of the code", 1)[1].split("```")[1]
    part = block[block.index("\n" + first):]
    return part[:part.index("\n" + last)] if last else part


def named_files(text: str, suffixes: str) -> set[str]:
    return set(re.findall(rf"\b(\w+\.(?:{suffixes}))\b", text))


def test_the_layout_names_every_module_and_no_module_that_is_gone():
    named = named_files(layout_part("zerofit/", "tests/"), "py")
    modules = {p.name for p in (ROOT / "zerofit").glob("*.py") if not p.name.startswith("__")}
    assert modules - named == set(), "add these to README's layout"
    assert named - modules == set(), "README's layout names modules that are gone"


def test_the_layout_names_every_bench_and_no_bench_that_is_gone():
    named = named_files(layout_part("bench/", None), "py|sh")
    benches = {p.name for p in (ROOT / "bench").iterdir() if p.suffix in (".py", ".sh")}
    assert benches - named == set(), "add these to README's layout"
    assert named - benches == set(), "README's layout names benches that are gone"


def test_the_readme_opens_with_the_commands_ci_runs():
    opening = README.split("```bash", 1)[1].split("```", 1)[0]
    commands = [line for line in opening.splitlines() if line and not line.startswith("#")]
    assert commands[0].endswith("zerofit train") and commands[0].startswith("pip install torch==2.13.0")
    ci_last = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert commands[1] == ci_last == 'pip install torch==2.13.0 && pip install -e ".[dev]" && python -m pytest -q'
