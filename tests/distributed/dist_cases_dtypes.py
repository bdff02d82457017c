"""Rank functions for tests/distributed/test_gloo_dtypes.py: DTensors of
dtypes gloo's collectives do not take (float8: "Invalid scalar type").

Upstream gathers and scatters each tensor with a collective of its own
dtype, which gloo refuses for float8; dcp_optim's gathers, cuts and
streams move bytes.  The truth is the source's values."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as upstream
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import dcp_optim

from ..support.oracle import assert_same_tree

DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.bool)


def _module(mesh: Any, rank: int, ws: int, seed: int) -> nn.Module:
    """Buffers of each dtype, 7 x 3 sharded on dim 0 (uneven), built from
    the same full values on every rank without a collective."""
    g = torch.Generator().manual_seed(seed)
    module = nn.Module()
    for i, dtype in enumerate(DTYPES):
        full = torch.randn(7, 3, generator=g) * 4
        full = full > 0 if dtype is torch.bool else full.to(dtype)
        local = full.chunk(ws, 0)[rank].clone() if rank < len(full.chunk(ws, 0)) else full[:0].clone()
        module.register_buffer(f"b{i}", DTensor.from_local(local, mesh, [Shard(0)], shape=full.shape,
                                                           stride=full.stride()))
    return module


def _locals(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.to_local().clone() for k, v in module.state_dict().items()}


def gloo_dtypes_case(rank: int, ws: int) -> list[str]:
    mesh = init_device_mesh("cpu", (ws,))
    source = _module(mesh, rank, ws, seed=0)
    want = {f"b{i}": v.full_tensor() if v.dtype not in DTYPES[:2] else None
            for i, v in enumerate(source.state_dict().values())}
    out = []
    # upstream: gloo refuses the float8 collectives
    try:
        upstream.get_model_state_dict(source, options=upstream.StateDictOptions(full_state_dict=True))
        out.append("upstream get: ok")
    except RuntimeError as exc:
        assert "Invalid scalar type" in str(exc), exc
        out.append("upstream get: Invalid scalar type")
    # dcp_optim: the full tensors are the shards put together, bit for bit
    full = dcp_optim.get_model_state_dict(source, options=dcp_optim.StateDictOptions(full_state_dict=True))
    for (key, value), shard in zip(full.items(), _locals(source).values()):
        assert value.dtype == shard.dtype and value.shape == (7, 3), (key, value)
        mine = value.chunk(ws, 0)[rank] if rank < len(value.chunk(ws, 0)) else value[:0]
        assert torch.equal(mine.view(torch.uint8), shard.view(torch.uint8)), key
        if want[key] is not None:
            assert torch.equal(value, want[key]), key
    out.append("get: the shards")
    # full loads, from every rank's copy and broadcast from rank 0
    for bcast in (False, True):
        target = _module(mesh, rank, ws, seed=1)
        opts = dcp_optim.StateDictOptions(full_state_dict=True, broadcast_from_rank0=bcast)
        dcp_optim.set_model_state_dict(target, dict(full) if rank == 0 or not bcast else {}, options=opts)
        assert_same_tree({k: v.view(torch.uint8) for k, v in _locals(target).items()},
                         {k: v.view(torch.uint8) for k, v in _locals(source).items()})
        out.append(f"load (broadcast={bcast}): the source's shards")
    dist.barrier()
    return out
