"""How node-setup speaks: one line per thing done on stderr, and the error that stops it."""

from __future__ import annotations

import sys


class SetupError(Exception):
    """A step cannot be done as asked; the message names the cause (exit status 1)."""


def log(message: str) -> None:
    print(f"node-setup: {message}", file=sys.stderr, flush=True)
