"""Smoke test of the scale simulation (``benchmarks/scale.py``): every
operation of the harness, both implementations, on torch's fake process
group at small worlds -- results, not timing.

Two process launches: one runs rank 0 and rank 1 of W=8, 64 and 512 with
FSDP2 on a 1-D mesh, of W=8 with FSDP1, then rank 0 of W=8 on a (dp, tp) mesh (torch cannot
re-create a 2-D mesh's groups in one process, so that pass is the last);
the second runs rank 1 of the (dp, tp) world from the broadcasts the first
recorded.  What is meaningful on the fake group is compared with upstream:
keys, types, shapes, dtypes, placements and local shard shapes of every
getter's result, the state the model and optimizer hold after every load,
the read items of a DCP resume plan.  The shims are checked against what
they claim, and the Python memory of dcp_optim's loads is compared
between W=8 and W=512 (an O(world) structure would show as growth).
"""

from __future__ import annotations

import pytest

from benchmarks import scale
from dcp_optim._engine.consistency import GATHERED_MIN_RANKS, RECORD_WORDS

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

MODEL = "mini"
BCAST = ["bcast_set_model", "bcast_set_optim"]
# the loads and the resume plan: per-rank work must not grow with the world
FLAT = ["sharded_set_model", "sharded_set_optim", *BCAST, "resume_plan"]


def _pass(world, layout, rank, **kw):
    return {"world": world, "model": MODEL, "layout": layout, "rank": rank, **kw}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("scale"))
    script = f"{tmp}/script.pkl"
    common = {"reps": 0, "check": True, "saved_world": 12}
    first = scale.launch(
        {
            **common,
            "selfcheck": True,
            "script_out": script,
            "passes": [
                _pass(8, "fsdp", 0),
                _pass(8, "fsdp", 1, census=True),
                _pass(64, "fsdp", 0),
                _pass(64, "fsdp", 1),
                _pass(512, "fsdp", 0, ops=BCAST),
                _pass(512, "fsdp", 1, ops=FLAT, census=True),
                _pass(8, "fsdp1", 0),
                _pass(8, "fsdp1", 1),
                _pass(8, "dp_tp", 0),
            ],
        },
        tmp,
        timeout_s=500,
    )
    assert "error" not in first, first
    second = scale.launch(
        {**common, "script_in": script, "passes": [_pass(8, "dp_tp", 1)]}, tmp, timeout_s=300
    )
    assert "error" not in second, second
    return first, second


def _passes(runs):
    return [p for r in runs for p in r["passes"]]


def test_shims_model_what_they_claim(runs):
    first, second = runs
    assert first["selfcheck"] and all(first["selfcheck"].values()), first["selfcheck"]
    # the receiving ranks' broadcast loads ran on rank 0's recorded metadata,
    # also in the second process (from the first one's recording)
    assert first["shims"].get("broadcast_object_list_recorded", 0) > 0
    assert first["shims"].get("broadcast_object_list_replayed", 0) > 0
    assert second["shims"].get("broadcast_object_list_replayed", 0) >= len(BCAST)  # upstream's
    # dcp_optim's payloads, the same way
    assert first["shims"].get("payload_recorded", 0) > 0 and first["shims"].get("payload_replayed", 0) > 0
    assert second["shims"].get("payload_replayed", 0) >= len(BCAST)
    # dcp_optim's agreement records went through the SPMD all-gather
    assert first["shims"].get("all_gather_into_tensor", 0) > 0


def test_every_operation_matches_upstream(runs):
    seen = set()
    for p in _passes(runs):
        for op, per in p["ops"].items():
            where = f"W={p['world']} rank {p['rank']} {p['layout']} {op}"
            assert "error" not in per, (where, per.get("traceback"))
            d = per["described"]
            assert d["upstream"], where
            assert d["upstream"] == d["dcp_optim"], where
            seen.add((p["layout"], p["world"], p["rank"], op))
    for world in (8, 64):
        for rank in (0, 1):
            assert {op for (lay, w, r, op) in seen if (lay, w, r) == ("fsdp", world, rank)} == set(scale.OPS)
    for layout in ("dp_tp", "fsdp1"):
        for rank in (0, 1):
            assert {op for (lay, w, r, op) in seen if (lay, w, r) == (layout, 8, rank)} == set(scale.OPS)


def test_wire_model(runs):
    """Bytes and collectives per call, against what the layout implies."""
    full = scale.full_bytes(MODEL)
    for p in _passes(runs):
        if p["layout"] != "fsdp" or p["world"] != 8:
            continue
        w, ops = p["world"], p["ops"]
        # one agreement record: RECORD_WORDS int64 words and their
        # negations, all-gathered up to GATHERED_MIN_RANKS ranks (the other
        # ranks' records, each way), all-reduced beyond (a ring all-reduce
        # moves 2 (w-1)/w of it each way)
        rec = 2 * RECORD_WORDS * 8
        record = rec * (w - 1) if w <= GATHERED_MIN_RANKS else int(rec * 2 * (w - 1) / w)
        up, dcp = ops["full_get_model"]["upstream"], ops["full_get_model"]["dcp_optim"]
        # upstream: one all-gather per sharded tensor (9 in the mini model),
        # each receiving the other ranks' shards (even shards at W=8)
        assert up["collectives"] == 9
        assert up["recv_bytes"] == full * (w - 1) // w
        # dcp_optim: the same bytes in bucketed all-gathers, plus its records
        assert dcp["collectives"] <= 3
        assert up["recv_bytes"] <= dcp["recv_bytes"] <= up["recv_bytes"] + 2 * record
        for impl in ("upstream", "dcp_optim"):
            assert ops["sharded_get_model"][impl]["collectives"] == 0
        # a broadcast load: upstream broadcasts every tensor whole, and so
        # does dcp_optim here: FSDP2's shards would be scattered (dim 0 over
        # the whole group), but only where a rank's chunk holds at least
        # SCATTER_MIN_CHUNK_BYTES, and this model's chunks hold at most
        # 96 x 16 x 4 bytes (the scatter path is counted and compared with
        # upstream on gloo: test_collectives).  Bucketed, with the metadata
        # broadcast besides: at most a few collectives, not one per tensor.
        from dcp_optim._engine.scatter_load import SCATTER_MIN_CHUNK_BYTES

        assert 96 * 16 * 4 < SCATTER_MIN_CHUNK_BYTES
        up, dcp = ops["bcast_set_model"]["upstream"], ops["bcast_set_model"]["dcp_optim"]
        assert dcp["collectives"] < up["collectives"], (dcp, up)
        if p["rank"] == 0:
            assert up["sent_bytes"] >= full and up["recv_bytes"] < full
            assert dcp["sent_bytes"] >= full and dcp["recv_bytes"] < full // w
        else:
            # a receiver sends at most its agreement records
            assert up["recv_bytes"] >= full and up["sent_bytes"] <= 3 * record
            assert full <= dcp["recv_bytes"] <= full + full // 2, (dcp, full)
            assert dcp["sent_bytes"] <= 3 * record


def test_no_python_memory_growing_with_the_world(runs):
    """dcp_optim's loads and resume plan at W=512 vs W=8 (rank 1): the
    Python memory a call allocates at its peak (tracemalloc; tensors are
    not traced) and the objects it leaves alive must not grow with the
    world."""
    census = {p["world"]: p["census"] for p in _passes(runs) if p.get("census")}
    small, large = census[8], census[512]
    for op in FLAT:
        assert large[op]["py_peak_kb"] <= 2 * small[op]["py_peak_kb"] + 16, (op, small[op], large[op])
        assert large[op]["objects_left"] <= small[op]["objects_left"] + 16, (op, small[op], large[op])
