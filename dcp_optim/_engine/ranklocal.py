"""Rank-local values the sharded getter cannot represent (D30 in
docs/differences.md).

Under FSDP2 or tensor parallelism an optimizer steps on each rank's local
shards, and some optimizers keep values computed from them outside
DTensors: Prodigy's group sums (``d``, ``d_numerator``), GaLore's
projectors and Shampoo's preconditioner objects holding local tensors.
DCP stores a value that is not a DTensor once for all ranks (its save
plan deduplicates replicated items), so on resume every rank loads one
rank's copy and training continues from state that is wrong on the other
ranks -- silently.  Upstream's getter returns such values as they are.

The sharded and full getters therefore agree (a full get before its
gather), on the mesh of the optimizer's
DTensor parameters, on one digest of every value of the returned dict that
is not a tensor (state entries and param-group values), and of every
small plain tensor (``SMALL_TENSOR``): one fixed-size
all-reduce of a fixed-size record per mesh (consistency.RECORD_WORDS,
the per-word minimum and maximum over the ranks, after the bounded
arrival), whatever the world size.  Only where the digests
differ (the error path) do ranks exchange per-entry digests, and every
rank raises ``RankLocalStateError`` naming the first differing entry and
the ranks per value.  ``DCP_OPTIM_RANK_LOCAL_CHECK=0`` turns the check off.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .. import errors
from .consistency import (
    _DIGEST_WORDS,
    _KIND_RANKLOCAL,
    _check_same_call,
    _digest_words,
    _Record,
    _same,
    await_arrival,
    mesh_all_gather_object,
)

CHECK_ENV = "DCP_OPTIM_RANK_LOCAL_CHECK"
_WHAT = "the optimizer state's non-tensor values ({} get)"


def check_enabled() -> bool:
    """Whether the ranks check that optimizer values DCP stores once agree
    (``CHECK_ENV``; on unless set to 0)."""
    return os.environ.get(CHECK_ENV, "").strip() not in ("0", "false", "no", "off")


def _value_digest(value: Any) -> bytes:
    """A digest of one non-tensor value that is equal on ranks holding
    equal values: its pickle (tensors inside an object are pickled with
    their data); where it cannot be pickled, its type only (a repr would
    hold the object's address)."""
    try:
        blob = pickle.dumps(value, protocol=4)
    except Exception:  # noqa: BLE001 - not picklable: its type stands in
        blob = b"unpicklable " + f"{type(value).__module__}.{type(value).__qualname__}".encode()
    return hashlib.sha1(blob).digest()


# Plain tensors (not DTensors) of at most this many elements are digested
# by their bytes too: DCP stores a plain tensor once for all ranks, like
# any other value.  Under FSDP1 an optimizer steps on each rank's pieces
# of the parameters, and the tensors it keeps beside them -- ASGD's group
# norms, D-Adaptation's weighted sums -- are each rank's own.  Larger
# plain tensors (a parameter's whole state, kept replicated) are not read
# on every get.
SMALL_TENSOR = 1024


def _leaves(value: Any, path: str, out: list[tuple[str, Any]], tensors: list[tuple[str, torch.Tensor]]) -> None:
    """(path, value) of every leaf of ``value`` that is not a tensor into
    ``out``, and of every small plain tensor into ``tensors`` (dicts,
    lists and tuples are walked)."""
    if isinstance(value, torch.Tensor):
        if (type(value) is torch.Tensor and value.numel() <= SMALL_TENSOR and value.layout is torch.strided
                and not value.is_quantized and value.device.type != "meta"):
            tensors.append((path, value))
        return
    if isinstance(value, dict):
        for k, v in value.items():
            _leaves(v, f"{path}.{k}", out, tensors)
        return
    if type(value) in (list, tuple):
        for i, v in enumerate(value):
            _leaves(v, f"{path}[{i}]", out, tensors)
        return
    out.append((path, value))


def _tensor_digests(tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, bytes]]:
    """A digest per small plain tensor: its dtype, shape and bytes, read
    with one copy to the host per device (not one per tensor)."""
    blobs: list[bytes] = [b""] * len(tensors)
    by_device: dict[Any, list[int]] = {}
    for i, (_, t) in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for indices in by_device.values():
        flat = [tensors[i][1].detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
                for i in indices]
        blob = torch.cat(flat).cpu().numpy().tobytes()
        pos = 0
        for i, f in zip(indices, flat):
            blobs[i] = blob[pos:pos + f.numel()]
            pos += f.numel()
    out = []
    for (path, t), blob in zip(tensors, blobs):
        h = hashlib.sha1(f"{t.dtype} {tuple(t.shape)} ".encode())
        h.update(blob)
        out.append((path, h.digest()))
    return out


def _where(path: str, osd: dict[str, Any]) -> str:
    """``path``, with the parameters of its group for a group key."""
    if not path.startswith("param_groups["):
        return f"'{path}'"
    try:
        params = osd["param_groups"][int(path[len("param_groups["):path.index("]")])]["params"]
        shown = ", ".join(str(p) for p in list(params)[:3]) + (", ..." if len(params) > 3 else "")
    except Exception:  # noqa: BLE001 - the path alone
        return f"'{path}'"
    return f"'{path}' (the param group of {shown})"


def check_rank_local(osd: dict[str, Any], info: Any, fsdp1: tuple[Any] | None = None) -> None:
    """Raise RankLocalStateError on every rank of a mesh when the ranks
    of that mesh return different non-tensor values in ``osd`` (the
    nested, FQN-keyed optimizer dict of a sharded get).  ``fsdp1``: (the
    mesh of an FSDP1 model's ranks, None for the default group), whose
    flat parameters hold every parameter: one check on it."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    if not check_enabled() or not isinstance(osd, dict):
        return
    index = info.index
    meshes: list[Any] = [] if fsdp1 is None else [fsdp1[0]]
    mesh_of: dict[str, int] = {}
    for tensor, fqns in zip(index.tensors, index.tensor_fqns):
        if fsdp1 is not None:
            break
        if not isinstance(tensor, DTensor):
            continue
        mesh = tensor.device_mesh
        m = next((i for i, known in enumerate(meshes) if known == mesh), len(meshes))
        if m == len(meshes):
            meshes.append(mesh)
        for fqn in fqns:
            mesh_of[fqn] = m
    if not meshes:
        return  # no sharded parameter: every rank steps on whole tensors
    entries: list[list[tuple[str, Any]]] = [[] for _ in meshes]
    tensors: list[list[tuple[str, torch.Tensor]]] = [[] for _ in meshes]
    state = osd.get("state")
    if isinstance(state, dict):
        for fqn, entry in state.items():
            m = mesh_of.get(fqn, 0) if isinstance(fqn, str) else 0
            _leaves(entry, f"state.{fqn}", entries[m], tensors[m])
    groups = osd.get("param_groups")
    if isinstance(groups, list):
        for i, group in enumerate(groups):
            if not isinstance(group, dict):
                continue
            params = group.get("params") or []
            m = next((mesh_of[p] for p in params if isinstance(p, str) and p in mesh_of), 0)
            for k, v in group.items():
                if k != "params":
                    _leaves(v, f"param_groups[{i}][{k!r}]", entries[m], tensors[m])
    for mesh, mine, small in zip(meshes, entries, tensors):
        _agree(mesh, mine, small, osd, bool(info.full_state_dict))


def _agree(mesh: Any, mine: list[tuple[str, Any]], small: list[tuple[str, torch.Tensor]],
           osd: dict[str, Any], full: bool) -> None:
    digests = [(path, _value_digest(v)) for path, v in mine] + _tensor_digests(small)
    total = hashlib.sha1()
    for path, d in digests:
        total.update(path.encode())
        total.update(d)
    what = _WHAT.format("full" if full else "sharded")
    await_arrival(mesh, what)
    record = _Record(_KIND_RANKLOCAL)
    at = record.put(_digest_words(total.digest()))
    lo, hi = record.reduce(mesh)
    if _same(lo, hi, 0, at + _DIGEST_WORDS):
        return
    # error path only: every rank's per-entry digests
    details, ranks = mesh_all_gather_object(
        mesh, ("ranklocal", what, [(p, d.hex()) for p, d in digests])
    )
    _check_same_call(details, list(ranks))
    per_rank = [dict(d[2]) for d in details]
    order = [p for d in details for p, _ in d[2]]
    for path in dict.fromkeys(order):
        values = [m.get(path) for m in per_rank]
        if all(v == values[0] for v in values):
            continue
        groups: dict[str, list[int]] = {}
        for rank, v in zip(ranks, values):
            groups.setdefault("no such entry" if v is None else f"value digest {v[:12]}", []).append(rank)
        split = "; ".join(f"rank(s) {rs}: {text}" for text, rs in groups.items())
        raise errors.RankLocalStateError(
            f"{_where(path, osd)} of the optimizer state is not a DTensor and differs between the ranks of "
            f"the mesh ({split}): the optimizer computed it from each rank's local shards. "
            + ("A full state dict holds rank 0's copy of such a value for all ranks"
               if full else "dcp.save stores such a value (a plain tensor too) once for all ranks")
            + ", so a resume would give every rank one rank's value and training would silently diverge; "
            "nothing was returned. Ways out: keep such values in DTensors (or reduce them across ranks "
            "inside the optimizer), or save this optimizer per rank with its own "
            "state_dict() and torch.save; DCP_OPTIM_RANK_LOCAL_CHECK=0 turns this check off.",
            path,
            [list(rs) for rs in groups.values()],
        )
    raise errors.RankLocalStateError(
        f"the non-tensor values of the optimizer state differ between ranks {list(ranks)} "
        "(the entries' names or order differ); nothing was returned.",
        "",
        [list(ranks)],
    )
