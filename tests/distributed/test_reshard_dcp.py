"""Resharding through DCP: save with dcp_optim at one parallel layout, load
with the template flow at another; every full parameter and optimizer
state tensor equals the saved run's, and training continues."""

from __future__ import annotations

import pytest

from ..support.harness import run_ranks
from . import dist_cases

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def fsdp2_checkpoints(tmp_path_factory):
    paths = {}
    for flatten in (False, True):
        path = str(tmp_path_factory.mktemp(f"fsdp2_ws2_flat{int(flatten)}"))
        run_ranks(2, dist_cases.dcp_save, path, "fsdp2", flatten)
        paths[flatten] = path
    return paths


@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flat"])
def test_fsdp2_ws2_to_plain_ws1(fsdp2_checkpoints, flatten):
    results = run_ranks(1, dist_cases.dcp_load, fsdp2_checkpoints[flatten], "plain", flatten)
    assert results[0]["tensors"] > 0


@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flat"])
def test_fsdp2_ws2_to_fsdp2_ws3_uneven(fsdp2_checkpoints, flatten):
    results = run_ranks(3, dist_cases.dcp_load, fsdp2_checkpoints[flatten], "fsdp2", flatten)
    assert results[0]["tensors"] > 0
    if not flatten:  # the full-gather layouts at 3 ranks, exact against upstream
        assert results[0]["gathers"] == ["10 layouts"] + [
            f"offload={o} bucket={b}" for o in (False, True) for b in (None, 1)
        ]
        assert results[1]["gathers"] == results[2]["gathers"] == results[0]["gathers"][:3]


@pytest.mark.slow
def test_fsdp2_ws2_to_2d_ws4(fsdp2_checkpoints):
    results = run_ranks(4, dist_cases.dcp_load, fsdp2_checkpoints[False], "fsdp_tp", False, timeout=300)
    assert results[0]["tensors"] > 0


def test_fsdp2_to_tp(fsdp2_checkpoints):
    results = run_ranks(2, dist_cases.dcp_load, fsdp2_checkpoints[False], "tp", False)
    assert results[0]["tensors"] > 0


def test_tp_to_fsdp2(tmp_path):
    path = str(tmp_path / "tp")
    run_ranks(2, dist_cases.dcp_save, path, "tp", False)
    results = run_ranks(2, dist_cases.dcp_load, path, "fsdp2", False)
    assert results[0]["tensors"] > 0
