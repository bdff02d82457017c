"""Model state dicts: get (canonical FQNs) and set (wrapper keys restored).

Per-key work -- canonicalising every key of ``model.state_dict()``,
dropping frozen parameters, re-keying for ``load_state_dict``, merging a
full state dict -- runs in the C core; this module sequences it.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules.module import _IncompatibleKeys

from . import errors
from ._core import C, context
from ._tree import maybe_full_or_cpu_state_dict

__all__ = ["get_model", "load_model", "state_dict_fn", "unflatten_model_state_dict"]

# Marks the closures _patch_*_state_dict installs (SPEC D17: a marker on the
# function instead of upstream's ever-growing registry of closures, which
# keeps every patched model alive).
PATCH_MARK = "_dcp_optim_patched"


def _is_patched(call: Any) -> bool:
    if getattr(call, PATCH_MARK, False):
        return True
    # Closures installed by upstream's own _patch_*_state_dict.
    try:
        from torch.distributed.checkpoint import state_dict as upstream
    except ImportError:  # pragma: no cover
        return False
    return call in upstream._patched_state_dict


def state_dict_fn(obj: nn.Module | torch.optim.Optimizer, api: str) -> Callable:
    """``obj.<api>``, or the class's method when it was patched by us or by
    upstream (so a patched object does not call itself recursively)."""
    call = getattr(obj, api)
    if _is_patched(call):
        call = functools.partial(getattr(type(obj), api), self=obj)
    return call


@torch.no_grad()
def get_model(model: nn.Module, info: Any) -> dict[str, Any]:
    if not info.handle_model:
        return {}
    with info.fsdp_context():
        state_dict = state_dict_fn(model, "state_dict")()
    if not _keys_are_canonical(info.index, state_dict):
        C.canonicalize_model_keys(context(), model, state_dict, info.dsd_fqn_modifiers)
    if info.submodule_prefixes:
        state_dict = C.filter_prefixes(
            state_dict, list(info.submodule_prefixes), info.keep_submodule_prefixes
        )
    if info.ignore_frozen_params:
        C.drop_frozen(info.index, state_dict)
    return maybe_full_or_cpu_state_dict(state_dict, info)


def _keys_are_canonical(index: Any, state_dict: Any) -> bool:
    """True when canonicalising ``state_dict`` would rename nothing: every
    key is a name the walk recorded as its own FQN, in a tree whose walk is
    replayable (``index.trace``: no modifier hooks, no FSDP1, no overridden
    ``named_*``/``get_extra_state``/attribute access -- csrc/walk.c).
    Resolving such a name (upstream's ``_get_fqns``) steps through
    registered, unwrapped modules only and returns it unchanged."""
    if index is None or index.trace is None or not isinstance(state_dict, dict):
        return False
    raw = index.raw_names
    if raw != index.fqns:  # a wrapper level or a hidden child somewhere
        return False
    return state_dict.keys() <= set(raw)


def unflatten_model_state_dict(
    model: nn.Module, state_dict: dict[Any, Any]
) -> dict[str, Any]:
    """The deprecated ``{submodule: state_dict}`` form, flattened (W2, E25)."""
    if not isinstance(state_dict, dict):
        raise errors.StateDictTypeError(
            f"model state dict must be a dict, not {type(state_dict).__name__}"
        )
    if not state_dict:
        return {}
    if isinstance(next(iter(state_dict.keys())), nn.Module):
        warnings.warn(errors.W2_MODULE_KEYED, FutureWarning, stacklevel=3)
        ctx = context()
        new_state_dict: dict[str, Any] = {}
        for submodule, sub_state_dict in state_dict.items():
            for name, module in model.named_modules():
                if module != submodule:
                    continue
                fqns = C.get_fqns(ctx, model, name, "_fqn_modifiers", True, True)
                if len(fqns) != 1:
                    raise AssertionError(errors.E25_SUBMODULE_FQNS)
                prefix = f"{next(iter(fqns))}."
                new_state_dict.update(
                    {prefix + subfqn: value for subfqn, value in sub_state_dict.items()}
                )
        return new_state_dict
    return cast(dict[str, Any], state_dict)


def _load_device(info: Any, local: dict[str, Any]) -> tuple[torch.device, bool]:
    """Upstream's device choice for full/broadcast loads: the one device of
    the local tensors with dim() > 0 (meta dropped, then ``assign=True``)."""
    devices = C.tensor_devices(context(), list(local.values()))
    assign = False
    meta = torch.device("meta")
    if meta in devices:
        devices.remove(meta)
        assign = True
    if not devices:
        devices.append(dist.distributed_c10d._get_pg_default_device())
    elif len(devices) > 1:
        raise ValueError(errors.E14_MULTIPLE_DEVICES)
    return devices[0], assign


@torch.no_grad()
def load_model(
    model: nn.Module, state_dict: dict[str, Any], info: Any
) -> _IncompatibleKeys:
    return prepare_model(model, state_dict, info)()


@torch.no_grad()
def prepare_model(model: nn.Module, state_dict: dict[str, Any], info: Any):
    """Everything of a model load that can fail or communicate; returns
    commit(), which runs model.load_state_dict on the validated dict.
    (Single-caller form of ``model_load_steps``, without agreement.)"""
    from ._distribute import drive_steps

    return drive_steps(model_load_steps(model, state_dict, info), info)[0]


def _noop_commit() -> _IncompatibleKeys:
    return _IncompatibleKeys({}, {})  # upstream's, dicts included


def model_load_steps(model: nn.Module, state_dict: dict[str, Any], info: Any):
    """A model load as a generator of steps (see _optim.optim_load_steps):
    local checks (yields the source's metadata, receives the exchanged
    one), validation of the whole load (yields None), data movement and
    the final checks (yields (commit, None)).  Run under no_grad."""
    if not info.handle_model or (not state_dict and not info.broadcast_from_rank0):
        yield None
        yield None
        yield _noop_commit, None
        return
    from ._distribute import ModelFullLoad, collective_device, route_for

    full_path = info.broadcast_from_rank0 or info.full_state_dict
    route = route_for(info.index, None) if info.broadcast_from_rank0 else None
    rename = route is None or route.is_source
    # A private, re-keyed view: the caller's dict is never mutated (D11).
    load_sd, local = C.rename_for_load(
        info.index, state_dict, info.strict, rename, full_path
    )
    assign = False
    plan = None
    if full_path:
        device, assign = _load_device(info, local)
        # Where the model load's checks can run before any data moves, the
        # shards are written straight into the parameters (see
        # _distribute); FSDP1 and models whose load hooks rename keys keep
        # the load-then-copy path.
        precheck = None
        if not info.fsdp_modules and not _custom_load(model, info):
            def precheck(sd: dict[str, Any]) -> None:
                check_load(model, sd, info)
        else:
            info.validated_after_move = True
        if route is not None:
            route.device = collective_device(device, info.index)
        plan = ModelFullLoad(
            load_sd, local, device, route=route, strict=info.strict,
            cpu_offload=info.cpu_offload, precheck=precheck, info=info,
        )
    elif not info.fsdp_modules:
        check_load(model, load_sd, info)
    meta = yield (plan.source_meta() if plan is not None else None)
    if plan is not None:
        plan.validate(meta)
    yield None
    if plan is not None:
        load_sd = plan.move()
        if not info.fsdp_modules:
            check_load(model, load_sd, info)

    def commit() -> _IncompatibleKeys:
        with info.fsdp_context():
            return cast(
                _IncompatibleKeys,
                state_dict_fn(model, "load_state_dict")(
                    state_dict=load_sd, strict=info.strict, assign=assign
                ),
            )

    yield commit, None


def _custom_load(model: nn.Module, info: Any) -> bool:
    """``index.custom_load`` (load hooks that may rename keys), except
    where the only hooks are FSDP2's: they reshard, rename nothing, and
    the load reshards up front anyway."""
    value = getattr(info, "custom_load_hooks", None)
    if value is None:
        from ._distribute import only_fsdp2_load_hooks

        value = bool(info.index.custom_load) and not only_fsdp2_load_hooks(model)
        info.custom_load_hooks = value
    return value


def check_load(model: nn.Module, load_sd: dict[str, Any], info: Any) -> None:
    """Raise what model.load_state_dict would raise, before it copies a
    single tensor: torch copies parameter by parameter and reports errors
    at the end, which leaves a half-loaded model behind.  Same text as
    torch's.  Models whose load hooks rename keys get the per-tensor checks
    only (their keys cannot be known up front)."""
    index = info.index
    # A module under several paths (``self.b = self.a``): the walk, like
    # upstream's, keeps the first path, but load_state_dict recurses into
    # every one and wants the keys under each; those come from torch's own
    # state_dict() (rare: one extra Python walk).
    custom = _custom_load(model, info)
    keys_known = not custom and not index.shared_modules
    missing, unexpected, errs = C.check_model_load(
        index, load_sd, info.strict, keys_known
    )
    if info.strict and index.shared_modules and not custom:
        expected = model.state_dict(keep_vars=True).keys()
        missing = [k for k in expected if k not in load_sd]
        unexpected = [k for k in load_sd if k not in expected]
    messages = list(errs)
    if unexpected:
        messages.insert(0, "Unexpected key(s) in state_dict: {}. ".format(
            ", ".join(f'"{k}"' for k in unexpected)))
    if missing:
        messages.insert(0, "Missing key(s) in state_dict: {}. ".format(
            ", ".join(f'"{k}"' for k in missing)))
    if messages:
        raise RuntimeError(
            "Error(s) in loading state_dict for {}:\n\t{}".format(
                type(model).__name__, "\n\t".join(messages)
            )
        )
