"""Shared helpers: environment description and interleaved timing.

Timing rules (every section):

* Implementations that are compared are run *interleaved* in the same
  process on the same objects: round ``r`` runs every candidate once, in an
  order rotated by ``r`` so that no candidate always runs first.
* One untimed-for-the-result warm-up call per candidate comes first.  Its
  duration decides how many repetitions the candidate gets (``budget_s`` of
  total measuring time, clamped to ``[min_reps, max_reps]``).  A candidate
  whose warm-up alone exceeds ``budget_s`` is not repeated: its single
  (cold) call is the measurement, and the result says so (``reps == 1``,
  ``"cold": true``).  This keeps upstream's quadratic loads at 50k tensors
  from dominating the run.
* ``gc.collect()`` runs before every call, outside the timed region (the
  callers ``gc.freeze()`` their long-lived fixtures first, so this is
  cheap and no automatic full collection lands inside a timed call).
  Anything a call needs as input (e.g. a fresh container copy of a state
  dict) is built by ``prepare`` outside the timed region too.
* The reported figure is the median; min and all samples are kept in JSON,
  with the CPU time of the calling thread (``time.thread_time``) of every
  call beside its wall time: on a loaded machine wall time includes the
  time other processes ran, CPU time does not.
* ``call_timeout_s``: a hard limit per call (SIGALRM, main thread only).
  A call that exceeds it is abandoned with a ``TimeoutError`` raised inside
  it; the result says ``timed_out`` and the caller must assume the objects
  it was working on are in an unknown state and rebuild them.
"""

from __future__ import annotations

import datetime
import gc
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

IMPLS = ("upstream", "dcp_optim")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit(root: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=5,
        )
        if out.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=5,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict[str, Any]:
    import dcp_optim

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "dcp_optim": getattr(dcp_optim, "__version__", "?"),
        "dcp_optim_backend": getattr(dcp_optim, "BACKEND", "?"),
        "git_commit": git_commit(root),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def copy_containers(obj: Any) -> Any:
    """A copy of the dict/list/tuple structure of a state dict; tensors and
    other leaves are shared (cheap, and enough to undo in-place edits of
    the containers by a loader)."""
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) is not dict else {}
        if hasattr(obj, "default_factory"):
            out = type(obj)(obj.default_factory)
        for k, v in obj.items():
            out[k] = copy_containers(v)
        return out
    if isinstance(obj, list):
        return [copy_containers(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(copy_containers(v) for v in obj)
    return obj


@dataclass
class Candidate:
    """One thing to time: ``fn(*prepare())``; ``prepare`` is not timed."""

    name: str
    fn: Callable[..., Any]
    prepare: Callable[[], tuple] | None = None


@dataclass
class Timing:
    median: float | None = None
    min: float | None = None
    reps: int = 0
    cold: bool = False
    samples: list[float] = field(default_factory=list)
    error: str | None = None
    skipped: str | None = None
    timed_out: bool = False
    predicted_s: float | None = None
    #: CPU time of the calling thread per call (``time.thread_time``):
    #: what the call itself consumed, whatever else the machine runs.
    cpu_samples: list[float] = field(default_factory=list)
    cpu_median: float | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "median_s": self.median,
            "min_s": self.min,
            "reps": self.reps,
            "cold": self.cold,
            "samples_s": [round(s, 9) for s in self.samples],
            "cpu_median_s": self.cpu_median,
            "cpu_samples_s": [round(s, 9) for s in self.cpu_samples],
        }
        if self.error:
            d["error"] = self.error
        if self.skipped:
            d["skipped"] = self.skipped
        if self.timed_out:
            d["timed_out"] = True
        if self.predicted_s is not None:
            d["predicted_s"] = self.predicted_s
        return d


class CallTimeout(BaseException):
    """BaseException, so that code under test cannot swallow it."""


def _on_alarm(signum, frame):
    raise CallTimeout()


def _timed_call(c: Candidate, timeout_s: float | None = None) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this thread) of one call."""
    args = c.prepare() if c.prepare is not None else ()
    gc.collect()
    alarm_s = timeout_s if threading.current_thread() is threading.main_thread() else None
    use_alarm = bool(alarm_s)
    if alarm_s:
        old = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, alarm_s)
    try:
        c0 = time.thread_time()
        t0 = time.perf_counter()
        result = c.fn(*args)
        dt = time.perf_counter() - t0
        dc = time.thread_time() - c0
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
    del result, args
    return dt, dc


def _describe(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0][:300] if msg else ''}"


def measure_interleaved(
    candidates: list[Candidate],
    *,
    budget_s: float,
    min_reps: int,
    max_reps: int,
    call_timeout_s: float | None = None,
    always_repeat: frozenset[str] = frozenset(),
) -> dict[str, Timing]:
    """Time ``candidates`` interleaved in one process; see the module
    docstring.  Exceptions are recorded per candidate, never raised.
    After a timeout nothing more is run (the objects are suspect).
    Candidates named in ``always_repeat`` get ``min_reps`` timed calls
    even when their warm-up exceeds the budget (a median, not one cold
    call)."""
    out: dict[str, Timing] = {}
    reps: dict[str, int] = {}
    live: list[Candidate] = []
    for c in candidates:
        if any(t.timed_out for t in out.values()):
            out[c.name] = Timing(error="not run: an earlier candidate timed out")
            continue
        try:
            t_warm, c_warm = _timed_call(c, call_timeout_s)
        except CallTimeout:
            out[c.name] = Timing(
                error=f"timeout: one call ran over {call_timeout_s:g} s", timed_out=True
            )
            continue
        except Exception as exc:  # noqa: BLE001 - reported, never hidden
            out[c.name] = Timing(error=_describe(exc))
            continue
        if t_warm >= budget_s and c.name not in always_repeat:
            out[c.name] = Timing(
                median=t_warm, min=t_warm, reps=1, cold=True, samples=[t_warm],
                cpu_samples=[c_warm], cpu_median=c_warm,
            )
            continue
        reps[c.name] = max(min_reps, min(max_reps, int(budget_s / max(t_warm, 1e-9))))
        out[c.name] = Timing()
        live.append(c)
    n_rounds = max(reps.values(), default=0)
    if any(t.timed_out for t in out.values()):
        n_rounds = 0
    for r in range(n_rounds):
        k = r % len(live) if live else 0
        order = live[k:] + live[:k]
        if r % 2:
            order.reverse()
        for c in order:
            if reps[c.name] <= r or out[c.name].error:
                continue
            try:
                wall, cpu = _timed_call(c, call_timeout_s)
                out[c.name].samples.append(wall)
                out[c.name].cpu_samples.append(cpu)
            except CallTimeout:
                out[c.name].error = f"timeout: one call ran over {call_timeout_s:g} s"
                out[c.name].timed_out = True
                break
            except Exception as exc:  # noqa: BLE001
                out[c.name].error = _describe(exc)
        if any(t.timed_out for t in out.values()):
            break
    for t in out.values():
        if t.samples and not t.cold and not t.error:
            t.median = statistics.median(t.samples)
            t.cpu_median = statistics.median(t.cpu_samples)
            t.min = min(t.samples)
            t.reps = len(t.samples)
    return out


def adam_after_one_step(model: torch.nn.Module) -> torch.optim.Optimizer:
    """An Adam optimizer of ``model`` after one real step, its gradients set
    directly (ones, sharded like their parameters) instead of by a backward
    pass -- FSDP2's backward on gloo costs seconds of setup per process
    pair, and the state-dict paths only need every parameter's Adam state."""
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optim.step()
    optim.zero_grad(set_to_none=True)
    return optim


def free_port() -> int:
    """A TCP port free on localhost now (for a run's ``TCPStore``)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tcp_store(rank: int, world: int, port: int, timeout: datetime.timedelta) -> Any:
    """The rendezvous store torchrun gives its ranks: a ``TCPStore`` on
    localhost served by rank 0.  dcp_optim's bounded arrival meets on the
    process group's store, so the store's kind is part of what a call
    costs (a ``FileStore`` is slower to answer)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timeout)


def spawn_ranks(target: Callable[..., None], rank_args: list[tuple], env: dict[str, str],
                timeout_s: float) -> tuple[list[Any], list[Any]]:
    """One fresh ``spawn`` process per entry of ``rank_args`` running
    ``target(*args)``, with ``env`` set while they start (restored after);
    waits for all of them until ``timeout_s`` and kills the ones still
    alive.  Returns (the processes, the ones killed)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        procs = [ctx.Process(target=target, args=args, daemon=True) for args in rank_args]
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join(5)
    return procs, hung
