"""Precision-changing resumes on an FSDP2 model (2 gloo ranks, uneven
shards): float64 or bf16 Adam moments loaded into a never-stepped AdamW
over float32 parameters, on every distributed load path -- sharded,
full (every rank holds the full dict) and broadcast from rank 0 -- in the
nested and the flattened format.

Torch's ``Optimizer.load_state_dict`` (which upstream calls) casts the
moments to the parameter dtype; dcp_optim does the same for an optimizer
that holds no state.  For each scenario the rank function loads with both
implementations, checks dtypes and placements, takes the next step, and
compares with torch's ``load_state_dict`` of the same state followed by
the same step: "ok" or the failure text, per implementation.
"""

from __future__ import annotations

import copy
import traceback

import torch
import torch.distributed.checkpoint.state_dict as upstream
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import dcp_optim

from ..support.oracle import assert_same_tree, optimizer_snapshot, params_snapshot
from .dist_cases import fsdp2_model, train

PATHS = {
    "sharded": {},
    "full": {"full_state_dict": True},
    "broadcast": {"full_state_dict": True, "broadcast_from_rank0": True},
    # the same load with its tensors streamed, not inline with the
    # source's metadata (which this small model's are otherwise)
    "streamed": {"full_state_dict": True, "broadcast_from_rank0": True},
}


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def _checkpoint(mesh, rank, saved_dtype, flat, options):
    src = fsdp2_model(mesh, seed=0)
    src_o = _adamw(src)
    train(src, src_o, steps=2, seed=1)
    for st in src_o.state.values():
        for k in ("exp_avg", "exp_avg_sq"):
            st[k] = st[k].to(saved_dtype)
    osd = dcp_optim.get_optimizer_state_dict(
        src, src_o, options=dcp_optim.StateDictOptions(flatten_optimizer_state_dict=flat, **options)
    )
    # torch's reference: the same (sharded) state through load_state_dict
    ref = fsdp2_model(mesh, seed=3)
    ref_o = _adamw(ref)
    ref_o.load_state_dict(copy.deepcopy(src_o.state_dict()))
    train(ref, ref_o, steps=1, seed=2)
    if options.get("broadcast_from_rank0") and rank != 0:
        osd = {}
    return osd, (ref, ref_o)


def _load_and_step(impl, mesh, osd, flat, options):
    model = fsdp2_model(mesh, seed=3)
    optim = _adamw(model)  # never stepped: holds no state
    # a copy: a load may alias the given tensors (torch's does), and the
    # step after it would advance them
    impl.set_optimizer_state_dict(
        model, optim, copy.deepcopy(osd), options=impl.StateDictOptions(flatten_optimizer_state_dict=flat, **options)
    )
    loaded = {
        k: (type(v).__name__, v.dtype, getattr(v, "placements", None))
        for st in optim.state.values() for k, v in st.items() if k != "step"
    }
    train(model, optim, steps=1, seed=2)
    return model, optim, loaded


def precision_fsdp2(rank: int, ws: int) -> dict[str, dict[str, str]]:
    mesh = init_device_mesh("cpu", (ws,))
    results: dict[str, dict[str, str]] = {}
    for path, options in PATHS.items():
        for flat in (False, True):
            for saved_dtype in (torch.float64, torch.bfloat16):
                name = f"{path}[{'flat' if flat else 'nested'}-{str(saved_dtype).split('.')[1]}]"
                out = results[name] = {}
                osd, (ref, ref_o) = _checkpoint(mesh, rank, saved_dtype, flat, options)
                try:
                    up_model, up_optim, _ = _load_and_step(upstream, mesh, osd, flat, options)
                    assert_same_tree(params_snapshot(up_model), params_snapshot(ref))
                    out["upstream"] = "ok"
                except Exception as exc:  # noqa: BLE001 - reported
                    out["upstream"] = f"{type(exc).__name__}: {exc}"[:300]
                from dcp_optim._engine import payload as _payload

                inline_bytes = _payload.INLINE_BYTES
                try:
                    if path == "streamed":
                        _payload.INLINE_BYTES = 0
                    model, optim, loaded = _load_and_step(dcp_optim, mesh, osd, flat, options)
                    for key, (kind, dtype, placements) in loaded.items():
                        assert kind == "DTensor" and dtype == torch.float32, (key, kind, dtype)
                        assert placements is not None
                    # the same state and the same next step as torch's
                    # load_state_dict of the same state
                    assert_same_tree(params_snapshot(model), params_snapshot(ref))
                    assert_same_tree(
                        optimizer_snapshot([optim], sort_names=True),
                        optimizer_snapshot([ref_o], sort_names=True),
                    )
                    out["dcp_optim"] = "ok"
                except Exception as exc:  # noqa: BLE001 - reported
                    out["dcp_optim"] = f"{type(exc).__name__}: {exc}"[:300] or traceback.format_exc(limit=2)
                finally:
                    _payload.INLINE_BYTES = inline_bytes
    results["schema_less_fsdp2"] = {"dcp_optim": _run(lambda: _schema_less(mesh))}
    results["extras_broadcast"] = {"dcp_optim": _run(lambda: _extras_broadcast(mesh, rank))}
    return results


class _Counting(torch.optim.SGD):
    """An optimizer whose own state_dict() has a top-level key."""

    def __init__(self, params):
        super().__init__(params, lr=0.1, momentum=0.9)
        self.total = 0

    def step(self, closure=None):
        self.total += 1
        return super().step(closure)

    def state_dict(self):
        return {**super().state_dict(), "total": self.total}

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self.total = state_dict.get("total", 0)


def _extras_broadcast(mesh, rank):
    """A broadcast load gives the source's top-level keys to every rank."""
    src = fsdp2_model(mesh, seed=0)
    src_o = _Counting(src.parameters())
    train(src, src_o, steps=2, seed=5)
    for flat in (False, True):
        options = dict(full_state_dict=True, flatten_optimizer_state_dict=flat)
        osd = dcp_optim.get_optimizer_state_dict(src, src_o, options=dcp_optim.StateDictOptions(**options))
        assert osd["total"] == 2
        dst = fsdp2_model(mesh, seed=0)
        dst_o = _Counting(dst.parameters())
        dcp_optim.set_optimizer_state_dict(
            dst, dst_o, osd if rank == 0 else {},
            options=dcp_optim.StateDictOptions(broadcast_from_rank0=True, **options),
        )
        assert dst_o.total == 2, (rank, dst_o.total)


def _run(fn) -> str:
    try:
        fn()
        return "ok"
    except Exception as exc:  # noqa: BLE001 - reported
        return f"{type(exc).__name__}: {exc}"[:300]


class _SignMomentum(torch.optim.Optimizer):
    """A third-party optimizer without a schema (Lion-like, with state
    from the parameter values and a group key made by the first step)."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr, "beta": 0.9})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["m"] = torch.zeros_like(p)
                    st["p0"] = p.detach().clone()
                st["m"].mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                p.add_(st["m"].sign(), alpha=-group["lr"])


def _schema_less(mesh):
    """The shadow-step template of a never-stepped optimizer over FSDP2
    parameters: DTensors placed like the parameters, from their values;
    a resume through it equals the uninterrupted run."""
    import warnings

    warnings.simplefilter("ignore")
    model = fsdp2_model(mesh, seed=0)
    optim = _SignMomentum(model.parameters(), lr=0.01)
    for flat in (False, True):
        options = dcp_optim.StateDictOptions(flatten_optimizer_state_dict=flat)
        sd = dcp_optim.get_optimizer_state_dict(model, optim, options=options)
        assert len(optim.state) == 0 and "step" not in optim.param_groups[0]
        if not flat:
            for name, p in model.named_parameters():
                st = sd["state"][name]
                assert sorted(st) == ["m", "p0"], sorted(st)
                assert isinstance(st["p0"], DTensor) and st["p0"].placements == p.placements
                assert torch.equal(st["p0"].to_local(), p.to_local())
            assert sd["param_groups"][0]["step"] == 0
    ref = fsdp2_model(mesh, seed=0)
    ref_o = _SignMomentum(ref.parameters(), lr=0.01)
    train(ref, ref_o, steps=3, seed=4)
    src = fsdp2_model(mesh, seed=0)
    src_o = _SignMomentum(src.parameters(), lr=0.01)
    train(src, src_o, steps=2, seed=4)
    sd = copy.deepcopy(dcp_optim.get_optimizer_state_dict(src, src_o))
    dst = fsdp2_model(mesh, seed=0)
    dst.load_state_dict(src.state_dict())
    dst_o = _SignMomentum(dst.parameters(), lr=0.01)
    template = dcp_optim.get_optimizer_state_dict(dst, dst_o)
    # what dcp.load does: tensors copied into the template's, every other
    # value replaced (the groups' "params" lists too: the template's mark
    # its never-stepped parameters, D48)
    for name, st in sd["state"].items():
        for key, value in st.items():
            target = template["state"][name][key]
            if isinstance(target, torch.Tensor):
                target.copy_(value)
            else:
                template["state"][name][key] = value
    template["param_groups"] = [dict(group) for group in sd["param_groups"]]
    dcp_optim.set_optimizer_state_dict(dst, dst_o, template)
    g = torch.Generator().manual_seed(4 * 100 + 2)
    dst(torch.randn(4, 8, generator=g)).backward()
    dst_o.step()
    assert_same_tree(params_snapshot(dst), params_snapshot(ref))
