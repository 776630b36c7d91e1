"""The config key reference (docs/config-reference.md), rendered from the typed config.

`render()` is pure: it reads the pydantic models of config.py (each field's type, default and
attribute docstring) and returns markdown, one table per section, as `zerofit train --help`
lists the same keys. tests/test_docs.py checks that the committed page equals its output.
Regenerate with `python -m zerofit.config.reference > docs/config-reference.md`.
"""
from __future__ import annotations

import json
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from zerofit.config.schema import DECIDED, Config

REGENERATE = "python -m zerofit.config.reference > docs/config-reference.md"
ONE_LINE = 160  # a description longer than this is cut to its first sentence
ABBREVIATIONS = ("e.g", "i.e", "etc", "vs", "cf")


def render(config: type[BaseModel] = Config, decided: dict[str, tuple[str, ...]] = DECIDED) -> str:
    """Markdown reference of every key of `config`: the top-level keys, then one table per section."""
    top = [(name, field) for name, field in config.model_fields.items() if not is_section(field.annotation)]
    sections = [(name, field) for name, field in config.model_fields.items() if is_section(field.annotation)]
    lines = [
        "# Config key reference",
        "",
        f"<!-- Generated from zerofit/config/schema.py by zerofit/config/reference.py; do not edit. Regenerate: {REGENERATE} -->",
        "",
        ("Every key of a zerofit run config (YAML, or `--set section.key=value`), as `zerofit train --help` "
         "lists them; `zerofit config --example` prints them as YAML. Unknown keys are errors that name the "
         "nearest valid key. **planner**: chosen by the planner when you leave the key unset (and `plan.enabled` "
         "is true), so the default shown is not what runs; `train.micro_batch_size` and `train.grad_accum_steps` "
         "only when `train.global_batch_size` is set. See [training and config](training.md) and "
         "[planning](planning.md)."),
        "",
        "Sections: " + ", ".join(f"[`{name}`](#{name})" for name, _ in sections) + ".",
        "",
        "## Top level",
        "",
        *table([(name, field, False) for name, field in top]),
    ]
    for name, field in sections:
        section = field.annotation
        lines += ["", f"## {name}", ""]
        doc = section.__dict__.get("__doc__")
        if doc:
            lines += [" ".join(doc.split()), ""]
        chosen = decided.get(name, ())
        lines += table([(key, sub, key in chosen) for key, sub in section.model_fields.items()])
    return "\n".join(lines) + "\n"


def is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def table(rows: list[tuple[str, Any, bool]]) -> list[str]:
    out = ["| key | type | default | description |", "|---|---|---|---|"]
    for key, field, planner in rows:
        default = "required" if field.is_required() else default_text(field.default)
        if planner:
            default += " (planner)"
        out.append(f"| `{key}` | {cell(type_text(field.annotation))} | {cell(default)} | "
                   f"{cell(one_line(field.description or ''))} |")
    return out


def type_text(annotation: Any) -> str:
    """A field's type as a reader writes it: `int`, `str or null`, `"cpu" | "nvme"`."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " | ".join(json.dumps(value) for value in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        named = [type_text(arg) for arg in args if arg is not type(None)]
        return " or ".join(named) + (" or null" if type(None) in args else "")
    if origin in (list, tuple, dict):
        inner = ", ".join(type_text(arg) for arg in typing.get_args(annotation))
        return f"{origin.__name__}[{inner}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def default_text(value: Any) -> str:
    if value is None:
        return "unset"
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, BaseModel):
        return "(section)"
    return f"`{json.dumps(list(value) if isinstance(value, tuple) else value)}`"


def one_line(doc: str) -> str:
    """The description on one line; one too long for it cut to its first sentence."""
    text = " ".join(doc.split())
    return first_sentence(text) if len(text) > ONE_LINE else text


def first_sentence(text: str) -> str:
    """Up to the first full stop outside parentheses and backticks that ends a sentence."""
    depth, quoted = 0, False
    for index, char in enumerate(text):
        if char == "`":
            quoted = not quoted
        elif quoted:
            continue
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth = max(0, depth - 1)
        elif char == "." and depth == 0 and (index + 1 == len(text) or text[index + 1] == " "):
            word = text[:index].rsplit(" ", 1)[-1].lstrip("(")
            if word.lower() not in ABBREVIATIONS:
                return text[:index + 1]
    return text


def cell(text: str) -> str:
    """Text safe inside a markdown table cell."""
    return text.replace("|", "\\|")


def main() -> None:
    print(render(), end="")


if __name__ == "__main__":
    main()
