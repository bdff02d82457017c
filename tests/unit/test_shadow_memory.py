"""Memory of the template routes without a schema (issue 23, requirement 7:
"the shadow step holds at most one copy of the parameters it needs, freed
on return").

Peak bytes are read from torch's allocator events (``torch.profiler`` with
``profile_memory``: every allocation and free of a CPU tensor, in order),
so the measure is deterministic and counts tensors only -- not the C
library's heap, which keeps freed blocks.  What a route holds beyond the
template it returns must stay within one copy of the parameters (the
stand-ins, or the saved values of the upstream-style step) plus a margin
for one parameter's temporaries.  The parameters are many and of one
size, so that margin is small.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint.state_dict as upstream
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

import dcp_optim

LAYERS, DIM = 40, 128


class OwnStep(torch.optim.AdamW):
    """No schema: the shadow step."""

    def step(self, closure=None):
        return super().step(closure)


class RefusesCopies(torch.optim.AdamW):
    """The shadow step raises on copies: the upstream-style step."""

    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if not getattr(p, "_live", False):
                    raise RuntimeError("not a live parameter")
        return super().step(closure)


class FillsGrads(torch.optim.AdamW):
    """Writes into each gradient in place with an op that does not refuse
    a stride-0 tensor (``fill_``), a different value per parameter: a
    shared gradient scalar would give every parameter the last value."""

    def step(self, closure=None):
        for g in self.param_groups:
            for i, p in enumerate(g["params"]):
                if p.grad is not None:
                    p.grad.fill_(float(i + 1))
        return super().step(closure)


class AddsIntoGrads(torch.optim.AdamW):
    """Writes into each gradient with an op that refuses a stride-0 tensor."""

    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.grad.add_(p, alpha=0.5)
        return super().step(closure)


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(DIM, DIM, bias=False) for _ in range(LAYERS)])
    for p in model.parameters():
        p._live = True
    return model


def _peak_beyond_template(cls) -> tuple[int, int, dict]:
    """(peak bytes allocated during the getter less the template's bytes,
    the parameters' bytes, the state dict)."""
    model = _model()
    opt = cls(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the profiler's own notes (torch 2.11 warns on entering it)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            sd = dcp_optim.get_optimizer_state_dict(model, opt)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    template = sum(v.numel() * v.element_size() for st in sd["state"].values() for v in st.values()
                   if isinstance(v, torch.Tensor))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return peak - template, params, sd


@pytest.mark.parametrize("cls", [OwnStep, RefusesCopies], ids=["shadow", "upstream-style"])
def test_one_copy_of_the_parameters_beyond_the_template(cls):
    beyond, params, sd = _peak_beyond_template(cls)
    assert len(sd["state"]) == LAYERS
    assert all(set(st) == {"step", "exp_avg", "exp_avg_sq"} for st in sd["state"].values())
    # one copy of the parameters, and one parameter's temporaries
    assert beyond <= 1.25 * params, (beyond / params, cls.__name__)


def test_schema_route_holds_nothing_beyond_the_template():
    """The measure itself: the schema route allocates the template only."""
    beyond, params, _ = _peak_beyond_template(torch.optim.AdamW)
    assert beyond <= 0.05 * params


def _upstream_template(cls) -> dict:
    model = _model()
    opt = cls(model.parameters(), lr=1e-3)
    return upstream.get_optimizer_state_dict(model, opt)


@pytest.mark.parametrize("cls", [FillsGrads, AddsIntoGrads], ids=["fill_", "add_"])
def test_optimizer_writing_into_gradients_gets_real_ones(cls):
    """An optimizer that writes into ``p.grad``: where the write raises on
    the stride-0 gradient, or changes its scalar, the step is redone with
    real gradient tensors; the template's values are those of upstream's
    initialising step (zero gradients, as the optimizer then changes
    them)."""
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mine = dcp_optim.get_optimizer_state_dict(model, cls(model.parameters(), lr=1e-3))
    theirs = _upstream_template(cls)
    assert mine["state"].keys() == theirs["state"].keys()
    for fqn, st in theirs["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(mine["state"][fqn][key], st[key], msg=f"{fqn} {key}")
    if cls is FillsGrads:  # the values differ per parameter: no shared scalar
        first, last = list(mine["state"].values())[0], list(mine["state"].values())[-1]
        assert not torch.equal(first["exp_avg"], last["exp_avg"])
