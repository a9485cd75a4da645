"""Flags, environment variables and start-up failures that name what is wrong."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuslice_mig_manager.app import MigManagerApp
from gpuslice_mig_manager.cli import Settings, build_parser, main
from gpuslice_nvml.fake import FakeNvml
from gpuslice_testkit.core import http_probe, preserved_logging

pytestmark = pytest.mark.timeout(20)


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """``main`` configures logging for the process, onto this test's captured stdout."""
    with preserved_logging():
        yield


FLAGS = {
    "--node-name": "GPUSLICE_NODE_NAME or NODE_NAME",
    "--kubeconfig": "KUBECONFIG",
    "--nvml": "GPUSLICE_NVML",
    "--fake-nvml-config": "GPUSLICE_FAKE_NVML_CONFIG",
    "--state-dir": "GPUSLICE_STATE_DIR",
    "--socket": "GPUSLICE_SOCKET",
    "--metrics-addr": "GPUSLICE_METRICS_ADDR",
    "--health-addr": "GPUSLICE_HEALTH_ADDR",
    "--config-file": "GPUSLICE_CONFIG_FILE",
    "--config-map": "GPUSLICE_CONFIG_MAP",
    "--dynamic-mig": "GPUSLICE_DYNAMIC_MIG",
    "--reconcile-interval": "GPUSLICE_RECONCILE_INTERVAL",
    "--retry-initial": "GPUSLICE_RETRY_INITIAL",
    "--retry-max": "GPUSLICE_RETRY_MAX",
    "--log-level": "GPUSLICE_LOG_LEVEL",
}


def test_help_documents_every_flag_with_its_variable() -> None:
    text = " ".join(build_parser().format_help().split())
    for flag, env in FLAGS.items():
        assert flag in text and f"[env {env}]" in text, flag


def test_environment_variables_set_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSLICE_DYNAMIC_MIG", "true")
    monkeypatch.setenv("GPUSLICE_RECONCILE_INTERVAL", "2.5")
    monkeypatch.setenv("GPUSLICE_SOCKET", "/tmp/x.sock")
    args = build_parser().parse_args([])
    assert (args.dynamic_mig, args.reconcile_interval, args.socket) == (True, 2.5, "/tmp/x.sock")
    assert build_parser().parse_args(["--no-dynamic-mig"]).dynamic_mig is False


def test_a_malformed_layout_file_stops_start_up_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "layouts.yaml"
    bad.write_text("version: v1\nmig-configs:\n  a:\n    - devices: all\n      mig-enable: true\n")

    code = main(["--nvml=fake", f"--config-file={bad}", f"--state-dir={tmp_path}"])

    assert code == 2
    err = capsys.readouterr().err
    assert "mig-configs.a[0].mig-enable: unknown key" in err


def test_file_and_configmap_are_exclusive(
    tmp_path: Path, layouts_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main([f"--config-file={layouts_file}", "--config-map=ns/name", "--node-name=n"])
    assert code == 2
    assert "mutually exclusive" in capsys.readouterr().err


def test_a_bad_configmap_reference_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--config-map=just-a-name", "--node-name=n"]) == 2
    assert "NAMESPACE/NAME" in capsys.readouterr().err


def test_fake_nvml_needs_a_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--nvml=fake", f"--state-dir={tmp_path}"]) == 2
    assert "--fake-nvml-config" in capsys.readouterr().err


def test_probe_fails_without_a_server(short_dir: Path) -> None:
    assert main(["--probe", f"--socket={short_dir / 'none.sock'}"]) == 1


def test_health_follows_the_socket_and_the_app(
    short_dir: Path, node_config: Path, fake: FakeNvml
) -> None:
    """/readyz: what --probe checks (the socket SERVING), 503 while starting and stopping;
    /healthz: the socket answers and the reconciler runs; the port closes with the app."""
    settings = Settings(
        nvml="fake",
        fake_nvml_config=str(node_config),
        state_dir=short_dir / "state",
        socket=short_dir / "mm.sock",
        health_addr="127.0.0.1:0",
        reconcile_interval=3600,
    )
    app = MigManagerApp(settings, fake, None)
    assert app.ready() == ["starting"] and app.live() == []
    app.start()
    port = app.health_server.port if app.health_server else 0
    try:
        assert http_probe(port, "/readyz") == 200
        assert http_probe(port, "/healthz") == 200
        assert main(["--probe", f"--socket={settings.socket}"]) == 0  # the same meaning
        app.server.health.enter_graceful_shutdown()
        assert http_probe(port, "/readyz") == 503
    finally:
        app.stop()
    assert app.ready() == ["stopping"]
    assert http_probe(port, "/readyz") is None
