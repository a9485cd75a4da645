"""Command-line flags that also read environment variables.

Every gpuslice flag has an environment variable named ``GPUSLICE_`` and the flag's name in
capitals (``--node-name`` / ``GPUSLICE_NODE_NAME``, ``--state-dir`` / ``GPUSLICE_STATE_DIR``), so
the same binary is configured by the Helm chart through env and by a developer through flags, and
one prefix tells a reader which variables are ours. A flag given on the command line wins over
its variable; the variable wins over the default. ``--help`` shows each flag's variable and
default, so the help text is the configuration reference.

Two kinds of other names are read too (docs/configuration.md):

- ``aliases``: names other projects define for the same setting (NVIDIA's ``NVIDIA_DRIVER_ROOT``,
  the kubelet plugins' ``NODE_NAME``), read quietly when the ``GPUSLICE_`` one is unset;
- ``deprecated``: the names gpuslice used before one prefix. Read for one release, each with a
  warning naming the new variable; the warnings wait in :func:`pop_deprecation_notices` until
  ``gpuslice_core.logging.configure`` writes them (flags are parsed before logging is set up).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

#: The prefix of every gpuslice environment variable.
ENV_PREFIX = "GPUSLICE_"


def env_name(flag: str) -> str:
    """The environment variable of ``flag``: ``--state-dir`` -> ``GPUSLICE_STATE_DIR``."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


@dataclass(frozen=True)
class DeprecatedEnv:
    """An old variable name found set: ``old`` is read (or ignored) in place of ``new``."""

    old: str
    new: str
    ignored: bool  # the new variable is set too, and wins

    @property
    def message(self) -> str:
        if self.ignored:
            return (
                f"environment variable {self.old} is deprecated and ignored because {self.new}"
                f" is set; remove {self.old}"
            )
        return (
            f"environment variable {self.old} is deprecated and will not be read after the next"
            f" release; set {self.new} instead"
        )


_NOTICES: list[DeprecatedEnv] = []


def pop_deprecation_notices() -> list[DeprecatedEnv]:
    """The deprecated variables the parsers read since the last call (and forget them)."""
    notices = list(_NOTICES)
    _NOTICES.clear()
    return notices


def read_env(
    name: str, *, aliases: Sequence[str] = (), deprecated: Sequence[str] = ()
) -> tuple[str, str] | None:
    """``(variable, value)`` of the first non-empty of ``name``, ``aliases``, ``deprecated``;
    a deprecated name found set is recorded for :func:`pop_deprecation_notices`."""
    found: tuple[str, str] | None = None
    for candidate in (name, *aliases):
        raw = os.environ.get(candidate)
        if raw:
            found = (candidate, raw)
            break
    for old in deprecated:
        raw = os.environ.get(old)
        if not raw:
            continue
        _NOTICES.append(DeprecatedEnv(old=old, new=name, ignored=found is not None))
        if found is None:
            found = (old, raw)
    return found


class EnvArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose ``add_flag`` binds each flag to an environment variable."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)
        #: Each flag's variable -> its action (the chart tests compare them with the chart).
        self.variables: dict[str, argparse.Action] = {}
        #: Each flag's variable -> the other names read for it (aliases, then deprecated ones).
        self.other_names: dict[str, tuple[str, ...]] = {}

    def _bind(
        self,
        name: str,
        action: argparse.Action,
        aliases: Sequence[str],
        deprecated: Sequence[str],
    ) -> None:
        self.variables[name] = action
        self.other_names[name] = (*aliases, *deprecated)

    def add_flag(
        self,
        flag: str,
        *,
        help: str,
        default: Any = None,
        type: Callable[[str], Any] = str,
        choices: Sequence[Any] | None = None,
        required: bool = False,
        env: str | None = None,
        aliases: Sequence[str] = (),
        deprecated: Sequence[str] = (),
    ) -> argparse.Action:
        """Add ``flag`` whose default comes from its variable (:func:`env_name`, or ``env`` for a
        name that is not ours, like ``KUBECONFIG``) when that variable is set."""
        name = env or env_name(flag)
        found = read_env(name, aliases=aliases, deprecated=deprecated)
        if found is not None:
            var, raw = found
            try:
                default = type(raw)
            except (TypeError, ValueError) as exc:
                self.error(f"environment variable {var}={raw!r} is invalid for {flag}: {exc}")
            if choices is not None and default not in choices:
                allowed = ", ".join(str(c) for c in choices)
                self.error(f"environment variable {var}={raw!r} must be one of: {allowed}")
            required = False
        action = self.add_argument(
            flag,
            default=default,
            type=type,
            choices=choices,
            required=required,
            help=f"{help} [env {_env_help(name, aliases)}]",
        )
        self._bind(name, action, aliases, deprecated)
        return action

    def add_bool_flag(
        self,
        flag: str,
        *,
        help: str,
        default: bool = False,
        env: str | None = None,
        aliases: Sequence[str] = (),
        deprecated: Sequence[str] = (),
    ) -> None:
        """Add an on/off flag (``--x`` / ``--no-x``) that also reads its variable (true/false)."""
        name = env or env_name(flag)
        found = read_env(name, aliases=aliases, deprecated=deprecated)
        if found is not None:
            default = parse_bool(found[1], name=found[0])
        action = self.add_argument(
            flag,
            action=argparse.BooleanOptionalAction,
            default=default,
            help=f"{help} [env {_env_help(name, aliases)}]",
        )
        self._bind(name, action, aliases, deprecated)


def _env_help(name: str, aliases: Sequence[str]) -> str:
    return " or ".join((name, *aliases))


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
    """``--log-level`` (``GPUSLICE_LOG_LEVEL``) and ``--log-format`` (``GPUSLICE_LOG_FORMAT``),
    the same on every service: one call in each cli.py, the parsed values go to
    ``logging.configure``."""
    # Here, not at the top: node-setup's cli uses this module and must run on the standard
    # library alone (gpuslice_core.logging needs structlog).
    from gpuslice_core.logging import FORMATS, LEVELS

    parser.add_flag(
        "--log-level",
        deprecated=["LOG_LEVEL"],
        default="info",
        choices=LEVELS,
        help="Least severe level of the log lines written (to stdout).",
    )
    parser.add_flag(
        "--log-format",
        deprecated=["LOG_FORMAT"],
        default="json",
        choices=FORMATS,
        help=(
            "json: one object per line with klog's keys (ts, level, msg, logger, err); text:"
            " key=value lines for a terminal. docs/logging.md"
        ),
    )
