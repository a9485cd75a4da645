from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from gpuslice_kube.client import new_api_client
from gpuslice_kube.errors import (
    ConflictError,
    GoneError,
    KubeAlreadyExistsError,
    KubeInvalidError,
    KubeNotFoundError,
    KubeUnreachableError,
)
from gpuslice_kube.raw import RawApi, resource_path
from gpuslice_kube.reflector import Reflector, metadata_only

# The scripted server fixture from conftest.py (not importable under importlib mode).
ScriptedServer = Any

SLICES = "/apis/resource.k8s.io/v1/resourceslices"


def obj(name: str, rv: str) -> dict[str, Any]:
    meta = {"name": name, "uid": f"uid-{name}", "resourceVersion": rv}
    return {"metadata": meta, "spec": {"driver": "d"}}


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "code": code, "reason": reason, "message": message}


def test_resource_paths() -> None:
    assert resource_path("v1", "pods", namespace="ns", name="p") == "/api/v1/namespaces/ns/pods/p"
    assert resource_path("resource.k8s.io/v1", "resourceslices") == SLICES


def test_list_follows_continue_tokens(
    apiserver: ScriptedServer, api_client: client.ApiClient
) -> None:
    def route(method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, Any]:
        if query.get("continue") == "page2":
            return 200, {"items": [obj("b", "2")], "metadata": {"resourceVersion": "9"}}
        return 200, {"items": [obj("a", "1")], "metadata": {"continue": "page2"}}

    apiserver.route = route
    listing = RawApi(api_client).list(SLICES, label_selector="x=y")
    assert [o["metadata"]["name"] for o in listing["items"]] == ["a", "b"]
    assert listing["metadata"]["resourceVersion"] == "9"
    assert apiserver.requests[0][2]["labelSelector"] == "x=y"


def test_transient_failures_are_retried(
    apiserver: ScriptedServer, api_client: client.ApiClient
) -> None:
    answers = [
        (503, status(503, "ServiceUnavailable", "etcd down")),
        (429, {}),
        (200, obj("a", "1")),
    ]
    apiserver.route = lambda *_: answers.pop(0)
    assert RawApi(api_client).get(SLICES + "/a")["metadata"]["name"] == "a"
    assert len(apiserver.requests) == 3


def test_an_unreachable_api_server_is_retried_unless_the_caller_says_it_is_final(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A refused connection is ``KubeUnreachableError`` naming the server: retried like any
    transient failure for a service, given up at once for a command a person runs."""
    attempts = 0
    request = RawApi._request

    def counted(self: RawApi, *args: Any, **kwargs: Any) -> Any:
        nonlocal attempts
        attempts += 1
        return request(self, *args, **kwargs)

    monkeypatch.setattr(RawApi, "_request", counted)
    with socket.socket() as s:  # bound, never listening: connections are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        config = client.Configuration()
        config.host = f"http://127.0.0.1:{port}"
        config.retries = False  # urllib3's own retries, not ours
        api = client.ApiClient(config)
        with pytest.raises(KubeUnreachableError) as final:
            RawApi(api, deadline=30.0, unreachable_is_final=True).get(SLICES)
        assert attempts == 1
        assert final.value.server == f"127.0.0.1:{port}"
        assert f"cannot connect to the API server at 127.0.0.1:{port}" in str(final.value)
        attempts = 0
        with pytest.raises(KubeUnreachableError):
            RawApi(api, deadline=0.5).get(SLICES)
        assert attempts > 1


@pytest.mark.parametrize(
    ("code", "reason", "error"),
    [
        (404, "NotFound", KubeNotFoundError),
        (409, "AlreadyExists", KubeAlreadyExistsError),
        (409, "Conflict", ConflictError),
        (422, "Invalid", KubeInvalidError),
    ],
)
def test_permanent_failures_carry_the_server_message(
    apiserver: ScriptedServer,
    api_client: client.ApiClient,
    code: int,
    reason: str,
    error: type[Exception],
) -> None:
    message = 'ResourceSlice.resource.k8s.io "s" is invalid: spec.devices: Too many: 129'
    apiserver.route = lambda *_: (code, status(code, reason, message))
    with pytest.raises(error, match=r"spec\.devices: Too many: 129"):
        RawApi(api_client).create(SLICES, obj("s", ""))
    assert len(apiserver.requests) == 1, "permanent errors must not be retried"


def test_watch_streams_events_and_reports_expiry(
    apiserver: ScriptedServer, api_client: client.ApiClient
) -> None:
    events = [
        {"type": "ADDED", "object": obj("a", "5")},
        {"type": "ERROR", "object": status(410, "Expired", "too old resource version")},
    ]
    apiserver.route = lambda *_: (200, events)
    stream = RawApi(api_client).watch(SLICES, resource_version="4")
    seen = []
    with pytest.raises(GoneError, match="too old"):
        for event in stream:
            seen.append((event.type, event.object["metadata"]["name"]))
    assert seen == [("ADDED", "a")]
    assert apiserver.requests[0][2]["resourceVersion"] == "4"


@pytest.mark.parametrize("keep", [None, metadata_only])
def test_reflector_relists_after_expiry_and_reports_missed_deletes(
    apiserver: ScriptedServer,
    api_client: client.ApiClient,
    keep: Callable[[dict[str, Any]], dict[str, Any]] | None,
) -> None:
    lists = [[obj("a", "1"), obj("b", "2")], [obj("a", "3")]]
    watches = [
        [
            {"type": "MODIFIED", "object": obj("a", "3")},
            {"type": "ERROR", "object": status(410, "Expired", "too old")},
        ],
        [{"type": "BOOKMARK", "object": obj("", "4")}],
    ]

    def route(method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, Any]:
        if query.get("watch") == "true":
            return 200, watches.pop(0)
        return 200, {"items": lists.pop(0), "metadata": {"resourceVersion": "2"}}

    apiserver.route = route
    seen: list[tuple[str, str]] = []
    done = threading.Event()

    def handler(event_type: str, o: dict[str, Any]) -> None:
        seen.append((event_type, o["metadata"]["name"]))
        if event_type == "DELETED":
            done.set()

    reflector = Reflector(RawApi(api_client), SLICES, handler, keep=keep)
    reflector.start()
    assert done.wait(10), f"no DELETED after relist; saw {seen}"
    reflector.stop()
    # A cache that keeps only names and versions diffs relists the same way.
    assert seen == [("ADDED", "a"), ("ADDED", "b"), ("MODIFIED", "a"), ("DELETED", "b")]
    assert set(reflector.cache) == {"a"}
    if keep is metadata_only:
        assert reflector.cache["a"] == {
            "metadata": {"name": "a", "uid": "uid-a", "resourceVersion": "3"}
        }
    else:
        assert reflector.cache["a"] == obj("a", "3")
    assert not reflector._thread or not reflector._thread.is_alive(), "stop() must end the thread"


def test_client_from_kubeconfig_with_a_wider_pool(tmp_path: Any) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'https://127.0.0.1:6443'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
    )
    api = new_api_client(kubeconfig, user_agent="gpuslice-test/1", pool_size=32)
    assert api.configuration.host == "https://127.0.0.1:6443"
    assert api.rest_client.pool_manager.connection_pool_kw["maxsize"] == 32
    assert api.user_agent == "gpuslice-test/1"
