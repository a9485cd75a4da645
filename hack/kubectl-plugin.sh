#!/usr/bin/env bash
# Builds kubectl-gpuslice as one executable file (a Python zip application,
# hack/kubectl_plugin/build.py) with the plugin, the gpuslice libraries and the third-party
# distributions tools/kubectl-gpuslice/pyproject.toml names vendored from an installed
# environment, and writes its sha256 next to it. The file runs from the zip with a python3 of the
# same CPython minor version on the same platform as that environment (pydantic-core, which the
# kubernetes client needs, is compiled; docs/cluster-view.md, "Installing"). Also packs it for
# krew with --archive.
#
# usage: hack/kubectl-plugin.sh [--python PY] [--out FILE] [--archive OS_ARCH]
#   --python PY        the interpreter of the environment to vendor from (default: .venv/bin/python
#                      of the repository, else python3); the file is for its version and platform
#   --out FILE         where to write the executable (default: dist/kubectl-gpuslice)
#   --archive OS_ARCH  also write dist/kubectl-gpuslice_<OS_ARCH>.tar.gz (the executable and the
#                      LICENSE, as krew installs it) and its .sha256
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=""
OUT="$REPO_ROOT/dist/kubectl-gpuslice"
ARCHIVE=""
while [ $# -gt 0 ]; do
  case "$1" in
    --python) PY=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --archive) ARCHIVE=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "kubectl-plugin.sh: unknown argument $1 (--help)" >&2; exit 2 ;;
  esac
done
if [ -z "$PY" ]; then
  if [ -x "$REPO_ROOT/.venv/bin/python" ]; then PY="$REPO_ROOT/.venv/bin/python"; else PY=python3; fi
fi

mkdir -p "$(dirname "$OUT")"
OUT="$(cd "$(dirname "$OUT")" && pwd)/$(basename "$OUT")"
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$PY" "$REPO_ROOT/hack/kubectl_plugin/build.py" --site-packages "$SITE" --out "$OUT"
chmod 0755 "$OUT"
sha() { if command -v sha256sum >/dev/null; then sha256sum "$1"; else shasum -a 256 "$1"; fi; }
(cd "$(dirname "$OUT")" && sha "$(basename "$OUT")" > "$(basename "$OUT").sha256")
cat "$OUT.sha256"

if [ -n "$ARCHIVE" ]; then
  dir=$(dirname "$OUT")
  stage=$(mktemp -d)
  trap 'rm -rf "$stage"' EXIT
  cp "$OUT" "$stage/kubectl-gpuslice"
  [ -f "$REPO_ROOT/LICENSE" ] && cp "$REPO_ROOT/LICENSE" "$stage/LICENSE"
  tarball="kubectl-gpuslice_${ARCHIVE}.tar.gz"
  (cd "$stage" && tar -czf "$dir/$tarball" ./*)
  (cd "$dir" && sha "$tarball" > "$tarball.sha256")
  cat "$dir/$tarball.sha256"
fi
