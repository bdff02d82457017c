"""Full gets and loads of float8 DTensors on gloo
(tests/distributed/dist_cases_dtypes.py): upstream's collectives of the
tensor's own dtype raise "Invalid scalar type"; dcp_optim's move bytes
and give the source's values (D39)."""

from __future__ import annotations

import pytest

from ..support.harness import run_ranks
from . import dist_cases_dtypes as cases

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("ws", [2, 3])
def test_float8_dtypes_on_gloo(ws):
    results = run_ranks(ws, cases.gloo_dtypes_case, timeout=180)
    expected = ["upstream get: Invalid scalar type", "get: the shards",
                "load (broadcast=False): the source's shards", "load (broadcast=True): the source's shards"]
    assert all(r == expected for r in results), results
