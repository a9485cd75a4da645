"""Input that others wrote, read without letting its size or shape decide our cost.

Objects a tenant can write (a ResourceClaim's opaque parameters, an AdmissionReview of one) and
requests any local client can send (a device plugin's Allocate) reach every gpuslice component.
None of them may crash or stall the component that reads them, and the errors about them go
into gRPC trailers, Events and log lines that have size limits of their own. So:

- messages quote such input through ``shown`` (at most ``SHOWN`` characters of one value) and
  ``listed`` (the first ``LISTED`` items and how many there are in all), never whole.
"""

from __future__ import annotations

from collections.abc import Sequence

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
