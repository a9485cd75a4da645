"""Strict decoding of configuration and API documents into pydantic models.

Every file or object a user writes (fake NVML configs, MIG layouts, opaque claim configs) is
decoded the same way: YAML without duplicate keys, models that forbid unknown keys, and one
error line per offending key that names it — ``gpus[1].model: unknown GPU model 'H101'`` or
``mig-configs.x[0].devcies: unknown key; allowed keys here: device-filter, devices, ...``.
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

ModelT = TypeVar("ModelT", bound=BaseModel)
Loc = tuple[int | str, ...]


class _UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that refuses a key given twice in one mapping (YAML allows it silently)."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_yaml(text: str, *, source: str, error: type[Exception]) -> Any:
    """Parse YAML (duplicate keys are errors); raise ``error`` naming ``source``."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise error(f"{source}: invalid YAML: {exc}") from exc


def read_text(path: str | Path, *, what: str, error: type[Exception]) -> str:
    """Read a config file; ``error`` says which file and why when it cannot be read."""
    file = Path(path)
    try:
        return file.read_text(encoding="utf-8")
    except OSError as exc:
        raise error(f"cannot read {what} {file}: {exc.strerror}") from exc


def decode(model: type[ModelT], data: Any, *, source: str, error: type[Exception]) -> ModelT:
    """Validate ``data`` into ``model``; every problem is named by its key path."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise error(f"{source}: {describe_errors(exc, model)}") from exc


def key_path(loc: Loc) -> str:
    """``('gpus', 1, 'model')`` → ``gpus[1].model``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<top level>"


def describe_errors(exc: ValidationError, model: type[BaseModel] | None = None) -> str:
    """One ``key: problem`` per offending key; the alternatives of a union are merged.

    With ``model`` an unknown key also lists the keys allowed at that place.
    """
    errors = [(_clean_loc(tuple(err["loc"])), err) for err in exc.errors()]
    locs = [loc for loc, _ in errors]
    merged: dict[Loc, list[str]] = {}
    inputs: dict[Loc, Any] = {}
    for loc, err in errors:
        if any(other[: len(loc)] == loc and len(other) > len(loc) for other in locs):
            continue  # a union member that went deeper explains it better
        if err["type"] == "extra_forbidden":
            allowed = ", ".join(allowed_keys(model, loc[:-1])) if model else ""
            message = "unknown key" + (f"; allowed keys here: {allowed}" if allowed else "")
        elif err["type"] == "missing":
            message = "required key is missing"
        else:
            message = str(err["msg"]).removeprefix("Value error, ")
            inputs[loc] = err.get("input")
        seen = merged.setdefault(loc, [])
        if seen and message.startswith("Input should be "):
            message = message.removeprefix("Input should be ")
        if message not in seen:
            seen.append(message)
    parts = []
    for loc, messages in merged.items():
        text = f"{key_path(loc)}: {' or '.join(messages)}"
        if loc in inputs and not isinstance(inputs[loc], dict | list):
            text += f" (got {inputs[loc]!r})"
        parts.append(text)
    return "; ".join(parts)


def allowed_keys(model: type[BaseModel], loc: Loc) -> list[str]:
    """The keys the model found at ``loc`` accepts (through lists, maps and optionals)."""
    candidates: list[Any] = [model]
    for part in loc:
        candidates = [nxt for ann in candidates for nxt in _step(ann, part)]
    for ann in candidates:
        for inner in _flatten(ann):
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                return sorted(f.alias or name for name, f in inner.model_fields.items())
    return []


def _clean_loc(loc: Loc) -> Loc:
    # Union members appear in pydantic's loc ("literal['all']", "list[int]", "str"): drop them.
    return tuple(
        p for p in loc if not (isinstance(p, str) and ("[" in p or p in {"str", "int", "bool"}))
    )


def _flatten(annotation: Any) -> list[Any]:
    """Strip Annotated/Optional/Union layers: the concrete alternatives."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _flatten(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [alt for arg in typing.get_args(annotation) for alt in _flatten(arg)]
    return [annotation]


def _step(annotation: Any, part: int | str) -> list[Any]:
    """The annotations one loc ``part`` below ``annotation``."""
    out: list[Any] = []
    for ann in _flatten(annotation):
        origin = typing.get_origin(ann)
        args = typing.get_args(ann)
        if isinstance(ann, type) and issubclass(ann, BaseModel) and isinstance(part, str):
            field = next((f for n, f in ann.model_fields.items() if part in (n, f.alias)), None)
            if field is not None:
                out.append(field.annotation)
        elif origin in (list, tuple, set, frozenset) and isinstance(part, int) and args:
            out.append(args[0])
        elif origin is dict and len(args) == 2:
            out.append(args[1])
    return out
