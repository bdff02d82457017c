"""Issue 3's corrections on an FSDP2 model (2 gloo ranks, uneven shards),
nested and flattened format: dcp_optim passes every scenario; upstream's
known failures are asserted as in tests/unit/test_deviations.py (strict: if
upstream is fixed, the expectation here has to change).  The scenarios are
in tests/distributed/dist_cases_deviations.py, all in one launch."""

from __future__ import annotations

import pytest

from ..support.harness import run_ranks
from . import dist_cases_deviations as cases

pytestmark = pytest.mark.dist

# scenario -> the upstream issue its upstream failure shows (None: upstream
# is right there too, in that format)
UPSTREAM_FAILS = {
    "getters_change_nothing[nested]": "fake optimizer.step() in the getter: pytorch/pytorch#164929",
    "getters_change_nothing[flat]": "fake optimizer.step() in the getter: pytorch/pytorch#164929",
    "never_stepped_round_trip[nested]": "template has step 1: resumed bias correction differs",
    "never_stepped_round_trip[flat]": "template has step 1: resumed bias correction differs",
    "state_after_backward[nested]": "no state when .grad is set: pytorch/pytorch#140898",
    "state_after_backward[flat]": "no state when .grad is set: pytorch/pytorch#140898",
    "partial_load[nested]": None,
    "partial_load[flat]": "TypeError from {} placeholders: pytorch/pytorch#192224",
    "trained_then_frozen[nested]": "frozen parameters' saved state dropped: pytorch/pytorch#192202",
    "trained_then_frozen[flat]": "frozen parameters' saved state dropped: pytorch/pytorch#192202",
    "empty_groups_and_keys[nested]": "two empty groups: pytorch/pytorch#143828",
    "empty_groups_and_keys[flat]": "empty groups in the flat format: pytorch/pytorch#143828",
    "low_precision_state[nested]": "state cast to the parameter dtype (D9; pytorch/pytorch#126950)",
    "low_precision_state[flat]": "state cast to the parameter dtype (D9; pytorch/pytorch#126950)",
    "failed_load_changes_nothing[nested]": "a wrong-shaped state is installed before the error",
    "failed_load_changes_nothing[flat]": None,
    "broadcast_non_contiguous_model[nested]": "a non-contiguous full tensor broadcast in its storage order (D33)",
    "broadcast_non_contiguous_model[flat]": "a non-contiguous full tensor broadcast in its storage order (D33)",
    "broadcast_strided_bias[nested]": "a non-contiguous full tensor broadcast in its storage order (D33)",
    "broadcast_strided_bias[flat]": "a non-contiguous full tensor broadcast in its storage order (D33)",
    "broadcast_channels_last[nested]": "a non-contiguous full tensor broadcast in its storage order (D33)",
    "broadcast_channels_last[flat]": "a non-contiguous full tensor broadcast in its storage order (D33)",
    "broadcast_non_contiguous_optim[nested]": "a non-contiguous full tensor broadcast in its storage order (D33)",
    "broadcast_non_contiguous_optim[flat]": "KeyError from a flattened local template (D34)",
    "full_optim_load[nested]": None,
    "full_optim_load[flat]": "KeyError from a flattened local template (D34)",
    "full_load_unshardable_state[nested]": "a full tensor not shaped like its parameter stays plain: the next "
                                           "step mixes it with DTensors",
    "full_load_unshardable_state[flat]": "a full tensor not shaped like its parameter stays plain: the next "
                                         "step mixes it with DTensors",
    "whole_state_beside_dtensors[nested]": None,
    "whole_state_beside_dtensors[flat]": None,
}


@pytest.fixture(scope="module")
def outcomes():
    results = run_ranks(2, cases.deviations_fsdp2, timeout=600)
    assert sorted(results[0]) == sorted(UPSTREAM_FAILS)
    return results


@pytest.mark.parametrize("scenario", list(UPSTREAM_FAILS))
def test_dcp_optim_is_right(outcomes, scenario):
    for rank, r in enumerate(outcomes):
        assert r[scenario]["dcp_optim"] == "ok", (rank, r[scenario]["dcp_optim"])


@pytest.mark.parametrize("scenario", [s for s, why in UPSTREAM_FAILS.items() if why])
def test_upstream_fails_as_recorded(outcomes, scenario):
    assert all(r[scenario]["upstream"] != "ok" for r in outcomes), UPSTREAM_FAILS[scenario]
