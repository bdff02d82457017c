"""Rank functions for tests/distributed/test_wrapper_subclasses.py: full
state dicts of DTensors whose local tensors are a wrapper subclass that
keeps its values in no single byte buffer -- torch's own ``TwoTensor``
(two inner tensors), the kind torchao's ``NF4Tensor`` (quantized data and
scales) and low-bit optimizer states are -- against upstream.

Byte-level bucketing would move one inner tensor's bytes, or fail in the
subclass's dispatch; such tensors take torch's own operations, as
upstream's do: full gets return the subclass, full loads cut it with
``distribute_tensor``, and a broadcast too large to travel inline is
refused on every rank before anything changes (upstream's fails in the
subclass's dispatch, leaving the other ranks in a broken group)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as upstream
import torch.nn as nn
from torch._C import _distributed_c10d as _c10d
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import dcp_optim
from dcp_optim import errors
from dcp_optim._engine.serial_collectives import one_collective_at_a_time

from ..support.oracle import assert_same_tree


def _two(full: torch.Tensor, mesh: Any, placements: list[Any]) -> DTensor:
    """A DTensor over a TwoTensor whose second tensor is ten times the
    first (so that a result holding one for the other is visible)."""
    plain = distribute_tensor(full, mesh, placements)
    local = plain.to_local()
    return DTensor.from_local(TwoTensor(local.clone(), local * 10), mesh, placements,
                              shape=plain.shape, stride=plain.stride())


class _Net(nn.Module):
    """Two wrapped weights (even Shard(0), uneven Shard(1)), a plain
    sharded one, a plain replicated bias."""

    def __init__(self, mesh: Any, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(_two(torch.randn(6, 4, generator=g), mesh, [Shard(0)]))
        self.v = nn.Parameter(_two(torch.randn(3, 5, generator=g), mesh, [Shard(1)]))
        self.u = nn.Parameter(distribute_tensor(torch.randn(4, 4, generator=g), mesh, [Shard(0)]))
        self.b = nn.Parameter(torch.randn(4, generator=g))


def _adam(model: nn.Module) -> torch.optim.Optimizer:
    """Adam with one step's worth of state, written by hand (a TwoTensor
    has no autograd here): its moments follow their parameters' class."""
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    for p in model.parameters():
        def like(scale: float, p: Any = p) -> Any:
            if isinstance(p, DTensor) and isinstance(p.to_local(), TwoTensor):
                local = p.to_local()
                return DTensor.from_local(TwoTensor(local.a * scale, local.b * scale), p.device_mesh,
                                          p.placements, shape=p.shape, stride=p.stride())
            return p.detach() * scale
        optim.state[p] = {"step": torch.tensor(1.0), "exp_avg": like(0.5), "exp_avg_sq": like(0.25)}
    return optim


def _resolved(value: Any) -> Any:
    """A result with its pending collectives waited for: upstream's full
    TwoTensor holds ``AsyncCollectiveTensor`` inners (so does ours: the
    same torch path)."""
    if isinstance(value, AsyncCollectiveTensor):
        return value.wait()
    if isinstance(value, TwoTensor):
        return ("TwoTensor", _resolved(value.a), _resolved(value.b))
    if isinstance(value, dict):
        return {k: _resolved(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolved(v) for v in value]
    if isinstance(value, DTensor):
        return ("DTensor", str(value.placements), _resolved(value.to_local()))
    return value


def _live(model: nn.Module, optim: torch.optim.Optimizer) -> Any:
    return _resolved({"model": dict(model.named_parameters()),
                      "optim": [optim.state[p] for p in model.parameters()]})


class _InFlight(TorchDispatchMode):
    """Records, for each functional collective issued on plain tensors
    while it is active (below dcp_optim's own modes), how many collectives
    were in flight when it started."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func.namespace == "_c10d_functional" and func.__name__ not in ("wait_tensor.default", "_wrap_tensor_autograd.default")
                and all(type(t) is torch.Tensor for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))):
            self.seen.append((func.__name__, _c10d._get_work_registry_size()))
        return func(*args, **kwargs)


def wrapper_case(rank: int, ws: int) -> list[str]:
    mesh = init_device_mesh("cpu", (ws,))
    done = []
    model = _Net(mesh, seed=0)
    optim = _adam(model)
    # the subclass's inner collectives run one at a time: two functional
    # all-gathers in flight on a gloo group corrupt torch's heap (an abort
    # or a segfault one gather in a few thousand); each inner gather of a
    # TwoTensor starts with nothing in flight
    with _InFlight() as watch:
        dcp_optim.get_model_state_dict(model, options=dcp_optim.StateDictOptions(full_state_dict=True))
    inner = [n for n, _ in watch.seen]
    assert inner == ["all_gather_into_tensor.default"] * 4, watch.seen  # w and v, a and b each
    assert all(n == 0 for _, n in watch.seen), watch.seen
    done.append("one collective at a time")
    # full gets, with and without cpu_offload (rank 0 only), as upstream's
    for offload in (False, True):
        for get in ("get_model_state_dict", "get_optimizer_state_dict"):
            args = (model,) if get == "get_model_state_dict" else (model, optim)
            # upstream's gather, its subclass's collectives one at a time
            # as dcp_optim's: two in flight on a gloo group corrupt torch's
            # heap now and then (dcp_optim/_engine/serial_collectives.py)
            with one_collective_at_a_time():
                theirs = getattr(upstream, get)(*args, options=upstream.StateDictOptions(
                    full_state_dict=True, cpu_offload=offload))
            ours = getattr(dcp_optim, get)(*args, options=dcp_optim.StateDictOptions(
                full_state_dict=True, cpu_offload=offload))
            assert_same_tree(_resolved(theirs), _resolved(ours))
            if rank == 0:
                w = ours["w"] if get == "get_model_state_dict" else ours["state"]["w"]["exp_avg"]
                assert isinstance(w, TwoTensor) and not torch.equal(_resolved(w.a), _resolved(w.b)), w
            done.append(f"{get}(offload={offload})")
    # full loads (every rank holds the dict, upstream's full get): the
    # source's values, each rank cutting its own copy (upstream's load
    # scatters rank 0's through the subclass: garbage in an uneven
    # Shard(1) moment at 2 ranks, a broken group at 3, so the source is
    # the oracle here)
    with one_collective_at_a_time():
        full_model = _resolved(upstream.get_model_state_dict(
            model, options=upstream.StateDictOptions(full_state_dict=True)))
        full_optim = upstream.get_optimizer_state_dict(
            model, optim, options=upstream.StateDictOptions(full_state_dict=True))
    rebuilt = {k: TwoTensor(v[1], v[2]) if isinstance(v, tuple) else v for k, v in full_model.items()}
    m = _Net(mesh, seed=5)
    o = _adam(m)
    dcp_optim.set_model_state_dict(m, dict(rebuilt), options=dcp_optim.StateDictOptions(full_state_dict=True))
    dcp_optim.set_optimizer_state_dict(m, o, _copy(full_optim), options=dcp_optim.StateDictOptions(full_state_dict=True))
    assert_same_tree(_live(m, o), _live(model, optim))
    done.append("full loads")
    # broadcasts: refused on every rank, nothing changed
    target = _Net(mesh, seed=2)
    target_optim = _adam(target)
    before = _live(target, target_optim)
    bcast = dcp_optim.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    for what, load, expected in (
        ("model", lambda: dcp_optim.set_model_state_dict(target, dict(rebuilt) if rank == 0 else {}, options=bcast),
         "w is a torch.testing._internal.two_tensor.TwoTensor"),
        ("optimizer", lambda: dcp_optim.set_optimizer_state_dict(
            target, target_optim, _copy(full_optim) if rank == 0 else {}, options=bcast),
         "optimizer state w.exp_avg is a torch.testing._internal.two_tensor.TwoTensor"),
    ):
        try:
            load()
        except errors.StateDictValueError as exc:
            assert f"broadcast_from_rank0=True: {expected}" in str(exc), exc
            assert "raised on rank 0" in str(exc) or rank == 0, exc
        else:
            raise AssertionError(f"rank {rank}: the {what}'s stream of a TwoTensor was not refused")
        assert_same_tree(_live(target, target_optim), before)
    done.append("stream refused")
    dist.barrier()
    return done


def _copy(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _copy(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_copy(v) for v in tree]
    if isinstance(tree, AsyncCollectiveTensor):
        return tree.wait()
    if isinstance(tree, TwoTensor):
        return TwoTensor(_copy(tree.a), _copy(tree.b))
    return tree


def nf4_case(rank: int, ws: int) -> list[str]:
    """torchao's NF4Tensor (QLoRA base weights) under FSDP2: a full get
    raises upstream's ``NotImplementedError`` on every rank -- the
    subclass has no all-gather -- naming the parameter; its sharded get
    and DCP round trip work (the way to save it)."""
    from torch.distributed.fsdp import fully_shard
    from torchao.dtypes.nf4tensor import linear_nf4, to_nf4

    class QLoRA(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(to_nf4(torch.randn(256, 256)), requires_grad=False)
            self.lora = nn.Linear(256, 256, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return linear_nf4(x, self.weight) + self.lora(x)

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    model = nn.Sequential(QLoRA())
    fully_shard(model, mesh=mesh)
    out = []
    for name, impl in (("upstream", upstream), ("dcp_optim", dcp_optim)):
        try:
            impl.get_model_state_dict(model, options=impl.StateDictOptions(full_state_dict=True))
        except NotImplementedError as exc:
            out.append(f"{name}: NotImplementedError")
            if name == "dcp_optim":
                assert str(exc).startswith("full state dict: 0.weight is a DTensor over "
                                           "torchao.dtypes.nf4tensor.NF4Tensor, which torch cannot gather"), exc
    sharded = dcp_optim.get_model_state_dict(model)
    assert type(sharded["0.weight"].to_local()).__name__ == "NF4Tensor"
    dist.barrier()
    return out
