"""Test configuration: environment for gloo workers, shared fixtures.

Under ``torchrun`` (``make test-torchrun``) every rank runs the same tests:
``dcp_optim.testing`` initialises the process group from torchrun's
environment and consolidates each test's verdict across ranks,
``tests.support.harness.run_ranks`` runs rank functions in-process, and
``tmp_path`` / ``tmp_path_factory`` give every rank the same directory.
"""

from __future__ import annotations

import os

# Before torch is imported anywhere (docs/testing.md, "The multi-process harness").
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import pytest  # noqa: E402

# The plugin below is imported here first: let pytest rewrite it anyway.
pytest.register_assert_rewrite("dcp_optim.testing")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dcp_optim.testing import launched_by_torchrun  # noqa: E402

torch.set_num_threads(1)

pytest_plugins = ["dcp_optim.testing"]

TORCHRUN = launched_by_torchrun()


if TORCHRUN:
    # Checkpoints written by all ranks go to one directory: rank 0 creates
    # it and every rank gets its path.

    @pytest.fixture(scope="session")
    def tmp_path_factory(dist_tmp_path_factory):
        return dist_tmp_path_factory

    @pytest.fixture
    def tmp_path(dist_tmp_path):
        return dist_tmp_path


# CI's split (.ci/run, TEST_SPLIT=1): `make test-torchrun` runs before
# `make test` and records, in the file this variable names, every test
# that passed whole under torchrun (rank 0 reports the verdict of every
# rank); `make test` then leaves those out, since their bodies ran, with
# the same assertions, on torchrun's process group.  A test that skips
# under torchrun (it also needs another world size) is not recorded and
# runs in `make test`.  Without the variable nothing is recorded or left
# out (a plain `make test` runs everything).
TORCHRUN_PASSED = os.environ.get("DCP_OPTIM_TORCHRUN_PASSED")


def pytest_runtest_logreport(report):
    if TORCHRUN and TORCHRUN_PASSED and report.when == "call" and report.passed and \
            os.environ.get("RANK") == "0":
        with open(TORCHRUN_PASSED, "a") as f:
            f.write(report.nodeid + "\n")


# CI's split, second part: `make test` also leaves out the tests that the
# sanitizer's run (make test-asan-suite and test-asan-hostile, in the same CI
# run) makes on the ASan+UBSan build of the core: those under the paths
# in DCP_OPTIM_SANITIZED_TESTS that carry none of the markers in
# DCP_OPTIM_SANITIZED_LEFT_OUT (the Makefile's ASAN_TESTS and ASAN_LEFT_OUT,
# from which it builds the sanitizer's -m expression).
# Taken out of the environment: the pytest runs that tests start themselves
# (tools/gpu-check.sh's, tests/tools/test_ci_split.py's) select their own.
SANITIZED_TESTS = os.environ.pop("DCP_OPTIM_SANITIZED_TESTS", "").split()
SANITIZED_LEFT_OUT = os.environ.pop("DCP_OPTIM_SANITIZED_LEFT_OUT", "").split()


def _sanitizer_runs(item) -> bool:
    path = item.nodeid.split("::", 1)[0]
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in SANITIZED_TESTS) and \
        not any(item.get_closest_marker(m) is not None for m in SANITIZED_LEFT_OUT)


def _passed_under_torchrun() -> set[str]:
    if TORCHRUN or not TORCHRUN_PASSED or not os.path.exists(TORCHRUN_PASSED):
        return set()
    with open(TORCHRUN_PASSED) as f:
        return {line.strip() for line in f if line.strip()}


def _runs_on_ranks(item) -> bool:
    """Whether a test runs rank functions (``tests.support.harness.run_ranks``),
    by its markers: ``dist`` (the module's or its own), and not ``local``
    (a single-process test in a module of dist tests)."""
    return item.get_closest_marker("dist") is not None and item.get_closest_marker("local") is None


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "torchrun: launches torchrun itself (make test-torchrun); runs only when "
        "selected with -m torchrun",
    )


def pytest_collection_modifyitems(config, items):
    """Tests marked ``torchrun`` (they launch torchrun, tens of seconds
    each) run only when ``-m`` names them.  Under torchrun only the
    distributed test bodies run (tests calling ``run_ranks``, directly or
    through a fixture; marked ``dist``): a single-process test would find torchrun's process
    group and act collectively (DCP does), and it runs in ``make test``.
    Selected by marker (``dist`` and not ``local``), never by reading the
    tests' source.  CI's ``make test`` leaves out what passed under
    torchrun (``TORCHRUN_PASSED``) and what the sanitizer runs
    (``SANITIZED_TESTS``)."""
    keep, drop = [], []
    opted_in = "torchrun" in (config.option.markexpr or "")
    ran = _passed_under_torchrun()
    sanitized = 0
    for item in items:
        if item.get_closest_marker("torchrun") is not None:
            ok = opted_in and not TORCHRUN
        else:
            ok = (not TORCHRUN or _runs_on_ranks(item)) and item.nodeid not in ran
        if ok and SANITIZED_TESTS and _sanitizer_runs(item):
            ok = False
            sanitized += 1
        (keep if ok else drop).append(item)
    if ran:
        print(f"\n{sum(item.nodeid in ran for item in items)} tests left out: they passed under torchrun "
              f"({TORCHRUN_PASSED})")
    if SANITIZED_TESTS:
        print(f"\n{sanitized} tests left out: the sanitizer's run makes them ({' '.join(SANITIZED_TESTS)}, "
              f"less the markers {' '.join(SANITIZED_LEFT_OUT) or '(none)'})")
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture
def world1(tmp_path):
    """A world-size-1 gloo process group in this process (DDP of one rank,
    trivial full/broadcast paths); destroyed after the test."""
    if TORCHRUN:
        pytest.skip("needs a one-process default group; under torchrun it is torchrun's")
    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def pytest_terminal_summary(terminalreporter):
    """The optimizer corpus' count of what ran (tests/unit/test_optim_corpus.py)."""
    import sys

    corpus = sys.modules.get("tests.unit.test_optim_corpus")
    for line in corpus.corpus_summary() if corpus else []:
        terminalreporter.write_line(line)
    matrix = sys.modules.get("tests.distributed.test_resume_matrix")
    for line in matrix.matrix_summary() if matrix else []:
        terminalreporter.write_line(line)
