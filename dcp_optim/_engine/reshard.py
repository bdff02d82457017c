"""In-memory resharding: the engine behind :func:`dcp_optim.reshard_state_dict`.

Three phases, every rank of the process group taking part:

1. **Agreement.**  After the bounded arrival, each rank describes its
   leaves (DTensor: dtype, global shape, mesh shape, placements and mesh
   ranks; plain tensor: dtype and shape; anything else: its value) for the
   source and the template, derives from them the layouts all ranks must
   agree on, and one ``all_reduce`` of a digest of that view settles it
   (``_agree_by_digest``; ranks without a view get one broadcast).  Only
   when the ranks disagree does one ``all_gather_object`` bring every
   rank's description to every rank (``_agree``); the checks then run on
   the same gathered data everywhere, so a mismatch raises the same error
   on every rank -- before anything is written.
2. **Plan.**  For each tensor, the native ``reshard_plan`` (csrc/reshard_plan.c)
   intersects source and destination shard boxes and picks one holder per
   byte (the rank itself when it holds it: a local copy).  Plans are cached
   per (global shape, source layout, destination layout, rank).
3. **Transfer.**  A tensor moved between two 1-D layouts over the whole
   group, its sharded dimensions divisible by the group's size (FSDP2 <->
   TP, ``Shard -> Replicate``), exchanges equal blocks with every rank:
   it is one ``all_to_all_single`` or all-gather (``_dense_kind``), with
   no per-peer work in Python.  For the others, boxes to and from each
   peer are packed into byte buckets
   of at most ``bucket_bytes`` (larger boxes are split along their outer
   dimensions).  Peers are visited as ring shifts (shift k: send to
   rank+k, receive from rank-k; shifts without data for the rank are
   skipped), one ``batch_isend_irecv`` per bucket, so a rank holds at most
   one send and one receive bucket at a time.  In a bucket, the small boxes
   travel packed as one message, and each box of 64 KiB or more as its own,
   which goes from / into the tensor itself where the box is contiguous
   there; boxes a rank holds itself are copied directly.  Received bytes are written into
   the template's local tensors (``copy_``: a dtype that differs from the
   source's is cast as ``dcp.load`` casts it).  An undo log (a host copy
   of the template's shards this rank receives into) puts them back if
   any rank fails before one last ``all_reduce`` says that every rank is
   done; the boxes a rank holds itself are copied after it.
"""

from __future__ import annotations

import copy
import hashlib
import pickle
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .. import errors
from .collectives import OwnFailure, recv_op, send_op
from .consistency import all_gather_flat, await_arrival, reduce_min
from .core import C
from .distribute import UNDO_ENV, _UndoLog, host_bytes, undo_enabled
from .tensor_bytes import bytes_view, flat_bytes, is_wrapper, opaque, own_bytes, values_tensor

__all__ = ["reshard", "DEFAULT_BUCKET_BYTES", "plan_cache_info", "clear_plan_cache", "agreement_info"]

DEFAULT_BUCKET_BYTES = 32 * 1024 * 1024
_ALIGN = 16  # widest scalar (complex128): the smallest bucket
_OWN_BUCKET = 64 * 1024  # a box this large is a message of its own (see _buckets)

_PLAN_CACHE: dict[tuple, tuple] = {}
_PLAN_CACHE_MAX = 65536
_cache_stats = {"hits": 0, "misses": 0}


def plan_cache_info() -> dict[str, int]:
    """Hits, misses and size of the per-layout-pair plan cache."""
    return {**_cache_stats, "size": len(_PLAN_CACHE)}


_agreements = {"digest": 0, "broadcast": 0, "gathered": 0}


def agreement_info() -> dict[str, int]:
    """How the calls of this process agreed on the layouts: by digest
    alone, by digest and one broadcast (some ranks pass no template or
    hold no source), or by gathering every rank's descriptions."""
    return dict(_agreements)


def clear_plan_cache() -> None:
    _PLAN_CACHE.clear()
    _cache_stats["hits"] = _cache_stats["misses"] = 0


def _scratch(kept: dict | None, role: str, nbytes: int, device: torch.device) -> torch.Tensor:
    """A byte buffer of at least ``nbytes`` for ``role`` (a send or receive
    bucket, the undo log's host copy): from ``kept``, the caller's
    ``ReshardBuffers``, when it has one large enough (a repeated call then
    writes into pages it already has: a fresh allocation's page faults
    cost about twice the copy into it), else a new one, kept there."""
    buf = kept.get((role, device)) if kept is not None else None
    if buf is None or buf.numel() < nbytes:
        if kept is not None:
            kept.pop((role, device), None)  # the old one goes before the new one comes
        buf = torch.empty(max(nbytes, _ALIGN), dtype=torch.uint8, device=device)
        if kept is not None:
            kept[(role, device)] = buf
    return buf


# --- leaves ----------------------------------------------------------------------


def _leaves(tree: Any, prefix: tuple = ()) -> list[tuple[tuple, Any]]:
    """(path, value) of every leaf; dicts are containers, anything else
    (lists such as ``param_groups`` included) is a leaf."""
    if isinstance(tree, Mapping):
        out: list[tuple[tuple, Any]] = []
        for k, v in tree.items():
            out.extend(_leaves(v, prefix + (k,)))
        return out
    return [(prefix, tree)]


def _name(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def _encode_placements(placements: Any, ndim: int) -> tuple | str:
    """(kind, dim, split_factor) triples, or the reason they cannot be moved."""
    out = []
    for p in placements:
        if isinstance(p, _StridedShard):
            out.append((2, p.dim % max(ndim, 1), int(p.split_factor)))
        elif isinstance(p, Shard):
            out.append((1, p.dim % max(ndim, 1), 1))
        elif isinstance(p, Replicate):
            out.append((0, 0, 1))
        else:
            return f"placement {p} (a pending reduction) has no well-defined value; redistribute it first"
    return tuple(out)


_MESH_RANKS: dict[Any, tuple[int, ...]] = {}


def _mesh_ranks(mesh: Any) -> tuple[int, ...]:
    """The global rank at each coordinate (row-major), cached per mesh:
    ``DeviceMesh.mesh`` builds a new tensor on every access."""
    ranks = _MESH_RANKS.get(mesh)
    if ranks is None:
        if len(_MESH_RANKS) >= 1024:
            _MESH_RANKS.clear()
        ranks = _MESH_RANKS[mesh] = tuple(int(r) for r in mesh.mesh.reshape(-1).tolist())
    return ranks


def _describe(value: Any, rank: int, with_values: bool) -> tuple:
    """A picklable description of one leaf (see the module docstring)."""
    if isinstance(value, DTensor):
        mesh = value.device_mesh
        placements = _encode_placements(value.placements, value.dim())
        if isinstance(placements, str):
            return ("bad", placements)
        local = value.to_local()
        coord = mesh.get_coordinate()
        return (
            "dt",
            str(value.dtype),
            tuple(value.shape),
            tuple(mesh.shape),
            placements,
            _mesh_ranks(mesh),
            None if coord is None else tuple(local.shape),
        )
    if with_values and isinstance(value, ShardedTensor):
        return _describe_sharded(value)
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
            return ("bad", f"tensor subclass {type(value).__name__} is not supported")
        return ("t", str(value.dtype), tuple(value.shape))
    return ("o", value if with_values else None)


def _describe_sharded(value: Any) -> tuple:
    """An FSDP1 ShardedTensor (a sharded getter's value for a flat
    parameter's original parameter): its shards cut dim 0 the way
    ``torch.chunk`` does, one rank each, in rank order -- the layout of
    Shard(0) on a 1-D mesh over those ranks.  Any other geometry is
    reported, not guessed."""
    md = value.metadata()
    gshape = tuple(md.size)
    shards = sorted(
        ((int(m.placement.rank()), tuple(m.shard_offsets), tuple(m.shard_sizes)) for m in md.shards_metadata),
        key=lambda s: (s[1], s[0]),
    )
    ranks = tuple(r for r, _, _ in shards)
    local = value.local_shards()
    lshape = tuple(local[0].tensor.shape) if local else None
    bad = ("bad", f"ShardedTensor with shards {[(r, list(o), list(z)) for r, o, z in shards]} of a "
           f"{list(gshape)} tensor: only dim-0 chunks, one per rank, can be resharded")
    if not gshape or len(set(ranks)) != len(ranks) or len(local) > 1:
        return bad
    layouts = C.shard_layouts(list(gshape), [len(ranks)], [(1, 0, 1)], [[i] for i in range(len(ranks))])
    for (_, off, size), (expect, blocks) in zip(shards, layouts):
        start = blocks[0][1] if blocks else (off[0],) + (0,) * (len(gshape) - 1)
        if tuple(size) != tuple(expect) or (blocks and tuple(off) != tuple(start)):
            return bad
    return ("dt", str(value.dtype), gshape, (len(ranks),), ((1, 0, 1),), ranks, lshape)


def _local(value: Any) -> torch.Tensor:
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, ShardedTensor):
        local = value.local_shards()
        if local:
            return local[0].tensor
        return torch.empty((0,) + tuple(value.metadata().size)[1:], dtype=value.dtype)
    return value


# --- agreement -------------------------------------------------------------------


class _Spec:
    """The agreed layouts of one tensor leaf."""

    __slots__ = ("path", "dtype", "shape", "src", "dst")

    def __init__(self, path, dtype, shape, src, dst):
        self.path = path
        self.dtype = dtype  # the source dtype: the bytes on the wire
        self.shape = shape
        self.src = src  # (mesh_shape, placements, ranks)
        self.dst = dst


def _agree(src_desc: dict, dst_desc: dict | None, rank: int, group: Any, local_problem: str | None,
           limit: int, group_ranks: list[int]):
    """Gathers every rank's descriptions and checks them; returns (specs,
    objects) or raises the same error on every rank."""
    world = dist.get_world_size(group)
    record = (rank, src_desc, dst_desc, local_problem, limit)
    gathered_all: list[Any] = [None] * world
    dist.all_gather_object(gathered_all, record, group=group)
    gathered_all.sort(key=lambda g: g[0])
    problems: list[str] = []

    def fail(msg: str) -> None:
        problems.append(msg)

    for r, _, _, lp, _ in gathered_all:
        if lp is not None:
            fail(f"rank {r}: {lp}")
    limits = sorted({g[4] for g in gathered_all})
    if len(limits) > 1:
        fail(f"the ranks pass different bucket_bytes ({limits}): the buckets of sender and receiver must agree")
    if problems:
        _raise(problems)
    gathered = [(r, sd, dd) for r, sd, dd, _, _ in gathered_all]
    members = set(group_ranks)

    # source: per key, who has what
    src_by_key: dict[tuple, list[tuple[int, tuple]]] = {}
    for r, sd, _ in gathered:
        for path, d in sd.items():
            src_by_key.setdefault(path, []).append((r, d))
    dst_ranks = [r for r, _, dd in gathered if dd is not None]
    if not dst_ranks:
        raise errors.StateDictValueError("reshard_state_dict: no rank passed a destination template")
    dst_keys = {r: set(dd) for r, _, dd in gathered if dd is not None}
    first = dst_ranks[0]
    for r in dst_ranks[1:]:
        if dst_keys[r] != dst_keys[first]:
            diff = sorted(dst_keys[r] ^ dst_keys[first], key=repr)[:3]
            fail(
                f"the templates of ranks {first} and {r} have different keys "
                f"(for example {', '.join(repr(_name(p)) for p in diff)})"
            )
    specs: list[_Spec] = []
    objects: dict[tuple, Any] = {}
    if not problems:
        template = {r: dd for r, _, dd in gathered if dd is not None}
        for path in sorted(dst_keys[first], key=repr):
            name = _name(path)
            holders = src_by_key.get(path)
            if not holders:
                fail(f"'{name}': in the template but in no rank's source state dict")
                continue
            descs = [(r, template[r][path]) for r in dst_ranks]
            for r, d in holders + descs:
                if d[0] == "bad":
                    fail(f"'{name}' on rank {r}: {d[1]}")
            if any(d[0] == "bad" for _, d in holders + descs):
                continue
            src_kinds = {d[0] for _, d in holders}
            dst_kinds = {d[0] for _, d in descs}
            if len(src_kinds) > 1 or len(dst_kinds) > 1:
                fail(f"'{name}': a DTensor on some ranks and not on others")
                continue
            sk, dk = src_kinds.pop(), dst_kinds.pop()
            if sk == "o" or dk == "o":
                if sk != dk:
                    fail(
                        f"'{name}': the source holds a {'tensor' if sk != 'o' else 'non-tensor value'} "
                        f"and the template a {'tensor' if dk != 'o' else 'non-tensor value'}"
                    )
                    continue
                objects[path] = holders[0][1][1]  # the lowest rank's value
                continue
            # tensors: one global dtype and shape on each side, and the same
            # global shape on both
            differ = _first_difference(holders, "source") or _first_difference(descs, "template")
            if differ is not None:
                fail(f"'{name}': {differ}")
                continue
            s0, d0 = holders[0][1], descs[0][1]
            if d0[2] != s0[2]:
                fail(
                    f"'{name}': the source's global shape {list(s0[2])} differs from "
                    f"the template's {list(d0[2])}"
                )
                continue
            spec = _layouts(path, sk, dk, holders, descs, s0, d0, fail)
            if spec is not None:
                specs.append(spec)
    for spec in specs:
        outside = sorted((set(spec.src[2]) | set(spec.dst[2])) - members)
        if outside:
            fail(f"'{_name(spec.path)}': its meshes include ranks {outside} outside the process group")
            break
    if problems:
        _raise(problems)
    return specs, objects


def _first_difference(described: list[tuple[int, Any]], side: str) -> str | None:
    """The first rank whose tensor description (kind, dtype, global shape)
    differs from the lowest rank's, as an error text, or None."""
    r0, d0 = described[0]
    for r, d in described[1:]:
        if d[:3] != d0[:3]:
            return (
                f"ranks {r0} and {r} hold different {side} tensors "
                f"({d0[1]} {list(d0[2])} vs {d[1]} {list(d[2])})"
            )
    return None


def _raise(problems: list[str]) -> None:
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    raise errors.StateDictRuntimeError(
        "reshard_state_dict: the layouts do not agree, nothing was changed: " + "; ".join(problems[:3]) + more
    )


def _layouts(path, sk, dk, holders, descs, s0, d0, fail) -> _Spec | None:
    name = _name(path)
    if sk == "dt":
        src = _merge_meshes(name, "source", holders, fail)
        if src is None:
            return None
        members = set(src[2])
        have = {r for r, _ in holders}
        if not members <= have:
            fail(f"'{name}': ranks {sorted(members - have)} of its source mesh do not pass it")
            return None
    else:
        ranks = tuple(r for r, _ in holders)
        src = ((len(ranks),), ((0, 0, 1),), ranks)
    if dk == "dt":
        dst = _merge_meshes(name, "template", descs, fail)
        if dst is None:
            return None
        have = {r for r, _ in descs}
        if not set(dst[2]) <= have:
            fail(f"'{name}': ranks {sorted(set(dst[2]) - have)} of its destination mesh pass no template")
            return None
    else:
        ranks = tuple(r for r, _ in descs)
        dst = ((len(ranks),), ((0, 0, 1),), ranks)
    # the local shapes must be the ones the placements imply
    for side, lay, entries, kind in (("source", src, holders, sk), ("template", dst, descs, dk)):
        if kind != "dt":
            continue
        mesh_shape, placements, ranks = lay
        index = {r: i for i, r in enumerate(ranks)}
        coords = []
        for r, d in entries:
            if r in index and d[6] is not None:
                coords.append((r, _coord(index[r], mesh_shape), d[6]))
        try:
            layouts = C.shard_layouts(list(s0[2]), list(mesh_shape), list(placements), [c for _, c, _ in coords])
        except ValueError as exc:
            fail(f"'{name}': {side} placements {placements}: {exc}")
            return None
        for (r, _, lshape), (expect, _) in zip(coords, layouts):
            if tuple(expect) != tuple(lshape):
                fail(
                    f"'{name}' on rank {r}: the {side}'s local shard has shape {list(lshape)}, "
                    f"its placements imply {list(expect)} (unsupported layout)"
                )
                return None
    return _Spec(path, s0[1], s0[2], (src[0], src[1], _intern(tuple(src[2]))), (dst[0], dst[1], _intern(tuple(dst[2]))))


def _merge_meshes(name: str, side: str, entries: list, fail) -> tuple | None:
    """The layout of a DTensor over every rank that holds it.  Ranks on
    one mesh give it as is; ranks on several disjoint meshes of one shape
    and placements (FSDP's data-parallel submeshes of a 2-D mesh: one per
    tensor-parallel rank) hold independent copies -- a Replicate mesh
    dimension in front of them."""
    meshes: dict[tuple, tuple] = {}
    for r, d in entries:
        if r in d[5]:
            meshes.setdefault(d[5], (d[3], d[4]))
    if not meshes:
        fail(f"'{name}': no rank is on the {side}'s mesh")
        return None
    if len(meshes) == 1:
        ((ranks, (shape, placements)),) = meshes.items()
        return (shape, placements, ranks)
    shapes = set(meshes.values())
    seen: set[int] = set()
    for ranks in meshes:
        if seen & set(ranks):
            shapes.add(None)  # type: ignore[arg-type]
        seen |= set(ranks)
    if len(shapes) != 1:
        described = "; ".join(f"ranks {list(r)}: mesh {list(m[0])} placements {m[1]}" for r, m in meshes.items())
        fail(f"'{name}': the {side}'s ranks hold it on overlapping or different meshes ({described})")
        return None
    shape, placements = shapes.pop()
    order = sorted(meshes, key=min)
    return ((len(order),) + tuple(shape), ((0, 0, 1),) + tuple(placements), tuple(r for rs in order for r in rs))


def _coord(index: int, shape: tuple) -> list[int]:
    coord = []
    for n in reversed(shape):
        coord.append(index % n)
        index //= n
    return coord[::-1]


# --- agreement by digest ---------------------------------------------------------
#
# The fast path of the agreement.  Each rank derives, from its own leaves
# alone, the layouts every rank must agree on: per template key (in the
# gathered path's order) the source dtype, the global shape, the template
# dtype and both layouts (mesh shape, placements, mesh ranks), or the
# source's value of a non-tensor leaf; plus the bucket size and the ranks
# that pass a template.  A rank that cannot (no template, a template key it
# does not hold in its source, anything the gathered path would report)
# has no view.  One all_reduce (MIN) of six integers then tells every rank
# whether the ranks with a view have the same 124-bit digest of it.  If
# every rank has one and they agree, the layouts are agreed.  If some
# ranks have none, the lowest rank with a view broadcasts it (its size is
# O(leaves + mesh ranks), not O(W x leaves)) and each of them checks its
# own leaves against it; one more all_reduce says whether all did.  Any
# disagreement falls back to the gathered agreement (``_agree``), which
# either finds the same layouts (for example a tensor held on only some
# of the submeshes of a mesh) or raises its error, the same on every rank.

_BIG = 1 << 62
_WORD = (1 << 62) - 1

# canonical tuples of mesh ranks: id -> tuple (kept alive, so ids are stable)
_INTERN_BY_ID: dict[int, tuple[tuple, tuple]] = {}
_INTERN_BY_VALUE: dict[tuple, tuple] = {}
_RANKS_DIGEST: dict[int, bytes] = {}
_POSITION: dict[tuple[int, int], int] = {}
_SUBSET: dict[tuple[int, int], bool] = {}
_MERGED: dict[Any, tuple | None] = {}
_TEMPLATE_RANKS: dict[tuple, tuple] = {}


def _intern(ranks: tuple) -> tuple:
    """The canonical object of a tuple of mesh ranks: looked up by identity
    first (a mesh's cached tuple: no hashing of its W ranks), by value the
    first time an object is seen.  Plans, digests and positions are keyed
    by the canonical object's id: it is kept alive here."""
    hit = _INTERN_BY_ID.get(id(ranks))
    if hit is not None and hit[0] is ranks:
        return hit[1]
    if len(_INTERN_BY_ID) >= 4096:
        # ids can be reused once the tuples go: what is keyed by them too
        _INTERN_BY_ID.clear()
        _INTERN_BY_VALUE.clear()
        _RANKS_DIGEST.clear()
        _POSITION.clear()
        _SUBSET.clear()
        _TEMPLATE_RANKS.clear()
        _MERGED.clear()
        _PLAN_CACHE.clear()
    canon = _INTERN_BY_VALUE.setdefault(ranks, ranks)
    _INTERN_BY_ID[id(ranks)] = (ranks, canon)
    _INTERN_BY_ID[id(canon)] = (canon, canon)
    return canon


def _position(ranks: tuple, rank: int) -> int:
    """The index of ``rank`` in the canonical ``ranks`` (-1: not there),
    found once per tuple."""
    key = (id(ranks), rank)
    pos = _POSITION.get(key)
    if pos is None:
        try:
            pos = ranks.index(rank)
        except ValueError:
            pos = -1
        _POSITION[key] = pos
    return pos


def _ranks_digest(ranks: tuple) -> bytes:
    d = _RANKS_DIGEST.get(id(ranks))
    if d is None:
        d = _RANKS_DIGEST[id(ranks)] = hashlib.blake2b(repr(ranks).encode(), digest_size=16).digest()
    return d


def _merged_layout(mesh: Any, placements: tuple) -> tuple | None:
    """The layout of a DTensor on ``mesh`` held on every submesh of its
    root mesh that has the same mesh dimensions (FSDP's data-parallel
    submeshes of a 2-D mesh): a Replicate dimension in front, submeshes
    ordered by their lowest rank, as ``_merge_meshes`` builds it.  None
    where the root cannot be cut that way."""
    key = (mesh, placements)
    if key in _MERGED:
        return _MERGED[key]
    out = None
    root = mesh._get_root_mesh()
    names, root_names = mesh.mesh_dim_names, root.mesh_dim_names
    if names and root_names and all(n in root_names for n in names) and len(set(names)) == len(names):
        sub = [root_names.index(n) for n in names]
        rest = [i for i in range(root.mesh.dim()) if i not in sub]
        rows = root.mesh.permute(rest + sub).reshape(-1, *tuple(mesh.shape))
        mine = tuple(int(r) for r in mesh.mesh.reshape(-1).tolist())
        flat = [tuple(int(r) for r in row.reshape(-1).tolist()) for row in rows]
        if mine in flat:
            flat.sort(key=min)
            ranks = tuple(r for row in flat for r in row)
            out = ((len(flat),) + tuple(mesh.shape), ((0, 0, 1),) + placements, _intern(ranks))
    if len(_MERGED) >= 1024:
        _MERGED.clear()
    _MERGED[key] = out
    return out


def _own_layout(value: Any, desc: tuple, rank: int, plain: tuple) -> tuple | None:
    """One side's layout of a tensor leaf as this rank sees it, or None;
    the rank's own local shard must be the one the layout implies."""
    if desc[0] == "t":
        return ((len(plain),), ((0, 0, 1),), plain)
    lay: tuple | None = (desc[3], desc[4], _intern(desc[5]))
    if isinstance(value, DTensor):
        mesh = value.device_mesh
        if mesh._get_root_mesh() is not mesh:
            lay = _merged_layout(mesh, desc[4])
            if lay is None:
                return None
    if not _local_shape_fits(desc, lay, rank):  # type: ignore[arg-type]
        return None
    return lay


def _local_shape_fits(desc: tuple, lay: tuple, rank: int) -> bool:
    """Whether this rank's local shard of a DTensor leaf has the shape the
    layout implies (a holder off the mesh, as in the gathered path, holds
    nothing of it)."""
    mesh_shape, placements, ranks = lay
    index = _position(ranks, rank)
    if desc[6] is None or index < 0:
        return True
    try:
        ((expect, _),) = C.shard_layouts(list(desc[2]), list(mesh_shape), list(placements),
                                         [_coord(index, mesh_shape)])
    except ValueError:
        return False
    return tuple(expect) == tuple(desc[6])


def _within(ranks: tuple, group_ranks: tuple) -> bool:
    key = (id(ranks), id(group_ranks))
    hit = _SUBSET.get(key)
    if hit is None:
        hit = _SUBSET[key] = set(group_ranks).issuperset(ranks)
    return hit


def _template_ranks(dst_layouts: list[tuple], group_ranks: tuple) -> tuple:
    """The ranks assumed to pass a template: every rank of the template's
    DTensor meshes (all of the group where it has none)."""
    distinct = {id(lay[2]): lay[2] for lay in dst_layouts}
    if not distinct:
        return group_ranks
    key = tuple(sorted(distinct))
    hit = _TEMPLATE_RANKS.get(key)
    if hit is None:
        if len(_TEMPLATE_RANKS) >= 256:
            _TEMPLATE_RANKS.clear()
        members: set[int] = set()
        for ranks in distinct.values():
            members.update(ranks)
        hit = _TEMPLATE_RANKS[key] = _intern(tuple(sorted(members)))
    return hit


def _view(src_leaves: dict, dst_leaves: dict | None, src_desc: dict, dst_desc: dict | None, rank: int,
          limit: int, group_ranks: tuple, local_problem: str | None) -> tuple | None:
    """This rank's account of the agreed layouts (see above), or None.
    Entries: ("o", path, value) or ("t", path, source dtype, global shape,
    template dtype, source kind, template kind, source layout, template
    layout)."""
    if local_problem is not None or dst_desc is None or dst_leaves is None:
        return None
    entries: list[tuple] = []
    plain_dst: list[int] = []
    dst_layouts: list[tuple] = []
    for path in sorted(dst_desc, key=repr):
        d, s = dst_desc[path], src_desc.get(path)
        if s is None or s[0] == "bad" or d[0] == "bad":
            return None
        if s[0] == "o" or d[0] == "o":
            if s[0] != d[0]:
                return None
            entries.append(("o", path, s[1]))
            continue
        if s[2] != d[2]:
            return None
        src = _own_layout(src_leaves[path], s, rank, group_ranks)
        dst = _own_layout(dst_leaves[path], d, rank, group_ranks) if d[0] != "t" else None
        if src is None or (d[0] != "t" and dst is None):
            return None
        if not _within(src[2], group_ranks) or (dst is not None and not _within(dst[2], group_ranks)):
            return None
        if dst is None:
            plain_dst.append(len(entries))
        else:
            dst_layouts.append(dst)
        entries.append(("t", path, s[1], s[2], d[1], s[0], d[0], src, dst))
    tmpl = _template_ranks(dst_layouts, group_ranks)
    if _position(tmpl, rank) < 0:
        return None
    plain = ((len(tmpl),), ((0, 0, 1),), tmpl)
    for i in plain_dst:
        entries[i] = entries[i][:8] + (plain,)
    return (limit, tmpl, entries)


def _digest_words(view: tuple) -> tuple[int, int]:
    """124 bits of a digest of a view: the W ranks of a mesh are hashed
    once per mesh, not once per leaf."""
    limit, tmpl, entries = view
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(limit).encode())
    h.update(_ranks_digest(tmpl))
    for e in entries:
        if e[0] == "o":
            h.update(b"o" + repr(e[1]).encode())
            h.update(_object_bytes(e[2]))
            continue
        h.update(repr(e[:7]).encode())
        for lay in e[7:]:
            h.update(repr(lay[:2]).encode())
            h.update(_ranks_digest(lay[2]))
    raw = h.digest()
    return int.from_bytes(raw[:8], "little") & _WORD, int.from_bytes(raw[8:], "little") & _WORD


def _object_bytes(value: Any) -> bytes:
    try:
        return pickle.dumps(value, protocol=4)
    except Exception:  # noqa: BLE001 - an unpicklable value: its repr
        return repr(value).encode()


def _reduce_min(values: list[int], group: Any) -> list[int]:
    # on the buckets' device: NCCL reduces CUDA tensors only
    buf = torch.tensor(values, dtype=torch.int64, device=_buffer_device(group))
    return reduce_min(buf, group, dist.get_world_size(group)).tolist()


def _fits(view: tuple, src_desc: dict, dst_desc: dict | None, rank: int, limit: int,
          local_problem: str | None, group_ranks: tuple) -> bool:
    """Whether this rank's own leaves agree with another rank's view
    (interned): what the gathered path would check of them."""
    vlimit, tmpl, entries = view
    if local_problem is not None or vlimit != limit or (dst_desc is not None) != (_position(tmpl, rank) >= 0):
        return False
    if dst_desc is not None and len(dst_desc) != len(entries):
        return False
    for e in entries:
        path = e[1]
        s = src_desc.get(path)
        d = None if dst_desc is None else dst_desc.get(path)
        if dst_desc is not None and (d is None or (e[0] == "o") != (d[0] == "o")):
            return False
        if e[0] == "o":
            if s is not None and (s[0] != "o" or _object_bytes(s[1]) != _object_bytes(e[2])):
                return False
            continue
        _, _, sdtype, shape, ddtype, skind, dkind, src, dst = e
        if d is not None and (d[0] != dkind or d[1] != ddtype or d[2] != shape):
            return False
        if d is not None and dkind == "dt" and not _on_layout(d, dst, rank):
            return False
        holds = s is not None
        if s is not None and (s[0] != skind or s[1] != sdtype or s[2] != shape):
            return False
        if (_position(src[2], rank) >= 0) != holds:
            return False
        if s is not None and skind == "dt" and not _on_layout(s, src, rank):
            return False
    return True


def _on_layout(desc: tuple, lay: tuple, rank: int) -> bool:
    """A DTensor leaf of this rank against an agreed layout: its mesh is
    the agreed one or one of its rows (the submeshes a Replicate dimension
    was put in front of), and its local shard has the implied shape."""
    mesh_shape, placements, ranks = lay
    mine = tuple(desc[5])
    if (tuple(desc[3]), tuple(desc[4])) == (tuple(mesh_shape), tuple(placements)):
        if mine != ranks:
            return False
    elif (tuple(desc[3]), tuple(desc[4])) == (tuple(mesh_shape[1:]), tuple(placements[1:])):
        n = len(mine)
        if mine not in {ranks[i:i + n] for i in range(0, len(ranks), n)}:
            return False
    else:
        return False
    return _local_shape_fits(desc, lay, rank)


def _agree_by_digest(src_leaves: dict, dst_leaves: dict | None, src_desc: dict, dst_desc: dict | None,
                     rank: int, group: Any, local_problem: str | None, limit: int,
                     group_ranks: tuple) -> tuple | None:
    """(specs, objects) when the ranks agree by digest (see above), or None
    on every rank: then the gathered agreement decides."""
    # whatever goes wrong here only costs this rank its view (the gathered
    # agreement then reports it): no rank may skip the collectives below
    try:
        view = _view(src_leaves, dst_leaves, src_desc, dst_desc, rank, limit, group_ranks, local_problem)
        words = None if view is None else _digest_words(view)
    except Exception:  # noqa: BLE001 - see above
        view = words = None
    if view is not None and words is not None:
        w0, w1 = words
        mine = [w0, w1, _WORD - w0, _WORD - w1, rank, 1]
    else:
        mine = [_BIG, _BIG, _BIG, _BIG, _BIG, 0]  # neutral; the last word: someone has no view
    lo0, lo1, hi0, hi1, root, everyone = _reduce_min(mine, group)
    if root == _BIG or (lo0, lo1) != (_WORD - hi0, _WORD - hi1):
        return None
    if not everyone:
        box = [view]
        dist.broadcast_object_list(box, src=root, group=group)
        if view is None:
            try:
                got: Any = box[0]  # None from a root without a view: TypeError, caught
                view = (got[0], _intern(got[1]), [
                    e if e[0] == "o" else e[:7] + tuple((lay[0], lay[1], _intern(lay[2])) for lay in e[7:])
                    for e in got[2]
                ])
                ok = _fits(view, src_desc, dst_desc, rank, limit, local_problem, group_ranks)
            except Exception:  # noqa: BLE001 - not fitting: the gathered agreement reports why
                ok = False
        else:
            ok = True
        (fine,) = _reduce_min([1 if ok else 0], group)
        if not fine:
            return None
        _agreements["broadcast"] += 1
    else:
        _agreements["digest"] += 1
    assert view is not None  # the root's, received, or this rank's own
    specs = [_Spec(e[1], e[2], e[3], e[7], e[8]) for e in view[2] if e[0] == "t"]
    objects = {e[1]: e[2] for e in view[2] if e[0] == "o"}
    return specs, objects


# --- plan ------------------------------------------------------------------------


def _plan(spec: _Spec, rank: int) -> tuple:
    # the mesh ranks are canonical objects (_intern): keyed by identity,
    # their W ranks are not hashed on every call
    src, dst = spec.src, spec.dst
    key = (spec.shape, src[0], src[1], id(src[2]), dst[0], dst[1], id(dst[2]), rank)
    plan = _PLAN_CACHE.get(key)
    if plan is not None:
        _cache_stats["hits"] += 1
        return plan
    _cache_stats["misses"] += 1
    plan = C.reshard_plan(
        list(spec.shape), list(spec.src[0]), list(spec.src[1]), list(spec.src[2]),
        list(spec.dst[0]), list(spec.dst[1]), list(spec.dst[2]), rank,
    )
    if len(_PLAN_CACHE) >= _PLAN_CACHE_MAX:
        _PLAN_CACHE.clear()
    _PLAN_CACHE[key] = plan
    return plan


def _box(start: tuple, lens: tuple) -> tuple:
    return tuple(slice(s, s + n) for s, n in zip(start, lens))


def _split(sstart, dstart, lens, itemsize: int, limit: int):
    """Splits a box along its outer dimensions until each piece is at most
    ``limit`` bytes (or a single row of the innermost dimension)."""
    nbytes = itemsize
    for n in lens:
        nbytes *= n
    if nbytes <= limit or not lens:
        return [(sstart, dstart, lens)]
    d = next((i for i, n in enumerate(lens) if n > 1), None)
    if d is None:
        return [(sstart, dstart, lens)]
    row = nbytes // lens[d]
    step = max(1, limit // max(row, 1))
    out = []
    for a in range(0, lens[d], step):
        n = min(step, lens[d] - a)
        s = sstart[:d] + (sstart[d] + a,) + sstart[d + 1:]
        t = dstart[:d] + (dstart[d] + a,) + dstart[d + 1:]
        ln = lens[:d] + (n,) + lens[d + 1:]
        out.extend(_split(s, t, ln, itemsize, limit))
    return out


def _buckets(items: list, limit: int) -> list[tuple[int, list]]:
    """Greedy packing of (tensor, start, lens, dtype, nbytes) items into
    buckets of at most ``limit`` bytes (a lone item may be larger):
    [(size, [(offset, item)])]; both sides compute the same, from the sizes
    alone.  The small items (under ``_OWN_BUCKET`` bytes) come first in a
    bucket, packed: each offset a multiple of its item's element size (so
    the bytes can be viewed in its dtype), items of one dtype with no gap;
    they travel as one message.  Each large item follows at an offset
    aligned to ``_ALIGN`` and is a message of its own (``_messages``), so
    that each side can send it from, or receive it into, the tensor itself
    where the box is contiguous there."""
    out: list[tuple[int, list]] = []
    small: list = []
    large: list = []
    small_end = 0  # the end of the packed small items
    large_bytes = 0  # the large items' bytes, each with its alignment slack

    def close() -> None:
        entries = list(small)
        end = small_end
        for item in large:
            off = (end + _ALIGN - 1) // _ALIGN * _ALIGN
            entries.append((off, item))
            end = off + item[4]
        out.append((end, entries))

    for item in items:
        n = item[4]
        if n >= _OWN_BUCKET:
            if (small or large) and small_end + large_bytes + n + _ALIGN > limit:
                close()
                small, large, small_end, large_bytes = [], [], 0, 0
            large.append(item)
            large_bytes += n + _ALIGN
            continue
        size = item[3].itemsize
        off = (small_end + size - 1) // size * size
        if (small or large) and off + n + large_bytes > limit:
            close()
            small, large, small_end, large_bytes = [], [], 0, 0
            off = 0
        small.append((off, item))
        small_end = off + n
    if small or large:
        close()
    return out


def _messages(entries: list) -> list[tuple[int, int, list]]:
    """A bucket's messages, (start, end, entries) in its bytes: the packed
    small items as one, then each large item alone (see ``_buckets``)."""
    n_small = 0
    while n_small < len(entries) and entries[n_small][1][4] < _OWN_BUCKET:
        n_small += 1
    out = []
    if n_small:
        last_off, last = entries[n_small - 1]
        out.append((0, last_off + last[4], entries[:n_small]))
    for off, item in entries[n_small:]:
        out.append((off, off + item[4], [(off, item)]))
    return out


# --- transfer --------------------------------------------------------------------


def reshard(source: Any, template: Any, *, group: Any = None, bucket_bytes: int | None = None,
            kept: dict | None = None) -> Any:
    """See :func:`dcp_optim.reshard_state_dict`."""
    if not dist.is_initialized():
        raise errors.StateDictRuntimeError("reshard_state_dict needs an initialized process group")
    limit = int(bucket_bytes) if bucket_bytes is not None else DEFAULT_BUCKET_BYTES
    if limit < _ALIGN:
        raise errors.StateDictValueError(f"bucket_bytes must be at least {_ALIGN}, got {limit}")
    rank = dist.get_rank()
    group_ranks = _group_ranks(group)
    if source is None:
        source = {}
    # Anything wrong on this rank alone is reported through the agreement
    # exchange, so that every rank raises (none is left waiting in it).
    local_problem: str | None = None
    src_leaves: dict = {}
    dst_leaves: dict | None = None
    src_desc: dict = {}
    dst_desc: dict | None = None
    try:
        if not isinstance(source, Mapping) or (template is not None and not isinstance(template, Mapping)):
            raise TypeError(
                f"source and template must be dicts (template may be None), got "
                f"{type(source).__name__} and {type(template).__name__}"
            )
        src_leaves = dict(_leaves(source))
        dst_leaves = dict(_leaves(template)) if template is not None else None
        src_desc = {p: _describe(v, rank, True) for p, v in src_leaves.items()}
        dst_desc = None if dst_leaves is None else {p: _describe(v, rank, False) for p, v in dst_leaves.items()}
        local_problem = (_unmovable_wrapper(src_leaves, "source") or _unmovable_wrapper(dst_leaves, "template")
                         or _shared_memory(src_leaves, dst_leaves))
    except Exception as exc:  # noqa: BLE001 - reported on every rank below
        local_problem = f"{type(exc).__name__}: {exc}"
        src_desc, dst_desc = {}, None
    # a rank that never comes (crashed, or elsewhere) is reported within
    # the package's bound instead of the process group's timeout
    await_arrival(None if len(group_ranks) == dist.get_world_size() else _RanksMesh(group_ranks),
                  "reshard_state_dict")
    agreed = _agree_by_digest(src_leaves, dst_leaves, src_desc, dst_desc, rank, group, local_problem, limit,
                              group_ranks)
    if agreed is None:
        _agreements["gathered"] += 1
        agreed = _agree(src_desc, dst_desc, rank, group, local_problem, limit, list(group_ranks))
    specs, objects = agreed

    # A wrapper subclass's local tensor (torchao's float8 training weights)
    # holds its values in one inner tensor: the transfer reads and writes
    # plain stand-ins, filled and emptied through the subclass's own copy_
    # (``_stand_ins``).  Allocating them can fail: agreed with the buffers.
    failure: Exception | None = None
    src_plain: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
    dst_plain: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
    try:
        paths = [spec.path for spec in specs]
        src_plain = _stand_ins(src_leaves, paths, read=True)
        dst_plain = _stand_ins(dst_leaves, paths, read=False)
    except Exception as exc:  # noqa: BLE001 - agreed on below, raised on every rank
        failure = exc

    def src_local(path: tuple) -> torch.Tensor:
        staged = src_plain.get(path)
        return _local(src_leaves[path]) if staged is None else staged[1]

    def dst_local(path: tuple) -> torch.Tensor:
        staged = dst_plain.get(path)
        return _local(dst_leaves[path]) if staged is None else staged[1]  # type: ignore[index]

    # this rank's boxes: locals, and per peer the ordered send / recv items
    locals_: list[tuple] = []
    alone: list[tuple] = []  # the boxes of the shards nothing else writes
    sends: dict[int, list] = {}
    recvs: dict[int, list] = {}
    written: dict[int, torch.Tensor] = {}  # the template's tensors this rank writes
    dense: list[tuple] = []  # (kind, i, j, source local, template local, its block's bytes)
    order = _group_order(group)
    for live, _plain in dst_plain.values():
        # a stand-in is no live tensor: the undo log keeps the values of
        # the wrapper it is copied into (its one inner tensor, ``_stand_ins``)
        inner = values_tensor(live)
        if inner is not None:
            written[id(inner)] = inner
    for spec in specs:
        dtype = _torch_dtype(spec.dtype)
        itemsize = torch.empty((), dtype=dtype).element_size()
        kind = _dense_kind(spec, order, itemsize, limit)
        undone = spec.path not in dst_plain
        if kind is not None:
            dst_t = dst_local(spec.path)
            if undone:
                written[id(dst_t)] = dst_t
            dense.append((*kind[:3], src_local(spec.path), dst_t, kind[3]))
            continue
        local, recv, send = _plan(spec, rank)
        if local or recv:
            dst_t = dst_local(spec.path)
            if recv and undone:
                written[id(dst_t)] = dst_t
        if local or send:
            src_t = src_local(spec.path)
        # boxes into a shard that also receives (the undo log keeps it) or
        # into a stand-in are copied before the last all_reduce; a shard
        # this rank fills alone, after it (see below)
        mine = locals_ if (recv or not undone) else alone
        for sstart, dstart, lens in local:
            mine.append((src_t, sstart, dst_t, dstart, lens))
        for peer, sstart, dstart, lens in recv:
            for _s, d, ln in _split(sstart, dstart, lens, itemsize, limit):
                recvs.setdefault(peer, []).append((dst_t, d, ln, dtype, _nbytes(ln, itemsize)))
        for peer, sstart, dstart, lens in send:
            for s, _d, ln in _split(sstart, dstart, lens, itemsize, limit):
                sends.setdefault(peer, []).append((src_t, s, ln, dtype, _nbytes(ln, itemsize)))

    # Received boxes land in the template as they come: a rank killed
    # mid-transfer would leave it half written.  The undo log keeps what
    # is overwritten (a host copy of each template tensor that receives
    # anything, as a load's in-place stream keeps it) until every rank has
    # received everything: the last all_reduce.  The boxes a rank holds
    # itself of those tensors, and the stand-ins written into torchao's
    # wrappers (the log keeps their inner tensors; the subclass's copy_
    # is its own code), are copied before it too, so that a copy that
    # fails is agreed on and put back like the others.  A shard this rank
    # fills alone, from its own source, is copied after it, needing no
    # copy kept: a plain copy_ between tensors already allocated, whose
    # cast (if any) was tried before the transfer (``_try_casts``), has
    # nothing left to fail on but the device itself.
    #
    # What the transfer allocates -- the undo log's copy, the send and
    # receive buffers (each at most a bucket, the largest any step uses,
    # shared by the steps) -- is allocated before it starts, and the ranks
    # agree that each of them could: one out of memory (a GPU near full)
    # raises with every rank, nothing changed, where it would have left
    # them in the transfer's first collective until the group's timeout.
    device = _buffer_device(group)
    steps = _dense_steps(_dense_groups(dense, limit, len(order)), len(order), limit, device)
    batches = _transfer_batches(sends, recvs, group_ranks, rank, limit, device)
    buffers: dict = kept if kept is not None else {}
    undo = None
    try:
        if failure is not None:
            raise failure
        _try_casts([spec for spec in specs if dst_leaves is not None and spec.path in dst_leaves], dst_local)
        for role, need in _buffer_needs(steps, batches).items():
            if need:
                _scratch(buffers, role, need, device)
        if undo_enabled():
            # the loads' undo log, over (source, template, meta) jobs: only
            # the templates matter to it
            undo = _UndoLog([(None, t, None) for t in written.values()])
            # without kept buffers, one host tensor per template shard: each
            # under glibc's mmap threshold comes from its heap, reused from
            # call to call (a single flat one above it would fault in fresh
            # pages every time)
            undo.save_all(_scratch(kept, "undo", host_bytes(undo.locals), torch.device("cpu"))
                          if kept is not None else None)
    except Exception as exc:  # noqa: BLE001 - agreed on below, raised on every rank
        failure = exc
    _agree_ready(failure, rank, group)
    own = OwnFailure()
    try:
        _collectives(steps, group, device, buffers, own)
        _transfer(batches, group, device, buffers, own)
        own.attempt(_copy_own_boxes, locals_, dst_plain)
        _agree_done(own.error, rank, group)
    except BaseException as exc:
        if undo is not None:
            undo.restore()
        note = (f" [reshard_state_dict, rank {rank}: "
                + ("the template was put back as it was before the call]" if undo is not None
                   else f"the template may be partly written ({UNDO_ENV}=0: no undo log)]"))
        if exc.args and isinstance(exc.args[0], str):
            exc.args = (exc.args[0] + note, *exc.args[1:])
        raise
    _copy_own_boxes(alone, {})
    if template is None:
        return None
    return _rebuild(template, (), objects)


def _copy_own_boxes(locals_: list[tuple], dst_plain: dict) -> None:
    """The boxes this rank holds of its own template, then each stand-in
    into the wrapper it stands for (the subclass's own ``copy_``, as a
    load's): once everything is received, before the last all_reduce."""
    for src_t, sstart, dst_t, dstart, lens in locals_:
        dst_t[_box(dstart, lens)].copy_(src_t[_box(sstart, lens)])
    with torch.no_grad():
        for live, plain in dst_plain.values():
            live.copy_(plain)


def _buffer_needs(steps: list[tuple], batches: list[tuple]) -> dict[str, int]:
    """The bytes of the send and the receive buffer the transfer's steps
    use at most (one buffer each, shared by the steps in turn)."""
    send = max((step[2] for step in steps), default=0)
    recv = max((step[3] for step in steps), default=0)
    for _to, _frm, out, into in batches:
        if out is not None and out[2]:
            send = max(send, out[0])
        if into is not None and into[2]:
            recv = max(recv, into[0])
    return {"send": send, "recv": recv}


def _agree_ready(failure: Exception | None, rank: int, group: Any) -> None:
    """One all_reduce: whether every rank allocated what its transfer
    needs (and could make its casts, ``_try_casts``).  Where one could
    not, every rank raises, naming each such rank and its error; nothing
    was changed."""
    _agree_verdict(failure, rank, group, "could not prepare its transfer (its buffers, the undo log's copy, "
                   "a cast it makes), nothing was changed")


def _agree_done(failure: Exception | None, rank: int, group: Any) -> None:
    """The transfer's last all_reduce: whether every rank received
    everything, its own copies included (``OwnFailure``).  Where one
    failed, every rank raises, naming it; the caller puts the template
    back (the undo log)."""
    _agree_verdict(failure, rank, group, "failed in its transfer")


def _agree_verdict(failure: Exception | None, rank: int, group: Any, what: str) -> None:
    """One all_reduce of every rank's verdict; where some rank failed,
    each such rank's error, gathered (on this path only), raised on every
    rank, the failing rank's own error the cause of its."""
    (ready,) = _reduce_min([0 if failure is not None else 1], group)
    if ready:
        return
    mine = None if failure is None else (rank, f"{type(failure).__name__}: {failure}")
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    problems = [f"rank {r}: {msg}" for r, msg in sorted(g for g in gathered if g is not None)]
    raise errors.StateDictRuntimeError(f"reshard_state_dict: a rank {what}: " + "; ".join(problems)) from failure


def _torch_dtype(name: str) -> torch.dtype:
    """The dtype a description spells (``str(dtype)``: "torch.float32")."""
    return getattr(torch, name.split(".")[-1])


def _try_casts(specs: list[_Spec], dst_local: Any) -> None:
    """Each cast the transfer makes that torch warns about -- complex
    source values into a real template, whose imaginary parts ``copy_``
    drops -- once, on one element, before the agreement ahead of the
    transfer: where the caller's warning filters make that warning an
    error (``-W error``), it fails there, with every rank, instead of in
    the middle of the transfer."""
    pairs = set()
    for spec in specs:
        src = _torch_dtype(spec.dtype)
        dst = dst_local(spec.path)
        if src.is_complex and isinstance(dst, torch.Tensor) and not dst.dtype.is_complex:
            pairs.add((src, dst.dtype))
    for src, dst in sorted(pairs, key=str):
        torch.empty(1, dtype=dst).copy_(torch.zeros(1, dtype=src))


def _transfer_batches(sends: dict, recvs: dict, ranks: tuple, rank: int, limit: int,
                      device: torch.device) -> list[tuple]:
    """The point-to-point exchanges that carry data for this rank, as
    batches (to, from, what it sends, what it receives), in order: the
    ring shifts in increasing order (shift k: send to rank+k, receive from
    rank-k; shifts with no peer skipped), and within a shift the buckets
    (``_buckets``) of each direction side by side.  Every rank goes through
    its shifts in the same order, and the sender and receiver of a pair
    pack the same buckets, so each batch's ``batch_isend_irecv`` meets its
    peer's, its messages (``_messages``) tagged by their position.  Each
    direction is None or (its bucket's size, [(tag, start, end, entries,
    the message's own tensor bytes or None)], whether the bucket buffer is
    needed): a message of one contiguous box is sent from, or received
    into, the tensor itself (no bucket copy; a received box only where the
    template holds the source's dtype); the others go through the send /
    receive buffer."""
    me = _position(ranks, rank)
    world = len(ranks)
    shifts = sorted({(_position(ranks, p) - me) % world for p in sends}
                    | {(me - _position(ranks, p)) % world for p in recvs})
    batches: list[tuple] = []

    def side(bucket: tuple, receiving: bool) -> tuple:
        size, entries = bucket
        msgs = []
        for tag, (lo, hi, msg) in enumerate(_messages(entries)):
            msgs.append((tag, lo, hi, msg, _whole(msg, device, msg[0][1][3] if receiving else None)))
        return size, msgs, any(m[4] is None for m in msgs)

    for k in shifts:
        if k == 0:
            continue
        to, frm = ranks[(me + k) % world], ranks[(me - k) % world]
        sb = _buckets(sends.get(to, []), limit)
        rb = _buckets(recvs.get(frm, []), limit)
        for t in range(max(len(sb), len(rb))):
            batches.append((to, frm, side(sb[t], False) if t < len(sb) else None,
                            side(rb[t], True) if t < len(rb) else None))
    return batches


def _transfer(batches: list[tuple], group: Any, device: torch.device, buffers: dict,
              failure: OwnFailure) -> None:
    """Run ``_transfer_batches``' batches, through the send and receive
    buffers of ``buffers`` (``_scratch``'s, allocated before); a copy of
    this rank's own that fails is skipped, as in ``_collectives``."""
    for to, frm, send, recv in batches:
        ops = []
        staged: list = []  # the received entries to copy out of the receive buffer
        recv_buf = None
        if send is not None:
            size, msgs, buffered = send
            send_buf = _scratch(buffers, "send", size, device) if buffered else None
            for tag, lo, hi, msg, view in msgs:
                if view is None:
                    assert send_buf is not None  # buffered: some message is not its own tensor
                    failure.attempt(_pack_message, send_buf, msg)
                    view = send_buf[lo:hi]
                ops.append(send_op(view, to, group, tag))
        if recv is not None:
            size, msgs, buffered = recv
            recv_buf = _scratch(buffers, "recv", size, device) if buffered else None
            for tag, lo, hi, msg, view in msgs:
                if view is None:
                    view = recv_buf[lo:hi]  # type: ignore[index]
                    staged.extend(msg)
                ops.append(recv_op(view, frm, group, tag))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        failure.attempt(_unpack_message, recv_buf, staged)


def _pack_message(send_buf: torch.Tensor, msg: list) -> None:
    """A message's boxes into the send buffer, each at its offset."""
    for off, (tensor, start, lens, dtype, n) in msg:
        _window(send_buf, off, n, dtype, lens).copy_(tensor[_box(start, lens)])


def _unpack_message(recv_buf: Any, staged: list) -> None:
    """The boxes received into the receive buffer, into the template."""
    for off, (tensor, start, lens, dtype, n) in staged:
        tensor[_box(start, lens)].copy_(_window(recv_buf, off, n, dtype, lens))


def _dense_kind(spec: _Spec, order: tuple, itemsize: int, limit: int) -> tuple | None:
    """(kind, i, j, the rank's block in bytes) of a tensor whose exchange
    is one collective over the group, or None.
    Between two 1-D layouts over the whole group in its own rank order,
    with the sharded dimensions divisible by the group's size, every rank
    exchanges an equal block with every other: ``Shard(i) -> Shard(j)``
    (FSDP2 <-> TP) is one ``all_to_all_single``, ``Shard(i) -> Replicate``
    one all-gather.  One call then carries all W - 1 peers' blocks (no
    per-peer Python: the per-rank cost stays flat in the world size).
    Only where the rank's block of the tensor (all-gather: the whole
    tensor) fits in a bucket, which keeps the memory bound.  Decided from
    the agreed layouts alone: the same on every rank, in the same order."""
    (src_mesh, src_pl, src_ranks), (dst_mesh, dst_pl, dst_ranks) = spec.src, spec.dst
    world = len(order)
    if world < 2 or src_mesh != (world,) or dst_mesh != (world,):
        return None
    # by value (identity first): interned tuples may be rebuilt on one
    # rank and not another, and the decision must be the same everywhere
    if not (src_ranks is order or src_ranks == order) or not (dst_ranks is order or dst_ranks == order):
        return None
    if src_pl[0][0] != 1:
        return None
    i = src_pl[0][1]
    numel = 1
    for n in spec.shape:
        numel *= n
    if numel == 0 or spec.shape[i] % world:
        return None
    block = numel // world * itemsize
    if dst_pl[0][0] == 1 and dst_pl[0][1] != i and spec.shape[dst_pl[0][1]] % world == 0:
        return ("a2a", i, dst_pl[0][1], block) if block <= limit else None
    if dst_pl[0][0] == 0:
        return ("gather", i, -1, block) if block * world <= limit else None
    return None


_GROUP_ORDER: dict[Any, tuple] = {}


def _group_order(group: Any) -> tuple:
    """The group's global ranks in its own rank order (a collective's
    order), canonical (``_intern``) when sorted; () when not sorted (no
    mesh's row-major ranks can then match it)."""
    key = group if group is not None else ("world", dist.get_world_size())
    order = _GROUP_ORDER.get(key)
    if order is None:
        got = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))
        order = _GROUP_ORDER[key] = _intern(got) if list(got) == sorted(got) else ()
    return order


# A dense tensor whose collective buffer is this large has a collective
# of its own (written straight into the template where its layout allows);
# smaller ones share one, packed (a collective costs more than copying them).
_OWN_DENSE = 1 << 20


def _dense_groups(dense: list, limit: int, world: int) -> list[list[tuple]]:
    """The dense tensors as collectives, in the agreed order: a tensor
    whose buffer (this rank's block; an all-gather's output: W blocks) is
    at least ``_OWN_DENSE`` alone, the smaller ones of each kind packed
    into one collective while its buffer stays within ``limit``.  Decided
    from the agreed layouts alone: the same on every rank."""
    groups: list[list[tuple]] = []
    packing: dict[str, tuple[int, int]] = {}  # kind -> (its open group, its bytes)
    for job in dense:
        kind, nbytes = job[0], job[5]
        wire = nbytes if kind == "a2a" else nbytes * world
        if wire >= _OWN_DENSE:
            groups.append([job])
            continue
        at = packing.get(kind)
        if at is not None and at[1] + _ALIGN * world + wire <= limit:
            groups[at[0]].append(job)
            packing[kind] = (at[0], at[1] + _ALIGN * world + wire)
        else:
            packing[kind] = (len(groups), wire)
            groups.append([job])
    return groups


def _dense_steps(groups: list, world: int, limit: int, device: torch.device) -> list[tuple]:
    """The dense tensors (``_dense_kind``), one collective per group of
    ``_dense_groups``, in the agreed order, as the steps ``_collectives``
    runs: ("wave", [(job, send offset or -1, receive offset or -1)], send
    bytes, receive bytes), consecutive single-tensor collectives staged
    within ``limit`` each way (an offset of -1: the tensor sends from, or
    receives into, its own shard), or ("packed", its ``_packed_layout``,
    send bytes, receive bytes), the small tensors of one collective."""
    steps: list[tuple] = []
    wave: list[tuple] = []
    staged = [0, 0]  # the wave's bytes in the send and the receive buffer

    def flush() -> None:
        if wave:
            steps.append(("wave", list(wave), staged[0], staged[1]))
            wave.clear()
            staged[0] = staged[1] = 0

    for jobs in groups:
        if len(jobs) > 1:
            flush()
            layout = _packed_layout(jobs, world)
            kind, _, row = layout
            steps.append(("packed", layout, world * row if kind == "a2a" else row, world * row))
            continue
        job = jobs[0]
        _, i, j, src_t, dst_t, _ = job
        send_n = 0 if _sends_itself(src_t, j, device) else _aligned(src_t.numel() * src_t.element_size())
        recv_n = 0 if _receives_itself(dst_t, src_t.dtype, i, device) else _aligned(dst_t.numel() * src_t.element_size())
        if wave and (staged[0] + send_n > limit or staged[1] + recv_n > limit):
            flush()
        wave.append((job, staged[0] if send_n else -1, staged[1] if recv_n else -1))
        staged[0] += send_n
        staged[1] += recv_n
    flush()
    return steps


def _collectives(steps: list[tuple], group: Any, device: torch.device, buffers: dict,
                 failure: OwnFailure) -> None:
    """Run ``_dense_steps``' steps, through the send and receive buffers
    of ``buffers`` (``_scratch``'s, allocated before).  The wire carries
    the source's bytes in rank-major blocks: block q of an all_to_all's
    input is the source shard's part of rank q's destination shard; block
    q of its output is rank q's part of this rank's.  A tensor alone in
    its collective is written straight into the template's shard where
    that is laid out so (split along dimension 0, contiguous, the source's
    dtype); otherwise one strided copy (and cast) puts the blocks in place.
    Packed tensors each take a slice of every rank's block: one copy in,
    one copy out per tensor.

    The single-tensor collectives of a wave (``_wave``) are each issued as
    soon as their blocks are packed, none waited for until the last is
    issued.  A collective costs a few milliseconds of scheduling on a busy
    host whatever its size (13 all_to_alls of 2 MB took twice one of
    26 MB); issued back to back, the process group's threads run them
    without waiting for this thread between them.

    A copy of this rank's own that fails (``failure``: a cast the caller's
    warning filters turn into an error, say) is skipped, the collectives
    go on -- the other ranks wait in them -- and the transfer's last
    agreement raises it on every rank."""
    world = dist.get_world_size(group)
    for kind, planned, send_bytes, recv_bytes in steps:
        if kind == "wave":
            _wave(planned, send_bytes, recv_bytes, world, group, device, buffers, failure)
        else:
            _packed_collective(planned, world, group, device, buffers, failure)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _wave(wave: list, send_bytes: int, recv_bytes: int, world: int, group: Any, device: torch.device,
          buffers: dict, failure: OwnFailure) -> None:
    """Run a wave of single-tensor collectives (see ``_collectives``),
    staging at most a bucket each way (``send_bytes``, ``recv_bytes``) in
    the send and the receive buffer.  If anything fails, every collective
    already issued is waited for before the error goes on: none may still
    write into the template while the undo log puts it back."""
    send_buf = _scratch(buffers, "send", send_bytes, device) if send_bytes else None
    recv_buf = _scratch(buffers, "recv", recv_bytes, device) if recv_bytes else None
    works: list = []
    unpack: list[tuple] = []  # (template shard, received blocks, dimension)
    try:
        for (kind, i, j, src_t, dst_t, _), send_at, recv_at in wave:
            if send_at < 0:
                send = src_t.detach()
            else:
                n = src_t.numel() * src_t.element_size()
                shape = _split_shape(src_t.shape, j, world) if j >= 0 else src_t.shape
                send = send_buf[send_at:send_at + n].view(src_t.dtype).view(shape)  # type: ignore[index]
                failure.attempt(_pack_blocks, send, src_t, j, world)
            if recv_at < 0:
                recv = dst_t.detach().view(world, -1)
            else:
                n = dst_t.numel() * src_t.element_size()
                recv = recv_buf[recv_at:recv_at + n].view(src_t.dtype).view(  # type: ignore[index]
                    _split_shape(dst_t.shape, i, world))
                unpack.append((dst_t, recv, i))
            works.append(_exchange(kind, bytes_view(recv), flat_bytes(send),
                                   group, async_op=True))
        while works:
            works[0].wait()
            works.pop(0)
    except BaseException:
        for work in works:
            try:
                work.wait()
            except BaseException:  # noqa: BLE001 - the first error is the one raised
                pass
        raise
    for dst_t, recv, i in unpack:
        failure.attempt(_unpack_blocks, dst_t, recv, i, world)


def _pack_blocks(send: torch.Tensor, src_t: torch.Tensor, j: int, world: int) -> None:
    """The source shard into a dense collective's input: split along
    ``j`` into the blocks of every rank, one after the other (``j`` -1:
    whole)."""
    send.copy_(src_t.detach().unflatten(j, (world, -1)).movedim(j, 0) if j >= 0 else src_t.detach())


def _unpack_blocks(dst_t: torch.Tensor, recv: torch.Tensor, i: int, world: int) -> None:
    """Every rank's block received, into the template's shard split along
    ``i`` (a cast where the dtypes differ)."""
    dst_t.detach().unflatten(i, (world, -1)).copy_(recv.movedim(0, i))


def _sends_itself(src_t: torch.Tensor, j: int, device: torch.device) -> bool:
    """Whether the source shard is its own send buffer: already split
    along ``j`` into blocks one after the other (``j`` -1: sent whole) and
    on the buffers' device."""
    return j <= 0 and own_bytes(src_t) and src_t.device == device


def _receives_itself(dst_t: torch.Tensor, dtype: torch.dtype, i: int, device: torch.device) -> bool:
    """Whether the template's shard can take the collective's output
    itself: split along dimension 0, contiguous, of the wire's ``dtype``,
    on the buffers' device."""
    return i == 0 and own_bytes(dst_t) and dst_t.dtype == dtype and dst_t.device == device


def _exchange(kind: str, out: torch.Tensor, inp: torch.Tensor, group: Any, async_op: bool = False) -> Any:
    """One dense collective of byte buffers: all_to_all (``kind`` "a2a")
    or all-gather; its work where ``async_op``."""
    if kind == "a2a":
        return dist.all_to_all_single(out, inp, group=group, async_op=async_op)
    return all_gather_flat(out, inp, group, async_op=async_op)


def _split_shape(shape: Any, dim: int, world: int) -> tuple:
    """``shape`` cut into ``world`` equal blocks along ``dim``, the blocks
    first: (world, ..., shape[dim] // world, ...)."""
    return (world, *shape[:dim], shape[dim] // world, *shape[dim + 1:])


def _packed_layout(jobs: list, world: int) -> tuple[str, list[tuple], int]:
    """(kind, [(job, its offset in a row, its bytes in a row)], the row's
    bytes) of a packed collective: each rank's block of the wire is a
    row of ``(world, row)`` bytes, tensor t taking columns ``[off_t,
    off_t + n_t)`` of every row (its part for / from that rank), at
    offsets aligned for any dtype."""
    kind = jobs[0][0]
    parts = []
    row = 0
    for job in jobs:
        n = job[5] // world if kind == "a2a" else job[5]
        parts.append((job, row, n))
        row += (n + _ALIGN - 1) // _ALIGN * _ALIGN
    return kind, parts, row


def _packed_collective(layout: tuple, world: int, group: Any, device: torch.device, buffers: dict,
                       failure: OwnFailure) -> None:
    """Several dense tensors of one kind in one collective, laid out by
    ``_packed_layout`` (planned with the steps), through the send and
    receive buffers."""
    kind, parts, row = layout
    if kind == "a2a":
        send = _scratch(buffers, "send", world * row, device)[:world * row].view(world, row)
    else:
        send = _scratch(buffers, "send", row, device)[:row].view(1, row)
    recv = _scratch(buffers, "recv", world * row, device)[:world * row].view(world, row)
    for (_, _, j, src_t, _, _), off, n in parts:
        failure.attempt(_pack_columns, send[:, off:off + n], src_t, j, world, kind)
    _exchange(kind, recv.reshape(-1), send.reshape(-1), group)
    for (_, i, _, src_t, dst_t, _), off, n in parts:
        failure.attempt(_unpack_columns, recv[:, off:off + n], src_t.dtype, dst_t, i, world)


def _pack_columns(columns: torch.Tensor, src_t: torch.Tensor, j: int, world: int, kind: str) -> None:
    """A tensor's columns of a packed collective's rows: per rank, its
    block of the source shard split along ``j`` (all_to_all), or the
    whole shard (all-gather)."""
    if kind == "a2a":
        columns.view(src_t.dtype).view(_split_shape(src_t.shape, j, world)).copy_(
            src_t.detach().unflatten(j, (world, -1)).movedim(j, 0))
    else:
        columns.view(src_t.dtype).view(1, *src_t.shape).copy_(src_t.detach())


def _unpack_columns(columns: torch.Tensor, dtype: torch.dtype, dst_t: torch.Tensor, i: int, world: int) -> None:
    """Rank q's part of the template's shard from row q of the columns,
    as the source shard it comes from is split along ``i``."""
    dst_t.detach().unflatten(i, (world, -1)).copy_(
        columns.view(dtype).view(_split_shape(dst_t.shape, i, world)).movedim(0, i))


def _whole(entries: list, device: torch.device, dtype: torch.dtype | None) -> torch.Tensor | None:
    """The bytes of a bucket's only box, where it is contiguous in its
    tensor (on the buckets' device; of ``dtype`` where given), or None."""
    if len(entries) != 1:
        return None
    tensor, start, lens, _, n = entries[0][1]
    if tensor.device != device or (dtype is not None and tensor.dtype != dtype) or n == 0:
        return None
    box = tensor[_box(start, lens)]
    if not own_bytes(box):
        return None
    return bytes_view(box.detach())


class _RanksMesh:
    """What ``await_arrival`` reads of a mesh (its rank tensor), for a
    process group over some of the ranks."""

    def __init__(self, ranks: tuple) -> None:
        self.mesh = torch.tensor(ranks)


_GROUP_RANKS: dict[Any, tuple] = {}


def _group_ranks(group: Any) -> tuple:
    """The sorted global ranks of ``group`` (None: the world), canonical
    (``_intern``), read once per group."""
    key = group if group is not None else ("world", dist.get_world_size())
    ranks = _GROUP_RANKS.get(key)
    if ranks is None or _INTERN_BY_ID.get(id(ranks), (None,))[0] is not ranks:
        got = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
        ranks = _GROUP_RANKS[key] = _intern(tuple(sorted(got)))
    return ranks


def _buffer_device(group: Any) -> torch.device:
    """Where the buckets live: NCCL moves CUDA tensors only; gloo (and
    the others) take CPU buffers, whatever device the shards are on."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _unmovable_wrapper(leaves: dict | None, side: str) -> str | None:
    """A tensor whose local values are a wrapper subclass that does not
    hold them in one inner tensor of its own shape and dtype (``_inner``;
    torch's ``TwoTensor`` holds two): a plain stand-in would lose some of
    them.  The first such leaf, as an error text."""
    for path, value in (leaves or {}).items():
        if isinstance(value, (DTensor, ShardedTensor, torch.Tensor)):
            local = _local(value)
            if opaque(local):
                cls = type(local)
                return (
                    f"the {side}'s '{_name(path)}' holds a {cls.__module__}.{cls.__qualname__}, a tensor "
                    "subclass that does not keep its values in one inner tensor of its own shape and dtype: "
                    "reshard_state_dict cannot reshard it"
                )
    return None


def _stand_ins(leaves: dict | None, paths: list[tuple], read: bool) -> dict[tuple, tuple[torch.Tensor, torch.Tensor]]:
    """For each of ``paths`` whose local tensor is a wrapper subclass
    (``_inner`` holds its values): (that tensor, a plain tensor of its
    shape and dtype), filled from it through its own ``copy_`` where
    ``read`` (the source), else to be copied into it once every rank
    received everything (the template: it is not written before)."""
    out: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
    if leaves is None:
        return out
    for path in paths:
        value = leaves.get(path)
        if not isinstance(value, (DTensor, ShardedTensor, torch.Tensor)):
            continue
        live = _local(value)
        if not is_wrapper(live):
            continue
        plain = torch.empty(live.shape, dtype=live.dtype, device=live.device)
        if read:
            with torch.no_grad():
                plain.copy_(live)
        out[path] = (live, plain)
    return out


def _storages(leaves: dict) -> dict[int, tuple]:
    out = {}
    for path, value in leaves.items():
        if isinstance(value, (DTensor, ShardedTensor, torch.Tensor)):
            t: torch.Tensor | None = _local(value)
            if t is not None and is_wrapper(t):
                t = values_tensor(t)  # its values' storage (the others were refused)
            if t is not None and t.numel():
                out[t.untyped_storage().data_ptr()] = path
    return out


def _shared_memory(src_leaves: dict, dst_leaves: dict | None) -> str | None:
    """The template is written while the source is read: they must not
    share memory."""
    if dst_leaves is None:
        return None
    src = _storages(src_leaves)
    for ptr, path in _storages(dst_leaves).items():
        if ptr in src:
            return f"the template's '{_name(path)}' shares memory with the source's '{_name(src[ptr])}'"
    return None


def _nbytes(lens: tuple, itemsize: int) -> int:
    n = itemsize
    for x in lens:
        n *= x
    return n


def _window(buf: torch.Tensor, off: int, n: int, dtype: torch.dtype, lens: tuple) -> torch.Tensor:
    return buf[off:off + n].view(dtype).view(lens)


def _rebuild(tree: Any, prefix: tuple, objects: dict) -> Any:
    """The template's structure: its own tensors (now filled), the
    source's non-tensor values (copied, never shared with the source)."""
    if isinstance(tree, Mapping):
        return {k: _rebuild(v, prefix + (k,), objects) for k, v in tree.items()}
    if prefix in objects:
        return copy.deepcopy(objects[prefix])
    return tree
