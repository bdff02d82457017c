"""Full loads of values in any memory layout, against the values
themselves: a seeded random sweep of FSDP2 models (uneven and empty
shards, several dtypes -- complex among them -- and casts), whose full
dicts hold transposed views, strided one-dimensional views, transposed
columns (rows of one element with another stride) and conjugate views
of complex values, loaded by broadcast from rank 0 or from every rank,
through every path of the stream (inline, bucketed broadcast, scattered
rows: steps and point-to-point units) as the seed picks its thresholds.

Upstream is not the oracle here: on gloo it loads such a value's storage
order on the receivers (docs/differences.md, D33).  The truth is the
source's values, cast to each live tensor's dtype."""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import dcp_optim
from dcp_optim._engine import collectives as _collectives
from dcp_optim._engine import payload as _payload
from dcp_optim._engine import scatter_load as _scatter


class _Bag(nn.Module):
    def __init__(self, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype]):
        super().__init__()
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
            self.register_parameter(f"p{i}", nn.Parameter(torch.randn(shape).to(dtype)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _model(shapes, dtypes, ws: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    model = nn.Sequential(*[_Bag(shapes[i::2], dtypes[i::2]) for i in range(2)])
    for bag in model:
        fully_shard(bag, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optim.step()
    optim.zero_grad()
    return model, optim


def _laid_out(value: torch.Tensor, how: str) -> torch.Tensor:
    """``value``'s values in another memory layout (``how``)."""
    if how == "transposed" and value.dim() == 2:
        out = value.t().contiguous().t()
    elif how == "strided" and value.dim() == 1:
        out = torch.stack([value, -value], dim=1)[:, 0]
    elif how == "conjugate" and value.is_complex():
        # the same values behind a conjugate view (its bit set, lazily)
        out = torch.conj_physical(value).conj()
        assert out.is_conj()
    else:
        return value
    assert torch.equal(out, value)
    return out


def layouts_case(rank: int, ws: int, seeds: list[int]) -> list[str]:
    """Per seed, a model's and its Adam state's full load; returns the
    seeds' descriptions (the same on every rank).  Raises on the first
    value that differs from the source's."""
    saved = (_scatter.SCATTER_MIN_CHUNK_BYTES, _scatter.DIRECT_BYTES, _payload.INLINE_BYTES,
             _collectives.set_bucket_bytes(None))
    done = []
    try:
        for seed in seeds:
            rnd = random.Random(seed)
            shapes, dtypes = [], []
            for _ in range(rnd.randint(2, 6)):
                rows = rnd.choice([1, 2, 3, 5, 7, 64, 100, 1027])
                cols = rnd.choice([None, 1, 3, 16, 256])
                shapes.append((rows,) if cols is None else (rows, cols))
                dtypes.append(rnd.choice([torch.float32, torch.bfloat16, torch.float64, torch.complex64]))
            source_dtype = rnd.choice([None, torch.float32, torch.float16])
            _scatter.SCATTER_MIN_CHUNK_BYTES = rnd.choice([1, 64, 1 << 62])
            _scatter.DIRECT_BYTES = rnd.choice([1 << 20, 4096, 512])
            _payload.INLINE_BYTES = rnd.choice([saved[2], 0])
            _collectives.set_bucket_bytes(rnd.choice([None, 8192, 65536]))
            broadcast = rnd.random() < 0.7
            how = rnd.choice(["transposed", "strided", "both"])
            model, optim = _model(shapes, dtypes, ws)
            g = torch.Generator().manual_seed(seed)
            full = dcp_optim.StateDictOptions(full_state_dict=True)
            # complex values travel as they are (a cast to a real dtype
            # would drop their imaginary parts)
            values = {k: torch.randn(tuple(v.shape), generator=g, dtype=v.dtype) if v.is_complex()
                      else torch.randn(tuple(v.shape), generator=g).to(source_dtype or v.dtype)
                      for k, v in dcp_optim.get_model_state_dict(model, options=full).items()}
            sent: dict[str, Any] = {}
            for k, v in values.items():
                if how in ("transposed", "both") and v.dim() == 2:
                    # a transposed column: rows of one element with stride != 1
                    v = _laid_out(v, "transposed")
                if how in ("strided", "both"):
                    v = _laid_out(v, "strided")
                sent[k] = _laid_out(v, "conjugate")
                assert torch.equal(sent[k], values[k])
            opts = dcp_optim.StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
            give = rank == 0 or not broadcast
            dcp_optim.set_model_state_dict(model, sent if give else {}, options=opts)
            for name, p in model.named_parameters():
                got = p.full_tensor()
                assert torch.equal(got, values[name].to(got.dtype)), (seed, name, how)
            osd = dcp_optim.get_optimizer_state_dict(model, optim, options=full)
            moments = {}
            for name, state in osd["state"].items():
                like = state["exp_avg"]
                m = (torch.randn(tuple(like.shape), generator=g, dtype=like.dtype) if like.is_complex()
                     else torch.randn(tuple(like.shape), generator=g).to(like.dtype))
                moments[name] = m
                state["exp_avg"] = _laid_out(_laid_out(_laid_out(m, "transposed"), "strided"), "conjugate")
            dcp_optim.set_optimizer_state_dict(model, optim, osd if give else {}, options=opts)
            params = dict(model.named_parameters())
            for name, m in moments.items():
                got = optim.state[params[name]]["exp_avg"].full_tensor()
                assert torch.equal(got, m.to(got.dtype)), (seed, name, how)
            n_complex = sum(d.is_complex for d in dtypes)
            done.append(f"seed {seed}: {len(shapes)} tensors ({n_complex} complex), {how}, broadcast={broadcast}")
    finally:
        (_scatter.SCATTER_MIN_CHUNK_BYTES, _scatter.DIRECT_BYTES, _payload.INLINE_BYTES, previous) = saved
        _collectives.set_bucket_bytes(previous)
    return done
