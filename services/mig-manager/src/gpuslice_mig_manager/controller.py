"""The label-driven layout controller.

The node label ``gpuslice.dev/mig.config`` names a layout. Each new value (or a change of the
layouts themselves) starts a *generation*: the state label goes to ``pending``, the layout is
applied, and the outcome is reported:

- ``success``: every selected GPU has its layout; a Normal ``MigConfigApplied`` Event.
- ``pending``: some GPU waits (an instance held by a claim or a process must not be destroyed,
  a GPU busy for a mode change). A Warning ``MigConfigWaiting`` Event names the instances and
  the processes or claims; the layout is tried again with exponential backoff and jitter
  (tenacity) until it completes. It never wedges: a new label value interrupts the wait at once
  and takes over.
- ``rebooting``: a MIG mode change needs a GPU reset that failed; a Warning
  ``MigConfigRebootRequired`` Event says so. The operator resets the GPU or reboots the node; the
  manager finishes the layout when it starts again.
- no label (removed): MIG stays as it is and the state label is removed.
- ``failed``: the layout cannot be applied as written (unknown layout or profile, does not fit);
  a Warning ``MigConfigFailed`` Event says why. Nothing is retried until the label or the
  layouts change.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import tenacity

from gpuslice_core.errors import GpusliceError, TransientError
from gpuslice_core.logging import get_logger
from gpuslice_mig_manager.apply import LayoutResult, LayoutState, apply_layout
from gpuslice_mig_manager.kube import LABEL_CONFIG, NORMAL, WARNING, NodeReporter
from gpuslice_mig_manager.manager import MigManager
from gpuslice_mig_manager.sources import LayoutSource

log = get_logger(__name__)


class _SupersededError(Exception):
    """The label or the layouts changed (or the controller stops) while waiting to retry."""


@dataclass(frozen=True)
class Backoff:
    """Retry delays of a waiting layout: exponential from ``initial`` up to ``maximum``."""

    initial: float = 1.0
    maximum: float = 60.0

    def wait(self) -> tenacity.wait.wait_base:
        return tenacity.wait_exponential_jitter(
            multiplier=self.initial, max=self.maximum, jitter=self.initial / 2
        )


class LayoutController:
    def __init__(
        self,
        manager: MigManager,
        source: LayoutSource | None,
        reporter: NodeReporter,
        *,
        backoff: Backoff = Backoff(),
        on_result: Callable[[LayoutResult], None] | None = None,
    ) -> None:
        self.manager = manager
        self.source = source
        self.reporter = reporter
        self.backoff = backoff
        self.on_result = on_result
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._desired: str | None = None
        self._generation = 0
        self._done = 0
        self._thread: threading.Thread | None = None
        #: The last outcome, for health and tests.
        self.last: LayoutResult | None = None

    # -- inputs -----------------------------------------------------------------------------
    def on_labels(self, labels: dict[str, str]) -> None:
        """The Node's labels as last seen (from the node reflector)."""
        value = labels.get(LABEL_CONFIG) or None
        with self._lock:
            if value == self._desired:
                return
            self._desired = value
            self._generation += 1
        log.info("mig config label changed", layout=value)
        self._wake.set()

    def on_layouts_changed(self) -> None:
        """The layouts changed: apply the selected one again."""
        with self._lock:
            if self._desired is None:
                return
            self._generation += 1
        log.info("mig layouts changed; applying the selected layout again")
        self._wake.set()

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="layout-controller", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def run(self) -> None:
        structlog.contextvars.bind_contextvars(component="mig-manager")  # a thread's own context
        while not self._stop.is_set():
            self._wake.clear()
            with self._lock:
                generation, name = self._generation, self._desired
            if name is None and generation != self._done:
                self._done = generation  # the label was removed: MIG stays as it is
                self.reporter.set_state(None)
                continue
            if name is None or generation == self._done:
                self._wake.wait()
                continue
            try:
                self._work(generation, name)
            except _SupersededError:
                continue
            except Exception as exc:  # never let the controller thread die
                log.exception("layout controller failed", layout=name)
                self._finish(
                    generation,
                    LayoutState.FAILED,
                    f"MIG layout {name} failed: internal error: {exc}",
                )

    # -- one generation ---------------------------------------------------------------------
    def _work(self, generation: int, name: str) -> None:
        self.reporter.set_state(LayoutState.PENDING.value)
        reported: list[str] = []

        def attempt() -> LayoutResult:
            result = self._attempt(name)
            self._check(generation)
            return result

        def waiting(retry_state: tenacity.RetryCallState) -> None:
            outcome = retry_state.outcome
            if outcome is None:
                return
            exc = outcome.exception()
            reason = str(exc) if exc is not None else outcome.result().reasons()
            delay = retry_state.next_action.sleep if retry_state.next_action else 0.0
            log.info("layout waits; retrying", layout=name, reason=reason, retry_in_s=delay)
            if reason not in reported:
                reported.append(reason)
                self.reporter.event(
                    WARNING, "MigConfigWaiting", f"MIG layout {name} waits: {reason}"
                )

        retrying = tenacity.Retrying(
            retry=(
                tenacity.retry_if_result(lambda r: r.state is LayoutState.PENDING)
                | tenacity.retry_if_exception_type(TransientError)
            ),
            wait=self.backoff.wait(),
            stop=tenacity.stop_never,
            sleep=self._sleep,
            before_sleep=waiting,
            reraise=True,
        )
        try:
            result = retrying(attempt)
        except _SupersededError:
            raise
        except GpusliceError as exc:
            self._finish(generation, LayoutState.FAILED, f"MIG layout {name} failed: {exc}")
            return
        self.last = result
        if self.on_result is not None:
            self.on_result(result)
        self._finish(generation, result.state, result.message)

    def _attempt(self, name: str) -> LayoutResult:
        if self.source is None:
            return LayoutResult(
                name,
                LayoutState.FAILED,
                False,
                [],
                f"MIG layout {name} failed: no layouts are configured (start the manager with"
                " --config-file or --config-map)",
            )
        return apply_layout(self.manager, name, self.source.load())

    def _finish(self, generation: int, state: LayoutState, message: str) -> None:
        self._check(generation)
        self._done = generation
        self.reporter.set_state(state.value)
        if state is LayoutState.SUCCESS:
            self.reporter.event(NORMAL, "MigConfigApplied", message)
        elif state is LayoutState.REBOOTING:
            self.reporter.event(WARNING, "MigConfigRebootRequired", message)
        else:
            self.reporter.event(WARNING, "MigConfigFailed", message)

    def _check(self, generation: int) -> None:
        with self._lock:
            current = self._generation
        if self._stop.is_set() or current != generation:
            raise _SupersededError

    def _sleep(self, seconds: float) -> None:
        if self._wake.wait(seconds) or self._stop.is_set():
            raise _SupersededError
