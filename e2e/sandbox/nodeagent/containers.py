"""From a pod's container spec to the config the runtime gets, as the kubelet builds it:
env (``value`` with ``$(VAR)`` references, ``fieldRef``), command and args with ``$(VAR)``
expanded, device-plugin edits, and the CDI ids (DRA claims and device-plugin ``cdi_devices``)
resolved through ``gpuslice_core.cdi`` like a CDI-enabled runtime does."""

from __future__ import annotations

import os
import re
from pathlib import Path

from e2e.sandbox.nodeagent.runtime import ContainerConfig, CreateContainerError
from gpuslice_core.cdi import ContainerEdits, DeviceNode, Mount, merge_edits, resolve
from gpuslice_core.errors import GpusliceError
from gpuslice_kube.raw import Obj

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_LABEL_REF = re.compile(r"metadata\.(labels|annotations)\['([^']+)'\]")


class ContainerConfigError(Exception):
    """The pod spec cannot be turned into a container config: CreateContainerConfigError."""


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined names are replaced, ``$$`` escapes ``$``,
    anything else (undefined names, unclosed ``$(``) is kept verbatim."""
    out: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                end = text.find(")", i + 2)
                if end != -1:
                    name = text[i + 2 : end]
                    out.append(env[name] if name in env else text[i : end + 1])
                    i = end + 1
                    continue
        out.append(ch)
        i += 1
    return "".join(out)


def field_ref(pod: Obj, path: str, node_name: str) -> str:
    meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName") or node_name,
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.hostIP": "127.0.0.1",
        "status.podIP": status.get("podIP") or "127.0.0.1",
    }
    if path in simple:
        return str(simple[path])
    m = _LABEL_REF.fullmatch(path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    raise ContainerConfigError(f"unsupported fieldRef fieldPath {path!r} in the node sandbox")


def container_env(pod: Obj, container: Obj, node_name: str) -> dict[str, str]:
    env: dict[str, str] = {"HOSTNAME": pod["metadata"]["name"]}
    for entry in container.get("env") or []:
        name = entry["name"]
        if "valueFrom" in entry:
            source = entry["valueFrom"]
            if "fieldRef" in source:
                env[name] = field_ref(pod, source["fieldRef"]["fieldPath"], node_name)
                continue
            raise ContainerConfigError(
                f"env {name}: valueFrom {sorted(source)} is not supported in the node sandbox"
            )
        env[name] = expand(str(entry.get("value", "")), env)
    if container.get("envFrom"):
        raise ContainerConfigError("envFrom is not supported in the node sandbox")
    return env


def device_plugin_edits(responses: list[Obj]) -> tuple[ContainerEdits, list[str]]:
    """Allocate responses (as dicts) → runtime edits, plus the CDI ids they name."""
    parts: list[ContainerEdits] = []
    cdi_ids: list[str] = []
    for r in responses:
        parts.append(
            ContainerEdits(
                env=[f"{k}={v}" for k, v in sorted((r.get("envs") or {}).items())],
                mounts=[
                    Mount(
                        host_path=m["host_path"],
                        container_path=m["container_path"],
                        options=["ro"] if m.get("read_only") else [],
                    )
                    for m in r.get("mounts") or []
                ],
                device_nodes=[
                    DeviceNode(
                        path=d["container_path"],
                        host_path=d["host_path"],
                        permissions=d.get("permissions") or "",
                    )
                    for d in r.get("devices") or []
                ],
            )
        )
        cdi_ids += [c["name"] for c in r.get("cdi_devices") or []]
    return merge_edits(parts), cdi_ids


def build_config(
    pod: Obj,
    container: Obj,
    *,
    node_name: str,
    cdi_root: Path,
    cdi_ids: list[str],
    device_plugin: list[Obj],
    workdir: Path,
) -> ContainerConfig:
    """The container config with every edit applied; raises ContainerConfigError for a spec
    the sandbox cannot run and CreateContainerError for CDI devices that do not resolve."""
    env = container_env(pod, container, node_name)
    env.setdefault("PATH", os.environ.get("PATH") or DEFAULT_PATH)
    argv = [
        expand(a, env) for a in (container.get("command") or []) + (container.get("args") or [])
    ]
    dp_edits, dp_cdi = device_plugin_edits(device_plugin)
    ids = list(dict.fromkeys(cdi_ids + dp_cdi))  # containerd skips repeated ids
    try:
        cdi_edits = resolve(cdi_root, ids) if ids else ContainerEdits()
    except GpusliceError as exc:
        raise CreateContainerError(
            f"failed to create containerd container: CDI device injection failed: {exc}"
        ) from exc
    edits = merge_edits([dp_edits, cdi_edits])
    cwd = container.get("workingDir") or ""
    if not cwd or not Path(cwd).is_dir():
        cwd = str(workdir)
    return ContainerConfig(
        pod_uid=pod["metadata"]["uid"],
        name=container["name"],
        argv=argv,
        env=env,
        cwd=cwd,
        annotations=dict(pod["metadata"].get("annotations") or {}),
        edits=edits,
        cdi_devices=ids,
    )
