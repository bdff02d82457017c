"""PEFT (Hugging Face ``peft``) on a tiny Llama, one process: every kind
of adapter the package offers that trains on CPU -- LoRA and its variants
(DoRA, ``modules_to_save``, ``target_parameters``' parametrizations,
several adapters), LoHa, LoKr, IA3, VeRA (shared buffers), OFT, BOFT,
AdaLoRA, prompt and prefix tuning, LayerNorm tuning, FourierFT, HRA, Bone,
RandLoRA -- with the optimizer over the adapters only.

For each, differentially against upstream: model and optimizer gets
(nested, flattened, ``ignore_frozen_params``, full); a resume into a
fresh model and optimizer through ``set_state_dict`` continues with the
losses of the run that never stopped; and a model load writes, reports
and raises what ``Module.load_state_dict`` does."""

from __future__ import annotations

import copy

import pytest
import torch.distributed.checkpoint.state_dict as upstream

import dcp_optim

from ..support.module_cases import assert_like_torch, load_three_ways
from ..support.oracle import assert_same_tree
from ..support.peft_models import KINDS, build, optimizer, train

pytest.importorskip("peft", reason="peft is a test dependency (Makefile)")
pytest.importorskip("transformers", reason="transformers is a test dependency (Makefile)")

OPTIONS = [{}, {"ignore_frozen_params": True}, {"flatten_optimizer_state_dict": True}, {"full_state_dict": True}]


@pytest.mark.parametrize("kind", KINDS)
def test_peft_adapters(kind):
    model = build(kind, 1)
    optim = optimizer(model)
    train(model, optim, range(2))
    for kw in OPTIONS:
        ours = dcp_optim.get_state_dict(model, optim, options=dcp_optim.StateDictOptions(**kw))
        theirs = upstream.get_state_dict(model, optim, options=upstream.StateDictOptions(**kw))
        assert_same_tree(ours, theirs)

    msd, osd = dcp_optim.get_state_dict(model, optim)
    msd, osd = {k: v.detach().clone() for k, v in msd.items()}, copy.deepcopy(osd)
    resumed = build(kind, 7)
    ropt = optimizer(resumed)
    dcp_optim.set_state_dict(resumed, ropt, model_state_dict=msd, optim_state_dict=osd)
    assert train(resumed, ropt, range(2, 4)) == train(model, optim, range(2, 4))

    r = load_three_ways(lambda: build(kind, 7), lambda m: {k: v.clone() for k, v in msd.items()})
    assert_like_torch(r)
