"""Loading full state dicts into (possibly sharded) models and optimizers.

Two modes, both planned natively (``plan_full_load``):

* every rank holds the full dict (``full_state_dict=True``): each rank
  copies out its own shard locally -- no communication at all;
* only the source holds it (``broadcast_from_rank0=True``): metadata goes
  first in one object broadcast, then the tensors travel in byte buckets
  (large tensors in row chunks), and each rank keeps only its shard of
  each bucket before the next one arrives.  Peak memory on a receiving
  rank is its local shards plus one bucket (adaptive budget, see
  ``_collectives``: 16 MiB unless a tensor is larger).

The "rank 0" of a broadcast is the first rank of the model's device mesh
(global rank 0 whenever the mesh spans all ranks; SPEC D18): for a model
sharded on a sub-mesh the data travels within that mesh.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from . import errors
from ._collectives import bucket_bytes, bucket_setting
from ._core import C, context

_CLASSES = (Shard, _StridedShard, Replicate)
_CPU = torch.device("cpu")


class TensorMeta(NamedTuple):
    """What a receiving rank learns about a tensor before its bytes."""

    shape: tuple[int, ...]
    dtype: torch.dtype


class Route:
    """How data travels from the source rank to every rank of a model.

    Without sharded tensors, or when their mesh spans the world: the default
    group, source global rank 0.  For a mesh on a subset of the ranks: one
    broadcast per mesh dimension, last dimension first, each from
    coordinate 0 (the source is the mesh's rank at coordinate (0, ..., 0)).
    """

    def __init__(self, mesh: Any | None, device: torch.device):
        self.device = device
        self.mesh = mesh
        if mesh is None or mesh.size() == dist.get_world_size():
            self.stages = [(None, 0)]
            self.is_source = dist.get_rank() == 0
            self.source = 0
            return
        coord = list(mesh.get_coordinate())
        grid = mesh.mesh
        self.stages = []
        for d in reversed(range(mesh.ndim)):
            if mesh.size(d) == 1:
                continue
            at_zero = list(coord)
            at_zero[d] = 0
            self.stages.append((mesh.get_group(d), int(grid[tuple(at_zero)])))
        self.source = int(grid[(0,) * mesh.ndim])
        self.is_source = all(c == 0 for c in coord)

    def agree(self, what: str, summary: Any) -> None:
        """Same error on every rank of the route when ``summary`` differs."""
        from ._consistency import check_agreement

        check_agreement(self.mesh, what, summary, lambda: [("options", repr(summary))])

    def broadcast(self, tensor: torch.Tensor) -> None:
        for group, src in self.stages:
            dist.broadcast(tensor, src=src, group=group)

    def broadcast_object(self, obj: Any) -> Any:
        for group, src in self.stages:
            box = [obj]
            dist.broadcast_object_list(box, src=src, group=group)
            obj = box[0]
        return obj


def route_for(index: Any, device: torch.device) -> Route:
    """The broadcast route of the model an index describes."""
    meshes = []
    for i in C.indices_of(index.tensors, DTensor):
        mesh = index.tensors[i].device_mesh
        if not any(mesh is m for m in meshes):
            meshes.append(mesh)
        if len(meshes) > 1:
            break
    if len(meshes) == 1:
        return Route(meshes[0], device)
    return Route(None, device)


def run_full_load(
    jobs: list[tuple[Any, Any, Any]],
    *,
    route: Route | None,
    offload: torch.device | None = None,
    in_place: bool = False,
) -> list[Any]:
    """Execute ``jobs`` = [(full value or TensorMeta, template, device)]:
    local slicing when ``route`` is None, else a bucketed broadcast stream.
    With ``in_place`` a DTensor template's shard lands straight in the
    template's own local tensor where dtype, device and layout allow (the
    caller has validated the whole load).  Returns the loaded value of each
    job (None where not needed)."""
    stream = route is not None
    # Every rank of a stream derives the budget from the same metadata.
    budget = bucket_bytes(_largest_job_bytes(jobs) if stream else 0)
    dests, layouts, buckets = C.plan_full_load(
        jobs, DTensor, _CLASSES, budget, torch.empty, stream, in_place
    )
    if stream and buckets:
        # One buffer for the whole stream: re-allocating per bucket lets
        # the allocator keep several freed buckets resident.
        storage = torch.empty(max(b[0] for b in buckets), dtype=torch.uint8, device=route.device)
        for nbytes, src_items, dst_items in buckets:
            buf = storage[:nbytes]
            if route.is_source:
                C.pack_rows(buf, src_items, jobs, torch.uint8)
            route.broadcast(buf)
            C.extract_rows(buf, dst_items, dests)
        del storage, buf
    return C.finish_full_load(jobs, dests, layouts, DTensor.from_local, offload)


def _largest_job_bytes(jobs: list[tuple[Any, Any, Any]]) -> int:
    """Bytes of the largest full tensor of a load (what the adaptive
    bucket budget is sized for)."""
    largest = 0
    for value, _, _ in jobs:
        n = value.dtype.itemsize
        for d in value.shape:
            n *= d
        largest = max(largest, n)
    return largest


# --- model ---------------------------------------------------------------------


def distribute_model_state_dict(
    full: dict[str, Any],
    local: dict[str, Any],
    device: torch.device,
    *,
    precheck: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every rank holds ``full``: upstream's _distribute_state_dict +
    update(local).  With ``precheck`` (the model load's full validation)
    and the same keys as the model's, the dict is validated first and each
    shard is then copied straight into the parameter's local tensor, as
    upstream does (no second copy of the shards); otherwise DTensors are
    sliced into new DTensors and nothing is written to the model before
    load_state_dict validates the result."""
    merged, jobs = C.full_load_merge(context(), full, local, device)
    in_place = precheck is not None and full.keys() == local.keys()
    if in_place:
        # Full tensors have the global shapes the check compares with.
        precheck(full)
    if jobs:
        job_list = [(full_t, local_t, local_t.device) for _, full_t, local_t in jobs]
        values = run_full_load(job_list, route=None, in_place=in_place)
        C.write_slots([(merged, key) for key, _, _ in jobs], values)
    return merged


def broadcast_model_state_dict(
    full: dict[str, Any],
    local: dict[str, Any],
    device: torch.device,
    *,
    strict: bool,
    cpu_offload: bool,
    route: Route,
    precheck: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Only the route's source holds ``full``; everyone ends with its
    local dict updated (upstream's _broadcast_state_dict semantics).
    ``precheck`` as for distribute_model_state_dict."""
    ctx = context()
    route.agree("model load options", ("model", strict, cpu_offload, bucket_setting()))
    if route.is_source:
        leaves = C.tree_leaves(ctx, full, False)
        meta = C.tree_rebuild(ctx, full, C.to_metadata(leaves, TensorMeta, torch.Tensor), False)
    else:
        meta = None
    meta = route.broadcast_object(meta)
    if not isinstance(meta, dict):
        raise errors.StateDictValueError(
            "broadcast_from_rank0=True: the source rank "
            f"({route.source}) did not provide a model state dict"
        )
    keys, jobs, non_tensor = _broadcast_jobs(meta, full if route.is_source else None, local, device)
    _check_broadcast_shapes(keys, jobs)
    out = dict(local)
    for key, value in non_tensor:
        if key in out:
            out[key] = value
    # In place (shards streamed straight into the parameters, peak one
    # bucket, as upstream) only once the whole load is known to pass: the
    # same keys as the model's, and the dict as it will be loaded -- the
    # live tensors standing in for the streamed ones, whose shapes were
    # just checked -- passes the model load's own checks.
    in_place = precheck is not None and meta.keys() == local.keys()
    if in_place:
        precheck(out)
    values = run_full_load(
        jobs, route=route, offload=_CPU if cpu_offload else None, in_place=in_place
    )
    C.write_slots([(out, k) for k in keys], values)
    if strict:
        for key in [k for k in out if k not in meta]:
            del out[key]
    if route.is_source:
        merged = dict(full)
        merged.update(out)
        return merged
    return out


def _check_broadcast_shapes(keys: list[str], jobs: list[tuple]) -> None:
    """Every rank sees the same metadata and model, so a shape mismatch is
    found -- and raised, with torch's wording -- on every rank alike,
    before the stream starts."""
    bad = C.shape_mismatches(jobs, torch.Tensor)
    if bad:
        i, got, want = bad[0]
        raise errors.StateDictRuntimeError(
            f"size mismatch for {keys[i]}: copying a param with shape {torch.Size(got)} "
            f"from checkpoint, the shape in current model is {torch.Size(want)}."
        )


def _broadcast_jobs(meta, full, local, device):
    return C.broadcast_jobs(meta, full, local, device, DTensor, torch.Tensor)


def collective_device(device: torch.device, index: Any) -> torch.device:
    """Where broadcast buffers live: the DTensors' mesh device type, else
    ``device`` when the default group's backend supports it (upstream's
    rule), else the group's default device (a CPU model over NCCL)."""
    dts = C.indices_of(index.tensors, DTensor)
    if dts:
        return torch.device(index.tensors[dts[0]].device_mesh.device_type)
    group = dist.distributed_c10d._get_default_group()
    types = {d.type for d in group._device_types}
    return device if device.type in types else group._device_types[0]


def require_full_dict_everywhere(has_data: Any, index: Any, what: str) -> None:
    """SPEC D15: a full load without broadcast needs the full dict on
    every rank.  Upstream hangs when only some ranks pass it (or raises on
    the empty ones only); one small agreement collective, before any other
    check, makes every rank raise the same clear error.

    ``has_data`` is one bool, or a tuple of bools (one per dict of the
    call), compared across the ranks of the model's mesh."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    route = route_for(index, None)
    flags, ranks = _gather_flags(route.mesh, has_data)
    if all(f == flags[0] for f in flags):
        return
    empty = [r for r, f in zip(ranks, flags) if f != max(flags)]
    raise errors.StateDictValueError(
        f"full_state_dict=True loads need the full {what} state dict on every "
        f"rank, but rank(s) {empty} passed an empty one. To load a dict that "
        "only rank 0 holds, use StateDictOptions(full_state_dict=True, "
        "broadcast_from_rank0=True)."
    )


def _gather_flags(mesh: Any, flags: Any) -> tuple[list[Any], list[int]]:
    """Every mesh rank's ``flags`` (a bool or a short tuple of bools): one
    all-gather of 16 bytes (an object all-gather costs two collectives and
    pickling)."""
    from ._consistency import mesh_all_gather_bytes, mesh_all_gather_object

    seq = flags if isinstance(flags, tuple) else (flags,)
    if len(seq) > 14 or not all(isinstance(f, bool) for f in seq):
        return mesh_all_gather_object(mesh, flags)
    data = bytes([isinstance(flags, tuple), len(seq), *map(int, seq)]).ljust(16, b"\0")
    blobs, ranks = mesh_all_gather_bytes(mesh, data)
    out = []
    for b in blobs:
        values = tuple(bool(x) for x in b[2 : 2 + b[1]])
        out.append(values if b[0] else values[0])
    return out, ranks


# --- optimizer -----------------------------------------------------------------


def localize_optim_view(
    view: tuple,
    info: Any,
    *,
    full: bool,
    held: Callable[[], dict[str, Any]] | None = None,
    precheck: Callable[[tuple], Any] | None = None,
) -> tuple:
    """Make the tensors of a loaded optimizer view local to this rank.

    full=True (full_state_dict loads): full tensors of DTensor parameters
    become this rank's shard, as DTensors (D9); with broadcast_from_rank0
    the view itself first travels from the source.
    full=False (sharded loads): only plain tensors given for DTensor
    parameters are converted (D9); everything else is left as is.

    ``held()`` (the optimizers' current state by FQN) and ``precheck(view)``
    (the load's whole validation): on full loads where every streamed
    tensor belongs to a DTensor parameter, the view is validated first with
    the current state tensors (or the parameters) standing in for the
    incoming ones, and the shards are then written straight into the
    current state tensors where dtype and layout allow -- upstream's
    footprint, without a second copy of the optimizer state, and still
    nothing changed when a check fails.
    """
    state, groups, fqn_group, empties, unexpected = view
    route = None
    if full and info.broadcast_from_rank0:
        device = _state_device(info.index)
        route = route_for(info.index, device)
        route.agree("optimizer load options", ("optim", info.strict, bucket_setting()))
        ctx = context()
        if route.is_source:
            leaves = C.tree_leaves(ctx, state, False)
            meta_state = C.tree_rebuild(
                ctx, state, C.to_metadata(leaves, TensorMeta, torch.Tensor), False
            )
            payload = (meta_state, groups, fqn_group, empties, unexpected)
        else:
            payload = None
        payload = route.broadcast_object(payload)
        if payload is None:
            raise errors.StateDictValueError(
                "broadcast_from_rank0=True: the source rank "
                f"({route.source}) did not provide an optimizer state dict"
            )
        if not route.is_source:
            state, groups, fqn_group, empties, unexpected = payload
    existing = held() if full and held is not None and precheck is not None else None
    new_state, jobs, slots, n_held = C.optim_state_jobs(
        info.index, state, DTensor, 0 if full else 1, DTensor.from_local, existing
    )
    # Only when every job's template is a held state tensor: an in-place
    # load writes into its templates, and a parameter is never one here.
    in_place = bool(jobs) and n_held == len(jobs)
    if in_place:
        C.write_slots(slots, [job[1] for job in jobs])
        precheck((new_state, groups, fqn_group, empties, unexpected))
    if jobs:
        values = run_full_load(jobs, route=route, in_place=in_place)
        C.write_slots(slots, values)
    return (new_state, groups, fqn_group, empties, unexpected)


def _state_device(index: Any) -> torch.device:
    """Device of the collective buffers: the model's parameters' device
    (for DTensors their mesh's device type)."""
    dts = C.indices_of(index.tensors, DTensor)
    if dts:
        return torch.device(index.tensors[dts[0]].device_mesh.device_type)
    devices = C.tensor_devices(context(), index.tensors)
    devices = [d for d in devices if d.type != "meta"]
    if devices:
        return devices[0]
    return dist.distributed_c10d._get_pg_default_device()


def agree_with_source(index: Any, value: Any) -> Any:
    """The source rank's ``value`` on every rank of the model's route (one
    small object broadcast).  Used so that ranks holding ``{}`` in a
    broadcast load take the same code path as the source: upstream's
    set_state_dict skips the model load on them and hangs."""
    return route_for(index, None).broadcast_object(value)
