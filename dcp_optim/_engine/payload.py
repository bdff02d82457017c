"""What the source of a broadcast load sends before any data: its payload.

A broadcast load's source sends the other ranks its metadata -- the tree
of (shape, dtype) of its dict, the optimizer's groups and extra entries --
pickled.  Its size travels ahead, in the flags of the load's first
agreement (``payload_flags``), so the payload itself is one broadcast of
known size, not ``broadcast_object_list``'s two.

Where the load is small (its tensors hold at most ``INLINE_BYTES`` in all,
every one a plain CPU tensor) the tensors' bytes ride in the same payload
("inline"): every rank then holds the whole dict and slices its shards out
locally, with no data stream, and no write into live tensors before the
commit -- one broadcast and one agreement fewer per load (the stream's
and the one after it), which is most of a small load's cost.

Layout: 8 bytes (the pickle's length, little-endian, in the first seven;
whether the tensors are inline, in the eighth), the pickle, then, from the
next 64-byte boundary, each inline tensor's bytes at a 64-byte aligned
offset.  The payload says itself how to read it: a receiver needs only
its size beforehand.  The pickle names each inline tensor by a persistent id
(offset, bytes, dtype, shape); 0-dim tensors of the metadata travel as
their dtype and bytes (``_MetadataPickler``).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .core import C, context
from .tensor_bytes import bytes_view, flat_bytes

__all__ = [
    "INLINE_BYTES",
    "MetadataPickler",
    "OutgoingPayload",
    "decode_payload",
    "encode_payload",
    "payload_flags",
    "payload_from_flags",
]

# Loads whose tensors hold at most this many bytes travel inline.  Every
# rank holds the whole payload at once: kept small, so that memory stays
# the destination plus a bucket's worth.
INLINE_BYTES = 1 << 20

# The size flags: 4 bytes; a payload at or over this size (never in
# practice: metadata of gigabytes) goes by ``broadcast_object_list``.
_UNSIZED = 0xFFFFFFFF
_HEADER = 8


def _aligned(n: int) -> int:
    return (n + 63) & ~63


class MetadataPickler(pickle.Pickler):
    """Pickles a plain 0-dim CPU tensor (exact type, strided, no autograd,
    no conjugate or negative bit) as its dtype and bytes, rebuilt as a new
    tensor of its own storage, as torch's unpickling gives it; torch's own
    reduction writes a ``torch.save`` archive per tensor (about 0.4 ms
    each).  Everything else is pickled as usual."""

    def reducer_override(self, obj: Any) -> Any:
        if (
            type(obj) is torch.Tensor
            and obj.dim() == 0
            and obj.device.type == "cpu"
            and obj.layout is torch.strided
            and not obj.requires_grad
            and not obj.is_conj()
            and not obj.is_neg()
            and not obj.is_quantized
        ):
            raw = bytes(obj.reshape(1).view(torch.uint8).tolist())
            return _scalar_tensor, (str(obj.dtype).removeprefix("torch."), raw)
        return NotImplemented


def _scalar_tensor(dtype: str, raw: bytes) -> torch.Tensor:
    """The 0-dim tensor of ``dtype`` whose bytes are ``raw``."""
    out = torch.empty((), dtype=getattr(torch, dtype))
    out.reshape(1).view(torch.uint8).copy_(torch.tensor(list(raw), dtype=torch.uint8))
    return out


def _inlinable(t: torch.Tensor) -> bool:
    """A tensor whose bytes can ride in the payload and be rebuilt exactly
    on the other ranks: a plain (or Parameter) dense CPU tensor."""
    return (
        type(t) in (torch.Tensor, nn.Parameter)
        and t.layout is torch.strided
        and t.device.type == "cpu"
        and not t.is_quantized
        and not t.is_nested
    )


class _InlinePickler(MetadataPickler):
    """Pickles every plain CPU tensor (``_inlinable``: all of the values',
    ``_inline_fits`` checked) as a persistent id, its bytes after the
    pickle (``encode_payload``); any other object (a 0-dim tensor of
    another type in the metadata) as ``MetadataPickler`` does."""

    def __init__(self, file: Any):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[tuple[torch.Tensor, int, int]] = []  # (tensor, offset, bytes)
        self.blob_bytes = 0

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor) or not _inlinable(obj):
            return None
        n = obj.numel() * obj.element_size()
        offset = self.blob_bytes
        self.blob_bytes += _aligned(n)
        self.tensors.append((obj, offset, n))
        return (offset, n, obj.dtype, tuple(obj.shape))


class _InlineUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, blob: torch.Tensor):
        super().__init__(file)
        self.blob = blob

    def persistent_load(self, pid: Any) -> torch.Tensor:
        offset, n, dtype, shape = pid
        out = torch.empty(shape, dtype=dtype)  # its own storage, as a received tensor
        if n:
            bytes_view(out).copy_(self.blob[offset : offset + n])
        return out


def _inline_fits(values: list[Any]) -> bool:
    """Whether every tensor of ``values`` can travel inline, and all of
    them within ``INLINE_BYTES``."""
    total = 0
    ctx = context()
    for tree in values:
        if tree is None:
            continue
        for leaf in C.tree_leaves(ctx, tree, False):
            if isinstance(leaf, torch.Tensor):
                if not _inlinable(leaf):
                    return False
                total += _aligned(leaf.numel() * leaf.element_size())
                if total > INLINE_BYTES:
                    return False
    return True


class OutgoingPayload:
    """The source's payload: ``tensor`` (its bytes, on the CPU), ``size``
    (what the first agreement announces), ``inline`` (whether the values
    travel in it), and what it encodes, ``metas`` and ``values`` (the
    source loads from its own)."""

    def __init__(self, metas: tuple, values: list[Any] | None, tensor: torch.Tensor, inline: bool,
                 keep: Any = None):
        self.metas = metas
        self.values = values
        self.tensor = tensor
        self.inline = inline
        self._keep = keep  # the BytesIO (and its buffer) a zero-copy tensor views

    @property
    def size(self) -> int:
        return self.tensor.numel()


def encode_payload(metas: tuple, values: list[Any] | None) -> OutgoingPayload:
    """The source's payload: ``metas`` (one per load part), with
    ``values`` (the parts' trees of real tensors) inline where they fit
    (see the module's docstring), else the metadata alone."""
    inline = values is not None and _inline_fits(values)
    buf = io.BytesIO()
    buf.write(bytes(_HEADER))
    if inline:
        pickler = _InlinePickler(buf)
        pickler.dump((metas, tuple(values or ())))
    else:
        MetadataPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump((metas, None))
    header = buf.tell() - _HEADER
    buf.getbuffer()[:_HEADER] = (header | (int(inline) << 56)).to_bytes(_HEADER, "little")
    if not inline:
        view = buf.getbuffer()
        return OutgoingPayload(metas, values, torch.frombuffer(view, dtype=torch.uint8), False, keep=(buf, view))
    base = _aligned(_HEADER + header)
    out = torch.empty(base + pickler.blob_bytes, dtype=torch.uint8)
    with buf.getbuffer() as view:
        out[: _HEADER + header].copy_(torch.frombuffer(view, dtype=torch.uint8))
    for tensor, offset, n in pickler.tensors:
        if n:
            src = flat_bytes(tensor.detach())
            out[base + offset : base + offset + n].copy_(src)
    return OutgoingPayload(metas, values, out, True)


def decode_payload(data: torch.Tensor) -> tuple[tuple, tuple | None]:
    """(metas, values or None) from a received payload (CPU bytes)."""
    word = int.from_bytes(data[:_HEADER].numpy().tobytes(), "little")
    header, inline = word & ((1 << 56) - 1), bool(word >> 56)
    raw = data[_HEADER : _HEADER + header].numpy().tobytes()
    if not inline:
        metas, _ = pickle.loads(raw)
        return metas, None
    blob = data[_aligned(_HEADER + header) :]
    metas, values = _InlineUnpickler(io.BytesIO(raw), blob).load()
    return metas, values


def payload_flags(payload: OutgoingPayload | None) -> tuple[int, ...]:
    """Four agreement flags (bytes): the payload's size, little-endian;
    zeros on the ranks that send none."""
    if payload is None:
        return (0, 0, 0, 0)
    return tuple(min(payload.size, _UNSIZED).to_bytes(4, "little"))


def payload_from_flags(flags: tuple[int, ...]) -> int | None:
    """The payload's size from the source's ``payload_flags`` (None where
    it did not fit them)."""
    size = int.from_bytes(bytes(flags[:4]), "little")
    return None if size == _UNSIZED else size


def broadcast_payload(route: Any, payload: OutgoingPayload | None, size: int) -> torch.Tensor:
    """The payload's bytes on every rank of ``route`` (a
    ``distribute.Route``), on the CPU: ``route.broadcast`` of a buffer on
    the device of its group's object collectives."""
    device = torch.device(dist.distributed_c10d._get_object_coll_device(route.stages[0][0]))
    if route.is_source:
        assert payload is not None
        data = payload.tensor.to(device)
    else:
        data = torch.empty(size, dtype=torch.uint8, device=device)
    route.broadcast(data)
    return data.cpu()
