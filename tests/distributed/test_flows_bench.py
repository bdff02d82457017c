"""Smoke test of section 9 of the benchmarks (``benchmarks/flows.py``): every
row of the real-flows section at the smallest settings (tiny model, one
steady call, one timed round) -- that it runs and reports, not timing.

Four launches of 2 gloo processes (a subset, to keep ``make test`` short:
the other forms and clients run the same code with other arguments): part
1's fresh pair per implementation for the full form, then one pair each
for Lightning Fabric (sharded checkpoints) and torchtune (its state-dict
API switch on, so the loads reach dcp_optim).
"""

from __future__ import annotations

import math

import pytest

from benchmarks import flows

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]


def _positive(x: float) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_flows_section_reports_every_row():
    first = flows.run_first_calls(1, ("full",), profile_top=12)
    assert [(r["form"], r["impl"]) for r in first] == [("full", i) for i in flows.IMPLS]
    for r in first:
        for key in ("import_s", "first_get_s", "first_set_s", "get_s", "set_s", "coll_s"):
            assert _positive(r[key]), (r["form"], r["impl"], key)
        for op in ("get", "set"):
            assert isinstance(r[f"{op}_colls"], int) and r[f"{op}_colls"] >= 0
            assert _positive(r["steady_ratio"][op]) and _positive(r["first_ratio"][op])
            # the profiled call is dcp_optim's, on rank 0, and went through its function
            for key in (f"{op}_profile", f"first_{op}_profile"):
                profile = r.get(key)
                if r["impl"] == "dcp_optim":
                    assert f"{op}_state_dict" in profile and "dcp_optim" in profile, key
                else:
                    assert profile is None, key
    # a full load in dcp_optim agrees across ranks: at least one collective
    full_ours = next(r for r in first if r["form"] == "full" and r["impl"] == "dcp_optim")
    assert full_ours["get_colls"] >= 1 and full_ours["set_colls"] >= 1

    trainers = flows.run_trainers(("tiny",), {"tiny": 1}, clients=("fabric", "torchtune-dsd"), forms=("sharded",),
                                  profile_top=12)
    expected = [("fabric", "sharded", op) for op in ("save", "load")]
    expected += [("torchtune-dsd", "-", op) for op in ("save", "load")]
    assert [(r["client"], r["form"], r["op"]) for r in trainers] == expected
    for r in trainers:
        assert r["size"] == "tiny" and r["reps"] == 1 and r["target"] == "<= 1.0"
        assert _positive(r["upstream_s"]) and _positive(r["dcp_optim_s"])
        assert r["ratio"] == pytest.approx(r["dcp_optim_s"] / r["upstream_s"])
        assert r["met"] == (r["ratio"] <= 1.0)
        assert "function calls" in r["profile"]
    # the clients' own functions ran under the profiler, and while patched
    # the state-dict calls reached dcp_optim's forwarders
    by = {(r["client"], r["form"], r["op"]): r["profile"] for r in trainers}
    assert "fabric.py" in by[("fabric", "sharded", "save")]
    assert "dcp_optim" in by[("torchtune-dsd", "-", "load")]

    text = flows.report(first, trainers, first_reps=1)
    for r in first:
        assert any(line.split()[:2] == [r["form"], r["impl"]] for line in text.splitlines())
    for r in trainers:
        assert any(line.split()[:4] == [r["client"], r["form"], "tiny", r["op"]] for line in text.splitlines())
