"""Fault injection for tests and drills: ZEROFIT_FAULT="kind@where:N[,kind@where:N...]".

Examples: `enospc@save:2` (the 2nd save's writes fail with ENOSPC), `oom@step:5`
(torch.OutOfMemoryError in the forward pass of step 5), `kill@save:1` (SIGKILL mid-save).
Code that can fail asks `armed(kind, where, n)` at the matching moment; nothing is
injected unless the variable is set.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

VARIABLE = "ZEROFIT_FAULT"


@dataclass(frozen=True)
class Fault:
    kind: str
    where: str
    n: int


def parse(text: str) -> list[Fault]:
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, at, rest = item.partition("@")
        where, colon, number = rest.partition(":")
        if not (at and colon and kind and where and number.isdigit()):
            raise ValueError(f"{VARIABLE}={text!r}: expected kind@where:N, e.g. enospc@save:2")
        faults.append(Fault(kind, where, int(number)))
    return faults


def armed(kind: str, where: str, n: int) -> bool:
    """True when ZEROFIT_FAULT asks for `kind` at the n-th `where` (1-based)."""
    text = os.environ.get(VARIABLE, "")
    return bool(text) and Fault(kind, where, n) in parse(text)
