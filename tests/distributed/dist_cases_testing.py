"""Rank functions for tests/distributed/test_testing.py: the cross-rank helpers of
``dcp_optim.testing`` on any world size >= 2 (spawned by ``run_ranks`` in
``make test``, on torchrun's processes in ``make test-torchrun``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import dcp_optim
from dcp_optim import testing

from .dist_cases import fsdp2_model, make_optimizer, plain_model, train


def _raises(fn) -> dict:
    """Outcome of ``fn()``: the exception type, message and ranks."""
    try:
        fn()
    except testing.RankFailure as exc:
        return {"type": "RankFailure", "message": str(exc), "ranks": exc.ranks}
    except Exception as exc:  # noqa: BLE001 - recorded for the test to judge
        return {"type": type(exc).__name__, "message": str(exc), "ranks": None}
    return {"type": None}


def helpers_case(rank: int, ws: int, ckpt: str) -> dict:
    last = ws - 1
    out: dict = {"gathered": testing.gather_objects(rank * 10)}

    testing.assert_all_ranks(True, "never shown")
    out["assert_all_ranks"] = _raises(
        lambda: testing.assert_all_ranks(rank != last, f"local value {rank * 10}")
    )

    def block():
        with testing.on_all_ranks("the block"):
            if rank == 0:
                raise ValueError("only rank 0 objects")

    out["on_all_ranks"] = _raises(block)

    mesh = init_device_mesh("cpu", (ws,))
    sharded = fsdp2_model(mesh, seed=3, hidden=8)
    full = plain_model(seed=3, hidden=8)
    # a sharded model state dict equals the same model's full one
    out["sharded_vs_full"] = _raises(
        lambda: testing.assert_state_dicts_equal(sharded.state_dict(), full.state_dict())
    )
    # one element of the shard the last rank holds differs
    corrupt = plain_model(seed=3, hidden=8)
    with torch.no_grad():
        corrupt.layers[1].up.weight[7, 2] += 0.5
    out["one_element"] = _raises(
        lambda: testing.assert_state_dicts_equal(sharded.state_dict(), corrupt.state_dict())
    )
    # a plain (not sharded) value differing on one rank only
    local = {"a": torch.ones(3), "b": {"c": torch.arange(4) + (rank == last)}}
    out["one_rank"] = _raises(
        lambda: testing.assert_state_dicts_equal(local, {"a": torch.ones(3), "b": {"c": torch.arange(4)}})
    )
    out["missing_key"] = _raises(
        lambda: testing.assert_state_dicts_equal({"a": 1, "b": 2}, {"a": 1})
    )
    out["dtype"] = _raises(
        lambda: testing.assert_state_dicts_equal({"a": torch.ones(2)}, {"a": torch.ones(2, dtype=torch.float64)})
    )

    # the round trip: FSDP2 + Adam, trained, saved, resumed into a fresh
    # pair (other seed, never stepped), one more step on both
    model = fsdp2_model(mesh, seed=1)
    optim = make_optimizer(model, "adam", groups=2)
    train(model, optim)

    def build():
        m = fsdp2_model(mesh, seed=2)
        return m, make_optimizer(m, "adam", groups=2)

    def step(m, o):
        train(m, o, steps=1, seed=7)

    new_model, new_optim = testing.save_resume_round_trip(model, optim, build, ckpt, then=step)
    out["round_trip"] = sorted(new_optim.state_dict()["state"]) == sorted(optim.state_dict()["state"])
    # a differing optimizer state is caught (a fresh, never-stepped one)
    out["round_trip_detects"] = _raises(
        lambda: testing.assert_state_dicts_equal(
            dcp_optim.get_state_dict(new_model, make_optimizer(new_model, "adam", groups=2)),
            dcp_optim.get_state_dict(model, optim),
        )
    )
    dist.barrier()
    return out
