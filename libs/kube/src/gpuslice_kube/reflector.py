"""A reflector: keep a local copy of a collection in sync by list, then watch.

It is the part of client-go's informer that our services need: list, watch from the listed
resourceVersion with bookmarks, list again when the version expires (410) or the watch fails,
and hand every change to a callback. A relist is diffed against the cache, so an object deleted
while the watch was down is still reported as DELETED.

An object that cannot be decoded (``gpuslice_core.untrusted``: nested too deep, a number out of
range) is treated as absent, the same way by a list and by a watch: the list leaves it out, and
a watch event for it removes it from the cache (DELETED to the handler if it was there), with a
warning per object and minute. One such object never stops the reflector; neither does any
other failure, which is logged and retried with backoff.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from gpuslice_core.errors import GpusliceError
from gpuslice_core.logging import get_logger
from gpuslice_kube.errors import GoneError
from gpuslice_kube.raw import Obj, RawApi, WatchEvent, WatchStream, report_skipped

log = get_logger(__name__)

Handler = Callable[[str, Obj], None]


def metadata_only(obj: Obj) -> Obj:
    """What a cache needs to diff a relist: the object's identity and resourceVersion."""
    meta = obj.get("metadata") or {}
    kept = ("name", "namespace", "uid", "resourceVersion")
    return {"metadata": {k: meta[k] for k in kept if k in meta}}


def object_key(obj: Obj) -> str:
    """``namespace/name`` (or ``name`` for cluster-scoped objects)."""
    meta = obj.get("metadata") or {}
    ns = meta.get("namespace")
    return f"{ns}/{meta['name']}" if ns else str(meta["name"])


class Reflector:
    """Mirror ``path`` (filtered by selectors) into ``self.cache`` and report each change.

    ``handler(event_type, obj)`` is called from the reflector's thread with ADDED, MODIFIED or
    DELETED; exceptions it raises are logged and do not stop the reflector. ``keep`` reduces what
    the cache holds of each object (``metadata_only``: a consumer that keeps its own digest
    needs only names and versions); the handler gets whole objects, except for a delete found by
    a relist, which it gets as the cache kept it.
    """

    def __init__(
        self,
        raw: RawApi,
        path: str,
        handler: Handler,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        watch_timeout: int = 300,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
        keep: Callable[[Obj], Obj] | None = None,
    ) -> None:
        self.raw = raw
        self.path = path
        self.handler = handler
        self.label_selector = label_selector
        self.field_selector = field_selector
        self.watch_timeout = watch_timeout
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.keep = keep or (lambda obj: obj)
        self.cache: dict[str, Obj] = {}
        self.synced = threading.Event()
        self._stop = threading.Event()
        self._stream: WatchStream | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name=f"reflector{self.path}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        with self._lock:
            if self._stream is not None:
                self._stream.close()
        if self._thread is not None:
            self._thread.join(timeout)

    def run(self) -> None:
        delay = self.backoff_initial
        while not self._stop.is_set():
            try:
                version = self._relist()
                delay = self.backoff_initial
                self._watch(version)
            except GoneError:
                log.info("watch expired; listing again", path=self.path)
            except Exception as exc:  # anything: a reflector that dies leaves a stale cache
                if isinstance(exc, GpusliceError):
                    log.warning(
                        "list/watch failed", path=self.path, error=str(exc), retry_in_s=delay
                    )
                else:
                    log.exception("list/watch crashed", path=self.path, retry_in_s=delay)
                if self._stop.wait(delay):
                    return
                delay = min(delay * 2, self.backoff_max)

    def _emit(self, event_type: str, obj: Obj) -> None:
        try:
            self.handler(event_type, obj)
        except Exception:
            log.exception("reflector handler failed", path=self.path, event_type=event_type)

    def _skip(self, event: WatchEvent) -> None:
        """An object that cannot be decoded: gone from the cache, as a relist would leave it
        out."""
        meta = event.object.get("metadata") or {}
        report_skipped(self.path, meta, event.undecodable)
        if "name" not in meta:
            return
        old = self.cache.pop(object_key(event.object), None)
        if old is not None:
            self._emit("DELETED", old)

    def _relist(self) -> str:
        """List page by page: each object is reported and reduced (``keep``) as its page
        arrives, so a large collection never sits in memory whole; what the cache holds that
        the list did not return was deleted meanwhile, reported last."""
        listed: set[str] = set()
        version: str | None = None
        for items, page_version in self.raw.pages(
            self.path, label_selector=self.label_selector, field_selector=self.field_selector
        ):
            version = page_version
            for obj in items:
                key = object_key(obj)
                listed.add(key)
                old = self.cache.get(key)
                self.cache[key] = self.keep(obj)
                if old is None:
                    self._emit("ADDED", obj)
                elif old["metadata"].get("resourceVersion") != obj["metadata"].get(
                    "resourceVersion"
                ):
                    self._emit("MODIFIED", obj)
        for key in set(self.cache) - listed:
            self._emit("DELETED", self.cache.pop(key))
        self.synced.set()
        return str(version)

    def _watch(self, version: str) -> None:
        while not self._stop.is_set():
            stream = self.raw.watch(
                self.path,
                resource_version=version,
                label_selector=self.label_selector,
                field_selector=self.field_selector,
                timeout_seconds=self.watch_timeout,
            )
            with self._lock:
                if self._stop.is_set():
                    stream.close()
                    return
                self._stream = stream
            for event in stream:
                obj = event.object
                version = str(obj.get("metadata", {}).get("resourceVersion") or version)
                if event.type == "BOOKMARK":
                    continue
                if event.undecodable:
                    self._skip(event)
                    continue
                key = object_key(obj)
                if event.type == "DELETED":
                    self.cache.pop(key, None)
                else:
                    self.cache[key] = self.keep(obj)
                self._emit(event.type, obj)
            with self._lock:
                self._stream = None
