"""The HTTPS server with the aggregated API on: an optional client certificate verified against
the front-proxy CA, the headers trusted only with it, webhooks and probes still served without
one, and a watch streamed chunked until it ends."""

from __future__ import annotations

import datetime as dt
import http.client
import json
import ssl
from collections.abc import Iterator
from http import HTTPStatus
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gpuslice_controller.server import WebhookServer
from gpuslice_controller.tls import certs
from gpuslice_controller.tls.serving import ServingCert
from gpuslice_controller.view.aggregated import AggregatedApi
from gpuslice_controller.view.auth import Authorizer, Decision
from gpuslice_controller.view.frontproxy import RequestHeaderConfig
from gpuslice_controller.view.gpustore import GpuStore
from gpuslice_testkit import view as t
from gpuslice_view.model import ClusterView

pytestmark = pytest.mark.timeout(20)
NOW = dt.datetime.now(dt.UTC)
GPUS = "/apis/view.gpuslice.dev/v1alpha1/gpus"
DAY = dt.timedelta(days=1)


def client_cert(ca_cert: bytes, ca_key: bytes, name: str, directory: Path) -> tuple[Path, Path]:
    """A client certificate (CN ``name``) from the CA, written for ``load_cert_chain``."""
    ca = x509.load_pem_x509_certificate(ca_cert)
    signer = serialization.load_pem_private_key(ca_key, password=None)
    assert isinstance(signer, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW - DAY)
        .not_valid_after(NOW + DAY)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(signer, hashes.SHA256())
    )
    crt, pem = directory / f"{name}.crt", directory / f"{name}.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return crt, pem


class Everyone(Authorizer):
    def __init__(self) -> None:
        pass

    def check_user(self, user: dict[str, Any], **question: str) -> Decision:
        return Decision(HTTPStatus.OK, user=user["username"])


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[WebhookServer, certs.Material, Path]]:
    serving = certs.bootstrap(certs.Policy(hosts=("localhost", "127.0.0.1")), NOW)
    proxy_ca, proxy_key = certs.new_ca(NOW, DAY)
    view = ClusterView.build(slices=[t.resource_slice("node-a", [t.gpu(0)])])
    source = t.FixedFeeder(view)
    config = RequestHeaderConfig(proxy_ca, frozenset({"front-proxy-client"}))
    aggregated = AggregatedApi(GpuStore(source), Everyone(), lambda: config, source.synced)
    cert = ServingCert(tmp_path / "certs")
    cert.set_client_ca(proxy_ca)  # before the serving certificate: kept for it
    cert.load(serving.cert, serving.key)
    server = WebhookServer(("127.0.0.1", 0), cert, {}, aggregated_api=aggregated)
    server.start()
    client_cert(proxy_ca, proxy_key, "front-proxy-client", tmp_path)
    client_cert(proxy_ca, proxy_key, "not-the-proxy", tmp_path)
    other_ca, other_key = certs.new_ca(NOW, DAY)
    client_cert(other_ca, other_key, "front-proxy-client-elsewhere", tmp_path)
    yield server, serving, tmp_path
    server.stop()


def connect(
    server: WebhookServer, ca: bytes, cert: Path | None = None
) -> http.client.HTTPSConnection:
    ctx = ssl.create_default_context(cadata=ca.decode())
    if cert is not None:
        ctx.load_cert_chain(cert, cert.with_suffix(".key"))
    return http.client.HTTPSConnection("127.0.0.1", server.port, context=ctx, timeout=5)


def get(conn: http.client.HTTPSConnection, path: str) -> tuple[int, Any]:
    conn.request(
        "GET", path, headers={"X-Remote-User": "system:admin", "X-Remote-Group": "system:masters"}
    )
    answer = conn.getresponse()
    return answer.status, json.loads(answer.read() or b"null")


def test_headers_count_only_with_the_front_proxy_certificate(
    setup: tuple[WebhookServer, certs.Material, Path],
) -> None:
    server, serving, directory = setup
    status, body = get(connect(server, serving.ca_certs), GPUS)
    assert status == 401 and body["reason"] == "Unauthorized"
    status, body = get(connect(server, serving.ca_certs, directory / "not-the-proxy.crt"), GPUS)
    assert status == 401
    status, body = get(
        connect(server, serving.ca_certs, directory / "front-proxy-client.crt"), GPUS
    )
    assert status == 200 and [o["metadata"]["name"] for o in body["items"]] == ["node-a.gpu-0"]
    # a certificate of another CA fails the handshake
    with pytest.raises((ssl.SSLError, ConnectionError)):
        get(connect(server, serving.ca_certs, directory / "front-proxy-client-elsewhere.crt"), GPUS)
    # probes (and webhooks) need no client certificate
    conn = connect(server, serving.ca_certs)
    conn.request("GET", "/healthz")
    assert conn.getresponse().read() == b"ok\n"


def test_a_watch_is_streamed_chunked_until_its_timeout(
    setup: tuple[WebhookServer, certs.Material, Path],
) -> None:
    server, serving, directory = setup
    conn = connect(server, serving.ca_certs, directory / "front-proxy-client.crt")
    conn.request("GET", f"{GPUS}?watch=true&timeoutSeconds=1", headers={"X-Remote-User": "alice"})
    answer = conn.getresponse()
    assert answer.status == 200 and answer.getheader("Transfer-Encoding") == "chunked"
    lines = answer.read().splitlines()  # ends when the watch does, after about a second
    [added] = [json.loads(line) for line in lines]
    assert added["type"] == "ADDED" and added["object"]["metadata"]["name"] == "node-a.gpu-0"
