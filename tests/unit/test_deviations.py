"""Where upstream is wrong and dcp_optim is right (docs/differences.md; issue 3).

Every test runs the same scenario on both implementations (`impl` is the
module: upstream's torch.distributed.checkpoint.state_dict or dcp_optim).
The upstream run is a strict expected failure carrying the upstream issue
it shows; the dcp_optim run must pass.  Scenarios cover the nested and the
flattened format.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as upstream
import torch.nn as nn

import dcp_optim

from ..support.oracle import assert_same_tree, optimizer_snapshot, params_snapshot


def impls(reason: str, *, raises: type[BaseException] | tuple[type[BaseException], ...] | None = None,
          upstream_fails: bool = True):
    """Run the test on upstream and on dcp_optim.  Where upstream fails
    (upstream_fails), its run is a strict xfail that must fail with
    `raises` (pytest.fail.Exception for a pytest.raises/warns that did not
    trigger): any other exception, a bug in the test included, fails."""
    if upstream_fails and raises is None:
        raise TypeError(f"impls({reason!r}): an upstream xfail names the exception it expects")
    marks = [pytest.mark.xfail(strict=True, raises=raises, reason=reason)] if upstream_fails else []
    return pytest.mark.parametrize(
        "impl",
        [pytest.param(upstream, id="upstream", marks=marks), pytest.param(dcp_optim, id="dcp_optim")],
    )


FORMATS = pytest.mark.parametrize("flat", [False, True], ids=["nested", "flat"])


def opts(impl, **kwargs):
    return impl.StateDictOptions(**kwargs)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).pow(2).sum()


def data(step: int):
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(step))


def train(model, optimizers, steps, start=0, closure=False):
    optimizers = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
    for step in range(start, start + steps):
        x = data(step)
        if closure:
            for o in optimizers:
                def fn():
                    o.zero_grad()
                    loss = model(x)
                    loss.backward()
                    return loss

                o.step(fn)
            continue
        model(x).backward()
        for o in optimizers:
            o.step()
            o.zero_grad()


OPTIMIZERS = {
    "adamw": (lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1), True),
    "adam_coupled_wd": (lambda ps: torch.optim.Adam(ps, lr=0.05, weight_decay=0.1), True),
    "sgd_momentum_dampening_wd": (
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.1),
        True,
    ),
    "rprop": (lambda ps: torch.optim.Rprop(ps, lr=0.05), True),
    "nadam": (lambda ps: torch.optim.NAdam(ps, lr=0.05), True),
    "radam": (lambda ps: torch.optim.RAdam(ps, lr=0.05), True),
    # Adagrad creates its state in __init__, so upstream never fake-steps it
    "adagrad_lr_decay": (lambda ps: torch.optim.Adagrad(ps, lr=0.05, lr_decay=0.1), False),
    "asgd": (lambda ps: torch.optim.ASGD(ps, lr=0.05), True),
    "adamax": (lambda ps: torch.optim.Adamax(ps, lr=0.05), True),
}


def fresh(name, seed=0):
    torch.manual_seed(seed)
    model = Net()
    return model, OPTIMIZERS[name][0](model.parameters())


# --- 1. getters change nothing (D1; pytorch/pytorch#164929) -------------------------


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("impl_name", ["upstream", "dcp_optim"])
@FORMATS
def test_getters_leave_training_bit_identical(name, impl_name, flat, request):
    impl = upstream if impl_name == "upstream" else dcp_optim
    if impl is upstream and OPTIMIZERS[name][1]:
        request.applymarker(pytest.mark.xfail(strict=True, raises=AssertionError, reason="fake step: pytorch/pytorch#164929"))
    reference = None
    for calls in (0, 1, 3):
        model, optim = fresh(name)
        fired = []
        optim.register_step_pre_hook(lambda *a: fired.append("pre"))
        optim.register_step_post_hook(lambda *a: fired.append("post"))
        before = optimizer_snapshot(optim)
        for _ in range(calls):
            impl.get_optimizer_state_dict(model, optim, options=opts(impl, flatten_optimizer_state_dict=flat))
        assert fired == [], "optimizer hooks fired during a get"
        assert all(p.grad is None for p in model.parameters()), "a get created grads"
        assert_same_tree(optimizer_snapshot(optim), before)
        train(model, optim, steps=3)
        result = params_snapshot(model)
        if reference is None:
            reference = result
        assert_same_tree(result, reference)


# --- 2. pristine templates for never-stepped optimizers (D2) -------------------------


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("impl_name", ["upstream", "dcp_optim"])
@FORMATS
def test_never_stepped_checkpoint_resumes_like_a_fresh_optimizer(name, impl_name, flat, tmp_path, request):
    impl = upstream if impl_name == "upstream" else dcp_optim
    if impl is upstream and OPTIMIZERS[name][1]:
        request.applymarker(pytest.mark.xfail(strict=True, raises=AssertionError, reason="fake-stepped template: pytorch/pytorch#164929"))
    o = opts(impl, flatten_optimizer_state_dict=flat)
    # save a never-stepped optimizer (its template is the whole state)
    model, optim = fresh(name)
    sd = impl.get_optimizer_state_dict(model, optim, options=o)
    assert sd["state"] if not flat else any(k.startswith("state.") for k in sd), "template has no state"
    dcp.save({"optim": sd}, checkpoint_id=str(tmp_path))
    # resume in a fresh optimizer through the template flow, then train
    model2, optim2 = fresh(name)
    template = impl.get_optimizer_state_dict(model2, optim2, options=o)
    state = {"optim": template}
    dcp.load(state, checkpoint_id=str(tmp_path))
    impl.set_optimizer_state_dict(model2, optim2, state["optim"], options=o)
    train(model2, optim2, steps=3)
    # reference: a fresh optimizer that was never checkpointed
    model3, optim3 = fresh(name)
    train(model3, optim3, steps=3)
    assert_same_tree(params_snapshot(model2), params_snapshot(model3))


class LionLike(torch.optim.Optimizer):
    """A third-party optimizer without a dcp_optim schema (its moment in
    ``moment_dtype``; None: the parameter's)."""

    def __init__(self, params, lr=0.01, beta=0.9, moment_dtype=None):
        super().__init__(params, {"lr": lr, "beta": beta})
        self.moment_dtype = moment_dtype

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["m"] = torch.zeros_like(p, dtype=self.moment_dtype)
                st["step"] += 1
                update = (group["beta"] * st["m"] + (1 - group["beta"]) * p.grad).sign()
                p.add_(update, alpha=-group["lr"])
                st["m"].mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])


def test_fallback_schema_for_unknown_optimizers(tmp_path):
    from dcp_optim._engine import shadow

    shadow._warned.discard(LionLike)
    torch.manual_seed(0)
    model = Net()
    optim = LionLike(model.parameters())
    with pytest.warns(UserWarning, match="no state schema for .*LionLike"):
        sd = dcp_optim.get_optimizer_state_dict(model, optim)
    assert len(optim.state) == 0, "the live optimizer was touched"
    assert set(sd["state"]) == {n for n, _ in model.named_parameters()}
    assert all(st["step"] == 0 and not st["m"].any() for st in sd["state"].values())
    dcp.save({"optim": sd}, checkpoint_id=str(tmp_path))
    torch.manual_seed(0)
    model2 = Net()
    optim2 = LionLike(model2.parameters())
    template = dcp_optim.get_optimizer_state_dict(model2, optim2)
    state = {"optim": template}
    dcp.load(state, checkpoint_id=str(tmp_path))
    dcp_optim.set_optimizer_state_dict(model2, optim2, state["optim"])
    train(model2, optim2, 3)
    torch.manual_seed(0)
    model3 = Net()
    optim3 = LionLike(model3.parameters())
    train(model3, optim3, 3)
    assert_same_tree(params_snapshot(model2), params_snapshot(model3))


def test_schema_plugin_hook():
    class Declared(LionLike):
        def step(self, closure=None):  # a different step: the base schema would not apply
            return super().step(closure)

    @dcp_optim.register_optimizer_schema(Declared)
    def declared_schema(optimizer, group):
        return [dcp_optim.schema.StateSpec("step", int, (0,)), dcp_optim.schema.zeros_like("m")]

    model = Net()
    optim = Declared(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sd = dcp_optim.get_optimizer_state_dict(model, optim)
    assert all(st["step"] == 0 and st["m"].shape == p.shape
               for (n, p), st in zip(model.named_parameters(), sd["state"].values()))


# --- 3. state does not depend on .grad (pytorch/pytorch#140898) -------------------------


@impls("state silently empty when grads are set: pytorch/pytorch#140898", raises=AssertionError)
@FORMATS
def test_state_after_backward_is_not_empty(impl, flat):
    torch.manual_seed(0)
    model = Net()
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(data(0)).backward()  # grads set, no step
    sd = impl.get_optimizer_state_dict(model, optim, options=opts(impl, flatten_optimizer_state_dict=flat))
    keys = sd["state"] if not flat else {k.split(".")[1] + "." + k.split(".")[2] for k in sd if k.startswith("state.")}
    assert set(keys) == {n for n, _ in model.named_parameters()}


@impls("state silently empty after a skipped step: pytorch/pytorch#140898", raises=AssertionError)
def test_state_after_grad_scaler_skipped_step(impl):
    torch.manual_seed(0)
    model = Net()
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)
    loss = model(data(0)) * float("inf")
    scaler.scale(loss).backward()
    scaler.step(optim)  # skipped: inf gradients
    scaler.update()
    assert len(optim.state) == 0
    sd = impl.get_optimizer_state_dict(model, optim)
    assert set(sd["state"]) == {n for n, _ in model.named_parameters()}


# --- 4. partial loading (D5; #132628, #192224) ---------------------------------------------


def trained(name="adam", seed=0):
    torch.manual_seed(seed)
    model = Net()
    optim = torch.optim.Adam(model.parameters(), lr=0.1) if name == "adam" else OPTIMIZERS[name][0](model.parameters())
    train(model, optim, 2, start=seed * 10)
    return model, optim


def drop(sd, fqn, flat):
    if not flat:
        sd = {"state": {k: v for k, v in sd["state"].items() if k != fqn}, "param_groups": sd["param_groups"]}
        return sd
    return {k: v for k, v in sd.items() if not k.startswith(f"state.{fqn}.")}


@FORMATS
@impls("flat partial loads raise TypeError: pytorch/pytorch#192224", upstream_fails=False)
def test_partial_load_non_strict_nested(impl, flat, request):
    if flat and impl is upstream:
        request.applymarker(pytest.mark.xfail(strict=True, raises=TypeError, reason="pytorch/pytorch#192224"))
    src, src_optim = trained(seed=0)
    sd = impl.get_optimizer_state_dict(src, src_optim, options=opts(impl, flatten_optimizer_state_dict=flat))
    sd = drop(sd, "a.weight", flat)
    if not flat:
        sd["state"]["ghost.weight"] = {"step": torch.tensor(1.0)}
    else:
        sd["state.ghost.weight.step"] = torch.tensor(1.0)
    model, optim = trained(seed=1)  # has its own state for every param
    impl.set_optimizer_state_dict(model, optim, sd, options=opts(impl, strict=False))
    by_name = dict(model.named_parameters())
    assert len(optim.state[by_name["a.weight"]]) == 0, "missing state must leave the param pristine"
    for name in ("a.bias", "b.weight", "b.bias"):
        assert torch.equal(optim.state[by_name[name]]["exp_avg"], src_optim.state[dict(src.named_parameters())[name]]["exp_avg"])
    train(model, optim, 1)  # step works: the pristine param initialises itself


@FORMATS
@impls("strict error names only the first missing FQN (nested) / TypeError (flat)", raises=(AssertionError, TypeError))
def test_partial_load_strict_names_every_missing_fqn(impl, flat):
    src, src_optim = trained()
    sd = impl.get_optimizer_state_dict(src, src_optim, options=opts(impl, flatten_optimizer_state_dict=flat))
    sd = drop(drop(sd, "a.weight", flat), "b.bias", flat)
    model, optim = trained(seed=1)
    before = optimizer_snapshot(optim)
    with pytest.raises(RuntimeError, match="Missing optimizer state for parameter 'a.weight'") as info:
        impl.set_optimizer_state_dict(model, optim, sd)
    assert "b.bias" in str(info.value)
    assert_same_tree(optimizer_snapshot(optim), before)


def test_partial_load_reports_missing_and_unexpected():
    src, src_optim = trained()
    sd = dcp_optim.get_optimizer_state_dict(src, src_optim)
    sd = drop(sd, "a.weight", False)
    sd["state"]["ghost.weight"] = {"step": torch.tensor(1.0)}
    model, optim = trained(seed=1)
    result = dcp_optim.set_optimizer_state_dict(model, optim, sd, options=dcp_optim.StateDictOptions(strict=False))
    assert result.missing_keys == ["a.weight"]
    assert result.unexpected_keys == ["ghost.weight"]
    msd = dcp_optim.get_model_state_dict(model)
    both = dcp_optim.set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=sd,
                                    options=dcp_optim.StateDictOptions(strict=False))
    assert both.optim_missing_keys == ["a.weight"] and both.optim_unexpected_keys == ["ghost.weight"]


# --- 5. trained-then-frozen parameters (D10; pytorch/pytorch#192202) -------------------


@FORMATS
@impls("saved state of now-frozen params dropped: pytorch/pytorch#192202", raises=KeyError)
def test_trained_then_frozen_keeps_state(impl, flat):
    src, src_optim = trained()
    src.a.weight.requires_grad_(False)
    o = opts(impl, flatten_optimizer_state_dict=flat)
    sd = impl.get_optimizer_state_dict(src, src_optim, options=o)
    torch.manual_seed(5)
    model = Net()
    model.a.weight.requires_grad_(False)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    impl.set_optimizer_state_dict(model, optim, sd, options=o)
    assert torch.equal(optim.state[model.a.weight]["exp_avg"], src_optim.state[src.a.weight]["exp_avg"])


# --- 6. param groups (D6, D7; #143828, #140900, torchtune#2553) -----------------------


def grouped(spec, cls=torch.optim.AdamW, seed=0, **kw):
    torch.manual_seed(seed)
    model = Net()
    ps = dict(model.named_parameters())
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [ps[n] for n in g["params"]]} for g in spec]
    return model, cls(groups, **kw)


EMPTY_GROUPS = [
    {"params": ["a.weight", "a.bias"]},
    {"params": [], "lr": 0.2, "betas": (0.5, 0.6)},
    {"params": ["b.weight", "b.bias"], "lr": 0.03},
    {"params": [], "lr": 0.3},
]


@FORMATS
@impls("two empty groups: E19 (nested) / IndexError (flat): pytorch/pytorch#143828", raises=(ValueError, IndexError))
def test_any_number_of_empty_groups(impl, flat):
    model, optim = grouped(EMPTY_GROUPS, lr=0.01)
    train(model, optim, 1)
    o = opts(impl, flatten_optimizer_state_dict=flat)
    sd = impl.get_optimizer_state_dict(model, optim, options=o)
    model2, optim2 = grouped([{"params": g["params"]} for g in EMPTY_GROUPS], lr=0.01)
    impl.set_optimizer_state_dict(model2, optim2, sd, options=o)
    for g_saved, g_loaded in zip(optim.param_groups, optim2.param_groups):
        for key in g_saved:
            if key != "params":
                assert g_loaded[key] == g_saved[key], key
    train(model2, optim2, 1)  # the step after loading works (KeyError: 'betas' upstream)


@impls("the one empty group gets the last loaded group's keys: pytorch/pytorch#143828", raises=KeyError)
def test_single_empty_group_gets_its_own_hyperparameters(impl):
    spec = [{"params": ["a.weight"]}, {"params": [], "lr": 0.5}, {"params": ["a.bias", "b.weight", "b.bias"], "lr": 0.02}]
    model, optim = grouped(spec, lr=0.01)
    train(model, optim, 1)
    sd = impl.get_optimizer_state_dict(model, optim)
    model2, optim2 = grouped([{"params": g["params"]} for g in spec], lr=0.01)
    impl.set_optimizer_state_dict(model2, optim2, sd)
    assert [g["lr"] for g in optim2.param_groups] == [0.01, 0.5, 0.02]


# Two saved groups configured differently, loaded into optimizers grouped
# otherwise: the groups merged into one, or split across two.
SAVED_GROUPS = [
    {"params": ["a.weight", "a.bias"], "lr": 0.05, "weight_decay": 0.1},
    {"params": ["b.weight", "b.bias"], "lr": 0.01, "weight_decay": 0.0},
]
REGROUPINGS = {
    "merged": [{"params": ["a.weight", "a.bias", "b.weight", "b.bias"]}],
    "split_across": [{"params": ["a.weight", "b.weight"]}, {"params": ["a.bias", "b.bias"]}],
}


@FORMATS
@pytest.mark.parametrize("regroup", list(REGROUPINGS))
@impls("a group over parameters of differently configured saved groups takes the last one's values "
       "(merged: 'a' trains with lr 0.01 and no weight decay, silently) or raises KeyError 'lr' (split)",
       raises=(pytest.fail.Exception, KeyError))
def test_load_into_another_grouping_raises(impl, flat, regroup):
    model, optim = grouped(SAVED_GROUPS, lr=0.02)
    train(model, optim, 1)
    o = opts(impl, flatten_optimizer_state_dict=flat)
    sd = impl.get_optimizer_state_dict(model, optim, options=o)
    model2, optim2 = grouped(REGROUPINGS[regroup], lr=0.02)
    before = optimizer_snapshot(optim2)
    with pytest.raises(ValueError, match=r"different 'lr' \(0.05 for 'a\.weight', 0.01 for 'b\.weight'\)") as info:
        impl.set_optimizer_state_dict(model2, optim2, sd, options=o)
    assert_same_tree(optimizer_snapshot(optim2), before)
    assert isinstance(info.value, dcp_optim.errors.ParamGroupConflictError)
    assert (info.value.optimizer, info.value.group, info.value.key) == (0, 0, "lr")


@FORMATS
@impls("through DCP into a template of one group: the body's values for all, silently (nested), "
       "or the last group's (flat)", raises=pytest.fail.Exception)
def test_dcp_resume_into_another_grouping_raises(impl, flat, tmp_path):
    """The template flow: a nested template built by an optimizer with
    other groups reads the checkpoint's groups by position (DCP keeps as
    many as the template has), so the second group's values are gone and
    its parameters' state stands in no group; flattened, every parameter
    reads its own group's values, which disagree."""
    model, optim = grouped(SAVED_GROUPS, lr=0.02)
    train(model, optim, 1)
    o = opts(impl, flatten_optimizer_state_dict=flat)
    dcp.save({"optim": impl.get_optimizer_state_dict(model, optim, options=o)}, checkpoint_id=str(tmp_path))
    model2, optim2 = grouped(REGROUPINGS["merged"], lr=0.02)
    state = {"optim": impl.get_optimizer_state_dict(model2, optim2, options=o)}
    dcp.load(state, checkpoint_id=str(tmp_path))
    before = optimizer_snapshot(optim2)
    match = "different 'lr'" if flat else "holds state for 'b.weight' but lists it in no param group"
    with pytest.raises(dcp_optim.errors.ParamGroupConflictError, match=match):
        impl.set_optimizer_state_dict(model2, optim2, state["optim"], options=o)
    assert_same_tree(optimizer_snapshot(optim2), before)


@FORMATS
@impls("equal groups merge", upstream_fails=False)
def test_load_equal_groups_merged(impl, flat):
    """Saved groups whose values agree (a NaN included) load into one
    group, and training goes on as it would have."""
    _load_equal_groups(impl, flat, "merged")


@FORMATS
@impls("equal groups split across two", upstream_fails=False)
def test_load_equal_groups_split_across(impl, flat, request):
    if impl is upstream and not flat:
        request.applymarker(pytest.mark.xfail(
            strict=True, raises=KeyError,
            reason="nested: the live groups lose every hyperparameter but 'params' (KeyError 'lr')"))
    _load_equal_groups(impl, flat, "split_across")


def _load_equal_groups(impl, flat, regroup):
    spec = [{**g, "lr": 0.05, "weight_decay": 0.1, "tag": float("nan")} for g in SAVED_GROUPS]
    model, optim = grouped(spec, lr=0.02)
    train(model, optim, 1)
    o = opts(impl, flatten_optimizer_state_dict=flat)
    sd = copy.deepcopy(impl.get_optimizer_state_dict(model, optim, options=o))
    model2, optim2 = grouped(REGROUPINGS[regroup], lr=0.02)
    impl.set_model_state_dict(model2, impl.get_model_state_dict(model))
    impl.set_optimizer_state_dict(model2, optim2, sd, options=o)
    assert all(g["lr"] == 0.05 and g["weight_decay"] == 0.1 for g in optim2.param_groups)
    train(model, optim, 2, start=1)
    train(model2, optim2, 2, start=1)
    assert_same_tree(params_snapshot(model2), params_snapshot(model))


@FORMATS
@impls("several optimizers with empty groups: E20 (nested) / IndexError (flat)", raises=(ValueError, IndexError))
def test_several_optimizers_with_empty_groups(impl, flat):
    def build(seed):
        torch.manual_seed(seed)
        model = Net()
        o1 = torch.optim.Adam([{"params": list(model.a.parameters())}, {"params": [], "lr": 0.4}], lr=0.01)
        o2 = torch.optim.SGD([{"params": [], "lr": 0.7}, {"params": list(model.b.parameters())}], lr=0.1, momentum=0.9)
        return model, (o1, o2)

    model, optims = build(0)
    train(model, optims, 1)
    o = opts(impl, flatten_optimizer_state_dict=flat)
    sd = impl.get_optimizer_state_dict(model, optims, options=o)
    model2, optims2 = build(1)
    optims2[0].param_groups[1]["lr"] = 9.0
    optims2[1].param_groups[0]["lr"] = 9.0
    impl.set_optimizer_state_dict(model2, optims2, sd, options=o)
    assert optims2[0].param_groups[1]["lr"] == 0.4 and optims2[1].param_groups[0]["lr"] == 0.7
    train(model2, optims2, 1)


@FORMATS
@impls("group of frozen parameters only", upstream_fails=False)
def test_frozen_only_group_round_trips(impl, flat):
    def build(seed):
        torch.manual_seed(seed)
        model = Net()
        model.a.requires_grad_(False)
        optim = torch.optim.Adam([{"params": list(model.a.parameters()), "lr": 0.5},
                                  {"params": list(model.b.parameters())}], lr=0.01)
        return model, optim

    model, optim = build(0)
    train(model, optim, 1)
    o = opts(impl, flatten_optimizer_state_dict=flat)
    sd = impl.get_optimizer_state_dict(model, optim, options=o)
    model2, optim2 = build(1)
    optim2.param_groups[0]["lr"] = 9.0
    impl.set_optimizer_state_dict(model2, optim2, sd, options=o)
    assert optim2.param_groups[0]["lr"] == 0.5
    train(model2, optim2, 1)


@FORMATS
@impls("saved group keys dropped / KeyError on the flat path: pytorch/pytorch#140900", upstream_fails=False)
def test_every_saved_group_key_survives(impl, flat, request):
    if flat and impl is upstream:
        request.applymarker(pytest.mark.xfail(strict=True, raises=KeyError, reason="pytorch/pytorch#140900, torchtune#2553"))
    torch.manual_seed(0)
    model = Net()
    optim = torch.optim.Adam(
        [{"params": list(model.a.parameters()), "lr_mult": 0.5, "name": "encoder"},
         {"params": list(model.b.parameters()), "lr": torch.tensor(0.02)}],
        lr=0.01, foreach=False,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 0.9**s)  # adds initial_lr
    train(model, optim, 1)
    sched.step()
    o = opts(impl, flatten_optimizer_state_dict=flat)
    sd = impl.get_optimizer_state_dict(model, optim, options=o)
    torch.manual_seed(1)
    model2 = Net()
    # a fresh optimizer without the scheduler's and the custom keys
    optim2 = torch.optim.Adam([{"params": list(model2.a.parameters())},
                               {"params": list(model2.b.parameters()), "lr": torch.tensor(0.5)}],
                              lr=0.01, foreach=False)
    impl.set_optimizer_state_dict(model2, optim2, sd, options=o)
    g0, g1 = optim2.param_groups
    assert g0["lr_mult"] == 0.5 and g0["name"] == "encoder"
    assert g0["initial_lr"] == 0.01 and g1["initial_lr"] == optim.param_groups[1]["initial_lr"]
    assert isinstance(g1["lr"], torch.Tensor) and float(g1["lr"]) == pytest.approx(0.018)
    assert type(g0["betas"]) is tuple
    train(model2, optim2, 1)


# --- 7. stateless optimizers and LBFGS (#192225) ---------------------------------------------


@FORMATS
@impls("stateless SGD round-trips to {fqn: {}} entries (flat): pytorch/pytorch#192225", upstream_fails=False)
def test_stateless_sgd_round_trips_as_empty(impl, flat, request):
    if flat and impl is upstream:
        request.applymarker(pytest.mark.xfail(strict=True, raises=AssertionError, reason="pytorch/pytorch#192225"))
    torch.manual_seed(0)
    model = Net()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, optim, 1)
    o = opts(impl, flatten_optimizer_state_dict=flat)
    sd = impl.get_optimizer_state_dict(model, optim, options=o)
    impl.set_optimizer_state_dict(model, optim, sd, options=o)
    assert dict(optim.state) == {}
    train(model, optim, 1)


@impls("the fake step calls LBFGS.step(closure=None)", raises=TypeError)
def test_lbfgs(impl):
    torch.manual_seed(0)
    model = Net()
    optim = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
    sd = impl.get_optimizer_state_dict(model, optim)  # never stepped
    # the keys one (single-iteration) step creates, under the first
    # parameter (tests/unit/test_templates.py checks their effect)
    assert list(sd["state"]) == ["a.weight"]
    assert list(sd["state"]["a.weight"]) == [
        "func_evals", "n_iter", "d", "t", "old_dirs", "old_stps", "ro", "H_diag", "prev_flat_grad", "prev_loss"]
    train(model, optim, 2, closure=True)
    sd = impl.get_optimizer_state_dict(model, optim)
    torch.manual_seed(0)
    model2 = Net()
    model2.load_state_dict(model.state_dict())
    optim2 = torch.optim.LBFGS(model2.parameters(), lr=0.5, max_iter=3)
    # a private copy: loaded tensors alias the dict's (as torch's own
    # load_state_dict does), and LBFGS updates its state in place
    impl.set_optimizer_state_dict(model2, optim2, copy.deepcopy(sd))
    train(model, optim, 1, start=5, closure=True)
    train(model2, optim2, 1, start=5, closure=True)
    assert_same_tree(params_snapshot(model), params_snapshot(model2))


# --- 8. the caller's data is never mutated (D11; torchtitan#961, #158519) -----------------


@impls("the caller's model dict is re-keyed in place: pytorch/torchtitan#961", raises=AssertionError)
def test_callers_model_dict_is_not_mutated(impl, world1):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(Net())
    sd = dcp_optim.get_model_state_dict(model)
    keys = list(sd)
    values = [id(v) for v in sd.values()]
    impl.set_model_state_dict(model, sd)
    assert list(sd) == keys and [id(v) for v in sd.values()] == values


@FORMATS
def test_optimizer_dict_is_not_mutated_and_can_be_reused(flat):
    src, src_optim = trained()
    o = dcp_optim.StateDictOptions(flatten_optimizer_state_dict=flat)
    sd = dcp_optim.get_optimizer_state_dict(src, src_optim, options=o)
    snapshot = copy.deepcopy(sd)
    structure = repr(sd)
    for seed in (1, 2):
        model, optim = trained(seed=seed)
        dcp_optim.set_optimizer_state_dict(model, optim, sd, options=o)
        assert repr(sd) == structure
        assert_same_tree(sd, snapshot)


# --- 9. types survive a load (D8, D9; #126950) -------------------------------------------------


@impls("state is cast to the parameter dtype (bf16 moments become fp32)", raises=AssertionError)
def test_low_precision_state_keeps_its_dtype(impl):
    """An optimizer that holds bf16 moments keeps them bf16 (a fresh,
    never-stepped one: see the next test, and
    tests/unit/test_longtail_optim.py for a resume at another precision)."""
    src, src_optim = trained()
    for st in src_optim.state.values():
        st["exp_avg"] = st["exp_avg"].to(torch.bfloat16)
        st["exp_avg_sq"] = st["exp_avg_sq"].to(torch.bfloat16)
    sd = impl.get_optimizer_state_dict(src, src_optim)
    model, optim = trained(seed=3)
    for st in optim.state.values():
        st["exp_avg"] = st["exp_avg"].to(torch.bfloat16)
        st["exp_avg_sq"] = st["exp_avg_sq"].to(torch.bfloat16)
    impl.set_optimizer_state_dict(model, optim, sd)
    assert all(st["exp_avg"].dtype == torch.bfloat16 for st in optim.state.values())


def _olmo_skip_step_adamw(params):
    from olmo_core.optim import SkipStepAdamW  # ai2-olmo-core, from PyPI

    return SkipStepAdamW(params, lr=0.05, dtype=torch.bfloat16)


def _hf_adafactor(params):
    from transformers.optimization import Adafactor  # transformers, from PyPI

    return Adafactor(params, lr=0.05, relative_step=False, scale_parameter=False, warmup_init=False)


# (optimizer, dtype of the parameters): each keeps some state in another
# floating dtype than its parameters'
OWN_PRECISION = {
    # transformers' Adafactor: float32 factored second moments and RMS
    # beside bf16 parameters
    "hf_adafactor_bf16_params": (_hf_adafactor, torch.bfloat16),
    # OLMo-core's SkipStepAdamW(dtype=bf16): bf16 moments of fp32 parameters
    "olmo_skip_step_adamw_bf16_moments": (_olmo_skip_step_adamw, torch.float32),
    # torch's NAdam: a float32 mu_product beside bf16 parameters
    "nadam_bf16_params": (lambda ps: torch.optim.NAdam(ps, lr=0.05), torch.bfloat16),
    # torch's ASGD: float32 eta and mu beside bf16 parameters
    "asgd_bf16_params": (lambda ps: torch.optim.ASGD(ps, lr=0.05), torch.bfloat16),
}


@impls("a never-stepped optimizer's loaded state is cast to the parameter's dtype: the resumed run differs",
       raises=AssertionError)
@pytest.mark.filterwarnings("ignore:dcp_optim has no state schema")  # SkipStepAdamW's: a shadow step
@pytest.mark.parametrize("name", list(OWN_PRECISION))
@FORMATS
def test_resume_keeps_the_precision_the_optimizer_keeps(impl, name, flat):
    """D35: a resume into a never-stepped optimizer (a fresh process)
    gives each state tensor the dtype the optimizer's own first step
    gives it, where that is not the parameter's, and the run continues
    bit for bit.  torch's Optimizer.load_state_dict, which upstream
    calls, casts it to the parameter's dtype: SkipStepAdamW's bf16
    moments become fp32 (twice the memory), NAdam's float32 mu_product
    and Adafactor's float32 moments become bf16, and the next steps
    differ from the uninterrupted run."""
    make, dtype = OWN_PRECISION[name]

    def build(seed):
        torch.manual_seed(seed)
        model = Net().to(dtype)
        return model, make(model.parameters())

    def steps(model, optim, start, count):
        for step in range(start, start + count):
            model(data(step).to(dtype)).backward()
            optim.step()
            optim.zero_grad()

    options = opts(impl, flatten_optimizer_state_dict=flat)
    src, src_optim = build(0)
    steps(src, src_optim, 0, 2)
    saved_dtypes = [{k: v.dtype for k, v in st.items() if torch.is_tensor(v)} for st in src_optim.state.values()]
    assert any(v != dtype for d in saved_dtypes for k, v in d.items() if k != "step"), saved_dtypes
    osd = copy.deepcopy(impl.get_optimizer_state_dict(src, src_optim, options=options))
    msd = copy.deepcopy(src.state_dict())
    steps(src, src_optim, 2, 2)

    model, optim = build(1)
    model.load_state_dict(msd)
    impl.set_optimizer_state_dict(model, optim, osd, options=options)
    loaded_dtypes = [{k: v.dtype for k, v in st.items() if torch.is_tensor(v)} for st in optim.state.values()]
    assert loaded_dtypes == saved_dtypes
    steps(model, optim, 2, 2)
    for (n, p), q in zip(model.named_parameters(), src.parameters()):
        assert torch.equal(p, q), n


def test_a_load_under_warnings_as_errors_raises_the_shadow_steps_warning():
    """D35's dtypes and the strict checks of a schema-less optimizer come
    from a shadow step, which warns once per class.  Under warnings
    turned into errors (as in this suite) the first load into a
    never-stepped optimizer raises that warning before anything changes,
    rather than taking it for a step that cannot run (which would load by
    torch's rule, unchecked); the next load goes through."""

    from dcp_optim._engine import shadow

    shadow._warned.discard(LionLike)  # its warning is due again
    torch.manual_seed(0)
    src = Net()
    src_optim = LionLike(src.parameters(), moment_dtype=torch.bfloat16)
    train(src, src_optim, 2)
    osd = copy.deepcopy(dcp_optim.get_optimizer_state_dict(src, src_optim))  # stepped: no shadow step
    model = Net()
    optim = LionLike(model.parameters(), moment_dtype=torch.bfloat16)
    with pytest.raises(UserWarning, match="no state schema"):
        dcp_optim.set_optimizer_state_dict(model, optim, copy.deepcopy(osd))
    assert not optim.state
    dcp_optim.set_optimizer_state_dict(model, optim, copy.deepcopy(osd))
    assert [st["m"].dtype for st in optim.state.values()] == [torch.bfloat16] * 4


def test_step_follows_the_optimizers_device_policy():
    src, src_optim = trained()
    sd = dcp_optim.get_optimizer_state_dict(src, src_optim)
    model, optim = trained(seed=1)
    dcp_optim.set_optimizer_state_dict(model, optim, sd)
    for st in optim.state.values():
        assert st["step"].device.type == "cpu" and st["step"].dtype == torch.float32


# --- 10. atomic loads --------------------------------------------------------------------------


@impls("torch copies tensor by tensor and raises at the end: a half-loaded model", raises=AssertionError)
def test_failed_model_load_changes_nothing(impl):
    src, _ = trained()
    sd = dict(src.state_dict())
    sd["b.weight"] = torch.zeros(7, 7)  # a shape mismatch after a.* were copied
    model, _ = trained(seed=1)
    before = params_snapshot(model)
    with pytest.raises(RuntimeError, match="size mismatch for b.weight"):
        impl.set_model_state_dict(model, sd)
    assert_same_tree(params_snapshot(model), before)


@impls("strict missing keys are reported after every other tensor was copied", raises=AssertionError)
def test_failed_strict_model_load_changes_nothing(impl):
    src, _ = trained()
    sd = {k: v for k, v in src.state_dict().items() if k != "b.bias"}
    model, _ = trained(seed=1)
    before = params_snapshot(model)
    with pytest.raises(RuntimeError, match='Missing key\\(s\\) in state_dict: "b.bias"'):
        impl.set_model_state_dict(model, sd)
    assert_same_tree(params_snapshot(model), before)


@FORMATS
@impls("a wrong-shaped state tensor is installed and fails later, in step()", raises=pytest.fail.Exception)
def test_failed_optimizer_load_changes_nothing(impl, flat):
    src, src_optim = trained()
    o = opts(impl, flatten_optimizer_state_dict=flat)
    sd = impl.get_optimizer_state_dict(src, src_optim, options=o)
    if flat:
        sd = dict(sd)
        sd["state.b.weight.exp_avg"] = torch.zeros(9)
    else:
        sd = {"state": dict(sd["state"]), "param_groups": sd["param_groups"]}
        sd["state"]["b.weight"] = {**sd["state"]["b.weight"], "exp_avg": torch.zeros(9)}
    model, optim = trained(seed=1)
    before = optimizer_snapshot(optim)
    with pytest.raises(ValueError, match="'exp_avg' of parameter 'b.weight'"):
        impl.set_optimizer_state_dict(model, optim, sd, options=o)
    assert_same_tree(optimizer_snapshot(optim), before)


@impls("set_state_dict: optimizer loaded, then the model load fails", raises=AssertionError)
def test_failed_set_state_dict_changes_nothing(impl):
    src, src_optim = trained()
    msd, osd = dcp_optim.get_state_dict(src, src_optim)
    msd = dict(msd)
    msd["a.bias"] = torch.zeros(11)
    model, optim = trained(seed=1)
    before = (params_snapshot(model), optimizer_snapshot(optim))
    with pytest.raises(RuntimeError, match="size mismatch for a.bias"):
        impl.set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
    assert_same_tree((params_snapshot(model), optimizer_snapshot(optim)), before)


@impls("a parameter in two optimizers: the dict keeps the last optimizer's state for it, silently",
       raises=pytest.fail.Exception)
def test_parameter_in_two_optimizers_raises(impl):
    model = Net()
    ps = dict(model.named_parameters())
    adam = torch.optim.AdamW([ps["a.weight"], ps["a.bias"], ps["b.weight"]], lr=0.05)
    sgd = torch.optim.SGD([ps["b.weight"], ps["b.bias"]], lr=0.01, momentum=0.9)
    train(model, [adam, sgd], 1)
    before = optimizer_snapshot([adam, sgd])
    with pytest.raises(ValueError, match=r"parameter 'b\.weight' is in optimizer 0 \(AdamW\) and in optimizer 1 \(SGD\)"):
        impl.get_optimizer_state_dict(model, (adam, sgd))
    sd = dcp_optim.get_optimizer_state_dict(model, adam)
    with pytest.raises(ValueError, match=r"parameter 'b\.weight' is in optimizer 0"):
        impl.set_optimizer_state_dict(model, (adam, sgd), sd)
    assert_same_tree(optimizer_snapshot([adam, sgd]), before)
    # one optimizer passed twice holds nothing twice
    impl.get_optimizer_state_dict(model, (adam, adam))
