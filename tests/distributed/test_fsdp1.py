"""FSDP1 (FullyShardedDataParallel, flat parameters) on CPU gloo: native
flat <-> original mapping against upstream, loads from other wrappings,
moves to and from FSDP2 and plain models through DCP, and the collective
count and memory of the bucketed gather."""

from __future__ import annotations

import pytest

from ..support.harness import run_ranks
from . import dist_cases_fsdp1 as cases

pytestmark = pytest.mark.dist


def test_fsdp1_against_upstream(tmp_path):
    results = run_ranks(2, cases.fsdp1_suite, str(tmp_path), timeout=600)
    expected = [
        "fsdp1[orig=False,nested]",
        "fsdp1[orig=False,root]",
        "fsdp1[orig=True,nested]",
        "fsdp1[orig=True,root,frozen]",
        "fsdp1[orig=False,nested,mesh]",
        "fsdp1[orig=True,nested,mesh]",
        "rewrap",
    ]
    assert all(r == expected for r in results)


@pytest.mark.parametrize(
    "source, target, target_ws",
    [
        ("fsdp1", "fsdp2", 2),
        ("fsdp1", "plain", 1),
        ("fsdp1", "fsdp1_orig", 1),
        ("fsdp2", "fsdp1", 2),
        ("plain", "fsdp1_orig", 2),
    ],
)
def test_cross_framework_through_dcp(tmp_path, source, target, target_ws):
    path = str(tmp_path / "ckpt")
    run_ranks(1 if source == "plain" else 2, cases.save, path, source)
    results = run_ranks(target_ws, cases.load, path, target)
    assert results[0]["tensors"] > 0


def test_gather_is_bucketed():
    # 9 flat parameters (8 blocks + root), 2 tensor states each
    results = run_ranks(2, cases.collectives_case, 8)
    for r in results:
        assert r["flat_params"] == 9
        # upstream: at least one all-gather per flat parameter and state
        assert r["upstream"] >= 2 * r["flat_params"], r
        # dcp_optim: the FSDP1 getter's agreement (options, FQNs), one
        # metadata exchange, the gather's agreement check, one bucket
        assert r["ours"] <= 4, r


def test_gather_memory_is_result_plus_buckets():
    # 64 MB of Adam moments in 16 flat tensors of 4 MB, 8 MB buckets
    for r in run_ranks(2, cases.memory_case, 64, 8, "dcp_optim"):
        # the result plus about one bucket (send and receive sides) and
        # allocator slack; a gather that held every flat tensor next to
        # its cut-out copies would need twice the result
        bound = r["result_bytes"] + 2 * r["bucket_bytes"] + 8 * 2**20
        assert r["peak_delta"] <= bound, r


@pytest.mark.parametrize("ws", [2, 4])
def test_chunks_torch_chunk_leaves_out(tmp_path, ws):
    """D40: parameters with fewer chunks than ranks (one row; 5 rows at 4
    ranks).  Upstream's sharded dicts cannot be loaded by DCP with their
    nested optimizer dict; dcp_optim's list a zero-size shard for each rank without
    one and resume exactly, from its own checkpoints and upstream's."""
    results = run_ranks(ws, cases.narrow_chunks_case, str(tmp_path), timeout=300)
    ours = ["ours, ours: resumed", "ours, theirs: resumed"]
    nested = ["upstream's template, ours: missing key", "upstream's template, theirs: missing key"] + ours
    flat = ["upstream's template, ours: loaded", "upstream's template, theirs: loaded"] + ours
    assert all(r == (nested + flat) * 2 for r in results), results


def test_use_orig_params_key_order():
    results = run_ranks(2, cases.key_order_case, timeout=300)
    assert all(r == ["ignored=False: a.bias ... blocks.1.up.weight", "ignored=True: skip.bias ... blocks.1.up.weight"]
               for r in results), results


def test_hybrid_shard_resumes(tmp_path):
    results = run_ranks(4, cases.hsdp_case, str(tmp_path), timeout=300)
    wide = [f"_Wide, orig={o}: {who} resumed" for o in (False, True) for who in ("upstream", "ours")]
    narrow = [x for o in (False, True)
              for x in (f"_Narrow, orig={o}: upstream's template fails", f"_Narrow, orig={o}: ours resumed")]
    mesh = [f"mesh, flat={f}: ours resumed" for f in (False, True)]
    assert all(r == mesh + wide + narrow for r in results), results


@pytest.mark.parametrize("ws", [2, 4])
def test_optimizer_wide_and_rank_local_values(tmp_path, ws):
    pytest.importorskip("pytorch_optimizer")
    pytest.importorskip("transformers")
    results = run_ranks(ws, cases.optimizer_values_case, str(tmp_path), timeout=300)
    expected = [f"MADGRAD orig={o} flat={f}: resumed" for o in (False, True) for f in (False, True)]
    if ws == 2:
        expected += ["Adafactor: InconsistentOptimizerStateError body.weight.RMS",
                     "Adafactor, DCP_OPTIM_RANK_LOCAL_CHECK=0: resumed"]
    assert all(r == expected for r in results), results


def test_flat_parameter_scalars_must_agree(tmp_path):
    results = run_ranks(2, cases.flat_scalars_case, str(tmp_path), timeout=300)
    expected = [f"{label}: {who}" for label in ("step differs", "names differ", "step missing")
                for who in ("ours StateDictValueError", "upstream ValueError")] + ["equal values: loaded"]
    # upstream's template holds one "step" for the flat parameter: dcp.load
    # leaves one parameter's in it, which upstream's set loads for all (D42)
    expected += ["lagging step through DCP: ours StateDictValueError",
                 "lagging step through DCP: upstream loaded 1 step for 4 parameters"]
    assert all(r == expected for r in results), results


def test_optimizer_wrappers_with_their_own_layout_refused():
    pytest.importorskip("pytorch_optimizer")
    results = run_ranks(2, cases.wrapper_layout_case, timeout=300)
    expected = [f"orig={o} {w}: StateDictValueError" for o in (True, False) for w in ("get", "full load")]
    assert all(r == expected for r in results), results


def test_optimizers_own_top_level_entries(tmp_path):
    pytest.importorskip("pytorch_optimizer")
    results = run_ranks(2, cases.optimizer_extras_case, str(tmp_path), timeout=300)
    for rank, r in enumerate(results):
        assert r == [x for o in (True, False) for x in
                     [f"orig={o} flat={f}: lookahead_step 3" for f in (False, True)]
                     + [f"orig={o} full on this rank: {rank == 0}"]], r


def test_optimizers_own_top_level_entries_hybrid_shard(tmp_path):
    pytest.importorskip("pytorch_optimizer")
    results = run_ranks(4, cases.hsdp_extras_case, str(tmp_path), timeout=300)
    assert all(r == [f"orig={o}: saved 3, loaded 3" for o in (True, False)] for r in results), results


def test_load_into_another_grouping_refused():
    results = run_ranks(2, cases.regroup_case, timeout=300)
    expected = []
    for label in ("FSDP1 orig=True", "FSDP1 orig=False", "FSDP2"):
        expected += [f"{label} bcast={b}: ParamGroupConflictError" for b in (False, True)]
        if label != "FSDP1 orig=False":
            # upstream: the head's values for the body too, silently
            expected.append(f"{label} upstream: lr 0.01, weight_decay 0.0")
    assert all(r == expected for r in results), results


def test_broadcast_of_tensors_inside_a_state_list_refused():
    results = run_ranks(2, cases.nested_state_broadcast_case, timeout=300)
    message = ("StateDictValueError: optimizer state 'GG' of 'body.weight' holds tensors inside a list: "
               "a broadcast l")
    assert all(r == [f"orig={o}: {message}" for o in (True, False)] for r in results), results


def test_state_tensors_inside_a_dict_refused():
    """heavyball under FSDP1: its state tensors sit in a dict per view,
    pieces of flat parameters no mapping reaches; refused on every rank
    (upstream: one rank's flat-shard state under every name, or a raise)."""
    pytest.importorskip("heavyball")
    results = run_ranks(2, cases.nested_state_pieces_case, timeout=300)
    expected = ["orig=True ours: InconsistentOptimizerStateError", "orig=True upstream: RuntimeError",
                "orig=False ours: InconsistentOptimizerStateError",
                "orig=False upstream: this rank's flat shard under both names: True"]
    assert all(r == expected for r in results), results


def test_flat_parameter_partly_marked_loads_whole(tmp_path):
    pytest.importorskip("pytorch_optimizer")
    results = run_ranks(2, cases.partial_flat_case, str(tmp_path / "ckpt"), timeout=300)
    assert results[0] == ["marked: ['1.weight']", "1.bias state kept: True", "0.weight state kept: True"], results
    assert results[1] == ["marked: ['1.weight']"], results


def test_hybrid_shard_never_stepped_resumes_as_fresh(tmp_path):
    pytest.importorskip("pytorch_optimizer")
    results = run_ranks(4, cases.hsdp_never_stepped_case, str(tmp_path), timeout=300)
    expected = [f"{how} orig={o} flat={f}: fresh, marks []" for how in ("groups", "mesh")
                for o in (False, True) for f in (False, True)]
    assert all(r == expected for r in results), results[0]
