"""Check the import contracts of the workspace with import-linter.

The contracts are derived from the workspace itself, so a new service is covered the moment it
exists: every package under services/ (and tools/, the applications that are not services, like
kubectl-gpuslice) sits in the top layer and may import nothing of another one; libs sit below
and may never import a service; among the libs, view (the cluster view) and draplugin (the
kubelet-facing half of a DRA driver) may use nvml, kube, api, core and protos but not each
other; nvml, kube and api may use core; core and the generated protos use no other gpuslice
package. The test kit (libs/testkit, never shipped) sits above everything, and nothing shipped
may import it.

Inside a package, INTERNAL_LAYERS orders its modules: the DRA helper (gpuslice_draplugin) goes
helper → the sockets, the publisher and the claim cache (independent of each other) → the
servicers → the API, metrics and the driver contract, so the contract module stays free of
gRPC and the servicers free of Kubernetes.

Inside each service, SERVICE_SHAPE orders its package as docs/architecture.md says: cli → app →
server → servicer → the domain modules (every other module and subpackage, which may import each
other but none of the layers above). A service names a layer otherwise in SHAPE_ALIASES; a layer
a service does not have is left out. The one import up the stack that the shape allows is
``app → cli``: the app is built from the frozen ``Settings`` that cli.py defines.

Usage: .venv/bin/python hack/check_imports.py   (exit status of lint-imports)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIB_LAYERS = [
    "gpuslice_view | gpuslice_draplugin",
    "gpuslice_nvml | gpuslice_kube | gpuslice_api",
    "gpuslice_core | gpuslice_protos",
]


def member_packages(kind: str) -> list[str]:
    """Top-level import packages of the workspace members under ``kind``/ (libs or services)."""
    packages = []
    for pyproject in sorted((ROOT / kind).glob("*/pyproject.toml")):
        name = tomllib.loads(pyproject.read_text())["project"]["name"]
        packages.append(name.replace("-", "_"))
    return packages


TESTKIT = "gpuslice_testkit"
INTERNAL_LAYERS = {
    "gpuslice_draplugin": [
        "helper",
        "server | slices | claimcache",
        "servicer",
        "kubeapi | metrics",
        "plugin",
    ],
}


#: The layers of a service package, top first; the domain layer (the rest) comes below them.
SERVICE_SHAPE = ["cli", "app", "server", "servicer"]
#: Where a service calls a layer something else: the device plugin's app is run.py.
SHAPE_ALIASES = {"gpuslice_device_plugin": {"app": "run"}}
NOT_DOMAIN = {"__init__", "__main__"}


def package_dir(package: str) -> Path | None:
    """The source directory of a workspace member's import package."""
    for kind in ("services", "tools"):
        for found in (ROOT / kind).glob(f"*/src/{package}/__init__.py"):
            return found.parent
    return None


def service_layers(package: str) -> list[str]:
    """The shape's layers this service has, top first, then its domain modules as one layer."""
    directory = package_dir(package)
    if directory is None:
        return []
    children = {
        p.stem if p.is_file() else p.name
        for p in directory.iterdir()
        if (p.suffix == ".py" and p.is_file()) or (p / "__init__.py").is_file()
    }
    aliases = SHAPE_ALIASES.get(package, {})
    layers = [aliases.get(layer, layer) for layer in SERVICE_SHAPE]
    present = [layer for layer in layers if layer in children]
    domain = sorted(children - set(layers) - NOT_DOMAIN)
    return present + ([" : ".join(domain)] if domain else [])


def service_contract(package: str) -> str:
    layers = service_layers(package)
    if len(layers) < 2:
        return ""
    app = SHAPE_ALIASES.get(package, {}).get("app", "app")
    ignores = (
        f"ignore_imports =\n    {package}.{app} -> {package}.cli\n"
        "unmatched_ignore_imports_alerting = none\n"  # an app may take its settings elsewhere
        if app in layers
        else ""
    )
    return (
        f"\n[importlinter:contract:{package}]\n"
        f"name = {package} in the service shape (cli, app, server, servicer, domain)\n"
        "type = layers\n"
        f"containers =\n    {package}\n"
        "layers =\n" + "".join(f"    {layer}\n" for layer in layers) + ignores
    )


def contracts() -> str:
    services = member_packages("services") + member_packages("tools")
    libs = [p for p in member_packages("libs") if p != TESTKIT]
    layers = [TESTKIT] + ([" | ".join(services)] if services else []) + LIB_LAYERS
    in_layers = {p.strip() for layer in layers for p in layer.split("|")}
    missing = sorted(set(libs) - in_layers)
    if missing:
        sys.exit(f"hack/check_imports.py: libs {missing} are in no layer; add them to LIB_LAYERS")
    indented = "\n".join(f"    {layer}" for layer in layers)
    return (
        "[importlinter]\n"
        "root_packages =\n" + "".join(f"    {p}\n" for p in [*services, *libs, TESTKIT]) + "\n"
        "[importlinter:contract:layers]\n"
        "name = services over libs; services never import each other; libs never import services\n"
        "type = layers\n"
        f"layers =\n{indented}\n\n"
        "[importlinter:contract:testkit]\n"
        "name = nothing shipped imports the test kit\n"
        "type = forbidden\n"
        "source_modules =\n" + "".join(f"    {p}\n" for p in [*services, *libs]) + ""
        f"forbidden_modules =\n    {TESTKIT}\n"
        + "".join(internal(p) for p in INTERNAL_LAYERS)
        + "".join(service_contract(p) for p in member_packages("services"))
    )


def internal(package: str) -> str:
    layers = "".join(f"    {layer}\n" for layer in INTERNAL_LAYERS[package])
    return (
        f"\n[importlinter:contract:{package}]\n"
        f"name = {package} modules in layers\n"
        "type = layers\n"
        f"containers =\n    {package}\n"
        f"layers =\n{layers}"
    )


def source_path() -> str:
    """PYTHONPATH with this tree's packages first. The environment's editable installs point at
    the checkout that made it: run from another worktree with that environment, import-linter
    would otherwise read the other checkout's code and pass whatever this one holds."""
    dirs = [
        str(d) for kind in ("libs", "services", "tools") for d in sorted(ROOT.glob(f"{kind}/*/src"))
    ]
    rest = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join(dirs + ([rest] if rest else []))


def main() -> int:
    config = contracts()
    print(config)
    with tempfile.NamedTemporaryFile("w", suffix=".ini", prefix="importlinter-") as f:
        f.write(config)
        f.flush()
        lint = Path(sys.executable).parent / "lint-imports"
        env = {**os.environ, "PYTHONPATH": source_path()}
        return subprocess.call([str(lint), "--config", f.name, "--no-cache", "--no-logo"], env=env)


if __name__ == "__main__":
    sys.exit(main())
