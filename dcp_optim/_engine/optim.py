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

import functools
import warnings
import weakref
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _IncompatibleKeys

from .. import errors
from ..schema import PARAM, PARAM_DEVICE, schema_for
from .core import C, context
from .model import _is_patched, state_dict_fn
from .pristine import pristine, pristine_states, template_error
from .shadow import fallback_pristine, fallback_wrapper_entries, upstream_wrapper_entries
from .tree import maybe_full_or_cpu_state_dict

__all__ = ["get_optim", "load_optim", "init_optim_state"]

_Optimizer = torch.optim.Optimizer


def _own_method(optim: _Optimizer, api: str, base: Any, hook_attrs: tuple[str, ...]) -> bool:
    """True when ``optim.<api>`` is torch's base implementation with no
    hooks, so the native path computes exactly what it would."""
    if getattr(type(optim), api, None) is not base:
        return False
    instance_attr = optim.__dict__.get(api)
    if instance_attr is not None and not _is_patched(instance_attr):
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


def _add_group_keys(groups: list[dict[str, Any]], extra: list[dict[str, Any]] | None) -> None:
    """Adds the first-step group keys to the (returned, never the live)
    groups of one optimizer."""
    if not extra or len(extra) != len(groups):
        return
    for group, keys in zip(groups, extra):
        for k, v in keys.items():
            group.setdefault(k, v)


@torch.no_grad()
def get_optim(model: nn.Module, optimizers: tuple[_Optimizer, ...], info: Any) -> dict[str, Any]:
    if not info.handle_optim:
        return {}
    for i, optim in enumerate(optimizers):
        _check_optimizer(optim, i)
    if info.fsdp_modules:
        from .fsdp1 import get_fsdp1_optim

        osd = get_fsdp1_optim(model, optimizers, info)
    else:
        osd = _get_plain(optimizers, info)
    extras = getattr(info, "optim_extras", None)
    if info.flatten_optimizer_state_dict:
        keys = _flat_keys(model)
        osd_nested = osd
        osd = C.flatten_optim(context(), osd_nested, info.group_counts, keys)
        if keys is not None:
            _trim_flat_keys(keys, osd_nested)
    if extras:
        # after "state"/"param_groups" (nested) or the flat keys
        for key, value in extras.items():
            osd.setdefault(key, value)
    return maybe_full_or_cpu_state_dict(osd, info)


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
    for optim in optimizers:
        if _native_get(optim):
            extra, group_keys = pristine(index, optim)
            first = len(groups)
            C.optim_pack(index, (optim,), (extra,), state, groups)
            _add_group_keys(groups[first:], group_keys)
            counts.append(len(optim.param_groups))
            continue
        osd = state_dict_fn(optim, "state_dict")()
        if not osd:
            continue
        target, wrapper_keys = optim, None
        wrapped = _wrapper_layout(optim, osd)
        if wrapped is not None:
            osd, target, wrapper_keys = _unwrap_state_dict(index, optim, osd, *wrapped)
        extra, group_keys = pristine(index, target)
        if wrapper_keys:
            group_keys = [{**w, **(g or {})} for w, g in zip(wrapper_keys, group_keys or [{}] * len(wrapper_keys))]
        _check_own_state_dict(optim, osd)
        C.optim_remap(index, target, osd)
        _collect_extras(optim, osd, extras)
        state.update(osd["state"])
        if extra:
            state.update(extra)
        _add_group_keys(osd["param_groups"], group_keys)
        groups.extend(osd["param_groups"])
        counts.append(len(osd["param_groups"]))
    info.group_counts = counts
    info.optim_extras = extras
    return {"state": state, "param_groups": groups}


_LAYOUT = ("state", "param_groups")


def _has_layout(osd: Any) -> bool:
    return isinstance(osd, dict) and all(k in osd for k in _LAYOUT)


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
    if not isinstance(osd, dict) or _has_layout(osd):
        return None
    keys = [k for k, v in osd.items() if _has_layout(v)]
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
        own = {k: _fill(v, first.get(k)) for k, v in own.items()}
    return {**osd[key], **own}, inner, group_keys


def _fill(held: Any, first: Any) -> Any:
    """``held`` with the entries of ``first`` it lacks added, at any depth
    of dicts (held values win)."""
    if not isinstance(held, dict) or not isinstance(first, dict):
        return held
    out = dict(held)
    for k, v in first.items():
        out[k] = _fill(out[k], v) if k in out else v
    return out


def _check_own_state_dict(optim: _Optimizer, osd: Any) -> None:
    """An optimizer's own ``state_dict()`` must have torch's layout to be
    keyed by FQN (wrappers such as Lookahead return another layout;
    upstream raises ``KeyError: 'state'`` on them)."""
    if _has_layout(osd):
        return
    got = sorted(map(repr, osd)) if isinstance(osd, dict) else type(osd).__name__
    raise errors.StateDictKeyError(
        f"{type(optim).__qualname__}.state_dict() returned {got}, not torch's "
        "{'state': ..., 'param_groups': ...} layout, so its state cannot be keyed "
        "by parameter FQN; save and load this optimizer with its own "
        "state_dict()/load_state_dict()"
    )


def _collect_extras(optim: _Optimizer, osd: dict[str, Any], extras: dict[str, Any]) -> None:
    """Top-level entries of an optimizer's own ``state_dict()`` besides
    "state" and "param_groups" (StableSPAM's ``total_step``): kept at the
    top level of the returned dict, and given back to the optimizer's own
    ``load_state_dict`` on load (upstream drops them)."""
    for key, value in osd.items():
        if key in _LAYOUT:
            continue
        if key in extras:
            warnings.warn(
                f"optimizers share the top-level state_dict() key {key!r}: the "
                f"combined dict keeps the first one's, not {type(optim).__qualname__}'s "
                "(upstream keeps neither); get them one optimizer at a time to keep both",
                UserWarning,
                stacklevel=6,
            )
            continue
        extras[key] = value


def _loaded_extras(osd: Any, flat: bool) -> dict[str, Any]:
    """The top-level entries of a loaded dict that belong to neither
    format's state or groups (see _collect_extras)."""
    if not isinstance(osd, dict):
        return {}
    if flat:
        return {
            k: v for k, v in osd.items()
            if not (isinstance(k, str) and k.startswith(("state.", "param_groups.")))
        }
    return {k: v for k, v in osd.items() if k not in _LAYOUT}


def init_optim_state(optim: _Optimizer) -> None:
    """Upstream's ``_init_optim_state`` made safe (D4 in docs/differences.md): fill
    ``optim.state`` with pristine state for trainable parameters lacking
    it.  No ``step()``, no hooks, no gradients."""
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
    whole = _whole_state_names(index, osd, optimizers)
    if not whole:
        return C.unflatten_optim(index, osd)
    view = C.unflatten_optim(index, {k: v for k, v in osd.items() if k not in whole})
    for key, (fqn, name) in whole.items():
        view[0].setdefault(fqn, {})[name] = osd[key]
    return view


def _whole_state_names(
    index: Any, flat: dict[str, Any], optimizers: tuple[_Optimizer, ...]
) -> dict[str, tuple[str, str]]:
    """Flat state keys to read whole, not split at the dots of their state
    path, as upstream's unflattening does: {key: (fqn, name)} for every
    dotted state name the live optimizers hold whose whole key
    "state.<fqn>.<name>" is in ``flat`` (docs/architecture.md, Flat keys)."""
    out: dict[str, tuple[str, str]] = {}
    for optim in optimizers:
        for param, live in optim.state.items():
            if not isinstance(live, dict):
                continue
            try:  # one join per parameter: this runs on every flat load
                if "." not in "".join(live):
                    continue
            except TypeError:  # a key that is not a str
                pass
            dotted = [k for k in live if isinstance(k, str) and "." in k]
            slot = index.slot_of(param) if dotted else None
            if slot is None:
                continue
            for fqn in index.tensor_fqns[slot]:
                for name in dotted:
                    key = f"state.{fqn}.{name}"
                    if key in flat:
                        out[key] = (fqn, name)
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


def _drop_stateless(
    optimizers: tuple[_Optimizer, ...], splits: list[dict[str, Any]], missing: list[str]
) -> list[str]:
    """``missing`` without the parameters of schema-less optimizers that a
    first step gives no state (LoRA-RITE keeps none for 1-D parameters):
    nothing of theirs can be missing from a checkpoint.  Where the shadow
    step cannot run (see shadow.fallback_pristine), none of that
    optimizer's parameters count as missing: torch's rule, which checks
    nothing."""
    todo = set(missing)
    stateless: set[str] = set()
    for optim, split in zip(optimizers, splits):
        if schema_for(optim) is not None:
            continue
        pairs = [
            (fqn, param)
            for saved, live in zip(split["param_groups"], optim.param_groups)
            for fqn, param in zip(saved["params"], live["params"])
            if fqn in todo
        ]
        if not pairs:
            continue
        try:
            states, _ = fallback_pristine(optim, [p for _, p in pairs])
        except Exception:  # noqa: BLE001 - cannot tell: torch's rule, no check
            states = {}
        stateless.update(fqn for fqn, p in pairs if not states.get(id(p)))
    return [fqn for fqn in missing if fqn not in stateless] if stateless else missing


def _prepare_view(optimizers: tuple[_Optimizer, ...], view: tuple, info: Any, extras: dict[str, Any] | None = None):
    """Validate a loaded view against every optimizer and build what
    commit installs: (prepared, missing, unexpected).  Raises on bad input;
    installs nothing.  ``extras``: top-level entries of the loaded dict
    for the optimizers' own ``load_state_dict`` (see _collect_extras)."""
    # wrappers (see _wrapper_layout): checked and split as their inner
    # optimizer, installed through their own load_state_dict
    wrapped = [_live_wrapper_layout(optim) for optim in optimizers]
    owners = optimizers
    optimizers = tuple(optim if w is None else w[1] for optim, w in zip(optimizers, wrapped))
    expect = [_expect_state(optim) for optim in optimizers]
    splits, missing, unexpected = C.split_optim(info.index, optimizers, view, expect)
    # Which state is required follows the groups as loaded (the
    # checkpoint's hyperparameters win): Adam saved without amsgrad loads
    # into Adam(amsgrad=True).  Split again in the rare case it differs.
    loaded_expect = [
        _expect_state(optim, split["param_groups"]) for optim, split in zip(optimizers, splits)
    ]
    if loaded_expect != expect:
        splits, missing, unexpected = C.split_optim(info.index, optimizers, view, loaded_expect)
    if missing:
        missing = _drop_stateless(optimizers, splits, missing)
    if missing and info.strict:
        message = errors.E18_MISSING_OPTIM_STATE.format(fqn=missing[0])
        if len(missing) > 1:
            message += f" ({len(missing)} parameters lack state: {missing})"
        raise errors.MissingOptimizerStateError(message, list(missing))
    ctx = context()
    # (True: native install | False: load_state_dict | _WRAPPER, payload)
    prepared: list[tuple[bool | str, Any]] = []
    for owner, optim, split, w in zip(owners, optimizers, splits, wrapped):
        _drop_sgd_placeholders(optim, split)
        expected = _param_shaped(optim, split["param_groups"])
        _check_steps(split["state"])
        if w is None and _native_load(optim):
            # the optimizer's own state tensors (the DCP resume) keep
            # their identity without the cast, which a __torch_function__
            # mode could intercept: then always cast
            aliased = not torch._C._is_torch_function_mode_enabled()
            prepared.append((True, C.prepare_install(ctx, optim, split, expected, aliased)))
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
            C.prepare_install(ctx, optim, split, expected)
            prepared.append((_WRAPPER, {**(extras or {}), w[0]: split}))
        else:
            # validate the same way, then let the optimizer's own
            # load_state_dict install it
            C.prepare_install(ctx, optim, split, expected)
            prepared.append((False, {**split, **extras} if extras else split))
    return prepared, missing, unexpected


_WRAPPER = "wrapper"  # a prepared load for a wrapper's own load_state_dict


def _live_wrapper_layout(optim: _Optimizer) -> tuple[Any, _Optimizer, list[Any]] | None:
    """_wrapper_layout of a live optimizer, with the keys of the wrapper's
    own entries (reads its own state_dict(); only for optimizers that
    override state_dict and hold an inner one)."""
    if _native_get(optim) or _inner_optimizer(optim) is None:
        return None
    osd = state_dict_fn(optim, "state_dict")()
    found = _wrapper_layout(optim, osd)
    return None if found is None else (*found, [k for k in osd if k != found[0]])


def held_state(index: Any, optimizers: tuple[_Optimizer, ...]) -> dict[str, Any]:
    """The optimizers' current state keyed by FQN (the live tensors, no
    pristine state added): where a load may write into it."""
    optimizers = tuple(optim if w is None else w[1] for optim, w in
                       ((o, _live_wrapper_layout(o)) for o in optimizers))
    state: dict[str, Any] = {}
    C.optim_pack(index, optimizers, (None,) * len(optimizers), state, [])
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
):
    """Everything of an optimizer load that can fail or communicate, with
    nothing installed yet: returns (commit, report).  commit() installs the
    prepared state into every optimizer and cannot fail on bad input.
    (Single-caller form of ``optim_load_steps``, without agreement.)"""
    from .distribute import drive_steps

    return drive_steps(optim_load_steps(model, optimizers, osd, info), info)


def optim_load_steps(
    model: nn.Module,
    optimizers: tuple[_Optimizer, ...],
    osd: dict[str, Any],
    info: Any,
):
    """An optimizer load as a generator of steps, so that the caller can
    agree with the other ranks between them (state_dict._run_load):

    1. local checks and planning; yields what the source broadcasts (or
       None), receives the exchanged metadata;
    2. validation of the whole load; yields None;
    3. data movement and the final checks; yields (commit, report).

    The caller runs it under ``torch.no_grad()``.
    """
    commit_report = yield from _optim_steps(model, optimizers, osd, info)
    yield commit_report


def _optim_steps(model, optimizers, osd, info):
    if not info.handle_optim:
        yield None
        yield None
        return _nothing, None
    for i, optim in enumerate(optimizers):
        _check_optimizer(optim, i)
    _check_loaded_dict(osd, bool(info.flatten_optimizer_state_dict))
    fsdp1 = bool(info.fsdp_modules)
    if fsdp1:
        from .fsdp1 import load_via_fsdp, native_supported

        if not native_supported(info):
            yield None
            yield None
            return (lambda: load_via_fsdp(model, optimizers, osd, info)), None
    if osd and not info.broadcast_from_rank0 and _is_native_format(osd):
        def commit_native():
            for optim in optimizers:
                state_dict_fn(optim, "load_state_dict")(state_dict=osd)

        yield None
        yield None
        return commit_native, _IncompatibleKeys([], [])
    from .distribute import OptimLocalize

    extras = {}
    if not all(_native_load(optim) for optim in optimizers):
        extras = _loaded_extras(osd, bool(info.flatten_optimizer_state_dict))
        if extras:
            osd = {k: v for k, v in osd.items() if k not in extras}
    # On broadcast loads only the source holds the extra keys: they travel
    # with its metadata (every rank has the same optimizers).
    source = {"extras": extras}
    view = _view(info.index, osd or {}, optimizers)
    localize = None
    if not fsdp1 and (
        # Full tensors of sharded parameters become local shards (full
        # loads); plain tensors given for DTensor parameters are sharded
        # too (D9).  A sharded load into a model without DTensors only
        # copies the containers there, which the native install does
        # anyway (it casts into new containers): skipped.
        info.full_state_dict
        or not all(_native_load(optim) for optim in optimizers)
        or C.indices_of(info.index.tensors, DTensor)
    ):
        localize = OptimLocalize(
            view,
            info,
            full=info.full_state_dict,
            held=lambda: held_state(info.index, optimizers),
            precheck=lambda v: _prepare_view(optimizers, v, info, source["extras"]),
        )
    meta, received = yield (
        localize.source_meta() if localize is not None else None,
        extras,
    )
    source["extras"] = received or {}
    if localize is not None:
        localize.validate(meta)
    yield None
    if fsdp1:
        # original parameters' state -> flat shards / local pieces
        from .fsdp1 import localize_fsdp1_view

        view = localize_fsdp1_view(view, info)
    elif localize is not None:
        view = localize.move()
    prepared, missing, unexpected = _prepare_view(optimizers, view, info, source["extras"])

    def commit():
        for optim, (native, payload) in zip(optimizers, prepared):
            if native is _WRAPPER:
                # positional: Lookahead's parameter is named `state`
                state_dict_fn(optim, "load_state_dict")(payload)
            elif native:
                state, groups = payload
                optim.__setstate__({"state": state, "param_groups": groups})
            else:
                state_dict_fn(optim, "load_state_dict")(state_dict=payload)

    return commit, _IncompatibleKeys(list(missing), list(unexpected))
