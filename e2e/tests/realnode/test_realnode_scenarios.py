"""The user-facing e2e scenarios on real kubelets (tier 4: docs/real-node.md).

A control plane of its own (the chart owns the DeviceClasses, which other suites create in the
shared sandbox), three real nodes (containerd + kubelet + runc each, e2e/sandbox/realnode.py;
two for DRA, one labelled gpuslice.dev/mode=device-plugin) and a loopback OCI registry
(Debian's docker-registry, gpuslice_testkit.registry) holding what a release publishes: every
image of hack/images.sh and the packaged chart (gpuslice_testkit.release, the steps of
.github/workflows/release.yml). Each node's containerd has only the pinned pause image and pulls
the rest through a hosts.toml for that registry, as a user's nodes pull from theirs; `helm
install oci://…/charts/gpuslice --version …` runs with the chart's default image references
(image.registry set to the registry) and pull policy, and the fake NVML node of
e2e/scenarios/nodes.py. The node DaemonSet runs from our images with the chart's RBAC and
hostPath mounts, node-setup installs the enforcer's static CDI hook (which runc then runs for
every shared container), the plugin registers with the real kubelet, and `helm test` passes.
Then the scenarios of e2e/scenarios/user.py, the same code kind runs (hack/e2e-kind.sh).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.sandbox import nodehost
from e2e.sandbox.binaries import REPO_ROOT, KubeBinaries
from e2e.sandbox.controlplane import ControlPlane, StartError
from e2e.sandbox.realnode import Image, RealNodes
from e2e.sandbox.realnode import StartError as NodeStartError
from e2e.scenarios.chart import Installed, install
from e2e.scenarios.cluster import Cluster, merged
from e2e.scenarios.nodes import chart_values
from e2e.scenarios.user import SCENARIOS
from gpuslice_kube.client import new_api_client
from gpuslice_kube.raw import resource_path
from gpuslice_testkit.enforcer import go_hook
from gpuslice_testkit.registry import start_registry
from gpuslice_testkit.release import Summary, release

pytest_plugins = ("e2e.sandbox.realnode_fixtures",)
pytestmark = pytest.mark.timeout(420)  # dynamic_mig: a rolling helm upgrade, 80-160 s here

NODES = ("gpu-real-0", "gpu-real-1")  # DRA
DEVICE_PLUGIN_NODES = ("gpu-real-dp",)  # gpuslice.dev/mode=device-plugin
SERVICES = ("kubelet-plugin", "enforcer", "mig-manager")
HOOK_DIR = "/var/lib/gpuslice/hook"  # the chart's enforcer.hook.hostDir
VERSION = "0.1.0-e2e"  # the release the tier publishes to its registry (chart and image tags)


@pytest.fixture(scope="module")
def helm_path() -> Path:
    out = subprocess.run(
        ["bash", str(REPO_ROOT / "hack" / "install-helm.sh")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if out.returncode != 0:
        pytest.fail(f"hack/install-helm.sh failed:\n{out.stderr[-2000:]}", pytrace=False)
    return Path(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def published(
    real_images: dict[str, Image],  # the images cache the release pushes (fails if missing)
    helm_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Summary]:
    """A release in a loopback registry, served for the module's whole life."""
    run_dir = tmp_path_factory.mktemp("release")
    with start_registry(run_dir / "registry") as registry:
        summary = release(
            registry=registry.address,
            prefix="gpuslice",
            version=VERSION,
            plain_http=True,
            workdir=run_dir / "work",
        )
        print(
            f"release pushed to {registry.address}: images {summary.images_seconds:.1f}s,"
            f" chart {summary.chart.seconds:.1f}s"
        )
        yield summary


@pytest.fixture(scope="module")
def chart_cluster(
    kube_binaries: KubeBinaries,
    published: Summary,
    helm_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Cluster, Installed, RealNodes]]:
    run_dir = tmp_path_factory.mktemp("chart-cluster")
    cp = ControlPlane(run_dir / "control-plane", binaries=kube_binaries)
    try:
        cp.start()
    except StartError as exc:
        pytest.fail(f"control plane did not start: {exc}", pytrace=False)
    try:
        yield from _cluster_from_registry(cp, run_dir, helm_path, published)
    finally:
        left = cp.stop()
        assert not left, f"control plane left behind: {left}"


def _cluster_from_registry(
    cp: ControlPlane, run_dir: Path, helm_path: Path, published: Summary
) -> Iterator[tuple[Cluster, Installed, RealNodes]]:
    registry = published.registry
    try:
        mode = {"gpuslice.dev/mode": "device-plugin"}
        nodes_cm = RealNodes.started(
            cp,
            NODES + DEVICE_PLUGIN_NODES,
            labels={name: mode for name in DEVICE_PLUGIN_NODES},
            import_names=("pause",),  # the sandbox image a node is configured with
            registries={registry: f"http://{registry}"},
        )
        nodes = nodes_cm.__enter__()
    except (NodeStartError, nodehost.HostError) as exc:
        pytest.fail(f"real nodes did not start: {exc}", pytrace=False)
    try:
        values = chart_values(registry=published.image_registry)
        chart_args = ("--version", VERSION, "--plain-http")

        def helm_install() -> Installed:
            return install(
                helm_path,
                cp.kubeconfig,
                values,
                run_dir / "values.json",
                chart=published.chart.ref,
                chart_args=chart_args,
            )

        installed = helm_install()  # cold: every node pulls every image it runs

        def upgrade(changes: dict[str, Any]) -> None:
            values.update(merged(values, changes))
            helm_install()

        cluster = Cluster(
            new_api_client(cp.kubeconfig, user_agent="gpuslice-e2e"),
            list(NODES),
            published.images["python-base"].ref,
            installed.namespace,
            nodes,
            upgrade,
            list(DEVICE_PLUGIN_NODES),
        )
        yield cluster, installed, nodes
    except BaseException:
        for node in nodes:  # what the nodes said, for the failure at hand
            print(f"--- {node.name} kubelet log (tail)", file=sys.stderr)
            print("\n".join(node.kubelet_log().splitlines()[-40:]), file=sys.stderr)
        raise
    finally:
        nodes_cm.__exit__(None, None, None)


def test_chart_runs_from_our_images_on_real_kubelets(
    chart_cluster: tuple[Cluster, Installed, RealNodes], published: Summary
) -> None:
    cluster, installed, nodes = chart_cluster
    print(f"helm install --wait: {installed.seconds:.1f}s; nodes: {nodes.timings}")
    # helm test's validation pod got the share it asked for
    assert "PASS" in installed.test_output, installed.test_output
    for node in NODES:
        pod = cluster.node_pod(node)
        statuses = {c["name"]: c for c in pod["status"]["containerStatuses"]}
        statuses |= {c["name"]: c for c in pod["status"]["initContainerStatuses"]}
        for service in SERVICES:
            status = statuses[service]
            assert status["ready"] and status["image"].endswith(
                cluster_image(cluster, installed, service)
            ), status
        # the plugin registered with the real kubelet: its slices are published for the node
        slices = cluster.kube.list(
            resource_path("resource.k8s.io/v1", "resourceslices"),
            field_selector=f"spec.nodeName={node}",
        )["items"]
        devices = sorted(d["name"] for s in slices for d in s["spec"].get("devices") or [])
        assert devices[:3] == ["gpu-0", "gpu-1", "gpu-2"], devices
        # node-setup put the enforcer image's static hook on the node, and nothing else: no
        # Python (runc runs it for every shared container: the scenarios)
        hook_dir = nodes[node].host_path(HOOK_DIR)
        assert sorted(p.relative_to(hook_dir).as_posix() for p in hook_dir.rglob("*")) == [
            "bin",
            "bin/gpuslice-enforcer-hook",
        ]
        assert (hook_dir / "bin" / "gpuslice-enforcer-hook").read_bytes() == go_hook().read_bytes()
        assert not nodes[node].host_path("/opt/gpuslice").exists()
        # pulled from the release's registry with the chart's pull policy, as on a user's node
        for container in pod["spec"]["initContainers"] + pod["spec"]["containers"]:
            assert container["imagePullPolicy"] == "IfNotPresent", container["name"]
            assert container["image"].startswith(published.image_registry + "/"), container
    # the controller runs from its image, every replica ready (its webhooks: the scenarios)
    controllers = cluster.kube.list(
        resource_path("v1", "pods", namespace=installed.namespace),
        label_selector="app.kubernetes.io/component=controller",
    )["items"]
    assert len(controllers) == 2, [p["metadata"]["name"] for p in controllers]
    for pod in controllers:
        [status] = pod["status"]["containerStatuses"]
        assert status["ready"] and status["image"].endswith(
            cluster_image(cluster, installed, "controller", "controller", "deployments")
        ), status


def cluster_image(
    cluster: Cluster,
    installed: Installed,
    service: str,
    component: str = "node",
    workloads: str = "daemonsets",
) -> str:
    """The image of ``service``'s container in the release's workload of ``component``."""
    workload = cluster.kube.list(
        resource_path("apps/v1", workloads, namespace=installed.namespace),
        label_selector=f"app.kubernetes.io/component={component}",
    )["items"][0]
    spec = workload["spec"]["template"]["spec"]
    for c in spec["containers"] + spec.get("initContainers", []):
        if c["name"] == service:
            image: str = c["image"]
            return image
    raise AssertionError(f"no container {service} in the DaemonSet")


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.__name__)
def test_scenario(
    chart_cluster: tuple[Cluster, Installed, RealNodes], scenario: Callable[[Cluster], None]
) -> None:
    scenario(chart_cluster[0])
