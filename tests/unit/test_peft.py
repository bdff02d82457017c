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
import warnings

import pytest
import torch
import torch.distributed.checkpoint.state_dict as upstream

import dcp_optim

from ..support.module_cases import assert_like_torch, load_three_ways
from ..support.oracle import assert_same_tree

peft = pytest.importorskip("peft", reason="peft is a test dependency (Makefile)")
transformers = pytest.importorskip("transformers", reason="transformers is a test dependency (Makefile)")

TARGETS = ["q_proj", "v_proj"]

KINDS = {
    "lora": lambda: peft.LoraConfig(r=4, target_modules=TARGETS, task_type="CAUSAL_LM"),
    "lora+modules_to_save": lambda: peft.LoraConfig(r=4, target_modules=TARGETS, modules_to_save=["lm_head"],
                                                    task_type="CAUSAL_LM"),
    "dora": lambda: peft.LoraConfig(r=4, target_modules=TARGETS, use_dora=True, task_type="CAUSAL_LM"),
    "lora-target-parameters": lambda: peft.LoraConfig(r=4, target_modules=[],
                                                      target_parameters=["mlp.gate_proj.weight"]),
    "loha": lambda: peft.LoHaConfig(r=4, target_modules=TARGETS),
    "lokr": lambda: peft.LoKrConfig(r=4, target_modules=TARGETS),
    "ia3": lambda: peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
    "vera": lambda: peft.VeraConfig(r=4, target_modules=TARGETS),
    "oft": lambda: peft.OFTConfig(r=0, oft_block_size=4, target_modules=TARGETS),
    "boft": lambda: peft.BOFTConfig(boft_block_size=4, target_modules=TARGETS),
    "adalora": lambda: peft.AdaLoraConfig(r=4, init_r=6, target_r=2, target_modules=TARGETS, total_step=10,
                                          tinit=1, tfinal=2),
    "prompt-tuning": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
    "prefix-tuning": lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
    "ln-tuning": lambda: peft.LNTuningConfig(target_modules=["input_layernorm"]),
    "fourierft": lambda: peft.FourierFTConfig(n_frequency=8, target_modules=TARGETS),
    "hra": lambda: peft.HRAConfig(r=2, target_modules=TARGETS),
    "bone": lambda: peft.BoneConfig(r=2, target_modules=TARGETS),
    "randlora": lambda: peft.RandLoraConfig(r=4, target_modules=TARGETS),
    "two-adapters": None,
}


def build(kind: str, seed: int):
    """The same frozen base (seed 0) under adapters from ``seed``."""
    cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                                   max_position_embeddings=32, tie_word_embeddings=False)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's notes on the configurations
        if kind == "two-adapters":  # one active, one not (frozen)
            model = peft.get_peft_model(base, KINDS["lora"]())
            model.add_adapter("other", peft.LoraConfig(r=2, target_modules=["k_proj"], task_type="CAUSAL_LM"))
            return model
        return peft.get_peft_model(base, KINDS[kind]())


def optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)


def train(model, optim, steps) -> list[float]:
    losses = []
    for i in steps:
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(100 + i))
        with warnings.catch_warnings():
            # prefix tuning passes transformers' deprecated past_key_values
            warnings.simplefilter("ignore", FutureWarning)
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


OPTIONS = [{}, {"ignore_frozen_params": True}, {"flatten_optimizer_state_dict": True}, {"full_state_dict": True}]


@pytest.mark.parametrize("kind", list(KINDS))
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
