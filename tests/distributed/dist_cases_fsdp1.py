"""Rank functions for the FSDP1 tests (tests/distributed/test_fsdp1.py).

FSDP1 (`FullyShardedDataParallel`) runs on CPU with gloo when
`device_id=torch.device("cpu")` is given.  Every configuration is compared
with upstream on twin objects where upstream is right; where upstream fails
on this torch (see docs/torch-2.13-findings.md) the expected values come from another
upstream path that works (the same state loaded with other options, or the
full state dict without the offload).
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as upstream
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

import dcp_optim
from dcp_optim import StateDictOptions as Opts
from dcp_optim._engine import collectives as _collectives

from ..support.oracle import assert_same_optimizers, assert_same_tree
from .dist_cases import (
    MLP,
    Block,
    CollectiveCounter,
    PeakRSS,
    fsdp2_model,
    make_optimizer,
    plain_model,
    train,
)

CPU = torch.device("cpu")
WRAPPER_TOKENS = ("_fsdp_wrapped_module", "_flat_param", "_fpw_module", "FlatParameter")


def fsdp1_model(seed: int = 0, *, orig: bool, wrap: str, frozen: bool = False, mesh=None, layers: int = 2, hidden: int = 7):
    """An MLP under FSDP1: "nested" wraps every Block and the root, "root"
    wraps only the root (one flat parameter for everything)."""
    torch.manual_seed(seed)
    model = MLP(width=8, hidden=hidden, layers=layers, frozen=frozen)
    policy = ModuleWrapPolicy({Block}) if wrap == "nested" else None
    kwargs = dict(device_id=CPU, use_orig_params=orig, auto_wrap_policy=policy)
    if mesh is not None:
        kwargs["device_mesh"] = mesh
    return FSDP(model, **kwargs)


def _assert_canonical(tree: Any, what: str) -> None:
    """No FSDP wrapper token in any key or parameter name."""
    keys: list[str] = []
    if "state" in tree and "param_groups" in tree:
        keys += list(tree["state"])
        for group in tree["param_groups"]:
            keys += list(group["params"])
    else:
        keys += list(tree)
    for key in keys:
        assert not any(tok in str(key) for tok in WRAPPER_TOKENS), (what, key)


def _full_model(model) -> dict[str, torch.Tensor]:
    """Every full parameter (and buffer), through upstream's working path."""
    return upstream.get_model_state_dict(model, options=upstream.StateDictOptions(full_state_dict=True))


def _full_optim(model, optim) -> dict[str, Any]:
    return upstream.get_optimizer_state_dict(model, optim, options=upstream.StateDictOptions(full_state_dict=True))


def _sorted_state(osd: dict[str, Any]) -> dict[str, Any]:
    """FQNs and state names in sorted order (FSDP1 sorts FQNs with
    use_orig_params and iterates a set of state names when loading)."""
    return {fqn: {k: osd["state"][fqn][k] for k in sorted(osd["state"][fqn])} for fqn in sorted(osd["state"])}


def _betas_to_tuples(optim) -> None:
    for g in optim.param_groups:
        if isinstance(g.get("betas"), list):
            g["betas"] = tuple(g["betas"])


def fsdp1_suite(rank: int, ws: int, tmp: str) -> list[str]:
    """Gets (every option combination) and loads (sharded, full, broadcast,
    flattened, from a differently wrapped run) for use_orig_params
    False/True, nested/root wrapping, with and without a device mesh."""
    done = []
    mesh = init_device_mesh("cpu", (ws,))
    configs = [
        dict(orig=False, wrap="nested"),
        dict(orig=False, wrap="root"),
        dict(orig=True, wrap="nested"),
        dict(orig=True, wrap="root", frozen=True),
        dict(orig=False, wrap="nested", mesh=True),
        dict(orig=True, wrap="nested", mesh=True),
    ]
    for cfg in configs:
        label = "fsdp1[orig={orig},{wrap}{f}{m}]".format(
            orig=cfg["orig"], wrap=cfg["wrap"], f=",frozen" if cfg.get("frozen") else "",
            m=",mesh" if cfg.get("mesh") else "",
        )

        def twin(seed=0, step=True, cfg=cfg):
            m = fsdp1_model(seed, orig=cfg["orig"], wrap=cfg["wrap"], frozen=cfg.get("frozen", False),
                            mesh=mesh if cfg.get("mesh") else None)
            o = make_optimizer(m, "adam", 2 if cfg["orig"] else 1)
            if step:
                train(m, o, seed=seed)
            return m, o

        (mu, ou), (md, od) = twin(), twin()

        # --- gets: equal to upstream wherever upstream works ---------------
        for options in (
            {},
            {"full_state_dict": True},
            {"flatten_optimizer_state_dict": True},
            {"full_state_dict": True, "flatten_optimizer_state_dict": True},
        ):
            a = upstream.get_state_dict(mu, ou, options=upstream.StateDictOptions(**options))
            b = dcp_optim.get_state_dict(md, od, options=Opts(**options))
            assert_same_tree(a, b)
            _assert_canonical(b[0], label)
            if not options.get("flatten_optimizer_state_dict"):
                _assert_canonical(b[1], label)
        # full + cpu_offload: upstream's optimizer path works and is the
        # oracle; its model path fails on CPU (FSDP's offload frees the
        # CPU storage it reads), so the model oracle is the full dict
        # without offload, on rank 0 only
        off = {"full_state_dict": True, "cpu_offload": True}
        a_o = upstream.get_optimizer_state_dict(mu, ou, options=upstream.StateDictOptions(**off))
        b_o = dcp_optim.get_optimizer_state_dict(md, od, options=Opts(**off))
        if cfg["orig"]:
            # upstream bug (docs/torch-2.13-findings.md): with use_orig_params, FSDP
            # all-gathers every state name into one reused buffer and, on a
            # CPU device, ".cpu()" returns views of it: every tensor state
            # equals the last one gathered.  The oracle is the full state
            # without offload, on rank 0.
            expected_o = _full_optim(mu, ou)
            if rank == 0:
                with pytest.raises(AssertionError):
                    assert_same_tree(expected_o, a_o)
            else:
                expected_o = {}
            assert_same_tree(expected_o, b_o)
        else:
            assert_same_tree(a_o, b_o)
        b_m = dcp_optim.get_model_state_dict(md, options=Opts(**off))
        expected = _full_model(mu)  # collective: every rank
        expected = expected if rank == 0 else {}
        assert_same_tree(expected, b_m)
        assert all(v.device.type == "cpu" for v in b_m.values())
        # the optimizer's own state is untouched by every get
        assert_same_optimizers(ou, od, skip_frozen=True, sort_names=True)

        # --- sharded round trip into fresh twins, then one more step -------
        msd_u, osd_u = upstream.get_state_dict(mu, ou)
        msd_d, osd_d = dcp_optim.get_state_dict(md, od)
        (fu, fou), (fd, fod) = twin(seed=5), twin(seed=5)
        upstream.set_state_dict(fu, fou, model_state_dict=msd_u, optim_state_dict=osd_u)
        dcp_optim.set_state_dict(fd, fod, model_state_dict=msd_d, optim_state_dict=osd_d)
        assert_same_tree(_full_model(fu), _full_model(fd))
        assert_same_optimizers(fou, fod, skip_frozen=True, sort_names=True)
        train(fu, fou, steps=1, seed=9)
        train(fd, fod, steps=1, seed=9)
        assert_same_tree(_full_model(fu), _full_model(fd))
        assert_same_optimizers(fou, fod, skip_frozen=True, sort_names=True)

        # --- full loads: every rank holds the dict / broadcast from rank 0 --
        full_msd = _full_model(mu)
        full_osd = _full_optim(mu, ou)
        for broadcast in (False, True):
            opts = dict(full_state_dict=True, broadcast_from_rank0=broadcast)
            give = not broadcast or rank == 0
            (fu, fou), (fd, fod) = twin(seed=7), twin(seed=7)
            upstream.set_optimizer_state_dict(fu, fou, full_osd if give else {}, options=upstream.StateDictOptions(**opts))
            dcp_optim.set_state_dict(
                fd, fod, model_state_dict=dict(full_msd) if give else {},
                optim_state_dict=full_osd if give else {}, options=Opts(**opts),
            )
            _betas_to_tuples(fou)
            assert_same_optimizers(fou, fod, skip_frozen=True, sort_names=True)
            assert_same_tree(full_msd, _full_model(fd))
            back = _full_optim(fd, fod)
            assert_same_tree(_sorted_state(full_osd), _sorted_state(back))

        # --- flattened loads ------------------------------------------------
        flat_opts = dict(flatten_optimizer_state_dict=True)
        flat = upstream.get_optimizer_state_dict(mu, ou, options=upstream.StateDictOptions(**flat_opts))
        (tu, tou), (fd, fod) = twin(seed=8), twin(seed=8)
        # upstream's flattened load aborts the process group with
        # use_orig_params=True (a collective mismatch in FSDP's
        # optim_state_dict_to_load): the oracle is upstream's nested load of
        # the same state
        upstream.set_optimizer_state_dict(tu, tou, upstream.get_optimizer_state_dict(mu, ou))
        dcp_optim.set_optimizer_state_dict(fd, fod, flat, options=Opts(**flat_opts))
        assert_same_optimizers(tou, fod, skip_frozen=True, sort_names=True)

        # --- a never-stepped optimizer: its template, nothing installed ------
        (tu, tou), (td, tod) = twin(step=False), twin(step=False)
        template = dcp_optim.get_optimizer_state_dict(td, tod)
        assert len(tod.state) == 0, "a get must not install state (D1)"
        reference = upstream.get_optimizer_state_dict(tu, tou)
        assert list(template["state"]) == list(reference["state"]), label
        for fqn, st in reference["state"].items():
            assert sorted(template["state"][fqn]) == sorted(st), fqn
            for key, value in st.items():
                mine = template["state"][fqn][key]
                assert type(mine) is type(value) and mine.dtype == value.dtype and mine.shape == value.shape, (fqn, key)
                if key == "step":
                    assert float(mine) == 0.0  # D2: pristine, not fake-stepped
        done.append(label)

    # --- a checkpoint from a differently wrapped run -----------------------
    # nested, flat parameters -> root, original parameters (and back)
    src, src_o = fsdp1_model(3, orig=False, wrap="nested"), None
    src_o = make_optimizer(src, "adam", 1)
    train(src, src_o, seed=3)
    for options in ({}, {"full_state_dict": True}):
        msd, osd = dcp_optim.get_state_dict(src, src_o, options=Opts(**options))
        dst = fsdp1_model(4, orig=True, wrap="root")
        dst_o = make_optimizer(dst, "adam", 1)
        if options:
            dcp_optim.set_state_dict(dst, dst_o, model_state_dict=msd, optim_state_dict=osd, options=Opts(**options))
        else:
            # sharded ShardedTensors of another wrapping: through DCP
            path = os.path.join(tmp, "rewrap")
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
            t_msd, t_osd = dcp_optim.get_state_dict(dst, dst_o)
            state = {"model": t_msd, "optim": t_osd}
            dcp.load(state, checkpoint_id=path)
            dcp_optim.set_state_dict(dst, dst_o, model_state_dict=state["model"], optim_state_dict=state["optim"])
        assert_same_tree(_full_model(src), _full_model(dst))
        assert_same_tree(_sorted_state(_full_optim(src, src_o)), _sorted_state(_full_optim(dst, dst_o)))
        train(dst, dst_o, steps=1, seed=5)
    done.append("rewrap")
    dist.barrier()
    return done


# --- cross-framework moves through DCP ----------------------------------------------


def build(kind: str, seed: int = 0):
    """The same MLP (width 8, hidden 8) under every framework."""
    if kind == "fsdp1":
        return fsdp1_model(seed, orig=False, wrap="nested", hidden=8)
    if kind == "fsdp1_orig":
        return fsdp1_model(seed, orig=True, wrap="root", hidden=8)
    if kind == "fsdp2":
        return fsdp2_model(init_device_mesh("cpu", (dist.get_world_size(),)), seed, hidden=8)
    if kind == "plain":
        return plain_model(seed, hidden=8)
    raise ValueError(kind)


def save(rank: int, ws: int, path: str, kind: str) -> str:
    """Train `kind`, save model + optimizer with DCP (sharded state dicts),
    and write the full reference values (rank 0)."""
    model = build(kind)
    optim = make_optimizer(model, "adam", 1)
    train(model, optim, steps=2, seed=3)
    msd, osd = dcp_optim.get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    full = Opts(full_state_dict=True, cpu_offload=True)
    full_m, full_o = dcp_optim.get_state_dict(model, optim, options=full)
    if rank == 0:
        torch.save({"model": full_m, "optim": full_o}, os.path.join(path, "reference.pt"))
    dist.barrier()
    return "saved"


def load(rank: int, ws: int, path: str, kind: str) -> dict[str, Any]:
    """Template flow into `kind` at this world size; every full tensor
    equals the saved run's, and training continues."""
    model = build(kind, seed=11)
    optim = make_optimizer(model, "adam", 1)
    msd, osd = dcp_optim.get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    dcp_optim.set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full = Opts(full_state_dict=True, cpu_offload=True)
    full_m, full_o = dcp_optim.get_state_dict(model, optim, options=full)
    result: dict[str, Any] = {"rank": rank}
    if rank == 0:
        ref = torch.load(os.path.join(path, "reference.pt"), weights_only=False)
        assert_same_tree(ref["model"], full_m)
        assert_same_tree(_sorted_state(ref["optim"]), _sorted_state(full_o))
        result["tensors"] = len(full_m) + sum(len(v) for v in full_o["state"].values())
    train(model, optim, steps=1, seed=4)
    dist.barrier()
    return result


# --- collectives and memory ----------------------------------------------------------


def collectives_case(rank: int, ws: int, layers: int) -> dict[str, Any]:
    """Collectives during a full optimizer-state gather of an FSDP1 model
    with `layers` + 1 flat parameters, upstream vs dcp_optim."""
    model = fsdp1_model(0, orig=False, wrap="nested", layers=layers)
    optim = make_optimizer(model, "adam", 1)
    train(model, optim, steps=1, seed=1)
    full = dict(full_state_dict=True)
    with CollectiveCounter() as ours:
        b = dcp_optim.get_optimizer_state_dict(model, optim, options=Opts(**full))
    with CollectiveCounter() as theirs:
        a = upstream.get_optimizer_state_dict(model, optim, options=upstream.StateDictOptions(**full))
    assert_same_tree(a, b)
    flat_params = sum(1 for p in model.parameters())
    dist.barrier()
    return {
        "flat_params": flat_params,
        "ours": ours.total,
        "ours_detail": ours.counts,
        "upstream": theirs.total,
        "upstream_detail": theirs.counts,
    }


def _return_freed_memory() -> None:
    """glibc raises its mmap threshold after large frees, so freed tensors
    stay resident and RSS stops measuring live memory: pin the threshold
    (M_MMAP_THRESHOLD = -3) at 64 KiB and trim eagerly (M_TRIM_THRESHOLD =
    -1)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)
    libc.mallopt(-1, 0)


def memory_case(rank: int, ws: int, state_mb: int, bucket_mb: int, impl: str = "dcp_optim") -> dict[str, Any]:
    """Peak RSS above the start during a full optimizer-state gather of an
    FSDP1 model whose full Adam moments total `state_mb` MB."""
    _return_freed_memory()
    n = state_mb * 2**20 // 8  # two fp32 moments per element
    width = 256
    rows = n // width // 8
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, rows, bias=False) for _ in range(8)])
    model = FSDP(model, device_id=CPU, use_orig_params=False,
                 auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optim.step()
    previous = _collectives.set_bucket_bytes(bucket_mb * 2**20)
    dist.barrier()
    try:
        with PeakRSS() as mem:
            if impl == "dcp_optim":
                out = dcp_optim.get_optimizer_state_dict(model, optim, options=Opts(full_state_dict=True))
            else:
                out = upstream.get_optimizer_state_dict(
                    model, optim, options=upstream.StateDictOptions(full_state_dict=True)
                )
        result_bytes = sum(
            v.numel() * v.element_size() for st in out["state"].values() for v in st.values() if v.dim() > 0
        )
        del out
    finally:
        _collectives.set_bucket_bytes(previous)
    dist.barrier()
    return {
        "rank": rank,
        "peak_delta": mem.peak - mem.base,
        "result_bytes": result_bytes,
        "bucket_bytes": bucket_mb * 2**20,
    }


# --- chunks torch.chunk leaves out ------------------------------------------------------


class _Narrow(nn.Module):
    """Parameters whose rows ``torch.chunk`` splits into fewer chunks than
    ranks: a head of one row (any world) and a layer of 5 rows (4 ranks:
    chunks of 2, 2, 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 5)
        self.head = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def _narrow(seed: int, orig: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = FSDP(_Narrow(), device_id=CPU, use_orig_params=orig)
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def _narrow_train(model: nn.Module, optim: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for i in steps:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * i + dist.get_rank()))
        loss = model(x).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def real_shards(tree: Any) -> Any:
    """``tree`` with each ShardedTensor as (size, its non-empty shards'
    metadata, its non-empty local shards): what two dicts that differ
    only in zero-size shards share."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(tree, dict):
        return {k: real_shards(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(real_shards(v) for v in tree)
    if isinstance(tree, ShardedTensor):
        md = tree.metadata()
        return (tuple(md.size), [(m.shard_offsets, m.shard_sizes, str(m.placement)) for m in md.shards_metadata
                                 if 0 not in m.shard_sizes],
                [s.tensor for s in tree.local_shards() if s.tensor.numel()])
    return tree


def narrow_chunks_case(rank: int, ws: int, path: str) -> list[str]:
    """FSDP1 sharded state dicts (ShardedTensors) of parameters that leave
    the last ranks without a chunk.  Upstream's dicts have no shard there,
    and DCP's load of model and optimizer together fails on them ("Missing
    key in checkpoint state_dict: ..."): its planner drops such entries
    from the template and takes the checkpoint for a pre-2.4 one, whose
    flattening spells the nested optimizer dict's param_groups otherwise.
    dcp_optim's list a zero-size shard for every such rank (otherwise the
    same values): the resume continues bit for bit, nested and flattened,
    and a checkpoint upstream wrote loads into its templates too."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out = []
    for orig in (False, True):
        for flat in (False, True):
            where = f"{path}/orig{int(orig)}-flat{int(flat)}"
            model, optim = _narrow(0, orig)
            _narrow_train(model, optim, range(2))
            kw = {"flatten_optimizer_state_dict": flat}
            ours = dcp_optim.get_state_dict(model, optim, options=Opts(**kw))
            theirs = upstream.get_state_dict(model, optim, options=upstream.StateDictOptions(**kw))
            assert_same_tree(real_shards(ours), real_shards(theirs))
            sharded = [v for v in ours[0].values() if isinstance(v, ShardedTensor)]
            assert sharded and all(len(v.metadata().shards_metadata) == ws and len(v.local_shards()) == 1
                                   for v in sharded)
            dcp.save({"model": ours[0], "optim": ours[1]}, checkpoint_id=f"{where}/ours")
            dcp.save({"model": theirs[0], "optim": theirs[1]}, checkpoint_id=f"{where}/theirs")
            expected = _narrow_train(model, optim, range(2, 4))

            for impl, options in ((upstream, upstream.StateDictOptions(**kw)), (dcp_optim, Opts(**kw))):
                for saved in ("ours", "theirs"):
                    resumed, ropt = _narrow(5, orig)
                    msd, osd = impl.get_state_dict(resumed, ropt, options=options)
                    state = {"model": msd, "optim": osd}
                    try:
                        dcp.load(state, checkpoint_id=f"{where}/{saved}")
                    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
                        assert impl is upstream and "Missing key in checkpoint state_dict" in str(exc), exc
                        out.append(f"upstream's template, {saved}: missing key")
                        continue
                    if impl is upstream:  # flattened: no list for the old format to spell otherwise
                        out.append(f"upstream's template, {saved}: loaded")
                        continue
                    impl.set_state_dict(resumed, ropt, model_state_dict=state["model"],
                                        optim_state_dict=state["optim"], options=options)
                    assert _narrow_train(resumed, ropt, range(2, 4)) == expected, (orig, flat, saved)
                    out.append(f"ours, {saved}: resumed")
    return out


class _Interleaved(nn.Module):
    """Root parameters whose names sort around a wrapped block's ("a" <
    "blocks" < "z"), and a module FSDP ignores ("skip")."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.blocks = nn.Sequential(Block(6, 7), Block(6, 7))
        self.skip = nn.Linear(6, 6)
        self.z = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.a(x))
        return self.z(x + self.skip(x))


def key_order_case(rank: int, ws: int) -> list[str]:
    """use_orig_params: the optimizer state's keys in FSDP's order (its
    merged keys sorted, the parameters it does not manage first, then each
    flat parameter's originals together, flat parameters in the order of
    their first key), which is not one sorted list when a flat parameter's
    names sort around another's: every getter format equals upstream's."""
    out = []
    for ignored in (False, True):
        torch.manual_seed(0)
        net = _Interleaved()
        model = FSDP(net, device_id=CPU, use_orig_params=True, auto_wrap_policy=ModuleWrapPolicy({Block}),
                     ignored_modules=[net.skip] if ignored else None)
        optim = torch.optim.Adam(model.parameters(), lr=0.1)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
        model(x).pow(2).mean().backward()
        optim.step()
        for kw in ({}, {"flatten_optimizer_state_dict": True}, {"full_state_dict": True}):
            ours = dcp_optim.get_optimizer_state_dict(model, optim, options=Opts(**kw))
            theirs = upstream.get_optimizer_state_dict(model, optim, options=upstream.StateDictOptions(**kw))
            assert_same_tree(real_shards(ours), real_shards(theirs))
        keys = list(dcp_optim.get_optimizer_state_dict(model, optim)["state"])
        assert keys != sorted(keys), keys  # the case this covers
        out.append(f"ignored={ignored}: {keys[0]} ... {keys[-1]}")
    return out


class _Wide(nn.Module):
    """Every parameter in as many chunks as ranks (at 2 ranks a group)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def hsdp_case(rank: int, ws: int, path: str) -> list[str]:
    """FSDP1 HYBRID_SHARD over a (replicate, shard) pair of groups (2 x 2;
    its state dicts are ShardedTensors over the shard group, made by
    FSDP's own optimizer-state functions): a never-stepped optimizer's
    template held no state at all, so the DCP resume into a fresh run left
    the checkpoint's moments behind, silently.  Now: gets equal
    upstream's, the template names every parameter's state, and the resume
    continues bit for bit, also for parameters with fewer chunks than the
    shard group has ranks (D40; upstream's template fails ``dcp.load``).
    With a device mesh instead, both formats resume.  Full dicts with
    ``cpu_offload`` hold every state of its own (D41)."""
    from torch.distributed.fsdp import ShardingStrategy

    mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard"))
    groups = (mesh.get_group(1), mesh.get_group(0))  # (shard, replicate)

    def make(cls: type, seed: int, orig: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = FSDP(cls(), device_id=CPU, use_orig_params=orig, sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                     process_group=groups)
        return model, torch.optim.Adam(model.parameters(), lr=0.1)

    # with a device mesh (DTensor state), a flattened dict into a
    # never-stepped optimizer: FSDP's conversion got every state empty
    # (upstream's unflattening looks up the names the live optimizer
    # holds: none) and raised, where upstream's load, which steps the
    # optimizer first, works
    out = []
    for flat in (False, True):
        options = Opts(flatten_optimizer_state_dict=flat)
        torch.manual_seed(0)
        model = FSDP(_Wide(), device_id=CPU, device_mesh=mesh, sharding_strategy=ShardingStrategy.HYBRID_SHARD)
        optim = torch.optim.Adam(model.parameters(), lr=0.1)
        _narrow_train(model, optim, range(2))
        msd, osd = dcp_optim.get_state_dict(model, optim, options=options)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{path}/mesh-{int(flat)}")
        expected = _narrow_train(model, optim, range(2, 4))
        torch.manual_seed(5)
        resumed = FSDP(_Wide(), device_id=CPU, device_mesh=mesh, sharding_strategy=ShardingStrategy.HYBRID_SHARD)
        ropt = torch.optim.Adam(resumed.parameters(), lr=0.1)
        msd, osd = dcp_optim.get_state_dict(resumed, ropt, options=options)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=f"{path}/mesh-{int(flat)}")
        dcp_optim.set_state_dict(resumed, ropt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                                 options=options)
        assert _narrow_train(resumed, ropt, range(2, 4)) == expected, flat
        out.append(f"mesh, flat={flat}: ours resumed")

    for cls in (_Wide, _Narrow):
        for orig in (False, True):
            where = f"{path}/{cls.__name__}-{int(orig)}"
            model, optim = make(cls, 0, orig)
            _narrow_train(model, optim, range(2))
            for kw in ({}, {"flatten_optimizer_state_dict": True}, {"full_state_dict": True}):
                ours = dcp_optim.get_state_dict(model, optim, options=Opts(**kw))
                theirs = upstream.get_state_dict(model, optim, options=upstream.StateDictOptions(**kw))
                assert_same_tree(real_shards(ours), real_shards(theirs))
            # D41: offloaded full dicts (a no-op offload on CPU) hold each
            # state of its own, as without the offload; upstream's, under
            # use_orig_params, give every state of a parameter the last
            # one FSDP gathered (its views of one reused buffer)
            options = {"full_state_dict": True, "cpu_offload": True}
            offloaded = dcp_optim.get_optimizer_state_dict(model, optim, options=Opts(**options))
            theirs = upstream.get_optimizer_state_dict(model, optim, options=upstream.StateDictOptions(**options))
            if rank == 0:
                full = dcp_optim.get_optimizer_state_dict(model, optim, options=Opts(full_state_dict=True))
                assert_same_tree(offloaded, full)
                aliased = [torch.equal(e["exp_avg"], e["exp_avg_sq"]) for e in theirs["state"].values()]
                assert aliased == [orig] * len(full["state"]), (orig, aliased)
            else:
                dcp_optim.get_optimizer_state_dict(model, optim, options=Opts(full_state_dict=True))
            msd, osd = dcp_optim.get_state_dict(model, optim)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=where)
            expected = _narrow_train(model, optim, range(2, 4))
            for impl, options in ((upstream, upstream.StateDictOptions()), (dcp_optim, Opts())):
                resumed, ropt = make(cls, 5, orig)
                msd, osd = impl.get_state_dict(resumed, ropt, options=options)
                assert sorted(osd["state"]) == sorted(msd), (impl.__name__, list(osd["state"]))  # every parameter
                state = {"model": msd, "optim": osd}
                try:
                    dcp.load(state, checkpoint_id=where)
                except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
                    assert impl is upstream and cls is _Narrow and "Missing key" in str(exc), exc
                    out.append(f"{cls.__name__}, orig={orig}: upstream's template fails")
                    continue
                impl.set_state_dict(resumed, ropt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                                    options=options)
                assert _narrow_train(resumed, ropt, range(2, 4)) == expected, (impl.__name__, cls, orig)
                out.append(f"{cls.__name__}, orig={orig}: {'ours' if impl is dcp_optim else 'upstream'} resumed")
    return out


def _resume_flow(make: Any, path: str, options: Any) -> bool:
    """Train two steps, save through DCP, resume a fresh model and
    never-stepped optimizer from it (template, ``dcp.load``, set): whether
    two more steps give the losses of the run that never stopped."""
    model, optim = make(0)
    _narrow_train(model, optim, range(2))
    msd, osd = dcp_optim.get_state_dict(model, optim, options=options)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    expected = _narrow_train(model, optim, range(2, 4))
    resumed, ropt = make(5)
    msd, osd = dcp_optim.get_state_dict(resumed, ropt, options=options)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    dcp_optim.set_state_dict(resumed, ropt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                             options=options)
    return _narrow_train(resumed, ropt, range(2, 4)) == expected


def optimizer_values_case(rank: int, ws: int, path: str) -> list[str]:
    """FSDP1, optimizers whose state is not only parameters' tensors:

    * pytorch-optimizer's MADGRAD keeps an optimizer-wide counter ``k``
      (D29): FSDP1's getters dropped it (and FSDP's own function, which
      HSDP takes, raised ``KeyError``), so the resume restarted it, silently;
    * transformers' Adafactor keeps each parameter's RMS, which with
      ``use_orig_params`` each rank computes from its piece: the ranks
      disagree, so a get raises InconsistentOptimizerStateError (an
      AssertionError, as FSDP's own gather); the value is recomputed at
      every step, and with the rank-local check off it saves the last
      rank's and resumes exactly.
    At 2 ranks FSDP1 on the native path; at 4 ranks HYBRID_SHARD (2 x 2),
    FSDP's own functions."""
    import os

    import pytorch_optimizer
    from torch.distributed.fsdp import ShardingStrategy
    from transformers.optimization import Adafactor

    from dcp_optim import errors
    from dcp_optim._engine.ranklocal import CHECK_ENV

    hybrid = {}
    if ws == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        hybrid = {"sharding_strategy": ShardingStrategy.HYBRID_SHARD, "device_mesh": mesh}
    madgrad = pytorch_optimizer.load_optimizer("madgrad")

    def maker(optimizer: Any, orig: bool) -> Any:
        def make(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
            torch.manual_seed(seed)
            model = FSDP(_Wide(), device_id=CPU, use_orig_params=orig, **hybrid)
            return model, optimizer(model.parameters())
        return make

    out = []
    for orig in (False, True):
        for flat in (False, True):
            options = Opts(flatten_optimizer_state_dict=flat)
            make = maker(lambda p: madgrad(p, lr=0.05), orig)
            resumed = _resume_flow(make, f"{path}/madgrad-{int(orig)}-{int(flat)}", options)
            out.append(f"MADGRAD orig={orig} flat={flat}: {'resumed' if resumed else 'DIVERGED'}")
    if ws == 2:
        make = maker(lambda p: Adafactor(p, lr=0.01, relative_step=False, scale_parameter=False), True)
        model, optim = make(0)
        _narrow_train(model, optim, range(2))
        try:
            dcp_optim.get_optimizer_state_dict(model, optim)
            out.append("Adafactor: no error")
        except errors.InconsistentOptimizerStateError as exc:
            assert isinstance(exc, AssertionError) and exc.key == "body.weight.RMS", exc
            out.append(f"Adafactor: {type(exc).__name__} {exc.key}")
        os.environ[CHECK_ENV] = "0"
        try:
            resumed = _resume_flow(make, f"{path}/adafactor", Opts())
        finally:
            del os.environ[CHECK_ENV]
        out.append(f"Adafactor, {CHECK_ENV}=0: {'resumed' if resumed else 'DIVERGED'}")
    return out


def flat_scalars_case(rank: int, ws: int, path: str) -> list[str]:
    """Loading into FSDP1 without ``use_orig_params``: a flat parameter
    holds one value of each 0-dim or non-tensor state for all of its
    original parameters.  A checkpoint from another layout (one process,
    FSDP2, ``use_orig_params=True``) holds one per parameter; where they
    differ (NovoGrad's per-parameter gradient norm) dcp_optim took the
    first and dropped the others, silently.  Now, as FSDP's own
    flattening (upstream's load): a ``ValueError`` (ours a
    ``StateDictValueError`` naming the parameters and the state) on every
    rank, the optimizer unchanged; also for state names that differ
    between the parameters, and a 0-dim state some parameters lack.
    Equal values still load."""
    model, optim = _narrow(0, False)  # one flat parameter: body.weight, body.bias, head.weight, head.bias
    _narrow_train(model, optim, range(2))
    good = dcp_optim.get_optimizer_state_dict(model, optim, options=Opts(full_state_dict=True))
    before = _full_optim(model, optim)

    def step_differs(osd):
        osd["state"]["head.bias"]["step"] = torch.tensor(7.0)

    def names_differ(osd):
        del osd["state"]["head.bias"]["exp_avg_sq"]

    def step_missing(osd):
        del osd["state"]["head.bias"]["step"]

    out = []
    for label, change in (("step differs", step_differs), ("names differ", names_differ),
                          ("step missing", step_missing)):
        for impl, options in ((dcp_optim, Opts(full_state_dict=True)),
                              (upstream, upstream.StateDictOptions(full_state_dict=True))):
            osd = {"state": {k: dict(v) for k, v in good["state"].items()}, "param_groups": good["param_groups"]}
            change(osd)
            try:
                impl.set_optimizer_state_dict(model, optim, osd, options=options)
            except ValueError as exc:
                name = type(exc).__name__
                if impl is dcp_optim:
                    assert "head.bias" in str(exc) and "body.weight" in str(exc), exc
                out.append(f"{label}: {'ours' if impl is dcp_optim else 'upstream'} {name}")
            else:
                out.append(f"{label}: {'ours' if impl is dcp_optim else 'upstream'} loaded")
            assert_same_tree(_full_optim(model, optim), before)
    dcp_optim.set_optimizer_state_dict(model, optim, good, options=Opts(full_state_dict=True))
    assert_same_tree(_full_optim(model, optim), before)
    out.append("equal values: loaded")

    # Through DCP, from a plain model whose head.bias missed the first
    # step (no gradient: Adam skips it, its step lags).  FSDP's templates
    # (upstream's) give the originals one "step" tensor: dcp.load wrote
    # every parameter's value into it in turn, the last one stayed, and
    # upstream's set loads that for all: the checkpoint's steps 2 and 1
    # became one of them, silently.  dcp_optim's templates hold a tensor per
    # parameter, and its set refuses the differing values.
    torch.manual_seed(0)
    plain = _Wide()  # chunks on every rank: upstream's template loads (D40)
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.1)
    for i in range(2):
        plain(torch.randn(4, 8)).pow(2).mean().backward()
        if i == 0:
            plain.head.bias.grad = None
        plain_opt.step()
        plain_opt.zero_grad()
    saved = dcp_optim.get_optimizer_state_dict(plain, plain_opt)
    assert [float(saved["state"][k]["step"]) for k in ("body.weight", "head.bias")] == [2.0, 1.0]
    dcp.save({"optim": saved}, checkpoint_id=f"{path}/lagging")
    for impl, options in ((dcp_optim, Opts()), (upstream, upstream.StateDictOptions())):
        torch.manual_seed(5)
        model = FSDP(_Wide(), device_id=CPU, use_orig_params=False)
        optim = torch.optim.Adam(model.parameters(), lr=0.1)
        state = {"optim": impl.get_optimizer_state_dict(model, optim, options=options)}
        dcp.load(state, checkpoint_id=f"{path}/lagging")
        who = "ours" if impl is dcp_optim else "upstream"
        loaded = {k: float(v["step"]) for k, v in state["optim"]["state"].items()}
        try:
            impl.set_optimizer_state_dict(model, optim, state["optim"], options=options)
        except ValueError as exc:
            assert loaded == {k: float(v["step"]) for k, v in saved["state"].items()}, loaded
            out.append(f"lagging step through DCP: {who} {type(exc).__name__}")
        else:
            steps = {float(s["step"]) for s in optim.state.values()}
            out.append(f"lagging step through DCP: {who} loaded {len(steps)} step for 4 parameters")
    return out


def wrapper_layout_case(rank: int, ws: int) -> list[str]:
    """pytorch-optimizer's Lookahead under FSDP1: its ``state_dict()``
    keeps the slow weights by (group, index) beside the base optimizer's
    dict, which FSDP1's cut into flat-parameter pieces cannot see.  Its
    get raised ``KeyError: 'param_groups'``, and a full dict from a plain
    model loaded the slow weights whole (shape (3, 5)) beside pieces of
    (10,).  Now both refuse on every rank with ``StateDictValueError``,
    naming the wrapper, the optimizer unchanged."""
    po = pytest.importorskip("pytorch_optimizer")
    torch.manual_seed(0)
    plain = _Wide()
    plain_opt = po.Lookahead(torch.optim.AdamW(plain.parameters(), lr=0.01), k=2)
    plain(torch.randn(4, 8)).sum().backward()
    plain_opt.step()
    full = dcp_optim.get_optimizer_state_dict(plain, plain_opt, options=Opts(full_state_dict=True))
    out = []
    for orig in (True, False):
        torch.manual_seed(1)
        model = FSDP(_Wide(), device_id=CPU, use_orig_params=orig)
        optim = po.Lookahead(torch.optim.AdamW(model.parameters(), lr=0.01), k=2)
        model(torch.randn(4, 8)).sum().backward()
        optim.step()
        before = optim.state_dict()
        for what, call in (
            ("get", lambda: dcp_optim.get_optimizer_state_dict(model, optim)),
            ("full load", lambda: dcp_optim.set_optimizer_state_dict(model, optim, full,
                                                                     options=Opts(full_state_dict=True))),
        ):
            try:
                call()
                out.append(f"orig={orig} {what}: no error")
            except dcp_optim.errors.StateDictValueError as exc:
                assert "Lookahead" in str(exc) and "FSDP1" in str(exc), exc
                out.append(f"orig={orig} {what}: StateDictValueError")
            assert_same_tree(optim.state_dict(), before)
    return out


def optimizer_extras_case(rank: int, ws: int, path: str) -> list[str]:
    """Top-level entries of an optimizer's own ``state_dict()`` besides
    "state" and "param_groups" (pytorch-optimizer's Ranger21 keeps its
    ``lookahead_step`` there): the FSDP1 getters dropped them, so a DCP
    resume restarted the lookahead counter at 0 -- silently, the merge
    then came steps late.  Now they are in the dict as for plain models,
    and the resume installs them."""
    po = pytest.importorskip("pytorch_optimizer")
    out = []
    for orig in (True, False):
        def make(seed: int):
            torch.manual_seed(seed)
            model = FSDP(_Wide(), device_id=CPU, use_orig_params=orig)
            return model, po.Ranger21(model.parameters(), num_iterations=100, lr=0.01)

        model, optim = make(0)
        _narrow_train(model, optim, range(3))
        for flat in (False, True):
            options = Opts(flatten_optimizer_state_dict=flat)
            saved = dcp_optim.get_optimizer_state_dict(model, optim, options=options)
            assert saved["lookahead_step"] == optim.lookahead_step == 3, saved.get("lookahead_step")
            dcp.save({"optim": saved}, checkpoint_id=f"{path}/r21-{int(orig)}-{int(flat)}")
            resumed, ropt = make(1)
            state = {"optim": dcp_optim.get_optimizer_state_dict(resumed, ropt, options=options)}
            dcp.load(state, checkpoint_id=f"{path}/r21-{int(orig)}-{int(flat)}")
            dcp_optim.set_optimizer_state_dict(resumed, ropt, state["optim"], options=options)
            out.append(f"orig={orig} flat={flat}: lookahead_step {ropt.lookahead_step}")
        full = dcp_optim.get_optimizer_state_dict(model, optim, options=Opts(full_state_dict=True, cpu_offload=True))
        out.append(f"orig={orig} full on this rank: {'lookahead_step' in full}")
    return out


def hsdp_extras_case(rank: int, ws: int, path: str) -> list[str]:
    """The same under HYBRID_SHARD (FSDP's own optimizer-state functions):
    the get keeps Ranger21's ``lookahead_step``, and the load gives it to
    Ranger21's own ``load_state_dict`` with FSDP's converted dict."""
    import pytorch_optimizer as po
    from torch.distributed.fsdp import ShardingStrategy

    mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard"))
    groups = (mesh.get_group(1), mesh.get_group(0))
    out = []
    for orig in (True, False):
        def make(seed: int):
            torch.manual_seed(seed)
            model = FSDP(_Wide(), device_id=CPU, use_orig_params=orig,
                         sharding_strategy=ShardingStrategy.HYBRID_SHARD, process_group=groups)
            return model, po.Ranger21(model.parameters(), num_iterations=100, lr=0.01)

        model, optim = make(0)
        _narrow_train(model, optim, range(3))
        saved = dcp_optim.get_optimizer_state_dict(model, optim)
        dcp.save({"optim": saved}, checkpoint_id=f"{path}/hsdp-r21-{int(orig)}")
        resumed, ropt = make(1)
        state = {"optim": dcp_optim.get_optimizer_state_dict(resumed, ropt)}
        dcp.load(state, checkpoint_id=f"{path}/hsdp-r21-{int(orig)}")
        dcp_optim.set_optimizer_state_dict(resumed, ropt, state["optim"])
        out.append(f"orig={orig}: saved {saved.get('lookahead_step')}, loaded {ropt.lookahead_step}")
    return out


def regroup_case(rank: int, ws: int) -> list[str]:
    """A checkpoint of two differently configured param groups (body: lr
    0.05, weight decay 0.1; head: lr 0.01, none) loaded into one group --
    as an FSDP1 flat parameter over both layers must be (use_orig_params=
    False), or FSDP2 built with one group.  Upstream's full load gives the
    one group the last saved group's values, so the body goes on with the
    head's learning rate and no weight decay, silently; dcp_optim raises
    ``ParamGroupConflictError`` on every rank (full and broadcast loads),
    the optimizer unchanged."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    plain = _Wide()
    plain_opt = torch.optim.AdamW([
        {"params": plain.body.parameters(), "lr": 0.05, "weight_decay": 0.1},
        {"params": plain.head.parameters(), "lr": 0.01, "weight_decay": 0.0},
    ])
    plain(torch.randn(4, 8)).sum().backward()
    plain_opt.step()
    full = dcp_optim.get_optimizer_state_dict(plain, plain_opt, options=Opts(full_state_dict=True))
    out = []
    layouts = [(f"FSDP1 orig={o}", lambda o=o: FSDP(_Wide(), device_id=CPU, use_orig_params=o)) for o in (True, False)]
    layouts.append(("FSDP2", lambda: fully_shard(_Wide(), mesh=init_device_mesh("cpu", (ws,)))))
    for label, build in layouts:
        for bcast in (False, True):
            torch.manual_seed(1)
            model = build()
            optim = torch.optim.AdamW(model.parameters(), lr=0.02)
            model(torch.randn(4, 8)).sum().backward()
            optim.step()
            before = copy.deepcopy(optim.state_dict())
            given = full if rank == 0 or not bcast else {}
            try:
                dcp_optim.set_optimizer_state_dict(model, optim, dict(given), options=Opts(
                    full_state_dict=True, broadcast_from_rank0=bcast))
                out.append(f"{label} bcast={bcast}: loaded")
            except dcp_optim.errors.ParamGroupConflictError as exc:
                assert "different 'lr' (0.05 for 'body.weight', 0.01 for 'head.weight')" in str(exc), exc
                out.append(f"{label} bcast={bcast}: ParamGroupConflictError")
                assert_same_tree(optim.state_dict(), before)
        if label != "FSDP1 orig=False":  # upstream's FSDP1 flat load goes through FSDP's own conversion
            torch.manual_seed(1)
            model = build()
            optim = torch.optim.AdamW(model.parameters(), lr=0.02)
            upstream.set_optimizer_state_dict(model, optim, dict(full),
                                              options=upstream.StateDictOptions(full_state_dict=True))
            out.append(f"{label} upstream: lr {optim.param_groups[0]['lr']}, "
                       f"weight_decay {optim.param_groups[0]['weight_decay']}")
    dist.barrier()
    return out


def nested_state_broadcast_case(rank: int, ws: int) -> list[str]:
    """pytorch-optimizer's SOAP keeps ``GG``, a list of per-dimension
    preconditioners, beside each parameter.  A full dict of it saved at one
    process, broadcast into FSDP1: the stream carries the state tensors it
    cuts into pieces, not tensors inside a list, so the receivers held
    only their metadata and failed in the install with a ``TypeError`` of
    the metadata's class; now ``StateDictValueError`` naming the state,
    on every rank, the optimizer unchanged.  (Each rank holding the full
    dict passes the lists through, as upstream.)"""
    from pytorch_optimizer import SOAP

    torch.manual_seed(0)
    plain = _Wide()
    plain_opt = SOAP(plain.parameters(), lr=1e-2)
    for _ in range(2):
        plain(torch.randn(4, 8)).sum().backward()
        plain_opt.step()
        plain_opt.zero_grad()
    full = dcp_optim.get_optimizer_state_dict(plain, plain_opt, options=Opts(full_state_dict=True))
    assert isinstance(full["state"]["body.weight"]["GG"], list)
    out = []
    for orig in (True, False):
        torch.manual_seed(1)
        model = FSDP(_Wide(), device_id=CPU, use_orig_params=orig)
        optim = SOAP(model.parameters(), lr=1e-2)
        model(torch.randn(4, 8)).sum().backward()
        optim.step()
        before = copy.deepcopy(optim.state_dict())
        try:
            dcp_optim.set_optimizer_state_dict(model, optim, dict(full) if rank == 0 else {}, options=Opts(
                full_state_dict=True, broadcast_from_rank0=True))
            out.append(f"orig={orig}: loaded")
        except Exception as exc:  # noqa: BLE001 - recorded
            out.append(f"orig={orig}: {type(exc).__name__}: {str(exc)[:80]}")
            assert_same_tree(optim.state_dict(), before)
    dist.barrier()
    return out


def nested_state_pieces_case(rank: int, ws: int) -> list[str]:
    """heavyball keeps each parameter's state in a dict per view
    (``state[p][0]["update_by_adam_exp_avg_0"]``).  Under FSDP1 it steps
    each rank's piece of a flat parameter, so those tensors are pieces,
    which no FSDP1 mapping knows inside a dict: dcp_optim refuses the get
    on every rank, naming the entry; upstream's sharded get with flat
    parameters returns each rank's own flat-shard state under every
    original name (the same tensors for the weight and the bias, other
    values on each rank), with original parameters it raises."""
    import gc
    import warnings

    import heavyball

    warnings.simplefilter("ignore")
    out = []
    for orig in (True, False):
        torch.manual_seed(0)
        model = FSDP(_Wide(), device_id=CPU, use_orig_params=orig, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
        optim = heavyball.AdamW(model.parameters(), lr=0.1)
        for i in range(2):
            torch.manual_seed(10 + i)
            model(torch.randn(4, 8)).sum().backward()
            optim.step()
            optim.zero_grad()
        before = copy.deepcopy(optim.state_dict())
        try:
            dcp_optim.get_optimizer_state_dict(model, optim)
            out.append(f"orig={orig} ours: saved")
        except dcp_optim.errors.InconsistentOptimizerStateError as exc:
            assert "holds tensors inside a dict" in str(exc) and "'body.weight'" in str(exc), exc
            out.append(f"orig={orig} ours: InconsistentOptimizerStateError")
        assert_same_tree(optim.state_dict(), before)
        try:
            theirs = upstream.get_optimizer_state_dict(model, optim)
        except RuntimeError:
            out.append(f"orig={orig} upstream: RuntimeError")
        else:
            weight, bias = (theirs["state"][f"body.{n}"][0]["update_by_adam_exp_avg_0"] for n in ("weight", "bias"))
            shard = optim.state[optim.param_groups[0]["params"][0]][0]["update_by_adam_exp_avg_0"]
            same = weight is bias or torch.equal(weight, bias)
            out.append(f"orig={orig} upstream: this rank's flat shard under both names: "
                       f"{same and torch.equal(weight, shard)}")
        # heavyball looks for FSDP's flat parameters among all live
        # objects: a dead weak proxy of this model's would break its step
        del model, optim, before
        gc.collect()
    dist.barrier()
    return out


def partial_flat_case(rank: int, ws: int, path: str) -> list[str]:
    """D48: a checkpoint of a plain model whose ``1.weight`` was frozen for
    the first steps (saved without state: marked) while ``1.bias``
    trained, loaded into FSDP1 with use_orig_params=False, where both are
    one flat parameter -- one optimizer entry.  The entry is loaded whole
    (the bias's trained moments kept, the weight's template in its
    place): leaving out the marked weight's entry would have dropped the
    bias's state with it."""
    from pytorch_optimizer import Yogi

    def net(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))

    plain = net(0)
    optim = Yogi(plain.parameters(), lr=0.1)
    plain[1].weight.requires_grad_(False)
    for i in range(2):
        optim.zero_grad()
        plain(torch.randn(5, 4, generator=torch.Generator().manual_seed(i))).pow(2).sum().backward()
        optim.step()
    plain[1].weight.requires_grad_(True)  # trainable, without state
    saved = dcp_optim.get_optimizer_state_dict(plain, optim)
    names = saved["param_groups"][0]["params"]
    out = [f"marked: {[str(n) for n in names if isinstance(n, dcp_optim.marks.NeverSteppedName)]}"]
    dcp.save({"optim": saved}, checkpoint_id=path)

    model = FSDP(net(1), device_id=CPU, use_orig_params=False, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    fresh = Yogi(model.parameters(), lr=0.1)
    state = {"optim": dcp_optim.get_optimizer_state_dict(model, fresh)}
    dcp.load(state, checkpoint_id=path)
    dcp_optim.set_optimizer_state_dict(model, fresh, state["optim"])
    full = dcp_optim.get_optimizer_state_dict(model, fresh, options=Opts(full_state_dict=True))
    if rank == 0:
        kept = all(torch.equal(full["state"]["1.bias"][k], saved["state"]["1.bias"][k])
                   for k in ("exp_avg", "exp_avg_sq"))
        out.append(f"1.bias state kept: {kept}")
        out.append(f"0.weight state kept: {torch.equal(full['state']['0.weight']['exp_avg'], saved['state']['0.weight']['exp_avg'])}")
    return out


def hsdp_never_stepped_case(rank: int, ws: int, path: str) -> list[str]:
    """D48 under FSDP1 hybrid sharding (FSDP's own optimizer-state
    functions; a pair of process groups, and a device mesh): a checkpoint
    of a never-stepped optimizer without a schema (pytorch-optimizer's
    Yogi, whose template -- a shadow step's state -- scales its second
    moment once, and adds the group's "step"), resumed through DCP into a
    fresh pair, trains as the fresh optimizer: losses compared over two
    steps, both formats, both ``use_orig_params``."""
    from pytorch_optimizer import Yogi
    from torch.distributed.fsdp import ShardingStrategy

    mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard"))
    groups = (mesh.get_group(1), mesh.get_group(0))  # (shard, replicate)
    out = []
    for how in ("groups", "mesh"):
        for orig in (False, True):
            where = {"process_group": groups} if how == "groups" else {"device_mesh": mesh}

            def make() -> tuple[nn.Module, torch.optim.Optimizer]:
                torch.manual_seed(0)
                model = FSDP(_Wide(), device_id=CPU, use_orig_params=orig,
                             sharding_strategy=ShardingStrategy.HYBRID_SHARD, **where)
                return model, Yogi(model.parameters(), lr=0.1)

            model, optim = make()
            expected = _narrow_train(model, optim, range(2))
            for flat in (False, True):
                options = Opts(flatten_optimizer_state_dict=flat)
                ckpt = f"{path}/{how}-{int(orig)}-{int(flat)}"
                model, optim = make()
                dcp.save({"optim": dcp_optim.get_optimizer_state_dict(model, optim, options=options)},
                         checkpoint_id=ckpt)
                model, optim = make()
                state = {"optim": dcp_optim.get_optimizer_state_dict(model, optim, options=options)}
                dcp.load(state, checkpoint_id=ckpt)
                dcp_optim.set_optimizer_state_dict(model, optim, state["optim"], options=options)
                marks = [type(v).__name__ for g in optim.param_groups for v in g.values()
                         if type(v).__module__ == "dcp_optim.marks"]
                same = _narrow_train(model, optim, range(2)) == expected
                out.append(f"{how} orig={orig} flat={flat}: {'fresh' if same else 'differs'}, marks {marks}")
    return out
