"""Certificates and keys for tests: a tiny CA, serving certificates, client certificates and
the service-account signing key (ECDSA P-256, like envtest). The sandbox's control plane and
nodes use it, and so do unit tests that need TLS (kubectl gpuslice's kubeconfig tests)."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = dt.timedelta(days=7)
LOOPBACK_DNS = ("localhost",)
LOOPBACK_IPS = ("127.0.0.1",)
# Names in-cluster clients use for the API server, plus the first service IP of 10.0.0.0/24.
APISERVER_DNS = (
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)
APISERVER_IPS = ("10.0.0.1",)


@dataclass(frozen=True)
class CertPair:
    """A PEM certificate and its PEM (PKCS#8, unencrypted) private key on disk."""

    cert: Path
    key: Path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write(path: Path, data: bytes, mode: int = 0o600) -> Path:
    path.write_bytes(data)
    path.chmod(mode)
    return path


def _name(common_name: str, organizations: tuple[str, ...] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attrs)


class TinyCA:
    """A self-signed CA that issues the sandbox's serving and client certificates."""

    def __init__(self, directory: Path, common_name: str = "gpuslice-sandbox-ca") -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        name = _name(common_name, ("gpuslice-sandbox",))
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False
            )
            .sign(self._key, hashes.SHA256())
        )
        self.pair = CertPair(
            cert=_write(directory / "ca.crt", self._cert.public_bytes(serialization.Encoding.PEM)),
            key=_write(directory / "ca.key", _key_pem(self._key)),
        )

    @classmethod
    def load(cls, directory: Path) -> TinyCA:
        """The CA whose ``ca.crt``/``ca.key`` are in ``directory`` (to issue more certificates,
        e.g. a node agent's kubelet identity)."""
        ca = cls.__new__(cls)
        ca.directory = directory
        ca._cert = x509.load_pem_x509_certificate((directory / "ca.crt").read_bytes())
        key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise TypeError(f"{directory / 'ca.key'} is not an EC key")
        ca._key = key
        ca.pair = CertPair(cert=directory / "ca.crt", key=directory / "ca.key")
        return ca

    @property
    def cert_pem(self) -> bytes:
        return self._cert.public_bytes(serialization.Encoding.PEM)

    def issue(
        self,
        name: str,
        common_name: str,
        *,
        organizations: tuple[str, ...] = (),
        dns_names: tuple[str, ...] = (),
        ip_addresses: tuple[str, ...] = (),
        server: bool = False,
        client: bool = False,
        out_dir: Path | None = None,
    ) -> CertPair:
        """Issue `<name>.crt`/`<name>.key` (in the CA's directory, or ``out_dir``)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        usages = []
        if server:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        if client:
            usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name, organizations))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                critical=False,
            )
        )
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns_names]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        directory = out_dir or self.directory
        directory.mkdir(parents=True, exist_ok=True)
        return CertPair(
            cert=_write(directory / f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM)),
            key=_write(directory / f"{name}.key", _key_pem(key)),
        )

    def serving(
        self, name: str, *, extra_dns: tuple[str, ...] = (), extra_ips: tuple[str, ...] = ()
    ) -> CertPair:
        """A serving certificate valid for localhost and 127.0.0.1 (plus extras)."""
        return self.issue(
            name,
            "localhost",
            dns_names=LOOPBACK_DNS + extra_dns,
            ip_addresses=LOOPBACK_IPS + extra_ips,
            server=True,
        )

    def client(
        self, name: str, user: str, groups: tuple[str, ...] = (), *, out_dir: Path | None = None
    ) -> CertPair:
        """A client certificate: CN is the Kubernetes user name, O entries its groups."""
        return self.issue(name, user, organizations=groups, client=True, out_dir=out_dir)


def service_account_key(directory: Path) -> CertPair:
    """The service-account token signing key (`cert` holds the public key, PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return CertPair(
        cert=_write(directory / "sa.pub", public, 0o644),
        key=_write(directory / "sa.key", _key_pem(key)),
    )
