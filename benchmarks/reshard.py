"""Section 6: in-memory resharding (``dcp_optim.reshard_state_dict``).

``python -m benchmarks --sections 7 [--reshard-mb 100] [--reshard-worlds 2,4]``

Part A, gloo on this machine: a model of ``--reshard-mb`` MB of float32
weights (square 1024-column matrices), held as DTensors sharded the FSDP2
way (``Shard(0)`` on a 1-D mesh), moved into a tensor-parallel template
(``Shard(1)`` on the same ranks) three ways, alternately, on the same
objects:

* ``reshard``   -- ``reshard_state_dict`` (point-to-point, bucketed);
* ``gather``    -- ``full_tensor()`` of each tensor, then a copy of the
  rank's slice (a full gather followed by a local slice);
* ``dcp_shm``   -- ``dcp.save`` into a fresh /dev/shm folder, then
  ``dcp.load`` into the template (tmpfs: no disk).

Each is timed as the slowest rank's wall time, median of ``--reshard-reps``
after a warm-up, and the three results are checked to be bit-identical.

Part B, planning cost at scale (one process, no process group): the
native plan of one rank of W, W up to 16384, for a (16384, 16384) tensor
moved FSDP2 -> TP and FSDP2 -> FSDP2 on half the ranks: CPU time of
``reshard_plan``, peers, and the bytes the rank receives and copies
locally against the bytes its destination shard needs.  The transfers themselves are not simulated (torch's fake
process group has no point-to-point operations to time).
"""

from __future__ import annotations

import datetime
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLS = 1024


def _tensors(total_mb: float) -> list[tuple[int, int]]:
    rows_total = int(total_mb * 1024 * 1024 / 4 / COLS)
    shapes = []
    while rows_total > 0:
        rows = min(2048, rows_total)
        shapes.append((rows, COLS))
        rows_total -= rows
    return shapes


def _rank_main(rank: int, world: int, store: str, cfg: dict[str, Any], queue) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    try:
        queue.put((rank, _measure(rank, world, cfg)))
    finally:
        dist.destroy_process_group()


def _measure(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import dcp_optim

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    src: dict[str, Any] = {}
    templates: dict[str, dict[str, Any]] = {name: {} for name in ("reshard", "gather", "dcp_shm")}
    for i, shape in enumerate(_tensors(cfg["mb"])):
        full = torch.randn(shape, generator=g)
        src[f"layer{i}.weight"] = distribute_tensor(full, mesh, [Shard(0)])
        for t in templates.values():
            t[f"layer{i}.weight"] = distribute_tensor(torch.zeros(shape), mesh, [Shard(1)])
        del full

    def run_reshard():
        dcp_optim.reshard_state_dict(src, templates["reshard"], bucket_bytes=cfg["bucket_bytes"])

    def run_gather():
        for k, v in src.items():
            full = v.full_tensor()
            dst = templates["gather"][k].to_local()
            n = dst.shape[1]
            dst.copy_(full[:, rank * n:(rank + 1) * n] if n else full[:, :0])
            del full

    def run_dcp():
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        path = [tempfile.mkdtemp(prefix="dcp_optim_bench_", dir=base) if rank == 0 else None]
        dist.broadcast_object_list(path, src=0)
        folder = path[0]
        assert folder is not None  # rank 0's, broadcast
        dcp.save(src, checkpoint_id=folder)
        dcp.load(templates["dcp_shm"], checkpoint_id=folder)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)

    runs = {"reshard": run_reshard, "gather": run_gather, "dcp_shm": run_dcp}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for rep in range(cfg["reps"] + 1):
        order = list(runs)[rep % 3:] + list(runs)[:rep % 3]
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            runs[name]()
            dt = time.perf_counter() - t0
            if rep:
                times[name].append(dt)
    same = all(
        torch.equal(templates["reshard"][k].to_local(), templates[other][k].to_local())
        for k in src for other in ("gather", "dcp_shm")
    )
    return {"times": times, "identical": same, "mb": sum(v.numel() * 4 for v in src.values()) / 2**20}


def run_gloo(world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    ctx = mp.get_context("forkserver")
    queue = ctx.Queue()
    store = tempfile.mktemp(prefix="dcp_optim_bench_store_")
    procs = [ctx.Process(target=_rank_main, args=(r, world, store, cfg, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join(timeout=120)
    reps = len(results[0]["times"]["reshard"])
    med = {
        name: statistics.median(max(results[r]["times"][name][i] for r in results) for i in range(reps))
        for name in results[0]["times"]
    }
    return {
        "world": world,
        "mb": results[0]["mb"],
        "median_s": med,
        "identical": all(r["identical"] for r in results.values()),
    }


def plan_scaling(worlds: list[int]) -> list[dict[str, Any]]:
    """One rank's plan (rank W // 3) of a (16384, 16384) float32 tensor,
    two pairs: FSDP2 -> TP (every rank exchanges with every other) and
    FSDP2 at W -> FSDP2 on the first W / 2 ranks (a few peers each)."""
    from dcp_optim._engine.core import C

    shape = [16384, 16384]
    out = []
    for world in worlds:
        ranks = list(range(world))
        rank = world // 3
        pairs = {
            "fsdp->tp": ([world], [(1, 1, 1)], ranks),
            "fsdp->fsdp(W/2)": ([world // 2], [(1, 0, 1)], ranks[: world // 2]),
        }
        for pair, (dmesh, dpl, dranks) in pairs.items():
            args = (shape, [world], [(1, 0, 1)], ranks, dmesh, dpl, dranks, rank)
            C.reshard_plan(*args)
            best = float("inf")
            for _ in range(3):
                t0 = time.process_time()
                local, recv, send = C.reshard_plan(*args)
                best = min(best, time.process_time() - t0)

            def nbytes(items, lens_at):
                total = 0
                for it in items:
                    n = 4
                    for x in it[lens_at]:
                        n *= x
                    total += n
                return total

            need = 0
            if rank in dranks:
                (lshape, _), = C.shard_layouts(shape, dmesh, dpl, [[dranks.index(rank)]])
                need = 4 * lshape[0] * lshape[1]
            out.append({
                "world": world, "pair": pair, "plan_cpu_ms": best * 1e3, "peers": len({p for p, *_ in recv + send}),
                "recv_bytes": nbytes(recv, 3), "send_bytes": nbytes(send, 3), "local_bytes": nbytes(local, 2),
                "dst_shard_bytes": need,
            })
    return out


def run_section(mb: float = 100.0, worlds: tuple[int, ...] = (2, 4), reps: int = 3,
                bucket_mb: float = 32.0, scale_worlds: tuple[int, ...] = (8, 64, 512, 4096, 16384)) -> dict[str, Any]:
    cfg = {"mb": mb, "reps": reps, "bucket_bytes": int(bucket_mb * 2**20)}
    gloo = [run_gloo(w, cfg) for w in worlds]
    scaling = plan_scaling(list(scale_worlds))
    print(f"\n== 6. In-memory resharding: FSDP2 Shard(0) -> TP Shard(1), {gloo[0]['mb']:.0f} MB of float32, "
          f"gloo; median of {reps}, slowest rank ==")
    print(f"{'ranks':>5}  {'reshard':>9}  {'gather+slice':>12}  {'dcp shm':>9}  {'vs gather':>9}  {'vs dcp':>7}  identical")
    for g in gloo:
        m = g["median_s"]
        print(f"{g['world']:>5}  {m['reshard']:>8.3f}s  {m['gather']:>11.3f}s  {m['dcp_shm']:>8.3f}s  "
              f"{m['gather'] / m['reshard']:>8.1f}x  {m['dcp_shm'] / m['reshard']:>6.1f}x  {g['identical']}")
    print("\n-- planning rank W // 3 of W (reshard_plan, one (16384, 16384) float32 tensor) --")
    print(f"{'W':>6}  {'pair':>16}  {'plan CPU':>9}  {'peers':>6}  {'recv MB':>8}  {'local MB':>8}  {'shard MB':>8}")
    for s in scaling:
        print(f"{s['world']:>6}  {s['pair']:>16}  {s['plan_cpu_ms']:>7.3f}ms  {s['peers']:>6}  "
              f"{s['recv_bytes'] / 2**20:>8.3f}  {s['local_bytes'] / 2**20:>8.3f}  {s['dst_shard_bytes'] / 2**20:>8.3f}")
    return {"gloo": gloo, "plan_scaling": scaling}


if __name__ == "__main__":
    run_section()
