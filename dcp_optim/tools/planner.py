"""A DCP load planner for flattened optimizer state across layouts.

dcp_optim stores the hyperparameters of an empty param group under reserved
keys anchored on a neighbouring group of the same optimizer
(``param_groups.<anchor>.__empty_group_after_<n>__.<key>``, see
``csrc/flat.c``).  When the layout changes -- other pipeline stages, other
optimizers per rank -- the groups that are empty change too, and a template
may ask for an empty group's keys that the checkpoint does not have.  DCP's
``DefaultLoadPlanner`` then fails with "Missing key in checkpoint
state_dict"; its ``allow_partial_load=True`` would also hide real gaps
(a missing state tensor would silently keep the template's pristine value).

``LoadPlanner`` is ``DefaultLoadPlanner`` with one difference: an
empty-group key absent from the checkpoint is left out of the plan, so that
group keeps the hyperparameters it was built with (it has no parameter, so
nothing else depends on them).  Every other missing key still fails.

    dcp.load(state, checkpoint_id=path, planner=dcp_optim.LoadPlanner())

Entries the template did not request.  DCP loads only the keys of the
state dict it is given; whatever else the checkpoint holds is left behind
without a word.  With an optimizer whose template is incomplete that is
state the resumed run silently restarts: a parameter trained and later
frozen (its state is not in a fresh optimizer's template), a wrapper's own
state (Lookahead's slow weights), optimizer-wide entries.  ``LoadPlanner``
records every checkpoint entry the state dict did not request in
``planner.unrequested`` ({checkpoint key: what it is}), and on request
warns, raises (on every rank, before anything is read), or loads them as
well, into ``planner.unrequested_state``::

    planner = dcp_optim.LoadPlanner(unrequested="raise")
    dcp.load(state, checkpoint_id=path, planner=planner)

``unrequested_entries(state_dict, checkpoint)`` gives the same report from
a checkpoint's metadata alone, before any load (docs/adoption.md,
"Nothing left behind").
"""

from __future__ import annotations

import io
import warnings
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

from .._engine.core import C

__all__ = [
    "LoadPlanner",
    "UnrequestedEntriesError",
    "describe_key",
    "is_empty_group_key",
    "unrequested_entries",
]

_ACTIONS = ("report", "warn", "raise", "load")


def is_empty_group_key(key: str) -> bool:
    """Whether ``key`` is one of dcp_optim's reserved empty-group keys:
    "...param_groups.<anchor>.__empty_group_after_<n>__.<key>",
    "...__empty_group_before_<n>__..." or
    "...param_groups.__optimizer_<o>_empty_group_<g>__.<key>", where DCP
    may prefix the app-state name ("optim.param_groups...").  Parsed by
    the C core's flat-key parser without FQNs (a DCP planner has none;
    docs/architecture.md, "Flat keys")."""
    if not isinstance(key, str):
        return False
    at = 0
    while (at := key.find("param_groups.", at)) != -1:
        if at == 0 or key[at - 1] == ".":
            parsed = C.parse_flat_key(key[at:], None)
            if parsed is not None and parsed[0] == "empty_group":
                return True
        at += 1
    return False


class UnrequestedEntriesError(RuntimeError):
    """The checkpoint holds entries the state dict did not request
    (``LoadPlanner(unrequested="raise")``).  ``entries``: {key: what it is}."""

    def __init__(self, message: str, entries: dict[str, str]):
        super().__init__(message)
        self.entries = entries

    def __reduce__(self):  # picklable (DCP gathers errors from every rank)
        return (type(self), (str(self.args[0]) if self.args else "", self.entries))


def describe_key(key: str, fqns: Any = None) -> str:
    """What a checkpoint key holds, from its spelling: optimizer state of
    a parameter, a param-group key, optimizer-wide state
    (``state..optimizer_<o>.<name>``, docs/differences.md#d29), an empty
    group's key, or another entry.  ``fqns``: parameter FQNs to read the
    flattened optimizer keys by (a set); without them a state key is
    described by its whole path."""
    known = fqns if isinstance(fqns, (set, frozenset)) else (set(fqns) if fqns else None)
    at = 0
    while True:
        hits = [i for i in (key.find("state.", at), key.find("param_groups.", at)) if i != -1]
        if not hits:
            return "an entry beside the optimizer's state and param groups (a model entry, a wrapper's own state, ...)"
        at = min(hits)
        if at == 0 or key[at - 1] == ".":
            rest = key[at:]
            if rest.startswith("state.."):
                wide = rest[len("state.."):].split(".", 1)
                return f"optimizer-wide state {wide[1]!r} of {wide[0]}" if len(wide) == 2 else "optimizer-wide state"
            parsed = C.parse_flat_key(rest, known)
            if parsed is not None:
                kind, fqn, name = parsed
                if kind == "state":
                    return f"optimizer state {name!r} of parameter {fqn!r}"
                if kind == "param_groups":
                    return f"param-group key {name!r} of parameter {fqn!r}"
                return f"key {name!r} of an empty param group"
            if rest.startswith("state."):
                return f"optimizer state {rest[len('state.'):]!r} (<parameter FQN>.<state name>)"
        at += 1


def _known_fqns(state_dict: Any, keys: set[str]) -> set[str]:
    """Parameter FQNs a state dict names: its keys without their first
    component ("model.0.weight" -> "0.weight") and the FQNs its
    optimizer param groups list."""
    out = {k.split(".", 1)[1] for k in keys if "." in k}

    def walk(obj: Any) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                if k == "params" and isinstance(v, (list, tuple)):
                    out.update(p for p in v if isinstance(p, str))
                else:
                    walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)

    walk(state_dict)
    return out


def _flat_keys(state_dict: dict[str, Any]) -> set[str]:
    """The keys DCP's default planners give ``state_dict`` (nested dicts
    and lists flattened)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return set(flatten_state_dict(state_dict)[0])


def _metadata(checkpoint: Any) -> Metadata:
    if isinstance(checkpoint, Metadata):
        return checkpoint
    read = getattr(checkpoint, "read_metadata", None)
    if read is None:
        from torch.distributed.checkpoint import FileSystemReader

        read = FileSystemReader(str(checkpoint)).read_metadata
    return read()


def unrequested_entries(state_dict: dict[str, Any], checkpoint: Any) -> dict[str, str]:
    """Every entry of ``checkpoint`` that ``dcp.load(state_dict, ...)``
    would not read, as {checkpoint key: what it is} (see describe_key),
    in the checkpoint's order.  ``checkpoint``: a checkpoint directory,
    a DCP ``StorageReader`` or its ``Metadata``.  Only the metadata is
    read; keys of ``state_dict`` follow DCP's flattening
    ("optim.state.<fqn>.<name>")."""
    wanted = _flat_keys(state_dict)
    fqns = _known_fqns(state_dict, wanted)
    return {
        key: describe_key(key, fqns)
        for key in _metadata(checkpoint).state_dict_metadata
        if key not in wanted
    }


class LoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that lets empty-group hyperparameter keys be
    absent from the checkpoint (they then keep their current values), and
    reports the checkpoint entries the state dict does not request.

    ``unrequested``: what to do about those entries -- "report" (only
    record them in ``self.unrequested``), "warn", "raise"
    (:class:`UnrequestedEntriesError` on every rank before anything is
    read) or "load" (read them too, as plain full tensors or objects,
    into ``self.unrequested_state`` keyed by checkpoint key; nothing of
    the state dict changes).  Further arguments go to
    ``DefaultLoadPlanner``."""

    def __init__(self, *args: Any, unrequested: str = "report", **kwargs: Any) -> None:
        if unrequested not in _ACTIONS:
            raise ValueError(f"unrequested must be one of {_ACTIONS}, got {unrequested!r}")
        super().__init__(*args, **kwargs)
        self.unrequested_action = unrequested
        self.unrequested: dict[str, str] = {}
        self.unrequested_state: dict[str, Any] = {}
        self.skipped_empty_group_keys: list[str] = []

    def create_local_plan(self) -> Any:
        # set_up_planner ran first (DefaultLoadPlanner's own check).
        if self.metadata is None:
            raise AssertionError("self.metadata is not None")
        saved = self.metadata.state_dict_metadata
        missing = [
            key
            for key in self.state_dict
            if key not in saved and is_empty_group_key(key)
        ]
        self.skipped_empty_group_keys = missing
        # The requested keys as DCP reads them (its pre-2.4 key fallback
        # may replace the flattened dict while planning: decided after).
        targets = self._unrequested_targets(saved)
        if not missing and not targets:
            plan = super().create_local_plan()
            self._note_unrequested(saved)
            return plan
        # Plan over a copy without those keys (and with the destinations of
        # the unrequested entries to load); the loads themselves write
        # through self.state_dict (or the mappings into the caller's dict),
        # so the original goes back once the plan exists -- unless DCP's
        # pre-2.4 key fallback replaced it while planning.
        original = self.state_dict
        skip = set(missing)
        planned = {k: v for k, v in original.items() if k not in skip}
        planned.update(targets)
        self.state_dict = planned
        try:
            plan = super().create_local_plan()
        finally:
            if self.state_dict is planned:
                self.state_dict = original
        self._note_unrequested(saved)
        return plan

    def _unrequested_targets(self, saved: dict[str, Any]) -> dict[str, Any]:
        """With ``unrequested="load"``: a destination for every entry the
        state dict does not request (an empty full tensor, or None for an
        object), kept in self.unrequested_state."""
        self.unrequested_state = {}
        if self.unrequested_action != "load":
            return {}
        targets: dict[str, Any] = {}
        for key, md in saved.items():
            if key in self.state_dict:
                continue
            if isinstance(md, BytesStorageMetadata):
                targets[key] = None
            else:
                targets[key] = torch.empty(md.size, dtype=md.properties.dtype)
                self.unrequested_state[key] = targets[key]
        return targets

    def _note_unrequested(self, saved: dict[str, Any]) -> None:
        requested = set(self.state_dict)
        unrequested = [k for k in saved if k not in requested]
        fqns = _known_fqns(self.original_state_dict, requested) if unrequested else None
        self.unrequested = {k: describe_key(k, fqns) for k in unrequested}
        if not self.unrequested or self.unrequested_action in ("report", "load"):
            return
        shown = list(self.unrequested.items())[:8]
        message = (
            f"the checkpoint holds {len(self.unrequested)} entries the state dict does not "
            "request, which this load leaves behind: "
            + "; ".join(f"{k} ({what})" for k, what in shown)
            + (" ..." if len(self.unrequested) > len(shown) else "")
            + ". Add them to the state dict (a complete optimizer template), or load them "
            "with dcp_optim.LoadPlanner(unrequested='load')"
        )
        if self.unrequested_action == "raise":
            raise UnrequestedEntriesError(message, dict(self.unrequested))
        warnings.warn(message, UserWarning, stacklevel=2)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        if self.unrequested_action == "load" and fqn in self.unrequested and fqn not in self.state_dict:
            self.unrequested_state[fqn] = torch.load(value, weights_only=False)
            return
        super().load_bytes(read_item, value)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        target = self.unrequested_state.get(index.fqn) if index.fqn not in self.state_dict else None
        if isinstance(target, torch.Tensor):
            return target
        return super().lookup_tensor(index)
