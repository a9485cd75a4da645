"""The plugin's API client: urllib3 and the standard library, no kubernetes client.

``KubeClient`` has the two calls of the kubernetes client's ``ApiClient`` that ``RawApi`` and
the controller source make (``gpuslice_kube.transport.ApiClientLike``), for a ``Config`` from
``kubeconfig``: TLS as the cluster entry says (CA file or data, ``insecure-skip-tls-verify``,
``tls-server-name``), a client certificate where the user has one (given, or from an exec
plugin), and an ``Authorization`` header for a token (given, from ``tokenFile``, from an exec
plugin) or a username and password (decision 15).
"""

from __future__ import annotations

import base64
import json
import ssl
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit
from urllib.request import (  # type: ignore[attr-defined] # (no stub for the second)
    getproxies_environment,
    proxy_bypass_environment,
)

import urllib3

from gpuslice_core.errors import FailedPreconditionError
from gpuslice_kube.transport import Timeout
from gpuslice_kubectl.execplugin import ExecRunner
from gpuslice_kubectl.kubeconfig import Config, User


class Response:
    """An answer, as the kubernetes client's ``RESTResponse`` gives it."""

    def __init__(self, response: urllib3.BaseHTTPResponse) -> None:
        self.response = response
        self._data: bytes | None = None

    @property
    def status(self) -> int:
        return int(self.response.status)

    @property
    def headers(self) -> Mapping[str, str]:
        return self.response.headers

    def read(self) -> bytes:
        if self._data is None:
            self._data = self.response.read()
        return self._data


def _pem(data: bytes | None, file: Path | None, what: str, user: User) -> bytes | None:
    if data is not None:
        return data
    if file is None:
        return None
    try:
        return file.read_bytes()
    except OSError as exc:
        raise FailedPreconditionError(
            f"kubeconfig users[name={user.name}]: the {what} {file} cannot be read: "
            f"{exc.strerror or exc}"
        ) from exc


class KubeClient:
    """Requests to the API server of ``config`` with its user's credentials."""

    def __init__(self, config: Config, *, user_agent: str, exec_runner: ExecRunner | None = None):
        self.config = config
        self.user_agent = user_agent
        user = config.user
        if exec_runner is None and user.exec is not None:
            exec_runner = ExecRunner(user.exec, self._cluster_info())
        self.exec_runner = exec_runner
        self._cert = _pem(user.cert_data, user.cert_file, "client certificate", user)
        self._key = _pem(user.key_data, user.key_file, "client key", user)
        if bool(self._cert) != bool(self._key):
            raise FailedPreconditionError(
                f"kubeconfig users[name={user.name}]: a client certificate needs both "
                "client-certificate(-data) and client-key(-data)"
            )
        self._pools: dict[tuple[bytes, bytes] | None, urllib3.PoolManager] = {}

    def _cluster_info(self) -> dict[str, Any]:
        """``spec.cluster`` of ``KUBERNETES_EXEC_INFO`` (provideClusterInfo)."""
        cluster = self.config.cluster
        info: dict[str, Any] = {"server": cluster.server}
        ca = cluster.ca_data
        if ca is None and cluster.ca_file is not None and cluster.ca_file.is_file():
            ca = cluster.ca_file.read_bytes()
        if ca:
            info["certificate-authority-data"] = base64.b64encode(ca).decode()
        if cluster.insecure:
            info["insecure-skip-tls-verify"] = True
        if cluster.tls_server_name:
            info["tls-server-name"] = cluster.tls_server_name
        return info

    def _credentials(self) -> tuple[str | None, tuple[bytes, bytes] | None]:
        """The ``Authorization`` value and the client certificate and key, as of now."""
        user = self.config.user
        pair = (self._cert, self._key) if self._cert and self._key else None
        if self.exec_runner is not None:
            got = self.exec_runner.credential()
            if got.cert_pem and got.key_pem:
                pair = (got.cert_pem, got.key_pem)
            if got.token:
                return f"Bearer {got.token}", pair
        if user.token:
            return f"Bearer {user.token}", pair
        if user.token_file is not None:
            try:
                token = user.token_file.read_text().strip()
            except OSError as exc:
                raise FailedPreconditionError(
                    f"kubeconfig users[name={user.name}].user.tokenFile: {user.token_file} "
                    f"cannot be read: {exc.strerror or exc}"
                ) from exc
            return f"Bearer {token}", pair
        if user.username is not None and user.password is not None:
            basic = base64.b64encode(f"{user.username}:{user.password}".encode()).decode()
            return f"Basic {basic}", pair
        return None, pair

    def _pool(self, pair: tuple[bytes, bytes] | None) -> urllib3.PoolManager:
        if pair not in self._pools:
            self._pools[pair] = self._new_pool(pair)
        return self._pools[pair]

    def _new_pool(self, pair: tuple[bytes, bytes] | None) -> urllib3.PoolManager:
        cluster = self.config.cluster
        kwargs: dict[str, Any] = {}
        if cluster.insecure:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
            kwargs["cert_reqs"] = "CERT_NONE"
            warnings.simplefilter("ignore", urllib3.exceptions.InsecureRequestWarning)
        elif cluster.ca_data is None and cluster.ca_file is None:
            context = ssl.create_default_context()  # the system's roots, as kubectl's
        else:  # the cluster's CA alone, as kubectl trusts it: not the system's roots too
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            try:
                if cluster.ca_data is not None:
                    context.load_verify_locations(cadata=cluster.ca_data.decode())
                else:
                    context.load_verify_locations(cafile=str(cluster.ca_file))
            except (OSError, ssl.SSLError, UnicodeDecodeError) as exc:
                raise FailedPreconditionError(
                    f"kubeconfig {self.config.source}: the cluster's certificate authority "
                    f"cannot be loaded: {exc}"
                ) from exc
        if pair is not None:
            _load_pair(context, pair, self.config.user)
        if cluster.tls_server_name:
            kwargs["server_hostname"] = cluster.tls_server_name
            if not cluster.insecure:
                kwargs["assert_hostname"] = cluster.tls_server_name
        proxy = self._proxy()
        if proxy is not None:
            return urllib3.ProxyManager(proxy, ssl_context=context, **kwargs)
        return urllib3.PoolManager(ssl_context=context, **kwargs)

    def _proxy(self) -> str | None:
        """The cluster's ``proxy-url``, else the environment's proxy for its server
        (``HTTPS_PROXY``, or ``HTTP_PROXY`` for an http:// server, unless ``NO_PROXY`` names
        it), as kubectl takes them."""
        cluster = self.config.cluster
        if cluster.proxy_url:
            return cluster.proxy_url
        proxies = getproxies_environment()
        server = urlsplit(cluster.server)
        if server.hostname and proxy_bypass_environment(server.hostname, proxies):
            return None
        proxy = proxies.get(server.scheme) or None
        if proxy is not None and not proxy.startswith(("http://", "https://")):
            raise FailedPreconditionError(
                f"the {server.scheme.upper()}_PROXY environment variable {proxy!r}: only "
                "http:// and https:// proxies are supported (not socks)"
            )
        return proxy

    def param_serialize(
        self,
        method: str,
        resource_path: str,
        path_params: Any = None,
        query_params: Sequence[tuple[str, Any]] | None = None,
        header_params: Mapping[str, str] | None = None,
        body: Any = None,
        post_params: Any = None,
        files: Any = None,
        auth_settings: Sequence[str] | None = None,
        collection_formats: Any = None,
        _host: Any = None,
        _request_auth: Any = None,
    ) -> tuple[str, str, dict[str, str], Any, Any]:
        """The URL (server, path, query), the headers (with the credentials when
        ``auth_settings`` names ``BearerToken``) and the body as JSON."""
        url = self.config.cluster.server + resource_path
        if query_params:
            url += "?" + urlencode([(k, _query_value(v)) for k, v in query_params])
        headers = {"User-Agent": self.user_agent, **(header_params or {})}
        if auth_settings and "BearerToken" in auth_settings:
            authorization, _pair = self._credentials()
            if authorization:
                headers["Authorization"] = authorization
        serialized = None if body is None else json.dumps(body).encode()
        return method, url, headers, serialized, post_params

    def call_api(
        self,
        method: str,
        url: str,
        header_params: Mapping[str, str] | None = None,
        body: Any = None,
        post_params: Any = None,
        _request_timeout: Timeout = None,
    ) -> Response:
        """Send the request; any status is an answer, transport failures raise urllib3's
        errors (``gpuslice_kube.errors.from_exception`` classifies them)."""
        _authorization, pair = self._credentials()
        timeout: urllib3.Timeout | None = None
        if isinstance(_request_timeout, tuple):
            timeout = urllib3.Timeout(connect=_request_timeout[0], read=_request_timeout[1])
        elif _request_timeout is not None:
            timeout = urllib3.Timeout(total=_request_timeout)
        response = self._pool(pair).request(
            method,
            url,
            headers=dict(header_params or {}),
            body=body,
            timeout=timeout,
            preload_content=False,
            redirect=False,
        )
        return Response(response)


def _query_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _load_pair(context: ssl.SSLContext, pair: tuple[bytes, bytes], user: User) -> None:
    """The client certificate and key, through files only this process can read (the ssl
    module loads them from files only), removed at once."""
    with tempfile.TemporaryDirectory(prefix="kubectl-gpuslice-") as tmp:
        cert, key = Path(tmp) / "client.crt", Path(tmp) / "client.key"
        for path, data in ((cert, pair[0]), (key, pair[1])):
            path.touch(mode=0o600)
            path.write_bytes(data)
        try:
            context.load_cert_chain(str(cert), str(key))
        except ssl.SSLError as exc:
            raise FailedPreconditionError(
                f"kubeconfig users[name={user.name}]: the client certificate and key cannot be "
                f"used: {exc}"
            ) from exc
