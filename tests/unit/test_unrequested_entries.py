"""Issue 23, requirement 4: nothing in a checkpoint is left behind
unnoticed.  DCP reads only the keys of the state dict it is given;
``dcp_optim.LoadPlanner`` and ``dcp_optim.unrequested_entries`` report
(or load) every checkpoint entry the template did not request.  Each case
of the issue: a parameter trained then frozen, LBFGS's history (its
template is empty), a wrapper's own state, optimizer-wide entries.
"""

from __future__ import annotations

import pytest
import pytorch_optimizer as po
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

import dcp_optim
from dcp_optim import LoadPlanner, UnrequestedEntriesError, unrequested_entries

from ..support.oracle import assert_same_tree


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def loss(model: nn.Module, step: int) -> torch.Tensor:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
    return model(x).pow(2).sum()


def train(model, optim, steps=2, closure=False):
    for i in range(steps):
        optim.zero_grad()
        if closure:
            def fn(i=i):
                optim.zero_grad()
                out = loss(model, i)
                out.backward()
                return out

            optim.step(fn)
        else:
            loss(model, i).backward()
            optim.step()
    optim.zero_grad(set_to_none=True)


def saved(tmp_path, model, optim, **extra) -> str:
    path = str(tmp_path / "ckpt")
    state = {"model": model.state_dict(), "optim": dcp_optim.get_optimizer_state_dict(model, optim), **extra}
    dcp.save(state, checkpoint_id=path)
    return path


def check_report(path, template, want_keys):
    """The metadata function and the planner report the same entries,
    and they are exactly ``want_keys``; "raise" raises before anything
    of the template changes; "load" reads them."""
    report = unrequested_entries(template, path)
    assert sorted(report) == sorted(want_keys)
    # report (the default): the load runs, the entries are recorded
    planner = LoadPlanner()
    dcp.load(template, checkpoint_id=path, planner=planner)
    assert planner.unrequested == report
    # raise: on every rank, before anything is read
    before = {k: v.clone() for k, v in template["model"].items()}
    for v in template["model"].values():
        v.zero_()
    with pytest.raises(BaseException) as info:  # DCP wraps planner errors (CheckpointException)
        dcp.load(template, checkpoint_id=path, planner=LoadPlanner(unrequested="raise"))
    assert isinstance(info.value, UnrequestedEntriesError) or "UnrequestedEntriesError" in str(info.value)
    assert all(not v.any() for v in template["model"].values())  # nothing read
    for k, v in template["model"].items():
        v.copy_(before[k])
    # warn
    with pytest.warns(UserWarning, match="does not request"):
        dcp.load(template, checkpoint_id=path, planner=LoadPlanner(unrequested="warn"))
    return report


def test_trained_then_frozen_parameter_state_is_reported_and_loadable(tmp_path):
    model = make_model()
    optim = torch.optim.Adam(model.parameters())
    train(model, optim)
    model[0].weight.requires_grad_(False)  # frozen after training: its state stays saved
    path = saved(tmp_path, model, optim)
    want = dcp_optim.get_optimizer_state_dict(model, optim)["state"]["0.weight"]

    fresh_model = make_model()
    fresh_model[0].weight.requires_grad_(False)
    fresh = torch.optim.Adam(fresh_model.parameters())
    template = {"model": fresh_model.state_dict(), "optim": dcp_optim.get_optimizer_state_dict(fresh_model, fresh)}
    assert "0.weight" not in template["optim"]["state"]  # the template does not ask for it
    report = check_report(path, template, [f"optim.state.0.weight.{n}" for n in ("step", "exp_avg", "exp_avg_sq")])
    assert report["optim.state.0.weight.exp_avg"] == "optimizer state 'exp_avg' of parameter '0.weight'"
    # load: read into planner.unrequested_state, the template untouched
    planner = LoadPlanner(unrequested="load")
    dcp.load(template, checkpoint_id=path, planner=planner)
    assert sorted(planner.unrequested_state) == sorted(report)
    got = {k.rsplit(".", 1)[1]: v for k, v in planner.unrequested_state.items()}
    assert_same_tree(got, {n: want[n] for n in got})


def test_lbfgs_history_is_reported(tmp_path):
    """A never-stepped LBFGS's template names the keys of its first step
    with empty history lists (D26): the trained run's history elements are
    in the checkpoint and nothing asks for them -- reported from the
    metadata alone (``dcp.load`` itself raises on the lists' length)."""
    model = make_model()
    optim = torch.optim.LBFGS(model.parameters(), history_size=3)
    train(model, optim, steps=3, closure=True)
    path = saved(tmp_path, model, optim)
    fresh_model = make_model()
    fresh = torch.optim.LBFGS(fresh_model.parameters(), history_size=3)
    template = {"model": fresh_model.state_dict(), "optim": dcp_optim.get_optimizer_state_dict(fresh_model, fresh)}
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    history = [k for k in keys if k.startswith("optim.state.")
               and any(f".{name}." in k for name in ("old_dirs", "old_stps", "ro", "al"))]
    assert any(".old_dirs." in k for k in history)
    report = unrequested_entries(template, path)
    assert sorted(report) == sorted(history)
    assert all(v.startswith("optimizer state") for v in report.values())
    with pytest.raises(dcp.api.CheckpointException, match="old_dirs"):
        dcp.load(template, checkpoint_id=path, planner=LoadPlanner(unrequested="load"))


@pytest.mark.filterwarnings("ignore:dcp_optim has no state schema:UserWarning")
def test_wrapper_state_missing_from_the_template_is_reported(tmp_path):
    """A template built for the inner optimizer (not the Lookahead that
    wraps it) lacks the wrapper's own state: the slow weights."""
    model = make_model()
    optim = po.Lookahead(torch.optim.AdamW(model.parameters()), k=2)
    train(model, optim, steps=3)
    path = saved(tmp_path, model, optim)
    own = [k for k in dcp.FileSystemReader(path).read_metadata().state_dict_metadata
           if k.startswith("optim.") and not k.startswith(("optim.state.", "optim.param_groups."))]
    assert own  # the wrapper's own entries, beside the inner optimizer's
    fresh_model = make_model()
    inner = torch.optim.AdamW(fresh_model.parameters())
    template = {"model": fresh_model.state_dict(), "optim": dcp_optim.get_optimizer_state_dict(fresh_model, inner)}
    # and the group key the wrapper adds (its step counter)
    report = check_report(path, template, [*own, "optim.param_groups.0.counter"])
    assert all("beside the optimizer's state" in report[k] for k in own)


def test_optimizer_wide_entries_are_reported(tmp_path):
    """Entries of a checkpoint the template has no key for at all (here
    an optimizer-wide entry, D29, and an application entry)."""
    model = make_model()
    optim = torch.optim.Adam(model.parameters())
    train(model, optim)
    osd = dcp_optim.get_optimizer_state_dict(model, optim)
    osd = {**osd, "state": {**osd["state"], ".optimizer_0": {"k": torch.tensor(7)}}}
    path = str(tmp_path / "ckpt")
    dcp.save({"model": model.state_dict(), "optim": osd, "extra": {"epoch": 3}}, checkpoint_id=path)
    template = {"model": model.state_dict(), "optim": dcp_optim.get_optimizer_state_dict(model, optim)}
    report = check_report(path, template, ["optim.state..optimizer_0.k", "extra.epoch"])
    assert report["optim.state..optimizer_0.k"] == "optimizer-wide state 'k' of optimizer_0"
    planner = LoadPlanner(unrequested="load")
    dcp.load(template, checkpoint_id=path, planner=planner)
    assert planner.unrequested_state == {"optim.state..optimizer_0.k": torch.tensor(7), "extra.epoch": 3}


def test_complete_template_reports_nothing(tmp_path):
    model = make_model()
    optim = torch.optim.Adam(model.parameters())
    train(model, optim)
    path = saved(tmp_path, model, optim)
    fresh_model = make_model()
    fresh = torch.optim.Adam(fresh_model.parameters())
    template = {"model": fresh_model.state_dict(), "optim": dcp_optim.get_optimizer_state_dict(fresh_model, fresh)}
    assert unrequested_entries(template, path) == {}
    planner = LoadPlanner(unrequested="raise")
    dcp.load(template, checkpoint_id=path, planner=planner)
    assert planner.unrequested == {}
    dcp_optim.set_optimizer_state_dict(fresh_model, fresh, template["optim"])
    assert_same_tree(fresh.state_dict()["state"], optim.state_dict()["state"])


def test_bad_action_is_refused():
    with pytest.raises(ValueError, match="unrequested must be one of"):
        LoadPlanner(unrequested="ignore")
