"""Readiness that means the webhooks work: the CA bundle is in every webhook configuration.

A replica that serves a certificate the API server does not trust answers nothing: every
review fails with an unknown authority. So, on every replica (not only the leader, which
publishes the bundle), readiness also waits until each webhook configuration the controller
serves (``--validating-webhooks``, ``--mutating-webhooks``, and the aggregated API's
``--apiservices``) exists and the ``caBundle`` of every webhook in it (of an APIService: its
own) trusts the certificate this replica serves: the leaf, or an intermediate the served chain
carries, is issued by a certificate of the bundle. That holds for the controller's
own CA and for cert-manager's injected bundle alike. ``helm install --wait`` and ``helm test``
then start only once the API server can call the webhooks; a configuration deleted, or
re-applied without the bundle, takes the replicas out of the Service until the leader (or
cert-manager's injector) has published it again.

Each configuration is watched by name (a ``metadata.name`` field selector, which RBAC
authorizes with ``resourceNames``); a probe only compares what the watches hold.
"""

from __future__ import annotations

import base64
import binascii
import threading
from collections.abc import Callable
from functools import partial

from cryptography import x509
from cryptography.hazmat.primitives import hashes

from gpuslice_controller.tls import certs
from gpuslice_controller.tls.rotation import WebhookConfigs, bundle_holders
from gpuslice_core.logging import get_logger
from gpuslice_kube.raw import Obj, RawApi
from gpuslice_kube.reflector import Reflector

log = get_logger(__name__)


def chain_trusted(chain_pem: bytes, bundle_pem: bytes) -> bool:
    """Whether a client that trusts ``bundle_pem`` accepts the served ``chain_pem`` (leaf
    first, then any intermediates): some certificate on the way up is issued by, or is, one of
    the bundle's."""
    try:
        chain = x509.load_pem_x509_certificates(chain_pem)
        anchors = x509.load_pem_x509_certificates(bundle_pem)
    except ValueError:
        return False
    pinned = {a.fingerprint(hashes.SHA256()) for a in anchors}
    current, rest = chain[0], list(chain[1:])
    while True:
        if current.fingerprint(hashes.SHA256()) in pinned:
            return True
        if any(certs.signed_by(current, anchor) for anchor in anchors):
            return True
        issuer = next((c for c in rest if certs.signed_by(current, c)), None)
        if issuer is None:
            return False
        rest.remove(issuer)
        current = issuer


class BundleReadiness:
    """``ready()``: every configuration of ``webhooks`` trusts ``served()`` (the PEM chain this
    replica serves; empty before a certificate is loaded)."""

    def __init__(self, raw: RawApi, webhooks: WebhookConfigs, served: Callable[[], bytes]) -> None:
        self.served = served
        self._lock = threading.Lock()
        named = webhooks.named()
        self._configs: dict[str, Obj | None] = {self._key(c, n): None for c, n in named}
        self.reflectors = [
            Reflector(
                raw,
                collection,
                partial(self._on_event, self._key(collection, name)),
                field_selector=f"metadata.name={name}",
            )
            for collection, name in named
        ]
        self._last = ""

    @staticmethod
    def _key(collection: str, name: str) -> str:
        """``validatingwebhookconfigurations/<name>``: how logs and readiness name it."""
        return f"{collection.rsplit('/', 1)[-1]}/{name}"

    def _on_event(self, key: str, event_type: str, config: Obj) -> None:
        with self._lock:
            self._configs[key] = None if event_type == "DELETED" else config

    def waiting_for(self) -> str:
        """The configurations that do not trust the served certificate yet ("" when none)."""
        chain = self.served()
        with self._lock:
            configs = dict(self._configs)
        missing = []
        for key, config in configs.items():
            if config is None:
                missing.append(f"{key} (not found)")
                continue
            for what, holder in bundle_holders(config):
                bundle = holder.get("caBundle") or ""
                try:
                    pem = base64.b64decode(bundle, validate=True)
                except (binascii.Error, ValueError):
                    pem = b""
                if not (chain and pem and chain_trusted(chain, pem)):
                    missing.append(f"{key} ({what})")
                    break
        waiting = ", ".join(missing)
        if waiting != self._last:
            if waiting:
                log.info("not ready: the CA bundle is not yet in", configurations=waiting)
            else:
                log.info("the CA bundle is in every webhook configuration")
            self._last = waiting
        return waiting

    def ready(self) -> bool:
        return not self.waiting_for()

    def start(self) -> None:
        for reflector in self.reflectors:
            reflector.start()

    def stop(self) -> None:
        for reflector in self.reflectors:
            reflector.stop()
