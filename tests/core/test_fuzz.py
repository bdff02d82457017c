"""Property-based fuzzing of the C entry points with hostile inputs.

Every input here is something a caller (or a module/optimizer subclass)
can legitimately hand to dcp_optim: modules whose attributes raise,
``_parameters`` that are not dicts or change while the walk reads them,
optimizers with odd ``param_groups``, state dicts with wrong types,
non-string keys, deep nesting, huge key counts -- and, for the private C
functions, arbitrary garbage in every argument position.  The property is
always the same: the call returns, or raises an ordinary exception with a
message.  Never a crash (the ASan/UBSan run, ``make test-asan``, executes
this file against the sanitizer build), never a hang (pytest-timeout),
never a ``SystemError`` (the C-API's "error return without exception set"
or "bad argument to internal function": a bug in the C code, not a clear
message).

The C-level properties use the fake classes of ``tests/core/refleak/fakes.py``;
the public-API ones use real torch modules and optimizers.
``DCP_OPTIM_FUZZ_EXAMPLES=n`` raises the number of examples per property
(default small enough for the whole file to stay well under a minute).
"""

from __future__ import annotations

import collections
import os
import sys

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dcp_optim
from dcp_optim import StateDictOptions

from .refleak import fakes
from .refleak.fakes import (
    PLACEMENT_CLASSES,
    FakeDTensor,
    FakeModule,
    FakeOptimizer,
    FakeParameter,
    FakeTensor,
    make_context,
)

C = dcp_optim._dcp_optim if hasattr(dcp_optim, "_dcp_optim") else fakes.load_core()
CTX = make_context(C)

EXAMPLES = int(os.environ.get("DCP_OPTIM_FUZZ_EXAMPLES", "40"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=os.environ.get("CI") is not None,
)


def outcome(fn, *args, **kwargs):
    """Calls fn; returns the result or the exception.  Fails the test on
    SystemError (a C-API misuse) or an exception without a message."""
    try:
        return fn(*args, **kwargs)
    except RecursionError as exc:
        return exc
    except SystemError as exc:  # pragma: no cover - a bug when it happens
        pytest.fail(f"SystemError from {getattr(fn, '__name__', fn)}: {exc!r}")
    except Exception as exc:
        if isinstance(exc, KeyError):
            assert exc.args, f"KeyError without a key from {fn}"
        else:
            assert str(exc), f"{type(exc).__name__} without a message from {fn}"
        return exc


# --- hostile objects ------------------------------------------------------------------------


class Boom(Exception):
    pass


class Raising:
    """Every protocol raises."""

    def __getattr__(self, name):
        raise Boom(f"getattr {name}")

    def __iter__(self):
        raise Boom("iter")

    def __len__(self):
        raise Boom("len")

    def __hash__(self):
        raise Boom("hash")

    def __eq__(self, other):
        raise Boom("eq")

    def __bool__(self):
        raise Boom("bool")

    def __index__(self):
        raise Boom("index")

    def __getitem__(self, key):
        raise Boom("getitem")

    def __call__(self, *args, **kwargs):
        raise Boom("call")


class BadMapping(dict):
    """A dict subclass whose items() lies."""

    def items(self):
        return [("x",), 3, None]


class SameHashKey:
    """Collides with every str key, equal to nothing, mutates on compare."""

    def __init__(self, target=None):
        self.target = target

    def __hash__(self):
        return hash("a.weight")

    def __eq__(self, other):
        if isinstance(self.target, dict):
            self.target.clear()
        return False


SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=4),
    st.sampled_from(["a.weight", "a.bias", "b.weight", "b.bias", "running", "step",
                     "state", "param_groups", "params", "lr", "_flat_param",
                     "state.a.weight.step", "param_groups.a.weight.lr",
                     "module.a.weight", "_orig_mod.x", "..", "."]),
)
OBJECTS = st.one_of(
    SCALARS,
    st.builds(FakeTensor, st.lists(st.integers(0, 3), max_size=3).map(tuple)),
    st.builds(Raising),
    st.builds(object),
    st.builds(lambda: BadMapping(a=1)),
)


def trees(leaves=OBJECTS, max_leaves=30):
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.lists(children, max_size=4),
            st.lists(children, max_size=4).map(tuple),
            st.dictionaries(st.one_of(st.text(max_size=6), st.integers(-3, 3),
                                      st.sampled_from(["state", "param_groups", "params",
                                                       "a.weight", "lr"])),
                            children, max_size=4),
        ),
        max_leaves=max_leaves,
    )


def deep(depth, kind=dict):
    obj: object = 1
    for _ in range(depth):
        obj = {"k": obj} if kind is dict else [obj]
    return obj


MODEL = fakes.small_model()
INDEX = C.walk_model(CTX, MODEL, "_fqn_modifiers")
PARAMS = fakes.params_of(MODEL)


# --- modules ------------------------------------------------------------------------------------


class HostileModule(FakeModule):
    """A fake module whose container attributes are drawn by hypothesis."""

    def __init__(self, params=None, buffers=None, modules=None, raise_on=()):
        super().__init__()
        self.__dict__["_raise_on"] = set(raise_on)
        if params is not None:
            self.__dict__["_parameters"] = params
        if buffers is not None:
            self.__dict__["_buffers"] = buffers
        if modules is not None:
            self.__dict__["_modules"] = modules

    def __getattribute__(self, name):
        if name in object.__getattribute__(self, "__dict__").get("_raise_on", ()):
            raise Boom(f"attribute {name} exploded")
        return object.__getattribute__(self, name)


CONTAINERS = st.one_of(
    st.none(),
    st.integers(),
    st.lists(st.tuples(st.text(max_size=3), st.builds(FakeParameter)), max_size=3),
    st.dictionaries(st.one_of(st.text(max_size=3), st.integers()),
                    st.one_of(st.none(), st.builds(FakeParameter), st.integers()), max_size=3),
    st.builds(lambda: BadMapping(w=FakeParameter())),
    st.builds(Raising),
)
ATTRS = st.sets(st.sampled_from(["_parameters", "_buffers", "_modules",
                                 "_non_persistent_buffers_set",
                                 "_load_state_dict_pre_hooks", "named_parameters",
                                 "_fqn_modifiers"]), max_size=2)


@st.composite
def hostile_models(draw):
    root = FakeModule()
    for i in range(draw(st.integers(0, 3))):
        child = HostileModule(draw(CONTAINERS), draw(CONTAINERS), None, draw(ATTRS))
        root._modules[draw(st.sampled_from([f"c{i}", i, "module", "_orig_mod"]))] = child
    if draw(st.booleans()):
        root._modules["ok"] = fakes.linear()
    return root


@FUZZ
@given(hostile_models(), st.sampled_from(["_fqn_modifiers", "", "x"]))
def test_walk_hostile_modules(model, modifiers):
    result = outcome(C.walk_model, CTX, model, modifiers)
    if not isinstance(result, Exception):
        result.valid_state()
        sd = dict(result.valid_state())
        outcome(C.canonicalize_model_keys, CTX, model, sd, modifiers)
    outcome(C.get_fqns, CTX, model, "c0.w", modifiers, True, True)
    outcome(C.get_fqns, CTX, model, "ok.weight", modifiers, False, False)


class MutatingModule(FakeModule):
    """Reading its _parameters clears the parent's children and its own
    parameters: containers changing (and modules dying) mid-walk."""

    def __init__(self, parent, mode):
        super().__init__()
        self.__dict__["_parent"] = parent
        self.__dict__["_mode"] = mode
        self.__dict__["_real"] = {"w": FakeParameter(), "v": FakeParameter()}

    @property
    def _parameters(self):
        mode = self.__dict__["_mode"]
        parent = self.__dict__["_parent"]
        if mode == 0:
            parent._modules.clear()
        elif mode == 1:
            self.__dict__["_real"].clear()
        elif mode == 2:
            parent._modules[f"n{len(parent._modules)}"] = fakes.linear()
        elif mode == 3:
            self.__dict__.pop("_parent", None)
            parent._modules.pop("m", None)
        return self.__dict__["_real"]

    @_parameters.setter
    def _parameters(self, value):
        pass


@FUZZ
@given(st.integers(0, 3), st.integers(0, 3))
def test_walk_containers_mutated_during_walk(mode, n_siblings):
    root = FakeModule()
    for i in range(n_siblings):
        root._modules[f"s{i}"] = fakes.linear()
    root._modules["m"] = MutatingModule(root, mode)
    for i in range(n_siblings):
        root._modules[f"t{i}"] = MutatingModule(root, (mode + i) % 4)
    outcome(C.walk_model, CTX, root, "_fqn_modifiers")
    outcome(C.get_fqns, CTX, root, "m.w", "_fqn_modifiers", True, True)
    outcome(C.canonicalize_model_keys, CTX, root, {"m.w": 1, "s0.weight": 2}, "_fqn_modifiers")


@pytest.mark.parametrize("depth", [50, 3000])
def test_walk_deep_nesting(depth):
    root = node = FakeModule()
    for _ in range(depth):
        node = node.add("c", FakeModule())
    node._parameters["w"] = FakeParameter()
    result = outcome(C.walk_model, CTX, root, "_fqn_modifiers")
    if depth > sys.getrecursionlimit():
        assert isinstance(result, RecursionError), result
    else:
        assert result.fqns == (".".join(["c"] * depth + ["w"]),)


def test_walk_huge_key_counts():
    root = FakeModule()
    for i in range(20000):
        root._parameters[f"p{i}"] = FakeParameter()
    index = C.walk_model(CTX, root, "_fqn_modifiers")
    assert len(index.fqns) == 20000
    sd = {f"p{i}": i for i in range(20000)}
    C.canonicalize_model_keys(CTX, root, sd, "_fqn_modifiers")
    load_sd, local = C.rename_for_load(index, sd, True, True, True)
    assert len(local) == 20000
    flat = {f"state.p{i}.exp": i for i in range(20000)}
    view = C.unflatten_optim(index, flat)
    assert len(view[0]) == 20000


# --- optimizers ---------------------------------------------------------------------------------

GROUP_PARAMS = st.lists(
    st.one_of(st.sampled_from(PARAMS), st.builds(FakeParameter), st.integers(), st.none(),
              st.builds(Raising)),
    max_size=5,
)
GROUPS = st.lists(
    st.one_of(
        st.builds(lambda p, lr: {"params": p, "lr": lr}, GROUP_PARAMS, SCALARS),
        st.builds(lambda p: {"params": tuple(p)}, GROUP_PARAMS),
        st.builds(lambda p: {"params": iter(p)}, GROUP_PARAMS),
        st.builds(lambda p: {"params": set(p[:1])}, st.lists(st.sampled_from(PARAMS))),
        st.just({"lr": 1.0}),  # no params
        st.just({"params": 5}),
        st.builds(lambda: {"params": Raising()}),
        SCALARS,
        st.builds(lambda: BadMapping(params=[PARAMS[0]])),
    ),
    max_size=4,
)


@st.composite
def hostile_optimizers(draw):
    opt = FakeOptimizer([])
    groups = draw(GROUPS)
    odd = [lambda: tuple(groups), lambda: None, lambda: 5, Raising, lambda: {"params": PARAMS}]
    opt.param_groups = groups if draw(st.booleans()) else draw(st.sampled_from(odd))()
    state = draw(st.dictionaries(
        st.one_of(st.sampled_from(PARAMS), st.integers(), st.text(max_size=2)),
        st.one_of(st.dictionaries(st.text(max_size=3), OBJECTS, max_size=2), OBJECTS),
        max_size=3))
    odd_state = [lambda: state, lambda: None, Raising, list]
    opt.state = (collections.defaultdict(dict, state) if draw(st.booleans())
                 else draw(st.sampled_from(odd_state))())
    return opt


@FUZZ
@given(hostile_optimizers(), trees(max_leaves=10), st.booleans())
def test_optimizer_functions_hostile(opt, loaded, flat):
    outcome(C.optim_pack, INDEX, [opt], [None], {}, [])
    outcome(C.optim_missing, INDEX, opt)
    osd = outcome(lambda: opt.state_dict())
    if isinstance(osd, dict):
        outcome(C.optim_remap, INDEX, opt, osd)
    view = outcome(C.unflatten_optim if flat else C.view_from_nested,
                   *((INDEX, loaded) if flat else (loaded,)))
    if not isinstance(view, Exception):
        split = outcome(C.split_optim, INDEX, [opt], view, [None])
        if not isinstance(split, Exception):
            for sd in split[0]:
                outcome(C.prepare_install, CTX, opt, sd, None)
    outcome(C.prepare_install, CTX, opt, loaded, None)
    outcome(C.prepare_install, CTX, opt, loaded, [loaded])


def test_optimizer_duplicate_and_foreign_params():
    dup = FakeOptimizer([[PARAMS[0], PARAMS[0], PARAMS[1]]])
    assert not isinstance(outcome(C.optim_pack, INDEX, [dup], [None], {}, []), Exception)
    foreign = FakeOptimizer([[PARAMS[0], FakeParameter((7,))]])
    exc = outcome(C.optim_pack, INDEX, [foreign], [None], {}, [])
    assert isinstance(exc, KeyError) and "not a parameter of the model" in str(exc)
    missing = FakeOptimizer([])
    missing.param_groups = [{"lr": 0.1}]
    exc = outcome(C.optim_missing, INDEX, missing)
    assert isinstance(exc, KeyError) and "'params'" in str(exc)


# --- state dicts --------------------------------------------------------------------------------


@FUZZ
@given(trees(), st.booleans())
def test_state_dict_trees_hostile(tree, type_check):
    leaves = outcome(C.tree_leaves, CTX, tree, type_check)
    if isinstance(leaves, list):
        outcome(C.tree_rebuild, CTX, tree, leaves, type_check)
        outcome(C.tree_rebuild, CTX, tree, leaves[:-1], type_check)
    outcome(C.tree_paths, CTX, tree)
    outcome(C.flatten_optim, CTX, tree, None)
    outcome(C.flatten_optim, CTX, {"state": tree, "param_groups": []}, None)
    outcome(C.unflatten_optim, INDEX, tree)
    outcome(C.view_from_nested, tree)
    outcome(C.rename_for_load, INDEX, tree, True, True, True)
    outcome(C.check_model_load, INDEX, tree, True, True)
    outcome(C.full_load_merge, CTX, tree, {"a.weight": FakeTensor((2, 3))}, "cpu")
    outcome(C.optim_state_jobs, INDEX, tree, FakeDTensor, 0, FakeDTensor.from_local)
    outcome(C.optim_state_jobs, INDEX, tree, FakeDTensor, 1, FakeDTensor.from_local)
    outcome(C.filter_prefixes, tree, ["a.", "b."], False)
    outcome(C.first_key_containing, tree, "_flat")
    outcome(C.broadcast_jobs, tree, None, {}, "cpu", FakeDTensor, FakeTensor)
    outcome(C.tensor_devices, CTX, tree)


@FUZZ
@given(st.dictionaries(st.one_of(st.text(max_size=12), st.integers(), st.builds(SameHashKey)),
                       trees(max_leaves=5), max_size=8))
def test_flat_and_nested_keys_hostile(d):
    flat = {("state." + k if isinstance(k, str) else k): v for k, v in d.items()}
    outcome(C.unflatten_optim, INDEX, flat)
    outcome(C.view_from_nested, {"state": d, "param_groups": [{"params": list(d)}]})
    outcome(C.flatten_optim, CTX, {"state": d, "param_groups": [{"params": list(d)}]}, [1])
    outcome(C.rename_for_load, INDEX, d, True, True, True)


@pytest.mark.parametrize("kind", [dict, list])
def test_deep_nesting(kind):
    tree = deep(50000, kind)
    for fn, args in [
        (C.tree_leaves, (CTX, tree, True)),
        (C.tree_rebuild, (CTX, tree, [], True)),
        (C.tree_paths, (CTX, tree)),
        (C.flatten_optim, (CTX, {"state": {"a.weight": tree}, "param_groups": []}, None)),
        (C.prepare_install, (CTX, FakeOptimizer([PARAMS]),
                             {"state": {"a.weight": tree},
                              "param_groups": [{"params": ["a.weight", "a.bias", "b.weight",
                                                           "b.bias"]}]}, None)),
        (C.optim_state_jobs, (INDEX, {"a.weight": tree}, FakeDTensor, 0, None)),
    ]:
        result = outcome(fn, *args)
        if kind is dict or fn is not C.optim_state_jobs:
            assert isinstance(result, (RecursionError, Exception)) or result is not None


def test_self_referencing_state():
    loop: dict = {}
    loop["self"] = loop
    assert isinstance(outcome(C.tree_leaves, CTX, loop, True), RecursionError)
    assert isinstance(outcome(C.flatten_optim, CTX, {"state": {"a.weight": loop},
                                                     "param_groups": []}, None), RecursionError)


# --- every private entry point, garbage in every position ----------------------------------------

GARBAGE = st.one_of(
    SCALARS,
    st.just(CTX),
    st.just(INDEX),
    st.builds(Raising),
    st.builds(lambda: BadMapping(a=1)),
    st.builds(FakeTensor, st.lists(st.integers(0, 4), max_size=2).map(tuple)),
    st.lists(st.one_of(SCALARS, st.tuples(SCALARS, SCALARS)), max_size=3),
    st.lists(st.tuples(st.integers(-2, 2**62), st.integers(-2, 2**62), st.integers(-2, 2**62)),
             max_size=3),
    st.dictionaries(st.text(max_size=3), SCALARS, max_size=3),
    st.just(FakeDTensor),
    st.just(FakeTensor),
    st.just(PLACEMENT_CLASSES),
    st.just(lambda *a, **k: FakeTensor()),
)
# A real plan among the garbage: its executor and methods meet wrong
# arguments too.
LOAD_PLAN = C.plan_full_load(
    [(FakeTensor((4, 2)), FakeDTensor((4, 2)), "cpu"), (FakeTensor(()), None, "cpu")],
    FakeDTensor, PLACEMENT_CLASSES, 16, lambda shape, **kw: FakeTensor(tuple(shape)), True,
)
GARBAGE = st.one_of(GARBAGE, st.just(LOAD_PLAN))
ARITY = {}
for _name in dir(C):
    _fn = getattr(C, _name)
    if callable(_fn) and not _name.startswith("_") and not isinstance(_fn, type):
        _sig = (_fn.__text_signature__ or "()").strip("()").split(",")
        ARITY[_name] = len([a for a in _sig if a.strip() not in ("", "/", "$module")])


@pytest.mark.parametrize("name", sorted(ARITY))
def test_entry_point_garbage(name):
    fn = getattr(C, name)

    @FUZZ
    @given(st.lists(GARBAGE, min_size=ARITY[name], max_size=ARITY[name]))
    def run(args):
        outcome(fn, *args)

    run()
    for n in {0, ARITY[name] + 1}:
        assert isinstance(outcome(fn, *([None] * n)), TypeError)


@FUZZ
@given(GARBAGE)
def test_load_plan_chunks_garbage(bucket):
    outcome(LOAD_PLAN.chunks, bucket)
    assert LOAD_PLAN.nbuckets == len(LOAD_PLAN.bucket_bytes) > 0


# --- resharding arithmetic ----------------------------------------------------------------------

SIZES = st.integers(0, 2**62)


@FUZZ
@given(st.lists(SIZES, max_size=3), st.lists(st.integers(0, 2**40), min_size=1, max_size=2),
       st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(1, 2**40)),
                min_size=1, max_size=2),
       st.lists(st.integers(0, 2**40), max_size=2))
def test_shard_layouts_extreme(shape, mesh, placements, coord):
    outcome(C.shard_layouts, shape, mesh, placements, [coord])


@FUZZ
@given(st.lists(st.integers(-1, 2**62), max_size=4), st.lists(st.booleans(), max_size=4),
       st.integers(-1, 2**62), st.integers(-1, 2**62))
def test_flat_pieces_extreme(numels, mask, shard, rank):
    outcome(C.flat_pieces, numels, mask[:len(numels)] + [False] * (len(numels) - len(mask)),
            shard, rank)


@FUZZ
@given(st.lists(st.integers(-1, 2**62), max_size=3), st.integers(1, 2**62))
def test_flatten_group_counts_extreme(counts, n):
    osd = {"state": {}, "param_groups": [{"params": ["a.weight"]}]}
    outcome(C.flatten_optim, CTX, osd, counts + [n])


# --- the public API with real torch -------------------------------------------------------------


def torch_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


TORCH_LEAVES = st.one_of(SCALARS, st.builds(lambda n: torch.zeros(n), st.integers(0, 4)),
                         st.just(torch.zeros(4, 3)), st.builds(object))


@FUZZ
@given(trees(TORCH_LEAVES, max_leaves=12), st.booleans(), st.booleans())
def test_public_set_hostile_state_dicts(sd, strict, flat):
    model = torch_model()
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    opts = StateDictOptions(strict=strict, flatten_optimizer_state_dict=flat)
    outcome(dcp_optim.set_model_state_dict, model, sd, options=opts)
    outcome(dcp_optim.set_optimizer_state_dict, model, optim, sd, options=opts)
    outcome(dcp_optim.set_state_dict, model, optim, model_state_dict=sd, optim_state_dict=sd,
            options=opts)


@FUZZ
@given(st.lists(st.one_of(
    st.just("missing-params"), st.just("duplicate"), st.just("non-tensor"), st.just("foreign"),
    st.just("empty"), st.just("tuple")), min_size=1, max_size=3), st.booleans())
def test_public_odd_param_groups(kinds, flat):
    model = torch_model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    params = list(model.parameters())
    for kind in kinds:
        if kind == "missing-params":
            optim.param_groups.append({"lr": 0.1})
        elif kind == "duplicate":
            optim.param_groups[0]["params"] = [*optim.param_groups[0]["params"], params[0]]
        elif kind == "non-tensor":
            optim.param_groups[0]["params"] = [*optim.param_groups[0]["params"], 3]
        elif kind == "foreign":
            optim.param_groups.append({**optim.param_groups[0], "params": [torch.zeros(2)]})
        elif kind == "empty":
            optim.param_groups.append({**optim.param_groups[0], "params": []})
        elif kind == "tuple":
            optim.param_groups[0]["params"] = tuple(optim.param_groups[0]["params"])
    opts = StateDictOptions(flatten_optimizer_state_dict=flat)
    sd = outcome(dcp_optim.get_optimizer_state_dict, model, optim, options=opts)
    if isinstance(sd, dict):
        outcome(dcp_optim.set_optimizer_state_dict, model, optim, sd, options=opts)


class ExplodingLinear(nn.Linear):
    def __init__(self, *a, when="named_parameters", **k):
        super().__init__(*a, **k)
        self.when = when

    def named_parameters(self, *a, **k):
        if self.when == "named_parameters":
            raise Boom("named_parameters exploded")
        return super().named_parameters(*a, **k)

    def get_extra_state(self):
        if self.when == "extra":
            raise Boom("get_extra_state exploded")
        return 1

    def _fqn_modifiers(self):
        if self.when == "modifiers":
            raise Boom("_fqn_modifiers exploded")
        return {}


@pytest.mark.parametrize("when", ["named_parameters", "extra", "modifiers", "never"])
def test_public_modules_whose_methods_raise(when):
    model = nn.Sequential(nn.Linear(3, 3), ExplodingLinear(3, 2, when=when))
    optim = torch.optim.Adam(model.parameters())
    for fn, args in [(dcp_optim.get_model_state_dict, (model,)),
                     (dcp_optim.get_optimizer_state_dict, (model, optim)),
                     (dcp_optim.get_state_dict, (model, optim))]:
        result = outcome(fn, *args)
        if isinstance(result, Exception):
            assert isinstance(result, Boom) and "exploded" in str(result)
