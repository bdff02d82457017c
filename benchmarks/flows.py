"""Section 9 (or 'flows'): real flows, dcp_optim against upstream at 2 gloo ranks.

Issue 26 requirement 4: the first call in a process, the fixed cost per
call on a tiny model, and the save and load of two real trainers (Lightning
Fabric, torchtune) on a tiny and a ~50 MB model.

Models (FSDP2 ``fully_shard`` per layer and at the root, 1-D CPU mesh):

``tiny``
    2 ``Linear(8, 8)``: 4 tensors.
``50mb``
    12 ``Linear(1024, 1024, bias=False)``: 12 tensors, 48 MiB (50.3 MB) of
    parameters.

Optimizers are stepped once on gradients of ones set on the sharded
parameters (no backward pass: FSDP2's backward on gloo costs seconds of
setup and the flows only need every parameter to have its state).

Part 1, first call and fixed cost (tiny model, Adam):
    one fresh process pair per (implementation, form), forms ``sharded``
    (default options) and ``full`` (``full_state_dict=True``; the load
    gets the full dict on every rank).  In it, after the model is built and
    the implementation's module imported (``import_s``; dcp_optim's
    bytecode is written first, as an install does: ``compile_bytecode``),
    the first ``get_state_dict`` and the first ``set_state_dict`` (loading
    what the get returned) are timed; then ``--first-reps`` more of each, whose
    median is the fixed cost per call, beside the same number of lone
    one-element ``all_reduce`` calls (``1 coll``: what one blocking
    collective costs behind the barrier on the host).  Then one more call
    of each counted by ``benchmarks.distributed.count_collectives``:
    ``colls`` = the
    collectives reaching the c10d dispatcher per rank, barriers included
    (every agreement exchange is one).  The launches alternate
    implementations (upstream first), so neither warms the other; a
    further launch per form runs dcp_optim's first calls under cProfile.
Part 2, trainers (one process pair per client, both models, both
implementations):
    ``fabric``: Lightning Fabric's ``ModelParallelStrategy`` (FSDP2), Adam;
    ``fabric.save(path, {"model", "optimizer", "step"})`` then
    ``fabric.load(path, state)`` into a freshly set-up model and
    never-stepped optimizer, in both checkpoint forms
    (``save_distributed_checkpoint=True``: a DCP directory; ``False``: one
    full-state-dict file).
    ``torchtune``: what its distributed recipes call, AdamW:
    save = ``training.gather_cpu_state_dict`` +
    ``training.get_full_optimizer_state_dict`` + ``torch.save`` on rank 0;
    load = ``torch.load`` on every rank +
    ``training.load_from_full_model_state_dict`` +
    ``training.load_from_full_optimizer_state_dict`` into a fresh model and
    never-stepped optimizer.  Twice: as torchtune 0.6.1 ships
    (``_DISTRIBUTED_STATE_DICT_API_IS_AVAILABLE = False``: the model load
    is torchtune's own code, the state-dict API does the optimizer gather
    and ``_init_optim_state``) and with that switch on (``torchtune-dsd``:
    the loads are ``set_model_state_dict`` / ``set_optimizer_state_dict``
    broadcast from rank 0).
    Checkpoints go to a directory under ``/dev/shm`` (removed after each
    call).  dcp_optim's side runs under ``dcp_optim.patch()``, upstream's
    after ``dcp_optim.unpatch()``: the clients' code is unchanged.  One
    warm-up round then ``reps`` rounds, implementations alternating in
    order; each call behind ``gc.collect()`` and a barrier; a call's time is
    the slowest rank's; the median over rounds is reported with the ratio
    dcp_optim / upstream beside the target (tiny: <= 1.0, no slower; 50 MB:
    < 1.0, faster).  After the timed rounds, one more dcp_optim call of each
    operation runs under cProfile on rank 0; its top entries are printed
    for a target that is missed.
"""

from __future__ import annotations

import contextlib
import cProfile
import datetime
import gc
import io
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

IMPLS = ("upstream", "dcp_optim")
FORMS = ("sharded", "full")
MODELS: dict[str, tuple[int, int, bool]] = {"tiny": (2, 8, True), "50mb": (12, 1024, False)}
CLIENTS = ("fabric", "torchtune", "torchtune-dsd")
# ratio dcp_optim / upstream that meets the target: tiny "no slower", 50 MB "faster"
TARGETS = {"tiny": ("<=", 1.0), "50mb": ("<", 1.0)}


# --- process launch ------------------------------------------------------------------


def _worker(rank: int, world: int, store_path: str, port: int, fn_name: str, cfg: dict[str, Any],
            out_path: str) -> None:
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    result: dict[str, Any]
    try:
        import warnings

        warnings.filterwarnings("ignore")
        import torch
        import torch.distributed as dist

        from .common import tcp_store

        torch.set_num_threads(1)
        timeout = datetime.timedelta(seconds=cfg.get("timeout_s", 300))
        # the rendezvous store torchrun gives its ranks (dcp_optim's bounded
        # arrival meets on the group's store), or a FileStore
        store: Any = (dist.FileStore(store_path, world) if cfg.get("store") == "file" else
                      tcp_store(rank, world, port, timeout))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        try:
            result = globals()[fn_name](rank, world, cfg)
        finally:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - reported by the parent
        result = {"fatal": "".join(traceback.format_exception(exc))[-4000:]}
    with open(out_path, "w") as f:
        json.dump(result, f)


def launch(fn_name: str, cfg: dict[str, Any], world: int = 2, timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """Runs ``fn_name(rank, world, cfg)`` of this module on ``world`` fresh
    gloo processes; returns every rank's result (raises if one failed)."""
    from .common import free_port, spawn_ranks

    with tempfile.TemporaryDirectory(prefix="dcp-flows-") as tmp:
        store = os.path.join(tmp, "store")
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(world)]
        port = free_port()
        procs, _ = spawn_ranks(_worker, [(r, world, store, port, fn_name, cfg, outs[r]) for r in range(world)],
                               {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}, timeout_s)
        results = []
        for r, path in enumerate(outs):
            try:
                with open(path) as f:
                    results.append(json.load(f))
            except (OSError, ValueError):
                results.append({"fatal": f"rank {r}: no result (exit code {procs[r].exitcode})"})
    fatal = [f"rank {r}: {res['fatal']}" for r, res in enumerate(results) if "fatal" in res]
    if fatal:
        raise RuntimeError(f"flows: {fn_name} failed:\n" + "\n".join(fatal))
    return results


# --- helpers inside the ranks ------------------------------------------------------


def _model(name: str):
    import torch
    import torch.nn as nn

    layers, dim, bias = MODELS[name]
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(dim, dim, bias=bias) for _ in range(layers)])


def _shard(model, mesh=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = mesh if mesh is not None else init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _step(model, optim) -> None:
    import torch

    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optim.step()
    optim.zero_grad(set_to_none=True)


def _timed(fn: Callable[[], Any]) -> float:
    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    t0 = time.perf_counter()
    res = fn()
    dt = time.perf_counter() - t0
    del res
    return dt


def _profile(rank: int, fn: Callable[[], Any], top: int) -> str | None:
    """``fn`` behind a barrier, under cProfile on rank 0: the top entries
    by cumulative time (other ranks just run it)."""
    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    if rank != 0:
        fn()
        return None
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(top)
    lines = [ln.rstrip() for ln in buf.getvalue().splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if "ncalls" in ln), 0)
    head = next((ln.strip() for ln in lines if "function calls" in ln), "")
    return "\n".join([head, *lines[start:]])


def _impl(name: str):
    if name == "upstream":
        import torch.distributed.checkpoint.state_dict as upstream

        return upstream
    import dcp_optim

    return dcp_optim


@contextlib.contextmanager
def _running(impl: str):
    """The clients' unchanged code on ``impl``: under ``dcp_optim.patch()``
    or after ``dcp_optim.unpatch()``."""
    import dcp_optim

    if impl == "dcp_optim":
        dcp_optim.patch()
        try:
            yield
        finally:
            dcp_optim.unpatch()
    else:
        dcp_optim.unpatch()
        yield


# --- part 1: first call and fixed cost ---------------------------------------------


def first_call(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    from .common import copy_containers
    from .distributed import _Counters, count_collectives, summarize_counts

    model = _shard(_model("tiny"))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    _step(model, optim)
    t0 = time.perf_counter()
    mod = _impl(cfg["impl"])
    import_s = time.perf_counter() - t0
    opts = mod.StateDictOptions(full_state_dict=cfg["form"] == "full")
    box: dict[str, Any] = {}

    def get() -> None:
        box["sd"] = mod.get_state_dict(model, optim, options=opts)

    def load() -> None:
        msd, osd = copy_containers(box["sd"])
        mod.set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd, options=opts)

    if cfg.get("profile_first"):  # a launch of its own: the first calls under cProfile
        return {"first_get_profile": _profile(rank, get, cfg["profile_top"]),
                "first_set_profile": _profile(rank, load, cfg["profile_top"])}
    out: dict[str, Any] = {"import_s": import_s, "first_get_s": _timed(get), "first_set_s": _timed(load)}
    gc.freeze()
    out["get_s"] = [_timed(get) for _ in range(cfg["reps"])]
    out["set_s"] = [_timed(load) for _ in range(cfg["reps"])]
    # the floor of one blocking collective behind the same barrier: a
    # one-element all_reduce (what one agreement exchange is on the wire)
    one = torch.zeros(1, dtype=torch.int64)
    out["coll_s"] = [_timed(lambda: torch.distributed.all_reduce(one)) for _ in range(cfg["reps"])]
    for op, fn in (("get", get), ("set", load)):
        counters = _Counters()
        gc.collect()
        torch.distributed.barrier()
        with count_collectives(counters):
            fn()
        out[f"{op}_colls"] = summarize_counts(counters)
        if cfg["impl"] == "dcp_optim" and cfg.get("profile_top"):
            out[f"{op}_profile"] = _profile(rank, fn, cfg["profile_top"])
    return out


def compile_bytecode() -> None:
    """Writes the bytecode of dcp_optim's modules, as ``pip install`` does
    for an installed package (torch's own modules in site-packages have
    theirs): where ``PYTHONDONTWRITEBYTECODE`` is set and the tree is a
    checkout, every fresh process would otherwise compile dcp_optim from
    source inside its import and its first calls (their lazy imports)."""
    import compileall

    import dcp_optim

    compileall.compile_dir(os.path.dirname(os.path.abspath(dcp_optim.__file__)), quiet=1)


def run_first_calls(reps: int, forms: tuple[str, ...] = FORMS, profile_top: int = 12, store: str = "tcp",
                    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> list[dict]:
    compile_bytecode()
    rows = []
    for form in forms:
        per_impl = {}
        for impl in IMPLS:
            log(f"[flows] first call: {impl}, {form}")
            res = launch("first_call", {"impl": impl, "form": form, "reps": reps, "profile_top": profile_top,
                                        "store": store})
            row: dict[str, Any] = {"form": form, "impl": impl,
                                   "import_s": max(r["import_s"] for r in res),
                                   "first_get_s": max(r["first_get_s"] for r in res),
                                   "first_set_s": max(r["first_set_s"] for r in res)}
            for op in ("get", "set"):
                row[f"{op}_s"] = statistics.median(max(r[f"{op}_s"][i] for r in res) for i in range(reps))
                colls = [r[f"{op}_colls"] for r in res]
                row[f"{op}_colls"] = max(c["wire_total"] + c["barriers"] for c in colls)
                row[f"{op}_colls_detail"] = colls[0]
                row[f"{op}_profile"] = res[0].get(f"{op}_profile")
            row["coll_s"] = statistics.median(max(r["coll_s"][i] for r in res) for i in range(reps))
            if impl == "dcp_optim" and profile_top:
                log(f"[flows] first call: {impl}, {form}, profiled")
                prof = launch("first_call", {"impl": impl, "form": form, "reps": reps, "profile_top": profile_top,
                                             "profile_first": True, "store": store})
                row["first_get_profile"] = prof[0]["first_get_profile"]
                row["first_set_profile"] = prof[0]["first_set_profile"]
            per_impl[impl] = row
            rows.append(row)
        for row in per_impl.values():
            row["steady_ratio"] = {op: per_impl["dcp_optim"][f"{op}_s"] / per_impl["upstream"][f"{op}_s"]
                                   for op in ("get", "set")}
            row["first_ratio"] = {op: per_impl["dcp_optim"][f"first_{op}_s"] / per_impl["upstream"][f"first_{op}_s"]
                                  for op in ("get", "set")}
    return rows


# --- part 2: trainers -----------------------------------------------------------------


def _rounds(rank: int, reps: int, ops: dict[str, Callable[[str, int], Callable[[], Any]]],
            after: Callable[[str, int], None], profile_top: int) -> dict[str, Any]:
    """``ops[name](impl, rep)`` prepares (untimed) and returns the timed
    call; ops run in their order, implementations alternating per round;
    ``after(impl, rep)`` cleans up.  Then one profiled dcp_optim round."""
    times: dict[str, dict[str, list[float]]] = {op: {impl: [] for impl in IMPLS} for op in ops}
    for rep in range(reps + 1):  # round 0 is the warm-up
        order = IMPLS if rep % 2 == 0 else IMPLS[::-1]
        for impl in order:
            with _running(impl):
                for op, prep in ops.items():
                    dt = _timed(prep(impl, rep))
                    if rep:
                        times[op][impl].append(dt)
                after(impl, rep)
    profiles: dict[str, str | None] = {}
    if profile_top:
        with _running("dcp_optim"):
            for op, prep in ops.items():
                profiles[op] = _profile(rank, prep("dcp_optim", -1), profile_top)
            after("dcp_optim", -1)
    return {"times": times, "profiles": profiles}


def _shm_dir(rank: int, tag: str) -> str:
    """A directory under /dev/shm (the temp dir where there is none) that
    every rank names the same."""
    import torch.distributed as dist

    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    box = [tempfile.mkdtemp(prefix=f"dcp-flows-{tag}-", dir=base) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None
    return box[0]


def _cleanup(rank: int, path: str) -> None:
    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    dist.barrier()


def fabric_flows(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    os.environ.update(NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    out: dict[str, Any] = {}
    root = _shm_dir(rank, "fabric")
    try:
        for form in cfg["forms"]:
            strategy = ModelParallelStrategy(
                lambda model, device_mesh: _shard(model, device_mesh["data_parallel"]),
                data_parallel_size=world, tensor_parallel_size=1,
                save_distributed_checkpoint=(form == "sharded"),
            )
            fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
            fabric.launch()
            for size in cfg["sizes"]:
                live: dict[str, Any] = {}

                def setup(stepped: bool, size: str = size, fabric: Any = fabric) -> dict[str, Any]:
                    model = fabric.setup_module(_model(size))
                    optim = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-3))
                    if stepped:
                        _step(model, optim)
                    return {"model": model, "optimizer": optim, "step": 1 if stepped else 0}

                def path(impl: str, rep: int, form: str = form, size: str = size) -> str:
                    return os.path.join(root, f"{size}-{form}-{impl}-{rep}" + ("" if form == "sharded" else ".ckpt"))

                def save(impl: str, rep: int, path: Callable[[str, int], str] = path,
                         setup: Callable[[bool], dict[str, Any]] = setup, fabric: Any = fabric) -> Callable[[], Any]:
                    live["state"] = setup(True)
                    return lambda: fabric.save(path(impl, rep), live["state"])

                def load(impl: str, rep: int, path: Callable[[str, int], str] = path,
                         setup: Callable[[bool], dict[str, Any]] = setup, fabric: Any = fabric) -> Callable[[], Any]:
                    live["state"] = setup(False)
                    return lambda: fabric.load(path(impl, rep), live["state"])

                def after(impl: str, rep: int, path: Callable[[str, int], str] = path) -> None:
                    live.clear()
                    _cleanup(rank, path(impl, rep))

                res = _rounds(rank, cfg["reps"][size], {"save": save, "load": load}, after, cfg["profile_top"])
                out[f"fabric/{form}/{size}"] = res
    finally:
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    return out


def torchtune_flows(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.nn as nn
    import torchtune.training._distributed as ttd  # type: ignore[import-untyped]
    from torchtune import training

    cpu = torch.device("cpu")
    is_zero = rank == 0
    out: dict[str, Any] = {}
    root = _shm_dir(rank, "torchtune")
    shipped = ttd._DISTRIBUTED_STATE_DICT_API_IS_AVAILABLE
    try:
        for client in cfg["clients"]:
            ttd._DISTRIBUTED_STATE_DICT_API_IS_AVAILABLE = shipped if client == "torchtune" else True
            for size in cfg["sizes"]:
                live: dict[str, Any] = {}

                def setup(stepped: bool, size: str = size) -> tuple[Any, Any]:
                    model = _model(size)
                    training.shard_model(model, [lambda name, m: isinstance(m, nn.Linear)], cpu_offload=False)
                    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
                    if stepped:
                        _step(model, optim)
                    return model, optim

                def path(impl: str, rep: int, size: str = size, client: str = client) -> str:
                    return os.path.join(root, f"{client}-{size}-{impl}-{rep}.pt")

                def save(impl: str, rep: int, path: Callable[[str, int], str] = path,
                         setup: Callable[[bool], tuple[Any, Any]] = setup) -> Callable[[], Any]:
                    model, optim = live["target"] = setup(True)

                    def run() -> None:
                        msd = training.gather_cpu_state_dict(model, is_zero, device=cpu)
                        osd = training.get_full_optimizer_state_dict(model, optim, is_zero, device=cpu)
                        if is_zero:
                            torch.save({"model": msd, "optimizer": osd}, path(impl, rep))
                    return run

                def load(impl: str, rep: int, path: Callable[[str, int], str] = path,
                         setup: Callable[[bool], tuple[Any, Any]] = setup) -> Callable[[], Any]:
                    import torch.distributed as dist

                    dist.barrier()  # rank 0's file is written
                    model, optim = live["target"] = setup(False)

                    def run() -> None:
                        ckpt = torch.load(path(impl, rep), weights_only=True, mmap=False)
                        training.load_from_full_model_state_dict(model, ckpt["model"], cpu, strict=True)
                        training.load_from_full_optimizer_state_dict(model, optim, ckpt["optimizer"], cpu)
                    return run

                def after(impl: str, rep: int, path: Callable[[str, int], str] = path) -> None:
                    live.clear()
                    _cleanup(rank, path(impl, rep))

                res = _rounds(rank, cfg["reps"][size], {"save": save, "load": load}, after, cfg["profile_top"])
                out[f"{client}/-/{size}"] = res
    finally:
        ttd._DISTRIBUTED_STATE_DICT_API_IS_AVAILABLE = shipped
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    return out


def run_trainers(sizes: tuple[str, ...], reps: dict[str, int], clients: tuple[str, ...] = CLIENTS,
                 forms: tuple[str, ...] = FORMS, profile_top: int = 12, store: str = "tcp",
                 log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> list[dict]:
    compile_bytecode()
    results: dict[str, Any] = {}
    base = {"sizes": list(sizes), "reps": reps, "profile_top": profile_top, "store": store}
    if "fabric" in clients:
        log("[flows] Lightning Fabric save/load")
        results.update(_merge(launch("fabric_flows", {**base, "forms": list(forms)})))
    tt = [c for c in clients if c.startswith("torchtune")]
    if tt:
        log("[flows] torchtune save/load")
        results.update(_merge(launch("torchtune_flows", {**base, "clients": tt})))
    return _rows(results)


def _merge(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Per flow: the slowest rank's time per round, rank 0's profiles."""
    merged: dict[str, Any] = {}
    for key, res0 in per_rank[0].items():
        times: dict[str, dict[str, list[float]]] = {}
        for op, by_impl in res0["times"].items():
            times[op] = {impl: [max(r[key]["times"][op][impl][i] for r in per_rank) for i in range(len(samples))]
                         for impl, samples in by_impl.items()}
        merged[key] = {"times": times, "profiles": res0["profiles"]}
    return merged


def _rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for key, res in results.items():
        client, form, size = key.split("/")
        for op, by_impl in res["times"].items():
            up, ours = statistics.median(by_impl["upstream"]), statistics.median(by_impl["dcp_optim"])
            cmp, bound = TARGETS[size]
            ratio = ours / up
            rows.append({"client": client, "form": form, "size": size, "op": op, "upstream_s": up,
                         "dcp_optim_s": ours, "ratio": ratio, "target": f"{cmp} {bound:.1f}",
                         "met": ratio <= bound if cmp == "<=" else ratio < bound,
                         "reps": len(by_impl["upstream"]), "samples_s": by_impl,
                         "profile": res["profiles"].get(op)})
    return rows


# --- the section ---------------------------------------------------------------------


def _load_avg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def report(first: list[dict], trainers: list[dict], *, first_reps: int, show_profiles: bool = True,
           store: str = "tcp") -> str:
    lines = [f"\n(section 9: rendezvous store of the process groups: {'TCPStore' if store == 'tcp' else 'FileStore'})"]
    if first:
        lines.append(f"\n== 9a. First call and fixed cost: tiny FSDP2 model (2 x Linear(8, 8)) + Adam, 2 gloo "
                     f"ranks; first call in a fresh process pair per (implementation, form), steady = median of "
                     f"{first_reps} later calls; slowest rank ==")
        lines.append("   colls = collectives per call per rank at the c10d dispatcher, barriers included "
                     "(agreement exchanges are among them)")
        lines.append("   1 coll = one blocking one-element all_reduce behind the same barrier (the floor of "
                     "a call with a collective on this host)")
        lines.append("   ratio = dcp_optim / upstream for the first calls and the steady calls (get/set), "
                     "beside the aim: no slower")
        lines.append(f"{'form':>8}  {'impl':>9}  {'import':>8}  {'1st get':>9}  {'1st set':>9}  "
                     f"{'get':>9}  {'set':>9}  {'1 coll':>8}  {'colls get/set':>13}  {'ratio 1st':>11}  "
                     f"{'ratio steady':>12}  target")
        for r in first:
            tail = ""
            if r["impl"] == "dcp_optim":
                fr, st = r["first_ratio"], r["steady_ratio"]
                tail = (f"{fr['get']:>5.2f}/{fr['set']:<5.2f}  {st['get']:>6.2f}/{st['set']:<5.2f}  <= 1.0: first "
                        + ("met" if max(fr.values()) <= 1.0 else "MISSED") + ", steady "
                        + ("met" if max(st.values()) <= 1.0 else "MISSED"))
            lines.append(f"{r['form']:>8}  {r['impl']:>9}  {r['import_s'] * 1e3:>6.1f}ms  "
                         f"{r['first_get_s'] * 1e3:>7.2f}ms  {r['first_set_s'] * 1e3:>7.2f}ms  "
                         f"{r['get_s'] * 1e3:>7.2f}ms  {r['set_s'] * 1e3:>7.2f}ms  {r['coll_s'] * 1e3:>6.2f}ms  "
                         f"{r['get_colls']:>6}/{r['set_colls']:<6}  {tail}")
        missed = [(r, kind, op) for r in first if r["impl"] == "dcp_optim" for kind in ("first", "steady")
                  for op in ("get", "set")
                  if r[f"{kind}_ratio"][op] > 1.0 and r.get(f"{'first_' if kind == 'first' else ''}{op}_profile")]
        if show_profiles and missed:
            lines.append("\n-- profiles of the missed aims (dcp_optim, rank 0, cProfile, by cumulative time; "
                         "first calls: in a launch of their own) --")
            for r, kind, op in missed:
                lines.append(f"\n{r['form']} {op}_state_dict, {kind} call:")
                lines.append(r[f"{'first_' if kind == 'first' else ''}{op}_profile"])
    if trainers:
        reps = sorted({r["reps"] for r in trainers})
        lines.append(f"\n== 9b. Trainers' save and load, 2 gloo ranks, dcp_optim (patched) vs upstream, "
                     f"interleaved; median of {'/'.join(map(str, reps))} rounds, slowest rank ==")
        lines.append(f"{'client':>13}  {'form':>7}  {'model':>5}  {'op':>4}  {'upstream':>10}  "
                     f"{'dcp_optim':>10}  {'ratio':>6}  target")
        for r in trainers:
            lines.append(f"{r['client']:>13}  {r['form']:>7}  {r['size']:>5}  {r['op']:>4}  "
                         f"{r['upstream_s'] * 1e3:>8.1f}ms  {r['dcp_optim_s'] * 1e3:>8.1f}ms  {r['ratio']:>5.2f}x  "
                         f"{r['target']}  {'met' if r['met'] else 'MISSED'}")
        missed_rows = [r for r in trainers if not r["met"] and r.get("profile")]
        if show_profiles and missed_rows:
            lines.append("\n-- profiles of the missed targets (one extra dcp_optim call, rank 0, cProfile, "
                         "by cumulative time) --")
            for r in missed_rows:
                lines.append(f"\n{r['client']} {r['form']} {r['size']} {r['op']}:")
                lines.append(r["profile"])
    lines.append(f"\nload average (1, 5, 15 min) at the end: {_load_avg()}")
    return "\n".join(lines)


def run_section(*, sizes: tuple[str, ...] = ("tiny", "50mb"), first_reps: int = 20,
                reps: dict[str, int] | None = None, clients: tuple[str, ...] = CLIENTS,
                forms: tuple[str, ...] = FORMS, first: bool = True, profile_top: int = 12,
                store: str = "tcp") -> dict[str, Any]:
    reps = reps or {"tiny": 7, "50mb": 5}
    t0 = time.perf_counter()
    load_before = _load_avg()
    first_rows = run_first_calls(first_reps, forms, profile_top, store) if first else []
    trainer_rows = run_trainers(sizes, reps, clients, forms, profile_top, store) if clients else []
    text = report(first_rows, trainer_rows, first_reps=first_reps, store=store)
    print(text, flush=True)
    return {"first_call": first_rows, "trainers": trainer_rows, "load_avg_before": load_before,
            "load_avg_after": _load_avg(), "wall_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m benchmarks.flows", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="tiny,50mb", help="models of the trainer flows (tiny,50mb)")
    p.add_argument("--clients", default=",".join(CLIENTS), help="fabric,torchtune,torchtune-dsd ('' for none)")
    p.add_argument("--forms", default=",".join(FORMS), help="sharded,full (part 1 and Fabric's checkpoint form)")
    p.add_argument("--reps", default="7,5", help="timed rounds of the trainer flows: tiny,50mb (default 7,5)")
    p.add_argument("--first-reps", type=int, default=20, help="part 1: steady calls after the first (default 20)")
    p.add_argument("--no-first", action="store_true", help="skip part 1")
    p.add_argument("--store", choices=("tcp", "file"), default="tcp",
                   help="rendezvous store of the process groups: TCPStore as under torchrun (default), FileStore")
    p.add_argument("--json", dest="json_path", help="write the results here")
    args = p.parse_args(argv)
    tiny_reps, big_reps = (int(x) for x in args.reps.split(","))
    out = run_section(sizes=tuple(s for s in args.sizes.split(",") if s), first_reps=args.first_reps,
                      reps={"tiny": tiny_reps, "50mb": big_reps},
                      clients=tuple(c for c in args.clients.split(",") if c),
                      forms=tuple(f for f in args.forms.split(",") if f), first=not args.no_first,
                      store=args.store)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    from benchmarks import flows

    sys.exit(flows.main())
