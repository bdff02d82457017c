"""``python -m dcp_optim.demo reshard``: move a trained FSDP2 model and its
optimizer to tensor parallelism in memory and keep training.

Two gloo processes on this machine each run both paths:

* **in memory**: FSDP2 training for ``--save-at`` steps, then
  :func:`dcp_optim.reshard_model_and_optimizer` moves the model and the
  AdamW state into a fresh TP model (ColwiseParallel / RowwiseParallel
  blocks) and a never-stepped optimizer, with no disk and no full gather;
* **through DCP**: the same FSDP2 state saved with ``dcp.save`` and loaded
  into another fresh TP model with ``dcp.load`` (the template flow).

Both TP models then train to ``--steps``; their losses must be identical
bit for bit (exit status 1 otherwise).
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from .demo import _context, _log, _train, build

WORLD = 2


def _tp(world_size: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model, optim, sched = build(1)  # plain, seed 0: overwritten below
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 1.0 / (1 + 0.1 * step))
    return model, optim, sched


def _run(rank: int, world_size: int, ckpt: str, steps: int, save_at: int) -> dict:
    import torch.distributed.checkpoint as dcp

    import dcp_optim

    quiet = lambda text: None  # noqa: E731
    model, optim, sched = build(world_size)
    _train(model, optim, sched, range(save_at), _log if rank == 0 else quiet, rank)
    # in memory: FSDP2 -> TP
    tp_a = _tp(world_size)
    dist.barrier()
    t0 = time.perf_counter()
    dcp_optim.reshard_model_and_optimizer(model, optim, tp_a[0], tp_a[1])
    tp_a[2].load_state_dict(sched.state_dict())
    t_mem = time.perf_counter() - t0
    # through DCP: save, then load into a TP template
    tp_b = _tp(world_size)
    dist.barrier()
    t0 = time.perf_counter()
    msd, osd = dcp_optim.get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    msd_b, osd_b = dcp_optim.get_state_dict(tp_b[0], tp_b[1])
    state: dict[str, Any] = {"model": msd_b, "optim": osd_b}
    dcp.load(state, checkpoint_id=ckpt)
    dcp_optim.set_state_dict(tp_b[0], tp_b[1], model_state_dict=msd_b, optim_state_dict=osd_b)
    tp_b[2].load_state_dict(sched.state_dict())
    t_dcp = time.perf_counter() - t0
    if rank == 0:
        _log(f"    resharded FSDP2 -> TP in memory in {t_mem * 1e3:.1f} ms "
             f"(dcp.save + dcp.load: {t_dcp * 1e3:.1f} ms); training on")
    a = _train(tp_a[0], tp_a[1], tp_a[2], range(save_at, steps), quiet, rank)
    b = _train(tp_b[0], tp_b[1], tp_b[2], range(save_at, steps), quiet, rank)
    return {"memory": a, "dcp": b}


def _worker(rank, store, ckpt, steps, save_at, queue):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    try:
        result = _run(rank, WORLD, ckpt, steps, save_at)
        queue.put((rank, result))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m dcp_optim.demo reshard",
        description="FSDP2 -> TP in memory (dcp_optim.reshard_model_and_optimizer) vs through DCP; "
        "the losses must be identical (docs/resharding.md).",
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--dir", default=None, help="checkpoint directory of the DCP path (default: a temp dir)")
    args = parser.parse_args(argv)
    return run(args.steps, args.save_at, args.dir)


def run(steps: int, save_at: int, ckpt: str | None) -> int:
    if not 0 < save_at < steps:
        raise SystemExit("dcp_optim.demo reshard: need 0 < --save-at < --steps")
    ckpt = ckpt or tempfile.mkdtemp(prefix="dcp_optim_demo_reshard_")
    print(f"dcp_optim demo reshard (torch {torch.__version__}): FSDP2 on {WORLD} processes, "
          f"{save_at} steps, then TP in memory vs TP resumed through DCP ({ckpt})", flush=True)
    ctx = _context()
    queue = ctx.Queue()
    store = tempfile.mktemp(prefix="dcp_optim_demo_store_")
    procs = [ctx.Process(target=_worker, args=(r, store, ckpt, steps, save_at, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=120)
        if p.exitcode != 0:
            raise SystemExit(f"demo worker failed with exit code {p.exitcode}")
    print()
    header = f"{'step':>4}  {'TP, resharded in memory':>24}  {'TP, resumed through DCP':>24}"
    print(header)
    print("-" * len(header))
    mem, ref = results[0]["memory"], results[0]["dcp"]
    for j, (a, b) in enumerate(zip(mem, ref)):
        print(f"{save_at + j + 1:>4}  {a:>24.10f}  {b:>24.10f}")
    identical = all(r["memory"] == r["dcp"] for r in results.values())
    print()
    print("losses are bit-identical on every rank" if identical
          else "MISMATCH: the in-memory reshard diverged from the DCP resume")
    return 0 if identical else 1
