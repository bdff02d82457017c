"""Complete templates of never-stepped optimizers (issue 23, requirements 1-2).

The template ``get_optimizer_state_dict`` returns for an optimizer that
has not stepped holds exactly the state entries (keys, shapes, dtypes,
devices, tensor classes) and param-group keys one real step creates, by
the first route that gives them (docs/differences.md, D-entries "complete
templates"): the schema (a proxy such as accelerate's
``AcceleratedOptimizer`` uses the wrapped optimizer's; LBFGS's
optimizer-wide entry), a shadow step (tensor subclasses copied
generically: torchao's low-bit states), upstream's zero-gradient step on
the real optimizer with every side effect undone, else
``IncompleteTemplateError``.  Never an incomplete template with a warning.
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
from dcp_optim._engine import shadow

FLAT = dcp_optim.StateDictOptions(flatten_optimizer_state_dict=True)


class Net(nn.Module):
    def __init__(self, width: int = 4, hidden: int = 3):
        super().__init__()
        self.width = width
        self.a = nn.Linear(width, hidden)
        self.b = nn.Linear(hidden, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).pow(2).sum()


def _x(i: int, width: int = 4) -> torch.Tensor:
    return torch.randn(8, width, generator=torch.Generator().manual_seed(i))


def train(model, opt, steps, start=0, closure=False):
    for i in range(start, start + steps):
        x = _x(i, model.width)
        if closure:
            def fn():
                opt.zero_grad()
                loss = model(x)
                loss.backward()
                return loss

            opt.step(fn)
        else:
            model(x).backward()
            opt.step()
        opt.zero_grad()


def _uninterrupted_and_source(make, steps, saved_at):
    """Two runs from the same start: ``steps`` steps uninterrupted (its
    model), and ``saved_at`` steps to save from (its model, optimizer)."""
    torch.manual_seed(0)
    ref = Net()
    train(ref, make(ref), steps)
    torch.manual_seed(0)
    src = Net()
    src_opt = make(src)
    train(src, src_opt, saved_at)
    return ref, src, src_opt


def _signature(value):
    """Keys at every depth; tensors as (class, shape, dtype, device)."""
    if isinstance(value, dict):
        return {k: _signature(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return (type(value).__name__, tuple(value.shape), value.dtype, value.device)
    if isinstance(value, list):
        return [_signature(v) for v in value]
    return type(value).__name__


def _real_step_signature(make, model_args=(), closure=False):
    torch.manual_seed(0)
    model = Net(*model_args)
    opt = make(model)
    train(model, opt, 1, closure=closure)
    names = {p: n for n, p in model.named_parameters()}
    return {names[p]: _signature(dict(st)) for p, st in opt.state.items()}, opt.param_groups


# --- torchao's low-bit optimizers: tensor subclasses, copied generically -------

ao = pytest.importorskip("torchao.optim")
AO = ["AdamW8bit", "AdamW4bit", "AdamWFp8"]


@pytest.mark.parametrize("cls", AO)
def test_torchao_template_is_a_first_steps_state(cls):
    """Upstream's getter gives these templates; ours was ``{}`` (the shadow
    step's ``.clone()`` is not implemented by torchao's state tensors)."""
    make = lambda m: getattr(ao, cls)(m.parameters(), lr=1e-2)  # noqa: E731
    want, _ = _real_step_signature(make, (64, 128))
    torch.manual_seed(0)
    model = Net(64, 128)
    opt = make(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "could not build" warning any more
        warnings.filterwarnings("ignore", "dcp_optim has no state schema")
        sd = dcp_optim.get_optimizer_state_dict(model, opt)
    assert len(opt.state) == 0
    assert {n: _signature(st) for n, st in sd["state"].items()} == want
    assert type(sd["state"]["a.weight"]["exp_avg"]).__name__.startswith("OptimState")
    flat = dcp_optim.get_optimizer_state_dict(model, opt, options=FLAT)
    assert _signature(flat["state.a.weight.exp_avg_sq"]) == want["a.weight"]["exp_avg_sq"]


@pytest.mark.parametrize("cls", AO)
def test_torchao_dcp_resume_is_exact(cls, tmp_path):
    make = lambda m: getattr(ao, cls)(m.parameters(), lr=1e-2)  # noqa: E731
    torch.manual_seed(0)
    ref = Net(64, 128)
    ref_opt = make(ref)
    train(ref, ref_opt, 4)
    torch.manual_seed(0)
    src = Net(64, 128)
    src_opt = make(src)
    train(src, src_opt, 2)
    for name, options in (("nested", dcp_optim.StateDictOptions()), ("flat", FLAT)):
        dcp.save({"o": dcp_optim.get_optimizer_state_dict(src, src_opt, options=options)},
                 checkpoint_id=str(tmp_path / name))
        torch.manual_seed(1)
        dst = Net(64, 128)
        dst.load_state_dict(src.state_dict())
        dst_opt = make(dst)
        state = {"o": dcp_optim.get_optimizer_state_dict(dst, dst_opt, options=options)}
        dcp.load(state, checkpoint_id=str(tmp_path / name))
        dcp_optim.set_optimizer_state_dict(dst, dst_opt, state["o"], options=options)
        train(dst, dst_opt, 2, start=2)
        for (n, p), q in zip(dst.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), f"{cls} {name}: {n} differs"


@pytest.mark.filterwarnings("ignore:dcp_optim has no state schema")
@pytest.mark.parametrize("impl", [
    pytest.param(upstream, id="upstream", marks=pytest.mark.xfail(strict=True, reason=(
        "its template holds Lamb's trust_ratio as the int 1 its zero-gradient step leaves; a stepped "
        "checkpoint holds a tensor there, and dcp.load fails on that entry"))),
    pytest.param(dcp_optim, id="dcp_optim"),
])
def test_template_value_types_follow_a_real_step(impl, tmp_path):
    """torch-optimizer's Lamb stores ``trust_ratio`` as the int 1 where the
    update's norm is 0 -- always, for the zero gradients of a template's
    step -- and as a tensor after a real step.  The template takes the
    type of the shadow's second step (unit gradients), so the template
    flow (get -> ``dcp.load`` -> set) resumes exactly."""
    topt = pytest.importorskip("torch_optimizer")
    make = lambda m: topt.Lamb(m.parameters(), lr=1e-2)  # noqa: E731
    ref, src, src_opt = _uninterrupted_and_source(make, 4, 2)
    assert isinstance(src_opt.state[src.a.weight]["trust_ratio"], torch.Tensor)
    dcp.save({"o": impl.get_optimizer_state_dict(src, src_opt)}, checkpoint_id=str(tmp_path))
    torch.manual_seed(1)
    dst = Net()
    dst.load_state_dict(src.state_dict())
    dst_opt = make(dst)
    state = {"o": impl.get_optimizer_state_dict(dst, dst_opt)}
    assert isinstance(state["o"]["state"]["a.weight"]["trust_ratio"], torch.Tensor)
    dcp.load(state, checkpoint_id=str(tmp_path))
    impl.set_optimizer_state_dict(dst, dst_opt, state["o"])
    train(dst, dst_opt, 2, start=2)
    for (n, p), q in zip(dst.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), f"{n} differs"


def test_copy_tensor_rebuilds_subclasses():
    t = ao.subclass_8bit.OptimState8bit.zeros((64, 64), signed=True, block_size=256)
    t.copy_(torch.randn(64, 64))
    c = shadow.copy_tensor(t)
    assert type(c) is type(t) and c.shape == t.shape and c.dtype == t.dtype
    assert torch.equal(c.dequantize(), t.dequantize())
    assert c.codes.untyped_storage().data_ptr() != t.codes.untyped_storage().data_ptr()
    plain = torch.arange(3.0)
    assert torch.equal(shadow.copy_tensor(plain), plain) and shadow.copy_tensor(plain) is not plain


# --- LBFGS: its optimizer-wide entry --------------------------------------------


def _lbfgs(model):
    return torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)


def test_lbfgs_template_has_the_first_steps_keys_and_changes_nothing():
    want, _ = _real_step_signature(lambda m: torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=1), closure=True)
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=1)
    sd = dcp_optim.get_optimizer_state_dict(model, opt)
    got = _signature(sd["state"]["a.weight"])
    for key in ("d", "prev_flat_grad", "old_dirs", "old_stps", "ro", "func_evals", "n_iter", "prev_loss"):
        assert got[key] == want["a.weight"][key], key
    assert set(sd["state"]) == set(want) == {"a.weight"}
    assert list(sd["state"]["a.weight"]) == list(want["a.weight"])
    assert len(opt.state) == 0


def test_lbfgs_template_set_into_a_fresh_optimizer_is_a_no_op():
    """Installing the pristine entry changes no step: the same parameters
    after three steps as an optimizer that never had it."""
    torch.manual_seed(0)
    a = Net()
    opt_a = _lbfgs(a)
    b = copy.deepcopy(a)
    opt_b = _lbfgs(b)
    sd = dcp_optim.get_optimizer_state_dict(b, opt_b)
    dcp_optim.set_optimizer_state_dict(b, opt_b, copy.deepcopy(sd))
    assert opt_b.state[b.a.weight]["n_iter"] == 0
    # the flattened format spells the (empty) history lists by their
    # length (D29), and sets back as the same no-op
    flat = dcp_optim.get_optimizer_state_dict(b, opt_b, options=FLAT)
    assert flat["state.a.weight.old_dirs.[]"] == 0
    dcp_optim.set_optimizer_state_dict(b, opt_b, flat, options=FLAT)
    assert opt_b.state[b.a.weight]["n_iter"] == 0 and opt_b.state[b.a.weight]["old_dirs"] == []
    train(a, opt_a, 3, closure=True)
    train(b, opt_b, 3, closure=True)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_lbfgs_dcp_resume_raises_instead_of_dropping_its_history(tmp_path):
    """The template names LBFGS's history: a trained run's history lists
    are longer, and dcp.load raises on them before anything trains on
    (the template was ``{}``, and the resume silently restarted LBFGS)."""
    torch.manual_seed(0)
    src = Net()
    src_opt = _lbfgs(src)
    train(src, src_opt, 3, closure=True)
    dcp.save({"o": dcp_optim.get_optimizer_state_dict(src, src_opt)}, checkpoint_id=str(tmp_path))
    dst = copy.deepcopy(src)
    dst_opt = _lbfgs(dst)
    state = {"o": dcp_optim.get_optimizer_state_dict(dst, dst_opt)}
    with pytest.raises(dcp.api.CheckpointException, match="old_dirs"):
        dcp.load(state, checkpoint_id=str(tmp_path))
    assert len(dst_opt.state) == 0


# --- proxies: accelerate's AcceleratedOptimizer -------------------------------------


def _accelerated(model):
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, PartialState

    accelerator = accelerate.Accelerator(cpu=True)
    try:
        return accelerator.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                             device_placement=False)
    finally:
        AcceleratorState._reset_state(True)
        PartialState._reset_state()


def test_accelerated_optimizer_uses_the_wrapped_optimizers_schema(monkeypatch):
    torch.manual_seed(0)
    model = Net()
    opt = _accelerated(model)
    calls = []
    monkeypatch.setattr(shadow, "_shadow_step", lambda *a, **k: calls.append(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sd = dcp_optim.get_optimizer_state_dict(model, opt)
    assert calls == [], "a shadow step ran for a proxy of AdamW"
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _same(sd, dcp_optim.get_optimizer_state_dict(model, plain))
    assert dcp_optim.schema.proxied(opt) is opt.optimizer


# --- the routes beyond the shadow step ---------------------------------------------

_LIVE: set[int] = set()  # ids of the parameters of live IdentityBound optimizers


class IdentityBound(torch.optim.Optimizer):
    """Creates state only for the parameters it was constructed with (by
    identity, through a module-level registry): a shadow step over copies
    creates none -- a condition it does not meet -- while a real step
    does.  Counts its steps in an attribute and a group key."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})
        self.calls = 0
        self.history: list[int] = []
        for g in self.param_groups:
            _LIVE.update(id(p) for p in g["params"])

    @torch.no_grad()
    def step(self, closure=None):
        self.calls += 1
        self.history.append(self.calls)
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            for p in group["params"]:
                if p.grad is None or id(p) not in _LIVE:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["m"] = torch.zeros_like(p)
                st["step"] += 1
                st["m"].mul_(0.9).add_(p.grad)
                p.add_(st["m"], alpha=-group["lr"])


class RaisesOnCopies(IdentityBound):
    """A shadow step raises (a step over copies fails its check)."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) not in _LIVE:
                    raise RuntimeError("not my parameter")
        return super().step(closure)


def _everything(model, opt):
    return (
        [(p.detach().clone(), p.grad if p.grad is None else p.grad.clone()) for p in model.parameters()],
        {id(k): {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in st.items()}
         for k, st in opt.state.items()},
        [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        opt.calls,
        list(opt.history),
    )


def _same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b, (a, b)


@pytest.mark.parametrize("cls", [IdentityBound, RaisesOnCopies])
@pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "partly-stepped"])
@pytest.mark.filterwarnings("ignore:dcp_optim has no state schema")
def test_upstream_route_completes_the_template_and_undoes_everything(cls, stepped, tmp_path):
    """Where the shadow step leaves a trainable parameter without state (or
    raises), one step of the real optimizer with zero gradients makes the
    template complete, and every side effect is undone: parameters,
    gradients (kept objects), state, group values and keys, counters."""
    torch.manual_seed(0)
    model = Net()
    opt = cls(model.parameters())
    if stepped:
        # a.weight steps alone, b.* keep no state: only they are filled
        model.b.requires_grad_(False)
        train(model, opt, 1)
        model.b.requires_grad_(True)
        model.a.weight.grad = torch.ones_like(model.a.weight)  # a gradient the user holds
    before = _everything(model, opt)
    grads = [p.grad for p in model.parameters()]
    sd = dcp_optim.get_optimizer_state_dict(model, opt)
    _same(_everything(model, opt), before)
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    assert set(sd["state"]) == {n for n, _ in model.named_parameters()}
    for n, st in sd["state"].items():
        assert list(st) == ["step", "m"], n
    if not stepped:
        assert all(st["step"] == 0 and not st["m"].any() for st in sd["state"].values())
        assert sd["param_groups"][0]["step"] == 0
    # the template resumes through DCP
    torch.manual_seed(0)
    src = Net()
    src_opt = cls(src.parameters())
    train(src, src_opt, 2)
    dcp.save({"o": dcp_optim.get_optimizer_state_dict(src, src_opt)}, checkpoint_id=str(tmp_path / "c"))
    dst = copy.deepcopy(src)
    dst_opt = cls(dst.parameters())
    state = {"o": dcp_optim.get_optimizer_state_dict(dst, dst_opt)}
    dcp.load(state, checkpoint_id=str(tmp_path / "c"))
    dcp_optim.set_optimizer_state_dict(dst, dst_opt, state["o"])
    train(src, src_opt, 1, start=2)
    train(dst, dst_opt, 1, start=2)
    for p, q in zip(src.parameters(), dst.parameters()):
        assert torch.equal(p, q)


class NeverSteps(torch.optim.Optimizer):
    """A step that cannot run at all without its caller's arguments."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    def step(self, closure=None, *, loss):  # noqa: ARG002
        raise AssertionError("unreachable")


@pytest.mark.filterwarnings("ignore:dcp_optim has no state schema")
def test_no_route_raises_on_the_getter_naming_class_and_way_out():
    torch.manual_seed(0)
    model = Net()
    opt = NeverSteps(model.parameters())
    for options in (dcp_optim.StateDictOptions(), FLAT):
        with pytest.raises(dcp_optim.errors.IncompleteTemplateError) as info:
            dcp_optim.get_optimizer_state_dict(model, opt, options=options)
        text = str(info.value)
        assert "NeverSteps" in text and "register_optimizer_schema(NeverSteps" in text
        assert isinstance(info.value, RuntimeError)
    # upstream raises the step's own error
    with pytest.raises(TypeError):
        upstream.get_optimizer_state_dict(model, opt)
    # a registered schema is the way out
    dcp_optim.register_optimizer_schema(
        NeverSteps, lambda o, g: [dcp_optim.schema.zeros_like("m")])
    try:
        sd = dcp_optim.get_optimizer_state_dict(model, opt)
        assert set(sd["state"]) == {n for n, _ in model.named_parameters()}
    finally:
        dcp_optim.schema._registry.pop(NeverSteps, None)


class HoldsAdamW(torch.optim.Optimizer):
    """Torch's default state_dict(), and an inner AdamW over the same
    parameters whose state is its own: Optimizer.state_dict() omits it."""

    def __init__(self, params, share: bool = False):
        params = list(params)
        super().__init__(params, {"lr": 0.01})
        self.inner = torch.optim.AdamW(params, lr=0.01)
        if share:
            self.state = self.inner.state

    def step(self, closure=None):
        return self.inner.step(closure)


@pytest.mark.filterwarnings("ignore:dcp_optim has no state schema")
def test_optimizer_holding_another_with_its_own_state_is_refused():
    """D31: an optimizer keeping another optimizer's state apart is refused
    on the getter (never-stepped and stepped, both formats), naming class
    and attribute, with nothing changed; upstream's dict silently lacks the
    inner state.  Sharing the inner optimizer's state is the way out."""
    torch.manual_seed(0)
    model = Net()
    opt = HoldsAdamW(model.parameters())
    for steps in (0, 1):
        train(model, opt, steps)
        before = copy.deepcopy(opt.inner.state_dict())
        for options in (dcp_optim.StateDictOptions(), FLAT):
            with pytest.raises(dcp_optim.errors.HeldOptimizerStateError) as info:
                dcp_optim.get_optimizer_state_dict(model, opt, options=options)
            assert info.value.owner == "HoldsAdamW" and info.value.attribute == "inner"
            assert "HoldsAdamW" in str(info.value) and ".inner" in str(info.value)
            assert "omits it" in str(info.value)
        after = opt.inner.state_dict()
        assert before["state"].keys() == after["state"].keys()
        for k, st in before["state"].items():
            for name, v in st.items():
                assert torch.equal(v, after["state"][k][name])
    theirs = upstream.get_optimizer_state_dict(model, opt)
    assert opt.inner.state and not any("exp_avg" in st for st in theirs["state"].values())
    # sharing the state: the inner AdamW's state is the optimizer's own
    torch.manual_seed(0)
    model = Net()
    opt = HoldsAdamW(model.parameters(), share=True)
    train(model, opt, 1)
    sd = dcp_optim.get_optimizer_state_dict(model, opt)
    assert all("exp_avg" in st for st in sd["state"].values())


class PrivateGroupKeys(torch.optim.SGD):
    """heavyball's pattern: the first step adds a private group key
    (``_shapes``, None here) and ``state_dict`` leaves out every group key
    starting with "_", so no checkpoint holds it."""

    def step(self, closure=None):
        for group in self.param_groups:
            group["_shapes"] = None
            group["steps_taken"] = group.get("steps_taken", 0) + 1
        return super().step(closure)

    def state_dict(self):
        sd = super().state_dict()
        for g in sd["param_groups"]:
            for k in [k for k in g if k.startswith("_")]:
                del g[k]
        return sd


@pytest.mark.parametrize("impl", [upstream, dcp_optim], ids=["upstream", "dcp_optim"])
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_template_groups_as_the_optimizers_own_state_dict_lays_them_out(impl, tmp_path):
    """A never-stepped optimizer's template holds the group keys a first
    step adds as its own ``state_dict`` lays them out: without the private
    key it leaves out (dcp.load of a checkpoint would miss it: "Missing
    key"), with the public one; the template flow resumes bit for bit."""
    def make(m):
        return PrivateGroupKeys(m.parameters(), lr=0.1, momentum=0.9)

    ref, src, src_opt = _uninterrupted_and_source(make, 3, 2)
    saved = impl.get_optimizer_state_dict(src, src_opt)
    assert "_shapes" not in saved["param_groups"][0] and saved["param_groups"][0]["steps_taken"] == 2
    dcp.save({"optim": saved}, checkpoint_id=str(tmp_path))
    dst = Net()
    dst.load_state_dict(src.state_dict())
    dst_opt = make(dst)
    template = impl.get_optimizer_state_dict(dst, dst_opt)
    assert sorted(template["param_groups"][0]) == sorted(saved["param_groups"][0])
    if impl is dcp_optim:  # (upstream's dummy step adds the key to the live group)
        assert "_shapes" not in dst_opt.param_groups[0] and "steps_taken" not in dst_opt.param_groups[0]
    state = {"optim": template}
    dcp.load(state, checkpoint_id=str(tmp_path))
    impl.set_optimizer_state_dict(dst, dst_opt, state["optim"])
    train(dst, dst_opt, 1, start=2)
    for a, b in zip(ref.parameters(), dst.parameters()):
        assert torch.equal(a, b)
