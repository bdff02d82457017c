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
bytes are under ``DIRECT_BYTES`` travel point to point instead, in
units of up to ``DIRECT_BYTES`` per rank (one ``batch_isend_irecv``
each): one message per tensor and receiving rank, sent from the source's
own tensor (a rank's rows of it are contiguous) straight into the
receiver's shard, while the source copies its own rows into its shards.
A scatter of such a group would need a buffer of equal parts per rank --
the source packing every rank's rows into it, each receiver unpacking
its part -- two copies of every byte that messages of each tensor's own
size do not make.

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

from .collectives import OwnFailure, recv_op, send_op
from .consistency import mesh_ranks
from .tensor_bytes import bytes_view, flat_bytes, own_bytes

# A tensor of at least this many bytes travels in scatters of its own;
# smaller ones go point to point in units of at most this many bytes per
# rank (the stream's threshold too).
DIRECT_BYTES = 1 << 20
# At most this many units in flight: a unit that copies nothing (its
# rows sent from the source's tensor, landing in the shards) holds no
# buffer, and without a bound a large load would post every one of its
# transfers at once (a backend's work and bookkeeping each).  Sixteen
# units of up to a bucket keep the transport busy.
MAX_UNITS_IN_FLIGHT = 16
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
            ok = meshes[id(mesh)] = mesh.ndim == 1 and list(mesh_ranks(mesh)) == ranks
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
    """The units of a load, in order: (bytes per rank, pieces).  A
    tensor of ``DIRECT_BYTES`` or more (or more than ``budget``) goes in
    steps of whole rows of every rank's chunk, ``W * k`` rows within
    ``budget`` (a row larger than that alone), each a scatter; smaller
    ones are grouped within ``budget`` and ``DIRECT_BYTES`` per rank, each
    group sent point to point (``_Messages``; small groups keep the
    receivers' landing pipelined with the transfer).  From the metadata
    alone: the same on every rank."""
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
        if packed and (world * (used + size) > budget or used + size > DIRECT_BYTES):
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
    real = piece.real_rows(rank)
    if real == piece.rows:
        return _rows_to_send(piece, rank, real, device)
    nbytes = piece.rows * piece.row_bytes
    out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if real:
        first = rank * piece.chunk + piece.start
        part = piece.value.detach()[first : first + real]
        out[: real * piece.row_bytes].view(part.dtype).view(part.shape).copy_(part)
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
        if own_bytes(value) and value.device == device:
            flat = flat_bytes(value)
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
        if dest is not None and p.real_rows(rank) == p.rows and own_bytes(dest) and dest.device == device:
            return bytes_view(dest[p.start : p.start + p.rows]), False
    return torch.empty(unit_bytes, dtype=torch.uint8, device=device), True


class ScatterSchedule:
    """Everything this rank does in a load's scatters, from the plan
    alone: the group (``_Peers``), the units (``_units``) and, for each
    unit sent point to point, its messages (``_unit_messages``).  Made by
    ``plan_stream`` before the agreement ahead of the stream: a rank whose
    geometry cannot be computed (a bug) fails there, with every rank,
    instead of inside the stream, where its peers would wait for its
    messages until the group's timeout.  After the agreement, a rank whose
    own code fails takes part in the rest of the stream from these numbers
    alone (``_sink_ops``): nothing that could fail the same way again."""

    __slots__ = ("peers", "source", "budget", "units", "messages")

    def __init__(self, jobs: list[tuple[Any, Any, Any]], dests: Any, route: Any, budget: int):
        group, src = route.stages[0]
        world = dist.get_world_size(group)
        me = dist.get_rank() if group is None else dist.get_group_rank(group, dist.get_rank())
        self.peers = _Peers(group, src, world, me)
        self.source = bool(route.is_source)
        self.budget = budget
        self.units = _units(jobs, dests, world, budget)
        # per unit: its messages, or None for a step (one scatter)
        self.messages: list[list[tuple] | None] = []
        tag = 0
        for unit_bytes, pieces in self.units:
            if _is_step(unit_bytes, pieces):
                self.messages.append(None)
                continue
            self.messages.append(_unit_messages(pieces, self.peers, self.source, tag))
            tag += len(pieces)


def _unit_messages(pieces: list[_Piece], peers: _Peers, source: bool, tag: int) -> list[tuple]:
    """This rank's messages of a unit sent point to point: (piece, the
    group rank whose rows travel, rows, bytes, global peer, tag), one per
    piece and receiving rank that holds rows of it, in piece order -- the
    same sequence on both ends.  Each piece's messages carry their own tag
    (its place in the stream, the same on every rank): gloo matches
    messages by (peer, tag), and many in flight under one tag stall it."""
    out = []
    if source:
        for t, p in enumerate(pieces, tag):
            for r in range(peers.world):
                real = p.real_rows(r) if r != peers.me else 0
                if real:
                    out.append((p, r, real, real * p.row_bytes, peers.globals[r], _tag(t)))
        return out
    for t, p in enumerate(pieces, tag):
        real = p.real_rows(peers.me)
        if real:
            out.append((p, peers.me, real, real * p.row_bytes, peers.source, _tag(t)))
    return out


def _sink_ops(messages: list[tuple], peers: _Peers, source: bool, sink: _Sink) -> list[Any]:
    """A unit's messages through the sink's buffers (this rank failed:
    it takes part, writing nothing)."""
    make = send_op if source else recv_op
    take = sink.send if source else sink.recv
    return [make(take(nbytes), peer, peers.group, tag) for _, _, _, nbytes, peer, tag in messages]


def run_scatter(schedule: ScatterSchedule, route: Any, undo: Any) -> int:
    """The scatters of ``schedule`` from the route's source into their
    jobs' destinations: a step of a large tensor is one ``scatter``; a
    packed unit travels point to point, one message per piece and
    receiving rank (``_Messages``).  The units are in flight together
    while the buffers they hold stay within two buckets; ``undo`` (or
    None) keeps each live destination before the first write to it.
    Returns the number of units.

    A failure of this rank's own (packing, landing, unpacking: not the
    backend's) does not end its part in the stream: the peers are waiting
    in the same sequence of transfers.  It keeps issuing every remaining
    one through a sink buffer that no live tensor shares (writing
    nothing more; the transfers' sizes come from the schedule, computed
    before the stream), and raises the failure once the stream is done;
    the load's agreement then fails on every rank, whose undo logs put
    back what the stream wrote (garbage, after a source's failure)."""
    _, src = route.stages[0]
    peers = schedule.peers
    me, world, group = peers.me, peers.world, peers.group
    source = schedule.source
    budget = schedule.budget
    device = route.device
    # each entry: (works, what lands once they completed or None, bytes held)
    pending: deque[tuple[list[Any], Any, int]] = deque()
    held = 0
    failure = OwnFailure()
    sink = _Sink(device)

    def finish_oldest() -> None:
        nonlocal held
        works, land, nbytes = pending.popleft()
        for work in works:
            work.wait()
        if land is not None:
            failure.attempt(land)
        held -= nbytes

    def make_room(nbytes: int | None) -> None:
        """Wait for the oldest units until one holding ``nbytes`` more fits
        the bounds (two buckets, ``MAX_UNITS_IN_FLIGHT``); with ``nbytes``
        None, for all of them (this rank failed: their buffers go before
        its sink's come, the failure may have been memory)."""
        while pending and (nbytes is None or held + nbytes > 2 * budget or len(pending) >= MAX_UNITS_IN_FLIGHT):
            finish_oldest()

    for (unit_bytes, pieces), entries in zip(schedule.units, schedule.messages):
        if entries is not None:
            messages = failure.attempt(_Messages, pieces, entries, peers, source, device, undo)
            if messages is None:  # this rank failed: it takes part, writing nothing
                make_room(None)
                ops, land, nbytes = _sink_ops(entries, peers, source, sink), None, 0
            else:
                ops, land, nbytes = messages.ops, (messages.land if messages.scratch else None), messages.nbytes
            make_room(nbytes)
            works = dist.batch_isend_irecv(ops) if ops else []
            if messages is not None and messages.own:
                failure.attempt(messages.copy_own)
            pending.append((works, land, nbytes))
            held += nbytes
            continue
        # what the unit holds until it completes, beyond the values and
        # the destinations: the source's copies, a receiver's scratch
        prepared = failure.attempt(_prepare_unit, unit_bytes, pieces, world, me, source, device, undo)
        if prepared is None:  # this rank failed: it takes part, writing nothing
            make_room(None)
            out = sink.recv(unit_bytes)
            prepared = ([sink.send(unit_bytes)] * world if source else None), 0, out, False
        inputs, nbytes, out, scratch = prepared
        make_room(nbytes)
        work = dist.scatter(out, inputs, src=src, group=group, async_op=True)
        land = (lambda out=out, pieces=pieces: _unpack(out, me, pieces)) if scratch else None
        pending.append(([work], land, nbytes))
        held += nbytes
    while pending:
        finish_oldest()
    failure.raise_if_any()
    return len(schedule.units)


class _Peers:
    """The ranks of a scatter's group as point-to-point messages name
    them (global ranks, ``globals`` in group order), the source's global
    rank, and this rank's place in the group (``me``)."""

    __slots__ = ("group", "source", "me", "world", "globals")

    def __init__(self, group: Any, source: int, world: int, me: int):
        self.group, self.source, self.world, self.me = group, source, world, me
        self.globals = _group_ranks(group)


class _Messages:
    """A packed unit's messages (``_unit_messages``) with their tensors:
    the source sends each receiving rank its rows of every piece straight
    from the full value (a view where they are contiguous on the stream's
    device, else one copy) and copies its own rows into its shards; each
    receiver takes its rows straight into its destination where that is
    contiguous on the device, else into a scratch it copies out of
    (``land``).  No packing and no unpacking: where ``scatter`` needs one
    buffer of equal parts, messages have each piece's own size, so a
    rank's rows never go through a buffer that only reorders them.  A
    receiver with no destination for a piece still takes its part."""

    __slots__ = ("ops", "nbytes", "scratch", "own", "undo", "me")

    def __init__(self, pieces: list[_Piece], entries: list[tuple], peers: _Peers, source: bool,
                 device: torch.device, undo: Any):
        self.ops: list[Any] = []
        self.nbytes = 0
        self.scratch: list[tuple[torch.Tensor, _Piece, int]] = []
        self.own: list[_Piece] = []  # the source's: its own rows, copied once its sends are issued
        self.undo = undo
        group = peers.group
        self.me = peers.me
        if source:
            for p, r, real, _, peer, tag in entries:
                data, copied = _rows_to_send(p, r, real, device)
                self.nbytes += copied
                self.ops.append(send_op(data, peer, group, tag))
            self.own = pieces
            return
        if undo is not None:  # before anything lands in the live destinations
            undo.save_dests([p.dest for p in pieces])
        for p, _, real, nbytes, peer, tag in entries:
            dest = p.dest
            if dest is not None and own_bytes(dest) and dest.device == device:
                into = bytes_view(dest[p.start : p.start + real])
            else:
                into = torch.empty(nbytes, dtype=torch.uint8, device=device)
                self.nbytes += nbytes
                if dest is not None:
                    self.scratch.append((into, p, real))
            self.ops.append(recv_op(into, peer, group, tag))

    def copy_own(self) -> None:
        """The source's own rows into its shards (after its sends are
        issued: they travel meanwhile), the undo log keeping them first."""
        if self.undo is not None:
            self.undo.save_dests([p.dest for p in self.own])
        _own_rows(self.me, self.own)

    def land(self) -> None:
        """The rows received into scratch buffers, into their destinations."""
        for into, p, real in self.scratch:
            rows = into.view(p.dest.dtype).view((real, *p.dest.shape[1:]))
            p.dest[p.start : p.start + real].copy_(rows)


def _tag(n: int) -> int:
    return n & 0x7FFFFFFF


def _rows_to_send(p: _Piece, rank: int, real: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """The source's bytes of ``rank``'s rows of a piece: a view of the
    value where they are contiguous on the stream's device, else a copy
    (and the bytes it took)."""
    first = rank * p.chunk + p.start
    part = p.value.detach()[first : first + real]
    if own_bytes(part) and part.device == device:
        return flat_bytes(part), 0
    out = torch.empty(real * p.row_bytes, dtype=torch.uint8, device=device)
    out.view(part.dtype).view(part.shape).copy_(part)
    return out, real * p.row_bytes


def _prepare_unit(unit_bytes: int, pieces: list[_Piece], world: int, me: int, source: bool,
                  device: torch.device, undo: Any) -> tuple[Any, int, torch.Tensor, bool]:
    """One step's scatter arguments on this rank: (the source's inputs or
    None, the bytes of the copies the unit holds, where this rank
    receives, whether that is a scratch to unpack)."""
    if undo is not None:
        undo.save_dests([p.dest for p in pieces])
    inputs, nbytes = None, 0
    if source:
        inputs, nbytes = _source_inputs(pieces[0], world, device)
    out, scratch = _landing(unit_bytes, pieces, me, device)
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
