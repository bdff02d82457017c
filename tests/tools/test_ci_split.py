"""CI's split of the suite between `make test` and the sanitizer's run.

Under ``TEST_SPLIT=1`` (``.ci/run``, ``make ci``), ``make test`` leaves out
the tests that ``make test-asan-suite`` and ``make test-asan-hostile`` make on
the ASan build (tests/conftest.py, from the Makefile's ``ASAN_TESTS`` and
``ASAN_LEFT_OUT``).  If the two selections drifted apart, CI would run some
tests twice or, worse, none of them at all.  Two collections (no test
runs) of a few files that hold every kind: files inside the sanitizer's
paths (named, and under a named folder), tests it leaves to ``make test``
(``process_bounds``), and a file outside its paths.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from ..support.harness import REPO_ROOT

FILES = [
    "tests/tools/test_hostile_checkpoints.py",  # named; holds process_bounds tests
    "tests/tools/test_convert.py",
    "tests/core/test_reshard_plan.py",  # under a named folder
    "tests/tools/test_gpu_check.py",  # outside the sanitizer's paths
]


def _env() -> dict[str, str]:
    # make's own variables, and CI's other split (DCP_OPTIM_TORCHRUN_PASSED
    # would leave out what passed under torchrun)
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "DCP_OPTIM_TORCHRUN_PASSED")
           and not k.startswith("DCP_OPTIM_SANITIZED")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _collect(args: list[str], env: dict[str, str]) -> tuple[set[str], int]:
    """The node ids a collection keeps, and how many it found in all."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", *args],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode in (0, 5), out.stdout[-2000:] + out.stderr[-2000:]  # 5: nothing kept
    kept = {line for line in out.stdout.splitlines() if "::" in line and not line.startswith(" ")}
    m = re.search(r"(\d+)/(\d+) tests collected|(\d+) tests? collected", out.stdout)
    assert m is not None, out.stdout[-2000:]
    total = int(m.group(2) or m.group(3))
    return kept, total


def test_make_test_leaves_out_exactly_what_the_sanitizer_makes():
    env = _env()
    selection = subprocess.run(["make", "-s", "--no-print-directory", "asan-selection"], cwd=REPO_ROOT, env=env,
                               capture_output=True, text=True, check=True, timeout=120).stdout.strip()
    paths, left_out, mark = (part.strip() for part in selection.split("|"))
    assert paths and left_out and mark

    # what the sanitizer's run makes: its -m expression over its own paths
    inside = [f for f in FILES if any(f == p or f.startswith(p + "/") for p in paths.split())]
    assert 0 < len(inside) < len(FILES)
    sanitized, _ = _collect(["-m", mark, *inside], env)
    # what make test keeps of the same files under TEST_SPLIT
    split_env = dict(env, DCP_OPTIM_SANITIZED_TESTS=paths, DCP_OPTIM_SANITIZED_LEFT_OUT=left_out)
    kept, total = _collect(FILES, split_env)

    assert sanitized, "the sanitizer would make none of these files' tests"
    assert kept.isdisjoint(sanitized), f"run twice: {sorted(kept & sanitized)[:5]}"
    assert len(kept) + len(sanitized) == total, "tests that neither run makes"
    # the hostile tests that time fresh processes (process_bounds) stay
    assert any(k.startswith("tests/tools/test_hostile_checkpoints.py") for k in kept)
    assert any(k.startswith("tests/tools/test_gpu_check.py") for k in kept)
