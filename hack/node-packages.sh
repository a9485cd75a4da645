#!/usr/bin/env bash
# Installs the Debian packages the real-node tier needs (docs/real-node.md), once:
#   buildah                      daemonless image builds from the services' own Dockerfiles
#   debootstrap                  local base images (Python, from Debian packages) instead of registry ones
#   containernetworking-plugins  CNI bridge, host-local and loopback for the nodes' containerd
#   libseccomp-dev, pkg-config   runc is built with the seccomp tag (cgo)
#   gcc, libc6-dev               the static pause image
#   iproute2                     the bridges and network namespaces the nodes leave behind are checked
#   docker-registry              the OCI registry on loopback that images and chart are pushed to (distribution 2.8;
#                                the system service the package enables is stopped, see the end)
#   skopeo                       copies the images' OCI archives to that registry, digests kept (hack/release.sh)
#   prometheus                   a real Prometheus (and promtool) scrapes the chart through its own monitors
#                                and judges the shipped alert rules (docs/alerts.md)
# Nothing happens when every package is already installed. Needs root (or sudo) and Debian's
# package mirrors; prints the missing packages and how to install them otherwise.
#
# usage: hack/node-packages.sh [--check]
#   --check   exit 1 (with the list) when a package is missing; install nothing
set -euo pipefail

PACKAGES=(buildah debootstrap containernetworking-plugins libseccomp-dev pkg-config gcc libc6-dev iproute2
          docker-registry skopeo prometheus)

missing=()
for p in "${PACKAGES[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [ "$status" = "install ok installed" ] || missing+=("$p")
done
[ ${#missing[@]} -gt 0 ] || exit 0

if [ "${1:-}" = --check ]; then
  printf 'node-packages: missing Debian packages: %s\n  install them with: hack/node-packages.sh\n' \
    "${missing[*]}" >&2
  exit 1
fi

SUDO=()
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || {
    printf 'node-packages: need root to install %s (run as root, or: apt-get install %s)\n' \
      "${missing[*]}" "${missing[*]}" >&2
    exit 1
  }
  SUDO=(sudo -n)
fi
printf '>> installing Debian packages: %s\n' "${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
# A fresh machine may have no package lists yet; a stale list fails with 404s: refresh once.
if ! "${SUDO[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}" >/tmp/node-packages.log 2>&1; then
  "${SUDO[@]}" apt-get update -q >>/tmp/node-packages.log 2>&1
  "${SUDO[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}" >>/tmp/node-packages.log 2>&1 || {
    printf 'node-packages: apt-get install failed; last lines of /tmp/node-packages.log:\n' >&2
    tail -n 20 /tmp/node-packages.log | sed 's/^/    /' >&2
    exit 1
  }
fi
# Debian's docker-registry package enables a system registry on :5000 (all interfaces). We use
# only its binary, each run with its own config on a port of its own: stop and disable that
# service when this run installed the package (a registry someone set up before is left alone).
# Debian's prometheus package likewise enables a system Prometheus on :9090.
for service in docker-registry prometheus; do
  if [[ " ${missing[*]} " == *" $service "* ]] && command -v systemctl >/dev/null \
    && [ -d /run/systemd/system ]; then
    "${SUDO[@]}" systemctl disable --now "$service.service" >>/tmp/node-packages.log 2>&1 || true
    printf '>> stopped and disabled %s.service (gpuslice starts its own)\n' "$service" >&2
  fi
done
