#!/usr/bin/env bash
# Builds the mock libnvidia-ml.so.1 (C sources in libs/nvml/mock/, docs/nvml-mock.md) with gcc
# against NVIDIA's nvml.h, into a cache outside the work tree:
#   ${XDG_CACHE_HOME:-$HOME/.cache}/gpuslice/nvml-mock/lib-<key>/libnvidia-ml.so.1
# where <key> hashes the sources, this script, the header and the compiler, so an edit builds a
# new library and an unchanged tree reuses the old one (a build is ~2 s). nvml.h comes from the
# PyPI wheel nvidia-nvml-dev (NVML_DEV_VERSION below), fetched once with pip into
#   ${XDG_CACHE_HOME:-$HOME/.cache}/gpuslice/nvml-mock/include-<version>/nvml.h
# or from NVML_HEADER=/path/to/nvml.h (a CUDA toolkit's) when set. No other dependency.
#
# Point a program at the library with LD_LIBRARY_PATH=<lib dir> and the node file it answers
# for: GPUSLICE_NVML_MOCK_NODE=<file> (python -m gpuslice_nvml.mock --config <fake node config>
# writes it and prints that line), or without the variable a gpuslice-nvml-mock-node.json next
# to the library (a driver root of files: gpuslice_testkit.nvml_mock.write_driver_root).
#
# usage: hack/nvml-mock.sh [--print-dir | --force | --help]
#   (none)       build unless cached; progress on stderr; the lib dir is the last stdout line
#   --print-dir  print the lib dir when the library for this tree is built, else exit 1
#   --force      rebuild even when the cache has it
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TOOL=nvml-mock
NVML_DEV_VERSION=13.4.92
PYTHON=${PYTHON:-python3.11}
SRC="$REPO_ROOT/libs/nvml/mock"
CACHE=${GPUSLICE_NVML_MOCK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpuslice/nvml-mock}
CFLAGS=(-std=c11 -D_GNU_SOURCE -O2 -g -fPIC -Wall -Wextra -Werror -pthread)

log() { printf '>> %s\n' "$*" >&2; }
die() { printf '%s: error: %s\n' "$TOOL" "$*" >&2; exit 1; }

MODE=build
case "${1:-}" in
  "") ;;
  --print-dir) MODE=print ;;
  --force) MODE=force ;;
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  *) die "unknown argument '$1' (see --help)" ;;
esac

command -v gcc >/dev/null || die "gcc is not installed (Debian: apt-get install gcc)"
mkdir -p "$CACHE"

header() { # the nvml.h to build against: NVML_HEADER, or the wheel's, fetched once
  if [ -n "${NVML_HEADER:-}" ]; then
    [ -f "$NVML_HEADER" ] || die "NVML_HEADER=$NVML_HEADER is not a file"
    echo "$NVML_HEADER"
    return
  fi
  local dir="$CACHE/include-$NVML_DEV_VERSION"
  if [ ! -f "$dir/nvml.h" ]; then
    [ "$MODE" = print ] && return 1
    log "fetching nvml.h from the PyPI wheel nvidia-nvml-dev==$NVML_DEV_VERSION"
    local work
    work=$(mktemp -d)
    "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps -d "$work" \
      "nvidia-nvml-dev==$NVML_DEV_VERSION" >&2 \
      || { rm -rf "$work"; die "pip could not download nvidia-nvml-dev==$NVML_DEV_VERSION (or set NVML_HEADER)"; }
    "$PYTHON" - "$work" <<'PY' || { rm -rf "$work"; die "the wheel has no nvml.h"; }
import glob, sys, zipfile
work = sys.argv[1]
wheel = zipfile.ZipFile(glob.glob(f"{work}/*.whl")[0])
name = next(n for n in wheel.namelist() if n.endswith("/nvml.h"))
with open(f"{work}/nvml.h", "wb") as out:
    out.write(wheel.read(name))
PY
    mkdir -p "$dir.partial"
    mv "$work/nvml.h" "$dir.partial/nvml.h"
    rm -rf "$work" "$dir"
    mv "$dir.partial" "$dir"
  fi
  echo "$dir/nvml.h"
}

HEADER=$(header) || { [ "$MODE" = print ] && exit 1; die "no nvml.h"; }
# gcc's first line, without `| head` (under pipefail, gcc writing after head left fails the script)
GCC_VERSION=$(gcc --version)
GCC_VERSION=${GCC_VERSION%%$'\n'*}
KEY=$( { cat "$SRC"/*.c "$SRC"/*.h "$SRC"/exports.map "$0" "$HEADER"; echo "$GCC_VERSION";
         echo "${CFLAGS[*]}"; } | sha256sum | cut -c1-16)
LIB_DIR="$CACHE/lib-$KEY"

if [ -f "$LIB_DIR/libnvidia-ml.so.1" ] && [ "$MODE" != force ]; then
  echo "$LIB_DIR"
  exit 0
fi
[ "$MODE" = print ] && exit 1

exec 9>"$CACHE/.build.lock"  # one build at a time; a waiter may find the work done
flock 9
if [ -f "$LIB_DIR/libnvidia-ml.so.1" ] && [ "$MODE" != force ]; then echo "$LIB_DIR"; exit 0; fi

start=$(date +%s%N)
stage=$(mktemp -d "$CACHE/.stage.XXXXXX")
trap 'rm -rf "$stage"' EXIT
gcc "${CFLAGS[@]}" -shared -I"$(dirname "$HEADER")" -o "$stage/libnvidia-ml.so.1" \
  -Wl,-soname,libnvidia-ml.so.1 -Wl,--version-script="$SRC/exports.map" -Wl,-z,defs \
  "$SRC"/*.c -lpthread -ldl
ln -s libnvidia-ml.so.1 "$stage/libnvidia-ml.so"
count=$(nm -D --defined-only "$stage/libnvidia-ml.so.1" | awk '$2 == "T" && $3 ~ /^nvml/' | wc -l)
rm -rf "$LIB_DIR"
mv "$stage" "$LIB_DIR"
trap - EXIT
log "built $LIB_DIR/libnvidia-ml.so.1: $count NVML functions, $(( ($(date +%s%N) - start) / 1000000 )) ms"
echo "$LIB_DIR"
