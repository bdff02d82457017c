"""The flat-key grammar (docs/architecture.md, "Flat keys"): one parser,
the C core's ``parse_flat_key`` (what ``unflatten_optim`` runs for
``set_optimizer_state_dict``), used by the tools too (convert, the
inspect/plan checkpoint reader, the load planner).

Keys come from upstream's own flattening (``_flatten_optim_state_dict``
through ``get_optimizer_state_dict(flatten_optimizer_state_dict=True)``)
of a model whose FQNs are the grammar's corner cases: dotted FQNs, FQNs
that are string prefixes of others (``l.1`` / ``l.10``), parameter and
module names spelled like dcp_optim's reserved empty-group components, a
dotted param_groups key and nested state.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as upstream
import torch.nn as nn

import dcp_optim
from dcp_optim import convert
from dcp_optim._engine.core import C
from dcp_optim.tools.checkpoint import Checkpoint
from dcp_optim.tools.planner import is_empty_group_key

from ..support.oracle import assert_same_tree


def corner_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    model.l = nn.ModuleList([nn.Linear(1, 1) for _ in range(11)])  # l.1.* and l.10.*
    # a parameter named like a whole reserved optimizer-level component
    model.register_parameter("__optimizer_0_empty_group_0__", nn.Parameter(torch.ones(2)))
    a = nn.Module()
    a.w = nn.Parameter(torch.ones(2))
    # a module named like a reserved anchored component: a.__empty_group_after_1__.weight
    a.add_module("__empty_group_after_1__", nn.Linear(2, 2, bias=False))
    model.a = a
    return model


def corner_optim(model: nn.Module, nested_state: bool) -> torch.optim.Optimizer:
    params = dict(model.named_parameters())
    first = [p for n, p in params.items() if n.startswith("l.")]
    rest = [p for n, p in params.items() if not n.startswith("l.")]
    optim = torch.optim.Adam(
        [{"params": first, "lr": 0.1, "my.key": 1}, {"params": rest, "lr": 0.2}], lr=0.01
    )
    for p in params.values():
        p.grad = torch.full_like(p, 0.5)
    optim.step()
    if nested_state:  # upstream flattens nested state dicts at every level
        p = params["l.10.weight"]
        optim.state[p]["nest"] = {"a": torch.zeros(1), "b": {"c": 3}}
    return optim


FLAT_UP = upstream.StateDictOptions(flatten_optimizer_state_dict=True)
FLAT = dcp_optim.StateDictOptions(flatten_optimizer_state_dict=True)


@pytest.fixture(scope="module")
def corner():
    model = corner_model()
    optim = corner_optim(model, nested_state=True)
    flat = upstream.get_optimizer_state_dict(model, optim, options=FLAT_UP)
    nested = upstream.get_optimizer_state_dict(model, optim)
    return model, optim, flat, nested


def _expected_parses(nested) -> dict[str, tuple[str, str, str]]:
    """What each flat key stands for, from upstream's nested dict (the
    parts upstream's flattening joins with dots)."""
    out = {}

    def leaves(fqn, d, path):
        for k, v in d.items():
            if isinstance(v, dict):
                leaves(fqn, v, f"{path}{k}.")
            else:
                out[f"state.{fqn}.{path}{k}"] = ("state", fqn, f"{path}{k}")

    for fqn, st in nested["state"].items():
        leaves(fqn, st, "")
    for g in nested["param_groups"]:
        for fqn in g["params"]:
            for k in g:
                if k != "params":
                    out[f"param_groups.{fqn}.{k}"] = ("param_groups", fqn, k)
    return out


def test_upstream_flattened_keys_parse_back_and_round_trip(corner):
    model, optim, flat, nested = corner
    expected = _expected_parses(nested)
    assert set(flat) == set(expected)
    fqns = frozenset(n for n, _ in model.named_parameters())
    for key in flat:
        parsed = C.parse_flat_key(key, fqns)
        assert parsed == expected[key], key
        kind, fqn, tail = parsed
        assert f"{kind}.{fqn}.{tail}" == key
    # our flattening writes the same keys in the same order
    ours = dcp_optim.get_optimizer_state_dict(model, optim, options=FLAT)
    assert list(ours) == list(flat)


# (key, known FQNs -> parse, FQNs unknown (None) -> parse)
KNOWN = frozenset({"a", "a.b", "l.1.w", "l.10.w", "__optimizer_0_empty_group_1__", "x"})
TABLE = [
    # the FQN is the longest known one; the state path keeps its dots
    ("state.a.exp_avg", ("state", "a", "exp_avg"), None),
    ("state.a.b.exp_avg.sq", ("state", "a.b", "exp_avg.sq"), None),
    ("state.l.10.w.step", ("state", "l.10.w", "step"), None),
    ("state.l.1.w.step", ("state", "l.1.w", "step"), None),
    ("state.zz.step", None, None),  # no known FQN
    # a dotted group key stays whole when the FQN is known
    ("param_groups.l.1.w.my.key", ("param_groups", "l.1.w", "my.key"),
     ("param_groups", "l.1.w.my", "key")),
    ("param_groups.q.r.lr", None, ("param_groups", "q.r", "lr")),
    # reserved empty-group keys
    ("param_groups.a.__empty_group_after_1__.lr", ("empty_group", "a|after|1", "lr"),
     ("empty_group", "a|after|1", "lr")),
    ("param_groups.a.__empty_group_before_2__.b.c", ("empty_group", "a|before|2", "b.c"),
     ("empty_group", "a|before|2", "b.c")),
    ("param_groups.__optimizer_3_empty_group_4__.lr",
     ("empty_group", "__optimizer_3_empty_group_4__", "lr"),
     ("empty_group", "__optimizer_3_empty_group_4__", "lr")),
    # a known FQN spelled like a reserved form is a parameter's
    ("param_groups.__optimizer_0_empty_group_1__.lr",
     ("param_groups", "__optimizer_0_empty_group_1__", "lr"),
     ("empty_group", "__optimizer_0_empty_group_1__", "lr")),
    # only the exact reserved spelling is reserved
    ("param_groups.__optimizer_x_empty_group_1__.lr", None,
     ("param_groups", "__optimizer_x_empty_group_1__", "lr")),
    ("param_groups.a.__empty_group_after__.lr", ("param_groups", "a", "__empty_group_after__.lr"),
     ("param_groups", "a.__empty_group_after__", "lr")),
    # the empty FQN is no FQN; an empty group key is a key
    ("state..x", None, None),
    ("param_groups..x", None, None),
    ("param_groups.x.", ("param_groups", "x", ""), ("param_groups", "x", "")),
    # not flat keys
    ("state", None, None),
    ("param_groups", None, None),
    ("optim.state.a.x", None, None),
]


def test_grammar_table():
    for key, with_fqns, without in TABLE:
        assert C.parse_flat_key(key, KNOWN) == with_fqns, key
        assert C.parse_flat_key(key, set(KNOWN)) == with_fqns, key
        assert C.parse_flat_key(key, None) == without, key
    with pytest.raises(TypeError):
        C.parse_flat_key(b"state.a.x", KNOWN)
    with pytest.raises(TypeError):
        C.parse_flat_key("state.a.x", list(KNOWN))


def test_set_parses_corner_keys_as_upstream(corner):
    """C's unflatten_optim (same parser) on the corner FQNs: the loaded
    optimizer equals upstream's load of the same flat dict."""
    src_model = corner_model()
    flat = upstream.get_optimizer_state_dict(
        src_model, corner_optim(src_model, nested_state=False), options=FLAT_UP
    )
    loaded = []
    for impl, opts in ((upstream, FLAT_UP), (dcp_optim, FLAT)):
        model = corner_model()
        optim = corner_optim(model, nested_state=False)
        for st in optim.state.values():
            for v in st.values():
                v.mul_(0).add_(7)
        impl.set_optimizer_state_dict(model, optim, dict(flat), options=opts)
        loaded.append(optim.state_dict())
    assert_same_tree(loaded[1], loaded[0])


def test_tools_parse_corner_keys_as_the_setter(corner, tmp_path):
    """convert.to_nested and the checkpoint reader (inspect, plan,
    convert_checkpoint) read every corner key as a parameter's.  Before
    they shared the C parser, both took "__optimizer_0_empty_group_0__"
    and "a.__empty_group_after_1__.weight" for reserved empty-group keys
    (their hyperparameters went to parameter-less groups, the latter's as
    key "weight.lr")."""
    model, optim, flat, nested = corner
    back = convert.to_nested(flat, model)
    assert [g["params"] for g in back["param_groups"]] == [
        g["params"] for g in nested["param_groups"]
    ]
    for g, want in zip(back["param_groups"], nested["param_groups"]):
        assert {k: v for k, v in g.items() if k != "params"} == {
            k: v for k, v in want.items() if k != "params"
        }
    assert list(back["state"]) == list(nested["state"])
    assert_same_tree(back["state"], nested["state"])
    # the load planner has no FQNs: it goes by spelling alone, so the keys
    # of parameters named like reserved components look reserved to it
    # (it then lets them be absent from a checkpoint: nothing else)
    reserved_spelling = ("param_groups.__optimizer_0_empty_group_0__.",
                         "param_groups.a.__empty_group_after_1__.weight.")
    looks_reserved = [k for k in flat if k.startswith(reserved_spelling)]
    assert len(looks_reserved) == 2 * (len(nested["param_groups"][1]) - 1)
    assert [k for k in flat if is_empty_group_key("optim." + k)] == looks_reserved
    assert not any(is_empty_group_key(k) for k in flat if k.startswith("state."))
    dcp.save({"model": model.state_dict(), "optim": flat}, checkpoint_id=str(tmp_path))
    ck = Checkpoint(str(tmp_path))
    (sec,) = ck.optimizers
    assert sec.unparsed == [] and sec.empties == {}
    fqns = [n for n, _ in model.named_parameters()]
    assert sorted(sec.group_keys) == sorted(fqns)
    assert set(sec.group_keys["l.1.weight"]) == set(nested["param_groups"][0]) - {"params"}
    assert sorted(sec.state) == sorted(nested["state"])
    assert set(sec.state["l.10.weight"]) == {"step", "exp_avg", "exp_avg_sq", "nest.a", "nest.b.c"}


def _dotted_state_name_load(impl, opts, beside_exp_avg=True, fresh=False):
    class DotAdam(torch.optim.Adam):
        def step(self, closure=None):
            out = super().step(closure)
            for st in self.state.values():
                st["exp_avg.sq"] = st["exp_avg_sq"].clone()
                if not beside_exp_avg:
                    del st["exp_avg"]
            return out

    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    optim = DotAdam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optim.step()
    flat = upstream.get_optimizer_state_dict(model, optim, options=FLAT_UP)
    assert "state.weight.exp_avg.sq" in flat
    if fresh:  # a never-stepped optimizer: no live state yet
        optim = DotAdam(model.parameters())
    impl.set_optimizer_state_dict(model, optim, flat, options=opts)
    return optim.state_dict()["state"]


@pytest.mark.parametrize("beside_exp_avg", [True, False])
@pytest.mark.filterwarnings("ignore:dcp_optim has no state schema:UserWarning")  # the load's shadow step
def test_dotted_state_name_is_read_whole_as_upstream(beside_exp_avg):
    """Upstream's unflattening looks each live state name up whole
    ("state.<fqn>.exp_avg.sq") before splitting on dots; the loaded view
    nests at every dot, so the setter reads the live optimizer's dotted
    names whole first.  Before, dcp_optim refused the load beside a state
    "exp_avg" (ValueError: nests under a non-dict state value) and loaded
    {"exp_avg": {"sq": ...}} without one."""
    want = _dotted_state_name_load(upstream, FLAT_UP, beside_exp_avg)
    assert isinstance(want[0]["exp_avg.sq"], torch.Tensor)
    assert ("exp_avg" in want[0]) is beside_exp_avg
    assert_same_tree(_dotted_state_name_load(dcp_optim, FLAT, beside_exp_avg), want)


# Into a never-stepped optimizer there is no live name to go by: the names
# come from the optimizer's template -- here, a subclass without a schema,
# its shadow step (which warns once per class).  Upstream loads nothing at
# all here (its initialising step is skipped while gradients are set, D2
# in docs/differences.md, and its unflattening goes by live names only).
@pytest.mark.filterwarnings("ignore:dcp_optim has no state schema:UserWarning")
@pytest.mark.parametrize("beside_exp_avg", [True, False])
def test_dotted_state_name_into_a_fresh_optimizer(beside_exp_avg):
    saved = _dotted_state_name_load(upstream, FLAT_UP, beside_exp_avg, fresh=False)
    assert isinstance(saved[0]["exp_avg.sq"], torch.Tensor)
    assert _dotted_state_name_load(upstream, FLAT_UP, beside_exp_avg, fresh=True) == {0: {}, 1: {}}
    assert_same_tree(_dotted_state_name_load(dcp_optim, FLAT, beside_exp_avg, fresh=True), saved)


def test_dotted_state_name_from_the_schema():
    """A registered schema's dotted names stay whole without any live
    state and without a shadow step (nothing warns)."""

    class EmaAdam(torch.optim.Adam):
        def step(self, closure=None):
            out = super().step(closure)
            for st in self.state.values():
                st["ema.fast"] = st["exp_avg"].clone()
            return out

    from dcp_optim import schema as sch

    @dcp_optim.register_optimizer_schema(EmaAdam)
    def _ema_adam(optimizer, group):
        return [sch.scalar("step", 0.0, dtype=torch.float32, on_param_device=False), sch.zeros_like("exp_avg"), sch.zeros_like("exp_avg_sq"),
                sch.zeros_like("ema.fast")]

    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    optim = EmaAdam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optim.step()
    flat = dcp_optim.get_optimizer_state_dict(model, optim, options=FLAT)
    assert "state.weight.ema.fast" in flat
    fresh = EmaAdam(model.parameters())
    template = dcp_optim.get_optimizer_state_dict(model, fresh, options=FLAT)
    assert "state.weight.ema.fast" in template
    dcp_optim.set_optimizer_state_dict(model, fresh, flat, options=FLAT)
    assert_same_tree(fresh.state_dict()["state"], optim.state_dict()["state"])

