"""D30: a sharded get raises RankLocalStateError on every rank when an
optimizer keeps a non-tensor value that differs between the ranks of the
mesh (dcp.save would store one rank's copy for all); torch.optim's dicts
stay equal to upstream's (scenarios: dist_cases_ranklocal.py)."""

from __future__ import annotations

import pytest

from ..support.harness import run_ranks
from . import dist_cases_ranklocal as cases

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def outcomes():
    return run_ranks(2, cases.rank_local_fsdp2, timeout=600)


@pytest.mark.parametrize("fmt", ["nested", "flat"])
def test_group_sum_raises_on_every_rank(outcomes, fmt):
    for out in outcomes:
        got = out[f"group_sum[{fmt}]"]
        assert got["raised"] == "RankLocalStateError", got
        assert got["key"] == "param_groups[0]['d']"
        assert sorted(r for rs in got["ranks"] for r in rs) == [0, 1]
        assert "dcp.save stores such a value (a plain tensor too) once" in got["text"]
        assert "DCP_OPTIM_RANK_LOCAL_CHECK=0" in got["text"]
    assert outcomes[0][f"group_sum[{fmt}]"] == outcomes[1][f"group_sum[{fmt}]"]
    # upstream returns each rank's own value, silently
    assert outcomes[0][f"upstream_d[{fmt}]"] != outcomes[1][f"upstream_d[{fmt}]"]


@pytest.mark.parametrize("fmt", ["nested", "flat"])
def test_state_object_raises(outcomes, fmt):
    for out in outcomes:
        got = out[f"object[{fmt}]"]
        assert got["raised"] == "RankLocalStateError", got
        assert got["key"].startswith("state.") and got["key"].endswith(".proj"), got


@pytest.mark.parametrize("fmt", ["nested", "flat"])
def test_small_plain_tensors_raise(outcomes, fmt):
    """Plain tensors (not DTensors) are stored once by DCP too: a group's
    1-element norm and a parameter's 0-dim scale computed from the local
    shards raise, naming them."""
    for out in outcomes:
        got = out[f"group_tensor[{fmt}]"]
        assert got["raised"] == "RankLocalStateError", got
        assert got["key"] == "param_groups[0]['norm']", got
        got = out[f"state_tensor[{fmt}]"]
        assert got["raised"] == "RankLocalStateError", got
        assert got["key"].startswith("state.") and got["key"].endswith(".scale"), got
    assert outcomes[0][f"state_tensor[{fmt}]"] == outcomes[1][f"state_tensor[{fmt}]"]


@pytest.mark.parametrize("fmt", ["nested", "flat"])
def test_torch_optim_unchanged(outcomes, fmt):
    for out in outcomes:
        assert out[f"adamw[{fmt}]"] == {"raised": None}


def test_switch_off(outcomes):
    for out in outcomes:
        assert out["off"] == {"raised": None}
        assert out["full off"] == {"raised": None}


def test_full_gets_raise(outcomes):
    """A full dict is saved once and loaded on every rank: upstream's holds
    rank 0's group sum, which rank 1 does not hold.  Ours raises on every
    rank, FSDP2 and FSDP1, with and without cpu_offload (which leaves
    ranks other than 0 with an empty dict: the check comes before)."""
    assert outcomes[0]["upstream full d"] == outcomes[0]["own d"] != outcomes[1]["own d"]
    labels = [f"fsdp2 full offload={o}" for o in (False, True)]
    labels += [f"fsdp1 orig={orig} full offload={o}" for orig in (False, True) for o in (False, True)]
    for label in labels:
        for out in outcomes:
            got = out[label]
            assert got["raised"] == "RankLocalStateError", (label, got)
            assert got["key"] == "param_groups[0]['d']", (label, got)
            assert "A full state dict holds rank 0's copy" in got["text"], got
        assert outcomes[0][label] == outcomes[1][label]
    for orig in (False, True):
        for out in outcomes:
            assert out[f"fsdp1 orig={orig} agreed"] == {"raised": None}
