"""Cross-rank agreement before collectives start (issue: ranks that
disagree on keys, shapes or options hang, or unpickle garbage).

Every path that moves data between ranks first exchanges one small digest
among the ranks involved (the ranks of the device mesh the tensors live
on).  If the digests differ, a second exchange -- only on this error path
-- carries the details, so that every rank raises the same error naming
the first differing key and the ranks involved, before any data moves.

The digest travels as a fixed-size byte tensor (one all-gather, no
pickling: ``all_gather_object`` costs two collectives, sizes then
payload); a one-byte per-rank flag rides along, which callers use to learn
which ranks want the data (the rank-0-only gathers of ``cpu_offload``).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from . import errors

__all__ = ["all_gather_flat", "mesh_all_gather_object", "mesh_all_gather_bytes", "check_agreement"]


def mesh_all_gather_object(mesh: Any | None, obj: Any) -> tuple[list[Any], list[int]]:
    """Every mesh rank's ``obj`` (row-major mesh order) and their global
    ranks.  ``mesh=None`` means the default group."""
    if mesh is None or mesh.size() == dist.get_world_size():
        world = dist.get_world_size()
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, obj)
        if mesh is None:
            return gathered, list(range(world))
        order = mesh.mesh.flatten().tolist()
        return [gathered[r] for r in order], order
    payload = obj
    for d in reversed(range(mesh.ndim)):
        if mesh.size(d) == 1:
            payload = [payload]
            continue
        row: list[Any] = [None] * mesh.size(d)
        dist.all_gather_object(row, payload, group=mesh.get_group(d))
        payload = row
    flat: list[Any] = []

    def walk(node, depth):
        if depth == mesh.ndim:
            flat.append(node)
            return
        for child in node:
            walk(child, depth + 1)

    walk(payload, 0)
    return flat, mesh.mesh.flatten().tolist()


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
    """``all_gather_into_tensor``.  torch 2.13 renamed it (the old name now
    warns) to ``all_gather_single``; older releases only have the former.
    Looked up per call so that tools wrapping torch.distributed see it."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def mesh_all_gather_bytes(mesh: Any | None, data: bytes) -> tuple[list[bytes], list[int]]:
    """Every mesh rank's ``data`` (the same length on every rank) in
    row-major mesh order, and their global ranks: one all-gather of a small
    byte tensor -- on the default group when the mesh spans the world (or
    ``mesh`` is None), else one per mesh dimension of size > 1."""
    n = len(data)
    mine = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if mesh is None or mesh.size() == dist.get_world_size():
        world = dist.get_world_size()
        device = torch.device(dist.distributed_c10d._get_object_coll_device())
        out = torch.empty(world * n, dtype=torch.uint8, device=device)
        all_gather_flat(out, mine.to(device), None)
        raw = out.cpu().tolist()
        chunks = [bytes(raw[i * n : (i + 1) * n]) for i in range(world)]
        if mesh is None:
            return chunks, list(range(world))
        order = mesh.mesh.flatten().tolist()
        return [chunks[r] for r in order], order
    device = torch.device(mesh.device_type)
    payload = mine.to(device)
    # last mesh dimension first: row-major mesh order (as the gathers do)
    for d in reversed(range(mesh.ndim)):
        if mesh.size(d) == 1:
            continue
        out = torch.empty(mesh.size(d) * payload.numel(), dtype=torch.uint8, device=device)
        all_gather_flat(out, payload, mesh.get_group(d))
        payload = out
    raw = payload.cpu().tolist()
    chunks = [bytes(raw[i * n : (i + 1) * n]) for i in range(mesh.size())]
    return chunks, mesh.mesh.flatten().tolist()


def _digest(value: Any) -> bytes:
    return hashlib.sha1(repr(value).encode()).digest()


def check_agreement(
    mesh: Any | None, what: str, summary: Any, details_fn, flag: int = 0
) -> list[int]:
    """Raise the same StateDictRuntimeError on every rank of ``mesh`` when
    their ``summary`` values differ.  ``details_fn()`` returns a list of
    (name, description) pairs that locate the difference; it runs only on
    that error path.  ``flag`` (0-255) is not compared: the flags of every
    mesh rank, in row-major mesh order, are returned."""
    blobs, ranks = mesh_all_gather_bytes(mesh, _digest(summary) + bytes((flag,)))
    if len({b[:-1] for b in blobs}) == 1:
        return [b[-1] for b in blobs]
    details, _ = mesh_all_gather_object(mesh, details_fn())
    message = _describe_difference(what, details, ranks)
    raise errors.StateDictRuntimeError(message)


def _describe_difference(what: str, details: list[Any], ranks: list[int]) -> str:
    reference = details[0]
    longest = max(len(d) for d in details)
    for i in range(longest):
        entries = [d[i] if i < len(d) else None for d in details]
        if all(e == entries[0] for e in entries):
            continue
        groups: dict[str, list[int]] = {}
        for rank, entry in zip(ranks, entries):
            text = "nothing" if entry is None else f"{entry[1]}"
            groups.setdefault(text, []).append(rank)
        names = sorted({e[0] for e in entries if e is not None})
        name = names[0] if names else "?"
        per_rank = "; ".join(f"rank(s) {rs}: {text}" for text, rs in groups.items())
        return (
            f"ranks disagree on the {what} before a collective; first "
            f"difference at '{name}': {per_rank}. Every rank must pass the "
            "same options and state dict structure for this call."
        )
    del reference
    return (
        f"ranks disagree on the {what} before a collective (ranks {ranks}); "
        "every rank must pass the same options and state dict structure."
    )
