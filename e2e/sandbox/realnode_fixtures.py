"""pytest fixtures for the real-node tier. They build on the session fixture ``sandbox`` (a
``ControlPlane``, e2e/conftest.py); use them with ``pytest_plugins``::

    pytest_plugins = ("e2e.sandbox.realnode_fixtures",)

- ``real_nodes``: two real nodes (``real-0``, ``real-1``: containerd + kubelet each, every image
  of hack/images.sh imported) for one test module, stopped at its end, and the stop checked;
- ``real_images``: the images of hack/images.sh's manifest, by name.

Where the machine cannot run real nodes at all (not root, no cgroup v1) the tests are skipped
with the reason; a missing build input FAILS them with the script that builds it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from e2e.sandbox import nodehost
from e2e.sandbox.binaries import BinariesMissingError
from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.realnode import (
    HostUnsupportedError,
    Image,
    InputsMissingError,
    RealNodes,
    StartError,
    check_host,
    find_images,
    find_node_binaries,
    start_real_nodes,
)

REAL_NODE_NAMES = ("real-0", "real-1")


def require_real_nodes() -> None:
    """Skip where real nodes cannot exist; fail, naming the script, where an input is missing."""
    try:
        check_host()
        find_node_binaries()
    except HostUnsupportedError as exc:
        pytest.skip(f"real nodes cannot run on this machine: {exc}")
    except InputsMissingError as exc:
        pytest.fail(f"real-node input missing: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def real_images() -> dict[str, Image]:
    require_real_nodes()
    try:
        return find_images()
    except InputsMissingError as exc:
        pytest.fail(f"real-node images missing: {exc}", pytrace=False)


@pytest.fixture(scope="module")
def real_nodes(sandbox: ControlPlane, real_images: dict[str, Image]) -> Iterator[RealNodes]:
    try:
        nodes = start_real_nodes(sandbox, REAL_NODE_NAMES)
    except (InputsMissingError, BinariesMissingError) as exc:
        pytest.fail(f"real-node input missing: {exc}", pytrace=False)
    except (StartError, nodehost.HostError) as exc:
        pytest.fail(f"real nodes did not start: {exc}", pytrace=False)
    try:
        yield nodes
    finally:
        left = nodes.stop()
        assert not left, f"real nodes left behind after stop: {', '.join(left)}"
