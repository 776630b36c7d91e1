"""The config as text: a YAML file read strictly (a key written twice, a tab, a non-mapping
refused with the fix), `--set section.key=value` overrides, validation errors said in words
(an unknown key names the nearest valid one, or its LLaMA-Factory counterpart), and the config
written back out (a run's config.yaml, `zerofit config --example`). The schema itself is
config.py's (the data section dataconfig.py's, the sections' base section.py's)."""
from __future__ import annotations

import difflib
import json
import re
import textwrap
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from zerofit.config import aliases
from zerofit.config.schema import DECIDED, Config
from zerofit.config.section import Section
from zerofit.core.errors import ConfigError

DEMO_CONFIG = Path(__file__).parents[1] / "demo" / "config.yaml"


# ---------------------------------------------------------------------------- loading
# With no config file, --set applies over the embedded demo. A key that replaces the demo's model
# or data drops the demo settings that only describe those: the demo's model.config beside a
# model.path is refused as two models, and alpaca is the demo data's format, not the default.
DEMO_ONLY = {"model.path": ("model", "config"), "data.path": ("data", "format")}


def load(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """YAML file (default: the embedded demo) plus `section.key=value` overrides."""
    raw = read_yaml(Path(path) if path else DEMO_CONFIG)
    if path and looks_like_llamafactory(raw):
        raise ConfigError(f"{path} is a LLaMA-Factory config ({', '.join(sorted(LLAMAFACTORY_KEYS & set(raw)))} "
                          f"at the top level): `zerofit config --from-llamafactory {path} > zerofit.yaml` translates "
                          f"it, then `zerofit train --config zerofit.yaml`")
    if path and looks_like_model_config(raw):
        raise ConfigError(f"{path} is a model's config.json ({', '.join(sorted(MODEL_CONFIG_KEYS & set(raw)))} at "
                          f"the top level), not a zerofit run config: use --model {path} (`zerofit plan --model "
                          f"FILE`), or model.config: {path} in a run config (model.path: its directory, for its "
                          f"weights)")
    for item in overrides:
        key, value = parse_override(item)
        if path is None and key in DEMO_ONLY:
            section, demo_key = DEMO_ONLY[key]
            raw.get(section, {}).pop(demo_key, None)
        set_dotted(raw, key, value)
    return validate(raw)


# keys every LLaMA-Factory training YAML holds some of, and no zerofit config does
LLAMAFACTORY_KEYS = {"model_name_or_path", "stage", "finetuning_type", "dataset", "template", "cutoff_len"}


# keys of a transformers config.json (PretrainedConfig.to_dict), none of them a zerofit section
MODEL_CONFIG_KEYS = {"model_type", "architectures", "hidden_size", "num_hidden_layers", "vocab_size"}


def looks_like_model_config(raw: dict) -> bool:
    """A transformers config.json given where a run config belongs: its keys, no zerofit section."""
    return bool(MODEL_CONFIG_KEYS & set(raw)) and not set(raw) & set(Config.model_fields)


def looks_like_llamafactory(raw: dict) -> bool:
    """A flat config with two of LLaMA-Factory's keys and none of zerofit's sections."""
    return len(LLAMAFACTORY_KEYS & set(raw)) >= 2 and not set(raw) & set(Config.model_fields)


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key written twice in one mapping (it kept the last
    silently: a second `train:` section dropped the first)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} appears twice in one mapping "
                                                        f"(YAML keeps only the last); merge them", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


# PyYAML's words for the usual slips, and what to do about them
YAML_HINTS = (("'\\t'", "; YAML indents with spaces, not tabs: replace the tab"),
              ("mapping values are not allowed here", "; a key is indented deeper than the keys beside it, or a "
               "value holds `: ` (quote it)"))


def read_yaml(path: Path) -> dict:
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; pass --config FILE (a directory's run config is "
                          f"{path / 'config.yaml'})")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass --config FILE "
                          f"(`zerofit config --example > zerofit.yaml` writes a starting point)")
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=UniqueKeyLoader) or {}
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text (byte {e.start} is {e.object[e.start:e.start + 1]!r}); is it "
                          f"the config? Save it as UTF-8") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = str(getattr(e, "problem", e))
        hint = next((fix for text, fix in YAML_HINTS if text in problem), "")
        raise ConfigError(f"{path}{where} is not valid YAML: {problem}{hint}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of sections (model:, train:, ...), "
                          f"got {type(raw).__name__}")
    return raw


def parse_override(item: str) -> tuple[str, Any]:
    """`train.lr=3e-4` -> ("train.lr", 3e-4); the value is read as YAML so types come out right."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. --set train.lr=3e-4")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    return key.strip(), value  # "3e-4", a string to YAML 1.1, becomes a number where the field is one (Section)


def set_dotted(raw: dict, key: str, value: Any) -> None:
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: {part} is not a section")
    node[parts[-1]] = value


def validate(raw: dict) -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_explain(e, raw)) from None


MISSING_HINTS = {"train": " (how long to train: train.max_steps or train.epochs)",
                 "model": " (model.path, a local model directory, or model.config, a preset name or config.json)"}


def _explain(error: ValidationError, raw: dict) -> str:
    """Each problem said once; several, one a line. The valid keys of a section with unknown keys
    not near any are listed once, beside the key where it is the only one (a model's config.json
    given as a run config read 20 unknown keys on one 2 KB line, the top level's keys in each)."""
    lines, branches, unplaced = [], {}, {}
    for item in error.errors():
        loc = ".".join(str(p) for p in item["loc"])
        if _union_branch(item["loc"]):  # pydantic says each of `str | list[str]`'s failures on its own
            branches.setdefault(loc.rsplit(".", 1)[0], (item.get("input"), []))[1].append(item["msg"])
        elif item["type"] == "extra_forbidden":
            line, valid = _unknown_key(item["loc"])
            if valid:
                unplaced.setdefault(valid, []).append(len(lines))
            lines.append(line)
        elif item["type"] == "missing":
            lines.append(f"{loc}: required but missing" + MISSING_HINTS.get(loc, ""))
        else:
            value = item.get("input")
            shown = "" if isinstance(value, dict) else f"={value!r}"
            msg = item["msg"].removeprefix("Value error, ")
            if isinstance(value, bool) and not item["type"].startswith("bool"):
                msg += " (YAML reads an unquoted yes, no, on or off as true or false: write the value itself)"
            lines.append(f"{loc}{shown}: {msg}")
    for loc, (value, messages) in branches.items():
        lines.append(f"{loc}={value!r}: should be " + " or ".join(m.removeprefix("Input should be ") for m in messages))
    listed = []
    for valid, at in unplaced.items():
        if len(at) == 1:
            lines[at[0]] += f"; {valid}"
        else:
            listed.append(valid)
    if len(lines) == 1:
        return f"invalid config: {lines[0]}"
    return f"invalid config, {len(lines)} problems:\n  " + "\n  ".join(lines + listed)


def _union_branch(loc: tuple) -> bool:
    """Whether `loc` is a section's field (one of several types) and the type tried last."""
    if len(loc) != 3 or loc[0] not in Config.model_fields:
        return False
    section = Config.model_fields[loc[0]].annotation
    field = section.model_fields.get(loc[1]) if isinstance(section, type) and issubclass(section, BaseModel) else None
    return field is not None and get_origin(field.annotation) in (Union, UnionType)


def _unknown_key(loc: tuple) -> tuple[str, str]:
    """What an unknown key is said as, and where no key is near it, the valid keys of its section
    (else "")."""
    *parents, name = [str(p) for p in loc]
    model: type[BaseModel] = Config
    for part in parents:
        model = model.model_fields[part].annotation
    valid = list(model.model_fields)
    elsewhere = [section for section, field in Config.model_fields.items() if isinstance(field.annotation, type)
                 and issubclass(field.annotation, BaseModel) and name in field.annotation.model_fields]
    theirs = aliases.hint(name)
    if theirs and not elsewhere:
        return f"unknown key {'.'.join(parents + [name])}; LLaMA-Factory's / HF Trainer's {name} is {theirs}", ""
    if elsewhere and name not in valid:  # `lr:` dedented out of `train:` read "did you mean lora?"
        return (f"unknown key {'.'.join(parents + [name])}; it is a key of {' and '.join(elsewhere)}: move it "
                f"under `{elsewhere[0]}:`"), ""
    # a key the name begins with first (evaluation: eval, not difflib's nearer-in-letters elastic)
    near = [key for key in valid if len(key) >= 3 and name.startswith(key)][:1] or \
        difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    if near:
        return f"unknown key {'.'.join(parents + [name])}; did you mean {'.'.join(parents + near)}?", ""
    return f"unknown key {'.'.join(parents + [name])}", f"valid keys in {'.'.join(parents) or 'top level'}: " \
        f"{', '.join(valid)}"


def dump_yaml(config: Config, marked: dict[str, set[str]] | None = None, mark: str = "") -> str:
    """The config as YAML; each key of `marked` ({section: keys}) gets `# mark` beside its value."""
    text = yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
    if not marked:
        return text
    out, section = [], ""
    for line in text.splitlines():
        if not line.startswith(" "):
            section = line.split(":")[0]
        elif line.startswith("  ") and line[2] != " " and line.split(":")[0].strip() in marked.get(section, ()):
            line = f"{line}  # {mark}"
        out.append(line)
    return "\n".join(out) + "\n"


def example_yaml() -> str:
    """Every section and field with its doc as a comment: generated, so it never goes stale.
    The keys the planner decides (config.schema.DECIDED) are commented out: a key written in the file
    is a constraint, so writing them all would turn the planner off."""

    out = ["# zerofit config: every key with its default. Keys commented out with `#!` are the",
           "# planner's to choose (plan.enabled); delete the `#! ` to fix one to your value.", ""]
    example = {"model": {"config": "demo"}, "train": {"max_steps": 300}}
    # the example's values that exclude another key: say which, so setting that one is not a conflict
    excludes = {("model", "config"): "model.path", ("train", "max_steps"): "train.epochs"}
    for name, field in Config.model_fields.items():
        if field.annotation in (str, "str"):
            out += [*comment(field.description, ""), f"{name}: {field.default}", ""]
            continue
        section: type[Section] = field.annotation
        out.append(f"{name}:")
        for key, sub in section.model_fields.items():
            value = example.get(name, {}).get(key, sub.default)
            out += comment(sub.description, "  ")
            planners = "#! " if key in DECIDED.get(name, ()) else ""
            other = excludes.get((name, key))
            note = f"  # the example's; delete this line when you set {other}" if other else ""
            out.append(f"  {planners}{key}: {json.dumps(list(value) if isinstance(value, tuple) else value)}{note}")
        out.append("")
    return "\n".join(out)


EXAMPLE_WIDTH = 88  # `config --example`'s comment lines, `# ` and indent included


def comment(doc: str | None, indent: str) -> list[str]:
    """A key's doc as YAML comment lines wrapped at EXAMPLE_WIDTH (a word longer than that
    stays whole on its own line)."""
    return [f"{indent}# {line}" for line in textwrap.wrap(" ".join((doc or "").split()),
                                                           EXAMPLE_WIDTH - len(indent) - 2, break_long_words=False,
                                                           break_on_hyphens=False)]


# ---------------------------------------------------------------------------- keys_help
# `zerofit train --help` lists every key with one short line: the first sentence of its doc,
# cut where it would run past the line (the whole doc is `config --example`'s)
SENTENCE_END = re.compile(r"(?<!e\.g)(?<!i\.e)(?<!etc)\.(?:\s|$)")
KEY_COLUMN = 22  # where the summaries start (a longer key pushes its own along)
SUMMARY_MAX = 48  # with KEY_COLUMN, 70 columns: the help of 101 keys stays under 8 KB


def keys_help(width: int) -> str:
    """Every config key by section, one line each no wider than `width`, `*` marking the keys
    the planner chooses when unset; the defaults and whole docs are `config --example`'s."""

    out = textwrap.wrap("config keys, in a YAML file or as --set SECTION.KEY=VALUE (*: the planner's to choose "
                        "when unset). Defaults and whole explanations: `zerofit config --example`, "
                        "docs/config-reference.md.", width) + [""]
    for name, field in Config.model_fields.items():
        section = field.annotation
        if not (isinstance(section, type) and issubclass(section, Section)):
            out.append(key_line(name, field.description, width))
            continue
        out.append(f"{name}:")
        out += [key_line(f"  {key}{'*' * (key in DECIDED.get(name, ()))}", sub.description, width)
                for key, sub in section.model_fields.items()]
    return "\n".join(out)


def key_line(label: str, doc: str | None, width: int) -> str:
    label = label.ljust(KEY_COLUMN) if len(label) <= KEY_COLUMN - 2 else f"{label}  "
    return label + summary(doc, min(width - len(label), SUMMARY_MAX))


def summary(doc: str | None, room: int) -> str:
    """The doc's first sentence in at most `room` characters: whole if it fits, else up to the
    last clause break that fits (`;`, `:`, ` (`) when that keeps 2/3 of the room, else cut
    after a word with `...`."""
    first = SENTENCE_END.split(" ".join((doc or "").split()), 1)[0].rstrip(".")
    if len(first) <= room:
        return first
    cuts = [at for at in clause_breaks(first) if 2 * room // 3 <= at <= room]
    if cuts:
        return first[:cuts[-1]]
    return first[:max(room - 3, 1)].rsplit(" ", 1)[0].rstrip(",;:") + "..."


def clause_breaks(text: str):
    """Where `text` may be cut after a clause: `; `, `: ` or ` (` outside brackets and backquotes."""
    depth, quoted = 0, False
    for at, char in enumerate(text):
        if char == "`":
            quoted = not quoted
        elif not quoted and char in "([{":
            depth += 1
        elif not quoted and char in ")]}":
            depth -= 1
        if depth == 0 and not quoted and text.startswith(("; ", ": ", " ("), at):
            yield at
