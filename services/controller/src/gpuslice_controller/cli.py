"""``gpuslice-controller``: flags (each with an environment variable) → a frozen ``Settings``,
and the entry point. Nothing past this module sees the parsed arguments."""

from __future__ import annotations

import argparse
import datetime as dt
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuslice_api.names import GPU_CLASS, MIG_CLASS
from gpuslice_controller import __version__
from gpuslice_controller.admission.dialects import Dialects, HamiNames
from gpuslice_core.cli import EnvArgumentParser, add_log_flags, positive_seconds, seconds_or_off
from gpuslice_core.logging import configure, get_logger
from gpuslice_view.live import NODE_SELECTOR

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(d|h|m|s)")
_UNITS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}


def duration(value: str) -> dt.timedelta:
    """A duration such as ``8760h``, ``90d`` or ``1h30m`` (d, h, m, s), for argparse."""
    text = value.strip()
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"{value!r} is not a duration; examples: 8760h, 90d, 1h30m, 45s")
    seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    if seconds <= 0:
        raise ValueError(f"{value!r} must be longer than zero")
    return dt.timedelta(seconds=seconds)


def names(value: str) -> tuple[str, ...]:
    """A comma-separated list of names."""
    return tuple(n.strip() for n in value.split(",") if n.strip())


@dataclass(frozen=True)
class Settings:
    """Everything the controller is told at start, checked (``ValueError`` names the flag).
    The defaults are the flags' (``build_parser``)."""

    kubeconfig: str | None
    namespace: str
    identity: str
    webhook_addr: str
    metrics_addr: str
    tls_secret: str
    manage_certificates: bool
    cert_hosts: tuple[str, ...]
    cert_dir: Path
    ca_validity: dt.timedelta
    cert_validity: dt.timedelta
    cert_check_interval: float
    validating_webhooks: tuple[str, ...]
    mutating_webhooks: tuple[str, ...]
    apiservices: tuple[str, ...]
    leader_elect: bool
    lease_name: str
    cluster_view: bool
    claim_node_labels: bool
    view_auth_ttl: float
    aggregated_api: bool
    live_usage_interval: float
    live_usage_timeout: float
    enforcer_namespace: str
    enforcer_selector: str
    event_interval: float
    gpu_device_classes: tuple[str, ...]
    mig_device_classes: tuple[str, ...]
    resource_api: str
    log_level: str
    log_format: str = "json"
    hami: HamiNames = HamiNames()  # noqa: RUF009 - frozen, never mutated

    def __post_init__(self) -> None:
        try:
            Dialects.of(self.hami)
        except ValueError as exc:  # a renamed HAMi resource that another dialect owns
            raise ValueError(f"--hami-resource-*: {exc}") from None
        if self.manage_certificates and not self.cert_hosts:
            raise ValueError(
                "--manage-certificates needs --cert-hosts (the names the API server calls)"
            )
        if not self.gpu_device_classes:
            raise ValueError("--gpu-device-classes needs at least one DeviceClass")


def settings_from(args: argparse.Namespace) -> Settings:
    return Settings(
        kubeconfig=args.kubeconfig or None,
        namespace=args.namespace,
        identity=args.identity,
        webhook_addr=args.webhook_addr,
        metrics_addr=args.metrics_addr,
        tls_secret=args.tls_secret,
        manage_certificates=args.manage_certificates,
        cert_hosts=tuple(args.cert_hosts),
        cert_dir=Path(args.cert_dir),
        ca_validity=args.ca_validity,
        cert_validity=args.cert_validity,
        cert_check_interval=args.cert_check_interval,
        validating_webhooks=tuple(args.validating_webhooks),
        mutating_webhooks=tuple(args.mutating_webhooks),
        apiservices=tuple(args.apiservices),
        leader_elect=args.leader_elect,
        lease_name=args.lease_name,
        cluster_view=args.cluster_view,
        claim_node_labels=args.claim_node_labels,
        view_auth_ttl=args.view_auth_ttl,
        aggregated_api=args.aggregated_api,
        live_usage_interval=args.live_usage_interval,
        live_usage_timeout=args.live_usage_timeout,
        enforcer_namespace=args.enforcer_namespace,
        enforcer_selector=args.enforcer_selector,
        event_interval=args.event_interval,
        gpu_device_classes=tuple(args.gpu_device_classes),
        mig_device_classes=tuple(args.mig_device_classes),
        resource_api=args.resource_api,
        log_level=args.log_level,
        log_format=args.log_format,
        hami=HamiNames(
            resource_name=args.hami_resource_name,
            resource_mem=args.hami_resource_mem,
            resource_mem_percentage=args.hami_resource_mem_percentage,
            resource_cores=args.hami_resource_cores,
            resource_priority=args.hami_resource_priority,
            default_mem=args.hami_default_mem,
            default_cores=args.hami_default_cores,
            default_gpu_num=args.hami_default_gpu_num,
        ),
    )


def build_parser() -> EnvArgumentParser:
    p = EnvArgumentParser(
        prog="gpuslice-controller",
        description=(
            "The cluster side of gpuslice: admission webhooks that check ResourceClaims for"
            " gpuslice's GPUs at the door and turn the pod specs of other GPU-sharing systems"
            " (HAMi, gpushare, vCUDA, qGPU, Volcano) into DRA claims. Every replica serves the"
            " webhooks; the leader (a coordination.k8s.io Lease) manages their certificates."
        ),
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_flag(
        "--kubeconfig",
        env="KUBECONFIG",
        help="Path of a kubeconfig; the pod's service account is used when it is not given.",
    )
    p.add_flag(
        "--namespace",
        deprecated=["POD_NAMESPACE"],
        default="gpuslice",
        help="Namespace of the controller's Lease and of the Secret with its certificates.",
    )
    p.add_flag(
        "--identity",
        deprecated=["POD_NAME"],
        default="",
        help=(
            "This replica's name in the Lease (the pod name in the chart); the host name and"
            " process id when empty."
        ),
    )
    p.add_flag(
        "--webhook-addr",
        deprecated=["WEBHOOK_ADDR"],
        default=":9443",
        help="host:port of the HTTPS server for the webhooks (/validate, /mutate) and probes.",
    )
    p.add_flag(
        "--metrics-addr",
        deprecated=["METRICS_ADDR"],
        default=":9090",
        help="host:port of the Prometheus metrics endpoint (/metrics); empty turns it off.",
    )
    p.add_flag(
        "--tls-secret",
        deprecated=["TLS_SECRET"],
        default="gpuslice-controller-tls",
        help=(
            "Secret (in --namespace) with the webhook's certificate: tls.crt, tls.key and"
            " ca.crt; written by the controller with --manage-certificates, by cert-manager"
            " otherwise."
        ),
    )
    p.add_bool_flag(
        "--manage-certificates",
        deprecated=["MANAGE_CERTIFICATES"],
        default=True,
        help=(
            "Generate a private CA and serving certificate into --tls-secret, renew them before"
            " they expire, and publish the CA bundle to the webhook configurations. Turn off"
            " when cert-manager issues the certificate and injects the CA bundle."
        ),
    )
    p.add_flag(
        "--cert-hosts",
        deprecated=["CERT_HOSTS"],
        type=names,
        default=(),
        help=(
            "Comma-separated DNS names and IP addresses the serving certificate is for; the"
            " first is its common name. The chart passes the Service's names"
            " (<service>.<namespace>.svc and .svc.cluster.local)."
        ),
    )
    p.add_flag(
        "--cert-dir",
        deprecated=["CERT_DIR"],
        default="/run/gpuslice-controller/certs",
        help="Private directory where the serving certificate is written for the TLS stack.",
    )
    p.add_flag(
        "--ca-validity",
        deprecated=["CA_VALIDITY"],
        type=duration,
        default=duration("87600h"),
        help="Lifetime of a generated CA (d, h, m, s); it is replaced with a third left.",
    )
    p.add_flag(
        "--cert-validity",
        deprecated=["CERT_VALIDITY"],
        type=duration,
        default=duration("8760h"),
        help="Lifetime of a generated serving certificate; it is renewed with a third left.",
    )
    p.add_flag(
        "--cert-check-interval",
        deprecated=["CERT_CHECK_INTERVAL"],
        type=positive_seconds,
        default=3600.0,
        help="Seconds between the leader's checks of the certificates and the CA bundles.",
    )
    p.add_flag(
        "--validating-webhooks",
        deprecated=["VALIDATING_WEBHOOKS"],
        type=names,
        default=("gpuslice-controller",),
        help="Comma-separated ValidatingWebhookConfigurations whose caBundle the leader keeps.",
    )
    p.add_flag(
        "--mutating-webhooks",
        deprecated=["MUTATING_WEBHOOKS"],
        type=names,
        default=("gpuslice-controller",),
        help="Comma-separated MutatingWebhookConfigurations whose caBundle the leader keeps.",
    )
    p.add_flag(
        "--apiservices",
        type=names,
        default=(),
        help=(
            "Comma-separated APIServices (the aggregated API's, v1alpha1.view.gpuslice.dev)"
            " whose spec.caBundle the leader keeps and readiness waits for, like the webhook"
            " configurations'."
        ),
    )
    p.add_bool_flag(
        "--leader-elect",
        deprecated=["LEADER_ELECT"],
        default=True,
        help="Take part in leader election; without it this replica always acts as the leader.",
    )
    p.add_flag(
        "--lease-name",
        deprecated=["LEASE_NAME"],
        default="gpuslice-controller",
        help="Name of the coordination.k8s.io Lease (in --namespace) the replicas compete for.",
    )
    p.add_bool_flag(
        "--cluster-view",
        deprecated=["CLUSTER_VIEW"],
        default=True,
        help=(
            "Hold the cluster view of every GPU (watches of ResourceSlices, ResourceClaims,"
            " pods, DeviceClasses and DeviceTaintRules) and serve it: the per-GPU and per-claim"
            " metrics, the /view/ endpoints and, on the leader, Events on unschedulable pods."
        ),
    )
    p.add_bool_flag(
        "--claim-node-labels",
        deprecated=["CLAIM_NODE_LABELS"],
        default=True,
        help=(
            "On the leader, label every allocated ResourceClaim of this driver with its node"
            " (gpu.gpuslice.dev/node), so that each node's kubelet plugin watches its own"
            " claims only; needs patch on resourceclaims."
        ),
    )
    p.add_flag(
        "--view-auth-ttl",
        deprecated=["VIEW_AUTH_TTL"],
        type=positive_seconds,
        default=10.0,
        help=(
            "Seconds a token that passed its TokenReview and SubjectAccessReview is trusted by"
            " the /view/ endpoints before it is reviewed again."
        ),
    )
    p.add_bool_flag(
        "--aggregated-api",
        default=False,
        help=(
            "Serve the cluster view's GPUs as the aggregated API gpus.view.gpuslice.dev on the"
            " HTTPS server (kubectl get gpus), for the API server's front proxy only: needs the"
            " cluster view, read access to kube-system/extension-apiserver-authentication and"
            " an APIService pointing at this controller (docs/view-api.md)."
        ),
    )
    p.add_flag(
        "--live-usage-interval",
        deprecated=["LIVE_USAGE_INTERVAL"],
        type=seconds_or_off,
        default=15.0,
        help=(
            "Seconds between two scrapes of every enforcer's metrics, whose memory and SM use"
            " per share the cluster view shows against the limits; 0 turns live usage off."
        ),
    )
    p.add_flag(
        "--live-usage-timeout",
        deprecated=["LIVE_USAGE_TIMEOUT"],
        type=positive_seconds,
        default=2.0,
        help="Seconds one enforcer may take to answer before its node's usage shows as unknown.",
    )
    p.add_flag(
        "--enforcer-namespace",
        deprecated=["ENFORCER_NAMESPACE"],
        default="",
        help="Namespace of the node pods whose enforcers are scraped; --namespace when empty.",
    )
    p.add_flag(
        "--enforcer-selector",
        deprecated=["ENFORCER_SELECTOR"],
        default=NODE_SELECTOR,
        help=(
            "Label selector of the node pods; each is scraped at its pod IP on the container"
            " port named 'enforcer'."
        ),
    )
    p.add_flag(
        "--event-interval",
        deprecated=["EVENT_INTERVAL"],
        type=positive_seconds,
        default=60.0,
        help=(
            "Seconds between two GpuUnschedulable Events with the same reason on one pod (the"
            " second counts the first up); a changed reason is posted at once."
        ),
    )
    p.add_flag(
        "--gpu-device-classes",
        deprecated=["GPU_DEVICE_CLASSES"],
        type=names,
        default=(GPU_CLASS,),
        help="Comma-separated DeviceClasses that select the driver's whole (shareable) GPUs.",
    )
    p.add_flag(
        "--mig-device-classes",
        deprecated=["MIG_DEVICE_CLASSES"],
        type=names,
        default=(MIG_CLASS,),
        help="Comma-separated DeviceClasses that select the driver's MIG devices.",
    )
    p.add_flag(
        "--resource-api",
        deprecated=["RESOURCE_API"],
        default="auto",
        choices=("auto", "v1", "v1beta2", "v1beta1"),
        help=(
            "resource.k8s.io version for ResourceSlices and the claim templates the pod webhook"
            " makes; auto picks the newest the API server serves."
        ),
    )
    _add_hami_flags(p)
    add_log_flags(p)
    return p


def _add_hami_flags(p: EnvArgumentParser) -> None:
    """HAMi's chart values that rename its resources and set its defaults, one flag each, so a
    renamed HAMi install is translated (controller.webhook.pods.hami in the chart)."""
    default = HamiNames()
    for value, resource, what in (
        ("resourceName", "resource-name", "the number of vGPUs"),
        ("resourceMem", "resource-mem", "MiB of memory per vGPU"),
        ("resourceMemPercentage", "resource-mem-percentage", "percent of each GPU's memory"),
        ("resourceCores", "resource-cores", "percent of each GPU's SMs"),
        ("resourcePriority", "resource-priority", "the task priority (removed, with a warning)"),
    ):
        p.add_flag(
            f"--hami-{resource}",
            default=getattr(default, resource.replace("-", "_")),
            help=f"HAMi's {value}: the extended resource for {what}.",
        )
    p.add_flag(
        "--hami-default-mem",
        type=int,
        default=default.default_mem,
        help=(
            "HAMi's defaultMem: MiB per vGPU for a HAMi container that names neither memory"
            " resource; 0 gives it all of each GPU's memory."
        ),
    )
    p.add_flag(
        "--hami-default-cores",
        type=int,
        default=default.default_cores,
        help=(
            "HAMi's defaultCores: percent of the SMs for a HAMi container that names no cores;"
            " 0 sets no limit."
        ),
    )
    p.add_flag(
        "--hami-default-gpu-num",
        type=int,
        default=default.default_gpu_num,
        help=(
            "HAMi's defaultGPUNum: vGPUs for a HAMi container that asks for memory or cores"
            " without a count."
        ),
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from(args)
    except ValueError as exc:
        configure(component="controller", level=args.log_level, log_format=args.log_format)
        get_logger(__name__).error("cannot start", error=str(exc))
        return 1
    from gpuslice_controller.app import run  # the API client is imported only to run

    return run(settings)


if __name__ == "__main__":
    sys.exit(main())
