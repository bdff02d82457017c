"""In-memory resharding (dcp_optim.reshard_state_dict, docs/resharding.md):
every (source layout, destination layout) pair at worlds 2 and 4, both
formats, bit-identical to dcp.save + dcp.load into the same template; the
convenience form keeps training with the losses of a DCP resume; errors
are the same on every rank and change nothing."""

from __future__ import annotations

import pytest

from ..support.harness import run_ranks
from . import dist_cases_reshard as cases

pytestmark = pytest.mark.dist

PAIRS = [f"{s}->{d}" for s in cases.KINDS for d in cases.KINDS]


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flat"])
def test_matrix(tmp_path, ws, flatten):
    results = run_ranks(ws, cases.matrix, str(tmp_path), flatten, timeout=600)
    assert all(r == PAIRS for r in results)


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flat"])
def test_fsdp1_source(tmp_path, ws, flatten):
    results = run_ranks(ws, cases.fsdp1_source, str(tmp_path), flatten, timeout=600)
    assert all(r == [f"fsdp1->{d}" for d in cases.KINDS] for r in results)


def test_convenience_form_keeps_training(tmp_path):
    results = run_ranks(2, cases.convenience_and_training, str(tmp_path))
    assert results[0] == results[1]
    assert len(results[0]["losses"]) == 3


@pytest.mark.parametrize("ws", [2, 4])
def test_errors_same_on_every_rank(ws):
    results = run_ranks(ws, cases.errors_case)
    for r in results[1:]:
        assert r == results[0]
    labels = [m.split(":")[0] for m in results[0]]
    assert labels == ["shape", "missing", "keys", "partial", "kind", "type", "buckets", "alias", "subclass", "leaver"]
    assert "rank 0: TypeError: source and template must be dicts" in results[0][5]
    assert "different bucket_bytes" in results[0][6]
    assert "the template's 'b' shares memory with the source's 'b'" in results[0][7]
    assert "global shape [6, 4] differs from the template's [6, 5]" in results[0][0]
    assert "in no rank's source state dict" in results[0][1]
    assert "pending reduction" in results[0][3]
    assert ("the template's 'w' holds a torch.testing._internal.two_tensor.TwoTensor, a tensor subclass"
            in results[0][8])
    assert f"ranks 0 and {ws - 1} hold different source tensors (torch.float32 [3] vs torch.float32 [4])" in results[0][9]


@pytest.mark.parametrize("ws", [2, 4])
def test_float8_training_weights(tmp_path, ws):
    """torchao's float8 training under FSDP2 (wrapper-subclass shards) to
    TP and to itself, and plain FSDP2 into it: bit-identical to DCP, and
    the convenience form trains on with a DCP resume's losses."""
    pytest.importorskip("torchao")
    results = run_ranks(ws, cases.float8_case, str(tmp_path), timeout=300)
    assert all(r["pairs"] == ["float8->tp", "float8->float8", "fsdp2->float8"] for r in results)
    assert all(r["losses"] == results[0]["losses"] for r in results)


@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flat"])
def test_subworld(tmp_path, flatten):
    results = run_ranks(4, cases.subworld_case, str(tmp_path), flatten, timeout=300)
    assert results[0] == results[1] == ["fsdp2", "tp"]
    assert results[2] == results[3] == ["left"]


def test_demo():
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "dcp_optim.demo", "reshard", "--steps", "4", "--save-at", "2"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "losses are bit-identical on every rank" in proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip().startswith(("3 ", "4 "))]
    assert len(rows) == 2 and all(r[1] == r[2] for r in rows)


@pytest.mark.parametrize(("undo", "rows"), [("1", 1024), ("0", 1024), ("1", 1023)],
                         ids=["dense", "dense-no-undo", "point-to-point"])
def test_peak_memory_is_two_buckets_and_the_undo_log(undo, rows):
    for r in run_ranks(2, cases.memory_case, 16, undo, rows):
        # two 16 MB buckets (measured: 32 MB) and 12 MB of allocator and
        # sampling slack, as the broadcast-load memory tests allow; the
        # destination shards (64 MB) exist before the call, and the undo
        # log (the default) holds one host copy of them during it
        undo_log = r["shard_bytes"] if undo == "1" else 0
        assert r["peak_delta"] <= undo_log + 2 * r["bucket_bytes"] + 12 * 2**20, r
        assert r["shard_bytes"] == 32 * rows * 512 * 4
        # ReshardBuffers keeps what a call allocates (at most the buckets
        # and the undo log's copy); a repeat with it allocates nothing
        assert r["kept_bytes"] <= undo_log + 2 * r["bucket_bytes"] + 2**20, r
        assert r["kept_peak_delta"] <= 12 * 2**20, r


@pytest.mark.parametrize(("ws", "when", "undo"),
                         [(3, "mid", "1"), (3, "mid", "0"), (2, "after", "1"), (2, "dense", "1"), (4, "dense", "0")])
def test_a_rank_killed_during_the_transfer(ws, when, undo):
    """Rank 0 SIGKILLed in its third bucket ("mid"), or after its whole
    transfer but before the last all_reduce ("after": the survivor has
    received everything, and would return a written template without that
    agreement), or as it issues its third dense collective ("dense": the
    first two wrote the survivors' shards in place): every survivor raises
    within the group's 10 s timeout; with the undo log (the default) its
    template is as before the call,
    without it (DCP_OPTIM_STREAM_UNDO=0) the buckets received so far
    stay written."""
    with pytest.raises(AssertionError) as info:
        run_ranks(ws, cases.killed_case, when, undo, timeout=120)
    assert info.value.exitcodes[0] == -9, str(info.value)[-2000:]
    for rank in range(1, ws):
        survivor = info.value.rank_results.get(rank)
        assert survivor is not None, str(info.value)[-2000:]
        assert survivor["result"] != "ok" and survivor["seconds"] < 15, survivor
        assert survivor["unchanged"] is (undo == "1"), survivor
        if undo == "1":
            assert f"[reshard_state_dict, rank {rank}: the template was put back" in survivor["result"], survivor


def test_a_rank_that_cannot_allocate_its_transfer():
    """One rank of three out of memory as it allocates its send buffer,
    its receive buffer or the undo log's copy: every rank raises the same
    error naming it within seconds, nothing changed, and the group is
    left fit for the next reshard."""
    for rank, loads in enumerate(run_ranks(3, cases.cannot_allocate_case, timeout=120)):
        *failed, then = loads
        assert then == {"then": True}, (rank, then)
        for load in failed:
            assert load["result"].startswith("StateDictRuntimeError"), (rank, load)
            assert "could not prepare its transfer" in load["result"], (rank, load)
            assert (f"rank {load['bad']}: OutOfMemoryError: no memory for the {load['role']} buffer"
                    in load["result"]), (rank, load)
            assert load["seconds"] < 8 and load["unchanged"], (rank, load)


@pytest.mark.parametrize("ws", [2, 3])
def test_a_rank_failing_on_its_own_mid_transfer(ws):
    """One rank's own code failing in the transfer (point to point, dense
    collectives, the boxes it holds itself), or a cast it cannot make:
    every rank
    raises the same error naming that rank within seconds, nothing
    changed, the group fit for the next reshard."""
    bad = ws - 1
    for rank, loads in enumerate(run_ranks(ws, cases.fails_mid_transfer_case, timeout=120)):
        *failed, then = loads
        assert then == {"then": True}, (rank, then)
        assert len(failed) == 8, failed
        for load in failed:
            assert load["result"].startswith("StateDictRuntimeError"), (rank, load)
            if load["step"] == "cast":
                assert "could not prepare its transfer" in load["result"], (rank, load)
                assert f"rank {bad}: UserWarning: Casting complex values to real" in load["result"], (rank, load)
            else:
                assert "a rank failed in its transfer" in load["result"], (rank, load)
                assert f"rank {bad}: RuntimeError: {load['step']} failed on rank {bad}" in load["result"], (rank, load)
            assert load["seconds"] < 8 and load["unchanged"], (rank, load)


@pytest.mark.parametrize("ws", [2, 4])
def test_large_boxes_alone_and_small_ones_packed(ws):
    results = run_ranks(ws, cases.large_and_small_case)
    assert all(r == ["bias", "big", "big16", "big64", "small"] for r in results)


@pytest.mark.parametrize("ws", [2, 4])
def test_dense_layouts_move_by_collectives(ws):
    """FSDP2 <-> TP and Shard -> Replicate over the whole group: the small
    tensors of each kind share one all_to_all_single (four tensors) or
    all-gather (two); alone, each is one; the uneven tensor and the one
    over the bucket go point to point."""
    for counts in run_ranks(ws, cases.dense_case):
        assert counts["packed"]["all_to_all_single"] == 1 and counts["packed"]["gather"] == 1, counts
        assert counts["alone"]["all_to_all_single"] == 4 and counts["alone"]["gather"] == 2, counts
        assert all(c["batch_isend_irecv"] >= 1 for c in counts.values()), counts
        # the agreement on the layouts, the readiness check, the completion
        assert all(c["agreement"] == 3 for c in counts.values()), counts
