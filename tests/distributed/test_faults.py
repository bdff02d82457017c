"""Issue 24: every distributed fault ends in bounded time, with the same
error on every surviving rank and nothing changed.  Two gloo ranks; the
scenarios are in tests/distributed/dist_cases_faults.py (upstream beside
dcp_optim where it runs to an end).  The whole fault matrix, with times,
is ``make fault-matrix`` (docs/reliability.md)."""

from __future__ import annotations

import pytest

from ..support.harness import run_ranks
from . import dist_cases_faults as cases

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def parameter_order():
    return run_ranks(2, cases.parameter_order_case, timeout=240)


def test_parameter_order_getters_raise_on_every_rank(parameter_order):
    for r in parameter_order:
        ours = r["dcp_optim"]
        assert ours["get_model_values"] is None, ours
        assert "first difference at 'sharded tensor #0 in gather order'" in ours["get_model"], ours
        assert "rank(s) [0]: a; rank(s) [1]: b" in ours["get_model"], ours
        assert "rank(s) [0]: state.a.exp_avg; rank(s) [1]: state.b.exp_avg" in ours["get_optim"], ours
    assert parameter_order[0]["dcp_optim"] == parameter_order[1]["dcp_optim"]


def test_parameter_order_upstream_mixes_values_up(parameter_order):
    # upstream: no error, and "a" gathers half of a's shards and half of
    # b's (a holds ~0.9 after the step, b ~1.9: the mixed mean is ~1.4)
    for r in parameter_order:
        up = r["torch"]
        assert up["get_model"] == "ok" and up["get_optim"] == "ok", up
        assert up["get_model_values"]["a"] == up["get_model_values"]["b"] == 1.4, up


def test_parameter_order_setters_raise_and_change_nothing(parameter_order):
    for key in ("set_full", "set_sharded"):
        errs = {r[key] for r in parameter_order}
        assert len(errs) == 1, errs
        err = errs.pop()
        assert err.startswith("StateDictRuntimeError: ranks disagree on the parameters of the model"), err
        assert "first difference at 'model tensor #0': rank(s) [0]: a; rank(s) [1]: b" in err, err
    assert all(r["unchanged"] for r in parameter_order)


@pytest.mark.parametrize("which", ["optim", "model"])
def test_full_getter_on_one_rank_only_raises_instead_of_hanging(which):
    r0, r1 = run_ranks(2, cases.one_rank_full_getter_case, which, timeout=120)
    assert r0["result"].startswith("StateDictRuntimeError: sharded tensors to gather: timed out after 2 s"), r0
    assert "waiting for rank(s) [1] of ranks [0, 1]" in r0["result"], r0
    assert "DCP_OPTIM_ARRIVAL_TIMEOUT" in r0["result"], r0
    assert r1["result"] == "ok", r1  # a sharded getter does not communicate


@pytest.mark.parametrize("api", ["set_state_dict", "broadcast", "getter"])
def test_a_rank_that_never_arrives(api):
    """Rank 1 is 4 s late, the bound is 2 s (the group's timeout 30 s):
    rank 0 raises naming rank 1; rank 1, arriving after rank 0 gave up,
    raises the same error; nothing changed."""
    r0, r1 = run_ranks(2, cases.never_arrives_case, api, timeout=120)
    assert r0["result"] == r1["result"], (r0, r1)
    assert "timed out after 2 s waiting for rank(s) [1] of ranks [0, 1]" in r0["result"], r0
    assert r0["unchanged"] and r1["unchanged"]


@pytest.mark.parametrize("mode", ["sharded", "full"])
def test_a_load_hook_raising_on_one_rank_changes_nothing_anywhere(mode):
    r0, r1 = run_ranks(2, cases.hook_raises_case, mode, timeout=120)
    ours = (r0["dcp_optim"], r1["dcp_optim"])
    assert ours[0]["result"] == ours[1]["result"], ours
    assert ours[0]["result"].startswith("RuntimeError: hook refuses the load on rank 1 [raised on rank 1"), ours
    assert ours[0]["unchanged"] and ours[1]["unchanged"], ours
    # upstream: rank 1 raises, rank 0 loaded
    assert r0["torch"]["result"] == "ok" and not r0["torch"]["unchanged"]
    assert r1["torch"]["result"].startswith("RuntimeError: hook refuses")


@pytest.mark.parametrize("part", ["model", "optim"])
@pytest.mark.parametrize("undo", ["1", "0"])
def test_a_source_killed_mid_stream(part, undo):
    """SIGKILL of the source inside the eighth transfer (a scatter, or a
    batch of point-to-point messages) of a broadcast load
    that streams into the live tensors: the survivor raises the backend's
    error (gloo: the connection closed), well within the group's 10 s
    timeout; with the undo log (the default) nothing changed, without it
    (DCP_OPTIM_STREAM_UNDO=0, upstream's footprint) rank 1's rows of the buckets before
    rows were written."""
    with pytest.raises(AssertionError) as info:
        run_ranks(2, cases.killed_mid_stream_case, part, undo, timeout=120)
    assert info.value.exitcodes[0] == -9, str(info.value)[-2000:]
    survivor = info.value.rank_results.get(1)
    assert survivor is not None, str(info.value)[-2000:]
    assert survivor["result"].startswith("RuntimeError"), survivor
    assert "Connection closed by peer" in survivor["result"] or "Connection reset by peer" in survivor["result"], survivor
    assert survivor["unchanged"] is (undo == "1"), survivor


@pytest.mark.parametrize("path", ["scatter", "broadcast"])
@pytest.mark.parametrize("who", ["source", "receiver"])
@pytest.mark.parametrize("part", ["model", "optim"])
def test_a_rank_failing_on_its_own_mid_stream(part, who, path):
    """An exception of our own code on one rank in the middle of a
    broadcast load's stream (the source preparing its third unit, or a
    receiver landing its third): that rank keeps taking part in every
    remaining collective instead of leaving the others waiting in them
    until the group's timeout, so every rank raises the failing rank's
    error within seconds, and nothing changed on any rank."""
    records = run_ranks(3, cases.fails_mid_stream_case, part, who, path, timeout=120)
    bad = 0 if who == "source" else 2
    assert records[bad]["calls"] >= 3, records
    for rank, rec in enumerate(records):
        assert rec["result"].startswith("RuntimeError") and "injected failure on rank" in rec["result"], (rank, rec)
        assert rec["seconds"] < 20, (rank, rec)
        assert rec["unchanged"], (rank, rec)


@pytest.mark.parametrize("who", ["source", "receiver"])
def test_a_bug_mid_scatter_ends_on_every_rank(who):
    """A rank whose own code cannot build a scatter unit's messages at
    all from the third unit on (a bug, not a passing failure): its part in
    the rest of the stream comes from the schedule made before the stream
    (sizes and peers only), not from that code again, so every rank raises
    its error within seconds, nothing changed anywhere.  (When the sink
    rebuilt the messages it raised again, and the peers waited in their
    transfers until the group's timeout.)"""
    records = run_ranks(3, cases.fails_mid_stream_case, "model", who, "scatter", True, timeout=120)
    bad = 0 if who == "source" else 2
    assert records[bad]["calls"] >= 3, records
    for rank, rec in enumerate(records):
        assert rec["result"].startswith("RuntimeError") and "injected failure on rank" in rec["result"], (rank, rec)
        assert rec["seconds"] < 20, (rank, rec)
        assert rec["unchanged"], (rank, rec)


def assert_safe(records) -> None:
    """The fault matrix's acceptance, on one dcp_optim cell: every rank
    ended (killed, or with a result: no hang); every surviving rank that
    raised is ``unchanged``, every one that returned is ``loaded`` (or,
    for a getter, ``unchanged``); the survivors raised the same error
    type."""
    survivors = [rec for rec in records if rec["result"] != "killed"]
    assert survivors, records
    for rec in survivors:
        assert not rec["result"].startswith("died"), records
        if rec["result"] == "ok":
            assert rec["state"] in ("loaded", "unchanged"), records
        else:
            assert rec["state"] == "unchanged", records
    assert len({rec["result"].split(":")[0] for rec in survivors}) == 1, records


def test_a_rank_that_cannot_allocate_its_stream():
    """One rank of three out of memory while it allocates what a broadcast
    load's stream needs (model and optimizer loads; the source, then the
    last rank): every rank raises its error within seconds, the group's
    30 s timeout far off, and nothing changed anywhere."""
    records = run_ranks(3, cases.stream_cannot_allocate_case, timeout=240)
    for rank, loads in enumerate(records):
        assert len(loads) == 4, (rank, loads)
        for load in loads:
            assert load["result"].startswith("OutOfMemoryError"), (rank, load)
            assert f"cannot allocate the stream on rank {load['bad']}" in load["result"], (rank, load)
            assert load["seconds"] < 10, (rank, load)
            assert load["unchanged"], (rank, load)
            assert (load["injected"] > 0) == (rank == load["bad"]), (rank, load)


def test_a_rank_that_cannot_allocate_an_fsdp1_optimizer_load():
    """One rank of three out of memory while it allocates the new state
    tensors of a broadcast optimizer load into an FSDP1 model, or its
    stream's buffer (flat and original parameters; the source, then the
    last rank): every rank raises its error within seconds, the group's
    30 s timeout far off, no optimizer changed, and the next load
    completes."""
    records = run_ranks(3, cases.fsdp1_stream_cannot_allocate_case, timeout=240)
    for rank, loads in enumerate(records):
        failed = [load for load in loads if "then" not in load]
        assert len(failed) == 8, (rank, loads)
        for load in failed:
            what = "the new state" if load["where"] == "state" else "the stream"
            assert load["result"].startswith("OutOfMemoryError"), (rank, load)
            assert f"no memory for {what} on rank {load['bad']}" in load["result"], (rank, load)
            assert load["seconds"] < 10, (rank, load)
            assert load["unchanged"], (rank, load)
            if load["where"] == "state":
                assert (load["injected"] > 0) == (rank == load["bad"]), (rank, load)
        assert [(load["then"], load["loaded"]) for load in loads if "then" in load] == [("ok", True)] * 2, (rank, loads)


def test_a_full_getter_out_of_memory_on_one_rank():
    """Rank 0 of three out of memory while it assembles a full getter's
    tensors: it raises its error within seconds, the group's 30 s timeout
    far off; the others, whose gathers it kept taking part in, return
    upstream's dict.  Where rank 0 could not even take part (every
    allocation fails), every rank raises its error at the gather check,
    within seconds too.  The next call returns upstream's dict on every
    rank."""
    for rank, loads in enumerate(run_ranks(3, cases.gather_cannot_allocate_case, timeout=240)):
        assert [load.get("then") for load in loads if "then" in load] == [True, True], (rank, loads)
        failed = [load for load in loads if "then" not in load]
        assert [load["at"] for load in failed] == [2, 3, 5, None] * 2, (rank, loads)
        for load in failed:
            assert load["seconds"] < 10, (rank, load)
            if rank == 0 or load["at"] is None:
                assert load["result"].startswith("OutOfMemoryError"), (rank, load)
                assert "no memory for a gathered tensor on rank 0" in load["result"], (rank, load)
            else:
                assert load["result"] == "ok", (rank, load)
            if rank == 0:
                assert load["calls"] >= (load["at"] or 1), (rank, load)
            if load["at"] is None:
                assert "raised on rank 0" in load["result"] and "nothing was gathered" in load["result"], (rank, load)


@pytest.mark.parametrize("streamed", [False, True])
def test_a_receiver_that_cannot_read_the_payload(streamed):
    """The source's payload, unreadable on rank 1 (a class it cannot
    import): every rank raises rank 1's error within seconds, the group's
    30 s timeout far off, and nothing changed anywhere."""
    records = run_ranks(2, cases.unreadable_payload_case, streamed, timeout=120)
    for rank, rec in enumerate(records):
        assert rec["result"].startswith("ModuleNotFoundError") and "only_on_the_source" in rec["result"], (rank, rec)
        assert rec["seconds"] < 10, (rank, rec)
        assert rec["unchanged"], (rank, rec)


@pytest.mark.parametrize("path", ["full", "broadcast", "inline", "flat"])
def test_peer_killed_before_the_last_agreement_changes_nothing(path):
    """Rank 1 dies after the data moved (an in-place full or streamed
    broadcast load writes shards straight into the live tensors; an
    inline one into new tensors) and before the last agreement: rank 0's
    agreement fails at once, and what the move wrote is put back (the
    fault matrix's "kill-agree" cells)."""
    from .fault_matrix import run_cell

    r0, r1 = records = run_cell("kill-agree", path, "dcp_optim")
    assert r1["result"] == "killed", r1
    assert r0["result"].startswith("RuntimeError:") and "gloo" in r0["result"], r0
    assert_safe(records)


def test_peer_killed_after_the_last_agreement_leaves_the_load():
    """Rank 1 dies as its commit starts, after the last agreement: the
    survivor completes the load it agreed on -- ``loaded``, bit for bit,
    not partly (the fault matrix's "kill-commit" cells)."""
    from .fault_matrix import run_cell

    r0, r1 = records = run_cell("kill-commit", "sharded", "dcp_optim")
    assert r1["result"] == "killed", r1
    assert r0["result"] == "ok" and r0["state"] == "loaded", r0
    assert_safe(records)


def test_the_matrix_classifies_what_a_call_left():
    import torch

    from .fault_matrix import classify

    before = ([torch.zeros(2), torch.zeros(3)], [{"exp_avg": torch.zeros(2), "step": torch.tensor(2.0)}])
    loaded = ([torch.ones(2), torch.ones(3)], [{"exp_avg": torch.ones(2), "step": torch.tensor(2.0)}])
    partial = ([torch.ones(2), torch.zeros(3)], [{"exp_avg": torch.ones(2), "step": torch.tensor(2.0)}])
    wrong = ([torch.ones(2), torch.full((3,), 0.5)], [{"exp_avg": torch.ones(2), "step": torch.tensor(2.0)}])
    assert classify(before, before, loaded) == "unchanged"
    assert classify(before, loaded, loaded) == "loaded"
    assert classify(before, partial, loaded) == "PARTIAL"
    assert classify(before, wrong, loaded) == "WRONG"
    assert classify(before, loaded, None) == "WRONG"  # a getter that wrote
    # a dtype change is not the same bits
    assert classify(before, ([torch.zeros(2, dtype=torch.float64), torch.zeros(3)], before[1]), loaded) == "WRONG"


@pytest.mark.parametrize("path", ["sharded", "broadcast"])
def test_an_optimizer_load_raising_on_one_rank_rolls_the_model_back(path):
    """The optimizer's own load_state_dict (an override) raises on rank 1
    only, after the model was committed on every rank (and, broadcast,
    after the stream wrote into the live tensors): every rank raises rank
    1's error, and every rank's model and optimizer are as before (the
    optimizer's hyperparameters too: the override set one before raising)."""
    from .fault_matrix import run_cell

    r0, r1 = records = run_cell("optim-load", path, "dcp_optim")
    assert r0["result"] == r1["result"], records
    assert r0["result"].startswith("RuntimeError: optimizer refuses the load on rank 1 [raised on rank 1"), records
    assert_safe(records)


@pytest.mark.parametrize("fault, path", [
    ("options", "fsdp1-sharded"),  # FSDP1 without a device mesh: its sharded load exchanges shards
    ("never", "fsdp1-get-full"),   # FSDP's own full state dict gathers every flat parameter
    ("optim-load", "fsdp1-full"),
])
def test_fsdp1_paths_raise_the_same_error_within_the_bound(fault, path):
    """FSDP1 paths that communicate through FSDP's own functions meet
    (bounded) and agree first: the same error on every rank, before the
    process group's timeout (6 s: what a hang would take), nothing
    changed."""
    from .fault_matrix import PG_TIMEOUT_S, run_cell

    records = run_cell(fault, path, "dcp_optim")
    assert records[0]["result"] == records[1]["result"], records
    assert records[0]["result"].startswith(("StateDictRuntimeError", "RuntimeError: optimizer refuses")), records
    assert all(rec["seconds"] < PG_TIMEOUT_S for rec in records), records
    assert_safe(records)


@pytest.mark.parametrize("fault, path", [
    ("kill-mid", "fsdp1-get-full"),            # FSDP's own gathers lose a peer: unsharded flat parameters resharded
    ("kill-agree", "fsdp1-broadcast"),         # the stream wrote, nothing installed
    ("kill-fsdp-commit", "fsdp1-mesh-sharded"),  # FSDP's own gathers at commit: the model put back
])
def test_fsdp1_survivor_of_a_dead_peer_is_unchanged(fault, path):
    """A peer SIGKILLed mid-transfer, before the last agreement, or in
    FSDP's own collectives at commit (after the last agreement): the
    survivor raises the backend's error at once (gloo: a closed
    connection) with its model and optimizer as before the call -- its
    flat parameters sharded again where FSDP's pre-hook had unsharded
    them."""
    from .fault_matrix import PG_TIMEOUT_S, run_cell

    records = run_cell(fault, path, "dcp_optim")
    assert [rec["result"] for rec in records].count("killed") == 1, records
    survivor = next(rec for rec in records if rec["result"] != "killed")
    assert survivor["result"].startswith("RuntimeError:") and "gloo" in survivor["result"], records
    assert survivor["seconds"] < PG_TIMEOUT_S, records
    assert_safe(records)


@pytest.fixture(scope="module")
def fsdp1_hook():
    return run_ranks(2, cases.fsdp1_hook_case, timeout=300)


@pytest.mark.parametrize("api", ["set_state_dict", "set_model_state_dict"])
@pytest.mark.parametrize("mode", cases.FSDP1_HOOK_MODES)
def test_fsdp1_module_hook_raising_on_one_rank_changes_nothing_anywhere(fsdp1_hook, api, mode):
    """FSDP1: an inner module's load pre-hook raises on rank 1 only, while
    FSDP's hooks gather unit by unit: rank 1 goes on through every unit's
    gathers, and every rank raises rank 1's error within a few seconds
    (the group's timeout is 20 s: what rank 0 waiting in the next unit's
    gather would take), its flat-parameter shards and optimizer state
    bit-identical to before."""
    records = [r["faults"][f"{api} {mode}"] for r in fsdp1_hook]
    assert records[0]["result"] == records[1]["result"], records
    assert records[0]["result"].startswith("RuntimeError: pre-hook refuses the load of '"), records
    assert "layers.0._fsdp_wrapped_module.up.' on rank 1 [raised on rank 1;" in records[0]["result"], records
    assert all(rec["seconds"] < 10 for rec in records), records
    assert all(rec["state"] == "unchanged" for rec in records), records


def test_fsdp1_module_post_hook_raising_on_one_rank_changes_nothing_anywhere(fsdp1_hook):
    """The same with a load post-hook (it runs after the unit's submodules
    loaded, before FSDP's post-hook reshards): its type survives."""
    records = [r["post_hook"] for r in fsdp1_hook]
    assert records[0]["result"] == records[1]["result"], records
    assert records[0]["result"].startswith("ValueError: post-hook refuses the load on rank 1 [raised on rank 1;"), records
    assert all(rec["seconds"] < 10 for rec in records), records
    assert all(rec["state"] == "unchanged" for rec in records), records


@pytest.mark.parametrize("mode", cases.FSDP1_HOOK_MODES)
def test_fsdp1_module_hook_raising_nowhere_loads_as_upstream(fsdp1_hook, mode):
    for r in fsdp1_hook:
        clean = r["clean"][mode]
        assert clean["result"] == "ok" and clean["torch"] == "ok", clean
        assert clean["changed"] and clean["same_as_torch"], clean


def test_fsdp1_own_load_code_failing_is_not_agreed_on(fsdp1_hook):
    """FSDP's own load code (its gather at commit) raises on rank 1 of a
    model whose commit can fail (its modules' hooks): rank 1 raises its
    own error at once instead of entering the outcome's agreement, which
    rank 0, left in FSDP's gather, never reaches; rank 0, released by the
    backend's timeout (5 s), raises the same error, relayed through the
    store, not the backend's.  Nothing changed."""
    r0, r1 = (r["fsdp_own"] for r in fsdp1_hook)
    assert r0["result"] == r1["result"], (r0, r1)
    assert r1["result"].startswith(
        "RuntimeError: FSDP1's own load fails on rank 1 [raised on rank 1 of ranks [0, 1] inside torch's own "
        "collectives of set_state_dict"), r1
    assert r1["seconds"] < 3, r1
    assert r0["seconds"] < 12, r0  # the group's timeout, then the store
    assert r0["state"] == r1["state"] == "unchanged", (r0, r1)


def test_fsdp1_model_only_load_failing_midway_in_fsdps_own_code_changes_nothing():
    """A model-only FSDP1 load has no fallible part, yet FSDP's own gathers
    at commit can fail on one rank after earlier units loaded: the commit
    is staged, so both ranks end unchanged (before: both PARTIAL), with the
    failing rank's error on both."""
    r0, r1 = run_ranks(2, cases.fsdp1_model_only_own_code_fails_case, timeout=120)
    assert r0["result"] == r1["result"], (r0, r1)
    assert r1["result"].startswith(
        "RuntimeError: FSDP1's own load fails on rank 1 [raised on rank 1 of ranks [0, 1] inside torch's own "
        "collectives of set_model_state_dict"), r1
    assert r0["state"] == r1["state"] == "unchanged", (r0, r1)


def test_optimizer_steps_that_communicate_meet_in_lockstep():
    r0, r1 = run_ranks(2, cases.step_collectives_case, timeout=240)
    # (a) heavyball's FSDP1 owners: one error on both ranks, at once (it
    # was the process group's timeout, 60 s here, and a broken group)
    assert r0["heavyball"][0] == r1["heavyball"][0] != "ok", (r0, r1)
    assert r0["heavyball"][1] < 15 and r1["heavyball"][1] < 15, (r0, r1)
    assert r0["heavyball_group"] == r1["heavyball_group"] == 2.0
    # (b) every rank steps: the collectives meet, upstream's keys
    assert r0["fresh_same_keys"] and r1["fresh_same_keys"], (r0, r1)
    assert r0["fresh_live"] == r1["fresh_live"] == 0
    # (c) rank 0 alone steps: its collective does not run, at once
    names, seconds = r0["one_sided"]
    assert names[:2] == ["IncompleteTemplateError", "StepCollectiveError"], names
    assert seconds < 15, r0
    assert r1["one_sided"][0] == [], r1
    assert r0["one_sided_live"] == 3 and r1["one_sided_live"] == 4
    assert r0["one_sided_group"] == r1["one_sided_group"] == 2.0
