#!/usr/bin/env bash
# The push steps of a release, sign-free and single-architecture, on the images hack/images.sh
# built (nothing is built here): every image of the images cache copied with skopeo to
# <registry>/<prefix>/gpuslice-<service>:<version>, the chart packaged with that version and
# pushed with `helm push` to oci://<registry>/<prefix>/charts; a JSON summary (refs, digests, the
# chart's reference) on stdout and the `helm install` command on stderr (docs/release.md).
# .github/workflows/release.yml does the same steps on a tag, with multi-arch builds and cosign.
#
# usage: hack/release.sh --local [--version V] [--prefix P] [--summary FILE]
#        hack/release.sh --registry HOST:PORT [--plain-http] [--version V] [--prefix P] ...
#   --local      start a loopback registry (Debian's docker-registry) for the run, stop it after
#   --help       every option (python -m gpuslice_testkit.release --help)
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-$REPO_ROOT/.venv/bin/python}

die() { printf 'release: error: %s\n' "$*" >&2; exit 1; }

[ -x "$PY" ] || die "no Python environment at $PY: make setup"
for tool in skopeo docker-registry; do
  command -v "$tool" >/dev/null || die "$tool is not installed: hack/node-packages.sh installs it"
done
bash "$REPO_ROOT/hack/images.sh" --check || exit 1
exec "$PY" -m gpuslice_testkit.release "$@"
