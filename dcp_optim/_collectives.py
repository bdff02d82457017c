"""Data movement for sharded tensors, through torch.distributed only.

Full gathers are planned natively (``plan_gather``): DTensors are grouped by
device mesh, every rank's shard geometry is computed from the mesh and the
placements (uneven and strided shards included), and the tensors are packed
into byte buckets.  Each bucket costs one ``all_gather_into_tensor`` per
mesh dimension of size > 1 (one for FSDP2's 1-D mesh), instead of upstream's
blocking collective per tensor.  Peak extra memory is one gathered bucket
on top of the results.

The bucket budget is the size of a *gathered* bucket in bytes.  It defaults
to 256 MiB and can be changed with :func:`set_bucket_bytes` or the
``DCP_OPTIM_BUCKET_MB`` environment variable (read at import).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ._consistency import check_agreement
from ._core import C

__all__ = ["bucket_bytes", "set_bucket_bytes", "gather_full_tensors"]

# 256 MiB: large enough that collective latency is amortised (a gloo or
# NCCL all-gather reaches its bandwidth well below this size), small enough
# to stay a small fraction of a GPU's or host's memory.
_DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024
_bucket_bytes = int(float(os.environ.get("DCP_OPTIM_BUCKET_MB", "0")) * 2**20) or _DEFAULT_BUCKET_BYTES

_PLACEMENT_CLASSES = (Shard, _StridedShard, Replicate)
_CPU = torch.device("cpu")

def _all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
    # torch 2.13 renamed all_gather_into_tensor (which now warns) to
    # all_gather_single; older releases only have the former.  Looked up
    # per call so that tools wrapping torch.distributed see the calls.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def bucket_bytes() -> int:
    """The current bucket budget in bytes."""
    return _bucket_bytes


def set_bucket_bytes(nbytes: int) -> int:
    """Set the bucket budget (bytes); returns the previous value."""
    global _bucket_bytes
    if int(nbytes) < 1:
        raise ValueError("bucket size must be positive")
    previous, _bucket_bytes = _bucket_bytes, int(nbytes)
    return previous


def _mesh_device(mesh) -> torch.device:
    return torch.device(mesh.device_type)


def gather_full_tensors(
    leaves: list[Any],
    *,
    bucket_bytes: int | None = None,
    cpu_offload: bool = False,
    keep: bool = True,
    options_key: Any = None,
    names_fn: Callable[[], list[str]] | None = None,
) -> list[Any]:
    """Full tensors for a list of tensor leaves (plain tensors unchanged).

    Every rank holding a shard must call this with the same DTensors (same
    meshes, shapes and placements, in the same order): that is checked
    first, per mesh, with one small object all-gather (``options_key``
    joins the check; ``names_fn`` names the leaves if it fails).  With
    ``keep=False`` this rank takes part in the collectives but assembles
    nothing (the ``cpu_offload`` rank-0-only mode).
    """
    results = list(leaves)
    budget = bucket_bytes or _bucket_bytes
    offload = _CPU if cpu_offload else None
    plans = C.plan_gather(leaves, DTensor, _PLACEMENT_CLASSES, budget)
    for mesh, _, signature, leaf_indices in plans:
        check_agreement(
            mesh,
            "sharded tensors to gather",
            (options_key, budget, signature),
            lambda: _details(signature, leaf_indices, names_fn, options_key, budget),
        )
    for mesh, buckets, _, _ in plans:
        if not buckets:
            continue
        device = _mesh_device(mesh)
        dims = [d for d, size in enumerate(mesh.shape) if size > 1]
        # Buffers allocated once per mesh and reused by every bucket (views
        # of the first bytes): per-bucket allocations would let the
        # allocator keep freed buckets resident.  Two gathered buffers
        # alternate when a multi-dimensional mesh gathers in stages.
        largest = max(b[0] for b in buckets)
        send = torch.empty(largest, dtype=torch.uint8, device=device)
        recv = [torch.empty(largest * mesh.size(), dtype=torch.uint8, device=device)]
        if len(dims) > 1:
            recv.append(torch.empty(largest * mesh.size(), dtype=torch.uint8, device=device))
        for segment, pack_items, unpack_items, indices in buckets:
            buf = send[:segment]
            C.pack_bytes(buf, pack_items, torch.uint8)
            # Last mesh dimension first: the gathered segments end up in
            # row-major mesh-coordinate order, which the plan assumes.
            for stage, d in enumerate(reversed(dims)):
                out = recv[stage % len(recv)][: buf.numel() * mesh.size(d)]
                _all_gather_flat(out, buf, group=mesh.get_group(d))
                buf = out
            if keep:
                C.unpack_gathered(
                    buf, segment, unpack_items, torch.empty, device, results, indices, offload
                )
        del send, recv, buf
    for i in C.indices_of(results, ShardedTensor):
        results[i] = _gather_sharded_tensor(results[i])
    return results


def _details(signature, leaf_indices, names_fn, options_key, budget):
    """Per-leaf description for the disagreement error (error path only)."""
    names = names_fn() if names_fn is not None else None
    out = [("options", f"options {options_key}, bucket {budget} bytes")]
    for sig, i in zip(signature, leaf_indices):
        name = names[i] if names is not None and i < len(names) else f"tensor #{i}"
        shape, placements, itemsize = sig
        out.append((name, f"shape {tuple(shape)}, placements {placements}, {itemsize}-byte dtype"))
    return out


def _gather_sharded_tensor(t: ShardedTensor) -> torch.Tensor:
    """Legacy ShardedTensor (FSDP1 sharded dicts): upstream's gather."""
    from torch.distributed._state_dict_utils import _all_gather_sharded_tensor

    full = _all_gather_sharded_tensor(t)
    shards = t.local_shards()
    device = shards[0].tensor.device if shards else _CPU
    return full if full.device == device else full.to(device)
