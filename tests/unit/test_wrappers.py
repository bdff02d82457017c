"""Each wrapper level torch strips, compared with upstream: DDP (world-1
gloo group), torch.compile, activation checkpointing, the _fqn_modifiers
hook, state-dict hooks, tied weights, extra state, non-persistent buffers.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.checkpoint.state_dict as upstream
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.nn.parallel import DistributedDataParallel as DDP

import dcp_optim

from ..support.oracle import assert_same_optimizers, assert_same_tree, params_snapshot


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.fc2 = nn.Linear(8, 4)
        self.register_buffer("stat", torch.arange(4.0))
        self.register_buffer("tmp", torch.zeros(2), persistent=False)

    def forward(self, x):
        return self.fc2(self.norm(self.fc1(x)).relu()) + self.stat


class Net(nn.Module):
    def __init__(self, tied=False):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 10, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = _unwrapped(b)(x)
        return self.head(x).logsumexp(-1).mean()


def _unwrapped(model):
    """The innermost module: forward bypasses DDP/compile wrappers (no
    dynamo tracing, which is slow on 2 cores and not what is tested)."""
    while True:
        if isinstance(model, DDP):
            model = model.module
        elif "_orig_mod" in model._modules:
            model = model._orig_mod
        elif "_checkpoint_wrapped_module" in model._modules:
            model = model._checkpoint_wrapped_module
        else:
            return model


def _train(model, optim, steps=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    fwd = _unwrapped(model)
    for _ in range(steps):
        fwd(torch.randint(0, 10, (3,), generator=g)).backward()
        optim.step()
        optim.zero_grad()


def _twins(wrap, tied=False, optim_cls=torch.optim.AdamW):
    out = []
    for _ in range(2):
        torch.manual_seed(0)
        base = Net(tied=tied)
        model = wrap(base)
        optim = optim_cls(model.parameters(), lr=1e-2)
        _train(model, optim)
        out.append((model, optim))
    return out


def _compare_everything(u, d, *, flat_too=True):
    (mu, ou), (md, od) = u, d
    a = upstream.get_model_state_dict(mu)
    b = dcp_optim.get_model_state_dict(md)
    assert_same_tree(a, b)
    assert a._metadata == b._metadata
    assert_same_tree(upstream.get_optimizer_state_dict(mu, ou), dcp_optim.get_optimizer_state_dict(md, od))
    if flat_too:
        opts = upstream.StateDictOptions(flatten_optimizer_state_dict=True)
        assert_same_tree(
            upstream.get_optimizer_state_dict(mu, ou, options=opts),
            dcp_optim.get_optimizer_state_dict(md, od, options=opts),
        )
    # round trip through set, then one more step on both
    msd_u, osd_u = upstream.get_state_dict(mu, ou)
    msd_d, osd_d = dcp_optim.get_state_dict(md, od)
    msd_d_before = dict(msd_d)
    upstream.set_state_dict(mu, ou, model_state_dict=msd_u, optim_state_dict=osd_u)
    dcp_optim.set_state_dict(md, od, model_state_dict=msd_d, optim_state_dict=osd_d)
    assert list(msd_d) == list(msd_d_before), "caller's model dict was re-keyed (D11)"
    assert_same_optimizers(ou, od)
    _train(mu, ou, steps=1, seed=1)
    _train(md, od, steps=1, seed=1)
    assert_same_tree(params_snapshot(mu), params_snapshot(md))
    return b


def test_plain_and_tied():
    _compare_everything(*_twins(lambda m: m))
    b = _compare_everything(*_twins(lambda m: m, tied=True))
    assert "head.weight" in b and "embed.weight" in b


def test_ddp_world1(world1):
    b = _compare_everything(*_twins(lambda m: DDP(m)))
    assert all(not k.startswith("module.") for k in b)


def test_compiled_root_and_submodule():
    b = _compare_everything(*_twins(lambda m: torch.compile(m, backend="eager")))
    assert all("_orig_mod" not in k for k in b)

    def compile_block(m):
        m.blocks[1] = torch.compile(m.blocks[1], backend="eager")
        return m

    b = _compare_everything(*_twins(compile_block))
    assert "blocks.1.fc1.weight" in b


def test_activation_checkpointing():
    def wrap_blocks(m):
        for i in range(len(m.blocks)):
            m.blocks[i] = checkpoint_wrapper(m.blocks[i])
        return m

    b = _compare_everything(*_twins(wrap_blocks))
    assert "blocks.0.fc1.weight" in b
    _compare_everything(*_twins(lambda m: checkpoint_wrapper(m)))


def test_ddp_of_compiled_of_checkpointed(world1):
    def wrap(m):
        m.blocks[0] = checkpoint_wrapper(m.blocks[0])
        return DDP(torch.compile(m, backend="eager"))

    b = _compare_everything(*_twins(wrap))
    assert "blocks.0.fc1.weight" in b


class FusionEmbeddingWithHook(nn.Module):
    """Upstream's test module: a state-dict hook hides the `embedding` level."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(5, 4)
        self.fusion_embedding = nn.Embedding(3, 4)
        self._register_state_dict_hook(FusionEmbeddingWithHook._state_dict_hook)
        self._register_load_state_dict_pre_hook(
            FusionEmbeddingWithHook._load_state_dict_hook, with_module=True
        )

    def _state_dict_hook(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = destination.pop(prefix + "embedding.weight")

    def _load_state_dict_hook(self, state_dict, prefix, *args, **kwargs):
        if state_dict:
            state_dict[prefix + "embedding.weight"] = state_dict.pop(prefix + "weight")


class FusionEmbeddingWithModifier(FusionEmbeddingWithHook):
    def _fqn_modifiers(self) -> dict[str, str]:
        return {"weight": "embedding"}


class FusionModel(nn.Module):
    def __init__(self, cls):
        super().__init__()
        self.fusion = cls()
        self.out = nn.Linear(4, 1)

    def forward(self, ids):
        e = self.fusion.embedding(ids % 5) + self.fusion.fusion_embedding(ids % 3)
        return self.out(e).sum()


def test_state_dict_hook_without_modifier_fails_like_upstream():
    """A hook that renames keys without declaring _fqn_modifiers leaves a
    key no attribute walk can resolve: both raise AttributeError."""
    m = FusionModel(FusionEmbeddingWithHook)
    with pytest.raises(AttributeError):
        upstream.get_model_state_dict(m)
    with pytest.raises(AttributeError, match="weight"):
        dcp_optim.get_model_state_dict(m)


@pytest.mark.parametrize("cls", [FusionEmbeddingWithModifier])
def test_state_dict_hooks_and_fqn_modifiers(cls):
    twins = []
    for _ in range(2):
        torch.manual_seed(0)
        m = FusionModel(cls)
        o = torch.optim.Adam(m.parameters(), lr=0.1)
        _train(m, o)
        twins.append((m, o))
    (mu, ou), (md, od) = twins
    a = upstream.get_model_state_dict(mu)
    b = dcp_optim.get_model_state_dict(md)
    assert_same_tree(a, b)
    assert "fusion.weight" in b
    assert_same_tree(upstream.get_optimizer_state_dict(mu, ou), dcp_optim.get_optimizer_state_dict(md, od))
    # loading the hook-renamed dict back works in both
    upstream.set_model_state_dict(mu, a)
    dcp_optim.set_model_state_dict(md, b)
    assert_same_tree(params_snapshot(mu), params_snapshot(md))
    assert_same_tree(
        list(upstream._iterate_valid_model_state(mu)).__len__(),
        list(dcp_optim.state_dict._iterate_valid_model_state(md)).__len__(),
    )
    for (na, _), (nb, _) in zip(
        upstream._iterate_valid_model_state(mu), dcp_optim.state_dict._iterate_valid_model_state(md)
    ):
        assert na == nb
        assert upstream._get_fqns(mu, na) == dcp_optim.state_dict._get_fqns(md, nb)


class WithExtra(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.calls = 7

    def get_extra_state(self):
        return {"calls": self.calls}

    def set_extra_state(self, state):
        self.calls = state["calls"]

    def forward(self, x):
        return self.lin(x).sum()


def test_extra_state_and_full_path():
    mu, md = WithExtra(), copy.deepcopy(WithExtra())
    md.load_state_dict(mu.state_dict())
    a = upstream.get_model_state_dict(mu)
    b = dcp_optim.get_model_state_dict(md)
    assert_same_tree(a, b)
    assert b["_extra_state"] == {"calls": 7}
    full = upstream.StateDictOptions(full_state_dict=True)
    a = upstream.get_model_state_dict(mu, options=full)
    b = dcp_optim.get_model_state_dict(md, options=full)
    assert_same_tree(a, b)
    b2 = dict(b)
    b2["_extra_state"] = {"calls": 9}
    dcp_optim.set_model_state_dict(md, b2, options=full)
    assert md.calls == 9
    assert b["_extra_state"] == {"calls": 7}


@pytest.mark.parametrize("name", ["plain", "ddp", "compile", "ckpt"])
def test_private_helpers_match_upstream(name, request):
    if name == "ddp":
        request.getfixturevalue("world1")
    wrap = {
        "plain": lambda m: m,
        "ddp": lambda m: DDP(m),
        "compile": lambda m: torch.compile(m, backend="eager"),
        "ckpt": lambda m: checkpoint_wrapper(m),
    }[name]
    torch.manual_seed(0)
    m = wrap(Net(tied=True))
    ours = list(dcp_optim.state_dict._iterate_valid_model_state(m))
    theirs = list(upstream._iterate_valid_model_state(m))
    assert [n for n, _ in ours] == [n for n, _ in theirs]
    assert all(a is b for (_, a), (_, b) in zip(ours, theirs) if isinstance(a, torch.Tensor))
    for n, _ in theirs:
        for skip_ddp in (True, False):
            for skip_compiler in (True, False):
                assert dcp_optim.state_dict._get_fqns(
                    m, n, skip_ddp_prefix=skip_ddp, skip_compiler_prefix=skip_compiler
                ) == upstream._get_fqns(m, n, skip_ddp_prefix=skip_ddp, skip_compiler_prefix=skip_compiler)
    info_u = upstream._verify_options(m, (), optim_only=False)
    info_d = dcp_optim.state_dict._verify_options(m, (), optim_only=False)
    assert info_u.fqn_param_mapping.keys() == info_d.fqn_param_mapping.keys()
    for k, v in info_u.fqn_param_mapping.items():
        assert (v is info_d.fqn_param_mapping[k]) if isinstance(v, torch.Tensor) else v == info_d.fqn_param_mapping[k]
    def keys(mapping):
        return {k if isinstance(k, str) else id(k) for k in mapping}

    assert keys(info_u.shared_params_mapping) == keys(info_d.shared_params_mapping)
    assert keys(info_u.shared_params_mapping)
