"""Section 8 (opt-in): the transport limit of full gets and broadcast loads.

For each model and world size (gloo on CPU, a TCPStore as under torchrun), dcp_optim's call against the raw
collective that moves the same bytes on the same group, in the same process
group and run:

``full_get`` / ``full_get_offload``
    ``get_model_state_dict(full_state_dict=True[, cpu_offload=True])``
    against one ``all_gather_into_tensor`` of a byte buffer the size of the
    whole model (its output allocated inside the timed region, as the full
    tensors are).
``bcast_model`` / ``bcast_optim``
    ``set_{model,optimizer}_state_dict(full_state_dict=True,
    broadcast_from_rank0=True)`` (rank 0 holds the full dict, the others
    ``{}``) against one ``broadcast`` of a byte buffer the size of every
    tensor of the full dict (allocated before the timed region: a load
    writes into live tensors).

Models (FSDP2 ``fully_shard`` per layer and at the root, 1-D mesh, Adam
after one step):

``big``
    12 ``Linear(1024, 1024, bias=False)``: 12 tensors, 48 MiB of parameters.
``small``
    256 ``Linear(256, 256)``: 512 tensors, 64 MiB of parameters.

Timing: one warm-up then ``reps`` rounds, dcp_optim and the raw collective
alternating; each call behind a barrier; a call's time is the slowest
rank's; the median over rounds is reported, and the ratio dcp_optim / raw
beside the 1.2x target.
"""

from __future__ import annotations

import datetime
import gc
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

TARGET = 1.2
MODELS = {"big": (12, 1024, False), "small": (256, 256, True)}
OPS = ("full_get", "full_get_offload", "bcast_model", "bcast_optim")


def _build(name: str, world: int):
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layers, dim, bias = MODELS[name]
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(dim, dim, bias=bias) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    from .common import adam_after_one_step

    return model, adam_after_one_step(model)


def _tensor_bytes(tree: Any) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(v) for v in tree)
    return 0


def _measure(rank: int, world: int, model_name: str, reps: int) -> dict[str, Any]:
    import dcp_optim
    from dcp_optim import StateDictOptions

    model, optim = _build(model_name, world)
    full_opts = StateDictOptions(full_state_dict=True)
    off_opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    bcast_opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    full_model = dcp_optim.get_model_state_dict(model, options=off_opts)
    full_optim = dcp_optim.get_optimizer_state_dict(model, optim, options=off_opts)
    model_bytes = _tensor_bytes(dcp_optim.get_model_state_dict(model, options=full_opts))
    optim_bytes = _tensor_bytes(dcp_optim.get_optimizer_state_dict(model, optim, options=full_opts))
    if rank != 0:
        full_model, full_optim = {}, {}

    def raw_gather(nbytes: int):
        seg = torch.ones(nbytes // world, dtype=torch.uint8)

        def run() -> None:
            out = torch.empty(seg.numel() * world, dtype=torch.uint8)
            dist.all_gather_into_tensor(out, seg)
        return run

    def raw_bcast(nbytes: int):
        buf = torch.ones(nbytes, dtype=torch.uint8)
        return lambda: dist.broadcast(buf, src=0)

    def shallow(d: dict) -> dict:
        return {k: (shallow(v) if isinstance(v, dict) else v) for k, v in d.items()}

    pairs = {
        "full_get": (lambda: dcp_optim.get_model_state_dict(model, options=full_opts), raw_gather(model_bytes),
                     model_bytes),
        "full_get_offload": (lambda: dcp_optim.get_model_state_dict(model, options=off_opts),
                             raw_gather(model_bytes), model_bytes),
        "bcast_model": (lambda: dcp_optim.set_model_state_dict(model, shallow(full_model), options=bcast_opts),
                        raw_bcast(model_bytes), model_bytes),
        "bcast_optim": (lambda: dcp_optim.set_optimizer_state_dict(model, optim, shallow(full_optim),
                                                                   options=bcast_opts),
                        raw_bcast(optim_bytes), optim_bytes),
    }
    gc.freeze()
    times: dict[str, dict[str, list[float]]] = {op: {"dcp_optim": [], "raw": []} for op in OPS}
    for rep in range(reps + 1):
        for op in OPS:
            ours, raw, _ = pairs[op]
            order = [("dcp_optim", ours), ("raw", raw)]
            if rep % 2:
                order.reverse()
            for impl, fn in order:
                gc.collect()
                dist.barrier()
                t0 = time.perf_counter()
                result = fn()
                dt = time.perf_counter() - t0
                del result
                if rep:
                    times[op][impl].append(dt)
    return {"times": times, "bytes": {op: pairs[op][2] for op in OPS}}


def _rank_main(rank: int, world: int, port: int, model_name: str, reps: int, queue) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["WORLD_SIZE"] = str(world)
    torch.set_num_threads(1)
    from .common import tcp_store

    timeout = datetime.timedelta(seconds=600)
    dist.init_process_group("gloo", store=tcp_store(rank, world, port, timeout), rank=rank, world_size=world,
                            timeout=timeout)
    try:
        queue.put((rank, _measure(rank, world, model_name, reps)))
    finally:
        dist.destroy_process_group()


def run_gloo(world: int, model_name: str, reps: int) -> dict[str, Any]:
    ctx = mp.get_context("forkserver")
    queue = ctx.Queue()
    from .common import free_port

    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, model_name, reps, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join(timeout=120)
    rows = []
    for op in OPS:
        med = {}
        for impl in ("dcp_optim", "raw"):
            n = len(results[0]["times"][op][impl])
            med[impl] = statistics.median(max(results[r]["times"][op][impl][i] for r in results) for i in range(n))
        rows.append({"model": model_name, "world": world, "op": op, "mb": results[0]["bytes"][op] / 2**20,
                     "dcp_optim_s": med["dcp_optim"], "raw_s": med["raw"], "ratio": med["dcp_optim"] / med["raw"]})
    return {"rows": rows}


def run_section(worlds: tuple[int, ...] = (2, 4), models: tuple[str, ...] = ("big", "small"),
                reps: int = 5) -> dict[str, Any]:
    rows = []
    for name in models:
        for w in worlds:
            rows.extend(run_gloo(w, name, reps)["rows"])
    print(f"\n== 8. Transport limit: dcp_optim vs the raw collective moving the same bytes "
          f"(gloo, median of {reps}, slowest rank; target <= {TARGET}x) ==")
    print(f"{'model':>6}  {'ranks':>5}  {'op':>17}  {'MiB':>6}  {'dcp_optim':>10}  {'raw':>9}  {'ratio':>6}  target")
    for r in rows:
        ok = "met" if r["ratio"] <= TARGET else "MISSED"
        print(f"{r['model']:>6}  {r['world']:>5}  {r['op']:>17}  {r['mb']:>6.1f}  {r['dcp_optim_s']:>9.3f}s  "
              f"{r['raw_s']:>8.3f}s  {r['ratio']:>5.2f}x  {ok}")
    return {"rows": rows, "target": TARGET}


if __name__ == "__main__":
    import sys

    worlds = tuple(int(w) for w in sys.argv[1].split(",")) if len(sys.argv) > 1 else (2, 4)
    models = tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else ("big", "small")
    run_section(worlds, models, int(sys.argv[3]) if len(sys.argv) > 3 else 5)
