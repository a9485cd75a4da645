from __future__ import annotations

from dataclasses import FrozenInstanceError, fields

import pytest

from gpuslice_device_plugin.cli import build_parser, parse
from gpuslice_device_plugin.config import CommandLine, ConfigError, parse_config
from gpuslice_testkit.device_plugin import settings

NVIDIA_EXAMPLE = """
version: v1
flags:
  migStrategy: mixed
  failOnInitError: true
  plugin:
    passDeviceSpecs: false
    deviceListStrategy: envvar
    deviceIDStrategy: uuid
sharing:
  timeSlicing:
    renameByDefault: true
    failRequestsGreaterThanOne: true
    resources:
    - name: nvidia.com/gpu
      replicas: 10
"""


def test_nvidia_example_is_read() -> None:
    s = settings(NVIDIA_EXAMPLE)
    assert s.mig_strategy == "mixed"
    assert s.device_list_strategies == ("envvar",)
    ts = s.time_slicing
    assert ts.renameByDefault and ts.failRequestsGreaterThanOne
    assert [(r.name, r.replicas) for r in ts.resources] == [("nvidia.com/gpu", 10)]


def test_defaults_without_a_file() -> None:
    s = settings()
    assert (s.mig_strategy, s.device_id_strategy, s.fail_on_init_error) == ("none", "uuid", True)
    assert s.device_list_strategies == ("envvar",)
    assert not s.pass_device_specs


def test_flags_win_over_the_file() -> None:
    s = settings(NVIDIA_EXAMPLE, "--mig-strategy=single", "--device-list-strategy=cdi-cri,envvar")
    assert s.mig_strategy == "single"
    assert s.device_list_strategies == ("cdi-cri", "envvar")


def test_list_strategy_may_be_a_list_and_names_without_domain_get_nvidia() -> None:
    s = settings(
        "flags: {plugin: {deviceListStrategy: [cdi-annotations, cdi-cri]}}\n"
        "sharing: {timeSlicing: {resources: [{name: gpu, replicas: 2}]}}"
    )
    assert s.device_list_strategies == ("cdi-annotations", "cdi-cri")
    assert s.cdi_only
    assert s.time_slicing.resources[0].name == "nvidia.com/gpu"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("flags: {migStrategy: none, bogus: 1}", "flags.bogus: unknown key; allowed keys here"),
        ("flags: {mpsRoot: /run/nvidia/mps}", "flags.mpsRoot: the enforcer sidecar owns"),
        (
            "sharing: {mps: {failRequestsGreaterThanOne: false}}",
            "sharing.mps.failRequestsGreaterThanOne: must be true for MPS",
        ),
        (
            "sharing: {mps: {resources: [{name: gpu, replicas: 49}]}}",
            "sharing.mps.resources: nvidia.com/gpu: replicas 49 is more than the 48 clients",
        ),
        (
            "sharing: {mps: {resources: [{name: gpu, replicas: 2, rename: x}]}}",
            "sharing.mps.resources[0].rename: per-resource rename is not supported",
        ),
        (
            "sharing:\n  mps: {resources: [{name: gpu, replicas: 2}]}\n"
            "  timeSlicing: {resources: [{name: gpu, replicas: 2}]}",
            "sharing: resource 'nvidia.com/gpu' is listed under both timeSlicing and mps",
        ),
        ("flags: {nvidiaDriverRoot: /}", "flags.nvidiaDriverRoot: use --driver-root"),
        (
            "sharing: {timeSlicing: {resources: [{name: x, replicas: 2, devices: all}]}}",
            "sharing.timeSlicing.resources[0].devices: device selection is not supported",
        ),
        ("version: v2", "version:"),
        ("flags: {migStrategy: some}", "flags.migStrategy:"),
        (
            "sharing: {timeSlicing: {resources: [{name: gpu, replicas: 1}]}}",
            "sharing.timeSlicing.resources[0].replicas: ",
        ),
        ("flags: {plugin: {deviceListStrategy: volumes}}", "flags.plugin.deviceListStrategy"),
        ("flags: {migStrategy: none}\nflags: {}", "duplicate key 'flags'"),
    ],
)
def test_bad_files_are_refused_naming_the_key(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(text, source="cfg.yaml")
    assert message in str(err.value)
    assert str(err.value).startswith("cfg.yaml: ")


def test_bad_list_strategy_flag() -> None:
    with pytest.raises(ConfigError, match="'volumes' is not one of"):
        settings("", "--device-list-strategy=volumes")


def test_every_flag_reaches_the_frozen_command_line() -> None:
    """cli.command_line copies each parsed flag; a flag added to the parser but not to
    CommandLine (or the other way round) fails here, not at a reload in production."""
    parsed = set(vars(build_parser().parse_args([]))) - {"probe"}
    assert {f.name for f in fields(CommandLine)} == parsed
    args, probing = parse(["--mig-strategy=single", "--probe"])
    assert (args.mig_strategy, probing) == ("single", True)
    with pytest.raises(FrozenInstanceError):
        args.mig_strategy = "mixed"  # type: ignore[misc]
