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

from ..support.models import fsdp2_with_adam_step


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
        off = dcp_optim.StateDictOptions(full_state_dict=True, cpu_offload=True)
        osd = dcp_optim.get_optimizer_state_dict(ours_m, ours_o, options=off)
        g = torch.Generator().manual_seed(11)
        if rank == 0:
            for state in osd["state"].values():
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and v.dim():
                        state[k] = torch.randn(tuple(v.shape), generator=g)
        else:
            osd = {}
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
