"""D30: rank-local non-tensor optimizer values under FSDP2 (2 gloo ranks,
uneven shards), sharded and full gets, and FSDP1's full gets.  Run by tests/distributed/test_rank_local.py, all in one
launch: each scenario's outcome on this rank, as a plain dict."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed.checkpoint.state_dict as upstream
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor

import dcp_optim
from dcp_optim.errors import RankLocalStateError

from ..support.oracle import assert_same_tree
from .dist_cases import MLP, fsdp2_model, train


class LocalSum(torch.optim.SGD):
    """SGD that keeps, like Prodigy, a group value summed over the rank's
    local shards (``d``), and, like GaLore, a per-parameter object built
    from the local shard (``proj``, with ``objects=True``)."""

    def __init__(self, params, objects: bool = False, tensors: str = ""):
        super().__init__(params, lr=0.01)
        self.objects = objects
        self.tensors = tensors  # "group": a 1-element group tensor; "state": a 0-dim state tensor

    @torch.no_grad()
    def step(self, closure=None):
        super().step(closure)
        for group in self.param_groups:
            local = [p.to_local() if isinstance(p, DTensor) else p for p in group["params"]]
            group["d"] = float(sum(t.abs().sum() for t in local))
            if self.objects:
                for p, t in zip(group["params"], local):
                    self.state[p]["proj"] = _Proj(t.clone())
            if self.tensors:
                # plain tensors (as pytorch-optimizer's ASGD keeps its
                # norms under FSDP1): DCP stores them once too
                group["d"] = 1.0
                if self.tensors == "group":
                    group["norm"] = torch.stack([t.float().norm() for t in local]).norm().reshape(1)
                else:
                    for p, t in zip(group["params"], local):
                        self.state[p]["scale"] = t.abs().amax() if t.numel() else torch.tensor(0.0)


class _Proj:
    def __init__(self, matrix: torch.Tensor):
        self.matrix = matrix


def _outcome(fn) -> dict[str, Any]:
    try:
        fn()
    except RankLocalStateError as exc:
        return {"raised": "RankLocalStateError", "key": exc.key, "ranks": exc.ranks, "text": str(exc)}
    except Exception as exc:  # noqa: BLE001 - reported
        return {"raised": type(exc).__name__, "text": str(exc)[:300]}
    return {"raised": None}


def rank_local_fsdp2(rank: int, ws: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (ws,))
    out: dict[str, Any] = {}
    for flat in (False, True):
        fmt = "flat" if flat else "nested"
        opts = dcp_optim.StateDictOptions(flatten_optimizer_state_dict=flat)
        # a group sum of local shards: raises on every rank, naming 'd'
        model = fsdp2_model(mesh, width=8, hidden=7)
        optim = LocalSum(model.parameters())
        train(model, optim)
        out[f"group_sum[{fmt}]"] = _outcome(lambda: dcp_optim.get_optimizer_state_dict(model, optim, options=opts))
        # upstream returns it silently (one rank's value is what DCP saves)
        theirs = upstream.get_optimizer_state_dict(
            model, optim, options=upstream.StateDictOptions(flatten_optimizer_state_dict=flat))
        pg = theirs["param_groups"][0]["d"] if not flat else next(v for k, v in theirs.items() if k.endswith(".d"))
        out[f"upstream_d[{fmt}]"] = pg
        # per-parameter objects built from the local shard
        model = fsdp2_model(mesh, width=8, hidden=7)
        optim = LocalSum(model.parameters(), objects=True)
        train(model, optim)
        for group in optim.param_groups:
            group["d"] = 1.0  # the group value agrees: the object is what differs
        out[f"object[{fmt}]"] = _outcome(lambda: dcp_optim.get_optimizer_state_dict(model, optim, options=opts))
        # small plain tensors computed from the local shards
        for where in ("group", "state"):
            model = fsdp2_model(mesh, width=8, hidden=7)
            optim = LocalSum(model.parameters(), tensors=where)
            train(model, optim)
            out[f"{where}_tensor[{fmt}]"] = _outcome(
                lambda: dcp_optim.get_optimizer_state_dict(model, optim, options=opts))
        # torch.optim: no error, and the dict equals upstream's
        model = fsdp2_model(mesh, width=8, hidden=7)
        optim = torch.optim.AdamW(model.parameters(), lr=0.01)
        train(model, optim)
        ours = dcp_optim.get_optimizer_state_dict(model, optim, options=opts)
        ref = upstream.get_optimizer_state_dict(
            model, optim, options=upstream.StateDictOptions(flatten_optimizer_state_dict=flat))
        assert_same_tree(ref, ours)
        out[f"adamw[{fmt}]"] = {"raised": None}
    # the check can be turned off: the dict comes back
    model = fsdp2_model(mesh, width=8, hidden=7)
    optim = LocalSum(model.parameters())
    train(model, optim)
    full = [dcp_optim.StateDictOptions(full_state_dict=True, cpu_offload=offload) for offload in (False, True)]
    os.environ["DCP_OPTIM_RANK_LOCAL_CHECK"] = "0"
    try:
        out["off"] = _outcome(lambda: dcp_optim.get_optimizer_state_dict(model, optim))
        out["full off"] = _outcome(lambda: dcp_optim.get_optimizer_state_dict(model, optim, options=full[1]))
    finally:
        del os.environ["DCP_OPTIM_RANK_LOCAL_CHECK"]
    # full gets too: the full dict holds rank 0's value for all ranks
    # (upstream's: rank 0's "d", saved once and loaded everywhere)
    for opts in full:
        out[f"fsdp2 full offload={opts.cpu_offload}"] = _outcome(
            lambda: dcp_optim.get_optimizer_state_dict(model, optim, options=opts))
    theirs = upstream.get_optimizer_state_dict(
        model, optim, options=upstream.StateDictOptions(full_state_dict=True, cpu_offload=True))
    out["upstream full d"] = theirs["param_groups"][0]["d"] if rank == 0 else None
    out["own d"] = optim.param_groups[0]["d"]
    # FSDP1, with and without use_orig_params: the group value is checked
    # before the gather (which leaves ranks other than 0 with nothing)
    for orig in (False, True):
        torch.manual_seed(0)
        model = FSDP(MLP(width=8, hidden=7, layers=2), device_id=torch.device("cpu"), use_orig_params=orig)
        optim = LocalSum(model.parameters())
        train(model, optim)
        for opts in full:
            out[f"fsdp1 orig={orig} full offload={opts.cpu_offload}"] = _outcome(
                lambda: dcp_optim.get_optimizer_state_dict(model, optim, options=opts))
        for group in optim.param_groups:
            group["d"] = 1.0  # agreed: the full get goes on
        out[f"fsdp1 orig={orig} agreed"] = _outcome(
            lambda: dcp_optim.get_optimizer_state_dict(model, optim, options=full[1]))
    return out
