"""Issue 23, requirements 3 and 6: a strict optimizer load never reports
success while dropping state, and the smaller rules (docs/differences.md,
D28).

Each scenario runs on both implementations (``impl``).  Where upstream
silently loses state or aliases live tensors, its run is a strict expected
failure naming what it does; dcp_optim's run must pass.
"""

from __future__ import annotations

import pytest
import pytorch_optimizer as po
import torch
import torch.distributed.checkpoint.state_dict as upstream
import torch.nn as nn

import dcp_optim
from dcp_optim import errors

from ..support.oracle import assert_same_tree, optimizer_snapshot

FORMATS = pytest.mark.parametrize("flat", [False, True], ids=["nested", "flat"])
# the shadow step's one-time notice for classes without a schema
NO_SCHEMA = pytest.mark.filterwarnings("ignore:dcp_optim has no state schema:UserWarning")


def impls(reason: str | None):
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.mark.parametrize(
        "impl",
        [pytest.param(upstream, id="upstream", marks=marks), pytest.param(dcp_optim, id="dcp_optim")],
    )


def opts(impl, **kwargs):
    return impl.StateDictOptions(**kwargs)


def stepped(cls, steps=2, **kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    optim = cls(model.parameters(), **kwargs)
    for i in range(steps):
        optim.zero_grad()
        model(torch.randn(5, 3, generator=torch.Generator().manual_seed(i))).pow(2).sum().backward()
        optim.step()
    # gradients as a fresh process has them (upstream's loads skip their
    # initialising step while gradients are set, D2 in docs/differences.md)
    optim.zero_grad(set_to_none=True)
    return model, optim


def without(osd, flat, fqn, name):
    """A copy of ``osd`` without state ``name`` of parameter ``fqn``."""
    if flat:
        return {k: v for k, v in osd.items() if k != f"state.{fqn}.{name}"}
    state = {k: ({n: v for n, v in e.items() if n != name} if k == fqn else e) for k, e in osd["state"].items()}
    return {**osd, "state": state}


# --- requirement 3: a partial entry -------------------------------------------


@NO_SCHEMA
@FORMATS
@pytest.mark.parametrize(
    "cls, name",
    [(po.AdaBelief, "exp_avg_var"), (po.Lion, "exp_avg"), (po.Prodigy, "exp_avg_sq")],
    ids=["AdaBelief", "Lion", "Prodigy"],
)
@impls("a schema-less optimizer's entry lacking a state name loads and reports success; "
       "the next step restarts that state from zeros")
def test_strict_refuses_an_entry_lacking_template_state(impl, cls, name, flat):
    model, optim = stepped(cls)
    osd = dcp_optim.get_optimizer_state_dict(model, optim, options=opts(dcp_optim, flatten_optimizer_state_dict=flat))
    bad = without(osd, flat, "0.weight", name)
    fresh = cls(model.parameters())
    before = optimizer_snapshot([fresh])
    with pytest.raises(errors.MissingOptimizerStateError) as info:
        impl.set_optimizer_state_dict(model, fresh, bad, options=opts(impl, flatten_optimizer_state_dict=flat))
    assert info.value.missing == ["0.weight"]
    # Lion keeps one state name: without it the flattened dict has no key
    # of the parameter, which is then missing altogether (E18)
    assert repr(name) in str(info.value) or "Missing optimizer state for parameter '0.weight'" in str(info.value)
    assert "strict=False" in str(info.value)
    assert_same_tree(optimizer_snapshot([fresh]), before)  # nothing changed


@NO_SCHEMA
def test_non_strict_loads_the_partial_entry_as_upstream():
    """``strict=False`` keeps its meaning: what the dict holds is loaded,
    as torch's ``load_state_dict`` and upstream do (upstream's flattened
    load fake-steps a fresh optimizer first and keeps that step's values
    for the missing name, so the comparison is with its nested load; ours
    loads the same in both formats)."""
    model, optim = stepped(po.AdaBelief)
    got = []
    for impl, flat in ((upstream, False), (dcp_optim, False), (dcp_optim, True)):
        osd = dcp_optim.get_optimizer_state_dict(
            model, optim, options=opts(dcp_optim, flatten_optimizer_state_dict=flat)
        )
        bad = without(osd, flat, "0.weight", "exp_avg_var")
        fresh = po.AdaBelief(model.parameters())
        impl.set_optimizer_state_dict(
            model, fresh, bad, options=opts(impl, strict=False, flatten_optimizer_state_dict=flat)
        )
        got.append(fresh.state_dict()["state"])
    assert "exp_avg_var" not in got[1][0] and "exp_avg" in got[1][0]
    assert_same_tree(got[1], got[0])
    assert_same_tree(got[2], got[0])


@impls("an empty entry for a parameter whose optimizer keeps state loads and reports success")
def test_strict_refuses_an_empty_entry_of_a_schema_optimizer(impl):
    """(Nested format: the flattened one has no spelling of an empty
    entry; without keys the parameter is missing, E18.)"""
    model, optim = stepped(torch.optim.Adam)
    osd = dcp_optim.get_optimizer_state_dict(model, optim)
    bad = {**osd, "state": {**osd["state"], "2.bias": {}}}
    fresh = torch.optim.Adam(model.parameters())
    before = optimizer_snapshot([fresh])
    with pytest.raises(errors.MissingOptimizerStateError) as info:
        impl.set_optimizer_state_dict(model, fresh, bad)
    assert info.value.missing == ["2.bias"]
    assert_same_tree(optimizer_snapshot([fresh]), before)


@NO_SCHEMA
@FORMATS
@impls("upstream fake-steps the fresh optimizer first: nested, E18 is raised with the optimizer "
       "already changed; flattened, the fake step's zeros stand in for the missing state")
def test_strict_refuses_a_schema_less_parameter_without_state(impl, flat):
    model, optim = stepped(po.Lion)
    osd = dcp_optim.get_optimizer_state_dict(model, optim, options=opts(dcp_optim, flatten_optimizer_state_dict=flat))
    if flat:
        bad = {k: v for k, v in osd.items() if not k.startswith("state.0.weight.")}
    else:
        bad = {**osd, "state": {k: v for k, v in osd["state"].items() if k != "0.weight"}}
    fresh = po.Lion(model.parameters())
    with pytest.raises(RuntimeError, match="Missing optimizer state for parameter '0.weight'"):
        impl.set_optimizer_state_dict(model, fresh, bad, options=opts(impl, flatten_optimizer_state_dict=flat))
    assert not fresh.state


# --- requirement 6: the smaller rules -----------------------------------------


@FORMATS
def test_integer_state_is_cast_as_upstream(flat):
    """An int64 ``exp_avg`` takes the parameter's dtype (torch's
    ``load_state_dict`` rule, which upstream follows); dcp_optim refused
    it before ("expected a floating-point tensor")."""
    model, optim = stepped(torch.optim.Adam)
    osd = dcp_optim.get_optimizer_state_dict(model, optim)
    state = {
        k: {**e, "exp_avg": (e["exp_avg"] * 1000).to(torch.int64), "exp_avg_sq": (e["exp_avg_sq"] > 0)}
        for k, e in osd["state"].items()
    }
    ints = {**osd, "state": state}
    got = []
    for impl in (upstream, dcp_optim):
        fresh = torch.optim.Adam(model.parameters())
        src = ints
        if flat:
            src = impl.get_optimizer_state_dict(model, optim, options=opts(impl, flatten_optimizer_state_dict=True))
            src = {
                k: (ints["state"][k.split(".", 1)[1].rsplit(".", 1)[0]][k.rsplit(".", 1)[1]] if k.startswith("state.")
                    else v)
                for k, v in src.items()
            }
        impl.set_optimizer_state_dict(model, fresh, src, options=opts(impl, flatten_optimizer_state_dict=flat))
        got.append(fresh.state_dict()["state"])
    assert got[1][0]["exp_avg"].dtype == torch.float32 and got[1][0]["exp_avg_sq"].dtype == torch.float32
    assert_same_tree(got[1], got[0])


def test_non_str_group_key_round_trips_flat_as_upstream():
    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    got = []
    for impl in (upstream, dcp_optim):
        optim = torch.optim.Adam([{"params": model.parameters(), 3: "saved"}])
        flat = impl.get_optimizer_state_dict(model, optim, options=opts(impl, flatten_optimizer_state_dict=True))
        assert flat["param_groups.weight.3"] == "saved"
        fresh = torch.optim.Adam([{"params": model.parameters(), 3: "live"}])
        impl.set_optimizer_state_dict(model, fresh, flat, options=opts(impl, flatten_optimizer_state_dict=True))
        got.append(fresh.param_groups[0])
    assert got[1][3] == "saved" and "3" not in got[1]
    assert {k: v for k, v in got[1].items() if k != "params"} == {k: v for k, v in got[0].items() if k != "params"}


@FORMATS
@pytest.mark.parametrize("full", [False, True], ids=["sharded", "full"])
@impls("cpu_offload returns the optimizer's own tensors on the CPU: training on changes the returned dict")
def test_cpu_offload_getter_returns_copies(impl, flat, full):
    model, optim = stepped(torch.optim.Adam)
    options = opts(impl, cpu_offload=True, full_state_dict=full, flatten_optimizer_state_dict=flat)
    got = impl.get_optimizer_state_dict(model, optim, options=options)
    want = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in
            (got.items() if flat else got["state"]["0.weight"].items())}
    live = {t.untyped_storage().data_ptr() for st in optim.state.values() for t in st.values()}
    tensors = [v for v in (got.values() if flat else [t for e in got["state"].values() for t in e.values()])
               if isinstance(v, torch.Tensor)]
    assert tensors
    assert not any(t.untyped_storage().data_ptr() in live for t in tensors)
    optim.zero_grad()
    model(torch.randn(5, 3)).pow(2).sum().backward()
    optim.step()  # training on does not change the dict about to be saved
    after = got.items() if flat else got["state"]["0.weight"].items()
    assert_same_tree(dict(after), want)


@NO_SCHEMA
@FORMATS
def test_strict_check_after_the_template_flow_uses_the_template(flat, tmp_path):
    """The template flow (get -> dcp.load -> set): the setter checks the
    loaded entries against the names of the template the getter built
    (no second shadow step), and refuses what the checkpoint lacks."""
    import torch.distributed.checkpoint as dcp

    model, optim = stepped(po.AdaBelief)
    options = opts(dcp_optim, flatten_optimizer_state_dict=flat)
    osd = dcp_optim.get_optimizer_state_dict(model, optim, options=options)
    dcp.save({"optim": without(osd, flat, "0.weight", "exp_avg_var")}, checkpoint_id=str(tmp_path))
    fresh = po.AdaBelief(model.parameters())
    template = {"optim": dcp_optim.get_optimizer_state_dict(model, fresh, options=options)}
    # DCP would refuse the missing key; a template without it stands for a
    # dict that lacks it
    template["optim"] = without(template["optim"], flat, "0.weight", "exp_avg_var")
    dcp.load(template, checkpoint_id=str(tmp_path))
    with pytest.raises(errors.MissingOptimizerStateError, match="exp_avg_var"):
        dcp_optim.set_optimizer_state_dict(model, fresh, template["optim"], options=options)
    assert not fresh.state


@NO_SCHEMA
@FORMATS
def test_strict_looks_into_the_state_an_optimizer_nests(flat):
    """bitsandbytes' 8-bit optimizers nest their quantization state under
    one key of each entry (their ``state_dict`` wraps it, their
    ``load_state_dict`` unwraps it): a whole entry loads in both formats,
    one lacking a name inside that key is refused, naming it, with
    nothing changed."""
    bnb = pytest.importorskip("bitsandbytes")
    model, optim = stepped(bnb.optim.Adam8bit, lr=1e-2, min_8bit_size=1)
    osd = dcp_optim.get_optimizer_state_dict(model, optim, options=opts(dcp_optim, flatten_optimizer_state_dict=flat))
    wrap = "__bnb_optimizer_quant_state__"
    if flat:
        assert f"state.0.weight.{wrap}.state1" in osd
        bad = {k: v for k, v in osd.items() if k != f"state.0.weight.{wrap}.state1"}
    else:
        assert "state1" in osd["state"]["0.weight"][wrap]
        entry = dict(osd["state"]["0.weight"])
        entry[wrap] = {k: v for k, v in entry[wrap].items() if k != "state1"}
        bad = {**osd, "state": {**osd["state"], "0.weight": entry}}
    options = opts(dcp_optim, flatten_optimizer_state_dict=flat)
    fresh = bnb.optim.Adam8bit(model.parameters(), lr=1e-2, min_8bit_size=1)
    before = optimizer_snapshot([fresh])
    with pytest.raises(errors.MissingOptimizerStateError) as info:
        dcp_optim.set_optimizer_state_dict(model, fresh, bad, options=options)
    assert info.value.missing == ["0.weight"] and "'state1'" in str(info.value)
    assert_same_tree(optimizer_snapshot([fresh]), before)  # nothing changed
    dcp_optim.set_optimizer_state_dict(model, fresh, osd, options=options)
    assert_same_tree(fresh.state_dict()["state"], optim.state_dict()["state"])


@NO_SCHEMA
@impls("an optimizer whose constructor creates state (APOLLO's per-parameter seed): upstream's template is "
       "that state alone, dcp.load restores nothing else, the load reports success and the next step "
       "restarts the moments and the projector")
def test_template_flow_of_an_optimizer_with_constructor_state_never_diverges(impl, tmp_path):
    """apollo-torch's APOLLO puts a ``seed`` in every parameter's state in
    its constructor and needs it to step.  A never-stepped APOLLO's
    template is that state (as upstream's); the strict set after
    ``dcp.load`` finds the moments missing -- the shadow step that names
    them starts from copies of the held state -- and raises, where the
    resume would silently restart them."""
    apollo_torch = pytest.importorskip("apollo_torch")
    import torch.distributed.checkpoint as dcp

    def make(params):
        params = list(params)
        mats = [p for p in params if p.dim() == 2]
        rest = [p for p in params if p.dim() != 2]
        return apollo_torch.APOLLOAdamW([{"params": rest}, {"params": mats, "rank": 1, "proj": "random",
                                          "scale_type": "channel", "update_proj_gap": 2, "scale": 1.0,
                                          "proj_type": "std"}], lr=1e-2)

    model, optim = stepped(make)
    dcp.save({"o": impl.get_optimizer_state_dict(model, optim)}, checkpoint_id=str(tmp_path))
    fresh = make(model.parameters())
    state = {"o": impl.get_optimizer_state_dict(model, fresh)}
    dcp.load(state, checkpoint_id=str(tmp_path))
    before = optimizer_snapshot([fresh])
    with pytest.raises(errors.MissingOptimizerStateError, match="exp_avg"):
        impl.set_optimizer_state_dict(model, fresh, state["o"])
    assert_same_tree(optimizer_snapshot([fresh]), before)  # nothing changed
