"""Who is asking, on a request the API server's aggregator proxies (request-header auth).

The aggregator authenticates the user itself, then calls us with its front-proxy client
certificate and the user in headers (``X-Remote-User``, ``X-Remote-Group``,
``X-Remote-Extra-<key>``, or the names the cluster configured). The headers are only as good as
the certificate: anyone who can reach the port can write them. So they are read only when the
TLS connection presented a client certificate that

- chains to the request-header CA (the TLS layer checks this: the server's context asks for an
  optional client certificate and trusts only that CA, see ``ServingCert.set_client_ca``), and
- names one of ``requestheader-allowed-names`` in its common name (any, when the list is empty,
  as upstream).

Everything comes from the ConfigMap ``kube-system/extension-apiserver-authentication`` that the
API server keeps (``RequestHeaderConfig.from_configmap``), as every aggregated API server reads
it (k8s.io/apiserver ``RequestHeaderAuthRequestController``); ``ConfigWatch`` re-reads it every
``interval`` seconds so a rotated front-proxy CA is picked up.

A request without such a certificate gets no user from here at all, whatever its headers say.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from email.message import Message
from typing import Any
from urllib.parse import unquote

from gpuslice_core.errors import GpusliceError
from gpuslice_core.logging import get_logger
from gpuslice_kube.errors import KubeNotFoundError
from gpuslice_kube.raw import RawApi, resource_path

log = get_logger(__name__)

CONFIGMAP = ("kube-system", "extension-apiserver-authentication")


@dataclass(frozen=True)
class RequestHeaderConfig:
    client_ca: bytes
    allowed_names: frozenset[str] = frozenset()
    username_headers: tuple[str, ...] = ("X-Remote-User",)
    group_headers: tuple[str, ...] = ("X-Remote-Group",)
    extra_prefixes: tuple[str, ...] = ("X-Remote-Extra-",)

    @classmethod
    def from_configmap(cls, data: Mapping[str, str]) -> RequestHeaderConfig | None:
        """The request-header settings of the ConfigMap's ``data``; None when it has no
        ``requestheader-client-ca-file`` (the API server proxies to no aggregated API then)."""
        ca = data.get("requestheader-client-ca-file", "").strip()
        if not ca:
            return None

        def names(key: str, default: tuple[str, ...]) -> tuple[str, ...]:
            raw = data.get(key)
            if not raw:
                return default
            try:
                listed = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{'/'.join(CONFIGMAP)}: {key} is not a JSON list") from exc
            return tuple(str(x) for x in listed) or default

        return cls(
            client_ca=ca.encode() + b"\n",
            allowed_names=frozenset(names("requestheader-allowed-names", ())),
            username_headers=names("requestheader-username-headers", cls.username_headers),
            group_headers=names("requestheader-group-headers", cls.group_headers),
            extra_prefixes=names("requestheader-extra-headers-prefix", cls.extra_prefixes),
        )


@dataclass(frozen=True)
class User:
    """A user as a SubjectAccessReview names one."""

    name: str
    groups: tuple[str, ...] = ()
    extra: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def as_obj(self) -> dict[str, Any]:
        """As TokenReview's ``status.user`` names a user (what ``auth.Authorizer`` reviews)."""
        user: dict[str, Any] = {"username": self.name, "groups": list(self.groups)}
        if self.extra:
            user["extra"] = {k: list(v) for k, v in self.extra.items()}
        return user


def _common_names(peercert: Mapping[str, Any]) -> list[str]:
    return [
        value for rdn in peercert.get("subject", ()) for key, value in rdn if key == "commonName"
    ]


def proxied_user(
    config: RequestHeaderConfig | None,
    peercert: Mapping[str, Any] | None,
    headers: Message,
) -> User | None:
    """The user the aggregator names, or None: no request-header config, no verified client
    certificate (``ssl``'s ``getpeercert()`` is empty unless the chain was verified), a common
    name not allowed, or no user header."""
    if config is None or not peercert:
        return None
    if config.allowed_names and not set(_common_names(peercert)) & config.allowed_names:
        return None
    name = next((str(headers[h]) for h in config.username_headers if headers.get(h)), "")
    if not name:
        return None
    groups = tuple(
        g.strip()
        for h in config.group_headers
        for value in headers.get_all(h) or []
        for g in str(value).split(",")
        if g.strip()
    )
    extra: dict[str, list[str]] = {}
    for header, value in headers.items():
        for prefix in config.extra_prefixes:
            if header.lower().startswith(prefix.lower()) and len(header) > len(prefix):
                key = unquote(header[len(prefix) :]).lower()
                extra.setdefault(key, []).extend(v.strip() for v in str(value).split(","))
    return User(name, groups, {k: tuple(v) for k, v in extra.items()})


class ConfigWatch:
    """Keeps the request-header config current; ``on_change(config)`` when it changes (the
    server then trusts the new CA for client certificates)."""

    def __init__(
        self,
        raw: RawApi,
        on_change: Callable[[RequestHeaderConfig | None], None],
        interval: float = 60.0,
    ) -> None:
        self.raw = raw
        self.on_change = on_change
        self.interval = interval
        self.config: RequestHeaderConfig | None = None
        self.loaded = threading.Event()

    def load(self) -> None:
        namespace, name = CONFIGMAP
        try:
            cm = self.raw.get(resource_path("v1", "configmaps", namespace=namespace, name=name))
            config = RequestHeaderConfig.from_configmap(cm.get("data") or {})
        except KubeNotFoundError:
            config = None
        except (GpusliceError, ValueError) as exc:
            log.warning("cannot read the front-proxy configuration", error=str(exc))
            return
        if config is None:
            log.warning(
                "no requestheader-client-ca-file in kube-system/extension-apiserver-"
                "authentication: the aggregated API answers no proxied request"
            )
        if config != self.config or not self.loaded.is_set():
            self.config = config
            self.on_change(config)
        self.loaded.set()

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.load()
            stop.wait(self.interval)
