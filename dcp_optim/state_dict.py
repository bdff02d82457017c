"""Drop-in replacement for ``torch.distributed.checkpoint.state_dict``.

Same public names and signatures as upstream (torch 2.13); see README.md
for the behaviour that deliberately differs (docs/differences.md).  Each
public function is: verify options, do the work (natively), verify the
result.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Iterable
from typing import Any, cast, no_type_check

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _IncompatibleKeys

from . import errors
from ._engine.checks import (
    _gc_context,
    _normalize_optimizers,
    _prepare,
    _StateDictInfo,  # noqa: F401
    _verify_options,  # noqa: F401
    _verify_state_dict,
)

# _EXTRA_STATE and _verify_options: upstream module names, kept importable
# from here like the rest of upstream's private helpers (test_wrappers).
from ._engine.core import EXTRA_STATE as _EXTRA_STATE  # noqa: F401
from ._engine.core import C, context
from ._engine.model import ModelLoad, get_model, unflatten_model_state_dict
from ._engine.optim import OptimLoad, get_optim, init_optim_state
from ._engine.own_calls import PATCH_MARK
from ._engine.payload import OutgoingPayload, encode_payload, payload_flags
from ._engine.pipeline import LoadPart, Prepared
from ._engine.zero import agreement_mesh as zero_agreement_mesh
from .options import StateDictOptions

__all__ = [
    "FQNS_T",
    "PrimitiveType",
    "ValueType",
    "DictValueType",
    "ListDictValueType",
    "OptimizerStateType",
    "StateDictOptions",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]

_FLAT_PARAM = "_flat_param"
_PG = "param_groups"
_PARAMS = "params"
_STATE = "state"

FQNS_T = set[str]
PrimitiveType = DTensor | ShardedTensor | torch.Tensor | int | float | str
ValueType = (
    PrimitiveType | list[PrimitiveType] | tuple[PrimitiveType] | dict[str, "ValueType"]
)
DictValueType = dict[str, ValueType]
ListDictValueType = list[DictValueType]
OptimizerStateType = dict[str, DictValueType | ListDictValueType]


# --- private names third parties import (kept compatible) --------------------


def _get_fqns(
    model: nn.Module,
    name: str,
    dsd_fqn_modifiers: str = "_fqn_modifiers",
    skip_ddp_prefix: bool = True,
    skip_compiler_prefix: bool = True,
) -> FQNS_T:
    """Canonical FQNs of ``name`` (a set: FSDP1 flat parameters have many)."""
    return C.get_fqns(
        context(), model, name, dsd_fqn_modifiers, skip_ddp_prefix, skip_compiler_prefix
    )


def _iterate_valid_model_state(model: nn.Module, dsd_fqn_modifiers: str = "_fqn_modifiers"):
    """(name, tensor-or-_EXTRA_STATE) pairs, children first, as upstream."""
    yield from C.walk_model(context(), model, dsd_fqn_modifiers).valid_state()


def _init_optim_state(optim: torch.optim.Optimizer) -> None:
    """Fill ``optim.state`` with pristine state for trainable parameters
    lacking it -- without ``step()``, hooks or gradients (D4 in docs/differences.md)."""
    init_optim_state(optim)


def _state_dict_fn(obj: nn.Module | torch.optim.Optimizer, api: str) -> Callable:
    from ._engine.own_calls import state_dict_fn

    return state_dict_fn(obj, api)


# --- public API ---------------------------------------------------------------


def get_model_state_dict(
    model: nn.Module,
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> dict[str, ValueType]:
    """
    Return the model state_dict of ``model``.

    See ``get_state_dict`` for the detail usage.

    Args:
        model (nn.Module): the nn.Module to the model.
        submodules (deprecated): Optional[set[nn.Module]]: only return the model parameters
            that belong to the submodules.
        options (StateDictOptions): the options to control how
            model state_dict and optimizer state_dict should be returned. See
            `StateDictOptions` for the details.

    Returns:
        The state_dict for ``model``.

    :rtype: typing.Dict[str, ValueType]
    """
    with _gc_context():
        _reshard_fsdp2(model)
        info = _prepare(model, (), optim_only=False, submodules=submodules, options=options)
        model_state_dict = get_model(model, info)
        _verify_state_dict(model_state_dict, {}, info)
        return model_state_dict


def get_optimizer_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> OptimizerStateType:
    """
    Return the combined state_dict for optimizers.

    See ``get_state_dict`` for the detail usage.

    Unlike upstream, the optimizers are never stepped or modified: a
    trainable parameter without state yet is returned with the state its
    optimizer would create on the first step (see ``dcp_optim.schema``).

    Args:
        model (nn.Module): the nn.Module to the model.
        optimizers (Union[None, Optimizer, Iterable[Optimizer]]):
            The optimizers that are used to optimize ``model``.
        submodules (deprecated): Optional[set[nn.Module]]: only return the model parameters
            that belong to the submodules.
        options (StateDictOptions): the options to control how
            model state_dict and optimizer state_dict should be returned. See
            `StateDictOptions` for the details.

    Returns:
        The state_dict for ``optimizers``.

    :rtype: OptimizerStateType
    """
    with _gc_context():
        _reshard_fsdp2(model)
        optimizers = _normalize_optimizers(optimizers)
        info = _prepare(
            model, optimizers, optim_only=True, submodules=submodules, options=options
        )
        optim_state_dict = get_optim(model, optimizers, info)
        _verify_state_dict({}, optim_state_dict, info)
        return optim_state_dict


def get_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> tuple[dict[str, ValueType], OptimizerStateType]:
    """
    Return the model state_dict and optimizers state_dict.

    ``get_state_dict`` can process any module that is parallelized by PyTorch
    FSDP/fully_shard, DDP/replicate, tensor_parallel/parallelize_module, and any
    combination of these parallelisms. The main functions of ``get_state_dict``
    are: 1.) returning a model and optimizer state_dict that can be resharded
    with a different number of trainers and/or different parallelisms.
    2.) hiding the parallelism-specific state_dict APIs. Users don't have to call
    these APIs.
    3.) sanity checking the result state_dict.

    The keys of the result state dictionary are the canonical FQNs (Fully
    Qualified Names).  A canonical FQN refers to the FQN based on a parameter's
    position in an nn.Module hierarchy. More specifically, a canonical FQN to a
    parameter is the FQN returned by ``module.named_parameters()`` or
    ``module.named_buffers()`` when the module is not distributed by any
    parallelisms. Since the optimizer internally uses parameter IDs to represent
    a parameter, there will be a conversion from the parameter IDs to the
    canonical FQNs when calling this API.

    ``get_state_dict`` can also process a module that is not parallelized. In
    such a case, ``get_state_dict`` only performs one function -- converting the
    optimizer parameter IDs to the canonical FQNs.

    Args:
        model (nn.Module): the nn.Module to the model.
        optimizers (Union[None, Optimizer, Iterable[Optimizer]]):
            The optimizers that are used to optimize ``model``.
        submodules (deprecated): Optional[set[nn.Module]]: only return the model parameters
            that belong to the submodules.
        options (StateDictOptions): the options to control how
            model state_dict and optimizer state_dict should be returned. See
            `StateDictOptions` for the details.

    Returns:
        ``Tuple`` that contain model state_dict and optimizer state_dict.

    :rtype: typing.Tuple[typing.Dict[str, ValueType], OptimizerStateType]
    """
    with _gc_context():
        _reshard_fsdp2(model)
        optimizers = _normalize_optimizers(optimizers)
        info = _prepare(
            model, optimizers, optim_only=False, submodules=submodules, options=options
        )
        model_state_dict = get_model(model, info)
        optim_state_dict = get_optim(model, optimizers, info)
        _verify_state_dict(model_state_dict, optim_state_dict, info)
        return model_state_dict, optim_state_dict


def set_model_state_dict(
    model: nn.Module,
    model_state_dict: dict[str, ValueType],
    *,
    options: StateDictOptions | None = None,
) -> _IncompatibleKeys:
    """Load the model state_dict.

    The counterpart of ``get_model_state_dict`` to set the state_dict to the
    model. See ``set_state_dict`` for the detail usage.

    The given dict is never modified.

    Args:
        model (nn.Module): the nn.Module to the model.
        model_state_dict: (Dict[str, ValueType]):
           the model state_dict to load. If the key of the ``model_state_dict``
           is nn.Module, the key is a submodule of ``model`` and the value should
           be the state_dict of the submodule. When loading the state_dict,
           the prefix of the submodule will be append to the state_dict.
        options (StateDictOptions): the options to control how
            model state_dict and optimizer state_dict should be loaded. See
            `StateDictOptions` for the details.

    Returns:
        ``NamedTuple`` with ``missing_keys`` and ``unexpected_keys`` fields:
            * **missing_keys** is a list of str containing the missing keys
            * **unexpected_keys** is a list of str containing the unexpected keys

    :type model_state_dict: typing.Dict[str, ValueType]
    """
    model_state_dict, error = _unflatten(model, model_state_dict)
    result, _ = _run_load("set_model_state_dict", model, None, model_state_dict, None, options, error)
    _check_after_load(model, (), options, ("model",))
    return result


def set_optimizer_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    optim_state_dict: OptimizerStateType,
    *,
    options: StateDictOptions | None = None,
) -> None:
    """Load the optimizers state_dict.

    The counterpart of ``get_optimizer_state_dict`` to set the state_dict to the
    optimizers. See ``set_state_dict`` for the detail usage.

    Parameters are matched by FQN in both the nested and the flattened
    format.  Unlike upstream, the optimizers are never stepped, and the
    return value reports what did not match: ``missing_keys`` (trainable
    parameters without saved state, allowed with ``strict=False``) and
    ``unexpected_keys`` (saved entries no given optimizer owns).

    Args:
        model (nn.Module): the nn.Module to the model.
        optimizers (Union[Optimizer, Iterable[Optimizer]]):
            The optimizers that are used to optimize ``model``.
        optim_state_dict: OptimizerStateType:
            the optimizer state_dict to load.
        options (StateDictOptions): the options to control how
            model state_dict and optimizer state_dict should be loaded. See
            `StateDictOptions` for the details.

    Returns:
        ``NamedTuple`` with ``missing_keys`` and ``unexpected_keys``.

    :type optim_state_dict: typing.OptimizerStateType
    """
    result, optimizers = _run_load(
        "set_optimizer_state_dict", model, optimizers, None, optim_state_dict, options
    )
    _check_after_load(model, optimizers, options, ("optim",))
    return result


def set_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    model_state_dict: dict[str, ValueType],
    optim_state_dict: OptimizerStateType,
    options: StateDictOptions | None = None,
) -> _IncompatibleKeys:
    """Load the model state_dict and optimizers state_dict.

    The counterpart of ``get_state_dict`` to set the state_dict to the model and
    optimizers.  The given ``model_state_dict`` and ``optim_state_dict`` do not
    have to be returned by ``get_state_dict`` but must meet the following
    requirements: 1) all FQNs are canonical FQNs as defined in ``get_state_dict``,
    2) if a tensor is sharded, it must be either a ShardedTensor or DTensor,
    3) optimizer state_dict cannot contain the parameter IDs; the keys should be
    the canonical FQNs.

    Args:
        model (nn.Module): the nn.Module to the model.
        optimizers (Union[Optimizer, Iterable[Optimizer]]):
            The optimizers that are used to optimize ``model``.
        model_state_dict: (Union[Dict[nn.Module, Dict[str, ValueType]], Dict[str, ValueType]]):
           the model state_dict to load. If the key of the ``model_state_dict``
           is nn.Module, the key is a submodule of ``model`` and the value should
           be the state_dict of the submodule. When loading the state_dict,
           the prefix of the submodule will be append to the state_dict.
        optim_state_dict: OptimizerStateType:
            the optimizer state_dict to load.
        options (StateDictOptions): the options to control how
            model state_dict and optimizer state_dict should be loaded. See
            `StateDictOptions` for the details.

    Returns:
        ``NamedTuple`` with ``missing_keys`` and ``unexpected_keys`` fields:
            * **missing_keys** is a list of str containing the missing keys of the model state_dict.
            * **unexpected_keys** is a list of str containing the unexpected keys of the model state_dict.
        The optimizer's report is attached as ``optim_missing_keys`` and
        ``optim_unexpected_keys``.

    :type model_state_dict: typing.Dict[str, ValueType]
    :type optim_state_dict: typing.OptimizerStateType
    """
    model_state_dict, error = _unflatten(model, model_state_dict)
    (result, handle_model), optimizers = _run_load(
        "set_state_dict", model, optimizers, model_state_dict, optim_state_dict, options, error
    )
    sections = ("model", "optim") if handle_model else ("optim",)
    _check_after_load(model, optimizers, options, sections)
    return result


def _reshard_fsdp2(model: Any) -> None:
    """Getters see the sharded parameters the optimizers hold, whatever
    state a forward left FSDP2 in (see _engine.distribute.reshard_fsdp2)."""
    if isinstance(model, nn.Module):
        from ._engine.distribute import reshard_fsdp2

        reshard_fsdp2(model)


def _check_after_load(model: nn.Module, optimizers: Any, options: Any, sections: tuple[str, ...]) -> None:
    """StateDictOptions.verify_checksums: recompute and compare (issue 9)."""
    expected = getattr(options, "verify_checksums", None)
    if expected is None:
        return
    from ._engine.checksums import verify

    getters = (get_model_state_dict, get_optimizer_state_dict, get_state_dict)
    verify(model, optimizers, expected, options=options, sections=sections, getters=getters)


# Options that decide which collectives a load runs: every rank of the
# load's mesh must pass the same.
_COLLECTIVE_OPTIONS = (
    "full_state_dict",
    "broadcast_from_rank0",
    "cpu_offload",
    "strict",
    "flatten_optimizer_state_dict",
    "ignore_frozen_params",
    "keep_submodule_prefixes",
)


def _unflatten(model: Any, model_state_dict: Any) -> tuple[Any, Exception | None]:
    """The deprecated module-keyed form, flattened here (its warning
    points at the caller); a failure is agreed on like any other."""
    try:
        return unflatten_model_state_dict(model, model_state_dict), None
    except Exception as exc:  # noqa: BLE001 - raised by _run_load
        return model_state_dict, exc


def _run_load(
    api: str,
    model: Any,
    optimizers: Any,
    model_state_dict: Any,
    optim_state_dict: Any,
    options: Any,
    error: Exception | None = None,
) -> tuple[Any, Any]:
    """The three setters, as a loop over the phases of the load pipeline
    (``_engine.pipeline.LoadPart``; parts: the optimizers', then the
    model's -- upstream's order, also for the collectives).  Every check of
    every rank runs, and is agreed on, before any data moves or anything
    is installed (atomic, the same error on every rank):

    1. ``plan`` every part (without broadcast, ``validate`` too; with
       it, the source encodes its payload, ``_engine.payload``);
    2. one agreement: options, D15, the full dicts' structure, every
       rank's verdict (and the source's payload size);
    3. broadcast loads: the source's payload (one broadcast), ``validate``
       on every rank, one agreement;
    4. ``move`` (data movement, the checks on the moved data), one more
       agreement, then ``commit`` -- which cannot fail on bad input.  A
       sharded load moves no data between ranks and writes nothing before
       commit: its ``move`` runs before the agreement of step 2, which is
       its only one (except into FSDP1 models, whose sharded move
       exchanges shards: after it, as above).  Likewise a broadcast load
       whose tensors came inline with the payload: its ``move`` slices
       them locally into new tensors, before the agreement of step 3.

    Agreements are fixed-size all-reduces (``_engine.consistency.Agreement``)
    among the ranks of the model's mesh (FSDP1: its device mesh or process
    group), made whenever the load communicates or the model holds
    sharded tensors; a plain model's
    sharded load runs alone on each rank, as upstream's does."""
    from ._engine.consistency import first_rank
    from ._engine.distribute import route_for

    bcast = bool(getattr(options, "broadcast_from_rank0", False))
    # Decided from the options as passed: ranks whose options differ meet
    # at the first agreement and raise there.
    sharded = not bcast and not getattr(options, "full_state_dict", False)
    has = (int(bool(model_state_dict)), int(bool(optim_state_dict)))
    grad = torch.is_grad_enabled()
    parts: list[LoadPart] = []
    with _gc_context():
        try:
            torch.set_grad_enabled(False)
            info, optimizers, error = _load_info(api, model, optimizers, model_state_dict, optim_state_dict, options, error)
            agreement = _agreement_for(api, model, info, options, model_state_dict, optim_state_dict, optimizers) if _distributed() else None
            if error is None:
                parts, error = _load_parts(api, model, optimizers, model_state_dict, optim_state_dict, info)
            metas, error = _phase(lambda p: p.plan(), parts, error)
            if not (bcast and agreement is not None):  # alone: the source's metadata is its own
                _, error = _phase(lambda pm: pm[0].validate(pm[1]), list(zip(parts, metas)), error)
            payload = None
            route = None
            if bcast and agreement is not None and info is not None and error is None:
                route = route_for(info.index, None)
            if route is not None and route.is_source:
                # the source encodes what it sends now: its size (and an
                # encoding failure) is agreed on at the first agreement
                try:
                    payload = _source_payload(parts, metas, info)
                except Exception as exc:  # noqa: BLE001 - agreed on below
                    error = exc
            prepared: list[Prepared | None] = []
            # FSDP1's sharded move exchanges shards across its group: it
            # runs after the first agreement, as full loads' moves do
            moves_first = sharded and not _holds_fsdp1(model, info)
            if moves_first:
                prepared, error = _phase(lambda p: p.move(), parts, error)
            # which parts' commits can fail on this rank: 1 the model's, 2 the optimizers'
            fallible = sum(bit for p in parts if p.can_fail for bit in (_FALLIBLE[p.name],))
            per_rank = _agree_or_abort(
                parts, agreement, error, (*has, fallible, *payload_flags(payload)), _flags_check(api, info)
            )
            assert info is not None  # else error was set, and raised above
            if bcast and agreement is not None:
                parts = _source_parts(api, parts, per_rank, info, optimizers)
                route = route or route_for(info.index, None)
                # the payload's size, as the source announced it (where the
                # source is the agreement's first rank: else it travels too)
                announced = per_rank[0][3:7] if first_rank(agreement.mesh) == route.source else None
                read = route.send_payload(payload, announced)
                try:
                    sent, values = read()
                except Exception as exc:  # noqa: BLE001 - agreed on below
                    sent, values, error = (), None, exc
                if values is not None:  # inline: every rank holds the source's tensors
                    for part, value in zip(parts, values):
                        part.take_inline(value)
                _, error = _phase(lambda pm: pm[0].validate(pm[1]), list(zip(parts, sent)), error)
                if values is not None:
                    # no collective in the moves and nothing written before
                    # commit (as a sharded load's): they run before the one
                    # agreement left
                    prepared, error = _phase(lambda p: p.move(), parts, error)
                    moves_first = True
                    _agree_or_abort(parts, agreement, error)
                else:
                    flags = _paths_flags(parts, error)
                    # the stream's plans and allocations, before the
                    # agreement ahead of it: a rank that cannot make them
                    # (out of memory) fails with every rank, not inside
                    # the stream's collectives
                    _, error = _phase(lambda p: p.reserve(), parts, error)
                    paths = _agree(agreement, error, flags if error is None else _paths_flags(parts, error))
                    if not _same_paths(paths):
                        for part in parts:
                            part.broadcast_all()
            if not moves_first:
                # on broadcast loads every part runs even after one failed
                # (its stream is a collective the others wait in)
                prepared, error = _phase(lambda p: p.move(), parts, error, every=bcast)
                _agree_or_abort(parts, agreement, error)
            fallible_somewhere = _fallible_somewhere(per_rank)
            reports = _commit(parts, prepared, agreement if fallible_somewhere else None, fallible_somewhere,
                              relay=agreement)
        finally:
            torch.set_grad_enabled(grad)
    model_report = reports.get("model") or _IncompatibleKeys({}, {})
    optim_report = reports.get("optim")
    if api == "set_model_state_dict":
        return model_report, optimizers
    if api == "set_optimizer_state_dict":
        return optim_report, optimizers
    result = _LoadResult(*model_report)
    result.optim_missing_keys = optim_report.missing_keys if optim_report else []
    result.optim_unexpected_keys = optim_report.unexpected_keys if optim_report else []
    return (result, info.handle_model), optimizers


def _source_payload(parts: list[LoadPart], metas: list[Any], info: Any) -> OutgoingPayload:
    """On a broadcast load's source: what it sends every rank (``metas``,
    one per part, and where the load is small its tensors inline).  Never
    inline into FSDP1 models, whose optimizer moves can make collectives
    of FSDP's own."""
    values = None if info.fsdp_modules else [part.inline_values() for part in parts]
    return encode_payload(tuple(metas), values)


def _holds_fsdp1(model: Any, info: Any) -> bool:
    from ._engine.fsdp1 import agreement_mesh

    return agreement_mesh(model, info)[0]


def _load_info(
    api: str, model: Any, optimizers: Any, model_state_dict: Any, optim_state_dict: Any,
    options: Any, error: Exception | None,
) -> tuple[_StateDictInfo | None, Any, Exception | None]:
    """The load's info (options checked against the model) and its
    normalized optimizers; (None, ..., the error) where that fails: the
    failure is agreed on like any other."""
    info = None
    try:
        if error is not None:
            raise error
        _reshard_fsdp2(model)
        if optimizers is not None:
            optimizers = _normalize_optimizers(optimizers)
        if api == "set_model_state_dict":
            info = _prepare(model, (), optim_only=False, options=options)
        elif api == "set_optimizer_state_dict":
            info = _prepare(model, optimizers, optim_only=True, options=options)
        else:
            info = _prepare(model, optimizers, optim_only=not model_state_dict, options=options)
            if info.broadcast_from_rank0 and _distributed():
                # Receivers pass {}: whether the model is loaded is the
                # source's decision (learnt at the first agreement),
                # or ranks take different collective paths (upstream
                # hangs here).  Planned on every rank until then.
                info.handle_model = True
        _verify_state_dict(model_state_dict or {}, optim_state_dict or {}, info)
    except Exception as exc:  # noqa: BLE001 - agreed on by the caller
        return info, optimizers, exc
    return info, optimizers, None


def _load_parts(
    api: str, model: Any, optimizers: Any, model_state_dict: Any, optim_state_dict: Any, info: Any
) -> tuple[list[LoadPart], Exception | None]:
    parts: list[LoadPart] = []
    try:
        if api != "set_model_state_dict":
            parts.append(OptimLoad(model, optimizers, optim_state_dict, info))
        if api != "set_optimizer_state_dict":
            parts.append(ModelLoad(model, model_state_dict, info))
    except Exception as exc:  # noqa: BLE001 - agreed on by the caller
        return parts, exc
    return parts, None


def _phase(
    step: Callable[[Any], Any], items: list[Any], error: Exception | None, every: bool = False
) -> tuple[list[Any], Exception | None]:
    """``step`` of every item, in order: (the results, the load's error).
    Stops at the first failure (or skips everything after an earlier
    one), unless ``every``: then each item runs and a failed one's result
    is None."""
    results: list[Any] = []
    for item in items:
        if error is not None and not every:
            break
        try:
            results.append(step(item))
        except Exception as exc:  # noqa: BLE001 - agreed on by the caller
            error = error or exc
            results.append(None)
    return results, error


def _agree(
    agreement: Any, error: Exception | None, flags: tuple[int, ...] = (), flags_check: Any = None
) -> list[tuple[int, ...]]:
    """One agreement point (see consistency.Agreement.agree); a load that
    runs alone raises its own error."""
    if agreement is not None:
        return cast(list[tuple[int, ...]], agreement.agree(error, flags=flags, flags_check=flags_check))
    if error is not None:
        raise error
    return []


def _agree_or_abort(parts: list[LoadPart], agreement: Any, error: Exception | None, *args: Any) -> list[tuple[int, ...]]:
    """``_agree`` after data moved: where it raises (a failure here or on
    another rank, or a peer that died), what in-place moves wrote into live
    tensors is put back first (``LoadPart.abort``)."""
    try:
        return _agree(agreement, error, *args)
    except BaseException:
        for part in parts:
            part.abort()
        raise


def _fallible_somewhere(per_rank: list[tuple[int, ...]]) -> int:
    """The OR over the ranks of their ``fallible`` flags (the third),
    without a pass over the ranks (consistency.RankFlags)."""
    from ._engine.consistency import flags_union

    return flags_union(per_rank, 2) if per_rank else 0


def _flags_check(api: str, info: Any) -> Any:
    if info is not None and info.full_state_dict and not info.broadcast_from_rank0:
        return functools.partial(_full_dict_everywhere, api)
    return None


def _paths_flags(parts: list[LoadPart], error: Exception | None) -> tuple[int, ...]:
    """A broadcast load's agreement flags after ``validate``: 1 and the
    four bytes of a digest of which tensors each part scatters (the ranks
    must issue the same collectives), or zeros where validation failed
    here (that failure is what the agreement reports)."""
    if error is not None:
        return (0, 0, 0, 0, 0)
    digest = 0
    for part in parts:
        digest = zlib.crc32(part.stream_paths().to_bytes(4, "little"), digest)
    return (1, *digest.to_bytes(4, "little"))


def _same_paths(per_rank: Any) -> bool:
    """Whether every rank would scatter the same tensors (the flags of
    ``_paths_flags``; all validated here: the agreement raised
    otherwise).  Where they differ -- the ranks lay out a tensor
    differently, which upstream's broadcast loads take as each rank's
    own -- every rank broadcasts every tensor instead."""
    if per_rank.rest is not None:
        return bool(per_rank.first == per_rank.rest)
    return all(f == per_rank[0] for f in per_rank)


def _source_parts(
    api: str, parts: list[LoadPart], per_rank: list[tuple[int, ...]], info: Any, optimizers: Any
) -> list[LoadPart]:
    """The parts of a broadcast load, as the source decided: set_state_dict
    loads the model only where the source passed one (its flags, learnt at
    the first agreement; the source is the mesh's first rank)."""
    if api != "set_state_dict":
        return parts
    info.handle_model = bool(per_rank[0][0])
    if info.handle_model:
        return parts
    if not optimizers:
        raise RuntimeError(errors.E4_NO_OPTIMIZERS)
    return [p for p in parts if p.name != "model"]


_FALLIBLE = {"model": 1, "optim": 2}


def _commit(
    parts: list[LoadPart], prepared: list[Prepared | None], agreement: Any, fallible: int = 0,
    relay: Any = None,
) -> dict[str, Any]:
    """Install every part, the model first: a model whose modules decide
    their own load rules is loaded by torch at its commit, before the
    optimizer's state is installed.  Such a commit can fail on some ranks
    only (a module's hook, an optimizer's own ``load_state_dict``): with
    ``agreement`` (some rank's commit can fail; ``fallible``: the parts
    whose commit can fail on some rank, ``_FALLIBLE`` bits), the model is
    staged (snapshot) before it commits, and so is every part that can
    fail; the ranks agree on the outcome of each part that can fail, and
    where any rank failed, every rank puts back every part it committed
    (the model too, where the optimizer failed) and raises that rank's
    error.  A failure inside collectives of torch's own code (FSDP1's load
    hooks, ``LoadPart.fatal``) raises the first failing rank's error on
    every rank, relayed through the store of ``relay`` (the call's
    agreement, also where no commit can fail)."""
    reports: dict[str, Any] = {}
    done: list[LoadPart] = []
    if agreement is None and any(p.can_fail for p in parts if p.name == "optim"):
        return _commit_alone(parts, prepared)
    for part, ready in sorted(zip(parts, prepared), key=lambda pair: pair[0].name != "model"):
        assert ready is not None  # a failed move was agreed on and raised
        bit = _FALLIBLE[part.name]
        if agreement is None or not (fallible & bit or part.name == "model"):
            # FSDP1's gathers at commit can fail on some ranks, midway:
            # staged, so that what the earlier units loaded is put back
            staged = relay is not None and part.collective_commit
            if staged:
                part.stage()
            try:
                reports[part.name] = part.commit(ready)
            except BaseException as exc:
                if staged:
                    _put_back([part], parts)
                if relay is not None:
                    _raise_relayed(part, exc, relay)
                raise
            continue
        if not fallible & bit:  # the model, staged for the optimizers' outcome
            part.stage()
            try:
                # FSDP1's own load hooks gather here: a peer that died
                # in them, or their own failure, raises on this rank
                reports[part.name] = part.commit(ready)
            except BaseException as exc:
                _put_back([part], parts)
                _raise_relayed(part, exc, agreement)
                raise
            done.append(part)
            continue
        error = None
        try:
            part.stage()
            reports[part.name] = part.commit(ready)
            done.append(part)
        except Exception as exc:  # noqa: BLE001 - agreed on below
            error = exc
            part.rollback()
            if _is_fatal(part, exc):
                # FSDP1's own hooks failed (a peer that died in their
                # gathers): the ranks are not all where the agreement meets
                _put_back(done, parts)
                _raise_relayed(part, exc, agreement)
                raise
        try:
            agreement.agree(error)
        except BaseException:
            _put_back(done, parts)
            raise
    return reports


def _is_fatal(part: LoadPart, exc: BaseException) -> bool:
    """Whether ``exc`` came from collectives of torch's own code in the
    part's commit (``LoadPart.fatal``)."""
    return any(exc is each for each in part.fatal)


def _raise_relayed(part: LoadPart, exc: BaseException, agreement: Any) -> None:
    """Where ``exc`` came from collectives of torch's own code in the
    part's commit (``part.fatal``: FSDP1's load hooks), raise the error
    every rank raises for it: the first failing rank's, relayed through
    the store (``consistency.relay_failure``); otherwise return."""
    if not _is_fatal(part, exc):
        return
    from ._engine.consistency import relay_failure

    relayed = relay_failure(agreement.mesh, agreement.what, exc)
    if relayed is not exc:
        raise relayed from exc


def _commit_alone(parts: list[LoadPart], prepared: list[Prepared | None]) -> dict[str, Any]:
    """``_commit`` of a load that runs alone whose optimizers' own
    ``load_state_dict`` can fail: the model is committed first, so it is
    staged too, and put back (with what an in-place move wrote) if the
    optimizers' load raises -- nothing changed, as with an agreement."""
    reports: dict[str, Any] = {}
    done: list[LoadPart] = []
    try:
        for part, ready in sorted(zip(parts, prepared), key=lambda pair: pair[0].name != "model"):
            assert ready is not None  # a failed move raised
            part.stage()
            done.append(part)
            reports[part.name] = part.commit(ready)
    except BaseException:
        _put_back(done, parts)
        raise
    return reports


def _put_back(committed: list[LoadPart], parts: list[LoadPart]) -> None:
    """Undo a failed commit: every committed part back to its snapshot,
    then every in-place move's undo log -- last, because the snapshots hold
    what the commits found after such a move wrote the loaded values."""
    for part in committed:
        part.rollback()
    for each in parts:
        each.abort()


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _agreement_for(
    api: str, model: Any, info: Any, options: Any, model_state_dict: Any, optim_state_dict: Any,
    optimizers: Any = None,
) -> Any:
    """The agreement of a distributed load, or None for a load that runs
    alone on each rank (no full dict, no sharded tensors).  Decided from
    the options as passed and the model's tensors, also where the load
    failed before its info was built, so that a rank that failed early
    still meets the others at the first agreement."""
    from ._engine.consistency import Agreement, option_pairs
    from ._engine.distribute import route_for

    index = info.index if info is not None else None
    if index is None and isinstance(model, nn.Module):
        try:
            from ._engine.checks import walk

            index = walk(model, getattr(options, "dsd_fqn_modifiers", "_fqn_modifiers"))
        except Exception:  # noqa: BLE001 - the load's own error is raised
            index = None
    full = bool(getattr(options, "full_state_dict", False) or getattr(options, "broadcast_from_rank0", False))
    sharded = index is not None and bool(C.indices_of(index.tensors, DTensor))
    mesh = route_for(index, None).mesh if index is not None else None
    # FSDP1: FSDP's own load functions gather across its group (sharded
    # loads too, without a device mesh): its ranks agree there
    from ._engine.fsdp1 import agreement_mesh

    fsdp1, fsdp1_known, fsdp1_mesh = agreement_mesh(model, info)
    if fsdp1 and fsdp1_known and mesh is None:
        mesh, sharded = fsdp1_mesh, fsdp1_mesh is not None or sharded
    # D36: a ZeroRedundancyOptimizer's ranks all load with it
    try:  # (normalised already, unless that failed on this rank)
        listed = () if optimizers is None else _normalize_optimizers(optimizers)
    except TypeError:
        listed = ()
    has_zero, zero_group_mesh = zero_agreement_mesh(listed)
    if has_zero and mesh is None:
        mesh = zero_group_mesh
    # Without one device mesh the group is the default one, which may
    # hold other models (pipeline stages): only loads that communicate
    # there anyway agree there.
    if not (full or (sharded and mesh is not None) or (fsdp1 and fsdp1_known) or has_zero):
        return None
    pairs = [("api", api), *option_pairs(options, _COLLECTIVE_OPTIONS), ("bucket", repr(_bucket_setting()))]
    structure = None
    if full and mesh is not None and not getattr(options, "broadcast_from_rank0", False):
        # every rank of the mesh holds the full dicts of one model: the
        # same checkpoint, so the same keys, shapes, dtypes and
        # hyperparameters
        structure = _structure(model_state_dict, "model") + _structure(optim_state_dict, "optimizer")
    identity = _identity(index, optimizers) if mesh is not None else None
    return Agreement(mesh, api, pairs, structure, identity)


def _identity(index: Any, optimizers: Any) -> list[tuple[str, Any]] | None:
    """The FQNs of the model's tensors in registration order, then those
    of every optimizer's parameters in group order: what every rank of a
    mesh agrees on besides shapes (the order of the collectives; issue
    24).  None where the optimizers cannot be read (their own error is
    agreed on)."""
    out: list[tuple[str, Any]] = [
        (f"model tensor #{i}", "|".join(fqns)) for i, fqns in enumerate(index.tensor_fqns)
    ]
    try:
        for k, optim in enumerate(optimizers or ()):
            for g, group in enumerate(optim.param_groups):
                for j, param in enumerate(group["params"]):
                    slot = index.slot_of(param)
                    name = "|".join(index.tensor_fqns[slot]) if slot is not None else "(not in the model)"
                    out.append((f"optimizer {k} param_groups[{g}] param #{j}", name))
    except Exception:  # noqa: BLE001 - the load's own checks report it
        return out
    return out


def _structure(state_dict: Any, what: str) -> list[tuple[str, str]]:
    """(entry, description) of every entry of a state dict, tensors as
    (shape, dtype): what every rank's copy of a full dict must share."""
    if not state_dict or not isinstance(state_dict, dict):
        return []
    from ._engine.distribute import to_metadata

    try:
        ctx = context()
        leaves = C.tree_leaves(ctx, state_dict, False)
        meta = C.tree_rebuild(ctx, state_dict, to_metadata(leaves), False)
    except Exception:  # noqa: BLE001 - the load's own checks report it
        return [(what, "a state dict whose structure cannot be read")]
    out = []
    for key, value in meta.items():
        if not isinstance(key, str):
            out.append((f"{what} entry", type(key).__name__))
        elif key == "state" and isinstance(value, dict):
            for fqn, entry in value.items():
                items = entry.items() if isinstance(entry, dict) else [("", entry)]
                for name, v in items:
                    out.append((f"{what} state '{fqn}' '{name}'", repr(v)))
        elif key == "param_groups" and isinstance(value, list):
            for i, group in enumerate(value):
                items = group.items() if isinstance(group, dict) else [("", group)]
                for name, v in items:
                    out.append((f"{what} param_groups[{i}] '{name}'", repr(v)))
        else:
            out.append((f"{what} '{key}'", repr(value)))
    return out


def _bucket_setting():
    from ._engine.collectives import bucket_setting

    return bucket_setting()


def _full_dict_everywhere(api: str, flags: list, ranks: list[int]) -> str | None:
    """D15 in docs/differences.md: a full load without broadcast needs the full dict on
    every rank; upstream hangs when only some ranks pass it (or raises on
    the empty ones only)."""
    for i, what in ((0, "model"), (1, "optimizer")):
        values = [f[i] for f in flags]
        if all(v == values[0] for v in values):
            continue
        empty = [r for r, v in zip(ranks, values) if not v]
        return (
            f"full_state_dict=True loads need the full {what} state dict on every "
            f"rank, but rank(s) {empty} passed an empty one. To load a dict that "
            "only rank 0 holds, use StateDictOptions(full_state_dict=True, "
            "broadcast_from_rank0=True)."
        )
    return None


class _LoadResult(_IncompatibleKeys):
    """``_IncompatibleKeys`` of the model, with the optimizer's report
    attached as ``optim_missing_keys`` / ``optim_unexpected_keys``."""

    optim_missing_keys: list[str]
    optim_unexpected_keys: list[str]


def _mark_patched(fn: Callable) -> Callable:
    setattr(fn, PATCH_MARK, True)
    return fn


@no_type_check
def _patch_model_state_dict(
    model: nn.Module,
    *,
    options: StateDictOptions | None = None,
) -> None:
    """Patch the ``state_dict`` and ``load_state_dict`` attributes of ``model``.

    Patch the ``state_dict`` and ``load_state_dict`` attributes of ``model`` to
    be a partial function to call ``get_state_dict`` and ``set_state_dict``.

    Example:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.checkpoint.state_dict import patch_model_state_dict

        model = fsdp(model)
        patch_model_state_dict(model)

    Args:
        model (nn.Module): the nn.Module to the model.
        options (StateDictOptions): the options to control how
            model state_dict and optimizer state_dict should be loaded. See
            `StateDictOptions` for the details.
    Returns:
        None
    """
    _state_dict_call = functools.partial(get_model_state_dict, model=model, options=options)

    def state_dict_call():
        return _state_dict_call()

    model.state_dict = _mark_patched(state_dict_call)

    _load_state_dict_call = functools.partial(
        set_model_state_dict, model=model, options=options
    )

    def load_state_dict_call(state_dict: dict[str, Any]):
        _load_state_dict_call(model_state_dict=state_dict)

    model.load_state_dict = _mark_patched(load_state_dict_call)


@no_type_check
def _patch_optimizer_state_dict(
    model: nn.Module,
    *,
    optimizers: tuple[torch.optim.Optimizer, ...],
    options: StateDictOptions | None = None,
) -> None:
    """Patch the ``state_dict`` and ``load_state_dict`` attributes of ``optimizers``.

    Patch the ``state_dict`` and ``load_state_dict`` attributes of ``optimizers`` to
    be a partial function to call ``get_state_dict`` and ``set_state_dict``.

    Note that if there are multiple optimizers, all of the optimizers will be patched.
    So users only need to call one of the state_dict() to get the full result.

    Args:
        model (nn.Module): the nn.Module to the model.
        options (StateDictOptions): the options to control how
            model state_dict and optimizer state_dict should be loaded. See
            `StateDictOptions` for the details.
    Returns:
        None
    """
    _state_dict_call = functools.partial(
        get_optimizer_state_dict, model=model, optimizers=optimizers, options=options
    )

    def state_dict_call():
        return _state_dict_call()

    _load_state_dict_call = functools.partial(
        set_optimizer_state_dict, model=model, optimizers=optimizers, options=options
    )

    def load_state_dict_call(state_dict: dict[str, Any]):
        _load_state_dict_call(optim_state_dict=state_dict)

    _mark_patched(state_dict_call)
    _mark_patched(load_state_dict_call)
    optimizers = (
        (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else tuple(optimizers)
    )
    for optim in optimizers:
        optim.state_dict = state_dict_call
        optim.load_state_dict = load_state_dict_call
