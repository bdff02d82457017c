"""Cross-rank agreement before collectives start (issue: ranks that
disagree on keys, shapes or options hang, or unpickle garbage).

Every path that moves data between ranks first exchanges one small digest
among the ranks involved (the ranks of the device mesh the tensors live
on).  If the digests differ, a second exchange -- only on this error path
-- carries the details, so that every rank raises the same error naming
the first differing key and the ranks involved, before any data moves.

The digest travels in a fixed-size record of int64 words, and the ranks
learn, per word, its minimum and maximum over the ranks in one
all-reduce (MIN of the words and of their negations; no pickling, no
per-rank data): the bytes and the work per rank do not depend on the
number of ranks.  Where a word's minimum and maximum differ, the ranks
disagree, and only then (the error path) does an exchange of every rank's
details follow.  A per-rank flag byte rides along, which callers use to
learn which ranks want the data (the rank-0-only gathers of
``cpu_offload``): the first rank's flags (the minimum of words tagged
with the rank's mesh index) and those of the other ranks, where those
agree (the usual case: one source or keeper, the others alike); where
they do not, one all-gather of every rank's flag bytes follows.

Every such record has the same size (``RECORD_WORDS``), a getter's gather
check as well as a load's agreement (``Agreement``: options, the full
dicts' structure, the rank's verdict on its own checks) and the sharded
getter's rank-local check, each tagged with its kind, so that ranks that
reached different ones still complete the exchange and raise the same
error instead of aborting in the backend; the error paths exchange
tagged payloads through ``all_gather_object`` (sizes first, then the
payload: the same two collectives on every rank).
"""

from __future__ import annotations

import hashlib
import os
import time
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .. import errors

__all__ = [
    "all_gather_flat",
    "mesh_all_gather_object",
    "mesh_all_gather_bytes",
    "mesh_all_gather_rows",
    "check_agreement",
    "flags_union",
    "flagged",
    "await_arrival",
    "arrival_bound",
    "relay_failure",
    "reduce_min",
]

# --- bounded arrival ----------------------------------------------------------------
#
# A collective waits for every rank of its group until the process group's
# timeout (30 minutes for gloo, 10 for NCCL by default), and a rank that
# never comes -- it crashed before the call, is stuck elsewhere, or took
# another path because its options differ -- leaves the others in that
# wait.  So before its first data collective, every call that
# communicates first meets the other ranks of its mesh on the process
# group's store, with a wait of its own, bounded by ARRIVAL_ENV (seconds;
# 0 turns it off; default: half the process group's timeout, at most 300
# s).  Every rank that gives up marks the meeting abandoned, atomically
# (compare_set), with the ranks that had not arrived: a rank arriving
# after that raises too, so every rank that arrives raises the same
# error, naming the missing ranks.  A meeting is 5 small store requests
# per rank on the success path (set, add, wait, get, delete).

ARRIVAL_ENV = "DCP_OPTIM_ARRIVAL_TIMEOUT"
_ARRIVAL_MAX_DEFAULT = 300.0
_ARRIVE = "dcp_optim/arrive"
_ABANDONED = b"abandoned "
# per group of ranks (a digest of their list), the number of meetings so far
_meetings: dict[str, int] = {}


def arrival_bound() -> float | None:
    """Seconds a call waits for the other ranks to arrive (None: no bound
    of ours, only the process group's timeout)."""
    raw = os.environ.get(ARRIVAL_ENV, "").strip()
    if raw:
        try:
            value = float(raw)
        except ValueError:
            raise errors.StateDictValueError(
                f"{ARRIVAL_ENV}={raw!r} is not a number of seconds (0 turns the bounded "
                "arrival off)"
            ) from None
        return value if value > 0 else None
    timeout = _group_timeout()
    if timeout is None:
        return _ARRIVAL_MAX_DEFAULT
    return min(_ARRIVAL_MAX_DEFAULT, timeout / 2)


def _group_timeout() -> float | None:
    """The default process group's timeout in seconds, or None."""
    try:
        group = dist.distributed_c10d._get_default_group()
        for device in group._device_types:
            timeout = group._get_backend(device).options._timeout
            return float(timeout.total_seconds())
    except Exception:  # noqa: BLE001 - another backend: the fixed default
        return None
    return None


def _mesh_ranks(mesh: Any | None) -> tuple[int, ...]:
    if mesh is None:
        return tuple(range(dist.get_world_size()))
    return tuple(int(r) for r in mesh.mesh.flatten().tolist())


def first_rank(mesh: Any | None) -> int:
    """The global rank at index 0 of ``mesh`` (None: the default group):
    the rank whose flags an agreement reports first (``RankFlags.first``)."""
    return 0 if mesh is None else mesh_ranks(mesh)[0]


def mesh_ranks(mesh: Any | None) -> tuple[int, ...]:
    """The global ranks of ``mesh`` in row-major order (None: the default
    group), computed once per mesh (torch builds ``DeviceMesh.mesh`` anew
    on every access: a tenth of a small full get's time)."""
    return _meeting_group(mesh)[0]


# per mesh (None: the default group, by its size), its ranks and the
# digest naming its meetings: computed once per mesh, not per call
_groups: dict[Any, tuple[tuple[int, ...], str]] = {}


def _meeting_group(mesh: Any | None) -> tuple[tuple[int, ...], str]:
    key = ("world", dist.get_world_size()) if mesh is None else mesh
    found = _groups.get(key)
    if found is None:
        ranks = _mesh_ranks(mesh)
        found = (ranks, _group_digest(ranks))
        _groups[key] = found
    return found


def _group_digest(ranks: tuple[int, ...]) -> str:
    """The name of the meetings of ``ranks`` on the store."""
    return hashlib.sha1(repr(tuple(ranks)).encode()).hexdigest()[:16]


def await_arrival(mesh: Any | None, what: str) -> None:
    """Meet every rank of ``mesh`` (None: the default group) on the
    process group's store, waiting at most ``arrival_bound()`` seconds;
    raise StateDictRuntimeError naming the ranks that did not arrive."""
    bound = arrival_bound()
    if bound is None or _mesh_size(mesh) < 2 or dist.get_backend() == "fake":
        # torch's fake process group (one process simulating a rank of a
        # large world, benchmarks/scale.py) has a store that implements
        # nothing, and no other rank to wait for
        return
    store = dist.distributed_c10d._get_default_store()
    ranks, group = _meeting_group(mesh)
    seq = _meetings.get(group, 0) + 1
    _meetings[group] = seq
    meet(store, f"{_ARRIVE}/{group}", seq, ranks, dist.get_rank(), what, bound)


def meet(store: Any, prefix: str, seq: int, ranks: tuple[int, ...], rank: int, what: str, bound: float) -> None:
    """Meeting ``seq`` of ``ranks`` on ``store`` under ``prefix``, as
    ``rank`` (see ``await_arrival``).  A constant number of store
    operations per rank (set, add, then the last to arrive marks the
    meeting complete and the others wait for that mark); only on a
    timeout does a rank look up who is missing, one key per rank."""
    base = f"{prefix}/{seq}"
    mine = f"{base}/r{rank}"
    store.set(mine, what)
    if store.add(f"{base}/n", 1) == len(ranks):
        state = bytes(store.compare_set(f"{base}/all", "", "1"))
        if state == b"1":
            # every rank is past the previous meeting: its keys can go
            _delete(store, f"{prefix}/{seq - 1}/all", f"{prefix}/{seq - 1}/n")
    else:
        try:
            _wait_for(store, f"{base}/all", bound)
            # set: by the last rank to arrive ("1"), or by one that timed out
            state = bytes(store.get(f"{base}/all"))
        except RuntimeError:  # the store's timeout (DistStoreError)
            # only now the ranks that are not here (one lookup each)
            missing = [r for r in ranks if not store.check([f"{base}/r{r}"])]
            desired = _ABANDONED.decode() + repr(missing)
            state = bytes(store.compare_set(f"{base}/all", "", desired))
    if state.startswith(_ABANDONED):
        missing_text = state[len(_ABANDONED):].decode()
        raise errors.StateDictRuntimeError(
            f"{what}: timed out after {bound:g} s waiting for rank(s) {missing_text} of "
            f"ranks {list(ranks)} to arrive (every rank must make the same dcp_optim "
            "calls with the same options; a rank that crashed, is stuck elsewhere or "
            "skipped this call because its options differ never arrives). The bound is "
            f"{ARRIVAL_ENV} (seconds; default half the process group's timeout, at most "
            f"{_ARRIVAL_MAX_DEFAULT:g} s; 0 turns it off)."
        )
    _delete(store, mine)


# --- collectives inside dcp_optim's own optimizer steps ----------------------------
#
# (see lockstep.py)  The k-th collective of the steps dcp_optim takes
# between two arrival meetings of a group meets that group's ranks under
# (the group, its next arrival, k): a step that failed or ran on one rank
# only never shifts the numbering of a later call's, as every rank makes
# every arrival.  Each rank sets its key, then waits for its peers' keys;
# a peer found waiting at its next arrival instead takes no step here: the
# meeting fails at once.  A failure stays until the group's next arrival
# (the step's retries and the other route fail at once, not after another
# wait).  A rank deletes its key of collective k - 1 once k is met (every
# peer has read it), and its last key of an earlier arrival at its first
# collective after that arrival (every peer has left those steps since).

_STEP = "dcp_optim/step"
# per group of ranks: (its next arrival, collectives met before it, the
# failure of the last one or None)
_step_meetings: dict[str, tuple[int, int, str | None]] = {}


def meet_in_step(ranks: tuple[int, ...], signature: str, what: str, bound: float) -> None:
    """Meet the other ``ranks`` at this rank's next collective
    (``signature``: the operator) of an optimizer step dcp_optim takes;
    raise ``StepCollectiveError`` where a peer takes no such step or is at
    another operator (see above)."""
    rank = dist.get_rank()
    group = _group_digest(ranks)
    arrival = _meetings.get(group, 0) + 1
    at, k, failed = _step_meetings.get(group, (arrival, 0, None))
    store = dist.distributed_c10d._get_default_store()
    if at != arrival:
        if k:
            _delete(store, f"{_STEP}/{group}/{at}/{k}/r{rank}")
        k, failed = 0, None
    if failed is not None:
        raise errors.StepCollectiveError(failed)
    k += 1
    _step_meetings[group] = (arrival, k, None)
    base = f"{_STEP}/{group}/{arrival}"
    store.set(f"{base}/{k}/r{rank}", signature)
    peers = [r for r in ranks if r != rank]
    keys = [f"{base}/{k}/r{r}" for r in peers]
    deadline = time.monotonic() + bound
    pause = _POLL_FIRST_S
    failure = None
    while not store.check(keys):
        absent = [r for r, key in zip(peers, keys) if not store.check([key])]
        elsewhere = [r for r in absent if _waiting_at_arrival(store, r, group)]
        left = deadline - time.monotonic()
        if elsewhere or left <= 0:
            failure = (
                f"rank(s) {elsewhere} of ranks {list(ranks)} are waiting at dcp_optim's next meeting"
                if elsewhere else
                f"rank(s) {absent} of ranks {list(ranks)} did not reach it within {bound:g} s "
                f"({ARRIVAL_ENV})"
            )
            break
        time.sleep(min(pause, left))
        pause = min(2 * pause, _POLL_MAX_S)
    if failure is None:
        theirs = [bytes(v).decode() for v in store.multi_get(keys)]
        other = [(r, v) for r, v in zip(peers, theirs) if v != signature]
        if other:
            failure = f"rank {other[0][0]} of ranks {list(ranks)} is at {other[0][1]} instead"
    if failure is not None:
        message = (
            f"{what} (a step dcp_optim takes to build the state template of parameters without "
            f"state) makes a collective, {signature}, on rank {rank}, and {failure}: the ranks' "
            "parameters without state differ, and a step on some ranks only cannot communicate. "
            "Nothing was changed; the collective did not run. Step the optimizer on every rank "
            "before taking its state dict, or declare its state with "
            "dcp_optim.register_optimizer_schema (no step is taken then)."
        )
        _step_meetings[group] = (arrival, k, message)
        raise errors.StepCollectiveError(message)
    if k > 1:
        _delete(store, f"{base}/{k - 1}/r{rank}")


def _waiting_at_arrival(store: Any, rank: int, group: str) -> bool:
    """Whether ``rank`` waits at its next arrival meeting of ``group`` or
    of any other group of ranks holding it that this rank knows."""
    digests = {group} | {digest for ranks, digest in _groups.values() if rank in ranks}
    return any(store.check([f"{_ARRIVE}/{d}/{_meetings.get(d, 0) + 1}/r{rank}"]) for d in digests)


# --- failures inside torch's own collectives --------------------------------------
#
# A commit that runs torch's own code with collectives in it (FSDP1's load
# hooks gather its flat parameters) cannot meet the other ranks at an
# agreement when it fails on some ranks only: the peers are inside the
# gather, released by the failing rank's closed connection or the
# process group's timeout, each with an error of the backend.  So every
# rank that fails there publishes its error on the store under the call's
# key, atomically (compare_set: the first failure stays), and raises the
# published one: every rank raises the first failure's exception, naming
# its rank.  The key is the call's arrival meeting (the same number on
# every rank of the mesh); without one (the bound turned off), a count of
# such failures per mesh.

_FAILED = "dcp_optim/failed"
_failures: dict[str, int] = {}


def relay_failure(mesh: Any | None, what: str, error: BaseException) -> BaseException:
    """The exception every rank of ``mesh`` raises for a failure inside
    collectives of torch's own code (see above): the first failing rank's
    ``error``, with a note naming that rank.  Returns ``error`` itself
    where no store can relay it (one rank, the fake process group, a
    store that cannot compare-and-set)."""
    import base64
    import pickle

    if _mesh_size(mesh) < 2 or dist.get_backend() == "fake":
        return error
    ranks, group = _meeting_group(mesh)
    count = _failures.get(group, 0) + 1
    _failures[group] = count
    meeting = _meetings.get(group, 0)
    key = f"{_FAILED}/{group}/" + (f"m{meeting}" if meeting else f"f{count}")
    rank = dist.get_rank()
    try:
        store = dist.distributed_c10d._get_default_store()
        # as text: the store's compare_set takes strings
        mine = base64.b64encode(pickle.dumps((rank, _export_error(error)))).decode("ascii")
        first_rank, exported = pickle.loads(base64.b64decode(bytes(store.compare_set(key, "", mine))))
    except Exception:  # noqa: BLE001 - no store to relay through: this rank's own error
        return error
    note = (
        f" [raised on rank {first_rank} of ranks {list(ranks)} inside torch's own collectives of "
        f"{what} (FSDP's load hooks), the first rank to fail there; every rank put back what it "
        "had installed]"
    )
    return _import_error(exported, note)


# A FileStore's own wait sleeps 10 ms between its looks at the file (it
# cannot be woken), so a rank that arrives a moment before the last one
# would lose up to 10 ms per call: a per-parameter loop of loads (Lightning
# Fabric's) pays that per parameter.  On such a store the wait looks
# itself, at pauses that start at 50 us and double up to 2 ms (a look is a
# few microseconds): a short wait ends within about its own length, a long
# one costs a look every 2 ms.
_POLL_FIRST_S = 5e-5
_POLL_MAX_S = 2e-3


def _base_store(store: Any) -> Any:
    """The store under ``store``'s prefixes (the default group's store is
    a PrefixStore over the one the process group was made with)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def _wait_for(store: Any, key: str, bound: float) -> None:
    """Wait until ``key`` is set on ``store``, at most ``bound`` seconds;
    raise RuntimeError (as the store's own timeout does) after that."""
    if not isinstance(_base_store(store), dist.FileStore):
        store.wait([key], timedelta(seconds=bound))
        return
    deadline = time.monotonic() + bound
    pause = _POLL_FIRST_S
    while not store.check([key]):
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"timed out after {bound:g} s waiting for store key {key!r}")
        time.sleep(min(pause, left))
        pause = min(2 * pause, _POLL_MAX_S)


def _delete(store: Any, *keys: str) -> None:
    for key in keys:
        try:
            store.delete_key(key)
        except Exception:  # noqa: BLE001 - a store without deletion keeps them
            pass


def mesh_all_gather_object(mesh: Any | None, obj: Any) -> tuple[list[Any], list[int]]:
    """Every mesh rank's ``obj`` (row-major mesh order) and their global
    ranks.  ``mesh=None`` means the default group."""
    if mesh is None or mesh.size() == dist.get_world_size():
        world = dist.get_world_size()
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, obj)
        if mesh is None:
            return gathered, list(range(world))
        order = mesh.mesh.flatten().tolist()
        return [gathered[r] for r in order], order
    payload = obj
    for d in reversed(range(mesh.ndim)):
        if mesh.size(d) == 1:
            payload = [payload]
            continue
        row: list[Any] = [None] * mesh.size(d)
        dist.all_gather_object(row, payload, group=mesh.get_group(d))
        payload = row
    flat: list[Any] = []

    def walk(node, depth):
        if depth == mesh.ndim:
            flat.append(node)
            return
        for child in node:
            walk(child, depth + 1)

    walk(payload, 0)
    return flat, mesh.mesh.flatten().tolist()


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group: Any, async_op: bool = False) -> Any:
    """``all_gather_into_tensor``.  torch 2.13 renamed it (the old name now
    warns) to ``all_gather_single``; older releases only have the former.
    Looked up per call so that tools wrapping torch.distributed see it.
    Its work where ``async_op``."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def mesh_all_gather_bytes(mesh: Any | None, data: bytes) -> tuple[list[bytes], list[int]]:
    """Every mesh rank's ``data`` (the same length on every rank) in
    row-major mesh order, and their global ranks: one all-gather of a small
    byte tensor -- on the default group when the mesh spans the world (or
    ``mesh`` is None), else one per mesh dimension of size > 1."""
    rows, ranks = mesh_all_gather_rows(mesh, data)
    return [bytes(r) for r in rows.numpy()], list(ranks)


def mesh_all_gather_rows(mesh: Any | None, data: bytes) -> tuple[torch.Tensor, Any]:
    """``mesh_all_gather_bytes`` without a Python object per rank: every
    mesh rank's ``data`` as the rows of one ``[ranks, len(data)]`` uint8
    CPU tensor, and their global ranks (a ``range`` when they are
    0 .. n-1 in order, the usual case; else a list)."""
    n = len(data)
    mine = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if mesh is None or mesh.size() == dist.get_world_size():
        world = dist.get_world_size()
        device = torch.device(dist.distributed_c10d._get_object_coll_device())
        out = torch.empty(world * n, dtype=torch.uint8, device=device)
        all_gather_flat(out, mine.to(device), None)
        rows = out.cpu().view(world, n)
        if mesh is None:
            return rows, range(world)
        return _in_mesh_order(rows, mesh.mesh.flatten())
    device = torch.device(mesh.device_type)
    payload = mine.to(device)
    # last mesh dimension first: row-major mesh order (as the gathers do)
    for d in reversed(range(mesh.ndim)):
        if mesh.size(d) == 1:
            continue
        out = torch.empty(mesh.size(d) * payload.numel(), dtype=torch.uint8, device=device)
        all_gather_flat(out, payload, mesh.get_group(d))
        payload = out
    return payload.cpu().view(mesh.size(), n), _ranks(mesh.mesh.flatten())


def _ranks(order: torch.Tensor) -> Any:
    if torch.equal(order, torch.arange(order.numel(), dtype=order.dtype)):
        return range(order.numel())
    return order.tolist()


def _in_mesh_order(rows: torch.Tensor, order: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """The default group's rows (by global rank) in mesh order."""
    ranks = _ranks(order)
    if isinstance(ranks, range):
        return rows, ranks
    return rows[order.long()], ranks


def _all_equal(rows: torch.Tensor) -> bool:
    return bool((rows == rows[:1]).all())


# Every fixed-size exchange of dcp_optim (a getter's gather check, a
# load's agreement, the sharded getter's rank-local check) is one
# all-reduce of a record of this many int64 words, so that ranks that
# reached different ones -- ranks that disagree on which call or which
# options -- still complete the exchange, see records that differ, and
# raise instead of aborting in the backend ("Received data size doesn't
# match").  RECORD_BYTES is the size of the error paths' fixed rows.
RECORD_BYTES = 64
RECORD_WORDS = 16

_DIGEST_BYTES = 20  # sha1
_WORD_BYTES = 5  # a digest travels as 40-bit words: -w never overflows
_DIGEST_WORDS = _DIGEST_BYTES // _WORD_BYTES
_BIG = 1 << 62  # what a rank contributes to a word it has no value for

# record kinds (word 0): records of different kinds differ
_KIND_GATHER, _KIND_LOAD, _KIND_RANKLOCAL = 1, 2, 3


def _digest(value: Any) -> bytes:
    return hashlib.sha1(repr(value).encode()).digest()


def _digest_words(digest: bytes) -> list[int]:
    return [
        int.from_bytes(digest[i : i + _WORD_BYTES], "little")
        for i in range(0, _DIGEST_BYTES, _WORD_BYTES)
    ]


def _mesh_index(mesh: Any | None) -> int:
    """This rank's row-major position in ``mesh`` (None: the default
    group), from its coordinate: no list of the mesh's ranks."""
    if mesh is None:
        return dist.get_rank()
    coord = mesh.get_coordinate()
    index = 0
    for c, n in zip(coord, mesh.shape):
        index = index * n + c
    return index


def _mesh_size(mesh: Any | None) -> int:
    return dist.get_world_size() if mesh is None else int(mesh.size())


def mesh_all_reduce_min(mesh: Any | None, words: list[int]) -> list[int]:
    """The elementwise minimum over the ranks of ``mesh`` (None: the
    default group) of ``words`` (int64, the same length on every rank):
    one all-reduce on the default group when the mesh spans the world,
    else one per mesh dimension of size > 1.  The bytes and work per rank
    do not depend on the number of ranks."""
    mine = torch.tensor(words, dtype=torch.int64)
    if mesh is None or mesh.size() == dist.get_world_size():
        device = torch.device(dist.distributed_c10d._get_object_coll_device())
        return reduce_min(mine.to(device), None, dist.get_world_size()).cpu().tolist()
    payload = mine.to(torch.device(mesh.device_type))
    for d in range(mesh.ndim):
        if mesh.size(d) > 1:
            payload = reduce_min(payload, mesh.get_group(d), mesh.size(d))
    return payload.cpu().tolist()


# Up to this many ranks the minimum is taken by each rank over every
# rank's words, all-gathered (at most 8 copies of a few dozen words: still
# a constant), rather than by an all-reduce: gloo's all-reduce of more
# than one element takes several dependent steps between the ranks, each a
# wake-up of the other side, and on a busy host one in ten of them waited
# a scheduler tick (about 4 ms at 2 ranks, where the gather of the same
# words took 0.1-0.2 ms).
GATHERED_MIN_RANKS = 8


def reduce_min(payload: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """The elementwise minimum of ``payload`` over the ``size`` ranks of
    ``group`` (None: the default group)."""
    return _reduced(payload, group, size, dist.ReduceOp.MIN)


def reduce_sum(payload: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """The elementwise sum of an integer ``payload`` over the ``size``
    ranks of ``group`` (None: the default group)."""
    return _reduced(payload, group, size, dist.ReduceOp.SUM)


def _reduced(payload: torch.Tensor, group: Any, size: int, op: Any) -> torch.Tensor:
    """``payload`` reduced with ``op`` (MIN or SUM) over the group: up to
    ``GATHERED_MIN_RANKS`` ranks, every rank's gathered and reduced on
    each rank; above, one all-reduce (in place)."""
    if size <= GATHERED_MIN_RANKS:
        gathered = torch.empty(size * payload.numel(), dtype=payload.dtype, device=payload.device)
        all_gather_flat(gathered, payload, group)
        rows = gathered.view(size, -1)
        return rows.amin(dim=0) if op == dist.ReduceOp.MIN else rows.sum(dim=0)
    dist.all_reduce(payload, op=op, group=group)
    return payload


class _Record:
    """One rank's fixed-size agreement record: per word, the minimum and
    the maximum over the ranks travel in one all-reduce (MIN of the words
    and of their negations).  A word a rank has no value for is neutral
    (its minimum +BIG, its maximum -BIG)."""

    def __init__(self, kind: int) -> None:
        self.lo = [_BIG] * RECORD_WORDS
        self.hi = [-_BIG] * RECORD_WORDS
        self.at = 0
        self.put([kind])

    def put(self, values: list[int]) -> int:
        """Words compared between ranks (min and max); their offset."""
        at = self.at
        for i, v in enumerate(values):
            self.lo[at + i] = self.hi[at + i] = v
        self.at += len(values)
        return at

    def put_min(self, values: list[int]) -> int:
        """Words of which only the minimum is learnt."""
        at = self.at
        for i, v in enumerate(values):
            self.lo[at + i] = v
        self.at += len(values)
        return at

    def skip(self, n: int) -> int:
        """Neutral words (a rank without a value for them)."""
        at = self.at
        self.at += n
        return at

    def reduce(self, mesh: Any | None) -> tuple[list[int], list[int]]:
        out = mesh_all_reduce_min(mesh, self.lo + [-h for h in self.hi])
        return out[:RECORD_WORDS], [-h for h in out[RECORD_WORDS:]]


def _same(lo: list[int], hi: list[int], at: int, n: int) -> bool:
    return lo[at : at + n] == hi[at : at + n]


class RankFlags(list):
    """The per-rank flags an agreement returns (row-major mesh order),
    learnt from reduced words where every rank but the mesh's first holds
    the same value (``first``, ``rest``: what the list holds, so that a
    caller needs no pass over the ranks); from a gather otherwise
    (``rest`` None)."""

    first: Any = None
    rest: Any = None

    @classmethod
    def of(cls, first: Any, rest: Any, n: int) -> RankFlags:
        out = cls([first])
        if n > 1:
            out.extend([rest] * (n - 1))  # one pointer fill, no object per rank
        out.first, out.rest = first, rest if n > 1 else first
        return out

    def union(self, i: int | None = None) -> int:
        """The bitwise OR over the ranks of flag ``i`` (None: of the
        flags themselves, ints)."""
        if self.rest is not None:
            pick = (lambda f: f) if i is None else (lambda f: f[i])
            return int(pick(self.first) | pick(self.rest))
        total = 0
        for f in self:
            total |= f if i is None else f[i]
        return total

    def flagged(self) -> tuple[int, int | None]:
        """(how many ranks have a non-zero flag, the first of them) for
        int flags."""
        if self.rest is not None:
            n = len(self)
            count = (1 if self.first else 0) + ((n - 1) if self.rest else 0)
            first = 0 if self.first else (1 if self.rest and n > 1 else None)
            return count, first
        marked = [i for i, f in enumerate(self) if f]
        return len(marked), (marked[0] if marked else None)


def flags_union(per_rank: list[Any], i: int | None = None) -> int:
    """``RankFlags.union`` of an agreement's flags (a plain list too)."""
    if not isinstance(per_rank, RankFlags):
        per_rank = RankFlags(per_rank)
    return per_rank.union(i)


def flagged(per_rank: list[int]) -> tuple[int, int | None]:
    """``RankFlags.flagged`` of a gather check's flags (a plain list too)."""
    if not isinstance(per_rank, RankFlags):
        per_rank = RankFlags(per_rank)
    return per_rank.flagged()


_FLAG_WORDS = 2  # up to 8 flags of one byte, 4 to a word
_FLAG_SHIFT = 32  # the first rank's words carry the mesh index above the flags


def _pack_flags(flags: list[int]) -> list[int]:
    padded = bytes(flags).ljust(4 * _FLAG_WORDS, b"\0")
    return [int.from_bytes(padded[4 * i : 4 * i + 4], "little") for i in range(_FLAG_WORDS)]


def _unpack_flags(words: list[int], k: int) -> tuple[int, ...]:
    packed = b"".join((w & 0xFFFFFFFF).to_bytes(4, "little") for w in words)
    return tuple(packed[:k])


def _put_flags(record: _Record, index: int, flags: list[int]) -> tuple[int, int, int]:
    """Flags (0-255 each, at most 8) on ``record``, packed: every rank's
    (min and max), the first rank's (the minimum of index-tagged words) and
    those of every rank but the first (min and max).  Returns the three
    offsets."""
    packed = _pack_flags(flags)
    every = record.put(packed)
    first = record.put_min([(index << _FLAG_SHIFT) | w for w in packed])
    rest = record.skip(_FLAG_WORDS) if index == 0 else record.put(packed)
    return every, first, rest


def _flags_learnt(
    lo: list[int], hi: list[int], at: tuple[int, int, int], k: int, n: int
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(first rank's flags, every other rank's) where the reduced words
    determine them, else None (some ranks past the first differ)."""
    every, first, rest = at
    if _same(lo, hi, every, _FLAG_WORDS):
        value = _unpack_flags(lo[every : every + _FLAG_WORDS], k)
        return value, value
    if not _same(lo, hi, rest, _FLAG_WORDS):
        return None
    return (
        _unpack_flags(lo[first : first + _FLAG_WORDS], k),
        _unpack_flags(lo[rest : rest + _FLAG_WORDS], k),
    )


def check_agreement(
    mesh: Any | None, what: str, summary: Any, details_fn, flag: int = 0,
    error: BaseException | None = None,
) -> list[int]:
    """Raise the same StateDictRuntimeError on every rank of ``mesh`` when
    their ``summary`` values differ.  ``details_fn()`` returns a list of
    (name, description) pairs that locate the difference; it runs only on
    that error path.  ``flag`` (0-255) is not compared: the flags of every
    mesh rank, in row-major mesh order, are returned (a ``RankFlags``).
    ``error``: this rank cannot go on (it could not allocate what the
    collectives after the check need, say): every rank raises the first
    failing rank's exception, naming that rank, instead of going on into
    collectives that rank would not take part in.

    The common case is one all-reduce of a fixed-size record (per word
    the minimum and maximum over the ranks): equal digests, and flags that
    every rank but the first shares.  Only where the digests differ, or a
    rank failed, does an exchange of every rank's details follow (the
    error), and only where the flags of the ranks past the first differ
    one of every rank's flag bytes."""
    await_arrival(mesh, what)
    n = _mesh_size(mesh)
    record = _Record(_KIND_GATHER)
    dig = record.put(_digest_words(_digest(summary)))
    failed = int(error is not None)
    at = _put_flags(record, _mesh_index(mesh), [flag, failed])
    lo, hi = record.reduce(mesh)
    same = _same(lo, hi, 0, dig + _DIGEST_WORDS)
    if same:
        learnt = _flags_learnt(lo, hi, at, 2, n)
        if learnt is None:
            rows, _ = mesh_all_gather_rows(mesh, bytes((flag, failed)))
            per_rank = RankFlags(rows[:, 0].tolist())
            anyone_failed = bool(rows[:, 1].any())
        else:
            per_rank = RankFlags.of(learnt[0][0], learnt[1][0], n)
            anyone_failed = bool(learnt[0][1] or learnt[1][1])
        if not anyone_failed:
            return per_rank
    # Error path: every rank is here (the records say so on every rank).
    ranks = list(_mesh_ranks(mesh))
    exported = None if error is None else _export_error(error)
    details, _ = mesh_all_gather_object(mesh, ("gather", what, None if same else details_fn(), exported))
    _check_same_call(details, ranks)
    if not same:
        # (a rank that also failed keeps its own error as the cause)
        raise errors.StateDictRuntimeError(_describe_difference(what, [d[2] for d in details], ranks)) from error
    _raise_first_failure(error, [(r, d[3]) for r, d in zip(ranks, details) if d[3] is not None], ranks,
                         "nothing was gathered on any rank")


def _check_same_call(gathered: list[Any], ranks: list[int]) -> None:
    """The error paths of a getter's gather check and of a load's
    agreement exchange tagged payloads: ranks that reached different ones
    (different calls, or options that send one rank down another path)
    raise this, the same on every rank."""
    calls: dict[str, list[int]] = {}
    for rank, g in zip(ranks, gathered):
        calls.setdefault(f"{g[0]} ({g[1]})", []).append(rank)
    if len(calls) > 1:
        per_rank = "; ".join(f"rank(s) {rs}: {c}" for c, rs in calls.items())
        raise errors.StateDictRuntimeError(
            "ranks are in different dcp_optim calls (or took different paths "
            f"through one): {per_rank}. Every rank must make the same calls with "
            "the same options."
        )


def _describe_difference(what: str, details: list[Any], ranks: list[int]) -> str:
    """Name the first entry -- in the order the ranks list them -- whose
    description differs between ranks or that some ranks lack (entries are
    matched by name, not by position: an extra entry on one rank, such as
    an optimizer state only ``amsgrad`` creates, is the difference, not
    everything after it)."""
    maps = [dict(d) for d in details]
    seen: set[Any] = set()
    longest = max((len(d) for d in details), default=0)
    for i in range(longest):
        for d in details:
            if i >= len(d) or d[i][0] in seen:
                continue
            name = d[i][0]
            seen.add(name)
            entries = [m.get(name) for m in maps]
            if all(e == entries[0] for e in entries):
                continue
            groups: dict[str, list[int]] = {}
            for rank, entry in zip(ranks, entries):
                text = "nothing (no such entry)" if entry is None else f"{entry}"
                groups.setdefault(text, []).append(rank)
            per_rank = "; ".join(f"rank(s) {rs}: {text}" for text, rs in groups.items())
            return (
                f"ranks disagree on the {what} before a collective; first "
                f"difference at '{name}': {per_rank}. Every rank must pass the "
                "same options and state dict structure for this call."
            )
    return (
        f"ranks disagree on the {what} before a collective (ranks {ranks}); "
        "every rank must pass the same options and state dict structure."
    )


# --- agreement on the outcome of a load -------------------------------------------
#
# A load is a sequence of steps, each either local (checks, planning) or
# collective (metadata exchange, data stream).  Before every collective
# step, and before anything is installed, the ranks of the load's mesh
# reduce one fixed-size record -- the digests of the call's options and
# of the dicts' structure, a failed word, up to 8 flag bytes -- whatever
# their options or outcome, so that the exchange itself always matches.
# If every digest agrees and no rank failed, the load goes on; otherwise
# (error path only) every rank contributes its option details and its
# exception to one object all-gather, and every rank raises the same
# exception (the lowest failing rank's).

_FLAG_BYTES = 8
_AGREEMENT_TAG = b"load"


class Agreement:
    """The agreement points of one distributed load (``mesh`` None: the
    default group).  ``options`` is a list of (name, value) pairs that must
    be equal on every rank (the call's options: they decide which
    collectives follow); ``structure`` another such list (the structure of
    the dicts every rank holds: keys, shapes, dtypes, hyperparameters),
    compared after the options and the flags.  ``identity``: the FQNs (and
    state keys) of what the ranks load, in the order their collectives
    take them, as (position, name) pairs -- compared with the structure
    (one digest for both), and named first when it differs.  The first
    agreement is preceded by a bounded meeting of the ranks
    (``await_arrival``)."""

    def __init__(
        self,
        mesh: Any | None,
        what: str,
        options: list[tuple[str, Any]],
        structure: list[tuple[str, Any]] | None = None,
        identity: list[tuple[str, Any]] | None = None,
    ):
        self.mesh = mesh
        self.what = what
        self.options = options
        self.structure = structure or []
        self.identity = identity or []
        self.digest = _digest(options) + _digest((self.structure, self.identity))
        self.arrived = False

    def agree(
        self,
        error: BaseException | None = None,
        flags: tuple[int, ...] = (),
        flags_check: Any = None,
    ) -> list[tuple[int, ...]]:
        """One agreement point.  ``error``: this rank's failure since the
        last point (None: it passed).  ``flags``: up to 8 small ints every
        rank learns (returned per rank, in row-major mesh order);
        ``flags_check(flags_per_rank, ranks)`` returns an error message
        when the flags disagree in a way that must stop the load.  Raises
        the same exception on every rank when the options differ, the
        flags check fails, the structures differ, or any rank failed (the
        lowest failing rank's exception, naming that rank)."""
        if len(flags) > _FLAG_BYTES:
            raise ValueError("at most 8 flags")
        if not self.arrived:
            await_arrival(self.mesh, self.what)
            self.arrived = True
        n = _mesh_size(self.mesh)
        record = _Record(_KIND_LOAD)
        options_at = record.put(_digest_words(self.digest[:_DIGEST_BYTES]))
        struct_at = record.put(_digest_words(self.digest[_DIGEST_BYTES:]))
        failed_at = record.put([int(error is not None)])
        flags_at = _put_flags(record, _mesh_index(self.mesh), list(flags))
        lo, hi = record.reduce(self.mesh)
        # the kind word joins the options: ranks in another call differ there
        same_options = _same(lo, hi, 0, options_at + _DIGEST_WORDS)
        same_structure = _same(lo, hi, struct_at, _DIGEST_WORDS)
        failed = bool(hi[failed_at])
        problem = None
        uniform = _same(lo, hi, flags_at[0], _FLAG_WORDS)
        per_rank: RankFlags | None = None
        if same_options:
            learnt = _flags_learnt(lo, hi, flags_at, len(flags), n)
            if learnt is not None:
                per_rank = RankFlags.of(learnt[0], learnt[1], n)
            else:  # ranks past the first differ: every rank's flag bytes
                rows, _ = mesh_all_gather_rows(self.mesh, bytes(flags).ljust(_FLAG_BYTES, b"\0"))
                per_rank = RankFlags(tuple(r[: len(flags)]) for r in rows.tolist())
            if flags_check is not None and not uniform:
                problem = flags_check(per_rank, _mesh_ranks(self.mesh))
        if same_options and same_structure and not failed and problem is None:
            assert per_rank is not None
            return per_rank
        # Error path: every rank is here (the records say so on every rank).
        mine = (
            "load",
            self.what,
            None if same_options else self.options,
            None if same_structure or not same_options or problem else (self.structure, self.identity),
            None if error is None else _export_error(error),
        )
        gathered, ranks = mesh_all_gather_object(self.mesh, mine)
        _check_same_call(gathered, ranks)
        gathered = [g[2:] for g in gathered]
        if not same_options:
            raise errors.StateDictRuntimeError(
                _describe_difference(f"options of {self.what}", [g[0] for g in gathered], ranks)
            )
        if problem is not None:
            raise errors.StateDictValueError(problem)
        if not same_structure:
            identities = [g[1][1] for g in gathered]
            if any(i != identities[0] for i in identities):
                raise errors.StateDictRuntimeError(
                    _describe_difference(
                        f"parameters of the model in {self.what} (their FQNs in registration "
                        "order: the order of the collectives)",
                        identities,
                        ranks,
                    )
                )
            raise errors.StateDictRuntimeError(
                _describe_difference(
                    f"state dicts passed to {self.what}", [g[1][0] for g in gathered], ranks
                )
            )
        failures = [(r, g[2]) for r, g in zip(ranks, gathered) if g[2] is not None]
        _raise_first_failure(error, failures, ranks, "nothing was loaded on any rank")


def option_pairs(options: Any, names: tuple[str, ...]) -> list[tuple[str, Any]]:
    """(name, repr(value)) of the option fields ``names`` of ``options``
    (a StateDictOptions or None), read without validating anything."""
    return [(name, repr(getattr(options, name, None))) for name in names]


def _export_error(error: BaseException) -> tuple[bytes | None, str]:
    import pickle

    text = f"{type(error).__name__}: {error}"
    try:
        blob = pickle.dumps(error)
        pickle.loads(blob)
    except Exception:  # noqa: BLE001 - not picklable: its text travels
        blob = None
    return blob, text


def _raise_first_failure(
    error: BaseException | None, failures: list[tuple[int, Any]], ranks: list[int], outcome: str
) -> NoReturn:
    """Raise, on every rank of an agreement's error path, the exception of
    the first of ``failures`` ((rank, ``_export_error``'s) of the ranks
    that failed) with a note naming its rank and ``outcome``; chained to
    this rank's own ``error`` where it failed too, or that very error
    where every rank failed alike."""
    texts = {text for _, (_, text) in failures}
    if error is not None and len(failures) == len(ranks) and len(texts) == 1:
        raise error  # every rank failed alike: its own exception
    rank, exported = failures[0]
    failing = [r for r, _ in failures]
    note = (
        f" [raised on rank {rank}"
        + ("" if len(failures) == len(ranks) else f"; rank(s) {failing} failed, the other ranks passed this check")
        + f"; {outcome}]"
    )
    agreed = _import_error(exported, note)
    if error is not None:
        raise agreed from error
    raise agreed


def _import_error(exported: tuple[bytes | None, str], note: str) -> BaseException:
    """The exception ``_export_error`` exported, rebuilt (or, where it
    does not unpickle, a StateDictRuntimeError with its text), with
    ``note`` appended to its message."""
    import pickle

    blob, text = exported
    exc = None
    if blob is not None:
        try:
            exc = pickle.loads(blob)
        except Exception:  # noqa: BLE001
            exc = None
    if not isinstance(exc, BaseException):
        return errors.StateDictRuntimeError(text + note)
    if exc.args and isinstance(exc.args[0], str):
        exc.args = (exc.args[0] + note, *exc.args[1:])
    else:
        exc.args = (*exc.args, note.strip())
    return exc


_GROUP_MESHES: dict[tuple[int, str], DeviceMesh] = {}


def mesh_for_group(group: Any, device_type: str) -> DeviceMesh:
    """A 1-D DeviceMesh over a process group (FSDP1's, a
    ZeroRedundancyOptimizer's), built once (no communication)."""
    key = (id(group), device_type)
    mesh = _GROUP_MESHES.get(key)
    if mesh is None or mesh.get_group() is not group:
        mesh = DeviceMesh.from_group(group, device_type)
        _GROUP_MESHES[key] = mesh
    return mesh
