"""The aggregated API's answers (discovery, list, get, Table, selectors, watch, errors) and the
versioned store under it, with the authorizer and the front proxy's user stubbed; the TLS side
(client certificates) is test_server_frontproxy.py's."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from email.message import Message
from http import HTTPStatus
from typing import Any

import pytest

from gpuslice_controller.view.aggregated import AggregatedApi, Stream, wants_table
from gpuslice_controller.view.auth import Authorizer, Decision
from gpuslice_controller.view.frontproxy import RequestHeaderConfig
from gpuslice_controller.view.gpustore import GpuStore
from gpuslice_testkit import view as t
from gpuslice_view.model import ClusterView

pytestmark = pytest.mark.timeout(10)
GPUS = "/apis/view.gpuslice.dev/v1alpha1/gpus"
TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"
CERT = {"subject": ((("commonName", "front-proxy-client"),),)}
CONFIG = RequestHeaderConfig(b"-", frozenset({"front-proxy-client"}))


def cluster() -> ClusterView:
    return ClusterView.build(
        slices=[
            t.resource_slice("node-a", [t.gpu(0), t.gpu(1), t.mig(2, "1g.10gb", 0, 9856)]),
            t.resource_slice("node-b", [t.gpu(0, model="NVIDIA L4", mib=23034)]),
        ],
        claims=[
            t.claim("ml", "a", results=[t.result("node-a", "gpu-0", cores="80", memory="20Gi")]),
        ],
        classes=t.CLASSES,
    )


class Grants(Authorizer):
    """Allows the verbs in ``verbs``; records what it was asked."""

    def __init__(self, *verbs: str) -> None:
        self.verbs = set(verbs)
        self.asked: list[tuple[str, str, str]] = []
        self.where: list[tuple[str, str, str]] = []  # (resource, namespace, name)

    def check_user(
        self,
        user: dict[str, Any],
        *,
        group: str,
        verb: str,
        resource: str = "gpus",
        namespace: str = "",
        name: str = "",
    ) -> Decision:
        self.asked.append((user["username"], group, verb))
        self.where.append((resource, namespace, name))
        if verb in self.verbs:
            return Decision(HTTPStatus.OK, user=user["username"])
        return Decision(HTTPStatus.FORBIDDEN, message=f"cannot {verb}")


def api(
    source: t.FixedFeeder | None = None, grants: Grants | None = None, **kw: Any
) -> AggregatedApi:
    source = source or t.FixedFeeder(cluster())
    return AggregatedApi(
        GpuStore(source),
        Grants("get", "list", "watch") if grants is None else grants,
        lambda: CONFIG,
        source.synced,
        **kw,
    )


def headers(accept: str = "application/json", user: str = "alice") -> Message:
    message = Message()
    message["Accept"] = accept
    message["X-Remote-User"] = user
    message["X-Remote-Group"] = "devs"
    return message


def get(a: AggregatedApi, target: str, accept: str = "application/json") -> tuple[int, Any]:
    answer = a.get(target, headers(accept), CERT)
    assert not isinstance(answer, Stream)
    return answer.status, json.loads(answer.body)


def test_discovery_names_the_group_version_and_resource() -> None:
    a = api()
    assert get(a, "/apis")[1]["groups"][0]["name"] == "view.gpuslice.dev"
    group = get(a, "/apis/view.gpuslice.dev")[1]
    assert group["preferredVersion"]["groupVersion"] == "view.gpuslice.dev/v1alpha1"
    gpus, claims, reasons = get(a, "/apis/view.gpuslice.dev/v1alpha1")[1]["resources"]
    assert gpus == {
        "name": "gpus",
        "singularName": "gpu",
        "namespaced": False,
        "kind": "GPU",
        "verbs": ["get", "list", "watch"],
    }
    assert claims == {
        "name": "gpuclaims",
        "singularName": "gpuclaim",
        "namespaced": True,
        "kind": "GPUClaim",
        "verbs": ["get", "list", "watch"],
    }
    assert reasons == {
        "name": "gpureasons",
        "singularName": "gpureason",
        "namespaced": True,
        "kind": "GPUReason",
        "verbs": ["get"],
    }
    assert get(a, "/openapi/v2")[0] == 404


def test_list_and_get_as_objects() -> None:
    status, listed = get(api(), GPUS)
    assert status == 200 and listed["kind"] == "GPUList"
    names = [o["metadata"]["name"] for o in listed["items"]]
    assert names == ["node-a.gpu-0", "node-a.gpu-1", "node-a.gpu-2-mig-1g-10gb-0", "node-b.gpu-0"]
    first = listed["items"][0]
    assert first["status"]["allocatedCores"] == 80 and first["spec"]["cores"] == 100
    assert first["metadata"]["labels"]["gpuslice.dev/allocated"] == "true"
    assert int(first["metadata"]["resourceVersion"]) <= int(listed["metadata"]["resourceVersion"])
    status, one = get(api(), f"{GPUS}/node-b.gpu-0")
    assert status == 200 and one["spec"]["model"] == "NVIDIA L4"
    status, missing = get(api(), f"{GPUS}/node-z.gpu-0")
    assert status == 404 and missing["reason"] == "NotFound"
    assert missing["message"] == 'gpus.view.gpuslice.dev "node-z.gpu-0" not found'


def test_tables_for_kubectl_with_wide_columns_at_priority_1() -> None:
    assert wants_table(TABLE) and not wants_table("application/json")
    status, table = get(api(), GPUS, TABLE)
    assert status == 200 and table["kind"] == "Table"
    columns = table["columnDefinitions"]
    assert [c["name"] for c in columns if c["priority"] == 1] == ["UUID", "Pods"]
    row = table["rows"][0]
    assert row["cells"][:4] == ["node-a.gpu-0", "node-a", "NVIDIA H100 80GB HBM3", "80%"]
    assert row["object"]["kind"] == "PartialObjectMetadata"
    assert (
        get(api(), f"{GPUS}?includeObject=Object", TABLE)[1]["rows"][0]["object"]["kind"] == "GPU"
    )


@pytest.mark.parametrize(
    ("selector", "names"),
    [
        ("gpuslice.dev/node=node-b", ["node-b.gpu-0"]),
        ("gpuslice.dev/type=mig", ["node-a.gpu-2-mig-1g-10gb-0"]),
        ("gpuslice.dev/mig-profile", ["node-a.gpu-2-mig-1g-10gb-0"]),
        ("gpuslice.dev/node in (node-a),gpuslice.dev/type!=mig", ["node-a.gpu-0", "node-a.gpu-1"]),
        (
            "gpuslice.dev/model notin (NVIDIA-H100-80GB-HBM3),!gpuslice.dev/mig-profile",
            ["node-b.gpu-0"],
        ),
        ("gpuslice.dev/allocated=true", ["node-a.gpu-0"]),
    ],
)
def test_label_selectors(selector: str, names: list[str]) -> None:
    status, listed = get(api(), f"{GPUS}?labelSelector={selector}")
    assert status == 200
    assert [o["metadata"]["name"] for o in listed["items"]] == names


def test_field_selector_on_the_name_and_400_for_others() -> None:
    _, listed = get(api(), f"{GPUS}?fieldSelector=metadata.name=node-b.gpu-0")
    assert [o["metadata"]["name"] for o in listed["items"]] == ["node-b.gpu-0"]
    status, error = get(api(), f"{GPUS}?fieldSelector=spec.node=node-b")
    assert status == 400 and "metadata.name" in error["message"]
    status, error = get(api(), f"{GPUS}?labelSelector=a b")
    assert status == 400 and error["reason"] == "BadRequest" and "'a b'" in error["message"]


def test_no_user_without_the_certificate_and_each_verb_reviewed() -> None:
    grants = Grants("list")
    a = api(grants=grants)
    no_cert: list[dict[str, Any] | None] = [None, {}]
    for cert in no_cert:
        answer = a.get(GPUS, headers(), cert)
        assert not isinstance(answer, Stream) and answer.status == 401
    other = {"subject": ((("commonName", "someone-else"),),)}
    assert not isinstance(answer := a.get(GPUS, headers(), other), Stream)
    assert answer.status == 401
    assert grants.asked == []  # nothing reviewed for a request without the proxy's certificate
    assert get(a, GPUS)[0] == 200
    status, error = get(a, f"{GPUS}/node-b.gpu-0")
    assert status == 403 and error["reason"] == "Forbidden"
    assert grants.asked == [
        ("alice", "view.gpuslice.dev", "list"),
        ("alice", "view.gpuslice.dev", "get"),
    ]


def test_503_until_the_view_has_synced() -> None:
    status, error = get(api(t.FixedFeeder(cluster(), synced=False)), GPUS)
    assert status == 503 and error["reason"] == "ServiceUnavailable"


def events(stream: Stream, count: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for chunk in stream.chunks:
        if chunk:
            out.append(json.loads(chunk))
        if len(out) == count:
            break
    return out


def watch(a: AggregatedApi, query: str, accept: str = "application/json") -> Stream:
    answer = a.get(f"{GPUS}?watch=true&{query}", headers(accept), CERT)
    assert isinstance(answer, Stream)
    return answer


def test_watch_replays_from_a_version_and_follows_the_selection() -> None:
    source = t.FixedFeeder(cluster())
    a = api(source)
    _, listed = get(a, f"{GPUS}?labelSelector=gpuslice.dev/allocated=true")
    assert [o["metadata"]["name"] for o in listed["items"]] == ["node-a.gpu-0"]
    version = listed["metadata"]["resourceVersion"]
    stream = watch(a, f"labelSelector=gpuslice.dev/allocated=true&resourceVersion={version}")
    # gpu-0's claim gone: out of the selection (DELETED); gpu-1 taken whole: into it (ADDED)
    source.view.apply(
        "ResourceClaim", "ADDED", t.claim("web", "w", results=[t.result("node-a", "gpu-1")])
    )
    source.view.apply("ResourceClaim", "DELETED", t.claim("ml", "a"))
    a.store.refresh()
    seen = events(stream, 2)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in seen] == [
        ("DELETED", "node-a.gpu-0"),
        ("ADDED", "node-a.gpu-1"),
    ]
    assert int(seen[0]["object"]["metadata"]["resourceVersion"]) > int(version)
    stream.release()


def test_watch_starts_with_the_state_as_table_rows_and_ends_in_time() -> None:
    a = api()
    stream = watch(a, "timeoutSeconds=0.2&labelSelector=gpuslice.dev/node=node-b", TABLE)
    everything = [json.loads(c) for c in stream.chunks if c]
    stream.release()
    [added] = everything
    assert added["type"] == "ADDED" and added["object"]["kind"] == "Table"
    assert added["object"]["rows"][0]["cells"][0] == "node-b.gpu-0"
    assert added["object"]["columnDefinitions"]


def test_watch_from_a_version_not_kept_is_410_and_watches_are_capped() -> None:
    source = t.FixedFeeder(cluster())
    store = GpuStore(source, history=2)  # four objects: the first two changes are forgotten
    a = AggregatedApi(store, Grants("watch"), lambda: CONFIG, source.synced, max_watches=1)
    store.refresh()
    stream = watch(a, "resourceVersion=1")
    [error] = events(stream, 1)
    assert error["type"] == "ERROR" and error["object"]["code"] == 410
    assert error["object"]["reason"] == "Expired"
    second = a.get(f"{GPUS}?watch=true", headers(), CERT)
    assert not isinstance(second, Stream) and second.status == 429
    stream.release()
    third = watch(a, "timeoutSeconds=0")
    third.release()


def test_store_versions_only_changes_and_wakes_waiters() -> None:
    source = t.FixedFeeder(cluster())
    store = GpuStore(source, clock=lambda: 1.0)
    first = store.refresh()
    assert first == 1_000_000 + 4  # four objects added
    assert store.refresh() == first  # nothing changed: no new version
    woke = threading.Event()

    def waiter() -> None:
        store.wait(first, 5)
        woke.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    source.view.apply("ResourceSlice", "DELETED", t.resource_slice("node-b", []))
    store.refresh()
    thread.join(5)
    assert woke.is_set()
    [gone] = store.changes_since(first) or []
    assert (gone.type, gone.obj["metadata"]["name"]) == ("DELETED", "node-b.gpu-0")
    assert store.changes_since(first - 10) is None  # before anything kept


def test_a_watch_from_another_replicas_version_misses_no_change() -> None:
    """The API server may list from one replica and watch from another: the watch catches up
    with the current state of what changed around that version, and goes on from there."""
    now = {"t": 100.0}

    def clock(lag: float) -> Callable[[], float]:
        return lambda: now["t"] + lag

    feeders = [t.FixedFeeder(cluster()), t.FixedFeeder(cluster())]
    replicas = [
        AggregatedApi(
            GpuStore(f, clock=clock(lag)),
            Grants("get", "list", "watch"),
            lambda: CONFIG,
            f.synced,
        )
        for f, lag in zip(feeders, (0.0, 0.002), strict=True)
    ]
    for replica in replicas:
        replica.store.refresh()
    _, listed = get(replicas[0], f"{GPUS}?labelSelector=gpuslice.dev/allocated=true")
    now["t"] += 1
    for feeder, replica in zip(feeders, replicas, strict=True):
        taken = t.claim("web", "w", results=[t.result("node-a", "gpu-1")])
        feeder.view.apply("ResourceClaim", "ADDED", taken)
        replica.store.refresh()
    version = listed["metadata"]["resourceVersion"]
    assert not replicas[1].store.ours(int(version))
    stream = watch(
        replicas[1],
        f"labelSelector=gpuslice.dev/allocated=true&resourceVersion={version}&timeoutSeconds=0.1",
    )
    seen = [json.loads(c) for c in stream.chunks if c]
    stream.release()
    assert ("ADDED", "node-a.gpu-1") in [(e["type"], e["object"]["metadata"]["name"]) for e in seen]
    assert all(e["type"] != "ERROR" for e in seen)


def test_a_request_derives_the_rows_again_only_after_a_mark() -> None:
    source = t.FixedFeeder(cluster())
    store = GpuStore(source)
    first = store.current()
    reads = source.reads
    assert store.current() == first and source.reads == reads  # nothing marked: no work
    source.view.apply("ResourceSlice", "DELETED", t.resource_slice("node-b", []))
    store.mark("ResourceSlice", "DELETED", {})
    assert store.current() > first and source.reads == reads + 1


# --- gpuclaims and gpureasons (namespaced) ----------------------------------------------------

V1 = "/apis/view.gpuslice.dev/v1alpha1"


def claims_cluster() -> ClusterView:
    view = cluster()
    labelled = t.claim("ml", "b", results=[t.result("node-b", "gpu-0")], pods=("trainer",))
    labelled["metadata"]["labels"] = {"team": "vision"}
    for obj in (labelled, t.claim("web", "w", cores="30"), t.claim("ml", "pending", cores="30")):
        view.apply("ResourceClaim", "ADDED", obj)
    view.apply("Pod", "ADDED", t.pod("ml", "waiting", claim="pending"))
    return view


def claims_api(grants: Grants | None = None) -> AggregatedApi:
    return api(t.FixedFeeder(claims_cluster()), grants)


def names(listed: dict[str, Any]) -> list[str]:
    return [f"{o['metadata']['namespace']}/{o['metadata']['name']}" for o in listed["items"]]


def test_gpuclaims_list_in_a_namespace_and_in_all() -> None:
    a = claims_api()
    status, listed = get(a, f"{V1}/namespaces/ml/gpuclaims")
    assert status == 200 and listed["kind"] == "GPUClaimList"
    assert names(listed) == ["ml/a", "ml/b", "ml/pending"]
    assert names(get(a, f"{V1}/gpuclaims")[1]) == ["ml/a", "ml/b", "ml/pending", "web/w"]
    one = get(a, f"{V1}/namespaces/ml/gpuclaims/b")[1]
    assert one["apiVersion"] == "view.gpuslice.dev/v1alpha1" and one["kind"] == "GPUClaim"
    assert one["metadata"]["labels"] == {"team": "vision"}
    assert one["metadata"]["resourceVersion"]
    [request] = one["spec"]["requests"]
    assert request["deviceClassName"] == "gpu.gpuslice.dev" and request["cores"] is None
    [device] = one["status"]["devices"]
    assert (device["device"], device["node"], device["cores"]) == ("node-b/0", "node-b", 100)
    assert one["status"]["pods"] == ["trainer"] and one["status"]["state"] == "Allocated"
    pending = get(a, f"{V1}/namespaces/ml/gpuclaims/pending")[1]
    reasons = pending["status"].pop("reasons")
    assert pending["status"] == {"state": "Pending", "devices": [], "pods": []}
    # 30 cores fit a GPU of the view: what is left to decide is the scheduler's
    assert [(r["code"], r["claim"]) for r in reasons] == [("Fits", "ml/pending")]
    assert [r["code"] for r in one["status"]["reasons"]] == ["Allocated"]
    # a list and a watch leave the reasons out (judged per get, not per change)
    assert not any("reasons" in o["status"] for o in listed["items"])
    status, missing = get(a, f"{V1}/namespaces/web/gpuclaims/a")  # a is in ml, not web
    assert status == 404 and missing["message"] == 'gpuclaims.view.gpuslice.dev "a" not found'
    assert missing["details"]["kind"] == "gpuclaims"
    # a namespaced object has no cluster-scoped path, a cluster-scoped one no namespaced path
    assert get(a, f"{V1}/gpuclaims/a")[0] == 404
    assert get(a, f"{V1}/namespaces/ml/gpus")[0] == 404
    assert get(a, f"{V1}/namespaces//gpuclaims")[0] == 404


def test_gpuclaims_tables_selectors_and_the_namespace_in_every_review() -> None:
    grants = Grants("get", "list", "watch")
    a = claims_api(grants)
    _, table = get(a, f"{V1}/namespaces/ml/gpuclaims", TABLE)
    columns = table["columnDefinitions"]
    assert [c["name"] for c in columns if c["priority"] == 1] == ["Nodes", "Classes"]
    assert table["rows"][0]["cells"] == [
        "a",
        "Allocated",
        "node-a/0",
        "80%",
        "20Gi",
        "-",
        "-",
        "-",
        "node-a",
        "gpu.gpuslice.dev",
    ]
    assert table["rows"][0]["object"]["metadata"]["namespace"] == "ml"
    _, selected = get(a, f"{V1}/gpuclaims?labelSelector=team=vision")
    assert names(selected) == ["ml/b"]
    _, selected = get(a, f"{V1}/gpuclaims?fieldSelector=metadata.namespace!=ml")
    assert names(selected) == ["web/w"]
    get(a, f"{V1}/namespaces/ml/gpuclaims/b")
    assert grants.where[-3:] == [
        ("gpuclaims", "", ""),  # -A: the cluster scope, as the API server asks it
        ("gpuclaims", "", ""),
        ("gpuclaims", "ml", "b"),
    ]
    assert grants.where[0] == ("gpuclaims", "ml", "")


def test_gpuclaims_forbidden_in_one_namespace_is_a_403_naming_it() -> None:
    class OnlyMl(Grants):
        def check_user(self, user: dict[str, Any], **kw: Any) -> Decision:
            super().check_user(user, **kw)
            if kw.get("namespace") == "ml":
                return Decision(HTTPStatus.OK, user=user["username"])
            return Decision(HTTPStatus.FORBIDDEN, message=f"not in {kw.get('namespace')!r}")

    a = claims_api(OnlyMl())
    assert get(a, f"{V1}/namespaces/ml/gpuclaims")[0] == 200
    status, error = get(a, f"{V1}/namespaces/web/gpuclaims")
    assert status == 403 and error["reason"] == "Forbidden" and "'web'" in error["message"]
    assert get(a, f"{V1}/gpuclaims")[0] == 403


def test_gpuclaims_watch_in_a_namespace_sees_its_claims_only() -> None:
    source = t.FixedFeeder(claims_cluster())
    a = api(source)
    _, listed = get(a, f"{V1}/namespaces/web/gpuclaims")
    version = listed["metadata"]["resourceVersion"]
    answer = a.get(
        f"{V1}/namespaces/web/gpuclaims?watch=true&resourceVersion={version}", headers(), CERT
    )
    assert isinstance(answer, Stream)
    source.view.apply("ResourceClaim", "DELETED", t.claim("ml", "a"))  # another namespace
    allocated = t.claim("web", "w", results=[t.result("node-a", "gpu-1", cores="30")])
    source.view.apply("ResourceClaim", "MODIFIED", allocated)
    a.claims.refresh()
    [event] = events(answer, 1)
    answer.release()
    assert event["type"] == "MODIFIED" and event["object"]["metadata"]["name"] == "w"
    assert event["object"]["status"]["devices"][0]["device"] == "node-a/1"


def test_gpureasons_get_only_for_a_pod_with_gpu_claims() -> None:
    grants = Grants("get")
    a = claims_api(grants)
    status, reason = get(a, f"{V1}/namespaces/ml/gpureasons/waiting")
    assert status == 200 and reason["kind"] == "GPUReason"
    assert reason["metadata"]["namespace"] == "ml" and reason["metadata"]["name"] == "waiting"
    [first, *_] = reason["status"]["reasons"]
    assert first["claim"] == "ml/pending" and first["code"]
    assert grants.where == [("gpureasons", "ml", "waiting")]
    _, table = get(a, f"{V1}/namespaces/ml/gpureasons/waiting", TABLE)
    [row] = table["rows"]
    assert row["cells"][:3] == ["waiting", "-", first["code"]]
    assert row["cells"][3].startswith("claim ml/pending: ")
    status, missing = get(a, f"{V1}/namespaces/ml/gpureasons/nobody")
    assert status == 404 and missing["message"] == 'gpureasons.view.gpuslice.dev "nobody" not found'
    status, refused = get(a, f"{V1}/namespaces/ml/gpureasons")
    assert status == 405 and refused["reason"] == "MethodNotAllowed"
    assert len(grants.where) == 3  # a 405 asks no review
