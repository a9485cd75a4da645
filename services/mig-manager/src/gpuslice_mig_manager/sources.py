"""Where layouts come from: a mig-parted file (a mounted ConfigMap) or a ConfigMap read live.

A source is read at every application, so an edited file or ConfigMap is used for the next
label change (and re-applied by the controller when it changes, see ``on_change``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from gpuslice_core.errors import FailedPreconditionError
from gpuslice_mig_manager.layouts import LayoutConfig, load_layouts_file, parse_layouts

DEFAULT_KEY = "config.yaml"


class LayoutSource(Protocol):
    def describe(self) -> str: ...

    def load(self) -> LayoutConfig:
        """The current layouts; ``LayoutError`` when malformed, ``FailedPrecondition`` when
        not available yet."""
        ...


class FileLayouts:
    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)

    def describe(self) -> str:
        return f"file {self.path}"

    def load(self) -> LayoutConfig:
        return load_layouts_file(self.path)


def parse_config_map_ref(value: str) -> tuple[str, str, str]:
    """``NAMESPACE/NAME[:KEY]`` -> (namespace, name, key); ValueError naming the flag."""
    ref, _, key = value.partition(":")
    namespace, sep, name = ref.partition("/")
    if not sep or not namespace or not name or "/" in name:
        raise ValueError(
            f"--config-map {value!r} must be NAMESPACE/NAME or NAMESPACE/NAME:KEY"
            f" (default key {DEFAULT_KEY})"
        )
    return namespace, name, key or DEFAULT_KEY


class ConfigMapLayouts:
    """The layouts in one key of a ConfigMap, kept current by a reflector (``update``)."""

    def __init__(self, namespace: str, name: str, key: str = DEFAULT_KEY) -> None:
        self.namespace = namespace
        self.name = name
        self.key = key
        self._text: str | None = None
        self._present = False
        self._lock = threading.Lock()
        self.on_change: Callable[[], None] | None = None

    def describe(self) -> str:
        return f"ConfigMap {self.namespace}/{self.name} key {self.key}"

    def update(self, data: dict[str, str] | None) -> None:
        """The ConfigMap's ``data`` as last seen; ``None`` when it does not exist."""
        text = None if data is None else data.get(self.key)
        with self._lock:
            changed = (data is not None) != self._present or text != self._text
            self._present = data is not None
            self._text = text
        if changed and self.on_change is not None:
            self.on_change()

    def load(self) -> LayoutConfig:
        with self._lock:
            present, text = self._present, self._text
        if not present:
            raise FailedPreconditionError(f"{self.describe()}: the ConfigMap does not exist")
        if text is None:
            raise FailedPreconditionError(f"{self.describe()}: the ConfigMap has no key {self.key}")
        return parse_layouts(text, source=self.describe())
