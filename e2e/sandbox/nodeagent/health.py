"""Device health from DRA plugins, as the kubelet does it with its ResourceHealthStatus gate
(docs/node-agent.md, "What it simulates": Device health): a ``NodeWatchResources`` stream per
plugin endpoint, the health cache, and the ``allocatedResourcesStatus`` of container statuses.

- A plugin that lists a health service in ``supported_versions`` gets a stream
  (``v1.DRAResourceHealth`` preferred when gpuslice_protos has it, else
  ``v1alpha1.DRAResourceHealth``); a plugin that lists none gets no stream. The stream is kept
  open and re-opened ``health_retry`` seconds (5 s) after it ended or failed; ``UNIMPLEMENTED``
  stops watching that endpoint.
- Every message is reconciled into the cache keyed ``<driver>/<pool>/<device>``, stamped with
  the agent's *own* receive time (the plugin's ``last_updated_time`` is ignored). A device not
  refreshed within its ``health_check_timeout_seconds`` (zero or negative: ``health_timeout``,
  30 s) reads as Unknown; a device missing from a message turns Unknown once it timed out.
  Changed devices (health, message or timeout) are reported to ``on_change``.
- A stream that ends clears the whole driver's health (its devices read Unknown). Unlike the
  kubelet, which leaves that to the next pod sync, the pods using those devices are told too.
- ``allocated_resources_status`` is the kubelet's ``UpdateAllocatedResourcesStatus``: per app
  container and per entry of its ``resources.claims`` whose claim is prepared on this node,
  ``name: claim:<podClaimName>`` (``claim:<podClaimName>/<request>`` when the reference names a
  request) with every device of the claim (all requests, all drivers):
  ``resourceID`` = the device's first CDI id, else ``<driver>/<pool>/<device>``, ``health``
  and, when the API server keeps it (gate ResourceHealthStatusMessage), the plugin's
  ``message`` (at most 1024 characters). Entries without devices are left out.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

import grpc

from e2e.sandbox.nodeagent.claims import PodClaim
from e2e.sandbox.nodeagent.dra_plugins import PreparedDevice
from gpuslice_core.logging import get_logger
from gpuslice_kube.raw import Obj
from gpuslice_protos.kubelet.dra_health.v1alpha1 import api_pb2 as v1alpha1_pb2
from gpuslice_protos.kubelet.dra_health.v1alpha1 import api_pb2_grpc as v1alpha1_grpc

log = get_logger(__name__)

HEALTH_V1 = "v1.DRAResourceHealth"
HEALTH_V1ALPHA1 = "v1alpha1.DRAResourceHealth"
HEALTHY, UNHEALTHY, UNKNOWN = "Healthy", "Unhealthy", "Unknown"
MAX_MESSAGE = 1024

Key = tuple[str, str, str]  # driver, pool, device
OnChange = Callable[[list[Key]], None]


def _services() -> dict[str, tuple[ModuleType, ModuleType]]:
    """The health services this agent can speak: v1alpha1 always, v1 once it is mirrored."""
    found = {HEALTH_V1ALPHA1: (v1alpha1_pb2, v1alpha1_grpc)}
    try:
        pb = importlib.import_module("gpuslice_protos.kubelet.dra_health.v1.api_pb2")
        grpc_pb = importlib.import_module("gpuslice_protos.kubelet.dra_health.v1.api_pb2_grpc")
    except ImportError:
        return found
    return {HEALTH_V1: (pb, grpc_pb), **found}


SERVICES = _services()


def choose_health_service(versions: Iterable[str]) -> str | None:
    """The health service to watch for a plugin with these ``supported_versions`` (v1 first)."""
    offered = set(versions)
    for service in (HEALTH_V1, HEALTH_V1ALPHA1):
        if service in offered and service in SERVICES:
            return service
    return None


def truncate_message(message: str) -> str:
    if len(message) <= MAX_MESSAGE:
        return message
    return message[: MAX_MESSAGE - 3] + "..."


@dataclass(frozen=True)
class DeviceHealth:
    pool: str
    device: str
    health: str  # Healthy | Unhealthy | Unknown
    message: str = ""
    timeout: float = 0.0  # the plugin's health_check_timeout_seconds; <= 0: the default
    last_updated: float = 0.0  # the agent's receive time (the cache's clock)


class HealthCache:
    """Known device health per driver (the kubelet's healthInfoCache, without a checkpoint)."""

    def __init__(
        self, default_timeout: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.default_timeout = default_timeout
        self.clock = clock
        self._drivers: dict[str, dict[tuple[str, str], DeviceHealth]] = {}
        self._lock = threading.Lock()

    def _timeout(self, d: DeviceHealth) -> float:
        return d.timeout if d.timeout > 0 else self.default_timeout

    def update(self, driver: str, devices: Iterable[DeviceHealth]) -> list[Key]:
        """Reconcile one message of ``driver``'s stream; the devices whose health changed."""
        with self._lock:
            now = self.clock()
            current = self._drivers.setdefault(driver, {})
            changed: list[tuple[str, str]] = []
            reported: set[tuple[str, str]] = set()
            for d in devices:
                key = (d.pool, d.device)
                reported.add(key)
                old = current.get(key)
                if old is None or (old.health, old.message, old.timeout) != (
                    d.health,
                    d.message,
                    d.timeout,
                ):
                    changed.append(key)
                current[key] = replace(d, last_updated=now)
            for key, old in list(current.items()):
                if key in reported or old.health == UNKNOWN:
                    continue
                if now - old.last_updated > self._timeout(old):
                    current[key] = replace(old, health=UNKNOWN, message="", last_updated=now)
                    changed.append(key)
        return [(driver, pool, device) for pool, device in changed]

    def clear_driver(self, driver: str) -> list[Key]:
        """Forget ``driver`` (its stream ended); the devices that were known."""
        with self._lock:
            gone = self._drivers.pop(driver, {})
        return [(driver, pool, device) for pool, device in gone]

    def get(self, driver: str, pool: str, device: str) -> tuple[str, str]:
        """(health, message) now: Unknown and no message when unknown or not refreshed in time."""
        with self._lock:
            d = self._drivers.get(driver, {}).get((pool, device))
            if d is None or self.clock() - d.last_updated > self._timeout(d):
                return UNKNOWN, ""
            return d.health, d.message


class HealthWatcher:
    """One ``NodeWatchResources`` stream to one plugin endpoint, re-opened until stopped."""

    def __init__(
        self,
        *,
        driver: str,
        endpoint: str,
        channel: grpc.Channel,
        service: str,
        cache: HealthCache,
        on_change: OnChange,
        retry: float,
        node: str,
    ) -> None:
        self.driver = driver
        self.endpoint = endpoint
        self.channel = channel
        self.service = service
        self.cache = cache
        self.on_change = on_change
        self.retry = retry
        self.node = node
        self.messages = 0  # received (for tests and logs)
        self.unimplemented = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._call: Any = None  # the streaming call (cancel() ends it)
        self._thread = threading.Thread(
            target=self._run, name=f"{node}-health-{driver}", daemon=True
        )

    def start(self) -> HealthWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        self._thread.join(timeout=5)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        pb, pb_grpc = SERVICES[self.service]
        stub = pb_grpc.DRAResourceHealthStub(self.channel)
        while not self._stop.is_set():
            try:
                call = stub.NodeWatchResources(pb.NodeWatchResourcesRequest())
            except ValueError:  # the channel was closed: the endpoint is gone
                return
            with self._lock:
                self._call = call
            if self._stop.is_set():
                call.cancel()
            log.info(
                "health stream opened", driver=self.driver, endpoint=self.endpoint, node=self.node
            )
            try:
                for response in call:
                    self.messages += 1
                    self._received(pb, response)
                log.info("health stream ended", driver=self.driver, node=self.node)
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                if code == grpc.StatusCode.UNIMPLEMENTED:
                    self.unimplemented = True
                elif not self._stop.is_set():
                    details = exc.details() if hasattr(exc, "details") else str(exc)
                    log.info(
                        "health stream failed",
                        driver=self.driver,
                        node=self.node,
                        code=getattr(code, "name", str(code)),
                        error=details,
                    )
            finally:
                with self._lock:
                    self._call = None
                cleared = self.cache.clear_driver(self.driver)
                if cleared:
                    self.on_change(cleared)
            if self.unimplemented:
                log.info(
                    "plugin does not implement NodeWatchResources; not watching its health",
                    driver=self.driver,
                    node=self.node,
                )
                return
            if self._stop.wait(self.retry):
                return

    def _received(self, pb: ModuleType, response: object) -> None:
        states = {pb.HEALTHY: HEALTHY, pb.UNHEALTHY: UNHEALTHY}
        devices = []
        for d in response.devices:  # type: ignore[attr-defined]
            timeout = d.health_check_timeout_seconds
            if timeout < 0:
                log.info(
                    "ignoring a negative health check timeout; using the default",
                    driver=self.driver,
                    device=d.device.device_name,
                    timeout=timeout,
                )
            devices.append(
                DeviceHealth(
                    pool=d.device.pool_name,
                    device=d.device.device_name,
                    health=states.get(d.health, UNKNOWN),
                    message=truncate_message(d.message),
                    timeout=float(max(timeout, 0)),
                )
            )
        changed = self.cache.update(self.driver, devices)
        if changed:
            log.info(
                "device health changed",
                driver=self.driver,
                node=self.node,
                devices={f"{p}/{n}": self.cache.get(self.driver, p, n)[0] for _, p, n in changed},
            )
            self.on_change(changed)


class NodeHealth:
    """The health side of one agent: the cache, a watcher per endpoint, and whether the API
    server keeps ``message`` (it drops the field without the ResourceHealthStatusMessage gate;
    then it is no longer sent, so status patches do not repeat forever)."""

    def __init__(
        self,
        *,
        node: str,
        retry: float,
        default_timeout: float,
        on_change: OnChange,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node = node
        self.retry = retry
        self.cache = HealthCache(default_timeout, clock)
        self.on_change = on_change
        self.messages = True
        self._watchers: dict[str, HealthWatcher] = {}  # key: endpoint
        self._lock = threading.Lock()

    def watch(
        self, driver: str, endpoint: str, channel: grpc.Channel, versions: Iterable[str]
    ) -> str | None:
        """Watch a registered endpoint when it offers a health service; that service."""
        service = choose_health_service(versions)
        if service is None:
            return None
        watcher = HealthWatcher(
            driver=driver,
            endpoint=endpoint,
            channel=channel,
            service=service,
            cache=self.cache,
            on_change=self._changed,
            retry=self.retry,
            node=self.node,
        )
        with self._lock:
            old = self._watchers.pop(endpoint, None)
            self._watchers[endpoint] = watcher
        if old is not None:
            old.stop()
        watcher.start()
        return service

    def unwatch(self, endpoint: str) -> None:
        with self._lock:
            watcher = self._watchers.pop(endpoint, None)
        if watcher is not None:
            watcher.stop()

    def watcher(self, endpoint: str) -> HealthWatcher | None:
        with self._lock:
            return self._watchers.get(endpoint)

    def stop(self) -> None:
        with self._lock:
            watchers = list(self._watchers.values())
            self._watchers.clear()
        for w in watchers:
            w.stop()

    def _changed(self, keys: list[Key]) -> None:
        try:
            self.on_change(keys)
        except Exception:
            log.exception("health change notification failed", node=self.node)

    def observe_readback(self, sent: Obj, stored: Obj) -> None:
        """Stop sending ``message`` once the API server is seen dropping it."""
        if not self.messages or not _has_message(sent.get("containerStatuses") or []):
            return
        if not _has_message((stored.get("status") or {}).get("containerStatuses") or []):
            self.messages = False
            log.info(
                "the API server drops allocatedResourcesStatus messages "
                "(ResourceHealthStatusMessage off); no longer sending them",
                node=self.node,
            )


def _has_message(statuses: list[Obj]) -> bool:
    return any(
        r.get("message")
        for cs in statuses
        for rs in cs.get("allocatedResourcesStatus") or []
        for r in rs.get("resources") or []
    )


def allocated_resources_status(
    pod: Obj,
    claims: Iterable[PodClaim],
    devices: Callable[[str], list[tuple[str, PreparedDevice]]],
    health: Callable[[str, str, str], tuple[str, str]],
    *,
    messages: bool = True,
) -> dict[str, list[Obj]]:
    """Container name → its ``allocatedResourcesStatus``. ``devices(claim_name)`` gives the
    (driver, device) pairs of a claim prepared on this node ([] when it is not);
    ``health(driver, pool, device)`` the (health, message) now."""
    by_pod_name = {pc.pod_claim_name: pc for pc in claims if pc.pod_claim_name}
    out: dict[str, list[Obj]] = {}
    for container in (pod.get("spec") or {}).get("containers") or []:
        entries: dict[str, Obj] = {}
        for ref in (container.get("resources") or {}).get("claims") or []:
            pc = by_pod_name.get(ref["name"])
            if pc is None:
                continue
            name = f"claim:{ref['name']}"
            if ref.get("request"):
                name += f"/{ref['request']}"
            resources: dict[str, Obj] = {}  # resourceID must be unique within an entry
            for driver, d in devices(pc.claim_name):
                state, message = health(driver, d.pool_name, d.device_name)
                rid = (
                    d.cdi_device_ids[0]
                    if d.cdi_device_ids
                    else f"{driver}/{d.pool_name}/{d.device_name}"
                )
                item: Obj = {"resourceID": rid, "health": state}
                if messages and message:
                    item["message"] = message
                resources.setdefault(rid, item)
            if resources:
                entries[name] = {"name": name, "resources": list(resources.values())}
        if entries:
            out[container["name"]] = [entries[k] for k in sorted(entries)]
    return out
