"""What a container gets from the driver root: MIG capability nodes read from the driver's
procfs, the driver's libraries and binaries at their host paths, nothing invented."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuslice_core.cdi import DeviceNode
from gpuslice_core.driverroot import DriverRoot
from gpuslice_core.errors import FailedPreconditionError

LIB = "usr/lib/x86_64-linux-gnu"


def proc(tmp_path: Path, *instances: tuple[int, int, int, list[tuple[int, int]]]) -> Path:
    """A /proc with the driver's capabilities: (gpu minor, gi, gi's minor, [(ci, minor)])."""
    root = tmp_path / "proc"
    caps = root / "driver" / "nvidia" / "capabilities"
    (caps / "mig").mkdir(parents=True)
    (caps / "mig" / "config").write_text("DeviceFileMinor: 1\nDeviceFileMode: 256\n")
    for gpu, gi, gi_minor, cis in instances:
        gi_dir = caps / f"gpu{gpu}" / "mig" / f"gi{gi}"
        gi_dir.mkdir(parents=True)
        (gi_dir / "access").write_text(f"DeviceFileMinor: {gi_minor}\nDeviceFileMode: 292\n")
        for ci, ci_minor in cis:
            (gi_dir / f"ci{ci}").mkdir()
            (gi_dir / f"ci{ci}" / "access").write_text(f"DeviceFileMinor: {ci_minor}\n")
    (root / "devices").write_text(
        "Character devices:\n195 nvidia\n238 nvidia-uvm\n241 nvidia-caps\n\nBlock devices:\n"
    )
    return root


def cap(minor: int) -> DeviceNode:
    return DeviceNode(path=f"/dev/nvidia-caps/nvidia-cap{minor}", type="c", major=241, minor=minor)


def test_a_mig_device_gets_its_gpu_and_compute_instance_capability_nodes(tmp_path: Path) -> None:
    root = DriverRoot(tmp_path / "root", proc=proc(tmp_path, (0, 1, 12, [(0, 13), (1, 14)])))
    assert root.mig_nodes(0, 1, 1) == [cap(12), cap(14)]  # not its sibling compute instance
    assert root.mig_nodes(0, 1, None) == [cap(12), cap(13), cap(14)]  # a GI made for a claim


def test_an_instance_the_driver_does_not_list_fails_with_the_path_it_looked_for(
    tmp_path: Path,
) -> None:
    root = DriverRoot(tmp_path / "root", proc=proc(tmp_path, (0, 1, 12, [(0, 13)])))
    with pytest.raises(FailedPreconditionError, match=r"compute instance 4 .*gi1/ci4/access"):
        root.mig_nodes(0, 1, 4)
    with pytest.raises(FailedPreconditionError, match="GPU instance 2 compute instance 0 of GPU"):
        root.mig_nodes(0, 2, 0)


def test_no_nvidia_kernel_module_means_no_capability_nodes(tmp_path: Path) -> None:
    """The fake NVML's nodes: no /proc/driver/nvidia, as they have no /dev/nvidia0."""
    empty = tmp_path / "proc"
    empty.mkdir()
    assert DriverRoot(tmp_path, proc=empty).mig_nodes(0, 1, 0) == []


def driver_files(root: Path) -> None:
    """A driver's user space as distributions lay it out: versioned files, soname links (one
    absolute), a copy in a later directory of the search, a dangling link."""
    lib = root / LIB
    lib.mkdir(parents=True)
    (lib / "libcuda.so.580.1").write_bytes(b"\x7fELF")
    (lib / "libcuda.so.1").symlink_to("libcuda.so.580.1")
    (lib / "libcuda.so").symlink_to("libcuda.so.1")
    (lib / "libnvidia-ml.so.580.1").write_bytes(b"\x7fELF")
    (lib / "libnvidia-ml.so.1").symlink_to(f"/{LIB}/libnvidia-ml.so.580.1")
    (lib / "libnvidia-ptxjitcompiler.so.1").symlink_to("libnvidia-ptxjitcompiler.so.580.1")
    (lib / "libnvidia-glcore.so.580.1").write_bytes(b"\x7fELF")  # graphics: not for compute
    (root / "usr/local/nvidia/lib64").mkdir(parents=True)
    (root / "usr/local/nvidia/lib64/libcuda.so.1").write_bytes(b"\x7fELF")
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/nvidia-smi").write_bytes(b"\x7fELF")


def test_the_drivers_libraries_and_binaries_are_mounted_read_only_at_their_host_paths(
    tmp_path: Path,
) -> None:
    seen = tmp_path / "driver-root"
    driver_files(seen)
    mounts = DriverRoot(seen, host=Path("/run/nvidia/driver"), machine="x86_64").user_space()
    got = {m.container_path: m.host_path for m in mounts}
    host = f"/run/nvidia/driver/{LIB}"
    assert got == {
        f"/{LIB}/libcuda.so.1": f"{host}/libcuda.so.580.1",
        f"/{LIB}/libcuda.so.580.1": f"{host}/libcuda.so.580.1",
        f"/{LIB}/libnvidia-ml.so.1": f"{host}/libnvidia-ml.so.580.1",  # absolute link, rerooted
        f"/{LIB}/libnvidia-ml.so.580.1": f"{host}/libnvidia-ml.so.580.1",
        # RHEL-like images' system library directory too (see the next test)
        "/usr/lib64/libcuda.so.1": f"{host}/libcuda.so.580.1",
        "/usr/lib64/libcuda.so.580.1": f"{host}/libcuda.so.580.1",
        "/usr/lib64/libnvidia-ml.so.1": f"{host}/libnvidia-ml.so.580.1",
        "/usr/lib64/libnvidia-ml.so.580.1": f"{host}/libnvidia-ml.so.580.1",
        "/usr/bin/nvidia-smi": "/run/nvidia/driver/usr/bin/nvidia-smi",
    }
    assert all(m.options[:3] == ["ro", "nosuid", "nodev"] for m in mounts)


@pytest.mark.parametrize(
    ("machine", "host_dir", "system_dirs"),
    [
        ("x86_64", "usr/lib64", ["/usr/lib/x86_64-linux-gnu", "/usr/lib64"]),  # RHEL host
        ("aarch64", "usr/lib/aarch64-linux-gnu", ["/usr/lib/aarch64-linux-gnu", "/usr/lib64"]),
        (
            "x86_64",
            "usr/lib/x86_64-linux-gnu/nvidia/current",
            ["/usr/lib/x86_64-linux-gnu", "/usr/lib64"],
        ),
        ("ppc64le", "usr/lib64", ["/usr/lib64"]),  # no Debian triplet known: its own path only
    ],
)
def test_every_library_is_also_where_either_familys_loader_looks_without_ldconfig(
    tmp_path: Path, machine: str, host_dir: str, system_dirs: list[str]
) -> None:
    """The update-ldcache question: the container's glibc searches its system library
    directories (Debian: /usr/lib/<triplet>; RHEL-like: /usr/lib64) after a miss in the
    image's ld.so.cache, so each library is mounted at its host path and in both, and a RHEL
    host's /usr/lib64 libraries are found in an Ubuntu image with no ldconfig and no
    LD_LIBRARY_PATH (and the other way round)."""
    lib = tmp_path / host_dir
    lib.mkdir(parents=True)
    (lib / "libcuda.so.580.1").write_bytes(b"\x7fELF")
    (lib / "libcuda.so.1").symlink_to("libcuda.so.580.1")
    mounts = DriverRoot(tmp_path, host=Path("/"), machine=machine).user_space()
    got: dict[str, set[str]] = {}
    for m in mounts:
        got.setdefault(m.host_path, set()).add(m.container_path)
        assert m.options[:3] == ["ro", "nosuid", "nodev"]
    want = {f"/{host_dir}", *system_dirs}
    assert got == {
        f"/{host_dir}/libcuda.so.580.1": {
            f"{d}/{name}" for d in want for name in ("libcuda.so.1", "libcuda.so.580.1")
        }
    }


def test_a_process_that_sees_its_own_root_mounts_nothing(tmp_path: Path) -> None:
    """``/`` in the plugin's container is its image: libraries NVIDIA's runtime put there are
    at the image's paths, which the host may not have."""
    assert DriverRoot(Path("/")).user_space() == []
    assert not DriverRoot(Path("/")).sees_host
    assert DriverRoot(Path("/"), host=Path("/")).sees_host


@pytest.mark.skipif(
    not Path("/proc/driver/nvidia/capabilities").is_dir(),
    reason="no NVIDIA kernel module on this machine (the GPU stage runs this on a GPU host)",
)
def test_the_real_drivers_files_exist_where_the_spec_says() -> None:
    """On a GPU host (run as the host sees itself): every mount's source is a file, libcuda and
    libnvidia-ml are there, and the MIG config capability parses as the instances' files do."""
    root = DriverRoot(Path("/"), host=Path("/"))
    mounts = root.user_space()
    assert all(Path(m.host_path).is_file() for m in mounts), mounts
    names = {Path(m.container_path).name for m in mounts}
    assert {"libcuda.so.1", "libnvidia-ml.so.1", "nvidia-smi"} <= names, sorted(names)
    assert root.caps_major() > 0


def test_the_drivers_nvidia_smi_and_its_library_directory_are_found(tmp_path: Path) -> None:
    """What the kubelet plugin runs to set a GPU's time slice: the driver root's nvidia-smi,
    with the directory of its libnvidia-ml."""
    driver_files(tmp_path)
    smi = tmp_path / "usr/bin/nvidia-smi"
    root = DriverRoot(tmp_path)
    assert root.binary("nvidia-smi") is None  # not executable: not runnable here
    smi.chmod(0o755)
    assert root.binary("nvidia-smi") == smi
    assert root.library_dir("libnvidia-ml.so") == tmp_path / LIB
    assert root.binary("nvidia-persistenced") is None
    assert root.library_dir("libnvidia-nope.so") is None
