"""The kubectl plugin's flags, and cordon on a cluster without the DeviceTaintRule API."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any, cast

import pytest
import yaml

from gpuslice_core.errors import FailedPreconditionError, NotFoundError
from gpuslice_kube.errors import KubeNotFoundError
from gpuslice_kube.raw import RawApi
from gpuslice_kubectl import cli
from gpuslice_kubectl.remote import Chooser
from gpuslice_kubectl.viewapi import VERSION_PATH, ViewApiSource
from gpuslice_testkit.view import CLASSES, claim, gpu, pod, resource_slice, result
from gpuslice_view import cordon, namespaced, report, resource
from gpuslice_view.model import ClusterView
from gpuslice_view.reasons import why_claim
from gpuslice_view.source import taint_rule_version


def test_flags_go_before_or_after_the_command_as_with_kubectl() -> None:
    before = cli.parser().parse_args(["-n", "ml", "-o", "yaml", "claims"])
    after = cli.parser().parse_args(["claims", "-n", "ml", "-A", "-o", "json"])
    assert (before.namespace, before.output, before.all_namespaces) == ("ml", "yaml", False)
    assert (after.namespace, after.output, after.all_namespaces) == ("ml", "json", True)
    evict = cli.parser().parse_args(["cordon", "node-a/0", "--evict", "--context", "prod"])
    assert (evict.gpu, evict.evict, evict.context) == ("node-a/0", True, "prod")


def test_bad_usage_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["top", "nodes"])
    assert exited.value.code == 2
    assert "invalid choice: 'nodes'" in capsys.readouterr().err


def test_a_missing_kubeconfig_is_an_error_that_names_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert cli.main(["--kubeconfig", str(tmp_path / "nope"), "top", "gpus"]) == 1
    assert f"--kubeconfig {tmp_path / 'nope'}: no such file" in capsys.readouterr().err


def test_an_api_server_nobody_listens_at_fails_at_once_as_kubectl_says_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No retries for a person: a refused connection is said at the first attempt, with the
    server the kubeconfig names (services still retry it: the API server restarts)."""
    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        kubeconfig = tmp_path / "config"
        server = {"server": f"https://127.0.0.1:{port}", "insecure-skip-tls-verify": True}
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "c", "cluster": server}],
                    "users": [{"name": "u", "user": {"token": "t"}}],
                    "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                    "current-context": "x",
                }
            )
        )
        assert cli.main(["--kubeconfig", str(kubeconfig), "top", "gpus"]) == 1
    err = capsys.readouterr().err
    assert f"the connection to the server 127.0.0.1:{port} was refused" in err, err
    assert "Connection refused" in err and "Retrying" not in err, err


def test_the_namespace_comes_from_the_kubeconfig_context(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: a\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts:\n"
        "- {name: a, context: {cluster: c, user: u, namespace: team-a}}\n"
        "- {name: b, context: {cluster: c, user: u}}\n"
    )
    for flags, namespace in [
        ([], "team-a"),
        (["--context", "b"], "default"),
        (["--context", "b", "-n", "mine"], "mine"),
    ]:
        args = cli.parser().parse_args(["claims", "--kubeconfig", str(config), *flags])
        assert cli._namespace(args, cli._config(args)) == namespace


class Discovery:
    """A RawApi that answers discovery as a 1.36 server with DeviceTaintRule off would."""

    def __init__(self, resources: dict[str, list[str]]) -> None:
        self.resources = resources

    def get(self, path: str) -> dict[str, Any]:
        if path == "/apis/resource.k8s.io":
            return {"versions": [{"version": v} for v in self.resources]}
        version = path.rsplit("/", 1)[-1]
        if version not in self.resources:
            raise KubeNotFoundError(path)
        return {"resources": [{"name": n} for n in self.resources[version]]}


def test_cordon_without_the_device_taint_rule_api_says_so() -> None:
    raw: Any = Discovery({"v1": ["resourceslices", "resourceclaims"], "v1beta2": ["deviceclasses"]})
    assert taint_rule_version(raw) is None
    device = ClusterView.build(slices=[resource_slice("n", [gpu(0)])]).find("n/0")
    with pytest.raises(FailedPreconditionError) as err:
        cordon.cordon(raw, device, evict=False)
    assert "this cluster does not serve DeviceTaintRule" in str(err.value)
    with pytest.raises(FailedPreconditionError):
        cordon.uncordon(raw, device)


def test_the_newest_served_device_taint_rule_version_is_used() -> None:
    raw: Any = Discovery({"v1": ["resourceslices"], "v1alpha3": ["devicetaintrules"]})
    assert taint_rule_version(raw) == "v1alpha3"
    raw = Discovery({"v1": ["devicetaintrules"], "v1alpha3": ["devicetaintrules"]})
    assert taint_rule_version(raw) == "v1"


def test_every_global_flag_goes_after_the_command_too() -> None:
    flags = ["-o", "json", "--context", "x", "--kubeconfig", "k", "-n", "ml", "--no-headers"]
    flags += ["-l", "gpuslice.dev/type=gpu", "--source", "api", "--controller", "ops/ctl"]
    flags += ["--controller-ca", "ca.crt"]
    for argv in (["top", "gpus", *flags], [*flags, "top", "gpus"]):
        args = cli.parser().parse_args(argv)
        kube = (args.output, args.context, args.kubeconfig, args.namespace, args.no_headers)
        assert kube == ("json", "x", "k", "ml", True)
        ours = (args.selector, args.source, args.controller, args.controller_ca)
        assert ours == ("gpuslice.dev/type=gpu", "api", "ops/ctl", "ca.crt")
    # given before the command and not after it, a flag keeps its value
    args = cli.parser().parse_args(["--source", "api", "-o", "yaml", "claims", "-A"])
    assert (args.source, args.output, args.all_namespaces) == ("api", "yaml", True)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["top", "gpus", "-o", "xml"], "give one of table, wide, json, yaml, name or jsonpath="),
        (["top", "gpus", "-o", "jsonpath={.items[?(@.x)]}"], "cannot read '[?(@.x)]'"),
        (["top", "gpus", "-o", "jsonpath={range .items[*]}"], "{range} without {end}"),
        (["claims", "-l", "a=b"], "-l/--selector applies to top gpus, not to claims"),
    ],
)
def test_bad_output_and_selector_flags_are_bad_usage(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert says in capsys.readouterr().err


def two_gpus() -> ClusterView:
    return ClusterView.build(
        slices=[resource_slice("node-a", [gpu(0), gpu(1)])],
        claims=[claim("ml", "a", results=[result("node-a", "gpu-0", cores="30")])],
    )


class Rows:
    """A source that answers with the rows of ``two_gpus`` (the controller's or the API's)."""

    name = "api"

    def gpu_rows(self) -> list[Any]:
        return report.gpu_rows(two_gpus())

    def gpu_row(self, ref: str) -> Any:
        view = two_gpus()
        return report.gpu_row(view, view.usage()[view.find(ref).key])


class Served:
    """The view API's list and get, the objects with the resourceVersion the store gives."""

    def __init__(self) -> None:
        self.objs = [
            {**resource.gpu_object(r), "metadata": {**resource.gpu_object(r)["metadata"]}}
            for r in report.gpu_rows(two_gpus())
        ]
        for obj in self.objs:
            obj["metadata"]["resourceVersion"] = "42"
            del obj["apiVersion"], obj["kind"]  # as a list's items may come

    def get(self, path: str) -> Any:
        if path == VERSION_PATH:
            return {"resources": [{"name": "gpus"}]}
        name = path.rsplit("/", 1)[1]
        return {"apiVersion": resource.API_VERSION, "kind": "GPU"} | next(
            o for o in self.objs if o["metadata"]["name"] == name
        )

    def list(self, path: str, label_selector: str | None = None) -> Any:
        return {"items": self.objs}


def printed(
    capsys: pytest.CaptureFixture[str], source: Any, argv: list[str], *, view_api: Any = None
) -> str:
    args = cli.parser().parse_args(argv)
    args.output = args.output or "table"
    chooser = Chooser(args.source, source, lambda: source, lambda line: None, view_api)
    cli._gpus(args, chooser)
    return capsys.readouterr().out


@pytest.mark.parametrize("where", ["rows", "view-api"])
def test_json_is_a_gpu_list_whatever_the_source(
    where: str, capsys: pytest.CaptureFixture[str]
) -> None:
    view_api = ViewApiSource(cast(RawApi, Served())) if where == "view-api" else None
    out = printed(capsys, Rows(), ["top", "gpus", "-o", "json"], view_api=view_api)
    listed = json.loads(out)
    assert (listed["apiVersion"], listed["kind"]) == ("view.gpuslice.dev/v1alpha1", "GPUList")
    [a0, a1] = listed["items"]
    assert (a0["apiVersion"], a0["kind"], a0["metadata"]["name"]) == (
        "view.gpuslice.dev/v1alpha1",
        "GPU",
        "node-a.gpu-0",
    )
    assert (a0["status"]["allocatedCores"], a1["status"]["allocatedCores"]) == (30, 0)
    # as served: the store's resourceVersion comes along; built from rows: none
    assert a0["metadata"].get("resourceVersion") == ("42" if view_api else None)
    one = json.loads(
        printed(capsys, Rows(), ["describe", "gpu", "node-a/1", "-o", "json"], view_api=view_api)
    )
    assert (one["kind"], one["metadata"]["name"]) == ("GPU", "node-a.gpu-1")
    names = printed(
        capsys,
        Rows(),
        ["top", "gpus", "-o", "jsonpath={.items[*].metadata.name}"],
        view_api=view_api,
    )
    assert names == "node-a.gpu-0 node-a.gpu-1"
    selected = printed(
        capsys,
        Rows(),
        ["top", "gpus", "-l", "gpuslice.dev/allocated=true", "-o", "yaml"],
        view_api=view_api,
    )
    assert [o["metadata"]["name"] for o in yaml.safe_load(selected)["items"]] == ["node-a.gpu-0"]
    named = printed(capsys, Rows(), ["top", "gpus", "-o", "name"], view_api=view_api)
    assert named.splitlines() == [
        "gpu.view.gpuslice.dev/node-a.gpu-0",
        "gpu.view.gpuslice.dev/node-a.gpu-1",
    ]
    one_name = printed(
        capsys, Rows(), ["describe", "gpu", "node-a/1", "-o", "name"], view_api=view_api
    )
    assert one_name == "gpu.view.gpuslice.dev/node-a.gpu-1\n"
    table = printed(capsys, Rows(), ["top", "gpus", "--no-headers"], view_api=view_api)
    assert [line.split()[:2] for line in table.splitlines()] == [
        ["node-a", "gpu-0"],
        ["node-a", "gpu-1"],
    ]


def claims_view() -> ClusterView:
    return ClusterView.build(
        slices=[resource_slice("node-a", [gpu(0)])],
        claims=[
            claim("ml", "a", results=[result("node-a", "gpu-0", cores="30")], pods=("p",)),
            claim("ml", "pending", cores="30"),
        ],
        pods=[pod("ml", "waiting", claim="pending")],
        classes=CLASSES,
    )


class ClaimRows:
    """A source that answers claims and why from ``claims_view`` (the controller's or the API's)."""

    name = "api"

    def claim_rows(self, namespace: str | None) -> list[Any]:
        return report.claim_rows(claims_view(), namespace)

    def why_pod(self, namespace: str, name: str) -> Any:
        return report.why_row(claims_view(), namespace, name)


class ServedClaims:
    """gpuclaims and gpureasons as the view API serves them (items without apiVersion/kind)."""

    def get(self, path: str) -> Any:
        if path == VERSION_PATH:
            return {"resources": [{"name": n} for n in ("gpus", "gpuclaims", "gpureasons")]}
        if "/gpuclaims/" in path:  # a get of one GPUClaim carries its reasons
            view, name = claims_view(), path.rsplit("/", 1)[1]
            if ("ml", name) not in view.claims:
                raise KubeNotFoundError(f"gpuclaims {name} not found")
            [obj] = [o for o in namespaced.claim_objects(view) if o["metadata"]["name"] == name]
            del obj["apiVersion"], obj["kind"]
            reasons = [r.to_dict() for r in why_claim(view, view.claims[("ml", name)])]
            return {**obj, "status": {**obj["status"], "reasons": reasons}}
        answer = report.why_row(claims_view(), "ml", path.rsplit("/", 1)[1])
        assert answer is not None
        return {**namespaced.reason_object("ml", "waiting", answer), "served": True}

    def list(self, path: str, label_selector: str | None = None) -> Any:
        objs = namespaced.claim_objects(claims_view())
        for obj in objs:
            obj["metadata"]["resourceVersion"] = "42"
            del obj["apiVersion"], obj["kind"]
        return {"items": objs}


@pytest.mark.parametrize("where", ["rows", "view-api"])
def test_claims_and_why_print_gpuclaim_and_gpureason_objects_whatever_the_source(
    where: str, capsys: pytest.CaptureFixture[str]
) -> None:
    view_api = ViewApiSource(cast(RawApi, ServedClaims())) if where == "view-api" else None

    def run(argv: list[str]) -> str:
        args = cli.parser().parse_args(argv)
        args.output = args.output or "table"
        chooser = Chooser(args.source, ClaimRows(), ClaimRows, lambda line: None, view_api)  # type: ignore[arg-type]
        if args.command == "claims":
            cli._claims(args, chooser, "ml")
        else:
            cli._why(args, cast(RawApi, None), chooser, "ml")
        return capsys.readouterr().out

    listed = json.loads(run(["claims", "-o", "json"]))
    assert (listed["apiVersion"], listed["kind"]) == ("view.gpuslice.dev/v1alpha1", "GPUClaimList")
    a, pending = listed["items"]
    assert (a["apiVersion"], a["kind"], a["metadata"]["name"]) == (
        "view.gpuslice.dev/v1alpha1",
        "GPUClaim",
        "a",
    )
    assert a["status"]["devices"][0]["device"] == "node-a/0"
    assert a["metadata"].get("resourceVersion") == ("42" if view_api else None)
    assert pending["status"]["state"] == "Pending"
    table = run(["claims"]).splitlines()
    assert table[1].split()[:3] == ["a", "Allocated", "node-a/0"]
    reason = json.loads(run(["why", "pod/waiting", "-o", "json"]))
    assert (reason["kind"], reason["metadata"]["name"]) == ("GPUReason", "waiting")
    assert reason["status"]["reasons"][0]["claim"] == "ml/pending"
    assert reason.get("served") == (True if view_api else None)
    text = run(["why", "waiting"])
    assert text.startswith("Pod: ml/waiting\n") and "claim ml/pending" in text
    # -o name: kubectl's <singular>.<group>/<name> of the objects -o json prints
    assert run(["claims", "-o", "name"]).splitlines() == [
        "gpuclaim.view.gpuslice.dev/a",
        "gpuclaim.view.gpuslice.dev/pending",
    ]
    assert run(["why", "pod/waiting", "-o", "name"]) == "gpureason.view.gpuslice.dev/waiting\n"


def test_why_claim_reads_the_gpuclaim_the_view_api_serves(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``why claim/<name>`` where the view API is served: the reasons of a get of the GPUClaim
    (no listing of the cluster by the plugin), its object for -o json and -o name; a claim the
    API does not know is not found."""
    view_api = ViewApiSource(cast(RawApi, ServedClaims()))

    def run(argv: list[str]) -> str:
        args = cli.parser().parse_args(argv)
        args.output = args.output or "table"
        chooser = Chooser(args.source, ClaimRows(), ClaimRows, lambda line: None, view_api)  # type: ignore[arg-type]
        cli._why(args, cast(RawApi, None), chooser, "ml")  # no raw: nothing else is read
        return capsys.readouterr().out

    text = run(["why", "claim/pending"])
    assert text.startswith("Claim: ml/pending\n  FullyBooked: claim ml/pending, gpu:"), text
    assert "node-a/0 by ml/a" in text
    obj = json.loads(run(["why", "claim/pending", "-o", "json"]))
    assert (obj["apiVersion"], obj["kind"]) == ("view.gpuslice.dev/v1alpha1", "GPUClaim")
    assert [r["code"] for r in obj["status"]["reasons"]] == ["FullyBooked"]
    assert run(["why", "claim/a", "-o", "name"]) == "gpuclaim.view.gpuslice.dev/a\n"
    assert "Allocated" in run(["why", "claim/a"])
    with pytest.raises(NotFoundError, match="no claim 'gone' in namespace ml"):
        run(["why", "claim/gone"])
