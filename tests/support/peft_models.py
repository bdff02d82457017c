"""PEFT (Hugging Face ``peft``) models for the tests: a tiny Llama whose
base weights come from one seed (the "pretrained" weights every run
shares) under adapters from another, an AdamW over the adapters only, and
a training loop (tests/unit/test_peft.py, tests/distributed/test_peft.py).
``peft`` and ``transformers`` are imported when a model is built."""

from __future__ import annotations

import warnings
from typing import Any

import torch

TARGETS = ["q_proj", "v_proj"]


def configs() -> dict[str, Any]:
    """Every adapter kind of ``peft`` 0.18 that trains on CPU: name ->
    its configuration (None: two LoRA adapters, one of them inactive)."""
    import peft

    return {
        "lora": peft.LoraConfig(r=4, target_modules=TARGETS, task_type="CAUSAL_LM"),
        "lora+modules_to_save": peft.LoraConfig(r=4, target_modules=TARGETS, modules_to_save=["lm_head"],
                                                task_type="CAUSAL_LM"),
        "dora": peft.LoraConfig(r=4, target_modules=TARGETS, use_dora=True, task_type="CAUSAL_LM"),
        "lora-target-parameters": peft.LoraConfig(r=4, target_modules=[], target_parameters=["mlp.gate_proj.weight"]),
        "loha": peft.LoHaConfig(r=4, target_modules=TARGETS),
        "lokr": peft.LoKrConfig(r=4, target_modules=TARGETS),
        "ia3": peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"],
                              task_type="CAUSAL_LM"),
        "vera": peft.VeraConfig(r=4, target_modules=TARGETS),
        "oft": peft.OFTConfig(r=0, oft_block_size=4, target_modules=TARGETS),
        "boft": peft.BOFTConfig(boft_block_size=4, target_modules=TARGETS),
        "adalora": peft.AdaLoraConfig(r=4, init_r=6, target_r=2, target_modules=TARGETS, total_step=10, tinit=1,
                                      tfinal=2),
        "prompt-tuning": peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
        "prefix-tuning": peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
        "ln-tuning": peft.LNTuningConfig(target_modules=["input_layernorm"]),
        "fourierft": peft.FourierFTConfig(n_frequency=8, target_modules=TARGETS),
        "hra": peft.HRAConfig(r=2, target_modules=TARGETS),
        "bone": peft.BoneConfig(r=2, target_modules=TARGETS),
        "randlora": peft.RandLoraConfig(r=4, target_modules=TARGETS),
        "two-adapters": None,
    }


KINDS = [
    "lora", "lora+modules_to_save", "dora", "lora-target-parameters", "loha", "lokr", "ia3", "vera", "oft", "boft",
    "adalora", "prompt-tuning", "prefix-tuning", "ln-tuning", "fourierft", "hra", "bone", "randlora", "two-adapters",
]


def build(kind: str, adapter_seed: int, base_seed: int = 0) -> Any:
    """``kind``'s adapters (seed ``adapter_seed``) over the tiny Llama
    (seed ``base_seed``), not sharded.  LoRA's B, which starts at zero
    (so that A's gradient would be zero too and a resume that lost A's
    state would not show), is drawn at random."""
    import peft
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                                   max_position_embeddings=32, tie_word_embeddings=False)
    torch.manual_seed(base_seed)
    base = transformers.LlamaForCausalLM(cfg)
    torch.manual_seed(adapter_seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's notes on the configurations
        config = configs()[kind]
        if config is None:
            model = peft.get_peft_model(base, configs()["lora"])
            model.add_adapter("other", peft.LoraConfig(r=2, target_modules=["k_proj"], task_type="CAUSAL_LM"))
        else:
            model = peft.get_peft_model(base, config)
    if kind in ("lora", "two-adapters"):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    return model


def optimizer(model: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)


def train(model: Any, optim: torch.optim.Optimizer, steps: range, rank: int = 0) -> list[float]:
    """One step per index, on a batch of its own (and of the rank's)."""
    losses = []
    for i in steps:
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1000 * i + rank))
        with warnings.catch_warnings():
            # prefix tuning passes transformers' deprecated past_key_values
            warnings.simplefilter("ignore", FutureWarning)
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses
