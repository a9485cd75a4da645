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

The cluster is one that keeps NVIDIA's GPU Operator for the driver (docs/migration.md, "Keeping
the GPU Operator for driver and toolkit"), and the install performs that migration: the nodes
carry the Operator's labels and their driver under its driver container's root
(/run/nvidia/driver, as files: the mock libnvidia-ml); the Operator's device plugin and MIG
manager DaemonSets exist, so the first install is refused by the chart's guard naming both;
they are then removed as the guide's `--set devicePlugin.enabled=false --set
migManager.enabled=false` makes the Operator remove them, and the chart installs with
examples/values-gpu-operator.yaml. Every scenario then runs on that layout.
"""

from __future__ import annotations

import base64
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.sandbox import nodehost
from e2e.sandbox.binaries import REPO_ROOT, KubeBinaries
from e2e.sandbox.controlplane import ControlPlane, StartError
from e2e.sandbox.realnode import Image, RealNodes
from e2e.sandbox.realnode import StartError as NodeStartError
from e2e.scenarios.chart import HelmError, Installed, install
from e2e.scenarios.cluster import Cluster, attribute, delete_and_wait, merged, request
from e2e.scenarios.nodes import FAKE_NODE, SHARE_GPU, chart_values
from e2e.scenarios.user import SCENARIOS
from e2e.support.prometheus import MONITORING_CRDS, dashboard
from gpuslice_kube.client import new_api_client
from gpuslice_kube.raw import Obj, RawApi, resource_path
from gpuslice_testkit.core import wait_for
from gpuslice_testkit.enforcer import go_hook
from gpuslice_testkit.kube_sd import KubernetesDiscovery
from gpuslice_testkit.nvml_mock import write_driver_root
from gpuslice_testkit.prometheus import (
    Prometheus,
    dashboard_queries,
    prometheus_binary,
    prometheus_config,
    scrape_configs,
)
from gpuslice_testkit.registry import start_registry
from gpuslice_testkit.release import Summary, release

pytest_plugins = ("e2e.sandbox.realnode_fixtures",)
pytestmark = pytest.mark.timeout(420)  # dynamic_mig: a rolling helm upgrade, 80-160 s here

VIEW_GROUP, VIEW_VERSION = "view.gpuslice.dev", "v1alpha1"  # the aggregated API (docs/view-api.md)
NODES = ("gpu-real-0", "gpu-real-1")  # DRA
DEVICE_PLUGIN_NODES = ("gpu-real-dp",)  # gpuslice.dev/mode=device-plugin
SERVICES = ("kubelet-plugin", "enforcer", "mig-manager")
HOOK_DIR = "/var/lib/gpuslice/hook"  # the chart's enforcer.hook.hostDir
VERSION = "0.1.0-e2e"  # the release the tier publishes to its registry (chart and image tags)
# Prometheus as a Prometheus Operator installation runs it: its own ServiceAccount (a reader of
# the controller's /view/metrics), the chart's monitors and rules as the operator reads them
MONITORING_NS, PROMETHEUS_SA = "monitoring", "prometheus"
SA_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
# The NVIDIA driver of every GPU node, as files: the mock libnvidia-ml.so.1 answering for the
# fake node of e2e/scenarios/nodes.py, its device nodes and capabilities (write_driver_root).
# The node pods run the real NVML backend on it, loading the library from the driver root
# they mount, as on a GPU node without the NVIDIA Container Toolkit.
# The GPU Operator's driver container root, as examples/values-gpu-operator.yaml names it; the
# same path on every node, each with its own files.
OPERATOR_VALUES: dict[str, Any] = yaml.safe_load(
    (REPO_ROOT / "examples" / "values-gpu-operator.yaml").read_text()
)
DRIVER_ROOT: str = OPERATOR_VALUES["nvml"]["driverRoot"]  # /run/nvidia/driver
OPERATOR_NS = "gpu-operator"
# What the Operator runs that gpuslice replaces (its DaemonSet → container names), on the nodes it
# labels nvidia.com/gpu.deploy.<component>=true (none here: its pods never start)
OPERATOR_DAEMONSETS = {
    "nvidia-device-plugin-daemonset": ("nvidia-device-plugin-ctr", "device-plugin"),
    "nvidia-mig-manager": ("nvidia-mig-manager", "mig-manager"),
}
# The labels the Operator (its NFD and GPU feature discovery) puts on a GPU node
OPERATOR_NODE_LABELS = {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": "NVIDIA-H100"}
MOCK_STATE_DIR = Path("/var/run/gpuslice/nvml-mock")  # under hostPaths.runDir: every NVML
# container mounts it read-write at the same path
DRIVER_VALUES: dict[str, Any] = {
    "nvml": {"backend": "real", "driverRoot": DRIVER_ROOT},
    # the MIG capabilities of the driver root's proc/, so MIG devices get their cap nodes
    "kubeletPlugin": {"extraEnv": [{"name": "GPUSLICE_PROC_ROOT", "value": "/driver-root/proc"}]},
    # the device plugin's pod mounts the run dir (the mock's state) with its enforcer
    "devicePlugin": {"enforcer": {"enabled": True}},
}
MONITORING_VALUES: dict[str, Any] = {
    "metrics": {
        "serviceMonitor": {"enabled": True, "interval": "2s"},
        "prometheusRule": {"enabled": True},
    },
    "controller": {
        "clusterView": {
            "readers": [
                {"kind": "ServiceAccount", "name": PROMETHEUS_SA, "namespace": MONITORING_NS}
            ]
        },
    },
}


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
        labels = {name: dict(OPERATOR_NODE_LABELS) for name in NODES}
        labels |= {name: OPERATOR_NODE_LABELS | mode for name in DEVICE_PLUGIN_NODES}
        nodes_cm = RealNodes.started(
            cp,
            NODES + DEVICE_PLUGIN_NODES,
            labels=labels,
            import_names=("pause",),  # the sandbox image a node is configured with
            registries={registry: f"http://{registry}"},
        )
        nodes = nodes_cm.__enter__()
    except (NodeStartError, nodehost.HostError) as exc:
        pytest.fail(f"real nodes did not start: {exc}", pytrace=False)
    try:
        kube = RawApi(new_api_client(cp.kubeconfig, user_agent="gpuslice-e2e"))
        _prepare_monitoring(kube)
        _operator_footprint(kube)
        config = run_dir / "fake-node.yaml"
        config.write_text(yaml.safe_dump(FAKE_NODE))
        for node in nodes:
            write_driver_root(node.host_path(DRIVER_ROOT), config, node.name, MOCK_STATE_DIR)
            node.host_path(str(MOCK_STATE_DIR)).mkdir(parents=True, exist_ok=True)
        values = merged(
            merged(chart_values(registry=published.image_registry), DRIVER_VALUES),
            MONITORING_VALUES,
        )
        values = merged(values, OPERATOR_VALUES)  # -f examples/values-gpu-operator.yaml
        values["nvml"].pop("fakeConfig")
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

        # the Operator's device plugin and MIG manager still run: the guard refuses, naming both
        try:
            helm_install()
        except HelmError as exc:
            refused = str(exc)
        else:
            raise AssertionError("installed next to the GPU Operator's device plugin")
        for name in OPERATOR_DAEMONSETS:
            assert f"DaemonSet {OPERATOR_NS}/{name}" in refused, refused
        assert "--set devicePlugin.enabled=false" in refused, refused
        _operator_components_off(kube)
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
            driver_files=True,  # the driver roots of files (DRIVER_ROOT)
        )
        yield cluster, installed, nodes
    except BaseException:
        for node in nodes:  # what the nodes said, for the failure at hand
            print(f"--- {node.name} kubelet log (tail)", file=sys.stderr)
            print("\n".join(node.kubelet_log().splitlines()[-40:]), file=sys.stderr)
        raise
    finally:
        nodes_cm.__exit__(None, None, None)


def _operator_footprint(kube: RawApi) -> None:
    """What a cluster with the GPU Operator runs that gpuslice replaces: its device plugin's and
    MIG manager's DaemonSets, as the Operator names them, on the nodes it labels for each."""
    kube.create(
        resource_path("v1", "namespaces"),
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OPERATOR_NS}},
    )
    for name, (container, component) in OPERATOR_DAEMONSETS.items():
        match = {"app": name}
        kube.create(
            resource_path("apps/v1", "daemonsets", namespace=OPERATOR_NS),
            {
                "apiVersion": "apps/v1",
                "kind": "DaemonSet",
                "metadata": {"name": name, "labels": match},
                "spec": {
                    "selector": {"matchLabels": match},
                    "template": {
                        "metadata": {"labels": match},
                        "spec": {
                            "nodeSelector": {f"nvidia.com/gpu.deploy.{component}": "true"},
                            "containers": [
                                {"name": container, "image": f"nvcr.io/nvidia/{component}:e2e"}
                            ],
                        },
                    },
                },
            },
        )


def _operator_components_off(kube: RawApi) -> None:
    """What `helm upgrade gpu-operator … --set devicePlugin.enabled=false --set
    migManager.enabled=false` does to the cluster: the two DaemonSets are gone."""
    for name in OPERATOR_DAEMONSETS:
        path = resource_path("apps/v1", "daemonsets", namespace=OPERATOR_NS, name=name)
        delete_and_wait(kube, path, f"DaemonSet {OPERATOR_NS}/{name}", 30)


def _prepare_monitoring(kube: RawApi) -> None:
    """What a cluster with Prometheus Operator has before the chart comes: the monitoring CRDs
    (established), and Prometheus's namespace and ServiceAccount."""
    crds = resource_path("apiextensions.k8s.io/v1", "customresourcedefinitions")
    for crd in MONITORING_CRDS:
        kube.create(crds, crd)

    def established() -> bool:
        for crd in MONITORING_CRDS:
            got = kube.get(f"{crds}/{crd['metadata']['name']}")
            conditions = {
                c["type"]: c["status"] for c in (got.get("status") or {}).get("conditions") or []
            }
            if conditions.get("Established") != "True":
                return False
        return True

    wait_for(established, 30, "the monitoring CRDs to be established")
    kube.create(
        resource_path("v1", "namespaces"),
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": MONITORING_NS}},
    )
    kube.create(
        resource_path("v1", "serviceaccounts", namespace=MONITORING_NS),
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": PROMETHEUS_SA}},
    )


@pytest.fixture(scope="module")
def prometheus(
    chart_cluster: tuple[Cluster, Installed, RealNodes], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Prometheus]:
    """Debian's Prometheus scraping the installed chart through the ServiceMonitors, PodMonitor
    and PrometheusRule the chart created (read back from the API server), with the token of its
    ServiceAccount and the CA of the Secret the monitor names: from the module's first test on,
    so it scrapes while the scenarios run."""
    binary = prometheus_binary()
    if binary is None:
        pytest.fail("prometheus is not installed: bash hack/node-packages.sh", pytrace=False)
    cluster, installed, _ = chart_cluster
    kube, ns = cluster.kube, installed.namespace
    workdir = tmp_path_factory.mktemp("prometheus")
    token = kube.create(
        resource_path("v1", "serviceaccounts", namespace=MONITORING_NS, name=PROMETHEUS_SA)
        + "/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {}},
    )["status"]["token"]
    (workdir / "token").write_text(token)

    def secret_file(namespace: str, name: str, key: str) -> Path:
        data = kube.get(resource_path("v1", "secrets", namespace=namespace, name=name))["data"]
        path = workdir / "secrets" / namespace / name / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data[key]))
        return path

    group = "monitoring.coreos.com/v1"
    monitors = [
        obj
        for plural in ("servicemonitors", "podmonitors")
        for obj in kube.list(resource_path(group, plural, namespace=ns))["items"]
    ]
    rule_files = []
    for rule in kube.list(resource_path(group, "prometheusrules", namespace=ns))["items"]:
        path = workdir / f"rules-{rule['metadata']['name']}.yaml"
        path.write_text(yaml.safe_dump(rule["spec"]))
        rule_files.append(path)
    assert monitors and rule_files, (monitors, rule_files)
    with KubernetesDiscovery(lambda path: kube.list(path)["items"]) as sd:
        scrape = scrape_configs(
            monitors, discovery_url=sd.url, files=secret_file, paths={SA_TOKEN: workdir / "token"}
        )
        config = prometheus_config(scrape, rule_files=rule_files)
        with Prometheus(workdir / "prometheus", config, binary) as prom:
            yield prom


def test_chart_runs_from_our_images_on_real_kubelets(
    chart_cluster: tuple[Cluster, Installed, RealNodes],
    published: Summary,
    prometheus: Prometheus,
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


def test_the_view_api_lists_every_published_device_through_the_apiservice(
    chart_cluster: tuple[Cluster, Installed, RealNodes],
) -> None:
    """The chart's APIService (on by default) on real kubelets, registered from the install on,
    so every scenario's namespace teardown runs with it in discovery (an unavailable one would
    stall them): the controller's leader puts its CA in it, the
    API server's aggregator reaches a controller pod through the Service's endpoints, and the
    controller accepts the aggregator's front-proxy identity (its RBAC: auth-delegator and the
    extension-apiserver-authentication reader). A list through the API server is one GPU
    object per device our slices publish, and a label selector is applied by the controller."""
    cluster = chart_cluster[0]
    kube = cluster.kube
    name = f"{VIEW_VERSION}.{VIEW_GROUP}"

    def available() -> bool:
        got = kube.get(resource_path("apiregistration.k8s.io/v1", "apiservices", name=name))
        conditions = (got.get("status") or {}).get("conditions") or []
        return any(c["type"] == "Available" and c["status"] == "True" for c in conditions)

    wait_for(available, 60, f"APIService {name} to be Available")
    slices = kube.list(resource_path("resource.k8s.io/v1", "resourceslices"))["items"]
    published = {
        f"{s['spec']['nodeName']}.{d['name']}"
        for s in slices
        if s["spec"].get("nodeName") in cluster.gpu_nodes
        for d in s["spec"].get("devices") or []
    }
    gpus = f"/apis/{VIEW_GROUP}/{VIEW_VERSION}/gpus"

    def listed() -> set[str] | None:
        found = kube.get(gpus)  # the answer as served, not a client-side merge of pages
        assert found["kind"] == "GPUList" and found["apiVersion"] == f"{VIEW_GROUP}/{VIEW_VERSION}"
        names = {item["metadata"]["name"] for item in found["items"]}
        return names if names >= published else None

    # the view lists what the slices say once its informers caught up with them
    assert wait_for(listed, 30, "the view API to list every published device") >= published
    node = cluster.gpu_nodes[0]
    selected = kube.list(gpus, label_selector=f"gpuslice.dev/node={node}")["items"]
    assert selected and {item["metadata"]["labels"]["gpuslice.dev/node"] for item in selected} == {
        node
    }
    assert {item["metadata"]["name"] for item in selected} == {
        n for n in published if n.startswith(f"{node}.")
    }


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


def _gpu_uuids(cluster: Cluster) -> set[str]:
    """The UUIDs of every GPU our slices publish (a MIG device's parent included)."""
    slices = cluster.kube.list(resource_path("resource.k8s.io/v1", "resourceslices"))["items"]
    return {
        attrs[key]["string"]
        for s in slices
        for d in s["spec"].get("devices") or []
        for attrs in [d.get("attributes") or {}]
        for key in ("uuid", "parentUUID")
        if key in attrs
    }


def _series(prometheus: Prometheus, expr: str, what: str) -> list[Obj]:
    """The series ``expr`` returns once it returns any (a scrape every 2 s)."""

    def found() -> list[Obj] | None:
        return prometheus.query(expr) or None

    return wait_for(found, 30, f"series for {what}: {expr}")


def _check_labels(series: list[Obj], what: str, cluster: Cluster, uuids: set[str]) -> None:
    """Every series names a real node, one of its GPUs and, for a workload, a pod that exists."""
    nodes = set(cluster.gpu_nodes) | set(cluster.device_plugin_nodes)
    for s in series:
        labels = s["metric"]
        if "Hostname" in labels:
            assert labels["Hostname"] in nodes, (what, labels)
        if "UUID" in labels:
            assert labels["UUID"] in uuids, (what, labels)
        if "pod" in labels and "namespace" in labels:
            pods = cluster.kube.list(resource_path("v1", "pods", namespace=labels["namespace"]))
            names = {p["metadata"]["name"] for p in pods["items"]}
            assert labels["pod"] in names, (what, labels, names)


# The series each alert reads, as they look in a healthy cluster running one share and one
# pod waiting for a claim that cannot be allocated (the alerts on kills and bypasses read
# counters that exist only once the enforcer acted: their expressions must evaluate, no more).
ALERT_SERIES = {
    "GpusliceGpuTainted": "gpuslice_gpu_tainted",
    "GpusliceNodeDevicesTainted": "gpuslice_kubelet_plugin_tainted_devices",
    "GpusliceShareOverMemoryLimit": "gpuslice_enforcer_share_memory_limit_bytes",
    "GpusliceShareProcessKilled": "",
    "GpusliceShareBypass": "",
    "GpusliceEnforcerDown": 'up{endpoint="enforcer"} == 1',
    "GpusliceComponentDown": 'up{endpoint!="enforcer"} == 1',
    "GpusliceMetricsAbsent": 'up{job=~".*gpuslice.*"}',
    "GpusliceClaimPending": "gpuslice_claim_pending",
}


def test_prometheus_scrapes_every_component_and_the_dashboard_and_alerts_find_their_series(
    chart_cluster: tuple[Cluster, Installed, RealNodes], prometheus: Prometheus
) -> None:
    """The last test of the module: Prometheus has scraped the chart through every scenario.
    With a share running and a pod waiting, every dashboard query returns series, every alert's
    expression evaluates, and the series they read name real nodes, GPUs and pods; the view
    API's gpuclaims and gpureasons show the same two pods."""
    cluster = chart_cluster[0]
    node = cluster.gpu_nodes[0]
    uuids = _gpu_uuids(cluster)
    with cluster.namespace("metrics") as ns:
        on_gpu = attribute("index", SHARE_GPU)
        cluster.template(ns, "share", request("gpu", selector=on_gpu, cores="30", memory="4Gi"))
        cluster.pod(ns, "share", node, templates={"gpu": "share"})
        cluster.template(ns, "toobig", request("gpu", selector=on_gpu, cores="100"))
        cluster.pod(ns, "waits", node, templates={"gpu": "toobig"})
        cluster.running(ns, "share")
        cluster.unschedulable(ns, "waits")

        # every target of every monitor is up: 3 per GPU node, the device plugin's node, and
        # each controller replica's two endpoints
        want = 3 * len(cluster.gpu_nodes) + len(cluster.device_plugin_nodes) + 2 * 2

        def all_up() -> list[Obj]:
            targets = prometheus.targets()
            healthy = [t for t in targets if t["health"] == "up"]
            assert len(healthy) >= want and len(healthy) == len(targets), [
                (t["labels"].get("job"), t["labels"].get("pod"), t["scrapeUrl"], t["lastError"])
                for t in targets
            ]
            return targets

        targets = wait_for(all_up, 60, f"{want} targets up")
        assert {t["labels"].get("Hostname") for t in targets} >= set(cluster.gpu_nodes), targets

        for name, expr in dashboard_queries(dashboard()).items():
            _check_labels(_series(prometheus, expr, name), name, cluster, uuids)

        rules = {r["name"]: r for g in prometheus.rules() for r in g["rules"]}
        assert set(rules) == set(ALERT_SERIES), sorted(rules)
        for rule in rules.values():
            assert rule["type"] == "alerting" and rule["health"] == "ok", rule
            prometheus.query(rule["query"])  # evaluates on the live series
        for alert, selector in ALERT_SERIES.items():
            if selector:
                _check_labels(_series(prometheus, selector, alert), alert, cluster, uuids)
        pending = prometheus.query(f'gpuslice_claim_pending{{namespace="{ns}"}}')
        # one series per controller replica (each serves the view), the alert takes the max
        assert {s["metric"]["pod"] for s in pending} == {"waits"}, pending
        share = cluster.pod_claim(cluster.get_pod(ns, "share"), "gpu")
        limit = prometheus.query(
            f'gpuslice_enforcer_share_memory_limit_bytes{{claim_uid="{share["metadata"]["uid"]}"}}'
        )
        assert [float(s["value"][1]) for s in limit] == [4 * 1024**3], limit
        # the same two pods through the view API's namespaced resources (docs/view-api.md): the
        # share's claim allocated on the node, and why the other pod waits
        view = f"/apis/{VIEW_GROUP}/{VIEW_VERSION}/namespaces/{ns}"
        claims = {c["metadata"]["name"]: c for c in cluster.kube.get(f"{view}/gpuclaims")["items"]}
        allocated = claims[share["metadata"]["name"]]["status"]
        assert allocated["state"] == "Allocated", allocated
        assert {d["node"] for d in allocated["devices"]} == {node}, allocated
        why = cluster.kube.get(f"{view}/gpureasons/waits")
        assert why["kind"] == "GPUReason" and why["status"]["reasons"], why
        firing = [a for a in prometheus.alerts() if a["state"] == "firing"]
        assert not firing, firing  # a healthy cluster: nothing fires
