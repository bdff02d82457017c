"""Strict comparators for state dicts (docs/testing.md, "The comparators").

`assert_same_tree` compares two state-dict trees exactly: container types
(OrderedDict vs dict, tuple vs list), key order, value types, tensor dtype,
device, shape, requires_grad and bits, DTensor mesh/placements/local
shards, and plain values by type and equality.
"""

from __future__ import annotations

from typing import Any

import torch

# The torch releases dcp_optim supports (pyproject.toml: torch>=2.11; each
# one's upstream is the oracle when the suite runs on it).
SUPPORTED_TORCH = ("2.11", "2.12", "2.13")


def _tensor_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point() or a.is_complex():
        # bitwise, so -0.0 vs 0.0 and NaN payloads count
        a_bits = a.detach().contiguous().view(-1).view(torch.uint8)
        b_bits = b.detach().contiguous().view(-1).view(torch.uint8)
        return torch.equal(a_bits, b_bits)
    return torch.equal(a, b)


def assert_same_tree(a: Any, b: Any, path: str = "$") -> None:
    from torch.distributed.tensor import DTensor

    assert type(a) is type(b), f"{path}: type {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), (
            f"{path}: keys differ\n  a={list(a.keys())}\n  b={list(b.keys())}"
        )
        for k in a:
            assert_same_tree(a[k], b[k], f"{path}[{k!r}]")
        return
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{path}[{i}]")
        return
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(a, ShardedTensor):
        assert a.size() == b.size(), f"{path}: size {a.size()} != {b.size()}"
        ma, mb = a.metadata(), b.metadata()
        assert [(m.shard_offsets, m.shard_sizes, str(m.placement)) for m in ma.shards_metadata] == [
            (m.shard_offsets, m.shard_sizes, str(m.placement)) for m in mb.shards_metadata
        ], f"{path}: shard metadata differs"
        assert ma.tensor_properties == mb.tensor_properties, f"{path}: tensor properties differ"
        la, lb = a.local_shards(), b.local_shards()
        assert len(la) == len(lb), f"{path}: local shard count differs"
        for i, (x, y) in enumerate(zip(la, lb)):
            assert x.metadata.shard_offsets == y.metadata.shard_offsets, f"{path}.shard{i}: offsets"
            assert_same_tree(x.tensor, y.tensor, f"{path}.shard{i}")
        return
    if isinstance(a, DTensor):
        assert a.device_mesh == b.device_mesh, f"{path}: mesh differs"
        assert a.placements == b.placements, f"{path}: {a.placements} != {b.placements}"
        assert a.shape == b.shape, f"{path}: global shape {a.shape} != {b.shape}"
        assert_same_tree(a.to_local(), b.to_local(), f"{path}.local")
        return
    if isinstance(a, torch.Tensor):
        assert a.device == b.device, f"{path}: device {a.device} != {b.device}"
        assert a.requires_grad == b.requires_grad, f"{path}: requires_grad differs"
        assert _tensor_equal(a, b), f"{path}: tensor values/dtype/shape differ: {a} vs {b}"
        return
    if isinstance(a, float) and a != a:  # NaN
        assert b != b, f"{path}: {a!r} != {b!r}"
        return
    assert a == b, f"{path}: {a!r} != {b!r}"


def live_storage(model: torch.nn.Module, optimizers=()) -> set[int]:
    """data_ptrs of every live parameter, buffer and optimizer state tensor."""
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = (optimizers,)
    ptrs = set()
    for t in list(model.parameters()) + list(model.buffers()):
        ptrs.add(t.data_ptr())
    for o in optimizers:
        for st in o.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    ptrs.add(v.data_ptr())
    return ptrs


def alias_pattern(tree: Any, live: set[int], live_objects: set[int] | None = None) -> list:
    """For every tensor leaf (traversal order): (aliases live storage,
    is the live object itself)."""
    out = []

    def visit(x):
        if isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)
        elif isinstance(x, torch.Tensor):
            out.append((x.data_ptr() in live, live_objects is not None and id(x) in live_objects))

    visit(tree)
    return out


def live_state_objects(optimizers) -> set[int]:
    ids = set()
    for o in optimizers:
        for st in o.state.values():
            ids.add(id(st))
            for v in st.values():
                ids.add(id(v))
    return ids


def optimizer_snapshot(optimizers, skip_frozen: bool = False, sort_names: bool = False) -> list:
    """A deep, comparable snapshot of optimizer state and groups keyed by
    parameter position.  ``skip_frozen`` leaves out the state of parameters
    with requires_grad=False (upstream drops it on load: D10 in docs/differences.md)."""
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = (optimizers,)
    snap = []
    for o in optimizers:
        params = [p for g in o.param_groups for p in g["params"]]
        pos = {id(p): i for i, p in enumerate(params)}
        state = {}
        for p, st in o.state.items():
            if skip_frozen and not p.requires_grad:
                continue
            items = sorted(st.items()) if sort_names else st.items()
            state[pos.get(id(p), -1)] = {
                k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in items
            }
        groups = [
            {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in g.items() if k != "params"}
            for g in o.param_groups
        ]
        snap.append({"state": dict(sorted(state.items())), "groups": groups})
    return snap


def assert_same_optimizers(a, b, skip_frozen: bool = False, sort_names: bool = False) -> None:
    """``sort_names``: ignore the order of state names (FSDP1 flattens from
    a set(), so upstream's order varies between processes)."""
    assert_same_tree(
        optimizer_snapshot(a, skip_frozen, sort_names), optimizer_snapshot(b, skip_frozen, sort_names)
    )


def params_snapshot(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}
