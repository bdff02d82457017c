"""The long tail of optimizers: every optimizer of ``pytorch-optimizer``
(its registry, ``get_supported_optimizers()``) and the wrappers it ships,
``lion-pytorch``, ``schedulefree``, ``prodigyopt``, ``bitsandbytes``,
``torch-optimizer``, ``galore-torch``, ``apollo-torch``, ``torch-optimi``,
``dadaptation``, ``adan-pytorch``, ``adam-mini``, ``came-pytorch``,
``heavyball``, transformers' ``Adafactor`` and ``torch.optim``,
differentially against upstream and torch.

For each, on a tiny model, one process:

* the template of a never-stepped optimizer holds every state key (and
  every param-group key) a real first step creates, with the step's
  shapes, no two tensors sharing storage; the getter changes nothing
  (state, groups, parameters, gradients) and fires no process-wide hook;
* after two steps, both formats equal upstream's (where upstream fails:
  the result round-trips like torch's ``state_dict()/load_state_dict()``);
* get, set into a fresh copy, one step: bit for bit the uninterrupted run;
* the same through ``dcp.save``/``dcp.load`` with a never-stepped template;
* a bf16 resume (fp32 checkpoint, bf16 parameters) steps, with the state
  dtypes torch's ``load_state_dict`` gives, but for the tensors a first
  step on bf16 parameters makes in another dtype (fp32 moments), which
  keep it (D35 in docs/differences.md).

Optimizers that cannot take a plain training step on CPU are skipped with
the reason printed; the session's summary prints how many of the catalogue
ran and were checked, and apart from them those on which every getter
raises in upstream too (only the exception class is compared there).
"""

from __future__ import annotations

import collections
import copy
import functools
import random
import warnings
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as upstream
import torch.nn as nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

import dcp_optim

from ..support.models import sharpness_aware_step
from ..support.oracle import assert_same_tree

po = pytest.importorskip("pytorch_optimizer")
lion_pytorch = pytest.importorskip("lion_pytorch")
schedulefree = pytest.importorskip("schedulefree")
prodigyopt = pytest.importorskip("prodigyopt")
bnb = pytest.importorskip("bitsandbytes")
topt = pytest.importorskip("torch_optimizer")
galore_torch = pytest.importorskip("galore_torch")
adam_mini = pytest.importorskip("adam_mini")
came_pytorch = pytest.importorskip("came_pytorch")
apollo_torch = pytest.importorskip("apollo_torch")
hf_optim = pytest.importorskip("transformers.optimization")
optimi = pytest.importorskip("optimi")
dadaptation = pytest.importorskip("dadaptation")
adan_pytorch = pytest.importorskip("adan_pytorch")
heavyball = pytest.importorskip("heavyball")
# heavyball compiles its steps with torch.compile by default (minutes of
# Inductor on the CPU for a tiny model); its documented switch runs them
# eagerly, the same update
heavyball.utils.compile_mode = None


class Net(nn.Module):
    def __init__(self, bias: bool = True):
        super().__init__()
        self.a = nn.Linear(4, 3, bias=bias)
        self.b = nn.Linear(3, 2, bias=bias)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).pow(2).sum()


def _x(step: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(step)).to(dtype)


# --- the catalogue -----------------------------------------------------------------


def _muon_groups(model):
    mats = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    return [{"params": mats, "use_muon": True}, {"params": rest, "use_muon": False}]


def _po(name, *, model_arg=False, groups=None, **kwargs):
    cls = po.load_optimizer(name)

    def make(model):
        if model_arg:
            return cls(model, **kwargs)
        params = groups(model) if groups else model.parameters()
        return cls(params, **kwargs)

    return make


# name -> why the optimizer cannot take a plain training step on CPU here
SKIP = {
    "demo": "DeMo needs einops and a process group (distributed compression)",
    "distributedmuon": "DistributedMuon needs an initialized process group",
    "spectralsphere": "SpectralSphere supports 2-D parameters only (and needs a closure-free sphere init)",
    "adalomo": "AdaLOMO fuses the update into backward hooks: no optimizer.step() training",
    "lomo": "LOMO fuses the update into backward hooks: no optimizer.step() training",
}
# trained with a closure re-evaluating the loss / with backward(create_graph=True)
CLOSURE = {"lbfgs"}
LOSS = {"alig"}  # step(lambda: loss) after backward
HESSIAN = {"adahessian", "sophiah"}
# sharpness-aware: gradients first, then step(closure) with a closure that
# clears and recomputes them (called twice or more per step)
SAM = {"bsam"}

# name -> constructor arguments beyond the parameters
KWARGS = {
    "ranger21": {"num_iterations": 10},
    "adammini": {"num_embeds": 3, "num_heads": 1},
    "bsam": {"num_data": 10},
}
GROUPS = {n: _muon_groups for n in ("muon", "adamuon", "adago", "muonclip", "normuon")}
MODEL_ARG = {"adammini"}


_SAM_FACTORIES: set = set()


def _sam(factory):
    _SAM_FACTORIES.add(factory)
    return factory


def _gsam(model):
    """GSAM over an AdamW instance, its rho driven by a ProportionScheduler
    of a constant LR scheduler; its closure returns (outputs, loss)."""
    base = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(base, lambda _: 1.0)
    rho = po.ProportionScheduler(sched, max_lr=1e-2, min_lr=0.0, max_value=0.05, min_value=0.05)
    return po.GSAM(model.parameters(), base_optimizer=base, model=model, rho_scheduler=rho)


def catalogue():
    out = {}
    for name in po.get_supported_optimizers():
        out[f"po.{name}"] = (
            SKIP.get(name),
            _po(name, model_arg=name in MODEL_ARG, groups=GROUPS.get(name), **KWARGS.get(name, {})),
        )
    out["lion_pytorch.Lion"] = (None, lambda m: lion_pytorch.Lion(m.parameters(), lr=1e-3, weight_decay=0.1))
    out["schedulefree.AdamWScheduleFree"] = (
        None, lambda m: schedulefree.AdamWScheduleFree(m.parameters(), lr=1e-2, weight_decay=0.1))
    out["schedulefree.SGDScheduleFree"] = (None, lambda m: schedulefree.SGDScheduleFree(m.parameters(), lr=1e-2))
    out["schedulefree.RAdamScheduleFree"] = (None, lambda m: schedulefree.RAdamScheduleFree(m.parameters(), lr=1e-2))
    # bitsandbytes: its state_dict() nests the quantization state of
    # every parameter under one key, which its load_state_dict unpacks;
    # min_8bit_size=1 quantizes the tiny model's parameters too
    for bname in ("Adam8bit", "AdamW8bit", "Lion8bit", "PagedAdamW8bit", "RMSprop8bit", "AdEMAMix8bit",
                  "Adam", "AdamW", "Lion", "LAMB8bit", "LARS8bit", "Adagrad8bit", "SGD8bit"):
        cls = getattr(bnb.optim, bname)
        kw = {"min_8bit_size": 1} if "8bit" in bname else {}
        if bname in ("SGD8bit", "LARS8bit"):
            kw["momentum"] = 0.9
        out[f"bnb.{bname}"] = (None, lambda m, cls=cls, kw=kw: cls(m.parameters(), lr=1e-2, **kw))
    # torch-optimizer (jettify), GaLore, APOLLO, transformers' Adafactor,
    # optimi (with and without Kahan summation), D-Adaptation, Adan,
    # Adam-mini, CAME
    for tname in ("A2GradExp", "A2GradInc", "A2GradUni", "AccSGD", "AdaBelief", "AdaBound", "AdaMod", "Adafactor",
                  "AdamP", "AggMo", "Apollo", "DiffGrad", "Lamb", "MADGRAD", "NovoGrad", "PID", "QHAdam", "QHM",
                  "RAdam", "Ranger", "RangerQH", "RangerVA", "SGDP", "SGDW", "SWATS", "Shampoo", "Yogi"):
        cls = getattr(topt, tname)
        kw = {"lr": 1e-2}
        if tname in ("PID", "SGDW", "QHM"):
            kw["momentum"] = 0.9
        out[f"topt.{tname}"] = (None, lambda m, cls=cls, kw=kw: cls(m.parameters(), **kw))
    out["topt.Lookahead(Yogi)"] = (
        "its own state_dict() raises AttributeError on torch >= 2 (its constructor skips Optimizer's)",
        lambda m: topt.Lookahead(topt.Yogi(m.parameters(), lr=1e-2), k=2))
    def _galore(m, cls):
        mats = [p for p in m.parameters() if p.dim() == 2]
        rest = [p for p in m.parameters() if p.dim() != 2]
        return cls([{"params": rest}, {"params": mats, "rank": 2, "update_proj_gap": 2, "scale": 0.25,
                                       "proj_type": "std"}], lr=1e-2)
    out["galore.AdamW"] = (None, lambda m: _galore(m, galore_torch.GaLoreAdamW))
    out["galore.Adafactor"] = (None, lambda m: _galore(m, functools.partial(
        galore_torch.GaLoreAdafactor, relative_step=False, scale_parameter=False)))
    out["galore.AdamW8bit"] = (
        "its step calls torch.cuda.synchronize(): CUDA only",
        lambda m: _galore(m, galore_torch.GaLoreAdamW8bit))
    def _apollo(m, proj):
        mats = [p for p in m.parameters() if p.dim() == 2]
        rest = [p for p in m.parameters() if p.dim() != 2]
        return apollo_torch.APOLLOAdamW([{"params": rest}, {"params": mats, "rank": 1, "proj": proj,
                                         "scale_type": "channel", "update_proj_gap": 2, "scale": 1.0,
                                         "proj_type": "std"}], lr=1e-2)
    out["apollo.random"] = (None, lambda m: _apollo(m, "random"))
    out["apollo.svd"] = (None, lambda m: _apollo(m, "svd"))
    out["hf.Adafactor"] = (None, lambda m: hf_optim.Adafactor(m.parameters(), lr=1e-2, relative_step=False,
                                                              scale_parameter=False, warmup_init=False))
    out["hf.Adafactor(relative)"] = (None, lambda m: hf_optim.Adafactor(m.parameters(), lr=None))
    for oname in ("Adam", "AdamW", "Adan", "Lion", "RAdam", "Ranger", "SGD", "StableAdamW"):
        cls = getattr(optimi, oname)
        kw = {"momentum": 0.9} if oname == "SGD" else {}
        out[f"optimi.{oname}"] = (None, lambda m, cls=cls, kw=kw: cls(m.parameters(), lr=1e-2, **kw))
        out[f"optimi.{oname}(kahan)"] = (None, lambda m, cls=cls, kw=kw: cls(m.parameters(), lr=1e-2,
                                                                                 kahan_sum=True, **kw))
    for dname in ("DAdaptAdaGrad", "DAdaptAdam", "DAdaptAdan", "DAdaptLion", "DAdaptSGD"):
        cls = getattr(dadaptation, dname)
        out[f"dadapt.{dname}"] = (None, lambda m, cls=cls: cls(m.parameters(), lr=1.0))
    # heavyball: each parameter's state nested under its view index 0
    # (non-tensor values there: DCP's string keys, D32), private group
    # keys its state_dict leaves out
    for hname in ("AdamW", "SGD", "LaProp", "ADOPT", "NAdam", "RMSprop", "SOAP", "Muon", "PSGDKron", "AdEMAMix",
                  "SFAdamW", "Scion", "SignLaProp", "AdamC", "MuonAdamW", "KLShampoo", "PSGDLRA", "UnscaledAdamW",
                  "QSGD", "HyperBallAdamW", "SUDSAdamW", "LATHER", "OrthoLaProp", "MSAMLaProp"):
        cls = getattr(heavyball, hname)
        out[f"heavyball.{hname}"] = (None, lambda m, cls=cls: cls(m.parameters(), lr=1e-2))
    out["adan_pytorch.Adan"] = (None, lambda m: adan_pytorch.Adan(m.parameters(), lr=1e-2))
    out["adam_mini"] = (None, lambda m: adam_mini.Adam_mini(m.named_parameters(), lr=1e-2, dim=4, n_heads=1))
    out["came.CAME"] = (None, lambda m: came_pytorch.CAME(m.parameters(), lr=1e-2))
    out["prodigyopt.Prodigy"] = (None, lambda m: prodigyopt.Prodigy(m.parameters(), lr=1.0, weight_decay=0.01))
    out["po.Lookahead(AdamW)"] = (None, lambda m: po.Lookahead(torch.optim.AdamW(m.parameters(), lr=1e-2), k=2))
    out["po.ScheduleFreeWrapper(SGD)"] = (
        None, lambda m: po.ScheduleFreeWrapper(torch.optim.SGD(m.parameters(), lr=1e-2)))
    out["po.OrthoGrad(AdamW)"] = (None, lambda m: po.OrthoGrad(torch.optim.AdamW(m.parameters(), lr=1e-2)))
    out["po.TRAC(AdamW)"] = (None, lambda m: po.TRAC(torch.optim.AdamW(m.parameters(), lr=1e-2)))
    out["po.PCGrad(AdamW)"] = (None, lambda m: po.PCGrad(torch.optim.AdamW(m.parameters(), lr=1e-2)))
    # sharpness-aware wrappers of a base optimizer class: SAM shares its
    # base optimizer's state, the others nest the base optimizer's
    # state_dict under "base_optimizer" in theirs
    for sam in (po.SAM, po.FriendlySAM, po.LookSAM):
        out[f"po.{sam.__name__}(AdamW)"] = (None, _sam(lambda m, cls=sam: cls(
            m.parameters(), base_optimizer=torch.optim.AdamW, lr=1e-2)))
    out["po.WSAM(AdamW)"] = (None, _sam(lambda m: po.WSAM(m, m.parameters(), base_optimizer=torch.optim.AdamW,
                                                          lr=1e-2)))
    out["po.GSAM(AdamW)"] = (None, _gsam)
    # steps fp32 master copies (not the model's parameters) and has no
    # param_groups/state of its own: both getters raise
    out["po.SafeFP16Optimizer(AdamW)"] = (
        None, lambda m: po.SafeFP16Optimizer(torch.optim.AdamW(m.parameters(), lr=1e-2)))
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adadelta,
                torch.optim.Adamax, torch.optim.ASGD, torch.optim.NAdam, torch.optim.RAdam,
                torch.optim.RMSprop, torch.optim.Rprop):
        out[f"torch.{cls.__name__}"] = (None, lambda m, cls=cls: cls(m.parameters(), lr=1e-2))
    out["torch.SGD(momentum)"] = (
        None, lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9, dampening=0.1))
    return out


CATALOGUE = catalogue()
name_of = {f: n.split(".", 1)[1] for n, (_, f) in CATALOGUE.items() if f is not None and n.startswith("po.")}
_RAN: set[str] = set()  # ran, and dcp_optim's results were checked
_BOTH_RAISE: dict[str, str] = {}  # ran, but every get raises in both: nothing to check beyond that
_SKIPPED: dict[str, str] = {}
_REFUSED: dict[str, str] = {}  # the getter raises HeldOptimizerStateError, checked
_UPSTREAM_FAILS: dict[str, str] = {}


def corpus_summary() -> list[str]:
    """Printed at the end of the session (conftest.py)."""
    if not (_RAN or _BOTH_RAISE or _SKIPPED or _REFUSED):
        return []
    lines = [
        f"optimizer corpus: {len(_RAN)} of {len(CATALOGUE)} ran and were checked (template, "
        f"formats, resumes); {len(_BOTH_RAISE)} ran but both dcp_optim and upstream raise on "
        f"get (only the exception class checked); {len(_REFUSED)} refused (a base optimizer's "
        f"state kept apart: HeldOptimizerStateError, checked); {len(_SKIPPED)} skipped; "
        f"upstream (or torch) fails on {len(_UPSTREAM_FAILS)} checks"
    ]
    lines += [f"  skipped {k}: {v}" for k, v in sorted(_SKIPPED.items())]
    lines += [f"  both raise {k}: {v}" for k, v in sorted(_BOTH_RAISE.items())]
    lines += [f"  refused {k}: {v}" for k, v in sorted(_REFUSED.items())]
    lines += [f"  upstream: {k}: {v}" for k, v in sorted(_UPSTREAM_FAILS.items())]
    return lines


# --- one optimizer ------------------------------------------------------------------


def _build(factory, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = Net().to(dtype)
    opt = factory(model)
    short = name_of.get(factory)
    mode = None
    if short in CLOSURE:
        mode = "closure"
    elif short in LOSS:
        mode = "loss"
    elif short in HESSIAN:
        mode = "hessian"
    elif short in SAM or factory in _SAM_FACTORIES:
        mode = "sam"
    elif factory is _gsam:
        mode = "gsam"
    # always written: a new optimizer can get the id of a collected one,
    # whose entry would otherwise give it that optimizer's step mode (an
    # EmoNavi stepped with a loss closure in one run and without in the
    # other: "differs after the resumed step", now and then)
    _MODE[id(opt)] = mode
    if hasattr(opt, "train") and callable(opt.train):
        opt.train()  # schedule-free optimizers step in train mode
    return model, opt


_MODE: dict[int, str | None] = {}  # id(optimizer) -> "closure" / "hessian" / ... / None (plain step)


def _step(model, opt, i, dtype=torch.float32):
    # every random stream an optimizer may draw from in step() (Kron's
    # balancing draws from numpy's global one), seeded by the step index:
    # the resumed step i draws what the uninterrupted run's step i drew
    random.seed(i)
    np.random.seed(i)
    torch.manual_seed(1000 + i)
    mode = _MODE.get(id(opt))
    if mode == "closure":
        def closure():
            opt.zero_grad()
            loss = model(_x(i, dtype))
            loss.backward()
            return loss

        opt.step(closure)
    elif mode in ("sam", "gsam"):
        sharpness_aware_step(model, opt, _x(i, dtype), gsam=mode == "gsam")
    elif mode == "loss":
        loss = model(_x(i, dtype))
        loss.backward()
        opt.step(lambda: float(loss))
    else:
        model(_x(i, dtype)).backward(create_graph=mode == "hessian")
        opt.step()
    opt.zero_grad()


def _snapshot(model, opt):
    """Everything a getter must leave as it was: parameters, gradients,
    state (identity and bits), groups."""
    def tree(v):
        if isinstance(v, torch.Tensor):
            return (id(v), v.detach().clone())
        if isinstance(v, dict):
            return {k: tree(x) for k, x in v.items()}
        if isinstance(v, (list, tuple, collections.deque)):
            return type(v)(tree(x) for x in v)
        return v

    return (
        [(n, p.detach().clone(), None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()],
        tree({id(k) if isinstance(k, torch.Tensor) else k: v for k, v in getattr(opt, "state", {}).items()}),
        tree([{k: v for k, v in g.items() if k != "params"} for g in getattr(opt, "param_groups", [])]),
    )


def _same(a, b, path="$"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                     and torch.equal(a.nan_to_num(), b.nan_to_num())), path
        return
    if isinstance(a, dict):
        assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
        assert list(a) == list(b), f"{path}: {list(a)} != {list(b)}"
        for k in a:
            _same(a[k], b[k], f"{path}[{k!r}]")
        return
    if isinstance(a, (list, tuple, collections.deque)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
        return
    if hasattr(a, "__dict__") and not isinstance(a, type) and not callable(a):
        # an object kept in the state (GaLore's projector): by value
        assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
        _same(vars(a), vars(b), f"{path}.__dict__")
        return
    # D48: a never-stepped parameter's name (nested) or group numbers
    # (flattened) are marked, with the plain value's equality
    a, b = _unmarked(a), _unmarked(b)
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    assert a == b or (a != a and b != b), f"{path}: {a!r} != {b!r}"


def _names_unmarked(osd):
    """A nested dict with its groups' marked names plain (D48)."""
    if not isinstance(osd, dict) or not isinstance(osd.get("param_groups"), list):
        return osd
    groups = [{**g, "params": [_unmarked(p) for p in g["params"]]} if isinstance(g, dict) and "params" in g else g
              for g in osd["param_groups"]]
    return {**osd, "param_groups": groups}


def _unmarked(value):
    from dcp_optim.marks import NeverSteppedFloat, NeverSteppedInt, NeverSteppedName

    for mark, plain in ((NeverSteppedName, str), (NeverSteppedInt, int), (NeverSteppedFloat, float)):
        if type(value) is mark:
            return plain(value)
    return value


def _storages(tree, out):
    if isinstance(tree, torch.Tensor):
        if tree.numel():
            out.append(tree.untyped_storage().data_ptr())
    elif isinstance(tree, dict):
        for v in tree.values():
            _storages(v, out)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            _storages(v, out)
    return out


def _fire_counter():
    calls = []
    pre = register_optimizer_step_pre_hook(lambda *a: calls.append("pre"))
    post = register_optimizer_step_post_hook(lambda *a: calls.append("post"))
    return calls, (pre, post)


_UPSTREAM_RUNS: dict[int, Any] = {}


def _upstream_get(model, opt, fmt, factory, steps):
    """Upstream's result (or exception) on a rebuilt copy (the same seeds
    and steps): its dummy step may change the optimizer, and a failing one
    leaves ``lr`` at 0."""
    m, o = _build(factory)
    for i in range(steps):
        _step(m, o, i)
    before = _snapshot(m, o)
    try:
        out = upstream.get_optimizer_state_dict(
            m, o, options=upstream.StateDictOptions(flatten_optimizer_state_dict=fmt == "flat"))
    except Exception as exc:  # noqa: BLE001 - the caller records it
        out = exc
    _UPSTREAM_RUNS[id(opt)] = (before, _snapshot(m, o))
    return out


def _upstream_round_trip(factory, fmt, theirs):
    """The exception upstream's own get-set-step round trip raises, if any."""
    if isinstance(theirs, BaseException):
        return theirs
    m, o = _build(factory, seed=1)
    try:
        upstream.set_optimizer_state_dict(
            m, o, copy.deepcopy(theirs),
            options=upstream.StateDictOptions(flatten_optimizer_state_dict=fmt == "flat"))
        _step(m, o, 2)
    except Exception as exc:  # noqa: BLE001 - returned to the caller
        return exc
    return None


def _upstream_kept(opt):
    """Whether upstream's last get left its copy of the optimizer as it was."""
    mine, theirs = _UPSTREAM_RUNS[id(opt)]
    try:
        _same(_strip_ids(mine), _strip_ids(theirs))
    except AssertionError:
        return False
    return True


def _strip_ids(tree):
    if isinstance(tree, tuple) and len(tree) == 2 and isinstance(tree[1], torch.Tensor) and isinstance(tree[0], int):
        return tree[1]
    if isinstance(tree, dict):
        return [_strip_ids(v) for v in tree.values()]  # keys are ids: order only
    if isinstance(tree, (list, tuple)):
        return [_strip_ids(v) for v in tree]
    return tree


def _wrapper_key(opt):
    """The entry of a wrapper's own ``state_dict()`` that holds its inner
    optimizer's (torch's layout), when the wrapper's is not torch's
    layout itself (Lookahead's ``base_optimizer``, Magma's ``base``)."""
    sd = opt.state_dict() if hasattr(opt, "state_dict") else {}
    if "state" in sd:
        return None
    keys = [k for k, v in sd.items() if isinstance(v, dict) and "state" in v and "param_groups" in v]
    return keys[0] if len(keys) == 1 else None


def _param_state(opt):
    """Where per-parameter state lives: a wrapper's inner optimizer."""
    return opt.optimizer.state if _wrapper_key(opt) is not None else getattr(opt, "state", {})


def _own_entries(opt):
    """A wrapper's own ``state_dict()`` entries (its per-parameter state
    keyed by (group, index), settings)."""
    key = _wrapper_key(opt)
    return {} if key is None else {k: v for k, v in opt.state_dict().items() if k != key}


def _tree_keys(tree):
    """Keys at every depth, tensors as (shape, dtype)."""
    if isinstance(tree, dict):
        return {k: _tree_keys(v) for k, v in tree.items()}
    if isinstance(tree, torch.Tensor):
        return (tuple(tree.shape), tree.dtype)
    return type(tree)


def _torch_view(model, opt):
    """torch's own ``opt.state_dict()``, integer IDs replaced by FQNs (a
    wrapper's: its inner optimizer's, its own entries beside it)."""
    sd = dict(opt.state_dict())
    key = _wrapper_key(opt)
    if key is not None:
        sd = {**sd[key], **{k: v for k, v in sd.items() if k != key}}
    fqn = {id(p): n for n, p in model.named_parameters()}
    ids = [fqn[id(p)] for g in opt.param_groups for p in g["params"]]
    state = {ids[k]: v for k, v in sd["state"].items() if isinstance(k, int)}
    # optimizer-wide entries (str keys: MADGRAD's "k"): under ".optimizer_0"
    # (D29 in docs/differences.md)
    wide = {k: v for k, v in sd["state"].items() if not isinstance(k, int)}
    if wide:
        state[".optimizer_0"] = wide
    groups = []
    for g in sd["param_groups"]:
        g = dict(g)
        g["params"] = [ids[i] for i in g["params"]]
        groups.append(g)
    return {"state": state, "param_groups": groups, **{k: v for k, v in sd.items() if k not in ("state", "param_groups")}}


OPTS = {
    "nested": dcp_optim.StateDictOptions(),
    "flat": dcp_optim.StateDictOptions(flatten_optimizer_state_dict=True),
}


# slow (about a minute for its 227 entries): make test runs it, the ASan
# run and make test-fast do not -- the C entry points it drives (the
# optimizer getters and setters) run under ASan in the other unit tests
@pytest.mark.slow
@pytest.mark.parametrize("name", list(CATALOGUE))
def test_corpus(name, tmp_path):
    skip, factory = CATALOGUE[name]
    if skip:
        _SKIPPED[name] = skip
        print(f"skip {name}: {skip}")
        pytest.skip(skip)
    warnings.simplefilter("ignore")

    # 1. never-stepped template: every key a first step creates; no effect.
    model, opt = _build(factory)
    real_model, real_opt = _build(factory)
    _step(real_model, real_opt, 0)
    real_entries = _stepped_entries(real_model, real_opt)
    real_keys = {n: sorted(_flat_entry(e)) for n, e in real_entries.items()}
    before = _snapshot(model, opt)
    calls, handles = _fire_counter()
    template = None
    failure = None
    try:
        template = dcp_optim.get_optimizer_state_dict(model, opt)
    except Exception as exc:  # noqa: BLE001 - checked below
        failure = exc
    finally:
        for h in handles:
            h.remove()
    assert calls == [], f"process-wide step hooks fired: {calls}"
    _same(_snapshot(model, opt), before)
    if isinstance(failure, dcp_optim.errors.HeldOptimizerStateError):
        _check_refused(name, factory, failure)
        return
    if failure is not None:
        # a state_dict() layout or state keys that cannot be keyed by FQN
        # (wrappers, optimizer-wide state entries), a step that needs a
        # graph (Hessian optimizers): upstream fails too
        theirs = _upstream_get(model, opt, "nested", factory, 0)
        assert isinstance(theirs, BaseException), (failure, theirs)
        # (no param_groups/state, as SafeFP16Optimizer: dcp_optim's
        # NotAnOptimizerError is an AttributeError like upstream's)
        if isinstance(failure, dcp_optim.errors.IncompleteTemplateError):
            # no zero-gradient step gives the template (D-Adaptation's SGD
            # divides by the gradients' norm): upstream's own step raises
            # that, dcp_optim names the class and the way out
            assert type(theirs).__name__ in str(failure), (failure, theirs)
            _BOTH_RAISE[name] = f"dcp_optim IncompleteTemplateError / upstream {type(theirs).__name__}: {theirs}"
            return
        assert isinstance(failure, type(theirs)), (failure, theirs)
        if isinstance(failure, (KeyError, dcp_optim.errors.StateDictTypeError)):
            _BOTH_RAISE[name] = (f"dcp_optim {type(failure).__name__}: {failure} / "
                                 f"upstream {type(theirs).__name__}: {theirs}")[:240]
            return
        _UPSTREAM_FAILS[f"{name} (template)"] = f"both raise {type(failure).__name__}: {failure}"[:160]
    if template is not None:
        _check_template(name, factory, model, opt, real_entries, real_opt, real_keys, template)
        _check_template_given_back(factory, template)
    checked = _check_resumes(name, factory, tmp_path)
    if template is None and not checked:
        _BOTH_RAISE[name] = "both raise on every get (see the upstream lines)"
    else:
        _RAN.add(name)


def _keep_first_step_dtypes(factory, src_model, src_opt, model, opt):
    """The oracle of a precision-changing resume (D35): ``opt`` (bf16
    parameters) holds what torch's ``load_state_dict`` gave it from
    ``src_opt``'s state; each floating tensor a real first step of the
    same optimizer on bf16 parameters makes in another dtype than the
    parameter's is replaced by the source's value in that dtype.  Not for
    an optimizer with its own ``load_state_dict`` (or its hooks), whose
    rule is its own, nor where that first step raises.  Returns the
    (state name, torch's dtype, the first step's dtype) it replaced."""
    changed: set[tuple[Any, torch.dtype, torch.dtype]] = set()
    if type(opt).load_state_dict is not torch.optim.Optimizer.load_state_dict or getattr(
            opt, "_optimizer_load_state_dict_pre_hooks", None) or getattr(
            opt, "_optimizer_load_state_dict_post_hooks", None):
        return changed
    first_model, first_opt = _build(factory, dtype=torch.bfloat16, seed=1)
    try:
        _step(first_model, first_opt, 0, torch.bfloat16)
    except Exception:  # noqa: BLE001 - no first step: torch's rule
        return changed
    first = {n: first_opt.state.get(p) or {} for n, p in first_model.named_parameters()}
    source = {n: src_opt.state.get(p) or {} for n, p in src_model.named_parameters()}
    for n, p in model.named_parameters():
        held = opt.state.get(p)
        for k, v in list(held.items()) if held else ():
            want = first[n].get(k)
            saved = source[n].get(k)
            if (k != "step" and isinstance(v, torch.Tensor) and isinstance(want, torch.Tensor)
                    and isinstance(saved, torch.Tensor) and want.dtype.is_floating_point
                    and want.dtype != p.dtype and want.dtype != v.dtype):
                held[k] = saved.detach().to(device=v.device, dtype=want.dtype)
                changed.add((k, v.dtype, want.dtype))
    return changed


def _check_refused(name, factory, failure):
    """A base optimizer whose state is kept apart (FriendlySAM, LookSAM,
    WSAM, GSAM): the getter refuses it, naming the class and attribute,
    before and after a step; upstream's getter returns a dict without that
    state (a resume through it silently restarts the base optimizer)."""
    model, opt = _build(factory)
    _step(model, opt, 0)
    assert failure.owner == type(opt).__qualname__ and failure.owner in str(failure)
    assert f".{failure.attribute}" in str(failure)
    with pytest.raises(dcp_optim.errors.HeldOptimizerStateError):
        dcp_optim.get_optimizer_state_dict(model, opt)
    inner = getattr(opt, failure.attribute)
    inner_keys = {k for st in inner.state.values() for k in st}
    assert inner_keys, "the base optimizer holds state after a step"
    theirs = _upstream_get(model, opt, "nested", factory, 1)
    kept = {k for st in theirs["state"].values() for k in st}
    assert not inner_keys <= kept, (inner_keys, kept)
    _UPSTREAM_FAILS[name] = f"upstream drops {type(inner).__name__}'s state {sorted(inner_keys - kept)}"
    _REFUSED[name] = str(failure)[:160]


def _wide_entries(opt):
    """The str-keyed (optimizer-wide) entries of an optimizer's state."""
    return {k: v for k, v in getattr(opt, "state", {}).items() if isinstance(k, str)}


def _declared_stateless(opt):
    schema = dcp_optim.schema.schema_for(opt)
    return schema is not None and not any(schema(opt, g) for g in opt.param_groups)


def _stepped_entries(model, opt):
    """Per FQN, a stepped optimizer's entry as a checkpoint holds it: in
    the optimizer's own ``state_dict()`` layout where its class overrides
    that method and keeps torch's layout around it (bitsandbytes nests its
    quantization state under one key), else its live state."""
    state = _param_state(opt)  # SafeFP16Optimizer has none
    live = {n: state[p] for n, p in model.named_parameters() if p in state}
    if (type(opt).state_dict is torch.optim.Optimizer.state_dict or not hasattr(opt, "param_groups")
            or _wrapper_key(opt) is not None):
        return live
    own = opt.state_dict()
    if not isinstance(own, dict) or not isinstance(own.get("state"), dict):
        return live
    params = [p for g in opt.param_groups for p in g["params"]]
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for i, entry in own["state"].items():
        if isinstance(i, int) and i < len(params) and id(params[i]) in names and isinstance(entry, dict):
            out[names[id(params[i])]] = entry
    return out


def _stepped_groups(opt):
    """A stepped optimizer's param groups as a checkpoint holds them: its
    own ``state_dict()``'s where its class overrides that method
    (heavyball's leaves out the group keys starting with "_"), else the
    live ones."""
    if type(opt).state_dict is torch.optim.Optimizer.state_dict or _wrapper_key(opt) is not None:
        return opt.param_groups
    own = opt.state_dict()
    groups = own.get("param_groups") if isinstance(own, dict) else None
    return groups if isinstance(groups, list) and len(groups) == len(opt.param_groups) else opt.param_groups


def _flat_entry(entry):
    """An entry's state by name, a nested dict's items as "outer.inner"."""
    out = {}
    for key, value in entry.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def _check_template_given_back(factory, template):
    """D48: the never-stepped template, loaded into a fresh pair, either
    raises (an optimizer whose constructor creates state: strict loads
    refuse a template without its first step's keys) or leaves it as the
    fresh optimizer -- two steps of each, the same parameters."""
    fresh_model, fresh = _build(factory)
    model, opt = _build(factory)
    try:
        dcp_optim.set_optimizer_state_dict(model, opt, copy.deepcopy(template))
    except dcp_optim.errors.MissingOptimizerStateError:
        return
    for i in range(2):
        _step(fresh_model, fresh, i)
        _step(model, opt, i)
    for (n, a), b in zip(fresh_model.named_parameters(), model.parameters()):
        assert torch.equal(a, b) or (torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())), \
            f"{n}: the template given back resumed unlike the fresh optimizer"


def _check_template(name, factory, model, opt, real_entries, real_opt, real_keys, template):
    if _declared_stateless(opt):
        # declared stateless until its first step (LBFGS: one optimizer-wide
        # entry under the first parameter, created by that step)
        _UPSTREAM_FAILS[f"{name} (template)"] = "schema: no pristine state (upstream's dummy step fails)"
        return
    state = _param_state(opt)
    held = {n: sorted(state[p]) for n, p in model.named_parameters() if p in state and state[p]}
    own = _own_entries(real_opt)
    if own:
        # a wrapper's own entries: those of a first step, by key and shape
        # (Lookahead's slow weights, schedule-free's z)
        assert _tree_keys({k: template[k] for k in own}) == _tree_keys(own)
        ptrs = _storages({k: template[k] for k in own}, _storages(template["state"], []))
        assert len(ptrs) == len(set(ptrs)), "template tensors share storage"
    for fqn, keys in real_keys.items():
        got = sorted(_flat_entry(template["state"].get(fqn, {})))
        if fqn in held:
            # the constructor created state (SARA's masks): the optimizer
            # is not recognisably never-stepped; the template is its held
            # state, as upstream's (which skips its dummy step then)
            theirs = _upstream_get(model, opt, "nested", factory, 0)
            if isinstance(theirs, KeyError) and _wide_entries(opt):
                # upstream raises on optimizer-wide state (SPAM's counters,
                # D29): the held state is returned as it is
                _UPSTREAM_FAILS[f"{name} (template)"] = f"KeyError: {theirs} (optimizer-wide state)"
                assert got == sorted(state[model.get_parameter(fqn)])
                continue
            assert sorted(theirs["state"][fqn]) == got
            continue
        assert set(keys) <= set(got), f"{fqn}: template {got}, a first step creates {keys}"
        for key in keys:
            want = _flat_entry(real_entries[fqn])[key]
            have = _flat_entry(template["state"][fqn])[key]
            if isinstance(want, torch.Tensor):
                assert isinstance(have, torch.Tensor) and have.shape == want.shape and have.dtype == want.dtype, (
                    f"{fqn}.{key}: template {tuple(have.shape)} {have.dtype}, step {tuple(want.shape)} {want.dtype}")
    live_keys = [set(g) for g in opt.param_groups]
    for g, (real_g, tmpl_g) in enumerate(zip(_stepped_groups(real_opt), template["param_groups"])):
        created = set(real_g) - live_keys[g]
        if held and len(held) == len(real_keys):
            # every parameter holds constructor state: as upstream's
            created = set(_upstream_get(model, opt, "nested", factory, 0)["param_groups"][g]) & created
        assert created <= set(tmpl_g), f"group {g}: the first step creates {sorted(created - set(tmpl_g))}"
    ptrs = _storages(template["state"], [])
    assert len(ptrs) == len(set(ptrs)), "template tensors share storage"


def _check_resumes(name, factory, tmp_path) -> bool:
    """Steps 2-5; False when every get raised (in upstream too)."""
    # 2. after two steps: both formats equal upstream's (or torch's round trip).
    ref_model, ref_opt = _build(factory)
    for i in range(3):
        _step(ref_model, ref_opt, i)
    expected_params = {n: p.detach().clone() for n, p in ref_model.named_parameters()}

    src_model, src_opt = _build(factory)
    for i in range(2):
        _step(src_model, src_opt, i)
    got_any = False
    for fmt, options in OPTS.items():
        try:
            ours = dcp_optim.get_optimizer_state_dict(src_model, src_opt, options=options)
            got_any = True
        except Exception as exc:  # noqa: BLE001 - compared with upstream
            # only where upstream fails the same way (e.g. the flat format
            # of non-tensor state: upstream's NotImplementedError)
            theirs = _upstream_get(src_model, src_opt, fmt, factory, 2)
            assert isinstance(theirs, BaseException) and isinstance(exc, type(theirs)), (
                f"{fmt}: dcp_optim raises {exc!r}, upstream returns")
            _UPSTREAM_FAILS[f"{name} ({fmt})"] = f"both raise {type(exc).__name__}: {exc}"[:160]
            continue
        theirs = _upstream_get(src_model, src_opt, fmt, factory, 2)
        if isinstance(theirs, BaseException):
            _UPSTREAM_FAILS[f"{name} ({fmt})"] = f"{type(theirs).__name__}: {theirs}"[:160]
        elif fmt == "nested" and not _upstream_kept(src_opt):
            # upstream's initialising dummy step advanced the optimizer
            # (stateless parameters): compare with torch's state_dict
            _UPSTREAM_FAILS[f"{name} ({fmt})"] = "upstream's dummy step advanced the optimizer"
            assert_same_tree(ours, _torch_view(src_model, src_opt))
        elif _upstream_kept(src_opt):
            extra = [k for k in ours if k not in theirs]
            if extra:
                # top-level keys of the optimizer's own state_dict(): kept
                # (upstream drops them), equal to torch's
                _UPSTREAM_FAILS[f"{name} ({fmt})"] = f"upstream drops state_dict() keys {extra}"
                own = src_opt.state_dict()
                for k in extra:
                    _same(ours[k], own[k])
                ours_cmp = {k: v for k, v in ours.items() if k not in extra}
                _same(ours_cmp, theirs)
            else:
                _same(ours, theirs)
        if fmt == "nested":
            # (D48: the names of parameters without state are marked)
            assert_same_tree(_names_unmarked(ours), _torch_view(src_model, src_opt))

        # 3. get, set into a fresh copy, one step: the uninterrupted run.
        dst_model, dst_opt = _build(factory, seed=1)
        dst_model.load_state_dict(src_model.state_dict())
        # a copy: like torch's load_state_dict, a load may alias the
        # given tensors, and the resumed step would advance src_opt
        try:
            dcp_optim.set_optimizer_state_dict(dst_model, dst_opt, copy.deepcopy(ours), options=options)
            _step(dst_model, dst_opt, 2)
        except Exception as exc:
            # only where upstream's own round trip fails the same way (the
            # flat format turns non-str state keys into str: AggMo)
            failure = _upstream_round_trip(factory, fmt, theirs)
            assert failure is not None and type(failure) is type(exc), (exc, failure)
            _UPSTREAM_FAILS[f"{name} ({fmt})"] = f"round trip: both raise {type(exc).__name__}: {exc}"[:160]
            continue
        for n, p in dst_model.named_parameters():
            assert torch.equal(p.detach(), expected_params[n]), f"{fmt}: {n} differs after the resumed step"

        # 4. the same through dcp.save / dcp.load into a never-stepped template.
        if _declared_stateless(src_opt):
            # LBFGS: its first step creates history lists of varying length,
            # no fixed template can hold them (upstream's getter fails)
            _UPSTREAM_FAILS[f"{name} ({fmt} via dcp)"] = "no template: state made by the first step"
            continue
        path = tmp_path / fmt
        dcp.save({"optim": ours}, checkpoint_id=str(path))
        dst_model, dst_opt = _build(factory, seed=1)
        dst_model.load_state_dict(src_model.state_dict())
        state = {"optim": dcp_optim.get_optimizer_state_dict(dst_model, dst_opt, options=options)}
        dcp.load(state, checkpoint_id=str(path))
        try:
            dcp_optim.set_optimizer_state_dict(dst_model, dst_opt, state["optim"], options=options)
        except dcp_optim.errors.MissingOptimizerStateError as exc:
            # an incomplete template (SPAM: its constructor's masks stand
            # for the state a first step adds): the strict set refuses
            # before training continues, and the checkpoint's entries the
            # template left behind are reported (issue 23)
            assert dcp_optim.unrequested_entries(state, str(path)), exc
            _UPSTREAM_FAILS[f"{name} ({fmt} via dcp)"] = f"strict set raises: {exc}"[:160]
            continue
        _step(dst_model, dst_opt, 2)
        for n, p in dst_model.named_parameters():
            assert torch.equal(p.detach(), expected_params[n]), f"{fmt} via dcp: {n} differs"

    if not got_any:
        return False

    # 5. bf16 resume of the fp32 checkpoint into a never-stepped optimizer:
    # steps, with torch's dtypes -- but where the optimizer's own first
    # step on the bf16 parameters gives a floating tensor another dtype
    # than the parameter's (fp32 second moments: NovoGrad and others), it
    # keeps that dtype, loaded from the checkpoint's value (D35).
    sd = copy.deepcopy(dcp_optim.get_optimizer_state_dict(src_model, src_opt))
    ours_model, ours_opt = _build(factory, dtype=torch.bfloat16, seed=1)
    dcp_optim.set_optimizer_state_dict(ours_model, ours_opt, sd)
    torch_model, torch_opt = _build(factory, dtype=torch.bfloat16, seed=1)
    torch_opt.load_state_dict(copy.deepcopy(src_opt.state_dict()))
    dtypes = lambda o, m: {  # noqa: E731
        n: {k: v.dtype for st in (getattr(o, "state", {}), _param_state(o)) if p in st
            for k, v in st[p].items() if isinstance(v, torch.Tensor)}
        for n, p in m.named_parameters()
    }
    kept = _keep_first_step_dtypes(factory, src_model, src_opt, torch_model, torch_opt)
    if kept:
        _UPSTREAM_FAILS[f"{name} (bf16 dtypes)"] = "torch's load casts " + ", ".join(
            f"{k} to {a} where a first step makes it {b}" for k, a, b in sorted(kept, key=str)) + " (D35)"
    assert dtypes(ours_opt, ours_model) == dtypes(torch_opt, torch_model)
    try:
        _step(torch_model, torch_opt, 2, torch.bfloat16)
    except Exception as exc:  # noqa: BLE001 - torch's own bf16 resume fails too
        with pytest.raises(type(exc)):
            _step(ours_model, ours_opt, 2, torch.bfloat16)
        _UPSTREAM_FAILS[f"{name} (bf16)"] = f"torch's own bf16 step raises {type(exc).__name__}: {exc}"[:160]
    else:
        _step(ours_model, ours_opt, 2, torch.bfloat16)
        for n, p in ours_model.named_parameters():
            assert torch.equal(p, torch_model.get_parameter(n)), f"bf16: {n} differs from torch's resume"
    return True
