"""Data movement for sharded tensors, through torch.distributed only.

Full gathers are planned natively (``plan_gather``, one ``GatherPlan`` per
mesh): DTensors are grouped by device mesh and packed into byte buckets.
Evenly sharded tensors (a 1-D mesh and ``Shard(0)``, FSDP2's layout, padded
or not) are planned in closed form -- the same slot in every rank's segment
--, so planning and unpacking cost the same at any world size; every other
layout (uneven per-rank geometry from strided shards, multi-dimensional
meshes, replicas) gets every rank's shard geometry from the mesh and the
placements.  Each bucket costs one collective per mesh dimension of
size > 1 (one for FSDP2's 1-D mesh), instead of upstream's blocking
collective per tensor, plus one small agreement exchange per call.

Which collective depends on who keeps the result, which every rank learns
from the agreement exchange (each rank's ``keep`` flag rides along):

* every rank keeps it: ``all_gather_into_tensor``, in place (each rank packs
  its segment straight into its slot of the gathered buffer);
* exactly one rank keeps it (``cpu_offload=True``: rank 0 only): ``gather``
  to that rank.  The other ranks hold only their own packed segment -- a
  bucket divided by the number of ranks -- never a gathered bucket;
* nobody on the mesh keeps it: no data moves at all.

Peak extra memory is one gathered bucket on a keeping rank (plus, on gloo,
the backend's own staging copy of it, which gloo's gather and all-gather
allocate internally), one segment on the others.

The bucket budget is the size of a *gathered* bucket in bytes.  By default
it adapts to the tensors: ``min(256 MiB, max(largest tensor, 16 MiB))``;
:func:`set_bucket_bytes` or the ``DCP_OPTIM_BUCKET_MB`` environment variable
(read at import) fix it instead.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .. import errors
from .consistency import all_gather_flat, check_agreement, flagged, mesh_ranks
from .core import C
from .serial_collectives import one_collective_at_a_time
from .tensor_bytes import opaque

__all__ = ["bucket_bytes", "bucket_setting", "set_bucket_bytes", "gather_full_tensors"]

# Default budget: max(largest tensor, 16 MiB), at most 256 MiB.
# * 16 MiB floor: measured with gloo on a 2-core host (benchmarks/README.md),
#   a 16 MiB all-gather already runs at the loopback's bandwidth (~1 GB/s,
#   15-20 ms), while 64 MiB ones were 4-10x slower per byte: buckets above
#   the allocator's mmap threshold (32 MiB in glibc) are fresh mappings on
#   every call, page-faulted in again each time (gloo's staging copy too).
#   Every extra MiB of budget is an extra MiB of peak memory (two on gloo).
# * largest tensor: a tensor never shares a bucket below its own size, so
#   the budget may as well fit it (it is needed anyway).
# * 256 MiB cap: collective latency is long amortised (NCCL reaches its
#   bandwidth well below this size), and the bucket stays a small fraction
#   of a GPU's or host's memory.
_MIN_BUCKET_BYTES = 16 * 1024 * 1024
_MAX_BUCKET_BYTES = 256 * 1024 * 1024
_explicit_bytes: int | None = int(float(os.environ.get("DCP_OPTIM_BUCKET_MB", "0")) * 2**20) or None

_PLACEMENT_CLASSES = (Shard, _StridedShard, Replicate)
_CPU = torch.device("cpu")


def bucket_bytes(largest: int = 0) -> int:
    """The bucket budget in bytes for a transfer whose largest tensor has
    ``largest`` bytes: the fixed setting if there is one, else
    ``min(256 MiB, max(largest, 16 MiB))``."""
    if _explicit_bytes is not None:
        return _explicit_bytes
    return min(_MAX_BUCKET_BYTES, max(_MIN_BUCKET_BYTES, int(largest)))


def bucket_setting() -> int | None:
    """The fixed budget (bytes), or None when it adapts to the tensors."""
    return _explicit_bytes


def set_bucket_bytes(nbytes: int | None) -> int | None:
    """Fix the bucket budget (bytes), or restore the adaptive default with
    None; returns the previous setting (None: it was adaptive)."""
    global _explicit_bytes
    if nbytes is not None and int(nbytes) < 1:
        raise ValueError("bucket size must be positive")
    previous, _explicit_bytes = _explicit_bytes, None if nbytes is None else int(nbytes)
    return previous


def _plan(leaves: list[Any], fixed: int | None) -> list[Any]:
    if fixed:
        return C.plan_gather(leaves, DTensor, _PLACEMENT_CLASSES, fixed, 0)
    return C.plan_gather(leaves, DTensor, _PLACEMENT_CLASSES, _MAX_BUCKET_BYTES, _MIN_BUCKET_BYTES)


def _reduce_partials(leaves: list[Any]) -> list[Any] | None:
    """``leaves`` with every DTensor that has Partial placements
    redistributed to Replicate on those mesh dimensions (the all-reduce
    ``full_tensor()`` runs), or None when no leaf has one."""
    out, changed = list(leaves), False
    for i in C.indices_of(leaves, DTensor):
        leaf = leaves[i]
        if any(p.is_partial() for p in leaf.placements):
            placements = [Replicate() if p.is_partial() else p for p in leaf.placements]
            # a wrapper subclass's collectives one at a time
            wrapped = type(leaf._local_tensor) is not torch.Tensor
            with one_collective_at_a_time() if wrapped else contextlib.nullcontext():
                out[i] = leaf.redistribute(leaf.device_mesh, placements)
            changed = True
    return out if changed else None


def _mesh_device(mesh) -> torch.device:
    return torch.device(mesh.device_type)


def send_op(tensor: torch.Tensor, peer: int, group: Any, tag: int) -> Any:
    """A ``P2POp`` sending ``tensor`` to global rank ``peer`` (for
    ``batch_isend_irecv``).  ``P2POp`` accepts only c10d's own ``isend`` /
    ``irecv`` (an identity check): they are named through that module, so
    that a tool wrapping ``torch.distributed.isend`` does not make every
    point-to-point transfer fail."""
    return dist.P2POp(_c10d.isend, tensor, peer, group, tag)


def recv_op(tensor: torch.Tensor, peer: int, group: Any, tag: int) -> Any:
    """A ``P2POp`` receiving ``tensor`` from global rank ``peer``."""
    return dist.P2POp(_c10d.irecv, tensor, peer, group, tag)


class OwnFailure:
    """The first failure of this rank's own code (not the backend's)
    inside a stream: the steps after it are skipped, while the caller
    keeps taking part in the stream's collectives, and it is raised once
    they are all issued and waited for."""

    def __init__(self) -> None:
        self.error: Exception | None = None

    def attempt(self, step: Any, *args: Any, **kwargs: Any) -> Any:
        """``step(*args, **kwargs)``, or None where it raised or an earlier
        step did."""
        if self.error is not None:
            return None
        try:
            return step(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - raised by raise_if_any
            self.error = exc
            return None

    def raise_if_any(self) -> None:
        if self.error is not None:
            raise self.error


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
    first, per mesh, with one small all-gather (``options_key`` joins the
    check; ``names_fn`` names the leaves if it fails).  With ``keep=False``
    this rank assembles nothing (the ``cpu_offload`` rank-0-only mode): it
    only sends its shards, to the one rank that keeps them when there is
    exactly one.
    """
    results = list(leaves)
    fixed = bucket_bytes or _explicit_bytes
    offload = _CPU if cpu_offload else None
    # DTensors over a wrapper subclass that no byte view reaches go
    # torch's own way (``_gather_opaque``), after the others
    wrapped = [i for i in C.indices_of(leaves, DTensor) if opaque(leaves[i]._local_tensor)]
    if wrapped:
        opaque_leaves = leaves
        leaves = list(leaves)
        for i in wrapped:
            leaves[i] = None
    try:
        plans = _plan(leaves, fixed)
    except errors.StateDictValueError:
        # The native plan takes no Partial placement: reduce those first,
        # as DTensor.full_tensor() does (every rank holds the same leaves,
        # so every rank takes this path, before any collective of ours).
        reduced = _reduce_partials(leaves)
        if reduced is None:
            raise
        leaves = reduced
        plans = _plan(leaves, fixed)
    work = []
    # Identity, not only geometry: the names of the gathered leaves, in
    # gather order, join every mesh's check (ranks that registered the
    # same shapes in another order would swap values without it).
    names = names_fn() if names_fn is not None and (plans or wrapped) else None
    for mesh, plan, signature, leaf_indices, budget in plans:
        order = _names_of(names, leaf_indices)
        flags = check_agreement(
            mesh,
            "sharded tensors to gather",
            (options_key, budget, signature, order),
            lambda: _details(signature, leaf_indices, names, options_key, budget),
            flag=1 if keep else 0,
            error=_cannot_take_part(mesh, plan, keep),
        )
        count, first = flagged(flags)  # no pass over the ranks
        if plan.buckets and count:
            root = first if count == 1 else None
            work.append((mesh, plan, root))
    failure = OwnFailure()
    for mesh, plan, root in work:
        _gather_mesh(mesh, plan, root, keep, results, offload, failure, leaves)
    failure.raise_if_any()
    if wrapped:
        _gather_opaque(opaque_leaves, wrapped, results, keep, offload, options_key, names)
    for i in C.indices_of(results, ShardedTensor):
        results[i] = _gather_sharded_tensor(results[i])
    return results


def _gather_opaque(
    leaves: list[Any], at: list[int], results: list[Any], keep: bool, offload: torch.device | None,
    options_key: Any, names: list[str] | None,
) -> None:
    """The leaves ``at``: DTensors whose local tensor is a wrapper subclass
    that keeps its values in no byte view (``tensor_bytes.opaque``: two
    inner tensors, as torch's ``TwoTensor``; quantized data and scales,
    as torchao's ``NF4Tensor``).  Packing their bytes would gather some
    other tensor, so they are gathered as upstream gathers every DTensor:
    a redistribute to ``Replicate`` on its mesh, one collective per
    tensor through the subclass's own operations -- the same result, or
    the same error where the subclass has no such operations.  The ranks
    first agree on them per mesh (geometry, class and name), as on the
    others."""
    meshes: list[tuple[Any, list[int]]] = []
    for i in at:
        mesh = leaves[i].device_mesh
        if mesh.get_coordinate() is None:
            continue  # not on this tensor's mesh: nothing to take part in
        for seen, members in meshes:
            if seen is mesh or seen == mesh:
                members.append(i)
                break
        else:
            meshes.append((mesh, [i]))
    for mesh, members in meshes:
        signature = [
            (tuple(leaves[i].shape), str(tuple(leaves[i].placements)), type(leaves[i]._local_tensor).__qualname__)
            for i in members
        ]
        order = _names_of(names, members)

        def details(signature=signature, members=members, order=order) -> list[tuple[str, str]]:
            out = [("options", f"options {options_key}")]
            for (shape, placements, cls), i, name in zip(signature, members, order or [None] * len(members)):
                out.append((name or f"tensor #{i}", f"shape {shape}, placements {placements}, local {cls}"))
            return out

        check_agreement(mesh, "wrapper-subclass tensors to gather", (("opaque", options_key), signature, order),
                        details)
    for _, members in meshes:
        for i in members:
            try:
                full = _upstream_full_tensor(leaves[i])
            except Exception as exc:
                # the subclass has no such operation (torchao's NF4Tensor and
                # low-bit optimizer states): every rank fails here alike, with
                # upstream's exception, named
                name = names[i] if names is not None and i < len(names) else f"tensor #{i}"
                cls = type(leaves[i]._local_tensor)
                if exc.args and isinstance(exc.args[0], str):
                    exc.args = (f"full state dict: {name} is a DTensor over {cls.__module__}.{cls.__qualname__}, "
                                f"which torch cannot gather (a sharded state dict saves it): {exc.args[0]}",
                                *exc.args[1:])
                raise
            if keep:
                results[i] = full if offload is None else full.to(offload)


def _upstream_full_tensor(value: Any) -> Any:
    """Upstream's gather of one DTensor (``_gather_state_dict``'s): on its
    mesh's device, redistributed to ``Replicate`` on every mesh dimension,
    its local tensor (waited for); the subclass's collectives run one at a
    time."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    mesh = value.device_mesh
    if value.device.type != mesh.device_type:
        value = value.to(mesh.device_type)
    # the subclass issues one functional collective per inner tensor: one
    # at a time, or torch's gloo group corrupts the heap (see the module)
    with one_collective_at_a_time():
        value = value.redistribute(device_mesh=mesh, placements=[Replicate() for _ in value.placements])
    local = value.to_local()
    if isinstance(local, AsyncCollectiveTensor):
        local = local.wait()
    return local


def _cannot_take_part(mesh: Any, plan: Any, keep: bool) -> BaseException | None:
    """The error of allocating, before the gather check, the largest
    buffer this rank takes part in the mesh's gathers through after a
    failure of its own (``_gather_mesh``: every segment of a bucket, on a
    rank that keeps the full tensors; on one that keeps nothing, the
    widest block it holds on the way to the one that does: its own
    segment on a 1-D mesh, more where it gathers a row of a larger mesh
    before sending it on), or None.  A rank that could not get it even
    then would raise in the middle of the gathers, leaving the others
    waiting in them until the group's timeout; found here, the check
    makes every rank raise it at once, before any gather.  The buffer is
    freed at once (a device's caching allocator keeps it for the
    gathers)."""
    if not plan.buckets:
        return None
    nbytes = plan.max_segment * (mesh.size() if keep else _sending_span(mesh))
    try:
        torch.empty(nbytes, dtype=torch.uint8, device=_mesh_device(mesh))
    except Exception as exc:  # noqa: BLE001 - agreed on by the gather check
        return exc
    return None


def _sending_span(mesh: Any) -> int:
    """The segments a rank that keeps nothing holds at its widest in a
    mesh's gathers.  Only the rank-0-only mode (``cpu_offload``) keeps
    nothing on some ranks, and there global rank 0 alone keeps: the
    gathers go to it (``_schedule``); where it is not on the mesh, no
    data moves and the rank's own segment is the bound."""
    ranks = mesh_ranks(mesh)
    if 0 not in ranks:
        return 1
    _, (_, count), _ = _schedule(mesh, ranks.index(0))
    return count


def _schedule(mesh: Any, root: int | None):
    """The collectives of one bucket on this rank, in units of segments.

    Segments sit in row-major mesh order.  Gathering along the last mesh
    dimension first and then outwards, the data a rank holds after each
    stage is a contiguous block that contains the block it held before, so
    every stage works in place in one buffer: its input is its slot of its
    output.  ``root`` (row-major index) is the only rank that needs the
    result (gather), or None (all-gather: everyone).  Returns
    (my slot, span, stages): span = (first, count) is the largest block
    this rank holds, the extent of its buffer; stages = [(group, dst, in
    block, out block or None)] with dst the global destination rank (None:
    all-gather) and out None where this rank only sends."""
    shape = list(mesh.shape)
    coord = list(mesh.get_coordinate())
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    me = sum(c * s for c, s in zip(coord, strides))
    target = None if root is None else [(root // s) % n for s, n in zip(strides, shape)]
    first, count = me, 1
    stages: list[tuple[Any, int | None, tuple[int, int], tuple[int, int] | None]] = []
    for d in reversed(range(len(shape))):
        if shape[d] == 1:
            continue
        out = (first - coord[d] * strides[d], count * shape[d])
        group = mesh.get_group(d)
        if target is None:
            stages.append((group, None, (first, count), out))
        else:
            at = list(coord)
            at[d] = target[d]
            dst = mesh_ranks(mesh)[sum(c * s for c, s in zip(at, strides))]
            receives = coord[d] == target[d]
            stages.append((group, dst, (first, count), out if receives else None))
            if not receives:
                break
        first, count = out
    return me, (first, count), stages


def _gather_mesh(mesh, plan, root, keep, results, offload, failure: OwnFailure, leaves: list[Any]) -> None:
    """Run the buckets of one mesh's plan; assemble the full tensors where
    kept.  A "direct" bucket (one evenly sharded tensor whose unpadded
    shards fill the segment) is gathered straight into its result tensor;
    the others through one shared buffer, unpacked by the plan (a strided
    copy or two per evenly sharded tensor, whatever the world size).

    A failure of this rank's own in allocating or assembling (out of
    memory, say: a full tensor on a GPU) does not end its part in the
    gathers, which the other ranks wait in: it puts back ``leaves`` in
    place of what it assembled (freeing that memory), takes part in every
    remaining collective through one buffer of its own, still sending its
    shards -- the others' results stay whole -- and the caller raises the
    failure once every gather is done (``failure``, shared by the meshes
    of one call)."""
    device = _mesh_device(mesh)
    me, (first, count), stages = _schedule(mesh, root)
    assemble = keep and count == mesh.size()
    # One buffer for every bucket of the mesh (views of its first bytes):
    # per-bucket allocations would let the allocator keep freed buckets
    # resident.  A rank that only sends holds just its own segment.
    storage = None
    for b in range(plan.buckets):
        segment = plan.segment(b)
        direct = plan.direct(b) if assemble and failure.error is None else None
        full = None
        if direct is not None:
            leaf, dtype, shape = direct
            full = failure.attempt(torch.empty, shape, dtype=dtype, device=device)
        if full is not None:
            buffer = full.view(-1).view(torch.uint8)
        else:
            need = max(plan.max_segment, segment) * count
            if storage is None or storage.numel() < need:
                storage = None
                if failure.error is None:
                    storage = failure.attempt(torch.empty, need, dtype=torch.uint8, device=device)
                if storage is None:
                    # this rank failed: what it assembled is of no use now,
                    # its memory goes before the buffer it takes part
                    # through comes
                    results[:] = leaves
                    storage = torch.empty(need, dtype=torch.uint8, device=device)
            buffer = storage[: segment * count]

        def view(block: tuple[int, int], seg: int = segment, buf: torch.Tensor = buffer) -> torch.Tensor:
            # bytes of the segments block[0] .. block[0] + block[1] - 1
            start = (block[0] - first) * seg
            return buf[start : start + block[1] * seg]

        C.pack_bucket(view((me, 1)), plan, b, torch.uint8)
        for group, dst, inp, out in stages:
            if dst is None:
                all_gather_flat(view(out), view(inp), group)
            elif out is None:
                dist.gather(view(inp), None, dst=dst, group=group)
            else:
                pieces = list(view(out).chunk(out[1] // inp[1]))
                dist.gather(view(inp), pieces, dst=dst, group=group)
        if failure.error is not None:
            continue
        if direct is not None:
            assert full is not None
            results[leaf] = full if offload is None else failure.attempt(full.to, offload)
        elif assemble:
            failure.attempt(C.unpack_bucket, buffer, plan, b, torch.empty, device, results, offload, torch.cat)
    if failure.error is not None:
        results[:] = leaves


def _names_of(names: list[str] | None, leaf_indices: Any) -> list[str] | None:
    if names is None:
        return None
    return [names[i] if i < len(names) else f"tensor #{i}" for i in leaf_indices]


def _details(
    signature: Any, leaf_indices: Any, names: list[str] | None, options_key: Any, budget: Any
) -> list[tuple[str, str]]:
    """Per-leaf description for the disagreement error (error path only):
    each leaf's geometry by name, then the names in gather order (last:
    an entry only some ranks hold is the difference, not everything
    after it; where every rank holds the same leaves, the order is)."""
    out = [("options", f"options {options_key}, bucket {budget} bytes")]
    order = _names_of(names, leaf_indices) or []
    for sig, i in zip(signature, leaf_indices):
        name = names[i] if names is not None and i < len(names) else f"tensor #{i}"
        shape, placements, itemsize = sig
        out.append((name, f"shape {tuple(shape)}, placements {placements}, {itemsize}-byte dtype"))
    out.extend((f"sharded tensor #{k} in gather order", name) for k, name in enumerate(order))
    return out


def _gather_sharded_tensor(t: ShardedTensor) -> torch.Tensor:
    """Legacy ShardedTensor (FSDP1 sharded dicts): upstream's gather."""
    from torch.distributed._state_dict_utils import _all_gather_sharded_tensor

    full = _all_gather_sharded_tensor(t)
    shards = t.local_shards()
    device = shards[0].tensor.device if shards else _CPU
    return full if full.device == device else full.to(device)
