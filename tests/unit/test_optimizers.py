"""Every torch.optim optimizer: the pristine state the schema builds has
the keys, shapes, dtypes and devices of the state a real first step
creates, and loading it then stepping equals stepping a fresh optimizer."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint.state_dict as upstream
import torch.nn as nn

import dcp_optim

from ..support.oracle import assert_same_optimizers, assert_same_tree, params_snapshot


class Net(nn.Module):
    def __init__(self, sparse=False):
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=sparse)
        self.lin = nn.Linear(4, 3)
        self.mat = nn.Parameter(torch.randn(3, 5))

    def forward(self, ids):
        return (self.lin(self.emb(ids)) @ self.mat).pow(2).mean()


def ids(step):
    return torch.randint(0, 10, (6,), generator=torch.Generator().manual_seed(step))


CASES = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "sgd_dampening": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, initial_accumulator_value=0.3),
    "adadelta": lambda ps: torch.optim.Adadelta(ps),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=0.01),
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=0.01),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=0.01),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=0.01),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5, centered=True),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=0.01),
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=0.01),
}


def build(name, seed=0):
    torch.manual_seed(seed)
    model = Net()
    return model, CASES[name](model.parameters())


def run(model, optim, start, n):
    for s in range(start, start + n):
        model(ids(s)).backward()
        optim.step()
        optim.zero_grad()


@pytest.mark.parametrize("name", list(CASES))
def test_pristine_state_matches_a_real_first_step(name):
    model, optim = build(name)
    pristine = dcp_optim.get_optimizer_state_dict(model, optim)
    stepped_model, stepped = build(name)
    run(stepped_model, stepped, 0, 1)
    real = dcp_optim.get_optimizer_state_dict(stepped_model, stepped)
    assert list(pristine["state"]) == list(real["state"])
    for fqn in real["state"]:
        a, b = pristine["state"][fqn], real["state"][fqn]
        assert list(a) == list(b), fqn
        for key in b:
            if isinstance(b[key], torch.Tensor):
                assert (a[key].shape, a[key].dtype, a[key].device) == (b[key].shape, b[key].dtype, b[key].device), (fqn, key)
            else:
                assert type(a[key]) is type(b[key])
    assert_same_tree(pristine["param_groups"], real["param_groups"])


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("flat", [False, True], ids=["nested", "flat"])
def test_loading_pristine_state_equals_a_fresh_optimizer(name, flat):
    o = dcp_optim.StateDictOptions(flatten_optimizer_state_dict=flat)
    model, optim = build(name)
    template = dcp_optim.get_optimizer_state_dict(model, optim, options=o)
    dcp_optim.set_optimizer_state_dict(model, optim, template, options=o)
    run(model, optim, 0, 3)
    ref_model, ref = build(name)
    run(ref_model, ref, 0, 3)
    assert_same_tree(params_snapshot(model), params_snapshot(ref_model))


@pytest.mark.parametrize("name", [n for n in CASES if n not in ("adafactor",)])
def test_round_trip_matches_upstream_after_steps(name):
    (mu, ou), (md, od) = build(name), build(name)
    run(mu, ou, 0, 2)
    run(md, od, 0, 2)
    a = upstream.get_optimizer_state_dict(mu, ou)
    b = dcp_optim.get_optimizer_state_dict(md, od)
    assert_same_tree(a, b)
    (fu, fou), (fd, fod) = build(name, 1), build(name, 1)
    run(fu, fou, 5, 1)
    run(fd, fod, 5, 1)
    upstream.set_optimizer_state_dict(fu, fou, a)
    dcp_optim.set_optimizer_state_dict(fd, fod, b)
    assert_same_optimizers(fou, fod)


def test_sparse_adam():
    def make():
        torch.manual_seed(0)
        model = Net(sparse=True)
        return model, torch.optim.SparseAdam(list(model.emb.parameters()), lr=0.01)

    (mu, ou), (md, od) = make(), make()
    template = dcp_optim.get_optimizer_state_dict(md, od)
    assert template["state"]["emb.weight"]["step"] == 0
    for m, o in ((mu, ou), (md, od)):
        m(ids(0)).backward()
        o.step()
        o.zero_grad()
    assert_same_tree(upstream.get_optimizer_state_dict(mu, ou), dcp_optim.get_optimizer_state_dict(md, od))


def test_muon():
    def make():
        torch.manual_seed(0)
        model = Net()
        return model, torch.optim.Muon([model.mat], lr=0.01)

    model, optim = make()
    pristine = dcp_optim.get_optimizer_state_dict(model, optim)
    assert list(pristine["state"]) == ["mat"]
    assert not pristine["state"]["mat"]["momentum_buffer"].any()
    dcp_optim.set_optimizer_state_dict(model, optim, pristine)
    run(model, optim, 0, 2)
    ref_model, ref = make()
    run(ref_model, ref, 0, 2)
    assert_same_tree(params_snapshot(model), params_snapshot(ref_model))


def test_init_optim_state_is_safe():
    """_init_optim_state stays importable and fills pristine state without
    stepping (D4 in docs/differences.md)."""
    from dcp_optim.state_dict import _init_optim_state

    model, optim = build("adamw")
    fired = []
    optim.register_step_pre_hook(lambda *a: fired.append(1))
    before = params_snapshot(model)
    _init_optim_state(optim)
    assert not fired and all(p.grad is None for p in model.parameters())
    assert_same_tree(params_snapshot(model), before)
    assert all(float(st["step"]) == 0 for st in optim.state.values())
    assert len(optim.state) == len(list(model.parameters()))
