"""Configuration files of a real sandbox node: containerd's config.toml (version 3), the CNI
bridge conflist and the KubeletConfiguration. Every path here is the one a real node uses
(/var/lib/kubelet, /run/containerd, /var/run/cdi, ...): the node's mount namespace puts the
node's own directories there (see realnode.py)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONTAINERD_SOCKET = "/run/containerd/containerd.sock"
CNI_BIN_DIR = "/usr/lib/cni"  # Debian's containernetworking-plugins
CDI_DIRS = ("/etc/cdi", "/var/run/cdi")
# containerd plugins a sandbox node does not use; "opt" would create /opt/containerd on the host
DISABLED_PLUGINS = (
    "io.containerd.internal.v1.opt",
    "io.containerd.tracing.processor.v1.otlp",
    "io.containerd.internal.v1.tracing",
    "io.containerd.snapshotter.v1.blockfile",
    "io.containerd.snapshotter.v1.erofs",
)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def _toml(tables: dict[str, dict[str, Any]], top: dict[str, Any]) -> str:
    lines = [f"{k} = {_toml_value(v)}" for k, v in top.items()]
    for name, table in tables.items():
        lines += ["", f"[{name}]"]
        lines += [f"  {k} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class NodeConfig:
    name: str
    kubelet_port: int
    cgroup_root: str
    bridge: str
    subnet: str
    pause_ref: str
    runc: Path
    cni_conf_dir: Path
    pki_dir: Path  # kubelet serving pair and the sandbox CA (client CA)
    volume_plugin_dir: Path
    feature_gates: dict[str, bool]
    service_ip: str = "10.0.0.1"  # the `kubernetes` Service's ClusterIP
    # registry host (as image references name it, e.g. "127.0.0.1:5000") -> the endpoint the
    # node pulls it from ("http://127.0.0.1:5000"), written as containerd hosts.toml files
    registries: Mapping[str, str] = field(default_factory=dict)
    registry_config_dir: Path | None = None  # where the hosts.toml files go (certs.d layout)

    def containerd_toml(self) -> str:
        runtime = "plugins.'io.containerd.cri.v1.runtime'"
        return _toml(
            {
                "grpc": {"address": CONTAINERD_SOCKET},
                "debug": {"level": "info"},
                runtime: {
                    # the VMs drop CAP_SYS_RESOURCE: runc may not lower oom_score_adj
                    "restrict_oom_score_adj": True,
                    "cdi_spec_dirs": list(CDI_DIRS),
                },
                f"{runtime}.containerd": {"default_runtime_name": "runc"},
                f"{runtime}.containerd.runtimes.runc": {"runtime_type": "io.containerd.runc.v2"},
                f"{runtime}.containerd.runtimes.runc.options": {
                    "BinaryName": str(self.runc),
                    "SystemdCgroup": False,
                },
                f"{runtime}.cni": {
                    "bin_dirs": [CNI_BIN_DIR],
                    "conf_dir": str(self.cni_conf_dir),
                    "max_conf_num": 1,
                },
                "plugins.'io.containerd.cri.v1.images'": {"snapshotter": "overlayfs"},
                "plugins.'io.containerd.cri.v1.images'.pinned_images": {"sandbox": self.pause_ref},
                **self._registry_table(),
                "plugins.'io.containerd.grpc.v1.cri'": {
                    "stream_server_address": "127.0.0.1",
                    "stream_server_port": "0",
                },
            },
            {
                "version": 3,
                "root": "/var/lib/containerd",
                "state": "/run/containerd",
                "disabled_plugins": list(DISABLED_PLUGINS),
            },
        )

    def _registry_table(self) -> dict[str, dict[str, Any]]:
        """containerd's registry host configuration directory, as a node with a private (or
        mirrored) registry sets it: one ``<host>/hosts.toml`` per registry (``hosts_tomls``)."""
        if not self.registries:
            return {}
        if self.registry_config_dir is None:
            raise ValueError("registries need a registry_config_dir for their hosts.toml files")
        table = "plugins.'io.containerd.cri.v1.images'.registry"
        return {table: {"config_path": str(self.registry_config_dir)}}

    def hosts_tomls(self) -> dict[str, str]:
        """``<host>/hosts.toml`` → its text: pull and resolve from the endpoint. A plain-HTTP
        endpoint (a loopback registry) is named with its scheme, which is all containerd needs
        to skip TLS for it; nothing else on the node trusts it."""
        files: dict[str, str] = {}
        for host, endpoint in sorted(self.registries.items()):
            if not endpoint.startswith(("http://", "https://")):
                raise ValueError(f"registry endpoint {endpoint!r} of {host!r}: need http(s)://")
            files[f"{host}/hosts.toml"] = (
                f"server = {json.dumps(endpoint)}\n\n"
                f"[host.{json.dumps(endpoint)}]\n"
                '  capabilities = ["pull", "resolve"]\n'
            )
        return files

    def cni_conflist(self) -> str:
        gateway = self.subnet.rsplit(".", 1)[0] + ".1"
        conf = {
            "cniVersion": "1.0.0",
            "name": f"gpuslice-{self.bridge}",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": self.bridge,
                    "isGateway": False,  # no default route, no ip_forward on the host
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": self.subnet, "gateway": gateway}]],
                        # the `kubernetes` Service, relayed on the host (e2e/sandbox/apiproxy.py)
                        "routes": [{"dst": f"{self.service_ip}/32", "gw": gateway}],
                        "dataDir": "/var/lib/cni/networks",
                    },
                }
            ],
        }
        return json.dumps(conf, indent=2) + "\n"

    def kubelet_config(self) -> dict[str, Any]:
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": "127.0.0.1",
            "port": self.kubelet_port,
            "readOnlyPort": 0,
            "healthzPort": 0,
            "tlsCertFile": str(self.pki_dir / "kubelet-serving.crt"),
            "tlsPrivateKeyFile": str(self.pki_dir / "kubelet-serving.key"),
            # the API server presents the sandbox CA's kube-apiserver-kubelet-client certificate
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(self.pki_dir / "ca.crt")},
            },
            "authorization": {"mode": "Webhook"},
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": self.cgroup_root,
            "failCgroupV1": False,
            "failSwapOn": False,
            "containerRuntimeEndpoint": f"unix://{CONTAINERD_SOCKET}",
            "imageServiceEndpoint": f"unix://{CONTAINERD_SOCKET}",
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {},
            "resolvConf": "",  # pods get no host resolver: nothing is sent off the machine
            "volumePluginDir": str(self.volume_plugin_dir),  # default is under /usr/libexec
            "serializeImagePulls": False,
            # no KUBE-FIREWALL/canary chains in the host's iptables (they would outlive the node)
            "makeIPTablesUtilChains": False,
            "rotateCertificates": False,
            "serverTLSBootstrap": False,
            "featureGates": dict(sorted(self.feature_gates.items())),
        }

    def write(self, directory: Path) -> tuple[Path, Path]:
        """containerd.toml and kubelet-config.json in ``directory``; the conflist in its dir."""
        directory.mkdir(parents=True, exist_ok=True)
        self.cni_conf_dir.mkdir(parents=True, exist_ok=True)
        (self.cni_conf_dir / "10-gpuslice.conflist").write_text(self.cni_conflist())
        if self.registry_config_dir is not None:
            for name, text in self.hosts_tomls().items():
                path = self.registry_config_dir / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
        containerd = directory / "containerd.toml"
        containerd.write_text(self.containerd_toml())
        kubelet = directory / "kubelet-config.json"
        kubelet.write_text(json.dumps(self.kubelet_config(), indent=2) + "\n")
        return containerd, kubelet
