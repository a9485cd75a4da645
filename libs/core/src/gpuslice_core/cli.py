"""Command-line flags that also read environment variables.

Every gpuslice flag has an environment variable (``--node-name`` / ``NODE_NAME``), so the same
binary is configured by the Helm chart through env and by a developer through flags. A flag given
on the command line wins over its variable; the variable wins over the default. ``--help`` shows
each flag's variable and default, so the help text is the configuration reference.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from typing import Any


class EnvArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose ``add_flag`` binds each flag to an environment variable."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def add_flag(
        self,
        flag: str,
        *,
        env: str,
        help: str,
        default: Any = None,
        type: Callable[[str], Any] = str,
        choices: Sequence[Any] | None = None,
        required: bool = False,
    ) -> argparse.Action:
        """Add ``flag`` whose default comes from ``env`` when that variable is set."""
        raw = os.environ.get(env)
        if raw is not None and raw != "":
            try:
                default = type(raw)
            except (TypeError, ValueError) as exc:
                self.error(f"environment variable {env}={raw!r} is invalid for {flag}: {exc}")
            if choices is not None and default not in choices:
                allowed = ", ".join(str(c) for c in choices)
                self.error(f"environment variable {env}={raw!r} must be one of: {allowed}")
            required = False
        return self.add_argument(
            flag,
            default=default,
            type=type,
            choices=choices,
            required=required,
            help=f"{help} [env {env}]",
        )

    def add_bool_flag(self, flag: str, *, env: str, help: str, default: bool = False) -> None:
        """Add an on/off flag (``--x`` / ``--no-x``) that also reads ``env`` (true/false)."""
        raw = os.environ.get(env)
        if raw:
            default = parse_bool(raw, name=env)
        self.add_argument(
            flag,
            action=argparse.BooleanOptionalAction,
            default=default,
            help=f"{help} [env {env}]",
        )


def parse_bool(value: str, *, name: str) -> bool:
    """Parse true/false (also 1/0, yes/no) or raise ``ValueError`` naming the setting."""
    lowered = value.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ValueError(f"{name}={value!r} is not a boolean; use true or false")


def positive_seconds(value: str) -> float:
    """A positive number of seconds, for argparse."""
    number = _number(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"{value!r} must be a positive number of seconds")
    return number


def seconds_or_off(value: str) -> float:
    """A number of seconds, or 0 for a feature that is then off, for argparse."""
    number = _number(value)
    if number < 0:
        raise argparse.ArgumentTypeError(
            f"{value!r} must be 0 (off) or a positive number of seconds"
        )
    return number


def _number(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None


def add_log_flags(parser: EnvArgumentParser) -> None:
    """``--log-level`` (``LOG_LEVEL``) and ``--log-format`` (``LOG_FORMAT``), the same on every
    service: one call in each cli.py, the parsed values go to ``logging.configure``."""
    # Here, not at the top: node-setup's cli uses this module and must run on the standard
    # library alone (gpuslice_core.logging needs structlog).
    from gpuslice_core.logging import FORMATS, LEVELS

    parser.add_flag(
        "--log-level",
        env="LOG_LEVEL",
        default="info",
        choices=LEVELS,
        help="Least severe level of the log lines written (to stdout).",
    )
    parser.add_flag(
        "--log-format",
        env="LOG_FORMAT",
        default="json",
        choices=FORMATS,
        help=(
            "json: one object per line with klog's keys (ts, level, msg, logger, err); text:"
            " key=value lines for a terminal. docs/logging.md"
        ),
    )
