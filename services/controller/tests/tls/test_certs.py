"""Certificate decisions with a fake clock: bootstrap, renewal, CA rotation in two steps."""

from __future__ import annotations

import datetime as dt
import ssl
import subprocess
from pathlib import Path

from cryptography import x509

from gpuslice_controller.tls import certs

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
DAY = dt.timedelta(days=1)
POLICY = certs.Policy(
    hosts=("gpuslice-controller.gpuslice.svc", "127.0.0.1"),
    ca_validity=90 * DAY,
    serving_validity=30 * DAY,
)


def _cas(material: certs.Material) -> list[x509.Certificate]:
    return material.cas()


def test_bootstrap_makes_a_chain_the_tls_stack_accepts(tmp_path: Path) -> None:
    step = certs.next_step(None, POLICY, dt.datetime.now(dt.UTC), bundle_published=False)
    assert step.material is not None and step.reason == "no certificate yet"
    m = step.material
    assert certs.signed_by(m.serving(), _cas(m)[0])
    assert certs.hosts_of(m.serving()) == set(POLICY.hosts)
    # The server side loads it; a client that trusts ca.crt verifies it (openssl, no network).
    (tmp_path / "tls.crt").write_bytes(m.cert)
    (tmp_path / "tls.key").write_bytes(m.key)
    (tmp_path / "ca.crt").write_bytes(m.ca_certs)
    ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(
        tmp_path / "tls.crt", tmp_path / "tls.key"
    )
    out = subprocess.run(
        ["openssl", "verify", "-CAfile", str(tmp_path / "ca.crt"), str(tmp_path / "tls.crt")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_nothing_changes_while_the_certificates_are_fresh() -> None:
    m = certs.bootstrap(POLICY, T0)
    step = certs.next_step(m, POLICY, T0 + 10 * DAY, bundle_published=True)
    assert step.material is None and step.reason == "up to date"


def test_the_serving_certificate_is_renewed_with_a_third_of_its_life_left() -> None:
    m = certs.bootstrap(POLICY, T0)
    assert certs.next_step(m, POLICY, T0 + 19 * DAY, bundle_published=True).material is None
    step = certs.next_step(m, POLICY, T0 + 21 * DAY, bundle_published=True)
    assert step.material is not None and "due for renewal" in step.reason
    assert step.material.ca_certs == m.ca_certs and step.material.cert != m.cert
    assert step.material.serving().not_valid_after_utc > m.serving().not_valid_after_utc


def test_a_new_host_name_gets_a_new_serving_certificate() -> None:
    m = certs.bootstrap(POLICY, T0)
    wider = certs.Policy(
        hosts=(*POLICY.hosts, "webhook.example"), ca_validity=90 * DAY, serving_validity=30 * DAY
    )
    step = certs.next_step(m, wider, T0 + DAY, bundle_published=True)
    assert step.material is not None and "lacks hosts ['webhook.example']" in step.reason
    assert "webhook.example" in certs.hosts_of(step.material.serving())


def test_the_ca_rotates_in_two_steps_so_admission_never_fails() -> None:
    m = certs.bootstrap(POLICY, T0)
    when = T0 + 61 * DAY  # under a third of the CA's 90 days left
    # Step 1: a new CA joins the bundle; the serving certificate stays (still trusted).
    step = certs.next_step(m, POLICY, when, bundle_published=True)
    assert step.material is not None and "new CA joins the bundle" in step.reason
    joined = step.material
    assert len(_cas(joined)) == 2 and joined.cert == m.cert
    # Until the bundle with both CAs is published, no certificate from the new CA is served.
    waiting = certs.next_step(joined, POLICY, when, bundle_published=False)
    assert waiting.material is None and "waiting for the CA bundle" in waiting.reason
    # Step 2: once published, the serving certificate comes from the new CA.
    step = certs.next_step(joined, POLICY, when, bundle_published=True)
    assert step.material is not None
    assert certs.signed_by(step.material.serving(), _cas(joined)[1])
    # Step 3: when the old CA expires it leaves the bundle.
    later = certs.next_step(step.material, POLICY, T0 + 91 * DAY, bundle_published=True)
    assert later.material is not None and later.reason == "expired CAs leave the bundle"
    assert len(_cas(later.material)) == 1


def test_a_serving_certificate_never_outlives_its_ca() -> None:
    ca_cert, ca_key = certs.new_ca(T0, 10 * DAY)
    cert, _ = certs.issue(ca_cert, ca_key, ["a.example"], T0, 365 * DAY)
    assert x509.load_pem_x509_certificate(cert).not_valid_after_utc <= T0 + 10 * DAY


def test_unreadable_or_expired_material_starts_over() -> None:
    m = certs.bootstrap(POLICY, T0)
    garbage = certs.Material(b"not a pem", m.ca_key, m.cert, m.key)
    step = certs.next_step(garbage, POLICY, T0, bundle_published=True)
    assert step.material is not None and "do not parse" in step.reason
    step = certs.next_step(m, POLICY, T0 + 100 * DAY, bundle_published=True)
    assert step.material is not None and step.reason == "the CA has expired"


def test_bundle_trust_is_checked_by_fingerprint() -> None:
    m = certs.bootstrap(POLICY, T0)
    other = certs.bootstrap(POLICY, T0)
    assert certs.bundle_trusts(m.ca_certs, m)
    assert certs.bundle_trusts(other.ca_certs + m.ca_certs, m)
    assert not certs.bundle_trusts(other.ca_certs, m)
    assert not certs.bundle_trusts(None, m)
    assert not certs.bundle_trusts(b"junk", m)


def test_secret_data_round_trip() -> None:
    m = certs.bootstrap(POLICY, T0)
    assert certs.Material.from_secret_data(m.secret_data()) == m
    partial = {k: v for k, v in m.secret_data().items() if k != certs.CA_KEY}
    assert certs.Material.from_secret_data(partial) is None
