"""The agreement record of ``_engine.consistency`` (issue 26: flat in the
world size): what the ranks learn from one all-reduce of per-word
minima and maxima, simulated here over many ranks in one process (the
elementwise minimum of every rank's sent words is what ``ReduceOp.MIN``
returns).  The distributed tests check the same records on gloo ranks."""

from __future__ import annotations

import pytest

from dcp_optim._engine import consistency as c


def _reduce(records: list[c._Record]) -> tuple[list[int], list[int]]:
    sent = [r.lo + [-h for h in r.hi] for r in records]
    out = [min(col) for col in zip(*sent)]
    return out[: c.RECORD_WORDS], [-h for h in out[c.RECORD_WORDS :]]


def _flags_record(index: int, flags: list[int], digest: bytes = b"x" * 20) -> tuple[c._Record, tuple]:
    record = c._Record(c._KIND_LOAD)
    record.put(c._digest_words(digest))
    at = c._put_flags(record, index, flags)
    assert record.at <= c.RECORD_WORDS
    return record, at


@pytest.mark.parametrize(
    "per_rank, learnt",
    [
        # every rank alike: one value
        ([(1, 1, 0)] * 5, ((1, 1, 0), (1, 1, 0))),
        # a broadcast load: the source holds the dicts, the others not
        ([(1, 1, 2)] + [(0, 0, 2)] * 4, ((1, 1, 2), (0, 0, 2))),
        # cpu_offload: rank 0 keeps, the others send only
        ([(1,)] + [(0,)] * 6, ((1,), (0,))),
        # 8 flags, the largest values
        ([(255,) * 8] + [(0, 255, 1, 2, 3, 4, 5, 255)] * 2, ((255,) * 8, (0, 255, 1, 2, 3, 4, 5, 255))),
        # ranks past the first differ: not learnt (the flags are gathered)
        ([(1, 1, 0), (0, 0, 0), (1, 0, 0)], None),
        ([(0,), (0,), (1,)], None),
    ],
)
def test_flags_learnt_from_the_reduction(per_rank, learnt):
    records = []
    for i, flags in enumerate(per_rank):
        record, at = _flags_record(i, list(flags))
        records.append(record)
    lo, hi = _reduce(records)
    assert c._flags_learnt(lo, hi, at, len(per_rank[0]), len(per_rank)) == learnt
    if learnt is not None:
        got = c.RankFlags.of(learnt[0], learnt[1], len(per_rank))
        assert got == list(per_rank)
        for i in range(len(per_rank[0])):
            assert c.flags_union(got, i) == c.flags_union(list(per_rank), i)


def test_digest_words_detect_any_difference_and_stay_in_range():
    a, b = bytes(20), bytes(19) + b"\x01"
    full = b"\xff" * 20
    for d in (a, b, full):
        words = c._digest_words(d)
        assert len(words) == c._DIGEST_WORDS and all(0 <= w < c._BIG for w in words)
    records = [_flags_record(0, [], a)[0], _flags_record(1, [], b)[0]]
    lo, hi = _reduce(records)
    assert not c._same(lo, hi, 0, 1 + c._DIGEST_WORDS)
    records = [_flags_record(0, [], full)[0], _flags_record(1, [], full)[0]]
    lo, hi = _reduce(records)
    assert c._same(lo, hi, 0, 1 + c._DIGEST_WORDS)


def test_records_of_other_kinds_differ():
    load = c._Record(c._KIND_LOAD)
    load.put(c._digest_words(bytes(20)))
    gather = c._Record(c._KIND_GATHER)
    gather.put(c._digest_words(bytes(20)))
    lo, hi = _reduce([load, gather])
    assert not c._same(lo, hi, 0, 1)


@pytest.mark.parametrize(
    "flags, expect",
    [([1, 1, 1, 1], (4, 0)), ([1, 0, 0, 0], (1, 0)), ([0, 1, 1], (2, 1)), ([0, 0, 0], (0, None)),
     ([0, 1, 0, 1], (2, 1))],
)
def test_flagged(flags, expect):
    # learnt (first, rest) and gathered lists answer alike
    assert c.flagged(flags) == expect
    if len(set(flags[1:])) == 1:
        assert c.flagged(c.RankFlags.of(flags[0], flags[1], len(flags))) == expect
