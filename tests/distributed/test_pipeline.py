"""Pipeline parallelism (MPMD): stage modules keeping the full model's FQNs,
one optimizer per stage, flattened state dicts saved at one stage layout
and loaded at another (tests/distributed/dist_cases_pp.py explains the simulation)."""

from __future__ import annotations

import pytest

from ..support.harness import run_ranks
from . import dist_cases_pp as pp

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def two_stage_checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("pp_2x1"))
    results = run_ranks(2, pp.save, path, "2x1")
    for r in results:
        assert r["compared"] > 0
    # rank 1's last stage has an empty "frozen" group (its reserved keys
    # aside, both stages' dicts equal upstream's)
    assert [r["empty_groups"] for r in results] == [0, 1]
    assert [r["upstream_equal"] for r in results] == [1, 1]
    return path


def test_two_stages_to_one_stage(two_stage_checkpoint):
    (r,) = run_ranks(1, pp.load, two_stage_checkpoint, "1x1")
    assert r["compared"] > 0


def test_two_stages_to_four_interleaved(two_stage_checkpoint):
    results = run_ranks(2, pp.load, two_stage_checkpoint, "4i2")
    assert all(r["compared"] > 0 for r in results)
    # stages 0-2 have an empty "frozen" group here but not (or elsewhere)
    # in the saved layout: their reserved keys were not in the checkpoint
    assert results[0]["skipped"] and all(".__empty_group_" in k for k in results[0]["skipped"])


@pytest.mark.slow
def test_two_stages_to_pp_by_dp(two_stage_checkpoint):
    results = run_ranks(4, pp.load, two_stage_checkpoint, "2x2dp", timeout=300)
    assert all(r["compared"] > 0 for r in results)


def test_interleaved_to_two_stages(tmp_path):
    path = str(tmp_path / "pp_4i2")
    run_ranks(2, pp.save, path, "4i2")
    results = run_ranks(2, pp.load, path, "2x1")
    assert all(r["compared"] > 0 for r in results)


# --- the planner on its own (one process, no process group) --------------------


def _save(path, state):
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=path, no_dist=True)


def _load(path, state, planner):
    import torch.distributed.checkpoint as dcp

    dcp.load(state, checkpoint_id=path, planner=planner, no_dist=True)


from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402  (a BaseException)


def _failure_text(exc: BaseException) -> str:
    """DCP wraps a rank's error in CheckpointException(failures={rank: exc})."""
    failures = getattr(exc, "failures", None)
    return " ".join(str(e) for e in failures.values()) if failures else str(exc)


@pytest.mark.local
def test_planner_skips_only_missing_empty_group_keys(tmp_path):
    import torch

    import dcp_optim

    path = str(tmp_path / "ckpt")
    _save(path, {"optim": {"state.w.exp_avg": torch.ones(3), "param_groups.w.lr": 0.5}})
    reserved = "param_groups.w.__empty_group_after_1__.lr"
    template = {"optim": {"state.w.exp_avg": torch.zeros(3), "param_groups.w.lr": 0.1, reserved: 0.25}}
    planner = dcp_optim.LoadPlanner()
    _load(path, template, planner)
    assert torch.equal(template["optim"]["state.w.exp_avg"], torch.ones(3))
    assert template["optim"]["param_groups.w.lr"] == 0.5
    assert template["optim"][reserved] == 0.25  # kept: nothing to load
    assert planner.skipped_empty_group_keys == [f"optim.{reserved}"]
    # DCP's own planner fails on the same template
    from torch.distributed.checkpoint import DefaultLoadPlanner

    with pytest.raises(CheckpointException) as info:
        _load(path, dict(template), DefaultLoadPlanner())
    assert "Missing key" in _failure_text(info.value)
    # any other missing key still fails
    bad = {"optim": {"state.w.exp_avg": torch.zeros(3), "state.w.exp_avg_sq": torch.zeros(3)}}
    with pytest.raises(CheckpointException) as info:
        _load(path, bad, dcp_optim.LoadPlanner())
    assert "Missing key in checkpoint state_dict: optim.state.w.exp_avg_sq" in _failure_text(info.value)


@pytest.mark.local
def test_planner_without_flattening_leaves_the_callers_dict(tmp_path):
    import torch

    import dcp_optim

    path = str(tmp_path / "ckpt")
    _save(path, {"param_groups.w.lr": 0.5, "w": torch.ones(2)})
    reserved = "param_groups.__optimizer_0_empty_group_1__.lr"
    template = {"param_groups.w.lr": 0.1, "w": torch.zeros(2), reserved: 0.25}
    _load(path, template, dcp_optim.LoadPlanner(flatten_state_dict=False))
    # every key is still there (DCP itself does not write non-tensor values
    # back without flattening, with or without this planner)
    assert list(template) == ["param_groups.w.lr", "w", reserved]
    assert template[reserved] == 0.25
    assert torch.equal(template["w"], torch.ones(2))


@pytest.mark.local
@pytest.mark.parametrize(
    "key, reserved",
    [
        ("optim.param_groups.layers.0.w.__empty_group_after_2__.lr", True),
        ("param_groups.emb.__empty_group_before_1__.betas", True),
        ("param_groups.__optimizer_3_empty_group_0__.lr", True),
        ("optim.param_groups.layers.0.w.lr", False),
        ("optim.state.__empty_group_after_2__.exp_avg", False),
        ("model.__empty_group_after_2__.weight", False),
    ],
)
def test_reserved_key_recognition(key, reserved):
    from dcp_optim.tools.planner import is_empty_group_key

    assert is_empty_group_key(key) is reserved
