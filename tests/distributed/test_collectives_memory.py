"""Full gathers: collectives per call and peak memory per rank (issue 7).

One launch of 2 gloo ranks runs every check on one FSDP2 model: for the
model and the optimizer, with and without ``cpu_offload``, dcp_optim's
result equals upstream's, the number of collectives is the number of
buckets plus the one agreement exchange, and the extra resident memory at
the call's peak stays within

* ``cpu_offload=True``, ranks other than 0 (they return ``{}``): their own
  packed segment of one bucket -- they send to rank 0 and never hold a
  gathered bucket;
* ranks that keep the result: the result plus one gathered bucket and gloo's
  internal staging copy of it.

The rank functions live here (run_ranks resolves them by module and name).
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import time
from typing import Any

import pytest

from ..support.harness import run_ranks

pytestmark = pytest.mark.dist

_MB = 2**20
# Python objects, allocator bookkeeping and the small tensors (biases,
# steps, the agreement digest) on top of the tensor memory accounted for.
_SLACK = 4 * _MB


def test_bucket_budget_adapts_and_can_be_fixed():
    from dcp_optim._engine import collectives as col

    previous = col.set_bucket_bytes(None)
    try:
        assert col.bucket_setting() is None
        assert col.bucket_bytes() == 16 * _MB
        assert col.bucket_bytes(100 * _MB) == 100 * _MB
        assert col.bucket_bytes(10**12) == 256 * _MB
        assert col.set_bucket_bytes(3 * _MB) is None
        assert col.bucket_bytes(100 * _MB) == 3 * _MB
        assert col.set_bucket_bytes(None) == 3 * _MB
        with pytest.raises(ValueError):
            col.set_bucket_bytes(0)
    finally:
        col.set_bucket_bytes(previous)


def test_full_gathers_collectives_and_peak_memory(capsys):
    results = run_ranks(2, gather_memory_case, timeout=300)
    with capsys.disabled():
        print()
        for r in results:
            for op, m in r["ops"].items():
                print(
                    f"rank {r['rank']} {op:18s} buckets {m['buckets']} collectives {m['ours']} "
                    f"(upstream {m['upstream']}), peak {m['peak'] / _MB:6.1f} MB "
                    f"(bound {m['bound'] / _MB:6.1f} MB, result {m['result'] / _MB:5.1f} MB, "
                    f"bucket {m['budget'] / _MB:.0f} MB)"
                )
    for r in results:
        for op, m in r["ops"].items():
            where = f"rank {r['rank']} {op}"
            assert m["ours"] == m["buckets"] + 1, (where, m)
            assert m["upstream"] >= m["tensors"], (where, m)
            assert m["peak"] <= m["bound"], (where, m)
            if op.endswith("offload") and r["rank"] != 0:
                # never a gathered bucket on a rank that keeps nothing
                assert m["peak"] < m["budget"], (where, m)


# --- rank function --------------------------------------------------------------


def _tune_malloc() -> None:
    """Every allocation of 64 KiB or more gets its own mapping, returned to
    the OS on free: resident memory then follows live tensor memory."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    libc.mallopt(M_MMAP_THRESHOLD, 65536)
    libc.mallopt(M_TRIM_THRESHOLD, 0)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def _peak_of(fn) -> tuple[int, Any]:
    """(peak resident bytes above the start, fn()): the kernel's high-water
    mark after resetting it, else a 1 ms sampler."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        exact = True
    except OSError:
        exact = False
    base = _rss()
    if exact:
        result = fn()
        return _hwm() - base, result
    peak = [base]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.001)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        result = fn()
    finally:
        stop.set()
        t.join()
    return max(peak[0], _rss()) - base, result


def _tensor_bytes(tree: Any) -> int:
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(v) for v in tree)
    return 0


def gather_memory_case(rank: int, ws: int) -> dict[str, Any]:
    _tune_malloc()
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint.state_dict as upstream
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import dcp_optim
    from dcp_optim._engine import collectives as _collectives
    from dcp_optim._engine.core import C

    from ..support.models import fsdp2_with_adam_step
    from ..support.oracle import assert_same_tree
    from .dist_cases import CollectiveCounter, _count_functional_collectives

    previous = _collectives.set_bucket_bytes(None)  # the adaptive default
    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    # 16 layers 768 -> 769 -> 768 (half the tensors split unevenly):
    # 38 MB of parameters, 76 MB of Adam state: several 16 MiB buckets.
    layers = [nn.Linear(768, 769) if i % 2 == 0 else nn.Linear(769, 768) for i in range(16)]
    model = nn.Sequential(*layers)
    optim = fsdp2_with_adam_step(model, mesh)

    def plan_of(leaves):
        plans = C.plan_gather(
            leaves, DTensor, _collectives._PLACEMENT_CLASSES, _collectives._MAX_BUCKET_BYTES,
            _collectives._MIN_BUCKET_BYTES,
        )
        (_, plan, _, _, budget), = plans
        return plan.buckets, budget, len(plans[0][2])

    sharded_model = dcp_optim.get_model_state_dict(model)
    sharded_optim = dcp_optim.get_optimizer_state_dict(model, optim)
    plans = {
        "model": plan_of(list(sharded_model.values())),
        "optim": plan_of([v for st in sharded_optim["state"].values() for v in st.values()]),
    }
    del sharded_model, sharded_optim
    out: dict[str, Any] = {"rank": rank, "ops": {}}
    try:
        for what in ("model", "optim"):
            for offload in (False, True):
                opts = dict(full_state_dict=True, cpu_offload=offload)

                def ours(opts=opts, what=what):
                    o = dcp_optim.StateDictOptions(**opts)
                    if what == "model":
                        return dcp_optim.get_model_state_dict(model, options=o)
                    return dcp_optim.get_optimizer_state_dict(model, optim, options=o)

                def theirs(opts=opts, what=what):
                    o = upstream.StateDictOptions(**opts)
                    if what == "model":
                        return upstream.get_model_state_dict(model, options=o)
                    return upstream.get_optimizer_state_dict(model, optim, options=o)

                # memory first, in a quiet process (no counters installed)
                dist.barrier()
                peak, result = _peak_of(ours)
                result_bytes = _tensor_bytes(result)
                del result
                dist.barrier()
                with CollectiveCounter() as ours_c10d:
                    mine, ours_func = _count_functional_collectives(ours)
                with CollectiveCounter() as theirs_c10d:
                    ref, theirs_func = _count_functional_collectives(theirs)
                assert_same_tree(ref, mine)
                del ref, mine
                buckets, budget, tensors = plans[what]
                keeps = not offload or rank == 0
                bound = (result_bytes + 2 * budget if keeps else math.ceil(budget / ws)) + _SLACK
                out["ops"][f"{what}{'_offload' if offload else ''}"] = {
                    "ours": ours_c10d.total + ours_func,
                    "ours_detail": dict(ours_c10d.counts, functional=ours_func),
                    "upstream": theirs_c10d.total + theirs_func,
                    "buckets": buckets,
                    "tensors": tensors,
                    "budget": budget,
                    "peak": peak,
                    "result": result_bytes,
                    "bound": bound,
                }
    finally:
        _collectives.set_bucket_bytes(previous)
    dist.barrier()
    return out
