"""The in-memory resharding plan (``reshard_plan``, csrc/reshard_plan.c)
without launching processes: every rank's plan of a random pair of
layouts is computed in one process, the boxes each rank sends are matched
in order with the boxes their receivers expect, and moving them (plus the
local copies) must give every destination rank exactly its shard of the
full tensor, each element written exactly once and read from a rank that
holds it.  Layouts: 1-D and 2-D meshes, Shard / _StridedShard / Replicate,
uneven and empty shards, 0-d tensors, destination meshes over a subset of
the ranks."""

from __future__ import annotations

import itertools

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcp_optim._engine.core import C


def _coords(mesh):
    return [list(c) for c in itertools.product(*(range(n) for n in mesh))]


def _local(full, mesh, placements, coord):
    (lshape, blocks), = C.shard_layouts(list(full.shape), list(mesh), placements, [coord])
    out = torch.full(tuple(lshape), -1, dtype=full.dtype)
    for ls, gs, ln in blocks:
        out[tuple(slice(a, a + n) for a, n in zip(ls, ln))] = full[tuple(slice(a, a + n) for a, n in zip(gs, ln))]
    return out


def _box(start, lens):
    return tuple(slice(a, a + n) for a, n in zip(start, lens))


def check(shape, src_mesh, src_pl, src_ranks, dst_mesh, dst_pl, dst_ranks):
    full = torch.arange(int(torch.tensor(shape).prod().item()) if shape else 1, dtype=torch.int64).reshape(shape)
    src_local = {r: _local(full, src_mesh, src_pl, c) for r, c in zip(src_ranks, _coords(src_mesh))}
    want = {r: _local(full, dst_mesh, dst_pl, c) for r, c in zip(dst_ranks, _coords(dst_mesh))}
    got = {r: torch.full_like(t, -1) for r, t in want.items()}
    count = {r: torch.zeros_like(t) for r, t in want.items()}
    plans = {
        r: C.reshard_plan(list(shape), list(src_mesh), src_pl, src_ranks, list(dst_mesh), dst_pl, dst_ranks, r)
        for r in set(src_ranks) | set(dst_ranks)
    }
    for r, (local, recv, send) in plans.items():
        for s, d, ln in local:
            got[r][_box(d, ln)] = src_local[r][_box(s, ln)]
            count[r][_box(d, ln)] += 1
        for peer in {p for p, *_ in recv}:
            mine = [(s, d, ln) for p, s, d, ln in recv if p == peer]
            theirs = [(s, d, ln) for p, s, d, ln in plans[peer][2] if p == r]
            assert mine == theirs, (r, peer)
            for s, d, ln in mine:
                got[r][_box(d, ln)] = src_local[peer][_box(s, ln)]
                count[r][_box(d, ln)] += 1
        # nothing is sent that nobody receives
        for p, *_ in send:
            assert any(q == r for q, *_ in plans[p][1])
    for r in want:
        assert torch.equal(got[r], want[r]), r
        assert bool((count[r] == 1).all()), r
    return plans


def test_fsdp_to_tp_moves_only_what_is_needed():
    plans = check((8, 4), (2,), [(1, 0, 1)], [0, 1], (2,), [(1, 1, 1)], [0, 1])
    local, recv, send = plans[0]
    assert local == [((0, 0), (0, 0), (4, 2))]
    assert recv == [(1, (0, 0), (4, 0), (4, 2))]
    assert send == [(1, (0, 2), (0, 0), (4, 2))]


def test_replicated_source_copies_locally():
    plans = check((5, 3), (2, 2), [(0, 0, 1), (1, 0, 1)], [0, 1, 2, 3], (4,), [(1, 0, 1)], [0, 1, 2, 3])
    # ranks 2 and 3 hold replicas of ranks 0 and 1's rows (0-2 and 3-4):
    # a holder copies locally, the others read holders[dst_rank % 2]
    recv_peers = {r: sorted({p for p, *_ in plans[r][1]}) for r in plans}
    assert recv_peers == {0: [], 1: [2], 2: [1], 3: []}
    assert plans[0][0] == [((0, 0), (0, 0), (2, 3))]
    assert plans[3][0] == [] and plans[3][1] == []  # rank 3's shard is empty


def test_subworld_and_scalar():
    check((7, 2), (4,), [(1, 0, 1)], [0, 1, 2, 3], (2,), [(1, 0, 1)], [2, 3])
    check((), (3,), [(0, 0, 1)], [0, 1, 2], (2,), [(0, 0, 1)], [1, 0])


def test_strided_2d_to_1d():
    check((8, 6), (2, 2), [(2, 0, 2), (1, 0, 1)], [0, 1, 2, 3], (4,), [(1, 1, 1)], [3, 2, 1, 0])


def test_errors():
    import pytest

    with pytest.raises(ValueError, match="Partial"):
        C.reshard_plan((4,), (2,), [(3, 0, 1)], [0, 1], (2,), [(1, 0, 1)], [0, 1], 0)
    with pytest.raises(ValueError, match="one placement per mesh dimension"):
        C.reshard_plan((4,), (2,), [], [0, 1], (2,), [(1, 0, 1)], [0, 1], 0)


def _layout(draw, ndim, ranks):
    shape = draw(st.sampled_from([(len(ranks),), (2, len(ranks) // 2)] if len(ranks) % 2 == 0 else [(len(ranks),)]))
    pl = []
    for _ in shape:
        kind = draw(st.sampled_from([0, 1, 2] if ndim else [0]))
        dim = draw(st.integers(0, max(ndim - 1, 0)))
        pl.append((kind, dim if kind else 0, draw(st.integers(1, 3)) if kind == 2 else 1))
    order = draw(st.permutations(ranks))
    return shape, pl, list(order)


@st.composite
def pairs(draw):
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.integers(0, 7)) for _ in range(ndim))
    world = draw(st.sampled_from([1, 2, 3, 4, 6]))
    ranks = list(range(world))
    src = _layout(draw, ndim, ranks)
    sub = ranks[: draw(st.integers(1, world))]
    dst = _layout(draw, ndim, sub)
    return shape, src, dst


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pairs())
def test_random_layout_pairs(pair):
    shape, (sm, sp, sr), (dm, dp, dr) = pair
    check(shape, sm, sp, sr, dm, dp, dr)


def test_boxes_split_and_buckets_stay_within_the_limit():
    from dcp_optim._engine import reshard as engine

    pieces = engine._split((1, 0), (0, 2), (10, 6), 4, 50)
    # every piece at most 50 bytes (2 rows of 6 float32 = 48), covering the box once, in order
    assert all(engine._nbytes(ln, 4) <= 50 for _, _, ln in pieces)
    assert sum(engine._nbytes(ln, 4) for _, _, ln in pieces) == 10 * 6 * 4
    assert [s for s, _, _ in pieces][:2] == [(1, 0), (3, 0)] and pieces[0][1] == (0, 2)
    # a single row larger than the limit splits along the next dimension
    assert all(engine._nbytes(ln, 8) <= 16 for _, _, ln in engine._split((0, 0), (0, 0), (1, 5), 8, 16))
    # each segment at a multiple of its own element size: no gap between
    # items of one dtype, padding only before a wider one
    f32, f64, u8, c128 = torch.float32, torch.float64, torch.uint8, torch.complex128
    kinds = [(f32, 48), (f32, 12), (u8, 3), (f64, 8), (f32, 4), (c128, 16), (f32, 40)]
    buckets = engine._buckets([(None, None, None, dt, n) for dt, n in kinds], 64)
    assert [[off for off, _ in entries] for _, entries in buckets] == [[0, 48, 60], [0, 8, 16], [0]]
    assert [size for size, _ in buckets] == [63, 32, 40]  # never above the limit
    assert all(off % item[3].itemsize == 0 for _, entries in buckets for off, item in entries)
    # a box of 64 KiB or more is a message of its own, after the packed
    # small ones (one message), at a 16-byte boundary
    kinds = [(f32, 102400), (f32, 12), (u8, 3), (f32, 70000)]
    items = [(None, None, None, dt, n) for dt, n in kinds]
    (size, entries), = engine._buckets(items, 2**20)
    assert [(off, item[4]) for off, item in entries] == [(0, 12), (12, 3), (16, 102400), (102416, 70000)]
    assert size == 172416
    assert [(lo, hi, len(msg)) for lo, hi, msg in engine._messages(entries)] == [
        (0, 15, 2), (16, 102416, 1), (102416, 172416, 1)]
    # the limit counts the large boxes too
    buckets = engine._buckets(items, 150000)
    assert [[(off, item[4]) for off, item in entries] for _, entries in buckets] == [
        [(0, 12), (12, 3), (16, 102400)], [(0, 70000)]]
    assert [size for size, _ in buckets] == [102416, 70000]
