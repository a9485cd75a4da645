"""A cap on the server-streaming calls of one gRPC server, so streams never starve unary calls.

The synchronous gRPC server runs every call, streams included, on one thread pool. A
ListAndWatch or ``grpc.health.v1.Health/Watch`` stream holds its thread for as long as the
client keeps it open, so eight held streams used to leave no thread for the kubelet's Allocate,
which then timed out. ``StreamCap`` admits at most ``cap`` open streams per method and refuses
the next one with RESOURCE_EXHAUSTED, naming the method and the cap; the server's pool is sized
``unary workers + cap * streaming methods`` (``pool_size``), so unary calls always keep their
own threads. The kubelet opens one ListAndWatch per registration (two for a moment while it
re-registers); a stream whose client went away frees its slot within ListAndWatch's 1 s wake-up.

Why not the async server: one interceptor and a larger pool fix the starvation for the cost of a
few idle threads, and the servicer stays synchronous like every other gpuslice servicer.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from gpuslice_core.logging import get_logger

log = get_logger(__name__)


def pool_size(unary_workers: int, cap: int, streaming_methods: int) -> int:
    """Threads for a server whose streams are capped: every stream can be open and
    ``unary_workers`` unary calls still run."""
    return unary_workers + cap * streaming_methods


class StreamCap(grpc.ServerInterceptor):
    """At most ``cap`` open calls of each server-streaming method; see the module doc."""

    def __init__(self, cap: int) -> None:
        if cap < 1:
            raise ValueError("StreamCap needs a cap of at least 1")
        self.cap = cap
        self._open: Counter[str] = Counter()
        self._lock = threading.Lock()

    def open_streams(self, method: str) -> int:
        with self._lock:
            return self._open[method]

    def _admit(self, method: str) -> bool:
        with self._lock:
            if self._open[method] >= self.cap:
                return False
            self._open[method] += 1
            return True

    def _release(self, method: str) -> None:
        with self._lock:
            self._open[method] -= 1

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_stream is None:
            return handler
        inner = handler.unary_stream
        method: str = handler_call_details.method

        def capped(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            if not self._admit(method):
                log.warning("stream refused: at the cap", method=method, cap=self.cap)
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"this device plugin serves at most {self.cap} streams of {method} at once "
                    "(the kubelet needs one); close one and call again",
                )
            try:
                yield from inner(request, context)
            finally:
                self._release(method)

        return grpc.unary_stream_rpc_method_handler(
            capped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
