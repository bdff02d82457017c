"""dcp_optim against upstream on one CUDA device (``make test-gpu``).

Every test takes the ``dev`` fixture: ``cuda:0`` under ``DCP_OPTIM_GPU=1``,
the CPU in ``make test``.  In-process tests run under a 1-rank process
group (``pg1``: NCCL on the GPU, gloo on the CPU); the 2-process test
shares the GPU between two ranks of a gloo group.  The oracle is upstream
(``torch.distributed.checkpoint.state_dict``) and torch's optimizers;
where dcp_optim deliberately differs (``step`` placement after a load,
never stepping in getters) the expected behaviour is spelled out.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as upstream

import dcp_optim

from ..support import harness
from ..support.oracle import live_storage
from . import cases
from .cases import (
    CAPTURABLE_ON_CPU,
    CPU,
    GPU_MODE,
    OPTIMS,
    assert_same_values,
    build,
    cpu_copy,
    is_cuda,
    live_snapshot,
    step_policy,
    tensors,
    train,
)

IMPLS = {"upstream": upstream, "dcp_optim": dcp_optim}
GETTER_OPTIONS = {
    "default": {},
    "offload": {"cpu_offload": True},
    "full": {"full_state_dict": True},
    "full-offload": {"full_state_dict": True, "cpu_offload": True},
    "flat": {"flatten_optimizer_state_dict": True},
}


def _skip_unless_available(name: str, dev: torch.device) -> None:
    if OPTIMS[name][2] and not is_cuda(dev):
        pytest.skip(CAPTURABLE_ON_CPU)


def _sync(dev: torch.device) -> None:
    if is_cuda(dev):
        torch.cuda.synchronize(dev)


# --- getters --------------------------------------------------------------------------


@pytest.mark.parametrize("opts", list(GETTER_OPTIONS), ids=list(GETTER_OPTIONS))
@pytest.mark.parametrize("name", list(OPTIMS))
def test_getters_match_upstream(name, opts, dev, pg1):
    """Model and optimizer getters on a trained model: the same tree as
    upstream (keys, nesting, dtypes, devices, bits); with ``cpu_offload``
    every tensor on the CPU and the live state untouched."""
    _skip_unless_available(name, dev)
    model, optim = build(name, dev)
    train(model, optim, 0, 2)
    before = live_snapshot(model, optim)
    live = live_storage(model, optim)
    results = {}
    for label, impl in IMPLS.items():
        options = impl.StateDictOptions(**GETTER_OPTIONS[opts])
        msd = impl.get_model_state_dict(model, options=options)
        osd = impl.get_optimizer_state_dict(model, optim, options=options)
        results[label] = (msd, osd)
    assert_same_values(cpu_copy(results["dcp_optim"]), cpu_copy(results["upstream"]))
    ours = results["dcp_optim"]
    if GETTER_OPTIONS[opts].get("cpu_offload"):
        assert {t.device for t in tensors(ours)} == {CPU}
        if is_cuda(dev):
            # copies, not views of the live GPU state: overwrite them (what
            # lived on the CPU already -- a non-capturable ``step`` -- is
            # returned as is, by upstream too)
            for t in tensors(ours):
                if t.data_ptr() not in live:
                    t.zero_() if not t.is_floating_point() else t.fill_(math.nan)
    assert_same_values(live_snapshot(model, optim), before)


# --- setters: same device, CPU -> CUDA, CUDA -> CPU -------------------------------------

ROUTES = ["same", "cpu-to-dev", "dev-to-cpu"] if GPU_MODE else ["same"]


def _route_devices(route: str, dev: torch.device):
    return {"same": (dev, dev), "cpu-to-dev": (CPU, dev), "dev-to-cpu": (dev, CPU)}[route]


@pytest.mark.parametrize("flat", [False, True], ids=["nested", "flat"])
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", list(OPTIMS))
def test_setters_match_upstream(name, route, flat, dev, pg1):
    """A trained state loaded into a fresh model and optimizer -- on the
    same device, from CPU state into a CUDA model and the reverse: the
    model equals upstream's load, the optimizer state holds the same
    values on the parameters' device, ``step`` where dcp_optim's policy
    puts it, and the next steps train exactly as after upstream's load
    (and, on one device, as the uninterrupted run)."""
    _skip_unless_available(name, dev)
    src_dev, dst_dev = _route_devices(route, dev)
    if OPTIMS[name][2] and CPU in (src_dev, dst_dev):
        pytest.skip(CAPTURABLE_ON_CPU)
    model, optim = build(name, src_dev)
    train(model, optim, 0, 2)
    options = dcp_optim.StateDictOptions(flatten_optimizer_state_dict=flat)
    msd, osd = dcp_optim.get_state_dict(model, optim, options=options)
    saved = copy.deepcopy(osd)
    after = {}
    for label, impl in IMPLS.items():
        fresh, fopt = build(name, dst_dev, seed=1)
        impl.set_state_dict(
            fresh, fopt, model_state_dict=copy.deepcopy(msd), optim_state_dict=copy.deepcopy(osd),
            options=impl.StateDictOptions(flatten_optimizer_state_dict=flat),
        )
        # upstream's dummy step leaves empty entries (plain SGD): not state
        loaded = {n: dict(st) for n, st in cases.optim_state_by_fqn(fresh, fopt).items() if st}
        after[label] = (fresh, fopt, loaded)
    assert_same_values(cpu_copy(osd), cpu_copy(saved))  # the caller's dict is not mutated
    ours_model, ours_optim, ours_state = after["dcp_optim"]
    up_model, up_optim, up_state = after["upstream"]
    assert_same_values(cpu_copy(ours_model.state_dict()), cpu_copy(up_model.state_dict()))
    params = dict(ours_model.named_parameters())
    groups = {n: g for g in ours_optim.param_groups for n, p in params.items() if any(p is q for q in g["params"])}
    assert list(ours_state) == list(up_state)
    for fqn, st in ours_state.items():
        assert list(st) == list(up_state[fqn]), fqn
        for key, value in st.items():
            ref = up_state[fqn][key]
            if not isinstance(value, torch.Tensor):
                assert value == ref, (fqn, key)
                continue
            assert torch.equal(value.detach().cpu().to(ref.dtype), ref.detach().cpu()), (fqn, key)
            if key == "step":
                assert (value.device, value.dtype) == step_policy(groups[fqn], params[fqn], ref), fqn
            else:
                assert (value.device, value.dtype) == (ref.device, ref.dtype), (fqn, key)
    ours_losses = train(ours_model, ours_optim, 2, 2)
    up_losses = train(up_model, up_optim, 2, 2)
    assert ours_losses == up_losses
    assert_same_values(cpu_copy(ours_model.state_dict()), cpu_copy(up_model.state_dict()))
    if src_dev == dst_dev:
        assert ours_losses == train(model, optim, 2, 2)


# --- pristine templates ---------------------------------------------------------------


def _first_step_state(name: str, dev: torch.device):
    """What torch's own first step creates (zero gradients)."""
    model, optim = build(name, dev)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optim.step()
    return {n: dict(optim.state[p]) for n, p in model.named_parameters()}


def _block(nbytes: int) -> int:
    """Bytes the CUDA caching allocator accounts for one allocation."""
    return max(512, -(-nbytes // 512) * 512)


@pytest.mark.parametrize("name", list(OPTIMS))
def test_pristine_templates(name, dev, pg1):
    """A never-stepped optimizer's template: every trainable parameter has
    its first-step state, each entry with the device and dtype torch's
    first step gives it (moments on the GPU in the parameter's dtype,
    ``step`` on the CPU unless capturable/fused), zero-valued; the live
    optimizer and model are untouched; the CUDA memory allocated is
    exactly that of the template's CUDA tensors (nothing allocated on the
    wrong device, nothing left behind)."""
    _skip_unless_available(name, dev)
    model, optim = build(name, dev)
    before = live_snapshot(model, optim)
    want = _first_step_state(name, dev)
    _sync(dev)
    base = torch.cuda.memory_allocated(dev) if is_cuda(dev) else 0
    osd = dcp_optim.get_optimizer_state_dict(model, optim)
    _sync(dev)
    grown = (torch.cuda.memory_allocated(dev) if is_cuda(dev) else 0) - base
    assert_same_values(live_snapshot(model, optim), before)
    assert len(optim.state) == 0
    expected_keys = list(want) if OPTIMS[name][0] is not torch.optim.SGD or OPTIMS[name][1].get("momentum") else []
    assert list(osd["state"]) == expected_keys
    _check_template_entries(osd, want)
    if is_cuda(dev):
        assert grown == sum(_block(t.untyped_storage().nbytes()) for t in tensors(osd["state"]) if t.is_cuda)
        del osd
        _sync(dev)
        assert torch.cuda.memory_allocated(dev) == base


def _check_template_entries(osd, want) -> None:
    """(A function: no loop variable keeps a template tensor alive.)"""
    for fqn, st in osd["state"].items():
        assert list(st) == list(want[fqn]), fqn
        for key, value in st.items():
            ref = want[fqn][key]
            assert (value.device, value.dtype, value.shape) == (ref.device, ref.dtype, ref.shape), (fqn, key)
            assert not bool(value.cpu().any()), (fqn, key)


TORCH_OPTIMS = [
    ("Adam", {}), ("AdamW", {"amsgrad": True}), ("SGD", {"momentum": 0.9, "dampening": 0.1}),
    ("Adagrad", {}), ("ASGD", {}), ("NAdam", {}), ("RAdam", {}), ("RMSprop", {"momentum": 0.5, "centered": True}),
    ("Rprop", {}), ("Adadelta", {}), ("Adamax", {}),
    ("Adam", {"capturable": True}), ("NAdam", {"capturable": True}), ("ASGD", {"capturable": True}),
    ("RAdam", {"capturable": True}), ("Adagrad", {"fused": True}), ("SGD", {"fused": True, "momentum": 0.9}),
]


@pytest.mark.parametrize(
    "cls_name,kw", TORCH_OPTIMS, ids=[f"{n}-{'-'.join(sorted(k)) or 'default'}" for n, k in TORCH_OPTIMS]
)
def test_template_round_trip_trains_like_a_fresh_optimizer(cls_name, kw, dev, pg1):
    """DCP's resume flow for every torch.optim class: a never-stepped
    optimizer's template loaded back, then two steps, trains like an
    optimizer that was never loaded (its state where the optimizer can
    step with it: a ``step`` on the wrong device fails or syncs here)."""
    if kw.get("capturable") and not is_cuda(dev):
        pytest.skip(CAPTURABLE_ON_CPU)
    cls = getattr(torch.optim, cls_name)
    runs = []
    for round_trip in (False, True):
        model = cases.make_net(dev)
        optim = cls(model.parameters(), lr=1e-2, **kw)
        if round_trip:
            template = dcp_optim.get_optimizer_state_dict(model, optim)
            dcp_optim.set_optimizer_state_dict(model, optim, template)
        losses = train(model, optim, 0, 2)
        runs.append((losses, cpu_copy(model.state_dict())))
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=1e-6, atol=0)
    for key, (_, _, _, value) in runs[0][1].items():
        torch.testing.assert_close(runs[1][1][key][3], value, rtol=1e-6, atol=1e-7)


# --- FSDP2 and DTensor on the 1-rank group ------------------------------------------------


def _fsdp2(dev, seed=0, fused=True):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(dev.type, (1,))
    model = cases.make_net(dev, seed=seed)
    fully_shard(model.l1, mesh=mesh)
    fully_shard(model.l2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)


def _tp(dev, seed=0, fused=True):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh(dev.type, (1,))
    model = cases.make_net(dev, seed=seed)
    parallelize_module(model, mesh, {"l1": ColwiseParallel(), "l2": RowwiseParallel()})
    # plain and DTensor parameters mixed: the single-tensor path
    return model, torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)


SHARDED = {"fsdp2": _fsdp2, "tp": _tp}


@pytest.mark.parametrize("opts", list(GETTER_OPTIONS), ids=list(GETTER_OPTIONS))
@pytest.mark.parametrize("kind", list(SHARDED))
def test_sharded_getters_match_upstream(kind, opts, dev, pg1):
    """FSDP2 and tensor-parallel DTensors on the 1-rank group (NCCL on the
    GPU): getters equal upstream's (DTensor placements included)."""
    model, optim = SHARDED[kind](dev)
    train(model, optim, 0, 2)
    before = live_snapshot(model, optim)
    results = {}
    for label, impl in IMPLS.items():
        options = impl.StateDictOptions(**GETTER_OPTIONS[opts])
        results[label] = impl.get_state_dict(model, optim, options=options)
    assert_same_values(cpu_copy(results["dcp_optim"]), cpu_copy(results["upstream"]))
    if GETTER_OPTIONS[opts].get("cpu_offload"):
        assert {t.device for t in tensors(results["dcp_optim"])} == {CPU}
    assert_same_values(live_snapshot(model, optim), before)


LOADS = {
    "sharded": {},
    "full": {"full_state_dict": True},
    "broadcast": {"full_state_dict": True, "broadcast_from_rank0": True},
    "broadcast-flat": {"full_state_dict": True, "broadcast_from_rank0": True, "flatten_optimizer_state_dict": True},
}


@pytest.mark.parametrize("load", list(LOADS))
@pytest.mark.parametrize("kind", list(SHARDED))
def test_sharded_setters_match_upstream(kind, load, dev, pg1):
    """Sharded, full and broadcast loads into fresh FSDP2 / TP models on
    the 1-rank group: the same model and optimizer state as upstream's
    load (placements, devices; ``step`` by dcp_optim's policy), then the
    same training."""
    model, optim = SHARDED[kind](dev)
    train(model, optim, 0, 2)
    after = {}
    for label, impl in IMPLS.items():
        opts = dict(LOADS[load])
        if label == "upstream":
            # upstream's optimizer load raises KeyError('state') for a
            # flattened broadcast: it gets the nested dict of the same state
            opts.pop("flatten_optimizer_state_dict", None)
        save_opts = {k: v for k, v in opts.items() if k != "broadcast_from_rank0"}
        msd, osd = dcp_optim.get_state_dict(model, optim, options=dcp_optim.StateDictOptions(**save_opts))
        fresh, fopt = SHARDED[kind](dev, seed=1)
        options = impl.StateDictOptions(**opts)
        impl.set_model_state_dict(fresh, copy.deepcopy(msd), options=options)
        impl.set_optimizer_state_dict(fresh, fopt, copy.deepcopy(osd), options=options)
        after[label] = (fresh, fopt)
    (ours_m, ours_o), (up_m, up_o) = after["dcp_optim"], after["upstream"]
    assert_same_values(cpu_copy(ours_m.state_dict()), cpu_copy(up_m.state_dict()))
    ours_state = cases.optim_state_by_fqn(ours_m, ours_o)
    up_state = cases.optim_state_by_fqn(up_m, up_o)
    params = dict(ours_m.named_parameters())
    group = ours_o.param_groups[0]
    for fqn, st in ours_state.items():
        for key, value in st.items():
            ref = up_state[fqn][key]
            if key == "step":
                assert (value.device, value.dtype) == step_policy(group, params[fqn], ref), fqn
                assert float(value) == float(ref)
            else:
                assert_same_values(cpu_copy(value), cpu_copy(ref), f"{fqn}.{key}")
    assert train(ours_m, ours_o, 2, 2) == train(up_m, up_o, 2, 2)
    assert train(ours_m, ours_o, 4, 1) == train(model, optim, 2, 3)[-1:]


def test_dcp_save_load_resume(dev, pg1, tmp_path):
    """The whole resume flow on the device: FSDP2 state saved with DCP,
    loaded into a fresh model through a never-stepped optimizer's
    template, training continues bit-identically."""
    model, optim = _fsdp2(dev)
    train(model, optim, 0, 2)
    msd, osd = dcp_optim.get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "ckpt"))
    reference = train(model, optim, 2, 3)

    fresh, fopt = _fsdp2(dev, seed=1)
    msd, osd = dcp_optim.get_state_dict(fresh, fopt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"))
    dcp_optim.set_state_dict(fresh, fopt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for p in fresh.parameters():
        st = fopt.state[p]
        assert st["exp_avg"].device_mesh.device_type == dev.type
        assert st["step"].device == step_policy(fopt.param_groups[0], p, st["step"])[0]
    assert train(fresh, fopt, 2, 3) == reference


# --- peak CUDA memory -------------------------------------------------------------------


def _peak(dev, fn):
    """(result, peak CUDA bytes above the start) of fn(); (result, None)
    on the CPU, where tests/distributed/test_collectives_memory.py measures RSS."""
    if not is_cuda(dev):
        return fn(), None
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    result = fn()
    torch.cuda.synchronize(dev)
    return result, torch.cuda.max_memory_allocated(dev) - base


_BIG = 1024


def _big_fsdp2(dev, seed=0):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(dev.type, (1,))
    torch.manual_seed(seed)
    width = _BIG if is_cuda(dev) else 128  # the CPU run checks results only
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(6)]).to(dev)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optim.step()
    optim.zero_grad(set_to_none=True)
    return model, optim


@pytest.mark.parametrize("offload", [False, True], ids=["gpu", "cpu-offload"])
def test_peak_memory_of_a_full_gather(offload, dev, pg1, record_property):
    """A full gather of model and optimizer state (24 MiB of parameters, 48
    MiB of moments): the same result as upstream, and a CUDA peak no
    larger than upstream's plus one bucket (dcp_optim gathers in buckets;
    with cpu_offload the results leave the GPU bucket by bucket)."""
    from dcp_optim._engine import collectives as _collectives

    model, optim = _big_fsdp2(dev)
    peaks, results = {}, {}
    for label, impl in IMPLS.items():
        options = impl.StateDictOptions(full_state_dict=True, cpu_offload=offload)
        results[label], peaks[label] = _peak(dev, lambda impl=impl, o=options: impl.get_state_dict(model, optim, options=o))
    assert_same_values(cpu_copy(results["dcp_optim"]), cpu_copy(results["upstream"]))
    if peaks["upstream"] is not None:
        record_property("peak_mib", {k: round(v / 2**20, 1) for k, v in peaks.items()})
        largest = _BIG * _BIG * 4
        assert peaks["dcp_optim"] <= peaks["upstream"] + _collectives.bucket_bytes(largest), peaks


def test_peak_memory_of_a_broadcast_load(dev, pg1, record_property):
    """A full model + optimizer state broadcast from rank 0 into a fresh
    FSDP2 model: the same loaded state as upstream, and a CUDA peak no
    larger than upstream's plus one bucket."""
    from dcp_optim._engine import collectives as _collectives

    model, optim = _big_fsdp2(dev)
    full_opts = {"full_state_dict": True, "cpu_offload": True}
    msd, osd = dcp_optim.get_state_dict(model, optim, options=dcp_optim.StateDictOptions(**full_opts))
    del model, optim
    peaks, loaded = {}, {}
    for label, impl in IMPLS.items():
        fresh, fopt = _big_fsdp2(dev, seed=1)
        options = impl.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)

        def load(impl=impl, fresh=fresh, fopt=fopt, options=options):
            impl.set_model_state_dict(fresh, copy.deepcopy(msd), options=options)
            impl.set_optimizer_state_dict(fresh, fopt, copy.deepcopy(osd), options=options)

        _, peaks[label] = _peak(dev, load)
        loaded[label] = live_snapshot(fresh, fopt)
        del fresh, fopt
    ours, up = loaded["dcp_optim"], loaded["upstream"]
    assert_same_values(ours["model"], up["model"])
    for fqn, st in ours["optim"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert_same_values(st[key], up["optim"][fqn][key], f"{fqn}.{key}")
    if peaks["upstream"] is not None:
        record_property("peak_mib", {k: round(v / 2**20, 1) for k, v in peaks.items()})
        largest = _BIG * _BIG * 4
        assert peaks["dcp_optim"] <= peaks["upstream"] + _collectives.bucket_bytes(largest), peaks


# --- two processes sharing the device over gloo ------------------------------------------


@pytest.mark.dist
def test_two_processes_over_gloo(dev, record_property):
    """FSDP2 and TP on 2 ranks of a gloo group, CUDA tensors when on the GPU
    (both ranks on cuda:0; NCCL refuses two ranks on one GPU): getters
    (sharded, full, full+offload, offload) and a broadcast load + step,
    against upstream.  A check may fail for both implementations where
    gloo lacks a collective for CUDA tensors; dcp_optim must never fail
    where upstream works, nor differ."""
    results = harness.run_ranks(2, cases.two_rank_checks, dev.type, timeout=240)
    outcomes = sorted({(check, outcome, detail) for rank in results for check, outcome, detail in rank})
    record_property("outcomes", [f"{c}: {o}" for c, o, _ in outcomes])
    bad = [o for o in outcomes if o[1] in ("differs", "dcp_optim-failed")]
    assert not bad, "\n".join(f"{c}: {o}: {d}" for c, o, d in bad)
    if not GPU_MODE:
        # gloo serves every collective on the CPU: everything compared
        assert {o for _, o, _ in outcomes} == {"equal"}, outcomes


def test_cpu_model_broadcast_load_over_the_group(dev, pg1, record_property):
    """A model kept on the CPU, loaded with ``broadcast_from_rank0`` over the
    1-rank group (NCCL on the GPU: its buffers must live on the GPU):
    the model load equals upstream's.  The optimizer load puts its buffers
    on the parameters' device, as upstream does, which NCCL cannot
    serve for a CPU model: it must work wherever upstream's works."""
    model, optim = build("adam-foreach", CPU)
    train(model, optim, 0, 2)
    msd, osd = dcp_optim.get_state_dict(model, optim, options=dcp_optim.StateDictOptions(full_state_dict=True))
    outcome, loaded = {}, {}
    for label, impl in IMPLS.items():
        fresh, fopt = build("adam-foreach", CPU, seed=1)
        options = impl.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        impl.set_model_state_dict(fresh, copy.deepcopy(msd), options=options)
        loaded[label] = cpu_copy(fresh.state_dict())
        try:
            impl.set_optimizer_state_dict(fresh, fopt, copy.deepcopy(osd), options=options)
            outcome[label] = "ok"
        except Exception as e:  # noqa: BLE001 - compared below
            outcome[label] = f"{type(e).__name__}: {str(e)[:120]}"
    record_property("optimizer_load", outcome)
    assert_same_values(loaded["dcp_optim"], loaded["upstream"])
    if outcome["upstream"] == "ok":
        assert outcome["dcp_optim"] == "ok", outcome
    if not GPU_MODE:
        assert outcome == {"upstream": "ok", "dcp_optim": "ok"}
