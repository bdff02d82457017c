"""Post-load verification: sharding-independent checksums of every model
and optimizer state tensor, taken at save time and checked after a load.

::

    # save
    state = {"model": msd, "optim": osd,
             "checksums": dcp_optim.verify.checksums(model, optimizer)}
    dcp.save(state, checkpoint_id=path)

    # load (any world size / parallel layout)
    msd, osd = dcp_optim.get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd, "checksums": dcp_optim.verify.template()}
    dcp.load(state, checkpoint_id=path)
    dcp_optim.set_state_dict(model, optimizer, model_state_dict=state["model"],
                             optim_state_dict=state["optim"])
    dcp_optim.verify.verify(model, optimizer, state["checksums"])

The checksum of a logical tensor (a model FQN, or an optimizer state
``(FQN, state name)``) is a function of its *full* value and nothing else:
not of the sharding, world size, mesh, placements or device (the algorithm:
``dcp_optim._engine.checksums``).

Collectives: none without a process group; otherwise one ``all_reduce`` of
an int64 vector (16 bytes per sharded tensor, plus 3 words) over the
world when every DTensor's mesh spans all ranks (FSDP2, TP, HSDP, 2-D,
DDP and plain models).  With meshes on subsets of the ranks (pipeline
stages) it is one reduction per mesh dimension of each mesh, then one
world ``all_reduce`` of a flag.  Every rank must call ``checksums`` and
``verify`` (like ``get_state_dict``).

Which state is covered: the tensors (and Python int/float/bool values) of
``dcp_optim.get_state_dict(model, optimizers, options=...)`` -- always the
sharded form (``full_state_dict``, ``cpu_offload``,
``broadcast_from_rank0`` and ``flatten_optimizer_state_dict`` are ignored,
they do not change logical values); ``ignore_frozen_params`` and
``dsd_fqn_modifiers`` apply, so save and verify with the same options.
Param-group hyperparameters are not covered.  Legacy ``ShardedTensor``
state dicts (FSDP1) are not supported.

Pipeline stages (each rank holding different FQNs): every rank records
the entries it holds; the dict of rank 0 is what DCP keeps under a shared
key, so store one dict per stage (``state[f"checksums_stage{k}"]``).
``verify`` checks the entries this rank holds and ignores expected entries
of FQNs it does not hold.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

from .._engine import checksums as _checksums
from .._engine.checksums import FORMAT, ChecksumMismatchError, shard_lanes, tensor_checksum
from ..state_dict import get_model_state_dict, get_optimizer_state_dict, get_state_dict

__all__ = [
    "FORMAT",
    "ChecksumMismatchError",
    "checksums",
    "verify",
    "template",
    "tensor_checksum",
    "shard_lanes",
]

_GETTERS = (get_model_state_dict, get_optimizer_state_dict, get_state_dict)


def template() -> dict[str, Any]:
    """The load template of a checksums dict (for ``dcp.load``)."""
    return {"format": None, "entries": None}


def checksums(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None,
    *,
    options: Any = None,
) -> dict[str, Any]:
    """Checksums of every model and optimizer state tensor of ``model`` and
    ``optimizers`` (see the module docstring), as a small dict to store in
    the checkpoint next to the state::

        {"format": "dcp_optim.verify/1",
         "entries": [(section, fqn, state_name, shape, dtype, lo, hi), ...]}

    ``entries`` is one list (DCP stores it as a single object).  A
    collective when a process group is initialised: call it on every rank.
    """
    return _checksums.checksums(model, optimizers, options=options, getters=_GETTERS)


def verify(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None,
    expected: dict[str, Any],
    *,
    options: Any = None,
    sections: tuple[str, ...] = ("model", "optim"),
) -> int:
    """Recompute the checksums after a load and compare with ``expected``
    (from :func:`checksums` at save time).  Every rank raises the same
    :class:`ChecksumMismatchError` (a ``StateDictValueError``) naming the
    first differing FQN and state name, the number of differences and the
    ranks that found them.  Returns the number of entries checked.
    ``sections``: which entries to check ("model", "optim"); the ``set_*``
    functions pass what they loaded (``StateDictOptions.verify_checksums``).

    A collective when a process group is initialised: call it on every rank.
    """
    return _checksums.verify(
        model, optimizers, expected, options=options, sections=sections, getters=_GETTERS
    )
