"""torch's ``ZeroRedundancyOptimizer`` (ZeRO-1 beside DDP), D36.

ZeRO partitions the parameters of its (global) ``param_groups`` among the
ranks; each rank steps its own partition with an inner optimizer at
``.optim``, which holds the state of that partition only.  The wrapper's
own ``state`` stays empty.  Its ``state_dict()`` is the state gathered by
the last ``consolidate_state_dict(to=rank)`` (a copy taken then), keyed
by global parameter index over the wrapper's groups; its
``load_state_dict`` takes such an index-keyed dict and installs, on each
rank, the state of the parameters that rank owns.

Upstream reads the wrapper's empty ``state`` as "never stepped" and runs
its initialising step, a real step of the inner optimizer (the moments
decay, ``step`` advances) which on one rank alone waits for the others in
ZeRO's broadcast; it returns the consolidated copy however old; and its
load hands ZeRO's ``load_state_dict`` a dict keyed by FQN, which raises
``TypeError``.  Here:

* get: the consolidated dict, re-keyed by FQN, after checking it is not
  older than the state this rank's partition holds; without a consolidated
  copy (where ZeRO's ``state_dict()`` raises), this rank's partition
  (:func:`state_dict`); trainable parameters without state get the state
  their first step creates, computed for the inner optimizer's class
  (:func:`standin`), never by stepping ZeRO;
* set: validated as for a plain optimizer of the inner class over ZeRO's
  groups (:func:`held_standin`), installed through ZeRO's own
  ``load_state_dict`` with the dict keyed by global index
  (:func:`index_keyed`); the state of parameters other ranks own is not
  required (:func:`without_other_partitions`).
"""

from __future__ import annotations

import collections
import weakref
from typing import Any

import torch
import torch.distributed as dist

from .. import errors
from ..schema import proxied
from .consistency import mesh_for_group
from .values import same_value

__all__ = [
    "is_zero",
    "check_supported",
    "check_not_wrapped",
    "agreement_mesh",
    "check_fresh",
    "consolidated",
    "state_dict",
    "owned",
    "in_partition",
    "without_other_partitions",
    "inner",
    "standin",
    "held_standin",
    "index_keyed",
]

_ZERO = ("torch.distributed.optim.zero_redundancy_optimizer", "ZeroRedundancyOptimizer")


def is_zero(optim: Any) -> bool:
    """Whether ``optim`` is a ``ZeroRedundancyOptimizer`` (or a subclass)."""
    cls = type(optim)
    found = _ZERO_CLASSES.get(cls)
    if found is None:
        # by name: torch.distributed.optim is not imported for every call
        found = _ZERO_CLASSES[cls] = any((c.__module__, c.__qualname__) == _ZERO for c in cls.__mro__)
    return found


# class -> whether it is ZeRO; weak: a class defined and dropped (tests)
# is not kept alive
_ZERO_CLASSES: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


def check_supported(optim: Any, position: int) -> None:
    """ZeRO with ``overlap_with_ddp=True`` steps a functional optimizer
    inside DDP's communication hook: its state is no ``torch.optim``
    optimizer's, and no template of it can be built here."""
    if getattr(optim, "_overlap_with_ddp", False):
        raise errors.HeldOptimizerStateError(
            f"optimizer {position} (ZeroRedundancyOptimizer) was built with "
            "overlap_with_ddp=True: the state of its partition lives in a functional "
            "optimizer inside DDP's communication hook, which dcp_optim cannot key by "
            "FQN or give a template of. Nothing is returned. Save and load it with "
            "consolidate_state_dict() + state_dict() and load_state_dict()",
            type(optim).__qualname__,
            "optim",
        )


def inner(optim: Any) -> torch.optim.Optimizer:
    """The inner optimizer stepping this rank's partition."""
    return optim.optim


def check_not_wrapped(optim: Any, position: int) -> None:
    """A proxy of a ZeroRedundancyOptimizer (torch's PostLocalSGDOptimizer
    or accelerate's AcceleratedOptimizer around one) shares ZeRO's empty
    ``state``: its templates would be taken for the whole state, and its
    own ``state_dict()`` holds entries of its own beside ZeRO's.  Refused
    by name (a step of it, upstream's initialising one, communicates)."""
    held = proxied(optim)
    if held is not optim and is_zero(held):
        cls = type(optim).__qualname__
        raise errors.HeldOptimizerStateError(
            f"optimizer {position} ({cls}) wraps a ZeroRedundancyOptimizer: dcp_optim reads "
            "ZeRO's partitions from the ZeroRedundancyOptimizer itself, not through a "
            f"wrapper. Nothing was read or changed. Pass the ZeroRedundancyOptimizer, and "
            f"save {cls}'s own entries apart",
            cls,
            "optim" if hasattr(optim, "optim") else "optimizer",
        )


def agreement_mesh(optimizers: Any) -> tuple[bool, Any]:
    """(whether a ZeroRedundancyOptimizer takes part, the mesh its ranks
    agree on: None for the default group).  Every rank of ZeRO's process
    group steps and loads with it, so a load into one agrees there like a
    sharded load into DTensors: a partition that fails its checks on one
    rank fails the load on every rank (DCP's flow validates each rank's
    own partition)."""
    for optim in optimizers or ():
        if is_zero(optim):
            group = getattr(optim, "process_group", None)
            if group is None or group is dist.group.WORLD or group is dist.distributed_c10d._get_default_group():
                return True, None
            device = getattr(optim, "_default_device", torch.device("cpu"))
            return True, mesh_for_group(group, torch.device(device).type)
    return False, None


def _flat_params(optim: Any) -> list[torch.Tensor]:
    """ZeRO's global parameter order: its indices (``_param_to_index``)."""
    return [p for group in optim.param_groups for p in group["params"]]


def _scalars(entry: dict[Any, Any]) -> list[tuple[Any, Any]]:
    return [
        (k, v) for k, v in entry.items()
        if not isinstance(v, torch.Tensor) or v.dim() == 0
    ]


def _entry_changed(saved: dict[Any, Any], live: dict[Any, Any]) -> bool:
    """Whether a partition's live state entry moved on from the copy
    consolidated earlier: a counter or other scalar moved (every stepping
    torch optimizer keeps ``step``), or, for entries with no scalar (SGD's
    ``momentum_buffer``), any tensor."""
    if saved.keys() != live.keys():
        return True
    scalars = _scalars(live)
    if scalars:
        return any(not same_value(saved[k], v) for k, v in scalars)
    return any(not same_value(saved[k], v) for k, v in live.items())


def check_fresh(optim: Any, position: int) -> None:
    """Raises ``StaleOptimizerStateError`` where this rank's partition
    holds state that moved on since ``consolidate_state_dict`` copied it:
    ZeRO's ``state_dict()`` would return the old copy beside the current
    parameters (upstream saves it)."""
    consolidated = getattr(optim, "_all_state_dicts", None)
    rank = getattr(optim, "rank", None)
    if not consolidated or not isinstance(rank, int) or rank >= len(consolidated):
        return
    saved = consolidated[rank].get("state", {})
    live = optim.optim.state_dict().get("state", {})
    stale = sorted(set(saved) ^ set(live), key=repr)
    if not stale:
        stale = [i for i, entry in live.items() if _entry_changed(saved[i], entry)]
    if not stale:
        return
    local = stale[0]
    names = sorted(map(str, live.get(local, saved.get(local, {}))))
    raise errors.StaleOptimizerStateError(
        f"optimizer {position} (ZeroRedundancyOptimizer) on rank {rank}: the state its "
        f"state_dict() returns was consolidated before the state this rank holds changed "
        f"(parameter {local} of this rank's partition, state {names}; "
        f"{len(stale)} parameter(s) differ). Saving it would pair the current parameters "
        "with older optimizer state. Nothing is returned. Call "
        "consolidate_state_dict(to=...) on every rank again right before this call",
        position,
    )


def consolidated(optim: Any) -> bool:
    """Whether ``consolidate_state_dict`` left a copy on this rank."""
    return bool(getattr(optim, "_all_state_dicts", None))


def state_dict(optim: Any, position: int, full: bool) -> tuple[dict[str, Any], set[int] | None]:
    """What the getter keys by FQN, with the ids of the parameters whose
    state it may hold (None: all of them).

    * Consolidated on this rank: ZeRO's own ``state_dict()`` -- the whole
      state, exactly upstream's -- after :func:`check_fresh`;
    * not consolidated (where ZeRO's ``state_dict()`` and upstream raise):
      this rank's partition, the live state of its inner optimizer keyed by
      global index, with ZeRO's global groups.  Every rank calling the
      getter (DCP's flow) together returns the whole state, each entry
      once, with no gather; a load takes it at any world size.  A full
      state dict (``full``) is the consolidated one: without it, ZeRO's
      own error, as upstream."""
    if consolidated(optim) or full:
        osd = optim.state_dict()
        check_fresh(optim, position)
        return osd, None
    params = _flat_params(optim)
    index = {id(p): i for i, p in enumerate(params)}
    live = optim.optim.state
    state = {
        index[id(p)]: live[p] for p in params
        if id(p) in index and p in live and live[p]
    }
    groups = torch.optim.Optimizer.state_dict(optim)["param_groups"]
    return {"state": state, "param_groups": groups}, owned(optim)


def owned(optim: Any) -> set[int]:
    """The ids of the parameters of this rank's partition."""
    return {id(p) for group in optim.optim.param_groups for p in group["params"]}


def _fqns(index: Any, params: list[Any]) -> set[str]:
    """The FQNs of ``params`` in the model index."""
    out: set[str] = set()
    for p in params:
        slot = index.slot_of(p)
        if slot is not None:
            out.update(index.tensor_fqns[slot])
    return out


def in_partition(index: Any, extra: dict[str, Any], param_ids: set[int]) -> dict[str, Any] | None:
    """Pristine entries (keyed by FQN) of this rank's partition only: the
    other ranks return the others'."""
    keep = _fqns(index, [p for p in index.tensors if id(p) in param_ids])
    return {k: v for k, v in extra.items() if k in keep} or None


def without_other_partitions(index: Any, optimizers: tuple[Any, ...], missing: list[str]) -> list[str]:
    """``missing`` (FQNs a load gives no state) without the parameters of
    other ranks' partitions: ZeRO's load keeps this rank's partition only,
    and DCP's flow reads each rank's partition (:func:`state_dict`)."""
    others: set[str] = set()
    for optim in optimizers:
        if is_zero(optim):
            mine = owned(optim)
            others |= _fqns(index, [p for p in _flat_params(optim) if id(p) not in mine])
    return [fqn for fqn in missing if fqn not in others]


def _copy_inner(optim: Any, groups: list[dict[str, Any]], state: dict[Any, Any]) -> Any:
    """A shallow copy of ZeRO's inner optimizer (its class: the schema and
    any shadow step are that class's) over ``groups`` holding ``state``;
    never stepped itself, never installed into."""
    # (not copy.copy: Optimizer.__getstate__ keeps three attributes only)
    inner = object.__new__(type(optim.optim))
    inner.__dict__.update(optim.optim.__dict__)
    inner.param_groups = groups
    inner.state = collections.defaultdict(dict, state)
    return inner


def _groups(optim: Any) -> list[dict[str, Any]]:
    return [{**group, "params": list(group["params"])} for group in optim.param_groups]


def standin(optim: Any, osd: dict[str, Any]) -> Any:
    """The inner optimizer's class over ZeRO's global groups, holding the
    consolidated state of ``osd`` (ZeRO's own ``state_dict()``): what the
    getter keys by FQN and completes with pristine state."""
    params = _flat_params(optim)
    state = {
        params[i]: entry for i, entry in osd.get("state", {}).items()
        if isinstance(i, int) and 0 <= i < len(params) and isinstance(entry, dict) and entry
    }
    return _copy_inner(optim, _groups(optim), state)


def held_standin(optim: Any) -> Any:
    """The inner optimizer's class over ZeRO's global groups, holding the
    state this rank's partition holds (the live tensors): what a load is
    validated against."""
    return _copy_inner(optim, _groups(optim), dict(optim.optim.state))


def index_keyed(split: dict[str, Any], extras: dict[str, Any] | None) -> dict[str, Any]:
    """A validated FQN-keyed load for ZeRO's own ``load_state_dict``: keyed
    by global index, as its ``state_dict()`` keys it (a fresh dict: that
    load overwrites the entries of parameters other ranks own)."""
    position: dict[Any, int] = {}
    groups = []
    for group in split["param_groups"]:
        ids = []
        for fqn in group["params"]:
            ids.append(position.setdefault(fqn, len(position)))
        groups.append({**group, "params": ids})
    odd = [key for key in split["state"] if key not in position]
    if odd:
        # optimizer-wide entries (D29): ZeRO's load looks every key up as
        # a parameter index
        raise errors.StateDictKeyError(
            f"the optimizer state dict holds the optimizer-wide entry {odd[0]!r} for a "
            "ZeroRedundancyOptimizer, which "
            "is no parameter's state: ZeRO's load_state_dict takes parameter state only "
            "(keyed by index). Nothing was loaded"
        )
    state = {position[key]: entry for key, entry in split["state"].items()}
    return {**(extras or {}), "state": state, "param_groups": groups}
