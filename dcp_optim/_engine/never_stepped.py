"""Parameters a checkpoint saved without state: left without state on load.

An optimizer without a schema gets the template of a parameter that has
no state from a shadow step (``shadow.fallback_pristine``): the state
*after* one step with zero gradients.  For many optimizers that is not
what a fresh one holds before its first step -- Yogi's second moment has
been scaled once, PID's gradient buffer holds a zero gradient, Adan's
previous gradient is zero instead of the first real one.  A checkpoint
of such a parameter (a never-stepped optimizer's, or the template given
back) loaded as plain state would make the resumed first step differ
from the fresh optimizer's: silently.

So the getter marks those parameters in what it returns, in a way every
format, ``dcp.save`` and the broadcast's metadata carry (pickled values,
never tensors):

* nested: the parameter's name in its group's ``params`` list is a
  ``NeverSteppedName`` (a str);
* flattened: the numbers among its ``param_groups.<fqn>.<key>`` entries
  are ``NeverSteppedInt`` / ``NeverSteppedFloat``.

The keys the shadow step adds to a group (pytorch-optimizer's ``step``,
heavyball's ``base_lr`` and ``step_count``) are in the template too,
their numbers marked as a first step's (``dcp_optim.marks``'
``StepCreatedInt`` / ``StepCreatedFloat``, as D47's).

A template of a never-stepped optimizer holds the marks, and ``dcp.load``
replaces them with what the checkpoint holds: a trained checkpoint's
plain names and numbers (its state is loaded), or a never-stepped
checkpoint's marks.  A load installs no state for a marked parameter
(its first real step creates it, as in the fresh optimizer), drops the
group values still marked as a first step's, and in a group all of whose
parameters are marked also drops the values of keys the live group lacks
that no mark can carry (tensors, bools: heavyball's ``step_count``);
where every group is such a never-stepped one, the optimizer-wide
entries the live optimizer lacks are left out too (MADGRAD's ``k``).  The
marks never reach the optimizer: other numbers are installed plain.

Only the schema-less route is marked, and wrappers that keep their inner
optimizer's state (their step may read it: a schema's zeros are not "no
moment yet" to pytorch-optimizer's Magma), and only entries that hold
something (an optimizer that keeps no state for a parameter has nothing
to leave out): a schema's pristine state is what a first step of the
optimizer itself starts from, so loading it is already the fresh one.
For a wrapper all of whose groups are never stepped, its own entries
keep only the keys the live wrapper holds (``only_held``).
"""

from __future__ import annotations

from typing import Any

from ..marks import (
    NeverSteppedFloat,
    NeverSteppedInt,
    NeverSteppedName,
    StepCreatedFloat,
    StepCreatedInt,
)

__all__ = [
    "mark_flat",
    "mark_groups",
    "marked_in_view",
    "only_held",
    "plain_groups",
    "unmarked_groups",
]


def _number_mark(value: Any) -> Any:
    if type(value) is int:
        return NeverSteppedInt(value)
    if type(value) is float:
        return NeverSteppedFloat(value)
    return value


def _plain(value: Any) -> Any:
    if isinstance(value, NeverSteppedInt):
        return int(value)
    if isinstance(value, NeverSteppedFloat):
        return float(value)
    return value


def mark_groups(groups: list[Any], never: set[str], first: int = 0) -> None:
    """The groups from ``first`` on (returned by a getter; in place: each
    marked group is replaced by a copy) with the names in ``never``
    marked."""
    for i in range(first, len(groups)):
        group = groups[i]
        params = group.get("params") if isinstance(group, dict) else None
        if isinstance(params, list) and any(p in never for p in params):
            groups[i] = {**group, "params": [NeverSteppedName(p) if p in never else p for p in params]}


def mark_flat(flat: dict[str, Any], nested_groups: list[Any], never: set[str]) -> None:
    """The numbers among the flattened group entries of the names in
    ``never`` marked, in the flattened dict the getter built (one marked
    object per group and key: the format repeats a group's objects under
    each of its parameters)."""
    for group in nested_groups:
        if not isinstance(group, dict):
            continue
        marked: dict[str, Any] = {}
        for fqn in group.get("params", ()):
            if fqn not in never:
                continue
            for key in group:
                if key == "params":
                    continue
                flat_key = f"param_groups.{fqn}.{key}"
                if flat_key in flat:
                    if key not in marked:
                        marked[key] = _number_mark(flat[flat_key])
                    flat[flat_key] = marked[key]


def marked_in_view(view: tuple) -> set[str]:
    """The names a loaded view marks: in its groups' ``params`` (nested),
    or by a marked number in the group the parse made for the name
    (flattened: one group per name, without ``params``)."""
    groups, fqn_group = view[1], view[2]
    out = {str(p) for g in groups if isinstance(g, dict)
           for p in (g.get("params") or ()) if isinstance(p, NeverSteppedName)}
    for fqn, gi in fqn_group.items():
        group = groups[gi] if isinstance(gi, int) and 0 <= gi < len(groups) else None
        if isinstance(group, dict) and "params" not in group and \
                any(isinstance(v, (NeverSteppedInt, NeverSteppedFloat)) for v in group.values()):
            out.add(str(fqn))
    return out


def plain_groups(groups: list[Any]) -> list[Any]:
    """A new list of a loaded view's groups, the marked numbers plain (in
    new dicts: the view's may be the caller's)."""
    return [{k: _plain(v) for k, v in g.items()}
            if isinstance(g, dict) and any(isinstance(v, (NeverSteppedInt, NeverSteppedFloat)) for v in g.values())
            else g for g in groups]


def unmarked_groups(
    split_groups: list[Any], live_groups: list[Any], all_never: list[bool]
) -> tuple[list[Any], bool]:
    """The groups a load installs: without the numbers still marked as a
    first step's (``StepCreatedInt`` / ``StepCreatedFloat``: the template
    of a never-stepped group, not replaced by a trained checkpoint's), the
    marks' numbers plain, and in a never-stepped group (one that holds
    such a mark, or whose parameters are all marked: ``all_never``)
    without the other values -- tensors, bools, which cannot be marked --
    of keys the live group lacks (the marks' own numbers were made plain
    in the view, ``plain_groups``).  Second: whether every group is such a
    never-stepped one (the optimizer-wide entries a first step creates
    are then left out too: pytorch-optimizer's MADGRAD ``k``)."""
    out = []
    every = bool(split_groups)
    for i, group in enumerate(split_groups):
        if not isinstance(group, dict):
            out.append(group)
            every = False
            continue
        live = live_groups[i] if i < len(live_groups) and isinstance(live_groups[i], dict) else None
        # a never-stepped group: its first step's numbers are still marked
        # (the checkpoint's, or the template's), or all its parameters are
        drop = live is not None and ((i < len(all_never) and all_never[i]) or any(
            isinstance(v, (StepCreatedInt, StepCreatedFloat)) for v in group.values()))
        every = every and drop
        new = {}
        for k, v in group.items():
            if isinstance(v, (StepCreatedInt, StepCreatedFloat)):
                continue
            if drop and k not in live and k != "params" and not _is_number(v):  # type: ignore[operator]
                continue
            new[k] = v
        out.append(new)
    return out, every


def only_held(loaded: Any, held: Any) -> Any:
    """``loaded`` (an entry of a never-stepped wrapper's own state_dict())
    with, at any depth of dicts, only the keys ``held`` (the live
    wrapper's entry) has: what a first step created there is left out.  A
    new dict where anything goes, ``loaded`` itself otherwise."""
    if not isinstance(loaded, dict) or not isinstance(held, dict):
        return loaded
    out = {k: only_held(v, held[k]) for k, v in loaded.items() if k in held}
    return loaded if len(out) == len(loaded) and all(out[k] is loaded[k] for k in out) else out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
