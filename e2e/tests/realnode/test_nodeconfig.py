"""The real node's configuration files, without starting a node: what containerd is told about
registries (the chart's images are pulled from the tier's loopback registry through them)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from e2e.sandbox.nodeconfig import NodeConfig


def _config(tmp_path: Path, registries: dict[str, str]) -> NodeConfig:
    return NodeConfig(
        name="n",
        kubelet_port=10250,
        cgroup_root="/gpuslice-rn0/pods",
        bridge="gsrn0",
        subnet="10.244.0.0/24",
        pause_ref="localhost/pause:1",
        runc=tmp_path / "runc",
        cni_conf_dir=tmp_path / "net.d",
        pki_dir=tmp_path / "pki",
        volume_plugin_dir=tmp_path / "vp",
        feature_gates={},
        registries=registries,
        registry_config_dir=tmp_path / "certs.d",
    )


def test_a_registry_gets_a_hosts_toml_and_containerd_reads_the_directory(tmp_path: Path) -> None:
    config = _config(tmp_path, {"127.0.0.1:5000": "http://127.0.0.1:5000"})
    config.write(tmp_path / "config")
    toml = tomllib.loads((tmp_path / "config" / "containerd.toml").read_text())
    images = toml["plugins"]["io.containerd.cri.v1.images"]
    assert images["registry"] == {"config_path": str(tmp_path / "certs.d")}
    hosts = tomllib.loads((tmp_path / "certs.d" / "127.0.0.1:5000" / "hosts.toml").read_text())
    assert hosts == {
        "server": "http://127.0.0.1:5000",
        "host": {"http://127.0.0.1:5000": {"capabilities": ["pull", "resolve"]}},
    }


def test_no_registry_leaves_containerd_on_its_defaults(tmp_path: Path) -> None:
    config = _config(tmp_path, {})
    config.write(tmp_path / "config")
    toml = tomllib.loads((tmp_path / "config" / "containerd.toml").read_text())
    assert "registry" not in toml["plugins"]["io.containerd.cri.v1.images"]
    assert not (tmp_path / "certs.d").exists()


def test_an_endpoint_without_a_scheme_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"'127.0.0.1:5000'.*http\(s\)://"):
        _config(tmp_path, {"r:1": "127.0.0.1:5000"}).hosts_tomls()
