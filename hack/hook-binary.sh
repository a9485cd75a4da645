#!/usr/bin/env bash
# Builds gpuslice-enforcer-hook, the enforcer's CDI hook (services/enforcer/hook: Go, standard
# library only, no cgo), as one static binary with the machine's Go, after gofmt, go vet and
# go test pass, into a cache outside the work tree:
#   ${GPUSLICE_HOOK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpuslice/hook}/bin/<key>/gpuslice-enforcer-hook
# <key> hashes the module's files (those git sees), the Go version and the build recipe, so a
# rerun with nothing changed only prints the path, and a worktree with other sources gets its
# own binary. Go's build cache is the one hack/kube-binaries.sh and hack/node-binaries.sh use
# (${GPUSLICE_KUBE_CACHE:-~/.cache/gpuslice/kube}/go-build), where containerd's static build has
# compiled the standard library with these flags already: a cold build here takes seconds, not
# a minute and a half. No module is downloaded (the module has no dependencies), so the build
# works offline. The flags are those of the enforcer image's build stage
# (services/enforcer/Dockerfile), so the same Go gives the same bytes.
# Binaries not used for 14 days are deleted.
#
# usage: hack/hook-binary.sh [--print-path | --check | --force | --help]
#   (none)        build unless cached; progress on stderr; the binary's path is the last stdout line
#   --print-path  print the path when the binary of these sources is built (no build), else exit 1
#   --check       like --print-path, silent on success, a how-to-build message on failure
#   --force       rebuild (and re-test) even when the binary is cached
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MODULE_DIR=services/enforcer/hook
NAME=gpuslice-enforcer-hook
# Bump when the way the binary is made changes in a way its inputs do not show.
RECIPE=1
# As the Dockerfile's hook stage: static (no cgo), no paths of this machine, no debug symbols.
LDFLAGS="-s -w"

log() { printf '>> %s\n' "$*" >&2; }
die() { printf 'hook-binary: error: %s\n' "$*" >&2; exit 1; }

MODE=build
case "${1:-}" in
  "") ;;
  --print-path) MODE=print ;;
  --check) MODE=check ;;
  --force) MODE=force ;;
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  *) die "unknown argument '$1' (see --help)" ;;
esac

CACHE=${GPUSLICE_HOOK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpuslice/hook}

command -v go >/dev/null || die "go is not installed (Go 1.22 or newer builds $MODULE_DIR; the enforcer image builds it in its own Go stage)"
export GOTOOLCHAIN=local GOWORK=off GO111MODULE=on GOFLAGS="-mod=mod -trimpath -buildvcs=false"
KUBE_CACHE=${GPUSLICE_KUBE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpuslice/kube}
export CGO_ENABLED=0 GOCACHE="$KUBE_CACHE/go-build" GOPATH="$CACHE/go"
GO_VERSION=$(go env GOVERSION)

# The module's files as git sees them (tracked, or untracked and not ignored), names and contents.
inputs=$(
  cd "$REPO_ROOT"
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -z -c -o --exclude-standard -- "$MODULE_DIR"
  else
    find "$MODULE_DIR" -type f -print0
  fi | sort -zu | while IFS= read -r -d '' f; do
    [ ! -f "$f" ] || printf '%s\0' "$f"
  done | xargs -0 -r sha256sum | sha256sum | cut -c1-64
)
KEY=$(printf '%s %s %s %s %s' "$RECIPE" "$GO_VERSION" "$(go env GOOS GOARCH | tr '\n' ' ')" "$LDFLAGS" "$inputs" | sha256sum | cut -c1-16)
DIR="$CACHE/bin/$KEY"
BINARY="$DIR/$NAME"

if [ "$MODE" != force ] && [ -x "$BINARY" ] && [ -f "$DIR/.stamp" ]; then
  touch "$DIR"  # in use: not pruned
  [ "$MODE" = check ] || echo "$BINARY"
  exit 0
fi
if [ "$MODE" = print ] || [ "$MODE" = check ]; then
  cat >&2 <<EOF
hook-binary: $NAME of these sources ($MODULE_DIR, $GO_VERSION) is not built.
  looked for: $BINARY
  build it (a few seconds; about 20 s with an empty Go build cache):  hack/hook-binary.sh
EOF
  exit 1
fi

mkdir -p "$CACHE/bin"
exec 9>"$CACHE/.lock"
if ! flock -n 9; then
  log "another build holds $CACHE/.lock; waiting for it"
  flock 9
fi
START=$SECONDS
cd "$REPO_ROOT/$MODULE_DIR"
NICE=(nice -n "${GPUSLICE_BUILD_NICE:-19}")
unformatted=$(gofmt -l .)
[ -z "$unformatted" ] || die "gofmt would change: $unformatted (run: gofmt -w $MODULE_DIR)"
"${NICE[@]}" go vet ./... || die "go vet failed in $MODULE_DIR"
"${NICE[@]}" go test ./... >&2 || die "go test failed in $MODULE_DIR"
STAGE="$DIR.partial-$$"
rm -rf "$STAGE"
mkdir -p "$STAGE"
"${NICE[@]}" go build -ldflags "$LDFLAGS" -o "$STAGE/$NAME" . || die "go build failed in $MODULE_DIR"
# the flags the binary records (go version -m): no cgo, so no libc to load
settings=$(go version -m "$STAGE/$NAME")
[[ $settings == *"CGO_ENABLED=0"* ]] || die "$NAME was not built with CGO_ENABLED=0: $settings"
said=$("$STAGE/$NAME" --help)
[[ $said == "usage: $NAME "* ]] || die "$NAME --help printed: $said"
printf 'built %s with %s in %ds; %s bytes; sha256 %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
  "$GO_VERSION" "$(( SECONDS - START ))" "$(stat -c %s "$STAGE/$NAME")" \
  "$(sha256sum <"$STAGE/$NAME" | cut -c1-64)" > "$STAGE/.stamp"
rm -rf "$DIR"
mv "$STAGE" "$DIR"
find "$CACHE/bin" -mindepth 1 -maxdepth 1 -type d -mtime +14 -exec rm -rf {} + 2>/dev/null || true
log "$NAME: $(cat "$DIR/.stamp")"
echo "$BINARY"
