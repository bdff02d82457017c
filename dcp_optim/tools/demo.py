"""The demo behind ``python -m dcp_optim.demo`` (see :mod:`dcp_optim.demo`).

The code lives here, not in ``dcp_optim/demo.py``: the module run with
``-m`` is re-run by multiprocessing in every worker as ``__mp_main__``,
and importing it beforehand (the forkserver preloads the workers' module)
makes runpy warn in each worker.
"""

from __future__ import annotations

import argparse
import datetime
import os
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


def _log(text):
    print(text, flush=True)


def _run(rank, world_size, mode, ckpt, steps, save_at):
    """Train (``reference``: from scratch, checkpoint after ``save_at``) or
    resume from the checkpoint; returns the losses of the steps run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.stateful import Stateful

    Stateful.register(AppState)
    model, optim, sched = build(world_size)
    if mode == "reference":
        losses = _train(model, optim, sched, range(save_at), _log, rank)
        dcp.save({"app": AppState(model, optim, sched)}, checkpoint_id=ckpt)
        if rank == 0:
            _log(f"    saved a checkpoint after step {save_at} to {ckpt}")
        losses += _train(model, optim, sched, range(save_at, steps), _log, rank)
    else:
        state = {"app": AppState(model, optim, sched)}
        dcp.load(state, checkpoint_id=ckpt)
        if rank == 0:
            _log(f"    loaded the step-{save_at} checkpoint")
        losses = _train(model, optim, sched, range(save_at, steps), _log, rank)
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
    try:
        losses = _run(rank, world_size, mode, ckpt, steps, save_at)
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
             "torch.distributed.checkpoint", "torch._dynamo", "dcp_optim", "dcp_optim.tools.demo"]
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


def _table(reference, reference_ws, resumed, save_at):
    """Print the losses of the steps after ``save_at`` side by side; True if
    every resumed run equals the reference bit for bit."""
    tail = reference[save_at:]
    print()
    header = f"{'step':>4}  {f'reference (ws={reference_ws})':>18}" + "".join(
        f"  {f'resumed ws={ws}':>18}" for ws in resumed
    )
    print(header)
    print("-" * len(header))
    for j, ref in enumerate(tail):
        step = save_at + j + 1
        row = f"{step:>4}  {ref:>18.10f}" + "".join(f"  {resumed[ws][j]:>18.10f}" for ws in resumed)
        print(row)
    identical = all(resumed[ws] == tail for ws in resumed)
    print()
    if identical:
        where = "at every world size" if len(resumed) > 1 else f"at world size {next(iter(resumed))}"
        print(f"resumed losses are bit-identical to the uninterrupted run {where}")
    else:
        print("MISMATCH: a resumed run diverged from the uninterrupted one")
    return identical


RUN_FILE = "demo_run.json"


def _torchrun(args) -> int:
    """``train`` / ``resume`` on the processes of the current launch
    (torchrun's environment), or on this process alone without torchrun."""
    import json

    from ..testing import init_from_env, launched_by_torchrun

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if launched_by_torchrun():
        created = init_from_env(timeout=120)
    else:  # one process: a group of one, as the spawned ws=1 phase has
        store = tempfile.mktemp(prefix="dcp_optim_demo_store_")
        dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
        created = True
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    run_file = os.path.join(args.dir, RUN_FILE)
    try:
        if args.command == "train":
            if not 0 < args.save_at < args.steps:
                raise SystemExit("dcp_optim.demo: need 0 < --save-at < --steps")
            if rank == 0:
                label = "plain model" if world_size == 1 else "FSDP2"
                _log(f"dcp_optim demo (torch {torch.__version__}): train on {world_size} "
                     f"process(es) ({label}), checkpoint in {args.dir}")
            losses = _run(rank, world_size, "reference", args.dir, args.steps, args.save_at)
            if rank == 0:
                with open(run_file, "w") as f:
                    json.dump({"steps": args.steps, "save_at": args.save_at,
                               "world_size": world_size, "losses": losses}, f)
                _log(f"    recorded the losses in {run_file}; resume at any world size with "
                     f"`... -m dcp_optim.demo resume --dir {args.dir}`")
            return 0
        try:
            with open(run_file) as f:
                run = json.load(f)
        except OSError as exc:
            raise SystemExit(
                f"dcp_optim.demo: no {RUN_FILE} in {args.dir}: run `dcp_optim.demo train` first ({exc})"
            ) from None
        if rank == 0:
            label = "plain model" if world_size == 1 else "FSDP2"
            _log(f"dcp_optim demo: resume on {world_size} process(es) ({label}) from "
                 f"the step-{run['save_at']} checkpoint of a run on {run['world_size']}")
        losses = _run(rank, world_size, "resume", args.dir, run["steps"], run["save_at"])
        # Every rank trains on the same batch: every rank's losses decide.
        identical = losses == run["losses"][run["save_at"]:]
        if rank == 0:
            identical = _table(run["losses"], run["world_size"], {world_size: losses}, run["save_at"])
        return 0 if identical else 1
    finally:
        if created:
            dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dcp_optim.demo",
        description="FSDP2 training, checkpointed with DCP through dcp_optim, resumed at "
        "other world sizes with bit-identical losses.",
        epilog="Without a command: the whole demo, in processes it starts itself. "
        "Under torchrun: `train` on the launched processes, then `resume` from another "
        "launch at any world size.",
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
    sub = parser.add_subparsers(dest="command")
    train = sub.add_parser("train", help="train, checkpoint after --save-at, record the losses")
    train.add_argument("--steps", type=int, default=6)
    train.add_argument("--save-at", type=int, default=3)
    train.add_argument("--dir", required=True, help="checkpoint directory (shared by the ranks)")
    resume = sub.add_parser("resume", help="resume --dir at this launch's world size, compare")
    resume.add_argument("--dir", required=True, help="checkpoint directory written by `train`")
    args = parser.parse_args(argv)
    if args.command is not None:
        return _torchrun(args)
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
    identical = _table(reference, 2, resumed, args.save_at)
    print(f"done in {time.time() - start:.1f}s")
    return 0 if identical else 1
