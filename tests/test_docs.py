"""The user docs stay true: the config key reference is what the schema generates, and every
relative link in README.md and docs/*.md lands on a file that exists (and a heading, if it names one)."""
import re
from pathlib import Path

from zerofit.config import reference

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def markdown_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def relative_links(text: str) -> list[str]:
    """The link targets of a page outside code blocks and code spans, web addresses left out."""
    prose = CODE_SPAN.sub("", FENCE.sub("", text))
    return [target for target in LINK.findall(prose) if not re.match(r"[a-z][a-z0-9+.-]*:", target)]


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces as dashes."""
    anchors = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", FENCE.sub("", text), re.MULTILINE):
        anchors.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return anchors


def test_the_config_reference_is_what_the_schema_generates():
    committed = (ROOT / "docs" / "config-reference.md").read_text()
    assert committed == reference.render(), (
        f"docs/config-reference.md differs from the schema in zerofit/config/schema.py; regenerate it: "
        f"`{reference.REGENERATE}`")


def test_every_relative_link_resolves():
    broken = []
    for page in markdown_pages():
        for target in relative_links(page.read_text()):
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in heading_anchors(file.read_text()):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == [], "fix these links:\n" + "\n".join(broken)


def test_the_link_check_sees_links():
    """The checks above would pass on a parser that finds nothing."""
    text = "[a](docs/x.md) `[b](y.md)` [c](https://e.org) ![img](p.png)\n```\n[d](z.md)\n```\n[e](#top)"
    assert relative_links(text) == ["docs/x.md", "#top"]
    assert heading_anchors("# Top\n## Multi-GPU (and CPU)\n") == {"top", "multi-gpu-and-cpu"}
