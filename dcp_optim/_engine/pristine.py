"""Pristine optimizer state: what a first step would create for trainable
parameters that have no state yet (D1, D2 in docs/differences.md), from
the optimizer's schema (``dcp_optim.schema``) or, without one, from a
shadow step.  Used by the optimizer getters (``optim``) and by FSDP1's
flat parameters (``fsdp1``).
"""

from __future__ import annotations

import warnings
from typing import Any, cast

import torch

from ..schema import OPTIMIZER_WIDE, PARAM, PARAM_DEVICE, fallback_pristine, schema_for
from .core import C

__all__ = ["pristine", "pristine_states"]

_Optimizer = torch.optim.Optimizer


def _specs(schema, optim: _Optimizer) -> list[list[tuple] | None]:
    out: list[list[tuple] | None] = []
    for group in optim.param_groups:
        specs = schema(optim, group)
        out.append([tuple(s) for s in specs] if specs else None)
    return out


def pristine_states(index: Any, optim: _Optimizer) -> dict[str, dict[str, Any]] | None:
    """Pristine state for every trainable parameter of ``optim`` without
    state, keyed by FQN, in param-group order (None if there is none)."""
    states = pristine(index, optim)[0]
    if states and OPTIMIZER_WIDE in states:
        states = {k: v for k, v in states.items() if k != OPTIMIZER_WIDE} or None
    return states


def pristine(
    index: Any, optim: _Optimizer
) -> tuple[dict[str, dict[str, Any]] | None, list[dict[str, Any]] | None]:
    """(pristine_states, group keys): the latter, for optimizers without a
    schema, lists per param group the keys a first step adds to the group
    (None when there are none)."""
    missing = C.optim_missing(index, optim)
    if not missing:
        return None, None
    schema = schema_for(optim)
    if schema is not None:
        return C.materialize_state(missing, _specs(schema, optim), PARAM, PARAM_DEVICE) or None, None
    # No schema: one step of a shadow optimizer (see schema.fallback_pristine).
    try:
        states, group_keys = fallback_pristine(optim, [p for p, _, _ in missing])
    except Exception as exc:  # noqa: BLE001 - reported, upstream's rule
        # a step that cannot run on copies (AdaHessian needs the loss'
        # graph): the parameters are returned as they are, without state
        # (upstream's getter returns them so once the optimizer holds any
        # state, and raises before)
        warnings.warn(
            f"dcp_optim could not build the pristine state of {type(optim).__qualname__}'s "
            f"parameters without state (its step raised {type(exc).__name__}: {exc}); they "
            "are returned without state. Declare the optimizer's schema with "
            "dcp_optim.register_optimizer_schema.",
            UserWarning,
            stacklevel=6,
        )
        return None, None
    out: dict[str, dict[str, Any]] = {}
    for param, _, fqn in missing:
        st = states.get(id(param))
        if st is not None:
            out[fqn] = st
    wide = cast(dict, states).get(OPTIMIZER_WIDE)
    if wide:
        # the optimizer-wide entries a first step creates, under a key no
        # FQN can be (the optimizer getter moves them, D29)
        out[OPTIMIZER_WIDE] = wide
    return out or None, (group_keys if any(group_keys) else None)
