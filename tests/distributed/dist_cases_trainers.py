"""Rank functions for the real-trainer tests (tests/tools/test_trainers.py), run
by tests.support.harness.run_ranks: Lightning Fabric's ``ModelParallelStrategy``
and torchtune's ``training._distributed`` helpers, each run once through
``dcp_optim.patch()`` and once on upstream's functions in the same
processes, on 2 gloo ranks.  Each returns plain data.

Proof that dcp_optim's code did the work: spies count the calls that reach
``dcp_optim.state_dict``'s functions (the forwarders ``patch()`` installs
look them up per call) and the calls that reach upstream's internal
implementation (``_get_model_state_dict`` & co.), which must be none while
patched.
"""

from __future__ import annotations

import copy
import os
import sys
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as upstream
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import dcp_optim
import dcp_optim.state_dict as ours
from dcp_optim import patching

from .dist_cases import Block
from .dist_cases_adoption import WIDTH, Net, _spy

IMPLS = ("dcp_optim", "upstream")
FORMS = ("sharded", "full")

PUBLIC = ("get_model_state_dict", "get_optimizer_state_dict", "get_state_dict",
          "set_model_state_dict", "set_optimizer_state_dict", "set_state_dict",
          "_init_optim_state")
UPSTREAM_INTERNALS = ("_get_model_state_dict", "_load_model_state_dict",
                      "_get_optim_state_dict", "_load_optim_state_dict")


def _decay_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two param groups, as trainers make them: weights with weight decay
    0.1, the rest without."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    other = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(100 + step))


def plain(v: Any) -> Any:
    """Bit-exact plain data: tensors as (dtype, shape, raw bits); DTensors
    gathered (with their placements)."""
    if isinstance(v, DTensor):
        return ("DTensor", [str(p) for p in v.placements], plain(v.full_tensor()))
    if isinstance(v, torch.Tensor):
        t = v.detach().reshape(-1).cpu()
        bits = t.view(torch.int32) if t.element_size() == 4 and t.is_floating_point() else t
        return (str(v.dtype), list(v.shape), bits.tolist())
    if isinstance(v, dict):
        return [(str(k), plain(x)) for k, x in v.items()]  # keeps the order
    if isinstance(v, list | tuple):
        return [plain(x) for x in v]
    return v


def live_state(model: nn.Module, optim: torch.optim.Optimizer) -> Any:
    """The model's parameters and the optimizer's own state, gathered, keyed
    by FQN (independent of either state-dict implementation)."""
    names = {p: n for n, p in model.named_parameters()}
    params = [(n, plain(p)) for n, p in model.named_parameters()]
    state = sorted((names[p], plain(dict(sorted(s.items())))) for p, s in optim.state.items())
    groups = [plain({k: v for k, v in g.items() if k != "params"}) for g in optim.param_groups]
    return {"params": params, "state": state, "groups": groups}


@contextmanager
def impl_run(impl: str, record: dict[str, Any]):
    """Run the block on ``impl``'s functions: under ``dcp_optim.patch()``
    or on upstream's.  ``record["client_calls"]``: the calls that reached
    dcp_optim's functions (patched), or upstream's public functions looked
    up on its module (not patched); ``record["upstream_internal_calls"]``:
    the calls that reached upstream's implementation."""
    client: dict[str, int] = {}
    internal: dict[str, int] = {}
    with ExitStack() as stack:
        saved_int = _spy(upstream, UPSTREAM_INTERNALS, internal)
        stack.callback(lambda: [setattr(upstream, n, f) for n, f in saved_int.items()])
        if impl == "dcp_optim":
            saved = _spy(ours, PUBLIC, client)
            stack.callback(lambda: [setattr(ours, n, f) for n, f in saved.items()])
            handle = dcp_optim.patch()
            assert handle.applied
            stack.callback(dcp_optim.unpatch)
            assert patching.is_patched_function(upstream.get_model_state_dict)
        else:
            assert not patching.is_patched()
            saved = _spy(upstream, PUBLIC[:-1], client)  # its internals call _init_optim_state
            stack.callback(lambda: [setattr(upstream, n, f) for n, f in saved.items()])
        yield
    assert not patching.is_patched()
    record["client_calls"] = client
    record["upstream_internal_calls"] = internal


# --- Lightning Fabric: ModelParallelStrategy (FSDP2) ---------------------------------


def _fabric(ws: int, form: str):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    def parallelize(model, device_mesh):
        mesh = device_mesh["data_parallel"]
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    strategy = ModelParallelStrategy(
        parallelize, data_parallel_size=ws, tensor_parallel_size=1,
        save_distributed_checkpoint=(form == "sharded"),
    )
    fabric = Fabric(accelerator="cpu", devices=ws, strategy=strategy)
    fabric.launch()
    assert fabric.world_size == ws and fabric.global_rank == dist.get_rank()
    return fabric


def _fabric_setup(fabric, seed: int):
    torch.manual_seed(seed)
    model = fabric.setup_module(Net())
    optim = torch.optim.AdamW(_decay_groups(model), lr=0.01)
    return model, fabric.setup_optimizers(optim)


def _fabric_train(fabric, model, optim, steps: int, start: int) -> list[str]:
    losses = []
    for step in range(start, start + steps):
        loss = model(_batch(step))
        fabric.backward(loss)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item().hex())
    return losses


def _fabric_env(rank: int, ws: int) -> None:
    # the harness made the process group; Lightning's environment reads
    # these (LOCAL_RANK set: processes are created externally)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(ws), LOCAL_RANK=str(rank),
                      NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")


def fabric_save(rank: int, ws: int, root: str, steps: int) -> dict[str, Any]:
    """For each implementation and checkpoint form: train ``steps`` steps,
    ``fabric.save``, then train ``steps`` more (the uninterrupted run)."""
    import lightning

    _fabric_env(rank, ws)
    out: dict[str, Any] = {"lightning": lightning.__version__}
    for impl in IMPLS:
        for form in FORMS:
            path = os.path.join(root, impl, "sharded" if form == "sharded" else "full.ckpt")
            rec: dict[str, Any] = {}
            with impl_run(impl, rec):
                fabric = _fabric(ws, form)
                model, optim = _fabric_setup(fabric, seed=0)
                rec["first"] = _fabric_train(fabric, model, optim, steps, 0)
                fabric.save(path, {"model": model, "optimizer": optim, "step": steps})
                rec["saved"] = live_state(model, optim)
                rec["reference"] = _fabric_train(fabric, model, optim, steps, steps)
            rec["kind"] = "dir" if os.path.isdir(path) else "file"
            out[f"{impl}/{form}"] = rec
    dist.barrier()
    if rank == 0:
        # the full-state-dict files of the two implementations, loaded plainly
        full = {impl: torch.load(os.path.join(root, impl, "full.ckpt"), weights_only=True)
                for impl in IMPLS}
        out["full_files"] = {impl: plain(sd) for impl, sd in full.items()}
    return out


def fabric_resume(rank: int, ws: int, root: str, steps: int) -> dict[str, Any]:
    """Fresh processes: for each implementation that loads, each that saved
    and each form, ``fabric.load`` into a model with another init and a
    never-stepped optimizer, then train ``steps`` steps."""
    _fabric_env(rank, ws)
    out: dict[str, Any] = {}
    for impl in IMPLS:
        for saved_by in IMPLS:
            for form in FORMS:
                path = os.path.join(root, saved_by, "sharded" if form == "sharded" else "full.ckpt")
                rec: dict[str, Any] = {}
                with impl_run(impl, rec):
                    fabric = _fabric(ws, form)
                    model, optim = _fabric_setup(fabric, seed=7)
                    state = {"model": model, "optimizer": optim, "step": 0}
                    remainder = fabric.load(path, state)
                    rec["step"] = state["step"]
                    rec["remainder"] = sorted(remainder)
                    rec["loaded"] = live_state(model, optim)
                    rec["resumed"] = _fabric_train(fabric, model, optim, steps, steps)
                out[f"{impl}<-{saved_by}/{form}"] = rec
    return out


# --- torchtune: training._distributed helpers on FSDP2 -------------------------------


def _tt_model(seed: int):
    from torchtune.training import shard_model

    torch.manual_seed(seed)
    model = Net()
    shard_model(model, [lambda name, m: isinstance(m, Block)], cpu_offload=False)
    return model


def _tt_optim(model):
    return torch.optim.AdamW(_decay_groups(model), lr=0.01)


def _tt_train(model, optim, steps: int, start: int) -> list[str]:
    losses = []
    for step in range(start, start + steps):
        loss = model(_batch(step))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item().hex())
    return losses


def _broadcast(obj: Any) -> Any:
    """Rank 0's object on every rank, as a copy (also on rank 0)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return copy.deepcopy(box[0])


def _torchtune_flow(rank: int, steps: int, dsd_api: bool) -> dict[str, Any]:
    """torchtune's checkpoint flow: load a full model state dict into a
    sharded model, train, gather the full model and optimizer state on
    rank 0, load both (every rank gets rank 0's dicts, as from a file) into
    a fresh model and never-stepped optimizer, train on; plus
    ``_init_optim_state`` alone, and a load while gradients are still
    attached.  ``dsd_api``: torchtune's switch between its own
    ``distribute_tensor`` code (0.6.1 ships it off) and
    ``set_model_state_dict`` / ``set_optimizer_state_dict``."""
    import torchtune.training._distributed as ttd

    cpu = torch.device("cpu")
    is_zero = rank == 0
    ttd._DISTRIBUTED_STATE_DICT_API_IS_AVAILABLE = dsd_api
    out: dict[str, Any] = {}
    torch.manual_seed(3)
    initial = Net().state_dict()  # the "pretrained" full state dict
    model = _tt_model(seed=0)
    result = ttd.load_from_full_model_state_dict(model, dict(initial), cpu, strict=True)
    out["model_load_result"] = [sorted(result.missing_keys), sorted(result.unexpected_keys)]
    optim = _tt_optim(model)
    out["after_model_load"] = live_state(model, optim)
    out["first"] = _tt_train(model, optim, steps, 0)
    full_msd = ttd.gather_cpu_state_dict(model, is_zero, device=cpu)
    full_osd = ttd.get_full_optimizer_state_dict(model, optim, is_zero, device=cpu)
    out["full_model"] = plain(full_msd)
    out["full_optim"] = plain(full_osd)
    out["saved"] = live_state(model, optim)
    # as from a file: copies (the gathered optimizer dict shares the plain
    # "step" tensors with the optimizer) that every rank gets
    msd, osd = _broadcast(full_msd), _broadcast(full_osd)
    out["reference"] = _tt_train(model, optim, steps, steps)

    model2 = _tt_model(seed=7)
    ttd.load_from_full_model_state_dict(model2, dict(msd), cpu, strict=True)
    optim2 = _tt_optim(model2)
    # each load gets its own copy: loads keep the dict's plain "step" tensors
    ttd.load_from_full_optimizer_state_dict(model2, optim2, copy.deepcopy(osd), cpu)
    out["loaded"] = live_state(model2, optim2)
    out["resumed"] = _tt_train(model2, optim2, steps, steps)

    # the same load right after a backward (gradients still attached)
    model3 = _tt_model(seed=7)
    ttd.load_from_full_model_state_dict(model3, dict(msd), cpu, strict=True)
    optim3 = _tt_optim(model3)
    model3(_batch(99)).backward()
    try:
        ttd.load_from_full_optimizer_state_dict(model3, optim3, copy.deepcopy(osd), cpu)
    except Exception as exc:  # noqa: BLE001 - recorded, compared by the test
        out["loaded_with_grads"] = ("raised", type(exc).__name__, str(exc))
    else:
        optim3.zero_grad()
        out["loaded_with_grads"] = live_state(model3, optim3)
    dist.barrier()

    # _init_optim_state alone (torchtune imports it), then training
    model4 = _tt_model(seed=0)
    optim4 = _tt_optim(model4)
    ttd._init_optim_state(optim4)
    out["init_state"] = live_state(model4, optim4)
    out["init_then_train"] = _tt_train(model4, optim4, steps, 0)
    model5 = _tt_model(seed=0)
    out["fresh_train"] = _tt_train(model5, _tt_optim(model5), steps, 0)
    return out


def torchtune_helpers(rank: int, ws: int, steps: int) -> dict[str, Any]:
    """torchtune's helpers through dcp_optim.patch() (torchtune is first
    imported while patched) and on upstream's functions, both switches."""
    assert "torchtune" not in sys.modules
    originals = {n: getattr(upstream, n) for n in patching.PATCHED_NAMES}
    out: dict[str, Any] = {}
    for impl in IMPLS:
        rec: dict[str, Any] = {}
        with impl_run(impl, rec):
            import torchtune
            import torchtune.training._distributed as ttd

            bound = {n: getattr(ttd, n) for n in ("get_optimizer_state_dict", "set_model_state_dict",
                                                  "set_optimizer_state_dict", "_init_optim_state")}
            rec["bound_forwarders"] = sorted(n for n, f in bound.items() if patching.is_patched_function(f))
            for dsd_api in (False, True):
                rec[f"dsd_api={dsd_api}"] = _torchtune_flow(rank, steps, dsd_api)
        rec["restored"] = sorted(n for n in bound if getattr(ttd, n) is originals[n])
        out[impl] = rec
    import torchao

    out["torchtune"], out["torchao"] = torchtune.__version__, torchao.__version__
    return out


# --- OLMo-core: its checkpoint functions on FSDP2, with its own optimizers -----------


def _olmo_model(seed: int, ws: int):
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(seed)
    model = Net()
    mesh = init_device_mesh("cpu", (ws,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


OLMO_OPTIMIZERS = ("SkipStepAdamW", "SkipStepAdamW/bf16", "SkipStepLion")


def _olmo_optim(name: str, model: nn.Module):
    """OLMo-core's own optimizers (``olmo_core.optim``): they create their
    state in ``step()`` (SkipStepAdamW's moments in ``dtype`` where given,
    its ``step`` a float32 tensor on the parameter's device), two groups."""
    from olmo_core import optim as olmo_optim

    groups = _decay_groups(model)
    if name == "SkipStepLion":
        return olmo_optim.SkipStepLion(groups, lr=0.01)
    dtype = torch.bfloat16 if name.endswith("/bf16") else None
    return olmo_optim.SkipStepAdamW(groups, lr=0.01, dtype=dtype, foreach=False)


def olmo_core_checkpoints(rank: int, ws: int, root: str, steps: int) -> dict[str, Any]:
    """OLMo-core's ``save_model_and_optim_state`` / ``load_model_and_optim_state``
    (DCP directories of sharded, CPU-offloaded state dicts; nested and
    flattened optimizer state), each implementation saving, then each
    loading what each saved into a model with another init and a
    never-stepped optimizer, and training on."""
    from importlib.metadata import version

    from olmo_core.distributed.checkpoint import (
        load_model_and_optim_state,
        save_model_and_optim_state,
    )

    out: dict[str, Any] = {"olmo_core": version("ai2-olmo-core")}
    for name in OLMO_OPTIMIZERS:
        for flat in (False, True):
            case = f"{name}/flat={flat}"
            for impl in IMPLS:
                rec: dict[str, Any] = {}
                path = os.path.join(root, case.replace("/", "_"), impl)
                with impl_run(impl, rec):
                    model = _olmo_model(0, ws)
                    optim = _olmo_optim(name, model)
                    rec["first"] = _tt_train(model, optim, steps, 0)
                    save_model_and_optim_state(path, model, optim, flatten_optimizer_state=flat)
                    rec["saved"] = live_state(model, optim)
                    rec["reference"] = _tt_train(model, optim, steps, steps)
                out[f"save {impl}/{case}"] = rec
            for impl in IMPLS:
                for saved_by in IMPLS:
                    rec = {}
                    path = os.path.join(root, case.replace("/", "_"), saved_by)
                    with impl_run(impl, rec):
                        model = _olmo_model(7, ws)
                        optim = _olmo_optim(name, model)
                        load_model_and_optim_state(path, model, optim, flatten_optimizer_state=flat)
                        rec["loaded"] = live_state(model, optim)
                        rec["resumed"] = _tt_train(model, optim, steps, steps)
                    out[f"load {impl}<-{saved_by}/{case}"] = rec
    return out
