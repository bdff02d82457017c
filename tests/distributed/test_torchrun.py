"""Launches of torchrun itself (``make test-torchrun``; opt-in marker
``torchrun``): the dcp_optim.testing plugin fails a test that fails or hangs
on one rank, on every rank, naming that rank; the demo runs under torchrun
and resumes at another world size; ``python -m dcp_optim.demo`` prints
nothing but the demo."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.torchrun

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A user's suite: docs/pytest-plugin.md's conftest.py and checks that pass, fail or
# hang on one rank.
CONFTEST = 'pytest_plugins = ["dcp_optim.testing"]\n'
CASES = textwrap.dedent(
    '''
    import time

    import pytest
    import torch
    import torch.distributed as dist

    from dcp_optim.testing import assert_all_ranks


    def test_passes(dist_group):
        assert_all_ranks(dist.get_world_size() == 2, "world size")


    def test_fails_on_rank_1():
        assert dist.get_rank() != 1, "deliberately false on rank 1"


    @pytest.mark.timeout(8)
    def test_hangs_on_rank_1():
        if dist.get_rank() == 1:
            time.sleep(600)


    def test_collectives_still_paired():
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 2


    def test_collective_hangs_on_rank_0():
        if dist.get_rank() == 0:
            dist.barrier()  # rank 1 never joins
    '''
)


# The project's own harness under torchrun: a rank function failing on
# rank 1 while rank 0 waits in a barrier rank 1 never joins.
HARNESS_CASES = textwrap.dedent(
    '''
    from tests.distributed import dist_cases_canary as cases
    from tests.support.harness import run_ranks


    def test_run_ranks_fails_on_rank_1():
        run_ranks(2, cases.fail_on_rank, 1)


    def test_never_reached():
        pass
    '''
)


# A test timing out on rank 0 (in Python) while rank 1 waits in a
# collective rank 0 never joins (issue 24: the harness fails fast).
TIMEOUT_CASES = textwrap.dedent(
    '''
    import time

    import torch.distributed as dist


    def test_times_out_on_rank_0_while_rank_1_waits_in_a_collective():
        if dist.get_rank() == 0:
            time.sleep(600)
        else:
            dist.barrier()


    def test_never_reached():
        pass
    '''
)


# Rank 1 has no pytest-timeout timer of its own: what ends its wait in
# the barrier shows in its failure (the abort: the connection closed; the
# group's timeout: "Timed out waiting 120000ms").
TIMEOUT_CONFTEST = textwrap.dedent(
    '''
    import os

    import pytest


    def pytest_collection_modifyitems(items):
        if os.environ.get("RANK") != "0":
            for item in items:
                item.add_marker(pytest.mark.timeout(0))
    '''
)


def _documented_example() -> tuple[str, str]:
    """The example ``conftest.py`` and test file of docs/pytest-plugin.md."""
    with open(os.path.join(REPO, "docs", "pytest-plugin.md")) as f:
        text = f.read()
    blocks = re.findall(r"```python\n(# conftest\.py\n.*?)```\n+```python\n(# test_checkpoint\.py\n.*?)```", text, re.S)
    assert len(blocks) == 1, "docs/pytest-plugin.md: the conftest.py / test_checkpoint.py example is missing"
    return blocks[0]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", COLUMNS="240")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    env.pop("PYTEST_ADDOPTS", None)
    return env


def _torchrun(nproc: int, *args: str, cwd: str, timeout: float, logs=None):
    """(exit status, output, seconds); with ``logs`` (a directory) each
    rank's stdout goes to its own file there, returned as a list."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    if logs is not None:
        cmd += ["--redirects", "3", "--log-dir", str(logs)]
    start = time.monotonic()
    proc = subprocess.run(
        [*cmd, *args], cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=timeout,
    )
    elapsed = time.monotonic() - start
    if logs is None:
        return proc.returncode, proc.stdout, elapsed
    ranks = []
    for rank in range(nproc):
        (path,) = glob.glob(os.path.join(str(logs), "**", str(rank), "stdout.log"), recursive=True)
        with open(path) as f:
            ranks.append(f.read())
    return proc.returncode, ranks, elapsed


def test_failing_and_hanging_ranks_fail_the_run_naming_the_rank(tmp_path):
    """The documented example suite passes; checks failing or hanging on one
    rank fail on every rank, naming it; the hangs end at the timeouts."""
    conftest, example = _documented_example()
    assert conftest.strip().endswith(CONFTEST.strip())
    (tmp_path / "conftest.py").write_text(conftest)
    (tmp_path / "test_checkpoint.py").write_text(example)
    (tmp_path / "test_cases.py").write_text(CASES)
    rc, ranks, elapsed = _torchrun(
        2, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", "--timeout", "120",
        "--dist-pg-timeout", "5", "--dist-keep-going", "test_checkpoint.py", "test_cases.py",
        cwd=str(tmp_path), timeout=240, logs=tmp_path / "logs",
    )
    assert rc != 0, ranks
    # every rank reports the same consolidated verdicts
    for out in ranks:
        for line in (
            "PASSED test_checkpoint.py::test_resume_continues_exactly",
            "PASSED test_checkpoint.py::test_sharded_equals_full",
            "PASSED test_cases.py::test_passes",
            "FAILED test_cases.py::test_fails_on_rank_1 - rank(s) [1]: AssertionError: "
            "deliberately false on rank 1",
            "FAILED test_cases.py::test_hangs_on_rank_1 - rank(s) [1]: Failed: Timeout (>8.0s)",
            "PASSED test_cases.py::test_collectives_still_paired",
            "FAILED test_cases.py::test_collective_hangs_on_rank_0 - rank(s) [0]: RuntimeError: ",
        ):
            assert line in out, (line, out)
        assert out.count("call failed on rank(s) [1] of 2 (rank 0 passed)") == 2, out
        assert "Timed out waiting 5000ms" in out, out
        assert "3 failed, 4 passed" in out, out
    # the hangs were ended by the hanging test's own timeout (8 s; the
    # others get 120 s, as the example's checks can take longer than 8 s on
    # a loaded machine) and the group's (5 s):
    # the consolidated Timeout/"Timed out" verdicts above say so (no
    # wall-clock bound: _torchrun's own limit ends a real hang)


def test_run_ranks_failure_names_the_rank_and_stops_the_session(tmp_path):
    """tests.support.harness.run_ranks under torchrun: rank 1's error and rank 0's
    group timeout in one report on every rank; the group is out of step
    after it, so the session stops."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_harness_cases.py").write_text(HARNESS_CASES)
    rc, ranks, _ = _torchrun(
        2, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", "--timeout", "30",
        "--dist-pg-timeout", "5", "test_harness_cases.py",
        cwd=str(tmp_path), timeout=240, logs=tmp_path / "logs",
    )
    assert rc != 0, ranks
    for out in ranks:
        assert (
            "FAILED test_harness_cases.py::test_run_ranks_fails_on_rank_1 - rank(s) [0, 1]: "
            "dcp_optim.testing.RankFailure: run_ranks(2, tests.distributed.dist_cases_canary.fail_on_rank): "
            "2 of 2 rank(s) failed"
        ) in out, out
        assert "--- rank 1: raised ---" in out and "ValueError: deliberate failure on rank 1" in out, out
        assert "--- rank 0: raised ---" in out and "Timed out waiting 5000ms" in out, out
        assert (
            "Interrupted: dcp_optim.testing: test_harness_cases.py::test_run_ranks_fails_on_rank_1 "
            "failed on rank(s) [0, 1] of 2 after a timeout; the ranks' collectives may be out of step"
        ) in out, out
        assert "1 failed in" in out and "test_never_reached" not in out, out


def test_a_timeout_on_one_rank_fails_every_rank_at_once(tmp_path):
    """pytest-timeout fires on rank 0 (5 s) while rank 1 (no timer) is
    blocked in a barrier; the group's timeout is 120 s.  Rank 0 aborts the process
    group, so rank 1's barrier fails at once (gloo: the connection
    closed), not at the group's timeout; the report names rank 0 as the
    rank that timed out first, and the session stops."""
    (tmp_path / "conftest.py").write_text(CONFTEST + TIMEOUT_CONFTEST)
    (tmp_path / "test_timeout_cases.py").write_text(TIMEOUT_CASES)
    rc, ranks, _ = _torchrun(
        2, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", "--timeout", "5",
        "--dist-pg-timeout", "120", "--dist-keep-going", "test_timeout_cases.py",
        cwd=str(tmp_path), timeout=240, logs=tmp_path / "logs",
    )
    assert rc != 0, ranks
    for out in ranks:
        assert (
            "FAILED test_timeout_cases.py::test_times_out_on_rank_0_while_rank_1_waits_in_a_collective"
            " - rank 0 timed out first: Failed: Timeout (>5.0s)"
        ) in out, out
        assert "call failed on rank(s) [0, 1] of 2; rank 0 timed out first" in out, out
        # rank 1 failed because the group was aborted, not at its timeout
        assert "Connection closed by peer" in out or "Connection reset by peer" in out, out
        assert "Timed out waiting 120000ms" not in out, out
        assert "the process group was aborted so that its peers failed at once, stopping" in out, out
        assert "test_never_reached" not in out, out


def test_demo_under_torchrun_resumes_at_another_world_size(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    rc, out, _ = _torchrun(
        2, "-m", "dcp_optim.demo", "train", "--steps", "4", "--save-at", "2", "--dir", ckpt,
        cwd=REPO, timeout=300,
    )
    assert rc == 0, out
    assert "train on 2 process(es) (FSDP2)" in out and "saved a checkpoint after step 2" in out
    rc, out, _ = _torchrun(3, "-m", "dcp_optim.demo", "resume", "--dir", ckpt, cwd=REPO, timeout=300)
    assert rc == 0, out
    assert "resume on 3 process(es) (FSDP2) from the step-2 checkpoint of a run on 2" in out
    assert "resumed losses are bit-identical to the uninterrupted run at world size 3" in out
    assert "Warning" not in out, out


def test_demo_output_is_clean(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "dcp_optim.demo", "--steps", "2", "--save-at", "1",
         "--dir", str(tmp_path / "ckpt")],
        cwd=REPO, env=_env(), capture_output=True, text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bit-identical to the uninterrupted run at every world size" in proc.stdout
    # no RuntimeWarning from runpy (or anything else) in any worker
    assert proc.stderr == "", proc.stderr
