"""Full loads of values in any memory layout (tests/distributed/dist_cases_layouts.py):
every rank holds the source's values after the load, whatever the
strides of the full tensors and whichever path of the stream carries
them."""

from __future__ import annotations

import pytest

from ..support.harness import run_ranks
from . import dist_cases_layouts

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("ws", [3, 4])
def test_full_loads_of_any_layout_hold_the_values(ws):
    seeds = list(range(100 * ws, 100 * ws + 12))
    results = run_ranks(ws, dist_cases_layouts.layouts_case, seeds, timeout=300)
    assert len(results[0]) == len(seeds) and all(r == results[0] for r in results), results
    # the sweep reaches complex values (conjugate views among the layouts)
    assert any("(0 complex)" not in d for d in results[0]), results[0]
