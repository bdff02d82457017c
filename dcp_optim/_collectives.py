"""Data movement for sharded tensors, through torch.distributed only.

``gather_full_tensors`` turns DTensors into full tensors.  This first
version gathers one tensor at a time with ``full_tensor()`` (what upstream
does); bucketed, natively planned gathers replace it for sharded training.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024


def gather_full_tensors(
    leaves: list[Any], *, bucket_bytes: int | None = None, cpu_offload: bool = False
) -> list[Any]:
    out = []
    for t in leaves:
        if isinstance(t, ShardedTensor):
            from torch.distributed._state_dict_utils import _all_gather_sharded_tensor

            full = _all_gather_sharded_tensor(t)
            shards = t.local_shards()
            device = shards[0].tensor.device if shards else torch.device("cpu")
            out.append(full if full.device == device else full.to(device))
        elif isinstance(t, DTensor):
            out.append(t.full_tensor())
        else:
            out.append(t)
    return out
