"""Every StateDictOptions field and deprecated argument, against upstream."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint.state_dict as upstream
import torch.nn as nn

import dcp_optim

from ..support.oracle import assert_same_optimizers, assert_same_tree, params_snapshot


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        self.decoder = nn.Linear(4, 2)
        self.register_buffer("counter", torch.tensor(3))
        self.encoder[0].weight.requires_grad_(False)

    def forward(self, x):
        return self.decoder(self.encoder(x)).sum()


def twins(optim_cls=torch.optim.Adam):
    out = []
    for _ in range(2):
        torch.manual_seed(0)
        m = Model()
        o = optim_cls([p for p in m.parameters() if p.requires_grad], lr=0.1)
        m(torch.randn(2, 4)).backward()
        o.step()
        o.zero_grad()
        out.append((m, o))
    return out


OPTION_SETS = [
    dict(),
    dict(full_state_dict=True),
    dict(cpu_offload=True),
    dict(full_state_dict=True, cpu_offload=True),
    dict(ignore_frozen_params=True),
    dict(flatten_optimizer_state_dict=True),
    dict(full_state_dict=True, flatten_optimizer_state_dict=True),
    dict(strict=False),
]


@pytest.mark.parametrize("kwargs", OPTION_SETS, ids=lambda k: ",".join(k) or "default")
def test_get_options(kwargs):
    (mu, ou), (md, od) = twins()
    a = upstream.get_state_dict(mu, ou, options=upstream.StateDictOptions(**kwargs))
    b = dcp_optim.get_state_dict(md, od, options=dcp_optim.StateDictOptions(**kwargs))
    assert_same_tree(a, b)
    # full without a process group: new plain dicts, same tensor objects
    if kwargs.get("full_state_dict") and not kwargs.get("cpu_offload"):
        assert type(b[0]) is dict
        live = {id(t) for t in md.state_dict(keep_vars=True).values()}
        assert not any(id(t) in live for t in b[0].values())  # detached views


@pytest.mark.parametrize("keep", [True, False])
def test_deprecated_submodules(keep):
    (mu, _), (md, _) = twins()
    opts = dict(keep_submodule_prefixes=keep)
    with pytest.warns(FutureWarning, match="Getting submodules only"):
        a = upstream.get_model_state_dict(
            mu, submodules={mu.encoder}, options=upstream.StateDictOptions(**opts)
        )
    with pytest.warns(FutureWarning, match="Getting submodules only"):
        b = dcp_optim.get_model_state_dict(
            md, submodules={md.encoder}, options=dcp_optim.StateDictOptions(**opts)
        )
    assert_same_tree(a, b)
    assert list(b) == (["encoder.0.weight", "encoder.0.bias", "encoder.1.weight", "encoder.1.bias"]
                       if keep else ["0.weight", "0.bias", "1.weight", "1.bias"])


def test_deprecated_module_keyed_load():
    (mu, _), (md, _) = twins()
    src = Model()
    with pytest.warns(FutureWarning, match="Passing model_state_dict as a"):
        ra = upstream.set_model_state_dict(
            mu, {mu.encoder: src.encoder.state_dict()}, options=upstream.StateDictOptions(strict=False)
        )
    with pytest.warns(FutureWarning, match="Passing model_state_dict as a"):
        rb = dcp_optim.set_model_state_dict(
            md, {md.encoder: src.encoder.state_dict()}, options=dcp_optim.StateDictOptions(strict=False)
        )
    assert ra == rb
    assert_same_tree(params_snapshot(mu), params_snapshot(md))


def test_strict_false_model_load_reports_like_upstream():
    (mu, _), (md, _) = twins()
    sd = {k: v for k, v in upstream.get_model_state_dict(mu).items() if k != "decoder.bias"}
    sd["unknown.weight"] = torch.zeros(1)
    ra = upstream.set_model_state_dict(mu, dict(sd), options=upstream.StateDictOptions(strict=False))
    rb = dcp_optim.set_model_state_dict(md, dict(sd), options=dcp_optim.StateDictOptions(strict=False))
    assert ra == rb
    assert rb.missing_keys == ["decoder.bias"] and rb.unexpected_keys == ["unknown.weight"]


def test_full_state_dict_load():
    (mu, ou), (md, od) = twins()
    src, _ = twins()[0]
    with torch.no_grad():
        for p in src.parameters():
            p.add_(1.0)
    full = dict(upstream.get_model_state_dict(src, options=upstream.StateDictOptions(full_state_dict=True)))
    partial = dict(full)
    del partial["decoder.weight"]
    for sd in (full, partial):
        ra = upstream.set_model_state_dict(mu, dict(sd), options=upstream.StateDictOptions(full_state_dict=True))
        rb = dcp_optim.set_model_state_dict(md, dict(sd), options=dcp_optim.StateDictOptions(full_state_dict=True))
        assert ra == rb
        assert_same_tree(params_snapshot(mu), params_snapshot(md))
    # optimizer full load
    osd = upstream.get_optimizer_state_dict(mu, ou, options=upstream.StateDictOptions(full_state_dict=True))
    upstream.set_optimizer_state_dict(mu, ou, osd, options=upstream.StateDictOptions(full_state_dict=True))
    dcp_optim.set_optimizer_state_dict(md, od, osd, options=dcp_optim.StateDictOptions(full_state_dict=True))
    # D8 in docs/differences.md: upstream's full path turns tuples into lists; dcp_optim keeps them
    assert type(ou.param_groups[0]["betas"]) is list
    assert type(od.param_groups[0]["betas"]) is tuple
    ou.param_groups[0]["betas"] = tuple(ou.param_groups[0]["betas"])
    assert_same_optimizers(ou, od)


def test_world1_full_offload_and_broadcast(world1):
    (mu, ou), (md, od) = twins()
    opts = dict(full_state_dict=True, cpu_offload=True)
    assert_same_tree(
        upstream.get_state_dict(mu, ou, options=upstream.StateDictOptions(**opts)),
        dcp_optim.get_state_dict(md, od, options=dcp_optim.StateDictOptions(**opts)),
    )
    msd, osd = upstream.get_state_dict(mu, ou, options=upstream.StateDictOptions(full_state_dict=True))
    bc = dict(full_state_dict=True, broadcast_from_rank0=True)
    upstream.set_state_dict(mu, ou, model_state_dict=dict(msd), optim_state_dict=osd,
                            options=upstream.StateDictOptions(**bc))
    dcp_optim.set_state_dict(md, od, model_state_dict=dict(msd), optim_state_dict=osd,
                             options=dcp_optim.StateDictOptions(**bc))
    assert_same_tree(params_snapshot(mu), params_snapshot(md))
    # D8 in docs/differences.md: upstream's full path turns tuples into lists
    assert type(ou.param_groups[0]["betas"]) is list
    ou.param_groups[0]["betas"] = tuple(ou.param_groups[0]["betas"])
    assert_same_optimizers(ou, od)


def test_empty_optimizer_iterable_in_get_state_dict():
    (mu, _), (md, _) = twins()
    a = upstream.get_state_dict(mu, [])
    b = dcp_optim.get_state_dict(md, [])
    assert_same_tree(a, b)
    assert b[1] == {}


def test_patch_functions_match_upstream():
    (mu, ou), (md, od) = twins()
    upstream._patch_model_state_dict(mu)
    upstream._patch_optimizer_state_dict(mu, optimizers=(ou,))
    dcp_optim._patch_model_state_dict(md)
    dcp_optim._patch_optimizer_state_dict(md, optimizers=(od,))
    assert_same_tree(mu.state_dict(), md.state_dict())
    assert_same_tree(ou.state_dict(), od.state_dict())
    sd_u, sd_d = mu.state_dict(), md.state_dict()
    assert mu.load_state_dict(sd_u) is None and md.load_state_dict(sd_d) is None
    ou.load_state_dict(ou.state_dict())
    od.load_state_dict(od.state_dict())
    assert_same_optimizers(ou, od)


def test_options_object_is_not_mutated():
    (md, od) = twins()[1]
    opts = dcp_optim.StateDictOptions(full_state_dict=True)
    before = dataclass_values(opts)
    osd = dcp_optim.get_optimizer_state_dict(md, od, options=opts)
    dcp_optim.set_optimizer_state_dict(md, od, osd, options=opts)
    assert dataclass_values(opts) == before


def dataclass_values(opts):
    import dataclasses

    return dataclasses.astuple(opts)


def test_no_warnings_in_normal_use():
    (md, od) = twins()[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        msd, osd = dcp_optim.get_state_dict(md, od)
        dcp_optim.set_state_dict(md, od, model_state_dict=msd, optim_state_dict=osd)
