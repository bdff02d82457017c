"""Section 2: distributed state dicts (gloo, 2 processes, FSDP2).

Model: ``nn.Sequential`` of ``--dist-layers`` ``nn.Linear`` layers whose
widths alternate ``dim -> dim+1 -> dim`` (so half the tensors split
unevenly over 2 ranks), each layer and the root wrapped by FSDP2's
``fully_shard`` on a 1-D CPU mesh, plus ``torch.optim.Adam`` after one
real step (gradients of ones set on the sharded parameters).  Default:
128 layers of width 256, i.e. 256 parameter tensors, 33 MB of parameters
and 66 MB of Adam state.

Operations (each for upstream and dcp_optim, on the same model/optimizer):

``full_get_model`` / ``full_get_model_offload``
    ``get_model_state_dict(full_state_dict=True[, cpu_offload=True])``
``full_get_optim`` / ``full_get_optim_offload``
    ``get_optimizer_state_dict(full_state_dict=True[, cpu_offload=True])``
``bcast_set_model`` / ``bcast_set_optim``
    ``set_{model,optimizer}_state_dict(full_state_dict=True,
    broadcast_from_rank0=True)``; rank 0 passes the full dict the same
    implementation produced with ``cpu_offload=True``, rank 1 passes ``{}``.
``sharded_get`` / ``sharded_set``
    ``get_state_dict`` / ``set_state_dict`` with default options (DTensor
    shards; the set loads what the same implementation's get returned).

Three measurements, in separate passes so that they do not disturb each
other:

time
    In one process pair: one warm-up call then ``--dist-reps`` calls per
    (op, implementation), the two implementations interleaved (order
    alternating per rep).  Every call is preceded by ``dist.barrier()``
    and ``gc.collect()`` (untimed); a call's time is the *maximum over the
    ranks* of the rank-local wall time; the median over reps is reported.
collectives
    Same process pair, one extra call per (op, implementation), counted
    per rank at two levels:

    * ``wire``: every op that reaches the c10d dispatcher in the
      ``c10d`` namespace (what ``torch.distributed.broadcast``,
      ``all_gather_into_tensor``, ``broadcast_object_list`` (2 each), ...
      and the ProcessGroup methods end in) or in ``_c10d_functional`` /
      ``c10d_functional`` / ``_c10d_functional_autograd`` (functional
      collectives: DTensor ``full_tensor()``/``redistribute`` and
      FSDP2), seen by a ``TorchDispatchMode``.  ``wait_tensor`` and
      ``_wrap_tensor_autograd`` are bookkeeping, listed but not counted.
      This is the number of backend round trips.
    * ``api``: outermost calls of the Python entry points
      (``torch.distributed.*`` collectives and object collectives,
      ``send``/``recv``, and ``torch.distributed._functional_collectives``
      functions), found by wrapping the function objects wherever a
      ``torch.*`` or ``dcp_optim.*`` module holds a reference to them.
      Nested calls (``broadcast_object_list`` -> ``broadcast``) count
      once, at the outermost level.

    A dispatch mode does not see ops issued from inside another tensor
    subclass's ``__torch_dispatch__`` (the mode is popped while it runs);
    the ``api`` level covers that blind spot for Python-issued
    collectives.  ``barrier`` is reported separately (``barriers``).
peak memory
    In fresh process pairs (one per implementation by default,
    ``--dist-mem-isolation op`` for one per (op, implementation),
    ``shared`` -- ``--quick`` -- for a single pair running both) started
    with ``MALLOC_MMAP_THRESHOLD_=65536`` and ``MALLOC_TRIM_THRESHOLD_=0``
    so glibc hands tensor memory back to the OS on free and RSS tracks live
    tensors.  Before each call: inputs prepared, ``gc.collect()``, the
    kernel's peak-RSS mark reset by writing ``5`` to
    ``/proc/self/clear_refs``, ``VmRSS`` read.  After: ``VmHWM`` read.
    ``peak_mb`` = VmHWM - VmRSS(before): the extra resident memory the call
    needed at its peak, including the result it returns.  ``retained_mb``
    = VmRSS(after, result alive) - VmRSS(before).  Where ``clear_refs`` is
    not writable, ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (never
    reset) is used instead and every call runs in its own process pair.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any

OPS: dict[str, tuple[str, dict[str, bool]]] = {
    "full_get_model": ("get_model_state_dict", {"full_state_dict": True}),
    "full_get_model_offload": (
        "get_model_state_dict",
        {"full_state_dict": True, "cpu_offload": True},
    ),
    "full_get_optim": ("get_optimizer_state_dict", {"full_state_dict": True}),
    "full_get_optim_offload": (
        "get_optimizer_state_dict",
        {"full_state_dict": True, "cpu_offload": True},
    ),
    "bcast_set_model": (
        "set_model_state_dict",
        {"full_state_dict": True, "broadcast_from_rank0": True},
    ),
    "bcast_set_optim": (
        "set_optimizer_state_dict",
        {"full_state_dict": True, "broadcast_from_rank0": True},
    ),
    "sharded_get": ("get_state_dict", {}),
    "sharded_set": ("set_state_dict", {}),
}
IMPLS = ("upstream", "dcp_optim")

WIRE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")
WIRE_NOT_COUNTED = ("wait_tensor", "_wrap_tensor_autograd")

C10D_API = (
    "broadcast", "all_reduce", "all_reduce_coalesced", "reduce", "all_gather",
    "all_gather_into_tensor", "all_gather_coalesced", "_all_gather_base", "gather",
    "scatter", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base",
    "all_to_all", "all_to_all_single", "_broadcast_coalesced",
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
    "send_object_list", "recv_object_list", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "barrier", "monitored_barrier",
)
FUNCOL_API = (
    "broadcast", "all_reduce", "all_gather_tensor", "all_gather_tensor_autograd",
    "all_gather_single", "all_gather_single_autograd", "reduce_scatter_tensor",
    "reduce_scatter_tensor_autograd", "reduce_scatter_single", "all_reduce_coalesced",
    "all_gather_into_tensor_coalesced", "all_gather_single_coalesced",
    "reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced",
    "all_to_all_single", "all_to_all_single_autograd", "permute_tensor",
)


# --- memory -----------------------------------------------------------------------


def _proc_status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0])  # kB
    return out


def can_reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


# --- collective counting --------------------------------------------------------


class _Counters:
    def __init__(self) -> None:
        self.wire: Counter[str] = Counter()
        self.wire_other: Counter[str] = Counter()
        self.api: Counter[str] = Counter()
        self.depth = 0


def _make_dispatch_counter(counters: _Counters):
    from torch.utils._python_dispatch import TorchDispatchMode

    class WireCounter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ns = getattr(func, "namespace", "")
            if ns in WIRE_NAMESPACES:
                name = f"{ns}.{func._opname}" if hasattr(func, "_opname") else str(func)
                if any(x in name for x in WIRE_NOT_COUNTED):
                    counters.wire_other[name] += 1
                else:
                    counters.wire[name] += 1
            return func(*args, **(kwargs or {}))

    return WireCounter()


@contextlib.contextmanager
def count_collectives(counters: _Counters):
    """Counts collectives at the dispatcher and at the Python API level."""
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.distributed_c10d as c10d

    originals: dict[int, tuple[Any, str]] = {}
    for mod, names, prefix in ((c10d, C10D_API, "dist."), (funcol, FUNCOL_API, "funcol.")):
        for name in names:
            fn = mod.__dict__.get(name)
            if callable(fn):
                originals[id(fn)] = (fn, prefix + name)

    def wrap(fn, label):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            if counters.depth == 0:
                counters.api[label] += 1
            counters.depth += 1
            try:
                return fn(*a, **k)
            finally:
                counters.depth -= 1

        return wrapper

    wrappers = {key: wrap(fn, label) for key, (fn, label) in originals.items()}
    patched: list[tuple[Any, str, Any]] = []
    for mname, mod in list(sys.modules.items()):
        if mod is None or not (mname.startswith("torch") or mname.startswith("dcp_optim")):
            continue
        d = getattr(mod, "__dict__", None)
        if not isinstance(d, dict):
            continue
        for attr, val in list(d.items()):
            w = wrappers.get(id(val)) if callable(val) else None
            if w is not None and originals[id(val)][0] is val:
                patched.append((mod, attr, val))
                setattr(mod, attr, w)
    mode = _make_dispatch_counter(counters)
    try:
        with mode:
            yield counters
    finally:
        for mod, attr, val in patched:
            setattr(mod, attr, val)


def summarize_counts(c: _Counters) -> dict[str, Any]:
    barriers = {k: v for k, v in c.wire.items() if "barrier" in k}
    wire = {k: v for k, v in c.wire.items() if "barrier" not in k}
    api_barriers = {k: v for k, v in c.api.items() if "barrier" in k}
    api = {k: v for k, v in c.api.items() if "barrier" not in k}
    return {
        "wire_total": sum(wire.values()),
        "api_total": sum(api.values()),
        "barriers": sum(barriers.values()) + sum(api_barriers.values()),
        "wire": dict(sorted(wire.items())),
        "api": dict(sorted(api.items())),
        "not_counted": dict(sorted(c.wire_other.items())),
    }


# --- worker -------------------------------------------------------------------------


def _build(cfg: dict[str, Any]):
    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    torch.manual_seed(0)
    dim = cfg["dim"]
    layers = []
    for i in range(cfg["layers"]):
        a, b = (dim, dim + 1) if i % 2 == 0 else (dim + 1, dim)
        layers.append(nn.Linear(a, b))
    layered = nn.Sequential(*layers)
    model: nn.Module = layered
    if cfg.get("framework") == "fsdp1":
        # FSDP1: one FlatParameter per Linear (and an empty root), CPU
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FSDP(layered, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    else:
        for layer in layered:
            fully_shard(layer, mesh=mesh)
        fully_shard(layered, mesh=mesh)
    from .common import adam_after_one_step

    return model, adam_after_one_step(model)


def _impl(name: str) -> Any:
    if name == "upstream":
        import torch.distributed.checkpoint.state_dict as upstream

        return upstream
    import dcp_optim

    return dcp_optim


class _Job:
    """One (op, impl): ``prepare()`` makes the call's arguments (untimed),
    ``call(args)`` runs the public function."""

    def __init__(self, op: str, impl: str, model, optim, rank: int, fsdp1: bool = False):
        from .common import copy_containers

        self.op, self.impl = op, impl
        mod = _impl(impl)
        func, kw = OPS[op]
        opts = mod.StateDictOptions(**kw)
        f = getattr(mod, func)
        self.input_error: str | None = None
        # timed: self.call(*self.prepare())
        self.prepare: Callable[[], tuple[Any, ...]]
        self.call: Callable[..., Any]
        if func == "get_model_state_dict":
            self.prepare, self.call = (lambda: ()), (lambda: f(model, options=opts))
        elif func == "get_optimizer_state_dict":
            self.prepare, self.call = (lambda: ()), (lambda: f(model, optim, options=opts))
        elif func == "get_state_dict":
            self.prepare, self.call = (lambda: ()), (lambda: f(model, optim, options=opts))
        elif func in ("set_model_state_dict", "set_optimizer_state_dict"):
            # the source dict for broadcast loads: full on rank 0 (FSDP1's
            # model offload path fails on CPU in upstream, so no offload
            # there; rank 1's copy is dropped below)
            src_opts = mod.StateDictOptions(full_state_dict=True, cpu_offload=not fsdp1)
            try:
                if func == "set_model_state_dict":
                    full = mod.get_model_state_dict(model, options=src_opts)
                else:
                    full = mod.get_optimizer_state_dict(model, optim, options=src_opts)
            except Exception as exc:  # noqa: BLE001
                self.input_error = f"its full get failed: {type(exc).__name__}: {exc}"[:300]
                full = {}
            if rank != 0:
                full = {}
            self.prepare = lambda: (copy_containers(full),)
            if func == "set_model_state_dict":
                self.call = lambda d: f(model, d, options=opts)
            else:
                self.call = lambda d: f(model, optim, d, options=opts)
        elif func == "set_state_dict":
            try:
                msd, osd = mod.get_state_dict(model, optim)
            except Exception as exc:  # noqa: BLE001
                self.input_error = f"its sharded get failed: {type(exc).__name__}: {exc}"[:300]
                msd, osd = {}, {}
            self.prepare = lambda: (copy_containers(msd), copy_containers(osd))
            self.call = lambda m, o: f(model, optim, model_state_dict=m, optim_state_dict=o, options=opts)
        else:  # pragma: no cover
            raise AssertionError(func)


class _Desync(RuntimeError):
    pass


def _exchange_status(store, tag: str, rank: int, world: int, ok: bool, timeout_s: float) -> list[bool]:
    """Every rank's ok/failed for one call, through the store (no
    collectives, so nothing is added to the counts or timings)."""
    store.set(f"{tag}/{rank}", "1" if ok else "0")
    keys = [f"{tag}/{r}" for r in range(world)]
    store.wait(keys, datetime.timedelta(seconds=timeout_s))
    return [store.get(k) == b"1" for k in keys]


def _worker(rank: int, world: int, port: int, cfg: dict[str, Any], out_dir: str) -> None:
    t_start = time.perf_counter()
    os.environ["WORLD_SIZE"] = str(world)
    os.environ["RANK"] = str(rank)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    phases: dict[str, float] = {"import": time.perf_counter() - t_start}
    result: dict[str, Any] = {"rank": rank, "mode": cfg["mode"], "jobs": {}, "phases_s": phases}
    from .common import tcp_store

    timeout = datetime.timedelta(seconds=cfg["timeout_s"])
    store = tcp_store(rank, world, port, timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    # Success/failure of every call is exchanged through the store itself
    # (un-prefixed keys), outside c10d: no collective is added.
    seq = [0]

    def status(ok: bool) -> list[bool]:
        seq[0] += 1
        return _exchange_status(store, f"bench-status/{seq[0]}", rank, world, ok, cfg["timeout_s"])

    try:
        import warnings

        warnings.filterwarnings("ignore")
        t0 = time.perf_counter()
        model, optim = _build(cfg)
        result["setup_s"] = phases["setup"] = time.perf_counter() - t0
        result["ru_maxrss_after_setup_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        t0 = time.perf_counter()
        jobs: dict[tuple[str, str], _Job] = {}
        for op, impl in cfg["jobs"]:
            jobs[(op, impl)] = _Job(op, impl, model, optim, rank, fsdp1=cfg.get("framework") == "fsdp1")
        gc.collect()
        gc.freeze()  # as in section 1: cheap gc.collect() before each call
        phases["inputs"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        if cfg["mode"] == "time":
            _time_and_count(jobs, cfg, result, status)
        else:
            _memory(jobs, cfg, result, status)
        phases["measure"] = time.perf_counter() - t0
    except _Desync as exc:
        result["aborted"] = str(exc)
    except Exception as exc:  # noqa: BLE001
        result["fatal"] = "".join(traceback.format_exception(exc))[-3000:]
    finally:
        with open(os.path.join(out_dir, f"{cfg['mode']}-{cfg['tag']}-rank{rank}.json"), "w") as f:
            json.dump(result, f)
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _run_one(job: _Job, status) -> tuple[bool, float, str | None]:
    """One barrier-synchronised, timed call.  Raises _Desync when the ranks
    disagree about success (the process group is then unusable)."""
    import torch.distributed as dist

    if job.input_error:
        return False, 0.0, "no input: " + job.input_error
    args = job.prepare()
    gc.collect()
    dist.barrier()
    err = None
    t0 = time.perf_counter()
    try:
        res = job.call(*args)
    except Exception as exc:  # noqa: BLE001
        res = None
        err = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
    dt = time.perf_counter() - t0
    del res, args
    oks = status(err is None)
    if not all(oks) and any(oks):
        raise _Desync(f"{job.op}/{job.impl}: ranks disagree on success {oks}: {err}")
    return err is None, dt, err


def _time_and_count(jobs, cfg, result, status) -> None:
    out = result["jobs"]
    by_op: dict[str, list[_Job]] = {}
    for (op, _impl), job in jobs.items():
        by_op.setdefault(op, []).append(job)
        out[f"{op}|{job.impl}"] = {"samples_s": [], "error": job.input_error and "no input: " + job.input_error}
    for op, op_jobs in by_op.items():
        live = [j for j in op_jobs if not j.input_error]
        for rep in range(cfg["reps"] + 1):  # rep 0 is the warm-up
            order = live if rep % 2 == 0 else live[::-1]
            for job in order:
                rec = out[f"{op}|{job.impl}"]
                if rec["error"]:
                    continue
                ok, dt, err = _run_one(job, status)
                if not ok:
                    rec["error"] = err
                elif rep > 0:
                    rec["samples_s"].append(dt)
                else:
                    rec["warmup_s"] = dt
        # collectives: one more, instrumented call each
        t_count = time.perf_counter()
        for job in live:
            rec = out[f"{op}|{job.impl}"]
            if rec["error"]:
                continue
            import torch.distributed as dist

            args = job.prepare()
            gc.collect()
            dist.barrier()
            counters = _Counters()
            err = None
            try:
                with count_collectives(counters):
                    res = job.call(*args)
                del res
            except Exception as exc:  # noqa: BLE001
                err = f"{type(exc).__name__}: {exc}"[:300]
            oks = status(err is None)
            if not all(oks) and any(oks):
                raise _Desync(f"{op}/{job.impl} (counting pass): ranks disagree {oks}: {err}")
            rec["collectives"] = summarize_counts(counters) if err is None else {"error": err}
        result["phases_s"]["counting"] = result["phases_s"].get("counting", 0.0) + time.perf_counter() - t_count


def _memory(jobs, cfg, result, status) -> None:
    import torch.distributed as dist

    reset = can_reset_peak()
    result["peak_method"] = "clear_refs+VmHWM" if reset else "ru_maxrss"
    for (op, impl), job in jobs.items():
        rec: dict[str, Any] = {}
        result["jobs"][f"{op}|{impl}"] = rec
        if job.input_error:
            rec["error"] = "no input: " + job.input_error
            continue
        args = job.prepare()
        gc.collect()
        dist.barrier()
        if reset:
            _reset_peak()
        before = _proc_status()
        maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        err = None
        res = None
        try:
            res = job.call(*args)
        except Exception as exc:  # noqa: BLE001
            err = f"{type(exc).__name__}: {exc}"[:300]
        after = _proc_status()
        maxrss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        del res, args
        gc.collect()
        oks = status(err is None)
        if err:
            rec["error"] = err
        else:
            if reset:
                rec["peak_mb"] = (after["VmHWM"] - before["VmRSS"]) / 1024
            else:
                rec["peak_mb"] = (maxrss_after - before["VmRSS"]) / 1024
                rec["maxrss_before_mb"] = maxrss_before / 1024
            rec["retained_mb"] = (after["VmRSS"] - before["VmRSS"]) / 1024
            rec["rss_before_mb"] = before["VmRSS"] / 1024
        if not all(oks) and any(oks):
            raise _Desync(f"{op}/{impl} (memory pass): ranks disagree {oks}: {err}")


# --- parent -----------------------------------------------------------------------


def _spawn(cfg: dict[str, Any], world: int, out_dir: str, env: dict[str, str], timeout_s: float) -> list[dict]:
    from .common import free_port, spawn_ranks

    port = free_port()
    procs, hung = spawn_ranks(_worker, [(r, world, port, cfg, out_dir) for r in range(world)], env, timeout_s)
    results = []
    for r in range(world):
        path = os.path.join(out_dir, f"{cfg['mode']}-{cfg['tag']}-rank{r}.json")
        try:
            with open(path) as f:
                results.append(json.load(f))
        except (OSError, ValueError):
            results.append(
                {
                    "rank": r,
                    "fatal": f"no result (exit code {procs[r].exitcode}"
                    + (", killed after timeout" if procs[r] in hung else "")
                    + ")",
                    "jobs": {},
                }
            )
    return results


def run_distributed(
    *,
    layers: int = 128,
    dim: int = 256,
    reps: int = 5,
    mem_isolation: str = "impl",
    world: int = 2,
    timeout_s: float = 300.0,
    ops: list[str] | None = None,
    framework: str = "fsdp2",
    log=lambda s: print(s, file=sys.stderr, flush=True),
) -> dict[str, Any]:
    if layers % 2:
        raise ValueError("--dist-layers must be even")
    ops = list(ops or OPS)
    t_start = time.perf_counter()
    base_env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    mem_env = {**base_env, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    all_jobs = [(op, impl) for op in ops for impl in IMPLS]
    common = {"layers": layers, "dim": dim, "reps": reps, "timeout_s": min(timeout_s, 120.0),
              "framework": framework}
    with tempfile.TemporaryDirectory(prefix="dcp-bench-") as tmp:
        log(f"[distributed] timing + collectives: {world} gloo ranks, {layers * 2} tensors")
        t = time.perf_counter()
        timing = _spawn({**common, "mode": "time", "tag": "all", "jobs": all_jobs}, world, tmp, base_env, timeout_s)
        log(f"[distributed] timing + collectives pass took {time.perf_counter() - t:.1f}s")
        if not can_reset_peak():
            mem_isolation = "op"
        if mem_isolation == "op":
            groups = [[j] for j in all_jobs]
        elif mem_isolation == "shared":
            groups = [all_jobs]
        else:
            groups = [[j for j in all_jobs if j[1] == impl] for impl in IMPLS]
        memory: list[list[dict]] = []
        for i, g in enumerate(groups):
            log(f"[distributed] memory pass {i + 1}/{len(groups)}: {', '.join(f'{o}/{m}' for o, m in g)[:100]}")
            t = time.perf_counter()
            memory.append(_spawn({**common, "mode": "memory", "tag": f"m{i}", "jobs": g}, world, tmp, mem_env, timeout_s))
            log(f"[distributed] memory pass {i + 1} took {time.perf_counter() - t:.1f}s")
    rows = []
    fatal = [r.get("fatal") or r.get("aborted") for r in timing if r.get("fatal") or r.get("aborted")]
    for op, impl in all_jobs:
        key = f"{op}|{impl}"
        per_rank = [r["jobs"].get(key, {}) for r in timing]
        row: dict[str, Any] = {"op": op, "impl": impl, "func": OPS[op][0], "options": OPS[op][1]}
        errs = [x.get("error") for x in per_rank if x.get("error")]
        samples = [x.get("samples_s", []) for x in per_rank]
        n = min((len(s) for s in samples), default=0)
        if errs:
            row["error"] = errs[0]
        if n and not errs:
            per_rep = [max(s[i] for s in samples) for i in range(n)]
            row["median_s"] = statistics.median(per_rep)
            row["min_s"] = min(per_rep)
            row["reps"] = n
            row["samples_s"] = per_rep
            row["per_rank_median_s"] = [statistics.median(s[:n]) for s in samples]
        else:
            row["median_s"] = None
        row["collectives_per_rank"] = [x.get("collectives") for x in per_rank]
        mem = None
        for group in memory:
            for r in group:
                if key in r.get("jobs", {}):
                    mem = mem or []
                    mem.append(r["jobs"][key])
        row["memory_per_rank"] = mem
        rows.append(row)
    mem_fatal = [r.get("fatal") or r.get("aborted") for g in memory for r in g if r.get("fatal") or r.get("aborted")]
    return {
        "config": {
            "world_size": world,
            "backend": "gloo",
            "framework": framework,
            "model": f"Sequential of {layers} Linear layers alternating {dim}->{dim + 1}->{dim}, "
            + ("FSDP1 (FullyShardedDataParallel) wrapping each Linear: "
               f"{layers} FlatParameters, device_id=cpu" if framework == "fsdp1"
               else "per-layer + root fully_shard (FSDP2), CPU mesh"),
            "n_tensors": layers * 2,
            "layers_flat": layers,
            "param_mb": _param_mb(layers, dim),
            "optimizer": "torch.optim.Adam(lr=1e-3), one step (gradients of ones on the sharded parameters)",
            "reps": reps,
            "mem_isolation": mem_isolation,
            "peak_method": next((r.get("peak_method") for g in memory for r in g if r.get("peak_method")), None),
        },
        "results": rows,
        "setup_s": [r.get("setup_s") for r in timing],
        "phases_s": {"timing": [r.get("phases_s") for r in timing],
                     "memory": [[r.get("phases_s") for r in g] for g in memory]},
        "problems": fatal + mem_fatal,
        "wall_s": time.perf_counter() - t_start,
    }


def _param_mb(layers: int, dim: int) -> float:
    per_pair = 2 * (dim * (dim + 1)) + (dim + 1) + dim
    return layers // 2 * per_pair * 4 / 2**20
