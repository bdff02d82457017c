"""Sharded training on CPU gloo: FSDP2 (1-D, uneven shards), tensor
parallel, FSDP2+TP on a 2x2 mesh, HSDP, FSDP2 with a mesh per parameter,
FSDP2 over torchao's float8 training --
every getter and setter against upstream, optimizer state placement (D9),
never-stepped templates (D1/D2)."""

from __future__ import annotations

import pytest

from ..support.harness import run_ranks
from . import dist_cases

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("ws", [2, 3])
def test_fsdp2(ws):
    results = run_ranks(ws, dist_cases.compare_sharded_suite, "fsdp2", timeout=300)
    assert all(r == ["fsdp2[0]", "fsdp2[1]", "fsdp2[2]"] for r in results)


def test_tensor_parallel():
    results = run_ranks(2, dist_cases.compare_sharded_suite, "tp", timeout=300)
    assert all(r == ["tp[0]"] for r in results)


@pytest.mark.slow
def test_fsdp2_tp_2d():
    results = run_ranks(4, dist_cases.compare_sharded_suite, "fsdp_tp", timeout=400)
    assert all(r == ["fsdp_tp[0]"] for r in results)


@pytest.mark.slow
def test_hsdp():
    results = run_ranks(4, dist_cases.compare_sharded_suite, "hsdp", timeout=400)
    assert all(r == ["hsdp[0]"] for r in results)


@pytest.mark.slow
def test_fsdp2_per_parameter_mesh():
    """torch 2.12's per-parameter meshes (``shard_placement_fn`` returning a
    ``ShardPlacementResult``; mixture-of-experts layouts): the experts'
    DTensors on a 1-D mesh of 2 ranks, replicated over the other 2, the
    rest on the world's mesh."""
    from torch.distributed.fsdp._fully_shard import _fsdp_common

    if not hasattr(_fsdp_common, "ShardPlacementResult"):
        pytest.skip("this torch has no per-parameter FSDP2 meshes (ShardPlacementResult: 2.12+)")
    results = run_ranks(4, dist_cases.compare_sharded_suite, "per_param_mesh", timeout=400)
    assert all(r == ["per_param_mesh[0]"] for r in results)


def test_fsdp2_float8_weights():
    """torchao's float8 training under FSDP2 (float8 all-gathers: the
    weights' local tensors are a torchao tensor subclass), AdamW."""
    pytest.importorskip("torchao")
    results = run_ranks(2, dist_cases.compare_sharded_suite, "float8", timeout=300)
    assert all(r == ["float8[0]"] for r in results)
