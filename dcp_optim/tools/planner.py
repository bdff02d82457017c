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
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint import DefaultLoadPlanner

from .._engine.core import C

__all__ = ["LoadPlanner", "is_empty_group_key"]


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


class LoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that lets empty-group hyperparameter keys be
    absent from the checkpoint (they then keep their current values)."""

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
        if not missing:
            return super().create_local_plan()
        # Plan over a copy without those keys; the loads themselves write
        # through self.state_dict (or the mappings into the caller's dict),
        # so the original goes back once the plan exists -- unless DCP's
        # pre-2.4 key fallback replaced it while planning.
        original = self.state_dict
        planned = {k: v for k, v in original.items() if k not in set(missing)}
        self.state_dict = planned
        try:
            return super().create_local_plan()
        finally:
            if self.state_dict is planned:
                self.state_dict = original
