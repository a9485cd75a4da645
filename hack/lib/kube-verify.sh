# Sourced by hack/kube-binaries.sh (and by hack/tests/test_kube_binaries.py, which runs this very
# code against stand-in binaries): do freshly built binaries report the pinned versions?
#
# Capture, then match. Never pipe a version command into `grep -q`, `head` or anything else that
# stops reading early: under `set -o pipefail` the pipeline fails whenever the reader exits at its
# first match and the writer is then killed by SIGPIPE writing its next line. `etcd --version |
# grep -q` did exactly that on a loaded 2-core machine, 23 times in 200, and threw away a
# finished ten-minute build.

# verify_versions DIR KUBE_VERSION ETCD_VERSION
#   0 when DIR/kube-apiserver --version prints exactly "Kubernetes KUBE_VERSION" and one line of
#   DIR/etcd --version is exactly "etcd Version: ETCD_VERSION" (a leading v is ignored);
#   otherwise 1, with one line on stderr that says what was reported instead.
verify_versions() {
  local dir=$1 kube=$2 etcd=${3#v} got
  if ! got=$("$dir/kube-apiserver" --version 2>&1); then
    printf 'kube-apiserver --version failed: %s\n' "$got" >&2
    return 1
  fi
  if [ "$got" != "Kubernetes $kube" ]; then
    printf "kube-apiserver reports '%s', expected 'Kubernetes %s'\n" "$got" "$kube" >&2
    return 1
  fi
  if ! got=$("$dir/etcd" --version 2>&1); then
    printf 'etcd --version failed: %s\n' "${got%%$'\n'*}" >&2
    return 1
  fi
  # a whole line, so that 3.6.1 is not taken for 3.6.16
  if [[ $'\n'$got$'\n' != *$'\n'"etcd Version: $etcd"$'\n'* ]]; then
    printf "etcd --version does not report %s: '%s'\n" "$etcd" "${got%%$'\n'*}" >&2
    return 1
  fi
}
