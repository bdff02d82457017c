"""DCP integration in one process: the template flow and the Stateful
AppState pattern, nested and flattened, then training continues exactly."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.stateful import Stateful

import dcp_optim

from ..support.oracle import assert_same_tree, params_snapshot


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.body = nn.Sequential(nn.Linear(6, 6), nn.GELU(), nn.LayerNorm(6))
        self.head = nn.Linear(6, 11)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, ids):
        self.calls += 1
        return nn.functional.cross_entropy(self.head(self.body(self.embed(ids))), ids)


class AppState(Stateful):
    def __init__(self, model, optim, options=None):
        self.model, self.optim, self.options = model, optim, options

    def state_dict(self):
        m, o = dcp_optim.get_state_dict(self.model, self.optim, options=self.options)
        return {"model": m, "optim": o}

    def load_state_dict(self, state):
        dcp_optim.set_state_dict(self.model, self.optim, model_state_dict=state["model"],
                                 optim_state_dict=state["optim"], options=self.options)


def build(seed=0):
    torch.manual_seed(seed)
    model = Model()
    optim = torch.optim.AdamW([{"params": [model.embed.weight], "lr": 0.01},
                               {"params": list(model.body.parameters()) + [model.head.bias]}], lr=0.02)
    return model, optim


def steps(model, optim, start, n):
    losses = []
    for s in range(start, start + n):
        ids = torch.randint(0, 11, (8,), generator=torch.Generator().manual_seed(s))
        loss = model(ids)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("flat", [False, True], ids=["nested", "flat"])
def test_stateful_app_state_round_trip(tmp_path, flat):
    options = dcp_optim.StateDictOptions(flatten_optimizer_state_dict=flat)
    model, optim = build()
    steps(model, optim, 0, 3)
    dcp.save({"app": AppState(model, optim, options)}, checkpoint_id=str(tmp_path))
    reference = steps(model, optim, 3, 3)
    resumed_model, resumed_optim = build(seed=42)  # different init, never stepped
    dcp.load({"app": AppState(resumed_model, resumed_optim, options)}, checkpoint_id=str(tmp_path))
    assert int(resumed_model.calls) == 3
    assert steps(resumed_model, resumed_optim, 3, 3) == reference
    assert_same_tree(params_snapshot(resumed_model), params_snapshot(model))


def test_template_flow_with_plain_dicts(tmp_path):
    model, optim = build()
    steps(model, optim, 0, 2)
    msd, osd = dcp_optim.get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path))
    model2, optim2 = build(seed=1)
    msd2, osd2 = dcp_optim.get_state_dict(model2, optim2)   # the template
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=str(tmp_path))
    dcp_optim.set_state_dict(model2, optim2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert steps(model2, optim2, 2, 2) == steps(model, optim, 2, 2)


def test_checkpoint_written_by_upstream_loads(tmp_path):
    import torch.distributed.checkpoint.state_dict as upstream

    for flat in (False, True):
        model, optim = build()
        steps(model, optim, 0, 2)
        o = upstream.StateDictOptions(flatten_optimizer_state_dict=flat)
        msd, osd = upstream.get_state_dict(model, optim, options=o)
        path = str(tmp_path / f"flat{int(flat)}")
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        model2, optim2 = build(seed=1)
        msd2, osd2 = dcp_optim.get_state_dict(model2, optim2, options=o)
        state = {"model": msd2, "optim": osd2}
        dcp.load(state, checkpoint_id=path)
        dcp_optim.set_state_dict(model2, optim2, model_state_dict=state["model"],
                                 optim_state_dict=state["optim"], options=o)
        assert steps(model2, optim2, 2, 2) == steps(model, optim, 2, 2)
