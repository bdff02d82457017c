"""Testing checkpointing code under ``torchrun`` with pytest.

Enable the plugin in your ``conftest.py``::

    pytest_plugins = ["dcp_optim.testing"]

and run the suite on every rank::

    torchrun --standalone --nproc-per-node=2 -m pytest -p no:cacheprovider tests/

Launched by torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` in the environment), the plugin

* initialises the default process group from torchrun's environment
  (``env://``; gloo on CPU, ``cpu:gloo,cuda:nccl`` when CUDA is available,
  each rank on the GPU of its ``LOCAL_RANK``) before collection, and
  destroys it at the end of the session;
* checks that every rank collected the same tests in the same order;
* consolidates every test phase (setup, call, teardown) across ranks: a
  failure on any rank fails the test on every rank, and the report names
  the failing rank(s) with each one's traceback.  A rank that raised still
  takes part in the agreement, which goes through the rendezvous store,
  not through collectives, so a rank that left a collective early cannot
  be mismatched with its peers' pending collectives;
* stops the session after a failure that may have left the ranks' collectives
  out of step (some ranks failed and others did not, or a timeout), because
  every later collective would pair with the wrong peer; pass
  ``--dist-keep-going`` to continue anyway.

Without torchrun the plugin is inert, and the fixtures fall back to a
world of one process, so the same tests also run under plain ``pytest``.

Fixtures: ``dist_group`` (the process group: torchrun's, or a one-process
gloo group), ``dist_tmp_path`` (a directory shared by every rank of the test).

Helpers (call them on every rank, in the same order; they exchange data
through the store, so a rank that fails in them is reported by name):

* :func:`gather_objects` -- every rank's picklable object, in rank order;
* :func:`assert_all_ranks` / :func:`on_all_ranks` -- a local check that
  must hold on every rank; every rank raises if one rank's check fails;
* :func:`assert_state_dicts_equal` -- two (model or optimizer) state dicts
  hold the same values as full tensors whatever their sharding (DTensor,
  ShardedTensor or plain tensors); the error names the first differing
  key and the ranks that see the difference;
* :func:`save_resume_round_trip` -- DCP save, a fresh model and optimizer,
  a template load through dcp_optim, and a comparison (optionally after
  one more training step on both).

Timeouts: ``--dist-pg-timeout`` (seconds, default 60) bounds every
collective of the process group the plugin creates; ``--dist-timeout``
(default: pytest-timeout's ``--timeout`` plus the group timeout plus 60 s,
or 1800 s without pytest-timeout) bounds how long a rank waits for its
peers at an agreement point.  With pytest-timeout's (default) signal
method a rank hanging in Python fails with ``Timeout``; if a peer does not
reach the verdict exchange within 3 s (it is blocked, most likely in a
collective the timed-out rank left), the timed-out rank aborts the
process group, so that the peer fails at once instead of at the group's
timeout, and the report names the rank that timed out first.  The session
then stops (the group is gone).  A rank blocked inside a collective with
no peer in Python fails when the group timeout expires.  Put an outer
``timeout`` around torchrun in CI as a last guard.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import re
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

try:
    import pytest
except ImportError as exc:  # pytest is the `test` extra, not a dependency
    raise ImportError(
        "dcp_optim.testing is a pytest plugin and needs pytest (>= 8): "
        "pip install pytest, or dcp-optim[test]"
    ) from exc

__all__ = [
    "RankFailure",
    "assert_all_ranks",
    "assert_state_dicts_equal",
    "gather_objects",
    "init_from_env",
    "launched_by_torchrun",
    "on_all_ranks",
    "save_resume_round_trip",
    "shared_tmp_dir",
    "SharedTempPathFactory",
]

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_DEFAULT_PG_TIMEOUT_S = 60.0
# How long a rank whose test timed out waits for its peers' verdicts
# before it aborts the process group (a peer still blocked in a
# collective would otherwise wait for the group's timeout).
_TIMEOUT_GRACE_S = 3.0


class RankFailure(AssertionError):
    """A check failed on some rank(s); raised on every rank alike.

    ``ranks`` lists the failing ranks.  ``in_step`` tells whether the
    process group's collectives are still paired: True when every rank
    reached the agreement point through the same code (the assertion
    helpers), False when they are known not to be (a rank never arrived,
    ranks at different agreement points), None when unknown.
    """

    def __init__(self, message: str, ranks: list[int], in_step: bool | None = True):
        super().__init__(message)
        self.ranks = list(ranks)
        self.in_step = in_step


# ---------------------------------------------------------------------------
# environment and process group


# how long a torchrun session's group waits for every rank to connect
_SETUP_TIMEOUT_S = 300.0


def launched_by_torchrun() -> bool:
    """True when the ``env://`` variables torchrun sets are all present."""
    return all(k in os.environ for k in _ENV)


def init_from_env(timeout: float = _DEFAULT_PG_TIMEOUT_S) -> bool:
    """Initialise the default process group from torchrun's environment.

    gloo on CPU; with CUDA, ``cpu:gloo,cuda:nccl`` and the current device set
    to ``LOCAL_RANK``.  Returns False (and does nothing) if a default group
    already exists, True if this call created it.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "cpu:gloo,cuda:nccl"
    # The group's setup (gloo connects every pair through the store) waits
    # with the timeout it is created with: on a loaded machine one rank can
    # start seconds after its peers (importing torch), which a short test
    # timeout must not turn into a failed start.  Created with a setup bound
    # of at least _SETUP_TIMEOUT_S, then given ``timeout`` for collectives.
    setup = max(timeout, _SETUP_TIMEOUT_S)
    dist.init_process_group(
        backend, init_method="env://", timeout=datetime.timedelta(seconds=setup)
    )
    if setup != timeout:
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout))
    return True


# ---------------------------------------------------------------------------
# exchange through the store (no collectives)

# "world": (rank, world size) of a torchrun session, kept for the verdict
# exchanges after the group was aborted (a timeout)
_state: dict[str, Any] = {"counter": 0, "store": None, "store_of": None, "timeout": 1800.0, "world": None}


def _store():
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        if _state["store"] is not None and _state["world"] is not None:
            return _state["store"]  # the group was aborted after a timeout: its store lives on
        raise RuntimeError("dcp_optim.testing: no default process group is initialised")
    base = c10d._get_default_store()
    if _state["store_of"] is not base:
        # A new default group (a later session, a spawned test world):
        # fresh key space.
        prefix = "dcp_optim.testing/{}/{}/".format(
            os.environ.get("TORCHELASTIC_RUN_ID", "-"),
            os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
        )
        _state["store"] = dist.PrefixStore(prefix, base)
        _state["store_of"] = base
        _state["counter"] = 0
    return _state["store"]


@contextlib.contextmanager
def _alarm_paused() -> Iterator[None]:
    """Pause an armed SIGALRM timer (pytest-timeout's signal method) while a
    rank waits for its peers: the waiting rank is not the one that hangs,
    and a timeout raised inside the exchange would desynchronise it.  The
    timer is re-armed with what was left of it, if anything."""
    if not hasattr(signal, "setitimer"):
        yield
        return
    remaining, interval = signal.setitimer(signal.ITIMER_REAL, 0)
    start = time.monotonic()
    try:
        yield
    finally:
        if remaining > 0:
            left = remaining - (time.monotonic() - start)
            if left > 0:
                signal.setitimer(signal.ITIMER_REAL, left, interval)


def gather_objects(obj: Any, *, what: str = "gather_objects", timeout: float | None = None) -> list:
    """Every rank's picklable ``obj``, in rank order (an all-gather through
    the rendezvous store, so it never pairs with a pending collective).

    All ranks must call it the same number of times in the same order;
    ``what`` labels the call site and a mismatch between ranks raises.
    Without a process group: ``[obj]``.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        rank, ws = dist.get_rank(), dist.get_world_size()
    elif _state["world"] is not None and _state["store"] is not None:
        rank, ws = _state["world"]  # the session's group was aborted
    else:
        return [obj]  # a single process without a group
    store = _store()
    _state["counter"] += 1
    base = f"{_state['counter']}/"
    store.set(base + str(rank), pickle.dumps((what, obj)))
    keys = [base + str(r) for r in range(ws)]
    limit = _state["timeout"] if timeout is None else timeout
    deadline = time.monotonic() + limit
    delay = 0.002
    with _alarm_paused():
        while not store.check(keys):
            if time.monotonic() > deadline:
                missing = [r for r, k in enumerate(keys) if not store.check([k])]
                raise RankFailure(
                    f"{what}: rank(s) {missing} did not arrive within {limit:.0f}s "
                    f"(rank {rank} waited)",
                    missing,
                    in_step=False,
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
    values = [pickle.loads(store.get(k)) for k in keys]
    labels = [v[0] for v in values]
    if len(set(labels)) > 1:
        raise RankFailure(
            "ranks are at different agreement points: "
            + ", ".join(f"rank {r}: {label}" for r, label in enumerate(labels)),
            [r for r, label in enumerate(labels) if label != what],
            in_step=False,
        )
    return [v[1] for v in values]


def shared_tmp_dir(make: Callable[[], Any]) -> Path:
    """``make()`` on rank 0 (a directory path), the same path on every rank."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return Path(make())
    path = None
    error = None
    if dist.get_rank() == 0:
        try:
            path = str(make())
        except Exception:  # noqa: BLE001 - reported on every rank below
            error = traceback.format_exc()
    path, error = gather_objects((path, error), what="shared_tmp_dir")[0]
    if error is not None:
        raise RankFailure(f"rank 0 could not create the shared directory:\n{error}", [0])
    return Path(path)


# ---------------------------------------------------------------------------
# cross-rank assertions


def _indent(text: str) -> str:
    return "".join("    " + line + "\n" for line in text.rstrip("\n").splitlines())


def assert_all_ranks(condition: bool, message: str = "") -> None:
    """Raise :class:`RankFailure` on every rank if ``condition`` is false on
    any; the message names each failing rank with its ``message``."""
    import torch.distributed as dist

    results = gather_objects((bool(condition), str(message)), what="assert_all_ranks")
    failing = [r for r, (ok, _) in enumerate(results) if not ok]
    if failing:
        ws = dist.get_world_size() if dist.is_initialized() else 1
        lines = [f"check failed on rank(s) {failing} of {ws}:"]
        lines += [f"  rank {r}: {results[r][1] or 'failed'}" for r in failing]
        raise RankFailure("\n".join(lines), failing)


@contextlib.contextmanager
def on_all_ranks(what: str = "check") -> Iterator[None]:
    """Run a block of local checks on every rank; if the block raises on any
    rank, every rank raises :class:`RankFailure` naming the failing ranks
    with their tracebacks."""
    import torch.distributed as dist

    error = None
    try:
        yield
    except Exception:  # noqa: BLE001 - reported on every rank below
        error = traceback.format_exc()
    results = gather_objects(error, what=f"on_all_ranks({what})")
    failing = [r for r, e in enumerate(results) if e is not None]
    if failing:
        ws = dist.get_world_size() if dist.is_initialized() else 1
        text = f"{what} failed on rank(s) {failing} of {ws}:\n"
        text += "".join(f"--- rank {r} ---\n{_indent(results[r])}" for r in failing)
        raise RankFailure(text, failing)


def _leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, leaf) in the tree's own order; dict keys and list
    indices form the path."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, f"{prefix}{key}.")
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from _leaves(value, f"{prefix}{i}.")
    else:
        yield prefix[:-1], tree


def _full(value: Any) -> Any:
    """A DTensor or ShardedTensor as its full tensor (collective on its
    group); other values unchanged."""
    import torch
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, ShardedTensor):
        from torch.distributed._state_dict_utils import _gather_state_dict

        return _gather_state_dict({"v": value})["v"]
    if isinstance(value, torch.Tensor):
        return value.detach()
    return value


def _kind(value: Any) -> str:
    import torch
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return "DTensor"
    if isinstance(value, ShardedTensor):
        return "ShardedTensor"
    if isinstance(value, torch.Tensor):
        return "Tensor"
    return "value"


def _difference(a: Any, b: Any, rtol: float, atol: float) -> tuple[str, tuple | None] | None:
    """None if equal, else (why, the first differing index or None)."""
    import torch

    if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
        return f"{type(a).__name__} != {type(b).__name__}", None
    if not isinstance(a, torch.Tensor):
        try:
            same = bool(a == b)
        except Exception:  # noqa: BLE001 - incomparable values differ
            same = False
        return None if same else (f"{a!r} != {b!r}", None)
    if a.dtype != b.dtype:
        return f"dtype {a.dtype} != {b.dtype}", None
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} != {tuple(b.shape)}", None
    a, b = a.cpu(), b.cpu()
    if rtol == 0 and atol == 0:
        same = torch.equal(a, b)
    else:
        same = torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
    if same:
        return None
    if a.dim() == 0:
        return f"{a.item()!r} != {b.item()!r}", None
    if a.is_floating_point() or a.is_complex():
        diff = (a.to(torch.complex128 if a.is_complex() else torch.float64) - b).abs()
        diff = diff.nan_to_num(float("inf")).flatten()
        flat = int(diff.argmax())
        index = divmod_index(flat, a.shape)
        why = (
            f"max abs difference {float(diff[flat]):.6g} at index {index} "
            f"({a.flatten()[flat].item()!r} != {b.flatten()[flat].item()!r})"
        )
        return why, index
    flat = int((a != b).flatten().nonzero()[0])
    index = divmod_index(flat, a.shape)
    return f"values differ at index {index}", index


def _holds(value: Any, index: tuple | None) -> bool | None:
    """Whether this rank's shard of DTensor ``value`` holds global
    ``index`` (None when not a DTensor or unknown)."""
    from torch.distributed.tensor import DTensor

    if index is None or not isinstance(value, DTensor):
        return None
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(
            value.shape, value.device_mesh, value.placements
        )
    except Exception:  # noqa: BLE001 - private helper: best effort
        return None
    return all(o <= i < o + n for i, o, n in zip(index, offset, shape))


def divmod_index(flat: int, shape) -> tuple[int, ...]:
    """The multi-dimensional index of position ``flat`` in ``shape``."""
    index = []
    for size in reversed(tuple(shape)):
        flat, i = divmod(flat, size) if size else (flat, 0)
        index.append(i)
    return tuple(reversed(index))


def assert_state_dicts_equal(
    actual: Any,
    expected: Any,
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
    what: str = "state dict",
) -> None:
    """Assert that two state dicts (model, optimizer, or any nesting of
    dicts and lists, e.g. ``(model_sd, optim_sd)``) hold equal values as
    full tensors, whatever their sharding: DTensors and ShardedTensors are
    gathered, plain tensors compared as they are, so a sharded dict can be
    compared with a full one.  Exact by default (``rtol``/``atol`` for
    ``torch.allclose``).

    Call on every rank.  Keys are checked first (without collectives); on
    a difference every rank raises :class:`RankFailure` naming the first
    differing key in ``actual``'s order and the ranks that see it.
    """

    a_leaves = list(_leaves(actual))
    b_leaves = list(_leaves(expected))
    a_keys = [k for k, _ in a_leaves]
    b_keys = [k for k, _ in b_leaves]
    structure = None
    if a_keys != b_keys:
        missing = [k for k in a_keys if k not in set(b_keys)]
        extra = [k for k in b_keys if k not in set(a_keys)]
        if missing:
            structure = f"key {missing[0]!r} is in actual but not in expected"
        elif extra:
            structure = f"key {extra[0]!r} is in expected but not in actual"
        else:
            first = next(i for i, (x, y) in enumerate(zip(a_keys, b_keys)) if x != y)
            structure = f"keys in another order: {a_keys[first]!r} where expected has {b_keys[first]!r}"
    # Every rank must walk the same keys with the same kinds of values, or
    # the gathers below would pair with the wrong peer.
    layout = (a_keys, [_kind(v) for _, v in a_leaves], [_kind(v) for _, v in b_leaves])
    views = gather_objects((structure, layout), what=f"assert_state_dicts_equal({what})")
    problems = {r: s for r, (s, _) in enumerate(views) if s is not None}
    if not problems:
        differing = [r for r, (_, lay) in enumerate(views) if lay != views[0][1]]
        if differing:
            raise RankFailure(
                f"{what}: rank(s) {differing} hold other keys or value kinds than rank 0",
                differing,
            )
    if problems:
        first = min(problems)
        raise RankFailure(
            f"{what}s differ: {problems[first]} (rank(s) {sorted(problems)})", sorted(problems)
        )
    mismatch = None
    for pos, ((key, a), (_, b)) in enumerate(zip(a_leaves, b_leaves)):
        fa, fb = _full(a), _full(b)  # collectives: on every rank, for every key
        if mismatch is None:
            found = _difference(fa, fb, rtol, atol)
            if found is not None:
                why, index = found
                holders = (_holds(a, index), _holds(b, index))
                mismatch = (pos, key, why, holders)
    reports = gather_objects(mismatch, what=f"assert_state_dicts_equal({what}) values")
    bad = {r: m for r, m in enumerate(reports) if m is not None}
    if bad:
        pos, key, why, _ = min(bad.values(), key=lambda m: m[0])
        ranks = sorted(r for r, m in bad.items() if m[1] == key)
        message = f"{what}s differ at {key!r}: {why}; seen on rank(s) {ranks}"
        for side, label in ((0, "actual"), (1, "expected")):
            holding = sorted(r for r in ranks if bad[r][3][side])
            if holding:
                message += f"; the {label} shard holding it is on rank(s) {holding}"
        raise RankFailure(message, ranks)


# ---------------------------------------------------------------------------
# save / resume round trip


def save_resume_round_trip(
    model,
    optimizers,
    build: Callable[[], tuple[Any, Any]],
    checkpoint_dir: str | os.PathLike,
    *,
    options=None,
    then: Callable[[Any, Any], Any] | None = None,
):
    """Save ``model`` and ``optimizers`` with DCP through dcp_optim, build a
    fresh pair with ``build()`` (same parallel layout or another one), load
    the checkpoint into it the template way (the fresh pair's own state
    dicts, a never-stepped optimizer included, as ``dcp.load``'s template),
    and assert on every rank that the resumed state equals the saved one
    as full tensors.  With ``then`` (e.g. one training step), run it on
    both pairs and compare again: training continues identically.

    ``checkpoint_dir`` must be the same path on every rank (the
    ``dist_tmp_path`` fixture).  Returns the fresh ``(model, optimizers)``.
    """
    import torch.distributed.checkpoint as dcp

    import dcp_optim

    model_sd, optim_sd = dcp_optim.get_state_dict(model, optimizers, options=options)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(checkpoint_dir))
    new_model, new_optimizers = build()
    t_model, t_optim = dcp_optim.get_state_dict(new_model, new_optimizers, options=options)
    template: dict[str, Any] = {"model": t_model, "optim": t_optim}
    dcp.load(template, checkpoint_id=str(checkpoint_dir))
    dcp_optim.set_state_dict(
        new_model,
        new_optimizers,
        model_state_dict=template["model"],
        optim_state_dict=template["optim"],
        options=options,
    )
    resumed = dcp_optim.get_state_dict(new_model, new_optimizers, options=options)
    assert_state_dicts_equal(resumed, (model_sd, optim_sd), what="resumed state")
    if then is not None:
        then(model, optimizers)
        then(new_model, new_optimizers)
        assert_state_dicts_equal(
            dcp_optim.get_state_dict(new_model, new_optimizers, options=options),
            dcp_optim.get_state_dict(model, optimizers, options=options),
            what="state after `then`",
        )
    return new_model, new_optimizers


# ---------------------------------------------------------------------------
# pytest plugin


def pytest_addoption(parser):
    group = parser.getgroup("dcp_optim.testing", "dcp_optim: tests under torchrun")
    group.addoption(
        "--dist-pg-timeout",
        type=float,
        default=_DEFAULT_PG_TIMEOUT_S,
        help="timeout (s) of the process group created from torchrun's environment",
    )
    group.addoption(
        "--dist-timeout",
        type=float,
        default=None,
        help="how long (s) a rank waits for its peers at an agreement point",
    )
    group.addoption(
        "--dist-keep-going",
        action="store_true",
        help="continue after a failure that may have left collectives out of step",
    )


def pytest_configure(config):
    if not launched_by_torchrun() or config.pluginmanager.has_plugin("dcp_optim.torchrun"):
        return
    config.pluginmanager.register(_TorchrunSession(config), "dcp_optim.torchrun")


def _is_timeout(text: str) -> bool:
    lowered = text.lower()
    return (
        "timeout >" in lowered or "timeout (>" in lowered  # pytest-timeout's message
        or "timed out" in lowered or "did not arrive within" in lowered
    )


class _Crash:
    def __init__(self, message: str, path: str, lineno: int):
        self.message, self.path, self.lineno = message, path, lineno


class _RankReport:
    """A consolidated failure text with the ``reprcrash`` pytest's summary
    line reads."""

    def __init__(self, text: str, crash: _Crash):
        self.text = text
        self.reprcrash = crash

    def toterminal(self, tw) -> None:
        for line in self.text.splitlines():
            tw.line(line)

    def __str__(self) -> str:
        return self.text


class _TorchrunSession:
    """Registered when pytest runs under torchrun: the process group for the
    session and one verdict per test phase across ranks."""

    def __init__(self, config):
        self.config = config
        self.created = False
        self.keep_going = config.getoption("dist_keep_going")
        self.pg_timeout = config.getoption("dist_pg_timeout")
        wait = config.getoption("dist_timeout")
        if wait is None:
            test_timeout = 0.0
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                test_timeout = float(config.getoption("timeout") or config.getini("timeout") or 0)
            wait = test_timeout + self.pg_timeout + 60.0 if test_timeout > 0 else 1800.0
        self.wait = wait

    # session ---------------------------------------------------------------

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session):
        import torch.distributed as dist

        self.created = init_from_env(self.pg_timeout)
        _state["timeout"] = self.wait
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        _state["world"] = (self.rank, self.world_size)
        _store()

    def pytest_report_header(self, config):
        return (
            f"dcp_optim.testing: rank {self.rank} of {self.world_size} (torchrun), "
            f"group timeout {self.pg_timeout:.0f}s, agreement timeout {self.wait:.0f}s"
        )

    def pytest_collection_finish(self, session):
        ids = [item.nodeid for item in session.items]
        views = gather_objects(ids, what="collection")
        differing = [r for r, v in enumerate(views) if v != views[0]]
        if differing:
            r = differing[0]
            only = sorted(set(views[r]) ^ set(views[0]))[:5]
            raise pytest.UsageError(
                f"dcp_optim.testing: rank {r} collected other tests than rank 0 "
                f"({len(views[r])} vs {len(views[0])}; e.g. {only}); "
                "every rank must run the same tests in the same order"
            )

    def pytest_unconfigure(self, config):
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        # Every rank has printed its report before any exits: torchrun
        # terminates the other ranks as soon as one exits with an error.
        # Flushed first: torchrun's redirected stdout is a file, so the
        # report (the terminal summary) sits in this process's buffer until
        # exit, and a rank terminated after its peer exited would lose it.
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        with contextlib.suppress(Exception):
            gather_objects(None, what="end of session", timeout=60)
        if self.created:
            with contextlib.suppress(Exception):  # aborted after a timeout
                dist.destroy_process_group()

    # verdicts ----------------------------------------------------------------

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        local = self._describe(report, call)
        if report.failed and _is_timeout(local["text"]) and not isinstance(
            getattr(call.excinfo, "value", None), RankFailure
        ):
            self._timed_out(item, call.when)
        try:
            views = gather_objects(local, what=f"{item.nodeid} ({call.when})")
        except RankFailure as exc:
            views = None
            error = str(exc)
        if views is None:
            self._fail(report, f"{call.when}: {error}", error)
            item.session.shouldstop = f"dcp_optim.testing: ranks out of step: {error}"
            return
        self._consolidate(item, report, call.when, views)

    def _timed_out(self, item, when: str) -> None:
        """This rank's test timed out (pytest-timeout): record it as the
        first timeout of this phase if no peer did before, and give the
        peers a moment to reach the verdict exchange.  A peer that does
        not is blocked, most likely in a collective this rank left: the
        process group is aborted, so that it fails at once (the
        connection closes) instead of at the group's timeout."""
        import torch.distributed as dist

        store = _store()
        store.compare_set(f"first-timeout/{item.nodeid}/{when}", "", str(self.rank))
        base = f"{_state['counter'] + 1}/"
        peers = [base + str(r) for r in range(self.world_size) if r != self.rank]
        deadline = time.monotonic() + _TIMEOUT_GRACE_S
        with _alarm_paused():
            while peers and not store.check(peers) and time.monotonic() < deadline:
                time.sleep(0.05)
        if peers and not store.check(peers):
            store.set("aborted", f"{item.nodeid} ({when}): rank {self.rank} timed out")
            with contextlib.suppress(Exception):
                dist.distributed_c10d._abort_process_group()

    @staticmethod
    def _aborted() -> bool:
        with contextlib.suppress(Exception):
            return bool(_store().check(["aborted"]))
        return False

    def _first_timeout(self, nodeid: str, when: str) -> int | None:
        key = f"first-timeout/{nodeid}/{when}"
        with contextlib.suppress(Exception):
            store = _store()
            if store.check([key]):
                return int(store.get(key))
        return None

    @staticmethod
    def _describe(report, call) -> dict:
        status = report.outcome
        if hasattr(report, "wasxfail"):
            status += "/xfail"
        in_step = None
        if call.excinfo is not None and isinstance(call.excinfo.value, RankFailure):
            in_step = call.excinfo.value.in_step
        crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
        return {
            "status": status,
            "text": report.longreprtext if report.failed else "",
            "message": getattr(crash, "message", "") if report.failed else "",
            "where": (getattr(crash, "path", ""), getattr(crash, "lineno", 0)) if crash else None,
            "in_step": in_step,
        }

    def _consolidate(self, item, report, when, views) -> None:
        statuses = [v["status"] for v in views]
        failed = [r for r, s in enumerate(statuses) if s == "failed"]
        if not failed and len(set(statuses)) == 1:
            return  # every rank agrees
        if not failed:
            text = f"ranks disagree on {item.nodeid} ({when}): " + ", ".join(
                f"rank {r} {s}" for r, s in enumerate(statuses)
            )
            self._fail(report, text, text)
            self._maybe_stop(item, text)
            return
        n = len(views)
        lines = [f"{when} failed on rank(s) {failed} of {n}"]
        others = [f"rank {r} {s}" for r, s in enumerate(statuses) if s != "failed"]
        if others:
            lines[0] += " (" + ", ".join(others) + ")"
        first = self._first_timeout(item.nodeid, when)
        if first is not None:
            lines[0] += f"; rank {first} timed out first"
        seen: dict[str, int] = {}
        for r in failed:
            # The same exception message: show the traceback once.
            key = views[r]["message"] or views[r]["text"]
            if key in seen:
                lines.append(f"--- rank {r}: the same failure as rank {seen[key]} ---")
                continue
            seen[key] = r
            lines.append(f"--- rank {r} ---")
            lines.append(views[r]["text"].rstrip("\n"))
        firsts = {r: (views[r]["message"] or "failed").splitlines()[0] for r in failed}
        if first is not None and first in firsts and len(failed) > 1:
            # the rank that timed out first: the others failed because of it
            message = f"rank {first} timed out first: {firsts[first]} (failed on rank(s) {failed})"
        elif len(set(firsts.values())) == 1:
            message = f"rank(s) {failed}: {firsts[failed[0]]}"
        else:
            message = "; ".join(f"rank {r}: {firsts[r]}" for r in failed[:3])
        self._fail(report, "\n".join(lines), message)
        # Still paired: every rank failed at an agreement helper, or at the
        # same place, and nobody timed out (a rank left behind in a
        # collective fails with the group's timeout).
        flags = [views[r]["in_step"] for r in failed]
        timed_out = any(_is_timeout(views[r]["text"]) for r in failed)
        in_step = len(failed) == n and False not in flags
        if in_step and not all(flags):
            in_step = len({views[r]["where"] for r in failed}) == 1 and not timed_out
        if first is not None and self._aborted():
            # no process group any more: every rank stops, --dist-keep-going or not
            item.session.shouldstop = (
                f"dcp_optim.testing: {item.nodeid}: rank {first} timed out first; the process "
                "group was aborted so that its peers failed at once, stopping"
            )
            return
        if not in_step:
            why = f"{item.nodeid} failed on rank(s) {failed} of {n}"
            self._maybe_stop(item, why + (" after a timeout" if timed_out else ""))

    def _fail(self, report, text: str, message: str) -> None:
        path, lineno = report.location[0], (report.location[1] or 0) + 1
        report.outcome = "failed"
        if hasattr(report, "wasxfail"):
            del report.wasxfail
        report.longrepr = _RankReport(text, _Crash(message, path, lineno))

    def _maybe_stop(self, item, why: str) -> None:
        if not self.keep_going:
            item.session.shouldstop = (
                f"dcp_optim.testing: {why}; the ranks' collectives may be out of step, "
                "stopping (--dist-keep-going to continue)"
            )


# ---------------------------------------------------------------------------
# fixtures


@pytest.fixture
def dist_group():
    """The default process group: torchrun's (for the whole session) or,
    without torchrun, a one-process gloo group created for this test."""
    import torch.distributed as dist

    if launched_by_torchrun() or dist.is_initialized():
        if not dist.is_initialized():
            init_from_env()
        yield dist.group.WORLD
        return
    with tempfile.TemporaryDirectory(prefix="dcp_optim_pg_") as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


class SharedTempPathFactory:
    """pytest's ``tmp_path_factory`` whose directories rank 0 creates and
    every rank receives (so a checkpoint written by all ranks lands in one
    place).  Call on every rank in the same order."""

    def __init__(self, factory):
        self._factory = factory

    def mktemp(self, basename: str, numbered: bool = True) -> Path:
        return shared_tmp_dir(lambda: self._factory.mktemp(basename, numbered=numbered))

    def getbasetemp(self) -> Path:
        return shared_tmp_dir(self._factory.getbasetemp)


@pytest.fixture(scope="session")
def dist_tmp_path_factory(request) -> SharedTempPathFactory:
    """Session-scoped factory of directories shared by every rank."""
    return SharedTempPathFactory(request.config._tmp_path_factory)


@pytest.fixture
def dist_tmp_path(request, dist_group, dist_tmp_path_factory) -> Path:
    """A fresh directory, the same path on every rank (created by rank 0)."""
    name = re.sub(r"[\W]", "_", request.node.name)[:30]
    return dist_tmp_path_factory.mktemp(name, numbered=True)
