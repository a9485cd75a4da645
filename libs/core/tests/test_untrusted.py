"""Decoding what others wrote: bounded nesting, lists that keep their good items, names of the
bad ones, bounded quotes, throttled reports."""

from __future__ import annotations

import json
import time

import pytest

from gpuslice_core import untrusted
from gpuslice_core.untrusted import (
    MAX_DEPTH,
    Throttle,
    UndecodableError,
    identity,
    listed,
    loads,
    nesting,
    prune,
    shown,
    split_items,
)

pytestmark = pytest.mark.timeout(10)

DEEP = '{"a":' * 1500 + "1" + "}" * 1500


def obj(name: str, spec: str = '{"x":1}') -> str:
    meta = {"name": name, "namespace": "ns", "uid": f"u-{name}", "resourceVersion": "7"}
    return (
        '{"metadata":'
        + json.dumps(meta)[:-1]
        + ',"managedFields":['
        + spec
        + ']},"spec":'
        + (spec + "}")
    )


def test_nesting_is_bounded_without_recursion() -> None:
    assert nesting(DEEP) == 1500
    assert nesting('{"s":"[[{{","t":["\\"]"]}') == 2  # brackets in strings do not count
    with pytest.raises(UndecodableError, match=f"JSON nested deeper than {MAX_DEPTH} levels"):
        loads(DEEP)
    assert loads("[" * MAX_DEPTH + "]" * MAX_DEPTH) is not None


def test_what_the_fast_parser_refuses_the_standard_one_decides() -> None:
    assert loads('{"x":"\\ud800"}') == {"x": "\ud800"}  # Kubernetes passes such escapes on
    with pytest.raises(UndecodableError, match="out of range"):
        loads('{"x":' + "1" * 5000 + "}")
    with pytest.raises(UndecodableError, match="not JSON"):
        loads("{nope")


def test_without_pydantic_core_the_standard_decoder_keeps_the_bounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kubectl gpuslice carries no pydantic-core: the same nesting is refused, numbers too long
    for int are not JSON, the rest decodes as before."""
    monkeypatch.setattr(untrusted, "_FAST", None)
    with pytest.raises(
        UndecodableError, match=f"JSON nested 1500 levels deep \\(at most {MAX_DEPTH}"
    ):
        loads(DEEP)
    assert loads("[" * MAX_DEPTH + "]" * MAX_DEPTH) is not None
    assert loads(obj("a"))["metadata"]["name"] == "a"
    assert loads('{"x":"\\ud800"}') == {"x": "\ud800"}
    with pytest.raises(UndecodableError, match="not JSON"):
        loads('{"x":' + "1" * 5000 + "}")
    with pytest.raises(UndecodableError, match="not JSON"):
        loads("{nope")


def test_a_list_keeps_its_good_items_and_names_the_bad_one() -> None:
    page = (
        '{"kind":"List","metadata":{"resourceVersion":"9","continue":"c"},"items":['
        + ",".join([obj("a"), obj("bad", DEEP), obj("b")])
        + "]}"
    )
    split = split_items(page)
    assert split is not None
    envelope, items = split
    assert json.loads(envelope) == {
        "kind": "List",
        "metadata": {"resourceVersion": "9", "continue": "c"},
        "items": [],
    }
    assert [len(i) < 200 for i in items] == [True, False, True]
    assert loads(items[0])["metadata"]["name"] == "a"
    assert identity(items[1]) == {
        "name": "bad",
        "namespace": "ns",
        "uid": "u-bad",
        "resourceVersion": "7",
    }
    event = '{"type":"MODIFIED","object":' + obj("bad", DEEP) + "}"
    assert identity(event, level=2)["name"] == "bad"
    assert loads(prune(event, 1)) == {"type": "MODIFIED", "object": None}
    assert split_items('{"kind":"Status"}') is None


def test_splitting_a_big_page_is_linear() -> None:
    page = '{"items":[' + ",".join([obj(f"o{i}") for i in range(2000)] + [obj("x", DEEP)]) + "]}"
    start = time.perf_counter()
    split = split_items(page)
    took = time.perf_counter() - start
    assert split is not None and len(split[1]) == 2001
    assert took < 1.0, took


def test_quotes_are_bounded() -> None:
    assert shown("20Gi") == "'20Gi'"
    text = shown("1" * 5000)
    assert len(text) < 100 and text.endswith("(5000 characters)")
    assert listed([str(i) for i in range(10_000)]) == "0, 1, 2, 3, 4 and 9995 more (10000 in all)"
    assert listed(["x" * 500]) == "x" * 64 + "…"


def test_throttle_reports_once_per_interval_and_counts_the_rest() -> None:
    now = [0.0]
    throttle = Throttle(60.0, clock=lambda: now[0])
    assert throttle.allow("a") == 0
    assert throttle.allow("a") is None
    assert throttle.allow("b") == 0
    now[0] = 30.0
    assert throttle.allow("a") is None
    now[0] = 61.0
    assert throttle.allow("a") == 2
