"""DTensors over wrapper subclasses that keep their values in no single
byte buffer (tests/distributed/dist_cases_wrappers.py): full gets and
full loads equal upstream's, a broadcast that must stream is refused on
every rank with nothing changed."""

from __future__ import annotations

import pytest

from ..support.harness import run_ranks
from . import dist_cases_wrappers as cases

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("ws", [2, 3])
def test_opaque_wrapper_subclasses(ws):
    results = run_ranks(ws, cases.wrapper_case, timeout=300)
    expected = ["one collective at a time"]
    expected += [f"{get}(offload={off})" for off in (False, True)
                for get in ("get_model_state_dict", "get_optimizer_state_dict")]
    expected += ["full loads", "stream refused"]
    assert all(r == expected for r in results), results


def test_nf4_full_get_names_the_parameter():
    """torchao's NF4Tensor (QLoRA's base weights) under FSDP2: a full get
    fails as upstream's does (the subclass has no all-gather), on every
    rank, naming the parameter."""
    pytest.importorskip("torchao")
    results = run_ranks(2, cases.nf4_case, timeout=300)
    assert all(r == ["upstream: NotImplementedError", "dcp_optim: NotImplementedError"] for r in results), results
