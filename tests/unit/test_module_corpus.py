"""The module corpus (issue 12): models whose modules save or load by
rules of their own, and tiny real models from ``transformers`` (configs
built here, nothing downloaded).

For each model, differentially against upstream and torch:
  * get_model_state_dict equals upstream's;
  * loading another instance's state dict into a fresh copy -- strict, and
    with a key missing and an unexpected one, strict and not -- reports,
    writes and raises what ``Module.load_state_dict`` does, and a failed
    load leaves the model as it was;
  * a round trip through ``dcp.save``/``dcp.load`` with a template from
    the fresh copy restores the saved values.

No torchvision/timm: torchvision's PyPI wheel (which timm imports) does
not load with the CPU torch build, so the timm-style backbone below uses
the FrozenBatchNorm2d written out in module_cases.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as upstream
import torch.nn as nn
import torch.nn.utils.parametrize as parametrize

import dcp_optim

from ..support.module_cases import (
    Extra,
    FrozenBatchNorm2d,
    RenamingLinear,
    assert_like_torch,
    load_three_ways,
    model_state,
    rename_hook,
    same_state,
)
from ..support.oracle import assert_same_tree

# --- the corpus ----------------------------------------------------------------


class Backbone(nn.Module):
    """A timm/torchvision-style ResNet stem and one basic block; the norm
    layer is a parameter, as in torchvision's ``norm_layer=``."""

    def __init__(self, norm=nn.BatchNorm2d):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, stride=2, padding=1, bias=False)
        self.bn1 = norm(4)
        self.layer1 = nn.Sequential(
            nn.Conv2d(4, 4, 3, padding=1, bias=False), norm(4), nn.ReLU(),
            nn.Conv2d(4, 4, 3, padding=1, bias=False), norm(4),
        )
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(x + self.layer1(x))
        return self.fc(x.mean((2, 3)))


class Symmetric(nn.Module):
    def forward(self, x):
        return x.triu() + x.triu(1).transpose(-1, -2)


def parametrized():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    parametrize.register_parametrization(model[0], "weight", Symmetric())
    nn.utils.parametrizations.orthogonal(model[1])
    nn.utils.parametrizations.weight_norm(model[2])
    return model


def parametrized_plain():
    """Parametrizations without compatibility hooks: the native path."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    parametrize.register_parametrization(model[0], "weight", Symmetric())
    nn.utils.parametrizations.orthogonal(model[1])
    return model


def spectral():
    # The old hook-based API: a state_dict hook adds a version entry, a
    # load pre-hook converts old checkpoints.
    return nn.Sequential(nn.utils.spectral_norm(nn.Linear(4, 4)), nn.Linear(4, 2))


class StateDictHooks(nn.Module):
    """Saves ``inner.weight`` transposed (a state_dict hook) and transposes
    it back when loading (a load pre-hook): the checkpoint's shape is not
    the parameter's."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(3, 2)
        self.head = nn.Linear(2, 2)
        self._register_state_dict_hook(StateDictHooks._save)
        self._register_load_state_dict_pre_hook(StateDictHooks._load)

    @staticmethod
    def _save(module, state_dict, prefix, local_metadata):
        key = prefix + "inner.weight"
        state_dict[key] = state_dict[key].t()

    @staticmethod
    def _load(state_dict, prefix, *args):
        key = prefix + "inner.weight"
        if key in state_dict:
            state_dict[key] = state_dict[key].t()


class RenamingStateDictHook(nn.Module):
    """Saves ``inner.*`` as ``legacy.*``: names no module has."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(3, 3)
        self._register_state_dict_hook(RenamingStateDictHook._save)

    @staticmethod
    def _save(module, state_dict, prefix, local_metadata):
        for key in [k for k in state_dict if k.startswith(prefix + "inner.")]:
            state_dict[prefix + "legacy." + key[len(prefix + "inner."):]] = state_dict.pop(key)


def mixed_rules():
    """Renaming module, key-editing pre-hook, post hook, extra state and
    an old-style BatchNorm in one tree."""
    model = nn.Sequential(RenamingLinear(3, 4), nn.BatchNorm1d(4), Extra(4, 4), nn.Linear(4, 2))
    model[3]._register_load_state_dict_pre_hook(rename_hook("kernel", "weight"))
    model.register_load_state_dict_post_hook(lambda module, keys: None)
    return model


def lazy():
    return nn.Sequential(nn.LazyConv2d(3, 1), nn.LazyBatchNorm2d(), nn.Flatten(), nn.LazyLinear(2))


def lazy_input():
    return torch.randn(2, 2, 3, 3, generator=torch.Generator().manual_seed(0))


def _transformers():
    return pytest.importorskip("transformers", reason="transformers is a test dependency (Makefile)")


def gpt2():
    t = _transformers()
    cfg = t.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=32,
                       bos_token_id=0, eos_token_id=0)
    return t.GPT2LMHeadModel(cfg)


def llama_tied():
    t = _transformers()
    cfg = t.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                        max_position_embeddings=32, tie_word_embeddings=True)
    model = t.LlamaForCausalLM(cfg)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def bert():
    t = _transformers()
    cfg = t.BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=32, vocab_size=64, max_position_embeddings=32)
    return t.BertModel(cfg)


CORPUS = {
    "backbone-batchnorm": Backbone,
    "backbone-frozen": lambda: Backbone(FrozenBatchNorm2d),
    "parametrizations": parametrized,
    "parametrizations-plain": parametrized_plain,
    "spectral-norm": spectral,
    "state-dict-hooks": StateDictHooks,
    "mixed-rules": mixed_rules,
    "lazy": lazy,
    "gpt2": gpt2,
    "llama-tied": llama_tied,
    "bert": bert,
}


def build(name, seed):
    torch.manual_seed(seed)
    model = CORPUS[name]()
    if name == "lazy":
        model(lazy_input())  # materialized, as after a first batch
    if name == "backbone-batchnorm":
        model(torch.randn(2, 3, 8, 8))  # running stats and counters move
    return model


def fresh(name, seed=1):
    """A new instance; lazy modules stay uninitialized."""
    torch.manual_seed(seed)
    return CORPUS[name]()


MODELS = pytest.mark.parametrize("name", list(CORPUS))


def _values(sd):
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
            for k, v in sd.items()}


# --- get ---------------------------------------------------------------------------


@MODELS
def test_get_equals_upstream(name):
    model = build(name, 0)
    ours = dcp_optim.get_model_state_dict(model)
    theirs = upstream.get_model_state_dict(model)
    assert_same_tree(ours, theirs)
    assert_same_tree(ours, dcp_optim.get_model_state_dict(model))  # replayed walk


def test_state_dict_hook_renaming_to_unknown_names():
    """Upstream resolves every key to a module attribute and fails on
    names no module has; dcp_optim fails the same way."""
    model = RenamingStateDictHook()
    for impl in (upstream, dcp_optim):
        with pytest.raises(AttributeError, match="no attribute 'legacy'"):
            impl.get_model_state_dict(model)


# --- load: like torch --------------------------------------------------------------


@MODELS
@pytest.mark.parametrize("strict", [True, False], ids=["strict", "nonstrict"])
@pytest.mark.parametrize("edit", ["exact", "missing+unexpected"])
def test_load_like_torch(name, strict, edit):
    source = _values(build(name, 0).state_dict())
    if edit != "exact":
        source.pop(next(reversed(source)))
        source["extra.weight"] = torch.ones(2)

    r = load_three_ways(lambda: fresh(name), lambda model: dict(source), strict=strict)
    assert_like_torch(r)
    if r["torch"][0][0] == "ok":
        assert r["upstream"][0] == r["torch"][0]


def test_frozen_backbone_loads_batchnorm_checkpoint():
    """The detection-backbone case: a BatchNorm-trained checkpoint into the
    same backbone with FrozenBatchNorm2d (num_batches_tracked dropped)."""
    name = "backbone-frozen"
    source = _values(build("backbone-batchnorm", 0).state_dict())
    r = load_three_ways(lambda: fresh(name), lambda model: dict(source))
    assert r["torch"][0] == ("ok", [], [])
    assert r["upstream"][0] == ("ok", [], [])
    assert_like_torch(r)


# --- dcp.save / dcp.load -------------------------------------------------------------


@MODELS
def test_dcp_round_trip(name, tmp_path):
    model = build(name, 0)
    dcp.save(dcp_optim.get_model_state_dict(model), checkpoint_id=str(tmp_path))
    target = fresh(name)
    if name == "lazy":
        target(lazy_input())  # a template needs shapes
    template = dcp_optim.get_model_state_dict(target)
    dcp.load(template, checkpoint_id=str(tmp_path))
    result = dcp_optim.set_model_state_dict(target, template)
    assert tuple(result) == ([], [])
    assert same_state(model_state(model), model_state(target))
