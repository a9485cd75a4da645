"""Keep the webhook's certificates in their Secret and the CA bundle in the webhook configurations.

Run by the leader only (``--manage-certificates``; with cert-manager the chart turns it off and
cert-manager's CA injector publishes the bundle). One ``reconcile`` call makes every change the
state needs, in the safe order of ``certs.next_step``: a new CA is stored and published before
any serving certificate is issued from it. Every write is a compare-and-swap on the object's
resourceVersion, so two controllers that both think they lead cannot overwrite each other: the
loser re-reads on its next pass.

Passes run every ``--cert-check-interval`` (an hour) and, in between, whenever one of the
webhook configurations the controller owns appears or changes without the bundle (created
after the controller started, re-applied by a tool that drops ``caBundle``): ``BundleWatch``
watches each by name (a ``metadata.name`` field selector, which RBAC authorizes with
``resourceNames``, so the controller needs no right on other webhook configurations) and wakes
the loop, which waits ``SETTLE`` for the rest of a burst and publishes within seconds.
"""

from __future__ import annotations

import base64
import datetime as dt
import threading
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes

from gpuslice_controller.tls import certs
from gpuslice_core.logging import get_logger, kobj
from gpuslice_kube.errors import ConflictError, KubeAlreadyExistsError, KubeNotFoundError
from gpuslice_kube.raw import Obj, RawApi
from gpuslice_kube.reflector import Reflector

log = get_logger(__name__)

ADMISSION = "/apis/admissionregistration.k8s.io/v1"
APIREGISTRATION = "/apis/apiregistration.k8s.io/v1"
MAX_STEPS = 4
"""Passes per reconcile: bootstrap, or new CA → publish → new serving certificate."""
PUBLISH_GRACE = 10.0
"""Seconds a newly published CA bundle is given to reach every API server (their webhook
configuration informers) before a certificate from the new CA is served."""
SETTLE = 1.0
"""Seconds a pass woken by a webhook configuration's change waits for the rest of a burst (helm
creates both configurations at once); also the least time between two such passes, so a tool
that keeps stripping the bundle costs one pass a second, not a hot loop."""


@dataclass(frozen=True)
class WebhookConfigs:
    """The configurations whose ``caBundle`` the controller owns, by name: webhook
    configurations, and the APIServices of the aggregated API (``view.aggregated``), whose
    ``spec.caBundle`` the API server trusts for the controller's certificate just the same."""

    validating: tuple[str, ...] = ()
    mutating: tuple[str, ...] = ()
    apiservices: tuple[str, ...] = ()

    def named(self) -> list[tuple[str, str]]:
        """(collection path, name) of every configuration."""
        return (
            [(f"{ADMISSION}/validatingwebhookconfigurations", n) for n in self.validating]
            + [(f"{ADMISSION}/mutatingwebhookconfigurations", n) for n in self.mutating]
            + [(f"{APIREGISTRATION}/apiservices", n) for n in self.apiservices]
        )

    def paths(self) -> list[str]:
        return [f"{collection}/{name}" for collection, name in self.named()]


def bundle_holders(config: Obj, *, create: bool = False) -> list[tuple[str, Obj]]:
    """(what to call it, the mapping whose ``caBundle`` it is) for every CA bundle in a
    configuration: each webhook's ``clientConfig``, or an APIService's ``spec`` (only
    APIServices have a ``spec``). ``create``: give webhooks without a ``clientConfig`` one, to
    write into."""
    spec = config.get("spec")
    if isinstance(spec, dict):
        return [("caBundle", spec)]
    holders = []
    for hook in config.get("webhooks") or []:
        client = hook.setdefault("clientConfig", {}) if create else hook.get("clientConfig") or {}
        holders.append((f"webhook {hook.get('name')}", client))
    return holders


def bundle_of(config: Obj) -> set[str | None]:
    """The distinct ``caBundle`` values of a configuration (None: one has none)."""
    return {holder.get("caBundle") for _, holder in bundle_holders(config)}


class BundleWatch:
    """Watches the webhook configurations by name; sets ``wake`` when one appears or changes
    and a webhook in it lacks ``wanted()`` (the bundle last published; None before the first
    pass: every configuration wakes)."""

    def __init__(
        self,
        raw: RawApi,
        webhooks: WebhookConfigs,
        wanted: Callable[[], str | None],
        wake: threading.Event,
    ) -> None:
        self.wanted = wanted
        self.wake = wake
        self.reflectors = [
            Reflector(raw, collection, self.on_event, field_selector=f"metadata.name={name}")
            for collection, name in webhooks.named()
        ]

    def on_event(self, event_type: str, config: Obj) -> None:
        if event_type == "DELETED":
            return  # nothing to publish to; the chart (or a user) creates it again
        want = self.wanted()
        if want is not None and bundle_of(config) <= {want}:
            return
        log.info(
            "webhook configuration lacks the CA bundle; publishing",
            name=(config.get("metadata") or {}).get("name"),
            change=event_type,
        )
        self.wake.set()

    def start(self) -> None:
        for reflector in self.reflectors:
            reflector.start()

    def stop(self) -> None:
        for reflector in self.reflectors:
            reflector.stop()


def secret_path(namespace: str, name: str = "") -> str:
    base = f"/api/v1/namespaces/{namespace}/secrets"
    return f"{base}/{name}" if name else base


def decode_data(secret: Obj) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}


def _encode(data: dict[str, bytes]) -> dict[str, str]:
    return {k: base64.b64encode(v).decode() for k, v in data.items()}


class Rotator:
    """Reconciles one Secret and a set of webhook configurations."""

    def __init__(
        self,
        raw: RawApi,
        *,
        namespace: str,
        secret: str,
        webhooks: WebhookConfigs,
        policy: certs.Policy,
        clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
        publish_grace: float = PUBLISH_GRACE,
        settle: float = SETTLE,
    ) -> None:
        self.raw = raw
        self.namespace = namespace
        self.secret = secret
        self.webhooks = webhooks
        self.policy = policy
        self.clock = clock
        self.publish_grace = dt.timedelta(seconds=publish_grace)
        self.settle = settle
        self.wake = threading.Event()
        """Set to run a pass now (``BundleWatch``, and ``run``'s stop)."""
        self.bundle: str | None = None
        """The CA bundle (base64, as in ``caBundle``) of the last pass."""
        self._seen_published: dict[bytes, dt.datetime] = {}

    # -- the Secret ------------------------------------------------------------------------

    def _read(self) -> Obj | None:
        try:
            return self.raw.get(secret_path(self.namespace, self.secret))
        except KubeNotFoundError:
            return None

    def _write(self, existing: Obj | None, material: certs.Material) -> None:
        body: Obj = {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "kubernetes.io/tls",
            "metadata": {
                "name": self.secret,
                "namespace": self.namespace,
                "labels": {"app.kubernetes.io/managed-by": "gpuslice-controller"},
            },
            "data": _encode(material.secret_data()),
        }
        if existing is None:
            self.raw.create(secret_path(self.namespace), body)
            return
        meta = existing["metadata"]
        body["metadata"] = {
            **meta,
            "labels": {**(meta.get("labels") or {}), **body["metadata"]["labels"]},
        }
        self.raw.replace(secret_path(self.namespace, self.secret), body)

    # -- the bundle ------------------------------------------------------------------------

    def _configs(self) -> list[tuple[str, Obj | None]]:
        found: list[tuple[str, Obj | None]] = []
        for path in self.webhooks.paths():
            try:
                found.append((path, self.raw.get(path)))
            except KubeNotFoundError:
                found.append((path, None))
        return found

    def _published(self, material: certs.Material) -> bool:
        for _path, config in self._configs():
            if config is None:
                continue  # nothing to publish to yet; the chart creates it
            for _, holder in bundle_holders(config):
                bundle = holder.get("caBundle")
                if not certs.bundle_trusts(base64.b64decode(bundle) if bundle else None, material):
                    return False
        return True

    def _settled(self, material: certs.Material) -> bool:
        """Published, and the newest CA seen published for ``publish_grace`` (by this process:
        a new leader waits the grace again, which is the safe side)."""
        if not self._published(material):
            return False
        newest = material.cas()[-1].fingerprint(hashes.SHA256())
        first = self._seen_published.setdefault(newest, self.clock())
        return self.clock() - first >= self.publish_grace

    def publish(self, ca_bundle: bytes) -> list[str]:
        """Set every webhook's ``caBundle`` to ``ca_bundle``; returns the configurations changed."""
        want = base64.b64encode(ca_bundle).decode()
        changed = []
        for path, config in self._configs():
            if config is None:
                log.warning("webhook configuration not found; nothing to publish to", path=path)
                continue
            if bundle_of(config) <= {want}:
                continue
            for _, holder in bundle_holders(config, create=True):
                holder["caBundle"] = want
            try:
                self.raw.replace(path, config)
            except ConflictError:
                log.info("webhook configuration changed while publishing; next pass", path=path)
                continue
            changed.append(path.rsplit("/", 1)[-1])
        return changed

    # -- the loop --------------------------------------------------------------------------

    def reconcile(self) -> str:
        """Bring the Secret and the bundles up to date; returns what was done (for logs)."""
        done: list[str] = []
        for _ in range(MAX_STEPS):
            secret = self._read()
            current = certs.Material.from_secret_data(decode_data(secret)) if secret else None
            published = current is not None and self._settled(current)
            step = certs.next_step(current, self.policy, self.clock(), bundle_published=published)
            if step.material is not None:
                try:
                    self._write(secret, step.material)
                except (ConflictError, KubeAlreadyExistsError):
                    done.append("the Secret changed under us; read again")
                    continue
                done.append(step.reason)
                current = step.material
            if current is not None:
                self.bundle = base64.b64encode(current.ca_certs).decode()
                changed = self.publish(current.ca_certs)
                if changed:
                    done.append(f"published the CA bundle to {', '.join(changed)}")
                    continue
            if step.material is None:
                if step.reason != "up to date" or not done:
                    done.append(step.reason)
                break
        return "; ".join(done)

    def run(self, stop: threading.Event, interval: float) -> None:
        """Reconcile now, every ``interval`` seconds and whenever a webhook configuration lacks
        the bundle, until ``stop`` is set."""

        def wake_on_stop() -> None:
            stop.wait()
            self.wake.set()

        threading.Thread(target=wake_on_stop, name="rotator-stop", daemon=True).start()
        watch = BundleWatch(self.raw, self.webhooks, lambda: self.bundle, self.wake)
        watching = False
        try:
            while not stop.is_set():
                self.wake.clear()
                if stop.is_set():  # set between the check and the clear: its wake is gone
                    break
                try:
                    outcome = self.reconcile()
                    log.info(
                        "certificates reconciled",
                        secret=kobj(self.namespace, self.secret),
                        outcome=outcome,
                    )
                except Exception as exc:  # a failed pass is retried on the next one
                    log.warning(
                        "certificate reconcile failed",
                        secret=kobj(self.namespace, self.secret),
                        error=str(exc),
                    )
                if not watching:  # after the first pass: its list then finds nothing to do
                    watch.start()
                    watching = True
                if self.wake.wait(interval):
                    stop.wait(self.settle)  # the rest of a burst; at most a pass a second
        finally:
            watch.stop()
