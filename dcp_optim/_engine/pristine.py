"""Pristine optimizer state: what a first step would create for trainable
parameters that have no state yet (D1, D2 in docs/differences.md).

Routes, in order (docs/differences.md, D-entries on complete templates):

1. the optimizer's schema (``dcp_optim.schema``; a proxy such as
   accelerate's ``AcceleratedOptimizer`` uses the schema of the optimizer
   it wraps), plus LBFGS's optimizer-wide entry;
2. without one, a shadow step (``shadow.fallback_pristine``);
3. where the shadow step raises or leaves a trainable parameter without
   state, upstream's method: one step of the real optimizer with zero
   gradients, undone (``shadow.upstream_pristine``); its result is the
   template (it is what a real step creates);
4. where that raises too: ``errors.IncompleteTemplateError``.  Never an
   incomplete template with a warning.

Used by the optimizer getters (``optim``) and by FSDP1's flat parameters
(``fsdp1``).
"""

from __future__ import annotations

from typing import Any, cast

import torch

from .. import errors
from ..schema import PARAM, PARAM_DEVICE, lbfgs_pristine, proxied, schema_for
from .core import C
from .shadow import OPTIMIZER_WIDE, fallback_pristine, upstream_pristine
from .wide import step_created

__all__ = ["add_group_keys", "pristine", "pristine_states", "template_error"]

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


def add_group_keys(groups: list[dict[str, Any]], extra: list[dict[str, Any]] | None, mark: bool = False) -> None:
    """Adds the first-step group keys (``pristine``'s second value) to the
    (returned, never the live) groups of one optimizer; with ``mark``,
    their numbers marked as a first step's (a load drops those still
    marked, D48)."""
    if not extra or len(extra) != len(groups):
        return
    for group, keys in zip(groups, extra):
        for k, v in keys.items():
            if k not in group:
                group[k] = step_created(v) if mark else v


def template_error(
    optim: Any, what: str, shadow: BaseException | None, upstream: BaseException
) -> errors.IncompleteTemplateError:
    """The error of an optimizer whose template cannot be built."""
    cls = type(optim)
    name = f"{cls.__module__}.{cls.__qualname__}"
    tried = f"a shadow step raised {type(shadow).__name__}: {shadow}; " if shadow is not None else (
        "a shadow step left trainable parameters without state; ")
    return errors.IncompleteTemplateError(
        f"dcp_optim cannot build the state template of {name}'s {what}: {tried}one step of "
        f"the optimizer itself with zero gradients (upstream's method, undone) raised "
        f"{type(upstream).__name__}: {upstream}. A template without that state would make "
        f"dcp.load leave the checkpoint's state behind. Declare the state the optimizer's "
        f"first step creates with dcp_optim.register_optimizer_schema({cls.__qualname__}, fn)."
    )


def _is_lbfgs(optim: Any) -> bool:
    return isinstance(optim, torch.optim.LBFGS) and type(optim).step is torch.optim.LBFGS.step


def pristine(
    index: Any, optim: _Optimizer
) -> tuple[dict[str, dict[str, Any]] | None, list[dict[str, Any]] | None]:
    """(pristine_states, group keys): the latter, for optimizers without a
    schema, lists per param group the keys a first step adds to the group
    (None when there are none).  Raises ``errors.IncompleteTemplateError``
    where no route gives a complete template."""
    missing = C.optim_missing(index, optim)
    inner = proxied(optim)
    if _is_lbfgs(inner):
        return _lbfgs(index, inner), None
    if not missing:
        return None, None
    schema = schema_for(optim)
    if schema is not None:
        return C.materialize_state(missing, _specs(schema, optim), PARAM, PARAM_DEVICE) or None, None
    params = [p for p, _, _ in missing]
    shadow_error: BaseException | None = None
    try:
        states, group_keys = fallback_pristine(optim, params)
    except Exception as exc:  # noqa: BLE001 - the next route, then raised
        # without its traceback: its frames hold the shadow step's copies
        # of the parameters, which upstream's step must not meet
        shadow_error = exc.with_traceback(None)
    else:
        if any(id(p) not in states for p in params):
            # A trainable parameter without state: either the optimizer
            # keeps none for it (LoRA-RITE's 1-D parameters) or the shadow
            # step missed a condition a real step meets.  Upstream's step
            # on the real optimizer tells.
            try:
                real, real_keys = upstream_pristine(optim, params)
            except Exception:  # noqa: BLE001 - the shadow step's result stands
                real = None
            if real is not None and any(id(p) in real and id(p) not in states for p in params):
                states, group_keys = real, real_keys
    if shadow_error is not None:
        try:
            states, group_keys = upstream_pristine(optim, params)
        except Exception as exc:  # noqa: BLE001 - raised as the template error
            raise template_error(optim, "parameters without state", shadow_error, exc) from exc
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


def _lbfgs(index: Any, optim: torch.optim.LBFGS) -> dict[str, dict[str, Any]] | None:
    """LBFGS's optimizer-wide entry under its first parameter, when the
    optimizer holds none yet (schema.lbfgs_pristine)."""
    params = getattr(optim, "_params", None)
    if not params or optim.state.get(params[0]):
        return None
    slot = index.slot_of(params[0])
    if slot is None:
        return None
    entry = lbfgs_pristine(optim)
    return {index.tensor_fqns[slot][0]: entry} if entry else None
