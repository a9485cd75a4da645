"""The view's objects (GPUs, or GPU claims) as versioned objects, with the recent changes a
watch replays.

``GpuStore.refresh()`` derives every object from the view (``derive``: the ``GPU`` objects of
``gpuslice_view.resource`` by default, or the ``GPUClaim`` objects of
``gpuslice_view.namespaced``; one store per resource, each with its own versions) and
compares it with what it holds: a new object is ``ADDED``, a changed one ``MODIFIED``, a
gone one ``DELETED``; each change takes the next resourceVersion, and an object's version is
that of its last change, as in etcd. The last ``history`` changes are kept, each with the
object before it, so a watch from a version can be replayed, and a watch with a label selector
can tell an object that left the selection (``DELETED`` for it) from one that changed in it.

Refreshing is driven from outside: the feeder's listener and the live poller mark the store
(``mark``: a counter and an Event, the reflector thread must not wait), and ``run`` refreshes
soon after a mark, and every ``interval`` seconds anyway (a node's live figures turn stale
without any event). A list or get refreshes first where a mark is not applied yet
(``current``), so it never answers older than the view, and costs nothing when nothing changed:
deriving every row takes ≈ 0.2 s for 1,000 nodes (docs/cluster-view.md, "Figures"), too much to
pay on every request or every second.

Versions are the wall clock in microseconds (or the last one plus one, if the clock did not
move), so a restarted controller never reuses one it gave before, and the versions of two
replicas behind one Service say roughly when each saw a change. That matters because the API
server may send a list to one replica and the watch after it to another: a watch from a version
this store gave out (``ours``) replays exactly what followed it; one from a version it never gave
(another replica's) is answered with the current state of every object that changed since
``skew`` seconds before that version (``changes_since`` coalesces them), which covers the two
replicas seeing the same API event a little apart and their clocks differing a little (a
replica that has forgotten nothing since it started sends every object then). Where those
changes are not all kept any more, the answer is 410 Expired and the client lists again, as
with a compacted etcd (docs/view-api.md, "resourceVersion").
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpuslice_controller.view.metrics import ViewSource
from gpuslice_view import report, resource
from gpuslice_view.model import ClusterView

Obj = dict[str, Any]


def gpu_objects(view: ClusterView) -> list[Obj]:
    """Every ``GPU`` object of the view (the default ``derive``)."""
    return [resource.gpu_object(row) for row in report.gpu_rows(view)]


def key(obj: Obj) -> str:
    """An object's key in a store: ``<namespace>/<name>``, or its name if cluster-scoped."""
    meta = obj["metadata"]
    return f"{meta['namespace']}/{meta['name']}" if meta.get("namespace") else str(meta["name"])


@dataclass(frozen=True)
class Change:
    version: int
    type: str  # ADDED | MODIFIED | DELETED
    obj: Obj
    before: Obj | None


def _content(obj: Obj) -> Obj:
    meta = {k: v for k, v in obj["metadata"].items() if k != "resourceVersion"}
    return {**obj, "metadata": meta}


class GpuStore:
    def __init__(
        self,
        source: ViewSource,
        *,
        derive: Callable[[ClusterView], list[Obj]] = gpu_objects,
        history: int = 1024,
        skew: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.source = source
        self.derive = derive
        self.clock = clock
        self.skew_us = int(skew * 1_000_000)
        self._objects: dict[str, Obj] = {}
        self._start = self._version = self._now()
        self._oldest = self._version  # replayable: changes after this version
        self._changes: deque[Change] = deque(maxlen=history)
        self._cond = threading.Condition()
        self._dirty = threading.Event()
        self._marks = 0  # marks so far
        self._mark_lock = threading.Lock()
        self._applied = -1  # the marks the last refresh had seen when it read the view

    @property
    def version(self) -> int:
        with self._cond:
            return self._version

    def mark(self, *_: object) -> None:
        """Something in the view changed (a feeder listener; the live poller)."""
        with self._mark_lock:  # (reflector threads of several kinds, and the poller)
            self._marks += 1
        self._dirty.set()

    def current(self) -> int:
        """Refresh if a change was marked since the last refresh read the view; the version."""
        if self._marks != self._applied:
            return self.refresh()
        return self.version

    def run(self, stop: threading.Event, interval: float = 10.0, settle: float = 0.05) -> None:
        while not stop.is_set():
            if self._dirty.wait(interval):
                stop.wait(settle)  # one refresh for a burst of events
            self._dirty.clear()
            if self.source.synced.is_set():
                self.refresh()

    def refresh(self) -> int:
        """Bring the objects up to the view; the current version."""
        seen = self._marks
        fresh = {key(obj): obj for obj in self.source.read(self.derive)}
        with self._cond:
            for name, obj in fresh.items():
                old = self._objects.get(name)
                if old is not None and _content(old) == obj:
                    continue
                self._record("ADDED" if old is None else "MODIFIED", name, obj, old)
            for name in [n for n in self._objects if n not in fresh]:
                old = self._objects.pop(name)
                gone = {**old, "metadata": dict(old["metadata"])}
                self._record("DELETED", name, gone, old, keep=False)
            self._applied = seen
            self._cond.notify_all()
            return self._version

    def _now(self) -> int:
        return int(self.clock() * 1_000_000)

    def _record(self, kind: str, name: str, obj: Obj, old: Obj | None, keep: bool = True) -> None:
        """One change (lock held)."""
        self._version = max(self._version + 1, self._now())
        if len(self._changes) == self._changes.maxlen:
            self._oldest = self._changes[0].version
        obj["metadata"]["resourceVersion"] = str(self._version)
        if keep:
            self._objects[name] = obj
        self._changes.append(Change(self._version, kind, obj, old))

    def snapshot(self) -> tuple[int, list[Obj]]:
        """(the version, every object by key: namespace, then name)."""
        with self._cond:
            return self._version, [self._objects[n] for n in sorted(self._objects)]

    def ours(self, version: int) -> bool:
        """Whether this store gave out ``version`` (at its start, or as a change's)."""
        with self._cond:
            return version == self._start or any(c.version == version for c in self._changes)

    def changes_since(self, version: int, *, foreign: bool = False) -> list[Change] | None:
        """The changes after ``version``, or None when they are not all kept any more.

        ``foreign``: a version of another replica. Then every object changed since ``skew``
        before it, once, in its current state (``before``: its state before the first of those
        changes), so that a client whose list came from the other replica misses nothing."""
        with self._cond:
            since = version - self.skew_us if foreign else version
            if foreign and since < self._oldest == self._start:
                since = self._start  # nothing forgotten yet: every object's state since start
            if since < self._oldest:
                return None
            changes = [c for c in self._changes if c.version > since]
        if not foreign:
            return changes
        first: dict[str, Change] = {}
        last: dict[str, Change] = {}
        for change in changes:
            name = key(change.obj)
            first.setdefault(name, change)
            last[name] = change
        merged = [Change(c.version, c.type, c.obj, first[name].before) for name, c in last.items()]
        return sorted(merged, key=lambda c: c.version)

    def wait(self, version: int, timeout: float) -> None:
        """Until there is a change after ``version``, at most ``timeout`` seconds."""
        with self._cond:
            self._cond.wait_for(lambda: self._version > version, timeout)
