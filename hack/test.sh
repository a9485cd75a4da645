#!/usr/bin/env bash
# `make test`'s checks and tests in two streams at once (docs/development.md, "How `make test`
# runs").
#
# The suite waits more than it computes: the real-node tier on pods, pulls and probes, the other
# e2e tiers on API servers and processes. One session after the other left two cores about a
# third busy and took close to CI's 20-minute budget. So BACKGROUND (the real-node tier and the
# tiers of about the same total length: node pods, chart, device plugin, cluster view) runs as a
# pytest session of its own, while the foreground runs ruff, mypy, the import contracts, the
# generated-code check and then every other test but QUIET. QUIET (the enforcer's timing tests)
# runs last, alone, once both are done. Real nodes claim their cgroups, bridge and pod subnet
# through a slot registry (e2e/sandbox/nodehost.py), and every sandbox takes fresh ports and temp
# dirs, so the two sessions share nothing but the CPUs.
#
# The background session's output is printed after the foreground's, whole; the exit status is
# the first failure's. Arguments go to the foreground pytest. GPUSLICE_TEST_SERIAL=1 runs the
# sessions one after the other (to tell a failure that only happens under load apart).
set -uo pipefail
cd "$(dirname "$0")/.."

BIN=.venv/bin
BACKGROUND=(e2e/tests/realnode e2e/tests/nodepod e2e/tests/chart e2e/tests/device_plugin e2e/tests/view)
# Tests that measure the enforcer's control loops against the clock (SM throttling converging
# to its limit, reaction times in sampling periods) run last, alone: under the other session's
# load a 30 % share measured 35.2 % (its ±5 tolerance is for an enforcer that gets its CPU).
QUIET=(e2e/tests/enforcer e2e/gpustage)
log=$(mktemp -t gpuslice-tests-XXXXXX.log)
background_pid=""

stop_background() {
    # SIGINT, as Ctrl-C: pytest stops and still runs its fixtures' teardown (real nodes,
    # control planes), which SIGTERM would skip
    if [[ -n "$background_pid" ]] && kill -0 "$background_pid" 2>/dev/null; then
        kill -INT "$background_pid" 2>/dev/null
        wait "$background_pid" 2>/dev/null
    fi
}
trap stop_background EXIT
trap 'exit 130' INT TERM

# no cache plugin: two sessions writing .pytest_cache at once would race
background_pytest=("$BIN/pytest" -q -p no:cacheprovider --durations=15 "${BACKGROUND[@]}")

started=$(date +%s)
if [[ -z "${GPUSLICE_TEST_SERIAL:-}" ]]; then
    # job control on: without it bash starts a background job with SIGINT ignored, and Python
    # then never turns a SIGINT into KeyboardInterrupt
    set -m
    "${background_pytest[@]}" >"$log" 2>&1 &
    background_pid=$!
    set +m
fi

status=0
make --no-print-directory lint typecheck imports proto-check || status=$?
if [[ $status -eq 0 ]]; then
    "$BIN/pytest" -q --durations=25 "${BACKGROUND[@]/#/--ignore=}" "${QUIET[@]/#/--ignore=}" \
        "$@" || status=$?
fi
echo "test.sh: the foreground's checks and tests finished in $(( $(date +%s) - started ))s"

if [[ -n "$background_pid" ]]; then
    if [[ $status -ne 0 ]]; then
        stop_background  # the run has failed already; do not wait minutes to say so
    fi
    wait "$background_pid"
    background_status=$?
    background_pid=""
    echo "==================== run alongside: ${BACKGROUND[*]} ===================="
    cat "$log"
else
    background_status=0
    if [[ $status -eq 0 ]]; then
        "${background_pytest[@]}"
        background_status=$?
    fi
fi
rm -f "$log"

quiet_status=0
if [[ $status -eq 0 ]]; then
    echo "==================== alone, last: ${QUIET[*]} ===================="
    "$BIN/pytest" -q -p no:cacheprovider --durations=10 "${QUIET[@]}" || quiet_status=$?
fi
echo "test.sh: everything finished in $(( $(date +%s) - started ))s"
for code in "$status" "$background_status" "$quiet_status"; do
    if [[ $code -ne 0 ]]; then
        exit "$code"
    fi
done
