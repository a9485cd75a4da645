#!/usr/bin/env bash
# `make test`'s checks and tests in two streams at once (docs/testing.md, "How make test runs").
#
# The real-node tier (e2e/tests/realnode: the chart on real kubelets, ~5 minutes) spends most of
# its time waiting for pods, pulls and probes, and everything else spends much of its time
# waiting for API servers and processes: one after the other they left two cores about a third
# busy and took close to CI's 20-minute budget. So the real-node tier runs as a pytest session
# of its own in the background, while the foreground runs ruff, mypy, the import contracts, the
# generated-code check and then every other test. Real nodes claim their cgroups, bridge and pod
# subnet through a slot registry (e2e/sandbox/nodehost.py), and every other sandbox takes fresh
# ports and temp dirs, so the two sessions share nothing but the CPUs.
#
# The background session's output is printed after the foreground's, whole; the exit status is
# the first failure's. Arguments go to the foreground pytest. GPUSLICE_TEST_SERIAL=1 runs the
# two one after the other instead (to tell a failure that only happens under load apart).
set -uo pipefail
cd "$(dirname "$0")/.."

BIN=.venv/bin
REALNODE=e2e/tests/realnode
log=$(mktemp -t gpuslice-realnode-XXXXXX.log)
realnode_pid=""

stop_background() {
    if [[ -n "$realnode_pid" ]] && kill -0 "$realnode_pid" 2>/dev/null; then
        kill -TERM "$realnode_pid" 2>/dev/null
        wait "$realnode_pid" 2>/dev/null
    fi
}
trap stop_background EXIT
trap 'exit 130' INT TERM

run_realnode() {
    # no cache plugin: two sessions writing .pytest_cache at once would race
    "$BIN/pytest" -q -p no:cacheprovider --durations=10 "$REALNODE"
}

started=$(date +%s)
if [[ -z "${GPUSLICE_TEST_SERIAL:-}" ]]; then
    run_realnode >"$log" 2>&1 &
    realnode_pid=$!
fi

status=0
make --no-print-directory lint typecheck imports proto-check || status=$?
if [[ $status -eq 0 ]]; then
    "$BIN/pytest" -q --durations=25 --ignore="$REALNODE" "$@" || status=$?
fi
echo "test.sh: checks and tests but the real-node tier finished in $(( $(date +%s) - started ))s"

if [[ -n "$realnode_pid" ]]; then
    if [[ $status -ne 0 ]]; then
        stop_background  # the run has failed already; do not wait minutes to say so
    fi
    wait "$realnode_pid"
    realnode_status=$?
    realnode_pid=""
    echo "==================== real-node tier ($REALNODE, run alongside) ===================="
    cat "$log"
else
    realnode_status=0
    if [[ $status -eq 0 ]]; then
        run_realnode
        realnode_status=$?
    fi
fi
rm -f "$log"
echo "test.sh: everything finished in $(( $(date +%s) - started ))s"
if [[ $status -ne 0 ]]; then
    exit "$status"
fi
exit "$realnode_status"
