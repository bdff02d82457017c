"""Structure-aware fuzzing of every entry point of the C core.

``tests/core/test_fuzz.py`` throws garbage at whole argument positions.  This
file starts from *valid* calls and breaks them a little, where the C code
parses them: one element of a nested tuple becomes a list, a tuple loses or
gains an item, an int becomes negative, huge or ``2**63``, a str becomes
bytes, a tensor gets another dtype, shape or the ``meta`` device, a
DTensor-like fake gets a bad mesh, and objects appear whose ``__index__``,
``__len__``, ``__iter__``, ``__getitem__``, ``__eq__``, ``__hash__`` or
``__bool__`` raise, or clear the very container the core is walking.

The property: the call returns or raises an ordinary exception (never a
``SystemError``, the C-API's mark of a C bug); the ASan/UBSan run
(``make test-asan`` runs this file against the sanitizer build) turns any
invalid memory access into a failure, pytest-timeout any hang.

Nothing here names the functions: the valid calls are recorded by running
the success cases of ``tests/core/refleak/test_refleak_core.py`` (which must
cover every function of the module) through a recording proxy, the types
come from the module and from the objects its functions return (their
methods are fuzzed too), and arities come from each function's advertised
signature.  A function added to the core is fuzzed as soon as it has a
success case there.

``DCP_OPTIM_FUZZ_CORE_EXAMPLES=n`` sets the examples per entry point (small
by default so ``make test`` stays fast; the ASan run uses more).
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import os
import sys
import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .refleak import fakes
from .refleak.fakes import (
    FLOAT32,
    UINT8,
    FakeDTensor,
    FakeParameter,
    FakeTensor,
    Mesh,
    Partial,
    Shard,
)

EXAMPLES = int(os.environ.get("DCP_OPTIM_FUZZ_CORE_EXAMPLES", "20"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=not os.environ.get("DCP_OPTIM_FUZZ_CORE_RANDOM"),
    suppress_health_check=list(HealthCheck),
)


# --- the valid calls, recorded from the refleak suite's success cases ----------------------


def _load_cases():
    """A private copy of the refleak case module (its own fixtures, so what
    the fuzzing mutates is not what the refleak tests use)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "refleak",
                        "test_refleak_core.py")
    spec = importlib.util.spec_from_file_location("tests.core.refleak._fuzz_core_cases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Recorder:
    """Stands in for the core module: records each call, then makes it."""

    def __init__(self, core, calls, results):
        self._core, self._calls, self._results = core, calls, results

    def __getattr__(self, name):
        target = getattr(self._core, name)
        if not callable(target) or name.startswith("_"):
            return target

        def record(*args, **kwargs):
            self._calls.setdefault(name, []).append((args, kwargs))
            result = target(*args, **kwargs)
            self._results.append(result)
            return result

        return record


CASES = _load_cases()
C = CASES.C
CALLS: dict[str, list] = {}
_RESULTS: list = []
CASES.C = _Recorder(C, CALLS, _RESULTS)
try:
    for _case in CASES.CASES:
        if _case.exc is None:
            _case.call()
finally:
    CASES.C = C


def _own_types():
    """The core's types: those the module exports and those of objects its
    functions return (internal heap types such as plans)."""
    found = {obj for name in dir(C) if isinstance(obj := getattr(C, name), type)}
    for result in _RESULTS:
        for item in result if isinstance(result, (tuple, list)) else (result,):
            if type(item).__module__ == C.__name__:
                found.add(type(item))
    return found


def _instances():
    out = {}
    for result in _RESULTS:
        for item in result if isinstance(result, (tuple, list)) else (result,):
            if type(item) in TYPES:
                out.setdefault(type(item).__name__, item)
    out.setdefault(type(CASES.CTX).__name__, CASES.CTX)
    out.setdefault(type(CASES.INDEX).__name__, CASES.INDEX)
    for obj in list(out.values()):  # internal types reachable from attributes
        for name in dir(obj):
            value = getattr(obj, name, None)
            if type(value).__module__ == C.__name__ and not isinstance(value, type):
                TYPES.add(type(value))
                out.setdefault(type(value).__name__, value)
    return out


TYPES = _own_types()
INSTANCES = _instances()
FUNCTIONS = sorted(name for name in dir(C)
                   if not name.startswith("_") and callable(getattr(C, name))
                   and not isinstance(getattr(C, name), type))


def _methods():
    out = {}
    for tname, obj in INSTANCES.items():
        for name in dir(type(obj)):
            if name.startswith("_"):
                continue
            attr = getattr(obj, name, None)
            if isinstance(attr, types.BuiltinMethodType):  # implemented in C
                out[f"{tname}.{name}"] = (obj, name)
    return out


METHODS = _methods()


def _arity(fn) -> tuple[int, int]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return 0, 3
    params = [p for p in sig.parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = sum(1 for p in params if p.default is p.empty)
    return required, len(params)


# --- hostile values -----------------------------------------------------------------------------


class Boom(Exception):
    pass


class Raising:
    """Every protocol the core might use raises."""

    def __index__(self):
        raise Boom("__index__")

    def __int__(self):
        raise Boom("__int__")

    def __len__(self):
        raise Boom("__len__")

    def __iter__(self):
        raise Boom("__iter__")

    def __getitem__(self, key):
        raise Boom("__getitem__")

    def __eq__(self, other):
        raise Boom("__eq__")

    def __hash__(self):
        raise Boom("__hash__")

    def __bool__(self):
        raise Boom("__bool__")

    def __getattr__(self, name):
        raise Boom(f"getattr {name}")


class Mutator:
    """Every protocol first clears ``target`` (the container the core is
    walking when it meets this object), then answers plausibly."""

    def __init__(self, target=None):
        self.target = target

    def _hit(self):
        target = self.__dict__.get("target")
        if isinstance(target, (list, dict, set, bytearray)):
            target.clear()

    def __index__(self):
        self._hit()
        return 0

    __int__ = __index__

    def __len__(self):
        self._hit()
        return 1

    def __iter__(self):
        self._hit()
        return iter(())

    def __getitem__(self, key):
        self._hit()
        raise IndexError(f"Mutator[{key!r}]")

    def __eq__(self, other):
        self._hit()
        return False

    def __hash__(self):
        self._hit()
        return 0

    def __bool__(self):
        self._hit()
        return True

    def __getattr__(self, name):
        self._hit()
        raise AttributeError(f"Mutator has no {name}")


class HugeIndex:
    def __index__(self):
        return 2**100


class LyingSequence(list):
    """A list subclass whose __len__ and __getitem__ disagree with its
    storage (PySequence_Fast takes it as is; a copy would not)."""

    def __len__(self):
        return 1000

    def __getitem__(self, i):
        raise IndexError(f"LyingSequence[{i!r}]")

    def __iter__(self):
        return iter(())


def _no_placements():
    t = FakeDTensor((4, 2))
    t.placements = ()
    return t


INTS = [-1, -(2**31), 2**31, 2**62, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, 2**100,
        -(2**100), 0, 1, True]
LEAVES = [
    None, *INTS, 1.5, math.nan, -math.inf, "", "a.weight", "state", b"a.weight", bytearray(b"x"),
    (), [], {}, set(), object(), type, int, HugeIndex(),
    FakeTensor(()), FakeTensor((0,)), FakeTensor((2**40, 2**40)), FakeTensor((-1, 3)),
    FakeTensor((2, 3), UINT8), FakeTensor((2, 3), device="meta"), FakeParameter((7,)),
    FakeTensor(("x",)), FakeDTensor((4, 2), placements=(Partial(),)),
    FakeDTensor((4, 2), placements=(Shard(5),)), FakeDTensor((4, 2), placements=(Shard(-1),)),
    FakeDTensor((4, 2), mesh=Mesh((2, 2), (0,))), FakeDTensor((4, 2), mesh=Mesh((2,), None)),
    FakeDTensor((4, 2), mesh=Mesh((0,), (3,))), _no_placements(),
    torch.zeros(2, 3, device="meta"), torch.zeros(3, dtype=torch.int8), torch.zeros(()),
    torch.zeros(0, 2), FLOAT32, UINT8, fakes.Replicate(), Shard(0),
]
_KINDS = ["leaf", "raising", "mutator", "lying", "flip", "drop", "grow", "bytes", "none"]


def _draft(obj, depth=0):
    """A mutable copy of the containers in a valid argument (exact lists,
    tuples and dicts down to a few levels; everything else is shared).
    Tuples become _TupleDraft lists, turned back into tuples by _freeze."""
    if depth > 6:
        return obj
    if type(obj) is list:
        return [_draft(x, depth + 1) for x in obj]
    if type(obj) is tuple:
        return _TupleDraft(_draft(x, depth + 1) for x in obj)
    if type(obj) is dict:
        return {k: _draft(v, depth + 1) for k, v in obj.items()}
    return obj


class _TupleDraft(list):
    pass


def _freeze(obj):
    if isinstance(obj, _TupleDraft):
        return tuple(_freeze(x) for x in obj)
    if type(obj) is list:
        obj[:] = [_freeze(x) for x in obj]
        return obj
    if type(obj) is dict:
        for k in list(obj):
            obj[k] = _freeze(obj[k])
        return obj
    return obj


def _slots(root):
    """(container, key) of every value inside the draft, top level first."""
    out, stack = [], [root]
    while stack and len(out) < 400:
        node = stack.pop()
        keys = list(node) if type(node) is dict else range(len(node))
        for key in keys:
            out.append((node, key))
            child = node[key]
            if type(child) in (list, dict, _TupleDraft):
                stack.append(child)
    return out


def _mutate(data, draft):
    slots = _slots(draft[0]) + _slots(draft[1])
    if not slots:
        return
    container, key = data.draw(st.sampled_from(slots), label="slot")
    value = container[key]
    kind = data.draw(st.sampled_from(_KINDS), label="kind")
    walked = container if type(container) in (list, dict) else None
    if kind == "leaf":
        new = data.draw(st.sampled_from(LEAVES + POOL), label="leaf")
    elif kind == "raising":
        new = Raising()
    elif kind == "mutator":
        new = Mutator(walked if data.draw(st.booleans()) else value)
    elif kind == "lying":
        new = LyingSequence(value if isinstance(value, (list, tuple)) else [value])
    elif kind == "flip":  # tuple <-> list, the other container type
        if isinstance(value, _TupleDraft):
            new = list(value)
        elif type(value) is list:
            new = _TupleDraft(value)
        elif type(value) is dict:
            new = list(value.items())
        else:
            new = (value,)
    elif kind == "drop" and type(value) in (list, _TupleDraft) and value:
        new = type(value)(value[:-1])
    elif kind == "grow" and type(value) in (list, _TupleDraft):
        new = type(value)([*value, data.draw(st.sampled_from(LEAVES), label="extra")])
    elif kind == "grow" and type(value) is dict:
        new = dict(value)
        new[data.draw(st.sampled_from([0, None, b"k", "zz", Mutator()]))] = value
    elif kind == "bytes" and isinstance(value, str):
        new = value.encode()
    elif isinstance(value, int) and not isinstance(value, bool):
        new = data.draw(st.sampled_from(INTS), label="int")
    else:
        new = None
    if type(container) is dict and kind == "drop":
        del container[key]
    else:
        container[key] = new


def _collect_leaves(obj, out, depth=0):
    if depth > 4 or len(out) > 200:
        return
    if type(obj) in (list, tuple):
        for x in obj:
            _collect_leaves(x, out, depth + 1)
    elif type(obj) is dict:
        for v in obj.values():
            _collect_leaves(v, out, depth + 1)
    elif obj is not None and not isinstance(obj, (int, float, str, bytes)):
        out.append(obj)


# Valid objects of other calls, to pass where they do not belong (a plan to
# another executor, an index where a context goes).
POOL: list = list(INSTANCES.values())
for _calls in CALLS.values():
    for _args, _kwargs in _calls[:2]:
        _collect_leaves(list(_args), POOL)
del POOL[300:]


_TRACE = os.environ.get("DCP_OPTIM_FUZZ_TRACE")


def outcome(fn, args, kwargs):
    if _TRACE:  # what was called last when the process dies
        sys.stderr.write(f"CALL {fn!r} {args!r:.3000} {kwargs!r:.2000}\n")
        sys.stderr.flush()
    try:
        fn(*args, **kwargs)
    except SystemError as exc:  # pragma: no cover - a C bug when it happens
        pytest.fail(f"SystemError from {fn!r}: {exc!r}")
    except RecursionError:
        pass
    except Exception as exc:
        assert str(exc) or exc.args, f"{type(exc).__name__} without a message from {fn!r}"


# --- the properties ---------------------------------------------------------------------------


def test_every_function_and_type_is_covered():
    """Every function of the core has recorded valid calls to start from,
    and its types' methods were found (discovery works)."""
    assert FUNCTIONS and not set(FUNCTIONS) - set(CALLS) - {"Context"}, \
        sorted(set(FUNCTIONS) - set(CALLS))
    assert "Context" in CALLS and any(n.startswith("ModelIndex.") for n in METHODS), METHODS


@pytest.mark.parametrize("name", sorted(set(CALLS) & (set(FUNCTIONS) | {"Context"})))
def test_valid_calls_broken_a_little(name):
    fn = getattr(C, name)
    calls = CALLS[name][:8]

    @FUZZ
    @given(st.data())
    def run(data):
        args, kwargs = data.draw(st.sampled_from(calls), label="call")
        draft = _draft([list(args), dict(kwargs)])
        for _ in range(data.draw(st.integers(1, 3), label="mutations")):
            _mutate(data, draft)
        draft = _freeze(draft)
        pos, kw = draft[0], draft[1]
        if type(pos) is not list or type(kw) is not dict or not all(isinstance(k, str) for k in kw):
            return
        outcome(fn, pos, kw)

    run()


@pytest.mark.parametrize("name", sorted(set(FUNCTIONS) | set(METHODS)))
def test_garbage_in_every_position(name):
    """Arities around the advertised one, each argument drawn from hostile
    leaves and valid objects of other calls."""
    if name in METHODS:
        obj, attr = METHODS[name]
        fn = getattr(obj, attr)
    else:
        fn = getattr(C, name)
    low, high = _arity(fn)
    values = st.one_of(st.sampled_from(LEAVES + POOL), st.builds(Raising), st.builds(Mutator),
                       st.builds(LyingSequence))

    @FUZZ
    @given(st.integers(max(0, low - 1), high + 1).flatmap(
        lambda n: st.lists(values, min_size=n, max_size=n)))
    def run(args):
        outcome(fn, args, {})

    run()


def test_types_refuse_garbage_construction():
    """The core's types: constructing, subclassing and attribute writes with
    garbage raise or succeed, never crash."""
    for tp in sorted(TYPES, key=lambda t: t.__name__):
        for args in ((), (None,), (Raising(),), (1, 2, 3)):
            outcome(tp, args, {})
        outcome(tp, (), {"bogus": Raising()})
        try:
            class Sub(tp):  # noqa: F841 - immutable types refuse it
                pass
        except TypeError:
            pass
    for obj in INSTANCES.values():
        for attr in [a for a in dir(obj) if not a.startswith("__")][:40]:
            for value in (None, Raising(), []):
                try:
                    setattr(obj, attr, value)
                except (AttributeError, TypeError):
                    pass
            try:
                getattr(obj, attr)
            except Exception as exc:  # noqa: BLE001 - any clear exception is fine
                assert not isinstance(exc, SystemError), (attr, exc)


# --- regressions: what the fuzzing found, pinned without hypothesis -------------------------


def test_copy_blocks_block_with_fewer_lengths_than_starts():
    """A block whose starts tuple is longer than its lengths tuple was read
    past the end of the lengths tuple (a segfault); starts and lengths that
    overflow when added were signed overflow."""
    dst, src = FakeTensor((4, 2)), FakeTensor((2, 2))
    for block in [((0, 0, 2**64), (0, 0), (2, 2)), ((0, 0), (0, 0, 1), (2, 2)),
                  ((0, 0), (0, 0), (2,))]:
        for direction in (0, 1):
            with pytest.raises(ValueError, match="starts and lengths differ"):
                C.copy_blocks(dst, src, [block], direction, None)
    with pytest.raises(ValueError, match="overflowing"):
        C.copy_blocks(dst, src, [((2**63 - 1, 0), (0, 0), (5, 2))], 0, None)
    with pytest.raises(ValueError, match="overflowing"):
        C.copy_blocks(dst, src, [((0, 0), (-3, 0), (2, 2))], 0, None)
    C.copy_blocks(dst, src, [((0, 0), (2, 0), (2, 2))], 0, None)  # a valid block still copies


def test_flat_layout_stops_at_a_bad_numel():
    """A numel that is not an int left its TypeError pending while the
    padding flag's __bool__ ran (SystemError: a result with an exception
    set)."""
    calls = []

    class Flag:
        def __bool__(self):
            calls.append(1)
            return False

    for fn, args in [(C.flat_unflatten, (FakeTensor((4,)), ["x"], [Flag()], [(1,)])),
                     (C.flat_pieces, (["x"], [Flag()], 4, 0))]:
        with pytest.raises(TypeError):
            fn(*args)
    assert not calls


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
