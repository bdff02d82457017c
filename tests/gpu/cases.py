"""Shared pieces of the CUDA suite: the device, models, optimizers, the
differential comparisons, and the rank function of the 2-process check
(module level, so that tests.support.harness can start it in worker processes).

The suite runs on ``cuda:0`` under ``make test-gpu`` (``DCP_OPTIM_GPU=1``)
and on the CPU otherwise, so its code paths run in every ``make test``.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as upstream
import torch.nn as nn

import dcp_optim

from ..support.oracle import assert_same_tree

GPU_MODE = os.environ.get("DCP_OPTIM_GPU") == "1"
CPU = torch.device("cpu")


def suite_device() -> torch.device:
    if GPU_MODE:
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return CPU


def is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


# --- model and optimizers ------------------------------------------------------------


class Net(nn.Module):
    """Embedding, two linears, a BatchNorm (float buffers and an int64 0-dim
    counter) and a plain buffer."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.l1 = nn.Linear(8, width)
        self.bn = nn.BatchNorm1d(width)
        self.l2 = nn.Linear(width, 8)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.bn(self.l1(self.emb(ids))))) * self.scale


def make_net(device, *, seed: int = 0, dtype=None, width: int = 32) -> Net:
    """Built on the CPU from ``seed`` and moved: the same values on every
    device."""
    torch.manual_seed(seed)
    net = Net(width)
    return net.to(device=device, dtype=dtype) if dtype is not None else net.to(device)


# name -> (class, kwargs, needs CUDA, low-precision model)
OPTIMS: dict[str, tuple[type, dict[str, Any], bool, bool]] = {
    "adam-foreach": (torch.optim.Adam, {"lr": 1e-2, "foreach": True}, False, False),
    "adamw-fused": (torch.optim.AdamW, {"lr": 1e-2, "fused": True, "weight_decay": 0.01}, False, False),
    "adam-capturable": (torch.optim.Adam, {"lr": 1e-2, "capturable": True, "foreach": False}, True, False),
    "adamw-capturable-foreach": (
        torch.optim.AdamW, {"lr": 1e-2, "capturable": True, "foreach": True}, True, False,
    ),
    "sgd-momentum": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}, False, False),
    "sgd": (torch.optim.SGD, {"lr": 1e-2}, False, False),
    "bf16-adamw-fused": (torch.optim.AdamW, {"lr": 1e-2, "fused": True}, False, True),
    "bf16-adam-foreach": (torch.optim.Adam, {"lr": 1e-2, "foreach": True}, False, True),
}

CAPTURABLE_ON_CPU = (
    "capturable=True steps only on CUDA-like devices (torch asserts it), "
    "so this configuration exists on a GPU only"
)


def build(name: str, device, *, seed: int = 0):
    cls, kwargs, _, low = OPTIMS[name]
    model = make_net(device, seed=seed, dtype=torch.bfloat16 if low else None)
    return model, cls(model.parameters(), **kwargs)


def batch(step: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 16, (12,), generator=g).to(device)


def train(model, optim, start: int, steps: int) -> list[float]:
    losses = []
    for s in range(start, start + steps):
        optim.zero_grad(set_to_none=True)
        device = next(model.parameters()).device
        loss = model(batch(s, device)).float().pow(2).mean()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return losses


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor, else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def step_policy(group: dict[str, Any], param: torch.Tensor, saved: torch.Tensor):
    """Where a loaded ``step`` goes in dcp_optim: float32 on the parameter's
    device when the group is capturable or fused (torch's load policy),
    else on the CPU with its dtype (where a fresh optimizer creates it;
    torch's own load keeps whatever device it came with)."""
    if group.get("capturable") or group.get("fused"):
        return local(param).device, torch.float32
    return CPU, saved.dtype


# --- comparisons ---------------------------------------------------------------------


def cpu_copy(tree: Any) -> Any:
    """Values and placement of a tree, detached onto the CPU (DTensors as
    (placements, local shard))."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, dict):
        return {k: cpu_copy(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(cpu_copy(v) for v in tree)
    if isinstance(tree, DTensor):
        return ("DTensor", tuple(tree.placements), cpu_copy(tree.to_local()))
    if isinstance(tree, torch.Tensor):
        return ("tensor", str(tree.device), tree.dtype, tree.detach().to("cpu", copy=True))
    return tree


def assert_same_values(a: Any, b: Any, path: str = "$") -> None:
    """``cpu_copy`` trees equal: devices, dtypes and bits."""
    assert_same_tree(a, b, path)


def optim_state_by_fqn(model: nn.Module, optim) -> dict[str, dict[str, Any]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: dict(st) for p, st in optim.state.items()}


def live_snapshot(model: nn.Module, optim) -> Any:
    return cpu_copy(
        {"model": dict(model.state_dict()), "optim": optim_state_by_fqn(model, optim)}
    )


def tensors(tree: Any):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from tensors(v)
    elif isinstance(tree, torch.Tensor):
        yield tree


# --- two processes over gloo, CUDA tensors ------------------------------------------


def _attempt(fn):
    try:
        return True, fn()
    except Exception as e:  # noqa: BLE001 - reported to the parent
        return False, f"{type(e).__name__}: {e}"[:400]


def _fsdp2(device, mesh, seed: int):
    from torch.distributed.fsdp import fully_shard

    model = make_net(device, seed=seed)
    fully_shard(model.l1, mesh=mesh)
    fully_shard(model.l2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    return model, optim


def _tp(device, mesh, seed: int):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = make_net(device, seed=seed)
    parallelize_module(model, mesh, {"l1": ColwiseParallel(), "l2": RowwiseParallel()})
    # plain and DTensor parameters mixed: the single-tensor path
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    return model, optim


def _manual_step(model, optim, value: float) -> None:
    """One optimizer step with constant gradients (DTensors where the
    parameters are): no backward, hence no reduce-scatter, which gloo does
    not offer for CUDA tensors."""
    for p in model.parameters():
        p.grad = torch.full_like(p, value)
    optim.step()
    optim.zero_grad(set_to_none=True)


def two_rank_checks(rank: int, world_size: int, device_type: str) -> list[tuple[str, str, str]]:
    """FSDP2 and tensor-parallel DTensors on two ranks of a gloo group,
    with CUDA tensors when ``device_type`` is "cuda" (both ranks share
    cuda:0).  Every check runs upstream and dcp_optim; returns
    [(check, outcome, detail)] with outcome "equal", "differs",
    "dcp_optim-failed" (upstream worked), "upstream-failed" (dcp_optim
    worked), "both-failed" (gloo lacks the collective for this device)
    or "setup-failed" (the model could not be built with gloo on this
    device: nothing compared)."""
    from torch.distributed.device_mesh import init_device_mesh

    if device_type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    else:
        device = CPU
    mesh = init_device_mesh(device_type, (world_size,))
    out = []

    def compare(check: str, run_up, run_ours):
        ok_up, res_up = _attempt(run_up)
        ok_ours, res_ours = _attempt(run_ours)
        if ok_up and ok_ours:
            try:
                assert_same_values(res_ours, res_up)
                out.append((check, "equal", ""))
            except AssertionError as e:
                out.append((check, "differs", str(e)[:400]))
        elif ok_up:
            out.append((check, "dcp_optim-failed", res_ours))
        elif ok_ours:
            out.append((check, "upstream-failed", res_up))
        else:
            out.append((check, "both-failed", f"upstream: {res_up} | dcp_optim: {res_ours}"))

    for label, make in (("fsdp2", _fsdp2), ("tp", _tp)):

        def setup(make=make):
            model, optim = make(device, mesh, 0)
            _manual_step(model, optim, 0.01)
            _manual_step(model, optim, -0.02)
            return model, optim

        ok, built = _attempt(setup)
        if not ok:
            # building the model needs collectives (TP scatters its
            # weights from rank 0) that gloo may not offer for CUDA
            out.append((f"{label} setup", "setup-failed", built))
            continue
        model, optim = built
        for opt_name, opts in (
            ("sharded", {}),
            ("full", {"full_state_dict": True}),
            ("full+offload", {"full_state_dict": True, "cpu_offload": True}),
            ("offload", {"cpu_offload": True}),
        ):
            compare(
                f"{label} get {opt_name}",
                lambda o=opts: cpu_copy(upstream.get_state_dict(model, optim, options=upstream.StateDictOptions(**o))),
                lambda o=opts: cpu_copy(dcp_optim.get_state_dict(model, optim, options=dcp_optim.StateDictOptions(**o))),
            )
        full_opts = {"full_state_dict": True, "cpu_offload": True}
        msd, osd = dcp_optim.get_state_dict(model, optim, options=dcp_optim.StateDictOptions(**full_opts))

        def load(impl, msd=msd, osd=osd, make=make):
            fresh, fopt = make(device, mesh, 1)
            # separate calls: upstream's set_state_dict hangs with {} on
            # the receiving ranks
            opts = impl.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            impl.set_model_state_dict(fresh, copy.deepcopy(msd) if rank == 0 else {}, options=opts)
            impl.set_optimizer_state_dict(fresh, fopt, copy.deepcopy(osd) if rank == 0 else {}, options=opts)
            _manual_step(fresh, fopt, 0.03)
            return live_snapshot(fresh, fopt)

        compare(f"{label} broadcast load + step", lambda: load(upstream), lambda: load(dcp_optim))
        dist.barrier()
    return out
