"""The controller as a local process, for the tests that run it: its readiness (/readyz), and the
controller serving the cluster view on loopback (no webhooks, no leader election) with its
metrics and /view/ endpoints (controller/, view/)."""

from __future__ import annotations

import contextlib
import json
import os
import ssl
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from e2e.sandbox import procs
from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.nodeagent.testing import wait_for
from gpuslice_kube.raw import RawApi, resource_path

BIN = Path(sys.executable).parent


def readyz(port: int, host: str = procs.LOOPBACK) -> str | None:
    """What /readyz answers ("ok\n" or "waiting for …"); None while nothing answers."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # readiness only; the API server checks the chain
    try:
        with urllib.request.urlopen(
            f"https://{host}:{port}/readyz", context=ctx, timeout=2
        ) as answer:
            return str(answer.read().decode())
    except urllib.error.HTTPError as exc:
        return str(exc.read().decode())
    except OSError:
        return None


def ready(port: int, host: str = procs.LOOPBACK) -> bool:
    return readyz(port, host) == "ok\n"


Sample = tuple[str, tuple[tuple[str, str], ...]]


def parse_samples(text: str) -> dict[Sample, float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@dataclass
class Controller:
    port: int
    metrics_port: int
    log: Path
    stop: Callable[[], object]
    host: str = procs.LOOPBACK

    def get(self, path: str, token: str | None) -> tuple[int, Any]:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE  # the controller's own CA; not what is tested here
        request = urllib.request.Request(f"https://{self.host}:{self.port}{path}")
        if token is not None:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, context=ctx, timeout=10) as r:
                return int(r.status), json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def metrics(self) -> dict[Sample, float]:
        """The open metrics port, as anyone on the network reads it."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                text = r.read().decode()
        except urllib.error.URLError:
            return {}  # not listening yet
        return parse_samples(text)

    def claim_metrics(self, token: str | None) -> tuple[int, dict[Sample, float]]:
        """``GET /view/metrics`` with ``token``: (status, samples)."""
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        request = urllib.request.Request(f"https://{self.host}:{self.port}/view/metrics")
        if token is not None:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, context=ctx, timeout=10) as r:
                return int(r.status), parse_samples(r.read().decode())
        except urllib.error.HTTPError as exc:
            return exc.code, {}


@contextlib.contextmanager
def running_controller(
    sandbox: ControlPlane,
    ns: str,
    root: Path,
    *,
    host: str = procs.LOOPBACK,
    cert_hosts: tuple[str, ...] = (),
    args: tuple[str, ...] = (),
) -> Iterator[Controller]:
    """The controller as a process (no webhooks, no election; its HTTPS server on ``host``,
    loopback by default, with a certificate for ``host`` and ``cert_hosts``, and ``args``
    added) once its view has synced and it is ready; stopped on leaving (``Controller.stop``
    stops it earlier)."""
    port, metrics_port = procs.free_port(), procs.free_port()
    hosts = ",".join(dict.fromkeys((host, *cert_hosts)))
    argv = [
        str(BIN / "gpuslice-controller"),
        *("--kubeconfig", str(sandbox.kubeconfig), "--namespace", ns, "--identity", "view-0"),
        *("--webhook-addr", f"{host}:{port}", "--metrics-addr", f"127.0.0.1:{metrics_port}"),
        *("--tls-secret", "view-tls", "--cert-hosts", hosts),
        *("--cert-dir", str(root / "certs"), "--no-leader-elect"),
        *("--validating-webhooks", "", "--mutating-webhooks", ""),
        *("--event-interval", "5", "--log-level", "debug"),
        *args,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = root / "controller.log"
    proc = procs.start("controller", argv, log, env, cwd=Path.cwd(), die_with_parent=True)
    ctl = Controller(port, metrics_port, log, stop=lambda: procs.stop([proc], grace=10), host=host)
    try:
        wait_for(
            lambda: ctl.metrics().get(("gpuslice_view_synced", ())) == 1 or None,
            60,
            "the controller's view to sync",
        )
        # and ready: its serving certificate is loaded from the TLS Secret the leader writes
        # (tests read that Secret's CA; the view can sync before the first write)
        wait_for(lambda: ready(port, host) or None, 60, "the controller to be ready")
        yield ctl
    finally:
        ctl.stop()
        print(log.read_text()[-6000:])


def token(kube: RawApi, ns: str, account: str) -> str:
    kube.create(
        resource_path("v1", "serviceaccounts", namespace=ns),
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account}},
    )
    path = resource_path("v1", "serviceaccounts", namespace=ns, name=account) + "/token"
    made = kube.create(path, {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest"})
    return str(made["status"]["token"])
