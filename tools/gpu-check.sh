#!/usr/bin/env bash
# dcp_optim on a CUDA machine, in one command:
#
#     tools/gpu-check.sh
#
# 1. an interpreter with torch: GPU_CHECK_PYTHON if given (used as it is);
#    else the virtualenv .venv-gpu, created once -- with the system's
#    packages visible when the base interpreter ($PYTHON, default python3)
#    already has torch (that torch is used, never replaced), otherwise
#    with torch==$TORCH_VERSION (default 2.13.0) installed from the
#    PyTorch CUDA index matching the driver (nvidia-smi), or from
#    $TORCH_INDEX_URL.  Without an NVIDIA driver nothing is downloaded:
#    the project's CPU virtualenv is used (make build).
# 2. test tools (pytest, pytest-timeout, numpy, setuptools) where missing,
#    with torch pinned to the installed version by a pip constraint;
#    torch's version is checked again afterwards.
# 3. the C core built in place.
# 4. the CPU-side checks: tests/unit/test_device_rules.py and the CUDA suite's
#    bodies on the CPU.
# 5. the CUDA suite, tests/gpu, on cuda:0 (DCP_OPTIM_GPU=1) -- or, without
#    a usable CUDA device, a message saying why, and exit status 0.
# 6. a summary table (also in $GPU_CHECK_OUT, default ./gpu-check-out:
#    the pytest logs and JUnit reports).
#
# Exit status: pytest's (0 when everything that could run passed).
#
# Time (an estimate until the first GPU run): with torch already
# installed, about 2 minutes (build 30 s, CPU
# checks 30-60 s, CUDA suite 1-2 min).  Downloading a CUDA torch (~2.5 GB
# plus NVIDIA libraries) adds 1-4 minutes on a fast link.  The whole run
# stays within GPU_CHECK_BUDGET seconds (default 480, install included):
# the CPU-side checks and then the CUDA suite are each killed at the time
# left, less GPU_CHECK_MARGIN (default 20 s, for the summary); the suite's
# limit is min(GPU_CHECK_TIMEOUT (default 360), budget - elapsed - margin),
# printed before it starts.  With less than 30 s left the suite is not
# started (exit 3): run the script again, torch is installed by then.
#
# `tools/gpu-check.sh --cuda-index` only prints the wheel index it would
# install torch from; `tools/gpu-check.sh --suite-timeout ELAPSED` only
# prints the suite's limit after ELAPSED seconds.
#
# Other settings: GPU_CHECK_VENV (default .venv-gpu), GPU_CHECK_SKIP_BUILD=1
# (make test-gpu builds first), GPU_CHECK_CPU_TESTS (the CPU-side test
# selection, default "tests/unit/test_device_rules.py tests/gpu").

set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

TORCH_VERSION=${TORCH_VERSION:-2.13.0}
OUT=${GPU_CHECK_OUT:-$ROOT/gpu-check-out}
VENV=${GPU_CHECK_VENV:-$ROOT/.venv-gpu}
BASE_PY=${PYTHON:-python3}
CPU_TESTS=${GPU_CHECK_CPU_TESTS:-tests/unit/test_device_rules.py tests/gpu}
SUITE_MAX=${GPU_CHECK_TIMEOUT:-360}
BUDGET=${GPU_CHECK_BUDGET:-480}
MARGIN=${GPU_CHECK_MARGIN:-20}
SUITE_MIN=30
START=$SECONDS

log() { printf '[gpu-check %3ds] %s\n' "$((SECONDS - START))" "$*"; }
die() { log "error: $*"; exit 2; }

has_torch() { "$1" -c "import torch" >/dev/null 2>&1; }

# The PyTorch wheel index for the driver's CUDA version (nvidia-smi), on
# stdout (messages go to stderr).
cuda_index() {
    local v major minor tag
    v=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' | head -n1)
    [ -n "$v" ] || return 1
    major=${v%%.*}
    minor=${v#*.}
    if [ "$major" -ge 13 ]; then
        tag=cu130
    elif [ "$major" -eq 12 ] && [ "$minor" -ge 8 ]; then
        tag=cu128
    elif [ "$major" -eq 12 ] && [ "$minor" -ge 6 ]; then
        tag=cu126
    else
        log "driver supports CUDA $v only; torch $TORCH_VERSION wheels need 12.6 or newer" >&2
        return 1
    fi
    echo "https://download.pytorch.org/whl/$tag"
}

# Seconds a step may take after $1 seconds of the run: what is left of the
# budget less the margin, at most $2 (and never below 0).
time_left() {
    local left=$((BUDGET - $1 - MARGIN))
    [ "$left" -gt 0 ] || left=0
    [ -z "${2:-}" ] || [ "$left" -le "$2" ] || left=$2
    echo "$left"
}

# tools/gpu-check.sh --cuda-index: print the wheel index it would use, and stop
if [ "${1:-}" = "--cuda-index" ]; then
    cuda_index
    exit $?
fi
# tools/gpu-check.sh --suite-timeout ELAPSED: the suite's limit, and stop
if [ "${1:-}" = "--suite-timeout" ]; then
    time_left "${2:?elapsed seconds}" "$SUITE_MAX"
    exit 0
fi

# --- 1. interpreter -------------------------------------------------------------
mkdir -p "$OUT"
if [ -n "${GPU_CHECK_PYTHON:-}" ]; then
    PY=$GPU_CHECK_PYTHON
    log "interpreter: $PY (given)"
elif ! nvidia-smi >/dev/null 2>&1 && [ -z "${TORCH_INDEX_URL:-}" ]; then
    log "no NVIDIA driver (nvidia-smi fails): no CUDA torch to install; using the project's CPU virtualenv (make build)"
    make -s build >"$OUT/build.log" 2>&1 || { tail -n 30 "$OUT/build.log"; die "make build failed"; }
    PY=$ROOT/.venv/bin/python
    GPU_CHECK_SKIP_BUILD=1
else
    if [ ! -x "$VENV/bin/python" ]; then
        if has_torch "$BASE_PY"; then
            log "$BASE_PY has torch: creating $VENV on top of it (--system-site-packages)"
            "$BASE_PY" -m venv --system-site-packages "$VENV"
        else
            log "creating $VENV"
            "$BASE_PY" -m venv "$VENV"
        fi
    fi
    PY=$VENV/bin/python
    if ! has_torch "$PY"; then
        INDEX=${TORCH_INDEX_URL:-$(cuda_index)} || die "cannot choose a CUDA wheel index: set TORCH_INDEX_URL"
        log "installing torch==$TORCH_VERSION from $INDEX (several GB)"
        "$PY" -m pip install -q --upgrade pip
        "$PY" -m pip install -q "torch==$TORCH_VERSION" --index-url "$INDEX"
    fi
    log "interpreter: $PY"
fi

# torch's version and, when CUDA cannot be used, why (one import of torch)
INFO=$("$PY" -m tests.gpu.env) || die "$PY cannot import torch"
TORCH_NOW=${INFO%%$'\t'*}
REASON=${INFO#*$'\t'}
log "torch $TORCH_NOW${REASON:+ -- $REASON}"
# the releases the package supports and the suite has run on (pyproject.toml:
# torch>=2.11; docs/testing.md, "Supported versions")
case "$TORCH_NOW" in
    "$TORCH_VERSION"|"$TORCH_VERSION"+*|2.11.*|2.12.*|2.13.*) ;;
    *) log "WARNING: torch $TORCH_NOW, not $TORCH_VERSION: the differential tests compare with this torch's upstream, and the suite was written against 2.11 to 2.13" ;;
esac

# --- 2. test tools, torch pinned ------------------------------------------------
if ! "$PY" -c "import pytest, pytest_timeout, numpy, setuptools" >/dev/null 2>&1; then
    CONSTRAINTS=$OUT/constraints.txt
    echo "torch==${TORCH_NOW}" >"$CONSTRAINTS"
    log "installing test tools (torch pinned to $TORCH_NOW)"
    "$PY" -m pip install -q -c "$CONSTRAINTS" "pytest>=8" pytest-timeout numpy setuptools
    AFTER=$("$PY" -c "import torch; print(torch.__version__)")
    [ "$AFTER" = "$TORCH_NOW" ] || die "torch changed during the install ($TORCH_NOW -> $AFTER)"
fi

# --- 3. build -------------------------------------------------------------------
if [ "${GPU_CHECK_SKIP_BUILD:-0}" != 1 ]; then
    log "building the C core in place"
    DCP_OPTIM_WERROR=1 "$PY" setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1 \
        || { tail -n 30 "$OUT/build.log"; die "build failed (see $OUT/build.log)"; }
fi

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
PYTEST=("$PY" -m pytest -p no:cacheprovider -o junit_family=xunit1 -rfEs)

# --- 4. CPU-side checks ---------------------------------------------------------
CPU_LIMIT=$(time_left "$((SECONDS - START))")
log "CPU-side checks: $CPU_TESTS (limit ${CPU_LIMIT}s)"
set +e
# shellcheck disable=SC2086  # a list of test paths / node ids
env -u DCP_OPTIM_GPU timeout -k 5 "$CPU_LIMIT" "${PYTEST[@]}" -q --junitxml="$OUT/cpu.xml" $CPU_TESTS >"$OUT/cpu.log" 2>&1
CPU_RC=$?
set -e
[ "$CPU_RC" -ne 124 ] && [ "$CPU_RC" -ne 137 ] || log "CPU-side checks killed after ${CPU_LIMIT}s (the ${BUDGET}s budget)"
tail -n 3 "$OUT/cpu.log"
"$PY" -m tests.gpu.summary --brief "$OUT/cpu.xml" "CPU-side checks (torch $TORCH_NOW):" >"$OUT/cpu-summary.txt" || true

# --- 5. the CUDA suite ----------------------------------------------------------
if [ -n "$REASON" ]; then
    cat "$OUT/cpu-summary.txt"
    echo
    log "CUDA suite skipped: $REASON"
    if [ "$CPU_RC" -ne 0 ]; then
        log "CPU-side checks FAILED (exit $CPU_RC): see $OUT/cpu.log"
        exit "$CPU_RC"
    fi
    log "CPU-side checks passed; nothing ran on a GPU (exit 0)"
    exit 0
fi

DEVICE=$("$PY" -c "import torch; p = torch.cuda.get_device_properties(0); print(f'{p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {\".\".join(map(str, torch.cuda.nccl.version()))}')")
ELAPSED=$((SECONDS - START))
SUITE_TIMEOUT=$(time_left "$ELAPSED" "$SUITE_MAX")
log "CUDA suite on $DEVICE: limit ${SUITE_TIMEOUT}s = min(${SUITE_MAX}, ${BUDGET} budget - ${ELAPSED} elapsed - ${MARGIN} margin)"
if [ "$SUITE_TIMEOUT" -lt "$SUITE_MIN" ]; then
    cat "$OUT/cpu-summary.txt"
    log "CUDA suite NOT run: ${SUITE_TIMEOUT}s left of the ${BUDGET}s budget after the install and the CPU-side checks; run again (torch is installed now)"
    exit 3
fi
set +e
DCP_OPTIM_GPU=1 timeout -k 5 "$SUITE_TIMEOUT" "${PYTEST[@]}" -v --junitxml="$OUT/gpu.xml" tests/gpu >"$OUT/gpu.log" 2>&1
GPU_RC=$?
set -e
tail -n 5 "$OUT/gpu.log"
echo
cat "$OUT/cpu-summary.txt"
echo
if [ -f "$OUT/gpu.xml" ]; then
    "$PY" -m tests.gpu.summary "$OUT/gpu.xml" "CUDA suite on $DEVICE:" | tee "$OUT/gpu-summary.txt"
else
    log "no JUnit report (killed after ${SUITE_TIMEOUT}s?): see $OUT/gpu.log"
fi
echo
log "done: CPU-side checks exit $CPU_RC, CUDA suite exit $GPU_RC (logs in $OUT)"
[ "$CPU_RC" -eq 0 ] || exit "$CPU_RC"
exit "$GPU_RC"
