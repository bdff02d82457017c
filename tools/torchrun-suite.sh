#!/usr/bin/env bash
# One world size of `make test-torchrun`: torchrun starts NPROCS ranks,
# each running pytest with the given arguments on torchrun's process group.
#
#     tools/torchrun-suite.sh NPROCS LOGDIR TORCHRUN LIMIT -- PYTEST-ARGS...
#
# Rank 0 prints to the console; the other ranks' output goes to LOGDIR
# (torchrun --log-dir, --redirects) and is printed from there when the
# launch fails (a rank that died shows why: pytest's faulthandler writes
# its stacks to stderr).
#
# One rerun, only for a crash of the process: torch's gloo backend
# corrupts its own heap now and then under functional collectives (two
# all-gathers in flight on one group abort or segfault within seconds, see
# dcp_optim/_engine/serial_collectives.py; the rare crash seen with them
# one at a time, once in many CI runs, stopped in torch's wait_tensor).
# When a rank dies of SIGSEGV or SIGABRT (torchrun's summary says so),
# the ranks' output is printed and the launch runs once more, whole; the
# rerun must pass.  A failing test, a hang (LIMIT), or a second crash
# fails the run.
set -uo pipefail

n=$1 logs=$2 torchrun=$3 limit=$4
shift 4
[ "${1:-}" = "--" ] && shift
others=$(seq -s, 1 $((n - 1)) | sed 's/\([0-9][0-9]*\)/\1:3/g')

print_rank_logs() {
    for f in $(find "$logs" -path '*/attempt_*/[1-9]*' -name 'std*.log' | sort); do
        echo "== $f"
        if [ "$(wc -l < "$f")" -le 160 ]; then cat "$f"
        else head -n 40 "$f"; echo "[...]"; tail -n 120 "$f"; fi
    done
}

for attempt in 1 2; do
    rm -rf "$logs"
    mkdir -p "$logs"
    console="$logs/console.log"
    timeout -k 10 "$limit" "$torchrun" --standalone --nproc-per-node="$n" \
        --log-dir "$logs" --redirects "$others" -m pytest "$@" 2>&1 | tee "$console"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] && exit 0
    print_rank_logs
    # rc 124/137: the launch ran past LIMIT, never rerun
    if [ "$attempt" -eq 1 ] && [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] && \
            grep -qE "Signal (6|11) \((SIGABRT|SIGSEGV)\) received" "$console"; then
        echo "== torchrun --nproc-per-node=$n: a rank crashed (above); running the launch once more"
        continue
    fi
    exit 1
done
exit 1
