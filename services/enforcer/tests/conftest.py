"""The hook a protocol test runs: each kind in turn (the static Go binary the chart installs,
and the Python hook); the Go one skips, saying why, only where there is no Go to build it."""

from __future__ import annotations

import pytest

from gpuslice_testkit.enforcer import HOOK_KINDS, hook_missing


@pytest.fixture(params=HOOK_KINDS)
def hook_kind(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    reason = hook_missing(kind)
    if reason:
        pytest.skip(reason)
    return kind
