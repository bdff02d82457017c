"""Rank functions for the distributed tests (run by tests.support.harness.run_ranks).

Each function runs on every rank of a fresh gloo group, goes through
several sub-configurations in one launch (launching processes dominates
the cost), compares dcp_optim with upstream on twin objects where upstream
is right, asserts the corrected behaviour where it is not, and returns
plain data.
"""

from __future__ import annotations

import gc
import os
import resource
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as upstream
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import dcp_optim
from dcp_optim import StateDictOptions as Opts
from dcp_optim._engine import collectives as _collectives
from dcp_optim._engine import distribute as _distribute

from ..support.oracle import assert_same_optimizers, assert_same_tree, params_snapshot

# --- models ----------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(x + self.down(torch.relu(self.up(x))))


class MLP(nn.Module):
    """Uneven widths on purpose (7 and 5 do not divide by 2 or 3)."""

    def __init__(self, width: int = 8, hidden: int = 7, layers: int = 2, frozen: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(Block(width, hidden) for _ in range(layers))
        self.head = nn.Linear(width, 5, bias=False)
        if frozen:
            for p in self.layers[0].parameters():
                p.requires_grad_(False)

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return self.head(x).pow(2).mean()


def fsdp2_model(mesh, seed=0, frozen=False, reshard=True, layers=2, width=8, hidden=7):
    torch.manual_seed(seed)
    model = MLP(width=width, hidden=hidden, layers=layers, frozen=frozen)
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model


def fsdp2_per_param_mesh_model(mesh2d, seed=0):
    """FSDP2 with a mesh per parameter (torch 2.12+, ``ShardPlacementResult``):
    the blocks' ``up`` weights -- the "experts" -- are sharded over the
    inner dimension of a 2-D mesh and replicated over the outer one, every
    other parameter over the whole world (the default mesh).  On the
    default group every parameter is fully sharded; the experts' DTensors
    live on a mesh of their own."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult

    torch.manual_seed(seed)
    model = MLP(width=8, hidden=8, layers=2)
    world = init_device_mesh("cpu", (mesh2d.size(),))
    experts = {id(block.up.weight) for block in model.layers}
    inner = FSDPMeshInfo(mesh=mesh2d["ep"], shard_mesh_dim=0)

    def placement(param):
        return ShardPlacementResult(placement=Shard(0), mesh_info=inner) if id(param) in experts else None

    for block in model.layers:
        fully_shard(block, mesh=world, shard_placement_fn=placement)
    fully_shard(model, mesh=world)
    meshes = {name: p.device_mesh.mesh.tolist() for name, p in model.named_parameters()}
    assert all((meshes[n] == mesh2d["ep"].mesh.tolist()) == (".up.weight" in n) for n in meshes), meshes
    return model


def fsdp2_float8_model(mesh, seed=0):
    """FSDP2 over torchao's float8 training (``convert_to_float8_training``
    with float8 all-gathers): the blocks' weights are DTensors whose local
    tensors are torchao's ``WeightWithDynamicFloat8CastTensor`` subclass.
    Width 16: float8 matmuls need dimensions divisible by 16 (the head,
    16 -> 5, stays a plain Linear)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(seed)
    model = MLP(width=16, hidden=32, layers=2)
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                               module_filter_fn=lambda module, fqn: fqn != "head")
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    subclass = {type(p.to_local()).__name__ for p in model.layers.parameters() if p.dim() == 2}
    assert subclass == {"WeightWithDynamicFloat8CastTensor"}, subclass
    return model


def tp_model(mesh, seed=0):
    torch.manual_seed(seed)
    model = MLP(width=8, hidden=8, layers=2)
    for block in model.layers:
        parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def fsdp_tp_model(mesh2d, seed=0):
    torch.manual_seed(seed)
    model = MLP(width=8, hidden=8, layers=2)
    for block in model.layers:
        parallelize_module(block, mesh2d["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh2d["dp"])
    fully_shard(model, mesh=mesh2d["dp"])
    return model


def plain_model(seed=0, hidden=7):
    torch.manual_seed(seed)
    return MLP(width=8, hidden=hidden, layers=2)


def make_optimizer(model, kind="adam", groups=1):
    params = [p for p in model.parameters() if p.requires_grad]
    if groups > 1:
        chunks = [params[i::groups] for i in range(groups)]
        spec = [{"params": c, "lr": 0.01 * (i + 1)} for i, c in enumerate(chunks) if c]
    else:
        spec = [{"params": params}]
    if kind == "adamw":
        return torch.optim.AdamW(spec, lr=0.01, weight_decay=0.1)
    if kind == "sgd":
        return torch.optim.SGD(spec, lr=0.01, momentum=0.9)
    return torch.optim.Adam(spec, lr=0.01)


def train(model, optim, steps=2, seed=0, batch=4, width=8):
    for step in range(steps):
        # the same global batch on every rank keeps data-parallel replicas
        # comparable with a single-process run
        g = torch.Generator().manual_seed(seed * 100 + step)
        x = torch.randn(batch, width, generator=g)
        model(x).backward()
        optim.step()
        optim.zero_grad()


def _betas_to_tuples(optim):
    # D8 in docs/differences.md: upstream's full load turns tuples into lists
    for g in optim.param_groups:
        if isinstance(g.get("betas"), list):
            g["betas"] = tuple(g["betas"])


def _assert_state_like_params(optim, *, skip_frozen=True):
    """D9: state tensors of a DTensor parameter are DTensors with its mesh
    and placements; step is a plain CPU scalar."""
    for group in optim.param_groups:
        for p in group["params"]:
            st = optim.state.get(p, {})
            for key, value in st.items():
                if not isinstance(value, torch.Tensor):
                    continue
                if key == "step":
                    assert not isinstance(value, DTensor) and value.device.type == "cpu", key
                    continue
                if isinstance(p, DTensor) and value.shape == p.shape:
                    assert isinstance(value, DTensor), (key, type(value))
                    assert value.placements == p.placements, (key, value.placements, p.placements)
                    assert value.device_mesh == p.device_mesh


# --- sharded state dicts vs upstream ---------------------------------------------


def _aten_copies(fn):
    """(fn(), number of aten.copy_ calls it dispatched)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = [0]

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.copy_.default:
                counts[0] += 1
            return func(*args, **(kwargs or {}))

    with Mode():
        result = fn()
    return result, counts[0]


def _self_load_like_upstream(mu, ou, md, od) -> None:
    """The DCP resume's load: set_state_dict of the views get_state_dict
    returned (DCP loads into them in place).  Same parameters, optimizer
    state, report and version counters as upstream's, and dcp_optim copies
    nothing (torch's load copies every tensor onto itself)."""
    msd_u, osd_u = upstream.get_state_dict(mu, ou)
    msd_d, osd_d = dcp_optim.get_state_dict(md, od)
    before_u = [p._version for p in mu.parameters()]
    before_d = [p._version for p in md.parameters()]
    report_u, copies_u = _aten_copies(
        lambda: upstream.set_state_dict(mu, ou, model_state_dict=msd_u, optim_state_dict=osd_u)
    )
    report_d, copies_d = _aten_copies(
        lambda: dcp_optim.set_state_dict(md, od, model_state_dict=msd_d, optim_state_dict=osd_d)
    )
    assert copies_u >= len(before_u) and copies_d == 0, (copies_u, copies_d)
    assert (list(report_u.missing_keys), list(report_u.unexpected_keys)) == (
        list(report_d.missing_keys), list(report_d.unexpected_keys))
    bumps_u = [p._version - v for p, v in zip(mu.parameters(), before_u)]
    bumps_d = [p._version - v for p, v in zip(md.parameters(), before_d)]
    assert bumps_u == bumps_d, (bumps_u, bumps_d)
    assert_same_tree(params_snapshot(mu), params_snapshot(md))
    assert_same_optimizers(ou, od, skip_frozen=True)
    _optim_self_load_like_upstream(mu, ou, md, od)


def _state_objects(optim) -> list[tuple[int, str, int]]:
    return [(i, k, id(v)) for i, s in enumerate(optim.state.values()) for k, v in s.items()]


def _optim_self_load_like_upstream(mu, ou, md, od) -> None:
    """The optimizer half of the DCP resume alone: set_optimizer_state_dict
    of what get_optimizer_state_dict returned (the optimizer's own state
    tensors).  Upstream's load (Optimizer.load_state_dict) keeps every
    state tensor object (its casts return them unchanged); dcp_optim's
    install proves that without casting and must keep the same objects,
    install the same state and groups, and take the same next step."""
    held_u, held_d = _state_objects(ou), _state_objects(od)
    osd_u = upstream.get_optimizer_state_dict(mu, ou)
    osd_d = dcp_optim.get_optimizer_state_dict(md, od)
    upstream.set_optimizer_state_dict(mu, ou, osd_u)
    dcp_optim.set_optimizer_state_dict(md, od, osd_d)
    assert _state_objects(ou) == held_u and _state_objects(od) == held_d
    assert_same_optimizers(ou, od, skip_frozen=True)
    assert_same_tree(upstream.get_optimizer_state_dict(mu, ou), dcp_optim.get_optimizer_state_dict(md, od))
    train(mu, ou, steps=1, seed=11)
    train(md, od, steps=1, seed=11)
    assert_same_tree(params_snapshot(mu), params_snapshot(md))
    assert_same_optimizers(ou, od, skip_frozen=True)


def compare_sharded_suite(rank: int, ws: int, kind: str) -> list[str]:
    """Sharded (default), full, full+cpu_offload and flattened getters, and
    the sharded, full and broadcast setters, against upstream."""
    dist.barrier()
    done = []
    if kind == "fsdp2":
        mesh = init_device_mesh("cpu", (ws,))
        configs = [
            dict(build=lambda s: fsdp2_model(mesh, s), optim="adam", groups=1),
            dict(build=lambda s: fsdp2_model(mesh, s, frozen=True, reshard=False), optim="adamw", groups=2),
            dict(build=lambda s: fsdp2_model(mesh, s, reshard=1 if ws > 1 else True), optim="sgd", groups=1),
        ]
    elif kind == "tp":
        mesh = init_device_mesh("cpu", (ws,))
        configs = [dict(build=lambda s: tp_model(mesh, s), optim="adam", groups=2)]
    elif kind == "fsdp_tp":
        mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("dp", "tp"))
        configs = [dict(build=lambda s: fsdp_tp_model(mesh, s), optim="adamw", groups=1)]
    elif kind == "float8":
        mesh = init_device_mesh("cpu", (ws,))
        configs = [dict(build=lambda s: fsdp2_float8_model(mesh, s), optim="adamw", groups=2, width=16)]
    elif kind == "per_param_mesh":
        mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("edp", "ep"))
        configs = [dict(build=lambda s: fsdp2_per_param_mesh_model(mesh, s), optim="adam", groups=2)]
    elif kind == "hsdp":
        mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard"))
        configs = [dict(build=lambda s: fsdp2_model(mesh, s), optim="adam", groups=1)]
    else:
        raise ValueError(kind)

    for ci, cfg in enumerate(configs):
        width = cfg.get("width", 8)

        def twin(seed=0, step=True, width=width):
            m = cfg["build"](seed)
            o = make_optimizer(m, cfg["optim"], cfg["groups"])
            if step:
                train(m, o, seed=seed, width=width)
            return m, o

        (mu, ou), (md, od) = twin(), twin()
        for options in (
            {},
            {"full_state_dict": True},
            {"full_state_dict": True, "cpu_offload": True},
            {"cpu_offload": True},
            {"flatten_optimizer_state_dict": True},
            {"full_state_dict": True, "flatten_optimizer_state_dict": True},
        ):
            a = upstream.get_state_dict(mu, ou, options=upstream.StateDictOptions(**options))
            b = dcp_optim.get_state_dict(md, od, options=Opts(**options))
            assert_same_tree(a, b)
        # optimizer state is DTensor exactly where the parameters are
        b_msd, b_osd = dcp_optim.get_state_dict(md, od)
        params = dict(md.named_parameters())
        for fqn, st in b_osd["state"].items():
            for key, value in st.items():
                if key == "step":
                    continue
                assert isinstance(value, DTensor) == isinstance(params[fqn], DTensor), (fqn, key)

        # sharded round trip into fresh twins, then one more step
        msd_u, osd_u = upstream.get_state_dict(mu, ou)
        msd_d, osd_d = dcp_optim.get_state_dict(md, od)
        (fu, fou), (fd, fod) = twin(seed=5), twin(seed=5)
        upstream.set_state_dict(fu, fou, model_state_dict=msd_u, optim_state_dict=osd_u)
        dcp_optim.set_state_dict(fd, fod, model_state_dict=msd_d, optim_state_dict=osd_d)
        assert_same_tree(params_snapshot(fu), params_snapshot(fd))
        assert_same_optimizers(fou, fod, skip_frozen=True)
        _assert_state_like_params(fod)
        train(fu, fou, steps=1, seed=9, width=width)
        train(fd, fod, steps=1, seed=9, width=width)
        assert_same_tree(params_snapshot(fu), params_snapshot(fd))

        if kind == "fsdp2":
            _self_load_like_upstream(mu, ou, md, od)

        # full loads: every rank holds the dict, then broadcast from rank 0
        full = upstream.StateDictOptions(full_state_dict=True)
        msd_full, osd_full = upstream.get_state_dict(mu, ou, options=full)
        for broadcast in (False, True):
            opts = dict(full_state_dict=True, broadcast_from_rank0=broadcast)
            give = not broadcast or rank == 0
            (fu, fou), (fd, fod) = twin(seed=7), twin(seed=7)
            upstream.set_model_state_dict(fu, dict(msd_full) if give else {}, options=upstream.StateDictOptions(**opts))
            upstream.set_optimizer_state_dict(fu, fou, osd_full if give else {}, options=upstream.StateDictOptions(**opts))
            # one call for both: dcp_optim keeps the ranks in step (upstream's
            # set_state_dict hangs here when non-zero ranks pass {})
            dcp_optim.set_state_dict(
                fd, fod,
                model_state_dict=dict(msd_full) if give else {},
                optim_state_dict=osd_full if give else {},
                options=Opts(**opts),
            )
            assert_same_tree(params_snapshot(fu), params_snapshot(fd))
            _betas_to_tuples(fou)
            assert_same_optimizers(fou, fod, skip_frozen=True)
            _assert_state_like_params(fod)
            back = dcp_optim.get_optimizer_state_dict(fd, fod, options=Opts(full_state_dict=True))
            assert_same_tree(back["state"], osd_full["state"])

        # a never-stepped optimizer: same structure, types and placements as
        # upstream's (fake-stepped) template, pristine values, nothing changed
        (tu, tou), (td, tod) = twin(step=False), twin(step=False)
        a = upstream.get_optimizer_state_dict(tu, tou)
        b = dcp_optim.get_optimizer_state_dict(td, tod)
        assert list(a["state"]) == list(b["state"])
        for fqn in a["state"]:
            assert list(a["state"][fqn]) == list(b["state"][fqn])
            for key in a["state"][fqn]:
                va, vb = a["state"][fqn][key], b["state"][fqn][key]
                assert type(va) is type(vb), (fqn, key)
                assert va.dtype == vb.dtype and va.shape == vb.shape and va.device == vb.device
                if isinstance(va, DTensor):
                    assert va.placements == vb.placements
                if key == "step":
                    assert float(vb) == 0.0 and float(va) == 1.0  # D1/D2
                else:
                    assert not bool(vb.to_local().any() if isinstance(vb, DTensor) else vb.any())
        assert len(tod.state) == 0, "a get must not install state (D1)"
        done.append(f"{kind}[{ci}]")
    dist.barrier()
    return done


# --- resharding through DCP ----------------------------------------------------------


def _build_kind(kind: str, rank: int, ws: int, seed: int = 0):
    if kind == "fsdp2":
        return fsdp2_model(init_device_mesh("cpu", (ws,)), seed, hidden=8)
    if kind == "tp":
        torch.manual_seed(seed)
        model = MLP(width=8, hidden=8, layers=2)
        mesh = init_device_mesh("cpu", (ws,))
        for block in model.layers:
            parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        return model
    if kind == "fsdp_tp":
        return fsdp_tp_model(init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("dp", "tp")), seed)
    if kind == "plain":
        return plain_model(seed, hidden=8)
    raise ValueError(kind)


def dcp_save(rank: int, ws: int, path: str, kind: str, flatten: bool) -> str:
    """Train `kind` at this world size, save with DCP through dcp_optim, and
    write the full reference tensors (rank 0) next to the checkpoint."""
    model = _build_kind(kind, rank, ws)
    optim = make_optimizer(model, "adam", groups=2)
    train(model, optim, steps=2, seed=3)
    opts = Opts(flatten_optimizer_state_dict=flatten)
    msd, osd = dcp_optim.get_state_dict(model, optim, options=opts)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    full_m, full_o = dcp_optim.get_state_dict(
        model, optim, options=Opts(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        torch.save({"model": full_m, "optim": full_o}, os.path.join(path, "reference.pt"))
    dist.barrier()
    return "saved"


def dcp_load(rank: int, ws: int, path: str, kind: str, flatten: bool) -> dict[str, Any]:
    """Template flow at another layout: fresh model + never-stepped
    optimizer -> get (template) -> dcp.load -> set; then every full
    parameter and optimizer state tensor equals the saved run's, and one
    more step works."""
    model = _build_kind(kind, rank, ws, seed=11)
    optim = make_optimizer(model, "adam", groups=2)
    opts = Opts(flatten_optimizer_state_dict=flatten)
    msd, osd = dcp_optim.get_state_dict(model, optim, options=opts)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    dcp_optim.set_state_dict(
        model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"], options=opts
    )
    full_m, full_o = dcp_optim.get_state_dict(
        model, optim, options=Opts(full_state_dict=True, cpu_offload=True)
    )
    result = {"rank": rank}
    if rank == 0:
        ref = torch.load(os.path.join(path, "reference.pt"), weights_only=False)
        assert_same_tree(ref["model"], full_m)
        assert_same_tree(ref["optim"]["state"], full_o["state"])
        lrs = sorted(g["lr"] for g in full_o["param_groups"])
        assert lrs == sorted(g["lr"] for g in ref["optim"]["param_groups"])
        result["tensors"] = len(full_m) + sum(len(v) for v in full_o["state"].values())
    if ws == 3 and kind == "fsdp2" and not flatten:
        # 3 ranks: the full-gather layouts, exact against upstream
        result["gathers"] = gather_exactness_cases(rank, ws)
    _assert_state_like_params(optim)
    train(model, optim, steps=1, seed=4)
    dist.barrier()
    return result


# --- cross-rank consistency ----------------------------------------------------------


def disagreement_cases(rank: int, ws: int) -> list[str]:
    """Ranks that disagree raise the same clear error, on every rank,
    before any data moves (no hang, no garbage)."""
    mesh = init_device_mesh("cpu", (ws,))
    messages = []
    # 1. a different model on the last rank (one layer wider)
    torch.manual_seed(0)
    model = MLP(width=8, hidden=7 if rank != ws - 1 else 9, layers=2)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    try:
        dcp_optim.get_model_state_dict(model, options=Opts(full_state_dict=True))
    except dcp_optim.errors.StateDictRuntimeError as exc:
        messages.append(str(exc))
    else:
        raise AssertionError("no error for different shapes across ranks")
    # 2. the same model, but cpu_offload differs between ranks
    model = fsdp2_model(mesh)
    try:
        dcp_optim.get_model_state_dict(
            model, options=Opts(full_state_dict=True, cpu_offload=(rank == 0))
        )
    except dcp_optim.errors.StateDictRuntimeError as exc:
        messages.append(str(exc))
    else:
        raise AssertionError("no error for different options across ranks")
    # 3. D15: a full load without broadcast where only rank 0 has the dict
    full = dcp_optim.get_model_state_dict(model, options=Opts(full_state_dict=True))
    try:
        dcp_optim.set_model_state_dict(
            model, full if rank == 0 else {}, options=Opts(full_state_dict=True)
        )
    except ValueError as exc:
        messages.append(str(exc))
    else:
        raise AssertionError("no error for a full load held by rank 0 only")
    dist.barrier()
    messages.append(gather_exactness_cases(rank, ws))
    return messages


# --- process groups ------------------------------------------------------------------


def submesh_case(rank: int, ws: int) -> dict[str, Any]:
    """Two FSDP2 models on disjoint sub-meshes ([0, 1] and [2, 3]): full
    gathers stay inside each mesh, and a broadcast load's source is the
    first rank of the model's mesh, not global rank 0 (D18 in docs/differences.md)."""
    half = ws // 2
    ranks = list(range(half)) if rank < half else list(range(half, ws))
    from torch.distributed.device_mesh import DeviceMesh

    # every rank creates both meshes (new_group is collective on WORLD)
    meshes = [DeviceMesh("cpu", list(range(half))), DeviceMesh("cpu", list(range(half, ws)))]
    mesh = meshes[0] if rank < half else meshes[1]
    seed = 0 if rank < half else 1
    model = fsdp2_model(mesh, seed=seed)
    optim = make_optimizer(model)
    train(model, optim, seed=seed)
    full_m, full_o = dcp_optim.get_state_dict(model, optim, options=Opts(full_state_dict=True))
    # broadcast load from the mesh's first rank into a fresh model: this
    # small model's tensors travel inline with the metadata, then (inline
    # off) streamed, each within the mesh: broadcast, then scattered (each
    # rank's rows point to point, the peers named by their global ranks)
    from dcp_optim._engine import payload as _payload
    from dcp_optim._engine import scatter_load as _scatter

    inline_bytes, min_chunk = _payload.INLINE_BYTES, _scatter.SCATTER_MIN_CHUNK_BYTES
    messages = []
    for inline, scatter in ((inline_bytes, False), (0, False), (0, True)):
        _payload.INLINE_BYTES = inline
        _scatter.SCATTER_MIN_CHUNK_BYTES = 1 if scatter else 1 << 62
        fresh = fsdp2_model(mesh, seed=seed + 10)
        fresh_optim = make_optimizer(fresh)
        source = rank == ranks[0]
        try:
            with CollectiveCounter() as seen:
                dcp_optim.set_state_dict(
                    fresh, fresh_optim,
                    model_state_dict=dict(full_m) if source else {},
                    optim_state_dict=full_o if source else {},
                    options=Opts(full_state_dict=True, broadcast_from_rank0=True),
                )
        finally:
            _payload.INLINE_BYTES, _scatter.SCATTER_MIN_CHUNK_BYTES = inline_bytes, min_chunk
        messages.append(seen.counts.get("batch_isend_irecv", 0))
        back_m, back_o = dcp_optim.get_state_dict(fresh, fresh_optim, options=Opts(full_state_dict=True))
        assert_same_tree(full_m, back_m)
        assert_same_tree(full_o["state"], back_o["state"])
    dist.barrier()
    return {"rank": rank, "mesh": ranks, "keys": len(back_m), "messages": messages,
            "gathers": gather_exactness_cases(rank, ws)}


# --- collective counts ------------------------------------------------------------------

_COUNTED = (
    "all_gather_into_tensor", "all_gather_single", "all_gather", "broadcast",
    "all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "_broadcast_coalesced",
    "broadcast_object_list", "all_gather_object", "scatter", "gather",
    "all_to_all_single", "send", "recv", "batch_isend_irecv",
)


class CollectiveCounter:
    """Counts calls into torch.distributed entry points and the functional
    collectives DTensor uses (torch.ops._c10d_functional.*), by wrapping
    them for the duration of a `with` block."""

    def __init__(self):
        self.counts: dict[str, int] = {}
        self._saved: list[tuple[Any, str, Any]] = []
        self._depth = 0

    def _wrap(self, owner, name, label):
        original = getattr(owner, name, None)
        if original is None:
            return

        def wrapper(*args, **kwargs):
            # only outermost calls: all_gather_object runs all_gather inside
            if self._depth == 0:
                self._record(name, label, args, kwargs)
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        self._saved.append((owner, name, original))
        setattr(owner, name, wrapper)

    def _record(self, name: str, label: str, args: tuple, kwargs: dict) -> None:
        self.counts[label] = self.counts.get(label, 0) + 1

    def __enter__(self):
        import torch.distributed.distributed_c10d as c10d

        for name in _COUNTED:
            self._wrap(dist, name, name)
            if getattr(c10d, name, None) is not getattr(dist, name, None):
                self._wrap(c10d, name, name)
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _count_functional_collectives(fn):
    """Counts _c10d_functional ops dispatched while fn runs (DTensor
    redistribute goes through them, not through torch.distributed)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = {"functional": 0}

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "_c10d_functional" and not func.name().endswith("wait_tensor"):
                counts["functional"] += 1
            return func(*args, **(kwargs or {}))

    with Mode():
        result = fn()
    return result, counts["functional"]


def collective_count_case(rank: int, ws: int, layers: int, bucket_mb: float) -> dict[str, Any]:
    """A `layers`-layer FSDP2 model: collectives during a full_state_dict
    gather of model + Adam state, upstream vs dcp_optim."""
    mesh = init_device_mesh("cpu", (ws,))
    model = fsdp2_model(mesh, layers=layers, width=16, hidden=24)
    optim = make_optimizer(model)
    train(model, optim, steps=1, seed=1, width=16)
    full = Opts(full_state_dict=True)
    previous = _collectives.set_bucket_bytes(int(bucket_mb * 2**20))
    try:
        with CollectiveCounter() as ours_c10d:
            ours, ours_func = _count_functional_collectives(
                lambda: dcp_optim.get_state_dict(model, optim, options=full)
            )
        with CollectiveCounter() as theirs_c10d:
            theirs, theirs_func = _count_functional_collectives(
                lambda: upstream.get_state_dict(model, optim, options=upstream.StateDictOptions(full_state_dict=True))
            )
    finally:
        _collectives.set_bucket_bytes(previous)
    assert_same_tree(theirs, ours)
    dtensors = sum(isinstance(p, DTensor) for p in model.parameters())
    state_dtensors = sum(
        isinstance(v, DTensor) for st in optim.state.values() for v in st.values()
    )
    gathered_bytes = sum(
        t.numel() * t.element_size()
        for t in list(ours[0].values()) + [v for st in ours[1]["state"].values() for v in st.values()]
        if isinstance(t, torch.Tensor)
    )
    dist.barrier()
    return {
        "rank": rank,
        "dtensors": dtensors + state_dtensors,
        "bytes": gathered_bytes,
        "ours": ours_c10d.total + ours_func,
        "ours_detail": dict(ours_c10d.counts, functional=ours_func),
        "upstream": theirs_c10d.total + theirs_func,
        "upstream_detail": dict(theirs_c10d.counts, functional=theirs_func),
    }


# --- memory ---------------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Samples the resident set size every millisecond in a thread; the
    peak above the value at entry is `peak - base`.  Cross-checked with
    the kernel's high-water mark (ru_maxrss) when that was below entry."""

    def __enter__(self):
        self.base = _rss_bytes()
        self.peak = self.base
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop:
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())
        self.maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def broadcast_memory_case(rank: int, ws: int, state_mb: int, bucket_mb: int, impl: str) -> dict[str, Any]:
    """Peak RSS on every rank during a broadcast_from_rank0 optimizer load
    whose full Adam state is `state_mb` MB.  The model is built on the
    meta device and only local shards are materialised, so a receiving
    rank's resident memory holds its shards and the transfer buffers."""
    mesh = init_device_mesh("cpu", (ws,))
    n = state_mb * 2**20 // 8  # Adam keeps two fp32 moments per parameter
    rows = 64
    cols = n // rows // 4
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(cols, rows, bias=False) for _ in range(4)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().fill_(0.5)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    # rank 0 holds the full checkpoint (made from the local shards' values)
    if rank == 0:
        full_params = {name: torch.full(p.shape, 0.25) for name, p in model.named_parameters()}
        full_osd = {
            "state": {
                name: {"step": torch.tensor(3.0), "exp_avg": torch.full(p.shape, 0.1),
                       "exp_avg_sq": torch.full(p.shape, 0.2)}
                for name, p in model.named_parameters()
            },
            "param_groups": [{**{k: v for k, v in optim.param_groups[0].items() if k != "params"},
                              "params": [n for n, _ in model.named_parameters()]}],
        }
        del full_params
    else:
        full_osd = {}
    local_bytes = sum(p.to_local().numel() * 4 for p in model.parameters()) * 2  # two moments
    previous = _collectives.set_bucket_bytes(bucket_mb * 2**20)
    opts = dict(full_state_dict=True, broadcast_from_rank0=True)
    dist.barrier()
    try:
        with PeakRSS() as mem:
            if impl == "dcp_optim":
                dcp_optim.set_optimizer_state_dict(model, optim, full_osd, options=Opts(**opts))
            else:
                upstream.set_optimizer_state_dict(model, optim, full_osd, options=upstream.StateDictOptions(**opts))
    finally:
        _collectives.set_bucket_bytes(previous)
    # the loaded values are right
    for p in model.parameters():
        st = optim.state[p]
        assert isinstance(st["exp_avg"], DTensor)
        assert bool((st["exp_avg"].to_local() == 0.1).all())
    dist.barrier()
    return {
        "rank": rank,
        "impl": impl,
        "local_state_bytes": local_bytes,
        "bucket_bytes": bucket_mb * 2**20,
        "peak_delta": mem.peak - mem.base,
        "full_state_bytes": state_mb * 2**20,
    }


def broadcast_model_in_place_case(rank: int, ws: int, bucket_mb: int) -> dict[str, Any]:
    """A broadcast_from_rank0 model load whose checks all pass up front
    streams each shard straight into the parameter's own local tensor:
    peak RSS growth on a receiving rank is about one bucket (not its local
    shard + a bucket), the parameters keep their storage, and loads that
    fail a check raise on every rank with the model unchanged."""
    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    # 4 x 16 MB weights: 32 MB of local shards per rank
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().fill_(0.5)
    names = [n for n, _ in model.named_parameters()]
    full = {n: torch.full(p.shape, float(i)) for i, (n, p) in enumerate(model.named_parameters())} if rank == 0 else {}
    storage = [p.to_local().data_ptr() for p in model.parameters()]
    opts = Opts(full_state_dict=True, broadcast_from_rank0=True)
    # upstream's footprint: the stream's undo log (host copies of the
    # overwritten shards, DCP_OPTIM_STREAM_UNDO) is what this measures
    # without; test_faults measures it with
    undo_before = os.environ.get(_distribute.UNDO_ENV)
    os.environ[_distribute.UNDO_ENV] = "0"
    previous = _collectives.set_bucket_bytes(bucket_mb * 2**20)
    try:
        gc.collect()
        dist.barrier()
        with PeakRSS() as mem:
            dcp_optim.set_model_state_dict(model, full, options=opts)
        errors = {}
        for what in ("non-tensor value", "wrong shape"):
            bad = {}
            if rank == 0:
                bad = dict(full)
                bad[names[0]] = 7.0 if what == "non-tensor value" else torch.zeros(3)
            try:
                dcp_optim.set_model_state_dict(model, bad, options=opts)
            except Exception as e:  # noqa: BLE001 - reported to the test
                errors[what] = f"{type(e).__name__}: {e}"
            else:
                errors[what] = None
    finally:
        _collectives.set_bucket_bytes(previous)
        if undo_before is None:
            os.environ.pop(_distribute.UNDO_ENV, None)
        else:
            os.environ[_distribute.UNDO_ENV] = undo_before
    values_ok = all(
        bool((p.to_local() == float(i)).all()) for i, p in enumerate(model.parameters())
    )
    return {
        "peak_delta": mem.peak - mem.base,
        "bucket_bytes": bucket_mb * 2**20,
        "local_bytes": sum(p.to_local().numel() * 4 for p in model.parameters()),
        "same_storage": storage == [p.to_local().data_ptr() for p in model.parameters()],
        "values_ok": values_ok,
        "errors": errors,
        "first": names[0],
    }


def broadcast_optim_in_place_case(rank: int, ws: int, bucket_mb: int) -> dict[str, Any]:
    """A broadcast_from_rank0 optimizer load into an optimizer that holds
    state already: validated first with the held state standing in, then
    each shard lands in the held state tensor (peak about one bucket, the
    state keeps its storage); loads that fail a check raise on every rank
    with the state unchanged."""
    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    # 4 x 8 MB weights: 2 moments x 16 MB of local state per rank
    model = nn.Sequential(*[nn.Linear(1024, 2048, bias=False) for _ in range(4)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optim.step()
    optim.zero_grad(set_to_none=True)
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]

    def full_osd(bad: str = "") -> dict[str, Any]:
        if rank != 0:
            return {}
        state = {
            n: {"step": torch.tensor(5.0), "exp_avg": torch.full(p.shape, float(i)),
                "exp_avg_sq": torch.full(p.shape, i + 0.5)}
            for i, (n, p) in enumerate(zip(names, params))
        }
        if bad == "shape":
            state[names[1]]["exp_avg"] = torch.zeros(3, 3)
        elif bad == "missing":
            del state[names[2]]
        group = {k: v for k, v in optim.param_groups[0].items() if k != "params"}
        return {"state": state, "param_groups": [{**group, "params": list(names)}]}

    def storage() -> list[int]:
        return [optim.state[p][k].to_local().data_ptr() for p in params for k in ("exp_avg", "exp_avg_sq")]

    def loaded() -> bool:
        return all(
            bool((optim.state[p]["exp_avg"].to_local() == float(i)).all())
            and bool((optim.state[p]["exp_avg_sq"].to_local() == i + 0.5).all())
            and float(optim.state[p]["step"]) == 5.0
            for i, p in enumerate(params)
        )

    before = storage()
    opts = Opts(full_state_dict=True, broadcast_from_rank0=True)
    # upstream's footprint: the stream's undo log (host copies of the
    # overwritten shards, DCP_OPTIM_STREAM_UNDO) is what this measures
    # without; test_faults measures it with
    undo_before = os.environ.get(_distribute.UNDO_ENV)
    os.environ[_distribute.UNDO_ENV] = "0"
    previous = _collectives.set_bucket_bytes(bucket_mb * 2**20)
    try:
        osd = full_osd()
        gc.collect()
        dist.barrier()
        with PeakRSS() as mem:
            dcp_optim.set_optimizer_state_dict(model, optim, osd, options=opts)
        del osd
        errors = {}
        for bad in ("shape", "missing"):
            try:
                dcp_optim.set_optimizer_state_dict(model, optim, full_osd(bad), options=opts)
            except Exception as e:  # noqa: BLE001 - reported to the test
                errors[bad] = f"{type(e).__name__}: {e}"
            else:
                errors[bad] = None
    finally:
        _collectives.set_bucket_bytes(previous)
        if undo_before is None:
            os.environ.pop(_distribute.UNDO_ENV, None)
        else:
            os.environ[_distribute.UNDO_ENV] = undo_before
    return {
        "peak_delta": mem.peak - mem.base,
        "bucket_bytes": bucket_mb * 2**20,
        "local_bytes": sum(p.to_local().numel() * 4 * 2 for p in params),
        "same_storage": before == storage(),
        "values_ok": loaded(),
        "errors": errors,
        "names": names,
    }


def _upstream_gathers(gather, names, leaves, offload) -> dict:
    """Upstream's ``_gather_state_dict`` of the named leaves; where it raises
    on the whole dict (torch 2.11's redistribute refuses a 1-D
    ``_StridedShard``), leaf by leaf, leaving out those it raises on.  The
    same calls on every rank: each raises before it communicates."""
    ranks_only = (0,) if offload else ()
    try:
        return gather(dict(zip(names, leaves)), cpu_offload=offload, ranks_only=ranks_only)
    except ValueError:
        pass
    out = {}
    for name, leaf in zip(names, leaves):
        try:
            out.update(gather({name: leaf}, cpu_offload=offload, ranks_only=ranks_only))
        except ValueError:
            continue
    return out


def gather_exactness_cases(rank: int, ws: int) -> list[str]:
    """Full gathers of DTensors of every layout the gather plans handle --
    even, padded, uneven (rows not divisible by the ranks), ranks holding 0
    rows, Shard(1), _StridedShard, replicas, 2-D meshes, dtype mixes --
    compared exactly with upstream's ``_gather_state_dict`` (what its full
    getters run): every rank keeping the result, and ``cpu_offload`` with
    rank 0 keeping it alone; with the default buckets (all tensors in one)
    and with one tensor per bucket (unpadded even tensors then gather
    straight into their result).  Returns the names of the cases checked."""
    from torch.distributed._state_dict_utils import _gather_state_dict
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    g = torch.Generator().manual_seed(3)

    def full(*shape, dtype=torch.float32):
        t = torch.randn(*shape, generator=g) * 100
        return t.to(dtype)

    mesh1 = init_device_mesh("cpu", (ws,))
    cases = [
        ("even", mesh1, [Shard(0)], full(4 * ws, 3)),
        ("even-1d-bf16", mesh1, [Shard(0)], full(8 * ws, dtype=torch.bfloat16)),
        ("padded-bf16", mesh1, [Shard(0)], full(4 * ws + 1, 5, dtype=torch.bfloat16)),
        ("uneven", mesh1, [Shard(0)], full(7, 5, 3)),
        ("zero-rows-on-some", mesh1, [Shard(0)], full(1, 4, dtype=torch.float64)),
        ("empty", mesh1, [Shard(0)], full(0, 3)),
        ("int64", mesh1, [Shard(0)], full(2 * ws + 1, 2).to(torch.int64)),
        ("shard1", mesh1, [Shard(1)], full(5, 7)),
        ("strided", mesh1, [_StridedShard(0, split_factor=2)], full(4 * ws, 6)),
        ("replicate", mesh1, [Replicate()], full(3, 2, dtype=torch.bfloat16)),
    ]
    if ws % 2 == 0:
        mesh2 = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("dp", "tp"))
        cases += [
            ("2d-shard0-shard1", mesh2, [Shard(0), Shard(1)], full(7, 5)),
            ("2d-hsdp", mesh2, [Replicate(), Shard(0)], full(5, 3, dtype=torch.bfloat16)),
            ("2d-shard0-shard0", mesh2, [Shard(0), Shard(0)], full(9, 2)),
            # the nested closed form: even outer blocks, padded inner chunks
            ("2d-shard0-shard0-padded", mesh2, [Shard(0), Shard(0)], full(2 * (ws // 2 + 1), 3)),
            ("2d-fsdp-over-tp", mesh2, [_StridedShard(0, split_factor=ws // 2), Shard(0)],
             full(ws // 2 * 4, 3)),
            ("2d-fsdp-over-tp-padded", mesh2, [_StridedShard(0, split_factor=ws // 2), Shard(0)],
             full(ws // 2 * 3, 5, dtype=torch.bfloat16)),
        ]
    names = [c[0] for c in cases]
    fulls = [c[3] for c in cases]
    # torch's scatter of a padded _StridedShard fails (its split does not
    # pad); every rank holds the same `full`, so those split locally
    leaves = [
        distribute_tensor(t, mesh, pl, src_data_rank=None if name.startswith("2d-fsdp") else 0)
        for name, mesh, pl, t in cases
    ]
    # interleave a plain tensor: it passes through untouched
    plain = torch.arange(3.0)
    checked = []
    for offload in (False, True):
        for bucket in (None, 1):
            ours = _collectives.gather_full_tensors(
                [plain, *leaves], bucket_bytes=bucket, cpu_offload=offload,
                keep=not offload or rank == 0,
            )
            assert ours[0] is plain
            theirs = _upstream_gathers(_gather_state_dict, names, leaves, offload)
            if offload and rank != 0:
                assert theirs == {}, sorted(theirs)
                continue
            for name, expected, mine in zip(names, fulls, ours[1:]):
                # where upstream cannot gather a layout on this torch (2.11:
                # a 1-D _StridedShard), the full tensor itself is the oracle
                ref = theirs.get(name, expected)
                assert type(mine) is torch.Tensor, (name, type(mine))
                assert (mine.dtype, mine.shape, mine.device) == (ref.dtype, ref.shape, ref.device), (
                    name, (mine.dtype, mine.shape, mine.device), (ref.dtype, ref.shape, ref.device))
                assert torch.equal(mine, ref) and torch.equal(mine, expected), name
            checked.append(f"offload={offload} bucket={bucket}")
    return [f"{len(names)} layouts", *checked]


class _AppState:
    """torchtitan's checkpoint wrapper: a ``Stateful`` whose state_dict and
    load_state_dict are dcp_optim's getters and setters."""

    def __init__(self, model: Any, optim: Any) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        msd, osd = dcp_optim.get_state_dict(self.model, self.optim)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        dcp_optim.set_state_dict(self.model, self.optim, model_state_dict=state["model"],
                                 optim_state_dict=state["optim"])


def async_save_case(rank: int, ws: int, path: str) -> str:
    """``dcp.async_save`` of the wrapper over its own gloo group (as
    torchtitan saves) while training goes on: the checkpoint holds the
    state of the moment it was called, and a resume from it takes the
    same next step as the run that never stopped."""
    from torch.distributed.checkpoint.stateful import Stateful

    assert isinstance(_AppState(None, None), Stateful)  # a runtime-checked protocol
    mesh = init_device_mesh("cpu", (ws,))
    model = fsdp2_model(mesh, 0)
    optim = make_optimizer(model, "adam", 2)
    train(model, optim, steps=2, seed=1)
    group = dist.new_group(backend="gloo")
    future = dcp.async_save({"app": _AppState(model, optim)}, checkpoint_id=path, process_group=group)
    train(model, optim, steps=1, seed=2)  # while the checkpoint is written
    future.result()
    resumed = fsdp2_model(mesh, 5)
    ropt = make_optimizer(resumed, "adam", 2)
    dcp.load({"app": _AppState(resumed, ropt)}, checkpoint_id=path)
    train(resumed, ropt, steps=1, seed=2)
    full = Opts(full_state_dict=True)
    assert_same_tree(dcp_optim.get_state_dict(model, optim, options=full),
                     dcp_optim.get_state_dict(resumed, ropt, options=full))
    dist.destroy_process_group(group)
    return "resumed"
