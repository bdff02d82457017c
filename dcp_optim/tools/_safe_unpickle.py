"""A restricted unpickler for DCP checkpoints: the ``.metadata`` file and
the ``torch.save`` archives of the data files (non-tensor "bytes" entries
and tensors' chunks).

``pickle.load`` (what ``FileSystemReader.read_metadata`` uses) and
``torch.load(weights_only=False)`` (what DCP's default planner uses for
non-tensor entries) call whatever the pickle names, so opening a hostile
checkpoint runs its code; ``torch.load(weights_only=True)`` (DCP's tensor
reads) calls ``bytearray(n)`` with a declared ``n``.  This module unpickles with the pure-Python
unpickler of the standard library, every opcode handler that can call or
mutate something replaced:

* ``find_class`` answers only from a fixed allowlist (no import ever
  happens); any other name raises :class:`Forbidden` naming it;
* a call (``REDUCE``) goes only to an allowlisted constructor through a
  validator of its arguments (never anything that allocates from a
  number, such as ``bytearray(n)``); ``NEWOBJ`` only creates the DCP
  metadata dataclasses, with no arguments; ``BUILD`` only fills those
  instances, with their own field names (or ``TensorProperties``'s
  ``__setstate__``); items are only appended / set / added to real
  lists, dicts and sets;
* opcodes no checkpoint uses are refused: ``INST``, ``OBJ``,
  ``NEWOBJ_EX``, the ``EXT`` codes, text persistent ids, ``BYTEARRAY8``
  (it allocates its declared length before reading), out-of-band buffers;
* the memo is a dict and every read is from an in-memory buffer, so a
  declared length or memo index allocates nothing it does not hold;
* tuples nested deeper than :data:`MAX_DEPTH` are refused as they are
  built (hashing one, as a dict key, recurses in C without a limit);
* the work a pickle implies is counted against :data:`MAX_WORK` units, not
  only its bytes: one per opcode, plus the expanded size (every shared
  part counted once per reference) of what a memo reference pushes, of
  every dict key, set element and callable hashed and of every
  constructor's arguments.  Past the budget it stops with
  :class:`Malformed` ("more work than ...").  A tuple of two references
  to the level below, 60 levels deep, is 120 bytes but 2**60 nodes:
  hashing it would never end, its expanded size is known after 60 steps.

Anything else wrong with the stream raises :class:`Malformed`.  Of
``torch.save`` zip archives, only those with stored (uncompressed) records
lying inside the archive are read, and tensors are rebuilt from their
records, with bounds checked, on the CPU.  Unpickled values are checked for cycles, nesting deeper than
:data:`MAX_DEPTH` and integers too long to print.
"""

from __future__ import annotations

import _compat_pickle
import collections
import dataclasses
import hashlib
import io
import pathlib
import pickle
import struct
import zipfile
from collections.abc import Callable
from typing import Any, ClassVar, cast

import torch

__all__ = ["Forbidden", "Malformed", "load_metadata", "load_object", "check_value", "MAX_DEPTH",
           "MAX_WORK", "MAX_METADATA_BYTES"]

#: Deepest nesting of containers accepted in a non-tensor entry.
MAX_DEPTH = 100
#: Work budget of one unpickling, in units (about one opcode, or one node
#: of an expanded memo reference, dict key or call argument, each): about
#: what a ``.metadata`` file of 20 MB (some 250,000 chunks) needs, and
#: seconds of work for the pure-Python unpickler.  The same number bounds
#: the expanded size of the unpickled value (shared parts counted once per
#: reference).  A larger checkpoint you trust: ``trusted=True`` / ``--trust``.
MAX_WORK = 1 << 23
#: Largest ``.metadata`` file read (checked before reading it).
MAX_METADATA_BYTES = 64 << 20
_MAX_INT_BITS = 14000  # Python prints ints of up to 4300 digits (~14284 bits)


class Forbidden(Exception):
    """The pickle names something outside the allowlist (``args[0]``: the
    dotted name; from :func:`load_object`, ``args[1]``: a digest of the
    entry's content, the same for the same object)."""


class Malformed(Exception):
    """The stream is not a well-formed pickle of what a checkpoint holds."""


# --- allowlists ---------------------------------------------------------------------------


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if type(value) is not tuple and type(value) is not list:
        raise Malformed(f"{what} must be a sequence of ints, got {type(value).__name__}")
    for v in value:
        if type(v) is not int:
            raise Malformed(f"{what} must be a sequence of ints, got a {type(v).__name__}")
    return tuple(value)


def _size(*args: Any) -> torch.Size:
    if len(args) > 1:
        raise Malformed("torch.Size takes one argument")
    values = _ints(args[0], "torch.Size") if args else ()
    if values and (min(values) < -(1 << 63) or max(values) >= (1 << 63)):
        raise Malformed("torch.Size value out of the int64 range")
    return torch.Size(values)


def _device(*args: Any) -> torch.device:
    if not 1 <= len(args) <= 2 or type(args[0]) is not str or (len(args) == 2 and type(args[1]) is not int):
        raise Malformed("torch.device takes a string and an optional index")
    return torch.device(*args)


def _layout(name: Any) -> torch.layout:
    from torch.serialization import _get_layout

    if type(name) is not str:
        raise Malformed("a layout is named by a string")
    return _get_layout(name)


def _encode(text: Any, encoding: Any = "utf-8") -> bytes:
    # protocol 2 pickles bytes as _codecs.encode(str, "latin1")
    if type(text) is not str or encoding not in ("latin1", "latin-1"):
        raise Malformed("_codecs.encode is only accepted as bytes' latin1 encoding")
    return text.encode("latin1")


def _bytearray(*args: Any) -> bytearray:
    if not args:
        return bytearray()
    if len(args) == 2 and type(args[0]) is str and args[1] in ("latin1", "latin-1"):
        return bytearray(args[0], "latin1")
    if len(args) == 1 and type(args[0]) is bytes:
        return bytearray(args[0])
    raise Malformed("bytearray is only accepted from a string or bytes (never from a size)")


def _reconstructor(new: frozenset[type]) -> Callable[..., Any]:
    # protocols 0 and 1 pickle a dataclass as copyreg._reconstructor(cls, object, None)
    def make(*args: Any) -> Any:
        if len(args) != 3 or not isinstance(args[0], type) or args[0] not in new \
                or args[1] is not object or args[2] is not None:
            raise Malformed("copyreg._reconstructor is only accepted for DCP's metadata classes")
        return cast(Any, args[0]).__new__(args[0])

    return make


def _collection(kind: type) -> Callable[..., Any]:
    def make(*args: Any) -> Any:
        if len(args) > 1 or (args and not isinstance(args[0], list | tuple | set | frozenset)):
            raise Malformed(f"{kind.__name__} takes one list")
        return kind(*args)

    return make


def _ordered_dict(*args: Any) -> collections.OrderedDict:
    if len(args) > 1 or (args and not isinstance(args[0], list | tuple)):
        raise Malformed("OrderedDict takes one list of pairs")
    return collections.OrderedDict(*args)


def _complex(*args: Any) -> complex:
    if len(args) > 2 or not all(type(a) in (int, float) for a in args):
        raise Malformed("complex takes two numbers")
    return complex(*args)


def _path(cls: type) -> Callable[..., Any]:
    def make(*args: Any) -> Any:
        if not all(type(a) is str for a in args):
            raise Malformed(f"{cls.__name__} takes strings")
        return cls(*args)

    return make


def _enum(cls: type) -> Callable[..., Any]:
    def make(*args: Any) -> Any:
        if len(args) != 1 or type(args[0]) not in (int, str):
            raise Malformed(f"{cls.__name__} takes one value")
        return cls(args[0])

    return make


@dataclasses.dataclass(frozen=True)
class _StorageType:
    """What ``torch.FloatStorage`` & co. resolve to: only usable in a
    tensor's persistent id, never callable."""

    dtype: torch.dtype


_STORAGE_TYPES = {
    "UntypedStorage": torch.uint8, "ByteStorage": torch.uint8, "CharStorage": torch.int8,
    "ShortStorage": torch.int16, "IntStorage": torch.int32, "LongStorage": torch.int64,
    "HalfStorage": torch.float16, "FloatStorage": torch.float32, "DoubleStorage": torch.float64,
    "BFloat16Storage": torch.bfloat16, "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64, "ComplexDoubleStorage": torch.complex128,
}


def _dtypes() -> dict[tuple[str, str], Any]:
    return {("torch", name): v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any,
                    hooks: Any, metadata: Any = None) -> torch.Tensor:
    if not isinstance(storage, torch.storage.TypedStorage):  # only persistent ids make them
        raise Malformed("a tensor must be rebuilt from a storage of the same archive")
    size, stride = _ints(size, "tensor size"), _ints(stride, "tensor stride")
    if (type(offset) is not int or offset < 0 or len(size) != len(stride)
            or any(v < 0 for v in size + stride) or type(requires_grad) is not bool
            or not isinstance(hooks, dict) or hooks or metadata):
        raise Malformed("invalid tensor layout")
    if all(size):
        last = offset + sum((n - 1) * s for n, s in zip(size, stride))
        if last >= storage._size():
            raise Malformed(f"tensor of size {list(size)} does not fit its storage of {storage._size()} elements")
    from torch._utils import _rebuild_tensor_v2

    return _rebuild_tensor_v2(storage, offset, torch.Size(size), tuple(stride), requires_grad,
                              collections.OrderedDict())


@dataclasses.dataclass
class _Policy:
    names: dict[tuple[str, str], Any]  # what find_class may return
    calls: dict[Any, Callable[..., Any]]  # REDUCE targets -> validating constructors
    new: frozenset[type]  # NEWOBJ (no arguments) and BUILD targets


def _metadata_policy() -> _Policy:
    from torch.distributed.checkpoint import filesystem as fs
    from torch.distributed.checkpoint import metadata as md

    m = "torch.distributed.checkpoint.metadata"
    classes = {
        (m, "Metadata"): md.Metadata, (m, "TensorStorageMetadata"): md.TensorStorageMetadata,
        (m, "BytesStorageMetadata"): md.BytesStorageMetadata,
        (m, "ChunkStorageMetadata"): md.ChunkStorageMetadata,
        (m, "TensorProperties"): md.TensorProperties, (m, "MetadataIndex"): md.MetadataIndex,
        (m, "StorageMeta"): md.StorageMeta,
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): fs._StorageInfo,
    }
    names: dict[tuple[str, str], Any] = dict(classes)
    names.update(_dtypes())
    names[(m, "_MEM_FORMAT_ENCODING")] = md._MEM_FORMAT_ENCODING
    names[("torch", "Size")] = torch.Size
    names[("torch.serialization", "_get_layout")] = _layout_marker
    for cls in (pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath):
        names[("pathlib", cls.__name__)] = cls
    calls: dict[Any, Callable[..., Any]] = {
        torch.Size: _size,
        _layout_marker: _layout,
        md._MEM_FORMAT_ENCODING: _enum(md._MEM_FORMAT_ENCODING),
    }
    for cls in (pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath):
        calls[cls] = _path(cls)
    new = frozenset(classes.values())
    # protocols 0 and 1: copyreg._reconstructor(cls, object, None), then BUILD
    names[("copyreg", "_reconstructor")] = _reconstructor_marker
    names[("builtins", "object")] = object
    calls[_reconstructor_marker] = _reconstructor(new)
    return _Policy(names, calls, new)


def _object_policy() -> _Policy:
    names: dict[tuple[str, str], Any] = {
        ("builtins", "set"): set, ("builtins", "frozenset"): frozenset,
        ("builtins", "complex"): complex, ("builtins", "bytearray"): bytearray,
        ("_codecs", "encode"): _encode_marker,
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("torch", "Size"): torch.Size, ("torch", "device"): torch.device,
        ("torch.serialization", "_get_layout"): _layout_marker,
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_marker,
    }
    names.update(_dtypes())
    for name, dtype in _STORAGE_TYPES.items():
        names[("torch", name)] = _StorageType(dtype)
    calls: dict[Any, Callable[..., Any]] = {
        set: _collection(set), frozenset: _collection(frozenset), complex: _complex,
        bytearray: _bytearray, _encode_marker: _encode, collections.OrderedDict: _ordered_dict,
        torch.Size: _size, torch.device: _device, _layout_marker: _layout,
        _rebuild_marker: _rebuild_tensor,
    }
    return _Policy(names, calls, frozenset())


class _Marker:
    """Stands for an allowlisted function: the unpickler calls its validator."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


_layout_marker = _Marker("torch.serialization._get_layout")
_encode_marker = _Marker("_codecs.encode")
_rebuild_marker = _Marker("torch._utils._rebuild_tensor_v2")
_reconstructor_marker = _Marker("copyreg._reconstructor")

_POLICIES: dict[str, _Policy] = {}


def _policy(kind: str) -> _Policy:
    if kind not in _POLICIES:
        _POLICIES[kind] = _metadata_policy() if kind == "metadata" else _object_policy()
    return _POLICIES[kind]


# --- the unpickler ------------------------------------------------------------------------------


def _qualname(obj: Any) -> str:
    if isinstance(obj, _Marker):
        return obj.name
    if isinstance(obj, type):
        return f"{obj.__module__}.{obj.__qualname__}"
    return type(obj).__name__


class _Unpickler(pickle._Unpickler):
    # pickle._Unpickler's own instance attributes, which typeshed leaves out.
    stack: list[Any]
    metastack: list[Any]
    fix_imports: bool
    pop_mark: Callable[[], list[Any]]
    # Its opcode table, holding this class's handlers too (typeshed types
    # the base table's handlers as taking the C Unpickler: they take ours).
    dispatch: ClassVar[dict[int, Callable[[_Unpickler], None]]] = dict(  # type: ignore[assignment]
        pickle._Unpickler.dispatch  # type: ignore[arg-type]
    )

    def __init__(self, data: bytes | bytearray, policy: _Policy,
                 persistent: Callable[[Any], Any] | None = None, budget: int = MAX_WORK):
        self._data = io.BytesIO(data)
        super().__init__(self._data)
        self._size = len(data)
        self._policy = policy
        self._persistent = persistent
        self._work, self._budget = 0, budget
        self._built: set[int] = set()  # instances filled by BUILD (once each)
        self._sizes: dict[int, int] = {}  # id -> cost of a memo reference to it
        # nesting depth of the tuples built here (hashing a tuple recurses
        # in C without a depth check: a deep one would overflow the stack)
        self._depth: dict[int, int] = {}
        self._keep: list[tuple] = []

    def _tuple(self, items: Any) -> tuple:
        value = tuple(items)
        depth = 1
        for item in value:
            if isinstance(item, tuple):
                depth = max(depth, self._depth.get(id(item), 1) + 1)
        if depth > 1:
            if depth > MAX_DEPTH:
                raise Malformed(f"tuples nested deeper than {MAX_DEPTH} levels")
            self._depth[id(value)] = depth
            self._keep.append(value)  # its id stays its own
        return value

    def load_tuple(self) -> None:
        items = self.pop_mark()  # (first: it replaces self.append)
        self.append(self._tuple(items))

    def _load_tuple_n(self, n: int) -> None:
        if len(self.stack) < n:
            raise Malformed("stack underflow")
        self.stack[-n:] = [self._tuple(self.stack[-n:])]

    def load_tuple1(self) -> None:
        self._load_tuple_n(1)

    def load_tuple2(self) -> None:
        self._load_tuple_n(2)

    def load_tuple3(self) -> None:
        self._load_tuple_n(3)

    def load(self) -> Any:
        # pickle._Unpickler.load, reading the in-memory buffer directly:
        # frames only delimit the same bytes (checked by load_frame), and a
        # short read means the data ended (the next opcode read is empty).
        self.read = self._data.read
        self.readline = self._data.readline
        self.metastack = []
        self.stack = []
        self.append = self.stack.append
        self.proto = 0
        read, dispatch, budget = self.read, self.dispatch, self._budget
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError
                dispatch[key[0]](self)
                self._work += 1
                if self._work > budget:
                    raise _over_budget(budget)
        except pickle._Stop as stop:  # type: ignore[attr-defined]  # private, untyped
            return stop.value

    # -- the work budget --------------------------------------------------------------------

    def _charge(self, obj: Any) -> None:
        """Count the expanded size of ``obj`` (about what hashing, copying
        or walking it costs) against the budget."""
        cost = _small(obj, self._policy.new)
        if cost is None:
            cost = _expanded(obj, self._budget - self._work, self._policy.new)
        self._work += cost
        if self._work > self._budget:
            raise _over_budget(self._budget)

    def _charge_top(self) -> None:
        # a memo reference pushes the object again: its expanded size, less
        # the opcode itself
        top = self.stack[-1]
        if type(top) in _PLAIN:
            return
        # the size of the first reference is charged again for the next
        # ones (what is appended later is counted by the final check of
        # the value's expanded size)
        cost = self._sizes.get(id(top))
        if cost is None:
            if _leaf_cost(top, self._policy.new) is not None:
                return
            before = self._work
            self._charge(top)
            self._sizes[id(top)] = self._work - before
            self._keep.append(top)  # its id stays its own
            return
        self._work += cost
        if self._work > self._budget:
            raise _over_budget(self._budget)

    def load_get(self) -> None:
        pickle._Unpickler.load_get(self)  # type: ignore[attr-defined]
        self._charge_top()

    def load_binget(self) -> None:
        pickle._Unpickler.load_binget(self)  # type: ignore[attr-defined]
        self._charge_top()

    def load_long_binget(self) -> None:
        pickle._Unpickler.load_long_binget(self)  # type: ignore[attr-defined]
        self._charge_top()

    def _keys(self, keys: Any) -> None:
        for key in keys:  # hashing a tuple walks all of it, every time
            if type(key) is not str:
                self._charge(key)

    def load_frame(self) -> None:
        (size,) = struct.unpack("<Q", self.read(8))
        if size > self._size - self._data.tell():
            raise Malformed(f"a frame of {size} bytes is longer than the data")

    def find_class(self, module: str, name: str) -> Any:
        if self.proto < 3 and self.fix_imports:
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            elif module in _compat_pickle.IMPORT_MAPPING:
                module = _compat_pickle.IMPORT_MAPPING[module]
        try:
            return self._policy.names[(module, name)]
        except (KeyError, TypeError):
            raise Forbidden(f"{module}.{name}") from None

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise Malformed("unexpected persistent id")
        return self._persistent(pid)

    def _refuse(self) -> None:
        raise Malformed("pickle opcode not used by checkpoints")

    def load_reduce(self) -> None:
        stack = self.stack
        args = stack.pop()
        func = stack[-1]
        # only what find_class returns is callable: a class or a marker
        # (nothing else is hashed: a tuple's hash walks all of it)
        make = self._policy.calls.get(func) if isinstance(func, type | _Marker) else None
        if make is None or type(args) is not tuple:
            raise Malformed(f"call of {_qualname(func)} not accepted")
        self._charge(args)
        stack[-1] = make(*args)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if not (isinstance(cls, type) and cls in self._policy.new) or type(args) is not tuple or args:
            raise Malformed(f"creation of {_qualname(cls)} not accepted")
        self.append(cast(Any, cls).__new__(cls))

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        cls = type(inst)
        if cls not in self._policy.new:
            raise Malformed(f"state of {_qualname(cls)} not accepted")
        if id(inst) in self._built:  # (its hash, as a key, must not change)
            raise Malformed(f"state of a {_qualname(cls)} set twice")
        self._built.add(id(inst))
        self._keep.append(inst)
        if isinstance(state, dict | tuple):  # (its values are not walked: counted when built)
            self._work += len(state)
        if "__setstate__" in vars(cls):  # TensorProperties
            if type(state) is not tuple:
                raise Malformed(f"state of {_qualname(cls)} must be a tuple")
            inst.__setstate__(state)
            return
        fields = _FIELDS.get(cls)
        if fields is None:
            fields = _FIELDS[cls] = frozenset(f.name for f in dataclasses.fields(cls))
        if type(state) is not dict or not all(type(k) is str for k in state) or not fields.issuperset(state):
            raise Malformed(f"state of {_qualname(cls)} must be a dict of its fields")
        inst.__dict__.update(state)

    def load_append(self) -> None:
        value = self.stack.pop()
        if type(self.stack[-1]) is not list:
            raise Malformed("APPEND to a non-list")
        self.stack[-1].append(value)

    def load_appends(self) -> None:
        items = self.pop_mark()
        if type(self.stack[-1]) is not list:
            raise Malformed("APPENDS to a non-list")
        self.stack[-1].extend(items)

    def load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        if type(self.stack[-1]) not in (dict, collections.OrderedDict):
            raise Malformed("SETITEM on a non-dict")
        self._keys((key,))
        self.stack[-1][key] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()
        target = self.stack[-1]
        if type(target) not in (dict, collections.OrderedDict) or len(items) % 2:
            raise Malformed("SETITEMS on a non-dict")
        self._keys(items[::2])
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]

    def load_dict(self) -> None:  # DICT (protocols 0 and 1)
        items = self.pop_mark()
        if len(items) % 2:
            raise Malformed("DICT of an odd number of items")
        self._keys(items[::2])
        self.append({items[i]: items[i + 1] for i in range(0, len(items), 2)})

    def load_additems(self) -> None:
        items = self.pop_mark()
        if type(self.stack[-1]) is not set:
            raise Malformed("ADDITEMS on a non-set")
        self._keys(items)
        self.stack[-1].update(items)

    def load_frozenset(self) -> None:
        items = self.pop_mark()
        self._keys(items)
        self.append(frozenset(items))


for _op in ("INST", "OBJ", "NEWOBJ_EX", "EXT1", "EXT2", "EXT4", "PERSID", "BYTEARRAY8",
            "NEXT_BUFFER", "READONLY_BUFFER"):
    _Unpickler.dispatch[getattr(pickle, _op)[0]] = _Unpickler._refuse
for _op, _fn in (("FRAME", _Unpickler.load_frame), ("REDUCE", _Unpickler.load_reduce),
                 ("TUPLE", _Unpickler.load_tuple), ("TUPLE1", _Unpickler.load_tuple1),
                 ("TUPLE2", _Unpickler.load_tuple2), ("TUPLE3", _Unpickler.load_tuple3), ("NEWOBJ", _Unpickler.load_newobj),
                 ("BUILD", _Unpickler.load_build), ("APPEND", _Unpickler.load_append),
                 ("APPENDS", _Unpickler.load_appends), ("SETITEM", _Unpickler.load_setitem),
                 ("SETITEMS", _Unpickler.load_setitems), ("ADDITEMS", _Unpickler.load_additems),
                 ("DICT", _Unpickler.load_dict), ("FROZENSET", _Unpickler.load_frozenset),
                 ("GET", _Unpickler.load_get), ("BINGET", _Unpickler.load_binget),
                 ("LONG_BINGET", _Unpickler.load_long_binget)):
    _Unpickler.dispatch[getattr(pickle, _op)[0]] = _fn
del _op, _fn


_FIELDS: dict[type, frozenset[str]] = {}


_CONTAINERS = (list, tuple, dict, set, frozenset)


def _over_budget(budget: int) -> Malformed:
    return Malformed(
        f"more work than the budget of {budget} units (memo references, dict keys and call "
        "arguments count expanded: see MAX_WORK in docs/adoption.md, 'Untrusted checkpoints'; "
        "trusted=True / --trust reads a checkpoint you trust without it)")


#: what a memo reference may push at the cost of its opcode alone (a
#: string's hash is cached; calls count their arguments' lengths)
_PLAIN = frozenset({str, bytes, int, float, bool, type(None), type, torch.dtype, _Marker})


def _leaf_cost(obj: Any, instances: frozenset[type]) -> int | None:
    """The cost of an object that holds no other (None for a container or
    a metadata instance): 1, more for long strings and integers."""
    if type(obj) is str:
        return 1 + len(obj) // 256
    if isinstance(obj, _CONTAINERS) or type(obj) in instances:
        return None
    if isinstance(obj, str | bytes | bytearray):
        return 1 + len(obj) // 256
    if type(obj) is int:
        return 1 + obj.bit_length() // 4096
    return 1


def _small(obj: Any, instances: frozenset[type], most: int = 64) -> int | None:
    """The tree size of a small value (at most ``most`` nodes), else None:
    the common case, walked without bookkeeping."""
    n = 0
    stack = [obj]
    while stack:
        o = stack.pop()
        n += 1
        if n > most:
            return None
        t = type(o)
        if t is str or t is bytes:
            n += len(o) >> 8
        elif t is int:
            n += o.bit_length() >> 12
        elif t is dict:
            stack.extend(o)
            stack.extend(o.values())
        elif t is tuple or t is list or t is torch.Size or t in instances or isinstance(o, _CONTAINERS):
            stack.extend(_children(o) if t in instances or isinstance(o, dict) else o)
        else:
            n += (_leaf_cost(o, instances) or 1) - 1
    return n


def _children(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return [x for kv in obj.items() for x in kv]
    if isinstance(obj, _CONTAINERS):
        return list(obj)
    return list(getattr(obj, "__dict__", {}).values())  # a metadata dataclass


def _expanded(root: Any, limit: int, instances: frozenset[type]) -> int:
    """The size of ``root`` as a tree (a part shared by several references
    counted once per reference): what hashing, printing or walking it
    costs, computed in time linear in its distinct parts.  Stops with a
    number above ``limit`` as soon as it exceeds it."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()
    keep: list[Any] = []  # the ids in sizes stay valid
    stack: list[tuple[Any, list[Any] | None]] = [(root, None)]
    while stack:
        obj, kids = stack.pop()
        if kids is None:
            if id(obj) in sizes:
                continue
            if id(obj) in open_:
                raise Malformed("a container holds itself")
            kids = _children(obj)
            open_.add(id(obj))
            keep.append(obj)
            stack.append((obj, kids))
            stack.extend((k, None) for k in kids if _leaf_cost(k, instances) is None and id(k) not in sizes)
            continue
        total = 1
        for k in kids:
            cost = _leaf_cost(k, instances)
            total += sizes[id(k)] if cost is None else cost
        if total > limit:
            return total
        sizes[id(obj)] = total
        open_.discard(id(obj))
    return sizes[id(root)]


def _unpickle(data: bytes | bytearray, policy: _Policy, persistent: Callable[[Any], Any] | None = None,
              budget: int = MAX_WORK) -> Any:
    try:
        return _Unpickler(data, policy, persistent, budget).load()
    except (Forbidden, Malformed):
        raise
    except RecursionError:
        raise Malformed("nested too deeply") from None
    except EOFError:
        raise Malformed("truncated (ends before its STOP opcode)") from None
    except Exception as exc:  # noqa: BLE001 -- anything a corrupted stream raises
        raise Malformed(f"not a valid pickle ({type(exc).__name__}: {exc})") from None


# --- public entry points ------------------------------------------------------------------------


def load_metadata(data: bytes | bytearray, budget: int = MAX_WORK) -> Any:
    """The ``Metadata`` pickled in ``data`` (a ``.metadata`` file, any
    pickle protocol), unpickled within ``budget`` units of work; its
    expanded size (shared parts counted once per reference) is at most
    ``budget`` nodes too."""
    from torch.distributed.checkpoint.metadata import Metadata

    if not data:
        raise Malformed("empty file")
    policy = _policy("metadata")
    value = _unpickle(data, policy, budget=budget)
    if type(value) is not Metadata:
        raise Malformed(f"holds a {_qualname(type(value))}, not a Metadata")
    check_value(value, max_nodes=budget, instances=policy.new)
    return value


_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., name length, extra length


class _MemFile:
    """A read-only file over a buffer, for zipfile's central directory
    reads (records themselves are sliced from the buffer, not copied)."""

    def __init__(self, view: memoryview):
        self.view, self.pos = view, 0

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self.pos, len(self.view))[whence]
        if base + offset < 0:
            raise OSError("negative seek position")
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = len(self.view) if n is None or n < 0 else min(len(self.view), self.pos + n)
        data = bytes(self.view[self.pos:end]) if end > self.pos else b""
        self.pos = max(self.pos, end)
        return data


def _records(blob: bytes | bytearray) -> dict[str, memoryview]:
    """The records of a ``torch.save`` zip archive, as views of ``blob``:
    only stored (uncompressed) records lying inside it are accepted."""
    if not blob.startswith(b"PK\x03\x04"):
        raise Malformed("not a torch.save archive")
    view = memoryview(blob)
    try:
        infos = zipfile.ZipFile(_MemFile(view)).infolist()
    except Exception as exc:  # noqa: BLE001
        raise Malformed(f"not a valid zip archive ({type(exc).__name__}: {exc})") from None
    out: dict[str, memoryview] = {}
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size:
            raise Malformed(f"record '{info.filename}' is compressed (torch.save stores records)")
        start = info.header_offset
        if start + _LOCAL_HEADER.size > len(blob):
            raise Malformed(f"record '{info.filename}' lies outside the archive")
        sig, name_len, extra_len = _LOCAL_HEADER.unpack_from(blob, start)
        data_start = start + _LOCAL_HEADER.size + name_len + extra_len
        if sig != b"PK\x03\x04" or data_start + info.file_size > len(blob):
            raise Malformed(f"record '{info.filename}' lies outside the archive")
        out[info.filename] = view[data_start:data_start + info.file_size]
    return out


def load_object(blob: bytes | bytearray) -> Any:
    """The object ``torch.save`` wrote into ``blob`` (a non-tensor entry,
    or a tensor's chunk).  Tensors are CPU tensors sharing ``blob``'s
    memory when it is a bytearray."""
    records = _records(blob)
    pkl = [name for name in records if name.endswith("data.pkl") and name.count("/") == 1]
    if len(pkl) != 1:
        raise Malformed("no data.pkl record in the archive")
    prefix = pkl[0][: -len("data.pkl")]
    order = bytes(records.get(prefix + "byteorder", b"little"))
    if order != b"little":
        raise Malformed(f"byte order {order[:16]!r} is not supported")
    storages: dict[str, Any] = {}

    def persistent(pid: Any) -> Any:
        if (type(pid) is not tuple or len(pid) != 5 or pid[0] != "storage"
                or not isinstance(pid[1], _StorageType) or type(pid[2]) is not str
                or type(pid[4]) is not int or pid[4] < 0):
            raise Malformed("unexpected persistent id")
        _, kind, key, _, numel = pid
        if key not in storages:
            record = records.get(f"{prefix}data/{key}")
            if record is None:
                raise Malformed(f"no record for storage '{key}'")
            itemsize = kind.dtype.itemsize
            if len(record) != numel * itemsize:
                raise Malformed(f"storage '{key}' declares {numel} elements, its record holds "
                                f"{len(record)} bytes")
            if not len(record):
                raw = torch.empty(0, dtype=torch.uint8).untyped_storage()
            elif record.readonly:
                raw = torch.frombuffer(bytearray(record), dtype=torch.uint8).untyped_storage()
            else:  # no copy
                raw = torch.frombuffer(record, dtype=torch.uint8).untyped_storage()
            storage = torch.storage.TypedStorage(wrap_storage=raw, dtype=kind.dtype, _internal=True)
            storages[key] = storage
        return storages[key]

    try:
        value = _unpickle(bytes(records[pkl[0]]), _policy("object"), persistent)
    except Forbidden as exc:  # args: the name, a digest of the archive's content
        digest = hashlib.sha256()
        for name in sorted(records):
            if not name.endswith("/.data/serialization_id"):
                digest.update(b"%d:%s%d:" % (len(name), name.encode(), len(records[name])))
                digest.update(records[name])
        raise Forbidden(exc.args[0], digest.hexdigest()) from None
    check_value(value)
    return value


def check_value(value: Any, max_nodes: int = 1 << 22, instances: frozenset[type] = frozenset()) -> None:
    """Reject what printing or comparing the value would choke on: cycles,
    containers nested deeper than MAX_DEPTH, shared sub-containers that
    expand to more than ``max_nodes`` nodes, integers too long to print.
    Instances of ``instances`` (the metadata dataclasses) count as
    containers of their fields."""
    done: dict[int, tuple[int, int]] = {}  # id -> (expanded nodes, depth)
    keep: list[Any] = []  # the ids in done stay valid
    open_: set[int] = set()
    stack: list[tuple[Any, bool]] = [(value, False)]
    while stack:
        obj, leaving = stack.pop()
        if type(obj) is int and obj.bit_length() > _MAX_INT_BITS:
            raise Malformed("an integer too long to print")
        if not (isinstance(obj, _CONTAINERS) or type(obj) in instances) or id(obj) in done:
            continue
        children = _children(obj)
        if leaving:
            open_.discard(id(obj))
            sizes = [done.get(id(c), (1, 0)) for c in children]
            nodes = 1 + sum(n for n, _ in sizes)
            depth = 1 + max((d for _, d in sizes), default=0)
            if depth > MAX_DEPTH:
                raise Malformed(f"containers nested deeper than {MAX_DEPTH} levels")
            if nodes > max_nodes:
                raise Malformed(f"shared containers expand to more than {max_nodes} values")
            done[id(obj)] = (nodes, depth)
            keep.append(obj)
            continue
        if id(obj) in open_:
            raise Malformed("a container holds itself")
        if len(open_) >= MAX_DEPTH:
            raise Malformed(f"containers nested deeper than {MAX_DEPTH} levels")
        open_.add(id(obj))
        stack.append((obj, True))
        stack.extend((child, False) for child in children)
