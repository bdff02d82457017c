"""The C core's exception contract (docs/architecture.md, "The exception
contract"): every error a caller can cause through the public API with bad
input is raised with a class of ``dcp_optim.errors`` that is also the
built-in exception upstream raises in that case, with a message naming the
offending FQN, state key or position.

Each C raise path converted to the package's classes is driven here once,
through the C entry point with the torch-free fakes (so no check of the
Python layer in front of it hides it), and where the public API reaches the
same path, through dcp_optim and upstream side by side.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed.checkpoint.state_dict as upstream
import torch.nn as nn

import dcp_optim
from dcp_optim import errors

from .refleak import fakes
from .refleak.fakes import FakeModule, FakeOptimizer, FakeParameter, make_context, small_model

C = dcp_optim._dcp_optim
CTX = make_context(C)
MODEL = small_model()
INDEX = C.walk_model(CTX, MODEL, "_fqn_modifiers")
PARAMS = fakes.params_of(MODEL)
FQNS = ["a.weight", "a.bias", "b.weight", "b.bias"]


def _optim(groups, state=None):
    opt = FakeOptimizer([])
    opt.param_groups = groups
    if state is not None:
        opt.state = state
    return opt


class _NoState:
    param_groups = [{"params": []}]


class _BadChildren(FakeModule):
    def named_children(self):
        yield "not a pair"


class _BadItems(dict):
    """A mapping whose items() yields no pairs."""

    def items(self):
        return [("a", 1, 2)]


class _ShrinkingState(dict):
    """Optimizer state whose items() drops a parameter from the groups."""

    def __init__(self, optim, entries):
        super().__init__(entries)
        self.optim = optim

    def items(self):
        self.optim.param_groups[0]["params"].pop()
        return list(dict.items(self))


def _groups_changed():
    opt = FakeOptimizer([PARAMS[:2]])
    # state out of parameter order, so the lookup needs the identity map
    opt.state = _ShrinkingState(opt, {PARAMS[1]: {"x": 1}, PARAMS[0]: {"x": 1}})
    return C.optim_pack(INDEX, [opt], [None], {}, [])


def _module(**containers):
    m = FakeModule()
    for name, items in containers.items():
        getattr(m, name).update(items)
    return m


def _view(groups):
    return C.view_from_nested({"state": {}, "param_groups": groups})


def _schema_check():
    """A saved state that lacks a key the optimizer's schema expects."""
    opt = FakeOptimizer([PARAMS[:1]])
    expected = [{"step": 1, "exp_avg": 2}]
    sd = {"state": {"a.weight": {"step": 1}}, "param_groups": [{"params": ["a.weight"]}]}
    return C.prepare_install(CTX, opt, sd, expected)


def _held_shard_mismatch():
    """A loaded DTensor-parameter state whose local shape fits neither the
    local shard nor the global shape."""
    root = FakeModule()
    root._parameters["w"] = fakes.FakeDTensor((4, 2))
    ix = C.walk_model(CTX, root, "_fqn_modifiers")
    state = {"w": {"exp_avg": fakes.FakeTensor((5, 2))}}
    return C.optim_state_jobs(ix, state, fakes.FakeDTensor, 1, fakes.FakeDTensor.from_local)


Meta = collections.namedtuple("Meta", "shape dtype")

# (id, call, built-in type upstream raises in that situation, texts the
# message must contain)
SITES = [
    # flat.c: flattening an optimizer state dict
    ("flatten/osd-not-dict", lambda: C.flatten_optim(CTX, [], None), TypeError, ["list"]),
    ("flatten/no-param-groups", lambda: C.flatten_optim(CTX, {"state": {}}, None), KeyError,
     ["'param_groups'"]),
    ("flatten/group-not-dict",
     lambda: C.flatten_optim(CTX, {"state": {}, "param_groups": [1]}, None), TypeError,
     ["param_groups[0]"]),
    ("flatten/group-without-params",
     lambda: C.flatten_optim(CTX, {"state": {}, "param_groups": [{"lr": 1}]}, None), KeyError,
     ["param_groups[0]", "'params'"]),
    ("flatten/params-not-fqns",
     lambda: C.flatten_optim(CTX, {"state": {}, "param_groups": [{"params": [7]}]}, None),
     TypeError, ["param_groups[0]['params']", "7"]),
    # flat.c: unflattening
    ("unflatten/not-dict", lambda: C.unflatten_optim(INDEX, []), TypeError, ["list"]),
    ("unflatten/key-not-str", lambda: C.unflatten_optim(INDEX, {("state", "a.weight"): 1}),
     TypeError, ["('state', 'a.weight')"]),
    ("unflatten/nests-under-leaf",
     lambda: C.unflatten_optim(INDEX, {"state.a.weight.x": 1, "state.a.weight.x.y": 2}),
     ValueError, ["state.a.weight.x.y"]),
    # fqn.c, model_load.c: model state dicts
    ("canonicalize/key-not-str",
     lambda: C.canonicalize_model_keys(CTX, MODEL, {3: 1}, "_fqn_modifiers"), TypeError, ["3"]),
    ("model-load/not-dict", lambda: C.rename_for_load(INDEX, [], True, True, True), TypeError,
     ["list"]),
    ("model-load/key-not-str",
     lambda: C.rename_for_load(INDEX, {"a.weight": 1, 5: 1}, True, True, True), TypeError,
     ["int key 5"]),
    ("model-check/not-dict", lambda: C.check_model_load(INDEX, [], True, True), TypeError,
     ["state_dict"]),
    # optim.c: reading the optimizers (get side)
    ("pack/foreign-parameter",
     lambda: C.optim_pack(INDEX, [FakeOptimizer([[FakeParameter((7,))]])], [None], {}, []),
     KeyError, ["param group 0", "(7,)", "not a parameter of the model"]),
    ("pack/no-param-groups", lambda: C.optim_pack(INDEX, [object()], [None], {}, []), TypeError,
     ["'param_groups'"]),
    ("pack/group-not-dict", lambda: C.optim_pack(INDEX, [_optim([1])], [None], {}, []),
     TypeError, ["param group 0"]),
    ("pack/group-without-params",
     lambda: C.optim_pack(INDEX, [_optim([{"lr": 1}])], [None], {}, []), KeyError,
     ["param group 0", "'params'"]),
    ("pack/state-outside-groups",
     lambda: C.optim_pack(INDEX, [_optim([{"params": PARAMS[:1]}], {PARAMS[1]: {"x": 1}})],
                          [None], {}, []), KeyError, ["a.bias"]),
    ("pack/no-state", lambda: C.optim_pack(INDEX, [_NoState()], [None], {}, []), TypeError,
     ["'state'"]),
    ("missing/group-without-params", lambda: C.optim_missing(INDEX, _optim([{"lr": 1}])),
     KeyError, ["'params'"]),
    ("remap/not-dict", lambda: C.optim_remap(INDEX, FakeOptimizer([PARAMS]), []), TypeError,
     ["list"]),
    ("remap/no-param-groups", lambda: C.optim_remap(INDEX, FakeOptimizer([PARAMS]), {"state": {}}),
     KeyError, ["'param_groups'"]),
    ("remap/unknown-state-key",
     lambda: C.optim_remap(INDEX, FakeOptimizer([PARAMS]),
                           {"state": {99: {}}, "param_groups": [{"params": [0, 1, 2, 3]}]}),
     KeyError, ["99"]),
    ("remap/param-groups-not-list",
     lambda: C.optim_remap(INDEX, FakeOptimizer([PARAMS]), {"state": {}, "param_groups": 5}),
     TypeError, ["'param_groups'"]),
    ("remap/group-without-params",
     lambda: C.optim_remap(INDEX, FakeOptimizer([PARAMS]),
                           {"state": {}, "param_groups": [{"lr": 1}]}), KeyError,
     ["param group 0", "'params'"]),
    ("remap/unknown-param-id",
     lambda: C.optim_remap(INDEX, FakeOptimizer([PARAMS]),
                           {"state": {}, "param_groups": [{"params": [0, 1, 2, 77]}]}),
     KeyError, ["77"]),
    # split.c: loading optimizer state (set side)
    ("view/not-dict", lambda: C.view_from_nested([]), TypeError, ["list"]),
    ("view/state-not-dict", lambda: C.view_from_nested({"state": [], "param_groups": []}),
     TypeError, ["['state']"]),
    ("view/group-not-dict", lambda: C.view_from_nested({"state": {}, "param_groups": [1]}),
     TypeError, ["param_groups[0]"]),
    ("split/foreign-parameter",
     lambda: C.split_optim(INDEX, [FakeOptimizer([[FakeParameter((7,))]])],
                           _view([{"params": FQNS}]), [None]),
     KeyError, ["param group 0", "not a parameter of the model"]),
    ("split/group-without-params",
     lambda: C.split_optim(INDEX, [_optim([{"lr": 1}])], _view([{"params": FQNS}]), [None]),
     KeyError, ["param group 0", "'params'"]),
    ("install/group-without-params",
     lambda: C.prepare_install(CTX, FakeOptimizer([PARAMS]),
                               {"state": {}, "param_groups": [{"lr": 1}]}, None),
     KeyError, ["param group 0", "'params'"]),
    ("install/missing-state-key", _schema_check, ValueError, ["a.weight", "exp_avg"]),
    # walk.c: the module tree
    ("walk/member-name-not-str",
     lambda: C.walk_model(CTX, _module(_parameters={1: FakeParameter()}), "_fqn_modifiers"),
     TypeError, ["got int"]),
    ("walk/child-name-not-str",
     lambda: C.walk_model(CTX, _module(_modules={("x",): FakeModule()}), "_fqn_modifiers"),
     TypeError, ["got tuple"]),
    ("walk/named-children-not-pairs",
     lambda: C.walk_model(CTX, _BadChildren(), "_fqn_modifiers"), ValueError,
     ["named_children()", "_BadChildren", "10 values"]),
    ("walk/member-name-not-str-is-attribute-error",
     lambda: C.walk_model(CTX, _module(_buffers={2: FakeParameter()}), "_fqn_modifiers"),
     AttributeError, ["got int"]),
    # module.c: the shared sequence and mapping helpers
    ("as-list/params-not-sequence",
     lambda: C.flatten_optim(CTX, {"state": {}, "param_groups": [{"params": 5}]}, None),
     TypeError, ["param_group['params']", "not int"]),
    ("items/not-pairs",
     lambda: C.flatten_optim(CTX, {"state": _BadItems(x=1), "param_groups": []}, None),
     ValueError, ["items() of _BadItems", "3 values"]),
    # flat.c: a flattened key that would replace nested state
    ("unflatten/collides-with-nested",
     lambda: C.unflatten_optim(INDEX, {"state.a.weight.x.y": 1, "state.a.weight.x": 2}),
     ValueError, ["'state.a.weight.x'", "collides"]),
    # optim.c: the groups' params lists changed while the state was read
    ("pack/groups-changed", _groups_changed, RuntimeError, ["param groups changed"]),
    # gather.c, full_load.c: DTensors the full gather or load cannot take
    ("gather/partial",
     lambda: C.plan_gather([fakes.FakeDTensor((4, 2), placements=(fakes.Partial(),))],
                           fakes.FakeDTensor, fakes.PLACEMENT_CLASSES, 1 << 20),
     ValueError, ["Partial"]),
    ("gather/placements-vs-mesh",
     lambda: C.plan_gather([fakes.FakeDTensor((4, 2), mesh=fakes.Mesh((2, 2), (0, 0)))],
                           fakes.FakeDTensor, fakes.PLACEMENT_CLASSES, 1 << 20),
     ValueError, ["placements do not match its mesh"]),
    ("full-load/rank-not-in-mesh",
     lambda: C.plan_full_load(
         [(fakes.FakeTensor((4, 2)), fakes.FakeDTensor((4, 2), mesh=fakes.Mesh((2,), None)),
           "cpu")], fakes.FakeDTensor, fakes.PLACEMENT_CLASSES, 1 << 20,
         lambda *a, **k: fakes.FakeTensor((8,)), True),
     ValueError, ["not part of the tensor's device mesh"]),
    ("full-load/placements-vs-mesh",
     lambda: C.plan_full_load(
         [(fakes.FakeTensor((4, 2)),
           fakes.FakeDTensor((4, 2), mesh=fakes.Mesh((2, 2), (0, 0))), "cpu")],
         fakes.FakeDTensor, fakes.PLACEMENT_CLASSES, 1 << 20,
         lambda *a, **k: fakes.FakeTensor((8,)), True),
     ValueError, ["placements do not match its mesh"]),
    # load_jobs.c: broadcast and DTensor optimizer state
    ("broadcast/missing-key",
     lambda: C.broadcast_jobs({"w": Meta((2,), fakes.FLOAT32)}, {}, {}, "cpu",
                              fakes.FakeDTensor, fakes.FakeTensor),
     KeyError, ["w"]),
    ("optim-state/local-shape", _held_shard_mismatch, ValueError, ["w", "exp_avg"]),
]


@pytest.mark.parametrize("site", SITES, ids=[s[0] for s in SITES])
def test_c_raise_path_uses_the_package_classes(site):
    _, call, builtin, texts = site
    with pytest.raises(errors.DcpOptimError) as info:
        call()
    assert isinstance(info.value, builtin), type(info.value).__mro__
    message = str(info.value)
    for text in texts:
        assert text in message, (text, message)


# --- the same paths through the public API, beside upstream ----------------------------------


def _trained():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def _stray_state(api, model, optim):
    optim.state[nn.Parameter(torch.zeros(1))] = {"x": torch.zeros(1)}
    return api.get_optimizer_state_dict(model, optim)


def _group_without_params(api, model, optim):
    optim.param_groups.append({"lr": 1.0})
    return api.get_optimizer_state_dict(model, optim)


PUBLIC = [
    ("foreign-parameter",
     lambda api, m, o: api.get_optimizer_state_dict(
         m, torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)),
     ["not a parameter of the model"]),
    ("state-outside-groups", _stray_state, ["not in any of its param groups"]),
    ("optimizer-group-without-params", _group_without_params, ["param group 1", "'params'"]),
    ("loaded-group-not-dict",
     lambda api, m, o: api.set_optimizer_state_dict(m, o, {"state": {}, "param_groups": [1]}),
     ["param_groups[0]"]),
    # upstream fails on these with AttributeError (a method the wrong type
    # lacks): ours is an OptimizerDictTypeError, a TypeError and an
    # AttributeError
    ("optimizer-group-not-dict",
     lambda api, m, o: (o.param_groups.append(5), api.get_optimizer_state_dict(m, o)),
     ["param group 1", "int"]),
    ("loaded-state-not-dict",
     lambda api, m, o: api.set_optimizer_state_dict(
         m, o, {"state": [], "param_groups": [{"params": ["0.weight", "0.bias", "1.weight",
                                                          "1.bias"], "lr": 0.1}]}),
     ["['state']", "list"]),
    ("flattened-key-not-str",
     lambda api, m, o: api.set_optimizer_state_dict(
         m, o, {1: 2}, options=api.StateDictOptions(flatten_optimizer_state_dict=True)),
     ["got 1"]),
    ("model-key-not-str",
     lambda api, m, o: api.set_model_state_dict(m, {1: torch.zeros(2)}), ["int key 1"]),
]


@pytest.mark.parametrize("case", PUBLIC, ids=[c[0] for c in PUBLIC])
def test_public_errors_are_package_classes_and_upstreams_type(case):
    _, call, texts = case
    with pytest.raises(Exception) as theirs:
        call(upstream, *_trained())
    with pytest.raises(errors.DcpOptimError) as ours:
        call(dcp_optim, *_trained())
    assert isinstance(ours.value, type(theirs.value)), (ours.value, theirs.value)
    for text in texts:
        assert text in str(ours.value), (text, str(ours.value))


def test_core_holds_the_package_classes():
    """The classes the core raises are errors.py's own (not copies): an
    ``except errors.StateDictKeyError`` catches what the C code raises."""
    with pytest.raises(errors.StateDictKeyError):
        C.optim_missing(INDEX, _optim([{"lr": 1}]))
    with pytest.raises(errors.StateDictTypeError):
        C.view_from_nested([])
    with pytest.raises(errors.StateDictValueError):
        C.unflatten_optim(INDEX, {"state.a.weight.x": 1, "state.a.weight.x.y": 2})


# --- a module's named_*() yielding no pairs, beside upstream ------------------------------------


def _yielding(method, item):
    """A model whose ``method`` (named_children, named_parameters or
    named_buffers) yields ``item`` first, then its real members."""

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("b", torch.zeros(2))

    real = getattr(nn.Module, method)

    def odd(self, *args, **kwargs):
        yield item(self)
        yield from real(self, *args, **kwargs)

    setattr(Odd, method, odd)
    return Odd()


# upstream unpacks each item (``for name, x in ...``): ValueError for the
# wrong number of values, TypeError for a non-iterable item; a non-str name
# fails its FQN lookup with AttributeError
NOT_PAIRS = [
    (method, kind, item)
    for method in ("named_children", "named_parameters", "named_buffers")
    for kind, item in (
        ("str", lambda m: "not a pair"),
        ("3-tuple", lambda m: ("x", m.lin, 3)),
        ("non-iterable", lambda m: 5),
    )
] + [
    ("named_children", "int-name", lambda m: (1, m.lin)),
    ("named_parameters", "int-name", lambda m: (1, m.lin.weight)),
]


@pytest.mark.parametrize("case", NOT_PAIRS, ids=[f"{c[0]}-{c[1]}" for c in NOT_PAIRS])
def test_named_members_not_pairs_raise_upstreams_type(case):
    method, _, item = case

    def call(api):
        model = _yielding(method, item)
        return api.get_state_dict(model, torch.optim.SGD([model.lin.weight, model.lin.bias]))

    with pytest.raises(Exception) as theirs:
        call(upstream)
    with pytest.raises(errors.DcpOptimError) as ours:
        call(dcp_optim)
    assert isinstance(ours.value, type(theirs.value)), (ours.value, theirs.value)
    assert method in str(ours.value) or "names must be str" in str(ours.value), str(ours.value)


def test_named_members_any_iterable_pair_is_accepted():
    """Unpacking takes any iterable of two, as upstream does."""
    class Lists(nn.Sequential):
        def named_children(self):
            return ([name, child] for name, child in super().named_children())

    model = Lists(nn.Linear(2, 2), nn.Linear(2, 1))
    theirs = upstream.get_model_state_dict(model)
    ours = dcp_optim.get_model_state_dict(model)
    assert list(ours) == list(theirs)


def test_partial_dtensor_full_state_dict_like_upstream(world1):
    """The native gather plan refuses Partial placements (gather/partial
    above); the public API reduces them first, as upstream's
    full_tensor() does, instead of rejecting what upstream accepts."""
    from torch.distributed.tensor import DTensor, Partial, init_device_mesh

    mesh = init_device_mesh("cpu", (1,))

    def model():
        torch.manual_seed(0)
        m = nn.Linear(3, 2)
        m.weight = nn.Parameter(DTensor.from_local(torch.randn(2, 3), mesh, [Partial()]))
        return m

    options = dict(full_state_dict=True)
    theirs = upstream.get_model_state_dict(model(), options=upstream.StateDictOptions(**options))
    ours = dcp_optim.get_model_state_dict(model(), options=dcp_optim.StateDictOptions(**options))
    assert list(ours) == list(theirs)
    for key in theirs:
        assert type(ours[key]) is type(theirs[key]) is torch.Tensor, key
        assert torch.equal(ours[key], theirs[key]), key
