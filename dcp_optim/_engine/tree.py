"""Post-processing of state-dict trees: full gathers, CPU offloading, and
the nesting of flattened keys' dotted paths (:func:`insert_path`).

The containers are copied natively (``tree_leaves`` / ``tree_rebuild``);
tensors are processed all at once, so a full gather can move many DTensors
per collective (see ``collectives``) instead of one blocking collective
per tensor as upstream does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .. import errors
from .core import C, context

_CPU = torch.device("cpu")


def gather_state_dict(
    state_dict: dict[str, Any],
    *,
    cpu_offload: bool = False,
    ranks_only: tuple[int, ...] = (),
    type_check: bool = True,
    bucket_bytes: int | None = None,
) -> dict[str, Any]:
    """Upstream's ``_gather_state_dict``: every DTensor (and ShardedTensor)
    becomes a full plain tensor; containers are rebuilt as plain dicts,
    lists and tuples.  Ranks not in ``ranks_only`` (when given) get ``{}``
    but take part in every collective."""
    ctx = context()
    leaves = C.tree_leaves(ctx, state_dict, type_check)
    from .collectives import gather_full_tensors

    keep = not ranks_only or dist.get_rank() in ranks_only
    full = gather_full_tensors(
        leaves,
        bucket_bytes=bucket_bytes,
        cpu_offload=cpu_offload,
        keep=keep,
        options_key=(cpu_offload, tuple(ranks_only)),
        names_fn=lambda: C.tree_paths(ctx, state_dict),
    )
    if not keep:
        return {}
    if cpu_offload:
        full = C.tensors_to(full, _CPU)
    return C.tree_rebuild(ctx, state_dict, full, type_check)


def offload_state_dict_to_cpu(
    state_dict: dict[str, Any], *, type_check: bool = True
) -> dict[str, Any]:
    """Upstream's ``_offload_state_dict_to_cpu``: ``.to("cpu")`` for every
    tensor (no copy for tensors already there; DTensors stay DTensors)."""
    ctx = context()
    leaves = C.tree_leaves(ctx, state_dict, type_check)
    return C.tree_rebuild(ctx, state_dict, C.tensors_to(leaves, _CPU), type_check)


def maybe_full_or_cpu_state_dict(state_dict: dict[str, Any], info: Any) -> dict[str, Any]:
    if info.full_state_dict:
        ranks_only = (
            ()
            if (not info.cpu_offload or not dist.is_initialized())
            else (0,)
        )
        return gather_state_dict(
            state_dict, cpu_offload=info.cpu_offload, ranks_only=ranks_only
        )
    if info.cpu_offload:
        return offload_state_dict_to_cpu(state_dict)
    return state_dict


def insert_path(root: dict[str, Any], path: str, value: Any, key: str, what: str) -> None:
    """Store ``value`` at the dotted ``path`` under ``root``, creating the
    dicts between (the flattened format's nesting of state names).  A
    part that already holds a non-dict, or a leaf that already holds a
    dict, is a collision: ``errors.StateDictValueError`` naming the
    flattened ``key`` and ``what`` it nests under (e.g. "state value")."""
    parts = path.split(".")
    node = root
    for part in parts[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise errors.StateDictValueError(
                f"flattened optimizer key {key!r} nests under a non-dict {what}"
            )
        node = nxt
    if isinstance(node.get(parts[-1]), dict):
        raise errors.StateDictValueError(
            f"flattened optimizer key {key!r} collides with nested {what}s under the same name"
        )
    node[parts[-1]] = value
