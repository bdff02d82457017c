"""Invariants behind the performance shortcuts (issue 7).

The model walk is replayed from a trace while the model is unchanged
(``dcp_optim._engine.checks.walk``; csrc/walk.c, "Replaying a walk").  These tests
pin down that a replay is indistinguishable from a fresh walk after every
kind of change to the module tree, that trees whose walk could run user
code are never replayed, and that the cache keeps no model alive.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn as nn

import dcp_optim
from dcp_optim._engine import checks as _verify
from dcp_optim._engine.core import C, context

FIELDS = (
    "raw_names",
    "fqns",
    "load_keys",
    "kinds",
    "tensor_fqns",
    "tensor_loads",
    "np_names",
    "np_fqns",
    "custom_load",
)
OBJECTS = ("values", "tensors", "np_params", "fsdp1_modules")


def fresh(model: nn.Module, modifiers: str = "_fqn_modifiers"):
    return C.walk_model(context(), model, modifiers)


def assert_same(a, b) -> None:
    for name in FIELDS:
        assert getattr(a, name) == getattr(b, name), name
    for name in OBJECTS:
        x, y = getattr(a, name), getattr(b, name)
        assert len(x) == len(y), name
        for u, v in zip(x, y):
            if isinstance(u, torch.Tensor) or isinstance(u, nn.Module):
                assert u is v, name
            else:
                assert type(u) is type(v), name
    assert a.model is b.model


def cached_walk(model: nn.Module):
    return _verify.walk(model, "_fqn_modifiers")


def tree() -> nn.Module:
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.ReLU())
    model = nn.Sequential(inner, nn.Linear(3, 2), nn.LSTM(2, 2))
    model.register_buffer("steps", torch.zeros(1))
    model.register_buffer("scratch", torch.zeros(2), persistent=False)
    return model


@pytest.fixture(autouse=True)
def _clean_cache():
    _verify._WALK_TRACES.clear()
    yield
    _verify._WALK_TRACES.clear()


def test_second_walk_is_a_replay_equal_to_a_walk():
    model = tree()
    first = cached_walk(model)
    assert first.trace is not None
    second = cached_walk(model)
    assert second.trace is first.trace  # replayed, not walked
    assert_same(second, fresh(model))
    assert_same(second, first)


def _replace_param(m):
    m[1].weight = nn.Parameter(torch.randn(2, 3))


def _add_child(m):
    m.add_module("extra", nn.Linear(2, 2))


def _delete_child(m):
    del m[0][2]


def _rename_child(m):
    child = m._modules.pop("1")
    m._modules["head"] = child


def _reorder_children(m):
    items = list(m._modules.items())
    m._modules.clear()
    m._modules.update(reversed(items))


def _make_non_persistent(m):
    m._non_persistent_buffers_set.add("steps")


def _make_persistent(m):
    m._non_persistent_buffers_set.discard("scratch")


def _tie(m):
    m[1].bias = m[0][0].bias  # noqa: not a shape check, just identity


def _param_to_none(m):
    m[1].register_parameter("bias", None)


def _buffer_to_none(m):
    m.steps = None


def _share_module(m):
    m.add_module("alias", m[0][0])


def _replace_child_same_name(m):
    m[1] = nn.Linear(3, 2)


def _hook_on_instance(m):
    m[0]._fqn_modifiers = lambda: {"x": "0"}


def _load_pre_hook(m):
    m[1]._register_load_state_dict_pre_hook(lambda *a, **k: None)


def _custom_named_parameters(m):
    class Custom(nn.Linear):
        def named_parameters(self, *args, **kwargs):
            return super().named_parameters(*args, **kwargs)

    m[1].__class__ = Custom


def _dict_subclass_container(m):
    class Params(dict):
        pass

    m[1]._parameters = Params(m[1]._parameters)


def _property_container(m):
    class Sneaky(nn.Linear):
        @property
        def _buffers(self):  # noqa: user code on every access
            return self.__dict__["_hidden_buffers"]

    lin = m[1]
    lin.__dict__["_hidden_buffers"] = lin.__dict__.pop("_buffers")
    lin.__class__ = Sneaky


def _extra_state_on_class(m):
    class WithExtra(nn.Linear):
        def get_extra_state(self):
            return {"v": 1}

        def set_extra_state(self, state):
            pass

    m[1].__class__ = WithExtra


def _non_str_key(m):
    class Key(str):
        pass

    lin = m[1]
    w = lin._parameters.pop("weight")
    lin._parameters[Key("weight")] = w


MUTATIONS = [
    _replace_param,
    _add_child,
    _delete_child,
    _rename_child,
    _reorder_children,
    _make_non_persistent,
    _make_persistent,
    _tie,
    _param_to_none,
    _buffer_to_none,
    _share_module,
    _replace_child_same_name,
    _hook_on_instance,
    _load_pre_hook,
    _custom_named_parameters,
    _dict_subclass_container,
    _property_container,
    _extra_state_on_class,
    _non_str_key,
]


@pytest.mark.parametrize("mutate", MUTATIONS, ids=lambda f: f.__name__.strip("_"))
def test_replay_after_a_change_equals_a_fresh_walk(mutate):
    model = tree()
    cached_walk(model)
    cached_walk(model)
    mutate(model)
    after = cached_walk(model)
    assert_same(after, fresh(model))
    again = cached_walk(model)  # whatever was cached now must be right too
    assert_same(again, fresh(model))


@pytest.mark.parametrize(
    "mutate",
    [
        _hook_on_instance,
        _custom_named_parameters,
        _dict_subclass_container,
        _property_container,
        _extra_state_on_class,
        _non_str_key,
    ],
    ids=lambda f: f.__name__.strip("_"),
)
def test_trees_whose_walk_runs_user_code_are_not_replayed(mutate):
    model = tree()
    mutate(model)
    assert fresh(model).trace is None


def test_class_patched_after_caching_is_seen():
    class Block(nn.Linear):
        pass

    model = nn.Sequential(Block(2, 2), nn.Linear(2, 2))
    cached_walk(model)
    Block.get_extra_state = lambda self: 1
    Block.set_extra_state = lambda self, state: None
    try:
        after = cached_walk(model)
        assert_same(after, fresh(model))
        assert "0._extra_state" in after.fqns
    finally:
        del Block.get_extra_state
        del Block.set_extra_state
    assert_same(cached_walk(model), fresh(model))


def test_modifiers_name_is_part_of_the_key():
    class Hidden(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(2, 2)

        def my_mods(self):
            return {"inner": "inner"}

    model = nn.Sequential(Hidden())
    a = _verify.walk(model, "_fqn_modifiers")
    b = _verify.walk(model, "my_mods")
    assert_same(b, fresh(model, "my_mods"))
    assert a.fqns != b.fqns


def test_cache_keeps_no_model_alive():
    model = tree()
    optim = torch.optim.Adam(model.parameters())
    dcp_optim.get_optimizer_state_dict(model, optim)
    dcp_optim.get_optimizer_state_dict(model, optim)
    assert id(model) in _verify._WALK_TRACES
    ref = weakref.ref(model)
    param_ref = weakref.ref(next(model.parameters()))
    del model, optim
    gc.collect()
    assert ref() is None and param_ref() is None
    assert not _verify._WALK_TRACES


def test_cache_is_bounded():
    models = [nn.Linear(2, 2) for _ in range(_verify._WALK_TRACES_MAX + 5)]
    for m in models:
        cached_walk(m)
    assert len(_verify._WALK_TRACES) == _verify._WALK_TRACES_MAX
    assert id(models[-1]) in _verify._WALK_TRACES


def test_api_calls_leave_the_trace_as_a_walk_builds_it():
    model = tree()
    optim = torch.optim.Adam(model.parameters())
    for flat in (False, True):
        opts = dcp_optim.StateDictOptions(flatten_optimizer_state_dict=flat)
        msd, osd = dcp_optim.get_state_dict(model, optim, options=opts)
        dcp_optim.set_state_dict(
            model, optim, model_state_dict=msd, optim_state_dict=osd, options=opts
        )
        dcp_optim.set_model_state_dict(model, msd, options=opts)
        dcp_optim.set_optimizer_state_dict(model, optim, osd, options=opts)
    trace = _verify._WALK_TRACES[id(model)][1]
    replayed = trace.replay(context(), model, "_fqn_modifiers")
    assert replayed is not None
    assert_same(replayed, fresh(model))


def test_getters_allocate_nothing_the_cyclic_gc_counts():
    """The getters build their output without allocating GC-tracked
    temporaries per parameter: each such allocation counts towards a
    young-generation collection, and every collection traverses the whole
    output dict built so far (with 10k parameters, flattening triggered 14
    collections that cost a third of its time)."""
    layers = [nn.Linear(2, 2) for _ in range(1500)]
    model = nn.Sequential(*[nn.Sequential(*layers[i : i + 25]) for i in range(0, len(layers), 25)])
    optim = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optim.step()
    flat = dcp_optim.StateDictOptions(flatten_optimizer_state_dict=True)
    nested = dcp_optim.get_optimizer_state_dict(model, optim)
    dcp_optim.get_optimizer_state_dict(model, optim, options=flat)  # warm caches
    starts = []

    def count(phase, info):
        if phase == "start":
            starts.append(info["generation"])

    gc.collect()
    gc.callbacks.append(count)
    try:
        C.flatten_optim(context(), nested, [1])
        flattened = starts[:]
        dcp_optim.get_optimizer_state_dict(model, optim)
        dcp_optim.get_optimizer_state_dict(model, optim, options=flat)
    finally:
        gc.callbacks.remove(count)
    assert flattened == [], f"flatten_optim: {len(flattened)} collections"
    assert starts == [], f"get_optimizer_state_dict: {len(starts)} collections"
