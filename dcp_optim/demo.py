"""dcp_optim demo: train with FSDP2 on 2 CPU processes, checkpoint with DCP
through dcp_optim, resume at other world sizes, and show the loss continues
exactly as if training had never stopped.

    python -m dcp_optim.demo [--steps 6] [--save-at 3] [--dir PATH]

Phases (each a fresh set of gloo processes on this machine):

  1. reference   FSDP2, 2 ranks: train `steps` steps, save a checkpoint
                 after step `save_at` (DCP + the Stateful AppState pattern,
                 state dicts from dcp_optim), keep training to the end.
  2. resume      fresh processes at world size 1 (plain model), 2 (FSDP2)
                 and 3 (FSDP2, uneven shards): a never-stepped optimizer
                 gives the load template, dcp.load fills it, dcp_optim
                 installs it, and training continues from `save_at`.

Every rank trains on the same batch, which makes the arithmetic of a step
independent of the world size (data-parallel gradient averaging of equal
values is exact), so the resumed losses must equal the reference bit for
bit -- any difference would be a state that was lost or changed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

WIDTH, HIDDEN = 16, 22  # 22 is not divisible by 3: uneven shards at ws=3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x):
        return self.norm(x + self.down(torch.relu(self.up(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, y):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return nn.functional.mse_loss(self.head(h).squeeze(-1), y)


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(32, 8, generator=g)
    return x, x.sum(-1).sin()


def build(world_size: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Model()
    if world_size > 1:
        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 1.0 / (1 + 0.1 * step))
    return model, optim, sched


class AppState:
    """The Stateful wrapper DCP's tutorial uses, on dcp_optim's functions."""

    def __init__(self, model, optim, sched):
        self.model, self.optim, self.sched = model, optim, sched

    def state_dict(self):
        import dcp_optim

        model_sd, optim_sd = dcp_optim.get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd, "sched": self.sched.state_dict()}

    def load_state_dict(self, state):
        import dcp_optim

        dcp_optim.set_state_dict(
            self.model,
            self.optim,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        self.sched.load_state_dict(state["sched"])


def _train(model, optim, sched, steps, log, rank):
    losses = []
    for step in steps:
        loss = model(*batch(step))
        loss.backward()
        optim.step()
        sched.step()
        optim.zero_grad()
        losses.append(loss.item())
        if rank == 0:
            log(f"    step {step + 1}: loss {losses[-1]:.10f}")
    return losses


def _worker(rank, world_size, store, mode, ckpt, steps, save_at, queue):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world_size),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.stateful import Stateful

    Stateful.register(AppState)

    def log(text):
        print(text, flush=True)

    try:
        model, optim, sched = build(world_size)
        if mode == "reference":
            losses = _train(model, optim, sched, range(save_at), log, rank)
            dcp.save({"app": AppState(model, optim, sched)}, checkpoint_id=ckpt)
            if rank == 0:
                log(f"    saved a checkpoint after step {save_at} to {ckpt}")
            losses += _train(model, optim, sched, range(save_at, steps), log, rank)
        else:
            state = {"app": AppState(model, optim, sched)}
            dcp.load(state, checkpoint_id=ckpt)
            if rank == 0:
                log(f"    loaded the step-{save_at} checkpoint")
            losses = _train(model, optim, sched, range(save_at, steps), log, rank)
        if rank == 0:
            queue.put(losses)
    finally:
        dist.destroy_process_group()


_CTX = None


def _context():
    """A forkserver that imports torch once; later launches fork from it."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(
            ["torch", "torch.distributed", "torch.distributed.fsdp",
             "torch.distributed.checkpoint", "torch._dynamo", "dcp_optim", "dcp_optim.demo"]
        )
    return _CTX


def _launch(world_size, mode, ckpt, steps, save_at):
    ctx = _context()
    queue = ctx.Queue()
    store = tempfile.mktemp(prefix="dcp_optim_demo_store_")
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, store, mode, ckpt, steps, save_at, queue))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    losses = queue.get(timeout=600)
    for p in procs:
        p.join(timeout=120)
        if p.exitcode != 0:
            raise SystemExit(f"demo worker failed with exit code {p.exitcode}")
    return losses


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
    args = parser.parse_args(argv)
    if not 0 < args.save_at < args.steps:
        parser.error("need 0 < --save-at < --steps")
    ckpt = args.dir or tempfile.mkdtemp(prefix="dcp_optim_demo_")
    start = time.time()
    print(f"dcp_optim demo (torch {torch.__version__}); checkpoint in {ckpt}", flush=True)
    print("[1/4] reference: FSDP2 on 2 processes, uninterrupted", flush=True)
    reference = _launch(2, "reference", ckpt, args.steps, args.save_at)
    resumed = {}
    for i, ws in enumerate((1, 2, 3), start=2):
        label = "plain model" if ws == 1 else "FSDP2"
        print(f"[{i}/4] resume at world size {ws} ({label}) from the checkpoint", flush=True)
        resumed[ws] = _launch(ws, "resume", ckpt, args.steps, args.save_at)
    tail = reference[args.save_at:]
    print()
    header = f"{'step':>4}  {'reference (ws=2)':>18}" + "".join(f"  {f'resumed ws={ws}':>18}" for ws in resumed)
    print(header)
    print("-" * len(header))
    for j, ref in enumerate(tail):
        step = args.save_at + j + 1
        row = f"{step:>4}  {ref:>18.10f}" + "".join(f"  {resumed[ws][j]:>18.10f}" for ws in resumed)
        print(row)
    identical = all(resumed[ws] == tail for ws in resumed)
    print()
    print(
        "resumed losses are bit-identical to the uninterrupted run at every world size"
        if identical
        else "MISMATCH: a resumed run diverged from the uninterrupted one"
    )
    print(f"done in {time.time() - start:.1f}s")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
