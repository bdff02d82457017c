"""The optimizers' snapshot a distributed load takes before a commit that
can fail on some ranks only (an optimizer's own load_state_dict): after
anything a load can do to an optimizer -- and to the optimizer a wrapper
holds -- ``restore`` gives back the same objects with the same bits."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
import torch.nn as nn

from dcp_optim._engine.optim import OptimSnapshot


class LookaheadLike(torch.optim.Optimizer):
    """Holds another optimizer in an attribute, shares its param groups
    and keeps state of its own (slow weights), like Lookahead."""

    def __init__(self, inner: torch.optim.Optimizer, k: int = 2):
        self.optimizer = inner
        self.k = k
        self.defaults = dict(inner.defaults)
        self.state = defaultdict(dict)
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self._optimizer_state_dict_pre_hooks = {}
        self._optimizer_state_dict_post_hooks = {}
        self._optimizer_load_state_dict_pre_hooks = {}
        self._optimizer_load_state_dict_post_hooks = {}

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self, closure=None):
        self.optimizer.step()
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].setdefault("slow", p.detach().clone())


def _trained(kind: str):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    inner = torch.optim.Adam(model.parameters(), lr=0.01)
    optim = LookaheadLike(inner) if kind == "wrapper" else inner
    for _ in range(2):
        model(torch.randn(4, 3)).sum().backward()
        optim.step()
    return model, optim, inner


def _bits(optim: torch.optim.Optimizer):
    out = []
    for group in optim.param_groups:
        out.append(sorted((k, repr(v)) for k, v in group.items() if k != "params"))
        for p in group["params"]:
            out.append(sorted((k, v.clone() if torch.is_tensor(v) else v) for k, v in optim.state[p].items()))
    return out


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and bool(torch.equal(a, b))
    return a == b


@pytest.mark.parametrize("kind", ["plain", "wrapper"])
def test_restore_undoes_what_a_load_can_do(kind):
    model, optim, inner = _trained(kind)
    before_inner, before_outer = _bits(inner), _bits(optim)
    state_obj, groups_obj, inner_state_obj = optim.state, optim.param_groups, inner.state
    exp_avg = inner.state[model.weight]["exp_avg"]
    snapshot = OptimSnapshot((optim,))

    # what loads do: torch's own load replaces the inner optimizer's
    # containers; an override writes in place, edits groups, replaces
    # the wrapper's state and settings
    _, other, other_inner = _trained(kind)
    for group in other_inner.param_groups:
        group["lr"] = 0.5
    inner.load_state_dict(other_inner.state_dict())
    with torch.no_grad():
        exp_avg.add_(1.0)
    optim.param_groups[0]["betas"] = (0.1, 0.2)
    if kind == "wrapper":
        optim.state[model.weight]["slow"].mul_(2)
        optim.state = defaultdict(dict)
        optim.k = 7
    assert not _same(_bits(inner), before_inner)

    snapshot.restore()
    assert _same(_bits(inner), before_inner) and _same(_bits(optim), before_outer)
    assert optim.state is state_obj and inner.state is inner_state_obj and optim.param_groups is groups_obj
    assert inner.state[model.weight]["exp_avg"] is exp_avg
    assert optim.param_groups[0]["params"] == [model.weight, model.bias]
    if kind == "wrapper":
        assert optim.k == 2 and optim.optimizer is inner
    # the restored optimizer still steps
    model(torch.randn(4, 3)).sum().backward()
    optim.step()


class _Refusing(torch.optim.Adam):
    """Its own load_state_dict sets a hyperparameter, then raises."""

    def load_state_dict(self, state_dict):
        self.param_groups[0]["lr"] = 123.0
        raise RuntimeError("optimizer refuses the load")


@pytest.mark.parametrize("full", [False, True])
def test_an_optimizer_load_raising_alone_leaves_the_model_as_before(full):
    """One process (no agreement): the model, committed before the
    optimizer, is put back when the optimizer's own load raises, and so
    is what that load set.  Upstream loads the optimizers first (its
    model stays as it was) and keeps what the failing load set."""
    import torch.distributed.checkpoint.state_dict as upstream

    import dcp_optim

    results = {}
    for name, mod in (("dcp_optim", dcp_optim), ("torch", upstream)):
        model, optim, _ = _trained("plain")
        optim.__class__ = _Refusing
        src, src_optim, _ = _trained("plain")
        with torch.no_grad():
            for p in src.parameters():
                p.add_(1.0)
        opts = dcp_optim.StateDictOptions(full_state_dict=full)
        msd, osd = dcp_optim.get_state_dict(src, src_optim, options=opts)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        optim_before = _bits(optim)
        with pytest.raises(RuntimeError, match="optimizer refuses the load"):
            mod.set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd,
                               options=mod.StateDictOptions(full_state_dict=full))
        results[name] = (all(torch.equal(before[k], v) for k, v in model.state_dict().items()),
                         _same(_bits(optim), optim_before))
    assert results["dcp_optim"] == (True, True)
    assert results["torch"] == (True, False)
