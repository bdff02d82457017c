"""FSDP1 (FullyShardedDataParallel) optimizer state through FSDP's own
APIs, as upstream does; FQN surgery for compiled submodules included."""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp._init_utils import HYBRID_SHARDING_STRATEGIES

from ._core import C, context
from ._model import state_dict_fn


def fsdp_process_group(model: nn.Module, info: Any):
    """SPEC 3.7 / D18: the FSDP1 instance's process group (None for HSDP)."""
    if isinstance(model, FSDP):
        fsdp_module = model
    elif info.fsdp_modules:
        fsdp_module = info.fsdp_modules[0]
    else:
        return None
    if fsdp_module.sharding_strategy in HYBRID_SHARDING_STRATEGIES:
        return None
    group = fsdp_module.process_group
    return None if isinstance(group, tuple) else group


def get_fsdp1_optim(model: nn.Module, optimizers, info: Any) -> dict[str, Any]:
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for optim in optimizers:
        osd = state_dict_fn(optim, "state_dict")()
        with info.fsdp_context():
            osd = FSDP.optim_state_dict(
                model, optim, osd, group=fsdp_process_group(model, info)
            )
        if not osd:
            continue
        for key in list(osd["state"].keys()):
            if "_orig_mod" in key:
                osd["state"][key.replace("_orig_mod.", "")] = osd["state"].pop(key)
        for group in osd["param_groups"]:
            group["params"] = [k.replace("_orig_mod.", "") for k in group["params"]]
        state.update(osd["state"])
        groups.extend(osd["param_groups"])
    return {"state": state, "param_groups": groups}


def load_fsdp1_optim(model: nn.Module, optimizers, osd: dict[str, Any], info: Any):
    from torch.distributed.checkpoint import state_dict as upstream

    ctx = context()
    for optim in optimizers:
        if osd:
            if "state" in osd:
                split = upstream._split_optim_state_dict(model, optim, osd, _compat_info(model, info))
            else:
                split = upstream._unflatten_optim_state_dict(optim, osd, _compat_info(model, info))
        else:
            split = {}
        for original_fqn, _ in model.named_parameters():
            fqns = C.get_fqns(ctx, model, original_fqn, "_fqn_modifiers", True, True)
            with_compiler = C.get_fqns(ctx, model, original_fqn, "_fqn_modifiers", True, False)
            if fqns == with_compiler:
                continue
            if len(fqns) != 1:
                raise AssertionError(f"Expected 1 FQN for '{original_fqn}', got {len(fqns)}")
            fqn = fqns.pop()
            fqn_with_compiler = with_compiler.pop()
            for g in split["param_groups"]:
                g["params"] = [k.replace(fqn, fqn_with_compiler) for k in g["params"]]
            for k in list(split["state"].keys()):
                if fqn in k:
                    split["state"][k.replace(fqn, fqn_with_compiler)] = split["state"].pop(k)
        with info.fsdp_context():
            split = FSDP.optim_state_dict_to_load(
                model, optim, split, group=fsdp_process_group(model, info)
            )
        state_dict_fn(optim, "load_state_dict")(state_dict=split)
    return None


def _compat_info(model: nn.Module, info: Any):
    from ._verify import _verify_options

    compat = _verify_options(model, (), optim_only=False, options=None)
    compat.strict = info.strict
    return compat
