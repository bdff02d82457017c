"""State nested under keys that are not strings, resumed through DCP's
template flow (D32 in docs/differences.md).

``dcp.load`` writes a non-tensor value back along its saved path, whose
keys are all ``str(key)``: an entry ``{0: {"n": 2, "buf": t}}`` comes back
as ``{0: {"n": <the template's n>, "buf": <loaded>}, "0": {"n": 2}}``.
heavyball keeps every parameter's state so (under its view index 0).
Upstream's setter installs that dict: the optimizer trains on the
template's counter (silently) or fails on the ``None`` DCP leaves for a
set.  dcp_optim's setter folds the checkpoint's values back under their
own keys: the resumed run is the uninterrupted one, bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as upstream
import torch.nn as nn

import dcp_optim
from dcp_optim._engine.optim import fold_dcp_string_keys


class NestedCounter(torch.optim.Optimizer):
    """A running mean of the gradients, kept per parameter under the int
    key 0 with a Python int count (a value DCP stores as bytes), a set
    of the views seen and, one level down under the float key 0.5, a
    second count."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p].setdefault(0, {"n": 0, "seen": set(), "buf": torch.zeros_like(p),
                                                  0.5: {"n": 0}})
                st["n"] += 1
                st[0.5]["n"] += 2
                st["seen"].add(len(st["seen"]))
                st["buf"].add_(p.grad)
                p.sub_(group["lr"] * st["buf"] / (st["n"] + st[0.5]["n"] + len(st["seen"])))


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))


def _step(model, opt, i):
    model(torch.randn(5, 3, generator=torch.Generator().manual_seed(i))).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def _resume_through_dcp(api, tmp_path):
    """Two steps, ``api``'s get -> dcp.save, a fresh model and optimizer,
    ``api``'s template -> dcp.load -> ``api``'s set, one more step:
    (the uninterrupted run's model, the resumed one, its optimizer)."""
    ref = _model(0)
    ref_opt = NestedCounter(ref.parameters())
    for i in range(3):
        _step(ref, ref_opt, i)
    model = _model(0)
    opt = NestedCounter(model.parameters())
    for i in range(2):
        _step(model, opt, i)
    dcp.save({"optim": api.get_optimizer_state_dict(model, opt)}, checkpoint_id=str(tmp_path))
    fresh = _model(1)
    fresh.load_state_dict(model.state_dict())
    fresh_opt = NestedCounter(fresh.parameters())
    state = {"optim": api.get_optimizer_state_dict(fresh, fresh_opt)}
    dcp.load(state, checkpoint_id=str(tmp_path))
    # what DCP leaves: the checkpoint's Python values under "0"
    entry = state["optim"]["state"]["0.weight"]
    assert set(entry) == {0, "0"} and entry["0"]["n"] == 2 and entry["0"]["0.5"]["n"] == 4
    api.set_optimizer_state_dict(fresh, fresh_opt, state["optim"])
    return ref, fresh, fresh_opt


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dcp_resume_of_state_under_int_keys_is_exact(tmp_path):
    ref, fresh, opt = _resume_through_dcp(dcp_optim, tmp_path)
    for p in fresh.parameters():
        assert list(opt.state[p]) == [0]
        st = opt.state[p][0]
        assert st["n"] == 2 and st[0.5] == {"n": 4} and st["seen"] == {0, 1}
    _step(fresh, opt, 2)
    for a, b in zip(ref.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_upstream_trains_on_the_template_values(tmp_path):
    _, fresh, opt = _resume_through_dcp(upstream, tmp_path)
    for p in fresh.parameters():
        assert set(opt.state[p]) == {0, "0"}
        # the counts of the never-stepped template's step, not the checkpoint's
        assert opt.state[p][0]["n"] != 2 and opt.state[p][0]["seen"] is None
    with pytest.raises(AttributeError):  # .add of DCP's None in place of the set
        _step(fresh, opt, 2)


def test_folding_copies_and_leaves_other_dicts_alone():
    t = torch.ones(2)
    inner = {0: {"n": 1, "buf": t, 1: {"k": 0}}, "0": {"n": 5, "1": {"k": 9}}}
    osd = {"state": {"a": inner, "b": {"x": 1}}, "param_groups": [{"params": ["a", "b"]}]}
    before = copy.deepcopy(osd)
    out = fold_dcp_string_keys(osd)
    assert out["state"]["a"] == {0: {"n": 5, "buf": t, 1: {"k": 9}}}
    assert out["state"]["a"][0]["buf"] is t
    assert out["state"]["b"] is osd["state"]["b"]
    # the caller's dict is unchanged
    assert osd["state"]["a"] is inner and set(inner) == {0, "0"} and inner[0]["n"] == 1
    assert repr(osd) == repr(before)
    # nothing to fold: the same object
    clean = {"state": {"a": {0: {"n": 1}}, "b": {"m": {0.9: t}}}, "param_groups": []}
    assert fold_dcp_string_keys(clean) is clean
