"""Issue 24's faults at world 2 on gloo: ranks that disagree on identity
(parameters registered in another order), a rank that never arrives,
and a module load hook that raises on one rank only.  Rank functions for
tests/distributed/test_faults.py.

Every scenario returns, per implementation, "ok" or the error it raised
("Type: message"), how long it took (seconds, rounded) and whether this
rank's model or optimizer changed.  A scenario in which upstream hangs
runs on upstream only with a short process-group timeout (its cell then
records the backend's timeout).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as upstream
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dcp_optim

from .dist_cases_reliability import _local_snapshot, _outcome, _same, build


class TwoParams(nn.Module):
    """Two parameters of the same shape, registered in ``order``."""

    def __init__(self, order: tuple[str, str]):
        super().__init__()
        for name in order:
            value = torch.full((4, 3), 1.0 if name == "a" else 2.0)
            self.register_parameter(name, nn.Parameter(value))

    def forward(self, x):
        return x @ self.a.T + x @ self.b.T


def _two_params(mesh, rank: int, swapped: bool):
    order = ("b", "a") if swapped and rank == 1 else ("a", "b")
    torch.manual_seed(0)
    model = TwoParams(order)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 3)).sum().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


@contextlib.contextmanager
def _arrival_bound(seconds: str) -> Iterator[None]:
    """DCP_OPTIM_ARRIVAL_TIMEOUT for the calls inside (restored after:
    under torchrun the rank functions run in the test process)."""
    from dcp_optim._engine.consistency import ARRIVAL_ENV

    old = os.environ.get(ARRIVAL_ENV)
    os.environ[ARRIVAL_ENV] = seconds
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ARRIVAL_ENV, None)
        else:
            os.environ[ARRIVAL_ENV] = old


def _timed(fn) -> tuple[str, float]:
    t0 = time.monotonic()
    result = _outcome(fn)
    return result, round(time.monotonic() - t0, 1)


def parameter_order_case(rank: int, ws: int) -> dict[str, Any]:
    """Same shapes, another registration order on rank 1: every getter
    that gathers and every setter raises on every rank (dcp_optim);
    upstream returns mixed-up values."""
    mesh = init_device_mesh("cpu", (ws,))
    out: dict[str, Any] = {}
    full = dcp_optim.StateDictOptions(full_state_dict=True)
    for impl, mod in (("dcp_optim", dcp_optim), ("torch", upstream)):
        model, optim = _two_params(mesh, rank, swapped=True)
        opts = mod.StateDictOptions(full_state_dict=True)
        result: dict[str, Any] = {}
        holder: dict[str, Any] = {}

        def get_model(m=mod, model=model, opts=opts, holder=holder):
            holder["msd"] = m.get_model_state_dict(model, options=opts)

        def get_optim(m=mod, model=model, optim=optim, opts=opts):
            m.get_optimizer_state_dict(model, optim, options=opts)

        result["get_model"] = _outcome(get_model)
        msd = holder.get("msd")
        # the values it returned: "a" holds 1s (before the step), "b" 2s
        result["get_model_values"] = (
            None if msd is None else
            {k: round(float(v.float().mean()), 1) for k, v in msd.items()}
        )
        result["get_optim"] = _outcome(get_optim)
        out[impl] = result
        dist.barrier()
    # setters (dcp_optim only): a full and a sharded load of rank 0's
    # layout, into the swapped model; nothing changes on any rank
    model, optim = _two_params(mesh, rank, swapped=True)
    before = _local_snapshot(model, optim)
    ref, ref_optim = _two_params(mesh, rank, swapped=False)
    sharded_msd = dcp_optim.get_model_state_dict(ref)
    out["set_full"] = _outcome(lambda: dcp_optim.set_model_state_dict(
        model, {"a": torch.ones(4, 3), "b": torch.ones(4, 3)}, options=full))
    out["set_sharded"] = _outcome(lambda: dcp_optim.set_model_state_dict(model, sharded_msd))
    out["unchanged"] = _same(before, _local_snapshot(model, optim))
    dist.barrier()
    return out


def one_rank_full_getter_case(rank: int, ws: int, which: str) -> dict[str, Any]:
    """full_state_dict=True on rank 0 only: rank 0 gathers, rank 1 does
    not communicate.  dcp_optim: rank 0 raises within the arrival bound
    (set to 2 s here) naming rank 1; rank 1 returns its sharded dict."""
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=30))
    mesh = init_device_mesh("cpu", (ws,))
    model, optim = build(mesh)
    opts = dcp_optim.StateDictOptions(full_state_dict=rank == 0)
    with _arrival_bound("2"):
        if which == "optim":
            result, seconds = _timed(lambda: dcp_optim.get_optimizer_state_dict(model, optim, options=opts))
        else:
            result, seconds = _timed(lambda: dcp_optim.get_model_state_dict(model, options=opts))
    # both ranks meet again (a store barrier: the group's collectives
    # would pair with whatever the other rank left behind)
    dist.distributed_c10d._get_default_store().add("one_rank_full_done", 1)
    return {"result": result, "seconds": seconds}


def never_arrives_case(rank: int, ws: int, api: str) -> dict[str, Any]:
    """Rank 1 never calls (it sleeps past the arrival bound of 2 s, well
    inside the process group's 30 s): rank 0 raises within the bound,
    naming rank 1, with nothing changed.  Then rank 1 arrives late: it
    raises the same error at once (the meeting was abandoned)."""
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=30))
    mesh = init_device_mesh("cpu", (ws,))
    model, optim = build(mesh)
    full = dcp_optim.StateDictOptions(full_state_dict=True)
    msd, osd = dcp_optim.get_state_dict(model, optim, options=full)
    before = _local_snapshot(model, optim)
    if rank == 1:
        time.sleep(4)
    if api == "set_state_dict":
        call = lambda: dcp_optim.set_state_dict(  # noqa: E731
            model, optim, model_state_dict=msd, optim_state_dict=osd, options=full)
    elif api == "broadcast":
        call = _broadcast_load("model", rank, model, optim, msd, osd)
    else:  # a full getter
        call = lambda: dcp_optim.get_model_state_dict(model, options=full)  # noqa: E731
    with _arrival_bound("2"):
        result, seconds = _timed(call)
    return {"result": result, "seconds": seconds,
            "unchanged": _same(before, _local_snapshot(model, optim))}


class Hooked(nn.Module):
    """A linear layer whose load post-hook raises on ``bad_rank``."""

    def __init__(self, bad_rank: int):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.bad_rank = bad_rank

        def hook(module, incompatible):
            if dist.get_rank() == module.bad_rank:
                raise RuntimeError(f"hook refuses the load on rank {dist.get_rank()}")

        self.register_load_state_dict_post_hook(hook)

    def forward(self, x):
        return self.lin(x)


class RefusingAdam(torch.optim.Adam):
    """Adam whose own ``load_state_dict`` (an override) raises on
    ``bad_rank`` after doing half its work (the first group's lr set):
    what a custom optimizer's checks do."""

    bad_rank = -1

    def load_state_dict(self, state_dict):
        self.param_groups[0]["lr"] = 123.0
        if dist.get_rank() == self.bad_rank:
            raise RuntimeError(f"optimizer refuses the load on rank {dist.get_rank()}")
        super().load_state_dict(state_dict)


def refusing_optimizer(optim: torch.optim.Optimizer, bad_rank: int) -> torch.optim.Optimizer:
    optim.__class__ = RefusingAdam
    optim.bad_rank = bad_rank  # type: ignore[attr-defined]
    return optim


def hook_raises_case(rank: int, ws: int, mode: str) -> dict[str, Any]:
    """A module's own load hook raises on rank 1 only: the same error on
    every rank, nothing changed on any rank (dcp_optim); upstream raises
    on rank 1 only, rank 0 loaded."""
    mesh = init_device_mesh("cpu", (ws,))
    out: dict[str, Any] = {}
    for impl, mod in (("dcp_optim", dcp_optim), ("torch", upstream)):
        torch.manual_seed(0)
        model = Hooked(bad_rank=1)
        fully_shard(model, mesh=mesh)
        optim = torch.optim.Adam(model.parameters(), lr=0.1)
        model(torch.ones(2, 3)).sum().backward()
        optim.step()
        before = _local_snapshot(model, optim)
        opts = mod.StateDictOptions(full_state_dict=mode == "full")
        src = dcp_optim.get_model_state_dict(model, options=dcp_optim.StateDictOptions(full_state_dict=mode == "full"))
        if mode == "full":
            src = {k: v + 1 for k, v in src.items()}
        else:
            src = {k: v.detach() + 1 for k, v in src.items()}
        result, seconds = _timed(lambda m=mod, model=model, opts=opts, src=src: m.set_model_state_dict(model, src, options=opts))
        out[impl] = {"result": result, "seconds": seconds,
                     "unchanged": _same(before, _local_snapshot(model, optim))}
        dist.barrier()
    return out


def _broadcast_load(part: str, rank: int, model: Any, optim: Any, msd: Any, osd: Any) -> Any:
    """The broadcast load of ``part`` ("model" or "optim") from rank 0,
    which alone passes the full dict: a call to time."""
    bopts = dcp_optim.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    if part == "model":
        return lambda: dcp_optim.set_model_state_dict(model, msd if rank == 0 else {}, options=bopts)
    return lambda: dcp_optim.set_optimizer_state_dict(model, optim, osd if rank == 0 else {}, options=bopts)


def _stream_load_inputs(ws: int, timeout_s: int) -> tuple[Any, ...]:
    """The group's timeout set, a trained model and optimizer to load into,
    the full dicts of another (seed 5) to load, and this rank's shards
    before the load: (model, optim, model dict, optimizer dict, snapshot).
    The load streams: this model is small enough to travel inline with
    the source's metadata otherwise (``payload.INLINE_BYTES``)."""
    from dcp_optim._engine import payload as _payload

    _payload.INLINE_BYTES = 0
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s))
    mesh = init_device_mesh("cpu", (ws,))
    model, optim = build(mesh)
    src, src_optim = build(mesh, seed=5)
    full = dcp_optim.StateDictOptions(full_state_dict=True)
    msd, osd = dcp_optim.get_state_dict(src, src_optim, options=full)
    return model, optim, msd, osd, _local_snapshot(model, optim)


def killed_mid_stream_case(rank: int, ws: int, part: str, undo: str) -> dict[str, Any]:
    """A broadcast load whose source (rank 0) is SIGKILLed while it sends
    the eighth collective of its stream (64-byte buckets: a row or two
    of every rank's shard in each scatter), every
    check passed (so the shards stream straight into the live tensors):
    the survivor raises the backend's error well within the group's
    timeout (10 s), and -- with the stream's undo log (``undo`` "1", the
    default) -- its model and optimizer are as before the call."""
    import signal

    from dcp_optim._engine import collectives as _collectives
    from dcp_optim._engine import distribute as _distribute
    from dcp_optim._engine import scatter_load as _scatter

    model, optim, msd, osd, before = _stream_load_inputs(ws, timeout_s=10)
    os.environ[_distribute.UNDO_ENV] = undo
    _collectives.set_bucket_bytes(64)
    # this model's chunks are far under the scatter threshold: scattered
    # anyway (every rank alike), so that the kill lands in a scatter
    _scatter.SCATTER_MIN_CHUNK_BYTES = 1
    if rank == 0:
        # the eighth transfer of the stream, a broadcast, a scatter or a
        # batch of messages (the model's tensors are sharded on dim 0:
        # they are scattered, the small ones point to point); the
        # seven before it have left rank 0 (it waits for them first: the
        # stream keeps them in flight together)
        sent: list[Any] = []
        original, original_scatter = _distribute.Route.broadcast, dist.scatter

        def count() -> None:
            if len(sent) == 7:
                for work in sent:  # a transfer's work, or a batch's works
                    for w in work if isinstance(work, list) else [work]:
                        if w is not None:
                            w.wait()
                os.kill(os.getpid(), signal.SIGKILL)

        def dying(self, tensor, *args, **kwargs):
            count()
            sent.append(original(self, tensor, *args, **kwargs))
            return sent[-1]

        def dying_scatter(*args, **kwargs):
            count()
            sent.append(original_scatter(*args, **kwargs))
            return sent[-1]

        def dying_messages(ops):
            count()
            works = original_messages(ops)
            sent.append(list(works))  # one transfer
            return works

        original_messages = dist.batch_isend_irecv
        _distribute.Route.broadcast = dying  # type: ignore[method-assign]
        dist.scatter = dying_scatter
        dist.batch_isend_irecv = dying_messages
    result, seconds = _timed(_broadcast_load(part, rank, model, optim, msd, osd))
    return {"result": result, "seconds": seconds,
            "unchanged": _same(before, _local_snapshot(model, optim))}


# per (who fails, path): the functions of the stream that rank calls per
# unit, one of which raises on its third call
_FAILING_STEPS = {
    ("source", "scatter"): ("_source_inputs", "_rows_to_send"),
    ("source", "broadcast"): ("_pack_rows", "_direct_bytes"),
    ("receiver", "scatter"): ("_landing", "_Messages"),
    ("receiver", "broadcast"): ("_extract_rows",),
}


# a bug rather than a passing failure: the unit's messages themselves
# cannot be built on that rank, from the third unit on, every time
_PERSISTENT_STEPS = ("_Messages",)


def fails_mid_stream_case(rank: int, ws: int, part: str, who: str, path: str,
                          persistent: bool = False) -> dict[str, Any]:
    """A broadcast load in which one rank fails on its own -- an exception
    in our code, not the backend's -- in the middle of its stream (64-byte
    buckets): the source (``who`` "source") while preparing the third unit
    it sends, or the last rank ("receiver") while landing the third it
    receives; ``path`` "scatter" (every tensor scattered) or "broadcast"
    (none).  The failing rank keeps meeting the others in every remaining
    collective, so every rank raises the failing rank's error well within
    the group's timeout (30 s), and no rank's model or optimizer changed
    (the others received what the failed source sent in place of data:
    their undo logs put it back).

    ``persistent``: every call of ``_PERSISTENT_STEPS`` from the third on
    raises (a bug, where the rank's part in the rest of the stream must
    not build them again)."""
    from dcp_optim._engine import collectives as _collectives
    from dcp_optim._engine import distribute as _distribute
    from dcp_optim._engine import scatter_load as _scatter

    model, optim, msd, osd, before = _stream_load_inputs(ws, timeout_s=30)
    bad = 0 if who == "source" else ws - 1
    names = _PERSISTENT_STEPS if persistent else _FAILING_STEPS[who, path]
    saved = [(m, n, getattr(m, n)) for m in (_scatter, _distribute) for n in names if hasattr(m, n)]
    assert len(saved) == len(names), names
    calls = [0]

    def failing(fn):
        def wrapper(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 3 or (persistent and calls[0] > 3):
                raise RuntimeError(f"injected failure on rank {rank}")
            return fn(*args, **kwargs)

        return wrapper

    previous_limit = _scatter.SCATTER_MIN_CHUNK_BYTES
    previous_bucket = _collectives.set_bucket_bytes(64)
    _scatter.SCATTER_MIN_CHUNK_BYTES = 1 if path == "scatter" else 1 << 62
    if rank == bad:
        for m, n, fn in saved:
            setattr(m, n, failing(fn))
    try:
        result, seconds = _timed(_broadcast_load(part, rank, model, optim, msd, osd))
    finally:
        for m, n, fn in saved:
            setattr(m, n, fn)
        _scatter.SCATTER_MIN_CHUNK_BYTES = previous_limit
        _collectives.set_bucket_bytes(previous_bucket)
    return {"result": result, "seconds": seconds, "calls": calls[0],
            "unchanged": _same(before, _local_snapshot(model, optim))}


def stream_cannot_allocate_case(rank: int, ws: int) -> list[dict[str, Any]]:
    """Broadcast loads (every tensor broadcast, 64-byte buckets) in which
    one rank cannot allocate what its stream needs -- its buffer, or the
    new tensors of a load that is not in place: ``torch.empty`` raises
    ``torch.OutOfMemoryError`` while ``plan_stream`` runs -- for the model
    and the optimizer, on the source and on the last rank, one load after
    another in the same group.  The stream is planned before the
    agreement ahead of it, so every rank raises that error at once (none
    waits in the stream's first collective for the group's 30 s timeout)
    and nothing changed anywhere."""
    from dcp_optim._engine import collectives as _collectives
    from dcp_optim._engine import distribute as _distribute
    from dcp_optim._engine import scatter_load as _scatter

    out = []
    planner = _distribute.plan_stream
    previous_limit = _scatter.SCATTER_MIN_CHUNK_BYTES
    previous_bucket = _collectives.set_bucket_bytes(64)
    _scatter.SCATTER_MIN_CHUNK_BYTES = 1 << 62
    try:
        for part in ("model", "optim"):
            for bad in (0, ws - 1):
                model, optim, msd, osd, before = _stream_load_inputs(ws, timeout_s=30)
                stand_in = _AllocationsFailing("cannot allocate the stream")
                if rank == bad:
                    _distribute.plan_stream = _planning_with(planner, stand_in)  # type: ignore[assignment]
                else:
                    _distribute.plan_stream = planner  # type: ignore[assignment]
                result, seconds = _timed(_broadcast_load(part, rank, model, optim, msd, osd))
                out.append({"part": part, "bad": bad, "result": result, "seconds": seconds,
                            "injected": stand_in.calls, "unchanged": _same(before, _local_snapshot(model, optim))})
    finally:
        _distribute.plan_stream = planner  # type: ignore[assignment]
        _scatter.SCATTER_MIN_CHUNK_BYTES = previous_limit
        _collectives.set_bucket_bytes(previous_bucket)
    return out


class _AllocationsFailing:
    """Stands in for the ``torch`` module inside a module of dcp_optim:
    its ``empty`` and ``zeros`` raise ``torch.OutOfMemoryError`` ("``what``
    on rank R") at call number ``at`` (counted from 1 in ``calls``), or at
    every call (``at`` None); every other attribute is torch's."""

    def __init__(self, what: str, at: int | None = None):
        self.what, self.at, self.calls = what, at, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def _allocate(self, allocate: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls += 1
        if self.at is None or self.calls == self.at:
            raise torch.OutOfMemoryError(f"{self.what} on rank {dist.get_rank()} (injected)")
        return allocate(*args, **kwargs)

    def empty(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._allocate(torch.empty, *args, **kwargs)

    def zeros(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._allocate(torch.zeros, *args, **kwargs)


def _planning_with(planner: Any, stand_in: _AllocationsFailing) -> Any:
    """``distribute.plan_stream`` (``planner``) with ``stand_in`` as the
    ``torch`` its allocations go through while it runs."""
    from dcp_optim._engine import distribute as _distribute

    def planning(*args: Any, **kwargs: Any) -> Any:
        real, _distribute.torch = _distribute.torch, stand_in  # type: ignore[attr-defined]
        try:
            return planner(*args, **kwargs)
        finally:
            _distribute.torch = real  # type: ignore[attr-defined]

    return planning


def fsdp1_stream_cannot_allocate_case(rank: int, ws: int) -> list[dict[str, Any]]:
    """Broadcast optimizer loads into FSDP1 models (flat parameters, and
    ``use_orig_params``) in which one rank -- the source, then the last
    rank -- cannot allocate its new state tensors (``torch.empty`` /
    ``torch.zeros`` of ``fsdp1``) or its stream's buffer (``plan_stream``).
    Both are made before the agreement ahead of the stream, so every rank
    raises that error at once (none waits in the stream's first broadcast
    for the group's 30 s timeout) and no optimizer changed; then a load
    with nothing injected completes on every rank."""
    from dcp_optim._engine import distribute as _distribute
    from dcp_optim._engine import fsdp1 as _fsdp1

    from .dist_cases import make_optimizer, train
    from .dist_cases_fsdp1 import fsdp1_model

    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=30))
    bopts = dcp_optim.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    planner = _distribute.plan_stream
    out: list[dict[str, Any]] = []

    for orig in (False, True):
        src = fsdp1_model(5, orig=orig, wrap="nested")
        src_optim = make_optimizer(src, "adam", 1)
        train(src, src_optim, seed=5)
        osd = dcp_optim.get_optimizer_state_dict(src, src_optim, options=dcp_optim.StateDictOptions(full_state_dict=True))
        model = fsdp1_model(0, orig=orig, wrap="nested")
        optim = make_optimizer(model, "adam", 1)
        train(model, optim, seed=0)
        before = _local_snapshot(model, optim)
        for where in ("state", "buffer"):
            for bad in (0, ws - 1):
                stand_in = _AllocationsFailing("no memory for the new state")
                if rank == bad and where == "state":
                    _fsdp1.torch = stand_in  # type: ignore[attr-defined]
                if rank == bad and where == "buffer":
                    _distribute.plan_stream = _planning_with(  # type: ignore[assignment]
                        planner, _AllocationsFailing("no memory for the stream"))
                try:
                    result, seconds = _timed(lambda: dcp_optim.set_optimizer_state_dict(
                        model, optim, osd if rank == 0 else {}, options=bopts))
                finally:
                    _fsdp1.torch = torch  # type: ignore[attr-defined]
                    _distribute.plan_stream = planner  # type: ignore[assignment]
                out.append({"orig": orig, "where": where, "bad": bad, "result": result, "seconds": seconds,
                            "injected": stand_in.calls, "unchanged": _same(before, _local_snapshot(model, optim))})
        result, _ = _timed(lambda: dcp_optim.set_optimizer_state_dict(model, optim, osd if rank == 0 else {},
                                                                        options=bopts))
        loaded = dcp_optim.get_optimizer_state_dict(model, optim, options=dcp_optim.StateDictOptions(full_state_dict=True))
        out.append({"orig": orig, "then": result, "loaded": rank != 0 or _same(loaded, osd)})
    return out


def gather_cannot_allocate_case(rank: int, ws: int) -> list[dict[str, Any]]:
    """Full getters (16 KiB buckets: several per call, some a tensor of
    their own gathered straight into it, the others through the shared
    buffer) in which rank 0 runs out of memory, for the model and the
    optimizer (``torch.empty`` in ``collectives``, counted from 1: the
    first is the buffer allocated before the gather check, the others are
    the gather's).  At the gather's first, second or fourth allocation
    rank 0 raises its error within seconds (the group's timeout is 30 s),
    still sending its shards, and the other ranks return what upstream
    returns.  Where every allocation fails (``at`` None: it could not take
    part in the gathers even after giving up its results) every rank
    raises rank 0's error at the gather check, before any gather.  Then
    every rank gets the same dict again."""
    from dcp_optim._engine import collectives as _collectives

    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=30))
    mesh = init_device_mesh("cpu", (ws,))
    model, optim = build(mesh)
    full = dcp_optim.StateDictOptions(full_state_dict=True)
    calls = {
        "model": lambda: dcp_optim.get_model_state_dict(model, options=full),
        "optim": lambda: dcp_optim.get_optimizer_state_dict(model, optim, options=full),
    }
    want = {
        "model": upstream.get_model_state_dict(model, options=upstream.StateDictOptions(full_state_dict=True)),
        "optim": upstream.get_optimizer_state_dict(model, optim,
                                                   options=upstream.StateDictOptions(full_state_dict=True)),
    }
    previous_bucket = _collectives.set_bucket_bytes(16 * 1024)
    out = []
    try:
        for part, call in calls.items():
            for at in (2, 3, 5, None):
                stand_in = _AllocationsFailing("no memory for a gathered tensor", at)
                if rank == 0:
                    _collectives.torch = stand_in  # type: ignore[attr-defined]
                t0 = time.monotonic()
                try:
                    got = call()
                    result = "ok" if _same(got, want[part]) else "WRONG"
                except Exception as exc:  # noqa: BLE001 - the verdict is returned
                    result = f"{type(exc).__name__}: {exc}"
                finally:
                    _collectives.torch = torch  # type: ignore[attr-defined]
                out.append({"part": part, "at": at, "result": result, "calls": stand_in.calls,
                            "seconds": round(time.monotonic() - t0, 1)})
            out.append({"part": part, "then": _same(call(), want[part])})
    finally:
        _collectives.set_bucket_bytes(previous_bucket)
    return out


def unreadable_payload_case(rank: int, ws: int, streamed: bool) -> dict[str, Any]:
    """A broadcast set_state_dict whose source's payload rank 1 cannot
    read (a class of a module only the source has, say): rank 1's failure
    is agreed on after the payload's broadcast, so every rank raises it at
    once -- none waits for the group's timeout -- and nothing changed.
    The tensors travel inline with the payload, or (``streamed``) after."""
    from dcp_optim._engine import distribute as _distribute
    from dcp_optim._engine import payload as _payload

    inline_bytes = _payload.INLINE_BYTES
    model, optim, msd, osd, before = _stream_load_inputs(ws, timeout_s=30)
    _payload.INLINE_BYTES = 0 if streamed else inline_bytes
    if rank == 1:
        def unreadable(data: torch.Tensor) -> Any:
            raise ModuleNotFoundError("No module named 'only_on_the_source'")

        _distribute.decode_payload = unreadable  # type: ignore[assignment]
    bopts = dcp_optim.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    result, seconds = _timed(lambda: dcp_optim.set_state_dict(
        model, optim, model_state_dict=msd if rank == 0 else {}, optim_state_dict=osd if rank == 0 else {},
        options=bopts))
    return {"result": result, "seconds": seconds, "unchanged": _same(before, _local_snapshot(model, optim))}


def refuse_load_on(module: nn.Module, bad_rank: int) -> None:
    """A load pre-hook on ``module`` (``_register_load_state_dict_pre_hook``)
    that raises on ``bad_rank``."""

    def hook(state_dict, prefix, *args):
        if dist.get_rank() == bad_rank:
            raise RuntimeError(f"pre-hook refuses the load of {prefix!r} on rank {dist.get_rank()}")

    module._register_load_state_dict_pre_hook(hook)


def fsdp1_hooked(seed: int, bad_rank: int, mesh=None):
    """FSDP1 (root and both blocks wrapped: three units) whose first
    block's inner ``up`` layer refuses the load on ``bad_rank``: the
    second block's unit gathers after it.  Trained two steps."""
    from .dist_cases import train
    from .dist_cases_fsdp1 import fsdp1_model

    model = fsdp1_model(seed, orig=False, wrap="nested", mesh=mesh)
    refuse_load_on(model.module.layers[0].module.up, bad_rank)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    train(model, optim, steps=2, seed=seed)
    return model, optim


FSDP1_HOOK_MODES = ("full", "broadcast", "sharded")


def _fsdp1_hook_call(mod, api: str, mode: str, rank: int, model, optim, msd, osd):
    opts = mod.StateDictOptions(full_state_dict=mode != "sharded", broadcast_from_rank0=mode == "broadcast")
    if mode == "broadcast" and rank != 0:
        msd, osd = {}, {}
    if api == "set_model_state_dict":
        return lambda: mod.set_model_state_dict(model, msd, options=opts)
    return lambda: mod.set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd, options=opts)


def fsdp1_hook_case(rank: int, ws: int) -> dict[str, Any]:
    """An FSDP1 model whose inner module's load pre-hook raises on rank 1
    only, for full, broadcast and sharded loads through set_state_dict and
    set_model_state_dict: per case, the result, the seconds it took (the
    group's timeout is 20 s: a rank left waiting in a later unit's gather
    would take that long) and what it left (fault_matrix.classify: this
    rank's flat-parameter shards, optimizer state and hyperparameters).
    Then the same models with hooks that raise nowhere: what dcp_optim's
    load leaves is bit for bit what upstream's leaves (for broadcast: its
    full load of the same dict)."""
    from .dist_cases import _betas_to_tuples
    from .fault_matrix import _snapshot, classify

    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=20))
    out: dict[str, Any] = {"faults": {}, "clean": {}}
    fresh = _snapshot(*fsdp1_hooked(0, bad_rank=-1))  # before any load
    src, src_optim = fsdp1_hooked(3, bad_rank=-1)
    for mode in FSDP1_HOOK_MODES:
        get_opts = dcp_optim.StateDictOptions(full_state_dict=mode != "sharded")
        msd, osd = dcp_optim.get_state_dict(src, src_optim, options=get_opts)
        for api in ("set_state_dict", "set_model_state_dict"):
            model, optim = fsdp1_hooked(0, bad_rank=1)
            before = _snapshot(model, optim)
            dist.barrier()
            result, seconds = _timed(_fsdp1_hook_call(dcp_optim, api, mode, rank, model, optim, msd, osd))
            out["faults"][f"{api} {mode}"] = {
                "result": result, "seconds": seconds,
                "state": classify(before, _snapshot(model, optim), None),
            }
        loads = {}
        for impl, mod in (("dcp_optim", dcp_optim), ("torch", upstream)):
            model, optim = fsdp1_hooked(0, bad_rank=-1)
            dist.barrier()
            # upstream's broadcast load of FSDP1 models mismatches
            # collectives: its oracle is its full load of the same dict
            how = "full" if impl == "torch" and mode == "broadcast" else mode
            result = _outcome(_fsdp1_hook_call(mod, "set_state_dict", how, rank, model, optim, msd, osd))
            _betas_to_tuples(optim)  # upstream's full load makes lists of them
            loads[impl] = (result, _snapshot(model, optim))
        ours, theirs = loads["dcp_optim"], loads["torch"]
        out["clean"][mode] = {
            "result": ours[0], "torch": theirs[0],
            "same_as_torch": classify(theirs[1], ours[1], None) == "unchanged",
            "changed": classify(fresh, ours[1], None) != "unchanged",
        }
    # a load post-hook (register_load_state_dict_post_hook) instead
    msd, osd = dcp_optim.get_state_dict(src, src_optim, options=dcp_optim.StateDictOptions(full_state_dict=True))
    model, optim = fsdp1_hooked(0, bad_rank=-1)

    def post_hook(module, incompatible_keys):
        if dist.get_rank() == 1:
            raise ValueError("post-hook refuses the load on rank 1")

    model.module.layers[0].module.down.register_load_state_dict_post_hook(post_hook)
    before = _snapshot(model, optim)
    dist.barrier()
    result, seconds = _timed(_fsdp1_hook_call(dcp_optim, "set_state_dict", "full", rank, model, optim, msd, osd))
    out["post_hook"] = {"result": result, "seconds": seconds,
                        "state": classify(before, _snapshot(model, optim), None)}
    dist.barrier()
    out["fsdp_own"] = _fsdp1_own_code_fails(rank)
    return out


def _fsdp1_own_code_fails(rank: int) -> dict[str, Any]:
    """Last (it leaves the ranks apart): a model whose hooks raise nowhere
    (its commit can fail, so the ranks would agree on its outcome), and
    FSDP's own load code raising on rank 1 in its first gather at commit:
    rank 1 raises that error at once, without entering the agreement that
    rank 0, waiting in the gather, would never reach; rank 0, released by
    the backend's timeout (5 s here), raises rank 1's error, relayed
    through the store.  Both unchanged."""
    model, optim = fsdp1_hooked(0, bad_rank=-1)
    src, src_optim = fsdp1_hooked(3, bad_rank=-1)
    msd, osd = dcp_optim.get_state_dict(src, src_optim, options=dcp_optim.StateDictOptions(full_state_dict=True))
    load = _fsdp1_hook_call(dcp_optim, "set_state_dict", "full", rank, model, optim, msd, osd)
    return _fsdp_fails_at_commit(rank, 1, model, optim, load)


def fsdp1_model_only_own_code_fails_case(rank: int, ws: int) -> dict[str, Any]:
    """``set_model_state_dict`` alone on a nested FSDP1 model whose modules
    have no load code of their own (no part of the load is fallible), with
    FSDP's own load code raising on rank 1 at its third collective at
    commit: a later unit's gather, after the earlier units loaded.  The
    commit is staged all the same (FSDP's collectives can fail midway), so
    every rank puts the earlier units back; rank 0, released by the
    backend's timeout (5 s), raises rank 1's error, relayed through the
    store."""
    from .fault_matrix import _build

    mesh = init_device_mesh("cpu", (ws,))
    model, optim = _build(mesh, "fsdp-commit-raises", rank, 0, "fsdp1-full")
    src, _ = _build(mesh, "fsdp-commit-raises", rank, 3, "fsdp1-full")
    opts = dcp_optim.StateDictOptions(full_state_dict=True)
    msd = dcp_optim.get_model_state_dict(src, options=opts)
    return _fsdp_fails_at_commit(rank, 3, model, optim, lambda: dcp_optim.set_model_state_dict(model, msd, options=opts))


def _fsdp_fails_at_commit(rank: int, nth: int, model: Any, optim: Any, load: Any) -> dict[str, Any]:
    """Runs ``load`` with FSDP's own load code raising on rank 1 at its
    ``nth`` collective at commit, under a 5 s group timeout; rank 1 then
    lives on (its peer is not told by a closed connection).  The result,
    the seconds it took and what it left (fault_matrix.classify)."""
    import dcp_optim.state_dict as ours

    from .fault_matrix import _fsdp_fails, _on_collective, _snapshot, classify

    before = _snapshot(model, optim)
    if rank == 1:
        real_commit = ours._commit

        def armed_commit(*a, **k):
            _on_collective(nth, _fsdp_fails)
            return real_commit(*a, **k)

        ours._commit = armed_commit  # type: ignore[assignment]
    dist.barrier()
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=5))
    result, seconds = _timed(load)
    if rank == 1:
        time.sleep(8)
    return {"result": result, "seconds": seconds, "state": classify(before, _snapshot(model, optim), None)}


def _errors_in_chain(exc: BaseException | None) -> list[str]:
    """The class names of ``exc`` and its causes and contexts."""
    names = []
    while exc is not None:
        names.append(type(exc).__name__)
        exc = exc.__cause__ or exc.__context__
    return names


def step_collectives_case(rank: int, ws: int) -> dict[str, Any]:
    """An optimizer whose step communicates, stepped by dcp_optim to build
    a template (lockstep.py).  (a) heavyball's SOAP under FSDP1 keeps the
    state of each flat parameter on its owner rank: a getter found
    parameters without state on rank 0 only and its shadow step waited in
    heavyball's all_to_all until the process group's timeout, which broke
    the group; now the collective meets no peer (rank 1 waits at the
    call's next meeting) and the call ends at once with one error on both
    ranks.  (b) pytorch-optimizer's AdamMini with ``model_sharding``
    all-gathers the parameters' sizes as it creates their state: every
    rank's template of a fresh optimizer comes from steps that meet in
    lockstep, upstream's keys.  (c) the same optimizer with one
    parameter's state gone on rank 0 only: rank 0's template step raises
    StepCollectiveError at once, as rank 1 waits at a meeting, and the
    group still works."""
    import heavyball
    from pytorch_optimizer import AdamMini
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from dcp_optim._engine import consistency

    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=60))
    out: dict[str, Any] = {}
    heavyball.utils.compile_mode = None
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)), device_id=torch.device("cpu"),
                 use_orig_params=True, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    optim = heavyball.SOAP(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(8, 4)).pow(2).sum().backward()
        optim.step()
        optim.zero_grad()
    with _arrival_bound("20"):
        result, seconds = _timed(lambda: dcp_optim.get_optimizer_state_dict(model, optim))
    out["heavyball"] = (result.split(":")[0], seconds)
    probe = torch.ones(1)
    dist.all_reduce(probe)  # the group works
    out["heavyball_group"] = float(probe)

    def adam_mini():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        return model, AdamMini(model, lr=1e-2, model_sharding=True, num_embeds=4, num_heads=1)

    model, optim = adam_mini()
    ref_model, ref_optim = adam_mini()
    with _arrival_bound("20"):
        ours = dcp_optim.get_optimizer_state_dict(model, optim)
    theirs = upstream.get_optimizer_state_dict(ref_model, ref_optim)
    out["fresh_same_keys"] = (
        list(ours["state"]) == list(theirs["state"])
        and all(list(ours["state"][k]) == list(theirs["state"][k]) for k in theirs["state"])
        and len(ours["state"]) == 4
    )
    out["fresh_live"] = len(optim.state)  # the shadow steps left no state
    model, optim = adam_mini()
    model(torch.randn(2, 4)).sum().backward()
    optim.step()  # both ranks: AdamMini's collectives meet
    if rank == 0:
        optim.state.pop(model[1].bias)
    t0 = time.monotonic()
    error = None
    with _arrival_bound("20"):
        try:
            dcp_optim.get_optimizer_state_dict(model, optim)
        except Exception as exc:  # noqa: BLE001 - recorded
            error = exc
        # rank 1 (no template to build) is at this meeting first
        consistency.await_arrival(None, "after the getter")
    out["one_sided"] = (_errors_in_chain(error), round(time.monotonic() - t0, 1))
    out["one_sided_live"] = len(optim.state)
    probe = torch.ones(1)
    dist.all_reduce(probe)
    out["one_sided_group"] = float(probe)
    return out
