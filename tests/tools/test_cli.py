"""``python -m dcp_optim``: inspect, convert, diff and plan on real DCP
checkpoints (template and AppState patterns, both optimizer layouts)."""

from __future__ import annotations

import json
import sys

import pytest
import torch.distributed.checkpoint as dcp

import dcp_optim
from dcp_optim import verify
from dcp_optim.__main__ import main

from ..distributed import dist_cases_adoption as cases

ENTRY = "tests.distributed.dist_cases_adoption:plan_entry"


def _save(path, *, flat=False, app=False, steps=2, lr=None):
    model, optim = cases.build(1, seed=3, sharded=False)
    cases.train(model, optim, steps)
    if lr is not None:
        optim.param_groups[0]["lr"] = lr
    options = dcp_optim.StateDictOptions(flatten_optimizer_state_dict=flat)
    msd, osd = dcp_optim.get_state_dict(model, optim, options=options)
    if app:
        state = {"app": {"model": msd, "optim": osd}}
    else:
        state = {"model": msd, "optim": osd, "extra": {"step": steps, "note": "demo"}}
    dcp.save(state, checkpoint_id=str(path))
    return model, optim


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("cli")
    paths = {
        "nested": base / "nested",
        "flat": base / "flat",
        "app_flat": base / "app_flat",
        "more": base / "more",  # one more step
        "lr": base / "lr",  # same tensors, other lr
    }
    _save(paths["nested"])
    _save(paths["flat"], flat=True)
    _save(paths["app_flat"], flat=True, app=True)
    _save(paths["more"], steps=3)
    _save(paths["lr"], lr=0.5)
    return {k: str(v) for k, v in paths.items()}


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _optimizer_row(out: str, fqn: str) -> str:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("optimizer '"))
    return next(line for line in lines[start:] if line.strip().startswith(fqn + " "))


# --- inspect -------------------------------------------------------------------------------------


def test_inspect_text(ckpts, capsys):
    code, out, _ = run(capsys, "inspect", ckpts["nested"])
    assert code == 0
    assert "model 'model': 13 entries" in out
    assert "optimizer 'optim': nested layout, 2 param group(s), 13 parameter(s) with state" in out
    lines = out.splitlines()
    row = _optimizer_row(out, "blocks.0.up.weight")
    assert row.split() == ["blocks.0.up.weight", "0", "step", "()", "float32"]
    following = out.splitlines()[out.splitlines().index(row) + 1]
    assert following.split() == ["exp_avg", "(7,", "8)", "float32"]
    assert any("tag='decay'" in line and "weight_decay=0.1" in line for line in lines)
    assert "other entries" in out and any(line.split()[:3] == ["extra.step", "object", "2"] for line in lines)


def test_inspect_json_both_layouts_and_app_state(ckpts, capsys):
    reports = {}
    for name in ("nested", "flat", "app_flat"):
        code, out, _ = run(capsys, "inspect", ckpts[name], "--json")
        assert code == 0
        reports[name] = json.loads(out)
    nested, flat, app = reports["nested"], reports["flat"], reports["app_flat"]
    assert [o["layout"] for o in (nested["optimizers"][0], flat["optimizers"][0])] == ["nested", "flat"]
    assert app["models"][0]["name"] == "app.model" and app["optimizers"][0]["name"] == "app.optim"
    assert app["optimizers"][0]["fqns_from"] == "model section 'app.model'"
    for report in (nested, flat, app):
        opt = report["optimizers"][0]
        assert opt["state"]["blocks.0.up.weight"]["group"] == 0
        assert opt["state"]["blocks.0.norm.bias"]["group"] == 1
        st = opt["state"]["blocks.1.down.weight"]["states"]
        assert sorted(st) == ["exp_avg", "exp_avg_sq", "step"]
        assert st["exp_avg"]["shape"] == [8, 7] and st["exp_avg"]["dtype"] == "float32"
        groups = opt["param_groups"]
        assert [g["hyperparameters"]["weight_decay"] for g in groups] == [0.1, 0.0]
        assert groups[0]["hyperparameters"]["tag"] == "decay"
        assert groups[0]["hyperparameters"]["betas"] == [0.9, 0.999]
        assert len(groups[0]["params"]) + len(groups[1]["params"]) == 13
        assert report["models"][0]["entries"]["head.weight"]["shape"] == [3, 8]
    assert {e["key"]: e["value"] for e in nested["other"]} == {"extra.step": 2, "extra.note": "demo"}


def test_inspect_values_and_filter(ckpts, capsys):
    code, out, err = run(capsys, "inspect", ckpts["nested"], "--json", "--values", "--fqn", "head.*")
    assert code == 0 and "reading tensors" in err
    report = json.loads(out)
    assert list(report["models"][0]["entries"]) == ["head.weight"]
    stats = report["models"][0]["entries"]["head.weight"]["stats"]
    value = dcp_optim.tools.checkpoint.Checkpoint(ckpts["nested"]).value("model.head.weight")
    lo, hi = verify.tensor_checksum(value)
    assert stats["checksum"] == f"{hi:08x}{lo:08x}"
    assert stats["min"] == float(value.min()) and stats["max"] == float(value.max())
    assert list(report["optimizers"][0]["state"]) == ["head.weight"]


def test_inspect_metadata_only_reads_no_data_file(ckpts, capsys, tmp_path):
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(ckpts["nested"], damaged)
    for data in damaged.glob("*.distcp"):
        data.write_bytes(b"")
    code, out, _ = run(capsys, "inspect", str(damaged), "--metadata-only")
    assert code == 0
    assert "param groups not read" in out and "param group keys (values not read): " in out
    row = _optimizer_row(out, "blocks.0.up.weight")
    assert row.split()[1] == "?"  # group membership needs the 'params' values
    code, out, err = run(capsys, "inspect", str(damaged))
    assert code == 2 and out == ""
    assert "__0_0.distcp: cannot read 'optim.param_groups." in err or "cannot read 'extra." in err
    assert err.startswith("dcp-optim inspect: error: ")


# --- convert and diff ---------------------------------------------------------------------------------


def test_convert_then_diff_equal(ckpts, capsys, tmp_path):
    out_dir = str(tmp_path / "converted")
    code, out, err = run(capsys, "convert", ckpts["nested"], out_dir, "--to", "flat")
    assert code == 0 and f"wrote {out_dir}: optimizer(s) optim in the flat layout" in out
    assert "reading:" in err and "writing" in err
    code, out, _ = run(capsys, "diff", ckpts["nested"], out_dir, "--values", "-q")
    assert code == 0
    assert "layout in A and the flat layout in B; compared per FQN" in out
    assert out.strip().endswith("no differences")
    code, _, err = run(capsys, "convert", out_dir, str(tmp_path / "again"), "--to", "flat", "-q")
    assert code == 2 and "already uses the flat layout" in err
    code, out, err = run(capsys, "convert", out_dir, str(tmp_path / "back"), "--to", "nested", "-q",
                         "--entry", ENTRY)
    assert code == 0 and "note:" not in err
    code, out, _ = run(capsys, "diff", ckpts["nested"], str(tmp_path / "back"), "--values", "-q")
    assert code == 0, out


def test_diff_reports_differences(ckpts, capsys):
    code, out, _ = run(capsys, "diff", ckpts["nested"], ckpts["lr"], "-q")
    assert code == 1
    assert "  param group of blocks.0.up.weight: lr: 0.01 vs 0.5" in out
    assert "param group of blocks.0.norm.bias" not in out  # the other group is unchanged
    assert "tensor values not compared" not in out.splitlines()[-1]
    # tensors differ only by value: found with --values only
    code, out, _ = run(capsys, "diff", ckpts["nested"], ckpts["more"], "-q")
    assert code == 1 and "extra.step: 2 vs 3" in out and "values differ" not in out
    code, out, _ = run(capsys, "diff", ckpts["nested"], ckpts["more"], "--values", "-q", "--json")
    assert code == 1
    report = json.loads(out)
    whats = {(d["kind"], d["fqn"], d["name"]): d["what"] for d in report["differences"]}
    assert whats[("model", "head.weight", "")].startswith("values differ in ")
    assert whats[("state", "head.weight", "step")].startswith("values differ in 1 of 1 elements")
    code, out, _ = run(capsys, "diff", ckpts["nested"], ckpts["app_flat"], "-q")
    assert code == 1 and "only in A (object)" in out  # extra.* entries


def test_diff_shapes_and_missing(ckpts, capsys, tmp_path):
    model, optim = cases.plan_entry_changed()
    cases.train(model, optim, 1)
    msd, osd = dcp_optim.get_state_dict(model, optim)
    del msd["blocks.0.norm.bias"]
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "other"))
    code, out, _ = run(capsys, "diff", ckpts["nested"], str(tmp_path / "other"), "-q")
    assert code == 1
    assert "  head.weight: shape (3, 8) vs (4, 8)" in out
    assert "  blocks.0.norm.bias: only in A ((8,) float32)" in out
    assert "  state head.weight [exp_avg]: shape (3, 8) vs (4, 8)" in out


# --- plan ------------------------------------------------------------------------------------------------


def test_plan_clean_load(ckpts, capsys):
    code, out, _ = run(capsys, "plan", ckpts["nested"], "--entry", ENTRY, "--json")
    assert code == 0
    report = json.loads(out)
    actions = {(r["section"], r["fqn"], r["name"]): r["action"] for r in report["rows"]}
    assert actions[("model", "head.weight", "")] == "load"
    assert actions[("optimizer", "blocks.0.up.weight", "exp_avg")] == "load"
    assert report["summary"] == {"load": 13 + 13 * 3 + 2}
    code, out, _ = run(capsys, "plan", ckpts["app_flat"], "--entry", ENTRY)
    assert code == 0 and "optimizer section 'app.optim' (flat layout)" in out
    assert "summary: 54 load; no conflicts" in out


def test_plan_conflicts(ckpts, capsys):
    code, out, _ = run(capsys, "plan", ckpts["nested"], "--entry",
                       "tests.distributed.dist_cases_adoption:plan_entry_changed")
    assert code == 1
    assert "  conflict  head.weight" in out and "shape: checkpoint (3, 8), live (4, 8)" in out
    group_line = next(line for line in out.splitlines() if "optimizer 0 group 0" in line)
    assert group_line.split()[0] == "conflict"
    assert "lr 0.5 -> 0.01" in group_line
    assert "saved groups beyond the 1 the load template holds" in group_line
    assert "conflicts found" in out
    code, out, _ = run(capsys, "plan", ckpts["more"], "--entry", ENTRY, "--json", "--partial")
    assert code == 0


def test_plan_missing_entries(ckpts, capsys, tmp_path):
    model, optim = cases.plan_entry()
    msd, osd = dcp_optim.get_state_dict(model, optim)
    del msd["head.weight"]
    del osd["state"]["head.weight"]
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "partial"))
    code, out, _ = run(capsys, "plan", str(tmp_path / "partial"), "--entry", ENTRY, "--json")
    assert code == 1
    rows = {(r["fqn"], r["name"]): r for r in json.loads(out)["rows"]}
    assert rows[("head.weight", "")]["action"] == "conflict"
    assert "missing state" in rows[("head.weight", "exp_avg")]["detail"]
    code, out, _ = run(capsys, "plan", str(tmp_path / "partial"), "--entry", ENTRY, "--json", "--partial")
    assert code == 0
    rows = {(r["fqn"], r["name"]): r for r in json.loads(out)["rows"]}
    assert rows[("head.weight", "")]["action"] == "fresh"
    assert rows[("head.weight", "exp_avg")]["action"] == "fresh"


# --- errors and the module entry point ---------------------------------------------------------------


def test_errors_name_the_problem(ckpts, capsys, tmp_path):
    code, _, err = run(capsys, "inspect", str(tmp_path / "nope"))
    assert code == 2 and "no such checkpoint directory" in err and str(tmp_path / "nope") in err
    (tmp_path / "empty").mkdir()
    code, _, err = run(capsys, "inspect", str(tmp_path / "empty"))
    assert code == 2 and "not a DCP checkpoint (no .metadata file)" in err
    code, _, err = run(capsys, "plan", ckpts["nested"], "--entry", "tests.distributed.dist_cases_adoption:nothing")
    assert code == 2 and "has no function 'nothing'" in err
    code, _, err = run(capsys, "plan", ckpts["nested"], "--entry", "no_such_module_xyz:f")
    assert code == 2 and "cannot import no_such_module_xyz" in err
    code, _, err = run(capsys, "convert", ckpts["nested"], str(tmp_path / "x"), "--to", "flat",
                       "--group-counts", "a,b")
    assert code == 2 and "--group-counts must be comma-separated integers" in err
    assert run(capsys, "diff", ckpts["nested"])[0] == 2  # usage error
    assert run(capsys, "--help")[0] == 0


def test_python_dash_m_entry_point(ckpts, capsys, monkeypatch):
    """``python -m dcp_optim`` runs dcp_optim/__main__.py as __main__ (run
    in this interpreter: a fresh one would spend its time importing torch)."""
    import runpy

    monkeypatch.setattr(sys, "argv", ["dcp_optim", "inspect", ckpts["flat"], "--json", "--fqn", "head.*"])
    monkeypatch.delitem(sys.modules, "dcp_optim.__main__", raising=False)
    with pytest.raises(SystemExit) as info:
        runpy.run_module("dcp_optim", run_name="__main__", alter_sys=True)
    assert info.value.code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["optimizers"][0]["layout"] == "flat"
    assert list(report["models"][0]["entries"]) == ["head.weight"]
