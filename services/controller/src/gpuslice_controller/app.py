"""Assembly of the controller, and its start and stop order.

``ControllerApp(settings)`` builds every part or raises (nothing is half-built): the API client
and the resource.k8s.io version, the admission reviewers and their caches, the cluster view and
its endpoints, metrics and Events, the serving certificate and its Secret watch, the HTTPS
server, the certificate rotator and the leader election. ``start``/``stop`` only start and stop
them; ``run(settings)`` is the process.

Start: API client → resource.k8s.io version → caches (our ResourceSlices, the claim templates
this controller made, the TLS Secret, the claims' node labels) → the cluster view
(``ViewFeeder``, on every replica) → HTTPS server → leader election (the leader writes the
claims' node labels, ``claimnodes``, and manages the certificates) → metrics. The server
answers /readyz only once a certificate is loaded, the admission caches have synced and both
webhook configurations carry a CA bundle that trusts the served certificate
(``tls.bundleready``), so no review is answered from an empty cache and none fails with an
unknown authority; it does not wait for the view, so admission never depends on it (the view's
own endpoints answer 503 until it has synced). With ``--aggregated-api`` the view's GPUs,
claims and reasons are also served as ``view.gpuslice.dev/v1alpha1`` (``view.aggregated``):
two stores version the GPUs and the claims (``view.gpustore``) and the front-proxy CA is read
from the API server's ConfigMap before the server starts (``view.frontproxy``). Stop (SIGTERM,
SIGINT): readiness goes first, then the server finishes the reviews in flight, then the caches
and the view stop.
"""

from __future__ import annotations

import os
import socket
import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY

from gpuslice_api.names import DRIVER
from gpuslice_controller import __version__
from gpuslice_controller.admission.dialects import Dialects
from gpuslice_controller.admission.inventory import GpuInventory
from gpuslice_controller.admission.mutate import PodTranslator
from gpuslice_controller.admission.translate import ClusterFacts
from gpuslice_controller.admission.validate import ClaimValidator, Classes
from gpuslice_controller.claimnodes import ClaimNodeLabels
from gpuslice_controller.cli import Settings
from gpuslice_controller.leader import Leadership
from gpuslice_controller.server import WebhookServer
from gpuslice_controller.tls import certs, rotation
from gpuslice_controller.tls.bundleready import BundleReadiness
from gpuslice_controller.tls.serving import ServingCert, TlsSecretWatch
from gpuslice_controller.view.aggregated import AggregatedApi
from gpuslice_controller.view.api import ViewApi
from gpuslice_controller.view.auth import Authorizer, Reviewer
from gpuslice_controller.view.diagnose import Diagnostics
from gpuslice_controller.view.frontproxy import ConfigWatch
from gpuslice_controller.view.gpustore import GpuStore
from gpuslice_controller.view.metrics import ViewCollector
from gpuslice_core import metrics
from gpuslice_core.errors import FailedPreconditionError, GpusliceError
from gpuslice_core.grpcserver import StopSignals
from gpuslice_core.logging import configure, get_logger
from gpuslice_kube.client import new_api_client
from gpuslice_kube.discovery import RESOURCE_VERSIONS, served_versions
from gpuslice_kube.raw import RawApi
from gpuslice_view import namespaced
from gpuslice_view.feed import ViewFeeder
from gpuslice_view.live import LivePoller, NodeLive, discover

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


class ControllerApp:
    """The whole controller replica, built and ready to start."""

    def __init__(self, settings: Settings) -> None:
        s = self.settings = settings
        api_client = new_api_client(
            s.kubeconfig, user_agent=f"gpuslice-controller/{__version__}", pool_size=32
        )
        raw = RawApi(api_client)
        self.version = resource_api_version(raw, s.resource_api)
        self.identity = s.identity or f"{socket.gethostname()}-{os.getpid()}"
        self.stopping = threading.Event()
        classes = Classes(DRIVER, frozenset(s.gpu_device_classes), frozenset(s.mig_device_classes))
        self.inventory = GpuInventory(raw, driver=DRIVER, version=self.version)
        validator = ClaimValidator(classes, self.inventory.max_gpu_memory)
        self.translator = PodTranslator(
            raw,
            version=self.version,
            facts=lambda: ClusterFacts(self.inventory.gpu_memory_sizes()),
            driver=DRIVER,
            device_class=s.gpu_device_classes[0],
            dialects=Dialects.of(s.hami),
        )
        self.claim_nodes = (
            ClaimNodeLabels(raw, version=self.version) if s.claim_node_labels else None
        )
        self.feeder = ViewFeeder(raw, driver=DRIVER) if s.cluster_view else None
        view_api = None
        authorizer = None
        if self.feeder is not None:
            # A caller waits for its reviews: a short deadline, not the writers' minute of
            # retries.
            reviewer = Reviewer(RawApi(api_client, deadline=5.0))
            authorizer = Authorizer(reviewer, ttl=s.view_auth_ttl)
            view_api = ViewApi(self.feeder, authorizer)
        cert = ServingCert(s.cert_dir)
        self.gpus: GpuStore | None = None
        self.gpu_claims: GpuStore | None = None
        self.front_proxy: ConfigWatch | None = None
        aggregated_api = None
        if self.feeder is not None and authorizer is not None and s.aggregated_api:
            self.gpus = GpuStore(self.feeder)
            self.gpu_claims = GpuStore(self.feeder, derive=namespaced.claim_objects)
            self.front_proxy = ConfigWatch(
                RawApi(api_client, deadline=10.0),
                lambda config: cert.set_client_ca(config.client_ca if config else None),
            )
            front_proxy = self.front_proxy
            aggregated_api = AggregatedApi(
                self.gpus,
                authorizer,
                lambda: front_proxy.config,
                self.feeder.synced,
                claims=self.gpu_claims,
            )
        elif s.aggregated_api:
            raise FailedPreconditionError(
                "--aggregated-api serves the cluster view: it needs --cluster-view"
            )
        self.secret_watch = TlsSecretWatch(raw, s.namespace, s.tls_secret, cert)
        webhooks = rotation.WebhookConfigs(
            s.validating_webhooks, s.mutating_webhooks, s.apiservices
        )
        self.bundles = BundleReadiness(raw, webhooks, lambda: cert.chain)
        self.server = WebhookServer(
            metrics.parse_addr(s.webhook_addr),
            cert,
            {
                "validate": ("claims", validator.review),
                "mutate": ("pods", self.translator.review),
            },
            readiness={
                "the ResourceSlice cache": self.inventory.synced,
                "the claim template cache": self.translator.synced,
                "the CA bundle in the webhook configurations": self.bundles.ready,
            },
            view=view_api,
            aggregated_api=aggregated_api,
        )
        self.rotator: rotation.Rotator | None = None
        if s.manage_certificates:
            self.rotator = rotation.Rotator(
                raw,
                namespace=s.namespace,
                secret=s.tls_secret,
                webhooks=webhooks,
                policy=certs.Policy(s.cert_hosts, s.ca_validity, s.cert_validity),
            )
        self.poller: LivePoller | None = None
        if self.feeder is not None and s.live_usage_interval > 0:
            lister = RawApi(api_client, deadline=10.0)
            where = s.enforcer_namespace or s.namespace
            self.feeder.view.live_stale_after = 3 * s.live_usage_interval + s.live_usage_timeout
            self.poller = LivePoller(
                lambda: discover(lister, where, s.enforcer_selector),
                self._publish_live,
                interval=s.live_usage_interval,
                timeout=s.live_usage_timeout,
            )
        self.collector = ViewCollector(self.feeder) if self.feeder is not None else None
        self.diagnostics: Diagnostics | None = None
        if self.feeder is not None:
            self.diagnostics = Diagnostics(
                self.feeder.read,
                RawApi(api_client, deadline=10.0),
                resource_api=self.version,
                leading=self._leading,
                identity=self.identity,
                interval=s.event_interval,
            )
        self.leadership: Leadership | None = None
        self.solo: threading.Thread | None = None
        if s.leader_elect:
            self.leadership = Leadership(
                api_client,
                namespace=s.namespace,
                name=s.lease_name,
                identity=self.identity,
                lead=self._lead,
            )
        else:
            self.solo = threading.Thread(
                target=self._lead, args=(self.stopping,), name="leader", daemon=True
            )
        self._http: WSGIServer | None = None

    def _publish_live(self, nodes: dict[str, NodeLive]) -> None:
        """The live poller's round: into the view, and the view API's GPUs marked for it."""
        if self.feeder is not None:
            self.feeder.set_live(nodes)
        for store in (self.gpus, self.gpu_claims):
            if store is not None:
                store.mark()

    def _lead(self, stop_leading: threading.Event) -> None:
        """The leader's work: the claims' node labels and the certificates (unless
        cert-manager has them), until ``stop_leading``."""
        labels: threading.Thread | None = None
        if self.claim_nodes is not None:
            labels = threading.Thread(
                target=self.claim_nodes.run, args=(stop_leading,), name="claim-nodes", daemon=True
            )
            labels.start()
        if self.rotator is not None:
            self.rotator.run(stop_leading, self.settings.cert_check_interval)
        else:
            stop_leading.wait()
        if labels is not None:
            labels.join(5.0)

    def _leading(self) -> bool:
        if self.leadership is None:  # no election: this replica always leads
            return True
        return self.leadership.leading.is_set()

    def start(self) -> None:
        s = self.settings
        metrics.standard_series(
            REGISTRY, component=metrics.Subsystem.CONTROLLER, version=__version__
        )
        if self.collector is not None:
            REGISTRY.register(self.collector)
        self._http = metrics.serve(s.metrics_addr) if s.metrics_addr else None
        log.info(
            "starting",
            version=__version__,
            resource_api=self.version,
            identity=self.identity,
            manage_certificates=s.manage_certificates,
            leader_elect=s.leader_elect,
            cluster_view=self.feeder is not None,
            claim_node_labels=self.claim_nodes is not None,
            live_usage_interval=s.live_usage_interval if self.poller is not None else 0,
        )
        for part in (self.inventory, self.translator, self.secret_watch.reflector, self.bundles):
            part.start()
        if self.claim_nodes is not None:
            self.claim_nodes.start()
        if self.feeder is not None and self.diagnostics is not None:
            self.feeder.listen(self.diagnostics.on_change)
            self.feeder.start()
            threading.Thread(
                target=self.diagnostics.run, args=(self.stopping,), name="diagnostics", daemon=True
            ).start()
            if self.poller is not None:
                threading.Thread(
                    target=self.poller.run, args=(self.stopping,), name="live-usage", daemon=True
                ).start()
        if (
            self.gpus is not None
            and self.gpu_claims is not None
            and self.front_proxy is not None
            and self.feeder is not None
        ):
            self.feeder.listen(self.gpus.mark)
            self.feeder.listen(self.gpu_claims.mark)
            self.front_proxy.load()  # before the server serves: no window without the CA
            for target, name in (
                (self.gpus.run, "gpu-store"),
                (self.gpu_claims.run, "gpu-claim-store"),
                (self.front_proxy.run, "front-proxy"),
            ):
                threading.Thread(
                    target=target, args=(self.stopping,), name=name, daemon=True
                ).start()
        self.server.start()
        if self.leadership is not None:
            self.leadership.start()
        elif self.solo is not None:
            self.solo.start()

    def stop(self) -> None:
        self.stopping.set()
        if self.leadership is not None:
            self.leadership.stop()
        self.server.stop()
        if self.feeder is not None:
            self.feeder.stop()
        if self.claim_nodes is not None:
            self.claim_nodes.stop()
        for part in (self.bundles, self.secret_watch.reflector, self.translator, self.inventory):
            part.stop()
        if self._http is not None:
            self._http.shutdown()
        if self.collector is not None:
            REGISTRY.unregister(self.collector)


def run(settings: Settings) -> int:
    """The process: build, start, serve until SIGTERM/SIGINT, stop. 1 when start-up fails."""
    configure(component="controller", level=settings.log_level, log_format=settings.log_format)
    try:
        app = ControllerApp(settings)
        signals = StopSignals(app.stopping)  # before anything serves (gpuslice_core.grpcserver)
        app.start()
    except GpusliceError as exc:
        log.error("cannot start", error=str(exc))
        return 1
    try:
        signum = signals.wait()
        log.info("stopping", signal=signum)
    finally:
        app.stop()
    return 0
