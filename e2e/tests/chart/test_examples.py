"""examples/ (issue 32): every spec a user copies parses, says what its containers will see, asks
only for the chart's DeviceClasses, and is accepted by the sandbox's real API server (server-side
dry run, strict field validation); every chart values file there renders the chart. The real
run — every example applied on real kubelets and its promises checked — is the scenario
``examples_run_as_documented`` (e2e/scenarios/examples.py), which the real-node tier and kind run.

Without a cluster: the scenario's pure parts (expect lines, image substitution, device
matching), every opaque config decoded as the webhook and the kubelet plugin decode it, and
every pod through the controller's translation (only the dialect-*.yaml pods are translated,
each into the share its header promises).
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import yaml

from e2e.sandbox.controlplane import ControlPlane
from e2e.scenarios.cluster import Cluster
from e2e.scenarios.examples import (
    EXAMPLES,
    Example,
    ExampleError,
    Expectation,
    check_devices,
    check_env,
    examples_run_as_documented,
    load,
    matches,
    name_clashes,
    parse_expectations,
    resource_of,
    values_files,
    with_image,
    workload_files,
)
from e2e.scenarios.nodes import L4_MEMORY
from e2e.scenarios.user import SCENARIOS
from e2e.support.chart import find, render
from gpuslice_api.gpuconfig import decode
from gpuslice_api.quantity import quantity_int
from gpuslice_controller.admission.translate import ClusterFacts, translate_pod
from gpuslice_device_plugin.config import parse_config

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)

WORKLOADS = workload_files()
VALUES = values_files()


def _ids(paths: list[Path]) -> list[str]:
    return [p.name for p in paths]


def test_the_examples_are_there_and_listed_in_their_readme() -> None:
    assert {p.name for p in WORKLOADS} >= {
        "whole-gpu.yaml",
        "share.yaml",
        "mig-static.yaml",
        "nvidia-gpuconfig.yaml",
        "dialect-hami.yaml",
        "dialect-gpushare.yaml",
        "dialect-vcuda.yaml",
        "dialect-qgpu.yaml",
        "dialect-volcano.yaml",
        "device-plugin.yaml",
    }
    readme = (EXAMPLES / "README.md").read_text()
    for path in WORKLOADS + VALUES:
        assert f"({path.name})" in readme, f"examples/README.md does not link {path.name}"
    assert not name_clashes(load(p) for p in WORKLOADS)


@pytest.mark.parametrize("path", WORKLOADS, ids=_ids(WORKLOADS))
def test_every_example_says_what_it_is_and_what_its_containers_see(path: Path) -> None:
    text = path.read_text()
    assert text.startswith("# "), f"{path.name} has no comment header"
    example = load(path)  # every container has an expect line, every line a container
    assert example.pods, f"{path.name} has no pod"
    for pod in example.pods:
        assert "namespace" not in pod["metadata"], "examples are applied with kubectl -n"
        for container in pod["spec"]["containers"]:
            # prints what Cluster.env reads, up to its READY line
            assert container["command"][:2] == ["sh", "-c"], container
            assert "echo READY" in container["command"][2], container
            assert container["image"] == "busybox:1.36", container  # one image to substitute


def _device_class_names(obj: Any) -> set[str]:
    found: set[str] = set()
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key == "deviceClassName":
                found.add(value)
            else:
                found |= _device_class_names(value)
    elif isinstance(obj, list):
        for item in obj:
            found |= _device_class_names(item)
    return found


def test_examples_ask_only_for_the_charts_device_classes(helm_bin: Path) -> None:
    served = {dc["metadata"]["name"] for dc in find(render(helm_bin), "DeviceClass")}
    asked = set().union(*(_device_class_names(load(p).objects) for p in WORKLOADS))
    assert asked and asked <= served, (asked, served)


@pytest.mark.parametrize("path", VALUES, ids=_ids(VALUES))
def test_every_values_file_renders_the_chart(helm_bin: Path, path: Path) -> None:
    assert path.read_text().startswith("# "), f"{path.name} has no comment header"
    objs = render(helm_bin, "-f", str(path))
    assert find(objs, "DaemonSet"), path.name
    values = yaml.safe_load(path.read_text())
    config = (values.get("devicePlugin") or {}).get("config")
    if config:  # NVIDIA's config file, decoded as the device plugin decodes it at start
        parse_config(config, source=path.name)


def test_every_example_is_accepted_by_the_api_server(sandbox: ControlPlane, namespace: str) -> None:
    for path in WORKLOADS:
        out = subprocess.run(
            [
                str(sandbox.binaries.path("kubectl")),
                f"--kubeconfig={sandbox.kubeconfig}",
                *("apply", "-n", namespace, "--server-side", "--dry-run=server"),
                *("--field-manager=gpuslice-examples-test", "--validate=strict", "-f", str(path)),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert out.returncode == 0, f"the API server refused {path.name}:\n{out.stderr}"
        accepted = [line for line in out.stdout.splitlines() if line.endswith("(server dry run)")]
        assert len(accepted) == len(load(path).objects), out.stdout
        assert not out.stderr.strip(), out.stderr  # no warnings either


def _opaque_configs(obj: Any) -> list[Any]:
    found: list[Any] = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            found += [value["parameters"]] if key == "opaque" else _opaque_configs(value)
    elif isinstance(obj, list):
        for item in obj:
            found += _opaque_configs(item)
    return found


def test_every_opaque_config_decodes_as_the_webhook_and_the_plugin_decode_it() -> None:
    configs = [c for p in WORKLOADS for c in _opaque_configs(load(p).objects)]
    assert {c["apiVersion"] for c in configs} == {"resource.nvidia.com/v1beta1"}, configs
    for config in configs:
        decode(config)  # raises with the field named where the webhook would deny it


def test_only_the_dialect_examples_are_translated_by_the_controller_and_to_their_promise() -> None:
    """The controller's translation (pure code) of every example pod on the scenario's L4s:
    each dialect-*.yaml pod becomes the share its expect line states, every other pod is left
    alone (a plain nvidia.com/gpu included)."""
    facts = ClusterFacts.of([L4_MEMORY])
    dialect_pods = set()
    for path in WORKLOADS:
        example = load(path)
        for pod in example.pods:
            name = pod["metadata"]["name"]
            t = translate_pod({**pod, "metadata": {**pod["metadata"], "namespace": "ns"}}, facts)
            if not path.name.startswith("dialect-"):
                assert t is None, f"{path.name}: the controller would translate pod {name}"
                continue
            assert t is not None, f"{path.name}: the controller would leave pod {name} alone"
            dialect_pods.add(name)
            [template] = t.templates
            [request] = template["spec"]["spec"]["devices"]["requests"]
            asked = request["exactly"]["capacity"]["requests"]
            [expect] = [e for e in example.expectations if e.pod == name]
            assert asked["cores"] == expect.fields["CORES"], (path.name, asked)
            assert quantity_int(asked["memory"]) == int(expect.fields["MEMORY"]), (path.name, asked)
    assert {"hami", "gpushare", "vcuda", "qgpu", "volcano"} <= dialect_pods, dialect_pods


def test_the_pod_webhook_is_sent_every_dialect_examples_pod(helm_bin: Path) -> None:
    """The API server sends a pod to the controller only when the mutating webhook's
    matchConditions match it: each resource a dialect example asks for is named there."""
    [webhooks] = find(render(helm_bin), "MutatingWebhookConfiguration")
    conditions = " ".join(
        c["expression"] for w in webhooks["webhooks"] for c in w.get("matchConditions") or []
    )
    for path in WORKLOADS:
        if not path.name.startswith("dialect-"):
            continue
        for pod in load(path).pods:
            for container in pod["spec"]["containers"]:
                for resource in container["resources"]["limits"]:
                    if resource != "nvidia.com/gpu":
                        assert f"'{resource}'" in conditions, (path.name, resource, conditions)


def test_the_examples_scenario_runs_before_dynamic_mig_which_stays_last() -> None:
    names = [s.__name__ for s in SCENARIOS]
    assert names[-2:] == ["examples_run_as_documented", "dynamic_mig"], names


# ---- the scenario's pure parts --------------------------------------------------------------
def test_expect_lines_are_parsed() -> None:
    text = (
        "# a header\n"
        "# expect p/c: DEVICE=gpu-* ENFORCEMENT=hard|soft\n"
        "#   expect-env legacy/main: NVIDIA_VISIBLE_DEVICES=GPU-*\n"
        "apiVersion: v1\n"
    )
    assert parse_expectations(text) == [
        Expectation("p", "c", {"DEVICE": "gpu-*", "ENFORCEMENT": "hard|soft"}),
        Expectation("legacy", "main", {"NVIDIA_VISIBLE_DEVICES": "GPU-*"}, env=True),
    ]
    for bad in (
        "# expect p: CORES=1",
        "# expect p/c: CORES",
        "# expect p/c:",
        "# expects p/c: A=1",
    ):
        with pytest.raises(ExampleError, match=r"<example>:1"):
            parse_expectations(bad)


def _pod(name: str, *containers: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "initContainers": [{"name": "init", "image": "busybox:1.36"}],
            "containers": [{"name": c, "image": "busybox:1.36"} for c in containers],
        },
    }


def test_load_refuses_an_unchecked_container_or_a_line_for_none(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text(
        "# expect p/a: CORES=1\n# expect p/init: CORES=1\n" + yaml.safe_dump(_pod("p", "a", "b"))
    )
    with pytest.raises(
        ExampleError, match=r"x.yaml: no expect line for pod/container \[\('p', 'b'\)\]"
    ):
        load(path)
    path.write_text("# expect p/z: CORES=1\n" + yaml.safe_dump(_pod("p")))
    with pytest.raises(ExampleError, match=r"name no such pod/container: \[\('p', 'z'\)\]"):
        load(path)
    path.write_text(yaml.safe_dump({"kind": "Secret", "metadata": {"name": "s"}}))
    with pytest.raises(ExampleError, match="a 'Secret'"):
        load(path)


def test_the_image_is_substituted_in_every_container_of_a_copy() -> None:
    pod = _pod("p", "a", "b")
    out = with_image(pod, "registry.local/python-base:1")
    spec = out["spec"]
    for container in spec["initContainers"] + spec["containers"]:
        assert container["image"] == "registry.local/python-base:1"
        assert container["imagePullPolicy"] == "IfNotPresent"
    assert pod["spec"]["containers"][0]["image"] == "busybox:1.36"  # the original is untouched
    template = {"kind": "ResourceClaimTemplate", "metadata": {"name": "t"}, "spec": {}}
    assert with_image(template, "x") == template
    assert resource_of(template) == ("resource.k8s.io/v1", "resourceclaimtemplates")
    assert resource_of(pod) == ("v1", "pods")


def test_patterns_and_device_matching() -> None:
    assert matches("hard", "hard|soft") and matches("soft", "hard|soft")
    assert not matches("off", "hard|soft") and not matches(None, "*")
    assert matches("gpu-3-mig-3g-20gb-4", "gpu-*-mig-3g-20gb-*") and not matches("", "?*")
    a = Expectation("p", "c", {"REQUEST": "a", "UUID": "MIG-*"})
    d = Expectation("p", "c", {"REQUEST": "d"})
    dev_a, dev_d = {"REQUEST": "a", "UUID": "MIG-1"}, {"REQUEST": "d", "UUID": "MIG-2"}
    assert check_devices([a, d], [dev_d, dev_a]) == []  # in any order
    assert check_devices([a], [dev_a, dev_d]) == [f"p/c: 2 devices, expected 1: {[dev_a, dev_d]}"]
    assert check_devices([d], [dev_a]) == ["p/c: REQUEST='a' (expected d)"]
    assert check_devices([a, a], [dev_a, dev_d])[0].startswith("p/c: no device for each")
    env = Expectation("legacy", "main", {"NVIDIA_VISIBLE_DEVICES": "GPU-*"}, env=True)
    assert check_env([env], {"NVIDIA_VISIBLE_DEVICES": "GPU-1"}) == []
    assert check_env([env], {}) == ["legacy/main: NVIDIA_VISIBLE_DEVICES=None (expected GPU-*)"]


def test_name_clashes_between_examples_are_found() -> None:
    one = Example(Path("a.yaml"), [_pod("p")], [])
    two = Example(Path("b.yaml"), [_pod("p")], [])
    assert name_clashes([one, two]) == ["Pod p in a.yaml and b.yaml"]


class FakeCluster:
    """What the scenario calls on a Cluster, recorded; each container "sees" what its expect
    lines promise (a glob's ``*`` and ``?`` filled in, the first ``|`` alternative)."""

    image = "registry.local/gpuslice/python-base:0.1.0-e2e"

    def __init__(self, device_plugin_nodes: list[str]) -> None:
        self.device_plugin_nodes = device_plugin_nodes
        self.calls: list[tuple[str, ...]] = []
        self.created: list[dict[str, Any]] = []
        self.promised = {
            (e.pod, e.container, e.env): e for p in WORKLOADS for e in load(p).expectations
        }

    @contextlib.contextmanager
    def namespace(self, prefix: str) -> Iterator[str]:
        self.calls.append(("namespace", prefix))
        yield "examples-1"
        self.calls.append(("deleted",))

    def create(self, namespace: str, resource: str, obj: Any, group_version: str = "v1") -> Any:
        assert namespace == "examples-1"
        self.calls.append(("create", obj["kind"], obj["metadata"]["name"]))
        self.created.append(obj)
        return obj

    def running(self, namespace: str, name: str, timeout: float = 0) -> Any:
        self.calls.append(("running", name))
        return {}

    @staticmethod
    def _fill(fields: Any) -> dict[str, str]:
        return {k: v.split("|")[0].replace("*", "x").replace("?", "y") for k, v in fields.items()}

    def env(self, namespace: str, name: str, container: str = "main") -> dict[str, str]:
        return self._fill(self.promised[(name, container, True)].fields)

    def devices(self, namespace: str, name: str, container: str = "main") -> list[dict[str, str]]:
        return [
            self._fill(e.fields)
            for p in WORKLOADS
            for e in load(p).expectations
            if (e.pod, e.container, e.env) == (name, container, False)
        ]


def test_the_scenario_creates_everything_first_then_waits_then_checks() -> None:
    fake = FakeCluster(["gpu-real-dp"])
    examples_run_as_documented(cast(Cluster, fake))
    kinds = [c[0] for c in fake.calls]
    assert kinds[0] == "namespace" and kinds[-1] == "deleted", kinds
    last_create = max(i for i, k in enumerate(kinds) if k == "create")
    first_wait = kinds.index("running")
    assert last_create < first_wait, kinds  # the pods start in parallel
    pods = {o["metadata"]["name"] for o in fake.created if o["kind"] == "Pod"}
    assert {c[1] for c in fake.calls if c[0] == "running"} == pods
    assert len(fake.created) == sum(len(load(p).objects) for p in WORKLOADS)
    for obj in fake.created:
        for container in obj.get("spec", {}).get("containers", []) if obj["kind"] == "Pod" else []:
            assert container["image"] == fake.image, container


class BrokenPromise(FakeCluster):
    """Every device has 99 cores, which no example promises."""

    def devices(self, namespace: str, name: str, container: str = "main") -> list[dict[str, str]]:
        return [{**d, "CORES": "99"} for d in super().devices(namespace, name, container)]


def test_the_scenario_fails_on_a_broken_promise_or_without_a_device_plugin_node() -> None:
    fake = BrokenPromise(["gpu-real-dp"])
    with pytest.raises(AssertionError, match=r"whole-gpu.yaml: whole-gpu/main: CORES='99'"):
        examples_run_as_documented(cast(Cluster, fake))
    with pytest.raises(AssertionError, match="no device-plugin-mode node"):
        examples_run_as_documented(cast(Cluster, FakeCluster([])))
