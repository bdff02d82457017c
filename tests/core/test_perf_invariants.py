"""Invariants behind the performance shortcuts (issue 7).

The model walk is replayed from a trace while the model is unchanged
(``dcp_optim._engine.checks.walk``; csrc/walk_cache.c, "Replaying a walk").  These tests
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


def test_model_getter_name_sets_are_per_trace_and_bounded():
    """get_model_state_dict's canonical-key check caches one name set per
    walk trace: after the tree changes (a new trace) the getter still
    returns what upstream's does, and the cache stays bounded."""
    from torch.distributed.checkpoint import state_dict as upstream

    from dcp_optim._engine import model as _model

    model = tree()
    for _ in range(2):
        assert list(dcp_optim.get_model_state_dict(model)) == list(upstream.get_model_state_dict(model))
    model[0].add_module("extra", nn.Linear(3, 3))
    assert list(dcp_optim.get_model_state_dict(model)) == list(upstream.get_model_state_dict(model))
    index = _verify.walk(model, "_fqn_modifiers")
    assert _model._CANONICAL_NAMES[id(index.trace)] == (index.trace, frozenset(index.raw_names))
    for m in [nn.Linear(2, 2) for _ in range(_model._CANONICAL_NAMES_MAX + 3)]:
        dcp_optim.get_model_state_dict(m)
    assert len(_model._CANONICAL_NAMES) <= _model._CANONICAL_NAMES_MAX


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


# --- sharded loads that write nothing (the DCP resume) -------------------------------


class _CopyCounter:
    """Counts aten.copy_ dispatched inside the ``with`` block."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        counter.copies = 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten.copy_.default:
                    counter.copies += 1
                return func(*args, **(kwargs or {}))

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    model.register_buffer("steps", torch.zeros(2))
    return model


def _versions(model: nn.Module) -> list[int]:
    return [t._version for t in model.state_dict(keep_vars=True).values()]


def test_a_load_of_the_models_own_views_copies_nothing():
    """set_model_state_dict of what get_model_state_dict returned (views
    of the live tensors, as after dcp.load into them): torch copies every
    tensor onto itself; dcp_optim copies nothing, and leaves the same
    version counters and report."""
    theirs, ours = _mlp(), _mlp()
    v_theirs, v_ours = _versions(theirs), _versions(ours)
    with _CopyCounter() as torch_load:
        report_theirs = theirs.load_state_dict(theirs.state_dict())
    with _CopyCounter() as our_load:
        report_ours = dcp_optim.set_model_state_dict(ours, dcp_optim.get_model_state_dict(ours))
    n = len(v_theirs)
    assert torch_load.copies == n and our_load.copies == 0
    assert tuple(report_ours) == tuple(report_theirs) == ([], [])
    assert [a - b for a, b in zip(_versions(ours), v_ours)] == [1] * n
    assert [a - b for a, b in zip(_versions(theirs), v_theirs)] == [1] * n


@pytest.mark.parametrize("change", ["other_tensor", "other_view", "missing_key"])
def test_a_load_of_other_data_goes_through_torchs_copies(change):
    """One entry that is not the live tensor's own data -- another tensor
    of equal values, a view of other geometry, a missing key -- and the
    load is torch's: every present tensor copied."""
    model = _mlp()
    sd = dcp_optim.get_model_state_dict(model)
    if change == "other_tensor":
        sd["0.bias"] = sd["0.bias"].clone() + 1
    elif change == "other_view":
        sd["0.bias"] = torch.ones(8)[::2]
    else:
        del sd["steps"]
    expected = {k: v.clone() for k, v in sd.items()}
    with _CopyCounter() as load:
        report = dcp_optim.set_model_state_dict(
            model, sd, options=dcp_optim.StateDictOptions(strict=change != "missing_key")
        )
    assert load.copies == len(sd)
    live = model.state_dict()
    for key, value in expected.items():
        assert torch.equal(live[key], value), key
    assert list(report.missing_keys) == (["steps"] if change == "missing_key" else [])


def test_a_model_with_its_own_load_hooks_is_loaded_by_torch():
    """A load hook that is not FSDP2's sees the load torch would make."""
    model = _mlp()
    calls = []
    model[2].register_load_state_dict_post_hook(lambda module, keys: calls.append(module))
    with _CopyCounter() as load:
        dcp_optim.set_model_state_dict(model, dcp_optim.get_model_state_dict(model))
    assert calls == [model[2]] and load.copies == len(model.state_dict())


# --- the flat getter's key strings, reused while the model is unchanged ------
#
# csrc/flat.c ("Reusing keys"): the flattened optimizer dict's key strings
# are kept per model between calls and reused where their FQN and state or
# group key are unchanged.  A stale key would be a silently wrong result,
# so after every kind of change the output is compared with upstream's.


def _flat_model():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)),
        nn.Linear(3, 2),
    )
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    _step(model, optim)
    return model, optim


def _step(model, optim):
    optim.zero_grad()
    out = model(torch.ones(2, 3))
    out.sum().backward()
    optim.step()


def _flat_pair(model, optim):
    import torch.distributed.checkpoint.state_dict as upstream

    ours = dcp_optim.get_optimizer_state_dict(
        model, optim, options=dcp_optim.StateDictOptions(flatten_optimizer_state_dict=True)
    )
    theirs = upstream.get_optimizer_state_dict(
        model, optim, options=upstream.StateDictOptions(flatten_optimizer_state_dict=True)
    )
    assert list(ours) == list(theirs)  # keys and order
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert ours[key] is value, key
        else:
            assert type(ours[key]) is type(value) and ours[key] == value, key
    return ours


def _same_key_objects(a, b) -> set[str]:
    """The keys of ``b`` that are the very string objects of ``a``."""
    olds = {k: k for k in a}
    return {k for k in b if olds.get(k) is k}


def test_flat_getter_reuses_its_key_strings():
    model, optim = _flat_model()
    first = _flat_pair(model, optim)
    second = _flat_pair(model, optim)
    assert second is not first
    assert _same_key_objects(first, second) == set(second)
    # what the cache holds: strings in tuples (untracked by the GC), no value;
    # a collection untracks a tuple once its items are, so inner ones first
    gc.collect()
    gc.collect()
    from dcp_optim._engine import optim as _optim

    keys = _optim._FLAT_KEYS[id(model)][1]
    assert set(keys) == {fqn for fqn, _ in model.named_parameters()}
    for record in keys.values():
        assert not gc.is_tracked(record)
        assert all(type(s) is str for part in record for s in part)


def _add_group(model, optim):
    extra = nn.Linear(2, 2)
    model.add_module("extra", extra)
    optim.add_param_group({"params": list(extra.parameters()), "lr": 0.5, "weight_decay": 0.1})


def _rename_module(model, optim):
    child = model._modules.pop("1")
    model._modules["head"] = child


def _add_state_key(model, optim):
    optim.state[model[1].weight]["marker"] = torch.zeros(1)


def _drop_state_key(model, optim):
    del optim.state[model[1].bias]["exp_avg_sq"]


def _reorder_state_keys(model, optim):
    st = optim.state[model[0][0].weight]
    items = list(st.items())
    st.clear()
    st.update(reversed(items))


def _add_group_key(model, optim):
    optim.param_groups[0]["my_hparam"] = 3


def _new_group_value(model, optim):
    optim.param_groups[0]["lr"] = 0.25


def _swap_param_order(model, optim):
    group = optim.param_groups[0]
    group["params"] = list(reversed(group["params"]))


FLAT_CHANGES = [
    _add_group,
    _rename_module,
    _add_state_key,
    _drop_state_key,
    _reorder_state_keys,
    _add_group_key,
    _new_group_value,
    _swap_param_order,
]


@pytest.mark.parametrize("change", FLAT_CHANGES, ids=lambda f: f.__name__.strip("_"))
def test_flat_getter_after_a_change_equals_upstream(change):
    model, optim = _flat_model()
    before = _flat_pair(model, optim)
    _flat_pair(model, optim)
    change(model, optim)
    if change is _add_group:
        _step(model, optim)  # state for the new parameters (no pristine-state rules involved)
    after = _flat_pair(model, optim)  # equal to upstream: nothing stale
    again = _flat_pair(model, optim)
    assert _same_key_objects(after, again) == set(again)  # the new keys are recorded
    # keys whose FQN and state/group key did not change are still reused
    # (reordered ones are rebuilt: records are compared position by position)
    unchanged = set(before) & set(after)
    if change is _reorder_state_keys:
        unchanged = {k for k in unchanged if not k.startswith("state.0.0.weight.")}
    assert unchanged and _same_key_objects(before, after) >= unchanged


def test_flat_key_cache_keeps_no_model_alive_and_is_bounded():
    from dcp_optim._engine import optim as _optim

    model, optim = _flat_model()
    _flat_pair(model, optim)
    ref = weakref.ref(model)
    key = id(model)
    assert key in _optim._FLAT_KEYS
    del model, optim
    gc.collect()
    assert ref() is None and key not in _optim._FLAT_KEYS
    models = [_flat_model() for _ in range(_optim._FLAT_KEYS_MAX + 3)]
    for m, o in models:
        _flat_pair(m, o)
    assert len(_optim._FLAT_KEYS) <= _optim._FLAT_KEYS_MAX


# --- optimizer loads of the optimizer's own state (the DCP resume) -------------


class _ToCounter:
    """Counts Tensor.to calls inside the ``with`` block (the install's
    cast of every state tensor; a no-op cast dispatches nothing, so no
    dispatch mode sees it)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = torch.Tensor.to

        def to(tensor, *args, **kwargs):
            self.calls += 1
            return real(tensor, *args, **kwargs)

        self._patch = lambda: monkeypatch.setattr(torch.Tensor, "to", to)
        self._undo = monkeypatch.undo

    def __enter__(self):
        self._patch()
        return self

    def __exit__(self, *exc):
        self._undo()


def _stepped(**adam):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    optim = torch.optim.Adam(model.parameters(), lr=0.1, **adam)
    model(torch.randn(5, 3)).sum().backward()
    optim.step()
    return model, optim


def _state_ids(optim) -> list[list[int]]:
    return [[id(v) for v in s.values()] for s in optim.state.values()]


def _assert_same_state(a, b) -> None:
    """Equal nested state, tensors bit for bit with dtype and device."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.device, a.shape) == (b.dtype, b.device, b.shape)
        assert torch.equal(a, b), (a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _assert_same_state(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same_state(x, y)
    else:
        assert a == b, (a, b)


def _next_step(model, optim) -> list[torch.Tensor]:
    optim.zero_grad()
    torch.manual_seed(1)
    model(torch.randn(5, 3)).sum().backward()
    optim.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("adam", [{}, {"amsgrad": True}, {"fused": True}], ids=["adam", "amsgrad", "fused"])
def test_an_optimizer_load_of_its_own_state_casts_nothing(monkeypatch, adam):
    """set_optimizer_state_dict of what get_optimizer_state_dict returned
    (the optimizer's own state tensors, as after dcp.load into them):
    torch's load casts every state tensor (a no-op cast, which returns it);
    dcp_optim proves that and casts none.  Same tensors, same
    optimizer.state_dict(), same next step as torch's own load."""
    theirs, t_opt = _stepped(**adam)
    ours, o_opt = _stepped(**adam)
    ids_theirs, ids_ours = _state_ids(t_opt), _state_ids(o_opt)
    n = sum(len(s) for s in t_opt.state.values())
    with _ToCounter(monkeypatch) as torch_load:
        t_opt.load_state_dict(t_opt.state_dict())
    with _ToCounter(monkeypatch) as our_load:
        dcp_optim.set_optimizer_state_dict(ours, o_opt, dcp_optim.get_optimizer_state_dict(ours, o_opt))
    # torch's _cast leaves `step` alone unless fused or capturable
    assert torch_load.calls == n - (0 if adam.get("fused") else len(t_opt.state))
    assert our_load.calls == 0
    assert _state_ids(t_opt) == ids_theirs and _state_ids(o_opt) == ids_ours
    _assert_same_state(o_opt.state_dict(), t_opt.state_dict())
    for a, b in zip(_next_step(ours, o_opt), _next_step(theirs, t_opt)):
        assert torch.equal(a, b)
    _assert_same_state(o_opt.state_dict(), t_opt.state_dict())


@pytest.mark.parametrize("change", ["clone", "other_dtype", "one_entry"])
def test_an_optimizer_load_of_other_state_is_cast(monkeypatch, change):
    """Loaded state that is not the optimizer's own (DCP's fresh tensors, a
    dtype to cast, one parameter's entry replaced) is cast as before:
    at least the replaced tensors go through .to, with torch's result."""
    theirs, t_opt = _stepped()
    ours, o_opt = _stepped()
    osd = dcp_optim.get_optimizer_state_dict(ours, o_opt)
    tsd = t_opt.state_dict()
    fqns = list(osd["state"])
    if change == "clone":
        osd["state"] = {f: {k: v.clone() for k, v in s.items()} for f, s in osd["state"].items()}
        tsd["state"] = {i: {k: v.clone() for k, v in s.items()} for i, s in tsd["state"].items()}
        replaced = sum(len(s) - 1 for s in osd["state"].values())
    elif change == "other_dtype":
        osd["state"][fqns[0]] = dict(osd["state"][fqns[0]], exp_avg=osd["state"][fqns[0]]["exp_avg"].double())
        tsd["state"][0] = dict(tsd["state"][0], exp_avg=tsd["state"][0]["exp_avg"].double())
        replaced = 1
    else:
        osd["state"][fqns[0]] = {k: v.clone() for k, v in osd["state"][fqns[0]].items()}
        tsd["state"][0] = {k: v.clone() for k, v in tsd["state"][0].items()}
        replaced = 2
    t_opt.load_state_dict(tsd)
    with _ToCounter(monkeypatch) as our_load:
        dcp_optim.set_optimizer_state_dict(ours, o_opt, osd)
    assert our_load.calls >= replaced
    _assert_same_state(o_opt.state_dict(), t_opt.state_dict())
    for a, b in zip(_next_step(ours, o_opt), _next_step(theirs, t_opt)):
        assert torch.equal(a, b)


def test_an_optimizer_load_under_a_torch_function_mode_is_cast(monkeypatch):
    """A __torch_function__ mode could intercept the cast's .to(): under
    one, the optimizer's own state is cast as torch's load would, and the
    mode sees those calls."""
    from torch.overrides import TorchFunctionMode

    seen = []

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") == "to":
                seen.append(func)
            return func(*args, **(kwargs or {}))

    model, optim = _stepped()
    osd = dcp_optim.get_optimizer_state_dict(model, optim)
    ids = _state_ids(optim)
    with _ToCounter(monkeypatch) as load, Mode():
        dcp_optim.set_optimizer_state_dict(model, optim, osd)
    n = sum(len(s) for s in optim.state.values())
    assert load.calls >= n and len(seen) >= n
    assert _state_ids(optim) == ids
