"""The load pipeline: the interface every part of a load implements.

A set call loads up to two parts, the optimizers' (``optim.OptimLoad``)
and the model's (``model.ModelLoad``).  Each runs in four phases, and
``state_dict._run_load`` agrees with the other ranks between them, so that
every check of every rank is agreed on before any data moves and before
anything is installed:

``plan()``          local checks and planning; returns what the source rank
                    broadcasts on broadcast loads (``SourceMeta``), or None;
``validate(meta)``  the validation of the whole load, given the source's
                    metadata (on loads that are not broadcast: the part's
                    own ``plan()`` result);
``move()``          the data movement (local slicing, the broadcast stream,
                    FSDP1's exchange) and the checks made on the moved data;
                    returns what ``commit`` installs (``Prepared``), having
                    installed nothing;
``commit(p)``       installs ``p``; cannot fail on bad input; returns the
                    part's report.  Where torch's own load decides (a
                    module's load rules or hooks: ``can_fail``), it can
                    still raise, on some ranks only: the ranks then agree
                    on the outcome and every rank that committed puts
                    back what it changed (``rollback``).

``run_alone`` drives one part without agreement (a single caller).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch.nn.modules.module import _IncompatibleKeys

__all__ = ["LoadPart", "Prepared", "Report", "SourceMeta", "run_alone"]

# What the source rank of a broadcast load sends the others: the tree of
# (shape, dtype) of its dict (model), or that with the optimizer's groups
# and its extra top-level entries (optimizer).  Opaque to the pipeline.
SourceMeta = Any

# missing_keys / unexpected_keys of one part (None: the optimizer's report
# of a load the optimizers' own load_state_dict ran).
Report = _IncompatibleKeys | None


class Prepared(NamedTuple):
    """What a part installs at commit: ``install()`` (which returns the
    model's report) and the report known before it runs (the optimizer's),
    or None."""

    install: Callable[[], Any]
    report: Report = None


class LoadPart(Protocol):
    """One part of a load (see the module's docstring)."""

    name: str
    # whether commit can fail (torch's own load with a module's hooks): then
    # the ranks agree on its outcome, and roll back where another failed
    can_fail: bool
    # exceptions of commit raised inside collectives of torch's own code
    # (FSDP1's load hooks), where the ranks are not all at one agreement:
    # relayed through the store instead (state_dict._raise_relayed)
    fatal: list[BaseException]
    # its commit makes collectives of torch's own code (FSDP1's load hooks
    # gather every flat parameter): a failure there can come on some ranks
    # only and midway, so the commit is staged even where no rank's part
    # is fallible, and put back when it raises
    collective_commit: bool

    def plan(self) -> SourceMeta | None: ...

    def validate(self, meta: SourceMeta | None) -> None: ...

    def move(self) -> Prepared: ...

    def commit(self, prepared: Prepared) -> Report: ...

    def stage(self) -> None: ...

    def rollback(self) -> None: ...

    def abort(self) -> None: ...

    # after validate on broadcast loads: a digest of which tensors move by
    # scatter (the ranks agree on it before data moves) ...
    def stream_paths(self) -> int: ...

    # ... and, where the ranks' digests differ, every tensor is broadcast
    def broadcast_all(self) -> None: ...

    # before that agreement: the stream's plan and allocations, so that a
    # rank that cannot make them fails there, with every rank
    def reserve(self) -> None: ...

    # small broadcast loads (``payload``): on the source, the tree whose
    # tensors travel with the metadata (None: nothing to send) ...
    def inline_values(self) -> Any: ...

    # ... and, on every rank, that tree as received: ``move`` then slices
    # it locally, with no collective and nothing written before commit
    def take_inline(self, values: Any) -> None: ...


def run_alone(part: LoadPart, info: Any) -> Prepared:
    """Plan, validate and move ``part`` without agreeing with other ranks;
    on broadcast loads the source's metadata travels by one object
    broadcast.  Returns what commit installs."""
    with torch.no_grad():
        meta = part.plan()
        if info.broadcast_from_rank0 and dist.is_initialized():
            from .distribute import route_for

            meta = route_for(info.index, None).broadcast_object(meta)
        part.validate(meta)
        return part.move()
