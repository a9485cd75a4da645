"""The chart's device-plugin parts beyond test_chart.py: named configs picked by a node label,
the enforcer sidecar for sharing.mps, and the device plugin's own RBAC (exactly its calls)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import pytest

from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.nodeagent.testing import unique
from e2e.support.chart import (
    CHART,
    NOT_FLAGS,
    allowed,
    containers,
    env_of,
    every_name,
    flag_variables,
    helm,
    pod_spec,
    render,
    set_json,
    sets,
)
from gpuslice_core.cli import EnvArgumentParser
from gpuslice_device_plugin.cli import build_parser as device_plugin_parser
from gpuslice_device_plugin.config import select_config
from gpuslice_enforcer.cli import build_parser as enforcer_parser
from gpuslice_kube.raw import RawApi

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)

CONFIGS = {
    "plain": "version: v1\n",
    "mps4": "version: v1\nsharing: {mps: {resources: [{name: gpu, replicas: 4}]}}\n",
}


def parse(
    parser: Callable[[], EnvArgumentParser], env: dict[str, object], mp: pytest.MonkeyPatch
) -> argparse.Namespace:
    """The service's flags as the container's environment sets them (the parser reads the
    variables when it is built)."""
    known = flag_variables(parser())
    assert env.keys() - known <= NOT_FLAGS, "not flags of the service"
    with mp.context() as m:
        for var in every_name(parser()) | NOT_FLAGS:
            m.delenv(var, raising=False)
        for var, value in env.items():
            if isinstance(value, str):
                m.setenv(var, value)
        return parser().parse_args([])


def test_named_configs_and_the_enforcer_sidecar(
    helm_bin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objs = render(
        helm_bin,
        *sets("devicePlugin.enforcer.enabled=true", "devicePlugin.defaultConfig=plain"),
        *set_json("devicePlugin.configs", CONFIGS),
    )
    [config_map] = [
        o
        for o in objs
        if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "gpuslice-device-plugin-configs"
    ]
    assert config_map["data"] == CONFIGS
    for name, text in config_map["data"].items():  # what the plugin reads from the volume
        (tmp_path / name).write_text(text)
    picked = select_config(
        tmp_path, label="nvidia.com/device-plugin.config", label_value="mps4", default="plain"
    )
    assert picked.config.sharing.mps.resources[0].replicas == 4

    spec = pod_spec(objs, "device-plugin")
    assert spec["hostPID"] is True
    byname = containers(objs, "device-plugin")
    assert [c["name"] for c in spec["initContainers"]] == ["node-setup", "enforcer"]
    # the static hook is copied to the host from the enforcer's image
    assert byname["node-setup"]["image"] == byname["enforcer"]["image"]
    assert env_of(byname["node-setup"])["GPUSLICE_HOOK_INSTALL_DIR"] == "/host-hook"
    assert byname["enforcer"]["restartPolicy"] == "Always"
    plugin = parse(device_plugin_parser, env_of(byname["device-plugin"]), monkeypatch)
    enforcer = parse(enforcer_parser, env_of(byname["enforcer"]), monkeypatch)
    assert plugin.config_dir == "/etc/gpuslice/device-plugin-configs"
    assert plugin.default_config == "plain"
    assert plugin.mode_check is True
    assert plugin.enforcer_socket == enforcer.socket
    mounts = {m["name"]: m["mountPath"] for m in byname["device-plugin"]["volumeMounts"]}
    assert mounts["configs"] == "/etc/gpuslice/device-plugin-configs"
    assert mounts["cdi"] == plugin.cdi_root == "/var/run/cdi"

    both = helm(
        helm_bin,
        "template",
        "x",
        str(CHART),
        *("-n", "gpuslice"),
        *set_json("devicePlugin.configs", CONFIGS),
        *sets("devicePlugin.config=version: v1"),
        check=False,
    )
    assert both.returncode != 0 and "set one of them" in both.stderr


def test_the_device_plugin_may_make_exactly_its_calls(
    helm_bin: Path, sandbox: ControlPlane, kube: RawApi, namespace: str
) -> None:
    release = unique("dpchart")
    helm(
        helm_bin,
        "install",
        release,
        str(CHART),
        "-n",
        namespace,
        f"--kubeconfig={sandbox.kubeconfig}",
        # no controller: its webhooks would be called for other suites' GPU claims and pods here
        *sets("deviceClasses.enabled=false", "controller.enabled=false"),
    )
    try:
        user = f"system:serviceaccount:{namespace}:{release}-gpuslice-device-plugin"
        grant = [
            {"group": "", "resource": "nodes", "verb": "get"},
            {"group": "", "resource": "nodes", "verb": "patch"},
            {"group": "", "resource": "nodes", "verb": "watch"},  # the config label: live reload
            {"group": "resource.k8s.io", "resource": "resourceslices", "verb": "list"},
            {"group": "", "resource": "events", "verb": "create", "namespace": "default"},
            {"group": "", "resource": "pods", "verb": "list"},  # per-container metrics
        ]
        deny = [
            {"group": "", "resource": "nodes", "verb": "update"},
            {"group": "", "resource": "nodes", "verb": "delete"},
            {"group": "resource.k8s.io", "resource": "resourceslices", "verb": "create"},
            {"group": "", "resource": "events", "verb": "create", "namespace": namespace},
            {"group": "", "resource": "configmaps", "verb": "get", "namespace": namespace},
            {"group": "", "resource": "pods", "verb": "get"},
            {"group": "", "resource": "pods", "verb": "watch"},
            {"group": "", "resource": "pods", "verb": "delete"},
        ]
        assert [a for a in grant if not allowed(kube, user, a)] == []
        assert [a for a in deny if allowed(kube, user, a)] == []
    finally:
        helm(helm_bin, "uninstall", release, "-n", namespace, f"--kubeconfig={sandbox.kubeconfig}")
