"""A never-stepped parameter of an optimizer without a schema resumes as
the fresh optimizer (D48 in docs/differences.md).

Its template comes from a shadow step: the state *after* one step with
zero gradients.  Loaded as state, that made the resumed first step
differ from the fresh optimizer's for about a quarter of the corpus
(Yogi's second moment scaled once, PID's gradient buffer a zero
gradient, pytorch-optimizer's group ``step`` already 1, heavyball's
``step_count``): a checkpoint taken before the first step, or the
template given back, changed training silently.  The getter now marks
those parameters (their names in ``params``, nested; their group
entries' numbers, flattened), and a load installs no state for them and
no group key a first step adds.  Optimizers from PyPI: torch-optimizer,
pytorch-optimizer, heavyball."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as upstream

import dcp_optim
from dcp_optim.marks import NeverSteppedFloat, NeverSteppedName

from .test_optim_corpus import CATALOGUE, _build, _step

pytest.importorskip("torch_optimizer")
pytest.importorskip("pytorch_optimizer")
heavyball = pytest.importorskip("heavyball")
heavyball.utils.compile_mode = None  # its compiled steps take minutes on this CPU

# state only in tensors, no group key a step adds (AccSGD, PID); a number
# in each entry (Yogi); a group "step" a first step adds (pytorch-
# optimizer); a tensor group key and an own state_dict() entry (heavyball);
# no state at all, group keys a step adds (AliG: "step", "step_size"); an
# optimizer-wide entry a step adds (MADGRAD's "k"); a wrapper whose step
# reads the state it wraps, and whose own entries a step fills (Magma over
# AdamW: a schema's template, zeros, is not "no moment yet" to it)
CASES = ["topt.AccSGD", "topt.PID", "topt.Yogi", "po.yogi", "po.adan", "heavyball.AdamW", "po.alig", "po.madgrad",
         "po.magma"]
pytestmark = pytest.mark.usefixtures("quiet_warnings")
FORMATS = pytest.mark.parametrize("flat", [False, True], ids=["nested", "flat"])


def _pair(name: str):
    skip, factory = CATALOGUE[name]
    assert not skip, skip
    return _build(factory)


def _same_params(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def _groups(optim) -> list[dict]:
    # (heavyball's own state_dict() leaves out its "_" keys: "_orig_shapes",
    # which its next step recreates)
    return [{k: v for k, v in g.items() if k != "params" and not str(k).startswith("_")} for g in optim.param_groups]


def _options(flat: bool) -> dcp_optim.StateDictOptions:
    return dcp_optim.StateDictOptions(flatten_optimizer_state_dict=flat)


def _resumed(name: str, model, saved: dict, path, flat: bool):
    """A fresh pair of the corpus entry, with ``model``'s weights and
    ``saved`` resumed through DCP (the template of the never-stepped
    optimizer, dcp.load, set)."""
    dcp.save({"optim": saved}, checkpoint_id=str(path))
    new_model, new_optim = _pair(name)
    new_model.load_state_dict(model.state_dict())
    template = {"optim": dcp_optim.get_optimizer_state_dict(new_model, new_optim, options=_options(flat))}
    dcp.load(template, checkpoint_id=str(path))
    dcp_optim.set_optimizer_state_dict(new_model, new_optim, template["optim"], options=_options(flat))
    return new_model, new_optim


@FORMATS
@pytest.mark.parametrize("name", CASES)
def test_never_stepped_checkpoint_resumes_like_the_fresh_optimizer(name, flat, tmp_path):
    fresh_model, fresh = _pair(name)
    # saved before any step, through DCP, into the template of another
    # never-stepped optimizer
    model, optim = _pair(name)
    dcp.save({"optim": dcp_optim.get_optimizer_state_dict(model, optim, options=_options(flat))},
             checkpoint_id=str(tmp_path))
    model, optim = _pair(name)
    template = {"optim": dcp_optim.get_optimizer_state_dict(model, optim, options=_options(flat))}
    dcp.load(template, checkpoint_id=str(tmp_path))
    dcp_optim.set_optimizer_state_dict(model, optim, template["optim"], options=_options(flat))
    # no state and the fresh optimizer's groups, plain numbers in them
    # (an empty entry where the optimizer keeps no state: AliG)
    assert not any(v for k, v in optim.state.items() if isinstance(k, torch.Tensor)), optim.state
    assert _groups(optim) == _groups(fresh)
    assert all(type(v) in (int, float) for g in _groups(optim) for v in g.values()
               if isinstance(v, (int, float)) and not isinstance(v, bool))
    # the template given back, without DCP
    back_model, back = _pair(name)
    given = copy.deepcopy(dcp_optim.get_optimizer_state_dict(back_model, back, options=_options(flat)))
    dcp_optim.set_optimizer_state_dict(back_model, back, given, options=_options(flat))
    for i in range(3):
        _step(fresh_model, fresh, i)
        _step(model, optim, i)
        _step(back_model, back, i)
    assert _same_params(model, fresh_model)
    assert _same_params(back_model, fresh_model)


@pytest.mark.parametrize("name", ["topt.Yogi", "po.yogi"])
def test_upstream_resumes_its_never_stepped_checkpoint_differently(name, tmp_path):
    """Upstream's template is its dummy step's state (and it steps the live
    optimizer); the resumed run differs from the fresh one."""
    fresh_model, fresh = _pair(name)
    model, optim = _pair(name)
    dcp.save({"optim": upstream.get_optimizer_state_dict(model, optim)}, checkpoint_id=str(tmp_path))
    model, optim = _pair(name)
    template = {"optim": upstream.get_optimizer_state_dict(model, optim)}
    dcp.load(template, checkpoint_id=str(tmp_path))
    upstream.set_optimizer_state_dict(model, optim, template["optim"])
    for i in range(3):
        _step(fresh_model, fresh, i)
        _step(model, optim, i)
    assert not _same_params(model, fresh_model)


@FORMATS
@pytest.mark.parametrize("name", ["topt.Yogi", "po.yogi", "heavyball.AdamW", "po.alig", "po.madgrad", "po.magma"])
def test_trained_checkpoint_through_a_never_stepped_template_loads_whole(name, flat, tmp_path):
    """A trained checkpoint replaces the template's marks with its plain
    names and numbers: every parameter's state is loaded, and the group
    keys its steps added (AliG keeps no state, only those)."""
    model, optim = _pair(name)
    for i in range(2):
        _step(model, optim, i)
    saved = dcp_optim.get_optimizer_state_dict(model, optim, options=_options(flat))
    new_model, new_optim = _resumed(name, model, saved, tmp_path, flat)
    # (entries that hold something: the flattened format has no key for an
    # empty one, AliG's)
    assert len([k for k, v in new_optim.state.items() if isinstance(k, torch.Tensor) and v]) == \
        len([k for k, v in optim.state.items() if isinstance(k, torch.Tensor) and v])
    assert _groups(new_optim) == _groups(optim)
    for i in range(2, 4):
        _step(model, optim, i)
        _step(new_model, new_optim, i)
    assert _same_params(model, new_model)


@FORMATS
def test_partly_stepped_optimizer_marks_only_the_parameters_without_state(flat, tmp_path):
    """A parameter that had no gradient at the first steps is marked, the
    others are not; the resume leaves it without state and loads theirs."""
    name = "topt.Yogi"

    def run(model, optim, steps):
        for i in steps:
            model.b.weight.requires_grad_(i >= 2)
            model.b.bias.requires_grad_(i >= 2)
            _step(model, optim, i)

    model, optim = _pair(name)
    run(model, optim, range(2))
    model.b.requires_grad_(True)  # trainable, without state
    saved = dcp_optim.get_optimizer_state_dict(model, optim, options=_options(flat))
    if flat:
        marked = {k for k, v in saved.items() if isinstance(v, NeverSteppedFloat)}
        assert marked and all(k.startswith(("param_groups.b.weight.", "param_groups.b.bias.")) for k in marked)
    else:
        names = saved["param_groups"][0]["params"]
        assert [n for n in names if isinstance(n, NeverSteppedName)] == ["b.weight", "b.bias"]
    new_model, new_optim = _resumed(name, model, saved, tmp_path, flat)
    assert set(new_optim.state) == {new_model.a.weight, new_model.a.bias}
    run(model, optim, range(2, 4))
    run(new_model, new_optim, range(2, 4))
    assert _same_params(model, new_model)


def test_marks_leave_the_callers_dict_and_the_optimizer_alone():
    model, optim = _pair("topt.Yogi")
    given = dcp_optim.get_optimizer_state_dict(model, optim)
    before = copy.deepcopy(given)
    dcp_optim.set_optimizer_state_dict(model, optim, given)
    assert given["param_groups"] == before["param_groups"]
    assert [type(n) for n in given["param_groups"][0]["params"]] == [NeverSteppedName] * 4
    assert given["state"].keys() == before["state"].keys()
    for fqn, entry in given["state"].items():
        assert entry.keys() == before["state"][fqn].keys()
        assert all(torch.equal(v, before["state"][fqn][k]) if isinstance(v, torch.Tensor) else v == before["state"][fqn][k]
                   for k, v in entry.items())
    # the live groups never held a mark
    assert all(type(p) is torch.nn.Parameter for g in optim.param_groups for p in g["params"])


def test_marks_pickle_under_the_public_module():
    """A checkpoint names the marks' classes by their module: the public
    ``dcp_optim.marks``, never the engine's."""
    import pickle

    from dcp_optim import marks

    for value in (marks.NeverSteppedName("a.weight"), marks.NeverSteppedInt(3), marks.NeverSteppedFloat(0.5),
                  marks.StepCreatedInt(1), marks.StepCreatedFloat(0.25)):
        data = pickle.dumps(value)
        assert b"dcp_optim.marks" in data and b"_engine" not in data
        back = pickle.loads(data)
        assert type(back) is type(value) and back == value
        buffer = io.BytesIO()
        torch.save(value, buffer)
        buffer.seek(0)
        assert type(torch.load(buffer, weights_only=True)) is type(value)


def test_marks_taken_out_of_a_dict_for_fsdps_own_load():
    """Loads through FSDP's own functions (FSDP1 hybrid sharding) take
    the marks out of the dict itself: no state for a marked name (not a
    name that merely starts like it, not a dotted state name's prefix), no
    mark left, no first step's group value, and in a group all of whose
    parameters are marked no value the live group lacks that no mark can
    carry."""
    from dcp_optim._engine.never_stepped import marked_names, unmarked_dict
    from dcp_optim.marks import NeverSteppedInt, StepCreatedInt

    live = {"lr": 0.1, "params": []}
    flat = {
        "state.a.weight.exp_avg": torch.ones(2),
        "state.a.weight.sq.avg": torch.ones(2),  # a dotted state name
        "state.a.weight2.exp_avg": torch.zeros(2),
        "param_groups.a.weight.lr": NeverSteppedFloat(0.1),
        "param_groups.a.weight.step": StepCreatedInt(1),
        "param_groups.a.weight.flag": torch.tensor(True),
        "param_groups.a.weight2.lr": 0.1,
        "param_groups.a.weight2.step": 3,
    }
    never = marked_names(flat, True)
    assert never == {"a.weight"}
    out = unmarked_dict(flat, True, never, {"a.weight": (live, True), "a.weight2": (live, False)})
    assert set(out) == {"state.a.weight2.exp_avg", "param_groups.a.weight.lr", "param_groups.a.weight2.lr",
                        "param_groups.a.weight2.step"}
    assert type(out["param_groups.a.weight.lr"]) is float and type(out["param_groups.a.weight2.step"]) is int
    assert isinstance(flat["param_groups.a.weight.lr"], NeverSteppedFloat)  # the caller's dict untouched

    nested = {
        "state": {"a.weight": {"exp_avg": torch.ones(2)}, "b.weight": {"exp_avg": torch.zeros(2)}},
        "param_groups": [{"lr": 0.1, "step": StepCreatedInt(1), "params": [NeverSteppedName("a.weight")]},
                         {"lr": 0.2, "step": NeverSteppedInt(4), "params": ["b.weight"]}],
    }
    never = marked_names(nested, False)
    assert never == {"a.weight"}
    out = unmarked_dict(nested, False, never, {"a.weight": (live, True), "b.weight": ({**live, "step": 0}, False)})
    assert list(out["state"]) == ["b.weight"]
    assert out["param_groups"] == [{"lr": 0.1, "params": ["a.weight"]}, {"lr": 0.2, "step": 4, "params": ["b.weight"]}]
    assert [type(p) for g in out["param_groups"] for p in g["params"]] == [str, str]
    assert type(out["param_groups"][1]["step"]) is int
    assert isinstance(nested["param_groups"][0]["params"][0], NeverSteppedName)
