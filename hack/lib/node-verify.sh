# Sourced by hack/node-binaries.sh (and by hack/tests/test_node_binaries.py, which runs this very
# code against stand-in binaries): do freshly built containerd, ctr, shim, runc and crictl report
# the pinned versions, and was runc built with seccomp?
#
# Capture, then match, as hack/lib/kube-verify.sh does: never `cmd | grep -q` under pipefail (the
# reader leaves at its first match, the writer dies of SIGPIPE on its next line, the pipeline fails
# and a finished build is thrown away).

# _node_line TEXT LINE -> 0 when LINE is one whole line of TEXT
_node_line() { [[ $'\n'$1$'\n' == *$'\n'"$2"$'\n'* ]]; }

# _node_field TEXT KEY VALUE -> 0 when a line of TEXT is "KEY: VALUE", any blanks around both
_node_field() {
  local key val
  while IFS=: read -r key val; do
    key=${key#"${key%%[![:space:]]*}"}
    val=${val#"${val%%[![:space:]]*}"}
    val=${val%"${val##*[![:space:]]}"}
    if [ "$key" = "$2" ] && [ "$val" = "$3" ]; then return 0; fi
  done <<<"$1"
  return 1
}

# _node_version DIR BINARY ARG -> the output of DIR/BINARY ARG in $got; 1 (with a reason) on failure
_node_version() {
  if ! got=$("$1/$2" "$3" 2>&1); then
    printf '%s %s failed: %s\n' "$2" "$3" "${got%%$'\n'*}" >&2
    return 1
  fi
}

# verify_node_versions DIR CONTAINERD_VERSION RUNC_VERSION CRICTL_VERSION
#   0 when, in DIR,
#     containerd --version        prints "containerd github.com/containerd/containerd/v2 vX.Y.Z[ REV]"
#     ctr --version               prints "ctr github.com/containerd/containerd/v2 vX.Y.Z"
#     containerd-shim-runc-v2 -v  has the line "  Version:  vX.Y.Z" (any blanks)
#     runc --version              has the line "runc version A.B.C" and a "libseccomp: ..." line
#     crictl --version            prints "crictl version vA.B.C"
#   (a leading v on the versions given is optional); otherwise 1, with one line on stderr that says
#   what was reported instead.
verify_node_versions() {
  local dir=$1 containerd=v${2#v} runc=${3#v} crictl=v${4#v} got first
  _node_version "$dir" containerd --version || return 1
  first=${got%%$'\n'*}
  # the revision is optional (empty when the module proxy gave no commit hash)
  if [[ $first != "containerd github.com/containerd/containerd/v2 $containerd" &&
        $first != "containerd github.com/containerd/containerd/v2 $containerd "* ]]; then
    printf "containerd reports '%s', expected version %s\n" "$first" "$containerd" >&2
    return 1
  fi
  _node_version "$dir" ctr --version || return 1
  if [ "${got%%$'\n'*}" != "ctr github.com/containerd/containerd/v2 $containerd" ]; then
    printf "ctr reports '%s', expected version %s\n" "${got%%$'\n'*}" "$containerd" >&2
    return 1
  fi
  _node_version "$dir" containerd-shim-runc-v2 -v || return 1
  if ! _node_field "$got" Version "$containerd"; then
    printf "containerd-shim-runc-v2 -v does not report %s: '%s'\n" "$containerd" "${got//$'\n'/ }" >&2
    return 1
  fi
  _node_version "$dir" runc --version || return 1
  # a whole line, so that 1.5.2 is not taken for 1.5.20
  if ! _node_line "$got" "runc version $runc"; then
    printf "runc --version does not report %s: '%s'\n" "$runc" "${got%%$'\n'*}" >&2
    return 1
  fi
  # without the seccomp build tag the pod sandbox fails to start ("seccomp not supported")
  if [[ $'\n'$got != *$'\n'"libseccomp: "* ]]; then
    printf 'runc was built without seccomp (no libseccomp line in runc --version)\n' >&2
    return 1
  fi
  _node_version "$dir" crictl --version || return 1
  if [ "$got" != "crictl version $crictl" ]; then
    printf "crictl reports '%s', expected 'crictl version %s'\n" "${got%%$'\n'*}" "$crictl" >&2
    return 1
  fi
}
