"""Rank functions for the adoption tests (patching a real client,
post-load verification, sharded checkpoints for the converter), run by
tests.support.harness.run_ranks.  Each returns plain data.

Also holds the ``plan`` / ``convert --entry`` functions the CLI tests
import (``tests.distributed.dist_cases_adoption:plan_entry``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import dcp_optim
from dcp_optim import verify as dverify
from dcp_optim._engine import checksums as _checksums

from .dist_cases import Block

WIDTH, HIDDEN = 8, 7  # 7 rows over 2 ranks: uneven shards


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block(WIDTH, HIDDEN) for _ in range(2))
        self.head = nn.Linear(WIDTH, 3, bias=False)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x).pow(2).mean()


def build(ws: int, seed: int = 0, sharded: bool | None = None):
    """Net + AdamW with two param groups (decay / no decay, custom key)."""
    torch.manual_seed(seed)
    model = Net()
    if sharded if sharded is not None else ws > 1:
        mesh = init_device_mesh("cpu", (ws,))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    other = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    optim = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1, "tag": "decay"}, {"params": other, "weight_decay": 0.0}],
        lr=0.01,
    )
    return model, optim


def train(model, optim, steps: int, start: int = 0) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(100 + step)
        loss = model(torch.randn(4, WIDTH, generator=g))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def full_state(model, optim) -> dict[str, Any]:
    """Full (gathered) model and optimizer state as plain bit-exact data."""
    msd, osd = dcp_optim.get_state_dict(
        model, optim, options=dcp_optim.StateDictOptions(full_state_dict=True)
    )

    def plain(v):
        if isinstance(v, torch.Tensor):
            t = v.detach().reshape(-1)
            return (str(v.dtype), list(v.shape), t.view(torch.int32).tolist() if t.element_size() == 4 else t.tolist())
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [plain(x) for x in v]
        return v

    return {"model": plain(msd), "optim": plain(osd)}


# --- plan / convert entries (single process) -------------------------------------------


def plan_entry():
    return build(1, seed=3, sharded=False)


def plan_entry_changed():
    model, _ = build(1, seed=3, sharded=False)
    model.head = nn.Linear(WIDTH, 4, bias=False)  # shape conflict
    optim = torch.optim.AdamW(model.parameters(), lr=0.5)  # one group, other lr
    return model, optim


# --- patching a real client: HuggingFace Accelerate's FSDP2 helpers ------------------------


_SPIED = ("get_model_state_dict", "get_optimizer_state_dict", "set_model_state_dict",
          "set_optimizer_state_dict")
_UPSTREAM_INTERNALS = ("_get_model_state_dict", "_load_model_state_dict",
                       "_get_optim_state_dict", "_load_optim_state_dict")


def _spy(module, names, counts):
    saved = {}
    for name in names:
        fn = getattr(module, name)
        saved[name] = fn

        def spy(*args, __fn=fn, __name=name, **kwargs):
            counts[__name] = counts.get(__name, 0) + 1
            return __fn(*args, **kwargs)

        setattr(module, name, spy)
    return saved


def accelerate_fsdp2_resume(rank: int, ws: int, path: str) -> dict[str, Any]:
    """Accelerate's own save_fsdp_model / save_fsdp_optimizer and
    load_fsdp_model / load_fsdp_optimizer (FSDP2, SHARDED_STATE_DICT, DCP)
    under dcp_optim.patch(): the resumed state equals the saved one, and
    dcp_optim's functions -- not upstream's -- did the work."""
    import accelerate
    import torch.distributed.checkpoint.state_dict as upstream
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import (
        load_fsdp_model,
        load_fsdp_optimizer,
        save_fsdp_model,
        save_fsdp_optimizer,
    )

    import dcp_optim.state_dict as ours

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(ws), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(ws), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == ws and accelerator.process_index == rank
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")

    ours_calls: dict[str, int] = {}
    upstream_calls: dict[str, int] = {}
    saved_ours = _spy(ours, _SPIED, ours_calls)
    saved_up = _spy(upstream, _UPSTREAM_INTERNALS, upstream_calls)
    try:
        model, optim = build(ws)
        train(model, optim, 2)
        with dcp_optim.patch() as handle:
            assert handle.applied
            assert dcp_optim.patching.is_patched_function(upstream.get_optimizer_state_dict)
            save_fsdp_model(plugin, accelerator, model, path)
            save_fsdp_optimizer(plugin, accelerator, optim, model, path)
            saved_state = full_state(model, optim)
            reference = train(model, optim, 2, start=2)

            model2, optim2 = build(ws, seed=7)  # other init, never stepped
            load_fsdp_model(plugin, accelerator, model2, path)
            load_fsdp_optimizer(plugin, accelerator, optim2, model2, path)
            # dcp_optim's own calls made by full_state above are counted too;
            # count the client's calls separately
            client_calls = dict(ours_calls)
            loaded_state = full_state(model2, optim2)
            resumed = train(model2, optim2, 2, start=2)
        assert not dcp_optim.patching.is_patched()
        assert upstream.get_state_dict is not None and not dcp_optim.patching.is_patched_function(
            upstream.get_state_dict
        )
    finally:
        for name, fn in saved_ours.items():
            setattr(ours, name, fn)
        for name, fn in saved_up.items():
            setattr(upstream, name, fn)
    return {
        "accelerate": accelerate.__version__,
        "client_calls": client_calls,
        "upstream_internal_calls": upstream_calls,
        "state_equal": saved_state == loaded_state,
        "state_entries": len(saved_state["optim"]["state"]),
        "reference": reference,
        "resumed": resumed,
        "files": sorted(os.listdir(path)),
    }


# --- verification ---------------------------------------------------------------------------


def _geometry_cases(rank: int, ws: int) -> list[str]:
    """Partial checksums of DTensors of every placement kind add up to the
    checksum of the full tensor."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    done = []
    mesh1 = init_device_mesh("cpu", (ws,))
    mesh2 = init_device_mesh("cpu", (ws, 1), mesh_dim_names=("a", "b"))
    mesh2b = init_device_mesh("cpu", (1, ws), mesh_dim_names=("c", "d"))
    g = torch.Generator().manual_seed(5)
    uneven = torch.randn(7, 5, 3, generator=g)  # 7 and 5 do not divide by 2
    even = torch.randn(8, 6, generator=g)  # torch shards _StridedShard evenly only
    cases = [
        ("shard0", mesh1, [Shard(0)], uneven),
        ("shard1", mesh1, [Shard(1)], uneven),
        ("shard2", mesh1, [Shard(2)], uneven),
        ("replicate", mesh1, [Replicate()], uneven),
        ("strided", mesh1, [_StridedShard(0, split_factor=2)], even),
        ("2d", mesh2, [Shard(0), Shard(1)], uneven),
        ("2d-rep", mesh2b, [Replicate(), Shard(1)], uneven),
    ]
    for name, mesh, placements, full in cases:
        expected = dverify.tensor_checksum(full)
        dt = distribute_tensor(full, mesh, placements)
        e = _checksums._entry("model", name, "", dt)
        entries = [e]
        _checksums._reduce(entries, 0)
        assert (e.lo, e.hi) == expected, (name, (e.lo, e.hi), expected)
        try:
            assert torch.equal(dt.full_tensor(), full)
        except ValueError:  # torch 2.11's redistribute refuses a 1-D _StridedShard
            assert name == "strided", name
        done.append(name)
    return done


def verify_save(rank: int, ws: int, path: str) -> dict[str, Any]:
    """FSDP2 training, checkpoint with the checksums stored alongside."""
    geometry = _geometry_cases(rank, ws)
    model, optim = build(ws)
    train(model, optim, 3)
    sums = dverify.checksums(model, optim)
    msd, osd = dcp_optim.get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd, "checksums": sums}, checkpoint_id=path)
    return {"geometry": geometry, "checksums": sums, "full": full_state(model, optim)}


def _load(ws: int, path: str, flat: bool = False):
    model, optim = build(ws, seed=11)
    options = dcp_optim.StateDictOptions(flatten_optimizer_state_dict=flat)
    msd, osd = dcp_optim.get_state_dict(model, optim, options=options)
    state = {"model": msd, "optim": osd, "checksums": dverify.template()}
    dcp.load(state, checkpoint_id=path)
    dcp_optim.set_state_dict(model, optim, model_state_dict=state["model"],
                             optim_state_dict=state["optim"], options=options)
    return model, optim, state["checksums"]


def _expect_mismatch(model, optim, expected) -> str:
    try:
        dverify.verify(model, optim, expected)
    except dverify.ChecksumMismatchError as exc:
        assert isinstance(exc, dcp_optim.errors.StateDictValueError)
        return str(exc)
    raise AssertionError("a corrupted state passed verification")


def verify_load(rank: int, ws: int, path: str, flat_path: str | None) -> dict[str, Any]:
    """Load (resharded: any ws), verify; at ws > 1 also corrupt one shard
    of an optimizer state and of a parameter and check every rank raises
    naming them."""
    model, optim, expected = _load(ws, path)
    checked = dverify.verify(model, optim, expected)
    out: dict[str, Any] = {"checked": checked, "recomputed": dverify.checksums(model, optim),
                           "full": full_state(model, optim)}
    if flat_path is not None:
        # a sharded checkpoint converted to the flat layout loads bit-identically
        model_f, optim_f, expected_f = _load(ws, flat_path, flat=True)
        dverify.verify(model_f, optim_f, expected_f)
        out["flat_full"] = full_state(model_f, optim_f)
    if ws > 1:
        fqn = "blocks.1.up.weight"
        param = dict(model.named_parameters())[fqn]
        exp_avg = optim.state[param]["exp_avg"]
        assert isinstance(exp_avg, DTensor)
        local = exp_avg.to_local()
        original = local.view(-1)[0].clone()
        if rank == 1:  # a single element of one rank's shard
            with torch.no_grad():
                local.view(-1)[0] += 1.0
        out["optim_error"] = _expect_mismatch(model, optim, expected)
        with torch.no_grad():
            local.view(-1)[0] = original
        dverify.verify(model, optim, expected)  # restored
        weight = dict(model.named_parameters())["head.weight"]
        if rank == 0:
            with torch.no_grad():
                weight.to_local().view(-1)[-1] *= -1.0
        out["model_error"] = _expect_mismatch(model, optim, expected)
        if rank == 0:
            with torch.no_grad():
                weight.to_local().view(-1)[-1] *= -1.0
        # a plain tensor every rank holds ("step") corrupted on one rank only
        step = optim.state[param]["step"]
        if rank == 1:
            step.add_(1)
        out["step_error"] = _expect_mismatch(model, optim, expected)
    dist.barrier()
    return out
