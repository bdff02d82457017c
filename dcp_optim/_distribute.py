"""Loading full state dicts into (possibly sharded) models.

``distribute_model_state_dict``: every rank holds the full dict; each rank
slices its own shard locally, with no communication.
``broadcast_model_state_dict``: only rank 0 holds it; the data is streamed
to the other ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ._core import C, context


def _local_slice(full: torch.Tensor, local: DTensor) -> DTensor:
    """The shard of ``full`` that ``local`` (a DTensor) holds on this rank."""
    shape, offset = compute_local_shape_and_global_offset(
        full.shape, local.device_mesh, local.placements
    )
    slices = tuple(slice(o, o + s) for s, o in zip(shape, offset))
    piece = full[slices].detach()
    if local.is_meta:
        # assign=True will install the piece itself: do not let it keep
        # the whole full tensor alive through a view.
        piece = piece.clone()
    # A new DTensor, not a copy into the live one: nothing is written to
    # the model before load_state_dict validated the whole dict.
    return DTensor.from_local(
        piece,
        local.device_mesh,
        local.placements,
        shape=local.shape,
        stride=local.stride(),
        run_check=False,
    )


def distribute_model_state_dict(
    full: dict[str, Any], local: dict[str, Any], device: torch.device
) -> dict[str, Any]:
    merged, jobs = C.full_load_merge(context(), full, local, device)
    for key, full_tensor, local_tensor in jobs:
        merged[key] = _local_slice(full_tensor.detach().to(device), local_tensor)
    return merged


def broadcast_model_state_dict(
    full: dict[str, Any],
    local: dict[str, Any],
    device: torch.device,
    *,
    strict: bool,
    cpu_offload: bool,
) -> dict[str, Any]:
    from torch.distributed._state_dict_utils import _broadcast_state_dict

    private = dict(full)
    _broadcast_state_dict(
        private, local, device=device, strict=strict, cpu_offload=cpu_offload
    )
    private.update(local)
    return private


def full_optim_to_local(model, optimizers, osd, info):
    """A full optimizer state dict as the local optimizers need it.

    Without sharded parameters and without broadcasting, full and local
    state are the same; sharded and broadcast loads are handled by the
    sharding layer."""
    from torch.distributed.tensor import DTensor as _DT

    sharded = any(isinstance(t, _DT) for t in info.index.tensors)
    if not sharded and not info.broadcast_from_rank0:
        return osd
    from ._sharded_optim import full_optim_to_local as impl

    return impl(model, optimizers, osd, info)
