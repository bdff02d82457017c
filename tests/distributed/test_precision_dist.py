"""Precision-changing resumes on every distributed load path (FSDP2, 2 gloo
ranks): float64/bf16 moments into a never-stepped AdamW over float32
parameters load with torch's cast, in both formats, and the next step
equals upstream's (torch's ``load_state_dict``) bit for bit.  The
scenarios are in tests/distributed/dist_cases_precision.py, all in one launch."""

from __future__ import annotations

import pytest

from ..support.harness import run_ranks
from . import dist_cases_precision as cases

pytestmark = pytest.mark.dist

SCENARIOS = [
    f"{path}[{fmt}-{dtype}]"
    for path in cases.PATHS
    for fmt in ("nested", "flat")
    for dtype in ("float64", "bfloat16")
]


@pytest.fixture(scope="module")
def outcomes():
    results = run_ranks(2, cases.precision_fsdp2, timeout=300)
    assert sorted(results[0]) == sorted([*SCENARIOS, "schema_less_fsdp2", "extras_broadcast"])
    return results


def test_schema_less_optimizer_on_fsdp2(outcomes):
    """The shadow-step fallback over DTensor parameters: template placed
    like the parameters, from their values; the resume is exact."""
    for rank, r in enumerate(outcomes):
        assert r["schema_less_fsdp2"]["dcp_optim"] == "ok", (rank, r["schema_less_fsdp2"])


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_precision_resume(outcomes, scenario):
    for rank, r in enumerate(outcomes):
        assert r[scenario]["dcp_optim"] == "ok", (rank, r[scenario])


# upstream casts like torch wherever it loads at all; its flattened full and
# broadcast loads fail for other reasons (KeyError on 'param_groups...')
UPSTREAM_FAILS = {s for s in SCENARIOS if s.startswith(("full[flat", "broadcast[flat", "streamed[flat"))}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_upstream(outcomes, scenario):
    """Upstream beside ours: torch's result where it loads."""
    for r in outcomes:
        if scenario in UPSTREAM_FAILS:
            assert r[scenario]["upstream"].startswith("KeyError"), r[scenario]
        else:
            assert r[scenario]["upstream"] == "ok", r[scenario]


def test_extra_state_dict_keys_reach_every_rank(outcomes):
    """Top-level keys of an optimizer's own state_dict() (kept, unlike
    upstream) travel with a broadcast load to every rank."""
    for rank, r in enumerate(outcomes):
        assert r["extras_broadcast"]["dcp_optim"] == "ok", (rank, r["extras_broadcast"])
