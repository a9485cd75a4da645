"""Kubeconfig files read as kubectl reads them, with the standard library and PyYAML only.

The one-file plugin carries no compiled code (decision 15), so it cannot use the kubernetes
client's loader (built on pydantic). This module reads what ``kubectl`` reads:

- the files: ``--kubeconfig`` or ``KUBECONFIG`` (several joined by ``os.pathsep``, merged as
  kubectl merges them: the first file that names a cluster, user or context wins it, and the
  first that sets ``current-context`` sets it; missing files are skipped), else
  ``~/.kube/config``, else the pod's service account (``in_cluster``);
- the context: ``--context`` or ``current-context``, and its ``namespace``;
- the cluster: ``server``, ``certificate-authority`` or ``-data``, ``insecure-skip-tls-verify``,
  ``tls-server-name``, ``proxy-url`` (else ``HTTPS_PROXY``/``NO_PROXY``, as kubectl);
- the user: ``token``, ``tokenFile``, ``client-certificate``/``client-key`` or their ``-data``,
  ``username``/``password``, and ``exec`` credential plugins (``ExecPlugin``).
  ``auth-provider`` (gcp and azure, which kubectl removed; oidc) is refused with a message that
  says to use an exec plugin.

Relative paths resolve against the directory of the file that holds them. Bad input is a
``FailedPreconditionError`` that names the file and the field, e.g.
``users[name=x].exec.apiVersion: unsupported "v1alpha1"; allowed: ...``.
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gpuslice_core.errors import FailedPreconditionError
from gpuslice_kubectl.execplugin import ExecPlugin, parse_exec

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True)
class Cluster:
    """Where the API server is and how its certificate is checked."""

    server: str
    ca_file: Path | None = None
    ca_data: bytes | None = None
    insecure: bool = False
    tls_server_name: str | None = None
    proxy_url: str | None = None
    """``proxy-url``; without it ``HTTPS_PROXY``/``NO_PROXY`` decide, as for kubectl."""


@dataclass(frozen=True)
class User:
    """The credentials of a kubeconfig user entry (``name``), as given."""

    name: str
    token: str | None = None
    token_file: Path | None = None
    cert_file: Path | None = None
    cert_data: bytes | None = None
    key_file: Path | None = None
    key_data: bytes | None = None
    username: str | None = None
    password: str | None = None
    exec: ExecPlugin | None = None


@dataclass(frozen=True)
class Config:
    """What the plugin connects with: one cluster, one user, the context's namespace."""

    cluster: Cluster
    user: User
    namespace: str = ""
    """The context's namespace ("" when it sets none)."""
    source: str = ""
    """Where it came from, for messages: the file(s), or ``in-cluster``."""


@dataclass
class _Merged:
    """The entries of several files, first one wins, each with the file that held it."""

    clusters: dict[str, tuple[Mapping[str, Any], Path]] = field(default_factory=dict)
    users: dict[str, tuple[Mapping[str, Any], Path]] = field(default_factory=dict)
    contexts: dict[str, tuple[Mapping[str, Any], Path]] = field(default_factory=dict)
    current: str = ""


def _bad(where: str, message: str) -> FailedPreconditionError:
    return FailedPreconditionError(f"kubeconfig {where}: {message}")


def _read(path: Path) -> Mapping[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise _bad(str(path), f"cannot be read: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise _bad(str(path), f"is not YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise _bad(str(path), f"is a {type(data).__name__}, not a kubeconfig mapping")
    return data


def _entries(
    data: Mapping[str, Any], key: str, inner: str, path: Path
) -> list[tuple[str, Mapping[str, Any]]]:
    """``clusters``/``users``/``contexts``: a list of ``{name, <inner>: {...}}``."""
    listed = data.get(key) or []
    if not isinstance(listed, list):
        raise _bad(f"{path}: {key}", f"is a {type(listed).__name__}, not a list")
    found: list[tuple[str, Mapping[str, Any]]] = []
    for i, entry in enumerate(listed):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise _bad(f"{path}: {key}[{i}]", "has no name")
        body = entry.get(inner) or {}
        if not isinstance(body, dict):
            raise _bad(f"{path}: {key}[name={entry['name']}].{inner}", "is not a mapping")
        found.append((entry["name"], body))
    return found


def _merge(paths: list[Path]) -> _Merged:
    merged = _Merged()
    for path in paths:
        data = _read(path)
        for key, inner, into in (
            ("clusters", "cluster", merged.clusters),
            ("users", "user", merged.users),
            ("contexts", "context", merged.contexts),
        ):
            for name, body in _entries(data, key, inner, path):
                into.setdefault(name, (body, path))
        if not merged.current and data.get("current-context"):
            merged.current = str(data["current-context"])
    return merged


def _string(body: Mapping[str, Any], key: str, where: str) -> str | None:
    value = body.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise _bad(f"{where}.{key}", f"is a {type(value).__name__}, not a string")
    return value


def _path(body: Mapping[str, Any], key: str, where: str, base: Path) -> Path | None:
    """A file a kubeconfig names; a relative one is relative to that kubeconfig's folder."""
    value = _string(body, key, where)
    if value is None:
        return None
    path = Path(value).expanduser()
    return path if path.is_absolute() else base.parent / path


def _data(body: Mapping[str, Any], key: str, where: str) -> bytes | None:
    value = _string(body, key, where)
    if value is None:
        return None
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _bad(f"{where}.{key}", "is not base64") from exc


def _bool(body: Mapping[str, Any], key: str, where: str) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise _bad(f"{where}.{key}", f"is {value!r}, not true or false")
    return value


def _cluster(name: str, body: Mapping[str, Any], path: Path) -> Cluster:
    where = f"{path}: clusters[name={name}].cluster"
    server = _string(body, "server", where)
    if server is None:
        raise _bad(f"{where}.server", "is missing")
    if not server.startswith(("https://", "http://")):
        raise _bad(f"{where}.server", f"{server!r} is not an http(s):// URL")
    return Cluster(
        server=server.rstrip("/"),
        ca_file=_path(body, "certificate-authority", where, path),
        ca_data=_data(body, "certificate-authority-data", where),
        insecure=_bool(body, "insecure-skip-tls-verify", where),
        tls_server_name=_string(body, "tls-server-name", where),
        proxy_url=_proxy(body, where),
    )


def _proxy(body: Mapping[str, Any], where: str) -> str | None:
    url = _string(body, "proxy-url", where)
    if url is not None and not url.startswith(("http://", "https://")):
        raise _bad(
            f"{where}.proxy-url",
            f"{url!r}: only http:// and https:// proxies are supported (not socks)",
        )
    return url


def _user(name: str, body: Mapping[str, Any], path: Path) -> User:
    where = f"{path}: users[name={name}].user"
    if body.get("auth-provider"):
        provider = body["auth-provider"]
        kind = provider.get("name", "?") if isinstance(provider, dict) else "?"
        raise _bad(
            f"{where}.auth-provider",
            f"{kind!r} is not supported; use an exec credential plugin (users[].user.exec) "
            "instead, e.g. gke-gcloud-auth-plugin, kubelogin (kubectl itself removed the gcp "
            "and azure providers)",
        )
    exec_body = body.get("exec")
    if exec_body is not None and not isinstance(exec_body, dict):
        raise _bad(f"{where}.exec", "is not a mapping")
    return User(
        name=name,
        token=_string(body, "token", where),
        token_file=_path(body, "tokenFile", where, path),
        cert_file=_path(body, "client-certificate", where, path),
        cert_data=_data(body, "client-certificate-data", where),
        key_file=_path(body, "client-key", where, path),
        key_data=_data(body, "client-key-data", where),
        username=_string(body, "username", where),
        password=_string(body, "password", where),
        exec=parse_exec(exec_body, f"{where}.exec", path) if exec_body else None,
    )


def paths_of(kubeconfig: str | None) -> list[Path]:
    """The files a ``--kubeconfig``/``KUBECONFIG`` value names (``os.pathsep``-joined)."""
    return [Path(p).expanduser() for p in (kubeconfig or "").split(os.pathsep) if p]


def load(kubeconfig: str, context: str | None = None) -> Config:
    """The config of ``context`` (else the current context) in ``kubeconfig``'s files."""
    paths = paths_of(kubeconfig)
    existing = [p for p in paths if p.is_file()]
    shown = os.pathsep.join(str(p) for p in paths)
    if not existing:
        raise FailedPreconditionError(f"--kubeconfig {shown}: no such file")
    merged = _merge(existing)
    chosen = context or merged.current
    if not chosen:
        raise _bad(shown, "sets no current-context; give --context")
    if chosen not in merged.contexts:
        raise _bad(shown, f"no context {chosen!r} (contexts: {', '.join(merged.contexts)})")
    body, path = merged.contexts[chosen]
    where = f"{path}: contexts[name={chosen}].context"
    cluster_name = _string(body, "cluster", where)
    user_name = _string(body, "user", where) or ""
    if cluster_name is None:
        raise _bad(f"{where}.cluster", "is missing")
    if cluster_name not in merged.clusters:
        raise _bad(f"{where}.cluster", f"names no cluster entry: {cluster_name!r}")
    if user_name and user_name not in merged.users:
        raise _bad(f"{where}.user", f"names no user entry: {user_name!r}")
    cluster = _cluster(cluster_name, *merged.clusters[cluster_name])
    user = _user(user_name, *merged.users[user_name]) if user_name else User(name="")
    return Config(
        cluster=cluster,
        user=user,
        namespace=_string(body, "namespace", where) or "",
        source=shown,
    )


def in_cluster(env: Mapping[str, str] | None = None, account: Path = SERVICE_ACCOUNT) -> Config:
    """The pod's service account: its token (read again for each request, as the kubelet
    rotates it) and CA, and the API server of ``KUBERNETES_SERVICE_HOST``/``_PORT``."""
    env = os.environ if env is None else env
    host = env.get("KUBERNETES_SERVICE_HOST", "")
    port = env.get("KUBERNETES_SERVICE_PORT", "")
    token = account / "token"
    if not host or not port or not token.is_file():
        raise FailedPreconditionError(
            "no --kubeconfig (KUBECONFIG) given and not running in a pod with a service "
            f"account: KUBERNETES_SERVICE_HOST/PORT unset or no {token}"
        )
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    namespace_file = account / "namespace"
    namespace = namespace_file.read_text().strip() if namespace_file.is_file() else ""
    ca = account / "ca.crt"
    return Config(
        cluster=Cluster(server=f"https://{host}:{port}", ca_file=ca if ca.is_file() else None),
        user=User(name="in-cluster", token_file=token),
        namespace=namespace,
        source="in-cluster",
    )
