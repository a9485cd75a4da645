"""The containers of one pod: init containers one at a time in order (sidecars started and
kept), then the app containers; exits seen by polling (the PLEG), restarts by the restart
policy with CrashLoopBackOff, create failures retried with backoff, and the stop sequence."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from e2e.sandbox.nodeagent import podstatus
from e2e.sandbox.nodeagent.config import Timings
from e2e.sandbox.nodeagent.containers import ContainerConfigError
from e2e.sandbox.nodeagent.podstatus import ContainerView
from e2e.sandbox.nodeagent.runtime import Container, ContainerConfig, CreateContainerError, Runtime
from gpuslice_core.cdi import Hook
from gpuslice_core.logging import get_logger
from gpuslice_kube.raw import Obj

log = get_logger(__name__)

# (event type, reason, message, fieldPath)
EventSink = Callable[[str, str, str, str], None]


@dataclass
class ContainerRun:
    spec: Obj
    view: ContainerView
    instance: Container | None = None
    hooks: list[Hook] = field(default_factory=list)
    next_start: float = 0.0
    crash_delay: float = 0.0
    create_delay: float = 0.0

    @property
    def key(self) -> str:
        """The device manager's name for the container (init containers prefixed)."""
        return ("init:" if self.view.init else "") + self.view.name

    @property
    def field_path(self) -> str:
        kind = "initContainers" if self.view.init else "containers"
        return f"spec.{kind}{{{self.view.name}}}"


def _run(spec: Obj, init: bool, has_inits: bool) -> ContainerRun:
    view = ContainerView(
        name=spec["name"],
        image=spec.get("image", ""),
        init=init,
        sidecar=init and spec.get("restartPolicy") == "Always",
        waiting_reason="PodInitializing" if has_inits and not init else "ContainerCreating",
    )
    return ContainerRun(spec=spec, view=view)


class PodContainers:
    def __init__(
        self, pod: Obj, runtime: Runtime, timings: Timings, events: EventSink, ref: str
    ) -> None:
        spec = pod.get("spec") or {}
        meta = pod["metadata"]
        self.uid: str = meta["uid"]
        self.pod_label = f"{meta['name']}_{meta['namespace']}({self.uid})"
        self.runtime = runtime
        self.timings = timings
        self.events = events
        self.ref = ref
        self.restart_policy: str = spec.get("restartPolicy") or "Always"
        inits = spec.get("initContainers") or []
        self.inits = [_run(c, init=True, has_inits=True) for c in inits]
        self.apps = [_run(c, init=False, has_inits=bool(inits)) for c in spec["containers"]]

    @property
    def all(self) -> list[ContainerRun]:
        return self.inits + self.apps

    def views(self) -> tuple[list[ContainerView], list[ContainerView]]:
        return [r.view for r in self.inits], [r.view for r in self.apps]

    def phase(self, terminal: bool) -> str:
        inits, apps = self.views()
        return podstatus.phase(self.restart_policy, inits, apps, terminal)

    def running(self, name: str) -> bool:
        return any(r.view.name == name and r.view.running for r in self.all)

    # ---- adoption after an agent restart ------------------------------------------------------
    def adopt(self, pod: Obj) -> bool:
        """Take over containers a previous agent left; True when there were any."""
        adopted = False
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        for run in self.all:
            inst = self.runtime.adopt(self.uid, run.view.name)
            if inst is None:
                continue
            adopted = True
            run.instance = inst
            run.view.container_id = f"gpuslice://{inst.id}"
            run.view.running_since = inst.started_at
            run.view.waiting_reason = ""
            for cs in statuses:
                if cs.get("name") == run.view.name:
                    run.view.restart_count = int(cs.get("restartCount") or 0)
        return adopted

    # ---- the loop ------------------------------------------------------------------------------
    def step(self, make_config: Callable[[ContainerRun], ContainerConfig]) -> None:
        """See exits, then start what is due: inits in order, then the app containers."""
        for run in self.all:
            self.poll(run)
        for run in self.inits:
            if run.view.sidecar:
                if self._due(run):
                    self._start(run, make_config)
                if not run.view.running:
                    return
                continue
            if run.view.succeeded() and not run.view.restarting:
                continue
            if self._due(run):
                self._start(run, make_config)
            return  # one init container at a time
        for run in self.apps:
            if self._due(run):
                self._start(run, make_config)

    def next_delay(self) -> float:
        delay = self.timings.pod_resync
        if any(r.instance is not None and r.view.exited is None for r in self.all):
            delay = min(delay, self.timings.pleg)
        pending = [r.next_start for r in self.all if r.instance is None or r.view.restarting]
        if pending:
            delay = min(delay, max(0.05, min(pending) - time.monotonic()))
        return delay

    def poll(self, run: ContainerRun) -> None:
        if run.instance is None or run.view.exited is not None:
            return
        status = run.instance.poll()
        if status is None:
            return
        t = self.timings
        run.view.exited = status
        run.view.running_since = ""
        self.runtime.poststop(run.hooks, run.instance)
        if run.view.sidecar:
            restart = True
        elif run.view.init:
            restart = status.exit_code != 0 and self.restart_policy != "Never"
        else:
            restart = self.restart_policy == "Always" or (
                self.restart_policy == "OnFailure" and status.exit_code != 0
            )
        if not restart:
            return
        run.view.restarting = True
        run.next_start = time.monotonic() + run.crash_delay  # the first restart is immediate
        if run.crash_delay > 0:
            run.view.waiting_reason = "CrashLoopBackOff"
            run.view.waiting_message = (
                f"back-off {run.crash_delay:g}s restarting failed container={run.view.name} "
                f"pod={self.pod_label}"
            )
            self.events(
                "Warning",
                "BackOff",
                f"Back-off restarting failed container {run.view.name}",
                run.field_path,
            )
        run.crash_delay = min(max(run.crash_delay * 2, t.crashloop_initial), t.crashloop_max)

    def _due(self, run: ContainerRun) -> bool:
        if run.instance is not None and not run.view.restarting:
            return False
        return time.monotonic() >= run.next_start

    def _start(
        self, run: ContainerRun, make_config: Callable[[ContainerRun], ContainerConfig]
    ) -> None:
        t = self.timings
        try:
            cfg = make_config(run)
            if not cfg.argv:  # no command: nothing to run, the container just "runs"
                cfg.argv = ["sleep", "infinity"]
            instance = self.runtime.run(cfg)
        except (ContainerConfigError, CreateContainerError, grpc.RpcError) as exc:
            reason = (
                "CreateContainerConfigError"
                if isinstance(exc, ContainerConfigError)
                else "CreateContainerError"
            )
            text = f"PreStartContainer: {exc}" if isinstance(exc, grpc.RpcError) else str(exc)
            run.view.waiting_reason, run.view.waiting_message = reason, text
            run.create_delay = min(
                max(run.create_delay * 2, t.pod_backoff_initial), t.pod_backoff_max
            )
            run.next_start = time.monotonic() + run.create_delay
            log.warning(
                "container create failed", pod=self.ref, container=run.view.name, error=text
            )
            self.events("Warning", "Failed", f"Error: {text}", run.field_path)
            return
        run.hooks = cfg.edits.hooks
        if run.view.exited is not None:  # a restart
            run.view.last_terminated = run.view.exited
            run.view.last_container_id = run.view.container_id
            run.view.restart_count += 1
        run.instance = instance
        run.create_delay = 0.0
        run.view.exited = None
        run.view.restarting = False
        run.view.container_id = f"gpuslice://{instance.id}"
        run.view.running_since = instance.started_at
        run.view.waiting_reason = run.view.waiting_message = ""
        self.events("Normal", "Created", f"Created container: {run.view.name}", run.field_path)
        self.events("Normal", "Started", f"Started container {run.view.name}", run.field_path)

    # ---- stopping ------------------------------------------------------------------------------
    def stop_all(self, grace: float, announce: bool = True) -> None:
        """SIGTERM to every running container's command, SIGKILL after ``grace``; no restarts."""
        running = [r for r in self.all if r.instance is not None and r.instance.poll() is None]
        for run in running:
            if announce:
                self.events(
                    "Normal", "Killing", f"Stopping container {run.view.name}", run.field_path
                )
            assert run.instance is not None
            run.instance.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for run in running:
            assert run.instance is not None
            run.instance.stop(max(0.0, deadline - time.monotonic()))
        for run in self.all:
            self.poll(run)
            run.view.restarting = False
