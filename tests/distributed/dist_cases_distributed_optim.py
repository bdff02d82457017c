"""The optimizer wrappers of ``torch.distributed.optim`` beside DDP, 2 gloo
ranks, one launch: ZeroRedundancyOptimizer (D36) and PostLocalSGDOptimizer.
Each scenario runs with dcp_optim and with upstream's functions and
records what happened (plain data, compared by test_distributed_optim.py).

ZeRO's ``consolidate_state_dict(to=r)`` gathers the partitions on rank
``r`` only (the others' copy is emptied), so where every rank must call a
getter the scenarios consolidate once per rank and keep each rank's own
copy (``_consolidate_everywhere``)."""

from __future__ import annotations

import copy
import json
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as upstream
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import dcp_optim
import dcp_optim.state_dict as dcp_state_dict

from ..support.oracle import assert_same_tree

IMPLS = {"dcp_optim": dcp_optim, "upstream": upstream}


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    # five tensors of unequal sizes: ZeRO gives the ranks unequal partitions
    return DDP(torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4),
                                   torch.nn.Linear(4, 1, bias=False)))


def _adafactor(params, **kw):
    from transformers.optimization import Adafactor

    return Adafactor(params, scale_parameter=False, relative_step=False, warmup_init=False, **kw)


# name -> (optimizer class, its keyword arguments)
OPTIMIZERS: dict[str, tuple[Any, dict[str, Any]]] = {
    "AdamW": (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}),
    "SGD": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    # schema-less (its templates come from a shadow step of the inner
    # class) and a Python-int step (ZeRO's CPU copy does not alias it)
    "Adafactor": (_adafactor, {"lr": 0.05}),
}


def _zero(model: torch.nn.Module, name: str) -> ZeroRedundancyOptimizer:
    cls, kw = OPTIMIZERS[name]
    return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, **kw)


def _steps(model, optim, n: int, seed: int, zero_grad: bool = True) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(n):
        loss = model(torch.randn(5, 6, generator=g)).pow(2).mean()
        loss.backward()
        optim.step()
        if zero_grad:
            optim.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _consolidate_everywhere(optim: ZeroRedundancyOptimizer, rank: int, world: int) -> None:
    kept = None
    for r in range(world):
        optim.consolidate_state_dict(to=r)
        if r == rank:
            kept = optim._all_state_dicts
    optim._all_state_dicts = kept


def _state_rows(groups: list[dict[str, Any]], state: dict[Any, Any]) -> list:
    """``state`` (keyed by parameter) by the parameter's index in
    ``groups``, bitwise and order-free."""
    position = {id(p): i for i, p in enumerate(p for g in groups for p in g["params"])}
    out = []
    for p, entry in state.items():
        row = {k: (str(v.dtype), v.clone().view(-1).view(torch.uint8).tolist()) if isinstance(v, torch.Tensor) else v
               for k, v in entry.items()}
        out.append((position[id(p)], sorted(row.items(), key=lambda kv: kv[0])))
    return sorted(out, key=lambda r: r[0])


def _inner_state(optim: ZeroRedundancyOptimizer) -> list:
    """This rank's partition state by global parameter index, bitwise."""
    return _state_rows(optim.param_groups, optim.optim.state)


def _trained_zero(name: str, steps: int, seed: int = 1):
    """A model (seed 0) and its ZeRO over ``name``, trained ``steps`` steps."""
    model = _model(0)
    optim = _zero(model, name)
    if steps:
        _steps(model, optim, steps, seed)
    return model, optim


def _state_keys(osd: dict[str, Any], flat: bool) -> list[str]:
    return sorted(k for k in osd if k.startswith("state.")) if flat else sorted(osd["state"])


def _run(fn: Callable[[], Any]) -> Any:
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - the failure is the result
        return (type(exc).__name__, f"{exc}"[:300] or traceback.format_exc(limit=2))


def _dcp_load(model, optim, flat: bool, path: str) -> bool:
    target = {"model": dcp_optim.get_model_state_dict(model),
              "optim": dcp_optim.get_optimizer_state_dict(model, optim, options=_opts(flat))}
    dcp.load(target, checkpoint_id=path)
    dcp_optim.set_model_state_dict(model, target["model"])
    dcp_optim.set_optimizer_state_dict(model, optim, target["optim"], options=_opts(flat))
    return True


def _dcp_resume(rank: int, name: str, flat: bool, path: str, reference: list[float], key: str) -> dict[str, Any]:
    """A fresh model (another init) and never-stepped ZeRO loading the
    checkpoint through DCP (their template: this rank's partition), then
    training on: the losses of the run that saved it?"""
    model = _model(7)
    optim = _zero(model, name)
    template = dcp_optim.get_optimizer_state_dict(model, optim, options=_opts(flat))
    out = {f"dcp template keys/{key}": _state_keys(template, flat)}
    got = _run(lambda: _dcp_load(model, optim, flat, path))
    out[f"dcp resume/{key}"] = got if got[0] != "ok" else _steps(model, optim, 3, 3) == reference
    return out


def zero_dcp_resume(rank: int, world: int, folder: str) -> dict[str, Any]:
    """Another world size loads the checkpoints zero_cases saved at 2
    ranks through DCP: ZeRO partitions the parameters anew, each rank's
    template names its new partition."""
    r: dict[str, Any] = {}
    for name in OPTIMIZERS:
        for flat in (False, True):
            path = os.path.join(folder, f"zero-dcp-{name}-{flat}")
            with open(path + ".losses.json") as f:
                reference = json.load(f)
            r.update(_dcp_resume(rank, name, flat, path, reference, f"{name}/flat={flat}"))
    return r


def _opts(flat: bool, **kw):
    return dcp_optim.StateDictOptions(flatten_optimizer_state_dict=flat, **kw)


def distributed_optim_cases(rank: int, world: int, folder: str) -> dict[str, Any]:
    r = zero_cases(rank, world, folder)
    r["folder"] = folder
    r.update(local_sgd_cases(rank, world, folder))
    r.update(zero_never_stepped(rank, world))
    return r


def zero_never_stepped(rank: int, world: int) -> dict[str, Any]:
    """D48 for ZeRO's classic full-dict flow (consolidate, a full get,
    every rank loads it): over pytorch-optimizer's Yogi (no schema; the
    template of a never-stepped parameter is a shadow step's state, its
    second moment scaled once), a dict taken before the first step resumes
    as the fresh optimizer: three steps' losses compared.  Without
    pytorch-optimizer: nothing recorded."""
    try:
        from pytorch_optimizer import Yogi
    except ImportError:
        return {}
    r: dict[str, Any] = {}
    for flat in (False, True):
        def make() -> tuple[torch.nn.Module, ZeroRedundancyOptimizer]:
            model = _model(0)
            return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=Yogi, lr=0.05)

        model, optim = make()
        fresh = _steps(model, optim, 3, 3)
        model, optim = make()
        _consolidate_everywhere(optim, rank, world)
        saved = dcp_optim.get_optimizer_state_dict(model, optim, options=_opts(flat, full_state_dict=True))
        model, optim = make()
        dcp_optim.set_optimizer_state_dict(model, optim, saved, options=_opts(flat, full_state_dict=True))
        held = sum(1 for entry in optim.optim.state.values() if entry)
        r[f"never stepped full/flat={flat}"] = (held, _steps(model, optim, 3, 3) == fresh)
    return r


def _zero_getter(rank: int, world: int, folder: str, name: str, flat: bool, r: dict[str, Any]) -> None:
    """1-2. The getter beside upstream's, with and without gradients set; cpu_offload copies."""
    case = f"{name}/flat={flat}"
    # the getter where upstream is right (consolidated, the
    # gradients still set: upstream takes no initialising step)
    model, optim = _trained_zero(name, 2, 1)
    _steps(model, optim, 1, 2, zero_grad=False)
    _consolidate_everywhere(optim, rank, world)
    before = _inner_state(optim)
    ours = dcp_optim.get_optimizer_state_dict(model, optim, options=_opts(flat))
    theirs = upstream.get_optimizer_state_dict(
        model, optim, options=upstream.StateDictOptions(flatten_optimizer_state_dict=flat))
    r[f"same as upstream/{case}"] = _run(lambda: assert_same_tree(ours, theirs))
    r[f"stepped keys/{case}"] = _state_keys(ours, flat)
    r[f"getters change nothing, grads set/{case}"] = _inner_state(optim) == before

    # cpu_offload returns copies (D28), consolidated or not
    for mode in ("consolidated", "partition"):
        if mode == "partition":
            optim._all_state_dicts = []
        got = dcp_optim.get_optimizer_state_dict(model, optim, options=_opts(flat, cpu_offload=True))
        live = {t.untyped_storage().data_ptr() for e in optim.optim.state.values()
                for t in e.values() if isinstance(t, torch.Tensor)}
        leaves = [t for t in (got.values() if flat else (v for e in got["state"].values() for v in e.values()))
                  if isinstance(t, torch.Tensor)]
        r[f"offload copies/{mode}/{case}"] = bool(leaves) and not any(
            t.untyped_storage().data_ptr() in live for t in leaves)
    _consolidate_everywhere(optim, rank, world)

    # after zero_grad(set_to_none=True): upstream's initialising
    # step steps the inner optimizer (every rank calls it here)
    optim.zero_grad(set_to_none=True)
    for impl, api in IMPLS.items():
        before = _inner_state(optim)
        _run(lambda: api.get_optimizer_state_dict(model, optim))
        r[f"getter changes nothing/{impl}/{case}"] = _inner_state(optim) == before


def _zero_own_flow_resume(rank: int, world: int, folder: str, name: str, flat: bool, r: dict[str, Any]) -> None:
    """3. ZeRO's own flow: rank 0 consolidates and saves one file; every rank loads it."""
    case = f"{name}/flat={flat}"
    # the resume of ZeRO's own flow: rank 0 consolidates and
    # saves one file; every rank loads it into a fresh model and a
    # never-stepped ZeroRedundancyOptimizer; the run goes on
    model, optim = _trained_zero(name, 2, 1)
    optim.consolidate_state_dict(to=0)
    path = os.path.join(folder, f"zero-{name}-{flat}.pt")
    if rank == 0:
        saved = dcp_optim.get_optimizer_state_dict(model, optim, options=_opts(flat))
        torch.save((dcp_optim.get_model_state_dict(model), saved), path)
    dist.barrier()
    saved_state = _inner_state(optim)
    reference = _steps(model, optim, 3, 3)
    for impl, api in IMPLS.items():
        model2 = _model(7)
        optim2 = _zero(model2, name)
        msd, osd = torch.load(path, weights_only=False)
        kept = copy.deepcopy(osd)
        api.set_model_state_dict(model2, msd)
        outcome = _run(lambda: api.set_optimizer_state_dict(
            model2, optim2, osd, options=upstream.StateDictOptions(flatten_optimizer_state_dict=flat)))
        r[f"resume load/{impl}/{case}"] = outcome[0]
        if outcome[0] == "ok":
            r[f"resume state/{impl}/{case}"] = _inner_state(optim2) == saved_state
            r[f"resume caller's dict kept/{impl}/{case}"] = _run(lambda: assert_same_tree(osd, kept))[0]
            r[f"resume losses/{impl}/{case}"] = _steps(model2, optim2, 3, 3) == reference
    # the same file read on rank 0 only and broadcast (full state)
    model2 = _model(7)
    optim2 = _zero(model2, name)
    msd, osd = torch.load(path, weights_only=False) if rank == 0 else ({}, {})
    full = _opts(flat, full_state_dict=True, broadcast_from_rank0=True)
    dcp_optim.set_model_state_dict(model2, msd, options=full)
    outcome = _run(lambda: dcp_optim.set_optimizer_state_dict(model2, optim2, osd, options=full))
    r[f"broadcast resume/{case}"] = outcome[0]
    if outcome[0] == "ok":
        r[f"broadcast resume state/{case}"] = _inner_state(optim2) == saved_state
        r[f"broadcast resume losses/{case}"] = _steps(model2, optim2, 3, 3) == reference
    dist.barrier()


def _zero_never_stepped_template(rank: int, world: int, folder: str, name: str, flat: bool, r: dict[str, Any]) -> None:
    """4. A never-stepped ZeRO's template."""
    case = f"{name}/flat={flat}"
    # a never-stepped ZeRO's template: the state a first step
    # creates, as a stepped one's keys; loading it into a fresh
    # ZeRO trains as a fresh one does
    for impl, api in IMPLS.items():
        # (each its own: upstream's initialising step gives the
        # inner optimizer state)
        model, optim = _trained_zero(name, 0)
        _consolidate_everywhere(optim, rank, world)
        template = _run(lambda: api.get_optimizer_state_dict(
            model, optim, options=upstream.StateDictOptions(flatten_optimizer_state_dict=flat)))
        r[f"template keys/{impl}/{case}"] = (
            _state_keys(template[1], flat) if template[0] == "ok" else template[0])
    model, optim = _trained_zero(name, 0)
    _consolidate_everywhere(optim, rank, world)
    template = dcp_optim.get_optimizer_state_dict(model, optim, options=_opts(flat))
    fresh = _steps(model, optim, 2, 4)
    model2, optim2 = _trained_zero(name, 0)
    dcp_optim.set_optimizer_state_dict(model2, optim2, template, options=_opts(flat))
    r[f"template trains as fresh/{case}"] = _steps(model2, optim2, 2, 4) == fresh


def _zero_stale_copy(rank: int, world: int, folder: str, name: str, flat: bool, r: dict[str, Any]) -> None:
    """5. A consolidated copy older than the state held."""
    case = f"{name}/flat={flat}"
    # consolidated before steps that change this rank's
    # partition: the copy is older than the state held
    model, optim = _trained_zero(name, 1, 1)
    _consolidate_everywhere(optim, rank, world)
    _steps(model, optim, 1, 2)
    for impl, api in IMPLS.items():
        got = _run(lambda: api.get_optimizer_state_dict(model, optim))
        r[f"stale/{impl}/{case}"] = got[0] if got[0] != "ok" else "returned"


def _zero_dcp_partitions(rank: int, world: int, folder: str, name: str, flat: bool, r: dict[str, Any]) -> None:
    """6. Not consolidated: each rank's partition, through DCP."""
    case = f"{name}/flat={flat}"
    # not consolidated on this rank (ZeRO's own state_dict() and
    # upstream raise): this rank's partition, in DCP's flow --
    # every rank gets, dcp.save; a fresh ZeRO's template (its
    # partition), dcp.load, set; the run goes on
    model, optim = _trained_zero(name, 2, 1)
    got = _run(lambda: upstream.get_optimizer_state_dict(model, optim))
    r[f"not consolidated/upstream/{case}"] = got[0]
    # a full state dict is the consolidated one: ZeRO's error, as upstream
    full = dcp_optim.StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=flat)
    got = _run(lambda: dcp_optim.get_optimizer_state_dict(model, optim, options=full))
    r[f"not consolidated full/{case}"] = got
    saved = dcp_optim.get_optimizer_state_dict(model, optim, options=_opts(flat))
    r[f"partition keys/{case}"] = _state_keys(saved, flat)
    path = os.path.join(folder, f"zero-dcp-{name}-{flat}")
    dcp.save({"model": dcp_optim.get_model_state_dict(model), "optim": saved}, checkpoint_id=path)
    saved_state = _inner_state(optim)
    reference = _steps(model, optim, 3, 3)
    if rank == 0:
        with open(path + ".losses.json", "w") as f:
            json.dump(reference, f)
    r.update(_dcp_resume(rank, name, flat, path, reference, f"same world/{case}"))
    model2 = _model(7)
    optim2 = _zero(model2, name)
    r[f"dcp resume state/{case}"] = _dcp_load(model2, optim2, flat, path) and _inner_state(optim2) == saved_state
    dist.barrier()


def _zero_failed_loads(rank: int, world: int, folder: str, name: str, flat: bool, r: dict[str, Any]) -> None:
    """7. Loads that fail change nothing."""
    case = f"{name}/flat={flat}"
    # a load that fails validation changes nothing
    model, optim = _trained_zero(name, 2, 1)
    _consolidate_everywhere(optim, rank, world)
    good = dcp_optim.get_optimizer_state_dict(model, optim)
    bad = copy.deepcopy(good)
    # a state the optimizer keeps, left out (strict: raises)
    entry = bad["state"]["0.weight"]
    del entry[sorted(entry)[0]]
    before = _inner_state(optim)
    got = _run(lambda: dcp_optim.set_optimizer_state_dict(model, optim, bad))
    r[f"bad load raises/{case}"] = got[0]
    r[f"bad load changes nothing/{case}"] = _inner_state(optim) == before
    # a partition that fails its checks on one rank only (each rank
    # loads its own, as in DCP's flow): every rank raises
    optim._all_state_dicts = []
    own = copy.deepcopy(dcp_optim.get_optimizer_state_dict(model, optim))
    _consolidate_everywhere(optim, rank, world)
    if rank == 1:
        entry = next(iter(own["state"].values()))
        del entry[sorted(entry)[0]]
    got = _run(lambda: dcp_optim.set_optimizer_state_dict(model, optim, own))
    r[f"one rank's bad partition/{case}"] = got[0]
    r[f"one rank's bad partition changes nothing/{case}"] = _inner_state(optim) == before
    # an optimizer-wide entry (D29's key) ZeRO's own load cannot take
    odd = {**good, "state": {**good["state"], ".optimizer_0": {"k": torch.tensor(3.0)}}}
    got = _run(lambda: dcp_optim.set_optimizer_state_dict(
        model, optim, odd, options=dcp_optim.StateDictOptions(strict=False)))
    r[f"wide entry raises/{case}"] = got[0]
    r[f"wide entry changes nothing/{case}"] = _inner_state(optim) == before
    dist.barrier()


def zero_cases(rank: int, world: int, folder: str) -> dict[str, Any]:
    r: dict[str, Any] = {}
    for name in OPTIMIZERS:
        for flat in (False, True):
            _zero_getter(rank, world, folder, name, flat, r)
            _zero_own_flow_resume(rank, world, folder, name, flat, r)
            _zero_never_stepped_template(rank, world, folder, name, flat, r)
            _zero_stale_copy(rank, world, folder, name, flat, r)
            _zero_dcp_partitions(rank, world, folder, name, flat, r)
            _zero_failed_loads(rank, world, folder, name, flat, r)
    r.update(zero_init_state(rank, world))

    # ZeRO over a process group of its own (not the default one): its
    # loads agree there (a DeviceMesh over that group)
    group = dist.new_group(list(range(world)))
    model = _model(0)
    optim = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                    process_group=group, lr=0.05)
    _steps(model, optim, 2, 1)
    own = copy.deepcopy(dcp_optim.get_optimizer_state_dict(model, optim))
    before = _inner_state(optim)
    bad = copy.deepcopy(own)
    if rank == 1:
        entry = next(iter(bad["state"].values()))
        del entry[sorted(entry)[0]]
    r["subgroup bad partition"] = _run(lambda: dcp_optim.set_optimizer_state_dict(model, optim, bad))[0]
    r["subgroup bad partition changes nothing"] = _inner_state(optim) == before
    r["subgroup load"] = _run(lambda: dcp_optim.set_optimizer_state_dict(model, optim, own))[0]
    r["subgroup load keeps the state"] = _inner_state(optim) == before

    # a PostLocalSGDOptimizer around a ZeroRedundancyOptimizer: refused by
    # name, nothing changed (upstream: its initialising step's TypeError)
    model = _model(0)
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    wrapped = PostLocalSGDOptimizer(optim=_zero(model, "AdamW"), averager=PeriodicModelAverager(period=2))
    _steps(model, wrapped, 1, 1)
    _consolidate_everywhere(wrapped.optim, rank, world)
    zero_state = dcp_optim.get_optimizer_state_dict(model, wrapped.optim)
    before = _inner_state(wrapped.optim)
    for impl, api in IMPLS.items():
        r[f"wrapped zero get/{impl}"] = _run(lambda: api.get_optimizer_state_dict(model, wrapped))[0]
        r[f"wrapped zero set/{impl}"] = _run(lambda: api.set_optimizer_state_dict(
            model, wrapped, copy.deepcopy(zero_state)))[0]
    r["wrapped zero unchanged"] = _inner_state(wrapped.optim) == before

    # overlap_with_ddp=True: a functional optimizer inside DDP's hook
    model = _model(0)
    optim = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                    overlap_with_ddp=True, lr=0.05)
    for impl, api in IMPLS.items():
        r[f"overlap get/{impl}"] = _run(lambda: api.get_optimizer_state_dict(model, optim))[0]
        r[f"overlap set/{impl}"] = _run(lambda: api.set_optimizer_state_dict(
            model, optim, {"state": {}, "param_groups": [{"lr": 0.05, "params": [
                n for n, _ in model.named_parameters()]}]}))[0]
    return r


def zero_init_state(rank: int, world: int) -> dict[str, Any]:
    """``_init_optim_state`` (torchtune's optimizer load calls it): fills
    this rank's partition with the first step's state; upstream's steps
    ZeRO (the moments of a stepped partition decay)."""
    r: dict[str, Any] = {}
    for impl, fn in (("dcp_optim", dcp_state_dict._init_optim_state), ("upstream", upstream._init_optim_state)):
        model = _model(0)
        optim = _zero(model, "AdamW")
        fn(optim)
        r[f"init fresh/{impl}"] = sorted(
            (i, sorted(entry), float(entry["step"]))
            for i, entry in ((_position(optim, p), e) for p, e in optim.optim.state.items()))
        r[f"init wrapper state empty/{impl}"] = not optim.state
        _steps(model, optim, 2, 1)
        before = _inner_state(optim)
        fn(optim)
        r[f"init stepped unchanged/{impl}"] = _inner_state(optim) == before
    return r


def _position(optim: ZeroRedundancyOptimizer, param: torch.Tensor) -> int:
    return next(i for i, p in enumerate(p for g in optim.param_groups for p in g["params"]) if p is param)


# --- PostLocalSGDOptimizer ----------------------------------------------------


def _local_sgd(model: torch.nn.Module, name: str):
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    cls, kw = OPTIMIZERS[name]
    # averaging every 2 steps after 1 warm-up step: the resumed run averages
    # where the uninterrupted one does only if the averager's counter survives
    return PostLocalSGDOptimizer(optim=cls(model.parameters(), **kw),
                                 averager=PeriodicModelAverager(period=2, warmup_steps=1))


def _local_state(optim) -> list:
    return [_state_rows(optim.param_groups, optim.state), optim.averager.step]


def local_sgd_cases(rank: int, world: int, folder: str) -> dict[str, Any]:
    """PostLocalSGDOptimizer: a proxy of its inner optimizer whose step
    also averages the parameters across ranks (a collective) and whose
    state_dict() adds the averager's counter."""
    r: dict[str, Any] = {}
    for name in ("AdamW", "Adafactor"):
        for flat in (False, True):
            case = f"{name}/flat={flat}"
            opts = _opts(flat)
            # a never-stepped one's template, on rank 0 alone: no step (its
            # step would wait for rank 1 in the averaging)
            model = _model(0)
            optim = _local_sgd(model, name)
            params = [p.detach().clone() for p in model.parameters()]
            if rank == 0:
                for impl, api in IMPLS.items():
                    got = _run(lambda: api.get_optimizer_state_dict(
                        model, optim, options=upstream.StateDictOptions(flatten_optimizer_state_dict=flat)))
                    r[f"plsgd template/{impl}/{case}"] = _state_keys(got[1], flat) if got[0] == "ok" else got[0]
                    r[f"plsgd template changes nothing/{impl}/{case}"] = (
                        not optim.state and optim.averager.step == 0
                        and all(torch.equal(a, b) for a, b in zip(params, model.parameters())))
            dist.barrier()

            # the DCP flow: every rank gets, dcp.save; fresh processes'
            # stand-ins (another init, never stepped) get their template,
            # dcp.load, set; both go on
            model = _model(0)
            optim = _local_sgd(model, name)
            _steps(model, optim, 3, 1)
            path = os.path.join(folder, f"plsgd-{name}-{flat}")
            saved = dcp_optim.get_optimizer_state_dict(model, optim, options=opts)
            r[f"plsgd saved step/{case}"] = saved.get("step")
            upstream_saved = upstream.get_optimizer_state_dict(
                model, optim, options=upstream.StateDictOptions(flatten_optimizer_state_dict=flat))
            r[f"plsgd upstream saved step/{case}"] = upstream_saved.get("step", "dropped")
            dcp.save({"model": dcp_optim.get_model_state_dict(model), "optim": saved}, checkpoint_id=path)
            saved_state = _local_state(optim)
            reference = _steps(model, optim, 4, 2)
            model2 = _model(7)
            optim2 = _local_sgd(model2, name)
            target = {"model": dcp_optim.get_model_state_dict(model2),
                      "optim": dcp_optim.get_optimizer_state_dict(model2, optim2, options=opts)}
            dcp.load(target, checkpoint_id=path)
            dcp_optim.set_model_state_dict(model2, target["model"])
            dcp_optim.set_optimizer_state_dict(model2, optim2, target["optim"], options=opts)
            r[f"plsgd resume state/{case}"] = _local_state(optim2) == saved_state
            r[f"plsgd resume losses/{case}"] = _steps(model2, optim2, 4, 2) == reference
            # upstream's load into a never-stepped one
            model3 = _model(7)
            optim3 = _local_sgd(model3, name)
            got = _run(lambda: upstream.set_optimizer_state_dict(
                model3, optim3, upstream_saved,
                options=upstream.StateDictOptions(flatten_optimizer_state_dict=flat)))
            r[f"plsgd upstream load/{case}"] = got[0]
            dist.barrier()
    return r
