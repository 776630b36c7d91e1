"""The base every config section builds on (config.py's sections, dataconfig.py's): unknown keys
refused, values as YAML writes them read as numbers, paths with `~` and $VARIABLES expanded. It
imports no section, so that every section module can import it."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, field_validator

# PyYAML reads YAML 1.1, where 1e9 and 3e-4 (no dot) are strings, not numbers
EXPONENT_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")
# fields that name files or directories: `~` and $VARIABLES expanded, as a shell would
PATH_FIELDS = ("path", "config", "tokenizer", "chat_template", "eval_path", "nvme_path", "run_dir", "cache_dir")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    @field_validator("*", mode="before")
    @classmethod
    def _yaml_values(cls, value: Any, info) -> Any:
        """1e9 written in a YAML file is a number where the field takes one; a path's `~` and
        $VARIABLES are expanded."""
        annotation = cls.model_fields[info.field_name].annotation
        numeric = annotation in (int, float) or {int, float} & set(get_args(annotation))
        if isinstance(value, str) and EXPONENT_NUMBER.fullmatch(value.strip()) and numeric:
            return float(value)
        takes_bool = annotation is bool or bool in get_args(annotation)
        if isinstance(value, bool) and numeric and not takes_bool:  # pydantic reads true as 1: a slip, not a count
            raise ValueError(f"expected a number, got {str(value).lower()}")
        if info.field_name in PATH_FIELDS:
            return expand_path(value)
        return value


def read_from(path: str | Path) -> str:
    """Where a relative path was looked for, for an error that found nothing there: config paths
    are read from the working directory (as LLaMA-Factory's and HF's are), not the config file's."""
    return "" if Path(path).is_absolute() else f" (a relative path is read from the working directory, {Path.cwd()})"


def expand_path(value: Any) -> Any:
    """`~` and $VARIABLES in a path (or each of a list of paths) expanded."""
    if isinstance(value, list):
        return [expand_path(v) for v in value]
    return os.path.expanduser(os.path.expandvars(value)) if isinstance(value, str) else value
