"""Keeping a ``ClusterView`` current from watches: the controller's way to hold the view.

One reflector (``gpuslice_kube.reflector``: list, then watch from the listed resourceVersion,
relist on 410) per kind the view keeps: our driver's ResourceSlices (field selector
``spec.driver``), every ResourceClaim (any namespace's allocation takes capacity), pods (only
those with claims are kept), DeviceClasses and, where the server serves them, DeviceTaintRules.
Every change is applied to the view under one lock, so readers see a view that some sequence of
events produced, never one half-applied. The reflectors' own caches keep only names, UIDs and
resourceVersions (``metadata_only``): the view's records are the one copy of the content.

``ViewFeeder(raw).start()``; ``feeder.synced.wait()``; ``feeder.read(lambda view: ...)``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from gpuslice_api.names import DRIVER
from gpuslice_core.logging import get_logger
from gpuslice_kube.discovery import RESOURCE_GROUP
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_kube.reflector import Reflector, metadata_only
from gpuslice_view.live import NodeLive
from gpuslice_view.model import ClusterView
from gpuslice_view.source import resource_version, taint_rule_version

log = get_logger(__name__)
T = TypeVar("T")
Listener = Callable[[str, str, Obj], None]


@dataclass(frozen=True)
class Source:
    kind: str  # as in ClusterView.apply
    path: str
    field_selector: str | None = None


def sources(raw: RawApi, *, driver: str = DRIVER) -> list[Source]:
    """What to watch on this server (asks discovery for the versions)."""
    gv = f"{RESOURCE_GROUP}/{resource_version(raw)}"
    found = [
        Source("ResourceSlice", resource_path(gv, "resourceslices"), f"spec.driver={driver}"),
        Source("ResourceClaim", resource_path(gv, "resourceclaims")),
        Source("Pod", resource_path("v1", "pods")),
        Source("DeviceClass", resource_path(gv, "deviceclasses")),
    ]
    rules = taint_rule_version(raw)
    if rules is not None:
        path = resource_path(f"{RESOURCE_GROUP}/{rules}", "devicetaintrules")
        found.append(Source("DeviceTaintRule", path))
    else:
        log.info("the API server serves no DeviceTaintRule: the view shows no cordons")
    return found


class ViewFeeder:
    """A ``ClusterView`` fed by one reflector per kind; see the module doc."""

    def __init__(self, raw: RawApi, *, driver: str = DRIVER, watch_timeout: int = 300) -> None:
        self.raw = raw
        self.view = ClusterView(driver=driver)
        self.driver = driver
        self.watch_timeout = watch_timeout
        self.synced = threading.Event()
        self.events: dict[str, int] = {}  # kind -> changes applied (for metrics and the bench)
        self._lock = threading.Lock()
        self._listeners: list[Listener] = []
        self._reflectors: list[Reflector] = []
        self._stopped = threading.Event()

    def listen(self, listener: Listener) -> None:
        """Call ``listener(kind, event, obj)`` after each change is applied (reflector thread;
        it must be quick and must not call ``read``'s caller back into the feeder's lock)."""
        self._listeners.append(listener)

    def start(self) -> None:
        for source in sources(self.raw, driver=self.driver):
            self.events[source.kind] = 0
            self._reflectors.append(
                Reflector(
                    self.raw,
                    source.path,
                    self._handler(source.kind),
                    field_selector=source.field_selector,
                    watch_timeout=self.watch_timeout,
                    keep=metadata_only,
                )
            )
        for reflector in self._reflectors:
            reflector.start()
        threading.Thread(target=self._wait_synced, name="view-synced", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()
        for reflector in self._reflectors:
            reflector.stop()

    def read(self, fn: Callable[[ClusterView], T]) -> T:
        """``fn(view)`` under the lock: what it derives is consistent. Keep it short; the
        reflectors wait meanwhile."""
        with self._lock:
            return fn(self.view)

    def set_live(self, nodes: dict[str, NodeLive]) -> None:
        """Replace the enforcers' latest figures (``gpuslice_view.live.LivePoller``'s publish)."""
        with self._lock:
            self.view.live = nodes

    def _handler(self, kind: str) -> Callable[[str, Obj], None]:
        def handle(event: str, obj: Obj) -> None:
            with self._lock:
                self.view.apply(kind, event, obj)
                self.events[kind] += 1
            for listener in self._listeners:
                listener(kind, event, obj)

        return handle

    def _wait_synced(self) -> None:
        for reflector in self._reflectors:
            while not reflector.synced.wait(0.2):
                if self._stopped.is_set():
                    return
        self.synced.set()
        log.info("cluster view synced", **{k.lower(): n for k, n in self.events.items()})
