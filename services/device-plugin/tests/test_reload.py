"""Live reload: what counts as a change, the main loop's queue, the servers switching to a new
config against a stand-in kubelet, and a bad config refused while the old one keeps serving."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuslice_device_plugin.allocate import Topology
from gpuslice_device_plugin.cli import parse as parse_command_line
from gpuslice_device_plugin.config import CommandLine
from gpuslice_device_plugin.devices import discover
from gpuslice_device_plugin.health import HealthTracker
from gpuslice_device_plugin.metrics import Metrics
from gpuslice_device_plugin.reload import Control, Watchers, fingerprint, load_settings
from gpuslice_device_plugin.run import Plugin
from gpuslice_device_plugin.server import PluginManager
from gpuslice_nvml import Nvml
from gpuslice_testkit.device_plugin import Kubelet

pytestmark = pytest.mark.timeout(30)
Factory = Callable[[dict[str, Any]], Nvml]
LABEL = "nvidia.com/device-plugin.config"


def ts(replicas: int) -> str:
    entry = f"{{name: gpu, replicas: {replicas}}}"
    return f"version: v1\nsharing: {{timeSlicing: {{resources: [{entry}]}}}}\n"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="gdpr-"))  # unix socket paths are short
    yield d
    shutil.rmtree(d, ignore_errors=True)


def parse(*argv: str) -> CommandLine:
    args, _ = parse_command_line(["--mode-check=false", "--metrics-addr=", *argv])
    return args


def test_fingerprint_follows_content_and_label(tmp_path: Path) -> None:
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "a").write_text(ts(2))
    (configs / "..data").mkdir()  # a ConfigMap volume's own entries do not count
    args = parse(f"--config-dir={configs}", "--node-name=n")
    first = fingerprint(args, "a")
    (configs / "a").write_text(ts(2))  # touched, same content
    assert fingerprint(args, "a") == first
    assert fingerprint(args, "b") != first
    (configs / "a").write_text(ts(4))
    assert fingerprint(args, "a") != first
    single = parse(f"--config-file={tmp_path / 'missing.yaml'}")
    gone = fingerprint(single, None)
    (tmp_path / "missing.yaml").write_text(ts(2))
    assert fingerprint(single, None) != gone


def test_control_coalesces_reloads_and_hup_is_a_reload() -> None:
    control = Control()
    control.reload("a")
    control.reload("b")
    assert control.next() == (None, ["a", "b"])
    control.reload("c")
    control.stop(15)
    assert control.next() == (15, ["c"])
    saved = {s: signal.getsignal(s) for s in (signal.SIGHUP, signal.SIGTERM)}
    try:
        control.install_signals()
        os.kill(os.getpid(), signal.SIGHUP)
        assert control.next(poll=0.05) == (None, ["SIGHUP"])
        os.kill(os.getpid(), signal.SIGTERM)
        assert control.wait_for_stop() == signal.SIGTERM
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def test_node_label_change_asks_for_a_reload(tmp_path: Path) -> None:
    control = Control()
    args = parse(f"--config-dir={tmp_path}", "--node-name=n")
    watchers = Watchers(args, control, None, {LABEL: "two"}, poll_interval=0)
    labels = {LABEL: "two", "other": "x"}
    watchers._on_node("ADDED", {"metadata": {"name": "n", "labels": labels}})  # the same value
    watchers._on_node("MODIFIED", {"metadata": {"name": "n", "labels": {**labels, LABEL: "four"}}})
    assert control.next() == (None, [f"node label {LABEL}=four"])
    assert watchers.snapshot()[0][LABEL] == "four"


def start(nvml: Nvml, directory: Path, args: CommandLine, labels: dict[str, str] | None) -> Plugin:
    settings = load_settings(args, labels)
    resources = discover(nvml, settings)
    manager = PluginManager(
        directory,
        resources,
        settings,
        HealthTracker(nvml, quiet_period=1000),
        Topology.from_nvml(nvml, [g.index for g in nvml.gpus()]),
        Metrics(),
    )
    manager.start()
    watchers = Watchers(args, Control(), None, labels, poll_interval=0)
    return Plugin(args, nvml, None, settings, resources, {}, manager, None, watchers)


def serving(plugin: Plugin) -> tuple[str, int]:
    """The running config's name and its device count."""
    return plugin.settings.config_name, len(plugin.manager.resources[0].devices)


def test_reload_switches_resources_and_refuses_a_bad_config(
    fake_node: Factory, short_dir: Path, tmp_path: Path
) -> None:
    nvml = fake_node({"gpus": [{"model": "H100", "count": 2}]})
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "two").write_text(ts(2))
    (configs / "four").write_text(ts(4))
    (configs / "mig").write_text("version: v1\nflags: {migStrategy: mixed}\n")
    args = parse(f"--config-dir={configs}", "--node-name=n", f"--cdi-root={tmp_path / 'cdi'}")
    kubelet = Kubelet(short_dir).start()
    plugin = start(nvml, short_dir, args, {LABEL: "two"})
    try:
        first = kubelet.requests.get(timeout=5)
        assert first.resource_name == "nvidia.com/gpu"
        assert len(plugin.manager.resources[0].devices) == 4
        # nothing changed: no reload, no registration
        assert plugin.reload(["config file content changed"]) is False
        # the label names the 4-replica config: the resource is served again and re-registered
        plugin.watchers._on_node("MODIFIED", {"metadata": {"labels": {LABEL: "four"}}})
        assert plugin.reload(["label"]) is True
        again = kubelet.requests.get(timeout=5)
        assert again.resource_name == "nvidia.com/gpu"
        [resource] = plugin.manager.resources
        assert len(resource.devices) == 8 and resource.replicas == 4
        assert plugin.manager.endpoints[0].servicer.resource is resource
        assert plugin.settings.config_name == "four"
        # a typo in the selected config: refused, the running one keeps serving
        (configs / "four").write_text("version: v1\nflags: {migStratgy: mixed}\n")
        assert plugin.reload(["config file content changed"]) is False
        assert serving(plugin) == ("four", 8)
        assert plugin.manager.endpoints[0].server is not None
        assert plugin.manager.socket(resource).exists()
        # the same broken inputs are not tried again until they change
        assert plugin.reload(["config file content changed"]) is False
        # a label that names no config is refused too
        plugin.watchers._on_node("MODIFIED", {"metadata": {"labels": {LABEL: "nope"}}})
        assert plugin.reload(["label"]) is False
        assert serving(plugin) == ("four", 8)
        assert kubelet.requests.empty()
        # settings that keep the devices: applied in place, no new registration
        cdi_cri = "flags: {plugin: {deviceListStrategy: cdi-cri}}\n"
        (configs / "four").write_text(ts(4) + cdi_cri)
        plugin.watchers._on_node("MODIFIED", {"metadata": {"labels": {LABEL: "four"}}})
        assert plugin.reload(["label"]) is True
        assert plugin.manager.endpoints[0].servicer.settings.device_list_strategies == ("cdi-cri",)
        assert kubelet.requests.empty()
        # SIGHUP back to two replicas: served and registered again
        plugin.watchers._on_node("MODIFIED", {"metadata": {"labels": {LABEL: "two"}}})
        assert plugin.reload(["SIGHUP"]) is True
        assert kubelet.requests.get(timeout=5).resource_name == "nvidia.com/gpu"
        assert serving(plugin) == ("two", 4)
    finally:
        plugin.manager.stop()
        kubelet.stop()


def test_a_resource_that_goes_away_is_stopped(
    fake_node: Factory, short_dir: Path, tmp_path: Path
) -> None:
    nvml = fake_node({"gpus": [{"model": "H100", "count": 2}]})
    config = tmp_path / "config.yaml"
    config.write_text(
        "version: v1\nsharing: {timeSlicing: {renameByDefault: true,"
        " resources: [{name: gpu, replicas: 2}]}}\n"
    )
    args = parse(f"--config-file={config}", f"--cdi-root={tmp_path / 'cdi'}")
    kubelet = Kubelet(short_dir).start()
    plugin = start(nvml, short_dir, args, None)
    try:
        assert kubelet.requests.get(timeout=5).resource_name == "nvidia.com/gpu.shared"
        shared_socket = short_dir / "gpuslice-gpu.shared.sock"
        assert shared_socket.exists()
        config.write_text("version: v1\n")
        assert plugin.reload(["config file content changed"]) is True
        assert kubelet.requests.get(timeout=5).resource_name == "nvidia.com/gpu"
        assert not shared_socket.exists()
        assert [ep.resource.name for ep in plugin.manager.endpoints] == ["nvidia.com/gpu"]
    finally:
        plugin.manager.stop()
        kubelet.stop()
