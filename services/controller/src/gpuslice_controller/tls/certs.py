"""The webhook's TLS material: a private CA, a serving certificate, and when to renew them.

Pure functions over PEM bytes and a clock, so rotation is tested with a fake ``now``. The
``rotation`` module stores the result in a Secret and publishes the CA bundle to the webhook
configurations; this module only decides.

The Secret (type ``kubernetes.io/tls``) holds:

``ca.crt``
    every CA certificate still trusted, oldest first: the API server's ``caBundle``.
``ca.key``
    the key of the last CA in ``ca.crt``, the one that signs (older keys are never needed).
``tls.crt`` / ``tls.key``
    the serving certificate, signed by one of the CAs in ``ca.crt``, and its key.

A CA is replaced when less than ``renew_fraction`` of its life is left, in two steps so that
admission never fails: first the new CA is added to ``ca.crt`` and published in every
``caBundle`` (the old serving certificate stays valid and trusted), and only once the bundle is
published is a serving certificate issued from the new CA. Expired CAs leave the bundle.

Keys are ECDSA P-256 (what cert-manager and the Kubernetes webhook examples use by default; a
key takes well under a millisecond to make, an RSA-2048 one about 50 ms).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_CERT = "ca.crt"
CA_KEY = "ca.key"
TLS_CERT = "tls.crt"
TLS_KEY = "tls.key"
ORGANIZATION = "gpuslice"
BACKDATE = dt.timedelta(minutes=1)
"""Certificates are valid from a minute before they are made, for clocks that disagree a
little; lifetimes and renewal are measured from when they were made."""


@dataclass(frozen=True)
class Policy:
    """Lifetimes and names of the certificates the controller makes."""

    hosts: tuple[str, ...]
    """DNS names and IP addresses the serving certificate is for (its SANs)."""
    ca_validity: dt.timedelta = dt.timedelta(days=3650)
    serving_validity: dt.timedelta = dt.timedelta(days=365)
    renew_fraction: float = 1 / 3
    """Renew a certificate once less than this fraction of its lifetime is left."""


@dataclass(frozen=True)
class Material:
    """The Secret's four entries as PEM bytes (``ca_certs``: the bundle, oldest first)."""

    ca_certs: bytes
    ca_key: bytes
    cert: bytes
    key: bytes

    @classmethod
    def from_secret_data(cls, data: Mapping[str, bytes]) -> Material | None:
        """The material in a Secret's (decoded) data, or None when an entry is missing."""
        if not all(data.get(k) for k in (CA_CERT, CA_KEY, TLS_CERT, TLS_KEY)):
            return None
        return cls(data[CA_CERT], data[CA_KEY], data[TLS_CERT], data[TLS_KEY])

    def secret_data(self) -> dict[str, bytes]:
        return {CA_CERT: self.ca_certs, CA_KEY: self.ca_key, TLS_CERT: self.cert, TLS_KEY: self.key}

    def cas(self) -> list[x509.Certificate]:
        return x509.load_pem_x509_certificates(self.ca_certs)

    def serving(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _base(
    subject: str,
    issuer: x509.Name | None,
    now: dt.datetime,
    validity: dt.timedelta,
    public_key: ec.EllipticCurvePublicKey,
) -> x509.CertificateBuilder:
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
            x509.NameAttribute(NameOID.COMMON_NAME, subject),
        ]
    )
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer or name)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + validity)
    )


def new_ca(now: dt.datetime, validity: dt.timedelta) -> tuple[bytes, bytes]:
    """A self-signed CA certificate and its key, as PEM."""
    key = _key()
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    cert = (
        _base(f"gpuslice-controller-ca@{stamp}", None, now, validity, key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _cert_pem(cert), _key_pem(key)


def issue(
    ca_cert: bytes,
    ca_key: bytes,
    hosts: Sequence[str],
    now: dt.datetime,
    validity: dt.timedelta,
) -> tuple[bytes, bytes]:
    """A serving certificate for ``hosts`` signed by the CA, and its key, as PEM."""
    if not hosts:
        raise ValueError("a serving certificate needs at least one host name")
    ca = x509.load_pem_x509_certificate(ca_cert)
    signer = serialization.load_pem_private_key(ca_key, password=None)
    if not isinstance(signer, ec.EllipticCurvePrivateKey):
        raise ValueError("ca.key is not an ECDSA key")
    # A CA whose remaining life is shorter than the requested validity caps the certificate:
    # a certificate must not outlive its issuer.
    validity = min(validity, ca.not_valid_after_utc - now)
    key = _key()
    cert = (
        _base(hosts[0], ca.subject, now, validity, key.public_key())
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(signer.public_key()),
            critical=False,
        )
        .sign(signer, hashes.SHA256())
    )
    return _cert_pem(cert), _key_pem(key)


def bootstrap(policy: Policy, now: dt.datetime) -> Material:
    """Fresh material: a new CA and a serving certificate from it."""
    ca_cert, ca_key = new_ca(now, policy.ca_validity)
    cert, key = issue(ca_cert, ca_key, policy.hosts, now, policy.serving_validity)
    return Material(ca_cert, ca_key, cert, key)


def due(cert: x509.Certificate, now: dt.datetime, fraction: float) -> bool:
    """Whether less than ``fraction`` of ``cert``'s lifetime is left (or it is expired)."""
    start, end = cert.not_valid_before_utc + BACKDATE, cert.not_valid_after_utc
    return end - now < (end - start) * fraction


def hosts_of(cert: x509.Certificate) -> set[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {str(n) for n in san.get_values_for_type(x509.DNSName)} | {
        str(ip) for ip in san.get_values_for_type(x509.IPAddress)
    }


def signed_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


@dataclass(frozen=True)
class Step:
    """What to do next: ``material`` to store (None: keep), and why."""

    material: Material | None
    reason: str


def next_step(
    current: Material | None, policy: Policy, now: dt.datetime, *, bundle_published: bool
) -> Step:
    """The one change the Secret needs now, if any.

    ``bundle_published``: every webhook configuration's ``caBundle`` already trusts every CA in
    ``current.ca_certs`` (a serving certificate from a new CA waits for it).
    """
    if current is None:
        return Step(bootstrap(policy, now), "no certificate yet")
    try:
        cas = current.cas()
        serving = current.serving()
    except ValueError as exc:
        return Step(bootstrap(policy, now), f"the stored certificates do not parse ({exc})")
    newest = cas[-1]
    if newest.not_valid_after_utc <= now:
        return Step(bootstrap(policy, now), "the CA has expired")
    live = [ca for ca in cas if ca.not_valid_after_utc > now]
    if due(newest, now, policy.renew_fraction):
        ca_cert, ca_key = new_ca(now, policy.ca_validity)
        bundle = b"".join(_cert_pem(c) for c in live) + ca_cert
        return Step(
            Material(bundle, ca_key, current.cert, current.key),
            "the CA is due for renewal: a new CA joins the bundle",
        )
    if len(live) < len(cas):
        bundle = b"".join(_cert_pem(c) for c in live)
        return Step(
            Material(bundle, current.ca_key, current.cert, current.key),
            "expired CAs leave the bundle",
        )
    reason = _serving_reason(serving, newest, policy, now)
    if reason is None:
        return Step(None, "up to date")
    if not bundle_published:
        return Step(None, f"{reason}; waiting for the CA bundle to be published first")
    cert, key = issue(_cert_pem(newest), current.ca_key, policy.hosts, now, policy.serving_validity)
    return Step(Material(current.ca_certs, current.ca_key, cert, key), reason)


def _serving_reason(
    serving: x509.Certificate, newest: x509.Certificate, policy: Policy, now: dt.datetime
) -> str | None:
    if not signed_by(serving, newest):
        return "the serving certificate is not from the newest CA"
    if due(serving, now, policy.renew_fraction):
        return "the serving certificate is due for renewal"
    missing = set(policy.hosts) - hosts_of(serving)
    if missing:
        return f"the serving certificate lacks hosts {sorted(missing)}"
    return None


def bundle_trusts(published: bytes | None, material: Material) -> bool:
    """Whether a published ``caBundle`` contains every CA of ``material``."""
    if not published:
        return False
    try:
        have = {c.fingerprint(hashes.SHA256()) for c in x509.load_pem_x509_certificates(published)}
    except ValueError:
        return False
    return all(c.fingerprint(hashes.SHA256()) in have for c in material.cas())
