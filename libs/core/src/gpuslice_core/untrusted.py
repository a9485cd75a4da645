"""Input that others wrote, read without letting its size or shape decide our cost.

Objects a tenant can write (a ResourceClaim's opaque parameters, an AdmissionReview of one) and
requests any local client can send (a device plugin's Allocate) reach every gpuslice component.
None of them may crash or stall the component that reads them, and the errors about them go
into gRPC trailers, Events and log lines that have size limits of their own. So:

- JSON is decoded by ``loads``, which refuses nesting deeper than ``MAX_DEPTH`` (the stdlib
  decoder recurses once per level and raised RecursionError at about 1,000 levels, which no
  caller expected; the levels it took were a hazard for every recursive walk after it);
- a list whose page cannot be decoded as a whole is split into its items (``split_items``) so
  that one bad item is skipped and the others are kept; ``prune`` cuts what is nested too
  deep so that the bad item's identity (its metadata) can still be named;
- reports about such input go through ``Throttle`` (one line per key per interval);
- messages quote such input through ``shown`` (at most ``SHOWN`` characters of one value) and
  ``listed`` (the first ``LISTED`` items and how many there are in all), never whole.

Where pydantic-core is not installed (the one-file ``kubectl gpuslice``, which carries no
compiled code: decision 15), ``loads`` checks the depth first and decodes with the standard
library; it refuses the same nesting, and a number too long for ``int`` as ``not JSON``.

Splitting and pruning scan the text once with a regular expression, without recursion, and run
only when the fast decoder has refused a document.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from gpuslice_core.errors import InvalidArgumentError

MAX_DEPTH = 200
"""Levels of nesting a decoded document may have (pydantic-core's JSON parser stops at 200).
Kubernetes objects nest about 20 levels; a list adds 2, a watch event 1. Only free-form fields
(a claim's opaque parameters) nest deeper, and nothing gpuslice accepts there does."""

SHOWN = 64
"""Characters of one value a message quotes."""
LISTED = 5
"""Items of a list a message names."""


def shown(value: object, limit: int = SHOWN) -> str:
    """``repr(value)`` cut to about ``limit`` characters, for messages: ``'1111…' (5000
    characters)``."""
    if isinstance(value, str | bytes) and len(value) > limit:
        return f"{repr(value[:limit])[:limit]}… ({len(value)} characters)"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def listed(items: Sequence[str], limit: int = LISTED, width: int = SHOWN) -> str:
    """The first ``limit`` items, each cut to ``width`` characters, and how many there are:
    ``a, b, c and 9997 more (10000 in all)``."""
    head = [i if len(i) <= width else f"{i[:width]}…" for i in items[:limit]]
    text = ", ".join(head)
    more = len(items) - len(head)
    return f"{text} and {more} more ({len(items)} in all)" if more > 0 else text


class UndecodableError(InvalidArgumentError):
    """JSON this process refuses to decode: nested deeper than ``MAX_DEPTH``, a number beyond
    what a float or a 4,300-digit integer holds, or not JSON at all."""


# A JSON string (escapes included) or a bracket; everything between them is skipped in C.
_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
_OPEN = frozenset(b"[{")
_QUOTE = ord('"')


def _bytes(data: bytes | str) -> bytes:
    return data.encode() if isinstance(data, str) else data


def nesting(data: bytes | str) -> int:
    """The deepest nesting of ``data``'s arrays and objects (0 for a scalar), without
    recursion."""
    depth = deepest = 0
    for match in _TOKENS.finditer(_bytes(data)):
        first = match.group()[0]
        if first == _QUOTE:
            continue
        if first in _OPEN:
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def _reason(exc: ValueError) -> str:
    text = str(exc)
    if text.startswith("recursion limit exceeded"):
        where = text.removeprefix("recursion limit exceeded").strip()
        return f"JSON nested deeper than {MAX_DEPTH} levels ({where})"
    if text.startswith("number out of range"):
        where = text.removeprefix("number out of range").strip()
        return f"a JSON number out of range ({where})"
    return f"not JSON: {text[:200]}"


def _fast_decoder() -> ModuleType | None:
    try:
        import pydantic_core
    except ImportError:
        return None
    return pydantic_core


_FAST = _fast_decoder()


def loads(data: bytes | str) -> Any:
    """Decode ``data``; ``UndecodableError`` says why not. Nothing it returns nests deeper
    than ``MAX_DEPTH``, so recursive walks of the result stay far from Python's limit."""
    if _FAST is not None:
        try:
            return _FAST.from_json(data)
        except ValueError as exc:
            reason = _reason(exc)
            if not reason.startswith("not JSON"):
                raise UndecodableError(reason) from exc
    # The fast parser refuses a few things the standard one takes (a lone surrogate escape,
    # which Kubernetes passes through in raw extensions): let the standard one decide, after
    # checking the depth without recursion.
    depth = nesting(data)
    if depth > MAX_DEPTH:
        raise UndecodableError(f"JSON nested {depth} levels deep (at most {MAX_DEPTH})")
    try:
        return json.loads(data)
    except ValueError as exc:
        raise UndecodableError(f"not JSON: {str(exc)[:200]}") from exc


def split_items(data: bytes | str, key: str = "items") -> tuple[bytes, list[bytes]] | None:
    """Split a list document ``{..., "<key>": [item, ...], ...}`` into the document with an
    empty ``key`` array and the text of each item; None when there is no such array."""
    data = _bytes(data)
    wanted = json.dumps(key).encode()
    depth = 0
    last_key: tuple[bytes, int] | None = None  # the last string at depth 1 and where it ends
    start = end = -1
    item_start = -1
    items: list[bytes] = []
    for match in _TOKENS.finditer(data):
        token = match.group()
        first = token[0]
        if first == _QUOTE:
            if depth == 1:
                last_key = (token, match.end())
            continue
        if first in _OPEN:
            depth += 1
            if (
                depth == 2
                and start < 0
                and token == b"["
                and last_key is not None
                and last_key[0] == wanted
                and data[last_key[1] : match.start()].strip() == b":"
            ):
                start = match.start()
            elif depth == 3 and start >= 0 and end < 0:
                item_start = match.start()
            continue
        if depth == 3 and start >= 0 and end < 0 and item_start >= 0:
            items.append(data[item_start : match.end()])
            item_start = -1
        elif depth == 2 and start >= 0 and end < 0:
            end = match.end()
        depth -= 1
    if start < 0 or end < 0:
        return None
    return data[:start] + b"[]" + data[end:], items


def prune(data: bytes | str, keep: int) -> bytes:
    """``data`` with every array or object nested deeper than ``keep`` levels replaced by
    ``null``: what is left names the document (``metadata.name`` sits at level 2 of an
    object, 3 of a watch event) and decodes whatever was below."""
    data = _bytes(data)
    out: list[bytes] = []
    pos = depth = 0
    cut = -1
    for match in _TOKENS.finditer(data):
        first = match.group()[0]
        if first == _QUOTE:
            continue
        if first in _OPEN:
            depth += 1
            if depth == keep + 1:
                cut = match.start()
            continue
        if depth == keep + 1 and cut >= 0:
            out += [data[pos:cut], b"null"]
            pos, cut = match.end(), -1
        depth -= 1
    out.append(data[pos:])
    return b"".join(out)


def identity(data: bytes | str, level: int = 1) -> dict[str, str]:
    """Name, namespace, UID and resourceVersion of the Kubernetes object at ``level`` of an
    undecodable document (1: the document itself, 2: a watch event's ``object``); empty when
    even that cannot be read."""
    try:
        doc = loads(prune(data, level + 1))
    except UndecodableError:
        return {}
    for _ in range(level - 1):
        doc = doc.get("object") if isinstance(doc, dict) else None
    meta = doc.get("metadata") if isinstance(doc, dict) else None
    if not isinstance(meta, dict):
        return {}
    kept = ("name", "namespace", "uid", "resourceVersion")
    return {k: meta[k] for k in kept if isinstance(meta.get(k), str)}


class Throttle:
    """Says whether to report about ``key`` now: at most once per ``interval`` seconds per
    key, with how many reports were held back since the last one. Keys are forgotten once
    their interval is over, so it holds at most what one interval brought."""

    def __init__(self, interval: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.interval = interval
        self.clock = clock
        self._last: dict[str, tuple[float, int]] = {}  # key -> (last report, held back since)
        self._lock = threading.Lock()

    def allow(self, key: str) -> int | None:
        """None: hold this report back; otherwise report it, with the count held back."""
        now = self.clock()
        with self._lock:
            if len(self._last) > 1024:
                self._last = {k: v for k, v in self._last.items() if now - v[0] < self.interval}
            last = self._last.get(key)
            if last is not None and now - last[0] < self.interval:
                self._last[key] = (last[0], last[1] + 1)
                return None
            self._last[key] = (now, 0)
            return last[1] if last is not None else 0
