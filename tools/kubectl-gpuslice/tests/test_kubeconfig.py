"""The plugin's kubeconfig loader and client, against a local HTTPS server with a throwaway CA:
what the server receives (token, basic auth, client certificate) for each kind of user entry,
and the messages for entries the plugin cannot use. The CA is the sandbox's
(``gpuslice_testkit.certs.TinyCA``)."""

from __future__ import annotations

import base64
import json
import select
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

from gpuslice_core.errors import FailedPreconditionError
from gpuslice_kube.errors import KubeError
from gpuslice_kube.raw import RawApi
from gpuslice_kubectl import kubeconfig
from gpuslice_kubectl.apiclient import KubeClient
from gpuslice_kubectl.execplugin import ExecRunner
from gpuslice_testkit.certs import TinyCA


class Echo(BaseHTTPRequestHandler):
    """Answers every GET with what it saw: the Authorization header and the client
    certificate's common name."""

    def do_GET(self) -> None:
        cert = self.connection.getpeercert() if isinstance(self.connection, ssl.SSLSocket) else None
        rdns: Any = (cert or {}).get("subject", ())
        subject = {k: v for rdn in rdns for k, v in rdn}
        body = json.dumps(
            {
                "path": self.path,
                "authorization": self.headers.get("Authorization"),
                "client": subject.get("commonName"),
                "agent": self.headers.get("User-Agent"),
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@dataclass
class Server:
    url: str
    ca: TinyCA
    dir: Path


def _serve(ca: TinyCA, cert: Path, key: Path) -> Iterator[str]:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(cert), str(key))
    context.load_verify_locations(cafile=str(ca.pair.cert))
    context.verify_mode = ssl.CERT_OPTIONAL  # client certificates are checked when sent
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    where = tmp_path_factory.mktemp("pki")
    ca = TinyCA(where / "ca")
    serving = ca.serving("apiserver")
    for url in _serve(ca, serving.cert, serving.key):
        yield Server(url, ca, where)


def write(path: Path, user: dict[str, Any], cluster: dict[str, Any], **context: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": cluster}],
                "users": [{"name": "u", "user": user}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u", **context}}],
                "current-context": "x",
            }
        )
    )
    return path


def seen(config: kubeconfig.Config, runner: ExecRunner | None = None) -> dict[str, Any]:
    """What the server saw of one GET through the plugin's client."""
    client = KubeClient(config, user_agent="kubectl-gpuslice/test", exec_runner=runner)
    return RawApi(client, deadline=0.5, unreachable_is_final=True).get("/api")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_token_with_the_ca_file_relative_to_the_kubeconfig(server: Server, tmp_path: Path) -> None:
    (tmp_path / "kube" / "pki").mkdir(parents=True)
    (tmp_path / "kube" / "pki" / "ca.crt").write_bytes(server.ca.cert_pem)
    path = write(
        tmp_path / "kube" / "config",
        {"token": "t0k"},
        {"server": server.url, "certificate-authority": "pki/ca.crt"},
    )
    got = seen(kubeconfig.load(str(path)))
    assert got["authorization"] == "Bearer t0k"
    assert got["agent"] == "kubectl-gpuslice/test"


def test_token_file_and_ca_data(server: Server, tmp_path: Path) -> None:
    (tmp_path / "token").write_text("from-file\n")
    cluster = {"server": server.url, "certificate-authority-data": b64(server.ca.cert_pem)}
    path = write(tmp_path / "config", {"tokenFile": "token"}, cluster)
    assert seen(kubeconfig.load(str(path)))["authorization"] == "Bearer from-file"


def test_client_certificate_as_data_and_as_relative_files(server: Server, tmp_path: Path) -> None:
    pair = server.ca.client("alice", "alice", out_dir=tmp_path / "certs")
    cluster = {"server": server.url, "certificate-authority-data": b64(server.ca.cert_pem)}
    data = {
        "client-certificate-data": b64(pair.cert.read_bytes()),
        "client-key-data": b64(pair.key.read_bytes()),
    }
    got = seen(kubeconfig.load(str(write(tmp_path / "a", data, cluster))))
    assert (got["client"], got["authorization"]) == ("alice", None)
    files = {"client-certificate": "certs/alice.crt", "client-key": "certs/alice.key"}
    assert seen(kubeconfig.load(str(write(tmp_path / "b", files, cluster))))["client"] == "alice"


def test_basic_auth(server: Server, tmp_path: Path) -> None:
    cluster = {"server": server.url, "certificate-authority-data": b64(server.ca.cert_pem)}
    path = write(tmp_path / "config", {"username": "ann", "password": "pw"}, cluster)
    expected = "Basic " + b64(b"ann:pw")
    assert seen(kubeconfig.load(str(path)))["authorization"] == expected


def test_an_unknown_ca_fails_and_insecure_skips_the_check(server: Server, tmp_path: Path) -> None:
    other = TinyCA(tmp_path / "other")
    cluster = {"server": server.url, "certificate-authority-data": b64(other.cert_pem)}
    with pytest.raises(KubeError, match="CERTIFICATE_VERIFY_FAILED"):
        seen(kubeconfig.load(str(write(tmp_path / "a", {"token": "t"}, cluster))))
    insecure = {"server": server.url, "insecure-skip-tls-verify": True}
    got = seen(kubeconfig.load(str(write(tmp_path / "b", {"token": "t"}, insecure))))
    assert got["authorization"] == "Bearer t"


def test_a_ca_file_that_is_not_there_is_named(tmp_path: Path) -> None:
    cluster = {"server": "https://127.0.0.1:1", "certificate-authority": "nope/ca.crt"}
    config = kubeconfig.load(str(write(tmp_path / "config", {"token": "t"}, cluster)))
    with pytest.raises(FailedPreconditionError, match="certificate authority cannot be loaded"):
        seen(config)
    assert config.cluster.ca_file == tmp_path / "nope" / "ca.crt"


def test_tls_server_name_is_the_name_checked(server: Server, tmp_path: Path) -> None:
    """A certificate for apiserver.internal only, reached by address with tls-server-name."""
    named = server.ca.issue("named", "apiserver", dns_names=("apiserver.internal",), server=True)
    for url in _serve(server.ca, named.cert, named.key):
        cluster = {"server": url, "certificate-authority-data": b64(server.ca.cert_pem)}
        with pytest.raises(KubeError, match=r"apiserver\.internal|IP address mismatch"):
            seen(kubeconfig.load(str(write(tmp_path / "a", {"token": "t"}, cluster))))
        cluster["tls-server-name"] = "apiserver.internal"
        got = seen(kubeconfig.load(str(write(tmp_path / "b", {"token": "t"}, cluster))))
        assert got["authorization"] == "Bearer t"


class Connect(BaseHTTPRequestHandler):
    """An HTTP proxy that only tunnels (CONNECT), and counts the tunnels it opened."""

    tunnels: ClassVar[list[str]] = []

    def do_CONNECT(self) -> None:
        host, _, port = self.path.rpartition(":")
        upstream = socket.create_connection((host, int(port)), timeout=10)
        Connect.tunnels.append(self.path)
        self.send_response(200)
        self.end_headers()
        sockets = [self.connection, upstream]
        try:
            while True:
                ready, _, _ = select.select(sockets, [], [], 10)
                if not ready:
                    return
                for sock in ready:
                    data = sock.recv(65536)
                    if not data:
                        return
                    (upstream if sock is self.connection else self.connection).sendall(data)
        finally:
            upstream.close()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_proxy_url_and_https_proxy_tunnel_to_the_server(
    server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), Connect)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{proxy.server_address[1]}"
    Connect.tunnels.clear()
    try:
        cluster = {"server": server.url, "certificate-authority-data": b64(server.ca.cert_pem)}
        for var in ("HTTPS_PROXY", "https_proxy", "NO_PROXY", "no_proxy"):
            monkeypatch.delenv(var, raising=False)
        plain = kubeconfig.load(str(write(tmp_path / "a", {"token": "t"}, cluster)))
        assert seen(plain)["authorization"] == "Bearer t"
        assert Connect.tunnels == []
        proxied = {**cluster, "proxy-url": url}
        got = seen(kubeconfig.load(str(write(tmp_path / "b", {"token": "t"}, proxied))))
        assert got["authorization"] == "Bearer t"
        assert Connect.tunnels == [server.url.removeprefix("https://")]
        monkeypatch.setenv("HTTPS_PROXY", url)
        assert seen(plain)["authorization"] == "Bearer t"
        assert len(Connect.tunnels) == 2
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        assert seen(plain)["authorization"] == "Bearer t"
        assert len(Connect.tunnels) == 2  # NO_PROXY names the server: straight to it
    finally:
        proxy.shutdown()
        proxy.server_close()
    socks = {**cluster, "proxy-url": "socks5://127.0.0.1:1080"}
    with pytest.raises(FailedPreconditionError, match=r"proxy-url: 'socks5://127\.0\.0\.1:1080'"):
        kubeconfig.load(str(write(tmp_path / "c", {"token": "t"}, socks)))


def plugin_script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "plugin.py"
    script.write_text("import json, os, sys, pathlib\n" + body)
    return script


def exec_user(script: Path, version: str = "client.authentication.k8s.io/v1", **more: Any) -> Any:
    return {
        "exec": {
            "apiVersion": version,
            "command": sys.executable,
            "args": [str(script)],
            "env": [{"name": "PLUGIN_SAYS", "value": "hello"}],
            "interactiveMode": "Never",
            **more,
        }
    }


def test_exec_v1_token_is_fetched_again_when_it_expires(server: Server, tmp_path: Path) -> None:
    script = plugin_script(
        tmp_path,
        "runs = pathlib.Path(sys.argv[0]).with_name('runs')\n"
        "n = len(runs.read_text()) + 1 if runs.exists() else 1\n"
        "runs.write_text('x' * n)\n"
        "pathlib.Path(sys.argv[0]).with_name('info').write_text(os.environ['KUBERNETES_EXEC_INFO'])\n"
        "print(json.dumps({'apiVersion': 'client.authentication.k8s.io/v1', "
        "'kind': 'ExecCredential', 'status': {'token': f\"tok-{n}-{os.environ['PLUGIN_SAYS']}\", "
        "'expirationTimestamp': '2030-01-01T00:00:00Z'}}))\n",
    )
    cluster = {"server": server.url, "certificate-authority-data": b64(server.ca.cert_pem)}
    user = exec_user(script, provideClusterInfo=True)
    config = kubeconfig.load(str(write(tmp_path / "config", user, cluster)))
    assert config.user.exec is not None
    now = [1_800_000_000.0]  # 2027: before the expiry
    client = KubeClient(config, user_agent="t")
    runner = ExecRunner(
        config.user.exec, client._cluster_info(), clock=lambda: now[0], terminal=lambda: True
    )
    assert seen(config, runner)["authorization"] == "Bearer tok-1-hello"
    assert seen(config, runner)["authorization"] == "Bearer tok-1-hello"  # still valid: kept
    now[0] = 1_900_000_000.0  # 2030-03: expired
    assert seen(config, runner)["authorization"] == "Bearer tok-2-hello"
    info = json.loads((tmp_path / "info").read_text())
    assert info["apiVersion"] == "client.authentication.k8s.io/v1"
    assert info["kind"] == "ExecCredential"
    assert info["spec"]["interactive"] is False  # interactiveMode Never, whatever the terminal
    assert info["spec"]["cluster"]["server"] == server.url
    assert info["spec"]["cluster"]["certificate-authority-data"] == b64(server.ca.cert_pem)


def test_exec_v1beta1_client_certificate(server: Server, tmp_path: Path) -> None:
    pair = server.ca.client("bob", "bob", out_dir=tmp_path)
    cred = {
        "apiVersion": "client.authentication.k8s.io/v1beta1",
        "kind": "ExecCredential",
        "status": {
            "clientCertificateData": pair.cert.read_text(),
            "clientKeyData": pair.key.read_text(),
        },
    }
    script = plugin_script(tmp_path, f"print(json.dumps({cred!r}))\n")
    cluster = {"server": server.url, "certificate-authority-data": b64(server.ca.cert_pem)}
    user = exec_user(script, "client.authentication.k8s.io/v1beta1")
    del user["exec"]["interactiveMode"]  # optional in v1beta1
    got = seen(kubeconfig.load(str(write(tmp_path / "config", user, cluster))))
    assert (got["client"], got["authorization"]) == ("bob", None)


def test_a_failing_exec_plugin_names_the_user_the_command_and_its_stderr(
    server: Server, tmp_path: Path
) -> None:
    script = plugin_script(
        tmp_path, "print('login expired: run sso login', file=sys.stderr)\nsys.exit(3)\n"
    )
    cluster = {"server": server.url, "insecure-skip-tls-verify": True}
    config = kubeconfig.load(str(write(tmp_path / "config", exec_user(script), cluster)))
    with pytest.raises(FailedPreconditionError) as failed:
        seen(config)
    message = str(failed.value)
    assert "users[name=u].user.exec" in message
    assert str(script) in message and "exit status 3" in message
    assert "login expired: run sso login" in message


@pytest.mark.parametrize(
    ("user", "says"),
    [
        (
            {"exec": {"apiVersion": "client.authentication.k8s.io/v1alpha1", "command": "x"}},
            'users[name=u].user.exec.apiVersion: unsupported "client.authentication.k8s.io/'
            'v1alpha1"; allowed: client.authentication.k8s.io/v1, '
            "client.authentication.k8s.io/v1beta1",
        ),
        (
            {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": "x"}},
            "users[name=u].user.exec.interactiveMode: is required for v1; allowed: Never, "
            "IfAvailable, Always",
        ),
        (
            {"auth-provider": {"name": "gcp", "config": {}}},
            "users[name=u].user.auth-provider: 'gcp' is not supported; use an exec credential "
            "plugin (users[].user.exec) instead",
        ),
        ({"token": 5}, "users[name=u].user.token: is a int, not a string"),
        ({"client-key-data": "not base64!"}, "users[name=u].user.client-key-data: is not base64"),
    ],
)
def test_entries_the_plugin_cannot_use_are_named(
    tmp_path: Path, user: dict[str, Any], says: str
) -> None:
    path = write(tmp_path / "config", user, {"server": "https://127.0.0.1:1"})
    with pytest.raises(FailedPreconditionError) as failed:
        kubeconfig.load(str(path))
    assert says in str(failed.value)
    assert str(path) in str(failed.value)


def test_kubeconfig_files_merge_first_wins_as_kubectl_merges(tmp_path: Path) -> None:
    first = tmp_path / "first"
    first.write_text(
        yaml.safe_dump(
            {
                "clusters": [{"name": "c", "cluster": {"server": "https://first:6443"}}],
                "users": [{"name": "u", "user": {"token": "first"}}],
                "contexts": [{"name": "a", "context": {"cluster": "c", "user": "u"}}],
            }
        )
    )
    second = write(
        tmp_path / "second",
        {"token": "second"},
        {"server": "https://second:6443"},
        namespace="ns-x",
    )
    files = f"{tmp_path / 'missing'}:{first}:{second}"
    config = kubeconfig.load(files)  # current-context x: only the second file sets one
    assert (config.cluster.server, config.user.token, config.namespace) == (
        "https://first:6443",
        "first",
        "ns-x",
    )
    chosen = kubeconfig.load(files, "a")
    assert (chosen.cluster.server, chosen.namespace) == ("https://first:6443", "")
    with pytest.raises(FailedPreconditionError, match="no context 'nope' \\(contexts: a, x\\)"):
        kubeconfig.load(files, "nope")


def test_in_cluster_service_account(server: Server, tmp_path: Path) -> None:
    account = tmp_path / "sa"
    account.mkdir()
    (account / "token").write_text("sa-token")
    (account / "ca.crt").write_bytes(server.ca.cert_pem)
    (account / "namespace").write_text("gpu-team\n")
    host, port = server.url.removeprefix("https://").split(":")
    env = {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port}
    config = kubeconfig.in_cluster(env, account)
    assert config.namespace == "gpu-team"
    assert seen(config)["authorization"] == "Bearer sa-token"
    with pytest.raises(FailedPreconditionError, match="not running in a pod"):
        kubeconfig.in_cluster({}, account)


NOT_IMPORTED = ("kubernetes", "pydantic", "pydantic_core")
WITHOUT_THEM = """
import importlib.abc, json, sys

class Absent(importlib.abc.MetaPathFinder):
    # as in the one-file plugin, which does not carry them
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in NOT_IMPORTED:
            raise ModuleNotFoundError(name)
        return None

sys.meta_path.insert(0, Absent())
from gpuslice_kube.raw import RawApi
from gpuslice_kubectl import cli, kubeconfig
from gpuslice_kubectl.apiclient import KubeClient

client = KubeClient(kubeconfig.load(sys.argv[1]), user_agent="t")
print(json.dumps(RawApi(client, deadline=1.0).get("/api")))
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in NOT_IMPORTED)))
"""


def test_the_plugin_runs_without_the_kubernetes_client_and_pydantic(
    server: Server, tmp_path: Path
) -> None:
    """What the one-file plugin leaves out is never imported: its modules import, and a
    request goes through, with those packages made unimportable (decision 15)."""
    cluster = {"server": server.url, "certificate-authority-data": b64(server.ca.cert_pem)}
    path = write(tmp_path / "config", {"token": "t"}, cluster)
    code = f"NOT_IMPORTED = {NOT_IMPORTED!r}\n{WITHOUT_THEM}"
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    answer, imported = done.stdout.splitlines()
    assert json.loads(answer)["authorization"] == "Bearer t"
    assert json.loads(imported) == []
