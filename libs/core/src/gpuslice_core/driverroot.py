"""What a container needs from the NVIDIA driver on the host, found under the driver root.

A CDI device that CUDA can use is more than ``/dev/nvidia<minor>``. This module finds, under a
driver root (``/`` for a driver installed on the host, ``/run/nvidia/driver`` for the GPU
Operator's driver container), the rest of what NVIDIA's own CDI generator puts in a spec:

* **control nodes** ``/dev/nvidiactl``, ``/dev/nvidia-uvm``, ``/dev/nvidia-uvm-tools``, where
  they exist (a node the runtime cannot find fails the container);
* for a **MIG device**, the capability nodes of its GPU instance and compute instance. Without
  them CUDA in the container sees no device at all. The driver lists them in procfs:
  ``/proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<G>/access`` and
  ``…/gi<G>/ci<C>/access`` hold ``DeviceFileMinor: <N>``; the node is
  ``/dev/nvidia-caps/nvidia-cap<N>``, a character device whose major is the ``nvidia-caps``
  line of ``/proc/devices``. The spec names type, major and minor, so the runtime makes the
  node in the container whether or not ``nvidia-modprobe`` has made it on the host yet;
* the driver's **user-space files** for compute and utility work (``NVIDIA_DRIVER_CAPABILITIES=
  compute,utility``, what a CUDA or NVML program needs): ``libcuda``, ``libnvidia-ml``, the PTX
  JIT and NVVM compilers, the MPS and ``nvidia-smi`` binaries — bind-mounted read-only at the
  paths they have on the host, as the NVIDIA Container Toolkit mounts them. Graphics, video and
  display libraries are left out, as NVIDIA leaves them out for ``compute,utility``.

procfs is the kernel's, so it is read from ``/proc`` whatever the driver root (``proc``: tests
pass a directory of their own). A host where ``/proc/driver/nvidia/capabilities`` does not exist
has no NVIDIA kernel module (the fake NVML's nodes): MIG devices then get no capability nodes,
as devices get no ``/dev`` node that is not there. A driver that has the directory but not the
instance asked for is an error: the container would start without its GPU.

The library search does not follow ``ld.so.cache``: it looks in the distributions' library
directories in a fixed order and takes, per library, the first directory that has it (the one
the host's own loader would usually pick).

**Finding them in the container without ldconfig.** Each library is mounted at its host path
*and* in both families' system library directories, ``/usr/lib/<triplet>`` (Debian, Ubuntu)
and ``/usr/lib64`` (RHEL, Fedora, Amazon Linux, SUSE): glibc's loader searches its built-in
system directories after a miss in ``ld.so.cache``, so ``dlopen("libcuda.so.1")`` finds the
library whatever the host's and the image's families, with no ``LD_LIBRARY_PATH`` and no
``ldconfig`` run in the container. NVIDIA's toolkit instead adds an ``update-ldcache``
createContainer hook (``ldconfig`` in the container's root); docs/cdi.md, "Driver files", says
why we do not.
"""

from __future__ import annotations

import os
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path

from gpuslice_core.cdi import DeviceNode, Mount
from gpuslice_core.errors import FailedPreconditionError

CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
VISIBLE_DEVICES_VOID = "NVIDIA_VISIBLE_DEVICES=void"
"""Set in every gpuslice device's edits: with NVIDIA's runtime as the node's default runtime,
an image that says ``NVIDIA_VISIBLE_DEVICES=all`` (every CUDA base image does) would otherwise
be given every GPU of the node by NVIDIA's legacy hook, whatever the claim holds."""

LIBRARIES = (
    # utility (NVML, nvidia-smi)
    "libnvidia-ml.so",
    "libnvidia-cfg.so",
    # compute (CUDA driver API, its JIT compilers, OpenCL, the allocator CUDA IPC uses)
    "libcuda.so",
    "libcudadebugger.so",
    "libnvidia-ptxjitcompiler.so",
    "libnvidia-nvvm.so",
    "libnvidia-gpucomp.so",
    "libnvidia-opencl.so",
    "libnvidia-allocator.so",
    "libnvidia-pkcs11-openssl3.so",
)
"""Library names without their version; every versioned file or link of each is mounted."""
LIBRARY_DIRS = (
    # NVIDIA's order (nvidia-container-toolkit internal/lookup/library.go, which NVIDIA's DRA
    # driver uses with its driver root to find libnvidia-ml.so.1), then where GKE and plain
    # /usr/lib installs put them
    "usr/lib64",
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib/x86_64-linux-gnu/nvidia/current",
    "usr/lib/aarch64-linux-gnu/nvidia/current",
    "lib64",
    "lib/x86_64-linux-gnu",
    "lib/aarch64-linux-gnu",
    "lib/x86_64-linux-gnu/nvidia/current",
    "lib/aarch64-linux-gnu/nvidia/current",
    "usr/local/nvidia/lib64",
    "usr/lib",
    "lib",
)
"""Searched in this order, relative to the driver root; per library the first that has it. The
same list finds the ``libnvidia-ml.so.1`` the services load (``gpuslice_nvml.real.library``), so
a container gets the library the plugin itself talks to."""
BINARIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)
#: glibc's built-in system library directories (``ld.so --help``, "System search path"): a
#: library there is found after a miss in the image's ``ld.so.cache``. Debian and Ubuntu search
#: ``/usr/lib/<triplet>``, RHEL-like distributions ``/usr/lib64``.
TRIPLETS = {
    "x86_64": "x86_64-linux-gnu",
    "aarch64": "aarch64-linux-gnu",
    "arm64": "aarch64-linux-gnu",
}
BINARY_DIRS = ("usr/bin", "usr/local/nvidia/bin", "bin")
MOUNT_OPTIONS = ["ro", "nosuid", "nodev", "rbind", "rprivate"]

_MINOR = re.compile(r"^DeviceFileMinor:\s*(\d+)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class DriverRoot:
    """The driver's files under ``path`` (its device nodes and user space) and the kernel's
    view of it under ``proc``. ``host`` is where the container runtime finds ``path``: the
    driver root on the host when this process sees it mounted elsewhere (the chart mounts it at
    ``/driver-root``); the spec's host paths are written under ``host``."""

    path: Path = Path("/")
    proc: Path = Path("/proc")
    host: Path | None = None
    #: The node's machine (``uname -m``): which ``/usr/lib/<triplet>`` libraries also go to.
    machine: str = field(default_factory=platform.machine)

    def system_library_dirs(self) -> list[str]:
        """Where every library is mounted besides its host path: both families' system
        library directories in the container."""
        triplet = TRIPLETS.get(self.machine)
        return ([f"/usr/lib/{triplet}"] if triplet else []) + ["/usr/lib64"]

    def host_path(self, inside: Path) -> str:
        """The host's path of ``inside`` (a path under ``path``)."""
        return str((self.host or self.path) / inside.relative_to(self.path))

    # ---- device nodes -----------------------------------------------------------------------
    def node(self, name: str) -> list[DeviceNode]:
        """``/dev/<name>`` as a device node of the spec, or nothing where the host has none."""
        seen = self.path / "dev" / name
        if not seen.exists():
            return []
        return [DeviceNode(path=f"/dev/{name}", host_path=self.host_path(seen))]

    def gpu_nodes(self, minor: int | None) -> list[DeviceNode]:
        """A GPU's node (when its minor is known) and the control nodes."""
        nodes = self.node(f"nvidia{minor}") if minor is not None else []
        return nodes + [n for name in CONTROL_NODES for n in self.node(name)]

    def mig_nodes(
        self, gpu_minor: int, gpu_instance: int, compute_instance: int | None
    ) -> list[DeviceNode]:
        """The capability nodes of a MIG device: its GPU instance's and its compute
        instance's; with ``compute_instance`` None (a GPU instance made for one claim), every
        compute instance of the GPU instance. Nothing where the host has no NVIDIA kernel
        module; ``FailedPreconditionError`` where the driver does not list the instance."""
        caps = self.proc / "driver" / "nvidia" / "capabilities"
        if not caps.is_dir():
            return []
        gi = caps / f"gpu{gpu_minor}" / "mig" / f"gi{gpu_instance}"
        if compute_instance is None:
            cis = sorted(gi.glob("ci*/access")) if gi.is_dir() else []
        else:
            cis = [gi / f"ci{compute_instance}" / "access"]
        files = [gi / "access", *cis]
        missing = [str(f) for f in files if not f.is_file()]
        if missing or (compute_instance is None and not cis):
            what = f"GPU instance {gpu_instance}" + (
                f" compute instance {compute_instance}" if compute_instance is not None else ""
            )
            raise FailedPreconditionError(
                f"the NVIDIA driver lists no capability for MIG {what} of GPU minor {gpu_minor} "
                f"(looked for {', '.join(missing) or str(gi / 'ci*' / 'access')}); the instance "
                "is gone or the driver's capabilities are not visible here (/proc of the host)"
            )
        major = self.caps_major()
        return [_cap_node(_device_minor(f), major) for f in files]

    def caps_major(self) -> int:
        """The character-device major of ``nvidia-caps`` (``/proc/devices``)."""
        try:
            lines = (self.proc / "devices").read_text().splitlines()
        except OSError as exc:
            raise FailedPreconditionError(f"cannot read {self.proc / 'devices'}: {exc}") from exc
        for line in lines:
            number, _, name = line.strip().partition(" ")
            if name.strip() == "nvidia-caps" and number.isdigit():
                return int(number)
        raise FailedPreconditionError(
            f"{self.proc / 'devices'} has no nvidia-caps line: the NVIDIA driver that lists MIG "
            "capabilities should register it"
        )

    # ---- user space -------------------------------------------------------------------------
    @property
    def sees_host(self) -> bool:
        """Whether the files under ``path`` are the host's: a root other than ``/`` is a mount
        of the host's (the chart mounts it at the same path), and ``/`` only when ``host`` says
        so. A process in a container sees its image's ``/``: driver libraries there were put in
        by NVIDIA's runtime at paths the host may not have."""
        return self.host is not None or self.path != Path("/")

    def user_space(self) -> list[Mount]:
        """Read-only bind mounts of the driver's compute and utility libraries and binaries,
        at their paths on the host (under the driver root); none unless ``sees_host``."""
        if not self.sees_host:
            return []
        mounts: list[Mount] = []
        for name in LIBRARIES:
            for directory in LIBRARY_DIRS:
                files = sorted((self.path / directory).glob(f"{name}.*"))
                if files:
                    for found in files:
                        at_host = self._mount(found)
                        mounts.append(at_host)
                        mounts += [
                            at_host.model_copy(update={"container_path": f"{d}/{found.name}"})
                            for d in self.system_library_dirs()
                            if f"{d}/{found.name}" != at_host.container_path
                        ]
                    break
        for name in BINARIES:
            for directory in BINARY_DIRS:
                binary = self.path / directory / name
                if binary.is_file():
                    mounts.append(self._mount(binary))
                    break
        return [m for m in mounts if m.host_path]

    def binary(self, name: str) -> Path | None:
        """The driver's binary ``name`` (``nvidia-smi``) under the driver root, as this process
        can run it; None where the root has none."""
        for directory in BINARY_DIRS:
            binary = self.path / directory / name
            if binary.is_file() and os.access(binary, os.X_OK):
                return binary
        return None

    def library_dir(self, name: str) -> Path | None:
        """The directory under the driver root that holds library ``name`` (``libnvidia-ml.so``,
        any version): what a driver binary run from there needs on ``LD_LIBRARY_PATH``."""
        for directory in LIBRARY_DIRS:
            if any((self.path / directory).glob(f"{name}.*")):
                return self.path / directory
        return None

    def _mount(self, found: Path) -> Mount:
        """``found`` at its own path in the container; a link mounts the file it names (a bind
        mount of a link would fail in the container, where its target may not exist)."""
        target = self._resolve(found)
        if target is None:
            return Mount(host_path="", container_path="/")  # dropped by the caller
        inside = "/" + os.path.relpath(found, self.path)
        return Mount(
            host_path=self.host_path(target), container_path=inside, options=list(MOUNT_OPTIONS)
        )

    def _resolve(self, path: Path) -> Path | None:
        return resolve(self.path, path)


def resolve(root: Path, path: Path) -> Path | None:
    """The file ``path`` (under ``root``) names, following links as the host would: an absolute
    link target is under the driver root, not under this process's ``/``. None for a missing
    file, a dangling link, a loop, a link out of the root or a target that is not a regular
    file."""
    for _ in range(40):
        if not path.is_symlink():
            return path if path.is_file() else None
        target = path.readlink()
        if target.is_absolute():
            path = root / target.relative_to("/")
        else:
            path = Path(os.path.normpath(path.parent / target))
        if not path.is_relative_to(root):
            return None
    return None


def library_candidates(root: Path, filename: str) -> list[Path]:
    """Where ``filename`` (e.g. ``libnvidia-ml.so.1``) is looked for under ``root``, in order."""
    return [root / directory / filename for directory in LIBRARY_DIRS]


def find_library(root: Path, filename: str) -> Path | None:
    """The first of :func:`library_candidates` that is (or links to) a file under ``root``:
    the file itself, links resolved within the root; None when no directory has it."""
    for candidate in library_candidates(root, filename):
        found = resolve(root, candidate)
        if found is not None:
            return found
    return None


def _device_minor(access: Path) -> int:
    match = _MINOR.search(access.read_text())
    if match is None:
        raise FailedPreconditionError(f"{access} has no DeviceFileMinor line")
    return int(match.group(1))


def _cap_node(minor: int, major: int) -> DeviceNode:
    return DeviceNode(
        path=f"/dev/nvidia-caps/nvidia-cap{minor}", type="c", major=major, minor=minor
    )
