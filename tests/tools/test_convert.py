"""The layout converter (dcp_optim.convert): nested <-> flat, in memory and
for DCP checkpoints.  Exactness: loading the converted state with the other
layout gives the optimizers bit-identical state and param groups to loading
the original with its own layout -- several optimizers, several groups,
empty groups (anchored before, after, and in an optimizer without
parameters), custom group keys, tuples and the scheduler's initial_lr."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as upstream
import torch.nn as nn
from torch.distributed.checkpoint.stateful import Stateful

import dcp_optim
from dcp_optim import StateDictOptions as Opts
from dcp_optim import convert
from dcp_optim.tools.checkpoint import Checkpoint, CheckpointError

from ..support.oracle import assert_same_tree

FLAT = Opts(flatten_optimizer_state_dict=True)


def build(seed=0, step=True):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 2))
    o1 = torch.optim.AdamW(
        [
            {"params": [], "lr": 0.5, "tag": "first-empty"},
            {"params": [model[0].weight], "lr": 0.1, "custom": ("x", 1)},
            {"params": [], "lr": 0.7},
            {"params": [model[0].bias, model[2].weight]},
            {"params": [model[2].bias]},  # same hyperparameters as its neighbour
        ],
        lr=0.01,
    )
    o2 = torch.optim.SGD([{"params": []}, {"params": list(model[3].parameters()), "momentum": 0.9}], lr=0.1)
    o3 = torch.optim.Adam([{"params": [], "lr": 3.0}])  # no parameter at all
    sched = torch.optim.lr_scheduler.StepLR(o1, 1)  # adds initial_lr
    if step:
        for i in range(2):
            model(torch.randn(2, 3, generator=torch.Generator().manual_seed(i))).sum().backward()
            o1.step()
            o2.step()
            o1.zero_grad()
            o2.zero_grad()
        sched.step()
    return model, [o1, o2, o3]


def counts(optims):
    return [len(o.param_groups) for o in optims]


def load_in_memory(osd, flat):
    model, optims = build(seed=1, step=False)
    dcp_optim.set_optimizer_state_dict(model, optims, osd, options=FLAT if flat else None)
    return [o.state_dict() for o in optims]


def save(path, flat, model, optims, app=False):
    options = FLAT if flat else Opts()
    if app:
        dcp.save({"app": App(model, optims, options)}, checkpoint_id=str(path))
        return
    msd, osd = dcp_optim.get_state_dict(model, optims, options=options)
    dcp.save({"model": msd, "optim": osd, "extra": {"step": 7}}, checkpoint_id=str(path))


def load_checkpoint(path, flat, app=False, builder=build):
    """The DCP template flow into a fresh model and never-stepped optimizers."""
    model, optims = builder(seed=1, step=False)
    options = FLAT if flat else Opts()
    if app:
        dcp.load({"app": App(model, optims, options)}, checkpoint_id=str(path))
        return [o.state_dict() for o in optims], None
    msd, osd = dcp_optim.get_state_dict(model, optims, options=options)
    state = {"model": msd, "optim": osd, "extra": {"step": 0}}
    dcp.load(state, checkpoint_id=str(path))
    dcp_optim.set_state_dict(model, optims, model_state_dict=state["model"],
                             optim_state_dict=state["optim"], options=options)
    return [o.state_dict() for o in optims], state["extra"]


class App(Stateful):
    def __init__(self, model, optims, options):
        self.model, self.optims, self.options = model, optims, options

    def state_dict(self):
        m, o = dcp_optim.get_state_dict(self.model, self.optims, options=self.options)
        return {"model": m, "optim": o}

    def load_state_dict(self, state):
        dcp_optim.set_state_dict(self.model, self.optims, model_state_dict=state["model"],
                                 optim_state_dict=state["optim"], options=self.options)


# --- in memory ---------------------------------------------------------------------------


def test_to_flat_is_byte_identical_to_the_flattened_getter():
    model, optims = build()
    nested = dcp_optim.get_optimizer_state_dict(model, optims)
    flat = dcp_optim.get_optimizer_state_dict(model, optims, options=FLAT)
    converted = convert.to_flat(nested, counts(optims))
    assert list(converted) == list(flat)
    assert any("__empty_group_before_" in k for k in flat)
    assert any("__empty_group_after_" in k for k in flat)
    assert any("__optimizer_2_empty_group_0__" in k for k in flat)
    for key in flat:
        assert converted[key] is flat[key], key  # values are not copied
    # without group_counts the empty groups anchor across optimizers
    assert list(convert.to_flat(nested)) != list(flat)


def test_to_nested_in_memory_loads_bit_identically():
    model, optims = build()
    nested = dcp_optim.get_optimizer_state_dict(model, optims)
    flat = dcp_optim.get_optimizer_state_dict(model, optims, options=FLAT)
    reference = load_in_memory(nested, flat=False)
    assert_same_tree(load_in_memory(flat, flat=True), reference)
    rebuilt = convert.to_nested(flat, model)
    # neighbours with equal hyperparameters merge; empty groups keep their place
    assert [g["params"] for g in rebuilt["param_groups"]] == [
        [], ["0.weight"], [], ["0.bias", "2.weight", "2.bias"], [], ["3.weight", "3.bias"], []
    ]
    assert rebuilt["param_groups"][0]["tag"] == "first-empty"
    assert rebuilt["param_groups"][1]["custom"] == ("x", 1)
    assert_same_tree(load_in_memory(rebuilt, flat=False), reference)
    assert_same_tree(load_in_memory(convert.to_flat(nested, counts(optims)), flat=True), reference)
    # the FQNs may also be given as strings
    assert_same_tree(convert.to_nested(flat, [n for n, _ in model.named_parameters()]), rebuilt)


def test_to_nested_with_the_loading_optimizers_group_structure():
    model, optims = build()
    nested = dcp_optim.get_optimizer_state_dict(model, optims)
    flat = dcp_optim.get_optimizer_state_dict(model, optims, options=FLAT)
    groups = convert.param_groups_of(*build(seed=3, step=False))
    assert groups == [[[], ["0.weight"], [], ["0.bias", "2.weight"], ["2.bias"]],
                      [[], ["3.weight", "3.bias"]], [[]]]
    rebuilt = convert.to_nested(flat, model, groups=groups)
    assert_same_tree(rebuilt, nested)


def test_in_memory_errors():
    model, optims = build()
    nested = dcp_optim.get_optimizer_state_dict(model, optims)
    flat = dcp_optim.get_optimizer_state_dict(model, optims, options=FLAT)
    with pytest.raises(dcp_optim.errors.StateDictValueError, match="already in the nested layout"):
        convert.to_nested(nested, model)
    with pytest.raises(dcp_optim.errors.StateDictTypeError, match="nested optimizer state dict"):
        convert.to_flat(flat)
    with pytest.raises(dcp_optim.errors.StateDictKeyError, match="'bogus.key' is not a key"):
        convert.to_nested({**flat, "bogus.key": 1}, model)
    with pytest.raises(dcp_optim.errors.StateDictKeyError, match="'state.nowhere.exp_avg'"):
        convert.to_nested({**flat, "state.nowhere.exp_avg": torch.zeros(1)}, ["0.weight"])
    with pytest.raises(ValueError, match="group_counts"):
        convert.to_flat(nested, [1, 1])


# --- checkpoints ---------------------------------------------------------------------------


def test_checkpoints_convert_exactly_both_ways(tmp_path):
    model, optims = build()
    save(tmp_path / "nested", False, model, optims)
    save(tmp_path / "flat", True, model, optims)
    reference, extra = load_checkpoint(tmp_path / "nested", flat=False)
    assert extra == {"step": 7}
    assert_same_tree(load_checkpoint(tmp_path / "flat", flat=True)[0], reference)

    report = convert.convert_checkpoint(tmp_path / "nested", tmp_path / "n2f", to="flat",
                                        group_counts=counts(optims))
    assert report["optimizers"] == ["optim"] and report["to"] == "flat"
    assert Checkpoint(tmp_path / "n2f").optimizers[0].layout == "flat"
    # the converted checkpoint has exactly the keys a flattened save writes
    assert set(Checkpoint(tmp_path / "n2f").by_key) == set(Checkpoint(tmp_path / "flat").by_key)
    converted, extra = load_checkpoint(tmp_path / "n2f", flat=True)
    assert_same_tree(converted, reference)
    assert extra == {"step": 7}

    # flat -> nested: a DCP load of the nested layout is positional, so the
    # group structure comes from the optimizers that will load it
    groups = convert.param_groups_of(*build(seed=2, step=False))
    convert.convert_checkpoint(tmp_path / "flat", tmp_path / "f2n", to="nested", groups=groups)
    assert set(Checkpoint(tmp_path / "f2n").by_key) == set(Checkpoint(tmp_path / "nested").by_key)
    assert_same_tree(load_checkpoint(tmp_path / "f2n", flat=False)[0], reference)


def build_distinct(seed=0, step=True):
    """Groups whose neighbours differ: rebuilt exactly without --entry."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    optim = torch.optim.AdamW(
        [{"params": [model[0].weight], "lr": 0.1, "custom": "yes"},
         {"params": [], "lr": 0.2},
         {"params": [model[0].bias, model[1].weight], "weight_decay": 0.0},
         {"params": [model[1].bias], "lr": 0.3}],
        lr=0.01,
    )
    if step:
        model(torch.randn(2, 3)).sum().backward()
        optim.step()
    return model, [optim]


def test_app_state_checkpoints_convert_without_entry(tmp_path):
    model, optims = build_distinct()
    save(tmp_path / "nested", False, model, optims, app=True)
    save(tmp_path / "flat", True, model, optims, app=True)

    def loaded(path, flat):
        return load_checkpoint(path, flat, app=True, builder=build_distinct)[0]

    reference = loaded(tmp_path / "nested", False)
    convert.convert_checkpoint(tmp_path / "nested", tmp_path / "n2f", to="flat")
    convert.convert_checkpoint(tmp_path / "flat", tmp_path / "f2n", to="nested")
    sections = Checkpoint(tmp_path / "f2n").optimizers
    assert [(s.name, s.layout) for s in sections] == [("app.optim", "nested")]
    assert_same_tree(loaded(tmp_path / "n2f", True), reference)
    assert_same_tree(loaded(tmp_path / "f2n", False), reference)
    # and back again: byte-identical keys
    convert.convert_checkpoint(tmp_path / "f2n", tmp_path / "f2n2f", to="flat")
    assert set(Checkpoint(tmp_path / "f2n2f").by_key) == set(Checkpoint(tmp_path / "flat").by_key)


def test_upstream_flat_checkpoint_converts_and_loads(tmp_path):
    model, optims = build_distinct()
    options = upstream.StateDictOptions(flatten_optimizer_state_dict=True)
    optim = torch.optim.AdamW(  # upstream's flat format has no empty groups
        [{"params": [model[0].weight], "lr": 0.1},
         {"params": [model[0].bias, model[1].weight, model[1].bias], "weight_decay": 0.0}],
        lr=0.01,
    )
    model(torch.randn(2, 3)).sum().backward()
    optim.step()
    msd, osd = upstream.get_state_dict(model, optim, options=options)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "up"))
    convert.convert_checkpoint(tmp_path / "up", tmp_path / "nested", to="nested")

    def fresh():
        torch.manual_seed(5)
        m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        o = torch.optim.AdamW([{"params": [m[0].weight]},
                               {"params": [m[0].bias, m[1].weight, m[1].bias]}], lr=0.5)
        return m, o

    results = []
    for path, opts in ((tmp_path / "up", FLAT), (tmp_path / "nested", Opts())):
        m, o = fresh()
        msd2, osd2 = dcp_optim.get_state_dict(m, o, options=opts)
        state = {"model": msd2, "optim": osd2}
        dcp.load(state, checkpoint_id=str(path))
        dcp_optim.set_state_dict(m, o, model_state_dict=state["model"],
                                 optim_state_dict=state["optim"], options=opts)
        results.append(o.state_dict())
    assert_same_tree(results[1], results[0])
    saved = optim.state_dict()
    assert_same_tree(results[1]["state"], saved["state"])
    assert results[1]["param_groups"] == saved["param_groups"]  # values (key order is the live group's)


def test_checkpoint_errors(tmp_path):
    model, optims = build_distinct()
    save(tmp_path / "nested", False, model, optims)
    with pytest.raises(CheckpointError, match="already uses the nested layout"):
        convert.convert_checkpoint(tmp_path / "nested", tmp_path / "x", to="nested")
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        convert.convert_checkpoint(tmp_path / "missing", tmp_path / "x", to="flat")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not empty"):
        convert.convert_checkpoint(tmp_path / "nested", tmp_path / "busy", to="flat")
    with pytest.raises(CheckpointError, match="is the source"):
        convert.convert_checkpoint(tmp_path / "nested", tmp_path / "nested", to="flat")
    with pytest.raises(dcp_optim.errors.StateDictValueError, match="'flat' or 'nested'"):
        convert.convert_checkpoint(tmp_path / "nested", tmp_path / "x", to="flattened")
    convert.convert_checkpoint(tmp_path / "nested", tmp_path / "busy", to="flat", overwrite=True)
    assert Checkpoint(tmp_path / "busy").optimizers[0].layout == "flat"
    # a damaged data file: the error names the file and the key
    data = next((tmp_path / "nested").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:64])
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: cannot read '"):
        convert.convert_checkpoint(tmp_path / "nested", tmp_path / "y", to="flat")
