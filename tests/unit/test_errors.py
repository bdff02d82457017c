"""Bad input: every case raises a specific error type whose message names
the offending FQN or key -- never a bare KeyError or an AssertionError from
dcp_optim itself -- and a failed load leaves model and optimizer as they
were.  Where upstream raises, the type (and text, where upstream's is
right) is the same."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed.checkpoint.state_dict as upstream
import torch.nn as nn

import dcp_optim
from dcp_optim import StateDictOptions as Opts
from dcp_optim import errors

from ..support.oracle import assert_same_tree, optimizer_snapshot, params_snapshot


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(4, 3)
        self.dec = nn.Linear(3, 2)

    def forward(self, x):
        return self.dec(self.enc(x)).sum()


def trained(seed=0, cls=torch.optim.Adam):
    torch.manual_seed(seed)
    model = Net()
    optim = cls(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def snapshot(model, optim):
    return params_snapshot(model), optimizer_snapshot(optim)


def expect_unchanged(model, optim, fn, exc, match):
    before = snapshot(model, optim)
    with pytest.raises(exc, match=match) as info:
        fn()
    assert_same_tree(snapshot(model, optim), before)
    return info.value


# --- model loads -------------------------------------------------------------


def test_model_shape_mismatch_names_the_key_like_torch():
    src, _ = trained()
    sd = dict(src.state_dict())
    sd["dec.weight"] = torch.zeros(5, 5)
    model, optim = trained(1)
    err = expect_unchanged(model, optim, lambda: dcp_optim.set_model_state_dict(model, sd),
                           RuntimeError, "size mismatch for dec.weight")
    with pytest.raises(RuntimeError) as theirs:
        upstream.set_model_state_dict(trained(1)[0], dict(sd))
    assert str(err) == str(theirs.value)


def test_model_missing_and_unexpected_keys_like_torch():
    src, _ = trained()
    sd = {k: v for k, v in src.state_dict().items() if k != "enc.bias"}
    sd["extra.weight"] = torch.zeros(1)
    model, optim = trained(1)
    err = expect_unchanged(model, optim, lambda: dcp_optim.set_model_state_dict(model, sd),
                           RuntimeError, 'Missing key\\(s\\) in state_dict: "enc.bias"')
    assert 'Unexpected key(s) in state_dict: "extra.weight"' in str(err)
    with pytest.raises(RuntimeError) as theirs:
        upstream.set_model_state_dict(trained(1)[0], dict(sd))
    assert str(err) == str(theirs.value)


def test_model_non_tensor_value_names_the_key():
    src, _ = trained()
    sd = dict(src.state_dict())
    sd["enc.weight"] = [1.0, 2.0]
    model, optim = trained(1)
    expect_unchanged(model, optim, lambda: dcp_optim.set_model_state_dict(model, sd),
                     RuntimeError, 'While copying the parameter named "enc.weight"')


def test_model_state_dict_of_wrong_type():
    model, _ = trained()
    with pytest.raises(TypeError, match="model state dict must be a dict"):
        dcp_optim.set_model_state_dict(model, [("enc.weight", torch.zeros(3, 4))])


def test_not_a_module():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        dcp_optim.get_model_state_dict(object())


# --- optimizer loads ------------------------------------------------------------


def test_optimizer_state_of_wrong_shape_names_fqn_and_key():
    src, src_optim = trained()
    sd = dcp_optim.get_optimizer_state_dict(src, src_optim)
    sd = {"state": {**sd["state"], "enc.bias": {**sd["state"]["enc.bias"], "exp_avg_sq": torch.zeros(7)}},
          "param_groups": sd["param_groups"]}
    model, optim = trained(1)
    err = expect_unchanged(model, optim, lambda: dcp_optim.set_optimizer_state_dict(model, optim, sd),
                           errors.StateDictValueError, "'exp_avg_sq' of parameter 'enc.bias'")
    assert isinstance(err, ValueError)


def test_optimizer_state_of_integer_dtype_is_cast():
    """An int64 ``exp_avg`` is no error: it takes the parameter's dtype,
    as torch's ``load_state_dict`` and upstream cast it (issue 23, D28 in
    docs/differences.md; refused before)."""
    src, src_optim = trained()
    sd = dcp_optim.get_optimizer_state_dict(src, src_optim)
    sd = {"state": {**sd["state"], "dec.weight": {**sd["state"]["dec.weight"],
                                                  "exp_avg": torch.full((2, 3), 3, dtype=torch.int64)}},
          "param_groups": sd["param_groups"]}
    model, optim = trained(1)
    dcp_optim.set_optimizer_state_dict(model, optim, sd)
    got = optim.state[model.dec.weight]["exp_avg"]
    assert got.dtype == model.dec.weight.dtype and bool((got == 3).all())


def test_optimizer_state_value_not_a_tensor():
    src, src_optim = trained()
    sd = dcp_optim.get_optimizer_state_dict(src, src_optim)
    sd = {"state": {**sd["state"], "enc.weight": {**sd["state"]["enc.weight"], "exp_avg": "zeros"}},
          "param_groups": sd["param_groups"]}
    model, optim = trained(1)
    expect_unchanged(model, optim, lambda: dcp_optim.set_optimizer_state_dict(model, optim, sd),
                     ValueError, "'exp_avg' of parameter 'enc.weight' must be a tensor")


def test_state_dict_of_another_optimizer_class():
    src, src_optim = trained(cls=lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9))
    sd = dcp_optim.get_optimizer_state_dict(src, src_optim)
    model, optim = trained(1)  # Adam
    expect_unchanged(model, optim, lambda: dcp_optim.set_optimizer_state_dict(model, optim, sd),
                     ValueError, "parameter 'enc.weight' has no 'step'.*another optimizer class")


def test_strict_missing_optimizer_state_names_every_fqn():
    src, src_optim = trained()
    sd = dcp_optim.get_optimizer_state_dict(src, src_optim)
    sd = {"state": {k: v for k, v in sd["state"].items() if k.startswith("enc.")},
          "param_groups": sd["param_groups"]}
    model, optim = trained(1)
    err = expect_unchanged(model, optim, lambda: dcp_optim.set_optimizer_state_dict(model, optim, sd),
                           RuntimeError, re.escape(upstream_e18("dec.weight")))
    assert isinstance(err, errors.MissingOptimizerStateError)
    assert err.missing == ["dec.weight", "dec.bias"]


def upstream_e18(fqn):
    return (f"Missing optimizer state for parameter '{fqn}' in checkpoint. The parameter requires "
            "gradients but has no saved optimizer state. To load anyway, use StateDictOptions(strict=False).")


def test_param_group_count_mismatch_of_an_id_keyed_dict():
    """An Optimizer.state_dict() (integer IDs) passes through to torch, as
    upstream: torch's own ValueError."""
    src, src_optim = trained()
    native = src_optim.state_dict()
    torch.manual_seed(1)
    model = Net()
    optim = torch.optim.Adam([{"params": list(model.enc.parameters())}, {"params": list(model.dec.parameters())}])
    with pytest.raises(ValueError, match="different number of parameter groups"):
        dcp_optim.set_optimizer_state_dict(model, optim, native)


def test_optimizer_holding_a_parameter_the_model_lacks():
    model, _ = trained()
    stray = nn.Parameter(torch.zeros(2, 2))
    optim = torch.optim.Adam(list(model.parameters()) + [stray])
    with pytest.raises(errors.StateDictKeyError, match="not a parameter of the model") as info:
        dcp_optim.get_optimizer_state_dict(model, optim)
    assert isinstance(info.value, KeyError)
    assert "shape torch.Size([2, 2])" in str(info.value)


def test_composite_optimizer_without_state():
    class Multi(torch.optim.Optimizer):
        def __init__(self):  # deliberately no super().__init__: no state/param_groups
            pass

    model, _ = trained()
    with pytest.raises(TypeError, match="Multi.*no 'param_groups'.*sub-optimizers") as info:
        dcp_optim.get_optimizer_state_dict(model, Multi())
    # what upstream raises reading optimizer.param_groups
    with pytest.raises(AttributeError):
        upstream.get_optimizer_state_dict(model, Multi())
    assert isinstance(info.value, AttributeError)


def test_optimizers_none_is_a_type_error_like_upstream():
    model, _ = trained()
    with pytest.raises(TypeError):
        upstream.get_optimizer_state_dict(model, None)
    with pytest.raises(TypeError):
        dcp_optim.get_optimizer_state_dict(model, None)


def test_flattening_unsupported_state_types():
    model, optim = trained()
    optim.state[model.enc.weight]["note"] = "a string"
    with pytest.raises(NotImplementedError, match="Flattening optimizer state_dict only supports"):
        upstream.get_optimizer_state_dict(model, optim, options=upstream.StateDictOptions(flatten_optimizer_state_dict=True))
    with pytest.raises(NotImplementedError, match="Flattening optimizer state_dict only supports") as info:
        dcp_optim.get_optimizer_state_dict(model, optim, options=Opts(flatten_optimizer_state_dict=True))
    assert "state.enc.weight.note" in " ".join(getattr(info.value, "__notes__", []))


def test_flattened_dict_with_non_string_keys():
    model, optim = trained()
    with pytest.raises(TypeError, match="keys must be str"):
        dcp_optim.set_optimizer_state_dict(model, optim, {("state", "enc.weight"): 1})


# --- options -----------------------------------------------------------------------


def test_broadcast_without_full_state_dict():
    model, optim = trained()
    for impl in (upstream, dcp_optim):
        with pytest.raises(ValueError, match="full_state_dict must be True when broadcast_from_rank0 is True"):
            impl.get_state_dict(model, optim, options=impl.StateDictOptions(broadcast_from_rank0=True))


def test_optimizer_api_without_optimizers():
    model, _ = trained()
    for impl in (upstream, dcp_optim):
        with pytest.raises(RuntimeError, match="Optimizers are not passed in"):
            impl.get_optimizer_state_dict(model, [])


def test_empty_model_state_dict_without_process_group():
    """D14: upstream raises ValueError (from dist.get_rank()) here."""
    with pytest.raises(ValueError):
        upstream.get_model_state_dict(nn.Module())
    with pytest.raises(RuntimeError, match="model state_dict is empty") as info:
        dcp_optim.get_model_state_dict(nn.Module())
    assert "rank" not in str(info.value)


def test_empty_optimizer_state_dict_names_the_optimizer():
    """D14: upstream's text blames the model dict."""
    model, optim = trained()
    with pytest.raises(RuntimeError, match="optimizer state_dict is required.*optim state_dict is empty"):
        dcp_optim.set_optimizer_state_dict(model, optim, {})


def test_flat_param_key_in_model_dict():
    model, _ = trained()
    sd = dict(model.state_dict())
    sd["enc._flat_param"] = torch.zeros(1)
    for impl in (upstream, dcp_optim):
        with pytest.raises(RuntimeError, match="enc._flat_param contains _flat_param"):
            impl.set_model_state_dict(model, dict(sd))


def test_ddp_prefix_missing_key_strict(world1):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(Net())
    sd = dcp_optim.get_model_state_dict(model)
    del sd["dec.bias"]
    for impl in (upstream, dcp_optim):
        with pytest.raises(RuntimeError, match=re.escape("Missing key: dec.bias.")):
            impl.set_model_state_dict(model, dict(sd))
