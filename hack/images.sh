#!/usr/bin/env bash
# Builds gpuslice's container images without a registry or a Docker engine, with buildah and
# debootstrap from Debian (hack/node-packages.sh installs them), and exports each as an OCI archive
# for `ctr -n k8s.io images import` on the real-node tier (docs/real-node.md):
#   pause        localhost/gpuslice/pause:TAG        static pause (hack/images/pause.c, gcc -static)
#   python-base  localhost/gpuslice/python-base:TAG  Debian bookworm minbase + python3.11 and
#                                                    ca-certificates: the role of python:3.11-slim,
#                                                    and the e2e pods' workload image
#   <service>    localhost/gpuslice/<service>:TAG    every services/*/Dockerfile, built unchanged
#                                                    with PYTHON_IMAGE/UV_IMAGE (and GO_IMAGE
#                                                    where it declares it) set to local images
# plus two images used by the builds only: uv (localhost/gpuslice/uv:TAG, a scratch image holding
# /uv and /uvx from .tools/, the uv hack/bootstrap.sh pins) in the role of ghcr.io/astral-sh/uv,
# and go (localhost/gpuslice/go:TAG, python-base plus this machine's Go toolchain at
# /usr/local/go) in the role of golang:1.26-bookworm, for the enforcer's static CDI hook, which
# must then be byte for byte the binary hack/hook-binary.sh built and the tests ran.
# TAG is a hash of the image's inputs (sources, lock file, recipe, base image ids): an image whose
# inputs did not change is not rebuilt, a changed one gets a new tag. Everything lives outside the
# work tree, in ${GPUSLICE_IMAGES_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpuslice/images}:
#   storage/    buildah's own storage (overlay when the kernel allows it, else vfs)
#   archives/   NAME-TAG.tar (OCI archive, ref = localhost/gpuslice/NAME:TAG) and NAME-TAG.json
#   logs/       one log per image build
#   manifest.json  {"registry", "storage_driver", "images": {NAME: {ref, archive, id,
#                  size_bytes (archive), image_bytes (unpacked), build_seconds (this run),
#                  cached, first_build_seconds}}, "build_images": {"uv": ..., "go": ...}}; its path is the
#                  last stdout line
# The python-base image is Debian's archive of the day it was built: it is rebuilt only when its
# recipe changes or with --refresh-base (then every service image gets a new tag too).
#
# usage: hack/images.sh [--print-manifest | --check | --force | --refresh-base | --help]
#   (none)            build what is missing; progress on stderr; the manifest path on stdout
#   --print-manifest  print the manifest path when it and every archive it names exist, else exit 1
#   --check           like --print-manifest, silent on success, a how-to-build message on failure
#   --force           rebuild every image: pause and uv come out identical, python-base keeps
#                     its tag with new content, so every service image gets a new tag
#   --refresh-base    rebuild python-base from today's Debian archive, then what depends on it
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
REGISTRY=localhost/gpuslice
SUITE=bookworm
MIRROR=${GPUSLICE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
BASE_PACKAGES=python3.11,ca-certificates
PAUSE_VERSION=3.10  # the registry.k8s.io/pause release whose behaviour hack/images/pause.c copies
# Bump a recipe's number when the way its image is made changes in a way its inputs do not show.
RECIPE_PAUSE=1
RECIPE_BASE=1
RECIPE_UV=1
RECIPE_SERVICE=1
RECIPE_GO=1

log() { printf '>> %s\n' "$*" >&2; }
die() { printf 'images: error: %s\n' "$*" >&2; exit 1; }

MODE=build
case "${1:-}" in
  "") ;;
  --print-manifest) MODE=print ;;
  --check) MODE=check ;;
  --force) MODE=force ;;
  --refresh-base) MODE=refresh ;;
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  *) die "unknown argument '$1' (see --help)" ;;
esac

CACHE=${GPUSLICE_IMAGES_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpuslice/images}
ARCHIVES="$CACHE/archives"
LOGS="$CACHE/logs"
MANIFEST="$CACHE/manifest.json"
STORAGE="$CACHE/storage"

# --- --print-manifest / --check: no build -------------------------------------------------------
manifest_ok() { # the manifest exists and names only archives that exist
  local archive
  [ -f "$MANIFEST" ] || return 1
  while IFS= read -r archive; do
    [ -f "$archive" ] || return 1
  done < <(sed -n 's/.*"archive": "\([^"]*\)".*/\1/p' "$MANIFEST")
}
if [ "$MODE" = print ] || [ "$MODE" = check ]; then
  if manifest_ok; then
    [ "$MODE" = check ] || echo "$MANIFEST"
    exit 0
  fi
  cat >&2 <<EOF
images: gpuslice's local images (pause, python-base, the services) are not built.
  looked for: $MANIFEST and the archives it names
  build them once (about 1.5 minutes on 2 cores, then a second when nothing changed):  make images
  or: hack/images.sh
EOF
  exit 1
fi

# --- tools ------------------------------------------------------------------------------------------
[ "$(id -u)" = 0 ] || die "needs root (buildah's chroot isolation and debootstrap); run it as root"
bash "$REPO_ROOT/hack/node-packages.sh" || die "the Debian packages above are needed (hack/node-packages.sh)"
for tool in buildah debootstrap gcc sha256sum flock go; do
  command -v "$tool" >/dev/null || die "$tool is not installed (hack/node-packages.sh installs it)"
done
UV_VERSION=$(sed -n 's/^UV_VERSION=\([^[:space:]#]*\).*/\1/p' "$REPO_ROOT/hack/bootstrap.sh")
UV_BIN="$REPO_ROOT/.tools/uv/bin/uv"
uv_reports=""
[ ! -x "$UV_BIN" ] || uv_reports=$("$UV_BIN" --version 2>&1) || true
if [ "$uv_reports" != "uv $UV_VERSION" ] && [[ $uv_reports != "uv $UV_VERSION "* ]]; then
  log "uv $UV_VERSION is not in .tools/ yet: running hack/bootstrap.sh"
  bash "$REPO_ROOT/hack/bootstrap.sh" >&2
fi
[ -x "$REPO_ROOT/.tools/uv/bin/uvx" ] || die "no uvx next to $UV_BIN"

mkdir -p "$CACHE" "$ARCHIVES" "$LOGS" "$STORAGE"
exec 9>"$CACHE/.lock"
if ! flock -n 9; then
  log "another build holds $CACHE/.lock; waiting for it"
  flock 9
fi

NICE=(nice -n "${GPUSLICE_BUILD_NICE:-19}")
# overlay first (ext4 and a kernel with overlayfs: layers are shared, not copied); vfs otherwise.
# The choice is kept with the storage: a storage root cannot change its driver.
if [ -f "$STORAGE/driver" ]; then
  DRIVER=$(<"$STORAGE/driver")
else
  DRIVER=vfs
  probe=(buildah --root "$STORAGE/root" --runroot "$STORAGE/run" --storage-driver overlay)
  if ctr=$("${probe[@]}" from scratch 2>/dev/null) && "${probe[@]}" mount "$ctr" >/dev/null 2>&1; then
    DRIVER=overlay
  fi
  [ -z "${ctr:-}" ] || "${probe[@]}" rm "$ctr" >/dev/null 2>&1 || true
  [ "$DRIVER" = overlay ] || rm -rf "$STORAGE/root" "$STORAGE/run"
  echo "$DRIVER" > "$STORAGE/driver"
  log "buildah storage: $STORAGE ($DRIVER)"
fi
B=(buildah --root "$STORAGE/root" --runroot "$STORAGE/run" --storage-driver "$DRIVER")
# working containers a killed run left (mounted, with their layers): the storage is ours alone
"${B[@]}" rm --all >/dev/null 2>&1 || true

# --- helpers ----------------------------------------------------------------------------------------
# hash_files PATH... -> sha256 over the names and contents of the files under the PATHs that git
# would see (tracked, or untracked and not ignored: no caches, no .venv); all files outside git
hash_files() {
  (
    cd "$REPO_ROOT"
    if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
      git ls-files -z -c -o --exclude-standard -- "$@"
    else
      find "$@" -type f -not -path '*/__pycache__/*' -print0
    fi | sort -zu | while IFS= read -r -d '' f; do
      [ ! -f "$f" ] || printf '%s\0' "$f"  # (a tracked file deleted in the work tree is skipped)
    done | xargs -0 -r sha256sum | sha256sum | cut -c1-64
  )
}
tag_of() { # tag_of TEXT -> the first 16 hex digits of its sha256: an image's tag
  local sum
  sum=$(printf '%s' "$1" | sha256sum)
  echo "${sum:0:16}"
}
image_id() { # image_id REF -> the image id, or nothing when the storage does not hold REF
  "${B[@]}" inspect --type image --format '{{.FromImageID}}' "$1" 2>/dev/null || true
}
du_image() { # du_image REF -> bytes of the image's root file system (a throwaway container)
  local c m bytes
  c=$("${B[@]}" from --pull-never "$1" 2>/dev/null) || return 1
  m=$("${B[@]}" mount "$c") || { "${B[@]}" rm "$c" >/dev/null; return 1; }
  bytes=$(du -sxb "$m" | cut -f1)
  "${B[@]}" umount "$c" >/dev/null
  "${B[@]}" rm "$c" >/dev/null
  echo "$bytes"
}

json_str() { # json_str TEXT -> TEXT as a JSON string (the values here are paths, refs and words)
  [[ $1 != *[\"\\]* ]] || die "refusing to write '$1' into JSON"
  printf '"%s"' "$1"
}

declare -A RESULT_REF RESULT_ARCHIVE RESULT_SECONDS RESULT_CACHED RESULT_ID
ORDER=()

# publish NAME TAG BUILD_FN [ARGS...]: unless the archive of NAME:TAG exists (and nothing is
# forced), call BUILD_FN REF ARGS... to make REF in the storage, then export it and record it.
# The storage keeps the image; a base that later builds start FROM, when only its archive is left
# (a fresh storage), is pulled back from it with the same id.
BASES="python-base uv go"
publish() {
  local name=$1 tag=$2 build=$3; shift 3
  local ref="$REGISTRY/$name:$tag" archive="$ARCHIVES/$name-$tag.tar" meta="$ARCHIVES/$name-$tag.json"
  local t=$SECONDS start=$SECONDS cached=true id first rc
  if [ "$FORCE_ALL" = 1 ] || [ "${FORCE_ONE:-}" = "$name" ] || [ ! -f "$archive" ] || [ ! -f "$meta" ]; then
    cached=false
    log "$name: building $ref (log: $LOGS/$name.log)"
    "${B[@]}" rmi "$ref" >/dev/null 2>&1 || true
    # not `if ! "$build"`: errexit would be off inside it, and a failed step would not stop it
    set +e
    (set -e; "$build" "$ref" "$@") >"$LOGS/$name.log" 2>&1
    rc=$?
    set -e
    if [ "$rc" != 0 ]; then
      printf 'images: building %s failed; last lines of %s:\n' "$name" "$LOGS/$name.log" >&2
      tail -n 30 "$LOGS/$name.log" | sed 's/^/    /' >&2
      printf '  fix the cause, then run again:  make images   (= hack/images.sh)\n' >&2
      exit 1
    fi
    rm -f "$archive.tmp" "$meta"
    # the ref inside the archive is what `ctr images import` names the image
    "${B[@]}" push --quiet "$ref" "oci-archive:$archive.tmp:$ref" >>"$LOGS/$name.log" 2>&1 \
      || die "buildah push $ref to $archive failed (see $LOGS/$name.log)"
    mv "$archive.tmp" "$archive"
    printf '{"build_seconds": %d, "image_bytes": %s, "id": %s}\n' "$(( SECONDS - t ))" \
      "$(du_image "$ref" || echo 0)" "$(json_str "$(image_id "$ref")")" > "$meta"
    # older tags of this image: their archives and storage names go (their layers with them)
    for old in "$ARCHIVES/$name-"*.tar; do
      [ "$old" = "$archive" ] || rm -f "$old" "${old%.tar}.json"
    done
    while IFS= read -r old; do
      [ -z "$old" ] || [ "$old" = "$ref" ] || "${B[@]}" rmi "$old" >/dev/null 2>&1 || true
    done < <("${B[@]}" images --noheading --format '{{.Name}}:{{.Tag}}' "$REGISTRY/$name" 2>/dev/null || true)
  elif [[ " $BASES " == *" $name "* ]] && [ -z "$(image_id "$ref")" ]; then
    "${B[@]}" pull --quiet "oci-archive:$archive" >/dev/null 2>>"$LOGS/$name.log" \
      || die "buildah pull oci-archive:$archive failed (see $LOGS/$name.log; delete the archive to rebuild)"
  fi
  id=$(sed -n 's/.*"id": "\([0-9a-f]*\)".*/\1/p' "$meta")
  [ "$cached" = true ] && [[ " $BASES " != *" $name "* ]] || id=$(image_id "$ref")
  [ -n "$id" ] || die "$ref is not in the storage after its build"
  first=$(sed -n 's/.*"build_seconds": \([0-9]*\).*/\1/p' "$meta")
  RESULT_REF[$name]=$ref
  RESULT_ARCHIVE[$name]=$archive
  RESULT_SECONDS[$name]=$(( SECONDS - start ))
  RESULT_CACHED[$name]=$cached
  RESULT_ID[$name]=$id
  ORDER+=("$name")
  if [ "$cached" = true ]; then
    log "$name: cached $ref"
  else
    log "$name: built $ref in ${first}s ($(( $(stat -c %s "$archive") / 1000000 )) MB archive)"
  fi
}

# --- builders: each makes REF in the storage ----------------------------------------------------
build_pause() { # REF
  local work="$CACHE/work/pause" ctr got
  rm -rf "$work"
  mkdir -p "$work"
  "${NICE[@]}" gcc -static -Os -s -Wall -Wextra -Werror -o "$work/pause" "$REPO_ROOT/hack/images/pause.c"
  got=$("$work/pause" -v)
  [ "$got" = "pause $PAUSE_VERSION (gpuslice)" ] || { echo "pause -v printed '$got'"; return 1; }
  ctr=$("${B[@]}" from scratch)
  "${B[@]}" copy --chmod 0755 "$ctr" "$work/pause" /pause
  # as registry.k8s.io/pause: the nobody-like user 65535, the binary as the entrypoint
  "${B[@]}" config --entrypoint '["/pause"]' --cmd '' --user 65535:65535 \
    --label org.opencontainers.image.title=pause --label "org.opencontainers.image.version=$PAUSE_VERSION" "$ctr"
  "${B[@]}" commit --rm --timestamp 0 "$ctr" "$1"
  rm -rf "$work"
}

build_uv() { # REF: /uv and /uvx, like ghcr.io/astral-sh/uv (what the Dockerfiles copy from it)
  local ctr
  ctr=$("${B[@]}" from scratch)
  "${B[@]}" copy --chmod 0755 "$ctr" "$REPO_ROOT/.tools/uv/bin/uv" "$REPO_ROOT/.tools/uv/bin/uvx" /
  "${B[@]}" config --entrypoint '["/uv"]' --label "org.opencontainers.image.version=$UV_VERSION" "$ctr"
  "${B[@]}" commit --rm --timestamp 0 "$ctr" "$1"
}

# What python:3.11-slim leaves out of its Debian base, and the same for later apt installs
SLIM_PATHS=(/usr/share/doc /usr/share/man /usr/share/info /usr/share/locale /usr/share/lintian
            /usr/share/linda /usr/share/groff /usr/share/common-licenses /var/cache/man)
build_python_base() { # REF PYTHON_MINOR
  local ref=$1 minor=$2 ctr mnt p mounts got
  ctr=$("${B[@]}" from scratch)
  mnt=$("${B[@]}" mount "$ctr")
  "${NICE[@]}" debootstrap --variant=minbase --include="$BASE_PACKAGES" --components=main \
    "$SUITE" "$mnt" "$MIRROR"
  # debootstrap unmounts what it mounted; make sure, before anything is deleted under $mnt
  mounts=$(findmnt -rn -o TARGET)
  if [[ $'\n'$mounts$'\n' == *$'\n'"$mnt"/* ]]; then
    echo "mounts left under $mnt after debootstrap:"; findmnt -rn -o TARGET | grep -F "$mnt/" || true
    return 1
  fi
  # python3/python as in python:3.11-slim (Debian's python3 symlink comes with python3-minimal)
  ln -sfn "python$minor" "$mnt/usr/bin/python3"
  ln -sfn "python$minor" "$mnt/usr/bin/python"
  got=$(chroot "$mnt" /usr/bin/python3 -c 'import ssl, sys; print("%d.%d" % sys.version_info[:2])')
  [ "$got" = "$minor" ] || { echo "the base's python3 is $got, the workspace needs $minor"; return 1; }
  # smaller: no package lists or caches (apt-get update restores them), no docs, man pages or
  # locales, now or in later installs (the dpkg excludes of Debian's slim images)
  rm -rf "$mnt"/var/lib/apt/lists/* "$mnt"/var/cache/apt/* "$mnt"/var/cache/debconf/*-old \
    "$mnt"/var/log/* "$mnt"/debootstrap "$mnt"/dev/* "$mnt"/run/* "$mnt"/tmp/*
  for p in "${SLIM_PATHS[@]}"; do
    [ ! -d "$mnt$p" ] || find "$mnt$p" -mindepth 1 -delete
  done
  mkdir -p "$mnt/etc/dpkg/dpkg.cfg.d"
  {
    echo "# gpuslice python-base (hack/images.sh): no docs, man pages or locales in later installs"
    for p in "${SLIM_PATHS[@]}"; do echo "path-exclude $p/*"; done
  } > "$mnt/etc/dpkg/dpkg.cfg.d/gpuslice-slim"
  got=$(chroot "$mnt" dpkg-query -W -f='${Version}' "python$minor")
  "${B[@]}" umount "$ctr"
  "${B[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --env "PYTHON_VERSION=$got" --cmd '["python3"]' \
    --label "org.opencontainers.image.title=python-base" \
    --label "org.opencontainers.image.description=Debian $SUITE minbase + $BASE_PACKAGES (python$minor $got)" "$ctr"
  "${B[@]}" commit --rm "$ctr" "$ref"
}

# The Go toolchain without what builds never read (its tests, API lists, docs, the tools' own
# sources): about 180 MB of the 270 MB
GO_SKIP=(./test ./api ./doc ./misc ./src/cmd)
build_go() { # REF: python-base + this machine's Go at /usr/local/go, like golang:1.26-bookworm
  local work="$CACHE/work/go" goroot ctr p excludes=()
  goroot=$(go env GOROOT)
  rm -rf "$work"
  mkdir -p "$work/go"
  for p in "${GO_SKIP[@]}"; do excludes+=(--exclude="$p"); done
  tar -C "$goroot" "${excludes[@]}" -cf - . | tar -C "$work/go" -xf -
  ctr=$("${B[@]}" from --pull-never "${RESULT_REF[python-base]}")
  "${B[@]}" copy "$ctr" "$work/go" /usr/local/go
  "${B[@]}" config --env PATH=/usr/local/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env GOTOOLCHAIN=local --env "GOLANG_VERSION=${GO_VERSION#go}" \
    --label org.opencontainers.image.title=go --label "org.opencontainers.image.version=$GO_VERSION" "$ctr"
  "${B[@]}" commit --rm "$ctr" "$1"
  rm -rf "$work"
}

build_service() { # REF DOCKERFILE
  local tls=() go=()
  # `uv sync` may reach PyPI through a TLS-intercepting proxy whose CA only the host's bundle
  # holds: lend the build that bundle (read-only) and name it, only when the host names one
  if [ -n "${SSL_CERT_FILE:-}" ] && [ -f "$SSL_CERT_FILE" ]; then
    tls=(-v "$SSL_CERT_FILE:$SSL_CERT_FILE:ro" --build-arg "SSL_CERT_FILE=$SSL_CERT_FILE")
  fi
  if grep -q '^ARG GO_IMAGE=' "$2"; then go=(--build-arg "GO_IMAGE=${RESULT_REF[go]}"); fi
  local rc=0
  "${NICE[@]}" "${B[@]}" bud --pull-never --network host --isolation chroot \
    --build-arg "PYTHON_IMAGE=${RESULT_REF[python-base]}" --build-arg "UV_IMAGE=${RESULT_REF[uv]}" \
    "${go[@]}" "${tls[@]}" -f "$2" -t "$1" "$REPO_ROOT" || rc=$?
  # buildah 1.28 leaves the working container of a stage used only by COPY --from (uv) behind,
  # mounted; the storage is ours alone, so every container in it can go
  "${B[@]}" rm --all >/dev/null
  return "$rc"
}

check_hook() { # REF BINARY: the image's /usr/local/bin/gpuslice-enforcer-hook is BINARY, byte for byte
  local c m
  c=$("${B[@]}" from --pull-never "$1" 2>/dev/null) || die "cannot open $1 to check its hook"
  m=$("${B[@]}" mount "$c") || { "${B[@]}" rm "$c" >/dev/null; die "cannot mount $1 to check its hook"; }
  if ! cmp -s "$m/usr/local/bin/gpuslice-enforcer-hook" "$2"; then
    "${B[@]}" umount "$c" >/dev/null; "${B[@]}" rm "$c" >/dev/null
    die "the hook in $1 is not the binary the tests run ($2): the Dockerfile's hook stage and hack/hook-binary.sh must build with the same Go and flags"
  fi
  "${B[@]}" umount "$c" >/dev/null
  "${B[@]}" rm "$c" >/dev/null
  log "enforcer: its hook is $2, byte for byte"
}

# --- build ------------------------------------------------------------------------------------------
FORCE_ALL=0
FORCE_ONE=""
[ "$MODE" != force ] || FORCE_ALL=1
[ "$MODE" != refresh ] || FORCE_ONE=python-base
START=$SECONDS
log "images: cache $CACHE (storage: $DRIVER)"

# python3.X of the workspace: requires-python = ">=3.11,<3.12" -> 3.11
PY_MINOR=$(sed -n 's/^requires-python = ">=\([0-9]*\.[0-9]*\).*/\1/p' "$REPO_ROOT/pyproject.toml")
[[ $PY_MINOR =~ ^3\.[0-9]+$ ]] || die "cannot read the Python minor from requires-python in pyproject.toml"
[ "python$PY_MINOR" = "${BASE_PACKAGES%%,*}" ] \
  || die "pyproject.toml wants Python $PY_MINOR but the base installs ${BASE_PACKAGES%%,*} (BASE_PACKAGES)"

publish pause "$(tag_of "pause $RECIPE_PAUSE $PAUSE_VERSION $(sha256sum <"$REPO_ROOT/hack/images/pause.c") $(gcc -dumpfullversion)")" build_pause
publish uv "$(tag_of "uv $RECIPE_UV $(sha256sum <"$REPO_ROOT/.tools/uv/bin/uv") $(sha256sum <"$REPO_ROOT/.tools/uv/bin/uvx")")" build_uv
publish python-base "$(tag_of "python-base $RECIPE_BASE $SUITE $BASE_PACKAGES ${SLIM_PATHS[*]}")" build_python_base "$PY_MINOR"
GO_VERSION=$(go env GOVERSION)
publish go "$(tag_of "go $RECIPE_GO $GO_VERSION $(go env GOOS GOARCH) ${GO_SKIP[*]} ${RESULT_ID[python-base]}")" build_go
# the static hook as the tests run it: the enforcer image's must be the same bytes
HOOK_BINARY=$(bash "$REPO_ROOT/hack/hook-binary.sh" | tail -n1) || die "hack/hook-binary.sh failed (above)"

# every service with a Dockerfile, new ones included
for dockerfile in "$REPO_ROOT"/services/*/Dockerfile; do
  [ -f "$dockerfile" ] || continue
  service=$(basename "$(dirname "$dockerfile")")
  [[ $service =~ ^[a-z0-9][a-z0-9._-]*$ ]] || die "services/$service: not a valid image name"
  text=$(<"$dockerfile")
  if [[ $text != *$'\n'"ARG PYTHON_IMAGE="* || $text != *$'\n'"ARG UV_IMAGE="* ]]; then
    die "services/$service/Dockerfile must take its base images as build arguments (ARG PYTHON_IMAGE=..., ARG UV_IMAGE=... before the first FROM, as services/kubelet-plugin/Dockerfile does; docs/images.md)"
  fi
  inputs=$(hash_files pyproject.toml uv.lock libs "services/$service" services/*/pyproject.toml tools/*/pyproject.toml)
  go_id=""
  if [[ $text == *$'\n'"ARG GO_IMAGE="* ]]; then go_id=${RESULT_ID[go]}; fi
  publish "$service" "$(tag_of "service $RECIPE_SERVICE $service $inputs ${RESULT_ID[python-base]} ${RESULT_ID[uv]}$go_id")" \
    build_service "$dockerfile"
done
# checked when built: a cached enforcer image's tag covers the hook's sources and the Go image
if [ -n "${RESULT_REF[enforcer]:-}" ] && [ "${RESULT_CACHED[enforcer]}" = false ]; then
  check_hook "${RESULT_REF[enforcer]}" "$HOOK_BINARY"
fi

# intermediate build stages (unnamed images) and what the old tags left
"${B[@]}" rmi --prune >/dev/null 2>&1 || true

# --- manifest ---------------------------------------------------------------------------------------
entry() { # entry NAME -> its JSON object
  local n=$1 meta="${RESULT_ARCHIVE[$1]%.tar}.json" first bytes
  first=$(sed -n 's/.*"build_seconds": \([0-9]*\).*/\1/p' "$meta")
  bytes=$(sed -n 's/.*"image_bytes": \([0-9]*\).*/\1/p' "$meta")
  printf '%s: {"ref": %s, "archive": %s, "id": %s, "size_bytes": %d, "image_bytes": %d, "build_seconds": %d, "cached": %s, "first_build_seconds": %d}' \
    "$(json_str "$n")" "$(json_str "${RESULT_REF[$n]}")" "$(json_str "${RESULT_ARCHIVE[$n]}")" \
    "$(json_str "${RESULT_ID[$n]}")" "$(stat -c %s "${RESULT_ARCHIVE[$n]}")" "${bytes:-0}" \
    "${RESULT_SECONDS[$n]}" "${RESULT_CACHED[$n]}" "${first:-0}"
}
{
  echo '{'
  printf '  "registry": %s,\n  "storage_driver": %s,\n  "images": {\n' "$(json_str "$REGISTRY")" "$(json_str "$DRIVER")"
  sep=""
  for n in "${ORDER[@]}"; do
    [ "$n" != uv ] && [ "$n" != go ] || continue
    printf '%s    %s' "$sep" "$(entry "$n")"
    sep=$',\n'
  done
  printf '\n  },\n  "build_images": {\n    %s,\n    %s\n  }\n}\n' "$(entry uv)" "$(entry go)"
} > "$MANIFEST.tmp"
mv "$MANIFEST.tmp" "$MANIFEST"
log "done in $(( SECONDS - START ))s: ${#ORDER[@]} images; import with: ctr -n k8s.io images import ARCHIVE"
echo "$MANIFEST"
