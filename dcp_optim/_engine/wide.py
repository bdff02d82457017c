"""Optimizer-wide state (D29 in docs/differences.md): entries of
``optimizer.state`` keyed by a str, not by a parameter (MADGRAD's "k",
SPAM's counters, EmoNavi's "ema"), as the optimizer getters return them
and the loads put them back -- for plain, sharded and FSDP1 models alike;
and the top-level entries of an optimizer's own ``state_dict()`` besides
"state" and "param_groups" (``collect_extras``).
"""

from __future__ import annotations

import warnings
from typing import Any

from .. import errors
from ..marks import StepCreatedFloat, StepCreatedInt
from .shadow import OPTIMIZER_WIDE

# Entries of ``optimizer.state`` keyed by a str, not by a parameter
# (MADGRAD's "k", SPAM's counters, EmoNavi's "ema"): torch's own
# ``Optimizer.state_dict()`` keeps them under their key; upstream's getter
# raises KeyError.  Here they sit in "state" under the key
# ".optimizer_<o>" (o: the optimizer's position in the call), a dict of
# the optimizer's entries; flattened, "state..optimizer_<o>.<name>".  An
# FQN never starts with "." (module, parameter and buffer names are
# non-empty), so the key cannot name a parameter.

WIDE_PREFIX = ".optimizer_"


def wide_key(o: int) -> str:
    return f"{WIDE_PREFIX}{o}"


def wide_index(key: Any) -> int | None:
    """o for a key ".optimizer_<o>", else None."""
    if not isinstance(key, str) or not key.startswith(WIDE_PREFIX):
        return None
    digits = key[len(WIDE_PREFIX):]
    return int(digits) if digits.isdigit() and str(int(digits)) == digits else None


def copy_containers(value: Any) -> Any:
    """``value`` with its dicts, lists and tuples copied (tensors and
    other leaves kept): the returned or installed optimizer-wide entries
    never share a container with the live ones or the caller's."""
    if isinstance(value, dict):
        return {k: copy_containers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [copy_containers(v) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(copy_containers(v) for v in value)
    return value


def pop_wide(extra: dict[str, Any] | None) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(pristine state without the optimizer-wide entries a first step
    creates, those entries): pristine() hands them over under
    schema.OPTIMIZER_WIDE (the template of a never-stepped MADGRAD holds
    its "k")."""
    if not extra or OPTIMIZER_WIDE not in extra:
        return extra, {}
    rest = {k: v for k, v in extra.items() if k != OPTIMIZER_WIDE}
    return rest or None, dict(extra[OPTIMIZER_WIDE])


def add_wide(state: dict[str, Any], o: int, wide: dict[str, Any]) -> None:
    if not wide:
        return
    for name, value in wide.items():
        if _holds_non_str_keys(value):
            raise errors.StateDictKeyError(
                f"optimizer {o}'s optimizer-wide state {name!r} holds entries keyed by "
                "parameters or their positions (pytorch-optimizer's TRAC), which cannot be "
                "keyed by FQN (nor spelled in the flattened format); nothing is returned. "
                "Save this optimizer with its own state_dict()"
            )
    state[wide_key(o)] = copy_containers(wide)


def _holds_non_str_keys(value: Any) -> bool:
    if isinstance(value, dict):
        return any(not isinstance(k, str) or _holds_non_str_keys(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_holds_non_str_keys(v) for v in value)
    return False


def split_own_wide(osd: Any) -> tuple[Any, dict[str, Any]]:
    """(osd without the str-keyed entries of its "state", those entries):
    an optimizer's own ``state_dict()`` keyed by parameter IDs keeps its
    optimizer-wide entries beside them."""
    if not (isinstance(osd, dict) and "state" in osd and "param_groups" in osd) or not isinstance(osd["state"], dict):
        return osd, {}
    wide = {k: v for k, v in osd["state"].items() if isinstance(k, str)}
    if not wide:
        return osd, {}
    rest = {k: v for k, v in osd["state"].items() if not isinstance(k, str)}
    return {**osd, "state": rest}, wide


# torch's own layout of an optimizer's state_dict()
TORCH_LAYOUT = ("state", "param_groups")


def has_torch_layout(osd: Any) -> bool:
    """Whether an optimizer's ``state_dict()`` is laid out as torch's."""
    return isinstance(osd, dict) and all(k in osd for k in TORCH_LAYOUT)


# --- entries of an optimizer's own state_dict() that a step creates ------------
#
# heavyball's optimizers add a "heavyball" entry to their state_dict(),
# whose ``inner_group`` dict a step fills (SOAP's and PSGD's preconditioner
# schedule: ``cumulative_prob`` and its step count).  The template of a
# never-stepped optimizer holds that dict empty, and dcp.load fills only
# the keys a template holds: the schedule restarted, silently.  So while
# some parameter has no state, such a dict is completed with the keys a
# first step (a shadow step) creates, their numbers marked as created by
# that step (dcp_optim.marks: an int or float subclass; every format,
# dcp.save and the broadcast's metadata carry them, pickled).  A load drops the values
# still marked -- a never-stepped optimizer's own checkpoint, or the
# template given back -- so the optimizer gets the dict it had, and a
# checkpoint of a trained one fills them with its values.


def step_created(value: Any) -> Any:
    """``value`` (created by a first step) marked where it is a number; a
    dict's numbers at any depth; anything else as it is."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return StepCreatedInt(value)
    if isinstance(value, float):
        return StepCreatedFloat(value)
    if isinstance(value, dict):
        return {k: step_created(v) for k, v in value.items()}
    return value


def filled(held: Any, first: Any, added: Any = None) -> Any:
    """``held`` with the entries of ``first`` it lacks added (through
    ``added`` where given), at any depth of dicts; held values win.  A new
    dict where anything is added, ``held`` itself otherwise (never
    changed)."""
    if not isinstance(held, dict) or not isinstance(first, dict):
        return held
    out = {k: filled(v, first[k], added) if k in first else v for k, v in held.items()}
    out.update((k, v if added is None else added(v)) for k, v in first.items() if k not in held)
    return held if len(out) == len(held) and all(out[k] is v for k, v in held.items()) else out


def with_step_created(held: Any, first: Any) -> Any:
    """``held`` (a dict of an optimizer's own ``state_dict()`` entry) with
    the keys ``first`` (the same entry after a first step) has and it
    lacks, their numbers marked (``filled``)."""
    return filled(held, first, step_created)


def without_step_created(value: Any) -> Any:
    """``value`` without the dict entries whose values are still marked as
    created by a first step, at any depth of dicts; a new dict where
    anything goes, ``value`` itself otherwise (never changed)."""
    if not isinstance(value, dict):
        return value
    out = {k: without_step_created(v) for k, v in value.items()
           if not isinstance(v, (StepCreatedInt, StepCreatedFloat))}
    return value if len(out) == len(value) and all(out[k] is v for k, v in value.items()) else out


def collect_extras(optim: Any, osd: dict[str, Any], extras: dict[str, Any], stacklevel: int = 6) -> None:
    """Top-level entries of an optimizer's own ``state_dict()`` besides
    "state" and "param_groups" (StableSPAM's ``total_step``, Ranger21's
    ``lookahead_step``): kept at the top level of the returned dict, and
    given back to the optimizer's own ``load_state_dict`` on load
    (upstream drops them)."""
    for key, value in osd.items():
        if key in TORCH_LAYOUT:
            continue
        if key in extras:
            warnings.warn(
                f"optimizers share the top-level state_dict() key {key!r}: the "
                f"combined dict keeps the first one's, not {type(optim).__qualname__}'s "
                "(upstream keeps neither); get them one optimizer at a time to keep both",
                UserWarning,
                stacklevel=stacklevel,
            )
            continue
        extras[key] = value
