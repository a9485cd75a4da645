"""A kubelet's identity for a sandbox node: a client certificate for ``system:node:<name>`` in
group ``system:nodes``, signed by the sandbox CA, in a kubeconfig of its own.

With it the agent is judged by the API server exactly like a kubelet: the Node authorizer and
NodeRestriction let it touch only its own Node and Lease, the pods bound to it, the claims those
pods reference, and ResourceSlices selected by ``spec.nodeName=<node>``.
"""

from __future__ import annotations

from pathlib import Path

from e2e.sandbox.controlplane import write_kubeconfig
from gpuslice_testkit.certs import TinyCA


def issue_node_cert(pki: Path, node: str, out_dir: Path) -> tuple[Path, Path]:
    """Sign ``<out_dir>/kubelet.crt``/``kubelet.key`` with the sandbox CA in ``pki``."""
    pair = TinyCA.load(pki).client(
        "kubelet", f"system:node:{node}", ("system:nodes",), out_dir=out_dir
    )
    return pair.cert, pair.key


def node_kubeconfig(pki: Path, server: str, node: str, out_dir: Path) -> Path:
    """A kubeconfig for ``system:node:<node>`` against ``server``."""
    crt, key = issue_node_cert(pki, node, out_dir)
    return write_kubeconfig(
        out_dir / "kubelet.kubeconfig", server, pki / "ca.crt", crt, key, f"system:node:{node}"
    )
