"""A state value that is a dict keyed by non-str keys (pytorch-optimizer's
AggMo: {beta: momentum buffer} with float betas) in the flattened format:
the flat key "state.<fqn>.momentum_buffer.0.9" is read back under the
template's own key 0.9 (D30's note in docs/differences.md), so a DCP-style
resume into a never-stepped optimizer trains on bit-identically.  Upstream
splits the key at its dots ({"0": {"9": ...}}) and the next step raises
KeyError."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed.checkpoint.state_dict as upstream
import torch.nn as nn

import dcp_optim

po = pytest.importorskip("pytorch_optimizer")

FLAT = dcp_optim.StateDictOptions(flatten_optimizer_state_dict=True)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))


def _step(model, opt, i: int) -> None:
    model(torch.randn(5, 3, generator=torch.Generator().manual_seed(i))).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def _resume(get, set_, options):
    ref = _model(0)
    ref_opt = po.AggMo(ref.parameters(), lr=0.1)
    for i in range(3):
        _step(ref, ref_opt, i)
    model = _model(0)
    opt = po.AggMo(model.parameters(), lr=0.1)
    for i in range(2):
        _step(model, opt, i)
    saved = copy.deepcopy(get(model, opt, options=options))
    fresh = _model(1)
    fresh.load_state_dict(model.state_dict())
    fresh_opt = po.AggMo(fresh.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        template = get(fresh, fresh_opt, options=options)
    assert set(template) == set(saved)
    set_(fresh, fresh_opt, saved, options=options)
    return ref, fresh, fresh_opt


def test_flat_float_keys_resume_bit_identically():
    ref, fresh, opt = _resume(dcp_optim.get_optimizer_state_dict, dcp_optim.set_optimizer_state_dict, FLAT)
    for p in fresh.parameters():
        assert set(opt.state[p]["momentum_buffer"]) == {0.0, 0.9, 0.99}
    _step(fresh, opt, 2)
    for a, b in zip(ref.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_upstream_splits_the_float_keys():
    _, fresh, opt = _resume(upstream.get_optimizer_state_dict, upstream.set_optimizer_state_dict,
                            upstream.StateDictOptions(flatten_optimizer_state_dict=True))
    assert all(set(opt.state[p]["momentum_buffer"]) == {"0"} for p in fresh.parameters())
    with pytest.raises(KeyError):
        _step(fresh, opt, 2)
