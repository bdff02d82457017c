"""Rank functions for tests/distributed/test_reshard_live.py: in-memory
resharding (dcp_optim.reshard_state_dict) against dcp.save + dcp.load into
the same template.

One launch runs every (source layout, destination layout) pair of a world
size and a format: each source layout is trained and saved once, then
every destination layout is built twice (one template filled by
``dcp.load``, one by ``reshard_state_dict``) and the two are compared bit
for bit, shard by shard.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.testing._internal.two_tensor import TwoTensor

import dcp_optim
from dcp_optim import StateDictOptions as Opts
from dcp_optim import errors
from dcp_optim._engine import reshard as engine

from ..support.oracle import assert_same_tree

WIDTH, HIDDEN = 8, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x):
        return self.norm(x + self.down(torch.relu(self.up(x))))


class Net(nn.Module):
    """head (5 rows) and gate (1 row) shard unevenly and leave ranks with
    zero-size shards under FSDP2 (hidden 8: TP trains at 4 ranks)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, 5, bias=False)
        self.gate = nn.Parameter(torch.randn(1, WIDTH))

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return (self.head(x * self.gate)).pow(2).mean()


def _tp(block, mesh):
    parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def build(kind: str, ws: int, seed: int) -> nn.Module:
    """Layouts: plain (every rank holds everything), fsdp2 (1-D), tp (1-D,
    Shard(0) / Shard(1) / Replicate + plain tensors), hsdp (2-D, Replicate
    then Shard(0)), fsdp_tp (2-D, FSDP over TP: _StridedShard)."""
    torch.manual_seed(seed)
    model = Net()
    if kind == "plain":
        return model
    if kind == "fsdp2":
        mesh = init_device_mesh("cpu", (ws,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind == "tp":
        mesh = init_device_mesh("cpu", (ws,))
        for block in model.layers:
            _tp(block, mesh)
    elif kind == "hsdp":
        mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("rep", "shard"))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind == "fsdp_tp":
        mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("dp", "tp"))
        for block in model.layers:
            _tp(block, mesh["tp"])
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    else:
        raise ValueError(kind)
    return model


KINDS = ("plain", "fsdp2", "tp", "hsdp", "fsdp_tp")


def optimizer(model):
    params = list(model.parameters())
    return torch.optim.Adam(
        [{"params": params[0::2], "lr": 0.01}, {"params": params[1::2], "lr": 0.02}], lr=0.01
    )


def train(model, optim, steps: int, seed: int) -> list[float]:
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(seed * 100 + step)
        loss = model(torch.randn(4, WIDTH, generator=g))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def trained_state(kind: str, ws: int, flatten: bool):
    model = build(kind, ws, seed=0)
    optim = optimizer(model)
    train(model, optim, steps=2, seed=3)
    msd, osd = dcp_optim.get_state_dict(model, optim, options=Opts(flatten_optimizer_state_dict=flatten))
    return model, optim, {"model": msd, "optim": osd}


def template(kind: str, ws: int, flatten: bool):
    model = build(kind, ws, seed=11)
    optim = optimizer(model)
    msd, osd = dcp_optim.get_state_dict(model, optim, options=Opts(flatten_optimizer_state_dict=flatten))
    return model, optim, {"model": msd, "optim": osd}


_MESH_RANKS: dict[int, tuple[Any, tuple[int, ...]]] = {}


def _mesh_ranks(mesh: Any) -> tuple[int, ...]:
    """A mesh's ranks in row-major order, once per mesh object (torch
    rebuilds ``DeviceMesh.mesh`` on every access: most of the matrix's
    comparison time); the mesh is kept with them, so its id is not reused."""
    hit = _MESH_RANKS.get(id(mesh))
    if hit is None or hit[0] is not mesh:
        hit = _MESH_RANKS[id(mesh)] = (mesh, tuple(mesh.mesh.reshape(-1).tolist()))
    return hit[1]


def _local_tree(tree: Any) -> Any:
    """DTensors as (placements, mesh ranks, local shard): what each rank
    holds, compared exactly."""
    if isinstance(tree, dict):
        return {k: _local_tree(v) for k, v in tree.items()}
    if isinstance(tree, DTensor):
        return (
            tuple(str(p) for p in tree.placements),
            _mesh_ranks(tree.device_mesh),
            tuple(tree.shape),
            tree.to_local().detach().clone(),
        )
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    return tree


def matrix(rank: int, ws: int, path: str, flatten: bool, sources=KINDS, dests=KINDS) -> list[str]:
    """Every (source, destination) pair: reshard_state_dict's result equals
    dcp.save + dcp.load into the same template, bit for bit.  Each
    destination's two templates (DCP's and reshard's) are built once and
    poisoned before every source (``_poison``): a tensor that DCP writes
    and reshard leaves alone fails the comparison, whatever the previous
    source wrote there."""
    done = []
    templates = {d: (template(d, ws, flatten)[2], template(d, ws, flatten)[2]) for d in dests}
    for src_kind in sources:
        _, _, src = trained_state(src_kind, ws, flatten)
        ckpt = os.path.join(path, f"{src_kind}-{int(flatten)}")
        dcp.save(src, checkpoint_id=ckpt)
        before = _local_tree(src)
        for dst_kind in dests:
            expected, tmpl = templates[dst_kind]
            _poison(expected)
            _poison(tmpl)
            dcp.load(expected, checkpoint_id=ckpt)
            agreed = engine.agreement_info()
            got = dcp_optim.reshard_state_dict(src, tmpl, bucket_bytes=256)
            # every rank passes both dicts and the layouts agree: the
            # digest alone agrees them (no rank's descriptions gathered)
            assert engine.agreement_info() == {**agreed, "digest": agreed["digest"] + 1}, (
                f"rank {rank}: {src_kind} -> {dst_kind}: {agreed} -> {engine.agreement_info()}"
            )
            try:
                assert_same_tree(_local_tree(expected), _local_tree(got))
            except AssertionError as exc:
                raise AssertionError(f"rank {rank}: {src_kind} -> {dst_kind} (flatten={flatten}): {exc}") from None
            # the template's tensors were filled in place, its dict untouched
            assert_same_tree(_local_tree(got["model"]), _local_tree(tmpl["model"]))
            done.append(f"{src_kind}->{dst_kind}")
        assert_same_tree(before, _local_tree(src))  # the source is untouched
    dist.barrier()
    return done


def _poison(tree: Any) -> None:
    """Every tensor of ``tree`` (a DTensor's local shard) set to a value no
    load of these checkpoints gives: NaN (its bits differ from any loaded
    float), -7 for integers, True for booleans."""
    if isinstance(tree, dict):
        for v in tree.values():
            _poison(v)
        return
    if isinstance(tree, torch.Tensor):
        local = tree.to_local() if isinstance(tree, DTensor) else tree
        with torch.no_grad():
            local.fill_(float("nan") if local.is_floating_point() else (True if local.dtype == torch.bool else -7))


def fsdp1_source(rank: int, ws: int, path: str, flatten: bool, dests=KINDS) -> list[str]:
    """FSDP1 flat parameters (sharded getters: ShardedTensors, dim-0
    chunks, empty on some ranks) as the source of every destination."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    model = FSDP(Net(), device_id=torch.device("cpu"), use_orig_params=False, auto_wrap_policy=ModuleWrapPolicy({Block}))
    optim = optimizer(model)
    train(model, optim, steps=2, seed=3)
    msd, osd = dcp_optim.get_state_dict(model, optim, options=Opts(flatten_optimizer_state_dict=flatten))
    src = {"model": msd, "optim": osd}
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    assert all(isinstance(v, ShardedTensor) for v in msd.values())
    empty = [any(not v.local_shards() or v.local_shards()[0].tensor.numel() == 0 for v in msd.values())]
    flags: list[Any] = [None] * ws
    dist.all_gather_object(flags, empty)
    assert any(f[0] for f in flags)  # some rank holds an empty shard (gate's single row)
    ckpt = os.path.join(path, f"fsdp1-{int(flatten)}")
    dcp.save(src, checkpoint_id=ckpt)
    done = []
    for dst_kind in dests:
        _, _, expected = template(dst_kind, ws, flatten)
        dcp.load(expected, checkpoint_id=ckpt)
        _, _, tmpl = template(dst_kind, ws, flatten)
        got = dcp_optim.reshard_state_dict(src, tmpl, bucket_bytes=512)
        try:
            assert_same_tree(_local_tree(expected), _local_tree(got))
        except AssertionError as exc:
            raise AssertionError(f"rank {rank}: fsdp1 -> {dst_kind} (flatten={flatten}): {exc}") from None
        done.append(f"fsdp1->{dst_kind}")
    dist.barrier()
    return done


def convenience_and_training(rank: int, ws: int, path: str) -> dict[str, Any]:
    """reshard_model_and_optimizer FSDP2 -> TP, then 3 more steps: the
    losses equal those of a TP run resumed through dcp.save + dcp.load."""
    model, optim, src = trained_state("fsdp2", ws, False)
    dcp.save(src, checkpoint_id=path)
    # resumed through DCP
    m1, o1, t1 = template("tp", ws, False)
    dcp.load(t1, checkpoint_id=path)
    dcp_optim.set_state_dict(m1, o1, model_state_dict=t1["model"], optim_state_dict=t1["optim"])
    ref = train(m1, o1, steps=3, seed=5)
    # resharded in memory
    m2 = build("tp", ws, seed=11)
    o2 = optimizer(m2)
    dcp_optim.reshard_model_and_optimizer(model, optim, m2, o2, bucket_bytes=1024)
    got = train(m2, o2, steps=3, seed=5)
    assert got == ref, (got, ref)
    return {"losses": got}


def errors_case(rank: int, ws: int) -> list[str]:
    """Mismatches raise the same error on every rank, nothing changed."""
    seen = []
    mesh = init_device_mesh("cpu", (ws,))
    full = torch.arange(24.0).reshape(6, 4)
    src = {"w": distribute_tensor(full, mesh, [Shard(0)]), "b": torch.ones(3)}

    def attempt(tmpl, label, source=src, **kwargs):
        snapshot = _local_tree(tmpl)
        try:
            dcp_optim.reshard_state_dict(source, tmpl, **kwargs)
        except errors.StateDictRuntimeError as exc:
            msg = str(exc)
            gathered: list[Any] = [None] * ws
            dist.all_gather_object(gathered, msg)
            assert all(m == msg for m in gathered), gathered
            assert_same_tree(snapshot, _local_tree(tmpl))
            seen.append(f"{label}: {msg}")
            return
        raise AssertionError(f"{label}: no error")

    # a different global shape on every rank
    attempt({"w": distribute_tensor(torch.zeros(6, 5), mesh, [Shard(1)]), "b": torch.zeros(3)}, "shape")
    # a key missing from the source
    attempt({"w": distribute_tensor(torch.zeros(6, 4), mesh, [Shard(1)]), "c": torch.zeros(3)}, "missing")
    # one rank's template differs from the others'
    extra = {"x": torch.zeros(1)} if rank == ws - 1 else {}
    attempt({"w": distribute_tensor(torch.zeros(6, 4), mesh, [Shard(1)]), "b": torch.zeros(3), **extra}, "keys")
    # a pending reduction cannot be moved
    partial = DTensor.from_local(torch.zeros(6, 4), mesh, [Partial()])
    attempt({"w": partial, "b": torch.zeros(3)}, "partial")
    # a tensor in the source, a non-tensor value in the template
    attempt({"w": distribute_tensor(torch.zeros(6, 4), mesh, [Shard(1)]), "b": 3}, "kind")
    # one rank passes something that is not a dict: every rank raises
    fresh = {"w": distribute_tensor(torch.zeros(6, 4), mesh, [Shard(1)]), "b": torch.zeros(3)}
    attempt(fresh, "type", source=[1] if rank == 0 else src)
    # different bucket sizes would pack different buckets
    attempt(fresh, "buckets", bucket_bytes=1024 + 16 * rank)
    # the template shares memory with the source
    attempt({"w": distribute_tensor(torch.zeros(6, 4), mesh, [Shard(1)]), "b": src["b"]}, "alias")
    # a wrapper subclass's local tensor (torchao's float8 weights are one):
    # its storage is not its values
    plain = distribute_tensor(torch.zeros(6, 4), mesh, [Shard(1)])
    local = plain.to_local()
    wrapped = DTensor.from_local(TwoTensor(local, local.clone()), mesh, [Shard(1)],
                                 shape=plain.shape, stride=plain.stride())
    attempt({"w": wrapped, "b": torch.zeros(3)}, "subclass")
    # a rank that leaves (no template) holds a source tensor of another
    # shape: the others' view does not fit it, the gathered agreement says so
    attempt({"b": torch.zeros(3)} if rank != ws - 1 else None, "leaver",
            source={"b": torch.ones(3 if rank != ws - 1 else 4)})
    assert engine.agreement_info()["digest"] == 0  # every error above was found by the gathered agreement
    # a plain tensor that only rank 0 holds: no view fits every rank, the
    # gathered agreement finds its one holder
    before = engine.agreement_info()
    only0 = {"w": src["w"], **({"b": torch.full((3,), 7.0)} if rank == 0 else {})}
    out = dcp_optim.reshard_state_dict(
        only0, {"w": distribute_tensor(torch.zeros(6, 4), mesh, [Shard(1)]), "b": torch.zeros(3)}
    )
    assert torch.equal(out["b"], torch.full((3,), 7.0)) and torch.equal(out["w"].full_tensor(), full)
    assert engine.agreement_info()["gathered"] == before["gathered"] + 1
    # and one that works: Shard(0) -> Shard(1), Replicate, dtype cast
    out = dcp_optim.reshard_state_dict(
        src, {"w": distribute_tensor(torch.zeros(6, 4, dtype=torch.float64), mesh, [Shard(1)]), "b": torch.zeros(3)}
    )
    assert torch.equal(out["w"].full_tensor(), full.double())
    assert torch.equal(out["b"], torch.ones(3))
    info = engine.plan_cache_info()
    assert info["misses"] >= 1
    dcp_optim.reshard_state_dict(
        src, {"w": distribute_tensor(torch.zeros(6, 4), mesh, [Shard(1)]), "b": torch.zeros(3)}
    )
    assert engine.plan_cache_info()["hits"] > info["hits"]  # the same pair of layouts: cached
    # the layouts agree: the digest alone agreed them, nothing gathered
    assert engine.agreement_info()["gathered"] == before["gathered"] + 1
    assert engine.agreement_info()["digest"] == before["digest"] + 2
    return seen


def subworld_case(rank: int, ws: int, path: str, flatten: bool) -> list[str]:
    """World ws -> the first ws // 2 ranks (the others leave, passing no
    template): the same shards as dcp.load on the subgroup."""
    _, _, src = trained_state("fsdp2", ws, flatten)
    dcp.save(src, checkpoint_id=path)
    half = ws // 2
    sub = DeviceMesh("cpu", torch.arange(half))  # every rank takes part in creating it
    kinds = ("fsdp2", "tp")
    if rank >= half:
        for _ in kinds:
            before = engine.agreement_info()
            assert dcp_optim.reshard_state_dict(src, None) is None
            # agreed by digest and the view of the lowest rank with a template
            assert engine.agreement_info() == {**before, "broadcast": before["broadcast"] + 1}
        dist.barrier()
        return ["left"]
    pg = sub.get_group()
    done = []
    for kind in kinds:
        results = []
        for how in ("dcp", "reshard"):
            torch.manual_seed(11)
            model = Net()
            if kind == "fsdp2":
                for block in model.layers:
                    fully_shard(block, mesh=sub)
                fully_shard(model, mesh=sub)
            else:
                for block in model.layers:
                    _tp(block, sub)
            optim = optimizer(model)
            msd, osd = dcp_optim.get_state_dict(model, optim, options=Opts(flatten_optimizer_state_dict=flatten))
            tmpl = {"model": msd, "optim": osd}
            if how == "dcp":
                dcp.load(tmpl, checkpoint_id=path, process_group=pg)
                results.append(_local_tree(tmpl))
            else:
                before = engine.agreement_info()
                results.append(_local_tree(dcp_optim.reshard_state_dict(src, tmpl)))
                assert engine.agreement_info() == {**before, "broadcast": before["broadcast"] + 1}
        assert_same_tree(results[0], results[1])
        done.append(kind)
    dist.barrier()
    return done




def memory_case(rank: int, ws: int, bucket_mb: int, undo: str, rows: int = 1024) -> dict[str, Any]:
    """Peak extra resident memory of a reshard (FSDP2 Shard(0) -> TP
    Shard(1), 32 float32 tensors of ``rows`` x 1024, about 64 MB of shards
    per rank): the two buckets, plus the undo log's host copy of the
    destination shards where ``undo`` is "1" (the default).  1024 rows:
    the dense path (one all_to_all_single per tensor); an odd number: point
    to point."""
    from dcp_optim._engine import distribute as _distribute

    from .dist_cases import PeakRSS

    os.environ[_distribute.UNDO_ENV] = undo

    mesh = init_device_mesh("cpu", (ws,))
    shapes = [(rows, 1024)] * 32
    src = {f"t{i}": distribute_tensor(torch.full(s, float(i)), mesh, [Shard(0)]) for i, s in enumerate(shapes)}
    tmpl = {f"t{i}": distribute_tensor(torch.zeros(s), mesh, [Shard(1)]) for i, s in enumerate(shapes)}
    bucket = bucket_mb * 2**20
    dcp_optim.reshard_state_dict(src, tmpl, bucket_bytes=bucket)  # warm-up: plans, gloo's pairs
    for t in tmpl.values():
        t.to_local().zero_()
    dist.barrier()
    with PeakRSS() as mem:
        dcp_optim.reshard_state_dict(src, tmpl, bucket_bytes=bucket)
    for i, t in enumerate(tmpl.values()):
        assert bool((t.to_local() == float(i)).all())
    dist.barrier()
    # with kept buffers: the first call allocates what a plain call does
    # and keeps it; a repeat allocates nothing more
    buffers = dcp_optim.ReshardBuffers()
    dcp_optim.reshard_state_dict(src, tmpl, bucket_bytes=bucket, buffers=buffers)
    dist.barrier()
    with PeakRSS() as kept_mem:
        dcp_optim.reshard_state_dict(src, tmpl, bucket_bytes=bucket, buffers=buffers)
    dist.barrier()
    return {
        "peak_delta": mem.peak - mem.base,
        "kept_peak_delta": kept_mem.peak - kept_mem.base,
        "kept_bytes": buffers.nbytes,
        "bucket_bytes": bucket,
        "shard_bytes": sum(t.to_local().numel() * 4 for t in tmpl.values()),
    }


def killed_case(rank: int, ws: int, when: str, undo: str) -> dict[str, Any]:
    """Rank 0 is SIGKILLed during a reshard (FSDP2 ``Shard(0)`` -> TP
    ``Shard(1)``, 256-byte buckets: several per peer): ``when`` "mid" in its
    third ``batch_isend_irecv``, "after" once its whole transfer is done
    (before the last all_reduce); "dense": 1 MiB shards in the default
    bucket, one ``all_to_all_single`` each -- killed as it issues the
    third (the first two, issued, write the survivors' templates in place).
    The survivors raise the backend's error within the group's timeout
    (10 s); with the undo log (``undo`` "1", the default) their templates
    are as before the call."""
    import datetime
    import signal
    import time

    from dcp_optim._engine import distribute as _distribute

    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=10))
    os.environ[_distribute.UNDO_ENV] = undo
    mesh = init_device_mesh("cpu", (ws,))
    shape, bucket = ((256 * ws, 1024), None) if when == "dense" else ((48, 36), 256)
    src = {f"t{i}": distribute_tensor(torch.randn(shape, generator=torch.Generator().manual_seed(i)),
                                      mesh, [Shard(0)]) for i in range(4)}
    tmpl = {k: distribute_tensor(torch.full(shape, -1.0), mesh, [Shard(1)]) for k in src}
    dcp_optim.reshard_state_dict(src, tmpl, bucket_bytes=bucket)  # gloo's pairs connected
    for t in tmpl.values():
        t.to_local().fill_(-1.0)
    before = _local_tree(tmpl)
    dist.barrier()
    if rank == 0:
        if when in ("dense", "mid"):
            # the collective of that path: killed as it is called the third time
            name = "all_to_all_single" if when == "dense" else "batch_isend_irecv"
            calls = [0]
            original = getattr(dist, name)

            def dying(*args, **kwargs):
                calls[0] += 1
                if calls[0] == 3:
                    os.kill(os.getpid(), signal.SIGKILL)
                return original(*args, **kwargs)

            setattr(dist, name, dying)
        else:
            transfer = engine._transfer

            def transferred_then_dying(*args, **kwargs):
                transfer(*args, **kwargs)
                os.kill(os.getpid(), signal.SIGKILL)

            engine._transfer = transferred_then_dying
    t0 = time.monotonic()
    try:
        dcp_optim.reshard_state_dict(src, tmpl, bucket_bytes=bucket)
        result = "ok"
    except Exception as exc:  # noqa: BLE001 - the verdict is returned
        result = f"{type(exc).__name__}: {exc}"
    after = _local_tree(tmpl)
    unchanged = all(torch.equal(before[k][3], after[k][3]) for k in before)
    return {"result": result, "seconds": round(time.monotonic() - t0, 1), "unchanged": unchanged}


def cannot_allocate_case(rank: int, ws: int) -> list[dict[str, Any]]:
    """Reshards (FSDP2 ``Shard(0)`` <-> TP ``Shard(1)``, 256-byte buckets:
    boxes through the send or the receive buffers) in which one rank
    cannot allocate what its transfer needs: its send buffer (rank 0),
    its receive buffer (the last rank), the undo log's copy (rank 1) --
    ``torch.OutOfMemoryError``, as a GPU near full gives.  Those are
    allocated before the transfer and agreed on, so every rank raises the
    same error naming that rank, within seconds (the group's timeout is
    10 s), its template unchanged; then a reshard in the same group
    succeeds (no collective was left behind)."""
    import datetime
    import time

    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=10))
    mesh = init_device_mesh("cpu", (ws,))
    shape = (48, 36)
    scratch, save_all = engine._scratch, engine._UndoLog.save_all
    out = []
    for bad, role in ((0, "send"), (ws - 1, "recv"), (1, "undo")):
        # a column block of a row shard is sent through the send buffer,
        # and received through the receive buffer the other way round
        src_pl, dst_pl = (Shard(1), Shard(0)) if role == "recv" else (Shard(0), Shard(1))
        src = {f"t{i}": distribute_tensor(torch.randn(shape, generator=torch.Generator().manual_seed(i)),
                                          mesh, [src_pl]) for i in range(4)}
        tmpl = {k: distribute_tensor(torch.full(shape, -1.0), mesh, [dst_pl]) for k in src}

        def failing_scratch(kept, what, nbytes, device, bad=bad, role=role):
            if rank == bad and what == role:
                raise torch.OutOfMemoryError(f"no memory for the {what} buffer on rank {rank} (injected)")
            return scratch(kept, what, nbytes, device)

        def failing_save_all(self, host=None, bad=bad, role=role):
            if rank == bad and role == "undo":
                raise torch.OutOfMemoryError(f"no memory for the undo buffer on rank {rank} (injected)")
            return save_all(self, host)

        before = _local_tree(tmpl)
        engine._scratch = failing_scratch
        engine._UndoLog.save_all = failing_save_all  # type: ignore[method-assign]
        t0 = time.monotonic()
        try:
            dcp_optim.reshard_state_dict(src, tmpl, bucket_bytes=256)
            result = "ok"
        except Exception as exc:  # noqa: BLE001 - the verdict is returned
            result = f"{type(exc).__name__}: {exc}"
        finally:
            engine._scratch = scratch
            engine._UndoLog.save_all = save_all  # type: ignore[method-assign]
        after = _local_tree(tmpl)
        out.append({"bad": bad, "role": role, "result": result, "seconds": round(time.monotonic() - t0, 1),
                    "unchanged": all(torch.equal(before[k][3], after[k][3]) for k in before)})
    dcp_optim.reshard_state_dict(src, tmpl, bucket_bytes=256)
    want = {k: distribute_tensor(v.full_tensor(), mesh, [dst_pl]).to_local() for k, v in src.items()}
    out.append({"then": all(torch.equal(tmpl[k].to_local(), want[k]) for k in src)})
    return out


def fails_mid_transfer_case(rank: int, ws: int) -> list[dict[str, Any]]:
    """Reshards in which one rank's own code fails in the middle of the
    transfer, every time from then on (a bug, or a cast the caller's
    warning filters make an error): packing or unpacking a point-to-point
    message (50 x 35: uneven, point to point, 256-byte buckets), a dense
    collective's blocks (48 x 36: even; alone, and packed), or copying
    the boxes it holds itself once all is received.
    The failing rank keeps taking part in every remaining exchange, so
    every rank raises the same error naming it within seconds (the
    group's timeout is 10 s), its template put back; a cast that fails
    under ``-W error`` on one rank is found before the transfer.  Then a
    reshard in the same group succeeds."""
    import datetime
    import time
    import warnings

    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=10))
    mesh = init_device_mesh("cpu", (ws,))
    bad = ws - 1
    out = []
    # step: (shape, whether the source is column shards, tensors, bucket).
    # Point to point, column blocks of row shards are packed on the way
    # out and row blocks of column shards unpacked on the way in; in a
    # dense collective (even shapes within a bucket; one tensor alone, or
    # several packed together) a row shard is cut into column blocks on
    # the way out, column blocks are put together on the way in.
    plans = {
        "_pack_message": ((50, 35), False, 3, 256),
        "_unpack_message": ((50, 35), True, 3, 256),
        "_pack_blocks": ((48, 36), False, 1, 1 << 20),
        "_unpack_blocks": ((48, 36), True, 1, 1 << 20),
        "_pack_columns": ((48, 36), True, 3, 1 << 20),
        "_unpack_columns": ((48, 36), False, 3, 1 << 20),
        "cast": ((48, 36), False, 3, 256),
        # the boxes a rank holds itself: the first lands, then the failure
        "_copy_own_boxes": ((50, 35), False, 3, 256),
    }
    for step, (shape, columns, count, bucket) in plans.items():
        src_pl, dst_pl = (Shard(1), Shard(0)) if columns else (Shard(0), Shard(1))
        original = getattr(engine, step, None)
        src_dtype = torch.complex64 if step == "cast" else torch.float32
        src = {f"t{i}": distribute_tensor(torch.randn(shape, generator=torch.Generator().manual_seed(i)).to(src_dtype),
                                          mesh, [src_pl]) for i in range(count)}
        tmpl = {k: distribute_tensor(torch.full(shape, -1.0), mesh, [dst_pl]) for k in src}
        before = _local_tree(tmpl)

        def failing(*args, step=step, original=original, **kwargs):
            if step == "_copy_own_boxes":
                boxes, _stand_ins = args
                original(boxes[:1], {})
            raise RuntimeError(f"{step} failed on rank {rank} (injected)")

        if rank == bad and original is not None:
            setattr(engine, step, failing)
        t0 = time.monotonic()
        try:
            with warnings.catch_warnings():
                if step == "cast" and rank == bad:
                    warnings.simplefilter("error")
                elif step == "cast":
                    warnings.simplefilter("ignore")
                dcp_optim.reshard_state_dict(src, tmpl, bucket_bytes=bucket)
            result = "ok"
        except Exception as exc:  # noqa: BLE001 - the verdict is returned
            result = f"{type(exc).__name__}: {exc}"
        finally:
            if original is not None:
                setattr(engine, step, original)
        after = _local_tree(tmpl)
        out.append({"step": step, "result": result, "seconds": round(time.monotonic() - t0, 1),
                    "unchanged": all(torch.equal(before[k][3], after[k][3]) for k in before)})
    src = {"t": distribute_tensor(torch.randn(50, 35), mesh, [Shard(0)])}
    tmpl = {"t": distribute_tensor(torch.zeros(50, 35), mesh, [Shard(1)])}
    dcp_optim.reshard_state_dict(src, tmpl, bucket_bytes=256)
    out.append({"then": torch.equal(tmpl["t"].full_tensor(), src["t"].full_tensor())})
    return out


def large_and_small_case(rank: int, ws: int) -> list[str]:
    """Boxes of at least 64 KiB travel as buckets of their own (sent from /
    received into the shards where contiguous), the small ones packed
    together, in the default bucket: FSDP2 ``Shard(0)`` -> TP ``Shard(1)``
    and -> ``Replicate``, float32 / float64 / bfloat16 and a cast, checked
    against the source's full tensor laid out on the template's placements."""
    mesh = init_device_mesh("cpu", (ws,))
    gen = torch.Generator().manual_seed(7)
    # odd first dimensions: not divisible by the world, so the point-to-point
    # path (the dense one has its own case, dense_case)
    shapes = {"big": ((1023, 512), torch.float32), "small": ((7, 4), torch.float32),
              "big64": ((255, 128), torch.float64), "bias": ((255,), torch.bfloat16),
              "big16": ((2047, 256), torch.bfloat16)}
    src = {k: distribute_tensor(torch.randn(s, generator=gen).to(dt), mesh, [Shard(0)])
           for k, (s, dt) in shapes.items()}
    placements = {"big": Shard(1), "small": Shard(1), "big64": Replicate(), "bias": Replicate(), "big16": Shard(1)}
    dtypes = {k: dt for k, (_, dt) in shapes.items()}
    dtypes["big16"] = torch.float32  # received into another dtype: cast by copy_
    tmpl = {k: distribute_tensor(torch.zeros(s, dtype=dtypes[k]), mesh, [placements[k]])
            for k, (s, _) in shapes.items()}
    dcp_optim.reshard_state_dict(src, tmpl)
    for k, t in tmpl.items():
        want = distribute_tensor(src[k].full_tensor().to(dtypes[k]), mesh, [placements[k]])
        assert torch.equal(t.to_local(), want.to_local()), k
    # kept buffers (a sync at every step): new values each round land
    # exactly, whatever the previous round left in the reused buckets and
    # host copy; a smaller bucket on the last round grows none of them
    buffers = dcp_optim.ReshardBuffers()
    for step, bucket in ((1, None), (2, None), (3, 1 << 16)):
        for v in src.values():
            v.to_local().mul_(-2.0).add_(step)
        dcp_optim.reshard_state_dict(src, tmpl, buffers=buffers, bucket_bytes=bucket)
        for k, t in tmpl.items():
            want = distribute_tensor(src[k].full_tensor().to(dtypes[k]), mesh, [placements[k]])
            assert torch.equal(t.to_local(), want.to_local()), (k, step)
        if step == 1:
            held = buffers.nbytes
            assert held >= sum(t.to_local().numel() * t.to_local().element_size() for t in tmpl.values())
        assert buffers.nbytes == held, (step, buffers.nbytes, held)
    buffers.clear()
    assert buffers.nbytes == 0
    return sorted(tmpl)


def dense_case(rank: int, ws: int) -> dict[str, dict[str, int]]:
    """Between 1-D layouts over the whole group with sharded dimensions
    divisible by its size, tensors move by collectives: ``Shard(i) ->
    Shard(j)`` by ``all_to_all_single``, ``Shard(i) -> Replicate`` by
    all-gather.  Round "packed": the small ones of each kind share one
    collective.  Round "alone" (every tensor its own collective, as a
    tensor of 1 MiB or more has): written straight into the template's
    shard where it is split along dimension 0 and of the source's dtype,
    else through one strided copy, which also casts.  An uneven tensor and
    one larger than the bucket go point to point.  Each round is checked
    against the source's full tensor laid out on the template's
    placements, and its collectives are counted."""
    from dcp_optim._engine import reshard as engine

    mesh = init_device_mesh("cpu", (ws,))
    gen = torch.Generator().manual_seed(11)
    cases = {  # name: (shape, source placement, template placement, template dtype)
        "fsdp_to_tp": ((8 * ws, 4 * ws), Shard(0), Shard(1), torch.float32),  # a2a straight into the template
        "tp_to_fsdp": ((8 * ws, 4 * ws), Shard(1), Shard(0), torch.float32),  # a2a into a strided target
        "cast": ((4 * ws, 2 * ws), Shard(0), Shard(1), torch.float64),  # a2a, cast by the copy
        "gather0": ((6 * ws, 3), Shard(0), Replicate(), torch.float32),  # straight into the template
        "gather1": ((5, 2 * ws), Shard(1), Replicate(), torch.bfloat16),  # strided copy and cast
        "mid": ((2, 3 * ws, 2 * ws), Shard(1), Shard(2), torch.float64),  # 3-D, a float64 source
        "uneven": ((8 * ws + 1, 4 * ws), Shard(0), Shard(1), torch.float32),  # point to point
        "big": ((64 * ws, 64 * ws), Shard(0), Shard(1), torch.float32),  # over the bucket: point to point
    }
    src = {k: distribute_tensor(torch.randn(shape, generator=gen).to(torch.float64 if k == "mid" else torch.float32),
                                mesh, [sp]) for k, (shape, sp, _, _) in cases.items()}
    tmpl = {k: distribute_tensor(torch.zeros(shape, dtype=dt), mesh, [tp])
            for k, (shape, _, tp, dt) in cases.items()}
    originals = {name: getattr(dist, name) for name in ("all_to_all_single", "all_gather_single",
                                                        "all_gather_into_tensor", "batch_isend_irecv")
                 if hasattr(dist, name)}
    out: dict[str, dict[str, int]] = {}
    own = engine._OWN_DENSE
    for round_, own_bytes in (("packed", own), ("alone", 0)):
        counts = out[round_] = {"all_to_all_single": 0, "gather": 0, "batch_isend_irecv": 0, "agreement": 0}

        def counted(name, key, counts=counts):
            def call(*args, **kwargs):
                # the agreements' records (int64 words; gathered at small
                # worlds) apart from the data's gathers (bytes)
                inp = args[1] if len(args) > 1 else kwargs.get("input_tensor")
                agreement = key == "gather" and isinstance(inp, torch.Tensor) and inp.dtype == torch.int64
                counts["agreement" if agreement else key] += 1
                return originals[name](*args, **kwargs)
            return call

        for t in tmpl.values():
            t.to_local().zero_()
        for name in originals:
            setattr(dist, name, counted(name, "gather" if "gather" in name else name))
        engine._OWN_DENSE = own_bytes
        try:
            # the bucket: 16 KiB, above every rank's block but "big"'s
            dcp_optim.reshard_state_dict(src, tmpl, bucket_bytes=16 * 1024)
        finally:
            engine._OWN_DENSE = own
            for name, fn in originals.items():
                setattr(dist, name, fn)
        for k, t in tmpl.items():
            want = distribute_tensor(src[k].full_tensor().to(t.dtype), mesh, [cases[k][2]])
            assert torch.equal(t.to_local(), want.to_local()), (round_, k)
    return out


def _values(local: torch.Tensor) -> torch.Tensor:
    """A shard's values as a plain tensor, read without its class's
    ``copy_`` (what reshard_state_dict goes through): a wrapper subclass's
    one inner tensor (``__tensor_flatten__``)."""
    if type(local) is torch.Tensor or isinstance(local, nn.Parameter):
        return local.detach().clone()
    names, _ = local.__tensor_flatten__()
    assert len(names) == 1, (type(local), names)
    inner = getattr(local, names[0])
    assert type(inner) is torch.Tensor, type(inner)
    return inner.detach().clone()


def _values_tree(tree: Any) -> Any:
    """``_local_tree`` with every shard's values read by ``_values``, and
    its class beside them."""
    if isinstance(tree, dict):
        return {k: _values_tree(v) for k, v in tree.items()}
    if isinstance(tree, DTensor):
        local = tree.to_local()
        return (tuple(str(p) for p in tree.placements), _mesh_ranks(tree.device_mesh), tuple(tree.shape),
                type(local).__name__, _values(local))
    if isinstance(tree, torch.Tensor):
        return (type(tree).__name__, _values(tree))
    return tree


def _shard_classes(tree: dict[str, Any]) -> set[tuple[str, str]]:
    """(top-level key, class name) of every DTensor's local shard."""
    out = set()

    def walk(part: str, value: Any) -> None:
        if isinstance(value, dict):
            for v in value.values():
                walk(part, v)
        elif isinstance(value, DTensor):
            out.add((part, type(value.to_local()).__name__))

    for part, value in tree.items():
        walk(part, value)
    return out


def float8_case(rank: int, ws: int, path: str) -> dict[str, Any]:
    """torchao's float8 training under FSDP2 (the blocks' weights are
    DTensors over ``WeightWithDynamicFloat8CastTensor`` shards) as the source of plain TP and of float8 FSDP2, and plain FSDP2
    as the source of float8 FSDP2: reshard_state_dict's result equals
    dcp.save + dcp.load into the same (poisoned) template, shard by shard,
    the shards' classes kept; the source is untouched.  Then the
    convenience form moves a trained float8 model and its optimizer to TP,
    which trains on with the losses of a TP run resumed through DCP."""
    from .dist_cases import MLP, fsdp2_float8_model, fsdp2_model

    mesh = init_device_mesh("cpu", (ws,))

    def tp(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        model = MLP(width=16, hidden=32, layers=2)
        for block in model.layers:
            _tp(block, mesh)
        return model

    builders = {
        "float8": lambda seed: fsdp2_float8_model(mesh, seed),
        "fsdp2": lambda seed: fsdp2_model(mesh, seed, width=16, hidden=32),
        "tp": tp,
    }

    def fresh(kind: str, seed: int = 11):
        model = builders[kind](seed)
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    def steps(model, optim, n: int, seed: int) -> list[float]:
        losses = []
        for step in range(n):
            g = torch.Generator().manual_seed(seed * 100 + step)
            loss = model(torch.randn(16, 16, generator=g))
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(float(loss.detach()))
        return losses

    def state(model, optim) -> dict[str, Any]:
        msd, osd = dcp_optim.get_state_dict(model, optim)
        return {"model": msd, "optim": osd}

    done = []
    for src_kind, dst_kind in (("float8", "tp"), ("float8", "float8"), ("fsdp2", "float8")):
        model, optim = fresh(src_kind, seed=0)
        steps(model, optim, 2, seed=3)
        src = state(model, optim)
        ckpt = os.path.join(path, f"{src_kind}-{dst_kind}")
        dcp.save(src, checkpoint_id=ckpt)
        before = _values_tree(src)
        expected, tmpl = state(*fresh(dst_kind)), state(*fresh(dst_kind))
        _poison(expected)
        _poison(tmpl)
        dcp.load(expected, checkpoint_id=ckpt)
        got = dcp_optim.reshard_state_dict(src, tmpl, bucket_bytes=256)
        try:
            assert_same_tree(_values_tree(expected), _values_tree(got))
        except AssertionError as exc:
            raise AssertionError(f"rank {rank}: {src_kind} -> {dst_kind}: {exc}") from None
        assert_same_tree(before, _values_tree(src))
        # the weights' shards are torchao's where float8 trains (AdamW's
        # moments are plain tensors)
        for kind, tree in ((src_kind, src), (dst_kind, got)):
            classes = _shard_classes(tree)
            wrapped = {"model"} if kind == "float8" else set()
            assert {part for part, cls in classes if cls == "WeightWithDynamicFloat8CastTensor"} == wrapped, (
                kind, classes)
        done.append(f"{src_kind}->{dst_kind}")

    model, optim = fresh("float8", seed=0)
    steps(model, optim, 2, seed=3)
    dcp.save(state(model, optim), checkpoint_id=os.path.join(path, "resume"))
    m1, o1 = fresh("tp")
    resumed = state(m1, o1)
    dcp.load(resumed, checkpoint_id=os.path.join(path, "resume"))
    dcp_optim.set_state_dict(m1, o1, model_state_dict=resumed["model"], optim_state_dict=resumed["optim"])
    ref = steps(m1, o1, 2, seed=5)
    m2, o2 = fresh("tp")
    dcp_optim.reshard_model_and_optimizer(model, optim, m2, o2, bucket_bytes=1024)
    got_losses = steps(m2, o2, 2, seed=5)
    assert got_losses == ref, (rank, got_losses, ref)
    dist.barrier()
    return {"pairs": done, "losses": got_losses}
