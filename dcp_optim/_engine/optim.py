"""Optimizer state dicts: get (FQN-keyed, never stepping) and set.

Get: the C core packs each optimizer's state keyed by FQN directly from
``optimizer.state`` and ``param_groups`` (what ``Optimizer.state_dict()``
plus upstream's ID -> FQN renaming produce), adding pristine state for
trainable parameters that have none yet (D1, D2 in docs/differences.md).  Optimizers whose
class overrides ``state_dict`` or that carry state-dict hooks go through
their own ``state_dict()`` and are re-keyed natively.

Set: the loaded dict (nested or flattened) becomes a neutral view, is
matched to every optimizer by FQN (D5-D7, D10), validated for all
optimizers, and only then installed -- natively for plain torch
optimizers (``Optimizer.load_state_dict`` semantics without its quadratic
scan, with the dtype/device policy of D9), through the optimizer's own
``load_state_dict`` otherwise.
"""

from __future__ import annotations

import collections
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _IncompatibleKeys

from .. import errors
from ..schema import PARAM, PARAM_DEVICE, proxied, schema_for
from . import zero
from .core import C, context
from .never_stepped import (
    mark_flat,
    mark_groups,
    marked_in_view,
    marked_names,
    only_held,
    partly_marked,
    plain_groups,
    unmarked_dict,
    unmarked_groups,
)
from .own_calls import is_patched, state_dict_fn
from .pipeline import Prepared, Report
from .pristine import add_group_keys, pristine, pristine_states, template_error
from .ranklocal import check_rank_local
from .shadow import (
    fallback_own_entries,
    fallback_pristine,
    fallback_wrapper_entries,
    upstream_wrapper_entries,
)
from .tree import insert_path, maybe_full_or_cpu_state_dict
from .values import plain_tensor_in, same_value
from .wide import (
    TORCH_LAYOUT,
    add_wide,
    collect_extras,
    copy_containers,
    filled,
    has_torch_layout,
    pop_wide,
    split_own_wide,
    wide_index,
    wide_key,
    with_step_created,
    without_step_created,
)

__all__ = ["OptimLoad", "get_optim", "load_optim", "init_optim_state"]

_Optimizer = torch.optim.Optimizer


def _own_method(optim: _Optimizer, api: str, base: Any, hook_attrs: tuple[str, ...]) -> bool:
    """True when ``optim.<api>`` is torch's base implementation with no
    hooks, so the native path computes exactly what it would."""
    if getattr(type(optim), api, None) is not base:
        return False
    instance_attr = optim.__dict__.get(api)
    if instance_attr is not None and not is_patched(instance_attr):
        return False
    return not any(getattr(optim, attr, None) for attr in hook_attrs)


def _native_get(optim: _Optimizer) -> bool:
    return _own_method(
        optim,
        "state_dict",
        _Optimizer.state_dict,
        ("_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks"),
    )


def _native_load(optim: _Optimizer) -> bool:
    return _own_method(
        optim,
        "load_state_dict",
        _Optimizer.load_state_dict,
        (
            "_optimizer_load_state_dict_pre_hooks",
            "_optimizer_load_state_dict_post_hooks",
        ),
    )


def _check_optimizer(optim: Any, position: int) -> None:
    """B8: composite optimizers without ``state``/``param_groups``."""
    for attr in ("param_groups", "state"):
        if not hasattr(optim, attr):
            raise errors.NotAnOptimizerError(
                f"optimizer {position} ({type(optim).__qualname__}) has no "
                f"'{attr}' attribute; pass torch.optim.Optimizer instances "
                "(for a composite optimizer, pass its sub-optimizers as the "
                "`optimizers` iterable)"
            )
    zero.check_not_wrapped(optim, position)


def _check_held_optimizers(optim: _Optimizer, i: int) -> None:
    """Raises ``HeldOptimizerStateError`` where ``optim`` (or the
    optimizer a proxy of it wraps) holds, as an attribute, another
    optimizer whose ``state`` is not its own and which is not the inner
    optimizer of a recognised wrapper layout (_wrapper_layout: Lookahead's
    ``state_dict()`` nests the inner one's beside its own entries).
    pytorch-optimizer's FriendlySAM, LookSAM, WSAM and GSAM keep their
    base optimizer's state so: their ``state_dict()`` nests its ID-keyed
    ``state_dict()`` under ``base_optimizer`` beside their own state,
    which no FQN-keyed dict (nor a DCP template) can carry; torch's
    default ``state_dict()`` omits it altogether.  SAM shares its base
    optimizer's ``state``, a proxy (accelerate) its inner one's: fine."""
    seen: set[int] = set()
    for owner in (optim, proxied(optim)):
        if id(owner) in seen:
            continue
        seen.add(id(owner))
        if zero.is_zero(owner):
            # its consolidated state_dict() holds its inner optimizer's
            # state, keyed by parameter index (zero.py)
            zero.check_supported(owner, i)
            continue
        own_state = getattr(owner, "state", None)
        held = [
            (name, v) for name, v in getattr(owner, "__dict__", {}).items()
            if isinstance(v, _Optimizer) and v is not owner and getattr(v, "state", None) is not own_state
        ]
        if not held:
            continue
        wrapped = _live_wrapper_layout(owner)
        held = [(name, v) for name, v in held if wrapped is None or v is not wrapped[1]]
        if not held:
            continue
        name, inner = held[0]
        cls = type(owner).__qualname__
        where = ("its state_dict() is torch's and omits it" if _native_get(owner)
                 else "its state_dict() keeps it apart from the state it keys by parameter")
        raise errors.HeldOptimizerStateError(
            f"optimizer {i} ({cls}) holds a {type(inner).__qualname__} at .{name} whose state "
            f"it keeps apart from its own ({where}): that state cannot be keyed by parameter "
            "FQN, and a resume through DCP would silently lose it (upstream's getter drops "
            "it). Nothing is returned. Save and load this optimizer with its own "
            f"state_dict()/load_state_dict(), or give {cls} one state dict that holds both "
            f"(e.g. sharing .{name}.state as its own state, as pytorch-optimizer's SAM does)",
            cls,
            name,
        )


def _torch_optimizer(optim: Any) -> bool:
    """A class of torch.optim itself (through proxies such as accelerate's
    AcceleratedOptimizer), with its own step: its non-tensor state and
    group values are hyperparameters and counters every rank shares."""
    return type(proxied(optim)).__module__.startswith("torch.optim.")


def _check_disjoint(optimizers: tuple[_Optimizer, ...], info: Any) -> None:
    """Raises ``StateDictValueError`` where a parameter is in two of the
    optimizers: a dict keyed by FQN holds one state and one group per
    parameter, so one optimizer's would be dropped (upstream's getter keeps
    the last optimizer's state for it, silently; its load gives both the
    same state)."""
    if len(optimizers) < 2:
        return
    owner: dict[int, int] = {}
    for i, optim in enumerate(optimizers):
        for group in optim.param_groups:
            for p in group["params"]:
                j = owner.setdefault(id(p), i)
                if j == i or proxied(optimizers[j]) is proxied(optim):  # one optimizer, passed twice
                    continue
                slot = info.index.slot_of(p)
                name = f"'{info.index.tensor_fqns[slot][0]}'" if slot is not None else f"of shape {tuple(p.shape)}"
                raise errors.StateDictValueError(
                    f"parameter {name} is in optimizer {j} ({type(optimizers[j]).__qualname__}) and in "
                    f"optimizer {i} ({type(optim).__qualname__}): an optimizer state dict keyed by FQN holds "
                    "one state per parameter, so one of them would be dropped silently. Nothing was "
                    "changed. Get and set these optimizers' state dicts in separate calls."
                )


@torch.no_grad()
def get_optim(model: nn.Module, optimizers: tuple[_Optimizer, ...], info: Any) -> dict[str, Any]:
    if not info.handle_optim:
        return {}
    for i, optim in enumerate(optimizers):
        _check_optimizer(optim, i)
        _check_held_optimizers(optim, i)
    _check_disjoint(optimizers, info)
    # D30: values an optimizer computes from the rank's shards (Prodigy's
    # and D-Adaptation's "d") are saved once, sharded or full; torch.optim's
    # own classes keep none outside tensors, and their sharded get stays
    # local (upstream's)
    rank_local = not all(_torch_optimizer(optim) for optim in optimizers)
    if info.fsdp_modules:
        from .fsdp1 import agreement_mesh, get_fsdp1_optim

        # a full get checks inside, before its gather: on ranks other than
        # 0 it may return nothing
        osd = get_fsdp1_optim(model, optimizers, info, check_rank_local=rank_local and info.full_state_dict)
        if rank_local and not info.full_state_dict:
            is_fsdp1, known, mesh = agreement_mesh(model, info)
            if is_fsdp1 and known:
                check_rank_local(osd, info, fsdp1=(mesh,))
    else:
        osd = _get_plain(optimizers, info)
        if rank_local:
            # before the full get's gather (DTensors still local)
            check_rank_local(osd, info)
    extras = getattr(info, "optim_extras", None)
    if info.flatten_optimizer_state_dict:
        keys = _flat_keys(model)
        osd_nested = osd
        try:
            osd = C.flatten_optim(context(), osd_nested, info.group_counts, keys)
        except NotImplementedError:
            # lists in the state (LBFGS's history): spelled element by
            # element with their length (D29); anything else raises as before
            encoded = _encode_lists(osd_nested)
            if encoded is osd_nested:
                raise
            osd = C.flatten_optim(context(), encoded, info.group_counts, keys)
        if keys is not None:
            _trim_flat_keys(keys, osd_nested)
        never = getattr(info, "never_stepped", None)
        if never:
            mark_flat(osd, osd_nested.get("param_groups", []), never)
    if extras:
        # after "state"/"param_groups" (nested) or the flat keys
        for key, value in extras.items():
            osd.setdefault(key, value)
    out = maybe_full_or_cpu_state_dict(osd, info)
    if info.cpu_offload and out:
        out = _unaliased(out, optimizers)
    return out


def _storage(t: torch.Tensor) -> int:
    if isinstance(t, DTensor):
        t = t._local_tensor
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage (a fake/meta-like subclass)
        return 0


def _live_storages(value: Any, out: set[int]) -> None:
    if isinstance(value, torch.Tensor):
        ptr = _storage(value)
        if ptr:
            out.add(ptr)
    elif isinstance(value, dict):
        for v in value.values():
            _live_storages(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _live_storages(v, out)


def _unaliased(osd: dict[str, Any], optimizers: tuple[_Optimizer, ...]) -> dict[str, Any]:
    """``cpu_offload=True`` returns copies (D28 in docs/differences.md):
    ``.to("cpu")`` keeps a tensor already on the CPU, so upstream returns
    the optimizer's own state tensors there (``step`` on every device),
    and training on after the get changes the dict about to be saved.
    Every returned tensor that shares storage with the live state (of
    any optimizer, including a wrapper's inner one and a
    ZeroRedundancyOptimizer's partition) is cloned; the
    containers are rebuilt around them."""
    live: set[int] = set()
    for optim in optimizers:
        for entry in getattr(optim, "state", {}).values():
            _live_storages(entry, live)
        inner = zero.inner(optim) if zero.is_zero(optim) else _inner_optimizer(optim)
        if inner is not None:
            for entry in inner.state.values():
                _live_storages(entry, live)
    if not live:
        return osd
    ctx = context()
    leaves = C.tree_leaves(ctx, osd, True)
    copies = [t.clone() if _storage(t) in live else t for t in leaves]
    if all(a is b for a, b in zip(copies, leaves)):
        return osd
    return C.tree_rebuild(ctx, osd, copies, True)


# The flat getter's key strings, kept between calls per model (id(model)
# -> (weak reference to the model, keys dict for C.flatten_optim; see
# "Reusing keys" in csrc/flat.c)).  A key is reused only where its FQN and
# state/group key equal the ones it was built from, so a changed model or
# optimizer cannot get a stale key; the dicts hold strings only, never a
# tensor, module or value, and go with their model.  Bounded: the least
# recently used model's strings go first.
_FLAT_KEYS: dict[int, tuple[weakref.ref, dict[str, Any]]] = {}
_FLAT_KEYS_MAX = 8


def _forget_flat_keys(key: int, ref: weakref.ref) -> None:
    entry = _FLAT_KEYS.get(key)
    if entry is not None and entry[0] is ref:
        _FLAT_KEYS.pop(key, None)


def _flat_keys(model: Any) -> dict[str, Any] | None:
    """The key cache of ``model`` for the flat getter (created on first
    use), or None for a model that cannot be weakly referenced."""
    key = id(model)
    entry = _FLAT_KEYS.pop(key, None)
    if entry is None or entry[0]() is not model:
        try:
            ref = weakref.ref(model, functools.partial(_forget_flat_keys, key))
        except TypeError:
            return None
        entry = (ref, {})
    _FLAT_KEYS[key] = entry  # most recently used last
    try:
        while len(_FLAT_KEYS) > _FLAT_KEYS_MAX:
            _FLAT_KEYS.pop(next(iter(_FLAT_KEYS)), None)
    except (RuntimeError, StopIteration):  # a weakref callback raced this
        pass
    return entry[1]


def _trim_flat_keys(keys: dict[str, Any], osd: dict[str, Any]) -> None:
    """Forget the strings of FQNs no longer used (renamed or removed
    parameters): cleared when it holds far more FQNs than this call used,
    and rebuilt by the next call."""
    used = len(osd.get("state", ())) + sum(len(g.get("params", ())) for g in osd.get("param_groups", ()))
    if len(keys) > 2 * used + 64:
        keys.clear()


def _get_plain(optimizers: tuple[_Optimizer, ...], info: Any) -> dict[str, Any]:
    index = info.index
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    counts: list[int] = []
    extras: dict[str, Any] = {}
    # the parameters whose state is a shadow step's (never_stepped)
    never: set[str] = set()
    for o, optim in enumerate(optimizers):
        if _native_get(optim):
            extra, group_keys = pristine(index, optim)
            extra, first_wide = pop_wide(extra)
            if extra and schema_for(optim) is None:
                _remember_template(optim, extra)
            first = len(groups)
            wide: list[dict[str, Any]] = []
            C.optim_pack(index, (optim,), (extra,), state, groups, wide)
            add_wide(state, o, {**first_wide, **wide[0]})
            add_group_keys(groups[first:], group_keys, mark=True)
            if schema_for(optim) is None:
                _mark_stepless(groups, first, extra, never)
            counts.append(len(optim.param_groups))
            continue
        zero_owner = zero.is_zero(optim)
        partition: set[int] | None = None
        if zero_owner:
            # (D36) its consolidated copy, checked against the live
            # partition, or else this rank's partition
            osd, partition = zero.state_dict(optim, o, bool(info.full_state_dict))
        else:
            osd = state_dict_fn(optim, "state_dict")()
        if not osd:
            continue
        osd, own_wide = split_own_wide(osd)
        target, wrapper_keys = optim, None
        wrapped = _wrapper_layout(optim, osd)
        if wrapped is not None:
            osd, target, wrapper_keys = _unwrap_state_dict(index, optim, osd, *wrapped)
        if zero_owner:
            # templates are its inner optimizer's class's
            target = zero.standin(optim, osd)
        extra, group_keys = pristine(index, target)
        if extra and partition is not None:
            extra = zero.in_partition(index, extra, partition)
        extra, first_wide = pop_wide(extra)
        if extra and schema_for(target) is None:
            _remember_template(optim if zero_owner else target, extra)
        if (extra or group_keys) and wrapped is None and not zero_owner:
            extra, group_keys = _in_own_layout(optim, index, extra, group_keys)
        if wrapper_keys:
            group_keys = [{**w, **(g or {})} for w, g in zip(wrapper_keys, group_keys or [{}] * len(wrapper_keys))]
        _check_own_state_dict(optim, osd)
        osd, inner_wide = split_own_wide(osd)
        C.optim_remap(index, target, osd)
        if wrapped is None and not zero_owner:
            osd = _own_entries_completed(index, optim, osd)
        collect_extras(optim, osd, extras)
        state.update(osd["state"])
        if extra:
            state.update(extra)
        add_wide(state, o, {**first_wide, **own_wide, **inner_wide})
        add_group_keys(osd["param_groups"], group_keys, mark=True)
        first = len(groups)
        groups.extend(osd["param_groups"])
        # (a wrapper's step may read the state it wraps: zeros from the
        # wrapped optimizer's schema are not "none yet" to it, D48).  ZeRO
        # (D36): only its consolidated copy, which holds every partition's
        # state; a rank's own partition knows nothing of the others'
        # parameters, and marking them would need a collective its getter
        # does not make (a rank-alone get after consolidating to it)
        if (schema_for(target) is None or wrapped is not None) and (not zero_owner or partition is None):
            _mark_stepless(groups, first, extra, never)
        counts.append(len(osd["param_groups"]))
    info.group_counts = counts
    info.optim_extras = extras
    info.never_stepped = never
    return {"state": state, "param_groups": groups}


def _mark_stepless(groups: list[dict[str, Any]], first: int, extra: dict[str, Any] | None, never: set[str]) -> None:
    """Marks, in one optimizer's returned groups (``groups[first:]``), the
    names of the parameters whose entry is a template (``extra``, from
    ``pristine``) that holds something, and adds them to ``never`` (D48).
    An empty entry (an optimizer that keeps no state for the parameter)
    has nothing to leave out."""
    stepless = {fqn for fqn, entry in (extra or {}).items() if entry}
    if stepless:
        never.update(stepless)
        mark_groups(groups, stepless, first)


def _in_own_layout(
    optim: _Optimizer, index: Any, extra: dict[str, Any] | None, group_keys: list[dict[str, Any]] | None
) -> tuple[dict[str, Any] | None, list[dict[str, Any]] | None]:
    """Pristine entries (keyed by FQN) and first-step group keys as the
    optimizer's own ``state_dict`` lays out a stepped optimizer's, so that
    a template matches its checkpoints (DCP: "Missing key" otherwise):

    * bitsandbytes' 8-bit optimizers nest their quantization state under
      one key of each entry;
    * heavyball's drop the group keys starting with "_" (its first step
      adds ``_orig_shapes``, None on a plain model).

    That method runs on a shallow copy of the optimizer whose state is the
    pristine entries alone and whose groups are copies of the live ones
    with the first step's keys added (the live optimizer is not touched);
    its entries are re-keyed by FQN, and a group key it leaves out is left
    out.  Each part stands as given where that raises or leaves an entry
    or a group out (an override bound to the live optimizer on the
    instance)."""
    # the parameters pristine() filled, under the FQNs it keyed them by
    by_fqn = {fqn: param for param, _, fqn in C.optim_missing(index, optim)}
    lay_state = bool(extra) and all(fqn in by_fqn for fqn in extra or ())
    live_groups = optim.param_groups
    lay_groups = bool(group_keys) and len(group_keys or ()) == len(live_groups)
    if not (lay_state or lay_groups):
        return extra, group_keys
    try:
        proxy = object.__new__(type(optim))
        proxy.__dict__.update(optim.__dict__)
        # (a wrapper's ``state`` may be a read-only property: the live
        # layout stands)
        proxy.state = collections.defaultdict(
            dict, {by_fqn[fqn]: entry for fqn, entry in (extra or {}).items()} if lay_state else {})
        if lay_groups:
            try:
                proxy.param_groups = [{**{k: v for k, v in (keys or {}).items() if k not in g}, **g}
                                      for g, keys in zip(live_groups, group_keys or ())]
            except Exception:  # noqa: BLE001 - a read-only property: the keys stand
                lay_groups = False
        osd = state_dict_fn(proxy, "state_dict")()
        osd, _ = split_own_wide(osd)
        own_groups = osd["param_groups"]
        C.optim_remap(index, proxy, osd)
        state = osd["state"]
    except Exception:  # noqa: BLE001 - the live layout stands
        return extra, group_keys
    if lay_state and (not isinstance(state, dict)
                      or any(not isinstance(state.get(fqn), dict) for fqn in extra or ())):
        lay_state = False
    if lay_groups and (not isinstance(own_groups, list) or len(own_groups) != len(live_groups)
                       or not all(isinstance(g, dict) for g in own_groups)):
        lay_groups = False
    if lay_state:
        extra = {fqn: state[fqn] for fqn in extra or ()}
    if lay_groups:
        group_keys = [{k: own[k] for k in (keys or {}) if k in own} for own, keys in zip(own_groups, group_keys or ())]
    return extra, group_keys




def _inner_optimizer(optim: Any) -> _Optimizer | None:
    """The one optimizer ``optim`` holds as an attribute and whose
    ``param_groups`` list it shares (a wrapper's inner optimizer)."""
    found = {
        id(v): v
        for v in getattr(optim, "__dict__", {}).values()
        if isinstance(v, _Optimizer) and v is not optim and v.param_groups is optim.param_groups
    }
    return next(iter(found.values())) if len(found) == 1 else None


def _wrapper_layout(optim: _Optimizer, osd: Any) -> tuple[Any, _Optimizer] | None:
    """(key, inner) when ``optim``'s own ``state_dict()`` is not torch's
    layout but nests, under one ``key``, the torch-layout ``state_dict()``
    of the inner optimizer whose param groups ``optim`` shares
    (pytorch-optimizer's Lookahead: ``base_optimizer``, Magma: ``base``);
    the wrapper's other entries sit beside it.  None otherwise."""
    if not isinstance(osd, dict) or has_torch_layout(osd):
        return None
    keys = [k for k, v in osd.items() if has_torch_layout(v)]
    if len(keys) != 1:
        return None
    inner = _inner_optimizer(optim)
    if inner is None:
        return None
    groups = osd[keys[0]]["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(inner.param_groups):
        return None
    return keys[0], inner


def _unwrap_state_dict(
    index: Any, optim: _Optimizer, osd: dict[str, Any], key: Any, inner: _Optimizer
) -> tuple[dict[str, Any], _Optimizer, list[dict[str, Any]] | None]:
    """A wrapper's ``state_dict()`` (see _wrapper_layout) as the inner
    optimizer's, keyed by FQN like any other, with the wrapper's own
    entries as extra top-level keys (handed back to the wrapper's
    ``load_state_dict`` beside the inner dict on load).  While some
    parameter has no state in the inner optimizer (never stepped), the
    wrapper's own entries are completed with what a first step creates
    (a shadow step, shadow.fallback_wrapper_entries; where it raises,
    upstream's step undone; else IncompleteTemplateError); entries it
    already holds are kept as they are; with them, the group keys that step adds
    (None when nothing is missing)."""
    own = {k: v for k, v in osd.items() if k != key}
    group_keys = None
    if C.optim_missing(index, inner):
        try:
            first, group_keys = fallback_wrapper_entries(optim, key)
        except Exception as shadow_exc:  # noqa: BLE001 - upstream's method, then raised
            shadow_exc.__traceback__ = None  # its frames hold the shadow's copies
            try:
                first, group_keys = upstream_wrapper_entries(optim, key)
            except Exception as exc:  # noqa: BLE001 - raised as the template error
                raise template_error(optim, "own state_dict() entries", shadow_exc, exc) from exc
        own = {k: filled(v, first.get(k)) for k, v in own.items()}
    return {**osd[key], **own}, inner, group_keys


def _own_entries_completed(index: Any, optim: _Optimizer, osd: dict[str, Any]) -> dict[str, Any]:
    """``osd`` (the optimizer's own ``state_dict()``, FQN-keyed) with the
    dicts among its own top-level entries completed, while some parameter
    has no state, with the keys a first step creates in them, marked
    (``wide.with_step_created``: heavyball's ``inner_group``, which dcp.load
    would otherwise leave empty).  ``osd`` itself where no entry is a dict,
    every parameter holds state, or the shadow step raises (the entries
    are returned as they are held, as before)."""
    own = [k for k, v in osd.items() if k not in TORCH_LAYOUT and isinstance(v, dict)]
    if not own or not C.optim_missing(index, optim):
        return osd
    try:
        first = fallback_own_entries(optim)
    except Exception as exc:  # noqa: BLE001 - the entries as held
        exc.__traceback__ = None  # its frames hold the shadow's copies
        return osd
    return {**osd, **{k: with_step_created(osd[k], first.get(k)) for k in own}}


def _check_own_state_dict(optim: _Optimizer, osd: Any) -> None:
    """An optimizer's own ``state_dict()`` must have torch's layout to be
    keyed by FQN (wrappers such as Lookahead return another layout;
    upstream raises ``KeyError: 'state'`` on them)."""
    if has_torch_layout(osd):
        return
    got = sorted(map(repr, osd)) if isinstance(osd, dict) else type(osd).__name__
    raise errors.StateDictKeyError(
        f"{type(optim).__qualname__}.state_dict() returned {got}, not torch's "
        "{'state': ..., 'param_groups': ...} layout, so its state cannot be keyed "
        "by parameter FQN; save and load this optimizer with its own "
        "state_dict()/load_state_dict()"
    )


def _loaded_extras(osd: Any, flat: bool, own: bool = True) -> dict[str, Any]:
    """The entries of a loaded dict that are not parameters' state or
    groups: the optimizer-wide entries (D29: ".optimizer_<o>" in "state",
    or flattened "state..optimizer_<o>.<name>"), and with ``own`` the
    top-level entries that belong to neither format's state or groups
    (see wide.collect_extras).  They travel with the source's metadata on
    broadcast loads."""
    if not isinstance(osd, dict):
        return {}
    if flat or "state" not in osd:
        return {
            k: v for k, v in osd.items()
            if isinstance(k, str) and k.startswith("state..")
            or own and not (isinstance(k, str) and k.startswith(("state.", "param_groups.")))
        }
    out = {k: v for k, v in osd.items() if k not in TORCH_LAYOUT} if own else {}
    state = osd.get("state")
    if isinstance(state, dict):
        out.update((k, v) for k, v in state.items() if isinstance(k, str) and k[:1] == ".")
    return out


def _without_extras(osd: dict[str, Any], extras: dict[str, Any]) -> dict[str, Any]:
    """``osd`` without the entries _loaded_extras took (a new dict; the
    caller's is never changed)."""
    out = {k: v for k, v in osd.items() if k not in extras}
    state = out.get("state")
    if isinstance(state, dict) and any(wide_index(k) is not None for k in extras):
        out["state"] = {k: v for k, v in state.items() if not (k in extras and wide_index(k) is not None)}
    return out


def _take_wide(
    extras: dict[str, Any], optimizers: tuple[_Optimizer, ...]
) -> tuple[dict[int, dict[str, Any]], dict[str, Any], list[str]]:
    """(optimizer-wide entries per optimizer position, the other extras,
    keys of optimizer-wide entries for no optimizer of this call).
    Flattened entries "state..optimizer_<o>.<path>" nest at the dots of
    their path, as parameters' state does, except where the path is a
    name the optimizer holds (a dotted name stays whole)."""
    wide: dict[int, dict[str, Any]] = {}
    rest: dict[str, Any] = {}
    unexpected: list[str] = []
    for key, value in extras.items():
        o = wide_index(key)
        if o is not None:  # nested: the optimizer's whole dict
            if o >= len(optimizers) or not isinstance(value, dict):
                unexpected.append(key)
            else:
                wide.setdefault(o, {}).update(value)
            continue
        if not (isinstance(key, str) and key.startswith("state..")):
            rest[key] = value
            continue
        head, _, path = key[len("state."):].partition(".optimizer_")[2].partition(".")
        o = int(head) if head.isdigit() and str(int(head)) == head else None
        if o is None or o >= len(optimizers) or not path:
            unexpected.append(key)
            continue
        names = wide.setdefault(o, {})
        held = optimizers[o].state
        if path in held or "." not in path:
            names[path] = value
            continue
        insert_path(names, path, value, key, "optimizer-wide value")
    return wide, rest, unexpected


def _live_wide(optim: _Optimizer) -> list[str]:
    """The names of the optimizer-wide entries ``optim`` holds."""
    state = getattr(optim, "state", None)
    if not isinstance(state, dict):
        return []
    try:
        return [k for k in state if isinstance(k, str)]
    except RuntimeError:  # changed while iterating
        return []


def init_optim_state(optim: _Optimizer) -> None:
    """Upstream's ``_init_optim_state`` made safe (D4 in docs/differences.md): fill
    ``optim.state`` with pristine state for trainable parameters lacking
    it.  No ``step()``, no hooks, no gradients.  A ZeroRedundancyOptimizer
    keeps its state in its inner optimizer, this rank's partition (D36):
    filled there."""
    if zero.is_zero(optim):
        zero.check_supported(optim, 0)
        optim = zero.inner(optim)
    params = [p for g in optim.param_groups for p in g["params"]]
    model = nn.Module()
    model._parameters.update({str(i): p for i, p in enumerate(params)})
    index = C.walk_model(context(), model, "_fqn_modifiers")
    pristine = pristine_states(index, optim)
    if not pristine:
        return
    by_fqn = {str(i): p for i, p in enumerate(params)}
    for fqn, st in pristine.items():
        optim.state[by_fqn[fqn]].update(st)


# --- set -----------------------------------------------------------------------


def _is_native_format(osd: dict[str, Any]) -> bool:
    """An ``Optimizer.state_dict()`` keyed by integer IDs (upstream passes
    such a dict through unchanged)."""
    state = osd.get("state")
    if not isinstance(state, dict):
        return False
    if state:
        return all(isinstance(k, int) for k in state)
    groups = osd.get("param_groups") or []
    params = [p for g in groups if isinstance(g, dict) for p in g.get("params", [])]
    return bool(params) and all(isinstance(p, int) for p in params)


def _expect_state(optim: _Optimizer, groups: list[dict[str, Any]] | None = None) -> list[bool] | None:
    """Per group, whether its parameters keep state, from the schema
    applied to ``groups`` (the groups as the load installs them: the
    checkpoint's values win, as in ``Optimizer.load_state_dict``; default:
    the live ones).  None without a schema."""
    schema = schema_for(optim)
    if schema is None:
        return None
    return [bool(schema(optim, g)) for g in (optim.param_groups if groups is None else groups)]


def _param_shaped(optim: _Optimizer, groups: list[dict[str, Any]]) -> list[dict[str, int] | None] | None:
    """Per group, what a loaded entry must hold (from the schema applied to
    the groups as loaded, ``groups``): state name -> 1 (required), 2
    (required, a floating tensor shaped like the parameter) or 3 (required,
    created on the parameter's device: where a loaded ``step`` goes when
    the group is neither capturable nor fused, as ASGD's).  None without a
    schema."""
    schema = schema_for(optim)
    if schema is None:
        return None
    out: list[dict[str, int] | None] = []
    for group in groups:
        specs = schema(optim, group) or []
        # what lives on the parameter's device whatever the flags
        flagless = schema(optim, {**group, "capturable": False, "fused": False}) or []
        on_device = {s.name for s in flagless if (s.kwargs or {}).get("device") is PARAM_DEVICE}
        names = {}
        for s in specs:
            if s.dims is not None:
                continue  # present for some shapes only
            shaped = s.factory in (torch.zeros_like, torch.full_like) and s.args[:1] == (PARAM,)
            names[s.name] = 2 if shaped else 3 if s.name in on_device else 1
        out.append(names or None)
    return out


def _cast_integer_state(
    optim: _Optimizer, split: dict[str, Any], expected: list[dict[str, int] | None] | None
) -> None:
    """Integer (or bool) tensors loaded for state the schema wants
    floating and shaped like a floating parameter (an int64 ``exp_avg``)
    take the parameter's dtype, as ``Optimizer.load_state_dict`` and
    upstream cast them (D28 in docs/differences.md).  The split's entries
    are replaced, never the caller's dicts changed."""
    if not expected:
        return
    state = split["state"]
    for names, saved, live in zip(expected, split["param_groups"], optim.param_groups):
        shaped = [n for n, need in (names or {}).items() if need == 2]
        if not shaped:
            continue
        for fqn, param in zip(saved["params"], live["params"]):
            entry = state.get(fqn)
            if not isinstance(entry, dict) or not isinstance(param, torch.Tensor):
                continue
            if not (param.is_floating_point() or param.is_complex()):
                continue
            cast = {
                n: entry[n].to(param.dtype)
                for n in shaped
                if isinstance(entry.get(n), torch.Tensor)
                and not (entry[n].is_floating_point() or entry[n].is_complex())
            }
            if cast:
                state[fqn] = {**entry, **cast}


def _drop_sgd_placeholders(optim: _Optimizer, split: dict[str, Any]) -> None:
    """SGD with dampening: an all-negative-zero momentum buffer is the
    pristine placeholder of schema._sgd -- "no buffer yet" (first-step
    semantics), so it is not installed."""
    if not isinstance(optim, torch.optim.SGD):
        return
    state = split["state"]
    for group in split["param_groups"]:
        if not group.get("momentum") or not group.get("dampening"):
            continue
        for fqn in group["params"]:
            entry = state.get(fqn)
            buf = entry.get("momentum_buffer") if isinstance(entry, dict) else None
            if (
                isinstance(buf, torch.Tensor)
                and buf.numel() > 0
                and bool((buf == 0).all())
                and bool(torch.signbit(buf).all())
            ):
                entry = dict(entry)
                del entry["momentum_buffer"]
                state[fqn] = entry


def _view(index: Any, osd: dict[str, Any], optimizers: tuple[_Optimizer, ...] = ()) -> tuple:
    if "state" in osd:
        return C.view_from_nested(osd)
    optimizers = _load_targets(optimizers)
    # Dotted state names are read whole (upstream's unflattening looks the
    # names up whole): the names the live optimizers hold or their schemas
    # declare; where the view still nests a name (or cannot: "exp_avg" and
    # "exp_avg.sq" side by side), the names of the optimizers' templates
    # too -- a never-stepped optimizer has no live names (rule 6 of
    # docs/differences.md#d28).
    whole = _whole_state_names(index, osd, optimizers)
    view: tuple | None = None
    try:
        view = _flat_view(index, osd, whole)
    except ValueError:
        if not optimizers:
            raise
    # (optimizers with a schema: their names are all in `whole` already)
    # (and where the view nests: the paths of state dicts keyed by non-str
    # keys, AggMo's, from the live state or the template, _odd_paths)
    if view is None or _nests(view[0]):
        more = _whole_state_names(index, osd, optimizers, template=True)
        if set(more) - set(whole):
            view = _flat_view(index, osd, {**whole, **more})
    if view is None:
        view = _flat_view(index, osd, whole)  # raises as before
    if C.first_key_containing(osd, "." + _LIST_LEN) is not None:
        state = view[0]
        for fqn, entry in list(state.items()):
            if isinstance(entry, dict) and any(isinstance(v, dict) for v in entry.values()):
                state[fqn] = {k: _decode_lists(v) for k, v in entry.items()}
    _restore_group_keys(view, optimizers)
    return view


# Lists in the flattened format (D29: LBFGS's history): a list value ``v``
# of a state path ``p`` is spelled "p.[i]" for each element that is not
# None and "p.[]" for its length (so an empty list, and None elements,
# survive); upstream's flattening raises NotImplementedError on lists.
_LIST_LEN = "[]"


def _encode_lists(osd: dict[str, Any]) -> dict[str, Any]:
    """``osd`` (nested, FQN-keyed) with every list inside a state entry
    replaced by its spelling as a dict ({"[i]": element, "[]": length});
    ``osd`` itself when it holds no list."""
    def enc(value: Any) -> Any:
        if isinstance(value, list):
            # None elements (LBFGS's scratch list "al") are left out
            out = {f"[{i}]": enc(v) for i, v in enumerate(value) if v is not None}
            out[_LIST_LEN] = len(value)
            return out
        if isinstance(value, dict):
            new = {k: enc(v) for k, v in value.items()}
            return value if all(new[k] is value[k] for k in value) else new
        return value

    state = osd.get("state")
    if not isinstance(state, dict):
        return osd
    new_state = {k: enc(v) for k, v in state.items()}
    if all(new_state[k] is state[k] for k in state):
        return osd
    return {**osd, "state": new_state}


def _decode_lists(value: Any) -> Any:
    """The inverse of _encode_lists' spelling, at any depth of dicts."""
    if not isinstance(value, dict):
        return value
    n = value.get(_LIST_LEN)
    if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
        spelled = {f"[{i}]" for i in range(n)}
        if all(k == _LIST_LEN or k in spelled for k in value):
            return [_decode_lists(value.get(f"[{i}]")) for i in range(n)]
    return {k: _decode_lists(v) for k, v in value.items()}


def _flat_view(index: Any, osd: dict[str, Any], whole: dict[str, tuple[str, Any]]) -> tuple:
    if not whole:
        return C.unflatten_optim(index, osd)
    view = C.unflatten_optim(index, {k: v for k, v in osd.items() if k not in whole})
    for key, (fqn, name) in whole.items():
        entry = view[0].setdefault(fqn, {})
        if isinstance(name, tuple):
            # a path into a state dict keyed by non-str or dotted keys
            # (AggMo's {0.9: buffer}): the template's own keys
            for k in name[:-1]:
                entry = entry.setdefault(k, {})
            entry[name[-1]] = osd[key]
        else:
            entry[name] = osd[key]
    return view


def _odd_paths(name: Any, value: Any) -> list[tuple[Any, ...]]:
    """The leaf paths (name, k1, ..., kn) of a state value that is a dict
    with a key that is not a str or holds a dot, at any depth (AggMo's
    momentum buffers keyed by their beta), or of one whose own name is not
    a str (heavyball's state per view index, ``{0: {...}}``): splitting
    their flattened keys at the dots cannot give those keys back; [] for
    any other value.  Inside such a value a list is walked as the
    flattened format spells it (``_encode_lists``: "[i]" per element, "[]"
    for its length), so its elements are read back under those keys and
    decoded with the rest."""
    odd = not isinstance(name, str)
    if not isinstance(value, dict) or not value:
        return [(name,)] if odd else []
    paths: list[tuple[Any, ...]] = []

    def walk(node: dict[Any, Any] | list[Any], path: tuple[Any, ...]) -> None:
        nonlocal odd
        if isinstance(node, list):
            paths.append((*path, _LIST_LEN))
            items: Any = ((f"[{i}]", v) for i, v in enumerate(node) if v is not None)
        else:
            items = node.items()
        for k, v in items:
            if not isinstance(k, str) or "." in k:
                odd = True
            if (isinstance(v, dict) and v) or isinstance(v, list):
                walk(v, (*path, k))
            else:
                paths.append((*path, k))

    walk(value, (name,))
    return paths if odd else []


def _nests(state: dict[str, Any]) -> bool:
    """Whether some parameter's loaded state holds a dict (a name the
    flattened keys nested at a dot)."""
    return any(
        isinstance(entry, dict) and any(isinstance(v, dict) for v in entry.values())
        for entry in state.values()
    )


def _restore_group_keys(view: tuple, optimizers: tuple[_Optimizer, ...]) -> None:
    """A flattened key "param_groups.<fqn>.<k>" names a group key by its
    str(); upstream's unflattening reads it back under the live group's
    own key (``3``, not ``"3"``).  The non-str keys of the live groups are
    put back the same way in the view's groups (built here, never the
    caller's); a str that two live keys share is left as it is."""
    keys: dict[str, Any] = {}
    for optim in optimizers:
        for group in getattr(optim, "param_groups", ()):
            for k in group:
                if not isinstance(k, str):
                    s = str(k)
                    keys[s] = k if keys.get(s, k) == k else _AMBIGUOUS
    keys = {s: k for s, k in keys.items() if k is not _AMBIGUOUS}
    if not keys:
        return
    groups = [g for g in view[1] if isinstance(g, dict)]
    groups += [g for g in view[3] if isinstance(g, dict)]
    groups += [x for e in view[3] if isinstance(e, tuple) for x in e if isinstance(x, dict)]
    for group in groups:
        for s, k in keys.items():
            if s in group and k not in group:
                group[k] = group.pop(s)


_AMBIGUOUS = object()


def _whole_state_names(
    index: Any, flat: dict[str, Any], optimizers: tuple[_Optimizer, ...], template: bool = False
) -> dict[str, tuple[str, str]]:
    """Flat state keys to read whole, not split at the dots of their state
    path, as upstream's unflattening does: {key: (fqn, name)} for every
    dotted state name the live optimizers hold or their schemas declare
    (``template``: the names of their templates, see _template_names)
    whose whole key "state.<fqn>.<name>" is in ``flat``
    (docs/architecture.md, Flat keys)."""
    out: dict[str, tuple[str, Any]] = {}

    def add(param: Any, dotted: list[Any]) -> None:
        slot = index.slot_of(param) if dotted else None
        if slot is None:
            return
        for fqn in index.tensor_fqns[slot]:
            for name in dotted:
                spelled = ".".join(str(k) for k in name) if isinstance(name, tuple) else name
                key = f"state.{fqn}.{spelled}"
                if key in flat:
                    out[key] = (fqn, name)

    for optim in optimizers:
        if template:
            for param, names in _template_names(index, optim).items():
                add(param, [k for k in names if isinstance(k, tuple) or (isinstance(k, str) and "." in k)])
            for param, live in optim.state.items():
                if isinstance(live, dict):
                    add(param, [p for k, v in live.items() for p in _odd_paths(k, v)])
            continue
        schema = schema_for(optim)
        if schema is not None:
            for group in optim.param_groups:
                dotted = [s.name for s in schema(optim, group) or () if "." in s.name]
                if dotted:
                    for param in group["params"]:
                        add(param, dotted)
        for param, live in optim.state.items():
            if not isinstance(live, dict):
                continue
            try:  # one join per parameter: this runs on every flat load
                if "." not in "".join(live):
                    continue
            except TypeError:  # a key that is not a str
                pass
            add(param, [k for k in live if isinstance(k, str) and "." in k])
    return out


def _template_names(index: Any, optim: _Optimizer) -> dict[Any, list[Any]]:
    """{param: state names} of the template of ``optim``'s trainable
    parameters without state: from the schema, or else one shadow step
    (schema.fallback_pristine); {} where that step cannot run."""
    try:
        missing = C.optim_missing(index, optim)
    except Exception:  # noqa: BLE001 - not an optimizer the index knows
        return {}
    if not missing:
        return {}
    schema = schema_for(optim)
    if schema is not None:
        groups = optim.param_groups
        return {p: [s.name for s in schema(optim, groups[g]) or ()] for p, g, _ in missing}
    try:
        states, _ = fallback_pristine(optim, [p for p, _, _ in missing])
    except Warning:
        raise  # warnings turned into errors by the caller (see _templates)
    except Exception:  # noqa: BLE001 - no template: nothing to go by
        return {}
    out: dict[Any, list[Any]] = {}
    for p, _, _ in missing:
        names: list[Any] = []
        for name, value in (states.get(id(p)) or {}).items():
            # a dict keyed by non-str keys: its leaf paths (_odd_paths)
            odd: list[Any] = _odd_paths(name, value)
            names.extend(odd or [name])
        out[p] = names
    return out


@torch.no_grad()
def load_optim(
    model: nn.Module,
    optimizers: tuple[_Optimizer, ...],
    osd: dict[str, Any],
    info: Any,
) -> _IncompatibleKeys | None:
    commit, report = prepare_optim(model, optimizers, osd, info)
    commit()
    return report


def _nothing() -> None:
    return None


# The state of the last template built for a schema-less optimizer (its
# getter's shadow step), by FQN: {name: dtype of a tensor, else None}.  The
# load that follows the template flow's get -> dcp.load checks against the
# names, and casts to the dtypes, without a second shadow step.  No
# tensor is kept; gone with the optimizer.
_TEMPLATE_ENTRIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Beside it, by FQN: the names of the states that are DTensors (what the
# optimizer keeps sharded at this layout; see _check_placed).
_TEMPLATE_PLACED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# And the paths (tuples of keys, nested entries included) of the tensors
# with a dimension that are not DTensors (what it keeps whole beside a
# DTensor parameter; see kept_plain).
_TEMPLATE_PLAIN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _first_step_entry(entry: dict[Any, Any]) -> dict[Any, torch.dtype | None]:
    """A first step's state entry as names and the dtypes of its tensors."""
    return {name: value.dtype if isinstance(value, torch.Tensor) else None for name, value in entry.items()}


def _placed_names(entry: dict[Any, Any]) -> frozenset[Any]:
    """The names of a first step's states that are DTensors."""
    return frozenset(name for name, value in entry.items() if isinstance(value, DTensor))


def _plain_paths(value: Any, path: tuple = ()) -> Iterator[tuple]:
    """The paths, in ``value``'s nested dicts, of its tensors with a
    dimension that are not DTensors."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _plain_paths(v, (*path, k))
    elif isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() > 0:
        yield path


def _remember_template(optim: _Optimizer, pristine_states: dict[str, Any] | None) -> None:
    if not pristine_states:
        return
    try:
        known = _TEMPLATE_ENTRIES.setdefault(optim, {})
        placed = _TEMPLATE_PLACED.setdefault(optim, {})
        plain = _TEMPLATE_PLAIN.setdefault(optim, {})
    except TypeError:  # not weakly referenceable
        return
    for fqn, entry in pristine_states.items():
        if isinstance(entry, dict):
            known[fqn] = _first_step_entry(entry)
            placed[fqn] = _placed_names(entry)
            plain[fqn] = frozenset(_plain_paths(entry))


def kept_plain(index: Any, optimizers: tuple[_Optimizer, ...]) -> dict[str, tuple[frozenset[tuple], tuple, Any]]:
    """Per FQN of a DTensor parameter, the paths of the state tensors its
    optimizer keeps as plain (whole) tensors, the parameter's global
    shape and its local device: heavyball computes on each
    parameter's full tensor and keeps its state whole on every rank.  A
    sharded or full load leaves a plain tensor given there as it is,
    instead of making it this rank's shard of the parameter (D9: the state
    keeps the live placement), which the next step would mix with the
    whole ones.  Read from the state the optimizer holds, else from the
    getter's template of it (its first step at this layout), else from
    one shadow step (kept as that template: the load's checks reuse it);
    where that step cannot run, nothing is kept (D9's sharding, as
    before).  Empty for optimizers with a schema (theirs are shaped like
    the parameter)."""
    out: dict[str, tuple[frozenset[tuple], tuple, Any]] = {}
    targets = _load_targets(tuple(optim if w is None else w[1] for optim, w in
                                  ((o, _live_wrapper_layout(o)) for o in optimizers)))
    fqn_of: dict[int, str] | None = None
    for optim in targets:
        if schema_for(optim) is not None:
            continue
        try:
            template = _TEMPLATE_PLAIN.get(optim) or {}
        except TypeError:
            template = {}
        shadowed = False
        for group in optim.param_groups:
            for param in group["params"]:
                if not isinstance(param, DTensor):
                    continue
                if fqn_of is None:
                    fqn_of = {id(t): fqns[0] for t, fqns in zip(index.tensors, index.tensor_fqns) if fqns}
                fqn = fqn_of.get(id(param))
                if fqn is None:
                    continue
                held = optim.state.get(param)
                if not held and fqn not in template and not shadowed:
                    shadowed = True  # at most one shadow step per optimizer
                    template = _shadow_template(optim, fqn_of) or template
                paths = frozenset(_plain_paths(held)) if held else template.get(fqn, frozenset())
                if paths:
                    out[fqn] = (paths, tuple(param.shape), param.device)
    return out


def _shadow_template(optim: _Optimizer, fqn_of: dict[int, str]) -> dict[str, frozenset[tuple]] | None:
    """One shadow step of ``optim`` for its DTensor parameters without
    state (``fqn_of``: their FQNs by id), remembered as the getter's
    template would be; the plain paths by FQN, or None where the step
    cannot run."""
    params: list[torch.Tensor] = [
        p for g in optim.param_groups for p in g["params"]
        if isinstance(p, DTensor) and p.requires_grad and not optim.state.get(p) and id(p) in fqn_of
    ]
    try:
        states = fallback_pristine(optim, params)[0]
    except Warning:
        raise  # warnings turned into errors: raised before anything changes
    except Exception:  # noqa: BLE001 - cannot tell: D9's sharding
        return None
    _remember_template(optim, {fqn_of[id(p)]: states[id(p)] for p in params if isinstance(states.get(id(p)), dict)})
    try:
        return _TEMPLATE_PLAIN.get(optim)
    except TypeError:  # not weakly referenceable: nothing remembered
        return None


def _templates(
    optimizers: tuple[_Optimizer, ...], splits: list[dict[str, Any]], missing: list[str], strict: bool
) -> tuple[list[dict[str, list[Any] | None] | None], list[dict[int, dict[Any, torch.Tensor]] | None],
           list[dict[str, frozenset[Any]]]]:
    """Per optimizer without a schema, what a first step gives the
    parameters that are ``missing``, or have a loaded entry and either
    hold no state yet or (``strict``) any: the template's state names
    of each, {fqn: names} -- those a first step gives it (the getter's
    template of this optimizer, or else one shadow step,
    schema.fallback_pristine) and those it holds ([] for a parameter a
    first step gives no state; where that step cannot run, the held
    names, or None: no check).  At most one shadow step per optimizer.
    Names None for optimizers with a schema (their entries are checked
    against it by prepare_install).  With them, per optimizer, the dtypes
    the load casts to (see _first_dtypes; a schema's: _schema_first_dtypes),
    and the names a first step gives as DTensors, {fqn: names}
    (_check_placed)."""
    todo = set(missing)
    out: list[dict[str, list[Any] | None] | None] = []
    dtypes: list[dict[int, dict[Any, torch.Tensor]] | None] = []
    placed_out: list[dict[str, frozenset[Any]]] = []
    for optim, split in zip(optimizers, splits):
        if schema_for(optim) is not None:
            out.append(None)
            dtypes.append(_schema_first_dtypes(optim, split))
            placed_out.append({})
            continue
        state = split["state"]
        try:
            known = _TEMPLATE_ENTRIES.get(optim) or {}
            known_placed = _TEMPLATE_PLACED.get(optim) or {}
        except TypeError:
            known, known_placed = {}, {}
        placed: dict[str, frozenset[Any]] = {}
        first: dict[str, dict[Any, torch.dtype | None] | None] = {}
        shadow: list[tuple[str, Any]] = []
        pairs: list[tuple[str, Any]] = []
        for saved, live in zip(split["param_groups"], optim.param_groups):
            for fqn, param in zip(saved["params"], live["params"]):
                loaded = isinstance(state.get(fqn), dict)
                if fqn not in todo and not (loaded and (strict or not optim.state.get(param))):
                    continue
                pairs.append((fqn, param))
                if fqn in known:
                    first[fqn] = known[fqn]
                    placed[fqn] = known_placed.get(fqn, frozenset())
                else:
                    shadow.append((fqn, param))
        if shadow:
            try:
                states: dict[int, dict[str, Any]] | None = fallback_pristine(optim, [p for _, p in shadow])[0]
            except Warning:
                # the caller turned warnings into errors (the shadow step's
                # "no state schema"): raised before anything changes, not
                # taken for "cannot tell", which would drop the checks
                raise
            except Exception:  # noqa: BLE001 - cannot tell: torch's rule, no check
                states = None
            for fqn, param in shadow:
                first[fqn] = None if states is None else _first_step_entry(states.get(id(param)) or {})
                if states is not None:
                    placed[fqn] = _placed_names(states.get(id(param)) or {})
        names: dict[str, list[Any] | None] = {}
        for fqn, param in pairs:
            # what a step creates, with what the parameter holds (SPAM's
            # masks, made by its constructor): held state alone is no
            # template -- the first step adds the moments
            held = optim.state.get(param)
            held_names = list(held) if isinstance(held, dict) else []
            step_entry = first[fqn]
            if step_entry is None:
                names[fqn] = held_names or None
            else:
                names[fqn] = list(step_entry) + [n for n in held_names if n not in step_entry]
        out.append(names)
        dtypes.append(_first_dtypes(optim, pairs, first))
        placed_out.append(placed)
    return out, dtypes, placed_out


def _first_dtypes(
    optim: _Optimizer, pairs: list[tuple[str, Any]], first: dict[str, dict[Any, torch.dtype | None] | None]
) -> dict[int, dict[Any, torch.Tensor]] | None:
    """For prepare_install's cast (D35 in docs/differences.md): per
    floating parameter of ``pairs`` that holds no state yet, {id(param):
    {name: a tensor of the dtype}} for each floating tensor its first step
    gives it (``first[fqn]``: name -> dtype) in a dtype other than the
    parameter's -- SkipStepAdamW(dtype=bf16)'s moments of fp32
    parameters, NAdam's float32 ``mu_product`` of bf16 ones.  The loaded
    state takes that dtype, as it takes a held state's: torch's rule, the
    parameter's dtype, would change the precision the optimizer keeps, and
    the resumed run would differ from the uninterrupted one.  None where
    there is none (the usual case: nothing for the cast to look up)."""
    out: dict[int, dict[Any, torch.Tensor]] = {}
    for fqn, param in pairs:
        step_entry = first.get(fqn)
        if not step_entry or optim.state.get(param) or not param.is_floating_point():
            continue
        own = {
            name: _dtype_stand_in(dtype)
            for name, dtype in step_entry.items()
            if dtype is not None and dtype != param.dtype and dtype.is_floating_point and name != "step"
        }
        if own:
            out[id(param)] = own
    return out or None


@functools.cache
def _dtype_stand_in(dtype: torch.dtype) -> torch.Tensor:
    """An empty meta tensor of ``dtype``: what the cast reads a dtype from."""
    return torch.empty(0, dtype=dtype, device="meta")


def _schema_first_dtypes(optim: _Optimizer, split: dict[str, Any]) -> dict[int, dict[Any, torch.Tensor]] | None:
    """``_first_dtypes`` of an optimizer with a schema: its specs'
    explicit dtypes, per group as loaded (NAdam's and ASGD's float32
    scalars); the state shaped like the parameter takes its dtype."""
    pairs: list[tuple[str, Any]] = []
    first: dict[str, dict[Any, torch.dtype | None] | None] = {}
    schema = schema_for(optim)
    assert schema is not None  # _templates' condition
    for saved, live in zip(split["param_groups"], optim.param_groups):
        explicit = {
            s.name: s.kwargs["dtype"]
            for s in schema(optim, saved) or []
            if s.name != "step" and s.kwargs and isinstance(s.kwargs.get("dtype"), torch.dtype)
        }
        if not explicit:
            continue
        for fqn, param in zip(saved["params"], live["params"]):
            pairs.append((fqn, param))
            first[fqn] = explicit
    return _first_dtypes(optim, pairs, first) if pairs else None


def _drop_stateless(missing: list[str], templates: list[dict[str, list[Any] | None] | None]) -> list[str]:
    """``missing`` without the parameters of schema-less optimizers that a
    first step gives no state (LoRA-RITE keeps none for 1-D parameters):
    nothing of theirs can be missing from a checkpoint.  Where the shadow
    step cannot run (see shadow.fallback_pristine), none of that
    optimizer's parameters count as missing: torch's rule, which checks
    nothing."""
    drop = {fqn for t in templates if t for fqn, names in t.items() if not names}
    return [fqn for fqn in missing if fqn not in drop] if drop else missing


def _holds_name(entry: dict[Any, Any], name: Any) -> bool:
    """Whether a loaded entry holds state ``name``: as a key, or as a key
    of a dict the entry nests (an optimizer whose own ``state_dict``
    groups state under one key -- bitsandbytes' 8-bit optimizers keep
    their quantization state under ``__bnb_optimizer_quant_state__``, and
    their ``load_state_dict`` unpacks it)."""
    if name in entry:
        return True
    return any(isinstance(value, dict) and name in value for value in entry.values())


def _check_entries(
    optimizers: tuple[_Optimizer, ...],
    splits: list[dict[str, Any]],
    templates: list[dict[str, list[Any] | None] | None],
) -> None:
    """``strict=True``: a loaded entry must hold every state name of the
    template (D28 in docs/differences.md).  A partial entry would install
    and report success, and the next step would recreate the rest from
    zeros: a silent restart of that state.  Schema-less optimizers: the
    template's names (see _templates); optimizers with a schema: an
    empty entry (prepare_install checks the others against the schema).
    Raises before anything is installed."""
    for optim, split, template in zip(optimizers, splits, templates):
        state = split["state"]
        shaped = _param_shaped(optim, split["param_groups"]) if template is None else None
        for g, saved in enumerate(split["param_groups"]):
            for fqn in saved["params"]:
                entry = state.get(fqn)
                if not isinstance(entry, dict):
                    continue
                if template is not None:
                    need = template.get(fqn) or []
                elif entry or not shaped or g >= len(shaped):
                    continue
                else:
                    need = list(shaped[g] or ())
                lacking = [n for n in need if not _holds_name(entry, n)]
                if lacking:
                    raise errors.MissingOptimizerStateError(
                        f"optimizer state of parameter '{fqn}' lacks {lacking} that "
                        f"{type(optim).__qualname__} holds after a step (the loaded entry has "
                        f"{list(entry)}): loading it would restart that state from scratch. "
                        "Nothing was loaded. To load anyway, use StateDictOptions(strict=False).",
                        [fqn],
                    )


def _check_placed(optimizers: tuple[_Optimizer, ...], splits: list[dict[str, Any]],
                  placed: list[dict[str, frozenset[Any]]]) -> None:
    """A full load (every rank given full tensors) turns the state tensors
    shaped like their DTensor parameter into its shards; any other tensor
    stays as it comes, a plain tensor.  Where the optimizer keeps that
    state as a DTensor at this layout (its first step's, ``placed``: a
    per-row norm of shape (rows, 1), a state kept flat), a plain tensor
    fails its next step (``got mixed torch.Tensor and DTensor``) or
    trains on other numbers: ``StateDictValueError`` before anything
    changes.  Through DCP the template, holding that DTensor, takes it."""
    from .distribute import TensorMeta

    for optim, split, names_of in zip(optimizers, splits, placed):
        for fqn, names in names_of.items():
            entry = split["state"].get(fqn)
            if not names or not isinstance(entry, dict):
                continue
            for name in names:
                value = entry.get(name)
                if isinstance(value, DTensor) or not isinstance(value, torch.Tensor | TensorMeta):
                    continue
                if len(value.shape) == 0:
                    continue
                raise errors.StateDictValueError(
                    f"optimizer state {name!r} of parameter '{fqn}' is a full tensor of shape "
                    f"{tuple(value.shape)}, not shaped like the parameter, where "
                    f"{type(optim).__qualname__} keeps a DTensor at this layout: a full load cannot "
                    "tell how to shard it, and a plain tensor would fail the next step or train on "
                    "other numbers. Nothing was loaded. Load this optimizer through DCP with a "
                    "sharded state dict (its template holds the DTensor)."
                )


def _refuse_group_conflicts(conflicts: list[tuple], optimizers: tuple[_Optimizer, ...],
                            splits: list[dict[str, Any]], view: tuple) -> None:
    """Raises ``ParamGroupConflictError`` where a live param group holds
    parameters that the loaded dict puts in groups with different values
    of one key (``C.split_optim``'s conflicts, those not plainly equal):
    the checkpoint was saved with another grouping (two groups merged into
    one, one group split across two, an FSDP1 flat parameter over
    parameters of several groups).  One live group cannot hold both values;
    upstream's load keeps the last group's (or raises ``KeyError`` when a
    group lacks a key), so some parameters would go on training with
    another group's learning rate or weight decay, silently.  Torch's own
    ``load_state_dict`` refuses any other grouping."""
    fqn_group, loaded = view[2], view[1]
    for conflict in conflicts:
        if conflict[0] == "ungrouped":
            o, g, fqn = conflict[1:]
            fqns = splits[o]["param_groups"][g]["params"]
            grouped = next((f for f in fqns if f in fqn_group), "?")
            raise errors.ParamGroupConflictError(
                f"optimizer {o} ({type(optimizers[o]).__qualname__}), param group {g}: the loaded dict "
                f"holds state for '{fqn}' but lists it in no param group, while '{grouped}' in the same "
                f"live group takes its loaded group's values: the values '{fqn}' was trained with are "
                "unknown. A "
                "template built by an optimizer with other param groups reads a checkpoint's groups "
                "by position (DCP's nested format), keeping only as many as it has. Nothing was "
                "loaded. Build the optimizer with the checkpoint's param groups, or save and load "
                "with flatten_optimizer_state_dict=True, whose groups are keyed by FQN.",
                o, g, None, [fqn, grouped],
            )
        o, g, key, held, value, gi = conflict[1:]
        if same_value(held, value):
            continue
        fqns = splits[o]["param_groups"][g]["params"]
        theirs = next((f for f in fqns if fqn_group.get(f) == gi), "?")
        ours = next((f for f in fqns if fqn_group.get(f) not in (None, gi)
                     and key in loaded[fqn_group[f]] and same_value(loaded[fqn_group[f]][key], held)), "?")
        raise errors.ParamGroupConflictError(
            f"optimizer {o} ({type(optimizers[o]).__qualname__}), param group {g}: its parameters "
            f"come from loaded param groups with different {key!r} ({held!r} for '{ours}', "
            f"{value!r} for '{theirs}'): the checkpoint was saved with another grouping of the "
            "parameters, and one group cannot hold both values (a load keeping either would "
            "train some parameters with another group's hyperparameters). Nothing was loaded. "
            "Build the optimizer with the checkpoint's param groups, or make the loaded groups' "
            f"{key!r} agree before loading.",
            o, g, key, [ours, theirs],
        )


def _prepare_view(optimizers: tuple[_Optimizer, ...], view: tuple, info: Any, extras: dict[str, Any] | None = None):
    """Validate a loaded view against every optimizer and build what
    commit installs: (prepared, missing, unexpected).  Raises on bad input;
    installs nothing.  ``extras``: top-level entries of the loaded dict
    for the optimizers' own ``load_state_dict`` (see wide.collect_extras)."""
    # wrappers (see _wrapper_layout): checked and split as their inner
    # optimizer, installed through their own load_state_dict
    wrapped = [_live_wrapper_layout(optim) for optim in optimizers]
    owners = optimizers
    optimizers = _load_targets(tuple(optim if w is None else w[1] for optim, w in zip(optimizers, wrapped)))
    expect = [_expect_state(optim) for optim in optimizers]
    # parameters the dict marks as saved without state (never_stepped):
    # none is installed, none is missing
    marked = _schema_less(optimizers) or any(w is not None for w in wrapped)
    never = marked_in_view(view) if marked else set()
    if never:
        view = ({k: v for k, v in view[0].items() if k not in never}, plain_groups(view[1]), *view[2:])
    splits, missing, unexpected, conflicts = C.split_optim(info.index, optimizers, view, expect)
    if conflicts:
        _refuse_group_conflicts(conflicts, optimizers, splits, view)
    # Which state is required follows the groups as loaded (the
    # checkpoint's hyperparameters win): Adam saved without amsgrad loads
    # into Adam(amsgrad=True).  Split again in the rare case it differs.
    loaded_expect = [
        _expect_state(optim, split["param_groups"]) for optim, split in zip(optimizers, splits)
    ]
    if loaded_expect != expect:
        splits, missing, unexpected, _ = C.split_optim(info.index, optimizers, view, loaded_expect)
    if never:
        missing = [fqn for fqn in missing if fqn not in never]
    # optimizers the dict gives as never stepped (every group): their
    # optimizer-wide entries a first step creates are left out below
    stepless: set[int] = set()
    if marked:
        for o, optim in enumerate(optimizers):
            splits[o], every = _without_first_step_keys(info.index, optim, splits[o], never)
            if every:
                stepless.add(o)
    if missing and any(zero.is_zero(owner) for owner in owners):
        missing = zero.without_other_partitions(info.index, owners, missing)
    templates, first_dtypes, placed = _templates(optimizers, splits, missing, bool(info.strict))
    if info.full_state_dict:
        _check_placed(optimizers, splits, placed)
    if missing:
        missing = _drop_stateless(missing, templates)
    wide, extras, wide_unexpected = _take_wide(extras or {}, optimizers)
    _only_live_wide(wide, stepless, optimizers)
    # entries a template marked as a first step's, still unfilled (a
    # never-stepped optimizer's own checkpoint): left out, as it had none
    extras = {k: without_step_created(v) for k, v in extras.items()}
    if wide_unexpected:
        unexpected = [*unexpected, *wide_unexpected]
    if info.strict:
        _check_entries(optimizers, splits, templates)
        _check_wide(optimizers, splits, wide)
    if missing and info.strict:
        message = errors.E18_MISSING_OPTIM_STATE.format(fqn=missing[0])
        if len(missing) > 1:
            message += f" ({len(missing)} parameters lack state: {missing})"
        raise errors.MissingOptimizerStateError(message, list(missing))
    ctx = context()
    # (True: native install | False: load_state_dict | _WRAPPER, payload)
    prepared: list[tuple[bool | str, Any]] = []
    for o, (owner, optim, split, w) in enumerate(zip(owners, optimizers, splits, wrapped)):
        if o in wide:  # torch's load_state_dict keeps the keys that are no parameter's
            split = {**split, "state": {**split["state"], **copy_containers(wide[o])}}
        _drop_sgd_placeholders(optim, split)
        expected = _param_shaped(optim, split["param_groups"])
        _cast_integer_state(optim, split, expected)
        _check_steps(split["state"])
        if optim is not owner and zero.is_zero(owner):
            # (D36) validated as its inner optimizer's class over its
            # groups; ZeRO's own load takes the dict keyed by index
            C.prepare_install(ctx, optim, split, expected)
            prepared.append((False, zero.index_keyed(split, extras)))
        elif w is None and _native_load(optim):
            # the optimizer's own state tensors (the DCP resume) keep
            # their identity without the cast, which a __torch_function__
            # mode could intercept: then always cast
            aliased = not torch._C._is_torch_function_mode_enabled()
            payload = C.prepare_install(ctx, optim, split, expected, aliased, first_dtypes[o])
            if o in wide:
                payload[0].update(copy_containers(wide[o]))
            prepared.append((True, payload))
        elif w is not None:
            # the wrapper's own layout: its entries beside the inner dict
            own = [k for k in w[2] if k in (extras or {})]
            if w[2] and not own:
                raise errors.StateDictKeyError(
                    f"the optimizer state dict has none of {type(owner).__qualname__}'s "
                    f"own state_dict() entries {w[2]} (its inner optimizer's state is "
                    "there): a dict from get_optimizer_state_dict of this wrapper carries "
                    "them as top-level keys; nothing was loaded"
                )
            full_entries = [k for k in own if plain_tensor_in((extras or {})[k])] if info.full_state_dict else []
            if full_entries and any(isinstance(p, DTensor) for g in optim.param_groups for p in g["params"]):
                # its own entries travel as they are, full: nothing would
                # shard the tensors it keeps beside DTensor parameters
                raise errors.StateDictValueError(
                    f"{type(owner).__qualname__}'s own state_dict() entries {full_entries} hold full tensors, and "
                    "its parameters are DTensors: a full load cannot shard the tensors of a wrapper's own "
                    "layout (the next step would mix them with DTensors). Nothing was loaded. Load it "
                    "through DCP with a sharded state dict (its template holds the shards)."
                )
            C.prepare_install(ctx, optim, split, expected)
            own_entries = extras or {}
            if o in stepless and own:
                # a never-stepped wrapper's own entries hold what a first
                # step creates there too (Magma's per-parameter alignment):
                # only what the live wrapper holds (D48)
                live_own = state_dict_fn(owner, "state_dict")()
                own_entries = {**own_entries, **{k: only_held(own_entries[k], live_own.get(k)) for k in own}}
            prepared.append((_WRAPPER, {**own_entries, w[0]: split}))
        else:
            # validate the same way, then let the optimizer's own
            # load_state_dict install it
            C.prepare_install(ctx, optim, split, expected)
            prepared.append((False, {**split, **extras} if extras else split))
    return prepared, missing, unexpected


_WRAPPER = "wrapper"  # a prepared load for a wrapper's own load_state_dict


def _schema_less(optimizers: tuple[_Optimizer, ...]) -> bool:
    """Whether some optimizer (or the one it wraps) has no schema: such an
    optimizer's getter marks never-stepped parameters (so does a
    wrapper's, which the load checks apart)."""
    return any(schema_for(optim) is None for optim in (*optimizers, *_load_targets(optimizers)))


def _unmarked_for_fsdp(
    index: Any, optimizers: tuple[_Optimizer, ...], osd: dict[str, Any], flat: bool, units: list[list[str]]
) -> tuple[dict[str, Any], set[int], set[str]]:
    """A loaded dict for FSDP's own load (hybrid sharding) as the native
    loads take a marked one (``_prepare_view``): no state for the
    parameters it marks as saved without state, no mark left, no group
    value a first step created (never_stepped.unmarked_dict); the
    positions of the optimizers all of whose groups are never stepped; the
    names left without state.  ``units``: the flat parameters' originals
    (one optimizer entry each: marked only in part, loaded whole,
    never_stepped.partly_marked)."""
    never = marked_names(osd, flat)
    never -= partly_marked(never, units)
    live_of: dict[str, tuple[dict[str, Any], bool]] = {}
    stepless: set[int] = set()
    for o, optim in enumerate(optimizers):
        every = bool(optim.param_groups)
        for group, (names, all_never) in zip(optim.param_groups, _never_groups(index, optim, never)):
            every = every and all_never
            for fqns in names:
                for fqn in fqns:  # a flat parameter's: each of its originals
                    live_of[fqn] = (group, all_never)
        if every:
            stepless.add(o)
    return unmarked_dict(osd, flat, never, live_of), stepless, never


def _never_groups(index: Any, optim: _Optimizer, never: set[str]) -> list[tuple[list[list[str]], bool]]:
    """Per live group of ``optim``: the names of each of its parameters
    (``tensor_fqns``: a flat parameter's originals), and whether every
    parameter is in ``never`` (by its canonical name: a flat parameter's
    originals are marked together)."""
    out = []
    for group in optim.param_groups:
        names = []
        for p in group.get("params", ()):
            slot = index.slot_of(p)
            names.append(list(index.tensor_fqns[slot]) if slot is not None else [])
        out.append((names, bool(names) and all(n and n[0] in never for n in names)))
    return out


def _without_first_step_keys(
    index: Any, optim: _Optimizer, split: dict[str, Any], never: set[str]
) -> tuple[dict[str, Any], bool]:
    """The split without what a first step created in its groups, and
    whether every group is a never-stepped one
    (never_stepped.unmarked_groups)."""
    all_never = [all_never for _, all_never in _never_groups(index, optim, never)] if never else \
        [False] * len(optim.param_groups)
    groups, every = unmarked_groups(split["param_groups"], optim.param_groups, all_never)
    return {**split, "param_groups": groups}, every


def _only_live_wide(wide: dict[int, dict[str, Any]], stepless: set[int],
                    optimizers: tuple[_Optimizer, ...]) -> None:
    """(in place) The optimizer-wide entries of the never-stepped
    optimizers at ``stepless``: only those the live optimizer holds (what
    a first step created is left out: MADGRAD's ``k``, D48)."""
    for o in stepless & set(wide):
        held = set(_live_wide(optimizers[o]))
        wide[o] = {k: v for k, v in wide[o].items() if k in held}


def _check_wide(
    optimizers: tuple[_Optimizer, ...], splits: list[dict[str, Any]], wide: dict[int, dict[str, Any]]
) -> None:
    """``strict=True``: a load that gives an optimizer parameters' state
    must give it the optimizer-wide entries it holds too (D29), or the
    next step restarts them (MADGRAD's ``k`` from 0)."""
    for o, (optim, split) in enumerate(zip(optimizers, splits)):
        if not split["state"]:
            continue
        lacking = [k for k in _live_wide(optim) if k not in wide.get(o, {})]
        if lacking:
            raise errors.MissingOptimizerStateError(
                f"the optimizer state dict lacks the optimizer-wide state {lacking} that "
                f"optimizer {o} ({type(optim).__qualname__}) holds ('{wide_key(o)}' in "
                f"'state'; flattened, 'state.{wide_key(o)}.<name>'): loading it would restart "
                "that state from scratch. Nothing was loaded. To load anyway, use "
                "StateDictOptions(strict=False).",
                [wide_key(o)],
            )


def _live_wrapper_layout(optim: _Optimizer) -> tuple[Any, _Optimizer, list[Any]] | None:
    """_wrapper_layout of a live optimizer, with the keys of the wrapper's
    own entries (reads its own state_dict(); only for optimizers that
    override state_dict and hold an inner one)."""
    if _native_get(optim) or _inner_optimizer(optim) is None:
        return None
    osd = state_dict_fn(optim, "state_dict")()
    found = _wrapper_layout(optim, osd)
    return None if found is None else (*found, [k for k in osd if k != found[0]])


def _load_targets(optimizers: tuple[_Optimizer, ...]) -> tuple[_Optimizer, ...]:
    """What a load validates each optimizer as: a ZeroRedundancyOptimizer
    as its inner optimizer's class over its global groups, holding this
    rank's partition (zero.held_standin; with the template its getter
    remembered); every other optimizer as itself."""
    if not any(zero.is_zero(optim) for optim in optimizers):
        return optimizers
    out: list[_Optimizer] = []
    for optim in optimizers:
        if zero.is_zero(optim):
            zero.check_supported(optim, len(out))
            target = zero.held_standin(optim)
            known = _TEMPLATE_ENTRIES.get(optim)
            if known:
                _TEMPLATE_ENTRIES[target] = known
                _TEMPLATE_PLACED[target] = _TEMPLATE_PLACED.get(optim) or {}
            optim = target
        out.append(optim)
    return tuple(out)


def held_state(index: Any, optimizers: tuple[_Optimizer, ...]) -> dict[str, Any]:
    """The optimizers' current state keyed by FQN (the live tensors, no
    pristine state added): where a load may write into it."""
    optimizers = _load_targets(tuple(optim if w is None else w[1] for optim, w in
                                     ((o, _live_wrapper_layout(o)) for o in optimizers)))
    state: dict[str, Any] = {}
    C.optim_pack(index, optimizers, (None,) * len(optimizers), state, [], [])  # optimizer-wide entries: not written into
    return state


def _check_loaded_dict(osd: Any, flat: bool) -> None:
    """The loaded dict's shape, before anything else reads it: a dict, and
    (nested) param groups listing FQNs when the state is keyed by FQN."""
    if osd is None:
        return
    if not isinstance(osd, dict):
        raise errors.OptimizerDictTypeError(
            f"the optimizer state dict must be a dict (nested or flattened, as "
            f"get_optimizer_state_dict returns), got {type(osd).__name__}: {osd!r:.80}"
        )
    if flat or "state" not in osd:
        return
    state, groups = osd.get("state"), osd.get("param_groups")
    if not isinstance(state, dict) or not isinstance(groups, list):
        return
    if not any(isinstance(k, str) for k in state):
        return
    for g, group in enumerate(groups):
        params = group.get("params") if isinstance(group, dict) else None
        if isinstance(params, (list, tuple)):
            for p in params:
                if isinstance(p, int):
                    raise errors.StateDictKeyError(
                        f"param_groups[{g}]['params'] lists parameter ID {p!r}, but the "
                        "state is keyed by FQN: a dict keyed by FQN lists FQNs in its "
                        "groups (get_optimizer_state_dict's format), one keyed by IDs "
                        "is Optimizer.state_dict()'s"
                    )


# --- DCP's string keys (D32 in docs/differences.md) ---------------------------
#
# dcp.load writes a non-tensor leaf back along its saved path, whose keys
# are all str(key): below a key that is not a str (heavyball keeps each
# parameter's state under the view index 0, {0: {"step": ...,
# "is_initialized": {0}}}), the checkpoint's value lands under a new key
# "0" beside the template's 0, which keeps the template's value (DCP sets
# a set-valued one to None).  Tensors are loaded in place and are right.
# Such a "twin" (keys k and str(k) in one dict) cannot come from a state a
# DCP save accepted (both flatten to one path, which the save refuses):
# the load folds the checkpoint's values back under their own keys.


def _folded(orig: Any, twin: Any) -> Any:
    """``orig`` with the values of ``twin`` (DCP's copy of its subtree,
    every key a str) put under its own keys: a copy, never ``orig``."""
    if not (isinstance(orig, dict) and isinstance(twin, dict)):
        return twin
    out = dict(orig)
    own = {str(k): k for k in orig}
    for text, value in twin.items():
        key = own.get(text, text) if isinstance(text, str) else text
        out[key] = _folded(out[key], value) if key in out else value
    return out


def _without_twins(d: dict[Any, Any]) -> dict[Any, Any]:
    """A copy of ``d`` with every twin below it folded back."""
    out = {k: _without_twins(v) if isinstance(v, dict) else v for k, v in d.items()}
    for key in [k for k in d if not isinstance(k, str)]:
        text = str(key)
        if text in out:
            out[key] = _folded(out[key], out.pop(text))
    return out


def fold_dcp_string_keys(osd: Any) -> Any:
    """A nested optimizer dict with DCP's twins folded back (a new dict
    sharing every untouched entry), or ``osd`` itself when it holds none:
    the caller's dict is never changed."""
    state = osd.get("state") if isinstance(osd, dict) else None
    if not isinstance(state, dict):
        return osd
    fqns = C.str_key_twins(state)
    if not fqns:
        return osd
    state = dict(state)
    for fqn in fqns:
        state[fqn] = _without_twins(state[fqn])
    return {**osd, "state": state}


def _check_steps(state: dict[str, Any]) -> None:
    """A ``step`` that is not a tensor is converted with ``float()`` by
    the optimizer's ``__setstate__`` (Adam & co.) at commit, after other
    state was installed: the same conversion is tried here first.
    ``state``: a split's entries by FQN."""
    for fqn, entry in state.items():
        if not isinstance(entry, dict):
            continue
        step = entry.get("step")
        if step is None or isinstance(step, torch.Tensor):
            continue
        try:
            float(step)
        except (TypeError, ValueError) as exc:
            raise errors.StateDictValueError(
                f"optimizer state 'step' of parameter '{fqn}' is {step!r:.80}, not a "
                f"number or a tensor ({exc})"
            ) from None


def prepare_optim(
    model: nn.Module,
    optimizers: tuple[_Optimizer, ...],
    osd: dict[str, Any],
    info: Any,
) -> tuple[Callable[[], Any], Report]:
    """Everything of an optimizer load that can fail or communicate, with
    nothing installed yet: returns (commit, report).  commit() installs the
    prepared state into every optimizer and cannot fail on bad input.
    (Single-caller form of ``OptimLoad``, without agreement.)"""
    from .pipeline import run_alone

    prepared = run_alone(OptimLoad(model, optimizers, osd, info), info)
    return prepared.install, prepared.report


class OptimLoad:
    """An optimizer load as a ``pipeline.LoadPart``, so that the caller can
    agree with the other ranks between its phases (state_dict._run_load):

    1. ``plan()``: local checks and planning; returns what the source
       broadcasts -- (its metadata or None, the loaded dict's extra
       top-level entries) -- or None for loads that take no agreement
       (the early exits: nothing to load, FSDP1's own load, a dict keyed
       by parameter IDs);
    2. ``validate(meta)``: the validation of the whole load;
    3. ``move()``: data movement and the final checks (``_prepare_view``);
    4. ``commit(prepared)``: installs into every optimizer.

    The caller runs it under ``torch.no_grad()``.
    """

    name = "optim"

    def __init__(
        self,
        model: nn.Module,
        optimizers: tuple[_Optimizer, ...],
        osd: dict[str, Any],
        info: Any,
    ):
        self.model = model
        self.optimizers = optimizers
        self.osd = osd
        self.info = info
        self.direct: Prepared | None = None  # an early exit's install
        self.via_fsdp: Callable[[], Callable[[], None]] | None = None  # FSDP's own load: conversion, then install
        self.view: tuple = ()
        self.localize: Any = None  # distribute.OptimLocalize, fsdp1.Fsdp1Localize
        self.extras: dict[str, Any] = {}
        # an optimizer's own load_state_dict (an override, hooks, a
        # wrapper's) runs at commit and can raise on some ranks only: the
        # ranks then agree on the outcome (state_dict._commit)
        self.can_fail = False
        self.fatal: list[BaseException] = []  # its commit makes no collective
        self.collective_commit = False
        self.snapshot: OptimSnapshot | None = None

    def plan(self) -> Any:
        model, optimizers, osd, info = self.model, self.optimizers, self.osd, self.info
        if not info.handle_optim:
            self.direct = Prepared(_nothing)
            return None
        for i, optim in enumerate(optimizers):
            _check_optimizer(optim, i)
        _check_disjoint(optimizers, info)
        self.can_fail = bool(info.fsdp_modules) or not all(_native_load(optim) for optim in optimizers)
        _check_loaded_dict(osd, bool(info.flatten_optimizer_state_dict))
        if not info.flatten_optimizer_state_dict:
            osd = self.osd = fold_dcp_string_keys(osd)
        fsdp1 = bool(info.fsdp_modules)
        if fsdp1:
            from .fsdp1 import check_torch_layout, load_via_fsdp, native_supported

            native = [_native_load(optim) for optim in optimizers]
            for optim, own_load in zip(optimizers, native):
                if not own_load:  # a wrapper's own state_dict(): torch's layout?
                    check_torch_layout(optim, state_dict_fn(optim, "state_dict")())

            if not native_supported(info):
                # FSDP's own load: its conversion makes collectives, so it
                # runs at move (before the last agreement), not at commit
                self.direct = Prepared(_nothing)
                # the optimizer-wide entries (D29) go round FSDP's
                # conversion, which takes every key for a parameter's
                flat = bool(info.flatten_optimizer_state_dict)
                extras = _loaded_extras(osd, flat, own=not all(native))
                # the optimizers' own top-level entries (Ranger21's
                # lookahead_step) go to their own load_state_dict with the
                # converted dict, as on the native path
                wide, own, _ = _take_wide(extras, tuple(optimizers))
                core = _without_extras(osd, extras) if extras else osd
                never: set[str] = set()
                if core and _schema_less(optimizers):
                    # (D48) what a never-stepped checkpoint marks, left out
                    # before FSDP's conversion: its functions know no marks
                    from .fsdp1 import flat_units

                    core, stepless, never = _unmarked_for_fsdp(info.index, optimizers, core, flat, flat_units(info))
                    _only_live_wide(wide, stepless, optimizers)
                    own = {k: without_step_created(v) for k, v in own.items()}
                # a flattened dict's states as the native path parses them:
                # upstream's unflattening, which FSDP's load takes, looks up
                # the names the live optimizer holds -- none, never stepped
                states = _view(info.index, core, tuple(optimizers))[0] if core and "state" not in core else None
                self.via_fsdp = functools.partial(load_via_fsdp, model, optimizers, core, info, states, wide, own,
                                                  never)
                return None
        if osd and not info.broadcast_from_rank0 and _is_native_format(osd):
            self.direct = Prepared(
                functools.partial(_commit_native, optimizers, osd), _IncompatibleKeys([], [])
            )
            return None
        from .distribute import OptimLocalize

        extras = _loaded_extras(
            osd, bool(info.flatten_optimizer_state_dict), own=not all(_native_load(optim) for optim in optimizers)
        )
        if extras:
            osd = _without_extras(osd, extras)
        # On broadcast loads only the source holds the extra keys: they travel
        # with its metadata (every rank has the same optimizers).
        self.extras = extras
        view = self.view = _view(info.index, osd or {}, optimizers)
        if fsdp1:
            from .fsdp1 import Fsdp1Localize

            self.localize = Fsdp1Localize(view, info)
        elif (
            # Full tensors of sharded parameters become local shards (full
            # loads); plain tensors given for DTensor parameters are sharded
            # too (D9).  A sharded load into a model without DTensors only
            # copies the containers there, which the native install does
            # anyway (it casts into new containers): skipped.
            info.full_state_dict
            or not all(_native_load(optim) for optim in optimizers)
            or C.indices_of(info.index.tensors, DTensor)
        ):
            self.localize = OptimLocalize(
                view,
                info,
                full=info.full_state_dict,
                held=lambda: held_state(info.index, optimizers),
                keep_plain=lambda: kept_plain(info.index, optimizers),
                precheck=lambda v: _prepare_view(optimizers, v, info, self.extras),
            )
        return (self.localize.source_meta() if self.localize is not None else None, extras)

    def validate(self, meta: Any) -> None:
        if self.direct is not None:
            return
        source_meta, received = meta if meta is not None else (None, None)
        self.extras = received or {}
        if self.localize is not None:
            self.localize.validate(source_meta)

    def move(self) -> Prepared:
        if self.via_fsdp is not None:
            return Prepared(self.via_fsdp())
        if self.direct is not None:
            return self.direct
        optimizers, info = self.optimizers, self.info
        view = self.view
        if self.localize is not None:
            # this rank's shards of full tensors (FSDP1: the original
            # parameters' state -> flat shards / local pieces)
            view = self.localize.move()
        prepared, missing, unexpected = _prepare_view(optimizers, view, info, self.extras)
        return Prepared(
            functools.partial(_install, optimizers, prepared),
            _IncompatibleKeys(list(missing), list(unexpected)),
        )

    def commit(self, prepared: Prepared) -> Report:
        prepared.install()
        return prepared.report

    def stage(self) -> None:
        """Before a commit that can fail here or on another rank: snapshot
        every optimizer (``OptimSnapshot``), held until the ranks agreed
        on the outcome."""
        if self.snapshot is None and self.info.handle_optim:
            self.snapshot = OptimSnapshot(self.optimizers)

    def rollback(self) -> None:
        """Put back what a commit changed (it raised here, or on another
        rank after this rank's commit)."""
        snapshot, self.snapshot = self.snapshot, None
        if snapshot is not None:
            snapshot.restore()

    def stream_paths(self) -> int:
        """Which of a broadcast load's tensors are scattered (a digest,
        after ``validate``; 0 for other loads)."""
        return self.localize.stream_paths() if self.localize is not None else 0

    def broadcast_all(self) -> None:
        if self.localize is not None:
            self.localize.broadcast_all()

    def reserve(self) -> None:
        """Before the agreement ahead of a broadcast load's stream: what
        the stream allocates (``distribute.StreamPlan``; into FSDP1 models
        also the new tensors it fills)."""
        if self.localize is not None and self.direct is None and self.via_fsdp is None:
            self.localize.reserve()

    def inline_values(self) -> Any:
        """On a broadcast load's source: the state whose tensors may
        travel inline (``payload``), else None."""
        return self.localize.inline_values() if self.localize is not None else None

    def take_inline(self, values: Any) -> None:
        """The source's state arrived inline: ``move`` slices it locally."""
        if self.localize is not None and values is not None:
            self.localize.take_inline(values)

    def abort(self) -> None:
        """Put back what ``move`` wrote into the optimizers' held state (an
        in-place full or broadcast load) when the load fails after it."""
        abort = getattr(self.localize, "abort", None)
        if abort is not None:
            abort()


class OptimSnapshot:
    """What a load can change in optimizers: each one's attributes (a load
    replaces its ``state`` and ``param_groups``: ``__setstate__``; a
    wrapper's own load sets its settings), the contents of its ``state``,
    ``param_groups`` and ``defaults``, a copy of every state tensor's
    values (an override may write into them), and the same of every
    optimizer a wrapper holds in an attribute (Lookahead's
    ``optimizer``), once each.
    Costs one copy of the optimizers' state tensors while it is held."""

    def __init__(self, optimizers: tuple[_Optimizer, ...]):
        self.owners: list[tuple[_Optimizer, dict[str, Any]]] = []
        self.dicts: list[tuple[dict, dict]] = []
        self.lists: list[tuple[list, list]] = []
        self.tensors: list[tuple[torch.Tensor, torch.Tensor]] = []
        seen: set[int] = set()
        pending = list(optimizers)
        while pending:
            optim = pending.pop(0)
            if id(optim) in seen:
                continue
            seen.add(id(optim))
            attrs = dict(vars(optim))
            self.owners.append((optim, attrs))
            for name in ("state", "param_groups", "defaults"):
                if name in attrs:
                    self._keep(attrs[name], seen)
            pending.extend(v for v in vars(optim).values() if isinstance(v, _Optimizer))

    def _keep(self, value: Any, seen: set[int]) -> None:
        if id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, dict):
            self.dicts.append((value, dict(value)))
            for v in list(value.values()):
                self._keep(v, seen)
        elif isinstance(value, list):
            self.lists.append((value, list(value)))
            for v in value:
                if not isinstance(v, torch.Tensor):  # a group's parameters
                    self._keep(v, seen)
        elif isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
            self.tensors.append((value, value.detach().clone()))

    @torch.no_grad()
    def restore(self) -> None:
        for optim, attrs in self.owners:
            live = vars(optim)
            if live.keys() != attrs.keys() or any(live[k] is not v for k, v in attrs.items()):
                live.clear()
                live.update(attrs)
        for live_dict, saved_dict in self.dicts:
            if live_dict.keys() != saved_dict.keys() or any(
                live_dict[k] is not v for k, v in saved_dict.items()
            ):
                live_dict.clear()
                live_dict.update(saved_dict)
        for live_list, saved_list in self.lists:
            if len(live_list) != len(saved_list) or any(a is not b for a, b in zip(live_list, saved_list)):
                live_list[:] = saved_list
        for t, saved in self.tensors:
            if t.shape == saved.shape and t.dtype == saved.dtype and type(t) is type(saved):
                t.copy_(saved)
            else:
                t.data = saved


def _commit_native(optimizers: tuple[_Optimizer, ...], osd: dict[str, Any]) -> None:
    """A dict keyed by parameter IDs: every optimizer's own load, as upstream."""
    for optim in optimizers:
        state_dict_fn(optim, "load_state_dict")(state_dict=osd)


def _install(optimizers: tuple[_Optimizer, ...], prepared: list[tuple[bool | str, Any]]) -> None:
    """Install what _prepare_view built into every optimizer."""
    for optim, (native, payload) in zip(optimizers, prepared):
        if native is _WRAPPER:
            # positional: Lookahead's parameter is named `state`
            state_dict_fn(optim, "load_state_dict")(payload)
        elif native:
            state, groups = payload
            optim.__setstate__({"state": state, "param_groups": groups})
        else:
            state_dict_fn(optim, "load_state_dict")(state_dict=payload)
