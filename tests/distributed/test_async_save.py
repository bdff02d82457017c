"""``dcp.async_save`` through a ``Stateful`` wrapper of dcp_optim's
getters and setters (torchtitan's flow), over a gloo group of its own
while training goes on (tests/distributed/dist_cases.py)."""

from __future__ import annotations

import pytest

from ..support.harness import run_ranks
from . import dist_cases

pytestmark = pytest.mark.dist


def test_async_save_resumes(tmp_path):
    results = run_ranks(2, dist_cases.async_save_case, str(tmp_path), timeout=300)
    assert results == ["resumed", "resumed"]
