# Sourced by hack/kube-binaries.sh and hack/node-binaries.sh: what building pinned binaries from
# Go modules into the cache takes, once. The sourcing script sets TOOL (its name, for messages)
# and VERSIONS_FILE first, and BINARIES, BIN_DIR, STAMP, STAMP_KEY, STAGE, VERSION_DIR, HOW and
# GO_VERSION before calling the functions that use them.

log() { printf '>> %s\n' "$*" >&2; }
die() { printf '%s: error: %s\n' "$TOOL" "$*" >&2; exit 1; }

pinned() { # pinned KEY -> value from versions.env (not sourced, so the environment wins)
  sed -n "s/^$1=\\([^[:space:]#]*\\).*/\\1/p" "$VERSIONS_FILE" | tail -n1
}
first_match() { # first_match 's/RE/REPL/' TEXT -> the first line RE matches, substituted
  sed -n "$1;T;p;q" <<<"$2"  # quits itself: no `| head -n1` for pipefail to trip over
}

have_all() { local d=$1 b; for b in "${BINARIES[@]}"; do [ -x "$d/$b" ] || return 1; done; }
missing_in() { local d=$1 b out=(); for b in "${BINARIES[@]}"; do [ -x "$d/$b" ] || out+=("$b"); done; echo "${out[*]}"; }
cache_ok() { [ -f "$STAMP" ] && [ "$(head -n1 "$STAMP")" = "$STAMP_KEY" ] && have_all "$BIN_DIR"; }

sumdb_or_off() { # sumdb_or_off MODULE@VERSION: GOSUMDB=off when sum.golang.org cannot be reached
  # (only package registries are reachable from some machines; checksums then come from the
  # proxy alone). Keeps the user's setting when it was given explicitly.
  [ -z "${GOSUMDB+x}" ] || return 0
  if ! curl -fsS -m 8 -o /dev/null "https://sum.golang.org/lookup/$1" 2>/dev/null; then
    log "warning: sum.golang.org is unreachable; building with GOSUMDB=off (module checksums from the proxy only)"
    export GOSUMDB=off
  fi
}

hold_lock() { # hold_lock FILE: one build of these versions at a time; a waiter that finds the
  # work done by the holder prints the bin dir and exits
  exec 9>"$1"
  if ! flock -n 9; then
    log "another build holds $1; waiting for it"
    flock 9
    if cache_ok && [ "$MODE" != force ]; then echo "$BIN_DIR"; exit 0; fi
  fi
}

rerun_hint() { # EXIT trap while building: a failed run says what it kept and what to run next
  [ "$1" != 0 ] || return 0
  printf '%s\n' \
    "$TOOL: the work done so far is kept (compiled packages in GOCACHE=$GOCACHE," \
    "  linked binaries in $STAGE/); a rerun redoes only what is missing." \
    "  fix the cause above, then run again:  ${HOW}make $TOOL   (= ${HOW}hack/$TOOL.sh)" >&2
}

progress() { # progress LOGFILE LABEL: count `go build -v` package lines, keep everything in LOGFILE
  local logf=$1 label=$2
  awk -v label="$label" -v logf="$logf" '
    { print > logf; fflush(logf) }
    /^go: downloading / { d++; if (d % 50 == 0) { printf "   %s: %d modules downloaded\n", label, d > "/dev/stderr" } next }
    /^[a-zA-Z0-9._~\/-]+$/ { n++; if (n % 250 == 0) { printf "   %s: %d packages compiled\n", label, n > "/dev/stderr" } }
    END { printf "   %s: %d modules downloaded, %d packages compiled\n", label, d, n > "/dev/stderr" }'
}

fail_with_log() { # fail_with_log LOGFILE WHAT COMMAND...
  local logf=$1 what=$2; shift 2
  printf '%s: building %s failed.\n  command (in %s): %s\n  last lines of %s:\n' \
    "$TOOL" "$what" "$PWD" "$*" "$logf" >&2
  grep -v '^go: downloading ' "$logf" | tail -n 40 | sed 's/^/    /' >&2
  exit 1
}

publish() { # publish ELAPSED: stamp the verified STAGE and make it BIN_DIR
  printf '%s\nbuilt %s with %s in %ds on %s cores\n' "$STAMP_KEY" "$BUILT_AT" "$GO_VERSION" \
    "$1" "$(nproc 2>/dev/null || echo '?')" > "$STAGE/.stamp"
  # bin/ is swapped by two renames (the old one, stamp and all, stays usable up to the first)
  rm -rf "$VERSION_DIR/bin.old"
  [ ! -e "$BIN_DIR" ] || mv "$BIN_DIR" "$VERSION_DIR/bin.old"
  mv "$STAGE" "$BIN_DIR"
  rm -rf "$VERSION_DIR/bin.old"
  trap - EXIT
}
