#!/usr/bin/env bash
# Installs the tools of the hardening targets (make lint, test-asan,
# test-refleak, test-valgrind).  Idempotent and quiet when everything is
# present; nothing is assumed to be pre-installed.
#
#   .ci/install-tools.sh [lint] [asan] [refleak] [valgrind] [clang]
#
# With no argument it installs everything.  Distribution packages come from
# apt (Debian 12: clang 14, cppcheck 2.10, valgrind 3.19, python3.11-dbg);
# ruff comes from PyPI into the project's .venv (pinned below).
set -euo pipefail
cd "$(dirname "$0")/.."

RUFF_VERSION="${RUFF_VERSION:-0.8.6}"
VENV_PY="${VENV_PY:-.venv/bin/python}"

want=("$@")
if [ ${#want[@]} -eq 0 ]; then
    want=(lint asan refleak valgrind clang)
fi

pkgs=()
need() { # need <command-or-file> <package>...
    local probe="$1"
    shift
    if [[ "$probe" == /* ]]; then
        [ -e "$probe" ] && return 0
    else
        command -v "$probe" >/dev/null 2>&1 && return 0
    fi
    pkgs+=("$@")
}
need_py_module() { # need_py_module <python> <module> <package>
    "$1" -c "import $2" >/dev/null 2>&1 || pkgs+=("$3")
}

for w in "${want[@]}"; do
    case "$w" in
    lint)
        need clang-format clang-format
        need clang-tidy clang-tidy
        need cppcheck cppcheck
        need /usr/include/python3.11/Python.h python3.11-dev
        ;;
    clang)
        need clang clang
        ;;
    asan)
        need gcc gcc
        # libasan.so for LD_PRELOAD comes with gcc's libgcc-12-dev.
        ;;
    refleak)
        need python3.11d python3.11-dbg
        need /usr/include/python3.11d/Python.h python3.11-dbg
        need_py_module /usr/bin/python3.11 pytest python3-pytest
        need_py_module /usr/bin/python3.11 pytest_timeout python3-pytest-timeout
        need_py_module /usr/bin/python3.11 hypothesis python3-hypothesis
        ;;
    valgrind)
        need valgrind valgrind
        need /usr/bin/python3.11 python3.11
        need /usr/include/python3.11/Python.h python3.11-dev
        need_py_module /usr/bin/python3.11 pytest python3-pytest
        need_py_module /usr/bin/python3.11 pytest_timeout python3-pytest-timeout
        need_py_module /usr/bin/python3.11 hypothesis python3-hypothesis
        ;;
    *)
        echo "install-tools.sh: unknown group '$w'" >&2
        exit 2
        ;;
    esac
done

if [ ${#pkgs[@]} -gt 0 ]; then
    # De-duplicate, keep order.
    mapfile -t pkgs < <(printf '%s\n' "${pkgs[@]}" | awk '!seen[$0]++')
    echo "install-tools.sh: apt-get install ${pkgs[*]}"
    export DEBIAN_FRONTEND=noninteractive
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
fi

for w in "${want[@]}"; do
    # ruff goes into the virtualenv, which may still be in the making when
    # .ci/run installs the distribution packages beside its creation
    # (TOOLS_NO_RUFF=1 there; make lint comes back for ruff)
    if [ "$w" = lint ] && [ "${TOOLS_NO_RUFF:-0}" != 1 ]; then
        if ! "$VENV_PY" -m ruff --version 2>/dev/null | grep -qx "ruff $RUFF_VERSION"; then
            echo "install-tools.sh: pip install ruff==$RUFF_VERSION"
            "$VENV_PY" -m pip install -q "ruff==$RUFF_VERSION"
        fi
    fi
done
