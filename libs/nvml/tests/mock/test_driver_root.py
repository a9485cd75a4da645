"""The real backend loads libnvidia-ml.so.1 from a driver root (``--driver-root``), as NVIDIA's
DRA driver does, so the node pods need no NVIDIA Container Toolkit.

Each case runs in a child process with no ``LD_LIBRARY_PATH`` of the mock and no
``GPUSLICE_NVML_MOCK_NODE`` (a process holds one libnvidia-ml for its life): the driver root
is the only way the child can reach the mock, and the mock finds its node from its own
directory. The machine must have no libnvidia-ml of its own on the loader's path, as CI has not.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpuslice_nvml import mock
from gpuslice_nvml.fake.node import load_node

pytestmark = pytest.mark.timeout(300)  # a cold build fetches nvml.h from PyPI first


@pytest.fixture
def mock_lib(mock_lib_dir: Path) -> Path:
    """The built mock (conftest's mock_lib_dir)."""
    return mock_lib_dir / "libnvidia-ml.so.1"


CHILD = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from gpuslice_nvml import NvmlError, open_nvml
    try:
        nvml = open_nvml("real", None, Path(sys.argv[1]) if sys.argv[1] else None)
    except NvmlError as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
        sys.exit(0)
    maps = [line.split()[-1] for line in open("/proc/self/maps") if "libnvidia-ml" in line]
    print(json.dumps({
        "library": str(nvml.library.path) if nvml.library.path else None,
        "driver": nvml.system_info().driver_version,
        "gpus": [g.name for g in nvml.gpus()],
        "mapped": sorted(set(maps)),
    }))
    """
)


def child(driver_root: Path | None, ld_library_path: str = "") -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", mock.NODE_ENV)}
    if ld_library_path:
        env["LD_LIBRARY_PATH"] = ld_library_path
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(driver_root or "")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result: dict[str, object] = json.loads(run.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture
def node_config(tmp_path: Path) -> Path:
    config = tmp_path / "node.yaml"
    config.write_text(
        "name: node-a\ndriverVersion: 580.65.06\ncudaDriverVersion: '13.0'\n"
        f"statePath: {tmp_path / 'state' / 'node-a.json'}\n"
        "gpus:\n  - model: L4\n    count: 2\n"
    )
    return config


def install(root: Path, directory: str, config: Path, mock_lib: Path) -> Path:
    """The mock under ``root/directory`` as a driver installs it (a versioned file and the
    soname link), with its node file beside it."""
    lib_dir = root / directory
    lib_dir.mkdir(parents=True)
    shutil.copyfile(mock_lib, lib_dir / "libnvidia-ml.so.580.65.06")
    (lib_dir / "libnvidia-ml.so.1").symlink_to("libnvidia-ml.so.580.65.06")
    mock.write_node_file(load_node(config), lib_dir / mock.LIBRARY_NODE_FILE)
    return lib_dir / "libnvidia-ml.so.580.65.06"


def test_the_library_of_the_driver_root_is_loaded_and_answers_for_its_node(
    tmp_path: Path, node_config: Path, mock_lib: Path
) -> None:
    root = tmp_path / "driver-root"
    # NVIDIA's order: usr/lib64 before usr/lib/x86_64-linux-gnu, whose file is not a library
    library = install(root, "usr/lib64", node_config, mock_lib)
    (root / "usr/lib/x86_64-linux-gnu").mkdir(parents=True)
    (root / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1").write_bytes(b"not a library")
    got = child(root)
    assert got.get("error") is None, got
    assert got["library"] == str(library)
    assert got["mapped"] == [str(library)]  # that file and no other libnvidia-ml
    assert got["driver"] == "580.65.06"
    assert got["gpus"] == ["NVIDIA L4", "NVIDIA L4"]


def test_a_root_without_the_library_names_every_directory_it_tried(tmp_path: Path) -> None:
    root = tmp_path / "empty-root"
    root.mkdir()
    got = child(root)
    assert got["error"] == "NvmlLibraryNotFound", got
    message = str(got["message"])
    for directory in ("usr/lib64", "usr/lib/x86_64-linux-gnu", "lib64", "usr/lib", "lib"):
        assert re.search(rf"[ (]{re.escape(directory)}[,)]", message), (directory, message)
    assert str(root) in message and "loader's search path" in message


def test_a_root_without_the_library_falls_back_to_the_loaders_search_path(
    tmp_path: Path, node_config: Path, mock_lib: Path
) -> None:
    """Today's behaviour stays: a driver root with no library (or none: ``/``) leaves the
    library to the loader, here LD_LIBRARY_PATH as the toolkit's injection or a host install
    would provide it."""
    lib_dir = tmp_path / "lib"
    library = install(lib_dir, "x", node_config, mock_lib)
    empty = tmp_path / "empty-root"
    empty.mkdir()
    for root in (empty, None):
        got = child(root, ld_library_path=str(library.parent))
        assert got.get("error") is None, got
        assert got["library"] is None
        assert got["mapped"] == [str(library)]
        assert got["driver"] == "580.65.06"


def test_a_file_that_is_not_a_library_is_a_clear_error(tmp_path: Path) -> None:
    root = tmp_path / "driver-root"
    (root / "usr/lib64").mkdir(parents=True)
    (root / "usr/lib64/libnvidia-ml.so.1").write_bytes(b"not a library")
    got = child(root)
    assert got["error"] == "NvmlLibraryNotFound", got
    assert "cannot load the driver root's library" in str(got["message"])
    assert str(root / "usr/lib64/libnvidia-ml.so.1") in str(got["message"])
