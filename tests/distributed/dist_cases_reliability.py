"""Distributed loads that never corrupt, never hang, and work in every
model state (2 gloo ranks, FSDP2 with uneven shards).  Rank functions for
tests/distributed/test_reliability.py; every scenario of one function runs in one
launch (launching processes dominates the cost).

Each scenario returns, per implementation, "ok" or the error it raised
("Type: message"), and whether anything changed: the model's parameters
and the optimizer's state are snapshot before each call and compared
after it.  Upstream runs on the same inputs wherever it ends (a scenario
in which upstream hangs or aborts a process is not run on upstream: the
test file says what upstream does there).
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as upstream
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

import dcp_optim
from dcp_optim._engine.distribute import fsdp2_param_groups

from ..support.oracle import assert_same_tree
from .dist_cases import MLP, CollectiveCounter, train


def _outcome(fn) -> str:
    try:
        fn()
        return "ok"
    except Exception as exc:  # noqa: BLE001 - the failure is the result
        return f"{type(exc).__name__}: {exc}"[:600] or traceback.format_exc(limit=2)


def _local_snapshot(model: nn.Module, optim) -> Any:
    """This rank's shards of every parameter -- FSDP2's sharded
    parameters, whatever state a forward left the module in -- and of the
    optimizer state, without collectives (for scenarios that may leave
    ranks apart)."""

    def local(v):
        return (v.to_local() if isinstance(v, DTensor) else v).detach().clone()

    params = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in fsdp2_param_groups(module._get_fsdp_state()):
                params.extend(local(fp.sharded_param) for fp in group.fsdp_params)
    state = []
    if optim is not None:
        for p in [p for g in optim.param_groups for p in g["params"]]:
            st = optim.state.get(p, {})
            state.append({k: (local(v) if isinstance(v, torch.Tensor) else v) for k, v in st.items()})
    return params, state


def _same(a, b) -> bool:
    try:
        assert_same_tree(a, b)
    except AssertionError:
        return False
    return True


def build(mesh, *, seed=0, root_default=False, reshard=True, amsgrad=False, trained=True):
    """The MLP of tests/distributed/dist_cases.py under fully_shard: layers and a root
    that owns the head.  ``root_default``: fully_shard's defaults (the root
    keeps its parameters unsharded after forward)."""
    torch.manual_seed(seed)
    model = MLP(width=8, hidden=7, layers=2)
    kw = {} if root_default else {"reshard_after_forward": reshard}
    for block in model.layers:
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    optim = torch.optim.Adam(model.parameters(), lr=0.01, amsgrad=amsgrad)
    if trained:
        train(model, optim, steps=2, seed=seed)
    return model, optim


def _states(mesh, state: str, seed: int = 0):
    """A trained model and optimizer left in one of the states FSDP2 can
    leave a module in."""
    if state == "sharded":
        return build(mesh, seed=seed)
    if state == "eval":  # a no_grad forward: the root stays unsharded
        model, optim = build(mesh, seed=seed, root_default=True)
        with torch.no_grad():
            model(torch.randn(4, 8))
        return model, optim
    if state == "mid_training":  # reshard_after_forward=False, between forward and backward
        model, optim = build(mesh, seed=seed, reshard=False)
        model._dcp_test_loss = model(torch.randn(4, 8))
        return model, optim
    raise ValueError(state)


def _opts(impl, **kw):
    return impl.StateDictOptions(**kw)


# --- defects 1-6 ------------------------------------------------------------------


def reliability_suite(rank: int, ws: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (ws,))
    out: dict[str, Any] = {}

    # 1. full load (every rank holds the dict, no broadcast) into a model
    #    that has run a forward: a wrong global shape is an error on every
    #    rank before anything is written.
    for shape in ((5, 1), (6, 8), (5, 5)):
        for impl in (upstream, dcp_optim):
            model, optim = build(mesh)
            full = dcp_optim.get_model_state_dict(model, options=dcp_optim.StateDictOptions(full_state_dict=True))
            full["head.weight"] = torch.randn(*shape)
            before = _local_snapshot(model, None)
            result = _outcome(
                lambda: impl.set_model_state_dict(model, full, options=_opts(impl, full_state_dict=True))
            )
            out[f"d1{shape}"] = out.get(f"d1{shape}", {})
            out[f"d1{shape}"][impl.__name__.split(".")[0]] = (result, _same(before, _local_snapshot(model, None)))

    # 2. getters and setters after a no_grad forward (root unsharded) and
    #    mid-training with reshard_after_forward=False: equal to the
    #    results after an explicit reshard(); upstream's too.
    for state in ("eval", "mid_training"):
        for options in ({}, {"full_state_dict": True}):
            model, optim = _states(mesh, state)
            ref_model, ref_optim = _states(mesh, state)
            got = _outcome(lambda: out.__setitem__(
                "_tmp", dcp_optim.get_state_dict(model, optim, options=dcp_optim.StateDictOptions(**options))))
            got_value = out.pop("_tmp", None)
            up_model, up_optim = _states(mesh, state)
            up = upstream.get_state_dict(up_model, up_optim, options=upstream.StateDictOptions(**options))
            for module in ref_model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
            ref = dcp_optim.get_state_dict(ref_model, ref_optim, options=dcp_optim.StateDictOptions(**options))
            equal = got == "ok" and _same(got_value, ref) and _same(got_value, up)
            out[f"d2_get[{state},{sorted(options)}]"] = {"dcp_optim": got if got != "ok" or equal else "differs"}
        # a setter in the same state: loads a trained checkpoint exactly
        src_model, src_optim = build(mesh, seed=5)
        msd, osd = dcp_optim.get_state_dict(src_model, src_optim)
        model, optim = _states(mesh, state)
        result = _outcome(lambda: dcp_optim.set_state_dict(
            model, optim, model_state_dict=msd, optim_state_dict=osd))
        if result == "ok":
            after = dcp_optim.get_state_dict(model, optim)
            result = "ok" if _same(after, (msd, osd)) else "loaded something else"
        out[f"d2_set[{state}]"] = {"dcp_optim": result}
        # training goes on after both getters and a full setter (the model's
        # own checkpoint loaded back) bit-identically to a run that had
        # none of them in between: mid-training, the stored loss's
        # backward() and step(); after the no_grad forward, a training step
        runs = []
        for with_calls in (True, False):
            model, optim = _states(mesh, state)

            def calls(model=model, optim=optim):
                dcp_optim.get_state_dict(model, optim)
                full = dcp_optim.StateDictOptions(full_state_dict=True)
                msd, osd = dcp_optim.get_state_dict(model, optim, options=full)
                dcp_optim.set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd, options=full)

            result = _outcome(calls) if with_calls else "ok"
            if state == "mid_training":
                model._dcp_test_loss.backward()
            else:
                model(torch.randn(4, 8, generator=torch.Generator().manual_seed(9))).backward()
            optim.step()
            runs.append((result, _local_snapshot(model, optim)))
        (result, after_calls), (_, plain) = runs
        out[f"d2_train[{state}]"] = {"dcp_optim": result if result != "ok" or _same(after_calls, plain) else "differs"}

    # 3. set_state_dict is atomic: a bad model dict changes neither the
    #    model nor the optimizer (full, broadcast and sharded modes).
    for mode, flat in ((m, f) for m in ("full", "broadcast", "sharded") for f in (False, True)):
        key = f"d3[{mode}{',flat' if flat else ''}]"
        out[key] = {}
        # upstream's set_state_dict hangs when receivers pass {} (see the
        # README): not run in broadcast mode
        for impl in (upstream, dcp_optim) if mode != "broadcast" else (dcp_optim,):
            model, optim = build(mesh)
            src_model, src_optim = build(mesh, seed=3)
            full = mode != "sharded"
            opts = dict(full_state_dict=full, broadcast_from_rank0=mode == "broadcast",
                        flatten_optimizer_state_dict=flat)
            msd, osd = dcp_optim.get_state_dict(
                src_model, src_optim,
                options=dcp_optim.StateDictOptions(full_state_dict=full, flatten_optimizer_state_dict=flat))
            msd = dict(msd)
            msd["layers.0.up.bias"] = torch.zeros(3)  # the wrong global shape (7,)
            if mode == "broadcast" and rank != 0:
                msd, osd = {}, {}
            before = _local_snapshot(model, optim)
            result = _outcome(lambda: impl.set_state_dict(
                model, optim, model_state_dict=msd, optim_state_dict=osd, options=_opts(impl, **opts)))
            out[key][impl.__name__.split(".")[0]] = (result, _same(before, _local_snapshot(model, optim)))

    # 5. a check that fails on one rank only: rank 1's optimizer holds
    #    state, rank 0's does not, the checkpoint lacks state for one
    #    trainable parameter.  strict: the same MissingOptimizerStateError
    #    on both ranks, nothing loaded; strict=False: both ranks load.
    for strict, flat in ((True, False), (False, False), (True, True), (False, True)):
        src_model, src_optim = build(mesh, seed=4)
        osd = dcp_optim.get_optimizer_state_dict(
            src_model, src_optim,
            options=dcp_optim.StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=flat))
        if flat:
            osd = {k: v for k, v in osd.items() if not k.startswith("state.head.weight.")}
        else:
            osd = {"state": {k: v for k, v in osd["state"].items() if k != "head.weight"},
                   "param_groups": osd["param_groups"]}
        if rank != 0:
            osd = {}
        model, optim = build(mesh, seed=1)
        if rank == 0:
            optim.state.clear()
        before = _local_snapshot(model, optim)
        result = _outcome(lambda: dcp_optim.set_optimizer_state_dict(
            model, optim, osd,
            options=dcp_optim.StateDictOptions(
                full_state_dict=True, broadcast_from_rank0=True, strict=strict, flatten_optimizer_state_dict=flat)))
        changed = not _same(before, _local_snapshot(model, optim))
        loaded = None
        if result == "ok":
            expect = dcp_optim.get_optimizer_state_dict(
                src_model, src_optim, options=dcp_optim.StateDictOptions(full_state_dict=True))
            got = dcp_optim.get_optimizer_state_dict(
                model, optim, options=dcp_optim.StateDictOptions(full_state_dict=True))
            loaded = all(_same(got["state"][k], v) for k, v in expect["state"].items() if k != "head.weight")
        out[f"d5[strict={strict}{',flat' if flat else ''}]"] = {"dcp_optim": (result, changed, loaded)}

    # 7. issue 23 (D28): a strict load whose dict holds an empty entry for
    #    a parameter the optimizer keeps state for.  broadcast: only rank 0
    #    holds the dict; sharded: only rank 1's dict is short.  Either way
    #    the same MissingOptimizerStateError on both ranks, nothing loaded.
    for mode in ("broadcast", "sharded"):
        src_model, src_optim = build(mesh, seed=4)
        full = mode == "broadcast"
        osd = dcp_optim.get_optimizer_state_dict(
            src_model, src_optim, options=dcp_optim.StateDictOptions(full_state_dict=full))
        short = (rank == 0) if full else (rank == 1)
        if short:
            osd = {"state": {**osd["state"], "head.weight": {}}, "param_groups": osd["param_groups"]}
        elif full:
            osd = {}
        model, optim = build(mesh, seed=1)
        before = _local_snapshot(model, optim)
        result = _outcome(lambda: dcp_optim.set_optimizer_state_dict(
            model, optim, osd,
            options=dcp_optim.StateDictOptions(full_state_dict=full, broadcast_from_rank0=full)))
        out[f"d7[{mode}]"] = {"dcp_optim": (result, _same(before, _local_snapshot(model, optim)))}

    # 4. ranks disagreeing on broadcast_from_rank0 (rank 0 broadcasts, rank
    #    1 passes {} without broadcast): the same error on both.
    model, optim = build(mesh)
    full = dcp_optim.get_model_state_dict(model, options=dcp_optim.StateDictOptions(full_state_dict=True))
    before = _local_snapshot(model, optim)
    result = _outcome(lambda: dcp_optim.set_model_state_dict(
        model, full if rank == 0 else {},
        options=dcp_optim.StateDictOptions(full_state_dict=True, broadcast_from_rank0=rank == 0)))
    out["d4"] = {"dcp_optim": (result, _same(before, _local_snapshot(model, optim)))}

    # 6. ranks disagreeing on amsgrad: the error names the extra state
    for flat in (False, True):
        model, optim = build(mesh, amsgrad=rank == 1)
        result = _outcome(lambda: dcp_optim.get_optimizer_state_dict(
            model, optim, options=dcp_optim.StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=flat)))
        out[f"d6{'[flat]' if flat else ''}"] = {"dcp_optim": result}

    # The collectives of a load (the sequence docs/architecture.md states): per
    # mode, every torch.distributed call and the bytes of its input.
    # "broadcast": this small model's tensors travel inline with the
    # source's metadata; "streamed": the same load with inlining off.
    from dcp_optim._engine import payload as _payload

    src_model, src_optim = build(mesh, seed=4)
    inline_bytes = _payload.INLINE_BYTES
    for mode in ("sharded", "full", "broadcast", "streamed"):
        bcast = mode in ("broadcast", "streamed")
        opts = dcp_optim.StateDictOptions(full_state_dict=mode != "sharded", broadcast_from_rank0=bcast)
        msd, osd = dcp_optim.get_state_dict(src_model, src_optim, options=opts)
        if bcast and rank != 0:
            msd, osd = {}, {}
        model, optim = build(mesh)
        _payload.INLINE_BYTES = 0 if mode == "streamed" else inline_bytes
        try:
            with CollectiveRecorder() as rec:
                result = _outcome(lambda: dcp_optim.set_state_dict(
                    model, optim, model_state_dict=msd, optim_state_dict=osd, options=opts))
        finally:
            _payload.INLINE_BYTES = inline_bytes
        out[f"collectives[{mode}]"] = {"dcp_optim": (result, rec.calls)}
    dist.barrier()
    return out


class CollectiveRecorder(CollectiveCounter):
    """CollectiveCounter (tests/distributed/dist_cases.py) that also records, in call
    order, each outermost call's name and the bytes of its input tensor
    (None for object collectives)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int | None]] = []

    def _record(self, name, label, args, kwargs):
        super()._record(name, label, args, kwargs)
        inp = None
        if name in ("all_gather_into_tensor", "all_gather_single"):
            inp = args[1] if len(args) > 1 else kwargs.get("input_tensor")
        elif name in ("broadcast", "all_reduce"):
            inp = args[0] if args else kwargs.get("tensor")
        size = inp.numel() * inp.element_size() if isinstance(inp, torch.Tensor) else None
        self.calls.append((name, size))


# --- no load writes a tensor of another global shape --------------------------------


def global_shape_suite(rank: int, ws: int) -> dict[str, str]:
    """Every load mode x model state, model and optimizer: a tensor of
    another global shape than its parameter's is refused on every rank,
    nothing changes."""
    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for state in ("sharded", "eval", "mid_training"):
        for mode in ("sharded", "full", "broadcast"):
            for part in ("model", "optim", "optim_flat"):
                model, optim = _states(mesh, state)
                full = mode != "sharded"
                flat = part == "optim_flat"
                opts = dcp_optim.StateDictOptions(
                    full_state_dict=full, broadcast_from_rank0=mode == "broadcast", flatten_optimizer_state_dict=flat)
                src_model, src_optim = build(mesh, seed=2)
                msd, osd = dcp_optim.get_state_dict(
                    src_model, src_optim,
                    options=dcp_optim.StateDictOptions(full_state_dict=full, flatten_optimizer_state_dict=flat))
                if part == "model":
                    msd = {**msd, "head.weight": torch.randn(7, 8)}  # global (5, 8)
                elif flat:
                    osd = {**osd, "state.head.weight.exp_avg": torch.randn(5, 1)}
                else:
                    st = dict(osd["state"]["head.weight"])
                    st["exp_avg"] = torch.randn(5, 1)
                    osd = {"state": {**osd["state"], "head.weight": st}, "param_groups": osd["param_groups"]}
                if mode == "broadcast" and rank != 0:
                    msd, osd = {}, {}
                before = _local_snapshot(model, optim)
                result = _outcome(lambda: dcp_optim.set_state_dict(
                    model, optim, model_state_dict=msd, optim_state_dict=osd, options=opts))
                changed = not _same(before, _local_snapshot(model, optim))
                out[f"{state}/{mode}/{part}"] = (result, changed)
    dist.barrier()
    return out


# --- fault injection --------------------------------------------------------------


def _fault_cases(rank: int, mesh) -> list[tuple[str, Any]]:
    """(name, call) pairs: each call is made on every rank, with the fault
    on one of them, against a fresh trained model and optimizer.  Cases
    that pass an optimizer dict run in both optimizer formats (the
    flattened one's name ends with " [flat]")."""

    def full_msd(model):
        return dcp_optim.get_model_state_dict(model, options=dcp_optim.StateDictOptions(full_state_dict=True))

    cases = []

    def case(name, formats=(False,)):
        def register(fn):
            for flat in formats:
                def call(model, optim, src, src_optim, fn=fn, flat=flat):
                    def F(**kw):
                        return dcp_optim.StateDictOptions(flatten_optimizer_state_dict=flat, **kw)

                    def full_osd(model, optim):
                        return dcp_optim.get_optimizer_state_dict(model, optim, options=F(full_state_dict=True))

                    return fn(model, optim, src, src_optim, F, full_osd, _OsdEdit(flat))

                cases.append((name + (" [flat]" if flat else ""), call))
            return fn
        return register

    both = (False, True)

    @case("options: full_state_dict differs (set_model_state_dict)")
    def _(model, optim, src, src_optim, F, full_osd, edit):
        msd = full_msd(src)
        dcp_optim.set_model_state_dict(model, msd, options=F(full_state_dict=rank == 0))

    @case("options: full_state_dict differs (set_optimizer_state_dict)", both)
    def _(model, optim, src, src_optim, F, full_osd, edit):
        full, sharded = full_osd(src, src_optim), dcp_optim.get_optimizer_state_dict(src, src_optim, options=F())
        osd = full if rank == 0 else sharded
        dcp_optim.set_optimizer_state_dict(model, optim, osd, options=F(full_state_dict=rank == 0))

    @case("options: broadcast_from_rank0 differs (set_model_state_dict)")
    def _(model, optim, src, src_optim, F, full_osd, edit):
        msd = full_msd(src)
        dcp_optim.set_model_state_dict(
            model, msd if rank == 0 else {}, options=F(full_state_dict=True, broadcast_from_rank0=rank == 0))

    @case("options: broadcast_from_rank0 differs (set_state_dict)", both)
    def _(model, optim, src, src_optim, F, full_osd, edit):
        msd, osd = full_msd(src), full_osd(src, src_optim)
        if rank != 0:
            msd, osd = {}, {}
        dcp_optim.set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd,
                                 options=F(full_state_dict=True, broadcast_from_rank0=rank == 0))

    @case("options: strict differs (set_optimizer_state_dict, broadcast)", both)
    def _(model, optim, src, src_optim, F, full_osd, edit):
        osd = full_osd(src, src_optim)
        dcp_optim.set_optimizer_state_dict(
            model, optim, osd if rank == 0 else {},
            options=F(full_state_dict=True, broadcast_from_rank0=True, strict=rank == 0))

    @case("options: cpu_offload differs (set_model_state_dict, broadcast)")
    def _(model, optim, src, src_optim, F, full_osd, edit):
        msd = full_msd(src)
        dcp_optim.set_model_state_dict(
            model, msd if rank == 0 else {},
            options=F(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=rank == 1))

    @case("options: broadcast_from_rank0 without full_state_dict on rank 1")
    def _(model, optim, src, src_optim, F, full_osd, edit):
        msd = full_msd(src)
        dcp_optim.set_model_state_dict(
            model, msd, options=F(full_state_dict=rank == 0, broadcast_from_rank0=True))

    @case("options: cpu_offload differs (get_model_state_dict, full)")
    def _(model, optim, src, src_optim, F, full_osd, edit):
        dcp_optim.get_model_state_dict(model, options=F(full_state_dict=True, cpu_offload=rank == 1))

    @case("options: cpu_offload differs (get_state_dict, full)", both)
    def _(model, optim, src, src_optim, F, full_osd, edit):
        dcp_optim.get_state_dict(model, optim, options=F(full_state_dict=True, cpu_offload=rank == 1))

    @case("keys: rank 1's full model dict lacks a key")
    def _(model, optim, src, src_optim, F, full_osd, edit):
        msd = full_msd(src)
        if rank == 1:
            del msd["layers.1.norm.bias"]
        dcp_optim.set_model_state_dict(model, msd, options=F(full_state_dict=True))

    @case("keys: rank 1's sharded model dict lacks a key")
    def _(model, optim, src, src_optim, F, full_osd, edit):
        msd = dcp_optim.get_model_state_dict(src)
        if rank == 1:
            del msd["layers.0.up.bias"]
        dcp_optim.set_model_state_dict(model, msd)

    @case("keys: each rank's sharded model dict lacks another key")
    def _(model, optim, src, src_optim, F, full_osd, edit):
        msd = dcp_optim.get_model_state_dict(src)
        del msd["layers.0.up.bias" if rank == 0 else "layers.1.up.bias"]
        dcp_optim.set_model_state_dict(model, msd)

    @case("shapes: rank 1's full model dict has a wrong global shape")
    def _(model, optim, src, src_optim, F, full_osd, edit):
        msd = full_msd(src)
        if rank == 1:
            msd["head.weight"] = torch.randn(6, 8)
        dcp_optim.set_model_state_dict(model, msd, options=F(full_state_dict=True))

    @case("shapes: rank 1's full optimizer dict has a wrong global shape", both)
    def _(model, optim, src, src_optim, F, full_osd, edit):
        msd, osd = full_msd(src), full_osd(src, src_optim)
        if rank == 1:
            osd = edit.set_state(osd, "layers.0.up.weight", "exp_avg_sq", torch.randn(8, 7))
        dcp_optim.set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd,
                                 options=F(full_state_dict=True))

    @case("hyperparameters: amsgrad on rank 1 only (get, full)", both)
    def _(model, optim, src, src_optim, F, full_osd, edit):
        if rank == 1:
            for g in optim.param_groups:
                g["amsgrad"] = True
            for st in optim.state.values():
                st["max_exp_avg_sq"] = torch.zeros_like(st["exp_avg"])
        try:
            full_osd(model, optim)
        finally:
            if rank == 1:  # a getter changes nothing: undo the fault
                for g in optim.param_groups:
                    g["amsgrad"] = False
                for st in optim.state.values():
                    del st["max_exp_avg_sq"]

    @case("hyperparameters: rank 1's full optimizer dict has another lr", both)
    def _(model, optim, src, src_optim, F, full_osd, edit):
        osd = full_osd(src, src_optim)
        if rank == 1:
            osd = edit.set_lr(osd, 0.5)
        dcp_optim.set_optimizer_state_dict(model, optim, osd, options=F(full_state_dict=True))

    @case("dtypes: rank 1's full model dict holds a float64 tensor")
    def _(model, optim, src, src_optim, F, full_osd, edit):
        msd = full_msd(src)
        if rank == 1:
            msd["head.weight"] = msd["head.weight"].double()
        dcp_optim.set_model_state_dict(model, msd, options=F(full_state_dict=True))

    @case("validation raises on rank 1 only (strict, missing optimizer state)", both)
    def _(model, optim, src, src_optim, F, full_osd, edit):
        osd = dcp_optim.get_optimizer_state_dict(src, src_optim, options=F())
        if rank == 1:
            osd = edit.drop_state(osd, "head.weight")
        dcp_optim.set_optimizer_state_dict(model, optim, osd, options=F())

    @case("validation raises on rank 1 only (its own load hook)")
    def _(model, optim, src, src_optim, F, full_osd, edit):
        def hook(*args, **kwargs):
            raise ValueError("rank 1's own check failed")

        handle = model.layers[0]._register_load_state_dict_pre_hook(hook) if rank == 1 else None
        try:
            msd = dcp_optim.get_model_state_dict(src)
            dcp_optim.set_model_state_dict(model, msd)
        finally:
            if handle is not None:
                handle.remove()

    @case("rank 0 broadcasts a wrong-shaped model tensor (set_state_dict)", both)
    def _(model, optim, src, src_optim, F, full_osd, edit):
        msd, osd = full_msd(src), full_osd(src, src_optim)
        msd["layers.1.down.weight"] = torch.randn(8, 8)
        if rank != 0:
            msd, osd = {}, {}
        dcp_optim.set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd,
                                 options=F(full_state_dict=True, broadcast_from_rank0=True))

    @case("rank 0 broadcasts a wrong-shaped optimizer tensor", both)
    def _(model, optim, src, src_optim, F, full_osd, edit):
        osd = edit.set_state(full_osd(src, src_optim), "head.weight", "exp_avg", torch.randn(5))
        dcp_optim.set_optimizer_state_dict(
            model, optim, osd if rank == 0 else {}, options=F(full_state_dict=True, broadcast_from_rank0=True))

    @case("calls: rank 0 gets a full dict, rank 1 loads one")
    def _(model, optim, src, src_optim, F, full_osd, edit):
        msd = dcp_optim.get_model_state_dict(src) if rank == 1 else None  # no collective
        if rank == 0:
            dcp_optim.get_model_state_dict(model, options=F(full_state_dict=True))
        else:
            dcp_optim.set_model_state_dict(model, msd, options=F(full_state_dict=True))

    @case("rank 0 broadcasts a model dict with an unexpected key (strict)")
    def _(model, optim, src, src_optim, F, full_osd, edit):
        msd = full_msd(src)
        msd["extra.weight"] = torch.randn(3)
        dcp_optim.set_model_state_dict(
            model, msd if rank == 0 else {}, options=F(full_state_dict=True, broadcast_from_rank0=True))

    return cases


class _OsdEdit:
    """Edits of an optimizer state dict in either format (new dicts; the
    caller's are left alone)."""

    def __init__(self, flat: bool):
        self.flat = flat

    def set_state(self, osd, fqn, key, value):
        if self.flat:
            assert f"state.{fqn}.{key}" in osd
            return {**osd, f"state.{fqn}.{key}": value}
        return {**osd, "state": {**osd["state"], fqn: {**osd["state"][fqn], key: value}}}

    def drop_state(self, osd, fqn):
        if self.flat:
            return {k: v for k, v in osd.items() if not k.startswith(f"state.{fqn}.")}
        return {**osd, "state": {k: v for k, v in osd["state"].items() if k != fqn}}

    def set_lr(self, osd, lr):
        if self.flat:
            return {k: (lr if k.startswith("param_groups.") and k.endswith(".lr") else v) for k, v in osd.items()}
        return {**osd, "param_groups": [{**osd["param_groups"][0], "lr": lr}, *osd["param_groups"][1:]]}


def fault_suite(rank: int, ws: int) -> dict[str, Any]:
    """Every fault in one launch (process-group timeout 10 s: a hang
    would end the case there, not the launch).  Per case: the error on
    this rank, whether anything changed, and whether the group still works
    afterwards (one all_reduce)."""
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=10))
    mesh = init_device_mesh("cpu", (ws,))
    out = {}
    for name, fn in _fault_cases(rank, mesh):
        if os.environ.get("DCP_FAULT_TRACE"):
            print(rank, name, file=sys.stderr, flush=True)
        model, optim = build(mesh)
        src, src_optim = build(mesh, seed=7)
        before = _local_snapshot(model, optim)
        result = _outcome(lambda: fn(model, optim, src, src_optim))
        changed = not _same(before, _local_snapshot(model, optim))
        probe = torch.tensor([rank + 1.0])
        dist.all_reduce(probe)
        out[name] = (result, changed, probe.item() == ws * (ws + 1) / 2)
    return out


def dying_rank_case(rank: int, ws: int, where: str) -> dict[str, Any]:
    """A rank that dies inside a load's collective (``where``: in the
    data stream, or before the first agreement).  Not recoverable without
    torch's help: the survivors' collective fails; what they see is the
    result (timed)."""
    import time

    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=5))
    mesh = init_device_mesh("cpu", (ws,))
    model, optim = build(mesh)
    msd = dcp_optim.get_model_state_dict(model, options=dcp_optim.StateDictOptions(full_state_dict=True))
    if where == "stream":
        from dcp_optim._engine import payload as _payload

        _payload.INLINE_BYTES = 0  # streamed: this small model would travel inline
    if rank == 1:
        from dcp_optim._engine import consistency as _consistency
        from dcp_optim._engine import distribute as _distribute

        def die(*args, **kwargs):
            os._exit(3)

        if where == "stream":  # a broadcast or a scatter of the stream
            _distribute.Route.broadcast = die
            dist.scatter = die
        elif where == "hang":  # alive, but late by more than the timeout
            _consistency.mesh_all_reduce_min = lambda *a, **k: time.sleep(8)
        else:
            _consistency.mesh_all_reduce_min = die
    t0 = time.monotonic()
    if where == "getter":  # rank 0 gets a full dict, rank 1 a sharded one
        full = rank == 0
        result = _outcome(lambda: dcp_optim.get_model_state_dict(
            model, options=dcp_optim.StateDictOptions(full_state_dict=full)))
        if rank == 1:
            time.sleep(7)  # alive, in no collective, past the timeout
        return {"result": result, "seconds": round(time.monotonic() - t0, 1)}
    result = _outcome(lambda: dcp_optim.set_model_state_dict(
        model, msd if rank == 0 else {},
        options=dcp_optim.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)))
    return {"result": result, "seconds": round(time.monotonic() - t0, 1)}


def upstream_failure_case(rank: int, ws: int, which: str) -> dict[str, Any]:
    """Upstream (torch 2.13) on the scenarios of defects 3 (broadcast
    mode), 4 and 5, which end in a hang or a backend abort there: run
    with a 2 s process-group timeout, this rank's result, that of the next
    collective (a barrier, as a training loop's next step would make), and
    how long they took (a rank the backend aborts returns nothing)."""
    import time

    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=2))
    mesh = init_device_mesh("cpu", (ws,))
    U = upstream.StateDictOptions
    full = dcp_optim.StateDictOptions(full_state_dict=True)
    if which == "d3":  # set_state_dict, broadcast, a bad model dict; {} on rank 1
        model, optim = build(mesh)
        src, src_optim = build(mesh, seed=3)
        msd, osd = dcp_optim.get_state_dict(src, src_optim, options=full)
        msd["layers.0.up.bias"] = torch.zeros(3)
        if rank != 0:
            msd, osd = {}, {}

        def call():
            upstream.set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd,
                                    options=U(full_state_dict=True, broadcast_from_rank0=True))
    elif which == "d4":  # rank 0 broadcasts, rank 1 passes {} without broadcast
        model, optim = build(mesh)
        msd = dcp_optim.get_model_state_dict(model, options=full)

        def call():
            upstream.set_model_state_dict(model, msd if rank == 0 else {},
                                          options=U(full_state_dict=True, broadcast_from_rank0=rank == 0))
    else:  # d5: rank 1 holds state, rank 0 none; the checkpoint lacks head.weight's
        src, src_optim = build(mesh, seed=4)
        osd = dcp_optim.get_optimizer_state_dict(src, src_optim, options=full)
        osd = {"state": {k: v for k, v in osd["state"].items() if k != "head.weight"},
               "param_groups": osd["param_groups"]}
        model, optim = build(mesh, seed=1)
        if rank == 0:
            optim.state.clear()

        def call():
            upstream.set_optimizer_state_dict(model, optim, osd if rank == 0 else {},
                                              options=U(full_state_dict=True, broadcast_from_rank0=True))
    t0 = time.monotonic()
    result = _outcome(call)
    # the job goes on: the next collective (a training loop's barrier)
    then = _outcome(dist.barrier)
    return {"result": result, "then": then, "seconds": round(time.monotonic() - t0, 1)}
