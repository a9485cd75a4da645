"""The certificate the webhook server presents, and the watch that keeps it current.

``ServingCert`` holds the ``SSLContext`` the next connection uses; ``load`` swaps in a new
certificate (connections already open finish on the old one). ``TlsSecretWatch`` loads it from
the TLS Secret whenever that changes, on every replica (the leader writes the Secret:
``rotation``; or cert-manager does).
"""

from __future__ import annotations

import os
import ssl
import threading
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes

from gpuslice_controller.tls import certs, rotation
from gpuslice_core.logging import get_logger, kobj
from gpuslice_kube.raw import Obj, RawApi
from gpuslice_kube.reflector import Reflector

log = get_logger(__name__)


class ServingCert:
    """The certificate and key the server presents; ``load`` swaps them in."""

    def __init__(self, cert_dir: Path) -> None:
        self.cert_dir = cert_dir
        self._context: ssl.SSLContext | None = None
        self._lock = threading.Lock()
        self.loaded = threading.Event()
        self.fingerprint = ""
        self.chain = b""
        """The PEM served (leaf first): what the webhook configurations' bundles must trust."""
        self._client_ca: bytes | None = None

    def load(self, cert: bytes, key: bytes) -> bool:
        """Serve ``cert``/``key`` from now on; False when they are what is served already."""
        fingerprint = x509.load_pem_x509_certificate(cert).fingerprint(hashes.SHA256()).hex()
        if fingerprint == self.fingerprint:
            return False
        self.cert_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        # ssl loads a chain only from files; these live in a private directory (an emptyDir).
        cert_file, key_file = self.cert_dir / "tls.crt", self.cert_dir / "tls.key"
        for path, data in ((cert_file, cert), (key_file, key)):
            tmp = path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            tmp.replace(path)
        with self._lock:
            self._context = self._build(cert_file, key_file, self._client_ca)
            self.fingerprint = fingerprint
            self.chain = cert
        self.loaded.set()
        log.info("serving certificate loaded", sha256=fingerprint[:16])
        return True

    def set_client_ca(self, ca: bytes | None) -> None:
        """Ask every new connection for an optional client certificate and verify it against
        ``ca`` (the API server's front-proxy CA: ``view.frontproxy``); None stops asking. A
        client without a certificate is served as before (webhooks, probes); one whose
        certificate does not chain to ``ca`` fails the handshake."""
        with self._lock:
            self._client_ca = ca
            if self._context is not None:
                cert_file, key_file = self.cert_dir / "tls.crt", self.cert_dir / "tls.key"
                self._context = self._build(cert_file, key_file, ca)
        log.info("client certificate CA", set=ca is not None)

    @staticmethod
    def _build(cert_file: Path, key_file: Path, client_ca: bytes | None) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.options |= ssl.OP_NO_RENEGOTIATION  # (TLS 1.2: a handshake's CPU, on demand)
        context.load_cert_chain(cert_file, key_file)
        if client_ca:
            context.verify_mode = ssl.CERT_OPTIONAL
            context.load_verify_locations(cadata=client_ca.decode())
        return context

    def context(self) -> ssl.SSLContext | None:
        with self._lock:
            return self._context


class TlsSecretWatch:
    """Loads the serving certificate from the TLS Secret whenever it changes (every replica)."""

    def __init__(self, raw: RawApi, namespace: str, secret: str, cert: ServingCert) -> None:
        self.cert = cert
        self.secret = secret
        self.ref = kobj(namespace, secret)  # for logs: the Secret's name, never its data
        self.reflector = Reflector(
            raw,
            rotation.secret_path(namespace),
            self._on_event,
            field_selector=f"metadata.name={secret}",
        )

    def _on_event(self, event_type: str, obj: Obj) -> None:
        if event_type == "DELETED":
            log.warning("TLS secret deleted; serving the last certificate", secret=self.ref)
            return
        data = rotation.decode_data(obj)
        cert, key = data.get(certs.TLS_CERT), data.get(certs.TLS_KEY)
        if not cert or not key:
            log.info("TLS secret has no certificate yet", secret=self.ref)
            return
        try:
            self.cert.load(cert, key)
        except (ValueError, OSError) as exc:  # ssl.SSLError is an OSError
            log.error("TLS secret holds an unusable certificate", secret=self.ref, error=str(exc))
