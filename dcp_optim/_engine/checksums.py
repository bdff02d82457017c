"""Sharding-independent checksums of model and optimizer state (the
machinery of ``dcp_optim.verify`` and of ``StateDictOptions.verify_checksums``).

The state dicts come from the getters the caller passes (``getters``:
``get_model_state_dict``, ``get_optimizer_state_dict``, ``get_state_dict``),
so that this module never imports ``dcp_optim.state_dict``.

The checksum of a logical tensor (a model FQN, or an optimizer state
``(FQN, state name)``) is a function of its *full* value and nothing else --
not of the sharding, world size, mesh, placements or device.  In 64-bit
wrapping integer arithmetic, for the element with row-major index ``i``
in the full tensor and raw bits ``x`` (its bytes read as a signed integer
of the same width, sign-extended; complex128 as ``re_bits * K2 + im_bits``)::

    h = ((i * K1) XOR x) * K2
    h = (h XOR (h >>> 32)) * K3                       (>>> logical shift)
    checksum = (sum of h mod 2**32,  sum of (h >>> 32) mod 2**32)

(K1, K2, K3 are splitmix64's odd constants.)  ``h`` is a bijection of
``x`` for a fixed ``i``, so changing any single element always changes
the checksum; several changes cancel with probability about 2**-64.
Sums are order-independent, so every rank hashes only the elements it
holds, at their *global* positions (from the DTensor's placements through
the C planner's ``shard_layouts``, which also covers uneven and strided
shards), and one integer ``all_reduce`` adds the partial sums.  Replicas
(``Replicate`` mesh dimensions) contribute once: only coordinate 0 of a
replicated mesh dimension adds its elements.  Everything is integer
arithmetic, so the result is exact and identical on CPU and GPU; values
are compared bit for bit (``-0.0`` differs from ``0.0``; a NaN equals the
same NaN).  Cost: about 15 ns per element on one CPU core (chunks of 64K
elements, a few temporaries of that size).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import errors
from ..options import StateDictOptions, _as_options
from .consistency import reduce_sum
from .core import C
from .tensor_bytes import flat_bytes

__all__ = [
    "FORMAT",
    "ChecksumMismatchError",
    "Getters",
    "checksums",
    "verify",
    "tensor_checksum",
]

#: The value of the "format" entry of a checksums dict.
FORMAT = "dcp_optim.verify/1"

_M32 = (1 << 32) - 1
_CHUNK = 1 << 16  # elements hashed per step (fits in cache; bounds temporaries)


def _s64(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_K1 = _s64(0x9E3779B97F4A7C15)
_K2 = _s64(0xBF58476D1CE4E5B9)
_K3 = _s64(0x94D049BB133111EB)
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ChecksumMismatchError(errors.StateDictValueError):
    """Loaded state differs from the checksums taken at save time.

    ``mismatches`` lists ``(section, fqn, state_name, reason)`` tuples
    (``section`` is "model" or "optim"; ``state_name`` is "" for the model).
    """

    def __init__(self, message: str, mismatches: list[tuple[str, str, str, str]]):
        super().__init__(message)
        self.mismatches = mismatches


# --- hashing -----------------------------------------------------------------------


def _bits(flat: torch.Tensor) -> torch.Tensor:
    """Raw bits of a 1-D contiguous tensor as an integer tensor, one value
    per element (sign-extended when combined with int64)."""
    size = flat.element_size()
    if size == 16:
        pairs = flat.view(torch.int64).view(-1, 2)
        return pairs[:, 0] * _K2 + pairs[:, 1]
    view = _INT_OF_SIZE.get(size)
    if view is None:
        raise errors.StateDictTypeError(f"cannot checksum tensors of dtype {flat.dtype}")
    return flat.view(view)


def _accumulate(h: torch.Tensor, bits: torch.Tensor, lanes: list[int]) -> None:
    """``h`` holds the global indices of ``bits``' elements; adds their
    hashes to ``lanes`` = [lo, hi] (in place; ``h`` is consumed)."""
    h.mul_(_K1)
    h.bitwise_xor_(bits)
    h.mul_(_K2)
    t = h >> 32
    t.bitwise_and_(_M32)
    h.bitwise_xor_(t)
    h.mul_(_K3)
    # sum(h) mod 2**32 is the sum of the low halves; the arithmetic shift
    # gives the high halves up to a multiple of 2**32
    lanes[0] = (lanes[0] + int(h.sum().item())) & _M32
    h >>= 32
    lanes[1] = (lanes[1] + int(h.sum().item())) & _M32


def _local_lanes(
    local: torch.Tensor,
    index_maps: list[torch.Tensor] | None,
    gstrides: list[int],
    base: int = 0,
) -> tuple[int, int]:
    """Lane sums of ``local``'s elements.  Element at local position
    (l_0, ..., l_n) sits at global index ``sum_d index_maps[d][l_d] *
    gstrides[d]``; with ``index_maps`` None at ``base`` + its local
    row-major position (a full tensor, or a shard that is one contiguous
    range of the full tensor)."""
    # its values in logical order (a conjugate view's too), flat
    flat = flat_bytes(local.detach()).view(local.dtype)
    n = flat.numel()
    lanes = [0, 0]
    if n == 0:
        return 0, 0
    device = flat.device
    lshape = list(local.shape)
    lstrides = [1] * len(lshape)
    for d in range(len(lshape) - 2, -1, -1):
        lstrides[d] = lstrides[d + 1] * lshape[d + 1]
    for start in range(0, n, _CHUNK):
        stop = min(n, start + _CHUNK)
        if index_maps is None:
            h = torch.arange(base + start, base + stop, dtype=torch.int64, device=device)
        else:
            pos = torch.arange(start, stop, dtype=torch.int64, device=device)
            h = torch.zeros_like(pos)
            for d, size in enumerate(lshape):
                ld = torch.div(pos, lstrides[d], rounding_mode="floor") % size
                h += index_maps[d][ld] * gstrides[d]
        _accumulate(h, _bits(flat[start:stop]), lanes)
    return lanes[0], lanes[1]


def tensor_checksum(tensor: torch.Tensor) -> tuple[int, int]:
    """The checksum of a plain (full, local) tensor: two 32-bit lanes."""
    return _local_lanes(tensor, None, [])


def _value_checksum(value: Any) -> tuple[int, int]:
    """Python int/float/bool state values: hashed as a 0-d tensor of the
    type torch would give them (int64 / float64 / bool)."""
    return tensor_checksum(torch.tensor(value))


# --- DTensor geometry --------------------------------------------------------------


def _encode_placements(placements, ndim: int, fqn: str) -> list[tuple[int, int, int]]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out = []
    for p in placements:
        if isinstance(p, _StridedShard):
            out.append((2, p.dim % ndim, int(p.split_factor)))
        elif isinstance(p, Shard):
            out.append((1, p.dim % ndim, 1))
        elif isinstance(p, Replicate):
            out.append((0, 0, 1))
        else:
            raise errors.StateDictValueError(
                f"cannot checksum '{fqn}': placement {p} (a pending reduction) has no "
                "well-defined value; redistribute it first"
            )
    return out


def _dtensor_part(dt: Any, fqn: str) -> tuple[int, int, bool]:
    """(lo, hi, contributes) of this rank's shard of DTensor ``dt``."""
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return 0, 0, False
    encoded = _encode_placements(dt.placements, max(dt.dim(), 1), fqn)
    local = dt.to_local()
    try:
        lo, hi = shard_lanes(local, tuple(dt.shape), tuple(mesh.shape), encoded, tuple(coord))
    except ValueError as exc:
        raise errors.StateDictRuntimeError(f"'{fqn}': {exc} (placements {dt.placements})") from exc
    return lo, hi, True


def shard_lanes(
    local: torch.Tensor,
    global_shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    placements: list[tuple[int, int, int]],
    coord: tuple[int, ...],
) -> tuple[int, int]:
    """Partial checksum lanes of the shard ``local`` held at mesh
    coordinate ``coord``; ``placements`` encoded as the C planner's
    ``shard_layouts`` takes them ((kind, dim, split_factor), kind 0
    Replicate, 1 Shard, 2 _StridedShard).  Summing the lanes of every
    coordinate (mod 2**32) gives the full tensor's checksum: replicated
    mesh dimensions contribute at coordinate 0 only."""
    if any(kind == 0 and c != 0 for (kind, _, _), c in zip(placements, coord)):
        return 0, 0
    gshape = list(global_shape)
    if not gshape:
        return tensor_checksum(local)
    (lshape, blocks), = C.shard_layouts(gshape, list(mesh_shape), placements, [list(coord)])
    if tuple(lshape) != tuple(local.shape):
        raise ValueError(
            f"local shard shape {tuple(local.shape)} differs from the shape "
            f"{tuple(lshape)} the placements imply"
        )
    ndim = len(gshape)
    gstrides = [1] * ndim
    for d in range(ndim - 2, -1, -1):
        gstrides[d] = gstrides[d + 1] * gshape[d + 1]
    if len(blocks) == 1:
        _, gstart, lens = blocks[0]
        # one box that is a contiguous range of the full tensor: dims
        # before some k have length 1, dims after k are complete
        k = next((d for d in range(ndim) if lens[d] != 1), ndim)
        if all(lens[d] == gshape[d] for d in range(k + 1, ndim)):
            base = sum(g * st for g, st in zip(gstart, gstrides))
            return _local_lanes(local, None, [], base)
    maps = []
    for d in range(ndim):
        segments = sorted({(b[0][d], b[1][d], b[2][d]) for b in blocks})
        if segments:
            maps.append(
                torch.cat(
                    [torch.arange(g, g + n, dtype=torch.int64) for _, g, n in segments]
                ).to(local.device)
            )
        else:
            maps.append(torch.zeros(0, dtype=torch.int64, device=local.device))
    return _local_lanes(local, maps, gstrides)


# --- collecting entries --------------------------------------------------------------


class _Entry:
    __slots__ = ("section", "fqn", "name", "shape", "dtype", "lo", "hi", "mesh")

    def __init__(self, section, fqn, name, shape, dtype, lo, hi, mesh):
        self.section, self.fqn, self.name = section, fqn, name
        self.shape, self.dtype, self.lo, self.hi, self.mesh = shape, dtype, lo, hi, mesh

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.section, self.fqn, self.name)

    def as_tuple(self) -> tuple:
        return (self.section, self.fqn, self.name, self.shape, self.dtype, self.lo, self.hi)


def _label(section: str, fqn: str, name: str) -> str:
    if section == "model":
        return f"model '{fqn}'"
    return f"optimizer state '{name}' of '{fqn}'"


def _entry(section: str, fqn: str, name: str, value: Any) -> _Entry | None:
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        lo, hi, _ = _dtensor_part(value, fqn)
        return _Entry(section, fqn, name, tuple(value.shape), str(value.dtype).replace("torch.", ""),
                      lo, hi, value.device_mesh)
    if isinstance(value, ShardedTensor):
        raise errors.StateDictTypeError(
            f"{_label(section, fqn, name)} is a ShardedTensor (FSDP1 sharded state "
            "dict); dcp_optim.verify supports plain tensors and DTensors"
        )
    if isinstance(value, torch.Tensor):
        if value.is_meta:
            raise errors.StateDictValueError(f"{_label(section, fqn, name)} is on the meta device")
        lo, hi = tensor_checksum(value)
        return _Entry(section, fqn, name, tuple(value.shape), str(value.dtype).replace("torch.", ""),
                      lo, hi, None)
    if isinstance(value, bool | int | float):
        lo, hi = _value_checksum(value)
        return _Entry(section, fqn, name, (), type(value).__name__, lo, hi, None)
    return None


def _state_leaves(fqn: str, value: Any, prefix: str = ""):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _state_leaves(fqn, v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], value


#: (get_model_state_dict, get_optimizer_state_dict, get_state_dict)
Getters = tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]


def _collect(
    model: nn.Module,
    optimizers: Any,
    options: Any,
    getters: Getters,
    sections: tuple[str, ...] = ("model", "optim"),
) -> list[_Entry]:
    get_model_state_dict, get_optimizer_state_dict, get_state_dict = getters
    opts = _as_options(options)
    opts = StateDictOptions(
        ignore_frozen_params=opts.ignore_frozen_params,
        keep_submodule_prefixes=opts.keep_submodule_prefixes,
        dsd_fqn_modifiers=opts.dsd_fqn_modifiers,
    )
    optims = _optimizer_tuple(optimizers) if "optim" in sections else ()
    # the nested layouts: {fqn: value} and {"state": {fqn: {...}}, "param_groups": [...]}
    msd: dict[str, Any]
    osd: dict[str, Any]
    if "model" not in sections:
        msd, osd = {}, (get_optimizer_state_dict(model, optims, options=opts) if optims else {})
    elif optims:
        msd, osd = get_state_dict(model, optims, options=opts)
    else:
        msd, osd = get_model_state_dict(model, options=opts), {}
    entries: list[_Entry] = []
    for fqn, value in msd.items():
        e = _entry("model", fqn, "", value)
        if e is not None:
            entries.append(e)
    for fqn, st in cast(dict[str, Any], osd.get("state") or {}).items():
        for name, value in _state_leaves(fqn, st):
            e = _entry("optim", fqn, name, value)
            if e is not None:
                entries.append(e)
    entries.sort(key=lambda e: e.key)
    return entries


def _optimizer_tuple(optimizers: Any) -> tuple:
    if optimizers is None:
        return ()
    if isinstance(optimizers, torch.optim.Optimizer):
        return (optimizers,)
    if isinstance(optimizers, Iterable):
        return tuple(optimizers)
    raise errors.StateDictTypeError(
        f"optimizers must be an Optimizer, an iterable of them or None, not {type(optimizers).__name__}"
    )


# --- reductions ------------------------------------------------------------------------


def _digest(items: list[tuple]) -> tuple[int, int]:
    d = hashlib.sha1(repr(items).encode()).digest()
    return int.from_bytes(d[:4], "little") >> 1, int.from_bytes(d[4:8], "little") >> 1


def _world_device() -> torch.device:
    backend = str(dist.get_backend())
    if "gloo" in backend or "cuda" not in backend and "nccl" not in backend:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _mesh_key(mesh) -> tuple:
    return (tuple(mesh.shape), tuple(mesh.mesh.flatten().tolist()), mesh.device_type)


def _disagree() -> errors.StateDictRuntimeError:
    return errors.StateDictRuntimeError(
        "ranks disagree on the sharded tensors of the model and optimizer (FQNs, "
        "state names, shapes or dtypes) while computing checksums; every rank of a "
        "device mesh must pass the same model and optimizer structure"
    )


def _reduce(entries: list[_Entry], extra: int) -> tuple[int, bool]:
    """Sum the DTensor entries' lanes over their meshes (in place).
    ``extra`` (a local count) is summed over the world.  Returns (world sum
    of extra, whether the world was covered by the reduction)."""
    if not (dist.is_available() and dist.is_initialized()):
        return extra, True
    world = dist.get_world_size()
    sharded = [e for e in entries if e.mesh is not None]
    if world == 1:
        return extra, True
    if all(e.mesh.size() == world for e in sharded):
        device = torch.device(sharded[0].mesh.device_type) if sharded else _world_device()
        d0, d1 = _digest([(e.key, e.shape, e.dtype) for e in sharded])
        values = [v for e in sharded for v in (e.lo, e.hi)] + [d0, d1, extra]
        buf = reduce_sum(torch.tensor(values, dtype=torch.int64, device=device), None, world)
        out = buf.tolist()
        if out[-3] != world * d0 or out[-2] != world * d1:
            raise _disagree()
        for i, e in enumerate(sharded):
            e.lo, e.hi = out[2 * i] & _M32, out[2 * i + 1] & _M32
        return out[-1], True
    # meshes on subsets of the ranks (pipeline stages): per mesh, summed
    # one mesh dimension at a time
    by_mesh: dict[tuple, list[_Entry]] = {}
    for e in sharded:
        by_mesh.setdefault(_mesh_key(e.mesh), []).append(e)
    for group_entries in by_mesh.values():
        mesh = group_entries[0].mesh
        d0, d1 = _digest([(e.key, e.shape, e.dtype) for e in group_entries])
        values = [v for e in group_entries for v in (e.lo, e.hi)] + [d0, d1]
        buf = torch.tensor(values, dtype=torch.int64, device=torch.device(mesh.device_type))
        for dim in range(mesh.ndim):
            if mesh.size(dim) > 1:
                buf = reduce_sum(buf, mesh.get_group(dim), mesh.size(dim))
        out = buf.tolist()
        if out[-2] != mesh.size() * d0 or out[-1] != mesh.size() * d1:
            raise _disagree()
        for i, e in enumerate(group_entries):
            e.lo, e.hi = out[2 * i] & _M32, out[2 * i + 1] & _M32
    return extra, False


# --- entry points (dcp_optim.verify, StateDictOptions.verify_checksums) -----------------


def checksums(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None,
    *,
    options: Any = None,
    getters: Getters,
) -> dict[str, Any]:
    """Checksums of every model and optimizer state tensor of ``model`` and
    ``optimizers`` (see the module docstring), as a small dict to store in
    the checkpoint next to the state::

        {"format": "dcp_optim.verify/1",
         "entries": [(section, fqn, state_name, shape, dtype, lo, hi), ...]}

    ``entries`` is one list (DCP stores it as a single object).  A
    collective when a process group is initialised: call it on every rank.
    """
    entries = _collect(model, optimizers, options, getters)
    _reduce(entries, 0)
    return {"format": FORMAT, "entries": [e.as_tuple() for e in entries]}


def _expected_map(expected: Any) -> dict[tuple[str, str, str], tuple]:
    if not isinstance(expected, dict) or expected.get("format") != FORMAT:
        got = expected.get("format") if isinstance(expected, dict) else type(expected).__name__
        raise errors.StateDictValueError(
            f"expected a checksums dict of format {FORMAT!r} (from "
            f"dcp_optim.verify.checksums), got {got!r}; was the 'checksums' entry "
            "loaded from the checkpoint (template())?"
        )
    out = {}
    for row in expected.get("entries") or ():
        section, fqn, name, shape, dtype, lo, hi = row
        out[(section, fqn, name)] = (tuple(shape), dtype, lo, hi)
    return out


def _compare(entries: list[_Entry], want: dict, sharded: bool) -> list[tuple[str, str, str, str]]:
    bad = []
    for e in entries:
        if (e.mesh is not None) != sharded:
            continue
        exp = want.get(e.key)
        if exp is None:
            bad.append((*e.key, "has no checksum in the expected dict"))
            continue
        shape, dtype, lo, hi = exp
        if shape != e.shape:
            bad.append((*e.key, f"shape {e.shape} != saved {shape}"))
        elif dtype != e.dtype:
            bad.append((*e.key, f"dtype {e.dtype} != saved {dtype}"))
        elif (lo, hi) != (e.lo, e.hi):
            bad.append((*e.key, f"values differ (checksum {e.hi:08x}{e.lo:08x}, saved {hi:08x}{lo:08x})"))
    return bad


def _missing(entries: list[_Entry], want: dict) -> list[tuple[str, str, str, str]]:
    """Expected state names of FQNs this rank holds that it lacks."""
    held = {(e.section, e.fqn) for e in entries}
    have = {e.key for e in entries}
    return [
        (*key, "is missing after the load")
        for key in want
        if (key[0], key[1]) in held and key not in have
    ]


def verify(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None,
    expected: dict[str, Any],
    *,
    options: Any = None,
    sections: tuple[str, ...] = ("model", "optim"),
    getters: Getters,
) -> int:
    """Recompute the checksums after a load and compare with ``expected``
    (from :func:`checksums` at save time).  Every rank raises the same
    :class:`ChecksumMismatchError` (a ``StateDictValueError``) naming the
    first differing FQN and state name, the number of differences and the
    ranks that found them.  Returns the number of entries checked.
    ``sections``: which entries to check ("model", "optim"); the ``set_*``
    functions pass what they loaded (``StateDictOptions.verify_checksums``).

    A collective when a process group is initialised: call it on every rank.
    """
    want = {k: v for k, v in _expected_map(expected).items() if k[0] in sections}
    entries = _collect(model, optimizers, options, getters, sections)
    local_bad = _compare(entries, want, sharded=False) + _missing(entries, want)
    total_local, covered = _reduce(entries, len(local_bad))
    bad_sharded = _compare(entries, want, sharded=True)
    failed = bool(total_local or bad_sharded)
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if distributed and not covered:
        flag = torch.tensor([int(failed)], dtype=torch.int64, device=_world_device())
        dist.all_reduce(flag)
        failed = bool(flag.item())
    if not failed:
        return len(entries)
    per_rank = [(0, local_bad + bad_sharded)]
    if distributed:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local_bad + bad_sharded)
        per_rank = list(enumerate(gathered))
    found: dict[tuple, list[int]] = {}
    reasons: dict[tuple, str] = {}
    for rank, rows in per_rank:
        for section, fqn, name, reason in rows:
            key = (section, fqn, name)
            found.setdefault(key, []).append(rank)
            reasons.setdefault(key, reason)
    ordered = sorted(found)
    first = ordered[0]
    ranks = found[first]
    message = (
        f"post-load verification failed: {_label(*first)} {reasons[first]}"
        + (f" on rank(s) {ranks}" if distributed else "")
    )
    if len(ordered) > 1:
        more = ", ".join(_label(*k) for k in ordered[1:6])
        message += f"; {len(ordered) - 1} more: {more}" + (" ..." if len(ordered) > 6 else "")
    raise ChecksumMismatchError(message, [(*k, reasons[k]) for k in ordered])
