"""The errors a user acts on. Every one is a ZerofitError: the CLI prints its message, one
problem per line, and exits 1, never with a traceback. A message says what happened, the
numbers, and the fix."""
from __future__ import annotations


class ZerofitError(Exception):
    """The root of zerofit's user-facing errors."""


class ConfigError(ZerofitError, ValueError):
    """A config the user must fix; the message names the key, the value and the fix."""
