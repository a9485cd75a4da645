"""hack/images.sh and what it builds from.

Always: each service's Dockerfile takes its base images as build arguments whose defaults are the
upstream images (so a user's plain ``docker build`` is unchanged), and the pause process behaves
like Kubernetes' own (SIGTERM/SIGINT, zombies reaped as PID 1).
Where ``hack/images.sh`` has built the images (CI runs it before the tests): every service image
is in the manifest under its directory's name, and its console script answers ``--help`` inside
the image; the Python base has what e2e workload pods use.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuslice_testkit.enforcer import go_hook, hook_missing

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "hack" / "images.sh"
PAUSE_C = ROOT / "hack" / "images" / "pause.c"
DOCKERFILES = sorted(ROOT.glob("services/*/Dockerfile"))
UV_VERSION = re.search(
    r"^UV_VERSION=(\S+)", (ROOT / "hack" / "bootstrap.sh").read_text(), re.MULTILINE
)
PYTHON_MINOR = re.search(
    r'^requires-python = ">=(\d+\.\d+)', (ROOT / "pyproject.toml").read_text(), re.MULTILINE
)
UPSTREAM = {
    "PYTHON_IMAGE": f"python:{PYTHON_MINOR.group(1) if PYTHON_MINOR else '?'}-slim",
    "UV_IMAGE": f"ghcr.io/astral-sh/uv:{UV_VERSION.group(1) if UV_VERSION else '?'}",
}
#: The Go stage's base, where a Dockerfile builds a Go program (the enforcer's static hook).
GO_IMAGE = re.compile(r"golang:1\.(\d+)-bookworm")
HOOK_MODULE = ROOT / "services" / "enforcer" / "hook" / "go.mod"


def _instructions(dockerfile: Path) -> list[str]:
    """The Dockerfile's instructions, one string each (comments and blank lines dropped)."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and line[0] != "#"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_base_images_are_build_args_defaulting_to_the_upstream_images(dockerfile: Path) -> None:
    steps = _instructions(dockerfile)
    first_from = next(i for i, s in enumerate(steps) if s.startswith("FROM "))
    global_args = dict(
        s.removeprefix("ARG ").split("=", 1) for s in steps[:first_from] if s.startswith("ARG ")
    )
    # docker build without --build-arg gets exactly the images it got before; a Go stage's base
    # is the Debian (bookworm) golang image of a Go at least as new as its module asks for
    go_image = global_args.pop("GO_IMAGE", None)
    assert global_args == UPSTREAM
    if go_image is not None:
        match = GO_IMAGE.fullmatch(go_image)
        wanted = re.search(r"^go 1\.(\d+)", HOOK_MODULE.read_text(), re.MULTILINE)
        assert match and wanted and int(match.group(1)) >= int(wanted.group(1)), go_image
    # every stage starts from one of them: no image name is hard-coded anywhere else
    froms = [s.split()[1] for s in steps if s.startswith("FROM ")]
    bases = {"${PYTHON_IMAGE}", "${UV_IMAGE}"} | ({"${GO_IMAGE}"} if go_image else set())
    assert set(froms) <= bases, froms
    assert froms[-1] == "${PYTHON_IMAGE}", "the final stage must run on the Python base"
    assert "FROM ${UV_IMAGE} AS uv" in steps
    assert "COPY --from=uv /uv /usr/local/bin/uv" in steps
    assert not [s for s in steps if re.match(r"COPY --from=\S*[:/]", s)], "copy from stages only"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_the_ca_bundle_argument_is_unset_unless_a_build_passes_it(dockerfile: Path) -> None:
    """``ARG SSL_CERT_FILE`` without a default: a user's build sets nothing, a build behind a
    TLS-intercepting proxy passes the path of the bundle it mounts (hack/images.sh)."""
    steps = _instructions(dockerfile)
    sync = next(i for i, s in enumerate(steps) if s.startswith("RUN uv sync"))
    stage = max(i for i, s in enumerate(steps[:sync]) if s.startswith("FROM "))
    assert "ARG SSL_CERT_FILE" in steps[stage:sync]
    assert not [s for s in steps if s.startswith("ARG SSL_CERT_FILE=")]
    assert not [s for s in steps if "SSL_CERT_FILE" in s and s.startswith("ENV")]


def test_missing_images_fail_with_how_to_build(tmp_path: Path) -> None:
    out = subprocess.run(
        ["bash", str(SCRIPT), "--check"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={**os.environ, "GPUSLICE_IMAGES_CACHE": str(tmp_path)},
    )
    assert out.returncode == 1
    assert "make images" in out.stderr


# --- the pause process -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pause_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not shutil.which("gcc"):
        pytest.skip("gcc is not installed (hack/node-packages.sh installs it)")
    binary = tmp_path_factory.mktemp("pause") / "pause"
    cmd = ["gcc", "-static", "-Os", "-Wall", "-Wextra", "-Werror", "-o", str(binary), str(PAUSE_C)]
    subprocess.run(cmd, check=True, timeout=50)
    return binary


@pytest.mark.parametrize("signo", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_pause_exits_0_on_a_stop_signal(pause_binary: Path, signo: signal.Signals) -> None:
    proc = subprocess.Popen([str(pause_binary)], stderr=subprocess.DEVNULL)
    time.sleep(0.2)  # its handlers are installed before it first sleeps
    proc.send_signal(signo)
    assert proc.wait(timeout=10) == 0


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, state) of the processes whose parent is ``pid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        state, ppid = text.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid:
            found.append((int(stat.parent.name), state))
    return found


def test_pause_reaps_the_orphans_of_its_pid_namespace(pause_binary: Path) -> None:
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("nsenter"):
        pytest.skip("needs root, unshare and nsenter (a PID namespace of its own)")
    # pause as PID 1 of a new PID namespace, as in a pod that shares its process namespace
    outer = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", str(pause_binary)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 10
        while not (kids := _children(outer.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert kids, "pause did not start"
        pause = kids[0][0]
        # a shell in its namespace leaves a short-lived child behind: the orphan becomes pause's
        subprocess.run(
            ["nsenter", "--target", str(pause), "--pid", "--", "sh", "-c", "sleep 0.3 & exit 0"],
            check=True,
            timeout=10,
        )
        assert [pid for pid, _ in _children(pause)], "the orphan was not reparented to pause"
        deadline = time.monotonic() + 10
        while _children(pause) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _children(pause) == [], "pause left its orphan a zombie"
        os.kill(pause, signal.SIGTERM)
        assert outer.wait(timeout=10) == 0
    finally:
        if outer.poll() is None:
            outer.kill()
            outer.wait(timeout=10)
        assert outer.stderr is not None
        outer.stderr.close()


# --- the built images ----------------------------------------------------------------------------


def _cache() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("GPUSLICE_IMAGES_CACHE") or Path(xdg) / "gpuslice" / "images")


@pytest.fixture(scope="module")
def manifest() -> dict[str, Any]:
    found = subprocess.run(
        ["bash", str(SCRIPT), "--print-manifest"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if found.returncode != 0:
        pytest.skip(f"no images built in {_cache()} (make images builds them)")
    loaded: dict[str, Any] = json.loads(Path(found.stdout.strip()).read_text())
    return loaded


@pytest.fixture(scope="module")
def buildah(manifest: dict[str, Any]) -> Iterator[list[str]]:
    """buildah on hack/images.sh's own storage, holding its lock (no build runs meanwhile)."""
    if os.geteuid() != 0 or not shutil.which("buildah"):
        pytest.skip("running an image needs root and buildah (hack/node-packages.sh)")
    storage = _cache() / "storage"
    with (_cache() / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield [
            "buildah",
            "--root",
            str(storage / "root"),
            "--runroot",
            str(storage / "run"),
            "--storage-driver",
            manifest["storage_driver"],
        ]


def _run_in(buildah: list[str], image: dict[str, Any], *argv: str) -> str:
    """Run ``argv`` in a throwaway container of ``image`` (restored from its archive if needed)."""
    ref = str(image["ref"])
    have = subprocess.run([*buildah, "inspect", "--type", "image", ref], capture_output=True)
    if have.returncode != 0:
        subprocess.run(
            [*buildah, "pull", "--quiet", f"oci-archive:{image['archive']}"],
            check=True,
            capture_output=True,
            timeout=50,
        )
    ctr = subprocess.run(
        [*buildah, "from", "--pull-never", ref],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout.strip()
    try:
        out = subprocess.run(
            [*buildah, "run", "--isolation", "chroot", ctr, "--", *argv],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    finally:
        subprocess.run([*buildah, "rm", ctr], capture_output=True, timeout=30, check=False)
    assert out.returncode == 0, f"{argv} in {ref}: {out.stderr}"
    return out.stdout


def test_every_service_image_is_in_the_manifest(manifest: dict[str, Any]) -> None:
    images = manifest["images"]
    expected = {d.parent.name for d in DOCKERFILES} | {"pause", "python-base"}
    assert set(images) == expected
    for name, image in images.items():
        # the chart is given image.registry=localhost/gpuslice and the tag per service
        ref = rf"localhost/gpuslice/{re.escape(name)}:[0-9a-f]{{16}}"
        assert re.fullmatch(ref, str(image["ref"]))
        assert Path(str(image["archive"])).stat().st_size == image["size_bytes"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_the_service_image_runs_its_console_script(
    dockerfile: Path, manifest: dict[str, Any], buildah: list[str]
) -> None:
    entrypoint = re.search(r'^ENTRYPOINT \["([^"]+)"', dockerfile.read_text(), re.MULTILINE)
    assert entrypoint
    image = manifest["images"][dockerfile.parent.name]
    out = _run_in(buildah, image, entrypoint.group(1), "--help")
    assert out.startswith(f"usage: {entrypoint.group(1)}")
    # the chart's node-setup runs from whichever service image it picks (gpuslice-core's script)
    setup = _run_in(buildah, image, "gpuslice-node-setup", "--help")
    assert setup.startswith("usage: gpuslice-node-setup")


def test_the_enforcer_image_holds_the_static_hook_the_tests_run(
    manifest: dict[str, Any], buildah: list[str]
) -> None:
    """hack/images.sh checks it at every build; here for the archive the manifest names now. The
    Python hook's console script is not in the image: the static hook is its only hook."""
    reason = hook_missing("go")
    if reason:
        pytest.skip(reason)
    image = manifest["images"]["enforcer"]
    script = "sha256sum /usr/local/bin/gpuslice-enforcer-hook; ls /opt/gpuslice/bin"
    out = _run_in(buildah, image, "/bin/sh", "-c", script).split()
    assert out[0] == hashlib.sha256(go_hook().read_bytes()).hexdigest()
    assert "gpuslice-enforcer" in out and "gpuslice-enforcer-hook" not in out
    usage = _run_in(buildah, image, "gpuslice-enforcer-hook", "--help")
    assert usage.startswith("usage: gpuslice-enforcer-hook {attach,detach}")


def test_the_python_base_serves_as_the_workload_image(
    manifest: dict[str, Any], buildah: list[str]
) -> None:
    image = manifest["images"]["python-base"]
    script = (
        "env >/dev/null && sleep 0 && cat /etc/debian_version >/dev/null && "
        "python3 -c 'import ssl, sys; print(\"%d.%d\" % sys.version_info[:2])'"
    )
    assert _run_in(buildah, image, "/bin/sh", "-c", script).strip() == UPSTREAM[
        "PYTHON_IMAGE"
    ].removeprefix("python:").removesuffix("-slim")


def test_the_pause_image_holds_the_static_pause(
    manifest: dict[str, Any], buildah: list[str]
) -> None:
    image = manifest["images"]["pause"]
    assert _run_in(buildah, image, "/pause", "-v").startswith("pause ")
