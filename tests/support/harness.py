"""Multi-process launcher for gloo tests (docs/testing.md, "The multi-process harness").

``run_ranks(ws, fn, *args)`` starts ``ws`` worker processes from a preloaded
forkserver; each one joins a fresh gloo process group (``FileStore`` rendezvous,
no ports), runs ``fn(rank, ws, *args)`` and sends back plain Python data. The
parent collects results under a deadline, kills stragglers and raises a single
``AssertionError`` that carries every failing rank's traceback, every crash
(exit code / signal, faulthandler dump) and every timed-out rank.

Under ``torchrun`` (``make test-torchrun``) every rank runs the same pytest
items and ``run_ranks`` runs ``fn`` in-process on torchrun's group instead
(see ``run_ranks``); ``dcp_optim.testing`` consolidates the verdicts.

``run_in_subprocess(fn, *args)`` runs ``fn(*args)`` alone in a fresh forkserver
child without a process group (isolated checks such as peak-RSS measurement).

Rank functions are passed by reference: only ``fn.__module__`` and
``fn.__qualname__`` travel to the child, which imports and resolves them, so
``fn`` must be a module-level function of an importable module (for example
``tests.distributed.dist_cases``); lambdas, closures and functions defined in a test
module that the child cannot import are rejected up front.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from multiprocessing import connection as mp_connection
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Environment every worker must see. Set in os.environ before the forkserver
# starts so that the server and every child inherit it; the child entry sets
# it again (cheap, and correct even if the server was started elsewhere).
WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "GLOO_SOCKET_IFNAME": "lo",
}

PRELOAD_MODULES = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    # fully_shard() imports torch._dynamo lazily (~2 s per child on 2 cores).
    "torch._dynamo",
    "dcp_optim",
    "tests.distributed.dist_cases",
    "tests.distributed.dist_cases_canary",
]

PG_TIMEOUT_S = 60.0
# After one rank has failed, the others are most likely blocked in a
# collective that will never complete; wait this long, then kill them.
FAIL_GRACE_S = 10.0

_ctx_lock = threading.Lock()
_ctx = None
_ctx_pid = None
_preloaded: list[str] = []
_preload_skipped: dict[str, str] = {}
_launch_times: list[tuple[int, float]] = []


# ---------------------------------------------------------------------------
# forkserver context


def _prepare_environment() -> None:
    for key, value in WORKER_ENV.items():
        os.environ[key] = value
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if REPO_ROOT not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([REPO_ROOT, *paths])
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)


def _importable(name: str) -> str | None:
    """Return None if ``name`` imports in this process, else the reason."""
    try:
        importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - any failure means "do not preload"
        return f"{type(exc).__name__}: {exc}"
    return None


def get_context():
    """The process-wide forkserver context (created and configured once).

    The forkserver itself starts lazily on the first ``Process.start()`` and
    captures ``sys.path`` and the environment at that moment.
    """
    global _ctx, _ctx_pid
    with _ctx_lock:
        if _ctx is not None and _ctx_pid == os.getpid():
            return _ctx
        import multiprocessing

        _prepare_environment()
        ctx = multiprocessing.get_context("forkserver")
        _preloaded.clear()
        _preload_skipped.clear()
        for name in PRELOAD_MODULES:
            # A module that fails to import would at best be skipped by the
            # forkserver (ImportError) and at worst kill it (any other
            # exception), so only preload what imports here.
            reason = _importable(name)
            if reason is None:
                _preloaded.append(name)
            else:
                _preload_skipped[name] = reason
        ctx.set_forkserver_preload(list(_preloaded))
        _ctx, _ctx_pid = ctx, os.getpid()
        return ctx


def preload_info() -> dict[str, Any]:
    """Which modules the forkserver preloads, and why others were skipped."""
    return {"preloaded": list(_preloaded), "skipped": dict(_preload_skipped)}


def launch_times() -> list[tuple[int, float]]:
    """(world_size, seconds from first start() to last join) of every launch."""
    return list(_launch_times)


# ---------------------------------------------------------------------------
# function references


def _fn_ref(fn: Callable) -> tuple[str, str]:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or "<" in qualname:
        raise TypeError(
            f"{fn!r} is not a module-level function of an importable module "
            "(lambdas, closures and locals cannot be resolved in a worker)"
        )
    if module == "__main__":
        raise TypeError(f"{fn!r} lives in __main__; move it to an importable module")
    return module, qualname


def _resolve(module: str, qualname: str) -> Callable:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _check_plain(value: Any, path: str = "result") -> None:
    """Children return plain data, never tensors (docs/testing.md, pitfall 8)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        raise TypeError(
            f"{path} is a {type(value).__name__}; return plain Python data "
            "(.tolist(), .item(), file paths), never tensors"
        )
    if isinstance(value, dict):
        for k, v in value.items():
            _check_plain(k, f"{path} key {k!r}")
            _check_plain(v, f"{path}[{k!r}]")
    elif isinstance(value, (list, tuple, set, frozenset)):
        for i, v in enumerate(value):
            _check_plain(v, f"{path}[{i}]")


# ---------------------------------------------------------------------------
# child entry points


def _child_common(fault_log: str | None):
    for key, value in WORKER_ENV.items():
        os.environ[key] = value
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    if fault_log:
        import faulthandler

        # Keep the file object alive for the life of the process.
        _child_common.fault_file = open(fault_log, "w")  # noqa: SIM115
        faulthandler.enable(file=_child_common.fault_file, all_threads=True)
        # The parent sends SIGUSR1 to a straggler before killing it, so a
        # hang is reported with every thread's Python stack.
        faulthandler.register(
            signal.SIGUSR1, file=_child_common.fault_file, all_threads=True, chain=False
        )


def _send(conn, message) -> None:
    try:
        conn.send(message)
    except Exception:  # noqa: BLE001 - e.g. unpicklable result
        rank = message[0]
        conn.send((rank, "err", "could not send the result to the parent:\n" + traceback.format_exc()))


def _rank_entry(rank, world_size, store_path, fn_module, fn_qualname, args, conn, fault_log):
    _child_common(fault_log)
    import torch

    torch.set_num_threads(1)
    import datetime

    import torch.distributed as dist

    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
        )
        fn = _resolve(fn_module, fn_qualname)
        result = fn(rank, world_size, *args)
        _check_plain(result)
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit
        _send(conn, (rank, "err", traceback.format_exc()))
        conn.close()
        # Do not attempt destroy_process_group(): the peers may be stuck in a
        # collective, and the parent kills them anyway.
        sys.exit(1)
    _send(conn, (rank, "ok", result))
    conn.close()
    dist.destroy_process_group()


def _single_entry(fn_module, fn_qualname, args, conn, fault_log):
    _child_common(fault_log)
    import torch

    torch.set_num_threads(1)
    try:
        fn = _resolve(fn_module, fn_qualname)
        result = fn(*args)
        _check_plain(result)
    except BaseException:  # noqa: BLE001
        _send(conn, (0, "err", traceback.format_exc()))
        conn.close()
        sys.exit(1)
    _send(conn, (0, "ok", result))
    conn.close()


# ---------------------------------------------------------------------------
# parent side


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name} ({code})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _read_tail(path: str, limit: int = 6000) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    return text[-limit:]


def _launch(targets, timeout: float, what: str) -> list:
    """Start processes, gather one message per process, enforce deadlines.

    ``targets`` is a list of (entry, args_without_conn_and_log) per rank.
    """
    ctx = get_context()
    n = len(targets)
    tmpdir = tempfile.mkdtemp(prefix="dcp_optim_ranks_")
    procs, readers = [], []
    t0 = time.perf_counter()
    try:
        for rank, (entry, args) in enumerate(targets):
            reader, writer = ctx.Pipe(duplex=False)
            fault_log = os.path.join(tmpdir, f"rank{rank}.fault")
            p = ctx.Process(
                target=entry,
                args=(*args, writer, fault_log),
                name=f"{what}-rank{rank}",
                daemon=True,
            )
            p.start()
            writer.close()  # the child holds the only write end: EOF on death
            procs.append(p)
            readers.append(reader)

        deadline = time.monotonic() + timeout
        messages: dict[int, tuple] = {}
        eof: set[int] = set()
        first_failure_at: float | None = None
        pending = {r: readers[r] for r in range(n)}
        while pending:
            now = time.monotonic()
            limit = deadline
            if first_failure_at is not None:
                limit = min(limit, first_failure_at + FAIL_GRACE_S)
            if now >= limit:
                break
            ready = mp_connection.wait(list(pending.values()), timeout=min(1.0, limit - now))
            for conn in ready:
                rank = readers.index(conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    eof.add(rank)
                    if first_failure_at is None:
                        first_failure_at = time.monotonic()
                else:
                    messages[rank] = msg
                    if msg[1] != "ok" and first_failure_at is None:
                        first_failure_at = time.monotonic()
                pending.pop(rank, None)

        # Join whoever finished; kill stragglers.
        join_deadline = time.monotonic() + (5.0 if not pending else 0.5)
        for p in procs:
            p.join(max(0.0, join_deadline - time.monotonic()))
        killed = [rank for rank, p in enumerate(procs) if p.is_alive()]
        if killed:
            for rank in killed:
                try:
                    os.kill(procs[rank].pid, signal.SIGUSR1)  # dump stacks
                except OSError:
                    pass
            time.sleep(0.5)
            for rank in killed:
                procs[rank].kill()
        for p in procs:
            p.join(5.0)
        _launch_times.append((n, time.perf_counter() - t0))

        failures = []
        timed_out = sorted(r for r in pending)
        for rank, p in enumerate(procs):
            msg = messages.get(rank)
            if msg is not None and msg[1] == "ok":
                if p.exitcode not in (0, None) and rank not in killed:
                    failures.append(
                        f"--- rank {rank}: reported ok, then {_describe_exit(p.exitcode)} "
                        "during teardown ---\n" + _read_tail(os.path.join(tmpdir, f"rank{rank}.fault"))
                    )
                continue
            if msg is not None:
                failures.append(f"--- rank {rank}: raised ---\n{msg[2]}")
            elif rank in eof:
                failures.append(
                    f"--- rank {rank}: died without a result ({_describe_exit(p.exitcode)}) ---\n"
                    + _read_tail(os.path.join(tmpdir, f"rank{rank}.fault"))
                )
            elif rank in pending:
                reason = (
                    f"killed {FAIL_GRACE_S:.0f}s after another rank failed"
                    if first_failure_at is not None
                    else f"no result within {timeout:.0f}s"
                )
                stacks = _read_tail(os.path.join(tmpdir, f"rank{rank}.fault"))
                failures.append(
                    f"--- rank {rank}: timed out ({reason}; {_describe_exit(p.exitcode)}) ---\n"
                    + (f"Python stacks at the deadline:\n{stacks}" if stacks else "")
                )
        if failures:
            header = f"{what}: {len(failures)} of {n} rank(s) failed"
            if timed_out:
                header += f"; timed out / killed: ranks {timed_out}"
            error = AssertionError(header + "\n" + "\n".join(failures))
            # Results of the ranks that did finish, for callers that record
            # partial outcomes (e.g. a crash on one rank only).
            error.rank_results = {
                r: m[2] for r, m in messages.items() if m[1] == "ok"
            }
            error.exitcodes = {r: p.exitcode for r, p in enumerate(procs)}
            raise error
        return [messages[r][2] for r in range(n)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5.0)
        for r in readers:
            r.close()
        for name in os.listdir(tmpdir):
            try:
                os.unlink(os.path.join(tmpdir, name))
            except OSError:
                pass
        try:
            os.rmdir(tmpdir)
        except OSError:
            pass


def under_torchrun() -> bool:
    """True when this pytest process is one rank of a ``torchrun`` launch
    (``dcp_optim.testing`` then owns the session's process group)."""
    from dcp_optim.testing import launched_by_torchrun

    return launched_by_torchrun()


def _process_groups() -> set:
    from torch.distributed import distributed_c10d as c10d

    return set(c10d._world.pg_map)


# Python's default warning filters (no -W option).
_IGNORED_BY_DEFAULT = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)


def _run_ranks_in_process(world_size: int, fn: Callable, args: tuple, what: str) -> list:
    """``run_ranks`` under torchrun: this process is one of the ranks, so
    run ``fn`` here on the session's default group (torchrun's env://
    group), then agree on every rank's outcome through the store."""
    import pickle

    import pytest
    import torch.distributed as dist

    from dcp_optim.testing import RankFailure, gather_objects

    ws = dist.get_world_size()
    if world_size != ws:
        pytest.skip(f"needs {world_size} ranks; torchrun started {ws}")
    rank = dist.get_rank()
    before = _process_groups()
    try:
        # Copies of the arguments, and the warning filters of a fresh
        # interpreter (not pytest's "error"), as the spawned ranks get them.
        with warnings.catch_warnings():
            warnings.resetwarnings()
            for category in _IGNORED_BY_DEFAULT:
                warnings.simplefilter("ignore", category)
            result = fn(rank, ws, *pickle.loads(pickle.dumps(args)))
        _check_plain(result)
        pickle.dumps(result)
        outcome = ("ok", result)
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - every failure is reported, timeouts too
        outcome = ("err", traceback.format_exc())
    try:
        outcomes = gather_objects(outcome, what=what)
    finally:
        # Groups (meshes, sub-groups) the body created, once every rank is
        # done with them; the default group lives for the session.
        # Destroying one is local (no collective).
        default = dist.group.WORLD
        for pg in _process_groups() - before:
            if pg is not default:
                dist.destroy_process_group(pg)
    failed = [r for r, (status, _) in enumerate(outcomes) if status != "ok"]
    if failed:
        text = f"{what}: {len(failed)} of {ws} rank(s) failed\n" + "\n".join(
            f"--- rank {r}: raised ---\n{outcomes[r][1]}" for r in failed
        )
        # Whether a rank that raised left collectives its peers were in is
        # unknown here (a peer left in one fails with the group's timeout).
        raise RankFailure(text, failed, in_step=None)
    return [result for _, result in outcomes]


def run_ranks(world_size: int, fn: Callable, *args, timeout: float = 180) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    Returns the per-rank results ordered by rank. Raises one ``AssertionError``
    with every failing rank's traceback (and which ranks timed out).
    ``args`` are pickled; results must be plain Python data.

    Under ``torchrun`` (``make test-torchrun``) the ranks are torchrun's
    processes, each running the same pytest items: ``fn`` runs in this
    process on the session's process group, the results of every rank are
    exchanged, and a test that needs another world size than torchrun's
    skips.  ``timeout`` is then pytest-timeout's and the group's job.  The
    test body around ``run_ranks`` runs on every rank too, and ``tmp_path``
    is shared: work done there on files (or with DCP, which acts on the
    whole group) must be safe to do on every rank at once.
    """
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    module, qualname = _fn_ref(fn)
    if under_torchrun():
        return _run_ranks_in_process(world_size, fn, args, f"run_ranks({world_size}, {module}.{qualname})")
    store_dir = tempfile.mkdtemp(prefix="dcp_optim_store_")
    store_path = os.path.join(store_dir, "store")
    try:
        targets = [
            (_rank_entry, (rank, world_size, store_path, module, qualname, args))
            for rank in range(world_size)
        ]
        return _launch(targets, timeout, f"run_ranks({world_size}, {module}.{qualname})")
    finally:
        try:
            if os.path.exists(store_path):
                os.unlink(store_path)
            os.rmdir(store_dir)
        except OSError:
            pass


def run_in_subprocess(fn: Callable, *args, timeout: float = 180) -> Any:
    """Run ``fn(*args)`` alone in a fresh forkserver child (no process group).

    Returns ``fn``'s (plain-data) result; raises ``AssertionError`` with the
    child's traceback, crash signal or timeout.
    """
    module, qualname = _fn_ref(fn)
    return _launch(
        [(_single_entry, (module, qualname, args))],
        timeout,
        f"run_in_subprocess({module}.{qualname})",
    )[0]
