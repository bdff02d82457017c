"""Loading full state dicts into (possibly sharded) models and optimizers.

Two modes, both planned natively (``plan_full_load``):

* every rank holds the full dict (``full_state_dict=True``): each rank
  copies out its own shard locally -- no communication at all;
* only the source holds it (``broadcast_from_rank0=True``): metadata goes
  first in one broadcast (``payload``; a small load's tensors with it,
  then sliced locally as above), then the tensors travel in byte buckets
  (large tensors in row chunks), and each rank keeps only its shard of
  each bucket before the next one arrives.  Peak memory on a receiving
  rank is its local shards plus one bucket (adaptive budget, see
  ``collectives``: 16 MiB unless a tensor is larger).  Within a bucket, a
  tensor or row chunk of 1 MiB or more is its own broadcast, sent from the
  source's tensor itself where contiguous; the bucket's broadcasts are in
  flight together, each unpacked as it arrives.

The "rank 0" of a broadcast is the first rank of the model's device mesh
(global rank 0 whenever the mesh spans all ranks; D18 in docs/differences.md): for a model
sharded on a sub-mesh the data travels within that mesh.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from .. import errors
from .collectives import OwnFailure, bucket_bytes
from .core import C, context
from .payload import (
    MetadataPickler,
    OutgoingPayload,
    broadcast_payload,
    decode_payload,
    payload_from_flags,
)
from .scatter_load import (
    DIRECT_BYTES,
    NO_CHUNKING,
    ScatterSchedule,
    paths_digest,
    run_scatter,
    scatter_jobs,
)
from .tensor_bytes import flat_bytes, opaque, own_bytes

_CLASSES = (Shard, _StridedShard, Replicate)
_CPU = torch.device("cpu")


class TensorMeta(NamedTuple):
    """What a receiving rank learns about a tensor before its bytes."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def to_metadata(leaves: list[Any]) -> list[Any]:
    """What a stream sends ahead of the tensor data, per tree leaf: the
    (shape, dtype) of a tensor, a 0-dim tensor itself (on the CPU: it
    travels in the metadata), any other value as it is."""
    out = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            shape = tuple(leaf.shape)
            leaf = TensorMeta(shape, leaf.dtype) if shape else leaf.cpu()
        out.append(leaf)
    return out


def tree_metadata(tree: Any) -> Any:
    """``tree`` with each leaf as ``to_metadata`` describes it: what a
    broadcast load's source sends ahead of the tensors' bytes."""
    ctx = context()
    return C.tree_rebuild(ctx, tree, to_metadata(C.tree_leaves(ctx, tree, False)), False)


class Route:
    """How data travels from the source rank to every rank of a model.

    Without sharded tensors, or when their mesh spans the world: the default
    group, source global rank 0.  For a mesh on a subset of the ranks: one
    broadcast per mesh dimension, last dimension first, each from
    coordinate 0 (the source is the mesh's rank at coordinate (0, ..., 0)).
    """

    def __init__(self, mesh: Any | None, device: torch.device | None):
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

    def broadcast(self, tensor: torch.Tensor, async_op: bool = False) -> Any:
        """Broadcast ``tensor`` along the route, in place.  With
        ``async_op`` (one-stage routes only) the broadcast is left in
        flight and its work returned (else None)."""
        if async_op:
            group, src = self.stages[0]
            return dist.broadcast(tensor, src=src, group=group, async_op=True)
        for group, src in self.stages:
            dist.broadcast(tensor, src=src, group=group)
        return None

    def broadcast_object(self, obj: Any) -> Any:
        """``obj`` from the source to every rank of the route (the source
        gets ``obj`` itself back).  It travels pickled by
        ``MetadataPickler``: the 0-dim tensors of the metadata (an
        optimizer's ``step``, one per parameter) as their dtype and bytes.
        (Loads with an agreement send theirs by ``send_payload``.)"""
        if self.is_source:
            buf = io.BytesIO()
            MetadataPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
            payload: Any = buf.getvalue()
        else:
            payload = None
        for group, src in self.stages:
            box = [payload]
            dist.broadcast_object_list(box, src=src, group=group)
            payload = box[0]
        return obj if self.is_source else pickle.loads(payload)

    def send_payload(
        self, payload: OutgoingPayload | None, flags: tuple[int, ...] | None
    ) -> Callable[[], tuple[tuple, tuple | None]]:
        """A load's payload (``payload``'s module) from the source to every
        rank of the route, its size learnt from the source's agreement
        ``flags`` (None: not known, it travels first).  Returns what reads
        it -- (metas, inline values or None); the source gets its own --
        apart from the collective: a receiver that cannot read it (a class
        it cannot import) fails there, and its caller agrees on that."""
        size = payload_from_flags(flags) if flags is not None else None
        if size is None:  # too large for the flags: size and payload travel
            metas = self.broadcast_object(payload.metas if payload is not None else None)
            return lambda: (metas, None)
        data = broadcast_payload(self, payload, size)
        if self.is_source:
            assert payload is not None
            own = payload.metas, tuple(payload.values) if payload.inline and payload.values is not None else None
            return lambda: own
        return lambda: decode_payload(data)


def route_for(index: Any, device: torch.device | None) -> Route:
    """The broadcast route of the model an index describes (``device``:
    where its buffers live, None for object broadcasts only)."""
    tensors = index.tensors
    first = None
    for i in C.indices_of(tensors, DTensor):
        mesh = tensors[i].device_mesh
        if first is None:
            first = mesh
        elif mesh is not first:
            return Route(None, device)  # several meshes
    return Route(first, device)


class StreamPlan:
    """What a load's stream needs before it starts, made by
    ``plan_stream``: the plans of its scattered and broadcast jobs, with
    their destinations (the new tensors of a load that is not in place),
    the scatters' schedule (``ScatterSchedule``: every transfer this rank
    takes part in) and the broadcast buffer allocated.  A broadcast load makes it before
    the agreement ahead of the stream (``reserve``): a rank that cannot
    allocate them fails there, with every rank, before any collective of
    the stream, where it would have left its peers waiting in the
    stream's first collective until the group's timeout."""

    __slots__ = ("scattered", "in_place", "rest", "plan", "splan", "schedule", "storage")

    def __init__(self, scattered, in_place, rest, plan, splan, schedule, storage):
        self.scattered, self.in_place, self.rest = scattered, in_place, rest
        self.plan, self.splan, self.schedule, self.storage = plan, splan, schedule, storage


def plan_stream(
    jobs: list[tuple[Any, Any, Any]], route: Route | None, in_place: bool, scattered: list[int] | None
) -> StreamPlan:
    """The plans of ``run_full_load``'s jobs (``route`` None: local
    slicing, no stream) and the buffer its broadcasts go through."""
    stream = route is not None
    # Every rank of a stream derives the budget from the same metadata.
    budget = bucket_bytes(_largest_job_bytes(jobs) if stream else 0)
    # The jobs a stream scatters (each rank gets its own rows) and those
    # it broadcasts, each with its own plan.
    if not stream:
        scattered = []
    elif scattered is None:
        scattered = scatter_jobs(jobs, route)
    splan = schedule = None
    if scattered:
        taken = set(scattered)
        rest = [i for i in range(len(jobs)) if i not in taken]
        picked = [jobs[i] for i in scattered]
        splan = C.plan_full_load(picked, DTensor, _CLASSES, NO_CHUNKING, torch.empty, True, in_place)
        schedule = ScatterSchedule(picked, splan.dests, route, budget)
        plan = C.plan_full_load([jobs[i] for i in rest], DTensor, _CLASSES, budget, torch.empty, True, in_place)
    else:
        rest = list(range(len(jobs)))
        plan = C.plan_full_load(jobs, DTensor, _CLASSES, budget, torch.empty, stream, in_place)
    storage = None
    if route is not None and plan.nbuckets:
        # One buffer for the whole stream: re-allocating per bucket lets
        # the allocator keep several freed buckets resident.
        storage = torch.empty(plan.max_bucket_bytes, dtype=torch.uint8, device=route.device)
    return StreamPlan(list(scattered), in_place, rest, plan, splan, schedule, storage)


def run_full_load(
    jobs: list[tuple[Any, Any, Any]],
    *,
    route: Route | None,
    offload: torch.device | None = None,
    in_place: bool = False,
    undo: _UndoLog | None = None,
    scattered: list[int] | None = None,
    planned: StreamPlan | None = None,
) -> list[Any]:
    """Execute ``jobs`` = [(full value or TensorMeta, template, device)]:
    local slicing when ``route`` is None, else a bucketed broadcast stream.
    With ``in_place`` a DTensor template's shard lands straight in the
    template's own local tensor where dtype, device and layout allow (the
    caller has validated the whole load).  ``undo`` (in-place loads) keeps
    what the load overwrites in live tensors, for the caller to restore if
    the load fails after this returns (its agreement); without one, a
    stream keeps its own until it completes.  ``scattered``: the jobs a
    stream scatters, as the ranks agreed (None: ``scatter_jobs``'s).
    ``planned``: ``plan_stream``'s result for these jobs, made before
    (used where it planned the same scattered jobs, in place or not).
    Returns the loaded value of each job (None where not needed)."""
    if route is None:
        wrapped = opaque_values(jobs)
        if wrapped:
            return _slice_opaque(jobs, wrapped, offload, in_place)
    if not in_place:
        undo = None
    if route is None and undo is not None:
        undo.save_all()  # local slicing writes every live shard at once
    if route is None or planned is None or planned.in_place != in_place or (
        scattered is not None and planned.scattered != scattered
    ):
        planned = plan_stream(jobs, route, in_place, scattered)
    scattered, rest, plan, splan = planned.scattered, planned.rest, planned.plan, planned.splan
    if route is not None and (scattered or plan.nbuckets):
        if undo is None and in_place and undo_enabled():
            undo = _UndoLog(jobs)
        try:
            if plan.nbuckets:
                _broadcast_stream(plan, route, undo, planned.storage)
            if scattered:
                run_scatter(planned.schedule, route, undo)
        except BaseException:
            # a peer died (or the backend failed) mid-stream: what the
            # stream so far wrote into live tensors is put back
            if undo is not None:
                undo.restore()
            raise
    values = C.finish_full_load(plan, DTensor.from_local, offload)
    if not scattered:
        return values
    out: list[Any] = [None] * len(jobs)
    for i, value in zip(rest, values):
        out[i] = value
    for i, value in zip(scattered, C.finish_full_load(splan, DTensor.from_local, offload)):
        out[i] = value
    return out


def opaque_values(jobs: list[tuple[Any, Any, Any]]) -> list[int]:
    """The jobs whose full value is a wrapper subclass no byte view reaches
    (``tensor_bytes.opaque``: torch's ``TwoTensor``, torchao's
    ``NF4Tensor``): the native planner would cut some other tensor's
    bytes."""
    return [i for i, (value, _, _) in enumerate(jobs) if isinstance(value, torch.Tensor) and opaque(value)]


def refuse_opaque_stream(jobs: list[tuple[Any, Any, Any]], names: Callable[[], list[str]], what: str = "") -> None:
    """On a broadcast load's source, before data moves: a stream sends
    bytes, and an opaque full value (``opaque_values``) has none that
    are its values.  Upstream's broadcast raises for it too (the
    subclass has no ``broadcast``).  Nor does the payload carry it
    inline (``payload._inlinable``: plain dense tensors only)."""
    wrapped = opaque_values(jobs)
    if wrapped:
        i = wrapped[0]
        cls = type(jobs[i][0])
        raise errors.StateDictValueError(
            f"broadcast_from_rank0=True: {what}{names()[i]} is a {cls.__module__}.{cls.__qualname__}, a tensor "
            "subclass that keeps its values in no single byte buffer: a broadcast cannot send it (upstream's "
            "cannot either); load it with every rank holding the full state dict, or from a sharded state dict"
        )


def _slice_opaque(jobs: list[tuple[Any, Any, Any]], wrapped: list[int], offload: torch.device | None,
                  in_place: bool) -> list[Any]:
    """``run_full_load`` without a stream where the jobs ``wrapped`` hold
    opaque full values: those are cut as upstream's
    ``_distribute_state_dict`` cuts every tensor -- ``distribute_tensor``
    through the subclass's own operations, each rank from its own copy of
    the full dict (``src_data_rank=None``: no communication, as every
    other tensor of a full load here), a 0-dim value on the CPU, a plain
    template's value as it is on its device -- new tensors, installed at
    commit by the subclass's own ``copy_``; the others as usual.  Never in
    place (``_StreamedLoad._settle_in_place``)."""
    assert not in_place, "a load with opaque full values is not written in place"
    taken = set(wrapped)
    rest = [i for i in range(len(jobs)) if i not in taken]
    out: list[Any] = [None] * len(jobs)
    if rest:
        for i, value in zip(rest, run_full_load([jobs[i] for i in rest], route=None, offload=offload)):
            out[i] = value
    for i in wrapped:
        value, template, device = jobs[i]
        full = value.detach()
        if full.dim() == 0:
            out[i] = full.cpu()
        elif isinstance(template, DTensor):
            out[i] = distribute_tensor(full.to(device), template.device_mesh, template.placements, src_data_rank=None)
        else:
            out[i] = full.to(device)
    return out


def _broadcast_stream(plan: Any, route: Route, undo: _UndoLog | None, storage: torch.Tensor) -> None:
    """The buckets of ``plan``, broadcast from the route's source through
    ``storage`` (``plan_stream``'s), each rank keeping its rows of every
    chunk.  A failure of this rank's own
    (packing, the undo log's copy, extracting: not the backend's) does not
    end its part in the stream, whose every broadcast the peers wait in:
    it stops writing, keeps taking part, and raises the failure once the
    stream is done (as ``run_scatter`` does)."""
    failure = OwnFailure()
    attempt = failure.attempt

    def land(chunks: list[tuple], buf: torch.Tensor, data: torch.Tensor | None = None) -> None:
        if undo is not None:
            undo.save(chunks)
        _extract_rows(buf, chunks, data)

    def send(run: list[tuple], buf: torch.Tensor) -> torch.Tensor | None:
        data = _direct_bytes(run, buf.device)
        if data is None:
            _pack_rows(buf, run)
        return data

    for b, nbytes in enumerate(plan.bucket_bytes):
        buf = storage[:nbytes]
        chunks = plan.chunks(b)
        if len(route.stages) != 1:
            if route.is_source:
                attempt(_pack_rows, buf, chunks)
            route.broadcast(buf)
            attempt(land, chunks, buf)
            continue
        # One collective per run of small chunks (packed) and per
        # large chunk (sent from the source's own tensor where its
        # bytes are contiguous, no copy), all in flight at once:
        # each run is unpacked as soon as it has arrived, while
        # the next ones travel.  The runs follow from the plan
        # alone, so every rank issues the same collectives.
        pending = []
        for run in _runs(chunks):
            view, data = _run_view(buf, run), None
            if route.is_source:
                data = attempt(send, run, buf)
            pending.append((route.broadcast(view if data is None else data, async_op=True), run, data))
        for work, run, data in pending:
            work.wait()
            attempt(land, run, buf, data)
        del pending
    failure.raise_if_any()


UNDO_ENV = "DCP_OPTIM_STREAM_UNDO"


def undo_enabled() -> bool:
    """Whether an in-place stream keeps the values it overwrites (on the
    host) until it completes: ``DCP_OPTIM_STREAM_UNDO`` (default 1; 0:
    upstream's footprint, and a stream that fails mid-way -- a peer killed
    -- leaves the tensors written so far)."""
    return os.environ.get(UNDO_ENV, "1").strip() not in ("0", "false", "False", "")


def _live_locals(jobs: list[tuple[Any, Any, Any]]) -> list[torch.Tensor]:
    """The local tensors of the jobs' live templates (a DTensor's shard)."""
    out = []
    for _, template, _ in jobs:
        local = template.to_local() if isinstance(template, DTensor) else template
        if isinstance(local, torch.Tensor):
            out.append(local)
    return out


_PLAIN_LOCALS = (torch.Tensor, nn.Parameter)


def _subclass_locals(locals_: list[torch.Tensor]) -> bool:
    """Whether a live template's local tensor (``_live_locals``) is a
    tensor subclass (not a plain tensor or parameter): its storage is not
    the values (a wrapper subclass has none), so the stream cannot write
    it in place nor keep it in the undo log by its storage."""
    return any(type(local) not in _PLAIN_LOCALS for local in locals_)


class _UndoLog:
    """The previous values of the live tensors an in-place stream writes
    into, each copied to the host the first time a bucket reaches it:
    the stream's cost is at most this rank's shards in host memory (no
    device memory), and a failed stream restores them."""

    def __init__(self, jobs: list[tuple[Any, Any, Any]], locals_: list[torch.Tensor] | None = None):
        self.locals = _live_locals(jobs) if locals_ is None else locals_
        self.live: set[int] = {local.untyped_storage().data_ptr() for local in self.locals}
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def save(self, chunks: list[tuple]) -> None:
        self.save_dests([chunk[7] for chunk in chunks])

    def save_dests(self, dests: list[Any]) -> None:
        """Keep each of ``dests`` that is a live tensor, the first time."""
        for dest in dests:
            if not isinstance(dest, torch.Tensor) or id(dest) in self.saved:
                continue
            if dest.untyped_storage().data_ptr() not in self.live:
                continue  # a fresh tensor of this load, not a live one
            self.saved[id(dest)] = (dest, dest.detach().to(_CPU, copy=True))

    def save_all(self, host: torch.Tensor | None = None) -> None:
        """Keep every live template's local tensor (a load that writes
        them all without buckets).  ``host``: a CPU byte buffer of at
        least ``host_bytes(self.locals)`` to keep the copies in (a caller
        that reuses it across calls spares the fresh pages' faults, about
        twice the copy itself); None allocates them."""
        off = 0
        for local in self.locals:
            if id(local) in self.saved:
                continue
            if host is None:
                self.saved[id(local)] = (local, local.detach().to(_CPU, copy=True))
                continue
            n = local.numel() * local.element_size()
            keep = host[off:off + n].view(local.dtype).view(local.shape)
            keep.copy_(local.detach())
            self.saved[id(local)] = (local, keep)
            off += _aligned(n)

    @torch.no_grad()
    def restore(self) -> None:
        for dest, old in self.saved.values():
            dest.copy_(old)
        self.saved.clear()


def _aligned(n: int) -> int:
    return (n + 63) & ~63


def host_bytes(locals_: list[torch.Tensor]) -> int:
    """The size of ``_UndoLog.save_all``'s ``host`` buffer for these tensors."""
    return sum(_aligned(t.numel() * t.element_size()) for t in locals_)


# The stream's executors only call torch methods: a C version measured no
# faster (docs/architecture.md, "What stays in C").


def _pack_rows(buf: torch.Tensor, chunks: list[tuple]) -> None:
    """Source side of a stream bucket: the bytes of each row chunk of a
    job's full value at its offset in ``buf``."""
    for value, row_start, rows, offset, _, _, _, _, _ in chunks:
        part = value if row_start < 0 else value[row_start : row_start + rows]
        data = flat_bytes(part)
        n = data.numel()
        if n:
            buf[offset : offset + n].copy_(data)


# A chunk of DIRECT_BYTES or more travels on its own (from the source's
# own tensor where it can); smaller neighbours share one packed
# collective.


def _runs(chunks: list[tuple]) -> list[list[tuple]]:
    """A bucket's chunks as consecutive runs of one collective each: every
    large row chunk alone, the chunks between them together (empty runs
    dropped).  Depends only on the plan, the same on every rank."""
    out: list[list[tuple]] = []
    packed: list[tuple] = []
    for chunk in chunks:
        if chunk[4] >= DIRECT_BYTES and chunk[1] >= 0:
            if packed:
                out.append(packed)
                packed = []
            out.append([chunk])
        else:
            packed.append(chunk)
    if packed:
        out.append(packed)
    return [run for run in out if run[-1][3] + run[-1][4] > run[0][3]]


def _run_view(buf: torch.Tensor, run: list[tuple]) -> torch.Tensor:
    """The bytes of ``buf`` a run spans."""
    return buf[run[0][3] : run[-1][3] + run[-1][4]]


def _direct_bytes(run: list[tuple], device: torch.device) -> torch.Tensor | None:
    """Source side: the bytes of a one-chunk run straight from its full
    value, when they are contiguous there and on the stream's device
    (else None: the run is packed)."""
    if len(run) != 1:
        return None
    value, row_start, rows = run[0][:3]
    if row_start < 0 or not isinstance(value, torch.Tensor) or value.device != device:
        return None
    part = value[row_start : row_start + rows]
    if not own_bytes(part):
        return None
    return flat_bytes(part.detach())


def _extract_rows(buf: torch.Tensor, chunks: list[tuple], data: torch.Tensor | None = None) -> None:
    """Every rank's side of a stream bucket: each row chunk into its job's
    destination -- the same rows of a full tensor, or the blocks of this
    rank's shard clipped to the rows (jobs not needed here are skipped).
    ``data``: the bytes of a one-chunk run where they are not in ``buf``
    (the source sent them from the tensor itself)."""
    for _, row_start, rows, offset, nbytes, dtype, shape, dest, blocks in chunks:
        if nbytes == 0 or dest is None:
            continue
        raw = buf[offset : offset + nbytes] if data is None else data
        chunk = raw.view(dtype).view(shape)
        if blocks is not None:
            C.copy_blocks(dest, chunk, blocks, 1, None if row_start < 0 else (row_start, rows))
        elif row_start < 0:
            dest.copy_(chunk)  # 0-dim values travel whole
        else:
            dest[row_start : row_start + rows] = chunk


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


class _StreamedLoad:
    """What the model's full load (``ModelFullLoad``) and the optimizer's
    (``OptimLocalize``) share about a broadcast load's data: which jobs
    its stream scatters, the stream's plan made before the agreement
    ahead of it (``reserve``), the source's tree where it came inline
    (every rank then slices it locally: nothing in place), and the undo of
    what an in-place stream wrote.  ``validate`` sets ``jobs`` and
    ``in_place``."""

    route: Route | None
    info: Any
    in_place: bool
    jobs: list[tuple[Any, Any, Any]]
    # the jobs the stream scatters (None: not decided yet; [] broadcasts all)
    scattered: list[int] | None = None
    # plan_stream's, made by reserve (None: move plans)
    planned: StreamPlan | None = None
    # inline loads (``payload``): the source's tree, as every rank received it
    inline: Any = None
    undo: _UndoLog | None = None
    # the live templates' local tensors (``_live_locals``), and whether
    # every one is plain: looked at once per load (None: not yet; reserve
    # and move both settle in_place, move keeps them in the undo log)
    live_locals: list[torch.Tensor] | None = None
    plain_locals: bool | None = None

    def stream_paths(self) -> int:
        self.scattered = _scattered(self.jobs, self.route)
        return paths_digest(len(self.jobs), self.scattered)

    def broadcast_all(self) -> None:
        """The ranks' digests differed: the stream broadcasts every job."""
        self.scattered = []
        self.planned = None  # reserved for the scatters: move plans again

    def take_inline(self, values: Any) -> None:
        self.inline = values

    def _settle_in_place(self) -> None:
        if self.inline is not None or not in_place_allowed(self.info):
            self.in_place = False  # inline: sliced locally into new tensors, nothing written before commit
        elif self.in_place:
            if self.plain_locals is None:
                self.plain_locals = not _subclass_locals(self._locals()) and not opaque_values(self.jobs)
            # a tensor subclass (torchao's float8 weights under FSDP2, say)
            # is written by its own copy_ in load_state_dict, as upstream's
            # load does: new tensors here, nothing written before commit
            self.in_place = self.plain_locals

    def _locals(self) -> list[torch.Tensor]:
        if self.live_locals is None:
            self.live_locals = _live_locals(self.jobs)
        return self.live_locals

    def _start_undo(self) -> None:
        """The undo log of a move that writes in place (none otherwise)."""
        self.undo = _UndoLog(self.jobs, self._locals()) if self.in_place and undo_enabled() else None

    def reserve(self) -> None:
        """Before the agreement ahead of a broadcast load's stream: plan
        it and allocate what it needs (``StreamPlan``)."""
        self._settle_in_place()
        if self.route is not None and self.inline is None and self.jobs:
            self.planned = plan_stream(self.jobs, self.route, self.in_place, self.scattered)

    def abort(self) -> None:
        """Put back what ``move`` wrote into live tensors (the load failed
        after it: its agreement)."""
        undo, self.undo = self.undo, None
        if undo is not None:
            undo.restore()


class ModelFullLoad(_StreamedLoad):
    """A full model load in three steps, so that every check of every rank
    is agreed on before any data moves (see ``consistency.Agreement``):

    * ``source_meta()`` (local): what the source broadcasts -- the tree of
      (shape, dtype) of its dict -- or None;
    * ``validate(meta)`` (local, after the metadata exchange): the jobs,
      every tensor's global shape against the parameter's, and ``precheck``
      (the model load's whole validation) on the dict as it will be
      loaded;
    * ``move()``: the data -- local slicing when every rank holds the full
      dict (``route`` None, upstream's _distribute_state_dict +
      update(local)), else a bucketed stream from the route's source
      (upstream's _broadcast_state_dict semantics).  Returns the dict to
      load.

    Where the checks ran on the whole dict (same keys as the model's, and a
    ``precheck``), the shards are written straight into the parameters
    (upstream's footprint: no second copy); otherwise DTensors are sliced
    into new DTensors and nothing is written before load_state_dict."""

    def __init__(
        self, full, local, device, *, route=None, strict=True, cpu_offload=False, precheck=None, info=None
    ):
        self.info = info
        self.full = full
        self.local = local
        self.device = device
        self.route = route
        self.strict = strict
        self.cpu_offload = cpu_offload
        self.precheck = precheck
        self.jobs = []

    def source_meta(self) -> Any:
        route = self.route
        if route is None or not route.is_source:
            return None
        return tree_metadata(self.full)

    def validate(self, meta: Any = None) -> None:
        if self.route is None:
            self._validate_local()
        else:
            self._validate_stream(meta)

    def _validate_local(self) -> None:
        full, local = self.full, self.local
        merged, jobs = C.full_load_merge(context(), full, local, self.device)
        self.merged = merged
        self.keys = [key for key, _, _ in jobs]
        self.jobs = [(full_t, local_t, local_t.device) for _, full_t, local_t in jobs]
        self.in_place = self.precheck is not None and full.keys() == local.keys()
        if self.precheck is not None:
            # The dict as it will be loaded, full tensors standing in for
            # this rank's shards: torch's own errors, all of them.
            pre = dict(merged)
            for key, job in zip(self.keys, self.jobs):
                pre[key] = job[0]
            self.precheck(pre)
        # Never cut a tensor with a parameter's sharding unless it has the
        # parameter's global shape (whatever else is known about the load).
        check_global_shapes(self.keys, self.jobs)

    def _validate_stream(self, meta: Any) -> None:
        route = self.route
        assert route is not None  # validate's stream branch
        if not isinstance(meta, dict):
            raise errors.StateDictValueError(
                "broadcast_from_rank0=True: the source rank "
                f"({route.source}) did not provide a model state dict"
            )
        self.meta = meta
        keys, jobs, non_tensor = _broadcast_jobs(
            meta, self.full if route.is_source else self.inline, self.local, self.device
        )
        check_global_shapes(keys, jobs)
        if route.is_source and self.inline is None:
            refuse_opaque_stream(jobs, lambda: keys)
        out = dict(self.local)
        for key, value in non_tensor:
            if key in out:
                out[key] = value
        self.keys, self.jobs, self.out = keys, jobs, out
        # In place (shards streamed straight into the parameters, peak one
        # bucket, as upstream) only once the whole load is known to pass:
        # the same keys as the model's, and the dict as it will be loaded
        # -- the live tensors standing in for the streamed ones, whose
        # shapes were just checked -- passes the model load's own checks.
        self.in_place = self.precheck is not None and meta.keys() == self.local.keys()
        if self.precheck is not None:
            self.precheck(self._as_loaded(out))

    def _as_loaded(self, out: dict[str, Any]) -> dict[str, Any]:
        """What move() returns, with ``out``'s values (live tensors of the
        global shapes just checked, for the streamed ones)."""
        out = dict(out)
        if self.strict:
            for key in [k for k in out if k not in self.meta]:
                del out[key]
        if self.route is not None and self.route.is_source:
            merged = dict(self.full)
            merged.update(out)
            return merged
        return out

    def move(self) -> dict[str, Any]:
        route = self.route
        self._settle_in_place()
        self._start_undo()
        if route is None:
            if self.jobs:
                values = run_full_load(self.jobs, route=None, in_place=self.in_place, undo=self.undo)
                C.write_slots([(self.merged, key) for key in self.keys], values)
            return self.merged
        out = self.out
        offload = _CPU if self.cpu_offload else None
        if self.inline is not None:
            values = run_full_load(self.jobs, route=None, offload=offload)
        else:
            values = run_full_load(
                self.jobs, route=route, offload=offload, in_place=self.in_place, undo=self.undo,
                scattered=self.scattered, planned=self.planned,
            )
            self.planned = None
        C.write_slots([(out, k) for k in self.keys], values)
        if self.strict:
            for key in [k for k in out if k not in self.meta]:
                del out[key]
        if route.is_source:
            merged = dict(self.full)
            merged.update(out)
            return merged
        return out

    def inline_values(self) -> Any:
        """What travels inline from the source (its dict), else None."""
        return self.full if self.route is not None and self.route.is_source else None


def _scattered(jobs: list[tuple], route: Route | None) -> list[int]:
    """The jobs a stream would scatter (none without a stream)."""
    return scatter_jobs(jobs, route) if route is not None else []


def _stand_in(job: tuple) -> Any:
    """What validates in place of a job's result before the data moves:
    its template (this rank's shard of the same global shape), else the
    full tensor, else (metadata on a receiving rank) an uninitialised
    tensor of its shape and dtype, freed before the data arrives in one of
    the same size."""
    value, template, device = job
    if template is not None:
        return template
    if isinstance(value, torch.Tensor):
        return value
    return torch.empty(value.shape, dtype=value.dtype, device=device)


def in_place_allowed(info: Any) -> bool:
    """Writes into live tensors before commit only while every part of
    the load was validated in full before data moved (a model whose load
    hooks may rename keys is validated after the data arrives: then
    nothing of the load is written in place, so that its failure changes
    nothing)."""
    return info is None or not getattr(info, "validated_after_move", False)


def check_global_shapes(keys: list[str], jobs: list[tuple], what: str = "") -> None:
    """A full tensor is cut with its template's sharding only when it has
    the template's global shape: raised with torch's wording, on every rank
    that sees the mismatch, before any data moves."""
    bad = C.shape_mismatches(jobs, torch.Tensor)
    if bad:
        i, got, want = bad[0]
        raise errors.StateDictRuntimeError(
            f"size mismatch for {what}{keys[i]}: copying a param with shape {torch.Size(got)} "
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


# --- optimizer -----------------------------------------------------------------


class OptimLocalize(_StreamedLoad):
    """Make the tensors of a loaded optimizer view local to this rank, in
    the three steps of ``ModelFullLoad`` (source_meta, validate, move).

    full=True (full_state_dict loads): full tensors of DTensor parameters
    become this rank's shard, as DTensors (D9); with broadcast_from_rank0
    the view itself first travels from the source.
    full=False (sharded loads): only plain tensors given for DTensor
    parameters are converted (D9); everything else is left as is.

    ``held()`` (the optimizers' current state by FQN) and ``precheck(view)``
    (the load's whole validation): the view is validated first with the
    current state tensors (or the parameters) standing in for the incoming
    ones; on full loads where every streamed tensor belongs to a held
    state tensor, the shards are then written straight into it where dtype
    and layout allow -- upstream's footprint, without a second copy of the
    optimizer state, and still nothing changed when a check fails.
    """

    def __init__(self, view: tuple, info: Any, *, full: bool, held=None, precheck=None, keep_plain=None):
        self.view = view
        self.info = info
        self.full = full
        self.held = held
        self.precheck = precheck
        self.keep_plain = keep_plain
        self.jobs = []
        self.route = None
        if full and info.broadcast_from_rank0:
            self.route = route_for(info.index, _state_device(info.index))

    def source_meta(self) -> Any:
        route = self.route
        if route is None or not route.is_source:
            return None
        return view_metadata(self.view)

    def validate(self, payload: Any = None) -> None:
        state, groups, fqn_group, empties, unexpected = self.view
        route = self.route
        if route is not None:
            if payload is None:
                raise errors.StateDictValueError(
                    "broadcast_from_rank0=True: the source rank "
                    f"({route.source}) did not provide an optimizer state dict"
                )
            if not route.is_source:
                state, groups, fqn_group, empties, unexpected = payload
                if self.inline is not None:
                    state = self.inline
        full = self.full
        existing = self.held() if full and self.held is not None and self.precheck is not None else None
        # the state tensors the optimizer keeps whole beside DTensor
        # parameters stay as they come (see optim.kept_plain)
        keep = self.keep_plain() if self.keep_plain is not None else {}
        kept = _set_aside(state, keep, full)
        original = state
        if kept:
            state = {fqn: _without(entry, kept[fqn]) if fqn in kept else entry for fqn, entry in state.items()}
        new_state, jobs, slots, n_held = C.optim_state_jobs(
            self.info.index, state, DTensor, 0 if full else 1, DTensor.from_local, existing
        )
        for fqn, paths in kept.items():
            _put_back(original[fqn], new_state[fqn], paths)
            if full:
                # a full load delivers them whole (a broadcast's stream
                # too), as any tensor no parameter's layout shards
                for path in paths:
                    container = new_state[fqn]
                    for key in path[:-1]:
                        container = container[key]
                    jobs.append((container[path[-1]], None, keep[fqn][2]))
                    slots.append((container, path[-1]))
        if full and jobs:
            owner = {id(entry): fqn for fqn, entry in new_state.items() if isinstance(entry, dict)}
            names = [f"{owner.get(id(slot[0]), '?')}.{slot[1]}" for slot in slots]
            check_global_shapes(names, jobs, "optimizer state ")
            if route is not None and route.is_source and self.inline is None:
                refuse_opaque_stream(jobs, lambda: names, "optimizer state ")
        # Only when every job's template is a held state tensor: an in-place
        # load writes into its templates, and a parameter is never one here.
        self.in_place = bool(jobs) and n_held == len(jobs)
        self.result = (new_state, groups, fqn_group, empties, unexpected)
        self.jobs, self.slots = jobs, slots
        if self.precheck is not None and jobs:
            # the templates stand in for the incoming tensors (same global
            # shape, just checked; this rank's shard of it)
            C.write_slots(slots, [_stand_in(job) for job in jobs])
            self.precheck(self.result)
            C.write_slots(slots, [None] * len(slots))

    def move(self) -> tuple:
        inline = self.inline is not None
        self._settle_in_place()
        self._start_undo()
        if self.jobs:
            values = run_full_load(
                self.jobs, route=None if inline else self.route, in_place=self.in_place, undo=self.undo,
                scattered=self.scattered, planned=self.planned,
            )
            self.planned = None
            C.write_slots(self.slots, values)
        return self.result

    def inline_values(self) -> Any:
        """What travels inline from the source (its state), else None."""
        return self.view[0] if self.route is not None and self.route.is_source else None


def _set_aside(state: dict[str, Any], keep: dict[str, tuple[frozenset[tuple], tuple, Any]],
               full: bool) -> dict[str, dict[tuple, Any]]:
    """Of ``keep``'s paths (with the parameter's global shape), those
    ``state`` holds a tensor (or its metadata) with a dimension at:
    {fqn: {path: value}}.  A full load sets aside only those of the
    parameter's shape: it keeps any other tensor whole already."""
    out: dict[str, dict[tuple, Any]] = {}
    for fqn, (paths, shape, _) in keep.items():
        entry = state.get(fqn)
        for path in paths:
            value: Any = entry
            for key in path:
                value = value.get(key) if isinstance(value, dict) else None
            if not isinstance(value, torch.Tensor | TensorMeta) or len(value.shape) == 0:
                continue
            if not full or tuple(value.shape) == shape:
                out.setdefault(fqn, {})[path] = value
    return out


def _without(entry: dict[Any, Any], paths: dict[tuple, Any], at: tuple = ()) -> dict[Any, Any]:
    """``entry`` without the leaves at ``paths`` (its dicts copied)."""
    out: dict[Any, Any] = {}
    for key, value in entry.items():
        if (*at, key) in paths:
            continue
        out[key] = _without(value, paths, (*at, key)) if isinstance(value, dict) else value
    return out


def _put_back(loaded: dict[Any, Any], entry: dict[Any, Any], paths: dict[tuple, Any], at: tuple = ()) -> None:
    """Put the values set aside at ``paths`` back into ``entry`` (the
    localized copy of ``loaded``), in ``loaded``'s order of keys.  In
    place: the load's slots (where each job's result goes) are entries'
    dicts."""
    ordered: list[tuple[Any, Any]] = []
    for key, value in loaded.items():
        here = (*at, key)
        if here in paths:
            ordered.append((key, paths[here]))
        elif key in entry:
            mine = entry[key]
            if isinstance(value, dict) and isinstance(mine, dict):
                _put_back(value, mine, paths, here)
            ordered.append((key, mine))
    entry.clear()
    entry.update(ordered)


def view_metadata(view: tuple) -> tuple:
    """What a broadcast load's source sends of an optimizer view (its
    state, groups, FQN groups, empty groups and unexpected keys): the
    state's ``tree_metadata``, the rest as is."""
    state, groups, fqn_group, empties, unexpected = view
    return (tree_metadata(state), groups, fqn_group, empties, unexpected)


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


def fsdp2_param_groups(state: Any) -> list[Any]:
    """The parameter groups of an FSDP2 state: ``_fsdp_param_groups`` from
    torch 2.12 on (a module may hold several), the single
    ``_fsdp_param_group`` (or ``None``) on torch 2.11.  Raises
    ``AttributeError`` on a layout that has neither, so that a torch with
    another layout fails loudly instead of skipping the groups."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return groups  # FSDP2's own list, read only (every get and set walks it)
    group = state._fsdp_param_group
    return [] if group is None else [group]


def reshard_fsdp2(model: nn.Module) -> None:
    """Bring every FSDP2 parameter group of ``model`` that a forward left
    unsharded (a ``no_grad`` forward of the root, ``reshard_after_forward=
    False``, between forward and backward) back to its sharded parameters,
    as the state-dict hooks FSDP2 registers do when upstream calls
    ``model.state_dict()`` / ``load_state_dict`` -- here before the model
    is walked, so that the optimizers' (sharded) parameters are the
    model's.  Local (no communication); the next forward all-gathers
    again.  Costs one pass over the process's FSDP2 states when none is
    unsharded."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:  # pragma: no cover - other torch layouts
        return
    # ``is_sharded`` is ``_sharded_state == SHARDED``: read directly (one
    # property call per group is most of this pass's cost); the modules
    # are looked at only where some group is not sharded.
    sharded = ShardedState.SHARDED
    if all(
        g._sharded_state is sharded
        for ref in list(_module_state_mapping.values())
        if isinstance(state := ref(), FSDPState)
        for g in fsdp2_param_groups(state)
    ):
        return
    pending = []
    for module, ref in list(_module_state_mapping.items()):
        state = ref()
        if not isinstance(state, FSDPState):
            continue
        groups = [g for g in fsdp2_param_groups(state) if not g.is_sharded]
        if groups:
            pending.append((module, groups))
    if not pending:
        return
    inside = {id(m) for m in model.modules()}
    for module, groups in pending:
        if id(module) in inside:
            for group in groups:
                group._to_sharded()
