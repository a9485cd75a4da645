"""Where kubectl gpuslice reads the model: the controller's /view/ through the API server's
service proxy (or a URL), the API listing, and the fallback between them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpuslice_core.errors import FailedPreconditionError, NotFoundError
from gpuslice_kube.errors import KubeForbiddenError, KubeNotFoundError
from gpuslice_kubectl import remote
from gpuslice_kubectl.remote import (
    Chooser,
    ControllerSource,
    Location,
    NotInstalledError,
    UnavailableError,
)
from gpuslice_view.wire import TOKEN_HEADER

pytestmark = pytest.mark.timeout(10)


class Fixed:
    def __init__(self, name: str, rows: list[Any] | Exception) -> None:
        self.name = name
        self.rows = rows

    def gpu_rows(self) -> list[Any]:
        if isinstance(self.rows, Exception):
            raise self.rows
        return self.rows

    def gpu_row(self, ref: str) -> Any:
        raise NotFoundError(f"no GPU {ref}")

    def claim_rows(self, namespace: str | None) -> list[Any]:
        return []

    def why_pod(self, namespace: str, name: str) -> Any:
        return None


def choose(mode: str, controller: Fixed | Exception) -> tuple[Chooser, list[str]]:
    notes: list[str] = []

    def find() -> Fixed:
        if isinstance(controller, Exception):
            raise controller
        return controller

    return Chooser(mode, Fixed("api", [{"from": "api"}]), find, notes.append), notes


def test_auto_reads_the_controller_when_it_answers_and_says_nothing() -> None:
    chooser, notes = choose("auto", Fixed("controller", [{"from": "controller"}]))
    assert chooser.read(lambda s: s.gpu_rows()) == [{"from": "controller"}]
    assert notes == []


def test_auto_falls_back_to_the_api_with_one_line_that_says_why() -> None:
    controller = Fixed("controller", UnavailableError("the controller answered 503: not synced"))
    chooser, notes = choose("auto", controller)
    assert chooser.read(lambda s: s.gpu_rows()) == [{"from": "api"}]
    assert chooser.read(lambda s: s.gpu_rows()) == [{"from": "api"}]  # not asked again
    [note] = notes
    assert note == (
        "reading from the API server (used columns show -): the controller answered 503: not synced"
    )


def test_auto_reads_the_api_quietly_where_no_controller_is_installed() -> None:
    chooser, notes = choose("auto", NotInstalledError("no controller Service in the cluster"))
    assert chooser.read(lambda s: s.gpu_rows()) == [{"from": "api"}]
    assert notes == []


def test_an_answer_of_the_controller_is_not_a_fallback() -> None:
    chooser, notes = choose("auto", Fixed("controller", []))
    with pytest.raises(NotFoundError):
        chooser.read(lambda s: s.gpu_row("node-x/9"))
    assert notes == []


def test_source_controller_fails_instead_of_falling_back() -> None:
    chooser, notes = choose("controller", UnavailableError("no controller Service"))
    with pytest.raises(FailedPreconditionError, match="no controller Service"):
        chooser.read(lambda s: s.gpu_rows())
    assert notes == []


def test_source_api_never_looks_for_the_controller() -> None:
    chooser, _ = choose("api", AssertionError("looked"))
    assert chooser.read(lambda s: s.gpu_rows()) == [{"from": "api"}]


def test_controller_locations() -> None:
    assert remote.parse("gpuslice/gpuslice-controller") == Location(
        "gpuslice", "gpuslice-controller"
    )
    assert remote.parse("ops/ctl:8443").port == 8443
    assert remote.parse("https://10.0.0.5:9443/").url == "https://10.0.0.5:9443"
    assert (
        Location("ops", "ctl").proxy_path == "/api/v1/namespaces/ops/services/https:ctl:443/proxy"
    )
    for bad in ("ctl", "ops/", "ops/ctl:http", "ops/a/b"):
        with pytest.raises(UnavailableError):
            remote.parse(bad)


class Cluster:
    """A RawApi with a tenant's Service that carries the chart's controller labels, and the
    APIService v1alpha1.view.gpuslice.dev when ``apiservice`` is given."""

    def __init__(self, apiservice: Any | Exception | None) -> None:
        self.apiservice = apiservice
        self.asked: list[str] = []

    def get(self, path: str) -> Any:
        self.asked.append(path)
        if isinstance(self.apiservice, Exception):
            raise self.apiservice
        if path != remote.APISERVICE_PATH or self.apiservice is None:
            raise KubeNotFoundError(path)
        return self.apiservice

    def list(self, path: str, label_selector: str | None = None) -> Any:
        self.asked.append(path)
        labels = {"app.kubernetes.io/part-of": "gpuslice"}
        labels["app.kubernetes.io/component"] = "controller"
        tenant = {"metadata": {"namespace": "team-a", "name": "gpuslice", "labels": labels}}
        return {"items": [tenant]}


def apiservice(service: Any) -> Any:
    return {"metadata": {"name": remote.APISERVICE}, "spec": {"service": service}}


def test_the_controller_is_the_service_the_apiservice_names() -> None:
    raw: Any = Cluster(apiservice({"namespace": "gpuslice", "name": "g-ctl", "port": 8443}))
    assert remote.discover(raw) == Location("gpuslice", "g-ctl", 8443)
    assert raw.asked == ["/apis/apiregistration.k8s.io/v1/apiservices/v1alpha1.view.gpuslice.dev"]
    raw = Cluster(apiservice({"namespace": "gpuslice", "name": "g-ctl"}))
    assert remote.discover(raw).port == 443
    for found, says in [
        (None, "no APIService v1alpha1.view.gpuslice.dev names the controller"),
        (apiservice(None), "names no Service (spec.service)"),
        ({"spec": {}}, "names no Service (spec.service)"),
        (KubeForbiddenError("no"), "may not read the APIService"),
    ]:
        with pytest.raises(UnavailableError) as err:
            remote.discover(Cluster(found))  # type: ignore[arg-type]
        assert says in str(err.value)
        assert "--controller or GPUSLICE_CONTROLLER=<namespace>/<service>" in str(err.value)


def test_a_labelled_service_of_a_tenant_never_receives_the_token() -> None:
    """Without the APIService, auto reads the API listing with one note and sends the token
    nowhere; with it, the token goes to the Service it names, never to the tenant's."""
    raw: Any = Cluster(None)
    client: Any = Client("admin-token", Response(200, [{"from": "controller"}]))
    notes: list[str] = []
    api = Fixed("api", [{"from": "api"}])
    chooser = Chooser(
        "auto", api, lambda: ControllerSource(client, remote.discover(raw)), notes.append
    )
    assert chooser.read(lambda s: s.gpu_rows()) == [{"from": "api"}]
    assert client.sent == []
    assert "/api/v1/services" not in raw.asked
    [note] = notes
    assert note.startswith("reading from the API server (used columns show -): no APIService")
    assert "name the controller with --controller" in note

    raw = Cluster(apiservice({"namespace": "gpuslice", "name": "gpuslice-controller"}))
    chooser = Chooser(
        "auto", api, lambda: ControllerSource(client, remote.discover(raw)), notes.append
    )
    assert chooser.read(lambda s: s.gpu_rows()) == [{"from": "controller"}]
    [(url, headers)] = client.sent
    assert "/namespaces/gpuslice/services/https:gpuslice-controller:443/proxy/" in url
    assert headers[TOKEN_HEADER] == "Bearer admin-token"
    assert not any("team-a" in u for u, _ in client.sent)
    assert "/api/v1/services" not in raw.asked


class Response:
    def __init__(self, status: int, data: Any) -> None:
        self.status = status
        self.data = data if isinstance(data, bytes) else json.dumps(data).encode()

    def read(self) -> bytes:
        return self.data


class Client:
    """The kubernetes ApiClient's two calls, as the proxy path uses them."""

    def __init__(self, token: str | None, answer: Response) -> None:
        self.token = token
        self.answer = answer
        self.sent: list[tuple[str, dict[str, str]]] = []

    def param_serialize(self, **kw: Any) -> tuple[Any, ...]:
        headers = dict(kw.get("header_params") or {})
        if self.token:
            headers["authorization"] = f"Bearer {self.token}"
        return "GET", "https://api:6443" + kw["resource_path"], headers, None, []

    def call_api(self, method: str, url: str, header_params: dict[str, str], **kw: Any) -> Any:
        self.sent.append((url, header_params))
        return self.answer


def test_the_proxy_request_carries_the_token_in_the_header_the_proxy_passes_on() -> None:
    client: Any = Client("tok", Response(200, [{"node": "n"}]))
    ctl = ControllerSource(client, Location("ops", "ctl"))
    assert ctl.gpu_rows() == [{"node": "n"}]
    [(url, headers)] = client.sent
    assert url == "https://api:6443/api/v1/namespaces/ops/services/https:ctl:443/proxy/view/gpus"
    assert headers[TOKEN_HEADER] == "Bearer tok"
    ctl.gpu_row("node-a/0")
    ctl.claim_rows("ml")
    assert [u.rsplit("/proxy", 1)[1] for u, _ in client.sent[1:]] == [
        "/view/gpus/node-a/0",
        "/view/claims?namespace=ml",
    ]


def test_controller_answers_and_failures() -> None:
    lost: Any = Client("tok", Response(404, {"error": "no GPU 'x/9'; GPUs: n/0", "code": 404}))
    with pytest.raises(NotFoundError, match="no GPU 'x/9'"):
        ControllerSource(lost, Location("o", "c")).gpu_row("x/9")
    assert ControllerSource(lost, Location("o", "c")).why_pod("ml", "p") is None
    for status, body, says in [
        (503, {"error": "the cluster view has not synced yet"}, "answered 503: the cluster"),
        (403, {"kind": "Status", "message": "cannot get services/proxy"}, "services/proxy"),
        (404, {"kind": "Status", "message": 'services "c" not found'}, "not found"),
        (502, b"<html>", "answered 502"),
    ]:
        client: Any = Client("tok", Response(status, body))
        with pytest.raises(UnavailableError, match=says):
            ControllerSource(client, Location("o", "c")).gpu_rows()
    certs_only: Any = Client(None, Response(200, []))
    with pytest.raises(UnavailableError, match="no bearer token"):
        ControllerSource(certs_only, Location("o", "c")).gpu_rows()
