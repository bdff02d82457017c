"""Rank functions for the gloo canaries (docs/testing.md, "What runs on CPU with gloo").

Each public function runs inside a worker started by ``tests.support.harness.run_ranks``
and returns plain Python data: numbers, lists, strings and dicts. Sub-checks
that might fail on a given torch build catch their own exception and report
``{"error": "<type>: <message>", "traceback": ...}`` instead of aborting the
whole launch, so one launch can settle several questions; the tests decide
what is a failure. Every sub-check also records the warnings torch emitted
while it ran (category, message, location), because an in-process test under
``filterwarnings = error`` would turn each of them into an error.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# ---------------------------------------------------------------------------
# helpers


class _Recorder:
    """Run named sub-checks, capturing errors and warnings per sub-check."""

    def __init__(self) -> None:
        self.results: dict[str, dict] = {}

    @contextlib.contextmanager
    def check(self, name: str):
        entry: dict = {}
        self.results[name] = entry
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                yield entry
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                entry["error"] = f"{type(exc).__name__}: {exc}"
                entry["traceback"] = traceback.format_exc()
        entry["seconds"] = round(time.perf_counter() - t0, 4)
        entry["warnings"] = _format_warnings(caught)


def _format_warnings(caught) -> list[dict]:
    out, seen = [], set()
    for w in caught:
        filename = w.filename
        marker = os.sep + "site-packages" + os.sep
        if marker in filename:
            filename = filename.split(marker, 1)[1]
        item = {
            "category": f"{w.category.__module__}.{w.category.__qualname__}"
            if w.category.__module__ != "builtins"
            else w.category.__qualname__,
            "message": str(w.message),
            "where": f"{filename}:{w.lineno}",
        }
        key = (item["category"], item["message"], item["where"])
        if key not in seen:
            seen.add(key)
            out.append(item)
    return out


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).abs().max().item()) if a.numel() else 0.0


def _full(t):
    """Full (global) value of a DTensor / ShardedTensor / plain tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.full_tensor()
    return t


def _type_name(v) -> str:
    return type(v).__name__


def _mlp(seed: int = 0) -> nn.Sequential:
    # 7 is deliberately not divisible by the world size (FSDP2 padding path).
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 7), nn.ReLU(), nn.Linear(7, 4)
    )


def _batches(steps: int, global_batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(steps, global_batch, 8, generator=g)
    ys = torch.randn(steps, global_batch, 4, generator=g)
    return xs, ys


def _local(t: torch.Tensor, rank: int, ws: int) -> torch.Tensor:
    n = t.shape[0] // ws
    return t[rank * n : (rank + 1) * n]


# ---------------------------------------------------------------------------
# collectives


def _check_collectives(rank: int, ws: int, rec: _Recorder) -> None:
    ranks_mean = sum(range(1, ws + 1)) / ws

    with rec.check("all_reduce_avg") as e:
        t = torch.tensor([1.0, 2.0, 3.0]) * (rank + 1)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        e["got"] = t.tolist()
        e["expected"] = [1.0 * ranks_mean, 2.0 * ranks_mean, 3.0 * ranks_mean]

    with rec.check("all_reduce_avg_int") as e:
        t = torch.tensor([3, 4], dtype=torch.int64) * (rank + 1)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        e["got"] = t.tolist()
        e["dtype"] = str(t.dtype)

    with rec.check("reduce_scatter_tensor_avg") as e:
        k = 3
        inp = torch.arange(ws * k, dtype=torch.float32) + 100.0 * rank
        out = torch.empty(k)
        dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.AVG)
        base = torch.arange(ws * k, dtype=torch.float32)[rank * k : (rank + 1) * k]
        e["got"] = out.tolist()
        e["expected"] = (base + 100.0 * (ws - 1) / 2).tolist()

    with rec.check("reduce_scatter_tensor_sum") as e:
        k = 2
        inp = torch.ones(ws * k) * (rank + 1)
        out = torch.empty(k)
        dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.SUM)
        e["got"] = out.tolist()
        e["expected"] = [float(sum(range(1, ws + 1)))] * k

    with rec.check("reduce_scatter_list_avg") as e:
        chunks = [torch.full((2,), float(10 * r + rank)) for r in range(ws)]
        out = torch.empty(2)
        dist.reduce_scatter(out, chunks, op=dist.ReduceOp.AVG)
        e["got"] = out.tolist()
        e["expected"] = [10.0 * rank + (ws - 1) / 2] * 2

    with rec.check("all_gather_into_tensor") as e:
        inp = torch.full((2,), float(rank))
        flat = torch.empty(ws * 2)
        dist.all_gather_into_tensor(flat, inp)
        e["got"] = flat.tolist()
        e["expected"] = [float(r) for r in range(ws) for _ in range(2)]
        # 2-D input gathered along dim 0 (the form FSDP/DTensor use).
        inp2 = torch.full((2, 3), float(rank))
        out2 = torch.empty(ws * 2, 3)
        dist.all_gather_into_tensor(out2, inp2)
        e["got_2d"] = out2.tolist()
        e["expected_2d"] = [[float(r)] * 3 for r in range(ws) for _ in range(2)]

    with rec.check("all_gather_into_tensor_stacked") as e:
        # The documented "stack" form: output (ws, *input.shape).
        inp = torch.full((2,), float(rank))
        stacked = torch.empty(ws, 2)
        dist.all_gather_into_tensor(stacked, inp)
        e["got"] = stacked.tolist()
        e["expected"] = [[float(r)] * 2 for r in range(ws)]

    with rec.check("all_gather_single") as e:
        inp = torch.full((2,), float(rank))
        flat = torch.empty(ws * 2)
        dist.all_gather_single(flat, inp)
        e["got"] = flat.tolist()
        e["expected"] = [float(r) for r in range(ws) for _ in range(2)]

    with rec.check("reduce_scatter_single_avg") as e:
        inp = torch.arange(ws * 2, dtype=torch.float32) + 100.0 * rank
        out = torch.empty(2)
        dist.reduce_scatter_single(out, inp, op=dist.ReduceOp.AVG)
        e["got"] = out.tolist()
        e["expected"] = (
            torch.arange(ws * 2, dtype=torch.float32)[rank * 2 : (rank + 1) * 2] + 50.0 * (ws - 1)
        ).tolist()

    with rec.check("broadcast") as e:
        t = torch.tensor([10.0 * rank + 1, 2.0])
        dist.broadcast(t, src=ws - 1)
        e["got"] = t.tolist()
        e["expected"] = [10.0 * (ws - 1) + 1, 2.0]

    with rec.check("broadcast_object_list") as e:
        objs = [{"a": 1, "t": (1, 2)}, "hello", None] if rank == 0 else [None, None, None]
        dist.broadcast_object_list(objs, src=0)
        e["got"] = objs
        e["expected"] = [{"a": 1, "t": (1, 2)}, "hello", None]

    with rec.check("all_gather_object") as e:
        out = [None] * ws
        dist.all_gather_object(out, {"rank": rank, "l": [rank] * rank})
        e["got"] = out
        e["expected"] = [{"rank": r, "l": [r] * r} for r in range(ws)]

    with rec.check("scatter_gather_object") as e:
        recv = [None]
        dist.scatter_object_list(recv, [f"item{r}" for r in range(ws)] if rank == 0 else None, src=0)
        gathered = [None] * ws if rank == 0 else None
        dist.gather_object(("r", rank), gathered, dst=0)
        e["scattered"] = recv[0]
        e["gathered"] = [list(x) for x in gathered] if rank == 0 else None

    with rec.check("broadcast_coalesced") as e:
        # Mixed dtypes and shapes; a tiny bucket forces several buckets.
        tensors = [
            torch.full((3,), float(rank + 1)),
            torch.full((2, 2), float(10 * (rank + 1)), dtype=torch.float64),
            torch.arange(5, dtype=torch.int64) * (rank + 1),
            torch.tensor(float(rank + 7)),
        ]
        pg = dist.group.WORLD
        dist._broadcast_coalesced(pg, tensors, 16, 0)
        big = [torch.full((4,), float(rank + 1)) for _ in range(3)]
        dist._broadcast_coalesced(pg, big, 1 << 20, 0)
        e["got"] = [t.tolist() for t in tensors]
        e["expected"] = [[1.0] * 3, [[10.0, 10.0], [10.0, 10.0]], list(range(5)), 7.0]
        e["got_big"] = [t.tolist() for t in big]
        e["expected_big"] = [[1.0] * 4] * 3

    with rec.check("all_to_all_single") as e:
        inp = torch.arange(ws, dtype=torch.float32) + 10.0 * rank
        out = torch.empty(ws)
        dist.all_to_all_single(out, inp)
        e["got"] = out.tolist()
        e["expected"] = [10.0 * r + rank for r in range(ws)]

    with rec.check("all_to_all_list") as e:
        ins = [torch.full((1,), float(10 * rank + r)) for r in range(ws)]
        outs = [torch.empty(1) for _ in range(ws)]
        dist.all_to_all(outs, ins)
        e["got"] = [o.item() for o in outs]
        e["expected"] = [float(10 * r + rank) for r in range(ws)]

    with rec.check("send_recv") as e:
        if ws >= 2:
            if rank == 0:
                dist.send(torch.tensor([42.0]), dst=1)
                w = dist.isend(torch.tensor([43.0]), dst=1)
                w.wait()
            elif rank == 1:
                a, b = torch.empty(1), torch.empty(1)
                dist.recv(a, src=0)
                w = dist.irecv(b, src=0)
                w.wait()
                e["got"] = [a.item(), b.item()]
                e["expected"] = [42.0, 43.0]
        dist.barrier()

    with rec.check("batch_isend_irecv") as e:
        peer = (rank + 1) % ws
        prev = (rank - 1) % ws
        recv = torch.empty(1)
        ops = [
            dist.P2POp(dist.isend, torch.tensor([float(rank)]), peer),
            dist.P2POp(dist.irecv, recv, prev),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        e["got"] = recv.item()
        e["expected"] = float(prev)

    with rec.check("coalescing_manager_all_gather_into_tensor") as e:
        ins = [torch.full((k,), float(10 * rank + k)) for k in (1, 2, 3)]
        outs = [torch.empty(ws * k) for k in (1, 2, 3)]
        with dist._coalescing_manager(async_ops=True) as cm:
            for o, i in zip(outs, ins):
                dist.all_gather_into_tensor(o, i)
        cm.wait()
        sync_outs = [torch.empty(ws * k) for k in (1, 2, 3)]
        with dist._coalescing_manager():
            for o, i in zip(sync_outs, ins):
                dist.all_gather_into_tensor(o, i)
        e["got_async"] = [o.tolist() for o in outs]
        e["got_sync"] = [o.tolist() for o in sync_outs]
        e["expected"] = [[float(10 * r + k) for r in range(ws) for _ in range(k)] for k in (1, 2, 3)]

    with rec.check("coalescing_manager_all_reduce_avg") as e:
        ts = [torch.full((k,), float(rank + 1)) for k in (1, 2)]
        with dist._coalescing_manager(async_ops=True) as cm:
            for t in ts:
                dist.all_reduce(t, op=dist.ReduceOp.AVG)
        cm.wait()
        e["got"] = [t.tolist() for t in ts]
        e["expected"] = [[ranks_mean] * k for k in (1, 2)]

    with rec.check("coalescing_manager_reduce_scatter_avg") as e:
        ins = [torch.arange(ws * k, dtype=torch.float32) + 100.0 * rank for k in (1, 2)]
        outs = [torch.empty(k) for k in (1, 2)]
        with dist._coalescing_manager(async_ops=True) as cm:
            for o, i in zip(outs, ins):
                dist.reduce_scatter_tensor(o, i, op=dist.ReduceOp.AVG)
        cm.wait()
        e["got"] = [o.tolist() for o in outs]
        e["expected"] = [
            (torch.arange(ws * k, dtype=torch.float32)[rank * k : (rank + 1) * k] + 50.0 * (ws - 1)).tolist()
            for k in (1, 2)
        ]

    with rec.check("premul_sum") as e:
        t = torch.ones(2)
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
        e["got"] = t.tolist()

    # Last, because a failing device= call can leave the group in coalescing
    # state (``_coalescing_manager`` has no try/finally).
    with rec.check("coalescing_manager_device_cpu") as e:
        group = dist.group.WORLD
        from torch.distributed.distributed_c10d import _world

        t = torch.full((2,), float(rank + 1))
        try:
            with dist._coalescing_manager(device=torch.device("cpu")):
                dist.all_reduce(t)
            e["raised"] = None
            e["got"] = t.tolist()
        except Exception as exc:  # noqa: BLE001 - the outcome is the finding
            e["raised"] = f"{type(exc).__name__}: {exc}"
        e["left_in_coalescing_state"] = group in _world.pg_coalesce_state
        # Does a plain collective issued now get swallowed by the stale state?
        probe = torch.ones(1)
        dist.all_reduce(probe)
        e["probe_all_reduce_after"] = probe.item()
        _world.pg_coalesce_state.pop(group, None)
        probe2 = torch.ones(1)
        dist.all_reduce(probe2)
        e["probe_all_reduce_after_cleanup"] = probe2.item()


# ---------------------------------------------------------------------------
# FSDP2


def _check_fsdp2_parity(rank: int, ws: int, rec: _Recorder, optim_name: str) -> None:
    steps, per_rank = 3, 4
    with rec.check(f"fsdp2_parity_{optim_name}") as e:
        model, ref = _fsdp2_model(ws, seed=0), _mlp(seed=0)
        make = {
            "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
            "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
        }[optim_name]
        opt, ref_opt = make(model.parameters()), make(ref.parameters())
        xs, ys = _batches(steps, per_rank * ws)
        grad_info = {}
        for s in range(steps):
            loss = F.mse_loss(model(_local(xs[s], rank, ws)), _local(ys[s], rank, ws))
            loss.backward()
            ref_loss = F.mse_loss(ref(xs[s]), ys[s])
            ref_loss.backward()
            if s == 0:
                diffs, ratios = [], []
                for p, rp in zip(model.parameters(), ref.parameters()):
                    g = _full(p.grad)
                    diffs.append(_maxdiff(g, rp.grad))
                    ratios.append(float(g.norm() / rp.grad.norm()))
                grad_info = {"grad_max_abs_diff": max(diffs), "grad_norm_ratios": ratios}
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
        e.update(grad_info)
        e["param_max_abs_diff"] = max(
            _maxdiff(_full(p), rp) for p, rp in zip(model.parameters(), ref.parameters())
        )
        e["param_types"] = sorted({_type_name(p) for p in model.parameters()})
        e["placements"] = sorted({str(p.placements) for p in model.parameters()})
        local_shapes = {n: list(p.to_local().shape) for n, p in model.named_parameters()}
        e["local_shapes"] = local_shapes
        if optim_name == "adam":
            sd_diff = {"exp_avg": 0.0, "exp_avg_sq": 0.0}
            state_types, step_types = set(), set()
            for p, rp in zip(model.parameters(), ref.parameters()):
                st, rst = opt.state[p], ref_opt.state[rp]
                for key in sd_diff:
                    state_types.add(_type_name(st[key]))
                    sd_diff[key] = max(sd_diff[key], _maxdiff(_full(st[key]), rst[key]))
                step_types.add(f"{_type_name(st['step'])}:{st['step'].dtype}:{st['step'].device}:{st['step'].dim()}d")
            e["state_max_abs_diff"] = sd_diff
            e["state_types"] = sorted(state_types)
            e["step_types"] = sorted(step_types)
        e["has_set_force_sum_reduction_for_comms"] = hasattr(
            model, "set_force_sum_reduction_for_comms"
        )
        return model, opt
    return None


def _fsdp2_model(ws: int, seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    model = _mlp(seed)
    for idx in (0, 2, 4):
        fully_shard(model[idx], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _check_fsdp2_dsd(rank: int, ws: int, rec: _Recorder, trained) -> None:
    """Upstream DSD on FSDP2: full + cpu_offload get, broadcast_from_rank0 set.

    Mostly here to record which warnings torch emits on these paths.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if trained is None:
        return
    model, opt = trained
    with rec.check("fsdp2_dsd_full_cpu_offload_get") as e:
        msd, osd = get_state_dict(
            model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        e["model_len"] = len(msd)
        e["optim_state_len"] = len(osd.get("state", {}))
        e["model_value_types"] = sorted({_type_name(v) for v in msd.values()})
        e["model_devices"] = sorted({str(v.device) for v in msd.values()})
    with rec.check("fsdp2_dsd_broadcast_from_rank0_set") as e:
        fresh = _fsdp2_model(ws, seed=99)
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
        # Separate setters, as upstream's test_broadcast_from_rank0 does:
        # set_state_dict() derives optim_only from ``not model_state_dict``
        # per rank, so ranks != 0 (empty dicts) skip the model broadcast that
        # rank 0 enters, and the job deadlocks (seen on 2.13.0).
        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(fresh, msd, options=opts)
        set_optimizer_state_dict(fresh, fresh_opt, osd, options=opts)
        full = StateDictOptions(full_state_dict=True)
        a_m, a_o = get_state_dict(model, opt, options=full)
        b_m, b_o = get_state_dict(fresh, fresh_opt, options=full)
        e["model_keys_equal"] = list(a_m) == list(b_m)
        e["model_max_abs_diff"] = max(_maxdiff(a_m[k], b_m[k]) for k in a_m)
        diff = 0.0
        for fqn, st in a_o["state"].items():
            for k in ("exp_avg", "exp_avg_sq", "step"):
                diff = max(diff, _maxdiff(st[k], b_o["state"][fqn][k]))
        e["optim_max_abs_diff"] = diff


# ---------------------------------------------------------------------------
# FSDP1


def _fsdp1_train_one_step(rank: int, ws: int):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model, ref = _mlp(), _mlp()
    fsdp = FSDP(
        model,
        device_id=torch.device("cpu"),
        use_orig_params=True,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
    )
    opt = torch.optim.Adam(fsdp.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    xs, ys = _batches(1, 4 * ws)
    F.mse_loss(fsdp(_local(xs[0], rank, ws)), _local(ys[0], rank, ws)).backward()
    opt.step()
    F.mse_loss(ref(xs[0]), ys[0]).backward()
    ref_opt.step()
    return fsdp, opt, ref, ref_opt


def _compare_full_dicts(msd, osd, ref, ref_opt) -> dict:
    ref_params = dict(ref.named_parameters())
    out = {
        "model_keys": list(msd.keys()),
        "model_value_types": sorted({_type_name(v) for v in msd.values()}),
        "model_devices": sorted({str(v.device) for v in msd.values()}),
        "model_max_abs_diff": max(_maxdiff(msd[k], ref_params[k]) for k in ref_params),
        "optim_state_keys": sorted(osd["state"].keys()),
        "optim_value_types": sorted(
            {_type_name(v) for st in osd["state"].values() for v in st.values()}
        ),
    }
    diff = 0.0
    for name, rp in ref_params.items():
        st, rst = osd["state"][name], ref_opt.state[rp]
        for key in ("exp_avg", "exp_avg_sq"):
            diff = max(diff, _maxdiff(st[key], rst[key]))
    out["optim_max_abs_diff"] = diff
    return out


def _check_fsdp1(rank: int, ws: int, rec: _Recorder) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with rec.check("fsdp1_without_device_id") as e:
        try:
            FSDP(_mlp(), use_orig_params=True)
            e["raised"] = None
        except Exception as exc:  # noqa: BLE001 - the outcome is the finding
            e["raised"] = f"{type(exc).__name__}: {exc}"

    state = {}
    with rec.check("fsdp1_train_step") as e:
        fsdp, opt, ref, ref_opt = _fsdp1_train_one_step(rank, ws)
        state.update(fsdp=fsdp, opt=opt, ref=ref, ref_opt=ref_opt)
        e["ok"] = True

    if not state:
        return
    with rec.check("fsdp1_get_state_dict_full") as e:
        msd, osd = get_state_dict(
            state["fsdp"], state["opt"], options=StateDictOptions(full_state_dict=True)
        )
        e.update(_compare_full_dicts(msd, osd, state["ref"], state["ref_opt"]))

    with rec.check("fsdp1_get_state_dict_sharded") as e:
        msd, osd = get_state_dict(state["fsdp"], state["opt"])
        e["model_value_types"] = sorted({_type_name(v) for v in msd.values()})
        e["optim_value_types"] = sorted(
            {_type_name(v) for st in osd["state"].values() for v in st.values()}
        )
        e["model_keys"] = list(msd.keys())


def fsdp1_full_cpu_offload(rank: int, ws: int) -> dict:
    """Upstream get_state_dict(full_state_dict=True, cpu_offload=True) on FSDP1.

    docs/testing.md, pitfall 2: FSDP1's ``offload_to_cpu`` frees storage that is
    already on CPU (pytorch#188989). Runs in its own launch because it may
    SIGSEGV; afterwards trains one more step and reads the dict again to see
    whether the live parameters survived.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    rec = _Recorder()
    fsdp, opt, ref, ref_opt = _fsdp1_train_one_step(rank, ws)
    with rec.check("fsdp1_full_cpu_offload") as e:
        msd, osd = get_state_dict(
            fsdp, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        e.update(_compare_full_dicts(msd, osd, ref, ref_opt))
    with rec.check("fsdp1_after_offload_step") as e:
        xs, ys = _batches(2, 4 * ws)
        F.mse_loss(fsdp(_local(xs[1], rank, ws)), _local(ys[1], rank, ws)).backward()
        opt.step()
        F.mse_loss(ref(xs[1]), ys[1]).backward()
        ref_opt.step()
        msd, osd = get_state_dict(fsdp, opt, options=StateDictOptions(full_state_dict=True))
        e.update(_compare_full_dicts(msd, osd, ref, ref_opt))
    return {"pid": os.getpid(), "torch": torch.__version__, "checks": rec.results}


# ---------------------------------------------------------------------------
# the ws=2 canary launch


def canary_ws2(rank: int, ws: int) -> dict:
    """Collectives, FSDP2 parity (Adam and SGD) and FSDP1, in one launch."""
    rec = _Recorder()
    t0 = time.perf_counter()
    _check_collectives(rank, ws, rec)
    dist.barrier()
    trained = _check_fsdp2_parity(rank, ws, rec, "adam")
    dist.barrier()
    _check_fsdp2_dsd(rank, ws, rec, trained)
    dist.barrier()
    _check_fsdp2_parity(rank, ws, rec, "sgd")
    dist.barrier()
    _check_fsdp1(rank, ws, rec)
    dist.barrier()
    return {
        "rank": rank,
        "torch": torch.__version__,
        "backend": dist.get_backend(),
        "num_threads": torch.get_num_threads(),
        "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME")},
        "seconds": round(time.perf_counter() - t0, 3),
        "checks": rec.results,
    }


# ---------------------------------------------------------------------------
# 2-D (dp x tp) at ws=4, then DCP load at ws=2 / ws=1


class TPMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(16, 32)
        self.out_proj = nn.Linear(32, 16)

    def forward(self, x):
        return self.out_proj(F.relu(self.in_proj(x)))


def _tp_mlp(seed: int = 0) -> TPMLP:
    torch.manual_seed(seed)
    return TPMLP()


def _tp_batch(global_batch: int = 8):
    g = torch.Generator().manual_seed(3)
    return torch.randn(global_batch, 16, generator=g)


def _full_state_lists(msd, osd) -> dict:
    """Full values as nested lists: {"model": {fqn: ...}, "optim": {fqn: {k: ...}}}."""
    model = {k: _full(v).tolist() for k, v in msd.items()}
    optim = {}
    for fqn, st in osd["state"].items():
        optim[fqn] = {k: (_full(v).tolist() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
    return {"model": model, "optim": optim}


def fsdp2_tp_save_ws4(rank: int, ws: int, ckpt_dir: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    rec = _Recorder()
    out: dict = {}
    with rec.check("fsdp2_tp_step") as e:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model, ref = _tp_mlp(), _tp_mlp()
        parallelize_module(
            model, mesh["tp"], {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}
        )
        fully_shard(model, mesh=mesh["dp"])
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
        x = _tp_batch()
        dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
        model(_local(x, dp_rank, dp_size)).pow(2).mean().backward()
        opt.step()
        ref(x).pow(2).mean().backward()
        ref_opt.step()
        e["mesh"] = {"shape": list(mesh.shape), "names": list(mesh.mesh_dim_names)}
        e["placements"] = {n: str(p.placements) for n, p in model.named_parameters()}
        e["param_max_abs_diff"] = max(
            _maxdiff(_full(p), rp) for p, rp in zip(model.parameters(), ref.parameters())
        )
        out["model"], out["opt"] = model, opt

    if "model" in out:
        with rec.check("dcp_save_ws4") as e:
            msd, osd = get_state_dict(out["model"], out["opt"])
            e["model_value_types"] = sorted({_type_name(v) for v in msd.values()})
            e["placements"] = {k: str(v.placements) for k, v in msd.items()}
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt_dir)
            e["full"] = _full_state_lists(msd, osd) if rank == 0 else None
            if rank != 0:
                _full_state_lists(msd, osd)  # full_tensor() is a collective
            e["files"] = sorted(os.listdir(ckpt_dir)) if rank == 0 else None
    return {"rank": rank, "checks": rec.results}


def _nested_maxdiff(a, b) -> float:
    ta, tb = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    if ta.shape != tb.shape:
        return float("inf")
    return float((ta - tb).abs().max().item()) if ta.numel() else 0.0


def _compare_to_expected(got: dict, expected: dict) -> dict:
    model_diff = max(_nested_maxdiff(got["model"][k], v) for k, v in expected["model"].items())
    optim_diff = 0.0
    for fqn, st in expected["optim"].items():
        for k, v in st.items():
            optim_diff = max(optim_diff, _nested_maxdiff(got["optim"][fqn][k], v))
    return {
        "model_keys_equal": sorted(got["model"]) == sorted(expected["model"]),
        "optim_keys_equal": sorted(got["optim"]) == sorted(expected["optim"]),
        "model_max_abs_diff": model_diff,
        "optim_max_abs_diff": optim_diff,
    }


def dcp_load(rank: int, ws: int, ckpt_dir: str, expected: dict, kind: str) -> dict:
    """dcp.load a checkpoint into an FSDP2 model (``kind="fsdp2"``) or a plain one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rec = _Recorder()
    with rec.check(f"dcp_load_{kind}_ws{ws}") as e:
        model = _tp_mlp(seed=123)  # different init: the load must overwrite it
        if kind == "fsdp2":
            mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("dp",))
            fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        # Never-stepped optimizer: upstream's getter initialises the state.
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=ckpt_dir)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        msd2, osd2 = get_state_dict(model, opt)
        got = _full_state_lists(msd2, osd2)
        e.update(_compare_to_expected(got, expected))
        e["model_value_types"] = sorted({_type_name(v) for v in msd2.values()})
    return {"rank": rank, "checks": rec.results}


# ---------------------------------------------------------------------------
# tiny functions for the harness self-tests


def echo(rank: int, ws: int, payload) -> dict:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "ws": ws, "payload": payload, "sum": t.item(), "pid": os.getpid(), "ppid": os.getppid()}


def fail_on_rank(rank: int, ws: int, bad_rank: int) -> int:
    if rank == bad_rank:
        raise ValueError(f"deliberate failure on rank {rank}")
    # The healthy ranks block in a collective the failing rank never joins.
    dist.barrier()
    return rank


def return_tensor(rank: int, ws: int):
    return {"t": torch.zeros(1)}


def sleep_forever(rank: int, ws: int) -> None:
    time.sleep(3600)


def crash_on_rank(rank: int, ws: int, bad_rank: int) -> int:
    if rank == bad_rank:
        import signal

        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()
    return rank


def peak_rss_mib(n_mib: int) -> dict:
    """Allocate ``n_mib`` MiB in a fresh child and report peak RSS (no PG)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t = torch.ones(n_mib * 1024 * 1024 // 4)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    del t
    return {
        "before_mib": before,
        "after_mib": after,
        "pid": os.getpid(),
        "has_pg": dist.is_initialized(),
        "torch_preloaded": True,
    }


def sys_path_info() -> dict:
    import importlib
    import sys

    info = {"sys_path_head": sys.path[:4], "pythonpath": os.environ.get("PYTHONPATH")}
    for name in ("dcp_optim", "tests", "tests.support.harness"):
        try:
            mod = importlib.import_module(name)
            info[name] = getattr(mod, "__file__", None)
        except Exception as exc:  # noqa: BLE001
            info[name] = f"{type(exc).__name__}: {exc}"
    return info
