"""gpuslice-node-setup (gpuslice_core.nodesetup), step by step; e2e/tests/chart/test_chart.py
runs the whole program against the chart's rendered environment and the real static hook."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gpuslice_core.nodesetup import cli, hook
from gpuslice_core.nodesetup.cli import FakeNvmlConfig, HookInstall, HookSocketSettings, Settings
from gpuslice_core.nodesetup.fakenvml import write_fake_config
from gpuslice_core.nodesetup.report import SetupError
from gpuslice_core.nodesetup.sockets import (
    claim_hook_socket,
    listening,
    release_hook_socket,
    sweep_sockets,
)

#: Stands in for the static hook: install_hook only looks at the ELF magic (running it is
#: check_runs's job, tested on its own below).
FAKE_HOOK = b"\x7fELF" + b"\0" * 60 + b"release one"
ENV = (
    "GPUSLICE_NODE_NAME",
    "GPUSLICE_SOCKET",
    "GPUSLICE_HOOK_SOCKET",
    "GPUSLICE_SOCKET_DIR",
    "GPUSLICE_FAKE_NVML_CONFIG_SRC",
    "GPUSLICE_FAKE_NVML_CONFIG",
    "GPUSLICE_FAKE_NVML_SET_NAME",
    "GPUSLICE_HOOK_INSTALL_DIR",
    "GPUSLICE_HOOK_HOST_DIR",
    "GPUSLICE_HOOK_BINARY",
    "NODE_NAME",
    "ENFORCER_SOCKET",
    "ENFORCER_HOOK_SOCKET",
    "SOCKET_DIR",
    "FAKE_NVML_CONFIG_SRC",
    "FAKE_NVML_CONFIG",
    "FAKE_NVML_SET_NAME",
    "HOOK_INSTALL_DIR",
    "HOOK_HOST_DIR",
    "HOOK_BINARY",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ENV:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """A short directory: a unix socket's path has at most 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="gs-ns-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def listener(path: Path) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(4)
    try:
        yield sock
    finally:
        sock.close()


def dead_socket(path: Path) -> None:
    """A socket file nobody listens on: a pod killed with SIGKILL (closed, not unlinked)."""
    with listener(path):
        pass


def pod_socket(directory: Path, kind: str = "enforcer") -> Path:
    return directory / f"{kind}-{uuid.uuid4()}.sock"


# ---- 1. dead per-pod sockets -------------------------------------------------------------------
def test_sweep_removes_dead_pod_sockets_and_keeps_live_ones(run_dir: Path) -> None:
    dead, dead_mig = pod_socket(run_dir), pod_socket(run_dir, "mig-manager")
    dead_attach = dead.with_name(dead.name + ".attach")  # the enforcer's hook socket
    for path in (dead, dead_mig, dead_attach):
        dead_socket(path)
    not_ours = run_dir / "kubelet.sock"  # not a per-pod name: never touched, dead or not
    dead_socket(not_ours)
    live = pod_socket(run_dir)
    regular = run_dir / f"enforcer-{uuid.uuid4()}.sock"
    regular.write_text("not a socket")
    with listener(live):
        assert listening(live) and not listening(dead)
        sweep_sockets(run_dir)
        assert live.exists()
    assert not dead.exists() and not dead_mig.exists() and not dead_attach.exists()
    assert not_ours.exists() and regular.exists()


def test_sweep_of_a_missing_directory_does_nothing(tmp_path: Path) -> None:
    sweep_sockets(tmp_path / "absent")
    assert not (tmp_path / "absent").exists()


# ---- 2. the fake NVML config -------------------------------------------------------------------
def test_fake_config_gets_the_node_name(tmp_path: Path) -> None:
    src = tmp_path / "node.yaml"
    src.write_text("gpus:\n  - model: A100-SXM4-40GB\n\n")
    dst = tmp_path / "deep" / "fake-nvml" / "node.yaml"
    write_fake_config(src, dst, "gpu-node-a", set_name=True)
    assert dst.read_text() == 'gpus:\n  - model: A100-SXM4-40GB\nname: "gpu-node-a"\n'
    assert stat.S_IMODE(dst.stat().st_mode) == 0o644
    write_fake_config(src, dst, "gpu-node-a", set_name=False)  # the config names it already
    assert dst.read_text() == src.read_text()
    assert [p.name for p in dst.parent.iterdir()] == ["node.yaml"]  # no temp file left


def test_fake_config_with_a_name_needs_the_node_name(tmp_path: Path) -> None:
    with pytest.raises(SetupError, match="GPUSLICE_FAKE_NVML_SET_NAME needs GPUSLICE_NODE_NAME"):
        FakeNvmlConfig(tmp_path / "a", tmp_path / "b", node_name="", set_name=True)


# ---- 3. the enforcer's CDI hook ----------------------------------------------------------------
@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Path, str]]:
    """check_runs, recorded instead of run."""
    calls: list[tuple[Path, str]] = []
    monkeypatch.setattr(hook, "check_runs", lambda path, host: calls.append((path, host)))
    return calls


def test_hook_install_same_bytes_are_left_alone(
    tmp_path: Path, ran: list[tuple[Path, str]], capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "image-hook"
    source.write_bytes(FAKE_HOOK)
    install = tmp_path / "host"
    hook.install_hook(install, "/var/lib/gpuslice/hook/", source)
    installed = install / "bin" / "gpuslice-enforcer-hook"
    assert installed.read_bytes() == FAKE_HOOK
    assert stat.S_IMODE(installed.stat().st_mode) == 0o755
    host_path = "/var/lib/gpuslice/hook/bin/gpuslice-enforcer-hook"
    assert f"{host_path} is now the static hook" in capsys.readouterr().err
    first = installed.stat().st_ino
    hook.install_hook(install, "/var/lib/gpuslice/hook", source)
    assert installed.stat().st_ino == first
    assert f"{host_path} is the static hook" in capsys.readouterr().err
    assert ran == [(installed, host_path)] * 2  # run once at every install
    assert sorted(p.relative_to(install).as_posix() for p in install.rglob("*")) == [
        "bin",
        "bin/gpuslice-enforcer-hook",
    ]


def test_hook_install_replaces_atomically(tmp_path: Path, ran: list[tuple[Path, str]]) -> None:
    """A new release is a new file renamed over the old one: a hook that runs (here: holds the
    file open) keeps reading the bytes it started from."""
    source = tmp_path / "image-hook"
    source.write_bytes(FAKE_HOOK)
    install = tmp_path / "host"
    hook.install_hook(install, "/h", source)
    installed = install / "bin" / "gpuslice-enforcer-hook"
    before = installed.stat().st_ino
    newer = FAKE_HOOK.replace(b"release one", b"release two")
    source.write_bytes(newer)
    with installed.open("rb") as running:
        hook.install_hook(install, "/h", source)
        assert running.read() == FAKE_HOOK
    assert installed.stat().st_ino != before and installed.read_bytes() == newer
    assert [p.name for p in (install / "bin").iterdir()] == ["gpuslice-enforcer-hook"]


def test_hook_install_restores_a_hook_that_lost_its_execute_bit(
    tmp_path: Path, ran: list[tuple[Path, str]]
) -> None:
    source = tmp_path / "image-hook"
    source.write_bytes(FAKE_HOOK)
    hook.install_hook(tmp_path / "host", "/h", source)
    installed = tmp_path / "host" / "bin" / "gpuslice-enforcer-hook"
    installed.chmod(0o644)
    hook.install_hook(tmp_path / "host", "/h", source)
    assert stat.S_IMODE(installed.stat().st_mode) == 0o755


def test_hook_install_refuses_what_is_not_the_static_hook(
    tmp_path: Path, ran: list[tuple[Path, str]]
) -> None:
    script = tmp_path / "gpuslice-enforcer-hook"
    script.write_text("#!/usr/bin/env python3\n")
    with pytest.raises(SetupError, match="is not the static hook binary"):
        hook.install_hook(tmp_path / "h", "/h", script)
    assert not (tmp_path / "h").exists() and ran == []


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_run_once_check_passes_for_a_hook_that_answers(tmp_path: Path) -> None:
    script = "#!/bin/sh\necho 'usage: gpuslice-enforcer-hook attach|detach ...'\n"
    hook.check_runs(executable(tmp_path / "hook", script), "/h/bin/gpuslice-enforcer-hook")


def test_run_once_check_fails_where_the_hook_cannot_be_executed(tmp_path: Path) -> None:
    """What a noexec file system does to the runtime's exec (EACCES): node-setup stops, naming
    the cause. A file without execute bits fails the same way, root or not."""
    installed = tmp_path / "bin" / "gpuslice-enforcer-hook"
    installed.parent.mkdir()
    installed.write_text("#!/bin/sh\necho 'usage: gpuslice-enforcer-hook'\n")
    installed.chmod(0o644)
    with pytest.raises(SetupError) as err:
        hook.check_runs(installed, "/var/lib/gpuslice/hook/bin/gpuslice-enforcer-hook")
    assert str(err.value).startswith(
        "/var/lib/gpuslice/hook/bin/gpuslice-enforcer-hook cannot be run (Permission denied)"
    )
    assert "mounted noexec" in str(err.value) and "enforcer.hook.hostDir" in str(err.value)


def test_run_once_check_fails_for_a_hook_that_does_not_answer(tmp_path: Path) -> None:
    broken = executable(tmp_path / "hook", "#!/bin/sh\necho broken >&2\nexit 3\n")
    with pytest.raises(SetupError, match="/h --help exited 3: broken"):
        hook.check_runs(broken, "/h")


def test_python_release_of_an_earlier_chart_goes_after_its_grace(
    tmp_path: Path, ran: list[tuple[Path, str]], capsys: pytest.CaptureFixture[str]
) -> None:
    """Earlier charts installed a wrapper and copies of the image's Python (releases/): the
    wrapper becomes the static hook, the release it ran stays for the grace period, the others
    go at once, that one at the first install after it."""
    install = tmp_path / "opt-gpuslice"
    (install / "bin").mkdir(parents=True)
    for release in ("aaaa1111", "bbbb2222"):
        (install / "releases" / release / "python" / "bin").mkdir(parents=True)
    wrapper = install / "bin" / "gpuslice-enforcer-hook"
    wrapper.write_text("#!/bin/sh\nR='/opt/gpuslice/releases/bbbb2222'\nexec \"$R/python\"\n")
    assert hook.python_release(wrapper) == "bbbb2222"
    source = tmp_path / "image-hook"
    source.write_bytes(FAKE_HOOK)

    hook.install_hook(install, "/opt/gpuslice", source)
    assert wrapper.read_bytes() == FAKE_HOOK and hook.python_release(wrapper) is None
    assert [p.name for p in (install / "releases").iterdir()] == ["bbbb2222"]
    assert "removed the Python hook release aaaa1111" in capsys.readouterr().err
    previous = install / "bin" / ".previous-release"
    assert previous.read_text() == "bbbb2222\n"

    hook.install_hook(install, "/opt/gpuslice", source)  # within the grace: kept
    assert [p.name for p in (install / "releases").iterdir()] == ["bbbb2222"]
    past = previous.stat().st_mtime - hook.PYTHON_RELEASE_GRACE_S - 1
    os.utime(previous, (past, past))  # the grace is over
    hook.install_hook(install, "/opt/gpuslice", source)
    assert "removed the Python hook release bbbb2222" in capsys.readouterr().err
    assert sorted(p.name for p in install.iterdir()) == ["bin"]
    assert [p.name for p in (install / "bin").iterdir()] == ["gpuslice-enforcer-hook"]


# ---- the enforcer's stable hook socket --------------------------------------------------------
def test_hook_socket_claim_and_release_hand_the_link_over(run_dir: Path) -> None:
    a, b = pod_socket(run_dir), pod_socket(run_dir)
    link = run_dir / "enforcer.sock"
    with listener(a), listener(b) as sock_b:
        claim_hook_socket(a, link)  # the old pod's enforcer
        claim_hook_socket(b, link)  # the new pod's enforcer takes over
        assert str(link.readlink()) == b.name  # relative: the same in every mount of the dir
        release_hook_socket(a, link)  # the old pod stops: not its link any more
        assert str(link.readlink()) == b.name
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(link))  # the hook reaches the new enforcer through the link
            sock_b.accept()[0].close()
        release_hook_socket(b, link)  # b goes while a still serves: a takes the link back
        assert str(link.readlink()) == a.name
    release_hook_socket(a, link)  # nobody else listens: the link stays (dangling) as it was
    assert str(link.readlink()) == a.name
    assert sorted(p.name for p in run_dir.iterdir()) == sorted([a.name, b.name, link.name])


def test_hook_socket_release_without_a_link_does_nothing(run_dir: Path) -> None:
    release_hook_socket(pod_socket(run_dir), run_dir / "enforcer.sock")
    assert list(run_dir.iterdir()) == []


# ---- the command line: the chart's environment -> Settings -> steps ---------------------------
def test_the_charts_environment_becomes_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for var, value in {
        "GPUSLICE_NODE_NAME": "gpu-node-a",
        "GPUSLICE_SOCKET_DIR": "/var/run/gpuslice",
        "GPUSLICE_FAKE_NVML_CONFIG_SRC": "/etc/gpuslice/fake-nvml/node.yaml",
        "GPUSLICE_FAKE_NVML_CONFIG": "/var/lib/gpuslice/fake-nvml/node.yaml",
        "GPUSLICE_FAKE_NVML_SET_NAME": "true",
        "GPUSLICE_HOOK_INSTALL_DIR": "/host-hook",
        "GPUSLICE_HOOK_HOST_DIR": "/var/lib/gpuslice/hook",
    }.items():
        monkeypatch.setenv(var, value)
    assert cli.settings_from(cli.build_parser().parse_args([])) == Settings(
        socket_dir=Path("/var/run/gpuslice"),
        fake_nvml=FakeNvmlConfig(
            Path("/etc/gpuslice/fake-nvml/node.yaml"),
            Path("/var/lib/gpuslice/fake-nvml/node.yaml"),
            "gpu-node-a",
            set_name=True,
        ),
        hook=HookInstall(Path("/host-hook"), "/var/lib/gpuslice/hook"),
    )
    assert HookInstall(Path("/x"), "/y").binary == Path("/usr/local/bin/gpuslice-enforcer-hook")
    monkeypatch.setenv("GPUSLICE_SOCKET", "/run/enforcer-1.sock")
    monkeypatch.setenv("GPUSLICE_HOOK_SOCKET", "/run/enforcer.sock")
    args = cli.build_parser().parse_args(["hook-socket", "release"])
    assert cli.settings_from(args) == HookSocketSettings(
        "release", Path("/run/enforcer-1.sock"), Path("/run/enforcer.sock")
    )


def test_old_variable_names_work_for_one_release_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Users' manifests (and a chart of the previous release) set ENFORCER_SOCKET and friends:
    they are read, and stderr says which variable to set instead."""
    monkeypatch.setenv("ENFORCER_SOCKET", str(tmp_path / "e.sock"))
    monkeypatch.setenv("ENFORCER_HOOK_SOCKET", str(tmp_path / "absent" / "enforcer.sock"))
    args = cli.build_parser().parse_args(["hook-socket", "claim"])
    assert cli.settings_from(args) == HookSocketSettings(
        "claim", tmp_path / "e.sock", tmp_path / "absent" / "enforcer.sock"
    )
    cli.main(["hook-socket", "claim"])
    err = capsys.readouterr().err
    assert (
        "node-setup: warning: environment variable ENFORCER_SOCKET is deprecated and will not"
        " be read after the next release; set GPUSLICE_SOCKET instead" in err
    )
    assert "set GPUSLICE_HOOK_SOCKET instead" in err


def test_nothing_asked_nothing_done() -> None:
    assert cli.settings_from(cli.build_parser().parse_args([])) == Settings()
    assert cli.main([]) == 0


@pytest.mark.parametrize(
    ("env", "argv", "message"),
    [
        (
            {"GPUSLICE_FAKE_NVML_CONFIG_SRC": "/a"},
            [],
            "GPUSLICE_FAKE_NVML_CONFIG_SRC needs GPUSLICE_FAKE_NVML_CONFIG",
        ),
        (
            {
                "GPUSLICE_FAKE_NVML_CONFIG_SRC": "/a",
                "GPUSLICE_FAKE_NVML_CONFIG": "/b",
                "GPUSLICE_FAKE_NVML_SET_NAME": "true",
            },
            [],
            "GPUSLICE_FAKE_NVML_SET_NAME needs GPUSLICE_NODE_NAME",
        ),
        (
            {"GPUSLICE_HOOK_INSTALL_DIR": "/host-hook"},
            [],
            "GPUSLICE_HOOK_INSTALL_DIR needs GPUSLICE_HOOK_HOST_DIR",
        ),
        ({"GPUSLICE_SOCKET": "/e.sock"}, ["hook-socket", "claim"], "hook-socket claim needs"),
    ],
)
def test_missing_settings_exit_1_naming_them(
    env: dict[str, str],
    argv: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert cli.main(argv) == 1
    assert f"node-setup: {message}" in capsys.readouterr().err


def test_a_failed_step_exits_1_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GPUSLICE_FAKE_NVML_CONFIG_SRC", str(tmp_path / "absent.yaml"))
    monkeypatch.setenv("GPUSLICE_FAKE_NVML_CONFIG", str(tmp_path / "node.yaml"))
    assert cli.main([]) == 1
    assert "node-setup: failed: [Errno 2] No such file or directory" in capsys.readouterr().err
    monkeypatch.setenv("GPUSLICE_SOCKET", str(tmp_path / "e.sock"))
    monkeypatch.setenv("GPUSLICE_HOOK_SOCKET", str(tmp_path / "absent" / "enforcer.sock"))
    assert cli.main(["hook-socket", "claim"]) == 1
    assert "node-setup: hook-socket claim failed: FileNotFoundError" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["hook-socket", "take"])
    assert exited.value.code == 2
    with pytest.raises(SystemExit) as exited:
        cli.main(["hook-socket"])
    assert exited.value.code == 2


def test_the_steps_run_in_order_from_the_module(tmp_path: Path, run_dir: Path) -> None:
    """``python -m gpuslice_core.nodesetup`` (the console script's twin) with the chart's
    variables: sockets swept, then the fake config written."""
    dead_socket(dead := pod_socket(run_dir))
    src = tmp_path / "node.yaml"
    src.write_text("gpus: []\n")
    out = subprocess.run(
        [sys.executable, "-m", "gpuslice_core.nodesetup"],
        env={
            "PATH": os.environ.get("PATH", ""),
            "PYTHONPATH": os.pathsep.join(sys.path),
            "GPUSLICE_NODE_NAME": "n1",
            "GPUSLICE_SOCKET_DIR": str(run_dir),
            "GPUSLICE_FAKE_NVML_CONFIG_SRC": str(src),
            "GPUSLICE_FAKE_NVML_CONFIG": str(tmp_path / "out" / "node.yaml"),
            "GPUSLICE_FAKE_NVML_SET_NAME": "true",
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == [
        f"node-setup: removed {dead}: nothing listens on it",
        f"node-setup: fake NVML config for node n1 written to {tmp_path / 'out' / 'node.yaml'}",
    ]
    assert (tmp_path / "out" / "node.yaml").read_text() == 'gpus: []\nname: "n1"\n'


def test_it_needs_the_standard_library_only() -> None:
    """None of gpuslice-core's dependencies is imported: node-setup runs in any image that holds
    the package, whatever else that image lacks."""
    probe = (
        "import sys, gpuslice_core.nodesetup.cli\n"
        "tops = {m.split('.')[0] for m in sys.modules}\n"
        "print(sorted(tops - set(sys.stdlib_module_names) - {'gpuslice_core', '__main__'}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-S", "-c", probe],
        env={"PYTHONPATH": os.pathsep.join(sys.path)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "[]"
