"""Section 7: in-memory resharding (``dcp_optim.reshard_state_dict``).

``python -m benchmarks --sections 7 [--reshard-mb 100] [--reshard-worlds 2,4]``

Part A, gloo on this machine: a model of ``--reshard-mb`` MB of float32
weights (square 1024-column matrices), held as DTensors sharded the FSDP2
way (``Shard(0)`` on a 1-D mesh), moved into a tensor-parallel template
(``Shard(1)`` on the same ranks) five ways, alternately, on the same
objects:

* ``reshard``   -- ``reshard_state_dict`` (point-to-point, bucketed), with
  its undo log (the default);
* ``kept``      -- the same with a ``ReshardBuffers`` kept across the
  repeats (a sync at every step: buckets and the undo log's host copy
  reuse their pages);
* ``no_undo``   -- the same with ``DCP_OPTIM_STREAM_UNDO=0`` (no host copy
  of the template shards it receives into);
* ``gather``    -- ``full_tensor()`` of each tensor, then a copy of the
  rank's slice (a full gather followed by a local slice);
* ``dcp_shm``   -- ``dcp.save`` into a fresh /dev/shm folder, then
  ``dcp.load`` into the template (tmpfs: no disk).

Each is timed as the slowest rank's wall time, median of ``--reshard-reps``
after a warm-up, and the five results are checked to be bit-identical.

Part B, planning cost at scale (one process, no process group): the
native plan of one rank of W, W up to 16384, for a (16384, 16384) tensor
moved FSDP2 -> TP and FSDP2 -> FSDP2 on half the ranks: CPU time of
``reshard_plan``, peers, and the bytes the rank receives and copies
locally against the bytes its destination shard needs.

Part C, the whole call at scale (``fake_call``, one fresh process per W and
pair): rank W // 3 of W on torch's fake process group runs
``reshard_state_dict`` end to end -- descriptions, the digest agreement
(the fake all_reduce leaves this rank's own digest: every rank agrees),
the plan, the bucket copies, every ``batch_isend_irecv`` and the dense
layouts' one collective per tensor (``all_to_all_single``, all-gather;
the fake group moves no data).  It reports the CPU time of the first call
(plans built) and of a repeat (plans cached), the part of it spent inside
the fake group's dense collectives (``fake coll``: it emulates an
all-gather by copying the input into each of the output's W blocks, CPU
work that a real group's transport does not put on the rank), the
collectives, the peers and the bytes this rank sends and receives, and
checks received + copied locally = its destination shard.  Leaving ranks (which get the view in one
broadcast) are not simulated.
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


def _rank_main(rank: int, world: int, port: int, cfg: dict[str, Any], queue) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    from .common import tcp_store

    timeout = datetime.timedelta(seconds=600)
    dist.init_process_group("gloo", store=tcp_store(rank, world, port, timeout), rank=rank, world_size=world,
                            timeout=timeout)
    try:
        queue.put((rank, _measure(rank, world, cfg)))
    finally:
        dist.destroy_process_group()


def _measure(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import dcp_optim
    from dcp_optim._engine.distribute import UNDO_ENV

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    src: dict[str, Any] = {}
    templates: dict[str, dict[str, Any]] = {name: {} for name in ("reshard", "kept", "no_undo", "gather", "dcp_shm")}
    for i, shape in enumerate(_tensors(cfg["mb"])):
        full = torch.randn(shape, generator=g)
        src[f"layer{i}.weight"] = distribute_tensor(full, mesh, [Shard(0)])
        for t in templates.values():
            t[f"layer{i}.weight"] = distribute_tensor(torch.zeros(shape), mesh, [Shard(1)])
        del full

    def run_reshard():
        dcp_optim.reshard_state_dict(src, templates["reshard"], bucket_bytes=cfg["bucket_bytes"])

    buffers = dcp_optim.ReshardBuffers()

    def run_kept():
        dcp_optim.reshard_state_dict(src, templates["kept"], bucket_bytes=cfg["bucket_bytes"], buffers=buffers)

    def run_no_undo():
        # DCP_OPTIM_STREAM_UNDO=0: no host copy of the template shards
        # (a failure mid-transfer then leaves them partly written)
        os.environ[UNDO_ENV] = "0"
        try:
            dcp_optim.reshard_state_dict(src, templates["no_undo"], bucket_bytes=cfg["bucket_bytes"])
        finally:
            del os.environ[UNDO_ENV]

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

    runs = {"reshard": run_reshard, "kept": run_kept, "no_undo": run_no_undo, "gather": run_gather, "dcp_shm": run_dcp}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for rep in range(cfg["reps"] + 1):
        order = list(runs)[rep % len(runs):] + list(runs)[:rep % len(runs)]
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            runs[name]()
            dt = time.perf_counter() - t0
            if rep:
                times[name].append(dt)
    same = all(
        torch.equal(templates["reshard"][k].to_local(), templates[other][k].to_local())
        for k in src for other in ("kept", "no_undo", "gather", "dcp_shm")
    )
    return {"times": times, "identical": same, "mb": sum(v.numel() * 4 for v in src.values()) / 2**20}


def run_gloo(world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    ctx = mp.get_context("forkserver")
    queue = ctx.Queue()
    from .common import free_port

    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, cfg, queue)) for r in range(world)]
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


# --- part C: the whole call on torch's fake process group ---------------------------

FAKE_SHAPE = (16384, 16384)


def fake_call(world: int, pair: str, reps: int = 2) -> dict[str, Any]:
    """One rank (W // 3) of a world of W on torch's fake process group: the
    whole ``reshard_state_dict`` call -- descriptions, the agreement (its
    all_reduce leaves this rank's own digest: every rank agrees), the plan
    and every ``batch_isend_irecv`` issued on the fake group (which moves
    nothing; the bucket copies are real).  Two leaves: a (16384, 16384)
    float32 weight and its (16384,) bias, FSDP2 ``Shard(0)`` at W, moved to
    TP (weight ``Shard(1)``, bias ``Replicate``) or to FSDP2 on the first
    W / 2 ranks.  Returns the CPU time of the first call (plans built) and
    of a repeat (plans cached), the collectives and the bytes this rank
    sends and receives."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import dcp_optim
    from dcp_optim._engine import reshard as engine
    from dcp_optim._engine.core import C

    rank = world // 3
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    half = DeviceMesh("cpu", torch.arange(world // 2)) if pair == "fsdp->fsdp(W/2)" else None

    def dtensor(shape, m, placements, fill):
        spec = [(1, p.dim, 1) if isinstance(p, Shard) else (0, 0, 1) for p in placements]
        coord = m.get_coordinate()
        ((lshape, _),) = C.shard_layouts(list(shape), list(m.shape), spec, [list(coord)])
        local = torch.full(tuple(lshape), fill, dtype=torch.float32)
        stride = tuple(int(torch.tensor(shape[i + 1:]).prod()) for i in range(len(shape)))
        return DTensor.from_local(local, m, placements, run_check=False, shape=torch.Size(shape), stride=stride)

    shapes = {"w": FAKE_SHAPE, "b": FAKE_SHAPE[:1]}
    src = {k: dtensor(s, mesh, [Shard(0)], 1.0) for k, s in shapes.items()}
    if half is None:
        tmpl = {"w": dtensor(shapes["w"], mesh, [Shard(1)], 0.0), "b": dtensor(shapes["b"], mesh, [Replicate()], 0.0)}
    else:
        tmpl = {k: dtensor(s, half, [Shard(0)], 0.0) for k, s in shapes.items()}
    need = sum(v.to_local().numel() * 4 for v in tmpl.values())

    counts: dict[str, Any] = {"sent": 0, "recv": 0, "p2p_batches": 0, "peers": set(), "all_reduce": 0, "broadcast_object_list": 0,
              "all_gather_object": 0, "dense": 0, "dense_local": 0, "fake_s": 0.0}
    orig = {name: getattr(dist, name) for name in ("batch_isend_irecv", "all_reduce", "broadcast_object_list",
                                                    "all_gather_object", "all_to_all_single", "all_gather_single",
                                                    "all_gather_into_tensor") if hasattr(dist, name)}

    def batch(ops):
        counts["p2p_batches"] += 1
        for op in ops:
            n = op.tensor.numel() * op.tensor.element_size()
            counts["sent" if op.op is dist.isend else "recv"] += n
            counts["peers"].add(op.peer)
        return orig["batch_isend_irecv"](ops)

    def dense(name):
        # one collective over the group: this rank's own block stays
        # local, the W - 1 others travel (all-gather: its block to each)
        def call(out, inp, *args, **kwargs):
            counts["dense"] += 1
            o, i = out.numel() * out.element_size(), inp.numel() * inp.element_size()
            if name == "all_to_all_single":
                counts["sent"] += i - i // world
                counts["recv"] += o - o // world
                counts["dense_local"] += o // world
            else:
                counts["sent"] += i * (world - 1)
                counts["recv"] += o - i
                counts["dense_local"] += i
            if len(counts["peers"]) < world - 1:
                counts["peers"].update(r for r in range(world) if r != rank)
            t0 = time.process_time()
            try:
                return orig[name](out, inp, *args, **kwargs)
            finally:
                # the fake group emulates a gather by copying the input
                # into each of the W blocks of the output (a real one
                # moves the bytes outside this rank's CPU): kept apart
                counts["fake_s"] += time.process_time() - t0
        return call

    def counted(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return orig[name](*args, **kwargs)
        return call

    dist.batch_isend_irecv = batch
    for name in ("all_reduce", "broadcast_object_list", "all_gather_object"):
        setattr(dist, name, counted(name))
    for name in ("all_to_all_single", "all_gather_single", "all_gather_into_tensor"):
        if name in orig:
            setattr(dist, name, dense(name))
    try:
        times, fakes = [], []
        for i in range(reps + 1):
            if i == 1:
                first = {k: (len(v) if isinstance(v, set) else v) for k, v in counts.items()}
            f0 = counts["fake_s"]
            t0 = time.process_time()
            dcp_optim.reshard_state_dict(src, tmpl)
            times.append(time.process_time() - t0)
            fakes.append(counts["fake_s"] - f0)
    finally:
        for name, fn in orig.items():
            setattr(dist, name, fn)
    local = first["dense_local"]
    for key, (loc, _, _) in engine._PLAN_CACHE.items():
        if key[-1] == rank:
            for _, _, lens in loc:
                n = 4
                for x in lens:
                    n *= x
                local += n
    dist.destroy_process_group()
    return {
        "world": world, "pair": pair, "rank": rank, "first_cpu_s": times[0], "repeat_cpu_s": min(times[1:]),
        "first_fake_s": fakes[0], "repeat_fake_s": fakes[1 + times[1:].index(min(times[1:]))],
        "sent_bytes": first["sent"], "recv_bytes": first["recv"], "local_bytes": local, "dst_shard_bytes": need,
        "peers": first["peers"], "p2p_batches": first["p2p_batches"], "dense": first["dense"],
        "all_reduce": first["all_reduce"],
        "broadcast_object_list": first["broadcast_object_list"], "all_gather_object": first["all_gather_object"],
        "agreement": engine.agreement_info(),
    }


def fake_scaling(worlds: list[int], reps: int = 2) -> list[dict[str, Any]]:
    """``fake_call`` for each W and pair, each in a fresh process."""
    import json
    import subprocess
    import sys

    out = []
    for world in worlds:
        for pair in ("fsdp->tp", "fsdp->fsdp(W/2)"):
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.reshard", "--fake", str(world), pair, str(reps)],
                capture_output=True, text=True, timeout=1800,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"fake-group simulation W={world} {pair} failed:\n{proc.stderr[-4000:]}")
            out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return out


def run_section(mb: float = 100.0, worlds: tuple[int, ...] = (2, 4), reps: int = 3,
                bucket_mb: float = 32.0, scale_worlds: tuple[int, ...] = (8, 64, 512, 4096, 16384),
                fake: bool = True) -> dict[str, Any]:
    cfg = {"mb": mb, "reps": reps, "bucket_bytes": int(bucket_mb * 2**20)}
    gloo = [run_gloo(w, cfg) for w in worlds]
    scaling = plan_scaling(list(scale_worlds))
    simulated = fake_scaling(list(scale_worlds)) if fake else []
    print(f"\n== 7. In-memory resharding: FSDP2 Shard(0) -> TP Shard(1), {gloo[0]['mb']:.0f} MB of float32, "
          f"gloo; median of {reps}, slowest rank ==")
    print(f"{'ranks':>5}  {'reshard':>9}  {'kept':>9}  {'no undo':>9}  {'gather+slice':>12}  {'dcp shm':>9}  "
          f"{'vs gather':>9}  {'vs dcp':>7}  {'kept vs gather':>14}  {'kept vs dcp':>11}  identical   "
          f"(targets at 4 ranks: 2x, 5x)")
    for g in gloo:
        m = g["median_s"]
        print(f"{g['world']:>5}  {m['reshard']:>8.3f}s  {m['kept']:>8.3f}s  {m['no_undo']:>8.3f}s  "
              f"{m['gather']:>11.3f}s  {m['dcp_shm']:>8.3f}s  {m['gather'] / m['reshard']:>8.1f}x  "
              f"{m['dcp_shm'] / m['reshard']:>6.1f}x  {m['gather'] / m['kept']:>13.1f}x  "
              f"{m['dcp_shm'] / m['kept']:>10.1f}x  {g['identical']}")
    print("\n-- planning rank W // 3 of W (reshard_plan, one (16384, 16384) float32 tensor) --")
    print(f"{'W':>6}  {'pair':>16}  {'plan CPU':>9}  {'peers':>6}  {'recv MB':>8}  {'local MB':>8}  {'shard MB':>8}")
    for s in scaling:
        print(f"{s['world']:>6}  {s['pair']:>16}  {s['plan_cpu_ms']:>7.3f}ms  {s['peers']:>6}  "
              f"{s['recv_bytes'] / 2**20:>8.3f}  {s['local_bytes'] / 2**20:>8.3f}  {s['dst_shard_bytes'] / 2**20:>8.3f}")
    if simulated:
        print("\n-- the whole call for rank W // 3 of W on torch's fake process group "
              "((16384, 16384) weight + (16384,) bias) --")
        print(f"{'W':>6}  {'pair':>16}  {'1st CPU':>9}  {'repeat CPU':>10}  {'fake coll':>9}  {'peers':>6}  "
              f"{'p2p':>6}  {'dense':>5}  {'coll':>4}  {'recv MB':>9}  {'sent MB':>9}  {'local MB':>9}  {'shard MB':>9}  recv+local=shard")
        for s in simulated:
            coll = s["all_reduce"] + s["broadcast_object_list"] + s["all_gather_object"]
            print(f"{s['world']:>6}  {s['pair']:>16}  {s['first_cpu_s'] * 1e3:>7.1f}ms  "
                  f"{s['repeat_cpu_s'] * 1e3:>8.1f}ms  {s['repeat_fake_s'] * 1e3:>7.1f}ms  {s['peers']:>6}  "
                  f"{s['p2p_batches']:>6}  {s['dense']:>5}  "
                  f"{coll:>4}  "
                  f"{s['recv_bytes'] / 2**20:>9.4f}  {s['sent_bytes'] / 2**20:>9.4f}  "
                  f"{s['local_bytes'] / 2**20:>9.4f}  {s['dst_shard_bytes'] / 2**20:>9.4f}  "
                  f"{s['recv_bytes'] + s['local_bytes'] == s['dst_shard_bytes']}")
    return {"gloo": gloo, "plan_scaling": scaling, "fake_scaling": simulated}


if __name__ == "__main__":
    import json
    import sys

    if len(sys.argv) >= 4 and sys.argv[1] == "--fake":
        print(json.dumps(fake_call(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 2)))
    else:
        run_section()
