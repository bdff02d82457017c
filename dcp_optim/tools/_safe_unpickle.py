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
  built (hashing one, as a dict key, recurses in C without a limit).

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
from typing import Any, ClassVar

import torch

__all__ = ["Forbidden", "Malformed", "load_metadata", "load_object", "MAX_DEPTH"]

#: Deepest nesting of containers accepted in a non-tensor entry.
MAX_DEPTH = 100
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
    return _Policy(names, calls, frozenset(classes.values()))


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
                 persistent: Callable[[Any], Any] | None = None):
        self._data = io.BytesIO(data)
        super().__init__(self._data)
        self._size = len(data)
        self._policy = policy
        self._persistent = persistent
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
        read, dispatch = self.read, self.dispatch
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError
                dispatch[key[0]](self)
        except pickle._Stop as stop:  # type: ignore[attr-defined]  # private, untyped
            return stop.value

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
        make = self._policy.calls.get(func) if _hashable(func) else None
        if make is None or type(args) is not tuple:
            raise Malformed(f"call of {_qualname(func)} not accepted")
        stack[-1] = make(*args)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if not (_hashable(cls) and cls in self._policy.new) or args != ():
            raise Malformed(f"creation of {_qualname(cls)} not accepted")
        self.append(cls.__new__(cls))

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        cls = type(inst)
        if cls not in self._policy.new:
            raise Malformed(f"state of {_qualname(cls)} not accepted")
        if "__setstate__" in vars(cls):  # TensorProperties
            if type(state) is not tuple:
                raise Malformed(f"state of {_qualname(cls)} must be a tuple")
            inst.__setstate__(state)
            return
        fields = _FIELDS.get(cls)
        if fields is None:
            fields = _FIELDS[cls] = frozenset(f.name for f in dataclasses.fields(cls))
        if type(state) is not dict or not fields.issuperset(state):
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
        self.stack[-1][key] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()
        target = self.stack[-1]
        if type(target) not in (dict, collections.OrderedDict) or len(items) % 2:
            raise Malformed("SETITEMS on a non-dict")
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]

    def load_additems(self) -> None:
        items = self.pop_mark()
        if type(self.stack[-1]) is not set:
            raise Malformed("ADDITEMS on a non-set")
        self.stack[-1].update(items)


for _op in ("INST", "OBJ", "NEWOBJ_EX", "EXT1", "EXT2", "EXT4", "PERSID", "BYTEARRAY8",
            "NEXT_BUFFER", "READONLY_BUFFER"):
    _Unpickler.dispatch[getattr(pickle, _op)[0]] = _Unpickler._refuse
for _op, _fn in (("FRAME", _Unpickler.load_frame), ("REDUCE", _Unpickler.load_reduce),
                 ("TUPLE", _Unpickler.load_tuple), ("TUPLE1", _Unpickler.load_tuple1),
                 ("TUPLE2", _Unpickler.load_tuple2), ("TUPLE3", _Unpickler.load_tuple3), ("NEWOBJ", _Unpickler.load_newobj),
                 ("BUILD", _Unpickler.load_build), ("APPEND", _Unpickler.load_append),
                 ("APPENDS", _Unpickler.load_appends), ("SETITEM", _Unpickler.load_setitem),
                 ("SETITEMS", _Unpickler.load_setitems), ("ADDITEMS", _Unpickler.load_additems)):
    _Unpickler.dispatch[getattr(pickle, _op)[0]] = _fn
del _op, _fn


_FIELDS: dict[type, frozenset[str]] = {}


def _hashable(obj: Any) -> bool:
    try:
        hash(obj)
    except TypeError:
        return False
    return True


def _unpickle(data: bytes | bytearray, policy: _Policy, persistent: Callable[[Any], Any] | None = None) -> Any:
    try:
        return _Unpickler(data, policy, persistent).load()
    except (Forbidden, Malformed):
        raise
    except RecursionError:
        raise Malformed("nested too deeply") from None
    except EOFError:
        raise Malformed("truncated (ends before its STOP opcode)") from None
    except Exception as exc:  # noqa: BLE001 -- anything a corrupted stream raises
        raise Malformed(f"not a valid pickle ({type(exc).__name__}: {exc})") from None


# --- public entry points ------------------------------------------------------------------------


def load_metadata(data: bytes | bytearray) -> Any:
    """The ``Metadata`` pickled in ``data`` (a ``.metadata`` file)."""
    from torch.distributed.checkpoint.metadata import Metadata

    if not data:
        raise Malformed("empty file")
    if data[:1] != pickle.PROTO:
        raise Malformed("not a pickle (no protocol header)")
    value = _unpickle(data, _policy("metadata"))
    if type(value) is not Metadata:
        raise Malformed(f"holds a {_qualname(type(value))}, not a Metadata")
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


def check_value(value: Any, max_nodes: int = 1 << 22) -> None:
    """Reject what printing or comparing the value would choke on: cycles,
    containers nested deeper than MAX_DEPTH, shared sub-containers that
    expand to more than ``max_nodes`` nodes, integers too long to print."""
    done: dict[int, tuple[int, int]] = {}  # id -> (expanded nodes, depth)
    keep: list[Any] = []  # the ids in done stay valid
    open_: set[int] = set()
    stack: list[tuple[Any, bool]] = [(value, False)]
    while stack:
        obj, leaving = stack.pop()
        if type(obj) is int and obj.bit_length() > _MAX_INT_BITS:
            raise Malformed("an integer too long to print")
        if not isinstance(obj, list | tuple | dict | set | frozenset) or id(obj) in done:
            continue
        children = [x for kv in obj.items() for x in kv] if isinstance(obj, dict) else list(obj)
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
