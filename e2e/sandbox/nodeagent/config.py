"""What one simulated node is: its name, its directories and the periods it runs on.

The defaults are the kubelet's (docs/node-agent.md, "Timings"); tests shorten the periods with
``Timings.fast()`` so a lease, a re-registration or a retry happens within a test's budget.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

KUBELET_PORT = 10250
MAX_UNIX_SOCKET_PATH = 107  # sun_path is 108 bytes including the terminating NUL


@dataclass(frozen=True)
class Timings:
    """Every period and timeout of the agent, in seconds (kubelet defaults)."""

    lease_duration: int = 40
    lease_renew: float = 10.0
    node_status: float = 10.0  # how often the status is computed (sent when changed)
    node_status_report: float = 300.0  # sent at least this often even when unchanged
    plugin_poll: float = 1.0  # the plugin manager's reconcile period (we poll the dir)
    registration_backoff_initial: float = 0.5
    registration_backoff_max: float = 122.0
    slice_wipe_delay: float = 30.0  # ResourceSlices of a driver with no live endpoint
    dra_call_timeout: float = 45.0  # NodePrepareResources / NodeUnprepareResources
    dra_reconcile: float = 60.0  # unprepare claims of pods that are gone
    pod_resync: float = 10.0  # full pod sync even without a change
    pleg: float = 1.0  # how often running containers are checked for exits (PLEG relist)
    pod_backoff_initial: float = 1.0  # retry of a failed prepare / container create
    pod_backoff_max: float = 10.0
    crashloop_initial: float = 10.0  # restart delay of an exited container (doubling)
    crashloop_max: float = 300.0
    default_grace: float = 30.0  # terminationGracePeriodSeconds when the pod sets none
    device_plugin_dial: float = 10.0
    health_retry: float = 5.0  # NodeWatchResources re-opened this long after it ended
    health_timeout: float = 30.0  # a device's health without its own timeout goes Unknown

    @classmethod
    def fast(cls, **overrides: float) -> Timings:
        """Short periods for tests: everything a test waits on happens within a second or two.

        The lease keeps its 40 s duration (the node lifecycle controller reads it); only the
        renewal is faster.
        """
        base = cls(
            lease_renew=2.0,
            node_status=1.0,
            plugin_poll=0.1,
            registration_backoff_initial=0.2,
            registration_backoff_max=2.0,
            slice_wipe_delay=2.0,
            dra_call_timeout=10.0,
            dra_reconcile=1.0,
            pod_resync=2.0,
            pleg=0.2,
            pod_backoff_initial=0.3,
            pod_backoff_max=2.0,
            crashloop_initial=1.0,
            crashloop_max=5.0,
            device_plugin_dial=5.0,
            health_retry=1.0,
        )
        return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]


@dataclass(frozen=True)
class NodeConfig:
    """One sandbox node. ``root`` is its kubelet root dir (``/var/lib/kubelet`` on a real node);
    keep it short: unix socket paths inside it must stay under 108 bytes."""

    name: str
    root: Path
    labels: dict[str, str] = field(default_factory=dict)
    cpu: str = "8"
    memory: str = "32Gi"
    ephemeral_storage: str = "100Gi"
    pods: int = 110
    timings: Timings = field(default_factory=Timings)
    cdi_root: Path | None = None  # default: <root>/cdi
    kubelet_port: int = KUBELET_PORT  # published in daemonEndpoints when not serving logs
    serve_logs: bool = True  # /containerLogs over HTTPS on a port of its own (kubectl logs)
    kubelet_version: str = ""  # default: the API server's version
    # the kubelet's ResourceHealthStatus gate: DRA health streams → allocatedResourcesStatus
    resource_health: bool = True

    @property
    def registry_dir(self) -> Path:
        return self.root / "plugins_registry"

    @property
    def plugins_dir(self) -> Path:
        return self.root / "plugins"

    @property
    def device_plugins_dir(self) -> Path:
        return self.root / "device-plugins"

    @property
    def cdi_dir(self) -> Path:
        return self.cdi_root if self.cdi_root is not None else self.root / "cdi"

    @property
    def pod_resources_dir(self) -> Path:
        return self.root / "pod-resources"

    @property
    def pods_dir(self) -> Path:
        return self.root / "pods"

    @property
    def dra_checkpoint(self) -> Path:
        return self.root / "dra_manager_state"

    @property
    def device_checkpoint(self) -> Path:
        return self.device_plugins_dir / "kubelet_internal_checkpoint"

    def make_dirs(self) -> None:
        for d in (
            self.root,
            self.registry_dir,
            self.plugins_dir,
            self.device_plugins_dir,
            self.cdi_dir,
            self.pods_dir,
            self.pod_resources_dir,
        ):
            d.mkdir(parents=True, exist_ok=True)
        self.registry_dir.chmod(0o755)
        longest = self.device_plugins_dir / "kubelet.sock"
        if len(str(longest)) > MAX_UNIX_SOCKET_PATH - 20:
            raise ValueError(
                f"node root {self.root} is too long for unix sockets inside it "
                f"(limit {MAX_UNIX_SOCKET_PATH} bytes per socket path); use a shorter dir"
            )
