"""Issue 23, requirement 5: optimizer-wide state (D29 in
docs/differences.md).

torch's ``Optimizer.state_dict()`` keeps the entries of ``optimizer.state``
that are not keyed by a parameter (pytorch-optimizer's MADGRAD ``k``, SPAM's
step counters, EmoNavi/EmoLynx/EmoFact's ``ema``).  Upstream's getter raises
``KeyError`` on them; dcp_optim returns them under "state" ->
".optimizer_<o>" (flattened "state..optimizer_<o>.<name>"), through DCP and
back, in both formats.
"""

from __future__ import annotations

import copy

import pytest
import pytorch_optimizer as po
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as upstream
import torch.nn as nn

import dcp_optim
from dcp_optim import errors

from ..support.oracle import assert_same_tree

FORMATS = pytest.mark.parametrize("flat", [False, True], ids=["nested", "flat"])
WIDE = pytest.mark.parametrize(
    "cls, names",
    [
        (po.MADGRAD, ["k"]),
        (po.SPAM, ["total_step", "current_step"]),
        (po.EmoNavi, ["ema"]),
        (po.EmoLynx, ["ema"]),
        (po.EmoFact, ["ema"]),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else None,
)
pytestmark = pytest.mark.filterwarnings("ignore:dcp_optim has no state schema:UserWarning")


def make_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential()
    # a module named like the reserved component: its FQNs never start with "."
    model.add_module("optimizer_0", nn.Linear(3, 4))
    model.add_module("act", nn.Tanh())
    model.add_module("out", nn.Linear(4, 2))
    return model


def step(model, optim, i):
    optim.zero_grad()
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(i))
    model(x).pow(2).sum().backward()
    optim.step()


def run(cls, steps):
    model = make_model()
    optim = cls(model.parameters())
    for i in range(steps):
        step(model, optim, i)
    return model, optim


def opts(impl, flat, **kw):
    return impl.StateDictOptions(flatten_optimizer_state_dict=flat, **kw)


def wide_of(optim):
    return {k: v for k, v in optim.state.items() if isinstance(k, str)}


@WIDE
@FORMATS
def test_upstream_raises_on_optimizer_wide_state(cls, names, flat):
    """The recorded difference: upstream's getter fails on them."""
    model, optim = run(cls, 2)
    assert sorted(wide_of(optim)) == sorted(names)
    with pytest.raises(KeyError):
        upstream.get_optimizer_state_dict(model, optim, options=opts(upstream, flat))


@WIDE
@FORMATS
def test_get_returns_them_under_the_reserved_key(cls, names, flat):
    model, optim = run(cls, 2)
    osd = dcp_optim.get_optimizer_state_dict(model, optim, options=opts(dcp_optim, flat))
    if flat:
        wide = sorted(k for k in osd if k.startswith("state.."))
        assert wide and all(k.startswith("state..optimizer_0.") for k in wide)
        assert {k[len("state..optimizer_0."):].split(".")[0] for k in wide} == set(names)
        # the parameters of the module named "optimizer_0" keep their keys
        assert "state.optimizer_0.weight.exp_avg_sq" in osd or any(
            k.startswith("state.optimizer_0.weight.") for k in osd
        )
    else:
        assert sorted(osd["state"][".optimizer_0"]) == sorted(names)
        assert "optimizer_0.weight" in osd["state"]
        # copies of the containers: the live "ema" dict is not returned
        for name in names:
            if isinstance(optim.state[name], dict):
                assert osd["state"][".optimizer_0"][name] is not optim.state[name]


@WIDE
@FORMATS
def test_dcp_resume_is_bit_identical(cls, names, flat, tmp_path):
    """get -> dcp.save; a second process's optimizer (stepped once, so its
    template holds the optimizer-wide entries) -> get -> dcp.load -> set;
    both train on identically."""
    model, optim = run(cls, 3)
    options = opts(dcp_optim, flat)
    dcp.save({"model": model.state_dict(), "optim": dcp_optim.get_optimizer_state_dict(model, optim, options=options)},
             checkpoint_id=str(tmp_path))
    model2, optim2 = run(cls, 1)
    state = {"model": model2.state_dict(), "optim": dcp_optim.get_optimizer_state_dict(model2, optim2, options=options)}
    planner = dcp_optim.LoadPlanner(unrequested="raise")
    dcp.load(state, checkpoint_id=str(tmp_path), planner=planner)
    model2.load_state_dict(state["model"])
    dcp_optim.set_optimizer_state_dict(model2, optim2, state["optim"], options=options)
    assert_same_tree(wide_of(optim2), wide_of(optim))
    for i in range(3, 6):
        step(model, optim, i)
        step(model2, optim2, i)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


@WIDE
@FORMATS
def test_set_round_trip_never_shares_the_callers_containers(cls, names, flat):
    model, optim = run(cls, 2)
    options = opts(dcp_optim, flat)
    osd = dcp_optim.get_optimizer_state_dict(model, optim, options=options)
    before = copy.deepcopy(osd)
    fresh = cls(model.parameters())
    dcp_optim.set_optimizer_state_dict(model, fresh, osd, options=options)
    assert_same_tree(osd, before)  # the caller's dict is unchanged
    assert_same_tree(wide_of(fresh), wide_of(optim))
    if not flat:
        for name in names:
            if isinstance(fresh.state[name], dict):
                assert fresh.state[name] is not osd["state"][".optimizer_0"][name]


@FORMATS
def test_strict_load_lacking_held_optimizer_wide_state_raises(flat):
    model, optim = run(po.MADGRAD, 2)
    options = opts(dcp_optim, flat)
    osd = dcp_optim.get_optimizer_state_dict(model, optim, options=options)
    if flat:
        bad = {k: v for k, v in osd.items() if not k.startswith("state..")}
    else:
        bad = {**osd, "state": {k: v for k, v in osd["state"].items() if k != ".optimizer_0"}}
    target_model, target = run(po.MADGRAD, 1)
    k_before = target.state["k"].clone()
    with pytest.raises(errors.MissingOptimizerStateError, match="optimizer-wide state \\['k'\\]") as info:
        dcp_optim.set_optimizer_state_dict(target_model, target, bad, options=options)
    assert info.value.missing == [".optimizer_0"]
    assert torch.equal(target.state["k"], k_before)  # nothing changed
    # strict=False: torch's load_state_dict rule, the state is replaced
    dcp_optim.set_optimizer_state_dict(target_model, target, bad, options=opts(dcp_optim, flat, strict=False))
    assert "k" not in target.state


@FORMATS
def test_several_optimizers_keep_their_own(flat):
    model = make_model()
    first = po.MADGRAD(model.optimizer_0.parameters())
    second = po.SPAM(model.out.parameters())
    for i in range(2):
        step(model, first, i)
        step(model, second, i)
    options = opts(dcp_optim, flat)
    osd = dcp_optim.get_optimizer_state_dict(model, (first, second), options=options)
    if not flat:
        assert sorted(osd["state"][".optimizer_0"]) == ["k"]
        assert sorted(osd["state"][".optimizer_1"]) == ["current_step", "total_step"]
    fresh = (po.MADGRAD(model.optimizer_0.parameters()), po.SPAM(model.out.parameters()))
    dcp_optim.set_optimizer_state_dict(model, fresh, copy.deepcopy(osd), options=options)
    assert_same_tree(wide_of(fresh[0]), wide_of(first))
    assert_same_tree(wide_of(fresh[1]), wide_of(second))


@FORMATS
def test_entry_for_no_optimizer_of_the_call_is_unexpected(flat):
    model, optim = run(po.MADGRAD, 2)
    options = opts(dcp_optim, flat)
    osd = dcp_optim.get_optimizer_state_dict(model, optim, options=options)
    if flat:
        osd = {**osd, "state..optimizer_3.k": torch.tensor([1])}
    else:
        osd = {**osd, "state": {**osd["state"], ".optimizer_3": {"k": torch.tensor([1])}}}
    fresh = po.MADGRAD(model.parameters())
    report = dcp_optim.set_optimizer_state_dict(model, fresh, osd, options=options)
    key = "state..optimizer_3.k" if flat else ".optimizer_3"
    assert key in report.unexpected_keys
    assert torch.equal(fresh.state["k"], optim.state["k"])


def test_parameter_keyed_entries_inside_are_refused_clearly():
    """TRAC keeps parameter tensors as keys inside its optimizer-wide
    dict (its own state_dict() turns them into positions, and its own
    load_state_dict takes nothing else): no format keys them by FQN, so
    the getter refuses them, naming the entry (upstream: a bare KeyError)."""
    model = make_model()
    optim = po.TRAC(torch.optim.AdamW(model.parameters()))
    for i in range(2):
        step(model, optim, i)
    assert any(isinstance(k, torch.Tensor) for k in optim.state["trac"])
    for flat in (False, True):
        with pytest.raises(errors.StateDictKeyError, match="optimizer-wide state 'trac' holds entries keyed by"):
            dcp_optim.get_optimizer_state_dict(model, optim, options=opts(dcp_optim, flat))


# --- LBFGS: its history in the flattened format --------------------------------


def _lbfgs(seed=0):
    torch.manual_seed(seed)
    model = nn.Linear(3, 1)
    return model, torch.optim.LBFGS(model.parameters(), history_size=3, max_iter=2)


def _lbfgs_step(model, optim):
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))

    def closure():
        optim.zero_grad()
        out = model(x).pow(2).sum() + model(x).sum()
        out.backward()
        return out

    optim.step(closure)


def test_lbfgs_history_flattened_upstream_raises():
    model, optim = _lbfgs()
    for _ in range(3):
        _lbfgs_step(model, optim)
    with pytest.raises(NotImplementedError, match="list"):
        upstream.get_optimizer_state_dict(model, optim, options=opts(upstream, True))


@FORMATS
def test_lbfgs_history_round_trips_and_dcp_never_drops_it(flat, tmp_path):
    """LBFGS keeps its history (lists of tensors, a list with None
    scratch entries) under its first parameter.  Flattened, a list is
    spelled "<name>.[i]" per element and "<name>.[]" for its length.  A
    direct get -> set carries the whole history in both formats; through
    DCP, a never-stepped LBFGS's template (its first step's keys, empty
    history: D26) cannot ask for lists of another length, so ``dcp.load``
    raises on them instead of silently restarting the history."""
    model, optim = _lbfgs()
    for _ in range(3):
        _lbfgs_step(model, optim)
    options = opts(dcp_optim, flat)
    osd = dcp_optim.get_optimizer_state_dict(model, optim, options=options)
    if flat:
        assert osd["state.weight.old_dirs.[]"] == len(optim.state[model.weight]["old_dirs"])
        assert "state.weight.old_dirs.[0]" in osd
    model2, optim2 = _lbfgs(seed=1)
    model2.load_state_dict(model.state_dict())
    template = {"optim": dcp_optim.get_optimizer_state_dict(model2, optim2, options=options)}
    dcp.save({"optim": osd}, checkpoint_id=str(tmp_path))
    with pytest.raises(dcp.api.CheckpointException):
        dcp.load(template, checkpoint_id=str(tmp_path))
    assert len(optim2.state) == 0
    dcp_optim.set_optimizer_state_dict(model2, optim2, copy.deepcopy(osd), options=options)
    live, got = optim.state[model.weight], optim2.state[model2.weight]
    assert sorted(live) == sorted(got)
    assert isinstance(got["old_dirs"], list) and len(got["old_dirs"]) == len(live["old_dirs"])
    assert [a is None for a in got["al"]] == [a is None for a in live["al"]]
    for _ in range(2):
        _lbfgs_step(model, optim)
        _lbfgs_step(model2, optim2)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
