"""Issue 24's fault matrix: every fault x path, dcp_optim beside upstream
(torch 2.13), two gloo ranks, FSDP2 (uneven shards) and, on the "fsdp1-"
paths, FSDP1 (flat parameters, nested wrapping, ``device_id`` cpu).  ``make fault-matrix``
runs it all (one launch per cell) and prints the table of
docs/reliability.md; tests/distributed/test_faults.py runs a sample of it
in ``make test``.

Each cell records, per implementation, what every surviving rank saw:
the time from the call to its end (seconds), the error (its type and
first words) or "ok", and what the call left in that rank's model and
optimizer (its shards of the parameters and of the optimizer state):

* ``unchanged``: bit-identical to before the call;
* ``loaded``: bit-identical to what a successful load of that dict gives;
* ``PARTIAL``: every tensor is one or the other, some loaded, some not;
* ``WRONG``: anything else (a tensor that is neither).

A getter's cells compare with before only (nothing is loaded).
The process group's timeout is 6 s in every cell (so that upstream's hangs
end), dcp_optim's arrival bound (DCP_OPTIM_ARRIVAL_TIMEOUT) 2 s.

    python -m tests.distributed.fault_matrix [--faults a,b] [--paths x,y]
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as upstream
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dcp_optim

PG_TIMEOUT_S = 6
ARRIVAL_S = "2"

FAULTS = {
    "options": "full_state_dict (or broadcast_from_rank0) differs on rank 1",
    "order": "parameters registered in another order on rank 1",
    "never": "rank 1 arrives 8 s late (past both bounds)",
    "kill-before": "rank 1 SIGKILLed before the call",
    "kill-mid": "rank 0 SIGKILLed in its third collective (mid-transfer)",
    "kill-agree": "rank 1 SIGKILLed before the last agreement (data moved, nothing installed)",
    "kill-commit": "rank 1 SIGKILLed after the last agreement, as its commit starts",
    "hook": "a module's load hook raises on rank 1 only",
    "optim-load": "the optimizer's own load_state_dict raises on rank 1 only (after the model's commit)",
    "kill-fsdp-commit": "rank 1 SIGKILLed in its first collective after the last agreement (FSDP1's own gathers at commit)",
    "fsdp-commit-raises": "FSDP1's own load code raises on rank 1 only, in its first collective at commit",
}
PATHS = {
    "get-full": "full getter (get_state_dict, full_state_dict)",
    "sharded": "sharded set_state_dict",
    "full": "full set_state_dict (every rank holds the dict)",
    "broadcast": "broadcast set_state_dict (rank 0 holds the dict), its tensors streamed",
    "inline": "broadcast set_state_dict of a small dict, its tensors inline with the metadata",
    "flat": "full set_state_dict, flattened optimizer dict",
    "fsdp1-get-full": "FSDP1: full getter",
    "fsdp1-sharded": "FSDP1: sharded set_state_dict (no device mesh: ShardedTensors)",
    "fsdp1-full": "FSDP1: full set_state_dict",
    "fsdp1-broadcast": "FSDP1: broadcast set_state_dict",
    "fsdp1-mesh-sharded": "FSDP1 with a device mesh: sharded set_state_dict (DTensors)",
    "fsdp1-hsdp-sharded": "FSDP1 hybrid sharding (1 x 2 mesh): sharded set_state_dict (FSDP's own optimizer load)",
}
FSDP1_FAULTS = ("options", "never", "kill-before", "kill-mid", "kill-agree", "kill-commit", "hook", "optim-load",
                "kill-fsdp-commit", "fsdp-commit-raises")
# faults in FSDP1's own commit: its set paths only
FSDP1_ONLY = ("kill-fsdp-commit", "fsdp-commit-raises")
# cells that do not apply (a getter has no commit nor load hook; sharded
# and full loads make fewer than three collectives: nothing is in transit)
SKIP = {("kill-commit", "get-full"), ("kill-agree", "get-full"), ("hook", "get-full"), ("optim-load", "get-full"),
        ("kill-mid", "sharded"), ("kill-mid", "full"), ("kill-mid", "flat"),
        ("kill-commit", "fsdp1-get-full"), ("kill-agree", "fsdp1-get-full"), ("optim-load", "fsdp1-get-full"),
        ("hook", "fsdp1-get-full")}
# FSDP1 (flat parameters, nested wrapping) runs the faults that do not
# depend on FSDP2 models (TwoParams; "hook" puts its load pre-hook on the
# first block's inner layer, dist_cases_faults.refuse_load_on); its loads all exchange data
# (FSDP1's sharded move exchanges shards), so kill-mid applies to each
SKIP |= {(f, p) for f in FAULTS for p in PATHS if p.startswith("fsdp1") and f not in FSDP1_FAULTS}
SKIP |= {(f, p) for f in FSDP1_ONLY for p in PATHS if not p.startswith("fsdp1") or p.endswith("get-full")}
COLLECTIVES = ("broadcast", "all_gather_into_tensor", "all_gather_single", "all_gather", "gather",
               "all_reduce", "scatter", "all_to_all_single", "reduce_scatter_tensor", "_all_gather_base")


def _on_collective(nth: int, action: Any) -> None:
    """From now on, this rank's ``nth`` collective runs ``action`` first."""
    count = [0]
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def wrapped(*a, _fn=fn, **k):
            count[0] += 1
            if count[0] == nth:
                action()
            return _fn(*a, **k)

        setattr(dist, name, wrapped)


def _fsdp_fails() -> None:
    raise RuntimeError("FSDP1's own load fails on rank 1")


def _snapshot(model: Any, optim: Any) -> Any:
    """This rank's shards of the parameters and of the optimizer state, and
    the optimizer's hyperparameters (without collectives)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from tests.distributed.dist_cases_reliability import _local_snapshot

    params, state = _local_snapshot(model, optim)
    if isinstance(model, FSDP):  # this rank's shards of the flat parameters
        params = [p.detach().clone() for p in model.parameters()]
    groups = [repr(sorted((k, v) for k, v in g.items() if k != "params")) for g in optim.param_groups]
    return params, state, groups


def _leaves(snapshot: Any) -> list[Any]:
    params, state, *groups = snapshot
    out = list(params)
    for st in state:
        out.extend(st[k] for k in sorted(st))
    for g in groups:
        out.extend(g)
    return out


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    return type(a) is type(b) and a == b


def classify(before: Any, after: Any, loaded: Any | None) -> str:
    """``unchanged``, ``loaded``, ``PARTIAL`` or ``WRONG`` (module
    docstring); ``loaded`` None: nothing was to be loaded (a getter)."""
    b, a = _leaves(before), _leaves(after)
    if len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b)):
        return "unchanged"
    if loaded is None:
        return "WRONG"
    ref = _leaves(loaded)
    if len(a) != len(b) or len(a) != len(ref):
        return "WRONG"
    if all(_equal(x, y) for x, y in zip(a, ref)):
        return "loaded"
    if all(_equal(x, y) or _equal(x, z) for x, y, z in zip(a, b, ref)):
        return "PARTIAL"
    return "WRONG"


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _build(mesh, fault: str, rank: int, seed: int, path: str = ""):
    from tests.distributed.dist_cases_faults import Hooked, _two_params, refusing_optimizer
    from tests.distributed.dist_cases_reliability import build

    if path.startswith("fsdp1"):
        from tests.distributed.dist_cases import train
        from tests.distributed.dist_cases_fsdp1 import fsdp1_model

        if "hsdp" in path:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp import ShardingStrategy

            from tests.distributed.dist_cases import MLP

            torch.manual_seed(seed)
            hybrid = init_device_mesh("cpu", (1, mesh.size()), mesh_dim_names=("replicate", "shard"))
            model = FSDP(MLP(width=8, hidden=7, layers=2), device_id=torch.device("cpu"), device_mesh=hybrid,
                         sharding_strategy=ShardingStrategy.HYBRID_SHARD)
        else:
            model = fsdp1_model(seed, orig=False, wrap="nested", mesh=mesh if "mesh" in path else None)
        if fault == "hook":  # the first block's inner layer (FSDP1 nested: a later unit gathers after it)
            from tests.distributed.dist_cases_faults import refuse_load_on

            up = next(m for name, m in model.named_modules() if name.endswith("layers.0._fsdp_wrapped_module.up")
                      or name.endswith("layers.0.up"))
            refuse_load_on(up, bad_rank=1 if seed == 0 else -1)
        optim = torch.optim.Adam(model.parameters(), lr=0.01)
        train(model, optim, steps=2, seed=seed)
        if fault == "optim-load":
            optim = refusing_optimizer(optim, bad_rank=1 if seed == 0 else -1)
        return model, optim

    if fault == "order":
        return _two_params(mesh, rank, swapped=seed == 0)
    if fault == "hook":
        torch.manual_seed(seed)
        model = Hooked(bad_rank=1 if seed == 0 else -1)
        fully_shard(model, mesh=mesh)
        optim = torch.optim.Adam(model.parameters(), lr=0.1)
        model(torch.ones(2, 3)).sum().backward()
        optim.step()
        return model, optim
    if fault == "optim-load":
        model, optim = build(mesh, seed=seed)
        return model, refusing_optimizer(optim, bad_rank=1 if seed == 0 else -1)
    return build(mesh, seed=seed)


def cell(rank: int, ws: int, fault: str, path: str, impl: str) -> dict[str, Any]:
    from tests.distributed.dist_cases_reliability import _outcome

    os.environ["DCP_OPTIM_ARRIVAL_TIMEOUT"] = ARRIVAL_S
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=PG_TIMEOUT_S))
    mesh = init_device_mesh("cpu", (ws,))
    mod: Any = dcp_optim if impl == "dcp_optim" else upstream
    model, optim = _build(mesh, fault, rank, 0, path)
    src, src_optim = _build(mesh, fault, rank, 3, path)  # "order": rank 0's layout everywhere
    flat = path == "flat"
    full = path.removeprefix("fsdp1-") in ("full", "broadcast", "inline", "flat", "get-full")
    bcast = path.endswith("broadcast") or path == "inline"
    if path != "inline":
        # this model is small enough to travel inline: streamed unless
        # the path is inline's (FSDP1's broadcast loads always stream)
        from dcp_optim._engine import payload as _payload

        _payload.INLINE_BYTES = 0
    get_opts = dcp_optim.StateDictOptions(full_state_dict=full, flatten_optimizer_state_dict=flat)
    msd, osd = dcp_optim.get_state_dict(src, src_optim, options=get_opts)
    if bcast and rank != 0:
        msd, osd = {}, {}
    kw: dict[str, Any] = {"full_state_dict": full, "broadcast_from_rank0": bcast,
                          "flatten_optimizer_state_dict": flat}
    if fault == "options" and rank == 1:
        key = "broadcast_from_rank0" if bcast else "full_state_dict"
        kw[key] = not kw[key]
        if key == "full_state_dict" and kw[key] is False:
            kw["broadcast_from_rank0"] = False
    opts = mod.StateDictOptions(**kw)
    before = _snapshot(model, optim)
    # what a successful load of (msd, osd) leaves here: this rank's shards
    # of the source (built on the same mesh, so sharded alike)
    loaded = None if path.endswith("get-full") else _snapshot(src, src_optim)
    if fault == "kill-mid" and rank == 0:
        _on_collective(3, _die)
    if fault in FSDP1_ONLY and rank == 1:
        # armed as the commit starts: its first collective is one of
        # FSDP's own (the gathers of its load hooks) where it makes any
        action = _die if fault == "kill-fsdp-commit" else _fsdp_fails
        if impl == "dcp_optim":
            import dcp_optim.state_dict as ours

            real_commit = ours._commit

            def armed_commit(*a, **k):
                _on_collective(1, action)
                return real_commit(*a, **k)

            ours._commit = armed_commit  # type: ignore[assignment]
        else:
            real_load = model.load_state_dict

            def armed_load(*a, **k):
                _on_collective(1, action)
                return real_load(*a, **k)

            model.load_state_dict = armed_load  # type: ignore[method-assign]
    if fault == "kill-agree" and rank == 1:
        # the last agreement of the load: the first of a sharded load, the
        # one after the data moved of full, FSDP1 sharded and inline
        # broadcast (second) and streamed broadcast (third) loads;
        # upstream has none: its last collective before installing
        last = 1 if path == "sharded" else (3 if bcast and path != "inline" else 2)
        if impl == "dcp_optim":
            import dcp_optim.state_dict as ours

            calls = [0]
            real_agree = ours._agree

            def agree(*a, **k):
                calls[0] += 1
                if calls[0] == last:
                    _die()
                return real_agree(*a, **k)

            ours._agree = agree  # type: ignore[assignment]
        else:
            model.load_state_dict = lambda *a, **k: _die()  # type: ignore[method-assign]
    if fault == "kill-commit" and rank == 1:
        if impl == "dcp_optim":
            import dcp_optim.state_dict as ours

            ours._commit = lambda *a, **k: _die()  # type: ignore[assignment]
        else:
            model.load_state_dict = lambda *a, **k: _die()  # type: ignore[method-assign]
    if path.endswith("get-full"):
        def call():
            mod.get_state_dict(model, optim, options=opts)
    else:
        def call():
            mod.set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd, options=opts)
    dist.barrier()
    if fault == "never" and rank == 1:
        time.sleep(8)
    if fault == "kill-before" and rank == 1:
        _die()
    t0 = time.monotonic()
    result = _outcome(call)
    seconds = round(time.monotonic() - t0, 1)
    if rank == 1 and (fault == "fsdp-commit-raises" or (fault == "hook" and path.startswith("fsdp1"))):
        # the failing rank lives on (as a training job's would): its
        # peers are not told by a closed connection
        time.sleep(PG_TIMEOUT_S + 2)
    return {"result": result, "seconds": seconds, "state": classify(before, _snapshot(model, optim), loaded)}


def run_cell(fault: str, path: str, impl: str) -> list[Any]:
    """Per rank: the cell's record, or what ended the rank."""
    from tests.distributed.fault_matrix import cell as importable_cell  # not __main__'s
    from tests.support.harness import run_ranks

    try:
        return run_ranks(2, importable_cell, fault, path, impl, timeout=120)
    except AssertionError as exc:
        results = getattr(exc, "rank_results", {}) or {}
        codes = getattr(exc, "exitcodes", {}) or {}
        out: list[Any] = []
        for r in range(2):
            if r in results:
                out.append(results[r])
            else:
                code = codes.get(r)
                out.append({"result": "killed" if code == -9 else f"died (exit code {code})",
                            "seconds": None, "state": None})
        return out


def _short(text: str) -> str:
    if text in ("ok", "killed") or text.startswith("died"):
        return text
    kind, _, message = text.partition(": ")
    message = re.sub(r"\[/\S*/gloo/transport/tcp/(\S+?)\]", r"[gloo \1]", message)
    words = message.replace("|", "/").split()
    return f"{kind}: {' '.join(words[:9])}{' ...' if len(words) > 9 else ''}"


def describe(records: list[Any]) -> str:
    parts = []
    for r, rec in enumerate(records):
        if rec["result"] == "killed":
            parts.append(f"r{r}: killed")
            continue
        changed = rec["state"] or "?"
        secs = "" if rec["seconds"] is None else f"{rec['seconds']:g} s, "
        parts.append(f"r{r}: {secs}{_short(rec['result'])}, {changed}")
    return "<br>".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--paths", default=",".join(PATHS))
    args = parser.parse_args(argv)
    print("| fault | path | dcp_optim | upstream |")
    print("|---|---|---|---|")
    for fault in args.faults.split(","):
        for path in args.paths.split(","):
            if (fault, path) in SKIP:
                continue
            row = [describe(run_cell(fault, path, impl)) for impl in ("dcp_optim", "torch")]
            print(f"| {FAULTS[fault]} | {PATHS[path]} | {row[0]} | {row[1]} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
