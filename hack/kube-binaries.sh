#!/usr/bin/env bash
# Builds the sandbox's Kubernetes binaries from Go modules, with the machine's Go:
#   etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, and kubelet (for the
#   real-node tier)
# of the release pinned in hack/kube/versions.env (override: KUBE_VERSION=v1.36.5 or =1.36,
# ETCD_VERSION=v3.6.16), into a cache outside the work tree:
#   ${GPUSLICE_KUBE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpuslice/kube}/<kube version>/bin/
# The Go module and build caches live under that cache root too. A stamp file (bin/.stamp) is
# written only after a complete, verified build; with it in place the script only prints the dir.
# A failed build loses nothing: compiled packages stay in the Go build cache and linked binaries
# in bin.partial/, so the rerun it asks for only redoes what is missing.
#
# When KUBEBUILDER_ASSETS names a directory holding all six binaries, those are used instead
# (nothing is built). GPUSLICE_KUBE_BIN_DIR does the same and wins over both.
#
# usage: hack/kube-binaries.sh [--print-dir | --check | --force | --prune | --latest | --help]
#   (none)       build unless cached; progress on stderr; the bin dir is the last stdout line
#   --print-dir  print the bin dir when usable binaries exist (no build), else exit 1
#   --check      like --print-dir, silent on success, a how-to-build message on failure
#   --force      rebuild even when the stamp says the cache is complete
#   --latest     ask the module proxy whether a newer patch/minor than the pin exists
#   --prune      after a build (or on a cached one): delete the Go module and build caches and the
#                wrapper modules (~5 GB), keeping only bin/ (~470 MB); a later build starts cold
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VERSIONS_FILE="$REPO_ROOT/hack/kube/versions.env"
TOOL=kube-binaries
# shellcheck source=lib/gobuild.sh
source "$REPO_ROOT/hack/lib/gobuild.sh"  # log, die, pinned, cache_ok, hold_lock, progress, publish, ...
# shellcheck source=lib/kube-verify.sh
source "$REPO_ROOT/hack/lib/kube-verify.sh"
BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet)
KUBE_CMDS=(kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet)
MIN_MINOR=34


MODE=build
PRUNE=0
case "${1:-}" in
  "") ;;
  --print-dir) MODE=print ;;
  --check) MODE=check ;;
  --force) MODE=force ;;
  --latest) MODE=latest ;;
  --prune) PRUNE=1 ;;
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  *) die "unknown argument '$1' (see --help)" ;;
esac

CACHE_ROOT=${GPUSLICE_KUBE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpuslice/kube}

# Go environment: everything under the cache root, no toolchain downloads, static binaries.
export GOPATH="$CACHE_ROOT/go"
export GOMODCACHE="$CACHE_ROOT/go/pkg/mod"
export GOCACHE="$CACHE_ROOT/go-build"
export GOTOOLCHAIN=local
export GOWORK=off
export GO111MODULE=on
export CGO_ENABLED=0
export GOFLAGS="-mod=mod -buildvcs=false -trimpath"

KUBE_VERSION=${KUBE_VERSION:-$(pinned KUBE_VERSION)}
ETCD_VERSION=${ETCD_VERSION:-$(pinned ETCD_VERSION)}
[ -n "$KUBE_VERSION" ] && [ -n "$ETCD_VERSION" ] || die "KUBE_VERSION/ETCD_VERSION missing in $VERSIONS_FILE"
[[ $KUBE_VERSION == v* ]] || KUBE_VERSION="v$KUBE_VERSION"
[[ $ETCD_VERSION == v* ]] || ETCD_VERSION="v$ETCD_VERSION"
REQUESTED=$KUBE_VERSION
HOW=""  # how to repeat a non-default selection in the how-to-build message
[ "$KUBE_VERSION" = "v$(pinned KUBE_VERSION | sed 's/^v//')" ] || HOW="KUBE_VERSION=$REQUESTED "

if [[ $KUBE_VERSION =~ ^v1\.[0-9]+$ ]] && { [ "$MODE" = print ] || [ "$MODE" = check ]; }; then
  # a minor only, no build wanted: the newest patch of it already in the cache
  cached=$(find "$CACHE_ROOT" -mindepth 3 -maxdepth 3 -path "$CACHE_ROOT/$KUBE_VERSION.*/bin/.stamp" \
    2>/dev/null | sed 's|/bin/.stamp$||; s|.*/||' | sort -V | tail -n1 || true)
  KUBE_VERSION=${cached:-$KUBE_VERSION.0}
elif [[ $KUBE_VERSION =~ ^v1\.[0-9]+$ ]]; then
  # a minor only: the newest patch of it in the proxy's version list
  command -v go >/dev/null || die "go is not installed (Go 1.26 or newer is needed)"
  resolved=$(go list -m "k8s.io/kubernetes@$KUBE_VERSION" 2>/dev/null | awk '{print $2}') \
    || die "could not resolve $KUBE_VERSION through the module proxy"
  log "KUBE_VERSION=$KUBE_VERSION resolved to $resolved"
  KUBE_VERSION=$resolved
fi
[[ $KUBE_VERSION =~ ^v1\.([0-9]+)\.([0-9]+)$ ]] || die "KUBE_VERSION must look like v1.37.2 (or v1.37), got '$KUBE_VERSION'"
KUBE_MINOR=${BASH_REMATCH[1]}
STAGING_VERSION="v0.${BASH_REMATCH[1]}.${BASH_REMATCH[2]}"
(( KUBE_MINOR >= MIN_MINOR )) || die "Kubernetes 1.$KUBE_MINOR is older than the oldest supported minor 1.$MIN_MINOR"

VERSION_DIR="$CACHE_ROOT/$KUBE_VERSION"
BIN_DIR="$VERSION_DIR/bin"
STAMP="$BIN_DIR/.stamp"
STAMP_KEY="kube=$KUBE_VERSION etcd=$ETCD_VERSION"

prune() {
  log "pruning the Go caches under $CACHE_ROOT (bin/ dirs are kept)"
  if [ -d "$GOMODCACHE" ]; then chmod -R u+w "$GOMODCACHE"; fi  # module files are read-only
  rm -rf "$GOCACHE" "$GOPATH" "$CACHE_ROOT/tmp" "$CACHE_ROOT"/v*/build "$CACHE_ROOT"/v*/bin.partial
}

# 1. binaries the user already has
if [ "$MODE" != force ] && [ "$MODE" != latest ]; then
  for var in GPUSLICE_KUBE_BIN_DIR KUBEBUILDER_ASSETS; do
    dir=${!var:-}
    [ -n "$dir" ] || continue
    if have_all "$dir"; then
      [ "$MODE" = check ] || { log "using binaries from $var=$dir"; echo "$dir"; }
      exit 0
    fi
    log "warning: $var=$dir lacks: $(missing_in "$dir"); using the pinned build instead"
  done
  if cache_ok; then
    [ "$PRUNE" = 0 ] || prune
    [ "$MODE" = check ] || { [ "$MODE" = print ] || log "cached: $BIN_DIR ($(sed -n 2p "$STAMP"))"; echo "$BIN_DIR"; }
    exit 0
  fi
  if [ "$MODE" = print ] || [ "$MODE" = check ]; then
    cat >&2 <<EOF
kube-binaries: the Kubernetes $REQUESTED binaries (control plane and kubelet) are not built.
  looked in: ${GPUSLICE_KUBE_BIN_DIR:+GPUSLICE_KUBE_BIN_DIR=$GPUSLICE_KUBE_BIN_DIR, }${KUBEBUILDER_ASSETS:+KUBEBUILDER_ASSETS=$KUBEBUILDER_ASSETS, }$BIN_DIR
  build them once (about 10 minutes on 2 cores, then cached):  ${HOW}make kube-binaries
  or: ${HOW}hack/kube-binaries.sh    (or point KUBEBUILDER_ASSETS at a dir with ${BINARIES[*]})
EOF
    exit 1
  fi
fi

command -v go >/dev/null || die "go is not installed (Go 1.26 or newer is needed)"
GO_VERSION=$(go env GOVERSION)

if [ "$MODE" = latest ]; then
  next_patch="v1.$KUBE_MINOR.$(( ${KUBE_VERSION##*.} + 1 ))"
  next_minor="v1.$(( KUBE_MINOR + 1 )).0"
  log "pinned: $KUBE_VERSION; proxy version list says latest is $(go list -m k8s.io/kubernetes@latest | awk '{print $2}')"
  for v in "$next_patch" "$next_minor"; do
    if ! go list -m "k8s.io/kubernetes@$v" >/dev/null 2>&1; then echo "not served: $v"; continue; fi
    # .info/.mod can be served while the module zip is not (v1.37.2 in 2026-11): try the zip
    if err=$(GOSUMDB=off go mod download -json "k8s.io/kubernetes@$v" 2>&1); then
      echo "newer release served and downloadable: $v (pin it in hack/kube/versions.env)"
    else
      echo "listed but not downloadable: $v: $(first_match 's/.*"Error": "\([^"]*\)".*/\1/' "$err")"
    fi
  done
  exit 0
fi

sumdb_or_off "k8s.io/api@$STAGING_VERSION"

mkdir -p "$CACHE_ROOT"
hold_lock "$CACHE_ROOT/.lock"

START=$SECONDS
BUILT_AT=$(date -u +%Y-%m-%dT%H:%M:%SZ)
NICE=(nice -n "${GPUSLICE_BUILD_NICE:-19}")
BUILD_DIR="$VERSION_DIR/build"
STAGE="$VERSION_DIR/bin.partial"
# go build's scratch dir on the cache's file system: a linked binary reaches bin.partial/ by
# rename, never as a half-copied file that a later run would take for up to date
export GOTMPDIR="$CACHE_ROOT/tmp"
# Nothing finished is thrown away: bin/ and its stamp stay usable until this build replaces them,
# and bin.partial/ of a failed run is kept, so go build relinks only what is not up to date.
rm -rf "$STAGE/.stamp" "$GOTMPDIR"  # (the scratch of a killed build; we hold the lock)
mkdir -p "$BUILD_DIR/kube" "$BUILD_DIR/etcd" "$STAGE" "$GOTMPDIR"
trap 'rerun_hint $?' EXIT
log "building Kubernetes $KUBE_VERSION + etcd $ETCD_VERSION with $GO_VERSION into $BIN_DIR"
log "caches: GOMODCACHE=$GOMODCACHE GOCACHE=$GOCACHE; full logs in $BUILD_DIR/*.log"
log "a cold build takes tens of minutes on 2 cores (nice -n ${GPUSLICE_BUILD_NICE:-19})"

# --- kube: a wrapper module that pins every staging module to the release ------------------------
log "[1/3] resolving k8s.io/kubernetes@$KUBE_VERSION"
cd "$BUILD_DIR/kube"
dl_json=$("${NICE[@]}" go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" 2>&1) \
  || die "go mod download -json k8s.io/kubernetes@$KUBE_VERSION failed: $(printf '%s\n' "$dl_json" | grep '"Error"')"
KUBE_GOMOD=$(printf '%s\n' "$dl_json" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",*$/\1/p')
KUBE_COMMIT=$(first_match 's/^[[:space:]]*"Hash": "\([0-9a-f]\{40\}\)",*$/\1/' "$dl_json")
KUBE_INFO=$(first_match 's/^[[:space:]]*"Info": "\(.*\)",*$/\1/' "$dl_json")
[ -f "$KUBE_GOMOD" ] || die "no go.mod for k8s.io/kubernetes@$KUBE_VERSION in the download ($KUBE_GOMOD)"
mapfile -t STAGING < <(awk '$2 == "=>" && $3 ~ /^\.\/staging\/src\// {print $1}' "$KUBE_GOMOD" | sort -u)
(( ${#STAGING[@]} > 10 )) || die "found only ${#STAGING[@]} staging replaces in $KUBE_GOMOD"
GO_DIRECTIVE=$(awk '$1 == "go" {print $2; exit}' "$KUBE_GOMOD")
GODEBUG_LINES=$(awk '
  /^godebug[[:space:]]*\(/ { inblk = 1; print; next }
  inblk { print; if ($0 ~ /^\)/) inblk = 0; next }
  /^godebug[[:space:]]/ { print }' "$KUBE_GOMOD")
{
  echo "// Generated by hack/kube-binaries.sh for k8s.io/kubernetes $KUBE_VERSION; do not edit."
  echo "module gpuslice.local/kube-binaries"
  echo
  echo "go $GO_DIRECTIVE"
  [ -z "$GODEBUG_LINES" ] || { echo; echo "$GODEBUG_LINES"; }
  echo
  echo "require k8s.io/kubernetes $KUBE_VERSION"
  echo
  echo "replace ("
  for m in "${STAGING[@]}"; do echo "	$m => $m $STAGING_VERSION"; done
  echo ")"
} > go.mod
rm -f go.sum
log "    wrapper module: $BUILD_DIR/kube/go.mod (go $GO_DIRECTIVE, ${#STAGING[@]} staging replaces at $STAGING_VERSION)"

# buildDate is the release's time as the module proxy reports it, not the time of this build: the
# same inputs then link to the same binary, and a rerun skips those already in bin.partial/
BUILD_DATE=""
[ ! -f "$KUBE_INFO" ] || BUILD_DATE=$(first_match 's/.*"Time":"\([^"]*\)".*/\1/' "$(<"$KUBE_INFO")")
BUILD_DATE=${BUILD_DATE:-$BUILT_AT}
LDFLAGS="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  LDFLAGS+=" -X $pkg.gitVersion=$KUBE_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$KUBE_MINOR"
  LDFLAGS+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$BUILD_DATE"
  [ -z "$KUBE_COMMIT" ] || LDFLAGS+=" -X $pkg.gitCommit=$KUBE_COMMIT"
done
PKGS=()
for c in "${KUBE_CMDS[@]}"; do PKGS+=("k8s.io/kubernetes/cmd/$c"); done

log "[2/3] go build ${KUBE_CMDS[*]} (one invocation; downloads modules on first run)"
t=$SECONDS
KUBE_CMD=(go build -v -o "$STAGE/" -ldflags "$LDFLAGS" "${PKGS[@]}")
"${NICE[@]}" "${KUBE_CMD[@]}" 2>&1 | progress "$BUILD_DIR/kube-build.log" kube \
  || fail_with_log "$BUILD_DIR/kube-build.log" "Kubernetes $KUBE_VERSION" "GOFLAGS='$GOFLAGS' CGO_ENABLED=0 ${KUBE_CMD[*]}"
log "    kube binaries built in $(( SECONDS - t ))s"

# --- etcd: a wrapper module requiring go.etcd.io/etcd/server/v3 ---------------------------------
log "[3/3] go build etcd $ETCD_VERSION"
t=$SECONDS
cd "$BUILD_DIR/etcd"
etcd_json=$("${NICE[@]}" go mod download -json "go.etcd.io/etcd/server/v3@$ETCD_VERSION" 2>&1) \
  || die "go mod download -json go.etcd.io/etcd/server/v3@$ETCD_VERSION failed: $(printf '%s\n' "$etcd_json" | grep '"Error"')"
ETCD_GOMOD=$(printf '%s\n' "$etcd_json" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",*$/\1/p')
ETCD_GO=$(awk '$1 == "go" {print $2; exit}' "$ETCD_GOMOD")
ETCD_COMMIT=$(first_match 's/^[[:space:]]*"Hash": "\([0-9a-f]\{40\}\)",*$/\1/' "$etcd_json")
cat > go.mod <<EOF
// Generated by hack/kube-binaries.sh for etcd $ETCD_VERSION; do not edit.
module gpuslice.local/etcd-binary

go $ETCD_GO

require go.etcd.io/etcd/server/v3 $ETCD_VERSION
EOF
rm -f go.sum
ETCD_LDFLAGS="-s -w"
[ -z "$ETCD_COMMIT" ] || ETCD_LDFLAGS+=" -X go.etcd.io/etcd/api/v3/version.GitSHA=${ETCD_COMMIT:0:8}"
ETCD_CMD=(go build -v -o "$STAGE/etcd" -ldflags "$ETCD_LDFLAGS" go.etcd.io/etcd/server/v3)
"${NICE[@]}" "${ETCD_CMD[@]}" 2>&1 | progress "$BUILD_DIR/etcd-build.log" etcd \
  || fail_with_log "$BUILD_DIR/etcd-build.log" "etcd $ETCD_VERSION" "GOFLAGS='$GOFLAGS' CGO_ENABLED=0 ${ETCD_CMD[*]}"
log "    etcd built in $(( SECONDS - t ))s"

# --- verify, then publish and stamp ----------------------------------------------------------------
why=$(verify_versions "$STAGE" "$KUBE_VERSION" "$ETCD_VERSION" 2>&1) || die "$why"  # hack/lib/kube-verify.sh
ELAPSED=$(( SECONDS - START ))
publish "$ELAPSED"
log "done in $(( ELAPSED / 60 ))m$(( ELAPSED % 60 ))s: $("$BIN_DIR/kube-apiserver" --version), etcd ${ETCD_VERSION#v}"
[ "$PRUNE" = 0 ] || prune
echo "$BIN_DIR"
