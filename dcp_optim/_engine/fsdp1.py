"""FSDP1 (FullyShardedDataParallel) optimizer state, mapped natively.

Upstream hands FSDP1 optimizers to FSDP's own ``_optim_utils``: for every
FlatParameter and every state name it all-gathers the whole padded flat
tensor (one blocking collective each) and then cuts it into the original
parameters.  Here the flat <-> original mapping is index arithmetic in the
C core (``flat_pieces``, ``flat_assemble``, ``flat_unflatten``) on the
FlatParameter's metadata, and the data moves in buckets across all flat
parameters and state names (``gather_full_tensors``).

Output follows upstream's form exactly: keys are the original parameters'
canonical FQNs in FSDP's order (rank 0's flat-parameter order with
``use_orig_params=False``; sorted FQNs with ``use_orig_params=True``);
state names sorted as FSDP sorts them (tensors, then 0-dim tensors, then
other values) with ``use_orig_params=False``; values are full tensors
(``full_state_dict=True``) or ShardedTensors chunked along dim 0 (the
default), or DTensors when FSDP was built with a device mesh.

Hybrid sharding (HSDP) keeps going through FSDP's own APIs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp._init_utils import HYBRID_SHARDING_STRATEGIES
from torch.distributed.tensor import DTensor, Shard

from .. import errors
from ..schema import schema_for
from .collectives import gather_full_tensors
from .consistency import mesh_for_group
from .core import C, context
from .never_stepped import mark_groups, marked_in_view, partly_marked, unmark
from .own_calls import state_dict_fn
from .pristine import add_group_keys
from .pristine import pristine as pristine_template
from .ranklocal import CHECK_ENV, check_enabled
from .ranklocal import check_rank_local as agree_rank_local
from .values import plain_tensor_in, same_value
from .wide import (
    add_wide,
    collect_extras,
    copy_containers,
    has_torch_layout,
    pop_wide,
    split_own_wide,
)

__all__ = [
    "Fsdp1Localize",
    "flat_units",
    "agreement_mesh",
    "check_before_fsdp",
    "check_torch_layout",
    "getter_options",
    "fsdp_process_group",
    "get_fsdp1_optim",
    "load_via_fsdp",
    "native_supported",
    "resharded_on_failure",
]


@contextlib.contextmanager
def resharded_on_failure(info: Any) -> Iterator[None]:
    """Around FSDP's own state_dict / load_state_dict: where it raises (a
    peer that died in its gathers, its own code failing), the FSDP modules
    whose parameters its pre-hook had already unsharded are resharded
    (FSDP's post-hook, which does that, never ran): the model is left with
    its flat parameters' shards, as before the call.  Local: resharding
    makes no collectives."""
    try:
        yield
    except BaseException:
        for module in info.fsdp_modules:
            entered = getattr(module, "_unshard_params_ctx", None)
            if not entered:
                continue
            for key, ctx in list(entered.items()):
                entered.pop(key, None)
                with contextlib.suppress(Exception):  # the one whose unshard failed: already closed
                    ctx.__exit__(None, None, None)
        raise


def fsdp_process_group(model: nn.Module, info: Any):
    """D18 in docs/differences.md: the FSDP1 instance's process group (None for HSDP)."""
    if isinstance(model, FSDP):
        fsdp_module = model
    elif info.fsdp_modules:
        fsdp_module = info.fsdp_modules[0]
    else:
        return None
    if fsdp_module.sharding_strategy in HYBRID_SHARDING_STRATEGIES:
        return None
    group = fsdp_module.process_group
    return None if isinstance(group, tuple) else group


def agreement_mesh(model: nn.Module, info: Any) -> tuple[bool, bool, DeviceMesh | None]:
    """(whether ``model`` holds FSDP1 instances, whether their ranks are
    known, the mesh they agree on: None for the default group).  The
    device mesh FSDP was built with, else a 1-D mesh over its process
    group; hybrid sharding given a pair of process groups: the default
    group where the pair spans the world, else unknown.  ``info`` may be
    None (a load that failed before its info was built)."""
    modules = list(info.fsdp_modules) if info is not None else []
    if not modules and isinstance(model, nn.Module):
        modules = [m for m in model.modules() if isinstance(m, FSDP)]
    if not modules:
        return False, False, None
    first = modules[0]
    mesh = getattr(first, "_device_mesh", None)
    if mesh is not None:
        return True, True, mesh
    group = first.process_group
    if isinstance(group, DeviceMesh):
        return True, True, group
    if first.sharding_strategy in HYBRID_SHARDING_STRATEGIES:
        inter = getattr(first, "_inter_node_pg", None)
        if group is not None and inter is not None:
            spans = dist.get_world_size(group) * dist.get_world_size(inter) == dist.get_world_size()
            return True, spans, None
        return True, False, None
    if group is None or isinstance(group, tuple):
        return True, False, None
    return True, True, mesh_for_group(group, first.compute_device.type)


def _getter_options(info: Any) -> tuple[tuple[str, Any], ...]:
    """The options that decide a getter's collectives."""
    return tuple((name, bool(getattr(info, name, False)))
                 for name in ("full_state_dict", "cpu_offload", "broadcast_from_rank0"))


def check_before_fsdp(model: nn.Module, info: Any, what: str, options: Any,
                      error: Exception | None = None) -> None:
    """Before FSDP1 paths communicate outside a load's agreement (FSDP's
    own full model state dict, the optimizer getters' first exchange):
    the bounded arrival of every rank of the FSDP1 group and one agreement
    on ``options`` and on the names of the model's tensors (identity), so
    that a rank that is missing, in another call, or holding another
    model raises the same error on every rank instead of hanging in the
    collectives.  ``error``: this rank failed preparing its part; every
    rank raises the first failing rank's exception."""
    from .consistency import check_agreement

    if not dist.is_initialized() or dist.get_world_size() < 2:
        if error is not None:
            raise error
        return
    is_fsdp1, known, mesh = agreement_mesh(model, info)
    if not (is_fsdp1 and known):
        if error is not None:
            raise error
        return
    names = [(f"model tensor #{i}", "|".join(fqns)) for i, fqns in enumerate(info.index.tensor_fqns)]
    check_agreement(mesh, what, (options, names), lambda: [("options", repr(options)), *names], error=error)


@dataclass
class _Handle:
    module: Any            # the FSDP instance (its _FSDPState)
    flat: Any              # FlatParameter
    fqns: list[str]        # canonical FQNs of the original parameters
    orig: bool             # use_orig_params
    params: list[Any]      # original parameters (use_orig_params) else []
    numels: tuple          # _numels_with_padding
    mask: list             # _is_padding_mask
    shapes: list           # _shapes
    shard: int             # numel of this rank's shard of the flat tensor
    group: Any
    ws: int
    rank: int
    sharded: bool          # the state is sharded across ranks


def _native_supported(info: Any) -> bool:
    for module in info.fsdp_modules:
        if module.sharding_strategy in HYBRID_SHARDING_STRATEGIES:
            return False
        handle = module._handle
        if handle is not None and not all(handle.flat_param._contiguities):
            return False
    return True


def _handles(info: Any) -> list[_Handle]:
    index = info.index
    out = []
    for module in info.fsdp_modules:
        handle = module._handle
        if handle is None:
            continue
        flat = handle.flat_param
        orig = bool(handle._use_orig_params)
        if orig:
            params = list(flat._params)
            slot = index.slot_of(params[0])
            first = index.tensor_fqns[slot][0]
            prefix = first[: len(first) - len(flat._fqns[0])]
            fqns = [prefix + f for f in flat._fqns]
        else:
            params = []
            fqns = list(index.tensor_fqns[index.slot_of(flat)])
        group = module.process_group
        ws = dist.get_world_size(group)
        out.append(
            _Handle(
                module=module,
                flat=flat,
                fqns=fqns,
                orig=orig,
                params=params,
                numels=tuple(flat._numels_with_padding),
                mask=list(flat._is_padding_mask),
                shapes=list(flat._shapes),
                shard=flat.numel(),
                group=group,
                ws=ws,
                rank=dist.get_rank(group),
                sharded=ws > 1 and module.sharding_strategy != ShardingStrategy.NO_SHARD,
            )
        )
    return out


def _sort_names(entry: dict[str, Any]) -> dict[str, Any]:
    """FSDP's order of state names (use_orig_params=False): tensors with a
    dimension, then 0-dim tensors, then other values, each sorted."""
    tensors = sorted(k for k, v in entry.items() if isinstance(v, torch.Tensor) and v.dim() > 0)
    scalars = sorted(k for k, v in entry.items() if isinstance(v, torch.Tensor) and v.dim() == 0)
    others = sorted(k for k, v in entry.items() if not isinstance(v, torch.Tensor))
    return {k: entry[k] for k in tensors + scalars + others}


# --- get -----------------------------------------------------------------------


def get_fsdp1_optim(model: nn.Module, optimizers, info: Any, check_rank_local: bool = False) -> dict[str, Any]:
    # Each optimizer's own dict and the never-stepped state of parameters
    # without any come first: building the latter can fail on some ranks
    # only (a shadow step on a rank's empty pieces), and such a failure is
    # agreed on, with every rank, before the first exchange -- not left to
    # the peers' wait in it.
    handles = _handles(info)
    local: list[tuple[dict[str, Any], dict[str, Any], list[Any], set[int]]] = []
    error: Exception | None = None
    extras: dict[str, Any] = {}
    try:
        local = [_local_optim_state(optim, info, handles, extras) for optim in optimizers]
    except Exception as exc:  # noqa: BLE001 - raised on every rank by the check below
        error = exc
    check_before_fsdp(model, info, "FSDP1 optimizer state dict", _getter_options(info), error=error)
    full = info.full_state_dict
    if check_rank_local:
        _check_saved_once(model, info, local, handles)
    rank0_only = full and (info.cpu_offload or info.broadcast_from_rank0)
    group = fsdp_process_group(model, info)
    to_save = not rank0_only or dist.get_rank(group) == 0
    # the optimizers' own top-level entries (Ranger21's lookahead_step),
    # which the caller adds to the returned dict as for plain models: the
    # FSDP1 getters dropped them, so a resume restarted them silently
    info.optim_extras = extras if to_save else {}
    if not _native_supported(info):
        return _get_via_fsdp(model, optimizers, info, local)
    by_flat = {id(h.flat): h for h in handles}
    by_orig = {id(p): (h, i) for h in handles for i, p in enumerate(h.params)}

    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    # the parameters whose state is a template on every rank holding a
    # piece of them (D48: marked, so that a load leaves them without state)
    never: set[str] = set()
    for o, (osd, wide, params, stepless) in enumerate(local):
        # local state per handle, keyed by original-parameter index (orig)
        # or the flat parameter itself; "templated": which of them hold
        # this rank's template (stepless), not state a step made
        per_handle: dict[int, dict[str, Any]] = {}
        plain: list[tuple[str, dict[str, Any]]] = []
        order: list[tuple[str, Any]] = []  # ("handle", h) / ("plain", fqn)
        for pid, p in enumerate(params):
            entry = osd["state"].get(pid)
            flat_of = by_flat.get(id(p))
            if flat_of is not None:
                if entry is not None:
                    per_handle[id(flat_of)] = {"flat": entry, "templated": pid in stepless}
                    order.append(("handle", flat_of))
                continue
            hi = by_orig.get(id(p))
            if hi is not None:
                h, i = hi
                held = per_handle.setdefault(id(h), {"pieces": {}, "templated": set()})
                held["pieces"][i] = entry
                if pid in stepless:
                    held["templated"].add(i)
                continue
            slot = info.index.slot_of(p)
            if slot is None:
                raise errors.StateDictKeyError(
                    f"optimizer holds a parameter (shape {tuple(p.shape)}) that is not a parameter of the model"
                )
            fqn = info.index.tensor_fqns[slot][0]
            if entry is not None:
                plain.append((fqn, entry))
                order.append(("plain", fqn))
                if pid in stepless:
                    never.add(fqn)
        entries = _gather_handles(handles, per_handle, info, to_save, never)
        if not to_save:
            continue
        out_state: dict[str, Any] = {}
        if any(h.orig for h in handles):
            # use_orig_params: FSDP's order.  It merges the state keys of
            # every rank, sorted, and walks them: a parameter it does not
            # manage (an ignored module's) is copied as it comes, the others
            # wait for their flat parameter's gather, whose originals then
            # come together, in that order -- so the unmanaged first, then
            # each flat parameter's, flat parameters in the order of their
            # first key
            for fqn, entry in sorted(plain, key=lambda item: item[0]):
                out_state[fqn] = _copy_plain(entry, info)
            units = [sorted(fqn for fqn in h.fqns if fqn in entries) for h in handles]
            for keys in sorted((keys for keys in units if keys), key=lambda keys: keys[0]):
                for fqn in keys:
                    out_state[fqn] = entries[fqn]
        else:
            for kind, item in order:
                if kind == "handle":
                    for fqn in item.fqns:
                        if fqn in entries:
                            out_state[fqn] = entries[fqn]
                else:
                    out_state[item] = _copy_plain(dict(plain)[item], info)
        state.update(out_state)
        add_wide(state, o, wide)  # D29: the optimizer's own entries, as every rank holds them
        first = len(groups)
        groups.extend(_groups_by_fqn(osd, params, handles, info))
        if never:
            mark_groups(groups, never, first)
    if not to_save:
        return {}
    _unshare_scalars(state)
    # the flattened format marks them too (optim.get_optim)
    info.never_stepped = never
    return {"state": state, "param_groups": groups}


def _check_saved_once(model: nn.Module, info: Any,
                      local: list[tuple[dict[str, Any], dict[str, Any], list[Any], set[int]]],
                      handles: list[_Handle]) -> None:
    """D30 for a full get, before its gather (which may leave ranks other
    than 0 with nothing): the values the full dict carries once for all
    ranks and no gather puts together -- group values, the optimizer-wide
    entries, the state of parameters FSDP does not manage -- are agreed
    on as the sharded get agrees on them.  The flat parameters' own 0-dim
    and other values are agreed in their gather (``_merge_scalars``)."""
    is_fsdp1, known, mesh = agreement_mesh(model, info)
    if not (is_fsdp1 and known):
        return
    managed = {id(h.flat) for h in handles} | {id(p) for h in handles for p in h.params}
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for o, (osd, wide, params, _stepless) in enumerate(local):
        for pid, p in enumerate(params):
            entry = osd["state"].get(pid)
            slot = None if entry is None or id(p) in managed else info.index.slot_of(p)
            if slot is not None:
                state[info.index.tensor_fqns[slot][0]] = entry
        add_wide(state, o, wide)
        groups.extend(_groups_by_fqn(osd, params, handles, info))
    agree_rank_local({"state": state, "param_groups": groups}, info, fsdp1=(mesh,))


def _unshare_scalars(state: dict[str, Any]) -> None:
    """Every original parameter of a flat parameter holds the flat
    parameter's 0-dim states; FSDP's own functions (upstream's) give them
    one tensor object.  ``dcp.load`` fills a template in place, so a
    checkpoint whose parameters hold different values (one from another
    layout: a parameter that missed a step, NovoGrad's norms) left the
    last one's value in all of them -- and the load's check that they
    agree (``_check_loaded_entries``) saw nothing to refuse.  Each entry
    gets a tensor of its own."""
    seen: set[int] = set()
    for entry in state.values():
        if not isinstance(entry, dict):
            continue
        for name, value in entry.items():
            if type(value) is torch.Tensor and value.dim() == 0:
                if id(value) in seen:
                    entry[name] = value.clone()
                else:
                    seen.add(id(value))


def _local_optim_state(optim: Any, info: Any, handles: list[_Handle],
                       extras: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], list[Any], set[int]]:
    """(the optimizer's own dict, with the never-stepped state of the
    parameters it holds none for; its optimizer-wide entries (D29),
    taken out of it; its parameters in order; the positions of those whose
    entry is a shadow step's template that holds something -- an
    optimizer without a schema, D48).  Its own top-level entries go into
    ``extras``."""
    raw = state_dict_fn(optim, "state_dict")()
    check_torch_layout(optim, raw)
    collect_extras(optim, raw, extras, stacklevel=7)
    osd, wide = split_own_wide(raw)
    params = [p for g in optim.param_groups for p in g["params"]]
    pids = {id(p): i for i, p in enumerate(params)}
    first_wide, group_keys, filled = _add_pristine(osd, params, pids, optim, info, handles)
    # the group keys a first step adds (pytorch-optimizer's "step"), into
    # the dict's own copies of the groups: a template without them would
    # make dcp.load leave the checkpoint's behind; marked as a first
    # step's (a never-stepped checkpoint's load drops them, D47)
    add_group_keys(osd["param_groups"], group_keys, mark=True)
    _check_flat_shapes(osd, pids, handles)
    stepless = {pid for pid in filled if osd["state"][pid]} if schema_for(optim) is None else set()
    return osd, {**first_wide, **wide}, params, stepless


def check_torch_layout(optim: Any, osd: Any) -> None:
    """FSDP1 cuts each parameter's optimizer state into the pieces of the
    flat parameters, which it finds under torch's "state" (by the
    optimizer's parameter indices).  An optimizer whose ``state_dict()``
    has a layout of its own (pytorch-optimizer's Lookahead and
    ScheduleFreeWrapper keep per-parameter tensors by (group, index)
    beside a nested base optimizer's dict) hides them from that cut: its
    get raised ``KeyError``, and a full dict's per-parameter tensors were
    loaded whole into the wrapper, beside pieces of another shape.
    Refused, naming it (FSDP2 keeps DTensors, whatever the layout)."""
    if has_torch_layout(osd):
        return
    keys = list(osd)[:4] if isinstance(osd, dict) else type(osd).__name__
    raise errors.StateDictValueError(
        f"{type(optim).__qualname__}.state_dict() has a layout of its own ({keys}), not torch's 'state' "
        "and 'param_groups': FSDP1 cuts each parameter's optimizer state into its flat parameter's "
        "pieces and cannot find them there.  Such optimizer wrappers are supported under FSDP2 "
        "(fully_shard) and on plain models, not under FSDP1")


def _check_flat_shapes(osd: dict[str, Any], pids: dict[int, int], handles: list[_Handle]) -> None:
    """A flat parameter's state tensors (with a dimension) are cut into
    its original parameters' pieces element for element, as FSDP cuts
    them: one of another size (pytorch-optimizer's QHAdam keeps a
    1-element ``beta1_weight`` per parameter) would come back as other
    memory.  Refused, naming it, before anything is exchanged.  The same
    for an original parameter's (``use_orig_params``) state tensors,
    pieces of the original as this rank holds it."""
    for h in handles:
        if h.orig:
            for fqn, param in zip(h.fqns, h.params):
                pid = pids.get(id(param))
                for name, value in (osd["state"].get(pid) or {}).items() if pid is not None else ():
                    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() != param.numel():
                        raise errors.StateDictValueError(
                            f"optimizer state {name!r} of {fqn!r} (FSDP1, use_orig_params=True) has "
                            f"{value.numel()} elements where this rank's piece of the parameter has "
                            f"{param.numel()}: FSDP1 shards a parameter's state tensors as it shards the "
                            "parameter, and this one is not shaped like it")
            continue
        pid = pids.get(id(h.flat))
        if pid is None:
            continue
        for name, value in (osd["state"].get(pid) or {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() != h.flat.numel():
                raise errors.StateDictValueError(
                    f"optimizer state {name!r} of the flat parameter of {h.fqns} (FSDP1, "
                    f"use_orig_params=False) has {value.numel()} elements where the parameter has "
                    f"{h.flat.numel()}: it cannot be cut into the original parameters' states. "
                    "use_orig_params=True gives the optimizer the original parameters"
                )


def _add_pristine(osd: dict[str, Any], params: list[Any], pids: dict[int, int], optim: Any, info: Any,
                  handles: list[_Handle]) -> tuple[dict[str, Any], list[dict[str, Any]] | None, list[int]]:
    """D2 for flat parameters too: the never-stepped state of each
    trainable parameter the optimizer holds none for, from the schema (or
    a shadow step), shaped like what the optimizer holds (the flat shard
    or the original parameter's piece), into ``osd["state"]`` (the
    optimizer's ``state_dict()``, a dict of its own) by position.  Returns
    the optimizer-wide entries (D29), the group keys a first step would
    create and the positions filled."""
    states, group_keys = pristine_template(info.index, optim)
    pristine, wide = pop_wide(states)
    filled: list[int] = []
    if not pristine:
        return wide, group_keys, filled
    by_fqn = {}
    for p in params:
        slot = info.index.slot_of(p)
        if slot is not None:
            by_fqn[info.index.tensor_fqns[slot][0]] = p
    # an original parameter with no piece on this rank is empty
    # here and never has state (FSDP does not step it)
    empty = {id(p) for h in handles if h.orig for p in h.params if p.numel() == 0}
    for h in handles:
        if h.orig:
            by_fqn.update(zip(h.fqns, h.params))
        else:
            by_fqn[h.fqns[0]] = h.flat
    for fqn, entry in pristine.items():
        p = by_fqn.get(fqn)
        if p is not None and id(p) in pids and id(p) not in empty:
            osd["state"][pids[id(p)]] = entry
            filled.append(pids[id(p)])
    return wide, group_keys, filled


def _copy_plain(entry: dict[str, Any], info: Any) -> dict[str, Any]:
    out = dict(entry)
    if info.cpu_offload:
        for k, v in list(out.items()):
            if isinstance(v, torch.Tensor):
                out[k] = v.cpu()
    return out


def _groups_by_fqn(osd, params, handles, info) -> list[dict[str, Any]]:
    """The optimizer's groups with original-parameter FQNs (a flat
    parameter expands to all of its originals)."""
    names: dict[int, list[str]] = {}
    for h in handles:
        if h.orig:
            for p, fqn in zip(h.params, h.fqns):
                names[id(p)] = [fqn]
        else:
            names[id(h.flat)] = list(h.fqns)
    out = []
    pid = 0
    for group in osd["param_groups"]:
        packed = {k: v for k, v in group.items() if k != "params"}
        fqns = []
        for _ in group["params"]:
            p = params[pid]
            pid += 1
            if id(p) in names:
                fqns.extend(names[id(p)])
            else:
                fqns.append(info.index.tensor_fqns[info.index.slot_of(p)][0])
        packed["params"] = fqns
        out.append(packed)
    return out


def _state_meta(h: _Handle, local: dict[str, Any] | None) -> dict[str, Any]:
    """What this rank knows about a handle's state: "names" maps each state
    name to ("t", dtype) for tensors with a dimension or ("s", value) for
    0-dim tensors and other values; "present" lists the original
    parameters (indices) with state here, "scalars" their 0-dim tensors
    (on CPU, as FSDP exchanges them) and other values (use_orig_params:
    each original parameter keeps its own, e.g. its step count), and
    "numels" the elements of each of their tensor states (a piece this
    rank holds none of has empty ones: ``_merge_scalars``); "templated"
    whether the flat parameter's entry, or which of the original
    parameters' (indices), is this rank's never-stepped template (D48)."""
    names: dict[str, Any] = {}
    present: list[int] = []
    scalars: dict[int, dict[str, Any]] = {}
    numels: dict[int, dict[str, int]] = {}
    templated: bool | list[int] = False
    if local is not None:
        if "flat" in local:
            entries = [local["flat"]]
            templated = bool(local["templated"])
        else:
            templated = sorted(local["templated"])
            entries = []
            for i, entry in sorted(local["pieces"].items()):
                if entry:
                    entries.append(entry)
                    present.append(i)
                    scalars[i] = {
                        name: _to_wire(value)
                        for name, value in entry.items()
                        if not (isinstance(value, torch.Tensor) and value.dim() > 0)
                    }
                    numels[i] = {
                        name: value.numel()
                        for name, value in entry.items()
                        if isinstance(value, torch.Tensor) and value.dim() > 0
                    }
        for entry in entries:
            for name, value in entry.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    names.setdefault(name, ("t", value.dtype))
                else:
                    names.setdefault(name, ("s", _to_wire(value)))
    return {"names": names, "present": present, "scalars": scalars, "numels": numels, "templated": templated}


def _gather_handles(handles, per_handle, info, to_save, never: set[str]) -> dict[str, dict[str, Any]]:
    """Full (or chunk-sharded) state of every original parameter of every
    handle that has state, keyed by canonical FQN.  Adds to ``never`` the
    original parameters whose state is a never-stepped template on every
    rank that holds some (``_never_stepped``): every rank comes to the
    same set."""
    from .consistency import mesh_all_gather_object

    metas = {h.fqns[0]: _state_meta(h, per_handle.get(id(h))) for h in handles}
    # One small exchange: which handles have which state on which rank.
    group_meshes = {}
    for h in handles:
        if h.sharded and id(h.group) not in group_meshes:
            group_meshes[id(h.group)] = mesh_for_group(h.group, h.flat.device.type)
    gathered_meta: dict[str, dict[str, Any]] = {}
    present: dict[str, set[int]] = {}
    # per handle and original parameter, each rank's (rank, scalars, numels)
    held: dict[str, dict[int, list[tuple[int, dict[str, Any], dict[str, int]]]]] = {}
    # per handle, the metas of the ranks of its group
    holders: dict[str, list[dict[str, Any]]] = {}
    flat_values: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    group_of = {h.fqns[0]: id(h.group) for h in handles if h.sharded}
    for group_id, mesh in group_meshes.items():
        all_metas, ranks = mesh_all_gather_object(mesh, metas)
        for rank, rank_meta in zip(ranks, all_metas):
            for key, meta in rank_meta.items():
                merged = gathered_meta.setdefault(key, {})
                for name, m in meta["names"].items():
                    merged.setdefault(name, m)
                present.setdefault(key, set()).update(meta["present"])
                if group_of.get(key) != group_id:  # the ranks of another group's handle: not its holders
                    continue
                holders.setdefault(key, []).append(meta)
                if not meta["present"] and meta["names"]:  # a flat parameter's: its 0-dim and other values
                    flat_values.setdefault(key, []).append(
                        (rank, {name: value for name, (kind, value) in meta["names"].items() if kind == "s"}))
                for i, values in meta["scalars"].items():
                    held.setdefault(key, {}).setdefault(i, []).append((rank, values, meta["numels"][i]))
    for h in handles:
        if not h.sharded:
            meta = metas[h.fqns[0]]
            gathered_meta.setdefault(h.fqns[0], meta["names"])
            present.setdefault(h.fqns[0], set(meta["present"]))
            held.setdefault(h.fqns[0], {i: [(dist.get_rank(), values, meta["numels"][i])]
                                        for i, values in meta["scalars"].items()})
            holders.setdefault(h.fqns[0], [meta])
    for h in handles:
        never.update(_never_stepped(h, holders.get(h.fqns[0], [])))
    param_scalars = {
        h.fqns[0]: {i: _merge_scalars(h.fqns[i], per_rank) for i, per_rank in held.get(h.fqns[0], {}).items()}
        for h in handles if h.orig
    }
    for h in handles:
        if not h.orig and h.fqns[0] in flat_values:
            # every rank returns its own, as FSDP does: they must agree
            _merge_scalars(h.fqns[0], [(rank, values, {}) for rank, values in flat_values[h.fqns[0]]])

    leaves: list[Any] = []
    slots: list[tuple[_Handle, str]] = []
    scalars: dict[int, dict[str, Any]] = {}
    for h in handles:
        meta = gathered_meta.get(h.fqns[0], {})
        if not meta:
            continue
        local = per_handle.get(id(h))
        pieces = C.flat_pieces(h.numels, h.mask, h.shard, h.rank) if h.orig else None
        for name, (kind, value) in meta.items():
            if kind == "s":
                if not h.orig:
                    scalars.setdefault(id(h), {})[name] = _scalar(local, name, value)
                continue
            if local is not None and "flat" in local:
                flat_state = local["flat"][name]
            else:
                flat_state = torch.zeros(h.shard, dtype=value, device=h.flat.device)
                if local is not None:
                    values = [None] * len(h.fqns)
                    for i, entry in local["pieces"].items():
                        if entry and name in entry:
                            values[i] = entry[name]
                    C.flat_assemble(flat_state, pieces, values)
            if h.sharded:
                mesh = group_meshes[id(h.group)]
                flat_state = DTensor.from_local(
                    flat_state, mesh, [Shard(0)], run_check=False,
                    shape=torch.Size([h.shard * h.ws]), stride=(1,),
                )
            leaves.append(flat_state)
            slots.append((h, name))
    full = gather_full_tensors(
        leaves,
        keep=to_save,
        options_key=("fsdp1", info.full_state_dict, info.cpu_offload),
    )
    out: dict[str, dict[str, Any]] = {}
    if not to_save:
        return out
    full = list(full)
    for i, (h, name) in enumerate(slots):
        # drop each gathered flat tensor once its originals are cut out
        # (cloned), so the peak stays near the result plus one flat tensor
        flat, full[i] = full[i], None
        views = C.flat_unflatten(flat, h.numels, h.mask, h.shapes)
        del flat
        if h.orig:
            # only parameters some rank has state for (frozen ones have none)
            keep = present.get(h.fqns[0], set())
            views = [v if j in keep else None for j, v in enumerate(views)]
        views = _finish_values(h, views, info)
        for fqn, view in zip(h.fqns, views):
            if view is not None:
                out.setdefault(fqn, {})[name] = view
    for h in handles:
        if h.orig:
            for i, values in param_scalars.get(h.fqns[0], {}).items():
                out.setdefault(h.fqns[i], {}).update(values)
            continue
        extra = scalars.get(id(h))
        if not extra:
            continue
        for fqn in h.fqns:
            out.setdefault(fqn, {}).update(extra)
    for h in handles:
        names = list(gathered_meta.get(h.fqns[0], {}))
        for fqn in h.fqns:
            entry = out.get(fqn)
            if entry is None:
                continue
            # use_orig_params: the optimizer's own order of state names;
            # flat parameters: FSDP's sorted order
            out[fqn] = {n: entry[n] for n in names if n in entry} if h.orig else _sort_names(entry)
    return out


def _never_stepped(h: _Handle, metas: list[dict[str, Any]]) -> list[str]:
    """The original parameters of ``h`` whose state is a never-stepped
    template on every rank of its group that holds state for them (the
    metas of ``_state_meta``).  A flat parameter is one optimizer entry:
    all its originals, or none."""
    if h.orig:
        out = []
        for i, fqn in enumerate(h.fqns):
            holding = [m for m in metas if i in m["present"]]
            if holding and all(i in m["templated"] for m in holding):
                out.append(fqn)
        return out
    holding = [m for m in metas if m["names"]]
    return list(h.fqns) if holding and all(m["templated"] for m in holding) else []


def _merge_scalars(fqn: str, per_rank: list[tuple[int, dict[str, Any], dict[str, int]]]) -> dict[str, Any]:
    """An original parameter's non-tensor states (use_orig_params) from
    the ranks that hold state for it, by FSDP's rule: a rank whose tensor
    states of it are empty (it holds no piece of the parameter: state an
    initialising step gave it, which later steps skip) is left out, and
    the others must agree; they all do in training, each stepping its
    piece.  Taking any rank's value would save a ``step`` that rank never
    advanced (upstream's dummy step gives the empty ranks one)."""
    tensor_names = {name for _, _, numels in per_rank for name in numels}
    out: dict[str, Any] = {}
    source: dict[str, int] = {}
    check = check_enabled()
    for rank, values, numels in per_rank:
        if any(numels.get(name, 0) == 0 for name in tensor_names):
            continue
        for name, value in values.items():
            if check and name in out and not _same_wire(out[name], value):
                if plain_tensor_in(value) or plain_tensor_in(out[name]):
                    raise errors.InconsistentOptimizerStateError(
                        f"optimizer state {name!r} of {fqn!r} holds tensors inside a "
                        f"{type(value).__name__}, and ranks {source[name]} and {rank} hold different "
                        "ones: under FSDP1 the optimizer steps each rank's piece of a flat parameter, so "
                        "such tensors are pieces too (heavyball keeps a parameter's state in a dict per "
                        "view), and dcp_optim maps pieces of state tensors only where they are the "
                        "state's own values, so the get is refused (upstream's saves one rank's pieces "
                        "under every original name, or raises).  Under FSDP2 (DTensor parameters) "
                        "dcp_optim saves such state",
                        f"{fqn}.{name}", [source[name], rank],
                    )
                raise errors.InconsistentOptimizerStateError(
                    f"optimizer state {name!r} of {fqn!r}: rank {rank} has {_show_wire(value)}, rank "
                    f"{source[name]} {_show_wire(out[name])}.  A value the optimizer computes from each "
                    "rank's piece of the parameter (transformers' Adafactor keeps the piece's RMS) or one "
                    "changed on one rank alone: a checkpoint holds one value for all ranks (FSDP's own "
                    "gather refuses this too).  Where the optimizer recomputes it at every step "
                    f"(Adafactor's RMS), {CHECK_ENV}=0 saves the last rank's; use_orig_params=False keeps "
                    "the optimizer's state per flat shard",
                    f"{fqn}.{name}", [source[name], rank],
                )
            out[name] = value
            source.setdefault(name, rank)
    return {name: _from_wire(value) for name, value in out.items()}


def _same_wire(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, _WireScalar) or isinstance(b, _WireScalar):
        return (isinstance(a, _WireScalar) and isinstance(b, _WireScalar) and a.dtype == b.dtype
                and a.value == b.value)
    return same_value(a, b)  # lists of tensors too (a preconditioner per dimension), bit for bit


def _show_wire(value: Any) -> str:
    return f"{value.value!r} ({value.dtype})" if isinstance(value, _WireScalar) else repr(value)


def _scalar(local, name, fallback):
    if local is not None:
        entries = [local["flat"]] if "flat" in local else [e for e in local["pieces"].values() if e]
        for entry in entries:
            if name in entry:
                value = entry[name]
                return value.detach().clone() if isinstance(value, torch.Tensor) else value
    return _from_wire(fallback)


@dataclass(frozen=True)
class _WireScalar:
    """A 0-dim tensor in the metadata exchange as a Python number and a
    dtype: pickling a tensor costs a torch.save/torch.load per value (about
    2 ms each), a number costs nothing.  Exact for every real dtype
    (float32 -> Python float is lossless); rebuilt on CPU, as FSDP's own
    exchange returns it."""

    value: Any
    dtype: torch.dtype


def _to_wire(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex():
        return _WireScalar(value.item(), value.dtype)
    if isinstance(value, torch.Tensor):
        return value.cpu()
    return value


def _from_wire(value: Any) -> Any:
    if isinstance(value, _WireScalar):
        return torch.tensor(value.value, dtype=value.dtype)
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _finish_values(h: _Handle, views: list[Any], info: Any) -> list[Any]:
    """Full values as upstream returns them: clones (full), or chunked
    ShardedTensors / DTensors (sharded)."""
    if info.full_state_dict:
        if info.cpu_offload:
            return C.map_call(torch.Tensor.cpu, views, ())
        return C.map_call(torch.Tensor.clone, views, ())
    from torch.distributed.fsdp._fsdp_extensions import _ext_chunk_dtensor, _ext_chunk_tensor

    state = h.module
    # FSDP.state_dict_type switches sharded optimizer state to DTensor
    # whenever the FSDP instance was given a device mesh
    # (_set_optim_use_dtensor); the native path does not enter that context
    if state._device_mesh is not None:
        return C.map_call(_ext_chunk_dtensor, views, (state.rank, state._device_mesh, state._fsdp_extension))
    values = C.map_call(
        _ext_chunk_tensor,
        views,
        (state.rank, state.world_size, state._device_handle.device_count(), state.process_group, state._fsdp_extension),
    )
    values = C.map_call(complete_chunks, values, ())
    if info.cpu_offload:
        values = C.map_call(_cpu, values, ())
    return values


def _cpu(value: Any) -> Any:
    return value.cpu()


# --- chunks no rank is left without ------------------------------------------------
#
# FSDP1's sharded state dict chunks each original parameter (and its
# optimizer state) along dim 0 with ``torch.chunk``, which makes fewer
# chunks than ranks wherever ceil(n / W) * (W - 1) >= n (n = 1 row at any
# world, 5 rows at 4 ranks, 100 at 64): the ShardedTensor lists no shard
# for the last ranks and has none there.  DCP's load planner drops a
# ShardedTensor without local shards from the template
# (``_flatten_sharded_tensors``), takes the keys it then misses for a
# pre-2.4 checkpoint and re-flattens the whole dict the old way, which
# fails once an optimizer is loaded with it ("Missing key in checkpoint
# state_dict: optim.param_groups.") -- on upstream's dicts as on ours
# (pytorch/pytorch#163480, not merged).  So the getters list a zero-size
# shard at offset n for every rank without one, and give such a rank an
# empty local shard: DCP keeps the entry, writes and reads nothing for it,
# and the global metadata is the same on every rank.


def complete_chunks(value: Any) -> Any:
    """``value`` itself, or, for an FSDP1 chunked ShardedTensor that
    leaves ranks of its group without a shard, the same tensor with a
    zero-size shard for each of them (see above)."""
    from torch.distributed._shard.sharded_tensor import Shard as LocalShard
    from torch.distributed._shard.sharded_tensor import ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharding_spec import ShardMetadata
    from torch.distributed.fsdp._shard_utils import _get_remote_device_str

    if not isinstance(value, ShardedTensor):
        return value
    md = value.metadata()
    pg = value._process_group
    world = dist.get_world_size(pg)
    size = list(md.size)
    if not size or not md.shards_metadata or len(md.shards_metadata) >= world:
        return value
    placements = [m.placement for m in md.shards_metadata]
    if any(p is None for p in placements):  # not FSDP's chunks (each names its rank)
        return value
    held = {p.rank() for p in placements if p is not None}
    device_type = cast(Any, placements[0]).device().type
    per_node = 1 if device_type == "cpu" else torch.get_device_module(device_type).device_count()
    offsets = [size[0]] + [0] * (len(size) - 1)
    sizes = [0] + size[1:]
    shards = list(md.shards_metadata)
    mine: Any = None
    me = dist.get_rank()
    for r in range(world):
        global_rank = dist.get_global_rank(pg, r)
        if global_rank in held:
            continue
        shard = ShardMetadata(list(offsets), list(sizes), _get_remote_device_str(global_rank, device_type, per_node))
        shards.append(shard)
        if global_rank == me:
            mine = shard
    local = value.local_shards()
    if mine is not None and not local:
        props = md.tensor_properties
        empty = torch.empty(sizes, dtype=props.dtype, layout=props.layout, device=mine.placement.device())
        local = [LocalShard(empty, mine)]
    metadata = ShardedTensorMetadata(shards, md.size, md.tensor_properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, metadata, process_group=pg)


def complete_chunks_of(entries: dict[str, Any]) -> None:
    """``complete_chunks`` on every value of ``entries`` (in place: a dict
    the getter built)."""
    for key, value in entries.items():
        entries[key] = complete_chunks(value)


def _get_via_fsdp(model: nn.Module, optimizers, info: Any, local: list[tuple]) -> dict[str, Any]:
    """FSDP's own APIs (HSDP, non-contiguous originals), on each
    optimizer's ``_local_optim_state``: a never-stepped optimizer's
    template holds the state a first step makes here too (D2; without it
    dcp.load would fill nothing and the resume would start from fresh
    moments), and the optimizer-wide entries (D29) go round FSDP's
    function, which takes every key of "state" for a parameter's."""
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    never = _agreed_never_stepped(model, optimizers, info, local)
    for o, (optim, (osd, wide, _params, _stepless)) in enumerate(zip(optimizers, local)):
        with info.fsdp_context():
            osd = FSDP.optim_state_dict(model, optim, osd, group=fsdp_process_group(model, info))
        if not osd:
            continue
        for key in list(osd["state"].keys()):
            if "_orig_mod" in key:
                osd["state"][key.replace("_orig_mod.", "")] = osd["state"].pop(key)
        for group in osd["param_groups"]:
            group["params"] = [k.replace("_orig_mod.", "") for k in group["params"]]
        if not info.full_state_dict:
            for entry in osd["state"].values():
                if isinstance(entry, dict):
                    complete_chunks_of(entry)
        state.update(osd["state"])
        add_wide(state, o, wide)
        first = len(groups)
        groups.extend(osd["param_groups"])
        if never:
            mark_groups(groups, never, first)
    _unshare_scalars(state)
    info.never_stepped = never
    return {"state": state, "param_groups": groups}


def _agreed_never_stepped(model: nn.Module, optimizers, info: Any, local: list[tuple]) -> set[str]:
    """FSDP's own getters (hybrid sharding): the original parameters whose
    state is a never-stepped template on every rank that holds state for
    them (D48), agreed in one all-reduce of two words per tensor of the
    model (the same tensors, in the same order, on every rank: the bytes
    do not grow with the world) -- only where some optimizer has no schema
    (the same on every rank) and the ranks of the model are known (hybrid
    sharding over process groups that span the world, or a device mesh);
    none otherwise, and the checkpoint's templates are then loaded as
    state, as before."""
    from .consistency import mesh_all_reduce_min

    if all(schema_for(optim) is not None for optim in optimizers):
        return set()
    is_fsdp1, known, mesh = agreement_mesh(model, info)
    if not (is_fsdp1 and known):
        return set()
    index = info.index
    # per tensor: [no rank holds state a step made, no rank holds a
    # template] -- 1 here until this rank holds one
    words = [1] * (2 * len(index.tensor_fqns))
    for osd, _wide, params, stepless in local:
        for pid, p in enumerate(params):
            slot = index.slot_of(p) if osd["state"].get(pid) else None
            if slot is not None:
                words[2 * slot + (1 if pid in stepless else 0)] = 0
    agreed = mesh_all_reduce_min(mesh, words)
    # (a flat parameter's tensor names all its originals)
    return {fqn for slot, fqns in enumerate(index.tensor_fqns)
            if agreed[2 * slot] == 1 and agreed[2 * slot + 1] == 0 for fqn in fqns}


# --- set -------------------------------------------------------------------------


def _to_dtensor(value: Any, h: _Handle) -> Any:
    """A ShardedTensor chunked along dim 0 over the handle's group is a
    DTensor Shard(0) in disguise: rewrap it so that the bucketed gather
    handles it (other layouts keep their own gather)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if not isinstance(value, ShardedTensor) or not h.sharded:
        return value
    size = value.size()
    if len(size) == 0:
        return value
    chunk = -(-size[0] // h.ws)
    shards = value.local_shards()
    expected = [r * chunk for r in range(h.ws) if r * chunk < size[0]]
    offsets = [m.shard_offsets[0] for m in value.metadata().shards_metadata if m.shard_sizes[0]]
    if offsets != expected or any(o != 0 for m in value.metadata().shards_metadata for o in m.shard_offsets[1:]):
        return value
    if shards:
        local = shards[0].tensor
    else:
        local = torch.empty((0, *size[1:]), dtype=value.dtype, device=h.flat.device)
    mesh = mesh_for_group(h.group, local.device.type)
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=size,
                              stride=torch.empty(size, device="meta").stride())


class Fsdp1Localize:
    """An optimizer load into an FSDP1 model in the load pipeline's phases
    (``pipeline.LoadPart``, driven by ``optim.OptimLoad``): every FSDP-
    managed original parameter's state becomes what this rank's optimizer
    holds -- the flat shard (keyed by the flat parameter's first FQN) or,
    with use_orig_params, this rank's piece of each original parameter.

    * ``source_meta()``: on a broadcast load's source, the metadata of its
      view (it travels in the load's payload);
    * ``validate(payload)``: a receiver takes the source's view;
    * ``reserve()``: the new tensors of this rank's state and the plan and
      buffer of the broadcast stream that fills them -- on broadcast loads
      before the agreement ahead of the stream, so that a rank out of
      memory fails there, with every rank, not inside the stream's
      collectives while its peers wait in them;
    * ``move()``: the data: sharded loads first gather the full tensors
      (bucketed), every rank slices its pieces out of them; broadcast loads
      stream them from rank 0 (the default group: FSDP1 parameters are
      plain tensors).  Returns the localized view.

    Nothing is written in place: the pieces land in new tensors, installed
    at commit."""

    def __init__(self, view: tuple, info: Any):
        from .distribute import Route

        self.view = view
        self.info = info
        self.handles = _handles(info)
        self.route = None
        if info.full_state_dict and info.broadcast_from_rank0:
            device = self.handles[0].flat.device if self.handles else torch.device("cpu")
            self.route = Route(None, device)
        self.jobs: list[tuple] | None = None  # reserve's
        self.result: tuple = ()
        self.planned: Any = None  # distribute.StreamPlan

    def source_meta(self) -> Any:
        from .distribute import view_metadata

        if self.route is None or not self.route.is_source:
            return None
        return view_metadata(self.view)

    def validate(self, payload: Any = None) -> None:
        if self.route is None:
            _check_loaded_entries(self.view, self.handles)
            return
        if payload is None:
            raise errors.StateDictValueError("broadcast_from_rank0=True: rank 0 did not provide an optimizer state dict")
        if not self.route.is_source:
            self.view = payload
        _check_loaded_entries(self.view, self.handles, broadcast=True)

    def reserve(self) -> None:
        from .distribute import plan_stream

        if self.jobs is None:
            self.result, self.jobs = _local_pieces(self.view, self.handles)
        if self.route is not None and self.jobs:
            # never scattered: the templates are plain tensors
            self.planned = plan_stream(self.jobs, self.route, False, [])

    def move(self) -> tuple:
        from .distribute import run_full_load

        self.view = _whole_flat_units(self.view, self.handles)
        if self.route is None and not self.info.full_state_dict:
            self.view = _gathered(self.view, self.handles)
        if self.jobs is None:  # not reserved: a load without agreement, or not broadcast
            self.reserve()
        assert self.jobs is not None
        if self.jobs:
            run_full_load(self.jobs, route=self.route, scattered=[], planned=self.planned)
            self.planned = None
        return self.result

    def stream_paths(self) -> int:
        return 0  # nothing scattered

    def broadcast_all(self) -> None:
        pass  # every tensor is broadcast already

    def inline_values(self) -> Any:
        return None  # never inline: see state_dict._source_payload

    def take_inline(self, values: Any) -> None:
        pass


def flat_units(info: Any) -> list[list[str]]:
    """The originals of each flat parameter (use_orig_params=False): one
    optimizer entry each (``never_stepped.partly_marked``)."""
    return [h.fqns for h in _handles(info) if not h.orig]


def _whole_flat_units(view: tuple, handles: list[_Handle]) -> tuple:
    """The view with the marks of flat parameters marked only in part
    taken out: such a flat parameter loads whole
    (``never_stepped.partly_marked``)."""
    partial = partly_marked(marked_in_view(view), [h.fqns for h in handles if not h.orig])
    return unmark(view, partial) if partial else view


def _check_loaded_entries(view: tuple, handles: list[_Handle], broadcast: bool = False) -> None:
    """A loaded original parameter's state tensors are shaped like it (they
    are cut as FSDP cuts the parameter: one of another size would be read
    past its end, after the ranks agreed).  And FSDP's rules for
    flattening original parameters' states into one flat parameter's
    (``use_orig_params=False``; FSDP's ``_flatten_optim_state``): the
    originals with state hold the same
    state names, each name of one kind, and a value the flat parameter
    holds once -- a 0-dim tensor or a non-tensor (a per-parameter
    ``step``, NovoGrad's gradient norm) -- is held by every original
    alike.  A checkpoint from another layout (one process, FSDP2, FSDP1
    with ``use_orig_params``) can hold different ones, and taking the
    first would drop the others silently: ``StateDictValueError``
    (a ``ValueError``, as FSDP raises) naming both parameters and the
    state.  So are the originals' param groups: a flat parameter sits in
    one group, and originals saved in groups with different values (the
    checkpoint's body and head with their own learning rates) cannot both
    keep theirs (``ParamGroupConflictError``).  On a ``broadcast`` load,
    a state that holds tensors inside a list, tuple or dict (SOAP's
    per-dimension preconditioners) is refused: the stream carries the
    tensors that are cut into pieces, and such tensors -- of shapes that
    follow the layout they were computed at -- would reach no rank but
    the source.  Metadata only (a broadcast's receivers see tensors as
    ``TensorMeta``: the source compares their values)."""
    from .distribute import TensorMeta

    state, groups, fqn_group = view[0], view[1], view[2]

    def kind(value: Any) -> str:
        if isinstance(value, TensorMeta):
            return "tensor" if len(value.shape) > 0 else "0-dim tensor"
        if isinstance(value, torch.Tensor):
            return "tensor" if value.dim() > 0 else "0-dim tensor"
        return "non-tensor"

    def same(a: Any, b: Any) -> bool:
        if isinstance(a, TensorMeta) or isinstance(b, TensorMeta):
            return True  # compared on the source
        return same_value(a, b)

    for h in handles:
        if not h.orig:
            _check_flat_groups(h, groups, fqn_group, same)
        entries = [(f, state.get(f)) for f in h.fqns]
        present = [(f, e) for f, e in entries if isinstance(e, dict) and e]
        for (fqn, entry), shape in zip(entries, h.shapes):
            numel = torch.Size(shape).numel()
            for name, value in entry.items() if isinstance(entry, dict) else ():
                if broadcast and kind(value) == "non-tensor" and plain_tensor_in(value):
                    raise errors.StateDictValueError(
                        f"optimizer state {name!r} of {fqn!r} holds tensors inside a "
                        f"{type(value).__name__}: a broadcast load into FSDP1 cuts a parameter's state "
                        "tensors into this rank's pieces, and tensors inside a container are no "
                        "parameter's shape (they follow the layout they were computed at); they would "
                        "reach no rank but the source. Nothing was loaded. Save and load this "
                        "optimizer through DCP at the layout it trains at.")
                if kind(value) == "tensor" and torch.Size(value.shape).numel() != numel:
                    raise errors.StateDictValueError(
                        f"optimizer state {name!r} of {fqn!r} has shape {tuple(value.shape)} where the "
                        f"parameter has {tuple(shape)}: FSDP1 shards a parameter's state tensors as it shards "
                        "the parameter, and this one is not shaped like it")
        if h.orig or not present:
            continue
        first, names = present[0][0], list(present[0][1])
        where = f"(FSDP1 flat parameter of {h.fqns}, use_orig_params=False)"
        for fqn, entry in present[1:]:
            if set(entry) != set(names):
                raise errors.StateDictValueError(
                    f"optimizer states of {first!r} {sorted(names)} and {fqn!r} {sorted(entry)} differ: "
                    f"they flatten into one flat parameter {where}, which holds one set of states")
        for name in names:
            values = [(fqn, entry[name]) for fqn, entry in present]
            kinds = {kind(v) for _, v in values}
            if len(kinds) != 1:
                raise errors.StateDictValueError(
                    f"optimizer state {name!r} is a tensor for some of {h.fqns} and not for others {where}")
            if kinds == {"tensor"}:
                continue  # cut into the flat shard: each original its own piece (zeros where absent)
            missing = [fqn for fqn, entry in entries if not (isinstance(entry, dict) and name in entry)]
            if missing:
                raise errors.StateDictValueError(
                    f"optimizer state {name!r} of {first!r} is held once by the flat parameter {where}, "
                    f"but {missing} have none: the flat parameter cannot hold both")
            for fqn, value in values[1:]:
                if not same(values[0][1], value):
                    raise errors.StateDictValueError(
                        f"optimizer state {name!r} of {first!r} ({values[0][1]!r}) differs from {fqn!r}'s "
                        f"({value!r}): the flat parameter {where} holds one value for all of its parameters; "
                        "loading would keep one and drop the other.  Load it into a model wrapped with "
                        "use_orig_params=True, or with each of these parameters in a flat parameter of its own")


def _check_flat_groups(h: _Handle, groups: list[Any], fqn_group: dict[str, int],
                       same: Callable[[Any, Any], bool]) -> None:
    """The loaded groups of a flat parameter's originals agree on every key
    both hold (see ``_check_loaded_entries``)."""
    loaded = [(f, fqn_group[f]) for f in h.fqns if f in fqn_group]
    first_fqn, first = loaded[0] if loaded else ("", -1)
    for fqn, gi in loaded[1:]:
        if gi == first:
            continue
        a, b = groups[first], groups[gi]
        for key, value in a.items():
            if key != "params" and key in b and not same(value, b[key]):
                raise errors.ParamGroupConflictError(
                    f"the FSDP1 flat parameter of {h.fqns} (use_orig_params=False) sits in one param "
                    f"group, but the loaded dict puts its parameters in groups with different {key!r} "
                    f"({value!r} for '{first_fqn}', {b[key]!r} for '{fqn}'): one group cannot hold both "
                    "values (a load keeping either would train some parameters with another group's "
                    "hyperparameters). Nothing was loaded. Wrap the model with use_orig_params=True and "
                    "build the optimizer with the checkpoint's param groups, or give these parameters "
                    "flat parameters of their own.",
                    -1, -1, key, [first_fqn, fqn],
                )


def _gathered(view: tuple, handles: list[_Handle]) -> tuple:
    """A sharded load's view with its sharded values (ShardedTensor /
    DTensor) of FSDP-managed parameters gathered into full tensors,
    bucketed (a collective across the group)."""
    state, groups, fqn_group, empties, unexpected = view
    keys, leaves = [], []
    by_fqn = {f: h for h in handles for f in h.fqns}
    for fqn, entry in state.items():
        h = by_fqn.get(fqn)
        if h is None or not isinstance(entry, dict):
            continue
        for name, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                keys.append((fqn, name))
                leaves.append(_to_dtensor(value, h))
    full = gather_full_tensors(leaves, options_key=("fsdp1-load",))
    state = {k: dict(v) if isinstance(v, dict) else v for k, v in state.items()}
    for (fqn, name), value in zip(keys, full):
        state[fqn][name] = value
    return (state, groups, fqn_group, empties, unexpected)


def _local_pieces(view: tuple, handles: list[_Handle]) -> tuple[tuple, list[tuple]]:
    """The localized view, its new tensors allocated (not yet filled), and
    the load's jobs that fill them: [(full value or TensorMeta, (dest,
    blocks) or False, device)], one per (original parameter, state name),
    in the same order on every rank (a broadcast stream pairs the
    source's and receivers' jobs by position); each rank copies only the
    blocks it holds."""
    state, groups, fqn_group, empties, unexpected = view
    new_state = {k: v for k, v in state.items()}
    jobs: list[tuple] = []
    for h in handles:
        pieces = C.flat_pieces(h.numels, h.mask, h.shard, h.rank) if h.sharded else [
            (i, 0, off, n) for i, (off, n) in enumerate(_offsets(h))
        ]
        entries = [state.get(f) if isinstance(state.get(f), dict) else None for f in h.fqns]
        for f in h.fqns:
            new_state.pop(f, None)
        present = [e for e in entries if e]
        if not present:
            continue
        mine: dict[int, list[tuple[int, int, int]]] = {}
        for i, pstart, sstart, length in pieces:
            mine.setdefault(i, []).append((pstart, sstart, length))
        if h.orig:
            for i, entry in enumerate(entries):
                if not entry:
                    continue
                held = mine.get(i, [])
                out: dict[str, Any] = {}
                for name, value in entry.items():
                    if not _is_full_tensor(value):
                        out[name] = value
                        continue
                    if not held:
                        jobs.append((_flat_value(value), False, h.flat.device))
                        continue
                    total = sum(n for _, _, n in held)
                    dest = torch.empty(total, dtype=value.dtype, device=h.flat.device)
                    blocks, pos = [], 0
                    for pstart, _, length in held:
                        blocks.append(((pos,), (pstart,), (length,)))
                        pos += length
                    jobs.append((_flat_value(value), (dest, blocks), h.flat.device))
                    # shaped like the original parameter as FSDP shows it
                    # here: a 1-D piece when sharded, its own shape when
                    # this rank holds it unsharded (world size 1, NO_SHARD)
                    out[name] = dest.view(h.params[i].shape)
                if held:
                    new_state[h.fqns[i]] = out
        else:
            flat_entry: dict[str, Any] = {}
            for name, value in present[0].items():
                if not _is_full_tensor(value):
                    flat_entry[name] = value
                    continue
                dest = torch.zeros(h.shard, dtype=value.dtype, device=h.flat.device)
                for i, entry in enumerate(entries):
                    if not entry or name not in entry:
                        continue
                    blocks = [((sstart,), (pstart,), (length,)) for pstart, sstart, length in mine.get(i, [])]
                    jobs.append((_flat_value(entry[name]), (dest, blocks), h.flat.device))
                flat_entry[name] = dest
            new_state[h.fqns[0]] = flat_entry
    return (new_state, groups, fqn_group, empties, unexpected), jobs


def _offsets(h: _Handle) -> list[tuple[int, int]]:
    out, pos = [], 0
    for n, pad in zip(h.numels, h.mask):
        if not pad:
            out.append((pos, n))
        pos += n
    return out


def _is_full_tensor(value: Any) -> bool:
    from .distribute import TensorMeta

    if isinstance(value, TensorMeta):
        return len(value.shape) > 0
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _flat_value(value: Any) -> Any:
    from .distribute import TensorMeta

    if isinstance(value, TensorMeta):
        numel = 1
        for d in value.shape:
            numel *= d
        return TensorMeta((numel,), value.dtype)
    return value.reshape(-1)


def native_supported(info: Any) -> bool:
    return _native_supported(info)


def load_via_fsdp(model: nn.Module, optimizers, osd: dict[str, Any], info: Any,
                  states: dict[str, Any] | None = None,
                  wide: dict[int, dict[str, Any]] | None = None,
                  own: dict[str, Any] | None = None,
                  never: set[str] | None = None) -> Callable[[], None]:
    """FSDP's own optimizer load (hybrid sharding, non-contiguous flat
    parameters): the conversion (``FSDP.optim_state_dict_to_load``, which
    makes collectives across the FSDP group) runs here, in the load's move,
    before the ranks' last agreement; returns the install, which only runs
    each optimizer's ``load_state_dict`` on the converted dicts (no
    collectives at commit).  ``states``: a flattened ``osd``'s states by
    FQN, as the native load parses them; ``wide``: the optimizer-wide
    entries (D29) per optimizer position, taken out of ``osd``; ``own``:
    the optimizers' own top-level entries, given to their own
    ``load_state_dict`` beside the converted dict; ``never``: the
    parameters the dict gives without state (D48: saved never stepped)."""
    converted = _convert_via_fsdp(model, optimizers, osd, info, states, never or set())
    for o, split in enumerate(converted):
        if wide and o in wide:  # torch's load_state_dict keeps the keys that are no parameter's
            split["state"] = {**split["state"], **copy_containers(wide[o])}
        for key, value in (own or {}).items():
            split.setdefault(key, value)

    def install() -> None:
        for optim, split in zip(optimizers, converted):
            state_dict_fn(optim, "load_state_dict")(state_dict=split)

    return install


def _convert_via_fsdp(model: nn.Module, optimizers, osd: dict[str, Any], info: Any,
                      states: dict[str, Any] | None, never: set[str]) -> list[dict[str, Any]]:
    from torch.distributed.checkpoint import state_dict as upstream

    ctx = context()
    converted: list[dict[str, Any]] = []
    for optim in optimizers:
        # upstream's OptimizerStateType: {"state": {fqn: {...}}, "param_groups": [{...}]}
        split: dict[str, Any] = {}
        if osd:
            if "state" in osd:
                split = cast(dict[str, Any], upstream._split_optim_state_dict(
                    model, optim, osd, _compat_info(model, info)))
            else:
                split = cast(dict[str, Any], upstream._unflatten_optim_state_dict(
                    optim, osd, _compat_info(model, info)))
                # upstream's unflattening takes the state names the live
                # optimizer holds: a never-stepped one (upstream's load
                # steps it first, dcp_optim never does: D1) holds none, and
                # FSDP's conversion then finds every state empty and raises
                for fqn, entry in split["state"].items():
                    if not entry and states and states.get(fqn):
                        split["state"][fqn] = states[fqn]
        # no entry at all for them: FSDP's conversion refuses an empty one
        # of a flat parameter, and skips a parameter without an entry
        for fqn in never:
            split.get("state", {}).pop(fqn, None)
        for original_fqn, _ in model.named_parameters():
            fqns = C.get_fqns(ctx, model, original_fqn, "_fqn_modifiers", True, True)
            with_compiler = C.get_fqns(ctx, model, original_fqn, "_fqn_modifiers", True, False)
            if fqns == with_compiler:
                continue
            if len(fqns) != 1:
                raise AssertionError(f"Expected 1 FQN for '{original_fqn}', got {len(fqns)}")
            fqn = fqns.pop()
            fqn_with_compiler = with_compiler.pop()
            for g in split["param_groups"]:
                g["params"] = [k.replace(fqn, fqn_with_compiler) for k in g["params"]]
            for k in list(split["state"].keys()):
                if fqn in k:
                    split["state"][k.replace(fqn, fqn_with_compiler)] = split["state"].pop(k)
        with info.fsdp_context():
            split = FSDP.optim_state_dict_to_load(
                model, optim, split, group=fsdp_process_group(model, info)
            )
        converted.append(split)
    return converted


def _compat_info(model: nn.Module, info: Any):
    from .checks import _verify_options

    compat = _verify_options(model, (), optim_only=False, options=None)
    compat.strict = info.strict
    return compat


def getter_options(info: Any) -> tuple[tuple[str, Any], ...]:
    return _getter_options(info)
