"""Optimizer state dicts: get (FQN-keyed, never stepping) and set.

Get: the C core packs each optimizer's state keyed by FQN directly from
``optimizer.state`` and ``param_groups`` (what ``Optimizer.state_dict()``
plus upstream's ID -> FQN renaming produce), adding pristine state for
trainable parameters that have none yet (SPEC D1, D2).  Optimizers whose
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

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _IncompatibleKeys

from . import errors
from ._core import C, context
from ._model import _is_patched, state_dict_fn
from ._tree import maybe_full_or_cpu_state_dict
from .schema import PARAM, PARAM_DEVICE, _fallback_pristine, schema_for

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
            raise errors.StateDictTypeError(
                f"optimizer {position} ({type(optim).__qualname__}) has no "
                f"'{attr}' attribute; pass torch.optim.Optimizer instances "
                "(for a composite optimizer, pass its sub-optimizers as the "
                "`optimizers` iterable)"
            )


def _specs(schema, optim: _Optimizer) -> list[list[tuple] | None]:
    out: list[list[tuple] | None] = []
    for group in optim.param_groups:
        specs = schema(optim, group)
        out.append([tuple(s) for s in specs] if specs else None)
    return out


def pristine_states(index: Any, optim: _Optimizer) -> dict[str, dict[str, Any]] | None:
    """Pristine state for every trainable parameter of ``optim`` without
    state, keyed by FQN, in param-group order (None if there is none)."""
    missing = C.optim_missing(index, optim)
    if not missing:
        return None
    schema = schema_for(optim)
    if schema is not None:
        return C.materialize_state(missing, _specs(schema, optim), PARAM, PARAM_DEVICE) or None
    # No schema: throw-away optimizer per group (see schema._fallback_pristine).
    by_group: dict[int, list[tuple[torch.Tensor, str]]] = {}
    for param, group_index, fqn in missing:
        by_group.setdefault(group_index, []).append((param, fqn))
    out: dict[str, dict[str, Any]] = {}
    for group_index, items in by_group.items():
        group = optim.param_groups[group_index]
        states = _fallback_pristine(optim, group, [p for p, _ in items])
        for (_, fqn), st in zip(items, states):
            if st:
                out[fqn] = st
    return out or None


@torch.no_grad()
def get_optim(model: nn.Module, optimizers: tuple[_Optimizer, ...], info: Any) -> dict[str, Any]:
    if not info.handle_optim:
        return {}
    for i, optim in enumerate(optimizers):
        _check_optimizer(optim, i)
    if info.fsdp_modules:
        from ._fsdp1 import get_fsdp1_optim

        osd = get_fsdp1_optim(model, optimizers, info)
    else:
        osd = _get_plain(optimizers, info)
    if info.flatten_optimizer_state_dict:
        osd = C.flatten_optim(context(), osd, info.group_counts)
    return maybe_full_or_cpu_state_dict(osd, info)


def _get_plain(optimizers: tuple[_Optimizer, ...], info: Any) -> dict[str, Any]:
    index = info.index
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    counts: list[int] = []
    for optim in optimizers:
        extra = pristine_states(index, optim)
        if _native_get(optim):
            C.optim_pack(index, (optim,), (extra,), state, groups)
            counts.append(len(optim.param_groups))
            continue
        osd = state_dict_fn(optim, "state_dict")()
        if not osd:
            continue
        C.optim_remap(index, optim, osd)
        state.update(osd["state"])
        if extra:
            state.update(extra)
        groups.extend(osd["param_groups"])
        counts.append(len(osd["param_groups"]))
    info.group_counts = counts
    return {"state": state, "param_groups": groups}


def init_optim_state(optim: _Optimizer) -> None:
    """Upstream's ``_init_optim_state`` made safe (SPEC D4): fill
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


def _expect_state(optim: _Optimizer) -> list[bool] | None:
    schema = schema_for(optim)
    if schema is None:
        return None
    return [bool(schema(optim, g)) for g in optim.param_groups]


def _param_shaped(optim: _Optimizer) -> list[dict[str, int] | None] | None:
    """Per group, what a loaded entry must hold (from the schema): state
    name -> 1 (required) or 2 (required, a floating tensor shaped like the
    parameter).  None without a schema."""
    schema = schema_for(optim)
    if schema is None:
        return None
    out: list[dict[str, int] | None] = []
    for group in optim.param_groups:
        specs = schema(optim, group) or []
        names = {}
        for s in specs:
            if s.dims is not None:
                continue  # present for some shapes only
            shaped = s.factory in (torch.zeros_like, torch.full_like) and s.args[:1] == (PARAM,)
            names[s.name] = 2 if shaped else 1
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


def _view(index: Any, osd: dict[str, Any]) -> tuple:
    if "state" in osd:
        return C.view_from_nested(osd)
    return C.unflatten_optim(index, osd)


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


def _prepare_view(optimizers: tuple[_Optimizer, ...], view: tuple, info: Any):
    """Validate a loaded view against every optimizer and build what
    commit installs: (prepared, missing, unexpected).  Raises on bad input;
    installs nothing."""
    expect = [_expect_state(optim) for optim in optimizers]
    splits, missing, unexpected = C.split_optim(info.index, optimizers, view, expect)
    if missing and info.strict:
        message = errors.E18_MISSING_OPTIM_STATE.format(fqn=missing[0])
        if len(missing) > 1:
            message += f" ({len(missing)} parameters lack state: {missing})"
        raise errors.MissingOptimizerStateError(message, list(missing))
    ctx = context()
    prepared = []
    for optim, split in zip(optimizers, splits):
        _drop_sgd_placeholders(optim, split)
        expected = _param_shaped(optim)
        if _native_load(optim):
            prepared.append((True, C.prepare_install(ctx, optim, split, expected)))
        else:
            # validate the same way, then let the optimizer's own
            # load_state_dict install it
            C.prepare_install(ctx, optim, split, expected)
            prepared.append((False, split))
    return prepared, missing, unexpected


def held_state(index: Any, optimizers: tuple[_Optimizer, ...]) -> dict[str, Any]:
    """The optimizers' current state keyed by FQN (the live tensors, no
    pristine state added): where a load may write into it."""
    state: dict[str, Any] = {}
    C.optim_pack(index, optimizers, (None,) * len(optimizers), state, [])
    return state


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
    from ._distribute import drive_steps

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
    fsdp1 = bool(info.fsdp_modules)
    if fsdp1:
        from ._fsdp1 import load_via_fsdp, native_supported

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
    from ._distribute import OptimLocalize

    view = _view(info.index, osd or {})
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
            precheck=lambda v: _prepare_view(optimizers, v, info),
        )
    meta = yield (localize.source_meta() if localize is not None else None)
    if localize is not None:
        localize.validate(meta)
    yield None
    if fsdp1:
        # original parameters' state -> flat shards / local pieces
        from ._fsdp1 import localize_fsdp1_view

        view = localize_fsdp1_view(view, info)
    elif localize is not None:
        view = localize.move()
    prepared, missing, unexpected = _prepare_view(optimizers, view, info)

    def commit():
        for optim, (native, payload) in zip(optimizers, prepared):
            if native:
                state, groups = payload
                optim.__setstate__({"state": state, "param_groups": groups})
            else:
                state_dict_fn(optim, "load_state_dict")(state_dict=payload)

    return commit, _IncompatibleKeys(list(missing), list(unexpected))
