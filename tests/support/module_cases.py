"""Modules that load by rules of their own, and the three-way comparison
of a model load: torch's ``Module.load_state_dict``, upstream's
``set_model_state_dict`` and dcp_optim's (issue 12, defect 2).

``FrozenBatchNorm2d`` is torchvision's (torchvision.ops.misc), written out
here: torchvision's PyPI wheel is built against the CUDA torch and its
compiled operators do not load with the CPU build (nor, therefore, does
timm, which imports it).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed.checkpoint.state_dict as upstream
import torch.nn as nn
from torch.nn.parameter import is_lazy

import dcp_optim


class FrozenBatchNorm2d(nn.Module):
    """torchvision.ops.misc.FrozenBatchNorm2d: BatchNorm2d with fixed
    statistics and affine parameters, all buffers; loads a BatchNorm
    checkpoint by dropping its num_batches_tracked."""

    def __init__(self, num_features: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.ones(num_features))
        self.register_buffer("bias", torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict,
                              missing_keys, unexpected_keys, error_msgs):
        num_batches_tracked_key = prefix + "num_batches_tracked"
        if num_batches_tracked_key in state_dict:
            del state_dict[num_batches_tracked_key]
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)

    def forward(self, x):
        w = self.weight.reshape(1, -1, 1, 1)
        b = self.bias.reshape(1, -1, 1, 1)
        rv = self.running_var.reshape(1, -1, 1, 1)
        rm = self.running_mean.reshape(1, -1, 1, 1)
        scale = w * (rv + self.eps).rsqrt()
        return x * scale + (b - rm * scale)


class RenamingLinear(nn.Linear):
    """A module that still loads its pre-rename checkpoints: ``w``/``b``
    become ``weight``/``bias`` in its own _load_from_state_dict."""

    def _load_from_state_dict(self, state_dict, prefix, *args):
        for old, new in (("w", "weight"), ("b", "bias")):
            if prefix + old in state_dict:
                state_dict[prefix + new] = state_dict.pop(prefix + old)
        super()._load_from_state_dict(state_dict, prefix, *args)


def rename_hook(old: str, new: str):
    def hook(state_dict, prefix, *args):
        if prefix + old in state_dict:
            state_dict[prefix + new] = state_dict.pop(prefix + old)
    return hook


class Scalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.arange(4.0))
        self.s = nn.Parameter(torch.tensor(1.5))
        self.register_buffer("t", torch.tensor(3))


class Extra(nn.Linear):
    """Extra state through get_/set_extra_state."""

    def __init__(self, *args):
        super().__init__(*args)
        self.tag = {"v": 1}

    def get_extra_state(self):
        return dict(self.tag)

    def set_extra_state(self, state):
        self.tag = dict(state)


class SetOnlyExtra(nn.Linear):
    """set_extra_state without get_extra_state: torch wants an
    ``_extra_state`` key its own state_dict() does not give."""

    def set_extra_state(self, state):
        self.seen = state


# --- comparing loads -------------------------------------------------------


def model_state(model: nn.Module) -> list[tuple[str, str, Any]]:
    """Every parameter and buffer (persistent or not, every name), with its
    class and values; lazy ones as such."""
    out = []
    for name, t in (*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)):
        if is_lazy(t):
            out.append((name, type(t).__name__, "uninitialized"))
        else:
            out.append((name, type(t).__name__, (t.dtype, t.detach().clone())))
    for name, m in model.named_modules():
        if type(m).get_extra_state is not nn.Module.get_extra_state:
            out.append((name + "._extra_state", "extra", m.get_extra_state()))
    return out


def same_state(a, b) -> bool:
    if len(a) != len(b):
        return False
    for (na, ca, va), (nb, cb, vb) in zip(a, b):
        if na != nb or ca != cb:
            return False
        if isinstance(va, tuple) and isinstance(vb, tuple):
            if va[0] != vb[0] or va[1].shape != vb[1].shape or not torch.equal(va[1], vb[1]):
                return False
        elif va != vb:
            return False
    return True


def outcome(fn):
    """("ok", missing, unexpected) or ("raise", exception)."""
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - compared below
        return ("raise", exc)
    return ("ok", list(result.missing_keys), list(result.unexpected_keys))


def load_three_ways(make_model, make_sd, *, strict=True, options=None):
    """Loads make_sd(model) into three copies of make_model(): with torch,
    upstream and dcp_optim.  Returns {name: (outcome, state before, state
    after)}; each state dict is built afresh (nobody sees another's)."""
    options = dict(options or {})
    results = {}
    for name in ("torch", "upstream", "dcp_optim"):
        model = make_model()
        sd = make_sd(model)
        before = model_state(model)
        sd_copy = copy.copy(sd)
        if name == "torch":
            out = outcome(lambda: model.load_state_dict(sd, strict=strict))
        else:
            impl = upstream if name == "upstream" else dcp_optim
            opts = impl.StateDictOptions(strict=strict, **options)
            out = outcome(lambda: impl.set_model_state_dict(model, sd, options=opts))
        if name == "dcp_optim":  # upstream's full path does (D11 in docs/differences.md)
            assert list(sd.keys()) == list(sd_copy.keys()), "dcp_optim mutated the caller's dict"
            assert all(sd[k] is v for k, v in sd_copy.items())
        results[name] = (out, before, model_state(model), model)
    return results


def assert_like_torch(results, *, atomic=True):
    """dcp_optim's load reports, writes and raises what torch's does; when
    torch raises, dcp_optim leaves the model as it was."""
    t_out, _, t_after, _ = results["torch"]
    o_out, o_before, o_after, _ = results["dcp_optim"]
    assert t_out[0] == o_out[0], f"torch {t_out}, dcp_optim {o_out}"
    if t_out[0] == "ok":
        assert t_out[1:] == o_out[1:], f"torch {t_out}, dcp_optim {o_out}"
        assert same_state(t_after, o_after), "dcp_optim wrote other values than torch"
        return
    assert isinstance(o_out[1], type(t_out[1])), f"torch {t_out[1]!r}, dcp_optim {o_out[1]!r}"
    assert str(o_out[1]) == str(t_out[1])
    if atomic:
        assert same_state(o_before, o_after), "dcp_optim left a half-loaded model"
