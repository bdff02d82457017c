"""Post-load verification (dcp_optim.verify): the checksum depends on the
full logical tensor only -- not on sharding, chunking or memory layout --
catches any single changed element, and verify() names the FQN and state
that differ.  The multi-process part saves with FSDP2 on 2 ranks, loads at
2 ranks (clean, then a corrupted shard on one rank) and at 1 rank."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

import dcp_optim
from dcp_optim import convert, verify
from dcp_optim._engine import checksums
from dcp_optim._engine.core import C

from ..distributed import dist_cases_adoption as cases
from ..support.harness import run_ranks


def _shard(full: torch.Tensor, mesh_shape, placements, coord) -> torch.Tensor:
    """The local shard at ``coord``, cut from ``full`` by the C planner's
    blocks (the reference geometry)."""
    (lshape, blocks), = C.shard_layouts(list(full.shape), list(mesh_shape), placements, [list(coord)])
    local = torch.empty(lshape, dtype=full.dtype)
    for ls, gs, ln in blocks:
        local[tuple(slice(a, a + n) for a, n in zip(ls, ln))] = full[
            tuple(slice(g, g + n) for g, n in zip(gs, ln))
        ]
    return local


LAYOUTS = [
    ((2,), [(1, 0, 1)]),                    # Shard(0), uneven
    ((3,), [(1, 1, 1)]),                    # Shard(1) over 3
    ((4,), [(1, 0, 1)]),                    # more ranks than some rows
    ((2,), [(0, 0, 1)]),                    # Replicate
    ((2,), [(2, 0, 2)]),                    # _StridedShard(0, sf=2)
    ((2, 3), [(1, 0, 1), (1, 1, 1)]),       # 2-D: rows x columns
    ((2, 2), [(0, 0, 1), (1, 0, 1)]),       # HSDP: replicate x shard
    ((2, 2), [(2, 0, 2), (1, 0, 1)]),       # FSDP2 + TP on the same dim
    ((3, 2), [(1, 2, 1), (1, 2, 1)]),       # both mesh dims split the last dim
]


@pytest.mark.parametrize("mesh_shape,placements", LAYOUTS)
def test_partial_checksums_add_up_to_the_full_tensor(mesh_shape, placements):
    full = torch.randn(7, 5, 6, generator=torch.Generator().manual_seed(0))
    expected = verify.tensor_checksum(full)
    lo = hi = 0
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        local = _shard(full, mesh_shape, placements, coord)
        a, b = verify.shard_lanes(local, tuple(full.shape), mesh_shape, placements, coord)
        lo, hi = (lo + a) & 0xFFFFFFFF, (hi + b) & 0xFFFFFFFF
    assert (lo, hi) == expected


def test_checksum_properties(monkeypatch):
    g = torch.Generator().manual_seed(1)
    t = torch.randn(33, 17, generator=g)
    base = verify.tensor_checksum(t)
    assert verify.tensor_checksum(t.clone()) == base
    # memory layout does not matter, only logical positions
    assert verify.tensor_checksum(t.t().contiguous().t()) == base
    assert verify.tensor_checksum(t.t()) == verify.tensor_checksum(t.t().contiguous())
    # one element whose stride is not 1, of a dtype wider than any integer
    # (hashed as int64 pairs), and a conjugate view: their values
    z = torch.randn(1, 3, dtype=torch.complex128, generator=g).t()
    assert verify.tensor_checksum(z[1:2]) == verify.tensor_checksum(z[1:2].clone(memory_format=torch.contiguous_format))
    assert verify.tensor_checksum(z.conj()) == verify.tensor_checksum(z.conj().resolve_conj())
    # nor the chunk size
    monkeypatch.setattr(checksums, "_CHUNK", 7)  # the hashing lives in the engine
    assert verify.tensor_checksum(t) == base
    monkeypatch.undo()
    # any single change is caught (h is a bijection of the bits)
    flat = t.view(-1)
    for pos in (0, 1, 100, flat.numel() - 1):
        for bit in (0, 1, 22, 31):
            u = flat.clone()
            u.view(torch.int32)[pos] ^= 1 << bit if bit < 31 else -(1 << 31)
            assert verify.tensor_checksum(u.view_as(t)) != base, (pos, bit)
    swapped = flat.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert verify.tensor_checksum(swapped.view_as(t)) != base
    assert verify.tensor_checksum(torch.tensor([0.0])) != verify.tensor_checksum(torch.tensor([-0.0]))
    nan = torch.tensor([float("nan"), 1.0])
    assert verify.tensor_checksum(nan) == verify.tensor_checksum(nan.clone())
    for dtype in (torch.bool, torch.uint8, torch.int16, torch.bfloat16, torch.float64,
                  torch.complex64, torch.complex128):
        x = torch.ones(4, 3, dtype=dtype)
        y = x.clone()
        y[2, 1] = 0
        assert verify.tensor_checksum(x) != verify.tensor_checksum(y), dtype
    assert verify.tensor_checksum(torch.empty(0, 3)) == (0, 0)


def _model():
    model, optim = cases.build(1, seed=2, sharded=False)
    cases.train(model, optim, 2)
    return model, optim


def test_single_process_checksums_and_verify(tmp_path):
    model, optim = _model()
    sums = verify.checksums(model, optim)
    assert sums["format"] == verify.FORMAT
    keys = {(e[0], e[1], e[2]) for e in sums["entries"]}
    assert ("model", "head.weight", "") in keys and ("optim", "head.weight", "exp_avg_sq") in keys
    assert len(keys) == 13 + 13 * 3
    assert verify.verify(model, optim, sums) == 52
    # stored in the checkpoint as a small non-tensor entry, loaded back
    msd, osd = dcp_optim.get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd, "checksums": sums}, checkpoint_id=str(tmp_path))
    from dcp_optim.tools.checkpoint import Checkpoint

    assert [it.key for it in Checkpoint(tmp_path).other] == ["checksums.format", "checksums.entries"]
    model2, optim2 = cases.build(1, seed=9, sharded=False)
    msd2, osd2 = dcp_optim.get_state_dict(model2, optim2)
    state = {"model": msd2, "optim": osd2, "checksums": verify.template()}
    dcp.load(state, checkpoint_id=str(tmp_path))
    with pytest.raises(verify.ChecksumMismatchError):  # not installed yet
        verify.verify(model2, optim2, state["checksums"])
    dcp_optim.set_state_dict(model2, optim2, model_state_dict=state["model"],
                             optim_state_dict=state["optim"])
    assert verify.verify(model2, optim2, state["checksums"]) == 52


def test_verify_names_what_differs():
    model, optim = _model()
    sums = verify.checksums(model, optim)
    param = dict(model.named_parameters())["blocks.1.down.weight"]
    with torch.no_grad():
        optim.state[param]["exp_avg"][3, 2] = 0.5
    with pytest.raises(verify.ChecksumMismatchError) as info:
        verify.verify(model, optim, sums)
    assert isinstance(info.value, dcp_optim.errors.StateDictValueError)
    assert str(info.value).startswith(
        "post-load verification failed: optimizer state 'exp_avg' of 'blocks.1.down.weight' values differ"
    )
    assert [m[:3] for m in info.value.mismatches] == [("optim", "blocks.1.down.weight", "exp_avg")]
    with torch.no_grad():
        model.head.weight[0, 0] += 1
    with pytest.raises(verify.ChecksumMismatchError, match=r"model 'head.weight' values differ.*1 more"):
        verify.verify(model, optim, sums)
    # a state the optimizer no longer holds, an entry without a checksum
    fresh_model, fresh_optim = _model()
    del fresh_optim.state[dict(fresh_model.named_parameters())["head.weight"]]["exp_avg_sq"]
    with pytest.raises(verify.ChecksumMismatchError, match="'exp_avg_sq' of 'head.weight' is missing"):
        verify.verify(fresh_model, fresh_optim, sums)
    pruned = {"format": sums["format"], "entries": [e for e in sums["entries"] if e[1] != "head.weight"]}
    with pytest.raises(verify.ChecksumMismatchError, match="has no checksum in the expected dict"):
        verify.verify(*_model(), pruned)
    with pytest.raises(dcp_optim.errors.StateDictValueError, match="expected a checksums dict"):
        verify.verify(model, optim, {"format": None, "entries": None})


def test_options_and_model_only():
    model, optim = _model()
    for p in model.blocks[0].parameters():
        p.requires_grad_(False)
    frozen = dcp_optim.StateDictOptions(ignore_frozen_params=True)
    sums = verify.checksums(model, optim, options=frozen)
    fqns = {e[1] for e in sums["entries"] if e[0] == "model"}
    assert "blocks.0.up.weight" not in fqns and "blocks.1.up.weight" in fqns
    assert verify.verify(model, optim, sums, options=frozen) == len(sums["entries"])
    only_model = verify.checksums(model, None)
    assert {e[0] for e in only_model["entries"]} == {"model"}
    assert verify.verify(model, (), only_model) == 13
    with pytest.raises(dcp_optim.errors.StateDictTypeError):
        verify.checksums(model, 3)


@pytest.mark.dist
def test_sharded_save_resharded_loads_and_corruption(tmp_path):
    path, flat = str(tmp_path / "ckpt"), str(tmp_path / "flat")
    saved = run_ranks(2, cases.verify_save, path)
    assert saved[0]["geometry"] == ["shard0", "shard1", "shard2", "replicate", "strided", "2d", "2d-rep"]
    assert saved[0]["checksums"] == saved[1]["checksums"]
    sums = saved[0]["checksums"]
    # the sharded checkpoint, converted to the flat layout, loads identically
    convert.convert_checkpoint(path, flat, to="flat")
    for ws in (2, 1):
        results = run_ranks(ws, cases.verify_load, path, flat)
        for r in results:
            assert r["checked"] == len(sums["entries"]) == 52
            assert r["recomputed"] == sums  # independent of the world size
            assert r["full"] == saved[0]["full"] == r["flat_full"]
    for r in run_ranks(2, cases.verify_load, path, None):
        assert r["optim_error"].startswith(
            "post-load verification failed: optimizer state 'exp_avg' of 'blocks.1.up.weight' "
            "values differ"
        )
        assert r["optim_error"].endswith("on rank(s) [0, 1]")  # sharded: found by every rank
        assert r["model_error"].startswith("post-load verification failed: model 'head.weight' values differ")
        assert "optimizer state 'step' of 'blocks.1.up.weight' values differ" in r["step_error"]
        assert r["step_error"].endswith("on rank(s) [1]")  # a plain tensor: only rank 1's copy


def test_full_checksum_of_a_plain_model_matches_the_sharded_one():
    """ws=1 reference for the geometry: the checksum of a parameter of a
    plain model equals tensor_checksum of its value."""
    model = nn.Linear(5, 3)
    sums = verify.checksums(model, None)
    entry = next(e for e in sums["entries"] if e[1] == "weight")
    assert tuple(entry[5:]) == verify.tensor_checksum(model.weight.detach())


def test_set_functions_verify_with_the_option(tmp_path):
    """StateDictOptions(verify_checksums=...) on set_*: the loaded entries
    are checked after the load, per what each function loads."""
    model, optim = _model()
    sums = verify.checksums(model, optim)
    msd, osd = dcp_optim.get_state_dict(model, optim)
    opts = dcp_optim.StateDictOptions(verify_checksums=sums)
    # a clean load passes
    model2, optim2 = cases.build(1, seed=9, sharded=False)
    dcp_optim.set_state_dict(model2, optim2, model_state_dict=msd, optim_state_dict=osd, options=opts)
    # a corrupted optimizer entry fails set_optimizer_state_dict and
    # set_state_dict, not set_model_state_dict (which loads no optimizer)
    bad_osd = {"state": {k: dict(v) for k, v in osd["state"].items()}, "param_groups": osd["param_groups"]}
    bad_osd["state"]["head.weight"]["exp_avg"] = osd["state"]["head.weight"]["exp_avg"] + 1
    model3, optim3 = cases.build(1, seed=9, sharded=False)
    with pytest.raises(verify.ChecksumMismatchError, match="'exp_avg' of 'head.weight' values differ"):
        dcp_optim.set_optimizer_state_dict(model3, optim3, bad_osd, options=opts)
    with pytest.raises(verify.ChecksumMismatchError, match="'exp_avg' of 'head.weight'"):
        dcp_optim.set_state_dict(model3, optim3, model_state_dict=msd, optim_state_dict=bad_osd, options=opts)
    # the model alone: only model entries are compared
    model4, _ = cases.build(1, seed=9, sharded=False)
    dcp_optim.set_model_state_dict(model4, msd, options=opts)
    bad_msd = dict(msd)
    bad_msd["head.weight"] = msd["head.weight"] * 2
    with pytest.raises(verify.ChecksumMismatchError, match="model 'head.weight' values differ"):
        dcp_optim.set_model_state_dict(model4, bad_msd, options=opts)
    # torch's own options (no such field) still work, without a check
    import torch.distributed.checkpoint.state_dict as upstream

    dcp_optim.set_model_state_dict(model4, bad_msd, options=upstream.StateDictOptions())
