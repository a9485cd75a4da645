#!/usr/bin/env bash
# Lints the GitHub workflows (.github/workflows/*.yml) with actionlint, built once from its Go
# module (github.com/rhysd/actionlint, pinned below) with this machine's Go; no binary download.
# The module cache, build cache and binary live outside the work tree, in
#   ${GPUSLICE_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpuslice/tools}/actionlint-<version>/
# so the second run only lints. actionlint runs shellcheck on `run:` scripts when shellcheck is on
# PATH (it is optional; without it those scripts are not linted, and actionlint says nothing).
#
# usage: hack/actionlint.sh [--print-path | --help] [FILE...]
#   (none)        build unless cached, then lint every .github/workflows/*.yml (or the FILEs)
#   --print-path  build unless cached and print the binary's path only
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# The newest release the Go module proxy serves here (/work/.library/env/packages/go-partial.tsv).
ACTIONLINT_VERSION=v1.7.12
TOOLS=${GPUSLICE_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpuslice/tools}
DIR="$TOOLS/actionlint-$ACTIONLINT_VERSION"
BIN="$DIR/bin/actionlint"

log() { printf '>> %s\n' "$*" >&2; }
die() { printf 'actionlint: error: %s\n' "$*" >&2; exit 1; }

MODE=lint
case "${1:-}" in
  --print-path) MODE=print; shift ;;
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  -*) die "unknown argument '$1' (see --help)" ;;
esac

if [ ! -x "$BIN" ]; then
  command -v go >/dev/null || die "go is not installed (actionlint is built from its Go module)"
  log "building actionlint $ACTIONLINT_VERSION from its Go module into $DIR (once)"
  start=$SECONDS
  mkdir -p "$DIR"
  # GOBIN: the binary; GOPATH, GOMODCACHE, GOCACHE: everything the build writes, in one place
  GOBIN="$DIR/bin.tmp" GOPATH="$DIR/gopath" GOMODCACHE="$DIR/gopath/pkg/mod" GOCACHE="$DIR/go-build" \
    GOTOOLCHAIN=local GOFLAGS=-mod=mod CGO_ENABLED=0 \
    go install "github.com/rhysd/actionlint/cmd/actionlint@$ACTIONLINT_VERSION" \
    || die "go install github.com/rhysd/actionlint/cmd/actionlint@$ACTIONLINT_VERSION failed (above)"
  rm -rf "$DIR/bin"
  mv "$DIR/bin.tmp" "$DIR/bin"
  log "built $BIN in $(( SECONDS - start ))s"
fi
got=$("$BIN" -version)
[[ $got == "$ACTIONLINT_VERSION"* || $got == "${ACTIONLINT_VERSION#v}"* ]] \
  || die "$BIN reports '${got%%$'\n'*}', expected $ACTIONLINT_VERSION (delete $DIR to rebuild)"
if [ "$MODE" = print ]; then
  echo "$BIN"
  exit 0
fi

cd "$REPO_ROOT"
if [ $# -eq 0 ]; then
  shopt -s nullglob
  set -- .github/workflows/*.yml .github/workflows/*.yaml
  [ $# -gt 0 ] || die "no workflow files in .github/workflows"
fi
"$BIN" -no-color "$@"
