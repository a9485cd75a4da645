"""Live usage: the enforcers' metrics parsed, found, scraped over real HTTP on loopback (one
target slow, one dead), and joined into the view's rows."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from gpuslice_testkit.view import GIB, claim, gpu, resource_slice, result
from gpuslice_view import live, report
from gpuslice_view.live import LivePoller, NodeLive, ShareLive, Target
from gpuslice_view.model import ClusterView

pytestmark = pytest.mark.timeout(30)
SHARE = ["claim_uid", "gpu", "UUID"]


def enforcer_text(*shares: tuple[str, str, str, int, float]) -> str:
    """Metrics text as the enforcer writes it (the same client, the same family names)."""
    r = CollectorRegistry()
    p = "gpuslice_enforcer_share"
    used = Gauge(f"{p}_memory_used_bytes", "m", SHARE, registry=r)
    limit = Gauge(f"{p}_memory_limit_bytes", "m", SHARE, registry=r)
    sm = Gauge(f"{p}_sm_ratio", "s", SHARE, registry=r)
    sm_limit = Gauge(f"{p}_sm_limit_ratio", "s", SHARE, registry=r)
    Gauge("gpuslice_enforcer_other", "o", registry=r).set(5)
    for _namespace, name, uuid, memory, percent in shares:
        labels = ("uid-" + name, uuid.removeprefix("GPU-"), uuid)
        used.labels(*labels).set(memory)
        limit.labels(*labels).set(20 * GIB)
        sm.labels(*labels).set(percent / 100)
        sm_limit.labels(*labels).set(0.3)
    return generate_latest(r).decode()


def test_parse_keeps_one_record_per_share() -> None:
    text = enforcer_text(("ml", "a", "GPU-0", 3 * GIB, 25.5), ("ml", "b", "GPU-0", GIB, 0))
    assert live.parse(text) == {
        ("uid-a", "GPU-0"): ShareLive(3 * GIB, 20 * GIB, 25.5, 30),
        ("uid-b", "GPU-0"): ShareLive(GIB, 20 * GIB, 0, 30),
    }
    assert live.parse("") == {}


class FakePods:
    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self.pods = pods
        self.asked: list[tuple[str, str | None]] = []

    def list(self, path: str, *, label_selector: str | None = None) -> dict[str, Any]:
        self.asked.append((path, label_selector))
        return {"items": self.pods}


def node_pod(node: str, ip: str, *, port: int = 9402, created: str = "2025-01-01T00:00:00Z",
             phase: str = "Running") -> dict[str, Any]:  # fmt: skip
    ports = [{"name": "plugin", "containerPort": 9400}, {"name": "enforcer", "containerPort": port}]
    return {
        "metadata": {"creationTimestamp": created},
        "spec": {"nodeName": node, "containers": [{"name": "enforcer", "ports": ports}]},
        "status": {"phase": phase, "podIP": ip},
    }


def test_discover_takes_running_node_pods_at_the_enforcer_port() -> None:
    pods = FakePods(
        [
            node_pod("b", "10.0.0.2"),
            node_pod("a", "10.0.0.1", created="2025-01-01T00:00:00Z"),
            node_pod("a", "10.0.0.9", created="2025-01-02T00:00:00Z"),  # the rollout's new one
            node_pod("c", "fd00::3", port=9500),
            node_pod("d", "10.0.0.4", phase="Pending"),
        ]
    )
    found = live.discover(pods, "gpuslice", "app=x")  # type: ignore[arg-type]
    assert found == [
        Target("a", "http://10.0.0.9:9402/metrics"),
        Target("b", "http://10.0.0.2:9402/metrics"),
        Target("c", "http://[fd00::3]:9500/metrics"),
    ]
    assert pods.asked == [("/api/v1/namespaces/gpuslice/pods", "app=x")]


@pytest.fixture
def servers() -> Iterator[dict[str, ThreadingHTTPServer]]:
    """Two enforcer stand-ins on loopback: ``fast`` answers at once, ``slow`` after 3 s."""
    text = enforcer_text(("ml", "a", "GPU-A", 3 * GIB, 25)).encode()

    def handler(delay: float) -> type[BaseHTTPRequestHandler]:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                time.sleep(delay)
                self.send_response(200)
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            def log_message(self, *args: object) -> None:
                pass

        return Handler

    made = {
        "fast": ThreadingHTTPServer(("127.0.0.1", 0), handler(0)),
        "slow": ThreadingHTTPServer(("127.0.0.1", 0), handler(3)),
    }
    for server in made.values():
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield made
    for server in made.values():
        server.shutdown()
        server.server_close()


def url(server: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}/metrics"


def test_a_slow_or_dead_enforcer_stalls_nobody_and_shows_no_numbers(
    servers: dict[str, ThreadingHTTPServer],
) -> None:
    dead = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    dead_url = url(dead)
    dead.server_close()  # nobody listens there now
    targets = [
        Target("fast", url(servers["fast"])),
        Target("slow", url(servers["slow"])),
        Target("dead", dead_url),
    ]
    published: list[dict[str, NodeLive]] = []
    poller = LivePoller(lambda: targets, published.append, interval=1, timeout=0.5)
    began = time.monotonic()
    got = poller.poll_once()
    assert time.monotonic() - began < 2.5  # the slow target's 3 s are not waited for
    assert got["fast"].error == "" and got["fast"].shares[("uid-a", "GPU-A")].sm_used == 25
    assert got["slow"].shares == {} and got["slow"].error  # timed out
    assert got["dead"].shares == {} and got["dead"].error
    assert published == [got]
    targets.pop()  # a node no longer found is dropped
    again = poller.poll_once()
    assert set(again) == {"fast", "slow"} and again["slow"].error


def test_the_view_joins_usage_per_share_and_marks_stale_and_unknown_nodes() -> None:
    view = ClusterView.build(
        slices=[resource_slice("node-a", [gpu(0), gpu(1)]), resource_slice("node-b", [gpu(0)])],
        claims=[
            claim("ml", "a", results=[result("node-a", "gpu-0", cores="30", memory="20Gi")]),
            claim("ml", "b", results=[result("node-a", "gpu-0", cores="20", memory="8Gi")]),
        ],
    )
    uuid = view.find("node-a/0").uuid
    now = 1000.0
    view.live = {
        "node-a": NodeLive(
            "node-a",
            "u",
            now - 2,
            {
                ("uid-a", uuid): ShareLive(3 * GIB, 0, 25),
                # a claim deleted since the scrape: counted on the device, named nowhere
                ("uid-gone", uuid): ShareLive(GIB, 0, 5),
            },
        ),
    }
    rows = {r["ref"]: r for r in (report.gpu_row(view, u, now) for u in view.usage().values())}
    gpu0 = rows["node-a/0"]
    assert gpu0["live"] == {"state": "ok", "memoryUsed": 4 * GIB, "smUsed": 30, "ageSeconds": 2}
    a, b = gpu0["allocations"]
    assert (a["memoryUsed"], a["smUsed"]) == (3 * GIB, 25)
    assert (b["memoryUsed"], b["smUsed"]) == (None, None)  # no series for it: unknown, not 0
    assert rows["node-a/1"]["live"]["memoryUsed"] == 0  # the enforcer answers; nothing runs
    assert rows["node-b/0"]["live"] == {"state": "unknown", "memoryUsed": None, "smUsed": None}
    text = report.describe_gpu(gpu0)
    assert "Used:       4Gi memory, 30% SM (enforcer, 2s ago)" in text
    assert "ml/a    gpu       30%     20Gi     25%       3Gi        -" in text
    table = report.gpu_table(list(rows.values())).splitlines()
    assert table[1].split()[-4:-2] == ["30%", "4Gi"] and table[3].split()[-4:-2] == ["-", "-"]
    claim_a = report.claim_row(view, view.claims[("ml", "a")], now)
    assert claim_a["devices"][0]["memoryUsed"] == 3 * GIB

    later = now + view.live_stale_after + 1
    stale = report.gpu_row(view, view.usage()[view.find("node-a/0").key], later)
    assert stale["live"]["state"] == "stale" and stale["live"]["memoryUsed"] is None
    assert stale["allocations"][0]["memoryUsed"] is None
    view.live = {"node-a": NodeLive("node-a", "u", now, error="timed out")}
    down = report.gpu_row(view, view.usage()[view.find("node-a/0").key], now)
    assert down["live"]["state"] == "unreachable" and down["live"]["error"] == "timed out"
    assert "the enforcer did not answer: timed out" in report.describe_gpu(down)
