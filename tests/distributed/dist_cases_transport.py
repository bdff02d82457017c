"""Broadcast loads whose tensors travel as their own collectives (at least
a MiB of rows, sent from the source's tensor itself) beside packed small
ones: bit-identical to upstream's load."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint.state_dict as upstream
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import dcp_optim
from dcp_optim._engine import collectives as _collectives

from ..support.models import adam_after_one_step, fsdp2_with_adam_step


def _model(ws: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    # 1027 rows: uneven shards at 2 and 3 ranks; 2 MiB+ weights beside
    # small biases and a 64-row layer
    model = nn.Sequential(nn.Linear(512, 1027), nn.Linear(1027, 64), nn.Linear(64, 1027, bias=False))
    optim = fsdp2_with_adam_step(model, mesh)
    return model, optim


def _full_source(model: nn.Module, rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    out: dict[str, Any] = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        value = torch.randn(tuple(p.shape), generator=g)
        if i == 2 and value.dim() == 2:
            # a non-contiguous source value (packed, not sent from itself)
            value = torch.randn(tuple(reversed(p.shape)), generator=g).t()
        out[name] = value
    return out


def _random_optim_source(model: nn.Module, optim: torch.optim.Optimizer, rank: int, g: torch.Generator) -> dict:
    """The source's full optimizer dict of a broadcast load (rank 0; {}
    elsewhere): the optimizer's own, every state tensor of a dimension
    replaced by random values."""
    off = dcp_optim.StateDictOptions(full_state_dict=True, cpu_offload=True)
    osd = dcp_optim.get_optimizer_state_dict(model, optim, options=off)
    if rank != 0:
        return {}
    for state in osd["state"].values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.dim():
                state[k] = torch.randn(tuple(v.shape), generator=g)
    return osd


def _locals(model: nn.Module) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in model.parameters()]


def direct_broadcast_case(rank: int, ws: int, bucket_mb: float | None) -> list[str]:
    """Model and optimizer broadcast loads, dcp_optim against upstream on
    twin models, bit for bit (``bucket_mb``: None adaptive, else fixed;
    small budgets split the large tensors into row chunks)."""
    ours_m, ours_o = _model(ws)
    theirs_m, theirs_o = _model(ws)
    expected = _full_source(ours_m, rank)
    full = expected if rank == 0 else {}
    previous = _collectives.set_bucket_bytes(None if bucket_mb is None else int(bucket_mb * 2**20))
    done = []
    try:
        opts = dcp_optim.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        up = upstream.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        dcp_optim.set_model_state_dict(ours_m, dict(full), options=opts)
        upstream.set_model_state_dict(theirs_m, dict(full), options=up)
        for (name, p), q in zip(ours_m.named_parameters(), theirs_m.parameters(), strict=True):
            got = p.full_tensor()
            assert torch.equal(got.view(torch.int32), expected[name].contiguous().view(torch.int32)), name
            if name != "1.weight":  # upstream (torch 2.13) loads this non-contiguous source value differently
                assert torch.equal(got, q.full_tensor()), name
        done.append("model")
        osd = _random_optim_source(ours_m, ours_o, rank, torch.Generator().manual_seed(11))
        dcp_optim.set_optimizer_state_dict(ours_m, ours_o, osd, options=opts)
        upstream.set_optimizer_state_dict(theirs_m, theirs_o, osd, options=up)
        for (pa, sa), (pb, sb) in zip(ours_o.state.items(), theirs_o.state.items(), strict=True):
            assert pa.shape == pb.shape
            for k in sa:
                a, b = sa[k], sb[k]
                a = a.to_local() if hasattr(a, "to_local") else a
                b = b.to_local() if hasattr(b, "to_local") else b
                assert torch.equal(a, b), k
        done.append("optim")
    finally:
        _collectives.set_bucket_bytes(previous)
    return done


def _scatter_model(ws: int, shard_dim_of_first: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """FSDP2 layers of every kind a scatter meets: a weight of 2 MiB (1027
    rows: uneven at 2 and 3 ranks), smaller weights, a weight of 2 rows of
    64 KiB (a rank without rows at 3), biases and a layer of 2 small rows
    (chunks under ``SCATTER_MIN_CHUNK_BYTES``: broadcast), and BatchNorm,
    whose running statistics are plain tensors (broadcast) and whose
    counter is 0-dim.  ``shard_dim_of_first``: the dim FSDP2 shards the
    first layer on."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(512, 1027), nn.Linear(1027, 64), nn.Linear(64, 1027, bias=False), nn.Linear(3, 2),
        nn.Linear(16384, 2, bias=False), nn.BatchNorm1d(5),
    )
    for i, layer in enumerate(model):
        dim = shard_dim_of_first if i == 0 else 0
        fully_shard(layer, mesh=mesh, shard_placement_fn=lambda p, dim=dim: Shard(min(dim, p.dim() - 1)))
    fully_shard(model, mesh=mesh)
    return model, adam_after_one_step(model)


def scatter_case(rank: int, ws: int, bucket_kib: int | None) -> dict[str, Any]:
    """Broadcast loads of a model and its Adam state where every
    parameter is sharded on dim 0 over the whole group: each rank receives
    its own rows by ``scatter`` where its chunk is large enough (the
    others, and BatchNorm's plain buffers, are broadcast), bit for bit as
    upstream's broadcast loads.  Returns the collectives counted on each
    load."""
    from .dist_cases import CollectiveCounter

    ours_m, ours_o = _scatter_model(ws)
    theirs_m, theirs_o = _scatter_model(ws)
    g = torch.Generator().manual_seed(5)
    full_m = {k: torch.randn(tuple(v.shape), generator=g) if v.dim() else v
              for k, v in dcp_optim.get_model_state_dict(
                  ours_m, options=dcp_optim.StateDictOptions(full_state_dict=True)).items()}
    # a non-contiguous source value (its rows are copied, not sent as views)
    w = full_m["1.weight"]
    full_m["1.weight"] = torch.randn(tuple(reversed(w.shape)), generator=g).t()
    opts = dcp_optim.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    up = upstream.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    previous = _collectives.set_bucket_bytes(None if bucket_kib is None else bucket_kib * 1024)
    counts = {}
    try:
        with CollectiveCounter() as seen:
            dcp_optim.set_model_state_dict(ours_m, dict(full_m) if rank == 0 else {}, options=opts)
        counts["model"] = dict(seen.counts)
        upstream.set_model_state_dict(theirs_m, dict(full_m) if rank == 0 else {}, options=up)
        for (name, a), b in zip(ours_m.state_dict().items(), theirs_m.state_dict().values(), strict=True):
            a = a.full_tensor() if hasattr(a, "full_tensor") else a
            b = b.full_tensor() if hasattr(b, "full_tensor") else b
            assert torch.equal(a, full_m[name]), name
            if name != "1.weight":  # upstream (torch 2.13) loads this non-contiguous source value differently
                assert torch.equal(a, b), name
        osd = _random_optim_source(ours_m, ours_o, rank, g)
        with CollectiveCounter() as seen:
            dcp_optim.set_optimizer_state_dict(ours_m, ours_o, osd, options=opts)
        counts["optim"] = dict(seen.counts)
        upstream.set_optimizer_state_dict(theirs_m, theirs_o, osd, options=up)
        for sa, sb in zip(ours_o.state.values(), theirs_o.state.values(), strict=True):
            for k in sa:
                a, b = sa[k], sb[k]
                a = a.full_tensor() if hasattr(a, "full_tensor") else a
                b = b.full_tensor() if hasattr(b, "full_tensor") else b
                assert torch.equal(a, b), k
    finally:
        _collectives.set_bucket_bytes(previous)
    return counts


def scatter_layout_mismatch_case(rank: int, ws: int) -> dict[str, int]:
    """The last rank's FSDP2 shards the first layer on dim 1, the others
    on dim 0: the source would scatter what that rank expects broadcast.
    The ranks learn it at the load's agreement and broadcast every
    tensor, each rank keeping its shard as its own layout says: as
    upstream's load, bit for bit.  Returns the collectives counted."""
    from .dist_cases import CollectiveCounter

    dim = 1 if rank == ws - 1 else 0
    ours, _ = _scatter_model(ws, shard_dim_of_first=dim)
    theirs, _ = _scatter_model(ws, shard_dim_of_first=dim)
    g = torch.Generator().manual_seed(3)
    # (dcp_optim's full getter would raise here: getters agree on layouts)
    full = {k: torch.randn(tuple(v.shape), generator=g) if v.dim() else v.clone()
            for k, v in ours.state_dict().items()}
    opts = dcp_optim.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    up = upstream.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    with CollectiveCounter() as seen:
        dcp_optim.set_model_state_dict(ours, dict(full) if rank == 0 else {}, options=opts)
    upstream.set_model_state_dict(theirs, dict(full) if rank == 0 else {}, options=up)
    for (name, a), b in zip(ours.state_dict().items(), theirs.state_dict().values(), strict=True):
        a = a.to_local() if hasattr(a, "to_local") else a
        b = b.to_local() if hasattr(b, "to_local") else b
        assert torch.equal(a, b), name
    return dict(seen.counts)
