"""The static CDI hook where there is no libc at all: a root file system holding only the
binary, the host's /proc and the enforcer's socket directory, entered with chroot in a mount
namespace of its own, as a host whose libc is too old (or missing) would run it. The hook
attaches a real container (a fake workload in its own cgroups) to a real enforcer. runc runs it
on the real nodes (e2e/tests/realnode/test_realnode_scenarios.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuslice_nvml.fake import FakeNvml
from gpuslice_testkit.enforcer import (
    Cgroups,
    EnforcerProcess,
    Workload,
    go_hook,
    hook_missing,
    remove_tree,
    share_request,
    short_tempdir,
)

NODE = 'name: nolibc\ndriverVersion: "570.158.01"\nstatePath: state.json\ngpus:\n  - model: L4\n'


@pytest.fixture
def workdir() -> Iterator[Path]:
    directory = short_tempdir()
    (directory / "node.yaml").write_text(NODE)
    yield directory
    remove_tree(directory)


@pytest.mark.skipif(os.geteuid() != 0, reason="chroot, mounts and cgroups need root")
@pytest.mark.timeout(60)
def test_the_static_hook_attaches_a_container_from_a_root_without_libc(workdir: Path) -> None:
    reason = hook_missing("go")
    if reason:
        pytest.skip(reason)
    root = short_tempdir("gs-root-")
    binary = root / "gpuslice-enforcer-hook"
    shutil.copy2(go_hook(), binary)
    (root / "proc").mkdir()
    inside = root / workdir.relative_to("/")  # the socket directory, at the same path
    inside.mkdir(parents=True)
    assert sorted(p.name for p in root.iterdir()) == ["gpuslice-enforcer-hook", "proc", "tmp"]
    assert not [p for p in root.rglob("*") if p.is_file() and p != binary]  # no ld.so, no libc

    proc = EnforcerProcess(workdir / "node.yaml", workdir, ["--mps=off"], hook="go").start()
    try:
        uuid = FakeNvml.from_config_file(proc.config).gpu(0).uuid
        with proc.channel() as channel:
            reply = proc.stub(channel).CreateShare(share_request("uid-nolibc", uuid))
        hook = next(h for h in reply.container_edits.hooks if h.hook_name == "createContainer")
        with Cgroups() as cgroups:
            workload = Workload(proc.config, cgroup_dirs=cgroups.container())
            try:
                script = (
                    f"mount --bind /proc {root}/proc && mount --bind {workdir} {inside} && "
                    f'exec chroot {root} /gpuslice-enforcer-hook "$@"'
                )
                unshare = ["unshare", "--mount", "--propagation", "private"]
                ran = subprocess.run(
                    [*unshare, "sh", "-c", script, "sh", *hook.args[1:]],
                    input=json.dumps({"id": "ctr-nolibc", "pid": workload.pid}),
                    env={"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")},
                    capture_output=True,
                    text=True,
                    timeout=30,
                    check=False,
                )
                assert ran.returncode == 0, ran.stderr
                assert ran.stdout.startswith("attached ctr-nolibc (RESOURCE_")
                state = json.loads((proc.state_dir / "enforcer.json").read_text())["data"]
                containers = {c for s in state["shares"].values() for c in s["containers"]}
                assert containers == {"ctr-nolibc"}
                # the control: a program that needs libc cannot even start in that root
                shutil.copy2(shutil.which("true") or "/bin/true", root / "true")
                control = subprocess.run(
                    ["chroot", str(root), "/true"], capture_output=True, text=True, check=False
                )
                assert control.returncode == 127, control.stderr  # ld.so is not found
            finally:
                workload.stop()
    finally:
        proc.stop()
        remove_tree(root)
