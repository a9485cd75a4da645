"""The push steps of a release against any registry, without signing and for one architecture:
what ``.github/workflows/release.yml`` does after its multi-arch build, run here on the images
``hack/images.sh`` built (docs/release.md).

    summary = release(registry="127.0.0.1:5000", prefix="gpuslice", version="0.1.0",
                      plain_http=True, workdir=tmp_path)
    summary.images["enforcer"].pinned   # 127.0.0.1:5000/gpuslice/gpuslice-enforcer:0.1.0@sha256:...
    summary.chart.ref                   # oci://127.0.0.1:5000/gpuslice/charts/gpuslice

1. every service image of the images cache (``services/<name>/Dockerfile``; nothing is built)
   is copied with skopeo from its OCI archive to ``<registry>/<prefix>/gpuslice-<name>:<version>``,
   in parallel, and its manifest digest is read back from skopeo's ``--digestfile``; the other
   images of the cache (pause, python-base: the real nodes' sandbox and workload images) go to
   ``<registry>/<prefix>/<name>:<version>``;
2. the chart is packaged with ``helm package --version V --app-version V`` (so its default image
   tag is V) and pushed with ``helm push`` to ``oci://<registry>/<prefix>/charts``.

With ``image.registry=<registry>/<prefix>`` the chart then resolves to exactly the pushed images.

Command line: ``python -m gpuslice_testkit.release --help`` (``hack/release.sh`` wraps it;
``make release-local`` runs it against a loopback registry).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from gpuslice_testkit import registry as loopback

ROOT = Path(__file__).resolve().parents[4]
CHART_DIR = ROOT / "charts" / "gpuslice"
CHART_NAME = "gpuslice"
IMAGE_PREFIX = "gpuslice-"
"""Service images are named ``gpuslice-<service>`` (values.yaml ``<service>.image.repository``)."""

# Helm wants SemVer 2 for chart versions; an image tag allows [A-Za-z0-9_.-] only, so no "+".
_VERSION = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z.-]+)?$")
_REGISTRY = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+)(:\d{1,5})?$")
# distribution's repository path: components of [a-z0-9] separated by ., _, __ or -
_COMPONENT = r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*"
_PREFIX = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
PUSH_TIMEOUT = 600.0


class ReleaseError(RuntimeError):
    """A push step failed; the message names the step and carries the tool's output."""


@dataclass(frozen=True)
class PushedImage:
    name: str
    """The image's name in the images cache (a service name, or pause/python-base)."""
    ref: str
    """``<registry>/<prefix>/<repository>:<version>``."""
    digest: str
    """The manifest digest the registry stored (``sha256:...``)."""
    source: str
    """The OCI archive it came from."""
    chart: bool
    """True for the services' images, which the chart's templates reference."""
    seconds: float

    @property
    def repository(self) -> str:
        return self.ref.rsplit(":", 1)[0]

    @property
    def pinned(self) -> str:
        """``ref@digest``: what a signature or a paranoid install names."""
        return f"{self.ref}@{self.digest}"


@dataclass(frozen=True)
class PushedChart:
    ref: str
    """``oci://<registry>/<prefix>/charts/gpuslice`` (with ``--version``: the chart)."""
    version: str
    digest: str
    package: str
    """The packaged .tgz."""
    seconds: float


@dataclass(frozen=True)
class Summary:
    registry: str
    prefix: str
    version: str
    plain_http: bool
    images: dict[str, PushedImage]
    chart: PushedChart
    images_seconds: float
    """Wall time of all image pushes together (parallel)."""

    @property
    def image_registry(self) -> str:
        """The chart's ``image.registry`` value that makes it use these images."""
        return f"{self.registry}/{self.prefix}"

    def install_command(self, release: str = "gpuslice", namespace: str = "gpuslice") -> str:
        plain = " --plain-http" if self.plain_http else ""
        return (
            f"helm install {release} {self.chart.ref} --version {self.version}{plain}"
            f" --namespace {namespace} --create-namespace"
            f" --set image.registry={self.image_registry}"
        )

    def to_json(self) -> str:
        data = asdict(self)
        for name, image in self.images.items():
            data["images"][name]["pinned"] = image.pinned
        data["image_registry"] = self.image_registry
        data["install"] = self.install_command()
        return json.dumps(data, indent=2) + "\n"


def check_inputs(registry: str, prefix: str, version: str) -> None:
    """ValueError naming the field and what it allows."""
    if not _REGISTRY.match(registry):
        raise ValueError(
            f"registry: {registry!r} is not HOST[:PORT] (e.g. 127.0.0.1:5000 or ghcr.io; no "
            "scheme, no path: the path goes in prefix)"
        )
    if not _PREFIX.match(prefix):
        raise ValueError(
            f"prefix: {prefix!r} is not a repository path (lower-case components of "
            "[a-z0-9] joined by '.', '_', '__' or '-', separated by '/', e.g. gpuslice or "
            "my-org/gpuslice)"
        )
    if not _VERSION.match(version):
        raise ValueError(
            f"version: {version!r} is not a release version MAJOR.MINOR.PATCH[-PRERELEASE] "
            "(SemVer without a leading 'v' or '+build': it is the chart version and the image tag)"
        )


def services(root: Path = ROOT) -> list[str]:
    """The services that have an image: every ``services/<name>/Dockerfile``."""
    return sorted(p.parent.name for p in (root / "services").glob("*/Dockerfile"))


def cached_images(manifest: Path | None = None) -> dict[str, Path]:
    """Name -> OCI archive of hack/images.sh's manifest (``$GPUSLICE_IMAGES_MANIFEST`` wins);
    ReleaseError saying ``make images`` when it, an archive or a service image is missing."""
    if manifest is None:
        env = os.environ.get("GPUSLICE_IMAGES_MANIFEST")
        if env:
            manifest = Path(env)
        else:
            found = subprocess.run(
                ["bash", str(ROOT / "hack" / "images.sh"), "--print-manifest"],
                capture_output=True,
                text=True,
                check=False,
            )
            if found.returncode != 0:
                raise ReleaseError(
                    "the images are not built (nothing is built here): make images\n"
                    + found.stderr.strip()
                )
            manifest = Path(found.stdout.strip().splitlines()[-1])
    entries = json.loads(manifest.read_text())["images"]
    archives = {name: Path(entry["archive"]) for name, entry in entries.items()}
    missing = [str(a) for a in archives.values() if not a.is_file()]
    absent = [s for s in services() if s not in archives]
    if missing or absent:
        raise ReleaseError(
            f"{manifest}: missing archives {missing} or service images {absent}: make images"
        )
    return archives


def _run(step: str, cmd: list[str], env: dict[str, str] | None = None) -> str:
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=PUSH_TIMEOUT, env=env, check=False
        )
    except FileNotFoundError as exc:
        raise ReleaseError(f"{step}: {cmd[0]} is not installed ({exc})") from exc
    except subprocess.TimeoutExpired as exc:
        raise ReleaseError(f"{step}: {' '.join(cmd)} ran past {PUSH_TIMEOUT:g} s") from exc
    if done.returncode != 0:
        raise ReleaseError(
            f"{step}: {' '.join(cmd)} exited with {done.returncode}:\n"
            f"{(done.stdout + done.stderr).strip()[-3000:]}"
        )
    return done.stdout + done.stderr


def push_image(
    name: str,
    archive: Path,
    ref: str,
    *,
    plain_http: bool,
    workdir: Path,
    chart: bool,
) -> PushedImage:
    """``skopeo copy oci-archive:ARCHIVE docker://REF``; the digest the registry stored."""
    start = time.monotonic()
    digest_file = workdir / f"{name}.digest"
    digest_file.unlink(missing_ok=True)
    cmd = ["skopeo", "copy", "--quiet", "--retry-times", "2", "--digestfile", str(digest_file)]
    if plain_http:
        cmd.append("--dest-tls-verify=false")
    _run(f"push {name}", [*cmd, f"oci-archive:{archive}", f"docker://{ref}"])
    digest = digest_file.read_text().strip()
    if not _DIGEST.match(digest):
        raise ReleaseError(f"push {name}: skopeo wrote no digest to {digest_file} ({digest!r})")
    return PushedImage(name, ref, digest, str(archive), chart, time.monotonic() - start)


def push_images(
    registry: str,
    prefix: str,
    version: str,
    *,
    plain_http: bool,
    workdir: Path,
    archives: dict[str, Path] | None = None,
    parallel: int = 2,
) -> dict[str, PushedImage]:
    """Every image of the cache, ``parallel`` at a time (1: one after the other)."""
    if parallel < 1:
        raise ValueError(f"parallel: {parallel} (allowed: 1 or more pushes at a time)")
    archives = cached_images() if archives is None else archives
    service_names = set(services())
    workdir.mkdir(parents=True, exist_ok=True)
    jobs = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
        for name, archive in sorted(archives.items()):
            chart = name in service_names
            repository = f"{IMAGE_PREFIX}{name}" if chart else name
            ref = f"{registry}/{prefix}/{repository}:{version}"
            jobs[name] = pool.submit(
                push_image, name, archive, ref, plain_http=plain_http, workdir=workdir, chart=chart
            )
    return {name: job.result() for name, job in jobs.items()}


def helm_env(workdir: Path) -> dict[str, str]:
    """helm with its registry config and caches in ``workdir`` (nothing in the user's home)."""
    home = workdir / "helm"
    return {
        **os.environ,
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_DATA_HOME": str(home / "data"),
    }


def push_chart(
    registry: str,
    prefix: str,
    version: str,
    *,
    helm: str,
    plain_http: bool,
    workdir: Path,
    chart_dir: Path = CHART_DIR,
) -> PushedChart:
    """``helm package --version V --app-version V`` and ``helm push`` to ``oci://.../charts``."""
    start = time.monotonic()
    out_dir = workdir / "chart"
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    env = helm_env(workdir)
    _run(
        "package the chart",
        [helm, "package", str(chart_dir), "--version", version, "--app-version", version,
         "--destination", str(out_dir)],
        env,
    )  # fmt: skip
    package = out_dir / f"{CHART_NAME}-{version}.tgz"
    if not package.is_file():
        raise ReleaseError(f"package the chart: helm package wrote no {package}")
    repo = f"oci://{registry}/{prefix}/charts"
    cmd = [helm, "push", str(package), repo]
    if plain_http:
        cmd.append("--plain-http")
    output = _run("push the chart", cmd, env)
    found = re.search(r"^Digest:\s*(sha256:[0-9a-f]{64})\s*$", output, re.MULTILINE)
    if not found:
        raise ReleaseError(
            f"push the chart: no 'Digest: sha256:...' in helm push's output:\n{output}"
        )
    return PushedChart(
        f"{repo}/{CHART_NAME}", version, found.group(1), str(package), time.monotonic() - start
    )


def find_helm() -> str:
    """helm from hack/install-helm.sh (installed on first use)."""
    done = subprocess.run(
        ["bash", str(ROOT / "hack" / "install-helm.sh")],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise ReleaseError(f"hack/install-helm.sh failed:\n{done.stderr[-2000:]}")
    return done.stdout.strip().splitlines()[-1]


def release(
    registry: str,
    prefix: str,
    version: str,
    *,
    plain_http: bool,
    workdir: Path,
    helm: str | None = None,
    archives: dict[str, Path] | None = None,
    parallel: int = 2,
) -> Summary:
    """Push the images, then the chart; the summary of both."""
    check_inputs(registry, prefix, version)
    helm = helm or find_helm()
    archives = cached_images() if archives is None else archives
    start = time.monotonic()
    images = push_images(
        registry, prefix, version, plain_http=plain_http, workdir=workdir, archives=archives,
        parallel=parallel,
    )  # fmt: skip
    images_seconds = time.monotonic() - start
    chart = push_chart(registry, prefix, version, helm=helm, plain_http=plain_http, workdir=workdir)
    return Summary(registry, prefix, version, plain_http, images, chart, images_seconds)


def _print_summary(summary: Summary, out: Path | None) -> None:
    text = summary.to_json()
    if out:
        out.write_text(text)
    print(text, end="")
    print(
        f"# pushed {len(summary.images)} images in {summary.images_seconds:.1f} s and the chart "
        f"in {summary.chart.seconds:.1f} s; install with:\n{summary.install_command()}",
        file=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpuslice_testkit.release",
        description="Push every image of the images cache (make images) and the chart, "
        "packaged with VERSION, to a registry; print a JSON summary (image refs with digests, "
        "the chart's oci:// reference) and the helm install command.",
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--registry", help="The registry as HOST:PORT (or HOST).")
    where.add_argument(
        "--local",
        action="store_true",
        help="Start a loopback registry (Debian's docker-registry) for the run, stop it after.",
    )
    parser.add_argument("--prefix", default="gpuslice", help="The repository path in the registry.")
    parser.add_argument("--version", default="0.0.0-local", help="Chart version and image tag.")
    parser.add_argument(
        "--plain-http", action="store_true", help="Talk HTTP, not HTTPS (implied by --local)."
    )
    parser.add_argument("--parallel", type=int, default=2, help="Image pushes at a time.")
    parser.add_argument("--summary", type=Path, help="Also write the JSON summary to this file.")
    parser.add_argument(
        "--workdir", type=Path, help="Scratch directory (default: a temporary one, removed)."
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gpuslice-release-") as tmp:
        workdir = (args.workdir or Path(tmp)).resolve()
        try:
            if args.local:
                with loopback.start_registry(workdir / "registry") as reg:
                    print(
                        f"# loopback registry at {reg.address} (stopped at the end)",
                        file=sys.stderr,
                    )
                    summary = release(
                        reg.address, args.prefix, args.version, plain_http=True, workdir=workdir,
                        parallel=args.parallel,
                    )  # fmt: skip
                    _print_summary(summary, args.summary)
            else:
                summary = release(
                    args.registry, args.prefix, args.version, plain_http=args.plain_http,
                    workdir=workdir, parallel=args.parallel,
                )  # fmt: skip
                _print_summary(summary, args.summary)
        except (ValueError, ReleaseError, loopback.RegistryError) as exc:
            print(f"release: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
