"""What ``RawApi`` needs of an API client: the two calls of the kubernetes client's
``ApiClient`` that it makes, as a protocol.

Services pass the kubernetes client's ``ApiClient`` (``gpuslice_kube.client.new_api_client``),
which has these calls; ``kubectl gpuslice`` passes its own client on urllib3 and the standard
library (``gpuslice_kubectl.apiclient``), so the one-file plugin needs neither the kubernetes
client nor the compiled pydantic-core under it (docs/decisions.md, 15). Nothing here imports
the kubernetes client.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import urllib3

Timeout = float | tuple[float, float] | None
"""Seconds for the whole request, or (connect, read)."""


class ApiResponse(Protocol):
    """An answer as ``call_api`` returns it (the kubernetes client's ``RESTResponse``)."""

    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def response(self) -> urllib3.BaseHTTPResponse:
        """The urllib3 response, not yet read (watches stream from it)."""
        ...

    def read(self) -> bytes: ...


class ApiClientLike(Protocol):
    """``param_serialize`` builds a request (the URL with the server and the query, the headers
    with the credentials when ``auth_settings`` names ``BearerToken``, the body as JSON);
    ``call_api`` sends it and returns the answer whatever its status, or raises on a transport
    failure (urllib3's errors, or the kubernetes client's ``ApiException`` wrapping them)."""

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
    ) -> tuple[str, str, dict[str, str], Any, Any]: ...

    def call_api(
        self,
        method: str,
        url: str,
        header_params: Mapping[str, str] | None = None,
        body: Any = None,
        post_params: Any = None,
        _request_timeout: Timeout = None,
    ) -> ApiResponse: ...
