"""gpuslice node setup: the init container of the gpuslice node DaemonSet (Helm chart).

Runs with the Python of one of the gpuslice images (stdlib only) before the services start, and
does what the environment asks for, each step idempotent:

1. SOCKET_DIR: removes the per-pod sockets (``enforcer-<podUID>.sock``,
   ``mig-manager-<podUID>.sock``) that no process listens on any more -- left behind by pods
   that were killed without a graceful stop. A socket with a listener is never touched.
2. FAKE_NVML_CONFIG_SRC -> FAKE_NVML_CONFIG: writes the fake NVML node config for this node
   (the ConfigMap's YAML, plus ``name: <NODE_NAME>`` when FAKE_NVML_SET_NAME is true, so every
   fake node gets its own GPU UUIDs), atomically.
3. HOOK_INSTALL_DIR (the host directory as mounted here) and HOOK_HOST_DIR (the same directory
   as the host sees it): installs ``gpuslice-enforcer-hook`` for the CDI createContainer hook
   (docs/enforcer.md). The runtime runs the hook on the host, outside any container, so it
   gets a self-contained copy of this image's Python -- interpreter, libpython, stdlib, the
   image's site-packages and the shared libraries they load, except glibc's -- under
   ``releases/<content digest>/``, and ``bin/gpuslice-enforcer-hook`` becomes a small shell
   wrapper that runs ``gpuslice_enforcer.hook.main`` with it (``python -s -S -c``). The
   wrapper is replaced atomically and the previous release is kept, so a hook that is running
   during an upgrade finishes with the files it started with. Older releases are removed.
   HOOK_SITE_PACKAGES names another site-packages to install from (the chart's tests use a
   stand-in package).

With the arguments ``hook-socket claim`` (the enforcer container's postStart) it points the
stable link ENFORCER_HOOK_SOCKET (``enforcer.sock``, the path the CDI hook calls) at this pod's
enforcer socket ENFORCER_SOCKET (``enforcer-<podUID>.sock``), atomically: in a rolling update
the newest enforcer takes over the hook. ``hook-socket release`` (its preStop) hands the link to
another enforcer socket that has a listener, if the link still points at this pod's.

Exit status 0 when every asked-for step succeeded; 1 with the reason on stderr otherwise.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

# per-pod sockets, and the enforcer's attach socket beside its gRPC one (``….sock.attach``)
SOCKET_PATTERN = re.compile(r"^(enforcer|mig-manager)-[0-9a-f-]{36}\.sock(\.attach)?$")
STDLIB_SKIP = {
    "site-packages",
    "test",
    "idlelib",
    "tkinter",
    "turtledemo",
    "ensurepip",
    "lib2to3",
    "pydoc_data",
}
# Libraries of glibc: they must come from the host, never from the image.
GLIBC = re.compile(
    r"^(ld-linux[^/]*|libc|libm|libdl|libpthread|librt|libutil|libresolv|libnsl|libcrypt"
    r"|libanl|libBrokenLocale|libmvec|libnss_[a-z]+|linux-vdso|linux-gate)\.so"
)
HOOK_NAME = "gpuslice-enforcer-hook"
WRAPPER = """#!/bin/sh
# {name}: installed by the gpuslice Helm chart (node-setup init container).
# The CDI createContainer/poststop hook of the gpuslice enforcer (docs/enforcer.md). It runs
# with a self-contained copy of the enforcer image's Python: release {release}.
R='{root}'
export LD_LIBRARY_PATH="$R/python/lib${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"
export PYTHONHOME="$R/python"
export PYTHONNOUSERSITE=1
# named, not left to site.py: a distribution's Python (Debian's) looks for dist-packages
export PYTHONPATH="$R/python/lib/{version}/site-packages"
# -S: no site.py (PYTHONPATH names the packages); -c, not -m: runpy costs more than main()
exec "$R/python/bin/python3" -s -S -c \\
  'import sys; from gpuslice_enforcer.hook import main; sys.exit(main())' "$@"
"""


def log(message: str) -> None:
    print(f"node-setup: {message}", file=sys.stderr, flush=True)


def write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    tmp.chmod(mode)
    tmp.replace(path)


# ---- 1. dead per-pod sockets -------------------------------------------------------------------
def listening(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(str(path))
        except OSError as exc:
            return exc.errno not in (errno.ECONNREFUSED, errno.ENOENT)
    return True


def sweep_sockets(directory: Path) -> None:
    if not directory.is_dir():
        return
    for path in sorted(directory.iterdir()):
        if SOCKET_PATTERN.match(path.name) and path.is_socket() and not listening(path):
            path.unlink(missing_ok=True)
            log(f"removed {path}: nothing listens on it")


# ---- 2. the fake NVML config -------------------------------------------------------------------
def write_fake_config(src: Path, dst: Path, node_name: str, set_name: bool) -> None:
    text = src.read_text()
    if set_name:
        if not node_name:
            raise SystemExit("node-setup: FAKE_NVML_SET_NAME needs NODE_NAME")
        text = text.rstrip("\n") + f"\nname: {json.dumps(node_name)}\n"
    write_atomic(dst, text)
    log(f"fake NVML config for node {node_name or '?'} written to {dst}")


# ---- 3. the enforcer's CDI hook ----------------------------------------------------------------
def site_packages() -> Path:
    return Path(os.environ.get("HOOK_SITE_PACKAGES") or sysconfig.get_paths()["purelib"])


def release_id(packages: Path) -> str:
    """A digest of the interpreter and of every installed distribution's RECORD (which lists
    each file with its own hash): a new image gives a new release, the same image the same."""
    digest = hashlib.sha256(sys.version.encode())
    digest.update(Path(os.path.realpath(sys.executable)).read_bytes())
    for record in sorted(packages.glob("*.dist-info/RECORD")):
        digest.update(record.parent.name.encode())
        digest.update(record.read_bytes())
    for module in sorted(packages.glob("*.py")):
        digest.update(module.read_bytes())
    return digest.hexdigest()[:16]


def _ignore_stdlib(directory: str, names: list[str]) -> set[str]:
    here = Path(directory)
    if here == Path(sysconfig.get_paths()["stdlib"]):
        return {n for n in names if n in STDLIB_SKIP or n.startswith("config-")}
    if here.name == "lib-dynload":  # Tk pulls in X11: never needed by the hook
        return {n for n in names if n.startswith("_tkinter")}
    return set()


def shared_libraries(tree: Path) -> set[Path]:
    """Libraries outside glibc that the ELF files under ``tree`` load, as ldd resolves them."""
    if shutil.which("ldd") is None:
        log("ldd not found: shared libraries of the image are not copied")
        return set()
    found: set[Path] = set()
    for path in tree.rglob("*"):
        if not path.is_file() or path.is_symlink():
            continue
        if not (path.name.endswith(".so") or ".so." in path.name or path.parent.name == "bin"):
            continue
        with path.open("rb") as f:
            if f.read(4) != b"\x7fELF":
                continue
        out = subprocess.run(["ldd", str(path)], capture_output=True, text=True, check=False)
        for line in out.stdout.splitlines():
            match = re.match(r"\s*(\S+) => (/\S+) \(0x[0-9a-f]+\)", line)
            if (
                match
                and not GLIBC.match(match.group(1))
                and not match.group(2).startswith(str(tree))
            ):
                found.add(Path(match.group(2)))
    return found


def build_release(target: Path, packages: Path) -> None:
    python = Path(os.path.realpath(sys.executable))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    (target / "python" / "bin").mkdir(parents=True)
    shutil.copy2(python, target / "python" / "bin" / version)
    (target / "python" / "bin" / "python3").symlink_to(version)
    lib = target / "python" / "lib"
    shutil.copytree(stdlib, lib / version, symlinks=True, ignore=_ignore_stdlib)
    shutil.copytree(packages, lib / version / "site-packages", symlinks=True)
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        libdir = Path(str(sysconfig.get_config_var("LIBDIR")))
        for so in libdir.glob(f"lib{version}*.so*"):
            shutil.copy2(so, lib / so.name, follow_symlinks=False)
    for dep in sorted(shared_libraries(target)):
        if not (lib / dep.name).exists():
            shutil.copy2(dep, lib / dep.name)


def previous_release(wrapper: Path) -> str | None:
    with contextlib.suppress(OSError):
        match = re.search(r"^R='.*/releases/([0-9a-f]+)'$", wrapper.read_text(), re.MULTILINE)
        if match:
            return match.group(1)
    return None


def install_hook(install_dir: Path, host_dir: str) -> None:
    packages = site_packages()
    if not (packages / "gpuslice_enforcer" / "hook.py").is_file():
        raise SystemExit(
            f"node-setup: {packages} has no gpuslice_enforcer/hook.py; the hook is installed "
            "from the enforcer image"
        )
    rid = release_id(packages)
    releases = install_dir / "releases"
    release = releases / rid
    if (release / ".complete").is_file():
        log(f"hook release {rid} already installed")
    else:
        partial = releases / f".{rid}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        build_release(partial, packages)
        (partial / ".complete").write_text(sys.version + "\n")
        shutil.rmtree(release, ignore_errors=True)  # an incomplete one from a killed setup
        partial.rename(release)
        log(f"hook release {rid} installed under {host_dir}/releases/{rid}")
    wrapper = install_dir / "bin" / HOOK_NAME
    previous_file = install_dir / "bin" / ".previous-release"
    previous = previous_release(wrapper)
    if previous is not None and previous != rid:
        write_atomic(previous_file, previous + "\n")
    elif previous_file.is_file():
        previous = previous_file.read_text().strip()
    keep = {rid, previous}
    root = f"{host_dir.rstrip('/')}/releases/{rid}"
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    text = WRAPPER.format(name=HOOK_NAME, release=rid, root=root, version=version)
    write_atomic(wrapper, text, mode=0o755)
    log(f"{host_dir.rstrip('/')}/bin/{HOOK_NAME} runs release {rid}")
    for old in releases.iterdir():
        if old.name not in keep:
            shutil.rmtree(old, ignore_errors=True)
            log(f"removed old hook release {old.name}")


# ---- the enforcer's stable hook socket --------------------------------------------------------
def point_link(link: Path, target: Path) -> None:
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target.name if target.parent == link.parent else target)
    tmp.replace(link)


def hook_socket(action: str, own: Path, link: Path) -> None:
    if action == "claim":
        point_link(link, own)
        log(f"{link} -> {own.name}")
        return
    current = link.readlink() if link.is_symlink() else None
    if current is None or (link.parent / current) != own:
        return
    for other in sorted(own.parent.glob("enforcer-*.sock")):
        if other != own and SOCKET_PATTERN.match(other.name) and listening(other):
            point_link(link, other)
            log(f"{link} handed over to {other.name}")
            return


def main(argv: list[str]) -> int:
    env = os.environ
    if argv[:1] == ["hook-socket"]:
        if len(argv) != 2 or argv[1] not in ("claim", "release"):
            log("usage: node-setup.py hook-socket claim|release")
            return 2
        try:
            hook_socket(argv[1], Path(env["ENFORCER_SOCKET"]), Path(env["ENFORCER_HOOK_SOCKET"]))
        except (OSError, KeyError) as exc:
            log(f"hook-socket {argv[1]} failed: {exc!r}")
            return 1
        return 0
    try:
        if env.get("SOCKET_DIR"):
            sweep_sockets(Path(env["SOCKET_DIR"]))
        if env.get("FAKE_NVML_CONFIG_SRC"):
            write_fake_config(
                Path(env["FAKE_NVML_CONFIG_SRC"]),
                Path(env["FAKE_NVML_CONFIG"]),
                env.get("NODE_NAME", ""),
                env.get("FAKE_NVML_SET_NAME", "").lower() == "true",
            )
        if env.get("HOOK_INSTALL_DIR"):
            install_hook(Path(env["HOOK_INSTALL_DIR"]), env["HOOK_HOST_DIR"])
    except OSError as exc:
        log(f"failed: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
