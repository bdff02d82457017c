"""Sets in optimizer state (D46 in docs/differences.md): heavyball keeps,
beside each parameter's tensors, the set of its initialised view indices
(``state[p][0]["is_initialized"]``).  Upstream's full and offloaded gets
raise ``ValueError`` on it and its flattened format ``NotImplementedError``;
dcp_optim carries a set of plain values as a value in each, and a resume
through any of them trains on bit for bit.  A set holding a tensor still
raises as upstream's (no gather would reach the tensor)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.checkpoint.state_dict as upstream
import torch.nn as nn

import dcp_optim

heavyball = pytest.importorskip("heavyball")
# heavyball compiles its steps by default (minutes on this CPU)
heavyball.utils.compile_mode = None

FORMS = {
    "full": {"full_state_dict": True},
    "offload": {"cpu_offload": True},
    "flat": {"flatten_optimizer_state_dict": True},
    "full flat": {"full_state_dict": True, "flatten_optimizer_state_dict": True},
}


pytestmark = pytest.mark.usefixtures("quiet_warnings")


def _build(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))
    return model, heavyball.AdamW(model.parameters(), lr=0.1)


def _step(model, optim, i: int) -> None:
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(i))
    model(x).pow(2).sum().backward()
    optim.step()
    optim.zero_grad()


def _trained(steps: int = 2):
    model, optim = _build()
    for i in range(steps):
        _step(model, optim, i)
    return model, optim


@pytest.mark.parametrize("form", list(FORMS))
def test_upstream_raises_on_the_set(form):
    model, optim = _trained()
    expected = NotImplementedError if "flat" in form else ValueError
    with pytest.raises(expected, match="set"):
        upstream.get_optimizer_state_dict(model, optim, options=upstream.StateDictOptions(**FORMS[form]))


@pytest.mark.parametrize("form", list(FORMS))
def test_sets_are_carried_and_resume_bit_identically(form):
    model, optim = _trained()
    live = optim.state[model[0].weight][0]["is_initialized"]
    assert isinstance(live, set) and live
    osd = dcp_optim.get_optimizer_state_dict(model, optim, options=dcp_optim.StateDictOptions(**FORMS[form]))
    if "flat" in form:
        value = osd["state.0.weight.0.is_initialized"]
    else:
        value = osd["state"]["0.weight"][0]["is_initialized"]
    assert type(value) is set and value == live
    if form != "flat":
        # a copy: heavyball adds to its own set as it trains on
        assert value is not live
    # the uninterrupted run
    ref_model, ref_optim = _trained(steps=3)
    # resumed from the dict, in a fresh process's state
    dst_model, dst_optim = _build(seed=1)
    dst_model.load_state_dict(model.state_dict())
    dcp_optim.set_optimizer_state_dict(dst_model, dst_optim, copy.deepcopy(osd),
                                       options=dcp_optim.StateDictOptions(**FORMS[form]))
    assert dst_optim.state[dst_model[0].weight][0]["is_initialized"] == live
    _step(dst_model, dst_optim, 2)
    for (name, p), q in zip(dst_model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("impl", [upstream, dcp_optim], ids=["upstream", "dcp_optim"])
def test_a_set_holding_a_tensor_still_raises(impl):
    model, optim = _trained()
    optim.state[model[0].weight][0]["marks"] = {torch.zeros(1)}
    with pytest.raises(ValueError, match="Unexpected value type"):
        impl.get_optimizer_state_dict(model, optim, options=impl.StateDictOptions(full_state_dict=True))
    with pytest.raises(NotImplementedError, match="set"):
        impl.get_optimizer_state_dict(model, optim, options=impl.StateDictOptions(
            flatten_optimizer_state_dict=True))


def test_a_frozenset_is_kept_and_a_set_subclass_copied_as_a_set():
    model, optim = _trained()

    class Marks(set):
        pass

    entry = optim.state[model[0].weight][0]
    entry["frozen"] = frozenset({(1, "a"), None, 2.5})
    entry["marks"] = Marks({1, 2})
    osd = dcp_optim.get_optimizer_state_dict(model, optim, options=dcp_optim.StateDictOptions(full_state_dict=True))
    got = osd["state"]["0.weight"][0]
    assert got["frozen"] is entry["frozen"]
    assert type(got["marks"]) is set and got["marks"] == {1, 2}
