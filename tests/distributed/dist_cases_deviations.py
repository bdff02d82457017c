"""Issue 3's corrections under sharding: the same scenarios as
tests/unit/test_deviations.py on an FSDP2 model (2 gloo ranks, uneven shards),
in the nested and the flattened format.

Each scenario runs on dcp_optim (must pass) and, where upstream is known to
be wrong, on upstream too: the rank function returns, per scenario, "ok" or
the failure text for each implementation, and tests/distributed/test_deviations_sharded.py
asserts dcp_optim's passes and upstream's fails (a strict expected failure,
as in the single-process tests).
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as upstream
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import dcp_optim

from ..support.oracle import assert_same_tree, optimizer_snapshot, params_snapshot
from .dist_cases import fsdp2_model, train


def _opts(impl, flat: bool, **kw):
    return impl.StateDictOptions(flatten_optimizer_state_dict=flat, **kw)


def _adamw(model, groups=None):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(groups(params) if groups else params, lr=0.01, weight_decay=0.1)


def _local(value):
    return value.to_local() if isinstance(value, DTensor) else value


def _run(fn: Callable[[], None]) -> str:
    try:
        fn()
        return "ok"
    except Exception as exc:  # noqa: BLE001 - the failure is the result
        return f"{type(exc).__name__}: {exc}"[:400] or traceback.format_exc(limit=2)


def _conv_model(mesh) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 5, 3), torch.nn.Conv2d(5, 7, 3))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class _RowNorm(torch.optim.Optimizer):
    """SGD that keeps, for 2-D parameters, a per-row norm of shape (rows,
    1) -- a DTensor under FSDP2, not shaped like its parameter -- and uses
    it in its update (as pytorch-optimizer's Nero keeps its norms)."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.01})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dim() == 2:
                    state = self.state[p]
                    norm = p.grad.norm(dim=1, keepdim=True)
                    state["row"] = state["row"] * 0.9 + norm if "row" in state else norm
                    p.add_(p.grad / (state["row"] + 1.0), alpha=-group["lr"])
                else:
                    p.add_(p.grad, alpha=-group["lr"])


class _WholeSum(torch.optim.Optimizer):
    """Keeps each DTensor parameter's gradient sum whole, plain, on every
    rank (shaped like the parameter: what heavyball keeps, in a state dict
    a full get can gather)."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                whole = p.grad.full_tensor()
                if "whole" not in state:
                    state["whole"] = torch.zeros_like(whole)
                state["whole"].add_(whole)
                p.add_(p.grad, alpha=-group["lr"])


def deviations_fsdp2(rank: int, ws: int) -> dict[str, dict[str, str]]:
    mesh = init_device_mesh("cpu", (ws,))

    def build(seed=0, frozen=False):
        return fsdp2_model(mesh, seed, frozen=frozen)

    results: dict[str, dict[str, str]] = {}

    for flat in (False, True):
        fmt = "flat" if flat else "nested"

        # 1. a get never changes training (AdamW: upstream's fake step
        #    starts `step` at 1, so bias correction differs from then on)
        def getters_change_nothing(impl, flat=flat):
            m0 = build()
            o0 = _adamw(m0)
            m3 = build()
            o3 = _adamw(m3)
            for _ in range(3):
                impl.get_optimizer_state_dict(m3, o3, options=_opts(impl, flat))
            train(m0, o0, steps=2, seed=1)
            train(m3, o3, steps=2, seed=1)
            assert_same_tree(params_snapshot(m0), params_snapshot(m3))
            assert_same_tree(optimizer_snapshot([o0]), optimizer_snapshot([o3]))

        # 2. a never-stepped template loads back and trains like a fresh
        #    optimizer
        def never_stepped_round_trip(impl, flat=flat):
            src = build()
            src_o = _adamw(src)
            osd = impl.get_optimizer_state_dict(src, src_o, options=_opts(impl, flat))
            dst = build()
            dst_o = _adamw(dst)
            impl.set_optimizer_state_dict(dst, dst_o, osd, options=_opts(impl, flat))
            ref = build()
            ref_o = _adamw(ref)
            train(dst, dst_o, steps=2, seed=2)
            train(ref, ref_o, steps=2, seed=2)
            assert_same_tree(params_snapshot(ref), params_snapshot(dst))

        # 3. right after backward(), before the first step: every trainable
        #    parameter has (pristine) state
        def state_after_backward(impl, flat=flat):
            m = build()
            o = _adamw(m)
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
            m(x).backward()
            osd = impl.get_optimizer_state_dict(m, o, options=_opts(impl, flat))
            if flat:
                names = {k.split(".", 1)[1].rsplit(".", 1)[0] for k in osd if k.startswith("state.")}
            else:
                names = set(osd["state"])
            expected = {n for n, p in m.named_parameters() if p.requires_grad}
            assert names == expected, sorted(expected - names)[:3]

        # 4. partial loads: strict=False leaves the missing parameter
        #    pristine and loads the rest; strict=True names it
        def partial_load(impl, flat=flat):
            src = build()
            src_o = _adamw(src)
            train(src, src_o, steps=2, seed=4)
            osd = impl.get_optimizer_state_dict(src, src_o, options=_opts(impl, flat))
            gone = "layers.1.up.weight"
            if flat:
                osd = {k: v for k, v in osd.items() if not k.startswith(f"state.{gone}.")}
            else:
                osd = {"state": {k: v for k, v in osd["state"].items() if k != gone},
                       "param_groups": osd["param_groups"]}
            dst = build(seed=6)
            dst_o = _adamw(dst)
            impl.set_optimizer_state_dict(dst, dst_o, osd, options=_opts(impl, flat, strict=False))
            params = dict(dst.named_parameters())
            src_params = dict(src.named_parameters())
            assert dst_o.state.get(params[gone], {}).get("step", torch.tensor(0.0)).item() == 0.0
            loaded = dst_o.state[params["head.weight"]]["exp_avg"]
            assert torch.equal(_local(loaded), _local(src_o.state[src_params["head.weight"]]["exp_avg"]))
            dst2 = build(seed=6)
            dst2_o = _adamw(dst2)
            try:
                impl.set_optimizer_state_dict(dst2, dst2_o, osd, options=_opts(impl, flat, strict=True))
            except Exception as exc:  # noqa: BLE001
                assert gone in str(exc), exc
            else:
                raise AssertionError("strict=True accepted missing state")

        # 5. trained-then-frozen parameters keep their saved state
        def trained_then_frozen(impl, flat=flat):
            src = build()
            src_o = _adamw(src)
            train(src, src_o, steps=2, seed=5)
            for p in src.layers[0].parameters():
                p.requires_grad_(False)
            osd = impl.get_optimizer_state_dict(src, src_o, options=_opts(impl, flat))
            dst = build(seed=8)
            for p in dst.layers[0].parameters():
                p.requires_grad_(False)
            dst_o = torch.optim.AdamW(dst.parameters(), lr=0.01, weight_decay=0.1)
            impl.set_optimizer_state_dict(dst, dst_o, osd, options=_opts(impl, flat))
            frozen = dict(dst.named_parameters())["layers.0.up.weight"]
            src_frozen = dict(src.named_parameters())["layers.0.up.weight"]
            assert frozen in dst_o.state, "the frozen parameter's saved state was dropped"
            assert torch.equal(_local(dst_o.state[frozen]["exp_avg"]), _local(src_o.state[src_frozen]["exp_avg"]))

        # 6. empty groups (two of them) and every group key survive; step()
        #    works after the load
        def empty_groups_and_keys(impl, flat=flat):
            def groups(params):
                return [
                    {"params": [], "lr": 0.5, "name": "empty-a"},
                    {"params": params[:4], "lr_mult": 2.0, "name": "first"},
                    {"params": [], "lr": 0.25, "name": "empty-b"},
                    {"params": params[4:], "name": "rest"},
                ]

            src = build()
            src_o = _adamw(src, groups)
            sched = torch.optim.lr_scheduler.LambdaLR(src_o, lambda step: 0.5 ** step)
            train(src, src_o, steps=2, seed=6)
            sched.step()
            osd = impl.get_optimizer_state_dict(src, src_o, options=_opts(impl, flat))
            dst = build(seed=9)
            dst_o = _adamw(dst, groups)
            impl.set_optimizer_state_dict(dst, dst_o, osd, options=_opts(impl, flat))
            for a, b in zip(src_o.param_groups, dst_o.param_groups):
                assert {k: v for k, v in a.items() if k != "params"} == {k: v for k, v in b.items() if k != "params"}, (a.get("name"), b.get("name"))
            train(dst, dst_o, steps=1, seed=7)

        # 9. types survive: bf16 moments stay bf16 DTensors with the
        #    parameter's placements
        def low_precision_state(impl, flat=flat):
            src = build()
            src_o = _adamw(src)
            train(src, src_o, steps=1, seed=8)
            for st in src_o.state.values():
                for k in ("exp_avg", "exp_avg_sq"):
                    st[k] = st[k].to(torch.bfloat16)
            osd = impl.get_optimizer_state_dict(src, src_o, options=_opts(impl, flat))
            dst = build(seed=10)
            dst_o = _adamw(dst)
            # holds bf16 moments (a never-stepped optimizer casts to the
            # parameter dtype, as torch: tests/distributed/dist_cases_precision.py)
            train(dst, dst_o, steps=1, seed=9)
            for st in dst_o.state.values():
                for k in ("exp_avg", "exp_avg_sq"):
                    st[k] = st[k].to(torch.bfloat16)
            impl.set_optimizer_state_dict(dst, dst_o, osd, options=_opts(impl, flat))
            for p, st in dst_o.state.items():
                assert isinstance(st["exp_avg"], DTensor) and st["exp_avg"].placements == p.placements
                assert st["exp_avg"].dtype == torch.bfloat16, st["exp_avg"].dtype

        # 10. a load that fails changes nothing (on every rank)
        def failed_load_changes_nothing(impl, flat=flat):
            src = build()
            src_o = _adamw(src)
            train(src, src_o, steps=1, seed=9)
            osd = impl.get_optimizer_state_dict(src, src_o, options=_opts(impl, flat, full_state_dict=True))
            bad_key = "layers.1.down.weight"
            if flat:
                osd = dict(osd)
                osd[f"state.{bad_key}.exp_avg"] = torch.zeros(3, 3)
            else:
                osd = {"state": {k: dict(v) for k, v in osd["state"].items()}, "param_groups": osd["param_groups"]}
                osd["state"][bad_key]["exp_avg"] = torch.zeros(3, 3)
            dst = build(seed=11)
            dst_o = _adamw(dst)
            train(dst, dst_o, steps=1, seed=10)
            before = optimizer_snapshot([dst_o])
            try:
                impl.set_optimizer_state_dict(dst, dst_o, osd, options=_opts(impl, flat, full_state_dict=True))
            except Exception:  # noqa: BLE001
                pass
            assert_same_tree(before, optimizer_snapshot([dst_o]))

        # 11. broadcast loads of full tensors laid out with other strides
        #     (a transposed weight, as converted checkpoints hold; a
        #     channels_last model's convolutions): every rank loads the
        #     values, not the source's storage order.  The model and the
        #     optimizer apart: upstream's flattened optimizer loads fail
        #     before (12).
        weight = "layers.1.up.weight"

        def strided(t):  # the same values, in the transpose's storage order
            view = t.t().contiguous().t()
            assert torch.equal(view, t) and not view.is_contiguous()
            return view

        def trained_source(impl, flat):
            src = build()
            src_o = _adamw(src)
            train(src, src_o, steps=1, seed=11)
            whole = _opts(impl, flat, full_state_dict=True)
            return impl.get_model_state_dict(src, options=whole), impl.get_optimizer_state_dict(src, src_o, options=whole)

        def trained_destination():
            dst = build(seed=12)
            dst_o = _adamw(dst)
            train(dst, dst_o, steps=1, seed=12)
            return dst, dst_o

        def broadcast_non_contiguous_model(impl, flat=flat, name=weight):
            msd, _ = trained_source(impl, flat)
            dst, _ = trained_destination()
            sent = {k: strided(v) if k == name else v for k, v in msd.items()}
            bcast = _opts(impl, flat, full_state_dict=True, broadcast_from_rank0=True)
            impl.set_model_state_dict(dst, sent if dist.get_rank() == 0 else {}, options=bcast)
            # the full tensor on every rank (a collective): each rank sees every shard
            got = dict(dst.named_parameters())[name].full_tensor()
            assert torch.equal(got, msd[name]), "the weight was loaded scrambled"

        # a bias given as a column of a matrix (a strided 1-d view: every
        # view of it is strided too)
        def broadcast_strided_bias(impl, flat=flat):
            msd, _ = trained_source(impl, flat)
            dst, _ = trained_destination()
            bias = "layers.1.up.bias"
            column = torch.stack([msd[bias], -msd[bias]], dim=1)[:, 0]
            assert torch.equal(column, msd[bias]) and column.stride() == (2,)
            sent = {k: column if k == bias else v for k, v in msd.items()}
            bcast = _opts(impl, flat, full_state_dict=True, broadcast_from_rank0=True)
            impl.set_model_state_dict(dst, sent if dist.get_rank() == 0 else {}, options=bcast)
            got = dict(dst.named_parameters())[bias].full_tensor()
            assert torch.equal(got, msd[bias]), "the bias was loaded scrambled"

        # convolutions saved from a channels_last model
        def broadcast_channels_last(impl, flat=flat):
            conv = _conv_model(mesh)
            g = torch.Generator().manual_seed(13)
            values = {k: torch.randn(tuple(p.shape), generator=g) for k, p in conv.named_parameters()}
            sent = {k: v.contiguous(memory_format=torch.channels_last) if v.dim() == 4 else v
                    for k, v in values.items()}
            assert not sent["1.weight"].is_contiguous()
            bcast = _opts(impl, flat, full_state_dict=True, broadcast_from_rank0=True)
            impl.set_model_state_dict(conv, sent if dist.get_rank() == 0 else {}, options=bcast)
            for k, p in conv.named_parameters():
                assert torch.equal(p.full_tensor(), values[k]), f"{k} was loaded scrambled"

        def broadcast_non_contiguous_optim(impl, flat=flat, name=weight):
            _, osd = trained_source(impl, flat)
            dst, dst_o = trained_destination()
            if flat:
                key = f"state.{name}.exp_avg"
                expected = osd[key]
                sent = {k: strided(v) if k == key else v for k, v in osd.items()}
            else:
                expected = osd["state"][name]["exp_avg"]
                sent = {"state": {k: {kk: strided(vv) if (k, kk) == (name, "exp_avg") else vv
                                      for kk, vv in v.items()} for k, v in osd["state"].items()},
                        "param_groups": osd["param_groups"]}
            bcast = _opts(impl, flat, full_state_dict=True, broadcast_from_rank0=True)
            impl.set_optimizer_state_dict(dst, dst_o, sent if dist.get_rank() == 0 else {}, options=bcast)
            got = dst_o.state[dict(dst.named_parameters())[name]]["exp_avg"].full_tensor()
            assert torch.equal(got, expected), "exp_avg was loaded scrambled"

        # 12. a full optimizer dict (on every rank, no broadcast) loads in
        #     both formats
        def full_optim_load(impl, flat=flat, name=weight):
            _, osd = trained_source(impl, flat)
            dst, dst_o = trained_destination()
            impl.set_optimizer_state_dict(dst, dst_o, osd, options=_opts(impl, flat, full_state_dict=True))
            got = dst_o.state[dict(dst.named_parameters())[name]]["exp_avg"].full_tensor()
            expected = osd[f"state.{name}.exp_avg"] if flat else osd["state"][name]["exp_avg"]
            assert torch.equal(got, expected)

        # 13. a full load of a state the optimizer keeps as a DTensor not
        #     shaped like its parameter (a per-row norm, as Nero's): the
        #     full tensor stays plain, and the next step mixes it with
        #     DTensors.  Refused on every rank, nothing changed.
        def full_load_unshardable_state(impl, flat=flat):
            src = build()
            src_o = _RowNorm(src.parameters())
            train(src, src_o, steps=1, seed=1)
            osd = impl.get_optimizer_state_dict(src, src_o, options=_opts(impl, flat, full_state_dict=True))
            dst = build(seed=3)
            dst_o = _RowNorm(dst.parameters())
            try:
                impl.set_optimizer_state_dict(dst, dst_o, osd, options=_opts(impl, flat, full_state_dict=True))
            except ValueError as exc:
                assert "a full load cannot tell how to shard it" in str(exc), exc
                assert not dst_o.state
                return
            train(dst, dst_o, steps=1, seed=2)  # upstream: the step raises (mixed Tensor and DTensor)

        # 15. an optimizer that keeps its state whole beside DTensor
        #     parameters (heavyball's MSAMLaProp: full tensors, plain, on
        #     every rank; pytorch-optimizer's QHAdam: a 1-element plain
        #     tensor): a sharded load keeps that placement (D9: the live
        #     one).  It made each a shard of the parameter (QHAdam's: a
        #     ValueError), and heavyball's next step mixed shards with
        #     whole tensors.  The resumed step equals the uninterrupted
        #     one bit for bit.  heavyball's state holds a set, which
        #     neither implementation flattens: the nested format only.
        def whole_state_beside_dtensors(impl, flat=flat):
            import heavyball
            from pytorch_optimizer import QHAdam

            heavyball.utils.compile_mode = None
            # (foreach=False: torch 2.11's DTensor has no sharding rule
            # for _foreach_pow, which QHAdam's batched step calls)
            makers = [lambda m: QHAdam(m.parameters(), lr=1e-2, foreach=False)]
            if not flat:
                makers.append(lambda m: heavyball.MSAMLaProp(m.parameters(), lr=1e-2))
            # (maker, full dict broadcast from rank 0): QHAdam's tensors
            # and _WholeSum's (of the parameter's shape) travel whole in a
            # broadcast too; heavyball has no full dict (a set in its
            # state: both implementations' gathers refuse it)
            makers.append(lambda m: _WholeSum(m.parameters()))
            runs = [(m, b) for m in (makers[0], makers[-1]) for b in (False, True)]
            runs += [(m, False) for m in makers[1:-1]]
            for make, bcast in runs:
                src = build()
                src_o = make(src)
                train(src, src_o, steps=2, seed=21)
                opts = _opts(impl, flat, full_state_dict=bcast, broadcast_from_rank0=bcast)
                msd = copy.deepcopy(impl.get_model_state_dict(src, options=opts))
                osd = copy.deepcopy(impl.get_optimizer_state_dict(src, src_o, options=opts))
                if bcast and dist.get_rank() != 0:
                    msd, osd = {}, {}
                dst = build(seed=22)
                dst_o = make(dst)
                impl.set_model_state_dict(dst, msd, options=opts)
                impl.set_optimizer_state_dict(dst, dst_o, osd, options=opts)
                train(src, src_o, steps=1, seed=23)
                train(dst, dst_o, steps=1, seed=23)
                assert_same_tree(params_snapshot(src), params_snapshot(dst))
                if not type(src_o).__module__.startswith("heavyball"):
                    # (heavyball's groups keep a private "_orig_shapes" its
                    # state_dict leaves out: a resume rebuilds it)
                    assert_same_tree(optimizer_snapshot([src_o]), optimizer_snapshot([dst_o]))

        scenarios = {
            "getters_change_nothing": getters_change_nothing,
            "never_stepped_round_trip": never_stepped_round_trip,
            "state_after_backward": state_after_backward,
            "partial_load": partial_load,
            "trained_then_frozen": trained_then_frozen,
            "empty_groups_and_keys": empty_groups_and_keys,
            "low_precision_state": low_precision_state,
            "failed_load_changes_nothing": failed_load_changes_nothing,
            "broadcast_non_contiguous_model": broadcast_non_contiguous_model,
            "broadcast_strided_bias": broadcast_strided_bias,
            "broadcast_channels_last": broadcast_channels_last,
            "broadcast_non_contiguous_optim": broadcast_non_contiguous_optim,
            "full_optim_load": full_optim_load,
            "full_load_unshardable_state": full_load_unshardable_state,
            "whole_state_beside_dtensors": whole_state_beside_dtensors,
        }
        for name, fn in scenarios.items():
            key = f"{name}[{fmt}]"
            results[key] = {}
            for label, impl in (("dcp_optim", dcp_optim), ("upstream", upstream)):
                dist.barrier()
                results[key][label] = _run(lambda fn=fn, impl=impl: fn(impl))
                # a failure on one rank only must not leave the other rank
                # inside a collective: agree before the next scenario
                dist.barrier()
    return results
