"""The full-load plan (``LoadPlan``) and the stream's Python executors, in
one process: what the source packs into each bucket is what every rank
copies out, row chunks split across buckets included (the multi-process
broadcast tests run the same code over real collectives)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from dcp_optim import _dcp_optim as C
from dcp_optim._engine.distribute import (
    _CLASSES,
    _extract_rows,
    _pack_rows,
    run_full_load,
    to_metadata,
)


def _values():
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(7, 3, generator=g),  # 84 bytes: split in row chunks
        torch.randn(5, generator=g).to(torch.bfloat16),
        torch.tensor(2.5, dtype=torch.float64),  # 0-dim: travels whole
        torch.arange(12, dtype=torch.int64).view(2, 3, 2),
        torch.randn(0, 4, generator=g),  # no rows at all
    ]


@pytest.mark.parametrize("budget", [16, 48, 1 << 20])
def test_stream_round_trip(budget):
    values = _values()
    # rows 1..5 of the first value land in a (dest, blocks) template, as
    # FSDP1's flat shards do; one job is not needed here
    part = torch.zeros(4, 3)
    blocks = [((0, 0), (1, 0), (4, 3))]
    jobs = [(values[0], (part, blocks), "cpu")] + [(v, None, "cpu") for v in values[1:]]
    jobs.append((torch.ones(3), False, "cpu"))
    plan = C.plan_full_load(jobs, DTensor, _CLASSES, budget, torch.empty, True)
    assert plan.njobs == len(jobs) and len(plan.bucket_bytes) == plan.nbuckets
    if budget == 16:
        assert plan.nbuckets > len(jobs)  # rows split across buckets
    storage = torch.zeros(plan.max_bucket_bytes, dtype=torch.uint8)
    for b, nbytes in enumerate(plan.bucket_bytes):
        buf = storage[:nbytes]
        chunks = plan.chunks(b)
        # within the budget, unless one row is larger (it travels alone)
        assert nbytes % 16 == 0 and (nbytes <= budget or len(chunks) == 1)
        _pack_rows(buf, chunks)
        packed = buf.clone()
        buf.zero_()
        buf.copy_(packed)  # what a broadcast delivers
        _extract_rows(buf, chunks)
    out = C.finish_full_load(plan, DTensor.from_local, None)
    assert out[0] is part and torch.equal(part, values[0][1:5])
    for got, want in zip(out[1:-1], values[1:]):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    assert out[-1] is None


def test_local_load_matches_stream():
    """route None (every rank holds the full values) and the stream give
    the same results."""
    values = _values()
    jobs = [(v, None, "cpu") for v in values]
    local = run_full_load(jobs, route=None)
    for got, want in zip(local, values):
        assert torch.equal(got, want) and got is not want
    plan = C.plan_full_load(jobs, DTensor, _CLASSES, 1 << 20, torch.empty, False)
    assert plan.nbuckets == 0 and plan.bucket_bytes == () and plan.max_bucket_bytes == 0
    with pytest.raises(IndexError, match="out of range"):
        plan.chunks(0)


def test_to_metadata():
    t = torch.zeros(2, 3, dtype=torch.float16)
    scalar = torch.tensor(1.5)
    meta = to_metadata([t, scalar, "x", 3])
    assert meta[0] == ((2, 3), torch.float16) and type(meta[0]).__name__ == "TensorMeta"
    assert meta[1] is scalar and meta[2:] == ["x", 3]
