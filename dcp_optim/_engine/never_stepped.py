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
    "marked_names",
    "only_held",
    "partly_marked",
    "plain_groups",
    "unmark",
    "unmarked_dict",
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


def unmark(view: tuple, names: set[str]) -> tuple:
    """A loaded view whose ``names`` are no longer marked (their state is
    then loaded as it stands): a new view and new groups where a mark goes
    (the view's may be the caller's).  Nested, a marked name in a group's
    ``params`` becomes a plain str; flattened, the group the parse made
    for the name gets plain numbers (each name has its own there)."""
    groups, fqn_group = view[1], view[2]
    out = list(groups)
    for gi, group in enumerate(groups):
        if not isinstance(group, dict):
            continue
        params = group.get("params")
        if isinstance(params, list) and any(isinstance(p, NeverSteppedName) and p in names for p in params):
            out[gi] = {**group, "params": [str(p) if isinstance(p, NeverSteppedName) and p in names else p
                                           for p in params]}
    for fqn in names:
        gi = fqn_group.get(fqn)
        group = out[gi] if isinstance(gi, int) and 0 <= gi < len(out) else None
        if isinstance(group, dict) and "params" not in group:
            out[gi] = {k: _plain(v) for k, v in group.items()}
    return (view[0], out, *view[2:])


def partly_marked(never: set[str], units: list[list[str]]) -> set[str]:
    """The names in ``never`` (a checkpoint's marks) of ``units`` only
    some of whose names are marked.  A unit -- an FSDP1 flat parameter,
    the originals it holds -- is one optimizer entry: such a checkpoint
    (another layout's, where the originals were stepped apart) loads it
    whole, the marked originals' templates in their places, for leaving
    the entry out would drop the others' state."""
    partial: set[str] = set()
    for unit in units:
        marked = [f for f in unit if f in never]
        if marked and len(marked) < len(unit):
            partial.update(marked)
    return partial


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


_GROUPS = "param_groups."
_STATE = "state."


def marked_names(osd: dict[str, Any], flat: bool) -> set[str]:
    """The names a loaded state dict marks, read from the dict itself
    (loads that hand it to FSDP's own functions, which take no view):
    nested, in its groups' ``params``; flattened, by a marked number among
    a name's ``param_groups.<fqn>.<key>`` entries."""
    if not flat:
        return {str(p) for g in osd.get("param_groups", ()) if isinstance(g, dict)
                for p in (g.get("params") or ()) if isinstance(p, NeverSteppedName)}
    return {key[len(_GROUPS):].rpartition(".")[0] for key, value in osd.items()
            if isinstance(value, (NeverSteppedInt, NeverSteppedFloat)) and key.startswith(_GROUPS)}


def unmarked_dict(
    osd: dict[str, Any], flat: bool, never: set[str], live_of: dict[str, tuple[dict[str, Any], bool]]
) -> dict[str, Any]:
    """A new state dict, as a load through FSDP's own functions takes it:
    no state for the names in ``never``, no mark left (names and numbers
    plain), and each group as ``unmarked_groups`` leaves it.  ``live_of``:
    each name's live group and whether all of that group's parameters are
    in ``never``."""
    def unmarked(group: dict[str, Any], fqn: str | None) -> dict[str, Any]:
        live, all_never = live_of.get(fqn, (None, False)) if fqn is not None else (None, False)
        plain = {k: _plain(v) for k, v in group.items()}
        return unmarked_groups([plain], [live] if live is not None else [], [all_never])[0][0]

    if not flat:
        groups = []
        for group in osd.get("param_groups", ()):
            if not isinstance(group, dict):
                groups.append(group)
                continue
            params = [str(p) if isinstance(p, NeverSteppedName) else p for p in group.get("params") or ()]
            new = unmarked({k: v for k, v in group.items() if k != "params"}, params[0] if params else None)
            groups.append({**new, "params": params} if "params" in group else new)
        state = {k: v for k, v in osd.get("state", {}).items() if k not in never}
        return {**osd, "state": state, "param_groups": groups}
    by_name: dict[str, dict[str, Any]] = {}
    for key, value in osd.items():
        if key.startswith(_GROUPS):
            fqn, _, name = key[len(_GROUPS):].rpartition(".")
            by_name.setdefault(fqn, {})[name] = value
    out = {}
    for key, value in osd.items():
        if never and key.startswith(_STATE) and _of_names(key[len(_STATE):], never):
            continue
        if not key.startswith(_GROUPS):
            out[key] = value
    for fqn, group in by_name.items():
        for name, value in unmarked(group, fqn).items():
            out[f"{_GROUPS}{fqn}.{name}"] = value
    return out


def _of_names(rest: str, names: set[str]) -> bool:
    """Whether ``rest`` (``<fqn>.<state name>``, either dotted) is a state
    of one of ``names``."""
    parts = rest.split(".")
    return any(".".join(parts[:i]) in names for i in range(1, len(parts)))
