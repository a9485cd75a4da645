"""The kubectl plugin's flags, and cordon on a cluster without the DeviceTaintRule API."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpuslice_core.errors import FailedPreconditionError
from gpuslice_kube.errors import KubeNotFoundError
from gpuslice_kubectl import cli
from gpuslice_testkit.view import gpu, resource_slice
from gpuslice_view import cordon
from gpuslice_view.model import ClusterView
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
    args = cli.parser().parse_args(["claims"])
    assert cli._namespace(args, str(config)) == "team-a"
    args = cli.parser().parse_args(["claims", "--context", "b"])
    assert cli._namespace(args, str(config)) == "default"


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
