"""Each service's own defaults are the chart's: a service started by hand with no flags behaves as
the default install (docs/configuration.md, "Defaults equal the chart's").

The chart is rendered with its default values; every variable a container sets to a literal value
is parsed by that container's service, and the result must equal what the service parses with
the variable unset. The exceptions below are values the chart derives from the pod or the release
(per-pod socket names, the release's names, a mount inside the pod) or steps the chart asks for
that a service run alone must not take; each says why.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import pytest

from e2e.support.chart import Obj, containers, env_of, every_name, one, render
from gpuslice_controller.cli import build_parser as controller_parser
from gpuslice_core.cli import EnvArgumentParser
from gpuslice_core.nodesetup.cli import build_parser as node_setup_parser
from gpuslice_device_plugin.cli import build_parser as device_plugin_parser
from gpuslice_enforcer.cli import build_parser as enforcer_parser
from gpuslice_kubelet_plugin.cli import build_parser as kubelet_plugin_parser
from gpuslice_mig_manager.cli import build_parser as mig_manager_parser

Parser = Callable[[], EnvArgumentParser]

PER_POD_SOCKET = "per-pod socket name ($(GPUSLICE_POD_UID)): two pods overlap in a rolling update"
NODE_SETUP_STEP = "node-setup runs a step only when its flag is given; the chart asks for it"
DRIVER_ROOT_MOUNT = (
    "the chart mounts the host's driver root (nvml.driverRoot) at /driver-root in every NVML"
    " container (gpuslice.nvmlEnv); a service on the host reads / itself"
)

#: (workload, container) -> {variable: why the chart's value is not the service's default}
EXCEPTIONS: dict[tuple[str, str], dict[str, str]] = {
    ("node", "node-setup"): {
        "GPUSLICE_SOCKET_DIR": NODE_SETUP_STEP,
        "GPUSLICE_HOOK_INSTALL_DIR": NODE_SETUP_STEP,
        "GPUSLICE_HOOK_HOST_DIR": NODE_SETUP_STEP,
    },
    ("node", "enforcer"): {
        "GPUSLICE_SOCKET": PER_POD_SOCKET,
        "GPUSLICE_HOOK_SOCKET": (
            "the stable link enforcer.sock that the CDI hook calls exists only because the chart's"
            " socket is per pod; a lone enforcer's hooks call its own --socket (the default)"
        ),
        "GPUSLICE_DRIVER_ROOT": DRIVER_ROOT_MOUNT,
    },
    ("node", "mig-manager"): {
        "GPUSLICE_SOCKET": PER_POD_SOCKET,
        "GPUSLICE_CONFIG_MAP": (
            "the release's own ConfigMap (<namespace>/<release>-mig-parted-config); a lone MIG"
            " manager has no ConfigMap unless told"
        ),
        "GPUSLICE_DRIVER_ROOT": DRIVER_ROOT_MOUNT,
    },
    ("node", "kubelet-plugin"): {
        "GPUSLICE_ENFORCER_SOCKET": (
            "the chart runs the enforcer sidecar; a lone plugin has none (shares are accounted"
            " only) and its socket is per pod"
        ),
        "GPUSLICE_MIG_MANAGER_SOCKET": "as the enforcer socket: a sidecar of the chart's pod",
        "GPUSLICE_DRIVER_ROOT": DRIVER_ROOT_MOUNT,
        "GPUSLICE_DRIVER_ROOT_HOST": (
            "the host path of that mount; the default, unset, means 'the same as --driver-root',"
            " which is / on the host, so it is the chart's / in effect"
        ),
    },
    ("device-plugin", "device-plugin"): {"GPUSLICE_DRIVER_ROOT": DRIVER_ROOT_MOUNT},
    ("controller", "controller"): {
        "GPUSLICE_CERT_HOSTS": "the release's Service DNS names (<release>-controller.<ns>.svc)",
        "GPUSLICE_ENFORCER_SELECTOR": (
            "the labels of this release's node pods (app.kubernetes.io/instance=<release>); the"
            " default selects the node pods of any gpuslice install"
        ),
        "GPUSLICE_AGGREGATED_API": (
            "the chart registers the APIService and grants the front-proxy reads it needs; a"
            " controller started by hand has neither, so it serves no aggregated API unless asked"
        ),
        "GPUSLICE_APISERVICES": "the chart's APIService, whose caBundle the leader keeps",
    },
}

#: Every (workload, container) of the default install that runs a gpuslice command (the device
#: plugin's pod gets node-setup and the enforcer only with sharing.mps, which is not the default).
WORKLOADS = [
    ("node", "node-setup"),
    ("node", "enforcer"),
    ("node", "mig-manager"),
    ("node", "kubelet-plugin"),
    ("device-plugin", "device-plugin"),
    ("controller", "controller"),
]

#: container name -> its service's parser
PARSERS: dict[str, Parser] = {
    "node-setup": node_setup_parser,
    "enforcer": enforcer_parser,
    "mig-manager": mig_manager_parser,
    "kubelet-plugin": kubelet_plugin_parser,
    "device-plugin": device_plugin_parser,
    "controller": controller_parser,
}


def _parse(parser: Parser, env: dict[str, str], argv: list[str], mp: pytest.MonkeyPatch) -> Obj:
    """The service's parsed flags with exactly ``env`` set (the parser reads it when built)."""
    with mp.context() as m:
        for var in every_name(parser()):
            m.delenv(var, raising=False)
        for var, value in env.items():
            m.setenv(var, value)
        args: argparse.Namespace = parser().parse_args(argv)
    return vars(args)


def _workloads(objs: list[Obj]) -> dict[tuple[str, str], Obj]:
    found: dict[tuple[str, str], Obj] = {}
    for component in ("node", "device-plugin"):
        for name, container in containers(objs, component).items():
            if name in PARSERS:
                found[(component, name)] = container
    controller = one(objs, "Deployment", "gpuslice-controller")
    for container in controller["spec"]["template"]["spec"]["containers"]:
        found[("controller", container["name"])] = container
    return found


@pytest.fixture(scope="module")
def default_render(helm_bin: Path) -> list[Obj]:
    return render(helm_bin)


def test_every_container_the_chart_runs_is_compared(default_render: list[Obj]) -> None:
    """A new container (or a renamed one) must join the comparison."""
    assert set(_workloads(default_render)) == set(WORKLOADS)
    assert EXCEPTIONS.keys() <= set(WORKLOADS)


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda w: "/".join(w))
def test_the_charts_default_values_are_the_services_defaults(
    default_render: list[Obj], workload: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    container = _workloads(default_render)[workload]
    parser = PARSERS[workload[1]]
    variables = parser().variables
    argv = list(container.get("args", []))
    assert argv == [], f"{workload}: the default install passes arguments {argv}"
    defaults = _parse(parser, {}, [], monkeypatch)
    exceptions = EXCEPTIONS.get(workload, {})
    differing: dict[str, tuple[str, object, object]] = {}
    compared = set()
    for var, value in env_of(container).items():
        if var not in variables or not isinstance(value, str):
            continue  # NVIDIA's runtime variables; the downward API (node name, pod UID)
        dest = variables[var].dest
        chart = _parse(parser, {var: value}, [], monkeypatch)[dest]
        compared.add(var)
        if chart != defaults[dest]:
            differing[var] = (value, chart, defaults[dest])
    assert set(differing) == set(exceptions), (
        f"{workload}: the chart's value differs from the service's default for"
        f" {sorted(differing.keys() - exceptions.keys())} (make the service's default the"
        " chart's, or list the exception with its reason); exceptions that no longer differ:"
        f" {sorted(exceptions.keys() - differing.keys())}; differences: {differing}"
    )
    assert compared, f"{workload}: nothing compared"


def test_the_kubelet_plugins_state_dir_is_the_charts(
    default_render: list[Obj], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one default that used to differ (the plugin kept its checkpoint under the kubelet's
    plugins directory): a plugin run by hand and the chart's now share one checkpoint path."""
    env = env_of(_workloads(default_render)[("node", "kubelet-plugin")])
    assert env["GPUSLICE_STATE_DIR"] == "/var/lib/gpuslice/kubelet-plugin"
    parsed = _parse(kubelet_plugin_parser, {}, [], monkeypatch)
    assert parsed["state_dir"] == Path("/var/lib/gpuslice/kubelet-plugin")
