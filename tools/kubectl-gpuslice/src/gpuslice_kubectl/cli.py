"""``kubectl gpuslice``: the cluster view of gpuslice GPUs, from the controller or the API server.

Installed as the executable ``kubectl-gpuslice``, which kubectl runs for ``kubectl gpuslice``.
Credentials come as kubectl's do: ``--kubeconfig``, else ``KUBECONFIG``, else
``~/.kube/config``, else the pod's service account; ``--context`` picks a context and
``-n``/``--namespace`` a namespace (default: the context's, else ``default``).

GPUs, claims and a pod's reasons come from the aggregated API ``view.gpuslice.dev`` where it is
served (``viewapi``: ``gpus``, ``gpuclaims``, ``gpureasons``; the user's own credentials stay
with the API server), else the model comes from the controller's ``/view/`` where it runs (live
usage in the used columns), else from one listing of the API (``--source``, ``--controller``:
``remote``). ``top gpus`` takes ``-l`` with the view API's labels whatever the source. ``-o
json|yaml|jsonpath`` prints the view API's objects whatever the source: a ``GPUList`` or
``GPU``, a ``GPUClaimList``, a ``GPUReason`` (``why`` of a claim prints its reasons as they
are: no resource holds them). Cordons are always written through the API.

Exit status: 0 done (also for a cordon that was already there or an uncordon of a GPU that was
not cordoned), 1 the request failed (no such GPU, pod or claim; API errors; no DeviceTaintRule
API), 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from gpuslice_core import logging as gslog
from gpuslice_core.errors import GpusliceError, NotFoundError
from gpuslice_kube.errors import KubeUnreachableError
from gpuslice_kube.raw import RawApi
from gpuslice_kube.transport import ApiClientLike
from gpuslice_kubectl import jsonpath, kubeconfig, remote, viewapi
from gpuslice_kubectl.apiclient import KubeClient
from gpuslice_view import __version__, cordon, namespaced, report, resource, source
from gpuslice_view.reasons import Reason, why_claim
from gpuslice_view.selectors import label_selector

OUTPUTS = ("table", "wide", "json", "yaml", "name")


def output_format(value: str) -> str:
    """``-o``: one of ``OUTPUTS`` or ``jsonpath=<template>`` (checked here: a bad template is
    bad usage, before any request)."""
    kind, eq, template = value.partition("=")
    if kind in ("jsonpath", "jsonpath-as-json") and eq:
        if kind == "jsonpath-as-json":
            raise argparse.ArgumentTypeError("jsonpath-as-json is not supported; use jsonpath=")
        try:
            jsonpath.parse(template)
        except GpusliceError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
        return value
    if value not in OUTPUTS:
        raise argparse.ArgumentTypeError(
            f"{value!r}: give one of {', '.join(OUTPUTS)} or jsonpath=<template>"
        )
    return value


def _common(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    """The flags that go before or after the command, as kubectl's global flags do. On the
    command's parser they default to SUPPRESS, so a flag given before it is kept."""

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    parser.add_argument(
        "--kubeconfig", default=default(None), help="The path of the kubeconfig file."
    )
    parser.add_argument("--context", default=default(None), help="The kubeconfig context to use.")
    parser.add_argument(
        "-n", "--namespace", default=default(None), help="The namespace to look in."
    )
    parser.add_argument(
        "-A",
        "--all-namespaces",
        action="store_true",
        default=default(False),
        help="Look in every namespace.",
    )
    parser.add_argument(
        "-o",
        "--output",
        type=output_format,
        default=default(None),
        help="The output format: table (the default), wide, json, yaml, name (one resource name "
        "a line, as kubectl's), or jsonpath=<template> (kubectl's JSONPath, a subset: "
        "docs/cluster-view.md).",
    )
    parser.add_argument(
        "--no-headers",
        action="store_true",
        default=default(False),
        help="Print tables without their header line.",
    )
    parser.add_argument(
        "-l",
        "--selector",
        default=default(None),
        help="For top gpus: only GPUs whose labels match, as kubectl get gpus -l takes it "
        "(gpuslice.dev/node, type, model, mig-profile, cordoned, allocated; docs/view-api.md).",
    )
    parser.add_argument(
        "--source",
        choices=remote.SOURCES,
        default=default(os.environ.get("GPUSLICE_SOURCE") or "auto"),
        help="Where the model comes from: view-api (the aggregated API view.gpuslice.dev: gpus, "
        "gpuclaims, gpureasons; what an older controller does not serve comes from the API "
        "server's objects), the controller's /view/, the API server's objects, or auto (the "
        "first of them that is installed and answers) (env GPUSLICE_SOURCE).",
    )
    parser.add_argument(
        "--controller",
        default=default(os.environ.get("GPUSLICE_CONTROLLER") or None),
        help="The controller as <namespace>/<service>[:port] (through the API server) or "
        "https://host[:port] (straight); when not given, the Service that the APIService "
        "v1alpha1.view.gpuslice.dev names, and no other (env GPUSLICE_CONTROLLER).",
    )
    parser.add_argument(
        "--controller-ca",
        default=default(os.environ.get("GPUSLICE_CONTROLLER_CA") or None),
        help="The CA file that signs the controller's certificate, for an https:// --controller "
        "(env GPUSLICE_CONTROLLER_CA).",
    )


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(
        prog="kubectl gpuslice",
        description="gpuslice's view of the cluster's GPUs: allocations, health, cordons, and "
        "why a claim does not get a GPU.",
    )
    main.add_argument("--version", action="version", version=f"kubectl-gpuslice {__version__}")
    _common(main, suppress=False)
    sub = main.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        _common(p, suppress=True)
        return p

    top = add("top", "Show every GPU and MIG device: cores and memory allocated, status.")
    top.add_argument("what", choices=("gpus",), help="What to show: gpus.")
    describe = add("describe", "Show one GPU: its taints and every claim and pod on it.")
    describe.add_argument("what", choices=("gpu",), help="What to describe: gpu.")
    describe.add_argument("gpu", help="A GPU or MIG UUID, <node>/<index> or <node>/<device>.")
    add("claims", "Show the claims on gpuslice GPUs and where they are allocated.")
    why = add("why", "Say why a pod or a claim has no GPU (or where it has one).")
    why.add_argument("target", help="A pod or claim name; pod/<name> or claim/<name> to choose.")
    cordon_p = add("cordon", "Take a GPU out of service with a DeviceTaintRule (NoSchedule).")
    cordon_p.add_argument("gpu", help="A GPU or MIG UUID, <node>/<index> or <node>/<device>.")
    cordon_p.add_argument(
        "--evict",
        action="store_true",
        help="Taint NoExecute: the device-taint eviction controller evicts the pods using it.",
    )
    uncordon_p = add("uncordon", "Put a cordoned GPU back into service.")
    uncordon_p.add_argument("gpu", help="A GPU or MIG UUID, <node>/<index> or <node>/<device>.")
    return main


def _kubeconfig(args: argparse.Namespace) -> str | None:
    if args.kubeconfig:
        return str(args.kubeconfig)
    if os.environ.get("KUBECONFIG"):
        return os.environ["KUBECONFIG"]
    default = Path.home() / ".kube" / "config"
    return str(default) if default.is_file() else None


def _config(args: argparse.Namespace) -> kubeconfig.Config:
    """The kubeconfig's cluster, user and namespace, else the pod's service account."""
    files = _kubeconfig(args)
    return kubeconfig.load(files, args.context) if files else kubeconfig.in_cluster()


def _namespace(args: argparse.Namespace, config: kubeconfig.Config) -> str:
    return str(args.namespace or config.namespace or "default")


def _emit(args: argparse.Namespace, data: Any, text: str, names: Sequence[str] = ()) -> None:
    if args.output.startswith("jsonpath="):
        print(jsonpath.render(args.output.removeprefix("jsonpath="), data), end="")
    elif args.output == "json":
        print(json.dumps(data, indent=2))
    elif args.output == "yaml":
        print(yaml.safe_dump(data, sort_keys=False), end="")
    elif args.output == "name":
        if names:
            print("\n".join(names))
    elif args.no_headers:
        body = text.splitlines()[1:]
        if body:
            print("\n".join(body))
    else:
        print(text)


def _object_name(singular: str, name: str) -> str:
    """``-o name`` as kubectl prints it for the view API's objects that ``-o json`` prints:
    ``<singular>.<group>/<name>``, without the namespace."""
    return f"{singular}.{resource.GROUP}/{name}"


def _gpu_name(row: report.Row) -> str:
    """A row's name as ``kubectl get gpus -o name`` prints it."""
    return _object_name(resource.SINGULAR, resource.object_name(row["node"], row["device"]))


def _claim_name(row: report.Row) -> str:
    """A claim row's name as ``kubectl get gpuclaims -o name`` prints it (its GPUClaim is
    named as the ResourceClaim)."""
    return _object_name(namespaced.CLAIM_SINGULAR, str(row["name"]))


def _served(source_: remote.ViewSource, rows: list[report.Row]) -> list[resource.Obj]:
    """The GPU objects of ``rows``: as the view API served them, else built from the rows the
    same way the controller builds what it serves."""
    if isinstance(source_, viewapi.ViewApiSource):
        return source_.served(rows)
    return [resource.gpu_object(row) for row in rows]


def _all_gpus(source_: remote.ViewSource) -> list[tuple[report.Row, resource.Obj]]:
    rows = source_.gpu_rows()
    return list(zip(rows, _served(source_, rows), strict=True))


def _one_gpu(source_: remote.ViewSource, ref: str) -> tuple[report.Row, resource.Obj]:
    row = source_.gpu_row(ref)
    return row, _served(source_, [row])[0]


def _all_claims(
    source_: remote.ViewSource, namespace: str | None
) -> list[tuple[report.Row, resource.Obj]]:
    """The claims' rows and their ``GPUClaim`` objects: as the view API served them, else built
    from the rows the same way the controller builds what it serves."""
    rows = source_.claim_rows(namespace)
    if isinstance(source_, viewapi.ViewApiSource):
        return list(zip(rows, source_.claims_served(rows), strict=True))
    return [(row, namespaced.claim_object(row)) for row in rows]


def _listed(kind: str, items: list[resource.Obj]) -> resource.Obj:
    """A list of the view API's objects, as ``-o json|yaml|jsonpath`` print it."""
    return {"apiVersion": resource.API_VERSION, "kind": kind, "metadata": {}, "items": items}


def _claims(args: argparse.Namespace, chooser: remote.Chooser, namespace: str) -> None:
    pairs = chooser.read(lambda s: _all_claims(s, None if args.all_namespaces else namespace))
    rows = [row for row, _ in pairs]
    listed = _listed(namespaced.CLAIM_LIST_KIND, [obj for _, obj in pairs])
    table = report.claim_table(rows, all_namespaces=args.all_namespaces)
    _emit(args, listed, table, [_claim_name(r) for r in rows])


def _why_pod(
    source_: remote.ViewSource, namespace: str, name: str
) -> tuple[report.Row, resource.Obj] | None:
    """``why pod/<name>``'s answer and its ``GPUReason``, or None (no such pod with claims)."""
    answer = source_.why_pod(namespace, name)
    if answer is None:
        return None
    if isinstance(source_, viewapi.ViewApiSource):
        return answer, source_.reason_served(namespace, name)
    return answer, namespaced.reason_object(namespace, name, answer)


def _gpus(args: argparse.Namespace, chooser: remote.Chooser) -> None:
    """``top gpus`` and ``describe gpu``: tables from the rows; ``-o json|yaml|jsonpath`` the
    GPU objects (a ``GPUList`` for top), whatever the source, so scripts see one format."""
    if args.command == "top":
        wanted = label_selector(args.selector)  # (a bad one fails before any request)
        pairs = chooser.read(_all_gpus)
        pairs = [(row, obj) for row, obj in pairs if wanted(obj["metadata"].get("labels") or {})]
        rows = [row for row, _ in pairs]
        listed = _listed(resource.LIST_KIND, [obj for _, obj in pairs])
        table = report.gpu_table(rows, wide=args.output == "wide")
        _emit(args, listed, table, [_gpu_name(r) for r in rows])
    else:
        row, obj = chooser.read(lambda s: _one_gpu(s, args.gpu))
        _emit(args, obj, report.describe_gpu(row), [_gpu_name(row)])


def _why(args: argparse.Namespace, raw: RawApi, chooser: remote.Chooser, namespace: str) -> None:
    kind, _, name = args.target.rpartition("/")
    if kind not in ("", "pod", "pods", "claim", "claims", "resourceclaim"):
        raise NotFoundError(f"why {args.target!r}: give a pod or claim (pod/<name>, claim/<name>)")
    data = None
    # what -o json and -o name print: the pod's GPUReason, or the claim's GPUClaim as a get of
    # the view API serves it (with its reasons)
    printed: resource.Obj | None = None
    singular = namespaced.REASON_SINGULAR
    if kind in ("", "pod", "pods"):
        found = chooser.read(lambda s: _why_pod(s, namespace, name))
        if found is not None:
            data, printed = found
    if data is None and kind not in ("pod", "pods"):
        singular = namespaced.CLAIM_SINGULAR
        answered, claimed = _why_claim_from_view_api(chooser, namespace, name)
        if claimed is not None:
            data, printed = claimed
        elif not answered:
            # no view API (or an older one): the reasons from the API's listing
            view = source.load(raw)
            claim = view.claims.get((namespace, name))
            if claim is not None:
                reasons = [r.to_dict() for r in why_claim(view, claim)]
                data = {"claim": f"{namespace}/{name}", "reasons": reasons}
    if data is None:
        what = {"": "pod with GPU claims or claim", "claim": "claim"}.get(kind, "pod with claims")
        raise NotFoundError(f"no {what} {name!r} in namespace {namespace}")
    lines = [f"{k.capitalize()}: {v}" for k, v in data.items() if k != "reasons" and v]
    lines += [f"  {r['code']}: {Reason(**r)}" for r in data["reasons"]]
    # -o name: the object, as kubectl get prints it; a claim's reasons read from the API's
    # listing are no object, so nothing (as -o json prints them as they are)
    names = [] if printed is None else [_object_name(singular, name)]
    _emit(args, data if printed is None else printed, "\n".join(lines), names)


def _why_claim_from_view_api(
    chooser: remote.Chooser, namespace: str, name: str
) -> tuple[bool, tuple[report.Row, resource.Obj] | None]:
    """Whether the view API answered for the claim, and its answer (None: no such claim)."""

    def ask(source_: remote.ViewSource) -> tuple[report.Row, resource.Obj] | None:
        if not isinstance(source_, viewapi.ViewApiSource):
            raise remote.NotServedError("only the view API serves a claim's reasons")
        return source_.why_claim(namespace, name)

    return chooser.from_view_api(ask)


def _chooser(args: argparse.Namespace, api_client: ApiClientLike, raw: RawApi) -> remote.Chooser:
    def controller() -> remote.ControllerSource:
        where = remote.parse(args.controller) if args.controller else remote.discover(raw)
        return remote.ControllerSource(api_client, where, ca_file=args.controller_ca)

    def note(line: str) -> None:
        print(f"kubectl-gpuslice: {line}", file=sys.stderr)

    # a short deadline: a registered but unavailable view API answers 503, which is retried
    view_api = viewapi.ViewApiSource(RawApi(api_client, deadline=3.0, unreachable_is_final=True))
    return remote.Chooser(args.source, source.ApiSource(raw), controller, note, view_api)


def run(args: argparse.Namespace) -> int:
    config = _config(args)
    api_client = KubeClient(config, user_agent=f"kubectl-gpuslice/{__version__}")
    raw = RawApi(api_client, deadline=20.0, unreachable_is_final=True)
    namespace = _namespace(args, config)
    chooser = _chooser(args, api_client, raw)
    if args.command in ("top", "describe"):
        _gpus(args, chooser)
    elif args.command == "claims":
        _claims(args, chooser, namespace)
    elif args.command == "why":
        _why(args, raw, chooser, namespace)
    else:
        device = source.load(raw).find(args.gpu)
        if args.command == "cordon":
            outcome = cordon.cordon(raw, device, evict=args.evict)
        else:
            outcome = cordon.uncordon(raw, device)
        print(outcome.message)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.output = args.output or "table"
    if args.selector is not None and args.command != "top":
        parser().error(f"-l/--selector applies to top gpus, not to {args.command}")
    # What the libraries log (e.g. an object in the cluster that cannot be decoded is skipped)
    # goes to stderr as text: stdout is the answer, and may be JSON another program reads.
    gslog.configure(component="kubectl-gpuslice", level="warning", json=False, stream=sys.stderr)
    # urllib3's own quick retries of a refused connection are not news to a person
    logging.getLogger("urllib3").setLevel(logging.ERROR)
    try:
        return run(args)
    except KubeUnreachableError as exc:
        # kubectl's words, at the first attempt: nothing listens where the kubeconfig points
        print(
            f"error: the connection to the server {exc.server} was refused or failed - did you "
            f"specify the right host or port? ({exc})",
            file=sys.stderr,
        )
        return 1
    except GpusliceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
