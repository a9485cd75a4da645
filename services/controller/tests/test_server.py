"""The HTTPS webhook server: real TLS on loopback, AdmissionReview round trips, cert swaps."""

from __future__ import annotations

import base64
import datetime as dt
import http.client
import json
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes

from gpuslice_controller.admission.review import Decision, Request
from gpuslice_controller.server import WebhookServer
from gpuslice_controller.tls import certs
from gpuslice_controller.tls.serving import ServingCert

NOW = dt.datetime.now(dt.UTC)


def _deny_odd(request: Request) -> Decision:
    n = request["object"]["n"]
    if n % 2:
        return Decision.deny(f"n={n} is odd", "odd numbers are frowned upon")
    return Decision.allow(patch=[{"op": "add", "path": "/metadata/labels", "value": {"n": "ok"}}])


def _crash(request: Request) -> Decision:
    raise RuntimeError("boom")


@pytest.fixture
def material() -> certs.Material:
    return certs.bootstrap(certs.Policy(hosts=("localhost", "127.0.0.1")), NOW)


@pytest.fixture
def server(tmp_path: Path, material: certs.Material) -> Iterator[WebhookServer]:
    cert = ServingCert(tmp_path / "certs")
    ready = {"synced": True}
    srv = WebhookServer(
        ("127.0.0.1", 0),
        cert,
        {"validate": ("test", _deny_odd), "crash": ("crash", _crash)},
        readiness={"the cache": lambda: ready["synced"]},
    )
    srv.start()
    yield srv
    srv.stop()


def _client(port: int, ca: bytes) -> http.client.HTTPSConnection:
    ctx = ssl.create_default_context(cadata=ca.decode())
    return http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=5)


def _review(n: int, uid: str = "abc") -> bytes:
    return json.dumps(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {"uid": uid, "kind": {"kind": "Thing", "version": "v1"}, "object": {"n": n}},
        }
    ).encode()


def _post(conn: http.client.HTTPSConnection, path: str, body: bytes) -> tuple[int, Any]:
    conn.request("POST", path, body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    return resp.status, (json.loads(data) if resp.status == 200 else data.decode())


def test_not_ready_until_a_certificate_is_loaded(
    server: WebhookServer, material: certs.Material
) -> None:
    assert server.not_ready() == "a serving certificate"
    # Without a certificate, a TLS connection is closed at once (the API server retries).
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        _post(_client(server.port, material.ca_certs), "/validate", _review(2))
    assert server.cert.load(material.cert, material.key)
    assert not server.cert.load(material.cert, material.key)  # same cert: nothing to do
    assert server.not_ready() == ""


def test_reviews_allow_deny_warn_and_patch_over_one_kept_alive_connection(
    server: WebhookServer, material: certs.Material
) -> None:
    server.cert.load(material.cert, material.key)
    conn = _client(server.port, material.ca_certs)
    status, allowed = _post(conn, "/validate", _review(2, "u1"))
    assert status == 200
    response = allowed["response"]
    assert response["uid"] == "u1" and response["allowed"] and response["patchType"] == "JSONPatch"
    patch = json.loads(base64.b64decode(response["patch"]))
    assert patch == [{"op": "add", "path": "/metadata/labels", "value": {"n": "ok"}}]
    status, denied = _post(conn, "/validate", _review(3, "u2"))
    response = denied["response"]
    assert response == {
        "uid": "u2",
        "allowed": False,
        "warnings": ["odd numbers are frowned upon"],
        "status": {"code": 403, "reason": "Forbidden", "message": "n=3 is odd"},
    }
    conn.close()


def test_a_reviewer_that_crashes_denies_with_the_reason(
    server: WebhookServer, material: certs.Material
) -> None:
    server.cert.load(material.cert, material.key)
    _, body = _post(_client(server.port, material.ca_certs), "/crash", _review(1))
    assert body["response"]["allowed"] is False
    assert "could not review this object: boom" in body["response"]["status"]["message"]


@pytest.mark.parametrize(
    ("path", "body", "status", "text"),
    [
        ("/nowhere", _review(1), 404, "no such webhook"),
        ("/validate", b"{}", 400, "not an AdmissionReview"),
        ("/validate", b"[", 400, "not JSON"),
        (
            "/validate",
            json.dumps(
                {"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview"}
            ).encode(),
            400,
            "set admissionReviewVersions: [v1]",
        ),
    ],
)
def test_what_is_not_an_admission_review_gets_a_client_error(
    server: WebhookServer,
    material: certs.Material,
    path: str,
    body: bytes,
    status: int,
    text: str,
) -> None:
    server.cert.load(material.cert, material.key)
    got, answer = _post(_client(server.port, material.ca_certs), path, body)
    assert got == status and text in answer


def test_a_new_certificate_is_served_to_new_connections_without_a_restart(
    server: WebhookServer, material: certs.Material
) -> None:
    server.cert.load(material.cert, material.key)
    old = _client(server.port, material.ca_certs)
    assert _post(old, "/validate", _review(2))[0] == 200
    renewed = certs.next_step(
        material,
        certs.Policy(hosts=("localhost", "127.0.0.1", "extra.example")),
        NOW,
        bundle_published=True,
    ).material
    assert renewed is not None
    assert server.cert.load(renewed.cert, renewed.key)
    new = _client(server.port, renewed.ca_certs)
    assert _post(new, "/validate", _review(2))[0] == 200
    assert isinstance(new.sock, ssl.SSLSocket)
    der = new.sock.getpeercert(binary_form=True)
    assert der is not None
    served = x509.load_der_x509_certificate(der)
    assert served.fingerprint(hashes.SHA256()) == renewed.serving().fingerprint(hashes.SHA256())
    # The connection opened before the swap finishes its work on the old certificate.
    assert _post(old, "/validate", _review(4))[0] == 200


def test_health_and_readiness(server: WebhookServer, material: certs.Material) -> None:
    server.cert.load(material.cert, material.key)
    server.readiness["the cache"] = lambda: False
    conn = _client(server.port, material.ca_certs)
    conn.request("GET", "/healthz")
    assert conn.getresponse().read() == b"ok\n"
    conn.request("GET", "/readyz")
    resp = conn.getresponse()
    assert resp.status == 503 and resp.read() == b"waiting for the cache\n"
