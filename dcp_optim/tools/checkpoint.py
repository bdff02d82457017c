"""What a DCP checkpoint holds, from its metadata: model entries per FQN,
optimizer state per (FQN, state name) and param groups, in either optimizer
layout, and everything else.  Used by ``dcp_optim.tools.cli`` and
``dcp_optim.convert``.

DCP flattens the saved state dict: nested dicts (and lists holding
containers or tensors) become dotted keys, and the metadata's
``planner_data`` keeps each key's *path* (the tuple of dict keys and list
indices).  Paths make the nested layout unambiguous even though FQNs
contain dots::

    ("optim", "state", "layers.0.weight", "exp_avg")          nested state
    ("optim", "param_groups", 0, "lr")                        nested group key
    ("optim", "state.layers.0.weight.exp_avg")                flat state
    ("optim", "param_groups.layers.0.weight.lr")              flat group key
    ("app", "model", "layers.0.weight")                       model (AppState)

Flat keys are split at the right-most dot whose left side is a known FQN
(csrc/flat.c's rule).  The known FQNs are those of the model section of
the same checkpoint (the section whose FQNs explain most of the
optimizer's keys), plus, for ``param_groups.<fqn>.<key>``, the part before
the last dot (torch's group keys have no dots) when no model FQN matches.

Tensor entries are described by the metadata alone.  Non-tensor entries
(param-group hyperparameters, ``params`` lists, schedulers, ``step``
counters) are pickled objects inside the data files.

Safe by default: ``Checkpoint(path)`` unpickles the ``.metadata`` file,
the non-tensor entries and the tensors' chunks with
``dcp_optim.tools._safe_unpickle`` (an allowlist of what DCP checkpoints hold;
nothing the file names outside it is ever called or imported).  A name
outside the allowlist in the metadata or in a tensor's chunk raises
:class:`UnsafeCheckpointError`; in a non-tensor entry it reads as a
:class:`NotLoaded` placeholder.  ``Checkpoint(path, trusted=True)`` reads
as before, through torch's own unpickling (``pickle.load`` of the
metadata, ``dcp.load``, whose ``torch.load(weights_only=False)`` runs
whatever a non-tensor entry names): a hostile checkpoint then runs code.
In both modes the metadata's structure and declared sizes are checked
before anything is allocated from them (:class:`MalformedCheckpointError`):
each tensor's chunks cover it exactly (no element twice, none left out,
so a tensor read holds only what the checkpoint wrote), saved paths are
consistent, their list indices in range.  Safe mode also bounds the work
of unpickling (``_safe_unpickle.MAX_WORK``), the size of the ``.metadata``
file (``MAX_METADATA_BYTES``) and refuses files that resolve (through
symlinks) outside the checkpoint directory.  Error messages are one line
of bounded length.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import pickle
import re
import stat
import sys
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import errors
from . import _safe_unpickle as _safe

__all__ = [
    "Checkpoint", "CheckpointError", "UnsafeCheckpointError", "MalformedCheckpointError",
    "NotLoaded", "Item", "Progress", "parse_flat_key", "group_runs",
]

NESTED, FLAT = "nested", "flat"


#: Longest error message (longer ones are cut, naming how much was left out).
MAX_MESSAGE = 2000
#: Most chunk-grid cells checked for exact cover per checkpoint (safe mode).
MAX_CHUNK_CELLS = 1 << 20
#: Largest list index a saved path may hold beyond the number of entries
#: saved under that list (DCP leaves out elements that hold nothing).
MAX_LIST_GAP = 64
#: Most optimizer sections (each is matched against every model section).
MAX_SECTIONS = 64


def _one_line(text: str) -> str:
    if len(text) > MAX_MESSAGE:
        text = text[: MAX_MESSAGE - 40] + f"... ({len(text) - MAX_MESSAGE + 40} more characters)"
    return text.replace("\r", "\\r").replace("\n", "\\n")


class CheckpointError(errors.DcpOptimError, ValueError):
    """A checkpoint cannot be read or does not have the expected structure;
    the message (one line, at most :data:`MAX_MESSAGE` characters) names
    the file and, where there is one, the key."""

    def __init__(self, *args: Any):
        if args and isinstance(args[0], str):
            args = (_one_line(args[0]), *args[1:])
        super().__init__(*args)


class UnsafeCheckpointError(CheckpointError, pickle.UnpicklingError):
    """The checkpoint's metadata, a tensor's data or (where its value is
    required) a non-tensor entry pickles a class or function outside the
    safe reader's allowlist: it was not unpickled; or a file it names
    resolves (through a symlink) outside the checkpoint directory: it was
    not read.  The message names it and the file (and key)."""


class MalformedCheckpointError(CheckpointError):
    """The metadata or an entry is not a well-formed pickle of what a DCP
    checkpoint holds (truncated, corrupted, not a pickle), or the metadata
    declares sizes its files do not back."""


class NotLoaded:
    """A non-tensor entry the safe reader did not unpickle: it names a
    class or function outside the allowlist.  Compares equal to another
    placeholder of the same pickled bytes."""

    __slots__ = ("cls", "key", "digest")

    def __init__(self, cls: str, key: str, digest: str):
        self.cls, self.key, self.digest = cls, key, digest

    def __repr__(self) -> str:
        return f"<object of class {self.cls}, not loaded>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NotLoaded) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)


# --- progress ------------------------------------------------------------------------


class Progress:
    """A progress line on stderr: redrawn in place on a terminal, at most
    one line a second otherwise; nothing when ``enabled`` is false."""

    def __init__(self, label: str, total_items: int, total_bytes: int, *, enabled: bool = True,
                 stream: Any = None):
        self.label, self.total_items, self.total_bytes = label, total_items, total_bytes
        self.items = self.bytes = 0
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._start = self._last = time.monotonic()

    def _text(self) -> str:
        mib = 1 << 20
        return (
            f"{self.label}: {self.items}/{self.total_items} items, "
            f"{self.bytes / mib:.1f}/{self.total_bytes / mib:.1f} MiB"
        )

    def update(self, items: int, nbytes: int) -> None:
        self.items += items
        self.bytes += nbytes
        if not self.enabled:
            return
        now = time.monotonic()
        if self.tty:
            self.stream.write("\r" + self._text())
            self.stream.flush()
        elif now - self._last >= 1.0:
            self.stream.write(self._text() + "\n")
            self.stream.flush()
            self._last = now

    def done(self) -> None:
        if not self.enabled:
            return
        text = self._text() + f" (done in {time.monotonic() - self._start:.1f}s)"
        self.stream.write(("\r" if self.tty else "") + text + "\n")
        self.stream.flush()


# --- items ---------------------------------------------------------------------------------


@dataclass
class Item:
    """One entry of the checkpoint's metadata."""

    key: str
    path: tuple
    meta: Any

    @property
    def is_tensor(self) -> bool:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        return isinstance(self.meta, TensorStorageMetadata)

    @property
    def shape(self) -> tuple[int, ...] | None:
        return tuple(self.meta.size) if self.is_tensor else None

    @property
    def dtype(self) -> str | None:
        return str(self.meta.properties.dtype).replace("torch.", "") if self.is_tensor else None

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return self.meta.properties.dtype if self.is_tensor else None

    def tensor_layout(self) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of a tensor entry (callers check is_tensor)."""
        if not self.is_tensor:
            raise TypeError(f"'{self.key}' is not a tensor entry")
        return tuple(self.meta.size), self.meta.properties.dtype

    @property
    def chunks(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        if not self.is_tensor:
            return []
        return [(tuple(c.offsets), tuple(c.sizes)) for c in self.meta.chunks]

    @property
    def nbytes(self) -> int:
        if not self.is_tensor:
            return 0
        n = 1
        for s in self.meta.size:
            n *= s
        return n * torch.empty((), dtype=self.meta.properties.dtype).element_size()

    def describe(self) -> str:
        if self.is_tensor:
            return f"{self.shape} {self.dtype}"
        return "object"


def parse_flat_key(key: str, known: set[str] | frozenset[str]) -> tuple[str, str, str] | None:
    """A key of the flattened optimizer format, parsed by the C core's
    parser (the one ``set_optimizer_state_dict`` uses; docs/architecture.md,
    "Flat keys"): ("state", fqn, path), ("param_groups", fqn, key) or
    ("empty_group", identity, key); None when it parses as neither.

    ``known``: the parameter FQNs.  A param_groups key whose FQN is not
    among them is parsed without FQNs (a reserved empty-group form, else
    split at its last dot); a state key needs its FQN."""
    from .._engine.core import C

    parsed = C.parse_flat_key(key, known)
    if parsed is None and key.startswith("param_groups."):
        parsed = C.parse_flat_key(key, None)
    return parsed


def _join(path: Iterable[Any]) -> str:
    return ".".join(str(p) for p in path)


# --- sections --------------------------------------------------------------------------------


@dataclass
class ModelSection:
    root: tuple
    entries: dict[str, Item] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return _join(self.root) or "<top level>"


@dataclass
class OptimizerSection:
    root: tuple
    layout: str
    # fqn -> state name (dotted for nested state values) -> item
    state: dict[str, dict[str, Item]] = field(default_factory=dict)
    # nested: group index -> key -> item (including "params")
    groups: dict[int, dict[str, Item]] = field(default_factory=dict)
    # flat: fqn -> group key -> item, and empty groups: identity -> key -> item
    group_keys: dict[str, dict[str, Item]] = field(default_factory=dict)
    empties: dict[str, dict[str, Item]] = field(default_factory=dict)
    unparsed: list[Item] = field(default_factory=list)
    model: ModelSection | None = None
    fqn_source: str = ""
    items: list[Item] = field(default_factory=list)
    source: str = ""  # the checkpoint directory (error messages)

    @property
    def name(self) -> str:
        return _join(self.root) or "<top level>"

    @property
    def prefix(self) -> str:
        return _join(self.root) + "." if self.root else ""

    def group_items(self) -> list[Item]:
        """Every non-tensor item of the param groups (what ``groups()``
        needs read)."""
        out = [it for g in self.groups.values() for it in g.values()]
        out += [it for g in self.group_keys.values() for it in g.values()]
        out += [it for g in self.empties.values() for it in g.values()]
        return out

    def logical_groups(self, values: dict[str, Any]) -> list[dict[str, Any]]:
        """The param groups as ``[{"params": [fqn, ...], <key>: value, ...}]``
        in order.  ``values`` holds the values of ``group_items()``.  For
        the flat layout the groups are reconstructed (``group_runs``)."""
        if self.layout == NESTED:
            out = []
            for idx in sorted(self.groups):
                entry = self.groups[idx]
                group = {k: values[it.key] for k, it in entry.items() if k != "params"}
                params = values[entry["params"].key] if "params" in entry else []
                if isinstance(params, NotLoaded):
                    raise UnsafeCheckpointError(
                        f"{self.source}: '{params.key}' pickles {params.cls}, which the safe reader "
                        "does not unpickle (trusted=True / --trust unpickles it, running any code it "
                        "names: only for checkpoints you trust)")
                if not isinstance(params, list | tuple):
                    raise MalformedCheckpointError(
                        f"{self.source}: '{entry['params'].key}' is a {type(params).__name__}, not a list "
                        "of parameters")
                group["params"] = [str(p) for p in params]
                out.append(group)
            return out
        per_fqn = {
            fqn: {k: values[it.key] for k, it in keys.items()} for fqn, keys in self.group_keys.items()
        }
        empties = {ident: {k: values[it.key] for k, it in keys.items()} for ident, keys in self.empties.items()}
        return group_runs(per_fqn, empties)


def _same(a: Any, b: Any) -> bool:
    """Equality of hyperparameter values (tensors never merge)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if type(a) is not type(b):
        return False
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float) and a != a:
        return b != b
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001
        return False


def _same_group(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)


def group_runs(
    per_fqn: dict[str, dict[str, Any]], empties: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """Param groups of a flattened optimizer dict.

    ``per_fqn``: FQN -> its group keys, in key order; ``empties``: identity
    ("<anchor>|after|<n>", "<anchor>|before|<n>" or
    "__optimizer_<o>_empty_group_<g>__") -> keys of an empty group.

    The flat layout does not record which parameters shared a group, so
    consecutive FQNs with equal keys and values form one group (loading
    gives each live group the saved values of its parameters, so merging
    equal neighbours changes nothing that is loaded).  An FQN that anchors
    an empty group starts a group.  Empty groups go where their anchors
    put them; those of optimizers without any parameter (no anchor) go
    first for optimizer 0 and last otherwise.
    """
    anchors: dict[str, list[tuple[str, int, str]]] = {}
    orphans: list[tuple[int, int, str]] = []
    for ident in empties:
        parts = ident.split("|")
        if len(parts) == 3 and parts[1] in ("after", "before") and parts[2].isdigit():
            anchors.setdefault(parts[0], []).append((parts[1], int(parts[2]), ident))
        else:
            m = re.match(r"^__optimizer_(\d+)_empty_group_(\d+)__$", ident)
            o, g = (int(m.group(1)), int(m.group(2))) if m else (1 << 30, len(orphans))
            orphans.append((o, g, ident))
    runs: list[tuple[list[str], dict[str, Any]]] = []
    for fqn, keys in per_fqn.items():
        if runs and fqn not in anchors and _same_group(runs[-1][1], keys):
            runs[-1][0].append(fqn)
        else:
            runs.append(([fqn], keys))
    out: list[dict[str, Any]] = []

    def emit_empty(ident: str) -> None:
        group = dict(empties[ident])
        group["params"] = []
        out.append(group)

    orphans.sort()
    for o, _, ident in orphans:
        if o == 0:
            emit_empty(ident)
    for params, keys in runs:
        first = params[0]
        marks = anchors.get(first, [])
        for _, _, ident in sorted((m for m in marks if m[0] == "before"), key=lambda m: -m[1]):
            emit_empty(ident)
        group = dict(keys)
        group["params"] = list(params)
        out.append(group)
        for _, _, ident in sorted((m for m in marks if m[0] == "after"), key=lambda m: m[1]):
            emit_empty(ident)
    for o, _, ident in orphans:
        if o != 0:
            emit_empty(ident)
    missing = [a for a in anchors if a not in per_fqn]
    for anchor in missing:  # anchored on an FQN without group keys: keep them, last
        for _, _, ident in sorted(anchors[anchor], key=lambda m: (m[0], m[1])):
            emit_empty(ident)
    return out


# --- the checkpoint ------------------------------------------------------------------------------


class Checkpoint:
    """A DCP checkpoint directory, parsed from its metadata.

    ``trusted=False`` (the default): the metadata, the non-tensor entries
    and the tensors' chunks are unpickled by the restricted unpickler
    (``dcp_optim.tools._safe_unpickle``), which never calls or imports anything
    the file names outside its allowlist; ``trusted=True``: by torch's own
    unrestricted unpickling, as ``dcp.load`` does (a hostile checkpoint
    runs code).

    Raises :class:`CheckpointError` (a ``ValueError``) for a missing or
    unreadable checkpoint, its subclasses :class:`UnsafeCheckpointError`
    (also a ``pickle.UnpicklingError``) for a name outside the allowlist
    and :class:`MalformedCheckpointError` for truncated, corrupted or
    not-a-pickle data and sizes its files do not back; messages name the
    file and, where there is one, the key."""

    def __init__(self, path: str | os.PathLike, *, trusted: bool = False):
        self.path = os.fspath(path)
        self.trusted = bool(trusted)
        meta_file = os.path.join(self.path, ".metadata")
        if not os.path.isdir(self.path):
            raise CheckpointError(f"{self.path}: no such checkpoint directory")
        if not os.path.exists(meta_file):
            raise CheckpointError(f"{self.path}: not a DCP checkpoint (no .metadata file)")
        self._file_sizes: dict[str, int] = {}
        self._root = os.path.realpath(self.path)
        if self.trusted:
            from torch.distributed.checkpoint import FileSystemReader

            try:
                self.metadata = FileSystemReader(self.path).read_metadata()
            except Exception as exc:  # noqa: BLE001
                raise CheckpointError(f"{meta_file}: cannot read the checkpoint metadata: {exc}") from exc
        else:
            self.metadata = self._read_metadata_safely(meta_file)
        self._storage = _check_metadata(self.metadata, meta_file, None if self.trusted else MAX_CHUNK_CELLS)
        planner = self.metadata.planner_data or {}
        self.items: list[Item] = []
        for key, meta in self.metadata.state_dict_metadata.items():
            saved = planner.get(key)
            item_path = tuple(saved) if isinstance(saved, tuple | list) and saved else (key,)
            self.items.append(Item(key, item_path, meta))
        _check_paths(self.items, meta_file)
        self.by_key = {it.key: it for it in self.items}
        self.models: list[ModelSection] = []
        self.optimizers: list[OptimizerSection] = []
        self.other: list[Item] = []
        self._values: dict[str, Any] = {}
        self._parse()

    def _read_metadata_safely(self, meta_file: str) -> Any:
        from torch.distributed.checkpoint.filesystem import _generate_uuid
        from torch.distributed.checkpoint.metadata import StorageMeta

        data = self._read_file(meta_file, 0, None, "the checkpoint metadata", limit=_safe.MAX_METADATA_BYTES)
        try:
            metadata = _safe.load_metadata(data)
        except _safe.Forbidden as exc:
            raise UnsafeCheckpointError(
                f"{meta_file}: the checkpoint metadata pickles {exc.args[0]}, which is not a class "
                "DCP metadata holds; not unpickled (trusted=True / --trust unpickles it, running "
                "any code it names: only for checkpoints you trust)"
            ) from None
        except _safe.Malformed as exc:
            raise MalformedCheckpointError(
                f"{meta_file}: cannot read the checkpoint metadata: {exc}") from None
        if not isinstance(getattr(metadata, "storage_meta", None), StorageMeta | None):
            raise MalformedCheckpointError(
                f"{meta_file}: malformed checkpoint metadata: storage_meta is a "
                f"{type(metadata.storage_meta).__name__}")
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = _generate_uuid()
        return metadata

    def _inside(self, name: str, what: str) -> None:
        """Safe mode: ``name`` resolves inside the checkpoint directory."""
        if self.trusted:
            return
        real = os.path.realpath(name)
        if not real.startswith(self._root.rstrip(os.sep) + os.sep):
            raise UnsafeCheckpointError(
                f"{name}: cannot read {what}: the file resolves to {real}, outside the checkpoint "
                f"directory {self._root} (a symlink); not read (trusted=True / --trust follows it)")

    def _read_file(self, name: str, offset: int, length: int | None, what: str,
                   limit: int | None = None) -> bytearray:
        """``length`` bytes at ``offset`` of a regular file (all of it for
        None, at most ``limit`` bytes), after checking that the file holds
        them and lies inside the checkpoint directory (safe mode)."""
        try:
            # O_NONBLOCK: a FIFO in place of a file must not block the open
            fd = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                os.close(fd)
                raise MalformedCheckpointError(f"{name}: cannot read {what}: not a regular file")
            try:
                self._inside(name, what)
            except CheckpointError:
                os.close(fd)
                raise
            with os.fdopen(fd, "rb") as f:
                if length is None:
                    length = st.st_size
                    if limit is not None and length > limit:
                        raise MalformedCheckpointError(
                            f"{name}: cannot read {what}: the file holds {length} bytes, more than the "
                            f"{limit} read from an untrusted checkpoint (MAX_METADATA_BYTES; "
                            "trusted=True / --trust reads it)")
                if offset + length > st.st_size:
                    raise MalformedCheckpointError(
                        f"{name}: cannot read {what}: it declares {length} bytes at offset "
                        f"{offset}, the file holds {st.st_size}")
                f.seek(offset)
                data = bytearray(length)
                got = f.readinto(data)
        except OSError as exc:
            raise CheckpointError(f"{name}: cannot read {what}: {exc}") from exc
        if got != length:
            raise MalformedCheckpointError(f"{name}: cannot read {what}: the file changed while read")
        return data

    def _file_size(self, relative: str, what: str = "it") -> int:
        if relative not in self._file_sizes:
            name = os.path.join(self.path, relative)
            try:
                st = os.stat(name)
            except OSError as exc:
                raise CheckpointError(f"{name}: {exc.strerror or exc}") from exc
            self._inside(name, what)
            self._file_sizes[relative] = st.st_size if stat.S_ISREG(st.st_mode) else -1
        return self._file_sizes[relative]

    # -- structure ----------------------------------------------------------------------------

    def _parse(self) -> None:
        roots: dict[tuple, str] = {}
        for it in self.items:
            p = it.path
            for j, el in enumerate(p):
                if el == "param_groups" and j + 1 < len(p) and isinstance(p[j + 1], int):
                    roots.setdefault(p[:j], NESTED)
                    break
                if j == len(p) - 1 and isinstance(el, str) and el.startswith("param_groups."):
                    roots.setdefault(p[:j], FLAT)
        # a root nested under another one is not a separate optimizer
        ordered = sorted(roots, key=len)
        optim_of: dict[str, OptimizerSection] = {}
        sections: dict[tuple, OptimizerSection] = {}
        for root in ordered:  # (a dict lookup per prefix: any number of sections)
            if any(root[:j] in sections for j in range(len(root) + 1)):
                continue
            sections[root] = OptimizerSection(root=root, layout=roots[root], source=self.path)
        if len(sections) > MAX_SECTIONS:  # each is matched against every model section
            raise MalformedCheckpointError(
                f"{os.path.join(self.path, '.metadata')}: malformed checkpoint metadata: "
                f"{len(sections)} optimizer sections (at most {MAX_SECTIONS})")
        for it in self.items:
            for j in range(len(it.path)):  # (sections do not nest: one root at most)
                sec = sections.get(it.path[:j])
                if sec is not None:
                    rel = it.path[j:]
                    if rel[0] in ("state", "param_groups") or (
                        isinstance(rel[0], str) and rel[0].startswith(("state.", "param_groups."))
                    ):
                        sec.items.append(it)
                        optim_of[it.key] = sec
                    break
        rest = [it for it in self.items if it.key not in optim_of]
        # model candidates: parents of string-keyed leaves
        candidates: dict[tuple, dict[str, Item]] = {}
        for it in rest:
            if isinstance(it.path[-1], str):
                candidates.setdefault(it.path[:-1], {})[it.path[-1]] = it
        models: dict[tuple, ModelSection] = {}

        def model_for(root: tuple) -> ModelSection:
            if root not in models:
                entries = {
                    fqn: it for fqn, it in candidates[root].items()
                    if it.is_tensor or fqn.endswith("_extra_state")
                }
                models[root] = ModelSection(root=root, entries=entries)
            return models[root]

        for sec in sections.values():
            self._parse_optimizer(sec, candidates, model_for)
        for root, entries in candidates.items():
            if root in models:
                continue
            named_model = bool(root) and "model" in str(root[-1]).lower()
            if (named_model or root == ()) and any(it.is_tensor for it in entries.values()):
                model_for(root)
        self.optimizers = list(sections.values())
        self.models = list(models.values())
        in_model = {it.key for m in self.models for it in m.entries.values()}
        self.other = [it for it in rest if it.key not in in_model]

    def _parse_optimizer(self, sec: OptimizerSection, candidates, model_for) -> None:
        n = len(sec.root)
        if sec.layout == NESTED:
            state_fqns = set()
            for it in sec.items:
                rel = it.path[n:]
                if rel[0] == "state" and len(rel) >= 3:
                    fqn = str(rel[1])
                    state_fqns.add(fqn)
                    sec.state.setdefault(fqn, {})[_join(rel[2:])] = it
                elif rel[0] == "param_groups" and len(rel) >= 3 and isinstance(rel[1], int):
                    sec.groups.setdefault(rel[1], {})[_join(rel[2:])] = it
                else:
                    sec.unparsed.append(it)
            best = max(
                candidates,
                key=lambda r: (len(state_fqns & set(candidates[r])), -len(r)),
                default=None,
            )
            if best is not None and state_fqns & set(candidates[best]):
                sec.model = model_for(best)
            sec.fqn_source = "saved paths"
            return
        # flat: choose the model section whose FQNs explain most keys
        from .._engine.core import C

        flat_keys: list[tuple[str, Item]] = []
        for it in sec.items:
            el = it.path[n] if len(it.path) == n + 1 else None
            if isinstance(el, str) and el.startswith(("state.", "param_groups.")):
                flat_keys.append((el, it))
            else:
                sec.unparsed.append(it)

        def names_fqn(parsed: tuple[str, str, str] | None) -> bool:
            # an FQN of `known`: a parameter's, or an empty group's anchor
            return parsed is not None and (parsed[0] != "empty_group" or "|" in parsed[1])

        def score(root: tuple) -> int:
            known = set(candidates[root])
            return sum(1 for el, _ in flat_keys if names_fqn(C.parse_flat_key(el, known)))

        # only sections holding an FQN that begins some key can score (the
        # first 64 dot-separated prefixes of each key; at most 64 sections,
        # those holding most of them): scoring every section against every
        # key would take time quadratic in the number of entries
        prefixes: set[str] = set()
        for el, _ in flat_keys:
            tail = el.split(".", 1)[1]
            pos = -1
            for _ in range(64):
                pos = tail.find(".", pos + 1)
                prefixes.add(tail if pos < 0 else tail[:pos])
                if pos < 0:
                    break
        hits = {r: sum(1 for f in fqns if f in prefixes) for r, fqns in candidates.items()}
        scored = sorted((r for r in candidates if hits[r]), key=lambda r: -hits[r])[:64]
        best = max(scored, key=lambda r: (score(r), -len(r)), default=None)
        model_fqns: set[str] = set()
        if best is not None and score(best) > 0:
            sec.model = model_for(best)
            model_fqns = set(candidates[best])
            sec.fqn_source = f"model section '{sec.model.name}'"
        else:
            sec.fqn_source = "param_groups keys"
        derived: set[str] = set()
        parsed_pg = []
        for el, it in flat_keys:
            if not el.startswith("param_groups."):
                continue
            parsed = parse_flat_key(el, model_fqns)
            if parsed is None:
                sec.unparsed.append(it)
            elif parsed[0] == "empty_group":
                sec.empties.setdefault(parsed[1], {})[parsed[2]] = it
            else:
                derived.add(parsed[1])
                parsed_pg.append((parsed[1], parsed[2], it))
        for fqn, key, it in parsed_pg:
            sec.group_keys.setdefault(fqn, {})[key] = it
        known = model_fqns | derived
        for el, it in flat_keys:
            if not el.startswith("state."):
                continue
            parsed = parse_flat_key(el, known)
            if parsed is None:
                sec.unparsed.append(it)
                continue
            sec.state.setdefault(parsed[1], {})[parsed[2]] = it

    def fqns_for(self, sec: OptimizerSection) -> set[str]:
        """Every FQN the optimizer section mentions (for to_nested)."""
        out = set(sec.state) | set(sec.group_keys)
        if sec.model is not None:
            out |= set(sec.model.entries)
        return out

    # -- values ----------------------------------------------------------------------------------

    def files_of(self, key: str) -> list[str]:
        files = {os.path.join(self.path, info.relative_path) for _, info in self._storage.get(key, ())}
        return sorted(files) or [self.path]

    def read(
        self,
        keys: Iterable[str],
        *,
        progress: str | None = None,
        batch_bytes: int = 256 << 20,
        show_progress: bool = True,
        placeholders: bool = True,
    ) -> dict[str, Any]:
        """Values of ``keys`` (tensors: full, plain, on CPU; objects:
        unpickled), read in batches of about ``batch_bytes``.  Cached.

        Safe mode: a non-tensor entry that pickles something outside the
        allowlist reads as a :class:`NotLoaded` placeholder, or, with
        ``placeholders=False``, raises :class:`UnsafeCheckpointError`."""
        requested = list(dict.fromkeys(keys))
        keys = [k for k in requested if k not in self._values]
        for key in keys:
            if key not in self.by_key:
                raise CheckpointError(f"{self.path}: no entry '{key}' in the checkpoint")
        for key in keys:  # nothing is allocated from a declared size before this
            self._check_backed(key)
        batches: list[list[str]] = []
        size = 0
        for key in keys:
            nbytes = self.by_key[key].nbytes
            if not batches or size + nbytes > batch_bytes:
                batches.append([])
                size = 0
            batches[-1].append(key)
            size += nbytes
        bar = None
        if progress and keys:
            bar = Progress(progress, len(keys), sum(self.by_key[k].nbytes for k in keys),
                           enabled=show_progress)
        for batch in batches:
            self._read_batch(batch)
            if bar is not None:
                bar.update(len(batch), sum(self.by_key[k].nbytes for k in batch))
        if bar is not None:
            bar.done()
        if not placeholders:
            for key in requested:
                if isinstance(self._values[key], NotLoaded):
                    raise self._unsafe_value(self._values[key])
        return dict(self._values)

    def _unsafe_value(self, value: NotLoaded) -> UnsafeCheckpointError:
        return UnsafeCheckpointError(
            f"{', '.join(self.files_of(value.key))}: '{value.key}' pickles {value.cls}, which the "
            "safe reader does not unpickle (trusted=True / --trust unpickles it, running any code "
            "it names: only for checkpoints you trust)")

    def _check_backed(self, key: str) -> None:
        """Every storage item of ``key`` lies inside its file, and a tensor's
        chunks hold at least its declared bytes, before anything is
        allocated for it."""
        infos = self._storage.get(key, [])
        files = ", ".join(self.files_of(key))
        it = self.by_key[key]
        if not infos:
            raise MalformedCheckpointError(f"{files}: cannot read '{key}': no storage item in the metadata")
        for _, info in infos:
            size = self._file_size(info.relative_path, f"'{key}'")
            if info.offset + info.length > size:
                where = os.path.join(self.path, info.relative_path)
                raise MalformedCheckpointError(
                    f"{where}: cannot read '{key}': it declares {info.length} bytes at offset "
                    f"{info.offset}, the file holds {max(size, 0)}"
                    + ("" if size >= 0 else " (not a regular file)"))
            if info.transform_descriptors and not self.trusted:
                raise MalformedCheckpointError(
                    f"{files}: cannot read '{key}': stream transforms {list(info.transform_descriptors)} "
                    "are not decoded by the safe reader (trusted=True / --trust)")
        if not it.is_tensor:
            if len(infos) != 1:
                raise MalformedCheckpointError(f"{files}: cannot read '{key}': {len(infos)} storage items")
            return
        # (the chunks cover the tensor exactly: checked with the metadata)
        _, dtype = it.tensor_layout()
        itemsize = dtype.itemsize
        by_offset = {tuple(index.offset or ()): info for index, info in infos}
        for chunk in it.meta.chunks:
            info = by_offset.get(tuple(chunk.offsets))
            n = math.prod(chunk.sizes)
            if info is None or info.length < n * itemsize:
                raise MalformedCheckpointError(
                    f"{files}: cannot read '{key}': chunk at {tuple(chunk.offsets)} declares "
                    f"{n * itemsize} bytes, its storage holds {info.length if info else 0}")

    def iter_values(self, keys: list[str], *, batch_bytes: int = 256 << 20):
        """Yield (key, value) for ``keys``, reading about ``batch_bytes`` at
        a time and keeping nothing cached afterwards."""
        batch: list[str] = []
        size = 0
        for i, key in enumerate(keys):
            batch.append(key)
            size += self.by_key[key].nbytes
            if size >= batch_bytes or i == len(keys) - 1:
                cached = {k for k in batch if k in self._values}
                self.read(batch, show_progress=False)
                for k in batch:
                    yield k, self._values[k]
                for k in batch:
                    if k not in cached:
                        self._values.pop(k, None)
                batch, size = [], 0

    def value(self, key: str) -> Any:
        if key not in self._values:
            self.read([key])
        return self._values[key]

    def _read_object_safely(self, key: str) -> Any:
        ((_, info),) = self._storage[key]
        name = os.path.join(self.path, info.relative_path)
        blob = self._read_file(name, info.offset, info.length, f"'{key}'")
        try:
            return _safe.load_object(blob)
        except _safe.Forbidden as exc:
            return NotLoaded(exc.args[0], key, exc.args[1])
        except _safe.Malformed as exc:
            raise MalformedCheckpointError(f"{name}: cannot read '{key}': {exc}") from None

    def _read_tensor_safely(self, key: str) -> torch.Tensor:
        """A tensor, from its chunks, each unpickled by the restricted
        unpickler (after _check_backed)."""
        it = self.by_key[key]
        shape, dtype = it.tensor_layout()
        value = torch.empty(shape, dtype=dtype)
        by_offset = {tuple(index.offset or ()): info for index, info in self._storage[key]}
        for chunk in it.meta.chunks:
            info = by_offset[tuple(chunk.offsets)]
            name = os.path.join(self.path, info.relative_path)
            blob = self._read_file(name, info.offset, info.length, f"'{key}'")
            try:
                part = _safe.load_object(blob)
            except _safe.Forbidden as exc:
                raise UnsafeCheckpointError(
                    f"{name}: '{key}': a chunk pickles {exc.args[0]}, which the safe reader does not "
                    "unpickle (trusted=True / --trust unpickles it, running any code it names: only "
                    "for checkpoints you trust)") from None
            except _safe.Malformed as exc:
                raise MalformedCheckpointError(f"{name}: cannot read '{key}': {exc}") from None
            if not isinstance(part, torch.Tensor) or tuple(part.shape) != tuple(chunk.sizes):
                what = f"{tuple(part.shape)}" if isinstance(part, torch.Tensor) else type(part).__name__
                raise MalformedCheckpointError(
                    f"{name}: cannot read '{key}': the chunk at {tuple(chunk.offsets)} holds {what}, "
                    f"not {tuple(chunk.sizes)}")
            region = value
            for dim, (start, length) in enumerate(zip(chunk.offsets, chunk.sizes)):
                region = region.narrow(dim, start, length)
            region.copy_(part)  # as DCP's read_data
            del blob, part
        return value

    def _read_batch(self, batch: list[str]) -> None:
        if not self.trusted:
            for key in batch:
                it = self.by_key[key]
                reader = self._read_tensor_safely if it.is_tensor else self._read_object_safely
                self._values[key] = reader(key)
            return
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.api import CheckpointException

        target: dict[str, Any] = {}
        for key in batch:
            it = self.by_key[key]
            if it.is_tensor:
                shape, dtype = it.tensor_layout()
                target[key] = torch.empty(shape, dtype=dtype)
            else:
                target[key] = None
        try:
            with quiet_dcp():
                dcp.load(target, storage_reader=FileSystemReader(self.path), no_dist=True)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 (a BaseException)
            if len(batch) > 1:
                for key in batch:  # find the entry that fails
                    self._read_batch([key])
            key = batch[0]
            raise CheckpointError(
                f"{', '.join(self.files_of(key))}: cannot read '{key}': {_short(exc)}"
            ) from exc
        self._values.update(target)


def _check_metadata(md: Any, meta_file: str, cells: int | None = MAX_CHUNK_CELLS) -> dict[str, list[tuple[Any, Any]]]:
    """Check the structure and the declared sizes of the metadata (before
    anything is allocated from them), and that each tensor's chunks cover
    it exactly (at most ``cells`` chunk-grid cells checked in all; None:
    no limit); returns key -> [(index, storage info)]."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    def bad(what: str) -> MalformedCheckpointError:
        return MalformedCheckpointError(f"{meta_file}: malformed checkpoint metadata: {what}")

    def dims(value: Any, what: str) -> tuple[int, ...]:
        if not isinstance(value, torch.Size | tuple | list) or not all(
            type(v) is int and 0 <= v < (1 << 63) for v in value
        ):
            raise bad(f"{what} is not a tensor size: {_brief(value)}")
        return tuple(value)

    if not isinstance(md, Metadata):
        raise bad(f"holds a {type(md).__name__}, not a Metadata")
    sdm = md.state_dict_metadata
    if not isinstance(sdm, dict):
        raise bad("state_dict_metadata is not a dict")
    if md.planner_data is not None and not isinstance(md.planner_data, dict):
        raise bad("planner_data is not a dict")
    for key, path in (md.planner_data or {}).items():
        # DCP's paths: tuples of dict keys (str) and list indices (int)
        if isinstance(path, tuple | list) and not all(type(p) in (str, int) for p in path):
            raise bad(f"the path of '{_brief(key)}' holds {_brief(path)}, not keys and indices")
    budget: list[int | None] = [cells]
    for key, meta in sdm.items():
        if type(key) is not str:
            raise bad(f"key {_brief(key)} is not a string")
        if isinstance(meta, BytesStorageMetadata):
            continue
        key = _brief(key, 200, quote=False)
        if not isinstance(meta, TensorStorageMetadata):
            raise bad(f"entry '{key}' is a {type(meta).__name__}")
        if not isinstance(meta.properties, TensorProperties) or not isinstance(
            meta.properties.dtype, torch.dtype
        ):
            raise bad(f"entry '{key}' has no tensor dtype")
        shape = dims(meta.size, f"entry '{key}': its size")
        if math.prod(shape) * meta.properties.dtype.itemsize >= (1 << 63):
            raise bad(f"entry '{key}' declares {_brief(shape)} elements of {meta.properties.dtype}, "
                      "more bytes than a tensor can hold")
        if not isinstance(meta.chunks, list):
            raise bad(f"entry '{key}': chunks is not a list")
        for chunk in meta.chunks:
            if not isinstance(chunk, ChunkStorageMetadata):
                raise bad(f"entry '{key}': a chunk is a {type(chunk).__name__}")
            offsets = dims(chunk.offsets, f"entry '{key}': chunk offsets")
            sizes = dims(chunk.sizes, f"entry '{key}': chunk sizes")
            if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                o + n > d for o, n, d in zip(offsets, sizes, shape)
            ):
                raise bad(f"entry '{key}': chunk at {_brief(offsets)} of size {_brief(sizes)} "
                          f"lies outside {_brief(shape)}")
        problem = _cover_problem(shape, meta.chunks, budget)
        if problem:
            raise bad(f"entry '{key}': {problem}")
    storage: dict[str, list[tuple[Any, Any]]] = {}
    sd = md.storage_data if md.storage_data is not None else {}
    if not isinstance(sd, dict):
        raise bad("storage_data is not a dict")
    for index, info in sd.items():
        if not isinstance(index, MetadataIndex) or type(index.fqn) is not str:
            raise bad(f"storage_data key {_brief(index)} is not a MetadataIndex")
        where = f"storage of '{_brief(index.fqn, 200, quote=False)}'"
        if index.offset is not None:
            dims(index.offset, f"{where}: offset")
        rel = getattr(info, "relative_path", None)
        if type(rel) is not str or not rel or "\0" in rel or os.path.isabs(rel) \
                or ".." in rel.replace("\\", "/").split("/"):
            raise bad(f"{where}: file {_brief(rel)} is not a file name inside the checkpoint")
        for name in ("offset", "length"):
            value = getattr(info, name, None)
            if type(value) is not int or not 0 <= value < (1 << 63):
                raise bad(f"{where}: {name} {_brief(value)} is not a byte count")
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors is not None and (
            not isinstance(descriptors, list | tuple) or not all(type(d) is str for d in descriptors)
        ):
            raise bad(f"{where}: transform descriptors are not strings")
        storage.setdefault(index.fqn, []).append((index, info))
    return storage


def _brief(value: Any, limit: int = 60, *, quote: bool = True) -> str:
    """``repr(value)`` cut to ``limit`` characters, computed in time and
    memory bounded by ``limit`` whatever ``value`` holds (shared or deep
    containers, long strings, huge integers, any object)."""
    parts: list[str] = []
    room = [limit + 1]

    def emit(text: str) -> bool:
        parts.append(text[: room[0]])
        room[0] -= len(text)
        return room[0] > 0

    def walk(v: Any, depth: int) -> bool:
        t = type(v)
        if t is str or t is bytes or t is bytearray:
            part = v[: room[0] + 1]
            return emit(part if t is str and not quote else repr(part))
        if t is int:
            return emit(repr(v) if v.bit_length() <= 256 else f"<int of {v.bit_length()} bits>")
        if t in (float, bool, complex) or v is None or isinstance(v, torch.dtype):
            return emit(repr(v))
        if isinstance(v, list | tuple | set | frozenset | dict):
            if depth > 8:
                return emit("...")
            if t is torch.Size:
                opening, closing = "torch.Size([", "])"
            elif isinstance(v, list):
                opening, closing = "[", "]"
            elif isinstance(v, tuple):
                opening, closing = "(", ",)" if len(v) == 1 else ")"
            elif isinstance(v, dict):
                opening, closing = "{", "}"
            else:
                opening, closing = ("{", "}") if v else (f"{t.__name__}(", ")")
            if not emit(opening):
                return False
            for i, item in enumerate(v.items() if isinstance(v, dict) else v):
                if i and not emit(", "):
                    return False
                if isinstance(v, dict):
                    if not (walk(item[0], depth + 1) and emit(": ") and walk(item[1], depth + 1)):
                        return False
                elif not walk(item, depth + 1):
                    return False
            return emit(closing)
        return emit(f"<{t.__name__}>")

    walk(value, 0)
    text = "".join(parts)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _cover_problem(shape: tuple[int, ...], chunks: list[Any], budget: list[int | None]) -> str | None:
    """What is wrong with how ``chunks`` cover a tensor of ``shape`` (None:
    every element in exactly one chunk).  Chunk boundaries cut the tensor
    into a grid of cells (for the usual layouts, one cell per chunk);
    each cell must lie in exactly one chunk.  ``budget[0]``: cells left to
    check (None: no limit)."""
    numel = math.prod(shape)
    boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in chunks]
    boxes = [b for b in boxes if all(b[1])]  # chunks of no element hold nothing
    if numel == 0:
        return None
    seen: set[tuple] = set()
    for box in boxes:
        if box in seen:
            return f"chunk at {_brief(box[0])} of size {_brief(box[1])} is listed twice"
        seen.add(box)
    ndim = len(shape)
    bounds = [sorted({0, shape[d]} | {o[d] for o, _ in boxes} | {o[d] + n[d] for o, n in boxes})
              for d in range(ndim)]
    counts = [len(b) - 1 for b in bounds]
    ncells = math.prod(counts)
    if budget[0] is None:  # trusted: the usual layouts, and then some
        if ncells > MAX_CHUNK_CELLS + 4 * len(boxes):
            return f"its {len(boxes)} chunks cut it into {ncells} cells, too many to check"
    else:
        if ncells > budget[0]:
            return (f"its {len(boxes)} chunks cut it into {ncells} cells, more than the "
                    f"{budget[0]} left to check (MAX_CHUNK_CELLS; trusted=True / --trust checks all)")
        budget[0] -= ncells
    index = [{v: i for i, v in enumerate(b)} for b in bounds]
    strides = [math.prod(counts[d + 1:]) for d in range(ndim)]
    owner = [-1] * ncells
    for k, (offsets, sizes) in enumerate(boxes):
        ranges = [range(index[d][offsets[d]], index[d][offsets[d] + sizes[d]]) for d in range(ndim)]
        for cell in itertools.product(*ranges):
            at = sum(c * st for c, st in zip(cell, strides))
            if owner[at] >= 0:
                other = boxes[owner[at]]
                return (f"chunk at {_brief(offsets)} of size {_brief(sizes)} overlaps the chunk at "
                        f"{_brief(other[0])} of size {_brief(other[1])}")
            owner[at] = k
    for at, k in enumerate(owner):
        if k < 0:
            where = [(at // strides[d]) % counts[d] for d in range(ndim)]
            region = ", ".join(f"{bounds[d][c]}:{bounds[d][c + 1]}" for d, c in enumerate(where))
            covered = sum(math.prod(n) for _, n in boxes)
            return (f"elements [{region}] are in no chunk (its chunks cover {covered} of {numel} "
                    "elements; a read would return memory the checkpoint never wrote)")
    return None


def _check_paths(items: list[Item], meta_file: str) -> None:
    """The saved paths (planner_data) build one nested state dict: each
    path starts with a key, holds keys (str) and list indices (int >= 0),
    no path is another's prefix or twin, a container holds either keys or
    indices, and a list's indices stay below the number of entries saved
    under it plus MAX_LIST_GAP (``convert`` rebuilds the lists)."""

    def bad(key: str, what: str) -> MalformedCheckpointError:
        return MalformedCheckpointError(
            f"{meta_file}: malformed checkpoint metadata: the path of '{_brief(key, 200, quote=False)}' "
            f"{what}")

    root: dict[Any, Any] = {}
    leaf: dict[int, str] = {}  # id(node) -> the key saved there
    first: dict[int, str] = {}  # id(node) -> the key of the first path through it
    keep: list[dict] = []
    lists: list[tuple[dict, str]] = []
    for it in items:
        path = it.path
        if len(path) > _safe.MAX_DEPTH:
            raise bad(it.key, f"is {len(path)} levels deep (at most {_safe.MAX_DEPTH})")
        if type(path[0]) is not str:
            raise bad(it.key, f"starts with {_brief(path[0])}, not a key")
        node = root
        for j, el in enumerate(path):
            if type(el) is int and el < 0:
                raise bad(it.key, f"holds the list index {el}")
            if id(node) in leaf:
                raise bad(it.key, f"runs through the entry '{_brief(leaf[id(node)], 200, quote=False)}'")
            if node and type(next(iter(node))) is not type(el):
                other = _brief(first[id(node)], 200, quote=False)
                raise bad(it.key, f"uses {_brief(el)} where the path of '{other}' uses a "
                          f"{'list index' if type(el) is str else 'key'}")
            if not node:
                first[id(node)] = it.key
                if type(el) is int:
                    lists.append((node, it.key))
            child = node.get(el)
            if child is None:
                child = node[el] = {}
                keep.append(child)
            elif j == len(path) - 1:
                raise bad(it.key, "is also the path of another entry, or of entries below it")
            node = child
        leaf[id(node)] = it.key
    for node, key in lists:
        if max(node) >= len(node) + MAX_LIST_GAP:
            raise bad(key, f"holds the list index {max(node)}, for {len(node)} saved entries of that "
                      f"list (at most {MAX_LIST_GAP} left out)")


@contextlib.contextmanager
def quiet_dcp():
    """DCP warns that it runs in one process even when asked to (no_dist)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"
