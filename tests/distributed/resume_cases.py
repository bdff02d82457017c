"""The DCP resume matrix (issue 23's acceptance; tests/distributed/test_resume_matrix.py).

For every optimizer of the corpora (tests/unit/test_optim_corpus.py's
catalogue: pytorch-optimizer, lion-pytorch, schedulefree, prodigyopt,
torch.optim and the wrappers), torchao's low-bit AdamWs, LBFGS and
accelerate's ``AcceleratedOptimizer``, in both formats, the whole flow
users run:

1. the uninterrupted run: ``STEPS + RESUMED`` steps (once per case: it
   does not depend on the format);
2. the interrupted run: ``STEPS`` steps (0: a checkpoint taken before
   the first step), ``get_optimizer_state_dict``,
   ``dcp.save``;
3. a fresh model (the trained weights loaded) and a never-stepped
   optimizer: ``get_optimizer_state_dict`` (the template), ``dcp.load``,
   ``set_optimizer_state_dict``, ``RESUMED`` steps;
4. the verdict: ``resumed`` (every parameter bit-identical to the
   uninterrupted run's), ``raised`` (an exception in 2 or 3, before any
   resumed step: the reason is kept), ``diverged`` (the failure this
   matrix exists to catch), or ``not run`` (the optimizer cannot take the
   uninterrupted run's steps here: the reason is kept).

``run_matrix(rank, world, names, root)`` runs every case in one process
(world 1) or on every rank of one launch (world 2, FSDP2 over a 1-D mesh);
ranks agree on each verdict (an exception on one rank is everyone's).
"""

from __future__ import annotations

import datetime
import os
import random
import shutil
import traceback
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

import dcp_optim

from ..support.models import sharpness_aware_step

# dcp.save/dcp.load raise CheckpointException, a BaseException
_ERRORS = (Exception, dcp.api.CheckpointException)

CASE_TIMEOUT = datetime.timedelta(seconds=15)
# before the checkpoint (DCP_OPTIM_MATRIX_STEPS=0: a checkpoint taken before the first step)
STEPS = int(os.environ.get("DCP_OPTIM_MATRIX_STEPS", "2"))
RESUMED = 2  # after it: LBFGS's history shows only in the second

FORMATS = {
    "nested": dcp_optim.StateDictOptions(),
    "flat": dcp_optim.StateDictOptions(flatten_optimizer_state_dict=True),
}


class Net(nn.Module):
    def __init__(self, width: int = 4, hidden: int = 4):  # even shards at world 2
        super().__init__()
        self.width = width
        self.a = nn.Linear(width, hidden)
        self.b = nn.Linear(hidden, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).pow(2).sum()


def _x(step: int, width: int) -> torch.Tensor:
    return torch.randn(8, width, generator=torch.Generator().manual_seed(step))


# --- the catalogue -----------------------------------------------------------


def _corpus() -> dict[str, Any]:
    from tests.unit import test_optim_corpus as corpus

    out = {}
    for name, (skip, factory) in corpus.CATALOGUE.items():
        short = corpus.name_of.get(factory) if factory is not None else None
        mode = ("closure" if short in corpus.CLOSURE else "loss" if short in corpus.LOSS
                else "hessian" if short in corpus.HESSIAN
                else "sam" if short in corpus.SAM or factory in corpus._SAM_FACTORIES
                else "gsam" if factory is corpus._gsam else None)
        out[name] = {"skip": skip, "factory": factory, "mode": mode}
    return out


def _torchao(cls_name: str):
    def make(model):
        from torchao import optim as ao

        return getattr(ao, cls_name)(model.parameters(), lr=1e-2)

    return make


def _accelerated(model):
    from accelerate import Accelerator

    # one Accelerator per process (its state is a singleton); CPU, no
    # mixed precision: prepare_optimizer only wraps
    accelerator = _ACCELERATOR.get("a")
    if accelerator is None:
        accelerator = _ACCELERATOR["a"] = Accelerator(cpu=True)
    return accelerator.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), device_placement=False)


_ACCELERATOR: dict[str, Any] = {}


def catalogue() -> dict[str, dict[str, Any]]:
    out = _corpus()
    # torchao quantizes state only for tensors of >= 4096 elements: a
    # wider model, so that both quantized and plain state are resumed.
    # Their steps run eagerly ("eager" in _step): compiled, torchao 0.15's
    # 8bit/4bit could not step under FSDP2 here, and Fp8 failed to step
    # after other cases in one launch ('OptimStateFp8' object has no
    # attribute 'qmap'); eagerly all three step and resume at both worlds.
    for cls_name in ("AdamWFp8", "AdamW8bit", "AdamW4bit"):
        out[f"torchao.{cls_name}"] = {"skip": None, "factory": _torchao(cls_name), "mode": "eager",
                                      "width": 64, "hidden": 128}
    out["torch.LBFGS"] = {"skip": None, "mode": "closure",
                          "factory": lambda m: torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=3)}
    out["accelerate.AcceleratedOptimizer(AdamW)"] = {"skip": None, "factory": _accelerated, "mode": None}
    return out


# --- one case ------------------------------------------------------------------


def _seed(seed: int) -> None:
    """``torch.manual_seed`` for the CPU, the only device here: the public
    call also queues a seed for every lazily initialised accelerator
    module, formatting a stack trace for each (1.6 ms a call, a sixth of a
    world-1 case)."""
    torch.default_generator.manual_seed(seed)


# the layout of the world-2 cases: "fsdp2" (fully_shard), "fsdp1" and
# "fsdp1-flat" (FullyShardedDataParallel with use_orig_params True/False,
# each Linear its own unit); set by run_matrix
_LAYOUT = {"name": "fsdp2"}

# cases whose uninterrupted run cannot take place under FSDP1 here
FSDP1_NOT_RUN = {
    "po.WSAM(AdamW)": "its step all-reduces over the default group in the middle of FSDP1's training "
                      "(its own collective): gloo aborts the process before any checkpoint",
}


def _build(case: dict[str, Any], world: int, seed: int = 0, mesh: Any = None):
    _seed(seed)
    model = Net(case.get("width", 4), case.get("hidden", 4))
    if world > 1 and _LAYOUT["name"] == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.a, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif world > 1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FSDP(model, device_id=torch.device("cpu"), use_orig_params=_LAYOUT["name"] == "fsdp1",
                     process_group=mesh.get_group(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    opt = case["factory"](model)
    if hasattr(opt, "train") and callable(opt.train):
        opt.train()  # schedule-free optimizers step in train mode
    return model, opt


def _step(model, opt, i: int, mode: str | None) -> None:
    random.seed(i)
    np.random.seed(i)
    _seed(1000 + i)
    x = _x(i, model.width)
    if mode == "closure":
        def closure():
            opt.zero_grad()
            loss = model(x)
            loss.backward()
            return loss

        opt.step(closure)
    elif mode in ("sam", "gsam"):
        sharpness_aware_step(model, opt, x, gsam=mode == "gsam")
    elif mode == "eager":
        # torchao compiles its step (inductor: about 7 s per parameter
        # shape on this CPU, three quarters of the world-1 matrix).  The
        # checkpoint carries the state, which eager and compiled steps
        # build alike (the same tensor subclasses), and every run of a
        # case steps the same way, so the bit-identity verdict stands.
        model(x).backward()
        with torch.compiler.set_stance("force_eager"):
            opt.step()
    elif mode == "loss":
        loss = model(x)
        loss.backward()
        opt.step(lambda: float(loss))
    else:
        model(x).backward(create_graph=mode == "hessian")
        opt.step()
    opt.zero_grad()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _params(model) -> dict[str, torch.Tensor]:
    return {n: _local(p.detach()).clone() for n, p in model.named_parameters()}


def _reason(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, dcp.api.CheckpointException):
        # the failing rank's traceback: its last line names the error
        last = [line.strip() for line in str(exc).splitlines() if line.strip()]
        text = f"{type(exc).__name__}: {last[-1] if last else exc}"
    return text.replace("\n", " ")[:220]


def _trace(text: str) -> None:
    """A debugging aid: with DCP_OPTIM_MATRIX_TRACE=<path>, each rank logs
    the cases it runs, every agreed failure and templates' tracebacks to
    <path>.<rank>."""
    if os.environ.get("DCP_OPTIM_MATRIX_TRACE"):
        rank = dist.get_rank() if dist.is_initialized() else 0
        with open(os.environ["DCP_OPTIM_MATRIX_TRACE"] + f".{rank}", "a") as trace:
            print(text, flush=True, file=trace)


def _agree(world: int, failure: str | None) -> str | None:
    """Every rank's failure of one phase (the first one), on every rank."""
    if os.environ.get("DCP_OPTIM_MATRIX_TRACE"):
        with open(os.environ["DCP_OPTIM_MATRIX_TRACE"] + f".{dist.get_rank() if world > 1 else 0}", "a") as trace:
            print("  agree", failure, flush=True, file=trace)
    if world == 1:
        return failure
    # one small all_reduce; the messages are gathered only when a rank failed
    flag = torch.tensor([0 if failure is None else 1])
    dist.all_reduce(flag)
    if not int(flag):
        return None
    got: list[Any] = [None] * world
    dist.all_gather_object(got, failure)
    fails = [f"rank {r}: {f}" for r, f in enumerate(got) if f is not None]
    return fails[0] if fails else None


def _train(model, opt, steps: range, mode: str | None, world: int) -> str | None:
    """``steps`` training steps; ranks agree after each (an optimizer step
    that raises on one rank only must not leave the other in the next
    step's collectives): the first failure, on every rank."""
    for i in steps:
        failure = None
        try:
            _step(model, opt, i, mode)
        except _ERRORS as exc:  # noqa: BLE001 - agreed on
            failure = _reason(exc)
        failure = _agree(world, failure)
        if failure is not None:
            return failure
    return None


def _case_mesh(world: int) -> Any:
    """The mesh the cases run on (None at world 1)."""
    mesh = None
    if world > 1:
        # the cases' collectives on a group of their own, with a short
        # timeout: an optimizer step that raises on one rank between the
        # step's own collectives (DTensor ops) breaks that group only, the
        # verdicts are still agreed on over the default group, and the
        # next case gets a new group (a broken one is left alone: DTensor
        # caches keep the names of destroyed groups)
        from torch.distributed.device_mesh import DeviceMesh

        if "mesh" not in _GROUP:
            # a name of its own: DTensor's caches compare meshes by
            # ranks and names, and would hand back the broken group
            _GROUP["n"] = _GROUP.get("n", 0) + 1
            _GROUP["mesh"] = DeviceMesh.from_group(
                dist.new_group(backend="gloo", timeout=CASE_TIMEOUT), "cpu", mesh_dim_names=(f"case{_GROUP['n']}",))
        mesh = _GROUP["mesh"]
    return mesh


_GROUP: dict[str, Any] = {}  # "mesh": the cases' mesh, "n": meshes made


def run_case(name: str, case: dict[str, Any], world: int, root: str, steps: int = STEPS) -> list[tuple[str, str]]:
    """[(verdict, reason)] of one case, one per format (FORMATS' order);
    ``steps`` before the checkpoint (0: saved before the first step).

    The uninterrupted run does not depend on the format: it runs once, and
    both formats' resumes are compared with it."""
    expected, failure = _uninterrupted(case, world, _case_mesh(world), steps)
    if failure is not None:
        _GROUP.pop("mesh", None)
        return [("not run", f"the uninterrupted run fails: {failure}")] * len(FORMATS)
    verdicts = []
    for fmt in FORMATS:
        if os.environ.get("DCP_OPTIM_MATRIX_TRACE"):
            with open(os.environ["DCP_OPTIM_MATRIX_TRACE"] + f".{dist.get_rank() if world > 1 else 0}", "a") as trace:
                print(name, fmt, flush=True, file=trace)
        verdict, reason = _resume(name, case, fmt, world, root, _case_mesh(world), expected, steps)
        if verdict != "resumed":
            _GROUP.pop("mesh", None)
        verdicts.append((verdict, reason))
    return verdicts


def _uninterrupted(case, world, mesh, steps) -> tuple[dict[str, torch.Tensor], str | None]:
    """1. the uninterrupted run: its parameters, or why it fails."""
    failure = None
    try:
        ref_model, ref_opt = _build(case, world, mesh=mesh)
    except _ERRORS as exc:  # noqa: BLE001 - a verdict
        failure = _reason(exc)
    failure = _agree(world, failure) or _train(ref_model, ref_opt, range(steps + RESUMED), case["mode"], world)
    if failure is not None:
        return {}, failure
    return _params(ref_model), None


def _resume(name, case, fmt, world, root, mesh, expected, steps) -> tuple[str, str]:
    """2. + 3. + 4. interrupt, save, resume into a never-stepped optimizer,
    train on; the verdict against the uninterrupted run's ``expected``."""
    options = FORMATS[fmt]
    mode = case["mode"]
    path = os.path.join(root, f"{name}-{fmt}".replace("/", "_"))
    model, opt = _build(case, world, mesh=mesh)
    failure = _train(model, opt, range(steps), mode, world)
    if failure is not None:
        return "not run", f"the interrupted run fails: {failure}"
    try:
        saved = dcp_optim.get_optimizer_state_dict(model, opt, options=options)
    except _ERRORS as exc:  # noqa: BLE001 - a verdict
        failure = "get (save side): " + _reason(exc)
    failure = _agree(world, failure)
    if failure is None:
        try:
            dcp.save({"model": dcp_optim.get_model_state_dict(model), "optim": saved}, checkpoint_id=path)
        except _ERRORS as exc:  # noqa: BLE001 - a verdict
            failure = "dcp.save: " + _reason(exc)
        failure = _agree(world, failure)
    if failure is None:
        try:
            model2, opt2 = _build(case, world, seed=1, mesh=mesh)
            state = {
                "model": dcp_optim.get_model_state_dict(model2),
                "optim": dcp_optim.get_optimizer_state_dict(model2, opt2, options=options),
            }
        except _ERRORS as exc:  # noqa: BLE001 - a verdict
            failure = "template: " + _reason(exc)
            _trace(traceback.format_exc())
        failure = _agree(world, failure)
    if failure is None:
        try:
            dcp.load(state, checkpoint_id=path)
        except _ERRORS as exc:  # noqa: BLE001 - a verdict
            failure = "dcp.load: " + _reason(exc)
        failure = _agree(world, failure)
    if failure is None:
        try:
            dcp_optim.set_model_state_dict(model2, state["model"])
            dcp_optim.set_optimizer_state_dict(model2, opt2, state["optim"], options=options)
        except _ERRORS as exc:  # noqa: BLE001 - a verdict
            failure = "set: " + _reason(exc)
        failure = _agree(world, failure)
    if failure is not None:
        return "raised", failure
    # 4. train on: resumed, or not?
    failure = _train(model2, opt2, range(steps, steps + RESUMED), mode, world)
    if failure is not None:
        # raised while training on, after the load said it succeeded
        failure = "the resumed step raised: " + failure
    else:
        got = _params(model2)
        differ = [n for n in expected if not torch.equal(got[n], expected[n])]
        if differ:
            failure = f"parameters differ from the uninterrupted run: {differ}"
    failure = _agree(world, failure)
    return ("diverged", failure) if failure is not None else ("resumed", "")


def run_matrix(rank: int, world: int, names: list[str], root: str,
               layout: str = "fsdp2", steps: int = STEPS) -> list[tuple[str, str, str, str]]:
    """[(name, format, verdict, reason)] for every case; on every rank.
    ``layout``: the world-2 model's (see _LAYOUT); ``steps``: before the
    checkpoint."""
    warnings.simplefilter("ignore")
    _LAYOUT["name"] = layout
    cases = catalogue()
    out = []
    for name in names:
        case = cases[name]
        skip = case["skip"] or (FSDP1_NOT_RUN.get(name) if world > 1 and layout != "fsdp2" else None)
        if skip:
            for fmt in FORMATS:
                out.append((name, fmt, "not run", skip))
            continue
        try:
            verdicts = run_case(name, case, world, root, steps)
        except Exception as exc:  # noqa: BLE001 - the harness itself broke: a failure
            verdicts = [("diverged", "matrix error: " + _reason(exc) + " " + traceback.format_exc()[-400:])] * len(FORMATS)
        out.extend((name, fmt, verdict, reason) for fmt, (verdict, reason) in zip(FORMATS, verdicts))
        if rank == 0:
            shutil.rmtree(os.path.join(root), ignore_errors=True)
            os.makedirs(root, exist_ok=True)
        if world > 1:
            dist.barrier()
    return out


def run_layouts(rank: int, world: int, names: list[str], root: str, layouts: list[str],
                steps: int = STEPS) -> dict[str, list[tuple[str, str, str, str]]]:
    """``run_matrix`` for each of ``layouts`` in one launch: {layout: rows}."""
    return {layout: run_matrix(rank, world, names, root, layout, steps) for layout in layouts}
