"""A kubelet's identity for a sandbox node: a client certificate for ``system:node:<name>`` in
group ``system:nodes``, signed by the sandbox CA, in a kubeconfig of its own.

With it the agent is judged by the API server exactly like a kubelet: the Node authorizer and
NodeRestriction let it touch only its own Node and Lease, the pods bound to it, the claims those
pods reference, and ResourceSlices selected by ``spec.nodeName=<node>``.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from e2e.sandbox.controlplane import write_kubeconfig

VALIDITY = dt.timedelta(days=2)


def issue_node_cert(pki: Path, node: str, out_dir: Path) -> tuple[Path, Path]:
    """Sign ``<out_dir>/kubelet.crt``/``kubelet.key`` with ``<pki>/ca.crt`` and ``ca.key``."""
    ca_cert = x509.load_pem_x509_certificate((pki / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((pki / "ca.key").read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise TypeError(f"{pki / 'ca.key'} is not an EC key")
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:nodes"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"system:node:{node}"),
        ]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    crt, pem = out_dir / "kubelet.crt", out_dir / "kubelet.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    pem.chmod(0o600)
    return crt, pem


def node_kubeconfig(pki: Path, server: str, node: str, out_dir: Path) -> Path:
    """A kubeconfig for ``system:node:<node>`` against ``server``."""
    crt, key = issue_node_cert(pki, node, out_dir)
    return write_kubeconfig(
        out_dir / "kubelet.kubeconfig", server, pki / "ca.crt", crt, key, f"system:node:{node}"
    )
