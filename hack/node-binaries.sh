#!/usr/bin/env bash
# Builds the real-node tier's container runtime from Go modules, with the machine's Go:
#   containerd, ctr, containerd-shim-runc-v2   (containerd, CGO_ENABLED=0, static)
#   runc                                        (CGO_ENABLED=1, seccomp, linked statically)
#   crictl                                      (cri-tools, CGO_ENABLED=0: the CRI's command line,
#                                                for pods, containers and logs on a node)
# of the releases pinned in hack/kube/versions.env (override: CONTAINERD_VERSION=v2.4.1,
# RUNC_VERSION=v1.5.1, CRICTL_VERSION=v1.36.0), into the cache hack/kube-binaries.sh uses, outside
# the work tree:
#   ${GPUSLICE_KUBE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpuslice/kube}/node-<containerd>-<runc>/bin/
# sharing its Go module and build caches. The kubelet comes from hack/kube-binaries.sh; the CNI
# plugins (bridge, host-local, loopback) from Debian's containernetworking-plugins.
# Debian's own containerd 1.6 has no CDI, and its runc 1.1.5 cannot run containerd 2.4's specs
# (docs/images.md, "Why buildah and debootstrap").
# A stamp file (bin/.stamp) is written only after a complete, verified build; with it in place the
# script only prints the dir. A failed build loses nothing: compiled packages stay in the Go build
# cache and linked binaries in bin.partial/, so the rerun it asks for only redoes what is missing.
#
# When GPUSLICE_NODE_BIN_DIR names a directory holding all five binaries, those are used instead.
#
# usage: hack/node-binaries.sh [--print-dir | --check | --force | --help]
#   (none)       build unless cached; progress on stderr; the bin dir is the last stdout line
#   --print-dir  print the bin dir when usable binaries exist (no build), else exit 1
#   --check      like --print-dir, silent on success, a how-to-build message on failure
#   --force      rebuild even when the stamp says the cache is complete
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TOOL=node-binaries
VERSIONS_FILE="$REPO_ROOT/hack/kube/versions.env"
# shellcheck source=lib/gobuild.sh
source "$REPO_ROOT/hack/lib/gobuild.sh"  # log, die, pinned, cache_ok, hold_lock, progress, publish, ...
# shellcheck source=lib/node-verify.sh
source "$REPO_ROOT/hack/lib/node-verify.sh"
BINARIES=(containerd ctr containerd-shim-runc-v2 runc crictl)
CONTAINERD_MODULE=github.com/containerd/containerd/v2
CONTAINERD_CMDS=(containerd ctr containerd-shim-runc-v2)
# no_btrfs/no_devmapper/no_zfs: snapshotters that need cgo headers or tools the nodes do not use
CONTAINERD_TAGS="no_btrfs no_devmapper no_zfs"
RUNC_MODULE=github.com/opencontainers/runc
# as runc's own `make static`: seccomp from libseccomp.a, no glibc NSS at run time
RUNC_TAGS="seccomp netgo osusergo"
CRICTL_MODULE=sigs.k8s.io/cri-tools


MODE=build
case "${1:-}" in
  "") ;;
  --print-dir) MODE=print ;;
  --check) MODE=check ;;
  --force) MODE=force ;;
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  *) die "unknown argument '$1' (see --help)" ;;
esac

CACHE_ROOT=${GPUSLICE_KUBE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpuslice/kube}

# Go environment: the caches of hack/kube-binaries.sh, no toolchain downloads.
export GOPATH="$CACHE_ROOT/go"
export GOMODCACHE="$CACHE_ROOT/go/pkg/mod"
export GOCACHE="$CACHE_ROOT/go-build"
export GOTOOLCHAIN=local
export GOWORK=off
export GO111MODULE=on
export GOFLAGS="-mod=mod -buildvcs=false -trimpath"

CONTAINERD_VERSION=${CONTAINERD_VERSION:-$(pinned CONTAINERD_VERSION)}
RUNC_VERSION=${RUNC_VERSION:-$(pinned RUNC_VERSION)}
CRICTL_VERSION=${CRICTL_VERSION:-$(pinned CRICTL_VERSION)}
[ -n "$CONTAINERD_VERSION" ] && [ -n "$RUNC_VERSION" ] && [ -n "$CRICTL_VERSION" ] \
  || die "CONTAINERD_VERSION/RUNC_VERSION/CRICTL_VERSION missing in $VERSIONS_FILE"
CONTAINERD_VERSION="v${CONTAINERD_VERSION#v}"
RUNC_VERSION="v${RUNC_VERSION#v}"
CRICTL_VERSION="v${CRICTL_VERSION#v}"
[[ $CONTAINERD_VERSION =~ ^v2\.[0-9]+\.[0-9]+$ ]] || die "CONTAINERD_VERSION must look like v2.4.2 (containerd 2.x), got '$CONTAINERD_VERSION'"
[[ $RUNC_VERSION =~ ^v1\.[0-9]+\.[0-9]+$ ]] || die "RUNC_VERSION must look like v1.5.2, got '$RUNC_VERSION'"
[[ $CRICTL_VERSION =~ ^v1\.[0-9]+\.[0-9]+$ ]] || die "CRICTL_VERSION must look like v1.37.0, got '$CRICTL_VERSION'"
HOW=""  # how to repeat a non-default selection in the how-to-build message
[ "$CONTAINERD_VERSION" = "v$(pinned CONTAINERD_VERSION | sed 's/^v//')" ] || HOW+="CONTAINERD_VERSION=$CONTAINERD_VERSION "
[ "$RUNC_VERSION" = "v$(pinned RUNC_VERSION | sed 's/^v//')" ] || HOW+="RUNC_VERSION=$RUNC_VERSION "
[ "$CRICTL_VERSION" = "v$(pinned CRICTL_VERSION | sed 's/^v//')" ] || HOW+="CRICTL_VERSION=$CRICTL_VERSION "

VERSION_DIR="$CACHE_ROOT/node-$CONTAINERD_VERSION-$RUNC_VERSION"
BIN_DIR="$VERSION_DIR/bin"
STAMP="$BIN_DIR/.stamp"
STAMP_KEY="containerd=$CONTAINERD_VERSION runc=$RUNC_VERSION crictl=$CRICTL_VERSION tags=$CONTAINERD_TAGS/$RUNC_TAGS"


# 1. binaries the user already has, or a finished build
if [ "$MODE" != force ]; then
  dir=${GPUSLICE_NODE_BIN_DIR:-}
  if [ -n "$dir" ]; then
    if have_all "$dir"; then
      [ "$MODE" = check ] || { log "using binaries from GPUSLICE_NODE_BIN_DIR=$dir"; echo "$dir"; }
      exit 0
    fi
    log "warning: GPUSLICE_NODE_BIN_DIR=$dir lacks: $(missing_in "$dir"); using the pinned build instead"
  fi
  if cache_ok; then
    [ "$MODE" = check ] || { [ "$MODE" = print ] || log "cached: $BIN_DIR ($(sed -n 2p "$STAMP"))"; echo "$BIN_DIR"; }
    exit 0
  fi
  if [ "$MODE" = print ] || [ "$MODE" = check ]; then
    cat >&2 <<EOF
node-binaries: containerd $CONTAINERD_VERSION, runc $RUNC_VERSION and crictl $CRICTL_VERSION (the real-node tier's runtime) are not built.
  looked in: ${GPUSLICE_NODE_BIN_DIR:+GPUSLICE_NODE_BIN_DIR=$GPUSLICE_NODE_BIN_DIR, }$BIN_DIR
  build them once (about 2 minutes on 2 cores, then cached):  ${HOW}make node-binaries
  or: ${HOW}hack/node-binaries.sh    (or point GPUSLICE_NODE_BIN_DIR at a dir with ${BINARIES[*]})
EOF
    exit 1
  fi
fi

# runc needs cgo with libseccomp (libseccomp-dev, pkg-config, gcc): Debian packages, once
bash "$REPO_ROOT/hack/node-packages.sh" || die "the Debian packages above are needed (hack/node-packages.sh)"
command -v go >/dev/null || die "go is not installed (Go 1.26 or newer is needed)"
GO_VERSION=$(go env GOVERSION)

sumdb_or_off "$RUNC_MODULE@$RUNC_VERSION"

mkdir -p "$VERSION_DIR"
# A lock of its own: this build may run beside hack/kube-binaries.sh (the Go caches are safe for
# concurrent go commands); only two builds of the same versions must not share bin.partial/.
hold_lock "$VERSION_DIR/.lock"

START=$SECONDS
BUILT_AT=$(date -u +%Y-%m-%dT%H:%M:%SZ)
NICE=(nice -n "${GPUSLICE_BUILD_NICE:-19}")
BUILD_DIR="$VERSION_DIR/build"
STAGE="$VERSION_DIR/bin.partial"
# go build's scratch dir on the cache's file system: a linked binary reaches bin.partial/ by
# rename, never as a half-copied file that a later run would take for up to date
export GOTMPDIR="$VERSION_DIR/tmp"
rm -rf "$STAGE/.stamp" "$GOTMPDIR"  # (the scratch of a killed build; we hold the lock)
mkdir -p "$BUILD_DIR/containerd" "$BUILD_DIR/runc" "$BUILD_DIR/crictl" "$STAGE" "$GOTMPDIR"
trap 'rerun_hint $?' EXIT
log "building containerd $CONTAINERD_VERSION + runc $RUNC_VERSION + crictl $CRICTL_VERSION with $GO_VERSION into $BIN_DIR"
log "caches: GOMODCACHE=$GOMODCACHE GOCACHE=$GOCACHE; full logs in $BUILD_DIR/*.log"

# wrapper_module DIR MODULE VERSION: a module of our own that requires MODULE at VERSION (none of
# their go.mod files has replace directives, but `go build -o` wants a main module); sets GOMOD_COMMIT
wrapper_module() {
  local dir=$1 module=$2 version=$3 json gomod godirective
  cd "$dir"
  json=$("${NICE[@]}" go mod download -json "$module@$version" 2>&1) \
    || die "go mod download -json $module@$version failed: $(printf '%s\n' "$json" | grep '"Error"')"
  gomod=$(printf '%s\n' "$json" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",*$/\1/p')
  [ -f "$gomod" ] || die "no go.mod for $module@$version in the download ($gomod)"
  godirective=$(awk '$1 == "go" {print $2; exit}' "$gomod")
  GOMOD_COMMIT=$(first_match 's/^[[:space:]]*"Hash": "\([0-9a-f]\{40\}\)",*$/\1/' "$json")
  printf '// Generated by hack/node-binaries.sh for %s %s; do not edit.\nmodule gpuslice.local/%s\n\ngo %s\n\nrequire %s %s\n' \
    "$module" "$version" "$(basename "$dir")-binary" "$godirective" "$module" "$version" > go.mod
  rm -f go.sum
}

# --- containerd: three commands in one invocation (they share most packages) ----------------------
log "[1/3] go build containerd, ctr, containerd-shim-runc-v2 $CONTAINERD_VERSION (CGO_ENABLED=0)"
t=$SECONDS
wrapper_module "$BUILD_DIR/containerd" "$CONTAINERD_MODULE" "$CONTAINERD_VERSION"
CONTAINERD_LDFLAGS="-s -w -X $CONTAINERD_MODULE/version.Version=$CONTAINERD_VERSION"
CONTAINERD_LDFLAGS+=" -X $CONTAINERD_MODULE/version.Package=$CONTAINERD_MODULE"
[ -z "$GOMOD_COMMIT" ] || CONTAINERD_LDFLAGS+=" -X $CONTAINERD_MODULE/version.Revision=$GOMOD_COMMIT"
PKGS=()
for c in "${CONTAINERD_CMDS[@]}"; do PKGS+=("$CONTAINERD_MODULE/cmd/$c"); done
CONTAINERD_CMD=(go build -v -o "$STAGE/" -tags "$CONTAINERD_TAGS" -ldflags "$CONTAINERD_LDFLAGS" "${PKGS[@]}")
CGO_ENABLED=0 "${NICE[@]}" "${CONTAINERD_CMD[@]}" 2>&1 | progress "$BUILD_DIR/containerd-build.log" containerd \
  || fail_with_log "$BUILD_DIR/containerd-build.log" "containerd $CONTAINERD_VERSION" "GOFLAGS='$GOFLAGS' CGO_ENABLED=0 ${CONTAINERD_CMD[*]}"
log "    containerd built in $(( SECONDS - t ))s"

# --- runc: cgo for libseccomp, linked statically as upstream's release binaries are ---------------
log "[2/3] go build runc $RUNC_VERSION (CGO_ENABLED=1, tags: $RUNC_TAGS)"
t=$SECONDS
pkg-config --exists libseccomp || die "pkg-config does not find libseccomp (hack/node-packages.sh installs libseccomp-dev)"
wrapper_module "$BUILD_DIR/runc" "$RUNC_MODULE" "$RUNC_VERSION"
RUNC_LDFLAGS="-s -w -linkmode external -extldflags -static"
[ -z "$GOMOD_COMMIT" ] || RUNC_LDFLAGS+=" -X main.gitCommit=$GOMOD_COMMIT"
RUNC_CMD=(go build -v -o "$STAGE/runc" -tags "$RUNC_TAGS" -ldflags "$RUNC_LDFLAGS" "$RUNC_MODULE")
CGO_ENABLED=1 "${NICE[@]}" "${RUNC_CMD[@]}" 2>&1 | progress "$BUILD_DIR/runc-build.log" runc \
  || fail_with_log "$BUILD_DIR/runc-build.log" "runc $RUNC_VERSION" "GOFLAGS='$GOFLAGS' CGO_ENABLED=1 ${RUNC_CMD[*]}"
log "    runc built in $(( SECONDS - t ))s"

# --- crictl ------------------------------------------------------------------------------------------
log "[3/3] go build crictl $CRICTL_VERSION (CGO_ENABLED=0)"
t=$SECONDS
wrapper_module "$BUILD_DIR/crictl" "$CRICTL_MODULE" "$CRICTL_VERSION"
CRICTL_LDFLAGS="-s -w -X $CRICTL_MODULE/pkg/version.Version=$CRICTL_VERSION"
CRICTL_CMD=(go build -v -o "$STAGE/crictl" -ldflags "$CRICTL_LDFLAGS" "$CRICTL_MODULE/cmd/crictl")
CGO_ENABLED=0 "${NICE[@]}" "${CRICTL_CMD[@]}" 2>&1 | progress "$BUILD_DIR/crictl-build.log" crictl \
  || fail_with_log "$BUILD_DIR/crictl-build.log" "crictl $CRICTL_VERSION" "GOFLAGS='$GOFLAGS' CGO_ENABLED=0 ${CRICTL_CMD[*]}"
log "    crictl built in $(( SECONDS - t ))s"

# --- verify, then publish and stamp ----------------------------------------------------------------
why=$(verify_node_versions "$STAGE" "$CONTAINERD_VERSION" "$RUNC_VERSION" "$CRICTL_VERSION" 2>&1) || die "$why"  # hack/lib/node-verify.sh
ELAPSED=$(( SECONDS - START ))
rm -rf "$GOTMPDIR"
publish "$ELAPSED"
log "done in $(( ELAPSED / 60 ))m$(( ELAPSED % 60 ))s: containerd ${CONTAINERD_VERSION#v}, runc ${RUNC_VERSION#v} (seccomp), crictl ${CRICTL_VERSION#v}"
echo "$BIN_DIR"
