"""Which claims the watch-fed claim cache answers for (events fed by hand; the cache against a
real API server is tested in e2e/tests/kubelet_plugin/test_kubelet_plugin_claimcache.py)."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes.client import ApiClient

from gpuslice_draplugin import ClaimCache, ClaimRef, ResourceApi, ServerInfo
from gpuslice_kube.raw import RawApi

pytestmark = pytest.mark.timeout(30)
Obj = dict[str, Any]
POOL = "node-a"
DRIVER = "gpu.example.com"


def claim(name: str, uid: str, *, pool: str | None = POOL, driver: str = DRIVER) -> Obj:
    obj: Obj = {"metadata": {"namespace": "ns", "name": name, "uid": uid}}
    if pool is not None:
        results = [{"driver": driver, "pool": pool, "device": "gpu-0", "request": "gpu"}]
        obj["status"] = {"allocation": {"devices": {"results": results}}}
    return obj


@pytest.fixture
def cache() -> ClaimCache:
    """A cache whose reflector is synced but not running: events come from the test."""
    api = ResourceApi(RawApi(ApiClient()), ServerInfo(version="v1", minor=35))
    cache = ClaimCache(api, driver=DRIVER, pool=POOL)
    cache.reflector = cache.new_reflector()
    cache.reflector.synced.set()
    return cache


def feed(cache: ClaimCache, event: str, obj: Obj) -> None:
    """What the reflector does: store (or drop) the object, then call the handler."""
    assert cache.reflector is not None
    key = f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"
    if event == "DELETED":
        cache.reflector.cache.pop(key, None)
    else:
        cache.reflector.cache[key] = cache.reflector.keep(obj)
    cache.observe(event, obj)


def test_a_cache_not_started_answers_nothing() -> None:
    api = ResourceApi(RawApi(ApiClient()), ServerInfo(version="v1", minor=35))
    unsynced = ClaimCache(api, driver=DRIVER, pool=POOL)
    assert unsynced.get(ClaimRef("ns", "c", "u1")) is None  # not started: read the API


def test_a_claim_allocated_here_is_answered_by_uid(cache: ClaimCache) -> None:
    feed(cache, "ADDED", claim("c", "u1"))
    assert cache.get(ClaimRef("ns", "c", "u1")) == claim("c", "u1")
    assert cache.get(ClaimRef("ns", "c", "u-other")) is None  # re-created: the API decides
    assert cache.get(ClaimRef("ns", "d", "u1")) is None


def test_claims_of_other_pools_drivers_or_unallocated_are_not_kept(cache: ClaimCache) -> None:
    feed(cache, "ADDED", claim("other-pool", "u1", pool="node-b"))
    feed(cache, "ADDED", claim("other-driver", "u2", driver="x.example.com"))
    feed(cache, "ADDED", claim("pending", "u3", pool=None))
    assert cache.get(ClaimRef("ns", "other-pool", "u1")) is None
    assert cache.get(ClaimRef("ns", "other-driver", "u2")) is None
    assert cache.get(ClaimRef("ns", "pending", "u3")) is None
    assert cache.reflector is not None
    # not ours: the reflector holds only what it needs to diff a relist
    assert [c.get("status") for c in cache.reflector.cache.values()] == [None, None, None]


def test_a_deallocated_or_deleted_claim_is_no_longer_answered(cache: ClaimCache) -> None:
    feed(cache, "ADDED", claim("c", "u1"))
    feed(cache, "MODIFIED", claim("c", "u1", pool=None))
    assert cache.get(ClaimRef("ns", "c", "u1")) is None
    feed(cache, "MODIFIED", claim("c", "u1"))
    feed(cache, "DELETED", claim("c", "u1"))
    assert cache.get(ClaimRef("ns", "c", "u1")) is None


def test_after_unprepare_the_uid_waits_until_the_claim_left_the_pool(cache: ClaimCache) -> None:
    feed(cache, "ADDED", claim("c", "u1"))
    cache.unprepared(ClaimRef("ns", "c", "u1"))
    # the allocation held now may be the one just unprepared: prepare reads the API
    assert cache.get(ClaimRef("ns", "c", "u1")) is None
    feed(cache, "MODIFIED", claim("c", "u1"))  # still the same allocation as far as we know
    assert cache.get(ClaimRef("ns", "c", "u1")) is None
    feed(cache, "MODIFIED", claim("c", "u1", pool=None))  # deallocated ...
    feed(cache, "MODIFIED", claim("c", "u1"))  # ... and allocated again: this one is newer
    assert cache.get(ClaimRef("ns", "c", "u1")) == claim("c", "u1")
