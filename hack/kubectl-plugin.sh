#!/usr/bin/env bash
# Builds kubectl-gpuslice as one executable file (a Python zip application,
# hack/kubectl_plugin/build.py) with the plugin, the gpuslice libraries and the third-party
# distributions tools/kubectl-gpuslice/pyproject.toml names vendored from an installed
# environment, and writes its sha256 next to it. Everything in it is pure Python: the one file
# runs with any python3 from 3.10 on, on every platform (docs/cluster-view.md, "Installing").
# Also packs it for krew with --archive.
#
# usage: hack/kubectl-plugin.sh [--python PY] [--out FILE] [--archive]
#   --python PY   the interpreter of the environment to vendor from (default: .venv/bin/python of
#                 the repository, else python3)
#   --out FILE    where to write the executable (default: dist/kubectl-gpuslice)
#   --archive     also write kubectl-gpuslice.tar.gz beside it (the executable and the LICENSE,
#                 as krew installs it) and its .sha256: one archive for every platform
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=""
OUT="$REPO_ROOT/dist/kubectl-gpuslice"
ARCHIVE=0
while [ $# -gt 0 ]; do
  case "$1" in
    --python) PY=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --archive) ARCHIVE=1; shift ;;
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

if [ "$ARCHIVE" = 1 ]; then
  dir=$(dirname "$OUT")
  stage=$(mktemp -d)
  trap 'rm -rf "$stage"' EXIT
  cp "$OUT" "$stage/kubectl-gpuslice"
  [ -f "$REPO_ROOT/LICENSE" ] && cp "$REPO_ROOT/LICENSE" "$stage/LICENSE"
  tarball="kubectl-gpuslice.tar.gz"
  (cd "$stage" && tar -czf "$dir/$tarball" ./*)
  (cd "$dir" && sha "$tarball" > "$tarball.sha256")
  cat "$dir/$tarball.sha256"
fi
