"""The scatter path of broadcast loads: each rank receives only its rows.

A broadcast load sends every tensor whole to every rank, which keeps only
its shard.  For the most common layout -- a DTensor sharded along dim 0
on a 1-D mesh whose ranks are the stream's group, in its rank order
(FSDP2's parameters and their optimizer state) -- the source can instead
scatter each rank its own rows: a receiver gets 1/W of the bytes, the
source sends each byte once, and where the rank's shard is contiguous its
rows land straight in it (no bucket, no copy).

The layout of ``Shard(0)`` is ``torch.chunk``'s: rank ``r`` holds rows
``[r * c, min((r + 1) * c, N))`` with ``c = ceil(N / W)`` (the last ranks
fewer, or none).  A scatter moves pieces of one size to every rank, so a
tensor travels as steps of ``k`` rows of every rank's chunk (``W * k``
rows within a bucket); a rank whose chunk ends inside a step receives
that step into a scratch buffer and keeps its real rows.  Tensors whose
bytes are under ``DIRECT_BYTES`` share one scatter per group of them
(a "packed" unit): the source lays out every other rank's rows of each
tensor in that rank's segment of a buffer, one strided copy per tensor,
and copies its own rows straight into its shards; each receiver copies
its rows out of its segment.

Only tensors whose chunk per rank holds at least
``SCATTER_MIN_CHUNK_BYTES`` take this path: the source's cost of a scatter
grows with the world (a list entry per rank), so at large worlds, where
chunks are small, tensors are broadcast instead.  The source's inputs of a
step are built in a constant number of torch calls (``_source_inputs``).

Which tensors take this path is decided from the templates' layouts and
the shared metadata (``scatter_jobs``); the ranks agree on it before data moves
(``paths_digest``, an agreement flag), because a rank that broadcast
where another scatters would leave both waiting.
"""

from __future__ import annotations

import math
import zlib
from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from .collectives import OwnFailure

# A tensor of at least this many bytes travels in scatters of its own;
# smaller ones share one packed scatter (the stream's threshold too).
DIRECT_BYTES = 1 << 20
# Plans of scatter jobs never split a tensor into row chunks (the
# executor steps through rows itself).
NO_CHUNKING = 1 << 62
# A tensor is scattered only where each rank's chunk of it holds at least
# this many bytes.  A scatter costs the source a list entry per rank, in
# torch's own Python (about 2-3 us each, whatever the bytes): amortized
# over 64 KiB per rank that is about a tenth of a host copy of the same
# bytes, while over the few bytes per rank of a large world it would be
# the whole call (a 1 MiB tensor over 16384 ranks is 64 bytes a rank).
# Smaller chunks are broadcast, with a constant number of calls per bucket.
SCATTER_MIN_CHUNK_BYTES = 64 << 10


def _align(n: int) -> int:
    return (n + 63) & ~63


def _group_ranks(group: Any) -> list[int]:
    if group is None:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def scatter_jobs(jobs: list[tuple[Any, Any, Any]], route: Any) -> list[int]:
    """Indices of the jobs a broadcast load scatters: a DTensor template
    sharded ``Shard(0)`` on a 1-D mesh whose ranks are the route's group
    in its rank order, living on the route's device, and a full value of
    at least one row whose chunk per rank holds at least
    ``SCATTER_MIN_CHUNK_BYTES``.  Depends on the templates' layouts
    (agreed through ``paths_digest``) and the shared metadata."""
    if len(route.stages) != 1:
        return []
    group, _ = route.stages[0]
    ranks = _group_ranks(group)
    if len(ranks) < 2:
        return []
    meshes: dict[int, bool] = {}
    out = []
    for i, (value, template, device) in enumerate(jobs):
        if not isinstance(template, DTensor) or torch.device(device) != route.device:
            continue
        pls = template.placements
        if len(pls) != 1 or type(pls[0]) is not Shard or pls[0].dim != 0:
            continue
        shape = tuple(value.shape)
        if not shape or shape[0] < 1 or any(d < 1 for d in shape):
            continue
        if -(-shape[0] // len(ranks)) * math.prod(shape[1:]) * value.dtype.itemsize < SCATTER_MIN_CHUNK_BYTES:
            continue
        mesh = template.device_mesh
        ok = meshes.get(id(mesh))
        if ok is None:
            ok = meshes[id(mesh)] = mesh.ndim == 1 and mesh.mesh.tolist() == ranks
        if ok:
            out.append(i)
    return out


def paths_digest(njobs: int, scattered: list[int]) -> int:
    """A 32-bit digest of which of ``njobs`` jobs are scattered: what
    the ranks agree on before data moves."""
    marks = bytearray(njobs)
    for i in scattered:
        marks[i] = 1
    return zlib.crc32(bytes(marks))


class _Piece:
    """One tensor's part of a scatter unit: rows ``[start, start + rows)``
    of every rank's chunk of ``value`` (chunks of ``chunk`` rows; ``n``
    rows in all), at byte ``offset`` of each rank's segment."""

    __slots__ = ("value", "dest", "n", "chunk", "start", "rows", "row_bytes", "offset")

    def __init__(self, value, dest, n, chunk, start, rows, row_bytes, offset):
        self.value, self.dest, self.n, self.chunk = value, dest, n, chunk
        self.start, self.rows, self.row_bytes, self.offset = start, rows, row_bytes, offset

    def real_rows(self, rank: int) -> int:
        """How many of the piece's rows rank ``rank`` holds."""
        have = min(self.chunk, self.n - rank * self.chunk) - self.start
        return max(0, min(self.rows, have))


def _units(jobs, dests, world: int, budget: int) -> list[tuple[int, list[_Piece]]]:
    """The scatters of a load, in order: (bytes per rank, pieces).  A
    tensor of ``DIRECT_BYTES`` or more (or more than ``budget``) goes in
    steps of whole rows of every rank's chunk, ``W * k`` rows within
    ``budget`` (a row larger than that alone); smaller ones are packed
    together within ``budget``.  From the metadata alone: the same
    on every rank."""
    units: list[tuple[int, list[_Piece]]] = []
    packed: list[_Piece] = []
    used = 0
    for (value, _, _), dest in zip(jobs, dests):
        shape = tuple(value.shape)
        n = shape[0]
        row_bytes = value.dtype.itemsize
        for d in shape[1:]:
            row_bytes *= d
        chunk = -(-n // world)
        if world * chunk * row_bytes >= min(DIRECT_BYTES, budget):
            k = max(1, min(chunk, budget // (world * row_bytes)))
            for start in range(0, chunk, k):
                rows = min(k, chunk - start)
                units.append((rows * row_bytes, [_Piece(value, dest, n, chunk, start, rows, row_bytes, 0)]))
            continue
        size = _align(chunk * row_bytes)
        if packed and world * (used + size) > budget:
            units.append((used, packed))
            packed, used = [], 0
        packed.append(_Piece(value, dest, n, chunk, 0, chunk, row_bytes, used))
        used += size
    if packed:
        units.append((used, packed))
    return units


def _source_rows(piece: _Piece, rank: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """The source's bytes of ``rank``'s rows of a one-piece unit: a view
    of the value where its rows are contiguous, whole and on the stream's
    device, else a padded copy; and the bytes that copy took (0 for a
    view)."""
    value, real = piece.value, piece.real_rows(rank)
    first = rank * piece.chunk + piece.start
    part = value.detach()[first : first + real]
    if real == piece.rows and part.is_contiguous() and part.device == device:
        return part.reshape(-1).view(torch.uint8), 0
    nbytes = piece.rows * piece.row_bytes
    out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if real:
        out[: real * piece.row_bytes].view(value.dtype).view(part.shape).copy_(part)
    return out, nbytes


def _whole_ranks(piece: _Piece, world: int) -> int:
    """How many leading ranks hold the piece's rows whole: rank ``r`` does
    while ``r * chunk + start + rows <= n`` (every rank before a partial
    or empty chunk; ``real_rows``)."""
    return max(0, min(world, (piece.n - piece.start - piece.rows) // piece.chunk + 1))


def _source_inputs(piece: _Piece, world: int, device: torch.device) -> tuple[list[torch.Tensor], int]:
    """Every rank's input of a one-piece unit's scatter, in a number of
    torch calls that does not grow with the world: the ranks holding the
    piece's rows whole as one strided selection of the value (views of
    it where it is contiguous on the stream's device, else one copy), the
    rank with a partial chunk (at most one) padded, and the ranks past the
    last row sharing one unwritten buffer (what they receive is never
    read).  Returns the inputs and the bytes their copies took."""
    whole = _whole_ranks(piece, world)
    step = piece.rows * piece.row_bytes
    inputs: list[torch.Tensor] = []
    nbytes = 0
    if whole:
        value = piece.value.detach()
        if value.is_contiguous() and value.device == device:
            flat = value.reshape(-1).view(torch.uint8)
            # as_strided's offset counts from the storage's start: add the view's own
            rows = flat.as_strided(
                (whole, step), (piece.chunk * piece.row_bytes, 1), flat.storage_offset() + piece.start * piece.row_bytes
            )
        else:
            # rows [r * chunk + start, + rows) of ranks r < whole, through the
            # value's own strides (its last chunk may be shorter than `chunk`
            # while this step's rows of it are whole)
            stride0 = value.stride(0)
            picked = value.as_strided(
                (whole, piece.rows, *value.shape[1:]),
                (piece.chunk * stride0, stride0, *value.stride()[1:]),
                value.storage_offset() + piece.start * stride0,
            )
            rows = torch.empty((whole, step), dtype=torch.uint8, device=device)
            rows.view(value.dtype).view(picked.shape).copy_(picked)
            nbytes += whole * step
        inputs.extend(rows.unbind(0))
    if whole < world and piece.real_rows(whole):
        part, copied = _source_rows(piece, whole, device)
        inputs.append(part)
        nbytes += copied
    if len(inputs) < world:
        idle = torch.empty(step, dtype=torch.uint8, device=device)
        inputs.extend([idle] * (world - len(inputs)))
        nbytes += step
    return inputs, nbytes


def _pack(buf: torch.Tensor, seg: int, world: int, pieces: list[_Piece], me: int) -> None:
    """Source side of a packed unit: rank ``r``'s rows of every piece at
    ``r * seg + piece.offset`` of ``buf``, for every rank but the source
    ``me`` (its own rows go straight to its destinations, ``_own_rows``);
    the ranks with whole chunks in one strided copy per run of them, the
    one with a partial chunk apart."""
    for p in pieces:
        nbytes = p.chunk * p.row_bytes
        whole = min(world, p.n // p.chunk)
        flat = p.value.detach().contiguous().reshape(-1).view(torch.uint8)
        for lo, hi in ((0, min(me, whole)), (me + 1, whole)):
            if hi > lo:
                dst = buf.as_strided((hi - lo, nbytes), (seg, 1), lo * seg + p.offset)
                dst.copy_(flat[lo * nbytes : hi * nbytes].view(hi - lo, nbytes))
        rest = p.n * p.row_bytes - whole * nbytes
        if rest > 0 and whole != me:
            at = whole * seg + p.offset
            buf[at : at + rest].copy_(flat[whole * nbytes :])


def _own_rows(me: int, pieces: list[_Piece]) -> None:
    """The source's own rows of a packed unit, from each full value
    straight into its destination (one copy, where packing them into the
    unit and out again would take two)."""
    for p in pieces:
        real = p.real_rows(me)
        if not real or p.dest is None:
            continue
        first = me * p.chunk + p.start
        p.dest[p.start : p.start + real].copy_(p.value.detach()[first : first + real])


def _unpack(out: torch.Tensor, rank: int, pieces: list[_Piece]) -> None:
    """Receiver side: this rank's real rows of each piece from ``out``
    (its segment, or a scratch step) into the piece's destination."""
    for p in pieces:
        real = p.real_rows(rank)
        if not real or p.dest is None:
            continue
        nbytes = real * p.row_bytes
        rows = out[p.offset : p.offset + nbytes].view(p.dest.dtype).view((real, *p.dest.shape[1:]))
        p.dest[p.start : p.start + real].copy_(rows)


def _is_step(unit_bytes: int, pieces: list[_Piece]) -> bool:
    """Whether a unit is one tensor's rows and nothing else (a step of
    ``_units``, or a packed unit of one tensor whose size needed no
    alignment): every rank's part of it is those rows.  A packed unit is
    aligned past its pieces: where a rank received one in place, its
    buffer would be smaller than what the source sends (gloo's scatter
    sends every rank the size of the source's own buffer)."""
    return len(pieces) == 1 and pieces[0].rows * pieces[0].row_bytes == unit_bytes


def _landing(unit_bytes: int, pieces: list[_Piece], rank: int, device: torch.device) -> tuple[torch.Tensor, bool]:
    """Where this rank receives a unit (``unit_bytes``, on every rank):
    its destination rows themselves (a step whose rows it holds whole, in
    a contiguous dest), else a scratch buffer to unpack (second value
    True)."""
    if _is_step(unit_bytes, pieces):
        p = pieces[0]
        dest = p.dest
        if dest is not None and p.real_rows(rank) == p.rows and dest.is_contiguous() and dest.device == device:
            return dest[p.start : p.start + p.rows].reshape(-1).view(torch.uint8), False
    return torch.empty(unit_bytes, dtype=torch.uint8, device=device), True


def run_scatter(jobs, dests, route: Any, budget: int, undo: Any) -> int:
    """Scatter ``jobs`` (``scatter_jobs``'s) from the route's source into
    ``dests`` (their plan's destinations), in the units of ``_units``.
    The scatters are in flight together while the buffers they hold stay
    within two buckets; ``undo`` (or None) keeps each live destination
    before the first write to it.  Returns the number of scatters.

    A failure of this rank's own (packing, landing, unpacking: not the
    backend's) does not end its part in the stream: the peers are waiting
    in the same sequence of scatters.  It keeps issuing every remaining
    scatter through a sink buffer that no live tensor shares (writing
    nothing more), and raises the failure once the stream is done; the
    load's agreement then fails on every rank, whose undo logs put back
    what the stream wrote (garbage, after a source's failure)."""
    group, src = route.stages[0]
    world = dist.get_world_size(group)
    me = dist.get_rank() if group is None else dist.get_group_rank(group, dist.get_rank())
    source = route.is_source
    device = route.device
    pending: deque[tuple[Any, torch.Tensor, bool, list[_Piece], int]] = deque()
    held = 0
    failure = OwnFailure()
    sink = _Sink(device)

    def finish_oldest() -> None:
        nonlocal held
        work, out, scratch, pieces, nbytes = pending.popleft()
        work.wait()
        if scratch:
            failure.attempt(_unpack, out, me, pieces)
        held -= nbytes

    units = _units(jobs, dests, world, budget)
    for unit_bytes, pieces in units:
        # what the unit holds until it completes, beyond the values and
        # the destinations: the source's copies, a receiver's scratch
        prepared = failure.attempt(_prepare_unit, unit_bytes, pieces, world, me, source, device, undo)
        if prepared is None:  # this rank failed: it takes part, writing nothing
            while pending:  # their buffers go first (the failure may have been memory)
                finish_oldest()
            out = sink.recv(unit_bytes)
            prepared = ([sink.send(unit_bytes)] * world if source else None), 0, out, False
        inputs, nbytes, out, scratch = prepared
        while pending and held + nbytes > 2 * budget:
            finish_oldest()
        work = dist.scatter(out, inputs, src=src, group=group, async_op=True)
        pending.append((work, out, scratch, pieces, nbytes))
        held += nbytes
    while pending:
        finish_oldest()
    failure.raise_if_any()
    return len(units)


def _prepare_unit(unit_bytes: int, pieces: list[_Piece], world: int, me: int, source: bool,
                  device: torch.device, undo: Any) -> tuple[Any, int, torch.Tensor, bool]:
    """One unit's scatter arguments on this rank: (the source's inputs or
    None, the bytes of the copies the unit holds, where this rank
    receives, whether that is a scratch to unpack)."""
    if undo is not None:
        undo.save_dests([p.dest for p in pieces])
    inputs, nbytes = None, 0
    step = _is_step(unit_bytes, pieces)
    if source and step:
        inputs, nbytes = _source_inputs(pieces[0], world, device)
    elif source:
        buf = torch.empty(world * unit_bytes, dtype=torch.uint8, device=device)
        _pack(buf, unit_bytes, world, pieces, me)
        _own_rows(me, pieces)
        inputs = list(buf.view(world, unit_bytes).unbind(0))
        nbytes = world * unit_bytes
    out, scratch = _landing(unit_bytes, pieces, me, device)
    # the source's own rows are in place already: what the scatter
    # writes into its landing is the unpacked segment, never read
    scratch = scratch and not (source and not step)
    return inputs, nbytes + (unit_bytes if scratch else 0), out, scratch


class _Sink:
    """Where a stream's collectives go after this rank failed on its own:
    two buffers (what it sends, what it receives) that no live tensor
    shares, grown to the largest unit seen, allocated only after a
    failure."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: dict[str, torch.Tensor] = {}

    def _get(self, which: str, nbytes: int) -> torch.Tensor:
        buf = self.buffers.get(which)
        if buf is None or buf.numel() < nbytes:
            buf = self.buffers[which] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf[:nbytes]

    def send(self, nbytes: int) -> torch.Tensor:
        return self._get("send", nbytes)

    def recv(self, nbytes: int) -> torch.Tensor:
        return self._get("recv", nbytes)
