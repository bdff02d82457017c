"""Rank functions for tests/distributed/test_peft.py: PEFT adapters
(LoRA, DoRA, LoRA with ``modules_to_save``, IA3) on a tiny Llama under
FSDP2, the base weights frozen and the optimizer over the adapters only.

Per rank: sharded and full gets equal upstream's (model and optimizer,
both formats, ``ignore_frozen_params``); a resume through ``dcp.save`` /
``dcp.load`` into a fresh model and optimizer continues with the losses
of the run that never stopped; an adapter-only checkpoint
(``ignore_frozen_params=True``, loaded with ``strict=False`` into a model
whose base weights come from the same pretrained seed) does too; and a
full state dict broadcast from rank 0 into a fresh model
(``broadcast_from_rank0``) leaves every rank with the source's values."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as upstream
from torch.distributed.fsdp import fully_shard

import dcp_optim

from ..support.oracle import assert_same_tree
from ..support.peft_models import build, optimizer, train
from .dist_cases_fsdp1 import real_shards


def shard(model: Any) -> Any:
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _options(impl: Any, **kw: Any) -> Any:
    return impl.StateDictOptions(**kw)


def _resume(model: Any, optim: torch.optim.Optimizer, path: str, options: Any) -> None:
    """The DCP resume: dcp_optim's template of ``model`` and ``optim``,
    ``dcp.load`` from ``path``, dcp_optim's set."""
    msd, osd = dcp_optim.get_state_dict(model, optim, options=options)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    dcp_optim.set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"],
                             options=options)


def peft_case(rank: int, ws: int, path: str, kinds: list[str]) -> list[str]:
    warnings.filterwarnings("ignore")
    return [f"{kind}: {step}" for kind in kinds for step in _fsdp2_kind(rank, f"{path}/{kind}", kind)]


def _fsdp2_kind(rank: int, path: str, kind: str) -> list[str]:
    done = []
    model = shard(build(kind, 1))
    optim = optimizer(model)
    train(model, optim, range(2), rank)

    # gets, against upstream's
    for kw in ({}, {"ignore_frozen_params": True}, {"flatten_optimizer_state_dict": True},
               {"full_state_dict": True, "cpu_offload": True},
               {"full_state_dict": True, "cpu_offload": True, "ignore_frozen_params": True}):
        ours = dcp_optim.get_state_dict(model, optim, options=_options(dcp_optim, **kw))
        theirs = upstream.get_state_dict(model, optim, options=_options(upstream, **kw))
        assert_same_tree(ours, theirs)
    done.append("gets")

    # checkpoints: whole, and the adapters alone
    whole, adapters = path + "/whole", path + "/adapters"
    msd, osd = dcp_optim.get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=whole)
    frozen = _options(dcp_optim, ignore_frozen_params=True)
    msd, osd = dcp_optim.get_state_dict(model, optim, options=frozen)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=adapters)
    expected = train(model, optim, range(2, 5), rank)

    for path, kw in ((whole, {}), (adapters, {"ignore_frozen_params": True, "strict": False})):
        resumed = shard(build(kind, 7))  # other adapters, the same base
        ropt = optimizer(resumed)
        _resume(resumed, ropt, path, _options(dcp_optim, **kw))
        got = train(resumed, ropt, range(2, 5), rank)
        assert got == expected, (path, got, expected)
        done.append(f"resume {path.rsplit('/', 1)[1]}")

    # a full state dict from rank 0 into a fresh model
    source = build(kind, 3)
    full = copy.deepcopy(source.state_dict()) if rank == 0 else {}
    target = shard(build(kind, 9))
    dcp_optim.set_model_state_dict(target, full, options=_options(
        dcp_optim, full_state_dict=True, broadcast_from_rank0=True))
    got = dcp_optim.get_model_state_dict(target, options=_options(dcp_optim, full_state_dict=True, cpu_offload=True))
    if rank == 0:
        assert_same_tree(got, dict(source.state_dict()))
    done.append("broadcast")
    return done


def peft_fsdp1_case(rank: int, ws: int, path: str, kinds: list[str]) -> list[str]:
    warnings.filterwarnings("ignore")
    return [f"{kind}: {step}" for kind in kinds for step in _fsdp1_kind(rank, f"{path}/{kind}", kind)]


def _fsdp1_kind(rank: int, folder: str, kind: str) -> list[str]:
    """LoRA under FSDP1 (``use_orig_params=True``: frozen and trainable
    parameters in one flat parameter per decoder layer).  The adapters
    of these small layers all fall in rank 0's half of each flat
    parameter: rank 1 holds empty pieces of them and no state.

    Upstream's get on rank 1 runs its initialising step, which gives
    those empty pieces a state (``step`` 1) that later steps skip, so
    after more training the ranks disagree on ``step``; FSDP's gather
    takes it from the ranks holding elements.  Gets and resumes after
    that must still see the trained step."""
    import functools

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, LlamaDecoderLayer))

    def wrap(model: Any) -> Any:
        return FSDP(model, device_id=torch.device("cpu"), use_orig_params=True, auto_wrap_policy=policy)

    done = []
    model = wrap(build(kind, 1))
    optim = optimizer(model)
    train(model, optim, range(2), rank)
    upstream.get_optimizer_state_dict(model, optim)  # its initialising step, on rank 1
    stale = sorted({float(s["step"]) for s in optim.state.values()})
    train(model, optim, range(2, 4), rank)
    steps = sorted({float(s["step"]) for s in optim.state.values()})
    if kind in ("lora", "dora"):  # IA3's (n, 1) vectors have elements on both ranks
        # rank 0 stepped on; rank 1's empty pieces kept the state the initialising step gave them
        assert (stale, steps) == (([2.0], [4.0]) if rank == 0 else ([1.0], [1.0])), (stale, steps)

    # full_state_dict with cpu_offload crashes upstream's FSDP1 on CPU (it
    # frees the storage its views point to): compared without it
    for kw in ({}, {"ignore_frozen_params": True}, {"flatten_optimizer_state_dict": True},
               {"full_state_dict": True}):
        ours = dcp_optim.get_state_dict(model, optim, options=_options(dcp_optim, **kw))
        theirs = upstream.get_state_dict(model, optim, options=_options(upstream, **kw))
        # IA3's (1, n) vectors have one chunk: D40's zero-size shards aside
        assert_same_tree(real_shards(ours), real_shards(theirs))
        steps = {k: float(v) for k, v in ours[1].items() if k.endswith(".step")} if "state" not in ours[1] else {
            k: float(entry["step"]) for k, entry in ours[1]["state"].items()}
        assert steps and set(steps.values()) == {4.0}, (kw, steps)
    done.append("gets")
    for kw in ({}, {"ignore_frozen_params": True, "strict": False}):
        options = _options(dcp_optim, **kw)
        path = f"{folder}/{len(done)}"
        msd, osd = dcp_optim.get_state_dict(model, optim, options=options)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        snapshot = copy.deepcopy(upstream.get_state_dict(model, optim))
        expected = train(model, optim, range(4, 6), rank)
        upstream.set_state_dict(model, optim, model_state_dict=snapshot[0], optim_state_dict=snapshot[1])
        resumed = wrap(build(kind, 7))
        ropt = optimizer(resumed)
        _resume(resumed, ropt, path, options)
        got = train(resumed, ropt, range(4, 6), rank)
        assert got == expected, (kw, got, expected)
        # what the resumed run saves next: the step it trained to
        ours = dcp_optim.get_optimizer_state_dict(resumed, ropt)
        assert {float(entry["step"]) for entry in ours["state"].values()} == {6.0}
        assert_same_tree(real_shards(ours), real_shards(upstream.get_optimizer_state_dict(resumed, ropt)))
        done.append(f"resume {sorted(kw)}")
    return done


def disagreeing_step_case(rank: int, ws: int) -> list[str]:
    """FSDP1 ``use_orig_params``: a weight whose pieces lie on both ranks,
    one rank's ``step`` changed alone.  FSDP's gather refuses it (an
    AssertionError); dcp_optim raises InconsistentOptimizerStateError (an
    AssertionError too) on every rank, naming the entry, where it used to
    save the last rank's value."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from dcp_optim import errors

    torch.manual_seed(0)
    model = FSDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)), device_id=torch.device("cpu"),
                 use_orig_params=True)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    optim.step()
    weight = model.module[0].weight
    assert weight.numel() > 0, "the first weight has a piece on every rank"
    if rank == 1:
        optim.state[weight]["step"] = torch.tensor(7.0)
    out = []
    try:
        upstream.get_optimizer_state_dict(model, optim)
    except AssertionError as exc:
        out.append(f"upstream: {type(exc).__name__}: {'different values for step' in str(exc)}")
    try:
        dcp_optim.get_optimizer_state_dict(model, optim)
    except errors.InconsistentOptimizerStateError as exc:
        assert isinstance(exc, AssertionError)
        out.append(f"dcp_optim: {exc.key} {exc.ranks}")
    return out
