"""Assembly and start/stop order of the controller.

Start: API client → resource.k8s.io version → caches (our ResourceSlices, the claim templates
this controller made, the TLS Secret) → the cluster view (``ViewFeeder``, on every replica) →
HTTPS server → leader election (the leader manages the certificates) → metrics. The server
answers /readyz only once a certificate is loaded and the admission caches have synced, so no
review is answered from an empty cache; it does not wait for the view, so admission never
depends on it (the view's own endpoints answer 503 until it has synced). Stop (SIGTERM,
SIGINT): readiness goes first, then the server finishes the reviews in flight, then the caches
and the view stop.
"""

from __future__ import annotations

import argparse
import os
import socket
import threading
from pathlib import Path

from prometheus_client import REGISTRY

from gpuslice_controller import __version__, certs, rotation
from gpuslice_controller.auth import Authorizer, Reviewer
from gpuslice_controller.diagnose import Diagnostics
from gpuslice_controller.inventory import GpuInventory
from gpuslice_controller.leader import Leadership
from gpuslice_controller.mutate import PodTranslator
from gpuslice_controller.server import ServingCert, WebhookServer
from gpuslice_controller.translate import ClusterFacts
from gpuslice_controller.validate import ClaimValidator, Classes
from gpuslice_controller.viewapi import ViewApi
from gpuslice_controller.viewmetrics import ViewCollector
from gpuslice_core import metrics
from gpuslice_core.errors import FailedPreconditionError, GpusliceError
from gpuslice_core.grpcserver import StopSignals
from gpuslice_core.logging import configure, get_logger
from gpuslice_kube.client import new_api_client
from gpuslice_kube.discovery import RESOURCE_VERSIONS, served_versions
from gpuslice_kube.raw import Obj, RawApi
from gpuslice_kube.reflector import Reflector
from gpuslice_view.feed import ViewFeeder
from gpuslice_view.live import LivePoller, discover

log = get_logger(__name__)


def resource_api_version(raw: RawApi, wanted: str) -> str:
    """The resource.k8s.io version to use: ``wanted``, or the newest served for ``auto``."""
    served = served_versions(raw)
    if wanted == "auto":
        newest = next((v for v in RESOURCE_VERSIONS if v in served), None)
        if newest is not None:
            return newest
        raise FailedPreconditionError(
            "the API server does not serve resource.k8s.io (DRA) in "
            f"{', '.join(RESOURCE_VERSIONS)}; served: {', '.join(served) or '-'}"
        )
    if wanted not in served:
        raise FailedPreconditionError(
            f"--resource-api {wanted}: the API server serves resource.k8s.io "
            f"{', '.join(served) or 'in no version'}"
        )
    return wanted


class TlsSecretWatch:
    """Loads the serving certificate from the TLS Secret whenever it changes (every replica)."""

    def __init__(self, raw: RawApi, namespace: str, secret: str, cert: ServingCert) -> None:
        self.cert = cert
        self.secret = secret
        self.reflector = Reflector(
            raw,
            rotation.secret_path(namespace),
            self._on_event,
            field_selector=f"metadata.name={secret}",
        )

    def _on_event(self, event_type: str, obj: Obj) -> None:
        if event_type == "DELETED":
            log.warning("TLS secret deleted; serving the last certificate", secret=self.secret)
            return
        data = rotation.decode_data(obj)
        cert, key = data.get(certs.TLS_CERT), data.get(certs.TLS_KEY)
        if not cert or not key:
            log.info("TLS secret has no certificate yet", secret=self.secret)
            return
        try:
            self.cert.load(cert, key)
        except (ValueError, OSError) as exc:  # ssl.SSLError is an OSError
            log.error(
                "TLS secret holds an unusable certificate", secret=self.secret, error=str(exc)
            )


def run(args: argparse.Namespace) -> int:
    configure(component="controller", level=args.log_level)
    try:
        return _run(args)
    except GpusliceError as exc:
        log.error("cannot start", error=str(exc))
        return 1


def _run(args: argparse.Namespace) -> int:
    api_client = new_api_client(
        args.kubeconfig, user_agent=f"gpuslice-controller/{__version__}", pool_size=32
    )
    raw = RawApi(api_client)
    version = resource_api_version(raw, args.resource_api)
    identity = args.identity or f"{socket.gethostname()}-{os.getpid()}"
    classes = Classes(
        args.driver_name, frozenset(args.gpu_device_classes), frozenset(args.mig_device_classes)
    )
    inventory = GpuInventory(raw, driver=args.driver_name, version=version)
    validator = ClaimValidator(classes, inventory.max_gpu_memory)
    translator = PodTranslator(
        raw,
        version=version,
        facts=lambda: ClusterFacts(inventory.gpu_memory_sizes()),
        driver=args.driver_name,
        device_class=args.gpu_device_classes[0],
    )
    feeder = ViewFeeder(raw, driver=args.driver_name) if args.cluster_view else None
    view_api = None
    if feeder is not None:
        # A caller waits for its reviews: a short deadline, not the writers' minute of retries.
        reviewer = Reviewer(RawApi(api_client, deadline=5.0))
        view_api = ViewApi(feeder, Authorizer(reviewer, ttl=args.view_auth_ttl))
    cert = ServingCert(Path(args.cert_dir))
    secret_watch = TlsSecretWatch(raw, args.namespace, args.tls_secret, cert)
    server = WebhookServer(
        metrics.parse_addr(args.webhook_addr),
        cert,
        {"validate": ("claims", validator.review), "mutate": ("pods", translator.review)},
        readiness={
            "the ResourceSlice cache": inventory.synced,
            "the claim template cache": translator.synced,
        },
        view=view_api,
    )
    leadership: Leadership | None = None
    rotator: rotation.Rotator | None = None
    if args.manage_certificates:
        if not args.cert_hosts:
            raise FailedPreconditionError(
                "--manage-certificates needs --cert-hosts (the names the API server calls)"
            )
        rotator = rotation.Rotator(
            raw,
            namespace=args.namespace,
            secret=args.tls_secret,
            webhooks=rotation.WebhookConfigs(args.validating_webhooks, args.mutating_webhooks),
            policy=certs.Policy(tuple(args.cert_hosts), args.ca_validity, args.cert_validity),
        )
    interval = args.cert_check_interval

    def lead(stop_leading: threading.Event) -> None:
        if rotator is not None:
            rotator.run(stop_leading, interval)
        else:
            stop_leading.wait()

    poller: LivePoller | None = None
    if feeder is not None and args.live_usage_interval > 0:
        lister = RawApi(api_client, deadline=10.0)
        where = args.enforcer_namespace or args.namespace
        feeder.view.live_stale_after = 3 * args.live_usage_interval + args.live_usage_timeout
        poller = LivePoller(
            lambda: discover(lister, where, args.enforcer_selector),
            feeder.set_live,
            interval=args.live_usage_interval,
            timeout=args.live_usage_timeout,
        )
    collector = ViewCollector(feeder) if feeder is not None else None
    if collector is not None:
        REGISTRY.register(collector)
    http = metrics.serve(args.metrics_addr) if args.metrics_addr else None
    stop = threading.Event()
    signals = StopSignals(stop)
    log.info(
        "starting",
        version=__version__,
        resource_api=version,
        identity=identity,
        manage_certificates=args.manage_certificates,
        leader_elect=args.leader_elect,
        cluster_view=feeder is not None,
        live_usage_interval=args.live_usage_interval if poller is not None else 0,
    )
    for part in (inventory, translator, secret_watch.reflector):
        part.start()
    diagnostics: Diagnostics | None = None
    if feeder is not None:

        def leading() -> bool:
            if not args.leader_elect:
                return True
            return leadership is not None and leadership.leading.is_set()

        diagnostics = Diagnostics(
            feeder.read,
            RawApi(api_client, deadline=10.0),
            resource_api=version,
            leading=leading,
            identity=identity,
            interval=args.event_interval,
        )
        feeder.listen(diagnostics.on_change)
        feeder.start()
        threading.Thread(
            target=diagnostics.run, args=(stop,), name="diagnostics", daemon=True
        ).start()
        if poller is not None:
            threading.Thread(
                target=poller.run, args=(stop,), name="live-usage", daemon=True
            ).start()
    server.start()
    solo: threading.Thread | None = None
    if args.leader_elect:
        leadership = Leadership(
            api_client, namespace=args.namespace, name=args.lease_name, identity=identity, lead=lead
        )
        leadership.start()
    else:
        solo = threading.Thread(target=lead, args=(stop,), name="leader", daemon=True)
        solo.start()
    try:
        signum = signals.wait()
        log.info("stopping", signal=signum)
    finally:
        stop.set()
        if leadership is not None:
            leadership.stop()
        server.stop()
        if feeder is not None:
            feeder.stop()
        for part in (secret_watch.reflector, translator, inventory):
            part.stop()
        if http is not None:
            http.shutdown()
        if collector is not None:
            REGISTRY.unregister(collector)
    return 0
