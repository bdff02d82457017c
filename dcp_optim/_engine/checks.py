"""Option verification and result checks shared by every public function.

Mirrors upstream's ``_verify_options`` / ``_verify_state_dict`` pipeline.
The difference is the model walk: upstream walks the module tree in Python
and resolves every name with a getattr chain on each call; here one native
walk (``ModelIndex``) does it, and only when a call needs it.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictType,
)
from torch.distributed.fsdp import (
    FullyShardedDataParallel as FSDP,
)
from torch.distributed.fsdp._common_utils import (
    _get_module_fsdp_state_if_fully_sharded_module,
)

from .. import errors
from ..options import StateDictOptions, _as_options
from .core import C, context

__all__ = [
    "_StateDictInfo",
    "_gc_context",
    "_normalize_optimizers",
    "_prepare",
    "_verify_options",
    "_verify_state_dict",
]


@contextlib.contextmanager
def _gc_context():
    """Upstream's: no garbage collection pauses while state dicts are built."""
    is_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if is_enabled:
            gc.enable()


@dataclass
class _StateDictInfo(StateDictOptions):
    """Upstream's ``_StateDictInfo`` plus the native walk of the model.

    ``fqn_param_mapping`` and ``shared_params_mapping`` (tensor-keyed dicts,
    slow to build because ``Tensor.__hash__`` is Python code) are filled only
    by ``_verify_options``, the private entry point third parties call;
    dcp_optim's own functions read ``index`` instead.
    """

    fqn_param_mapping: dict[Any, Any] = field(default_factory=dict)
    shared_params_mapping: dict[Any, Any] = field(default_factory=dict)
    submodule_prefixes: set[str] = field(default_factory=set)
    handle_model: bool = True
    handle_optim: bool = True
    fsdp_context: Callable = contextlib.nullcontext
    fsdp_modules: list[nn.Module] = field(default_factory=list)
    index: Any = field(default=None, repr=False, compare=False)
    group_counts: list[int] | None = field(default=None, repr=False, compare=False)


def _normalize_optimizers(
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
) -> tuple[torch.optim.Optimizer, ...]:
    return (
        (optimizers,)
        if isinstance(optimizers, torch.optim.Optimizer)
        else tuple(optimizers)
    )


def _fsdp_context(
    model: nn.Module, options: StateDictOptions, fsdp_modules: Sequence[nn.Module] = ()
) -> Callable:
    """FSDP.state_dict_type(...) for FSDP1 models, with its FutureWarning
    filtered as upstream does.

    FSDP1 computing on CPU: its model state-dict offload path frees the
    unsharded CPU storage it is reading ("setStorage: ... out of bounds for
    storage of size 0", torch 2.13), so the offload -- a no-op there, the
    values are on CPU already -- is left out; rank0_only still applies.
    Its optimizer-state offload is left out there too: under
    ``use_orig_params`` FSDP gathers every state name of a flat parameter
    into one reused buffer and, offloading, keeps ``value.cpu()`` of its
    views -- the buffer itself on CPU -- so every state of a parameter
    came back as the last one gathered (``exp_avg`` equal to
    ``exp_avg_sq``); without the offload it clones each."""
    on_cpu = bool(fsdp_modules) and all(
        getattr(m, "compute_device", None) is not None and m.compute_device.type == "cpu"
        for m in fsdp_modules
    )
    offload_model = options.cpu_offload and not on_cpu
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig
    if options.full_state_dict:
        state_dict_config = FullStateDictConfig(
            offload_to_cpu=offload_model, rank0_only=options.cpu_offload
        )
        optim_state_dict_config = FullOptimStateDictConfig(
            offload_to_cpu=options.cpu_offload and not on_cpu,
            rank0_only=(options.cpu_offload or options.broadcast_from_rank0),
        )
        state_dict_type = StateDictType.FULL_STATE_DICT
    else:
        state_dict_config = ShardedStateDictConfig(offload_to_cpu=offload_model)
        optim_state_dict_config = ShardedOptimStateDictConfig(
            offload_to_cpu=options.cpu_offload
        )
        state_dict_type = StateDictType.SHARDED_STATE_DICT

    @contextlib.contextmanager
    def fsdp_state_dict_type_without_warning(
        module, state_dict_type, state_dict_config, optim_state_dict_config
    ):
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message="FSDP.state_dict_type", category=FutureWarning
            )
            with FSDP.state_dict_type(
                module=module,
                state_dict_type=state_dict_type,
                state_dict_config=state_dict_config,
                optim_state_dict_config=optim_state_dict_config,
            ):
                yield

    return functools.partial(
        fsdp_state_dict_type_without_warning,
        module=model,
        state_dict_type=state_dict_type,
        state_dict_config=state_dict_config,
        optim_state_dict_config=optim_state_dict_config,
    )


def _submodule_prefixes(model: nn.Module, submodules: Iterable[nn.Module]) -> set[str]:
    """The deprecated ``submodules`` argument as FQN prefixes (E5)."""
    wanted = set(submodules)
    prefixes: set[str] = set()
    ctx = context()
    for name, module in model.named_modules():
        if module not in wanted:
            continue
        fqns = C.get_fqns(ctx, model, name, "_fqn_modifiers", True, True)
        if len(fqns) != 1:
            raise AssertionError(errors.E5_SUBMODULE_FQN)
        prefixes.update(f"{fqn}." for fqn in fqns)
    return prefixes


# --- the model walk, replayed while the model is unchanged ---------------------

# id(model) -> (weak reference to the model, WalkTrace of its last walk).
# A trace holds strings and decisions only, never a module or a tensor, so
# this cache keeps nothing alive; an entry goes when its model dies.  The
# bound keeps the strings of models that are alive but unused from piling
# up (least recently walked first out).
_WALK_TRACES: dict[int, tuple[weakref.ref, Any]] = {}
_WALK_TRACES_MAX = 16


def _forget_trace(key: int, ref: weakref.ref) -> None:
    entry = _WALK_TRACES.get(key)
    if entry is not None and entry[0] is ref:
        _WALK_TRACES.pop(key, None)


def walk(model: nn.Module, modifiers: str) -> Any:
    """``C.walk_model(context(), model, modifiers)``.

    When the model was walked before, the recorded walk is replayed
    instead: the replay reads the same containers in the same order and
    compares every name and decision with the record (see "Replaying a
    walk" in csrc/walk_cache.c), returning what a walk would build or None at the
    first difference -- then the model is walked afresh.  Models whose walk
    could run user code (custom ``named_*``, ``_fqn_modifiers`` hooks,
    ``get_extra_state``, FSDP1, mapping subclasses) are never replayed.
    """
    ctx = context()
    key = id(model)
    entry = _WALK_TRACES.get(key)
    if entry is not None and entry[0]() is model:
        index = entry[1].replay(ctx, model, modifiers)
        if index is not None:
            _touch_trace(key, entry)
            return index
    index = C.walk_model(ctx, model, modifiers)
    trace = index.trace
    if trace is None:
        if entry is not None:
            _WALK_TRACES.pop(key, None)
        return index
    try:
        ref = weakref.ref(model, functools.partial(_forget_trace, key))
    except TypeError:  # a module class without __weakref__
        return index
    _WALK_TRACES.pop(key, None)
    _WALK_TRACES[key] = (ref, trace)
    _touch_trace(key, (ref, trace))
    return index


def _touch_trace(key: int, entry: tuple[weakref.ref, Any]) -> None:
    """Make ``entry`` the most recently used trace and evict the least
    recently used beyond the bound.  Best effort: another thread, or a
    model's weakref callback fired by a collection in the middle of this,
    may change the dict under an iterator (RuntimeError); the cache is then
    left as it is, which is still correct (it only holds traces that are
    checked before use)."""
    try:
        if next(reversed(_WALK_TRACES), None) != key:
            _WALK_TRACES.pop(key, None)
            _WALK_TRACES[key] = entry
        while len(_WALK_TRACES) > _WALK_TRACES_MAX:
            _WALK_TRACES.pop(next(iter(_WALK_TRACES)), None)
    except (RuntimeError, StopIteration):
        pass


def _prepare(
    model: nn.Module,
    optims: tuple[torch.optim.Optimizer, ...],
    optim_only: bool,
    *,
    submodules: set[nn.Module] | None = None,
    options: object | None = None,
    stacklevel: int = 3,
) -> _StateDictInfo:
    """Upstream's ``_verify_options`` without the Python mapping build."""
    if submodules:
        warnings.warn(errors.W1_SUBMODULES, FutureWarning, stacklevel=stacklevel)
    if optim_only and not optims:
        raise RuntimeError(errors.E4_NO_OPTIMIZERS)
    opts = _as_options(options)
    if not isinstance(model, nn.Module):
        raise errors.StateDictTypeError(
            f"model must be a torch.nn.Module, not {type(model).__name__}"
        )
    index = walk(model, opts.dsd_fqn_modifiers)
    prefixes = _submodule_prefixes(model, submodules) if submodules else set()
    if opts.broadcast_from_rank0 and not opts.full_state_dict:
        raise ValueError(errors.E6_BROADCAST_NEEDS_FULL)
    fsdp_modules = list(index.fsdp1_modules)
    return _StateDictInfo(
        full_state_dict=opts.full_state_dict,
        cpu_offload=opts.cpu_offload,
        ignore_frozen_params=opts.ignore_frozen_params,
        keep_submodule_prefixes=opts.keep_submodule_prefixes,
        strict=opts.strict,
        broadcast_from_rank0=opts.broadcast_from_rank0,
        flatten_optimizer_state_dict=opts.flatten_optimizer_state_dict,
        dsd_fqn_modifiers=opts.dsd_fqn_modifiers,
        submodule_prefixes=prefixes,
        fsdp_context=_fsdp_context(model, opts, fsdp_modules) if fsdp_modules else contextlib.nullcontext,
        fsdp_modules=fsdp_modules,
        handle_model=not optim_only,
        handle_optim=len(optims) > 0,
        index=index,
    )


def _verify_options(
    model: nn.Module,
    optims: tuple[torch.optim.Optimizer, ...],
    optim_only: bool,
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> _StateDictInfo:
    """Upstream-compatible ``_verify_options`` (third parties import it):
    also fills ``fqn_param_mapping`` and ``shared_params_mapping``."""
    info = _prepare(
        model, optims, optim_only, submodules=submodules, options=options
    )
    mapping: dict[Any, Any] = {}
    shared: dict[Any, Any] = {}
    index = info.index
    for tensor, fqns in zip(index.tensors, index.tensor_fqns):
        mapping[tensor] = set(fqns)
        if len(fqns) > 1:
            shared[tensor] = mapping[tensor]
        for fqn in fqns:
            mapping[fqn] = tensor
    for tensor, fqns in list(shared.items()):
        for fqn in fqns:
            shared[fqn] = tensor
    info.fqn_param_mapping = mapping
    info.shared_params_mapping = shared
    return info


def _verify_state_dict(
    model_state_dict: dict[str, Any],
    optim_state_dict: dict[str, Any],
    info: _StateDictInfo,
) -> None:
    for module in info.fsdp_modules:
        if _get_module_fsdp_state_if_fully_sharded_module(module) is None:
            raise AssertionError(errors.E7_FSDP_STATE)
    if (
        info.handle_model
        and not model_state_dict
        and not info.submodule_prefixes
        and not info.ignore_frozen_params
        and not (info.cpu_offload and info.full_state_dict)
        and info.strict
        and not info.broadcast_from_rank0
    ):
        # D14: upstream raises ValueError here without a process group.
        message = errors.E8_EMPTY_MODEL
        if dist.is_available() and dist.is_initialized():
            message += f"rank = {dist.get_rank()=}."
        raise errors.StateDictRuntimeError(message)
    if info.handle_optim:
        if (
            not optim_state_dict
            and not (info.cpu_offload and info.full_state_dict)
            and not info.broadcast_from_rank0
        ):
            raise errors.StateDictRuntimeError(
                errors.E9_EMPTY_OPTIM.format(osd=optim_state_dict)
            )
    if isinstance(model_state_dict, dict):
        key = C.first_key_containing(model_state_dict, "_flat_param")
        if key is not None:
            raise RuntimeError(errors.E10_FLAT_PARAM.format(key=key))
