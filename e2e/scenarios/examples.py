"""The specs of examples/ applied as a user applies them, and checked against what each file's
header promises (the scenario ``examples_run_as_documented`` in ``e2e.scenarios.user.SCENARIOS``).

Each workload example (``examples/*.yaml`` except ``values-*.yaml``, which are chart values) has
a comment header that ends with what its containers see, one line per device:

    # expect <pod>/<container>: FIELD=pattern FIELD=pattern ...
    # expect-env <pod>/<container>: VARIABLE=pattern ...

``expect`` is one gpuslice device the container got, its fields as ``GPUSLICE_<device>_<FIELD>``
states them (UUID, DEVICE, CORES, MEMORY, ENFORCEMENT, SHARE_ID, ...; ``Cluster.devices``); a
container gets exactly as many devices as it has ``expect`` lines. ``expect-env`` is plain
environment (``NVIDIA_VISIBLE_DEVICES`` of the device plugin). A pattern is a shell glob
(``GPU-*``, ``?*`` = not empty) or several separated by ``|`` (``hard|soft``). Every container of
every pod has at least one line, so no example goes unchecked.

Everything but the scenario itself is pure and unit-tested (e2e/tests/chart/test_examples.py,
which also has the API server accept every object with a server-side dry run).
"""

from __future__ import annotations

import copy
import fnmatch
import itertools
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from e2e.sandbox.binaries import REPO_ROOT
from e2e.scenarios.cluster import POD_TIMEOUT, RESOURCE, Cluster
from gpuslice_kube.raw import Obj

EXAMPLES = REPO_ROOT / "examples"
MODE_LABEL = "gpuslice.dev/mode"
# every pod of every example starts at once: the last one may wait for image unpacks and CDI
# hooks of all the others on a loaded 2-core node
RUNNING_TIMEOUT = 2 * POD_TIMEOUT
# kind → (group/version, plural) of every kind an example may hold
RESOURCES: dict[str, tuple[str, str]] = {
    "Pod": ("v1", "pods"),
    "ResourceClaim": (RESOURCE, "resourceclaims"),
    "ResourceClaimTemplate": (RESOURCE, "resourceclaimtemplates"),
}
_EXPECT = re.compile(r"^#\s*(expect|expect-env)\s+([^/\s]+)/([^:\s]+):\s*(.*)$")


class ExampleError(ValueError):
    """An example file that this module cannot apply or check; the message names the file."""


@dataclass(frozen=True)
class Expectation:
    """One line of an example's header: a device (``env`` False) or environment (``env``
    True) that container ``container`` of pod ``pod`` sees."""

    pod: str
    container: str
    fields: Mapping[str, str]
    env: bool = False


@dataclass(frozen=True)
class Example:
    path: Path
    objects: list[Obj]
    expectations: list[Expectation]

    @property
    def pods(self) -> list[Obj]:
        return [o for o in self.objects if o.get("kind") == "Pod"]

    @property
    def needs_device_plugin_node(self) -> bool:
        """A pod of it selects the nodes in device-plugin mode."""
        return any(
            (p["spec"].get("nodeSelector") or {}).get(MODE_LABEL) == "device-plugin"
            for p in self.pods
        )


def workload_files(directory: Path = EXAMPLES) -> list[Path]:
    """The examples a user applies with kubectl (not the chart values files)."""
    return sorted(p for p in directory.glob("*.yaml") if not p.name.startswith("values-"))


def values_files(directory: Path = EXAMPLES) -> list[Path]:
    """The chart values files (``helm install -f``)."""
    return sorted(directory.glob("values-*.yaml"))


def parse_expectations(text: str, source: str = "<example>") -> list[Expectation]:
    """The ``expect``/``expect-env`` lines of an example's text."""
    found: list[Expectation] = []
    for number, line in enumerate(text.splitlines(), 1):
        match = _EXPECT.match(line.strip())
        if match is None:
            if re.match(r"^#\s*expect", line.strip()):
                raise ExampleError(
                    f"{source}:{number}: {line.strip()!r} is not "
                    "'# expect[-env] <pod>/<container>: FIELD=pattern ...'"
                )
            continue
        verb, pod, container, rest = match.groups()
        fields: dict[str, str] = {}
        for word in rest.split():
            key, sep, pattern = word.partition("=")
            if not sep or not key or not pattern:
                raise ExampleError(f"{source}:{number}: {word!r} is not FIELD=pattern")
            fields[key] = pattern
        if not fields:
            raise ExampleError(f"{source}:{number}: no FIELD=pattern after {pod}/{container}:")
        found.append(Expectation(pod, container, fields, env=verb == "expect-env"))
    return found


def load(path: Path) -> Example:
    """An example file: its objects (in file order) and its expectations, checked against each
    other: every container of every pod is expected something, every line names a container."""
    text = path.read_text()
    objects = [doc for doc in yaml.safe_load_all(text) if doc]
    for obj in objects:
        if obj.get("kind") not in RESOURCES:
            raise ExampleError(
                f"{path.name}: a {obj.get('kind')!r}; examples hold {', '.join(RESOURCES)}"
            )
    example = Example(path, objects, parse_expectations(text, path.name))
    containers = {
        (p["metadata"]["name"], c["name"])
        for p in example.pods
        for c in p["spec"].get("initContainers", []) + p["spec"]["containers"]
    }
    expected = {(e.pod, e.container) for e in example.expectations}
    if unknown := sorted(expected - containers):
        raise ExampleError(f"{path.name}: expect lines name no such pod/container: {unknown}")
    if unchecked := sorted(containers - expected):
        raise ExampleError(f"{path.name}: no expect line for pod/container {unchecked}")
    return example


def name_clashes(examples: Iterable[Example]) -> list[str]:
    """Objects of one kind and name in more than one example (they share a namespace)."""
    seen: dict[tuple[str, str], str] = {}
    clashes: list[str] = []
    for example in examples:
        for obj in example.objects:
            key = (obj["kind"], obj["metadata"]["name"])
            if key in seen:
                clashes.append(f"{key[0]} {key[1]} in {seen[key]} and {example.path.name}")
            seen[key] = example.path.name
    return clashes


def resource_of(obj: Obj) -> tuple[str, str]:
    """The (group/version, plural) to create ``obj`` under."""
    try:
        return RESOURCES[obj["kind"]]
    except KeyError:
        raise ExampleError(f"no resource known for kind {obj.get('kind')!r}") from None


def with_image(obj: Obj, image: str) -> Obj:
    """A copy of ``obj`` whose every container runs ``image`` (pulled only if not present)."""
    out = copy.deepcopy(obj)
    if out.get("kind") == "Pod":
        spec = out["spec"]
        for key in ("initContainers", "containers", "ephemeralContainers"):
            for container in spec.get(key) or []:
                container["image"] = image
                container["imagePullPolicy"] = "IfNotPresent"
    return out


def matches(value: str | None, pattern: str) -> bool:
    """``value`` matches one of the ``|``-separated globs of ``pattern`` (None matches none)."""
    return value is not None and any(fnmatch.fnmatchcase(value, p) for p in pattern.split("|"))


def _mismatch(got: Mapping[str, str], fields: Mapping[str, str]) -> list[str]:
    return [
        f"{key}={got.get(key)!r} (expected {pattern})"
        for key, pattern in fields.items()
        if not matches(got.get(key), pattern)
    ]


def check_devices(expectations: list[Expectation], devices: list[dict[str, str]]) -> list[str]:
    """What is wrong with the devices one container got: the problems, none when each
    expectation matches a device of its own and no device is left over."""
    where = f"{expectations[0].pod}/{expectations[0].container}" if expectations else "?"
    if len(devices) != len(expectations):
        return [f"{where}: {len(devices)} devices, expected {len(expectations)}: {devices}"]
    for order in itertools.permutations(devices):
        if all(not _mismatch(d, e.fields) for d, e in zip(order, expectations, strict=True)):
            return []
    if len(expectations) == 1:
        return [f"{where}: " + ", ".join(_mismatch(devices[0], expectations[0].fields))]
    return [f"{where}: no device for each expect line: got {devices}"]


def check_env(expectations: Iterable[Expectation], env: Mapping[str, str]) -> list[str]:
    """What is wrong with one container's environment against its ``expect-env`` lines."""
    return [
        f"{e.pod}/{e.container}: {problem}"
        for e in expectations
        for problem in _mismatch(env, e.fields)
    ]


def examples_run_as_documented(cluster: Cluster) -> None:
    """Every workload example of examples/ applied as its header says, in one namespace, with
    the cluster's workload image: every pod runs and each container sees the GPU devices
    (``GPUSLICE_*``) or environment its ``expect`` lines promise. All objects are created
    first, then the pods are waited for, so they start in parallel."""
    examples = [load(path) for path in workload_files()]
    if clashes := name_clashes(examples):
        raise ExampleError(f"examples share one namespace, and these names clash: {clashes}")
    if any(e.needs_device_plugin_node for e in examples):
        assert cluster.device_plugin_nodes, "the scenario cluster has no device-plugin-mode node"
    with cluster.namespace("examples") as ns:
        started = time.monotonic()
        for example in examples:
            for obj in example.objects:
                group_version, plural = resource_of(obj)
                cluster.create(ns, plural, with_image(obj, cluster.image), group_version)
        for example in examples:
            for obj in example.pods:
                cluster.running(ns, obj["metadata"]["name"], timeout=RUNNING_TIMEOUT)
        print(f"examples: every pod Running {time.monotonic() - started:.1f}s after the creates")
        problems: list[str] = []
        for example in examples:
            for (pod, container, env), lines in _by_container(example.expectations).items():
                if env:
                    found = check_env(lines, cluster.env(ns, pod, container))
                else:
                    found = check_devices(lines, cluster.devices(ns, pod, container))
                problems += [f"{example.path.name}: {p}" for p in found]
        assert not problems, "examples/ do not do what their headers say:\n" + "\n".join(problems)


def _by_container(
    expectations: Iterable[Expectation],
) -> dict[tuple[str, str, bool], list[Expectation]]:
    """Expect lines grouped by (pod, container, env or devices), in file order."""
    grouped: dict[tuple[str, str, bool], list[Expectation]] = {}
    for e in expectations:
        grouped.setdefault((e.pod, e.container, e.env), []).append(e)
    return grouped
