"""The public calls are correct with the cyclic GC running inside them.

The getters and setters disable the collector around each call, as
upstream's ``_gc_context`` does.  That used to be the only thing keeping
the C core's dict snapshots safe (a finalizer changing a dict while the core
iterated it crashed it; tests/core/refleak/test_dict_iteration.py).  Since
every dict loop of the core pins its entries and checks the size, the
collector is no longer needed off for safety: here ``gc.disable`` is made a
no-op and the gen-0 threshold is 1 (a collection at nearly every
allocation, with finalizers of garbage cycles running), and every public
call must give the result it gives with the collector off.  Why the calls
still disable it (pauses, not safety) is measured in docs/architecture.md,
"The collector during calls".
"""

from __future__ import annotations

import gc

import torch
import torch.nn as nn

import dcp_optim
from dcp_optim import StateDictOptions


class _Garbage:
    """A reference cycle with a finalizer, collected at some allocation."""

    def __init__(self, sink: list):
        self.sink = sink
        self.cycle = self

    def __del__(self):
        self.sink.append(len(self.sink))


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def _calls(model, opt, sink):
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    out = {}
    for name, call in [
        ("model", lambda: dcp_optim.get_model_state_dict(model)),
        ("optim", lambda: dcp_optim.get_optimizer_state_dict(model, opt)),
        ("flat", lambda: dcp_optim.get_optimizer_state_dict(model, opt, options=flat)),
        ("both", lambda: dcp_optim.get_state_dict(model, opt)),
    ]:
        for _ in range(20):
            _Garbage(sink)
        out[name] = call()
    dcp_optim.set_model_state_dict(model, out["model"])
    dcp_optim.set_optimizer_state_dict(model, opt, out["optim"])
    dcp_optim.set_optimizer_state_dict(model, opt, out["flat"])
    dcp_optim.set_state_dict(model, opt, model_state_dict=out["both"][0], optim_state_dict=out["both"][1])
    out["after"] = dcp_optim.get_state_dict(model, opt)
    return out


def test_calls_with_the_collector_running(monkeypatch):
    model, opt = _setup()
    expected = _calls(model, opt, [])
    sink: list = []
    old = gc.get_threshold()
    monkeypatch.setattr(gc, "disable", lambda: None)
    gc.set_threshold(1, 1, 1)
    try:
        got = _calls(model, opt, sink)
    finally:
        gc.set_threshold(*old)
    assert sink, "no finalizer ran during the calls"
    _assert_same(got, expected)
    assert gc.isenabled()


def _assert_same(a, b, where="out"):
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where
