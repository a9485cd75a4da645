"""Reading the view from the controller's ``/view/`` JSON, and choosing between it and the API.

Where the controller runs, ``kubectl gpuslice`` asks it: its model has live usage (the used
columns), which a listing of the API cannot have. The request goes through the API server's
service proxy, ``/api/v1/namespaces/<ns>/services/https:<service>:<port>/proxy/view/...``, with
the user's own kubeconfig credentials, so it works from anywhere kubectl does. The API server
removes ``Authorization`` once it has authenticated the user with it, so the user's bearer
token is sent again as ``X-Gpuslice-Authorization``, which the proxy passes on and the
controller reviews as it reviews ``Authorization`` (TokenReview + SubjectAccessReview). A
``https://`` location connects straight to the controller instead (from inside the cluster, or
a port-forward), with the token in ``Authorization``.

The user's token goes only to a controller a cluster admin named: the Service that the APIService
``v1alpha1.view.gpuslice.dev`` (cluster-scoped; the chart registers it) names in ``spec.service``,
or one named with ``--controller`` / ``GPUSLICE_CONTROLLER`` as ``<namespace>/<service>[:port]``
or ``https://host:port``. Never a Service found by labels: where anyone who may create a Service
could make one with the chart's labels, that would hand them the token of whoever runs the
plugin (issue 32). ``Chooser`` reads from the controller (``--source controller``), from the API
(``api``), or from the controller when found and answering, else from the API with one line on
stderr that says why (``auto``).
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast
from urllib.parse import quote, urlencode

from gpuslice_core.errors import FailedPreconditionError, GpusliceError, NotFoundError
from gpuslice_kube.errors import KubeForbiddenError, KubeNotFoundError
from gpuslice_kube.raw import RawApi
from gpuslice_kube.transport import ApiClientLike
from gpuslice_view.report import Row
from gpuslice_view.resource import GROUP, VERSION
from gpuslice_view.wire import TOKEN_HEADER

APISERVICE = f"{VERSION}.{GROUP}"
"""The chart's APIService; its ``spec.service`` is the controller's Service."""
APISERVICE_PATH = f"/apis/apiregistration.k8s.io/v1/apiservices/{APISERVICE}"
NAME_IT = "name the controller with --controller or GPUSLICE_CONTROLLER=<namespace>/<service>"
PORT = 443
TIMEOUT = 10.0
SOURCES = ("auto", "view-api", "controller", "api")
T = TypeVar("T")


class UnavailableError(GpusliceError):
    """The controller cannot answer (not found, not reachable, not authorized, not synced)."""


class NotInstalledError(UnavailableError):
    """No controller in the cluster: ``auto`` reads from the API without a note (nothing is
    wrong; a cluster without the controller is a supported setup)."""


class NotServedError(NotInstalledError):
    """The source does not answer this kind of question (an older controller's view API serves
    GPUs only): the next source answers it, without a note."""


class ViewSource(Protocol):
    name: str

    def gpu_rows(self) -> list[Row]: ...
    def gpu_row(self, ref: str) -> Row: ...
    def claim_rows(self, namespace: str | None) -> list[Row]: ...
    def why_pod(self, namespace: str, name: str) -> Row | None: ...


@dataclass(frozen=True)
class Location:
    """Where the controller is: a Service (reached through the API server) or a URL."""

    namespace: str = ""
    service: str = ""
    port: int = PORT
    url: str = ""

    def __str__(self) -> str:
        return self.url or f"{self.namespace}/{self.service}:{self.port}"

    @property
    def proxy_path(self) -> str:
        return (
            f"/api/v1/namespaces/{self.namespace}/services/https:{self.service}:{self.port}/proxy"
        )


def parse(spec: str) -> Location:
    """``<namespace>/<service>[:port]`` or ``https://host[:port]``."""
    if spec.startswith("https://"):
        return Location(url=spec.rstrip("/"))
    namespace, _, rest = spec.partition("/")
    service, _, port = rest.partition(":")
    if not namespace or not service or "/" in service or (port and not port.isdigit()):
        raise UnavailableError(
            f"--controller {spec!r}: give <namespace>/<service>[:port] or https://host[:port]"
        )
    return Location(namespace, service, int(port) if port else PORT)


def discover(raw: RawApi) -> Location:
    """The Service that the APIService ``v1alpha1.view.gpuslice.dev`` names.

    Only cluster admins create APIServices, so the Service it names is one an admin chose; the
    chart's ClusterRole ``<release>-gpus`` lets viewers read this one APIService. Without it
    (or without its ``spec.service``) no Service is trusted with the token: the caller falls
    back to the API listing with a note that says how to name the controller.
    """
    try:
        found = raw.get(APISERVICE_PATH)
    except KubeNotFoundError as exc:
        raise UnavailableError(
            f"no APIService {APISERVICE} names the controller, and no other Service is trusted "
            f"with your token; {NAME_IT}"
        ) from exc
    except KubeForbiddenError as exc:
        raise UnavailableError(
            f"may not read the APIService {APISERVICE} that names the controller; {NAME_IT}"
        ) from exc
    service = (found.get("spec") or {}).get("service") or {}
    if not service.get("namespace") or not service.get("name"):
        raise UnavailableError(
            f"the APIService {APISERVICE} names no Service (spec.service), and no other Service "
            f"is trusted with your token; {NAME_IT}"
        )
    return Location(
        str(service["namespace"]), str(service["name"]), int(service.get("port") or PORT)
    )


class ControllerSource:
    """The commands' answers from the controller's ``/view/`` (docs/controller.md)."""

    name = "controller"

    def __init__(self, api_client: ApiClientLike, where: Location, *, ca_file: str | None = None):
        self.api_client = api_client
        self.where = where
        self.ca_file = ca_file

    def gpu_rows(self) -> list[Row]:
        rows: list[Row] = self._get("gpus")
        return rows

    def gpu_row(self, ref: str) -> Row:
        row: Row = self._get("gpus/" + "/".join(quote(p, safe="") for p in ref.split("/")))
        return row

    def claim_rows(self, namespace: str | None) -> list[Row]:
        query = f"?{urlencode({'namespace': namespace})}" if namespace else ""
        rows: list[Row] = self._get("claims" + query)
        return rows

    def why_pod(self, namespace: str, name: str) -> Row | None:
        try:
            answer: Row = self._get(f"why/{quote(namespace, safe='')}/{quote(name, safe='')}")
        except NotFoundError:
            return None
        return answer

    def _authorization(self) -> str:
        """The kubeconfig's ``Bearer <token>`` (exec plugins and refresh included)."""
        _m, _u, headers, _b, _p = self.api_client.param_serialize(
            method="GET", resource_path="/", auth_settings=["BearerToken"]
        )
        value = str(headers.get("authorization") or headers.get("Authorization") or "")
        if not value.lower().startswith("bearer "):
            raise UnavailableError(
                "the kubeconfig's credentials have no bearer token (the controller reviews "
                "tokens; client certificates cannot be passed on to it)"
            )
        return value

    def _get(self, path: str) -> Any:
        authorization = self._authorization()
        if self.where.url:
            status, body = self._direct(f"{self.where.url}/view/{path}", authorization)
        else:
            status, body = self._proxied(f"{self.where.proxy_path}/view/{path}", authorization)
        try:
            data = json.loads(body) if body else {}
        except ValueError:
            data = {"message": body[:200].decode(errors="replace")}
        if status == 200:
            return data
        message = str(data.get("error") or data.get("message") or f"HTTP {status}")
        if status == 404 and "error" in data:  # the controller's own answer: no such GPU/pod
            raise NotFoundError(message)
        raise UnavailableError(f"the controller {self.where} answered {status}: {message}")

    def _proxied(self, path: str, authorization: str) -> tuple[int, bytes]:
        headers = {"Accept": "application/json", TOKEN_HEADER: authorization}
        _m, url, headers, _b, _p = self.api_client.param_serialize(
            method="GET", resource_path=path, header_params=headers, auth_settings=["BearerToken"]
        )
        try:
            response = self.api_client.call_api(
                "GET", url, header_params=headers, _request_timeout=TIMEOUT
            )
        except Exception as exc:  # transport failures of the client: the controller is unknown
            raise UnavailableError(f"the API server did not pass the request on: {exc}") from exc
        return int(response.status), response.read() or b""

    def _direct(self, url: str, authorization: str) -> tuple[int, bytes]:
        request = urllib.request.Request(url, headers={"Authorization": authorization})  # noqa: S310 - https only (parse)
        context = ssl.create_default_context(cafile=self.ca_file)
        try:
            with urllib.request.urlopen(request, context=context, timeout=TIMEOUT) as r:  # noqa: S310
                return int(r.status), bytes(r.read())
        except urllib.error.HTTPError as exc:
            return int(exc.code), bytes(exc.read())
        except (urllib.error.URLError, OSError) as exc:
            raise UnavailableError(f"the controller {url} did not answer: {exc}") from exc


class Chooser:
    """Runs each read on the chosen source: the view API (``view_api``), the controller, the
    API listing, or (``auto``) the first of them that is installed and answers, saying why once
    on ``note`` where one is installed and does not answer."""

    def __init__(
        self,
        mode: str,
        api: ViewSource,
        controller: Callable[[], ViewSource],
        note: Callable[[str], None],
        view_api: ViewSource | None = None,
    ) -> None:
        self.mode = mode
        self.api = api
        self._controller = controller
        self.note = note
        self.view_api = view_api

    def from_view_api(self, fn: Callable[[ViewSource], T]) -> tuple[bool, T | None]:
        """``(True, fn's answer)`` from the view API; ``(False, None)`` where it is not chosen,
        not installed, not serving this question (an older controller), or not answering (said
        once on ``note``, and the view API is not asked again; with ``--source=view-api``, an
        error)."""
        if self.mode not in ("auto", "view-api") or self.view_api is None:
            return False, None
        try:
            return True, fn(self.view_api)
        except NotServedError:
            return False, None  # a question for the next source; the view API stays first
        except UnavailableError as exc:
            if self.mode == "view-api":
                raise FailedPreconditionError(str(exc)) from exc
            if not isinstance(exc, NotInstalledError):
                self.note(f"not reading from the view API: {exc}")
            self.view_api = None
            return False, None

    def read(self, fn: Callable[[ViewSource], T]) -> T:
        answered, answer = self.from_view_api(fn)
        if answered:
            return cast(T, answer)
        if self.mode == "view-api":
            return fn(self.api)  # (what an older controller's view API does not serve)
        if self.mode != "api":
            try:
                return fn(self._controller())
            except UnavailableError as exc:
                if self.mode == "controller":
                    raise FailedPreconditionError(str(exc)) from exc
                if not isinstance(exc, NotInstalledError):
                    self.note(f"reading from the API server (used columns show -): {exc}")
                self.mode = "api"
        return fn(self.api)
