"""dcp_optim.testing: the cross-rank helpers (a world of 2 spawned ranks
in ``make test``; torchrun's 2 and 4 processes in ``make test-torchrun``)
and the fallback to one process without torchrun."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dcp_optim import testing

from ..support.harness import run_ranks, under_torchrun
from . import dist_cases_testing as cases


def _world_size() -> int:
    """torchrun's world size under torchrun, else 2 spawned ranks."""
    return dist.get_world_size() if under_torchrun() else 2


@pytest.fixture(scope="module")
def helpers(tmp_path_factory):
    ws = _world_size()
    ckpt = str(tmp_path_factory.mktemp("round_trip"))
    return ws, run_ranks(ws, cases.helpers_case, ckpt, timeout=300)


@pytest.mark.dist
def test_gather_and_assert_all_ranks(helpers):
    ws, results = helpers
    for r in results:
        assert r["gathered"] == [10 * i for i in range(ws)]
        failure = r["assert_all_ranks"]
        # every rank raised, naming the one rank whose check failed
        assert failure["type"] == "RankFailure" and failure["ranks"] == [ws - 1]
        assert f"rank {ws - 1}: local value {10 * (ws - 1)}" in failure["message"]
        block = r["on_all_ranks"]
        assert block["type"] == "RankFailure" and block["ranks"] == [0]
        assert "--- rank 0 ---" in block["message"]
        assert "ValueError: only rank 0 objects" in block["message"]


@pytest.mark.dist
def test_state_dicts_compared_as_full_tensors(helpers):
    ws, results = helpers
    for r in results:
        assert r["sharded_vs_full"] == {"type": None}
        one = r["one_element"]
        assert one["type"] == "RankFailure", one
        # seen on every rank (full tensors), the shard is the last rank's
        assert one["message"].startswith("state dicts differ at 'layers.1.up.weight': ")
        assert "at index (7, 2)" in one["message"]
        assert f"seen on rank(s) {list(range(ws))}" in one["message"]
        assert f"the actual shard holding it is on rank(s) [{ws - 1}]" in one["message"]
        plain = r["one_rank"]
        assert plain["type"] == "RankFailure" and plain["ranks"] == [ws - 1]
        assert plain["message"].startswith("state dicts differ at 'b.c': values differ at index (0,)")
        assert r["missing_key"]["message"] == (
            f"state dicts differ: key 'b' is in actual but not in expected (rank(s) {list(range(ws))})"
        )
        assert "dtype torch.float32 != torch.float64" in r["dtype"]["message"]


@pytest.mark.dist
def test_save_resume_round_trip(helpers):
    _, results = helpers
    for r in results:
        assert r["round_trip"] is True
        detects = r["round_trip_detects"]
        assert detects["type"] == "RankFailure"
        assert "state dicts differ at '1.state.layers.0.up.weight.step'" in detects["message"], detects


def test_helpers_without_a_process_group():
    assert not dist.is_initialized()
    assert testing.gather_objects("x") == ["x"]
    testing.assert_state_dicts_equal({"w": torch.ones(2)}, {"w": torch.ones(2)})
    with pytest.raises(testing.RankFailure, match=r"differ at 'w': max abs difference 1 at index \(1,\)"):
        testing.assert_state_dicts_equal({"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([1.0, 1.0])})


def test_dist_group_fixture_falls_back_to_one_process(dist_group, dist_tmp_path):
    assert dist.get_world_size(dist_group) == 1 and dist_tmp_path.is_dir()
    with pytest.raises(testing.RankFailure, match=r"rank\(s\) \[0\] of 1:\n  rank 0: nope"):
        testing.assert_all_ranks(False, "nope")
