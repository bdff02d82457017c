"""The bounded arrival of a load's ranks (``consistency.meet``), one thread
per rank on one torch store: a meeting costs each rank a constant number
of store operations whatever the number of ranks (no lookup per rank
unless it times out), and a rank that never arrives is named by every
rank that waited for it, within the bound."""

from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import timedelta

import pytest
import torch.distributed as dist

from dcp_optim import errors
from dcp_optim._engine.consistency import meet


class CountingStore:
    """A torch store that counts each rank's operations."""

    def __init__(self, store):
        self.store = store
        self.ops: Counter[str] = Counter()

    def __getattr__(self, name):
        op = getattr(self.store, name)

        def counted(*args):
            self.ops[name] += 1
            return op(*args)

        return counted


def _meet_all(ranks, arriving, bound, seq=1, store=None, counting=True, late=()):
    store = store or dist.HashStore()
    store.set_timeout(timedelta(seconds=30))
    per_rank = {r: CountingStore(store) if counting else store for r in ranks}
    results: dict[int, object] = {}

    def one(rank):
        if rank in late:
            time.sleep(0.2)  # the others are waiting when it comes
        t0 = time.monotonic()
        try:
            meet(per_rank[rank], "test/arrive", seq, tuple(ranks), rank, "a load", bound)
            results[rank] = ("ok", time.monotonic() - t0)
        except Exception as exc:  # noqa: BLE001 - the test's subject
            results[rank] = (exc, time.monotonic() - t0)

    threads = [threading.Thread(target=one, args=(r,)) for r in arriving]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results, per_rank, store


@pytest.mark.parametrize("world", [2, 8, 64])
def test_a_meeting_costs_each_rank_a_constant_number_of_store_operations(world):
    ranks = list(range(world))
    results, per_rank, _ = _meet_all(ranks, ranks, bound=20.0)
    assert all(r == "ok" for r, _ in results.values()), results
    for rank, store in per_rank.items():
        assert store.ops["check"] == 0, (rank, store.ops)
        assert sum(store.ops.values()) <= 7, (rank, store.ops)


def test_meetings_follow_one_another_and_clean_up():
    ranks = list(range(4))
    store = dist.HashStore()
    for seq in (1, 2, 3):
        results, _, store = _meet_all(ranks, ranks, bound=20.0, seq=seq, store=store)
        assert all(r == "ok" for r, _ in results.values()), (seq, results)
    # the keys of meeting 1 and 2 are gone (the last arrival of the next
    # meeting deletes them), each rank's own key too
    for seq in (1, 2):
        assert not store.check([f"test/arrive/{seq}/all"]) and not store.check([f"test/arrive/{seq}/n"])
    assert not any(store.check([f"test/arrive/{s}/r{r}"]) for s in (1, 2, 3) for r in ranks)


def test_a_rank_that_never_arrives_is_named_within_the_bound():
    ranks = list(range(4))
    results, per_rank, _ = _meet_all(ranks, [0, 1, 2], bound=0.5)
    assert set(results) == {0, 1, 2}
    for rank, (exc, seconds) in results.items():
        assert isinstance(exc, errors.StateDictRuntimeError), (rank, exc)
        assert "timed out after 0.5 s waiting for rank(s) [3] of ranks [0, 1, 2, 3]" in str(exc), exc
        assert seconds < 5, (rank, seconds)


@pytest.fixture
def file_store(tmp_path, monkeypatch):
    """A FileStore under a prefix (as the default group's store is), whose
    own ``wait`` -- a sleep of 10 ms between looks -- must not be used."""

    def slow_wait(*args):
        raise AssertionError("FileStore.wait sleeps 10 ms per look: meet polls the store itself")

    # the store meet is given: the prefix store's wait is the file store's
    monkeypatch.setattr(dist.PrefixStore, "wait", slow_wait)
    return dist.PrefixStore("default_pg", dist.FileStore(str(tmp_path / "store"), 4))


def test_a_meeting_on_a_file_store_looks_itself(file_store):
    ranks = list(range(4))
    results, _, _ = _meet_all(ranks, ranks, bound=20.0, store=file_store, counting=False, late=(3,))
    assert all(r == "ok" for r, _ in results.values()), results


def test_a_rank_that_never_arrives_on_a_file_store_is_named_within_the_bound(file_store):
    ranks = list(range(2))
    results, _, _ = _meet_all(ranks, [1], bound=0.3, store=file_store, counting=False)
    exc, seconds = results[1]
    assert isinstance(exc, errors.StateDictRuntimeError), exc
    assert "timed out after 0.3 s waiting for rank(s) [0] of ranks [0, 1]" in str(exc), exc
    assert seconds < 5, seconds
