"""Model loads where modules decide how they load (issue 12, defect 2 and
the model part of defect 6).

Every case loads the same state dict with torch's
``Module.load_state_dict``, upstream's ``set_model_state_dict`` and
dcp_optim's: dcp_optim must accept what torch accepts, report the same
missing/unexpected keys, write the same values and raise torch's error
where torch raises -- and then, unlike torch and upstream, leave the model
as it was.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
import torch.distributed.checkpoint.state_dict as upstream
import torch.nn as nn

import dcp_optim
from dcp_optim import errors

from ..support.module_cases import (
    Extra,
    FrozenBatchNorm2d,
    RenamingLinear,
    Scalar,
    SetOnlyExtra,
    assert_like_torch,
    load_three_ways,
    model_state,
    rename_hook,
    same_state,
)

STRICT = pytest.mark.parametrize("strict", [True, False], ids=["strict", "nonstrict"])
# The in-place full-state-dict path checks the load before any shard is
# written; it needs a process group (world1).
PATHS = pytest.mark.parametrize("full", [False, "full", "broadcast"], ids=["local", "full", "broadcast"])


def _opts(full):
    if full == "broadcast":
        return {"full_state_dict": True, "broadcast_from_rank0": True}
    return {"full_state_dict": True} if full else {}


def bn_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model[1].num_batches_tracked.fill_(7)
    return model


def without(*keys, **extra):
    def make(model):
        sd = {k: v.detach().clone() + 1 for k, v in model.state_dict().items() if k not in keys}
        sd.update(extra)
        return sd
    return make


def _run(full, make_model, make_sd, strict=True):
    return load_three_ways(make_model, make_sd, strict=strict, options=_opts(full))


@pytest.fixture
def maybe_world(request, tmp_path):
    if request.node.callspec.params.get("full"):
        request.getfixturevalue("world1")


# --- BatchNorm's num_batches_tracked -----------------------------------------


@PATHS
@STRICT
def test_batchnorm_checkpoint_without_num_batches_tracked(maybe_world, full, strict):
    """A pre-0.4.1 BatchNorm checkpoint (no num_batches_tracked, no
    version): torch keeps the live counter and reports nothing missing;
    dcp_optim used to reject it under strict."""
    r = _run(full, bn_model, without("1.num_batches_tracked"), strict)
    assert r["torch"][0] == ("ok", [], [])
    assert r["upstream"][0] == ("ok", [], [])
    assert_like_torch(r)
    assert r["dcp_optim"][3][1].num_batches_tracked.item() == 7


@STRICT
def test_batchnorm_version_2_checkpoint_without_counter(strict):
    """With version 2 metadata the counter is required: torch reports it
    missing (strict: raises after copying the rest); dcp_optim raises the
    same error before anything is written."""
    def make_sd(model):
        sd = OrderedDict((k, v + 1) for k, v in model.state_dict().items()
                         if k != "1.num_batches_tracked")
        sd._metadata = model.state_dict()._metadata
        return sd

    r = load_three_ways(bn_model, make_sd, strict=strict)
    if strict:
        assert r["torch"][0][0] == "raise" and "1.num_batches_tracked" in str(r["torch"][0][1])
        assert not same_state(r["torch"][1], r["torch"][2])  # torch: half-loaded
    else:
        assert r["torch"][0] == ("ok", ["1.num_batches_tracked"], [])
    assert_like_torch(r)


def test_batchnorm_stopped_tracking_reports_counter_missing():
    def make_model():
        model = bn_model()
        model[1].track_running_stats = False
        return model

    r = load_three_ways(make_model, without("1.num_batches_tracked"), strict=False)
    assert r["torch"][0] == ("ok", ["1.num_batches_tracked"], [])
    assert_like_torch(r)


def test_batchnorm_without_counter_buffer():
    """track_running_stats with the counter set to None: torch inserts a
    0 that no buffer takes (an unexpected key)."""
    def make_model():
        model = bn_model()
        model[1].num_batches_tracked = None
        return model

    for strict in (True, False):
        r = load_three_ways(make_model, without(), strict=strict)
        assert_like_torch(r)


# --- modules overriding _load_from_state_dict --------------------------------


def frozen_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 1, bias=False), FrozenBatchNorm2d(3))


@PATHS
@STRICT
def test_frozen_batchnorm_receives_batchnorm_checkpoint(maybe_world, full, strict):
    def make_sd(model):
        sd = {k: v + 1 for k, v in model.state_dict().items()}
        sd["1.num_batches_tracked"] = torch.tensor(11)
        return sd

    r = _run(full, frozen_model, make_sd, strict)
    assert r["torch"][0] == ("ok", [], [])
    assert r["upstream"][0] == ("ok", [], [])
    assert_like_torch(r)


def renaming_model():
    torch.manual_seed(0)
    return nn.Sequential(RenamingLinear(3, 3), nn.Linear(3, 2))


def old_names(model):
    sd = {k: v + 1 for k, v in model.state_dict().items()}
    sd["0.w"] = sd.pop("0.weight")
    sd["0.b"] = sd.pop("0.bias")
    return sd


@PATHS
@STRICT
def test_module_renaming_an_old_key(maybe_world, full, strict):
    r = _run(full, renaming_model, old_names, strict)
    assert r["torch"][0] == ("ok", [], [])
    assert r["upstream"][0] == ("ok", [], [])
    assert_like_torch(r)


@STRICT
def test_renaming_module_with_a_bad_value_is_restored(strict):
    """torch copies 0.weight (renamed) before finding 1.weight's size
    mismatch; dcp_optim raises the same error and puts 0.weight back."""
    def make_sd(model):
        sd = old_names(model)
        sd["1.weight"] = torch.zeros(5, 5)
        return sd

    r = load_three_ways(renaming_model, make_sd, strict=strict)
    assert r["torch"][0][0] == "raise" and "size mismatch for 1.weight" in str(r["torch"][0][1])
    assert not same_state(r["torch"][1], r["torch"][2])
    assert not same_state(r["upstream"][1], r["upstream"][2])
    assert_like_torch(r)


def test_extra_state_restored_when_the_load_fails():
    def make_model():
        torch.manual_seed(0)
        return nn.Sequential(Extra(2, 2), RenamingLinear(2, 2))

    def make_sd(model):
        sd = dict(model.state_dict())
        sd["0._extra_state"] = {"v": 2}
        sd["1.weight"] = torch.zeros(3)
        return sd

    r = load_three_ways(make_model, make_sd)
    assert r["torch"][3][0].tag == {"v": 2}  # torch: set before the error
    assert_like_torch(r)
    assert r["dcp_optim"][3][0].tag == {"v": 1}


def test_set_extra_state_without_get_extra_state():
    """torch wants an _extra_state key that state_dict() never gives."""
    def make_model():
        torch.manual_seed(0)
        return nn.Sequential(SetOnlyExtra(2, 2))

    for strict in (True, False):
        r = load_three_ways(make_model, without(), strict=strict)
        assert r["torch"][0][0] == ("raise" if strict else "ok")
        assert_like_torch(r)


# --- load_state_dict pre/post hooks ------------------------------------------


def hooked_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    model[0]._register_load_state_dict_pre_hook(rename_hook("kernel", "weight"))
    return model


@PATHS
@STRICT
def test_pre_hook_renaming_a_key(maybe_world, full, strict):
    def make_sd(model):
        sd = {k: v + 1 for k, v in model.state_dict().items()}
        sd["0.kernel"] = sd.pop("0.weight")
        return sd

    r = _run(full, hooked_model, make_sd, strict)
    assert r["torch"][0] == ("ok", [], [])
    assert_like_torch(r)


def test_pre_hook_model_failing_is_restored():
    def make_sd(model):
        sd = {k: v + 1 for k, v in model.state_dict().items()}
        sd["0.kernel"] = sd.pop("0.weight")
        del sd["1.bias"]
        return sd

    r = load_three_ways(hooked_model, make_sd)
    assert r["torch"][0][0] == "raise"
    assert not same_state(r["torch"][1], r["torch"][2])
    assert_like_torch(r)


def post_hooked_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    model.register_load_state_dict_post_hook(lambda module, keys: keys.missing_keys.clear())
    return model


@PATHS
@STRICT
def test_post_hook_clearing_missing_keys(maybe_world, full, strict):
    r = _run(full, post_hooked_model, without("1.bias"), strict)
    assert r["torch"][0] == ("ok", [], [])
    assert r["upstream"][0] == ("ok", [], [])
    assert_like_torch(r)


def test_post_hook_keeping_unexpected_keys():
    r = load_three_ways(post_hooked_model, without("1.bias", extra=torch.ones(1)))
    assert r["torch"][0][0] == "raise" and '"extra"' in str(r["torch"][0][1])
    assert_like_torch(r)


# --- lazy modules ------------------------------------------------------------


def lazy_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.LazyLinear(3), nn.ReLU(), nn.Linear(3, 2))


def lazy_sd(model, in_features=5):
    torch.manual_seed(1)
    return {"0.weight": torch.randn(3, in_features), "0.bias": torch.randn(3),
            "2.weight": torch.randn(2, 3), "2.bias": torch.randn(2)}


@STRICT
def test_lazy_module_materialized_from_loaded_shapes(strict):
    r = load_three_ways(lazy_model, lazy_sd, strict=strict)
    assert r["torch"][0] == ("ok", [], [])
    assert r["upstream"][0] == ("ok", [], [])
    assert_like_torch(r)
    model = r["dcp_optim"][3]
    assert model[0].weight.shape == (3, 5)
    assert model(torch.ones(1, 5)).shape == (1, 2)


@pytest.mark.parametrize("full", ["full", "broadcast"])
def test_lazy_module_full_state_dict(world1, full):
    """Upstream chooses the load device with dim() over the live tensors
    and fails on the uninitialized ones; dcp_optim leaves them out of that
    choice and loads like torch."""
    r = load_three_ways(lazy_model, lazy_sd, options=_opts(full))
    assert r["torch"][0] == ("ok", [], [])
    assert r["upstream"][0][0] == "raise"
    assert "uninitialized parameter" in str(r["upstream"][0][1])
    assert_like_torch(r)


def test_lazy_module_failing_load_stays_uninitialized():
    def make_sd(model):
        sd = lazy_sd(model)
        sd["2.weight"] = torch.zeros(7)
        return sd

    r = load_three_ways(lazy_model, make_sd)
    assert r["torch"][0][0] == "raise"
    assert not same_state(r["torch"][1], r["torch"][2])  # torch: materialized
    assert_like_torch(r)
    model = r["dcp_optim"][3]
    assert nn.parameter.is_lazy(model[0].weight)
    model(torch.ones(1, 4))  # still infers its shape from the first input
    assert model[0].weight.shape == (3, 4)


# --- 0-dim parameters --------------------------------------------------------


@STRICT
def test_zero_dim_parameter_given_two_elements(strict):
    """torch's backward-compatible rule takes a shape-(1,) value for a
    0-dim parameter; a shape-(2,) one is a size mismatch, found by
    dcp_optim's pre-check before ``a`` is written (torch and upstream
    write ``a`` first)."""
    def make_sd(model):
        return {"a": torch.full((4,), 7.0), "s": torch.tensor([2.0, 3.0]), "t": torch.tensor(4)}

    r = load_three_ways(Scalar, make_sd, strict=strict)
    assert r["torch"][0][0] == "raise" and "size mismatch for s" in str(r["torch"][0][1])
    assert not same_state(r["torch"][1], r["torch"][2])
    assert not same_state(r["upstream"][1], r["upstream"][2])
    assert_like_torch(r)


def test_zero_dim_parameter_given_one_element():
    def make_sd(model):
        return {"a": torch.full((4,), 7.0), "s": torch.tensor([2.0]), "t": torch.tensor([4])}

    r = load_three_ways(Scalar, make_sd)
    assert r["torch"][0] == ("ok", [], [])
    assert_like_torch(r)
    assert r["dcp_optim"][3].s.item() == 2.0


# --- the model with an optimizer: nothing installed when the model fails ----


def test_set_state_dict_leaves_optimizer_alone_when_model_rules_fail():
    model = renaming_model()
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 3)).sum().backward()
    optim.step()
    msd, osd = dcp_optim.get_state_dict(model, optim)
    osd["param_groups"][0]["lr"] = 0.5
    msd = old_names(model)
    msd["1.weight"] = torch.zeros(5, 5)
    before, opt_before = model_state(model), optim.state_dict()["param_groups"][0]["lr"]
    with pytest.raises(RuntimeError, match="size mismatch for 1.weight"):
        dcp_optim.set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
    assert same_state(before, model_state(model))
    assert optim.param_groups[0]["lr"] == opt_before


def test_set_state_dict_with_model_rules_resumes_exactly():
    """Model (renaming module, old BatchNorm checkpoint) and optimizer
    together: the next step equals the uninterrupted run's."""
    def train(model, optim, steps, start):
        for s in range(start, start + steps):
            x = torch.randn(4, 3, generator=torch.Generator().manual_seed(s))
            model(x).pow(2).sum().backward()
            optim.step()
            optim.zero_grad()

    def make(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(RenamingLinear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    model, optim = make(0)
    train(model, optim, 2, 0)
    msd, osd = dcp_optim.get_state_dict(model, optim)
    # as read back from an old checkpoint (no version metadata): nothing
    # shared with the live run
    msd, osd = {k: v.clone() for k, v in msd.items()}, copy.deepcopy(osd)
    msd["0.w"] = msd.pop("0.weight")
    del msd["1.num_batches_tracked"]  # the fresh model's counter is kept
    resumed, resumed_optim = make(1)
    resumed[1].num_batches_tracked.copy_(model[1].num_batches_tracked)
    result = dcp_optim.set_state_dict(resumed, resumed_optim, model_state_dict=msd,
                                      optim_state_dict=osd)
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    train(model, optim, 1, 2)
    train(resumed, resumed_optim, 1, 2)
    assert same_state(model_state(model), model_state(resumed))


# --- non-str keys (defect 6, the model part) ---------------------------------


@pytest.mark.parametrize("key", [3, ("0", "weight"), b"0.weight"], ids=["int", "tuple", "bytes"])
@STRICT
def test_non_str_key_is_a_clear_error(key, strict):
    """torch fails on any non-str key (AttributeError or TypeError from
    key.startswith, with strict either way); upstream fails with a bare TypeError
    ("argument of type 'int' is not iterable") for most; dcp_optim raises
    a TypeError naming the key before anything is written."""
    def make_sd(model):
        sd = {k: v + 1 for k, v in model.state_dict().items()}
        sd[key] = torch.ones(1)
        return sd

    r = load_three_ways(bn_model, make_sd, strict=strict)
    assert r["torch"][0][0] == "raise"
    assert isinstance(r["torch"][0][1], (AttributeError, TypeError))
    assert r["upstream"][0][0] == "raise"
    out, before, after, _ = r["dcp_optim"]
    assert out[0] == "raise"
    assert isinstance(out[1], errors.StateDictTypeError) and isinstance(out[1], TypeError)
    assert repr(key) in str(out[1])
    assert same_state(before, after)


def test_non_str_key_upstream_error():
    """Upstream's error for an int key does not name it."""
    model = bn_model()
    sd = dict(model.state_dict())
    sd[3] = torch.ones(1)
    with pytest.raises(TypeError, match="argument of type 'int' is not iterable"):
        upstream.set_model_state_dict(model, sd, options=upstream.StateDictOptions(strict=False))


# --- a model loaded again: the walk's replay sees hooks and rules ------------


def test_hook_added_between_loads_is_honoured():
    """The second call replays the first walk; a post hook registered in
    between must still send the load through torch's rules."""
    model = post_hooked_model()
    ref = post_hooked_model()
    dcp_optim.set_model_state_dict(model, without()(model))
    ref.load_state_dict(without()(ref))
    for m in (model, ref):
        m[1].register_load_state_dict_post_hook(lambda module, keys: keys.unexpected_keys.clear())
    sd = without("1.bias", extra=torch.ones(1))(model)
    expected = ref.load_state_dict(without("1.bias", extra=torch.ones(1))(ref))
    assert tuple(dcp_optim.set_model_state_dict(model, sd)) == tuple(expected) == ([], [])
    assert same_state(model_state(model), model_state(ref))


def test_batchnorm_model_loaded_twice():
    model = bn_model()
    for _ in range(2):
        result = dcp_optim.set_model_state_dict(model, without("1.num_batches_tracked")(model))
        assert tuple(result) == ([], [])
    assert model[1].num_batches_tracked.item() == 7


# --- FSDP2 (one rank): DTensor parameters through torch's path ---------------


def _fsdp2_model():
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(RenamingLinear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    fully_shard(model[0])
    fully_shard(model)
    model(torch.randn(4, 3)).sum().backward()  # FSDP2's own load hooks now registered
    return model


def _full_values(model):
    return [(k, v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone())
            for k, v in model.state_dict().items()]


def _same_values(a, b):
    return [k for k, _ in a] == [k for k, _ in b] and all(
        torch.equal(x, y) for (_, x), (_, y) in zip(a, b))


def test_fsdp2_model_with_own_load_rules(world1):
    """Sharded state dict (DTensors) with an old key name and no BatchNorm
    counter: loaded like torch; a failing load puts the shards back."""
    from torch.distributed.tensor import DTensor

    model = _fsdp2_model()
    sd = {k: v + 1 if v.is_floating_point() else v
          for k, v in dcp_optim.get_model_state_dict(model).items()}
    expected = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sd.items()}
    sd["0.w"] = sd.pop("0.weight")
    del sd["1.num_batches_tracked"]
    assert tuple(dcp_optim.set_model_state_dict(model, sd)) == ([], [])
    got = dict(_full_values(model))
    assert all(torch.equal(got[k], v) for k, v in expected.items() if k != "1.num_batches_tracked")

    before = _full_values(model)
    bad = dict(sd)
    bad["2.weight"] = bad["2.weight"] * 2
    bad["2.bias"] = torch.zeros(5)
    with pytest.raises(RuntimeError, match="size mismatch for 2.bias"):
        dcp_optim.set_model_state_dict(model, bad)
    assert _same_values(before, _full_values(model))


def test_fsdp2_full_state_dict_renamed_key_fails_like_upstream(world1):
    """A full state dict whose key only the module's own code renames: the
    full tensor is never sharded, upstream and torch's copy fail; dcp_optim
    raises the same error and leaves the shards as they were."""
    errors_seen = []
    for impl in (upstream, dcp_optim):
        model = _fsdp2_model()
        full = impl.get_model_state_dict(model, options=impl.StateDictOptions(full_state_dict=True))
        full["0.w"] = full.pop("0.weight") + 1
        before = _full_values(model)
        with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor") as info:
            impl.set_model_state_dict(model, full, options=impl.StateDictOptions(full_state_dict=True))
        errors_seen.append(str(info.value))
        if impl is dcp_optim:
            assert _same_values(before, _full_values(model))
    assert errors_seen[0] == errors_seen[1]
