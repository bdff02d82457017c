"""Collectives inside the optimizer steps dcp_optim takes itself.

A template of an optimizer without a schema comes from a step of that
optimizer (``shadow.fallback_pristine``, or upstream's step on the real
optimizer, undone), run on each rank for the parameters that rank holds
no state for.  Some optimizers communicate in their step: Muon-like ones
gather each parameter's full tensor (``DTensor.full_tensor()``), Prodigy
and D-Adaptation all-reduce their sums under FSDP1, heavyball assigns
FSDP1 flat parameters to owner ranks and all-reduces their sizes.  Where
every rank takes the same step -- a fresh optimizer's template, every
rank without state -- those collectives meet and the step works.  Where
the ranks' needs differ (state on one rank only: heavyball's owners, an
FSDP1 rank whose piece of a parameter is empty, a step that raises on one
rank and is retried there), the rank taking the step waits in a
collective no other rank makes -- until the process group's timeout,
which breaks the group -- or meets another collective of the peers'
(dcp_optim's own agreement) with bytes of another meaning.

So while dcp_optim steps an optimizer, every collective the step issues
through ``torch.distributed`` or its functional collectives first meets
the other ranks of its group on the process group's store
(``consistency.meet_in_step``): it goes ahead only when every rank of the
group is at the same collective of its own step.  A rank found waiting at
dcp_optim's next meeting instead (it takes no step) fails the meeting at
once; otherwise the wait is bounded like an arrival.  The step then
raises ``StepCollectiveError`` and the template is refused as any other
that cannot be built, on every rank, by the call's agreement.

What is watched: the operators of the ``c10d``, ``_c10d_functional`` and
``_c10d_functional_autograd`` namespaces that the step calls itself (a
``TorchDispatchMode`` sees the calls made while it is active, not the
collectives a DTensor makes inside its own dispatch: a sum turned
replicated by a DTensor operator is not seen; that DTensor's ranks all
hold a piece of the parameter, and the same step on each issues the same
collectives).  Off on one process, on torch's fake process group, and
where ``DCP_OPTIM_ARRIVAL_TIMEOUT=0`` turns the bounded waits off.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["collectives_in_step"]

_NAMESPACES = frozenset(("c10d", "_c10d_functional", "_c10d_functional_autograd"))
# operators of those namespaces that move no data between ranks
_LOCAL = frozenset(("wait_tensor", "_wrap_tensor_autograd"))
# point-to-point operators: both sides meet as "p2p" (a send meets a recv)
_P2P = frozenset(("send", "recv_", "recv_any_source_"))


class _Lockstep(TorchDispatchMode):
    """Meets the group's ranks before each collective the step issues."""

    def __init__(self, optimizer: Any, bound: float):
        super().__init__()
        self.what = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}.step"
        self.bound = bound

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.compile skips frames under a mode that does not say so
        # (torchao's and heavyball's compiled steps then raise "found no
        # compiled frames"); compiled code runs without the mode, so a
        # collective inside a compiled graph is not watched
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = func._schema.name
        namespace, _, name = op.partition("::")
        if namespace in _NAMESPACES and name not in _LOCAL:
            ranks = _group_ranks(args, kwargs)
            if len(ranks) > 1:
                from . import consistency

                consistency.meet_in_step(ranks, "p2p" if name in _P2P else op, self.what, self.bound)
        return func(*args, **kwargs)


def _group_ranks(args: tuple, kwargs: dict) -> tuple[int, ...]:
    """The global ranks of the group an operator of the c10d namespaces
    runs on: its ProcessGroup argument (``c10d``), or the name of its
    group (the functional collectives); the default group where none
    resolves."""
    for value in (*args, *kwargs.values()):
        group = None
        if isinstance(value, dist.ProcessGroup):
            group = value
        elif isinstance(value, str):
            try:
                group = dist.distributed_c10d._resolve_process_group(value)  # type: ignore[arg-type]
            except Exception:  # noqa: BLE001 - not a group's name
                continue
        if group is not None:
            try:
                return tuple(dist.get_process_group_ranks(group))
            except Exception:  # noqa: BLE001 - a group outside the world's map
                break
    return tuple(range(dist.get_world_size()))


def collectives_in_step(optimizer: Any) -> contextlib.AbstractContextManager[Any]:
    """The context in which dcp_optim steps ``optimizer`` (a shadow or the
    real one): its collectives go ahead in lockstep with the other ranks
    or raise ``errors.StepCollectiveError`` (see the module's docstring)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return contextlib.nullcontext()
    if dist.get_backend() == "fake":
        return contextlib.nullcontext()
    # imported here: the meetings' module sits deep in the package's
    # import graph, and a step runs long after every module is loaded
    from . import consistency

    bound = consistency.arrival_bound()
    if bound is None:
        return contextlib.nullcontext()
    return _Lockstep(optimizer, bound)
