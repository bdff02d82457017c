"""A module's or optimizer's own ``state_dict`` / ``load_state_dict``,
past the patches that upstream's ``_patch_*_state_dict`` and ours install.

A leaf of ``_engine``: the model, optimizer and FSDP1 paths all call
objects' own methods through :func:`state_dict_fn`, and none of them
imports another for it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

__all__ = ["PATCH_MARK", "is_patched", "state_dict_fn"]

# Marks the closures _patch_*_state_dict installs (D17 in docs/differences.md: a marker on the
# function instead of upstream's ever-growing registry of closures, which
# keeps every patched model alive).
PATCH_MARK = "_dcp_optim_patched"


def is_patched(call: Any) -> bool:
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
    if is_patched(call):
        call = functools.partial(getattr(type(obj), api), self=obj)
    return call
