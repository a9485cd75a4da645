"""Readiness waits for the CA bundle in every webhook configuration (``bundleready``)."""

from __future__ import annotations

import base64
import datetime as dt
from typing import cast

from gpuslice_controller.tls import certs
from gpuslice_controller.tls.bundleready import BundleReadiness, chain_trusted
from gpuslice_controller.tls.rotation import WebhookConfigs
from gpuslice_kube.raw import Obj, RawApi

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
POLICY = certs.Policy(("ctl.ns.svc",))
VALIDATING = "validatingwebhookconfigurations/ctl"
MUTATING = "mutatingwebhookconfigurations/ctl"


def config(*bundles: bytes | None) -> Obj:
    hooks = []
    for i, bundle in enumerate(bundles):
        client: Obj = {"service": {"name": "ctl"}}
        if bundle is not None:
            client["caBundle"] = base64.b64encode(bundle).decode()
        hooks.append({"name": f"h{i}.gpu.gpuslice.dev", "clientConfig": client})
    return {"metadata": {"name": "ctl"}, "webhooks": hooks}


def test_the_served_chain_must_lead_to_a_certificate_of_the_bundle() -> None:
    ours = certs.bootstrap(POLICY, NOW)
    other = certs.bootstrap(POLICY, NOW)
    assert chain_trusted(ours.cert, ours.ca_certs)
    assert chain_trusted(ours.cert, other.ca_certs + ours.ca_certs)  # a bundle during rotation
    assert not chain_trusted(ours.cert, other.ca_certs)
    assert not chain_trusted(ours.cert, b"not pem")
    # cert-manager: a self-signed serving certificate is its own bundle
    assert chain_trusted(ours.ca_certs, ours.ca_certs)
    # an intermediate the server sends along: leaf <- intermediate <- root (the bundle)
    inter_cert, inter_key = certs.issue(
        ours.ca_certs, ours.ca_key, ["inter"], NOW, POLICY.ca_validity
    )
    leaf, _ = certs.issue(inter_cert, inter_key, ["ctl.ns.svc"], NOW, POLICY.serving_validity)
    assert chain_trusted(leaf + inter_cert, ours.ca_certs)
    assert not chain_trusted(leaf, ours.ca_certs)  # without the intermediate: no path


def test_ready_only_once_both_configurations_trust_the_served_certificate() -> None:
    ours = certs.bootstrap(POLICY, NOW)
    served = {"chain": b""}
    ready = BundleReadiness(
        cast(RawApi, None), WebhookConfigs(("ctl",), ("ctl",)), lambda: served["chain"]
    )
    assert ready.waiting_for() == f"{VALIDATING} (not found), {MUTATING} (not found)"
    ready._on_event(VALIDATING, "ADDED", config(None))  # as the chart creates it
    ready._on_event(MUTATING, "ADDED", config(ours.ca_certs))
    served["chain"] = ours.cert
    assert ready.waiting_for() == f"{VALIDATING} (webhook h0.gpu.gpuslice.dev)"
    ready._on_event(VALIDATING, "MODIFIED", config(ours.ca_certs))  # the leader published
    assert ready.ready()
    # one webhook of a configuration without it is enough to wait
    ready._on_event(MUTATING, "MODIFIED", config(ours.ca_certs, None))
    assert ready.waiting_for() == f"{MUTATING} (webhook h1.gpu.gpuslice.dev)"
    ready._on_event(MUTATING, "DELETED", config(ours.ca_certs))
    assert not ready.ready()
    # none configured (the chart's webhooks off, or a development run): nothing to wait for
    assert BundleReadiness(cast(RawApi, None), WebhookConfigs(), lambda: b"").ready()


def test_ready_waits_for_the_apiservice_bundle_too() -> None:
    ours = certs.bootstrap(POLICY, NOW)
    ready = BundleReadiness(
        cast(RawApi, None),
        WebhookConfigs(apiservices=("v1alpha1.view.gpuslice.dev",)),
        lambda: ours.cert,
    )
    key = "apiservices/v1alpha1.view.gpuslice.dev"
    assert ready.waiting_for() == f"{key} (not found)"
    spec: Obj = {"group": "view.gpuslice.dev", "version": "v1alpha1"}
    ready._on_event(
        key, "ADDED", {"metadata": {"name": "v1alpha1.view.gpuslice.dev"}, "spec": spec}
    )
    assert ready.waiting_for() == f"{key} (caBundle)"
    spec = {**spec, "caBundle": base64.b64encode(ours.ca_certs).decode()}
    ready._on_event(
        key, "MODIFIED", {"metadata": {"name": "v1alpha1.view.gpuslice.dev"}, "spec": spec}
    )
    assert ready.ready()
