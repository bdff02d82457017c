"""Pristine state of optimizers without a schema (``dcp_optim.schema``).

Two routes, tried in order by ``_engine.pristine``:

1. the *shadow step* (:func:`fallback_pristine`): a copy of the optimizer
   object, built without its constructor, over copies of the parameters,
   takes the step a real first step would; the live optimizer is never
   touched;
2. *upstream's method* (:func:`upstream_pristine`): one step of the real
   optimizer with zero gradients and ``lr`` 0, as upstream's
   ``_init_optim_state``, with every side effect undone (parameters,
   gradients, state, group values, the optimizer's counters).  Taken where
   the shadow step raises or leaves a trainable parameter without state.

Where both fail the getter raises ``errors.IncompleteTemplateError``:
a template is never returned incomplete.  Tensors are copied generically
(:func:`copy_tensor`), tensor subclasses included: torchao's quantized
optimizer states implement neither ``clone`` nor ``empty_like``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import defaultdict
from typing import Any, NoReturn

import torch

from ..schema import step_target
from .lockstep import collectives_in_step

__all__ = [
    "OPTIMIZER_WIDE",
    "copy_tensor",
    "fallback_own_entries",
    "fallback_pristine",
    "fallback_wrapper_entries",
    "upstream_pristine",
    "upstream_wrapper_entries",
]


def copy_tensor(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``t`` with its own storage, of ``t``'s class.
    Plain tensors and DTensors: ``clone``.  Other wrapper subclasses
    (``__tensor_flatten__``, as torchao's ``OptimState8bit``/``4bit``/
    ``Fp8``, which implement neither ``clone`` nor ``empty_like``): rebuilt
    with ``__tensor_unflatten__`` from copies of their inner tensors."""
    cls = type(t)
    if cls is torch.Tensor or cls is torch.nn.Parameter or not hasattr(cls, "__tensor_flatten__"):
        return t.detach().clone()
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor) and type(t._local_tensor) is torch.Tensor:
        return t.detach().clone()
    # (a DTensor of a subclass, as torchao's states under FSDP2: its
    # local tensor is copied the same way)
    names, ctx = t.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = {}
    for name in names:
        value = getattr(t, name)
        # (only tensors are copied: a subclass may list other inner values)
        inner[name] = copy_tensor(value) if isinstance(value, torch.Tensor) else value
    return cls.__tensor_unflatten__(inner, ctx, t.size(), t.stride())  # type: ignore[attr-defined]


_warned: set[type] = set()

class _Shadow:
    """Copies of an optimizer object graph for one throw-away step.

    Optimizers (the stepped one and any it holds, e.g. Lookahead's inner
    optimizer) become shallow copies built with ``object.__new__`` -- their
    constructor never runs -- whose attributes are copied structurally:
    containers (lists, tuples, dicts, sets, defaultdicts) are rebuilt,
    tensors are cloned, parameters become detached clones, every
    optimizer's ``state`` starts empty, and shared objects stay shared
    among the copies (a wrapper and its inner optimizer keep one
    ``param_groups`` list).  Anything else (modules, callables, numbers) is
    referenced, not copied.  Entries of ``state`` not keyed by a tensor
    (an optimizer's own counters) are copied too."""

    def __init__(self, params: dict[int, torch.Tensor], held: bool = False):
        self.memo: dict[int, Any] = {}
        self.params = params  # id(real param) -> its stand-in
        self.keep: list[Any] = []  # originals, so their ids stay unique
        self.held = held  # per-parameter state copied, not emptied

    def value(self, v: Any) -> Any:
        key = id(v)
        if key in self.memo:
            return self.memo[key]
        out: Any
        if isinstance(v, torch.Tensor):
            out = self.params.get(key)
            if out is None:
                out = copy_tensor(v)
        elif isinstance(v, torch.optim.Optimizer):
            out = self.optimizer(v)
        elif type(v) in (list, set) or isinstance(v, dict):
            out = self.container(v)
        elif type(v) is tuple:
            out = tuple(self.value(x) for x in v)
        else:
            return v
        self.memo[key] = out
        self.keep.append(v)
        return out

    def container(self, v: Any) -> Any:
        if isinstance(v, dict):
            if isinstance(v, defaultdict):
                out: Any = defaultdict(v.default_factory)
            else:
                try:
                    out = type(v)()
                except TypeError:
                    out = {}
            self.memo[id(v)] = out
            for k, x in v.items():
                out[self.value(k)] = self.value(x)
            return out
        if type(v) is list:
            out = []
            self.memo[id(v)] = out
            out.extend(self.value(x) for x in v)
            return out
        return {self.value(x) for x in v}

    def fresh_state(self, v: dict) -> Any:
        """Per-parameter state starts empty (with ``held``: copies of the
        entries the parameters hold); entries under other keys (SPAM's
        ``state['current_step']``) are copied.  One per original (a
        wrapper sharing its inner optimizer's state keeps sharing)."""
        if id(v) in self.memo:
            return self.memo[id(v)]
        fresh: Any = defaultdict(dict)
        self.memo[id(v)] = fresh
        self.keep.append(v)
        for k, x in v.items():
            if not isinstance(k, torch.Tensor):
                fresh[k] = self.value(x)
            elif self.held and isinstance(x, dict) and id(k) in self.params:
                fresh[self.params[id(k)]] = self.container(x)
        return fresh

    def optimizer(self, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        shadow = object.__new__(type(opt))
        self.memo[id(opt)] = shadow
        self.keep.append(opt)
        attrs = {}
        for name, v in vars(opt).items():
            if name == "state" and isinstance(v, dict):
                attrs[name] = self.fresh_state(v)
            elif name == "step":
                continue  # an instance-level step may drive the live one
            else:
                attrs[name] = self.value(v)
        shadow.__dict__.update(attrs)
        return shadow


@contextlib.contextmanager
def _no_global_step_hooks():
    """Hide the process-wide optimizer step hooks
    (``torch.optim.optimizer.register_optimizer_step_pre_hook``/``_post_hook``)
    for the duration: a shadow step is no training step.  Hooks registered
    meanwhile are kept.  Another thread stepping a real optimizer at that
    moment would not see them either."""
    from torch.optim import optimizer as torch_optimizer

    tables: tuple[dict[int, Any], ...] = (
        torch_optimizer._global_optimizer_pre_hooks,
        torch_optimizer._global_optimizer_post_hooks,
    )
    saved: list[dict[int, Any]] = [dict(t) for t in tables]
    for t in tables:
        t.clear()
    try:
        yield
    finally:
        for t, hooks in zip(tables, saved):
            added = dict(t)
            t.clear()
            t.update(hooks)
            t.update(added)


def _zero_steps(value: Any, key: Any = None) -> Any:
    """Counters named ``step`` back to zero (a never-stepped parameter has
    taken no step), at any depth."""
    if key == "step":
        if isinstance(value, torch.Tensor):
            return value.zero_()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return type(value)(0)
    if isinstance(value, dict):
        return {k: _zero_steps(v, k) for k, v in value.items()}
    return value


def _own(value: Any, seen: dict[int, Any] | None = None) -> Any:
    """Containers rebuilt and tensors cloned, so no two tensors of a
    template share storage (dcp.load would write one value into all)."""
    if isinstance(value, torch.Tensor):
        return copy_tensor(value)
    if isinstance(value, dict):
        return {k: _own(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_own(v) for v in value)
    return value


def _storage(t: torch.Tensor) -> int | None:
    """The data pointer of a plain tensor's storage (of a DTensor's plain
    local tensor); None for other subclasses and empty tensors."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t._local_tensor
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        return None
    return t.untyped_storage().data_ptr() if t.numel() else None


class _Keep:
    """Hands over a shadow step's tensors without copying them where they
    can be: a tensor is copied only when its storage is a stand-in's or
    a stand-in gradient's, or is already handed over (no two tensors of a
    template share storage); the shadow is discarded on return, so the
    rest become the template as they are (one copy of the state, not
    two).  Tensor subclasses are always copied."""

    def __init__(self, avoid: set[int]):
        self.used = set(avoid)

    def __call__(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            ptr = _storage(value)
            if ptr is not None and not value.requires_grad and ptr not in self.used:
                self.used.add(ptr)
                return value.detach()
            return copy_tensor(value)
        if isinstance(value, dict):
            return {k: self(v) for k, v in value.items()}
        if type(value) in (list, tuple):
            return type(value)(self(v) for v in value)
        return value


class _StandIns:
    """One detached copy of each parameter of ``optimizer`` (the
    stand-ins a shadow step updates), made once and reused by every try
    and pass: :meth:`prepare` copies the live values back in place and
    gives the stand-ins gradients.

    Gradients of a plain tensor are, by default (``"expanded"``),
    stride-0 views of one scalar per dtype and device
    (``torch.full((), v).expand_as(p)``): no memory per parameter.  An
    optimizer that writes into ``p.grad`` in place either raises (most
    in-place ops refuse a tensor whose elements share memory) or changes
    the scalar (``fill_``, ``zero_``), which :meth:`intact` tells; the
    step is then redone with ``"dense"`` gradients (``full_like``).
    ``"graph"`` gradients carry a graph (Hessian-vector products)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.order: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.by_id: dict[int, torch.Tensor] = {}
        self.scalars: list[tuple[torch.Tensor, float]] = []
        self.fresh = True
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if id(p) in self.by_id:
                        continue
                    clone = p.detach().clone()
                    if p.requires_grad:
                        clone.requires_grad_(True)
                    self.by_id[id(p)] = clone
                    self.order.append((p, clone))

    def prepare(self, value: float, mode: str, only: set[int] | None = None) -> None:
        """Live values copied into the stand-ins (but on first use);
        gradients ``value`` (``mode``, see the class) for the trainable
        ones (those in ``only`` where given), None for the others."""
        with torch.no_grad():
            if not self.fresh:
                for p, clone in self.order:
                    clone.grad = None
                    clone.copy_(p.detach())
            self.fresh = False
        self.set_grads(value, mode, only)

    def set_grads(self, value: float, mode: str, only: set[int] | None = None) -> None:
        self.scalars = []
        scalars: dict[tuple[Any, Any], torch.Tensor] = {}
        with torch.no_grad():
            for p, clone in self.order:
                if not p.requires_grad or (only is not None and id(p) not in only):
                    clone.grad = None
                    continue
                if mode == "graph":
                    with torch.enable_grad():
                        clone.grad = clone * 0.0 + value
                    continue
                grad = None
                if mode == "expanded":
                    grad = self._expanded(clone, value, scalars)
                clone.grad = torch.full_like(clone, value) if grad is None else grad
        self.scalars = [(s, value) for s in scalars.values()]

    @staticmethod
    def _expanded(clone: torch.Tensor, value: float, scalars: dict) -> torch.Tensor | None:
        from torch.distributed.tensor import DTensor

        local = clone._local_tensor if isinstance(clone, DTensor) else clone
        if type(local) not in (torch.Tensor, torch.nn.Parameter) or local.is_sparse:
            return None
        key = (local.dtype, local.device)
        scalar = scalars.get(key)
        if scalar is None:
            scalar = scalars[key] = torch.full((), value, dtype=local.dtype, device=local.device)
        view = scalar.expand_as(local)
        if isinstance(clone, DTensor):
            return DTensor.from_local(view, clone.device_mesh, clone.placements, run_check=False,
                                      shape=clone.shape, stride=clone.stride())
        return view

    def intact(self) -> bool:
        """Whether every scalar behind an expanded gradient holds its value
        (the step wrote into no gradient)."""
        return all(bool((s == v).item()) for s, v in self.scalars)

    def drop_grads(self) -> None:
        """The stand-ins' gradients dropped: a gradient with a graph holds
        its stand-in through autograd's nodes (a cycle no garbage
        collection sees, the stand-in holding its gradient)."""
        for _, clone in self.order:
            clone.grad = None

    def storages(self) -> set[int]:
        out = set()
        for _, clone in self.order:
            for t in (clone, clone.grad):
                ptr = None if t is None else _storage(t)
                if ptr is not None:
                    out.add(ptr)
        for s, _ in self.scalars:
            out.add(s.untyped_storage().data_ptr())
        return out


class _GradientWritten(RuntimeError):
    """A shadow step wrote into the stand-ins' shared gradient scalar."""


def _tries(
    optimizer: torch.optim.Optimizer,
    stand: _StandIns,
    wanted: set[int],
    grad_value: float,
    tries: list[tuple[bool, bool, bool]],
    only: set[int] | None = None,
    own_key: Any = None,
    held: bool = False,
) -> tuple[Any, list[dict[str, Any]]]:
    """The first of ``tries`` (zero lr, closure, graph) that steps: each
    with expanded gradients, redone with dense ones where that raises or
    writes into a gradient.  Raises the last failure."""
    failures: list[BaseException] = []
    for zero_lr, closure, graph in tries:
        for mode in ("graph",) if graph else ("expanded", "dense"):
            try:
                stand.prepare(grad_value, mode, only)
                got = _shadow_step(optimizer, stand, wanted, zero_lr, grad_value, mode, closure, only, own_key, held)
                if not stand.intact():
                    raise _GradientWritten("the step wrote into a gradient")
                return got
            except Exception as exc:  # noqa: BLE001 - retried, then re-raised
                # kept without its traceback: its frames hold that try's
                # state, which the next try must not meet
                failures.append(exc.with_traceback(None))
            finally:
                stand.drop_grads()
    _raise_last(failures)


def _raise_last(failures: list[BaseException]) -> NoReturn:
    """Raises the last of ``failures`` with no reference cycle through
    the raising frame (the exception's traceback holds that frame, whose
    locals would hold the exception): a cycle would keep the frames of
    the failed step, and its copies of the parameters, until a garbage
    collection."""
    last = failures[-1]
    failures.clear()
    try:
        raise last
    finally:
        del last


def _probes(optimizer: torch.optim.Optimizer, wanted: set[int]) -> set[int]:
    """Per param group, the smallest wanted trainable parameter of each
    (dimensionality, dtype): the parameters the unit-gradient pass steps
    first."""
    out: set[int] = set()
    for group in optimizer.param_groups:
        smallest: dict[tuple[int, Any], torch.Tensor] = {}
        for p in group["params"]:
            if id(p) in wanted and p.requires_grad:
                key = (p.dim(), p.dtype)
                if key not in smallest or p.numel() < smallest[key].numel():
                    smallest[key] = p
        out.update(id(p) for p in smallest.values())
    return out


def fallback_pristine(
    optimizer: torch.optim.Optimizer, params: list[torch.Tensor]
) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]]]:
    """Pristine state of ``params`` (trainable parameters of ``optimizer``
    without state) for an optimizer class with no schema: what a real first
    step creates, from the parameters' real values, keyed by ``id(param)``;
    with it, per live param group, the group keys that step adds
    (pytorch-optimizer's ``group['step']``, Prodigy's running sums).

    A shadow of the optimizer (see :class:`_Shadow`: its constructor never
    runs) holding a detached copy of every parameter (:class:`_StandIns`)
    and empty state takes one step of its class under ``torch.no_grad``:
    every parameter gets a zero gradient and every group ``lr`` 0, as in
    upstream's initialising step (the real ``lr`` where that step raises),
    so that state derived from the parameters (schedule-free's ``z``,
    Prodigy's ``p0``, an EMA of the weights) starts from their real values.
    A second shadow step with unit gradients and the real ``lr`` adds the
    keys some optimizers create only for a nonzero update (D-Adapt SGD,
    Prodigy's ``d`` sums), with that step's values, and replaces a number
    the first step left where it leaves a tensor (see ``_retyped``): first over probes
    only (per group, the smallest parameter of each dimensionality and
    dtype; the others without gradient), over every parameter only where
    a probe's state gains a key the first pass did not give it (or the
    probe step raises).  A step that raises is retried with a closure
    returning a zero loss (which sets the stand-ins' gradients again:
    sharpness-aware optimizers clear them before calling it), then with
    gradients carrying a graph (Hessian-vector products); the last failure
    is re-raised.  The optimizer's own step hooks run with the shadow as
    their optimizer (an EMA kept by ``register_step_post_hook`` is state a
    real step creates); the process-wide ones do not (see
    :func:`_no_global_step_hooks`).  Counters named ``step`` are reset to
    0, every tensor is a fresh copy (no two share storage).  The live
    optimizer, its groups, parameters, gradients and hooks are untouched;
    a hook or step that reaches the live objects through a closure rather
    than its ``optimizer`` argument is outside this guarantee.

    Cost beyond the returned template: one copy of the parameters (the
    stand-ins, reused by every try and pass), freed on return; gradients
    are stride-0 views of one scalar (real tensors only for an optimizer
    that writes into them); the first pass's state is the template
    itself; the probes' state is the size of the probes.  Only for
    optimizers without a schema, only while some parameter lacks state.
    A proxy whose own step communicates (torch's PostLocalSGDOptimizer)
    steps its inner optimizer (schema.step_target).
    """
    optimizer = step_target(optimizer)
    cls = type(optimizer)
    if cls not in _warned:
        _warned.add(cls)
        warnings.warn(
            f"dcp_optim has no state schema for {cls.__module__}.{cls.__qualname__}; "
            "pristine state for never-stepped parameters comes from one step of a "
            "throw-away shadow of the optimizer over copies of the parameters. "
            "Declare the schema with dcp_optim.register_optimizer_schema to avoid this.",
            UserWarning,
            stacklevel=5,
        )
    wanted = {id(p) for p in params}
    stand = _StandIns(optimizer)
    # Pass 1, zero gradients and lr 0 (the real lr where that raises);
    # without a closure, then with one returning a zero loss (LBFGS-like,
    # AliG-like, sharpness-aware steps); last, gradients with a graph
    # (AdaHessian and SophiaH take Hessian-vector products of them: here
    # the Hessian is 0)
    tries1 = [(z, c, False) for z in (True, False) for c in (False, True)] + [(z, False, True) for z in (True, False)]
    held = False
    try:
        states, group_keys = _tries(optimizer, stand, wanted, 0.0, tries1)
    except Exception:
        # A step that needs what the constructor put in the state (APOLLO's
        # per-parameter "seed"): every try again, the shadow holding
        # copies of the parameters' entries
        if not any(optimizer.state.get(p) for p, _ in stand.order if id(p) in wanted):
            raise
        held = True
        states, group_keys = _tries(optimizer, stand, wanted, 0.0, tries1, held=held)
    # Pass 2, unit gradients and the group's lr: the keys that some
    # optimizers create only for a nonzero update (D-Adapt SGD's state,
    # Prodigy's d sums), added with pass 2's values where pass 1 lacks
    # them.  Probes first; every parameter where a probe tells more.
    tries2 = [(False, False, False), (False, True, False), (False, False, True)]
    probes = _probes(optimizer, wanted)
    try:
        got, keys = _tries(optimizer, stand, probes, 1.0, tries2, only=probes, held=held)
    except Exception:  # noqa: BLE001 - every parameter, below
        full = True
    else:
        full = any(
            not set(st).issubset(states.get(pid, {})) or _retyped(states.get(pid, {}), st)
            for pid, st in got.items()
            if pid in probes
        )
    if full:
        try:
            got, keys = _tries(optimizer, stand, wanted, 1.0, tries2, held=held)
        except Exception:  # noqa: BLE001 - pass 1 succeeded: keep what it gave
            return states, group_keys
    for pid, st in got.items():
        merged = states.setdefault(pid, st)
        if merged is not st:
            for k, v in st.items():
                if k not in merged or _takes_tensor(merged[k], v):
                    merged[k] = v
    for mine, theirs in zip(group_keys, keys):
        for k, v in theirs.items():
            mine.setdefault(k, v)
    return states, group_keys


def _takes_tensor(first: Any, second: Any) -> bool:
    """Whether pass 2's value replaces pass 1's: a tensor where pass 1
    left a number -- a value whose type follows the data (torch-optimizer's
    Lamb stores its ``trust_ratio`` as the int 1 when the update's norm is
    0, as it is for zero gradients, and as a tensor after a real step).
    The template takes the tensor, the type a checkpoint of a stepped
    optimizer holds (a number there would make ``dcp.load`` fail on that
    entry)."""
    number = isinstance(first, (int, float)) and not isinstance(first, bool)
    return number and isinstance(second, torch.Tensor)


def _retyped(first: dict[Any, Any], second: dict[Any, Any]) -> bool:
    """Whether pass 2 retypes any of pass 1's values (``_takes_tensor``)."""
    return any(_takes_tensor(first[k], v) for k, v in second.items() if k in first)


def _left_out(key: Any, own_key: Any) -> bool:
    """Whether a top-level key of an optimizer's own ``state_dict()`` is
    not one of the entries asked for: the wrapper's inner dict
    (``own_key``), or torch's own layout (a frozenset of its keys)."""
    return key in own_key if isinstance(own_key, frozenset) else key == own_key


def fallback_own_entries(optimizer: torch.optim.Optimizer) -> dict[Any, Any]:
    """For an optimizer whose own ``state_dict()`` adds top-level entries
    beside torch's layout (heavyball's "heavyball", whose ``inner_group``
    a step fills): those entries as a first step leaves them, by one
    shadow step as :func:`fallback_wrapper_entries` takes.  Raises what
    the step raises."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    stand = _StandIns(optimizer)
    first, _ = _tries(optimizer, stand, {id(p) for p in params}, 0.0, [(True, False, False)],
                      own_key=frozenset(("state", "param_groups")))
    return first


def fallback_wrapper_entries(
    optimizer: torch.optim.Optimizer, inner_key: Any
) -> tuple[dict[Any, Any], list[dict[str, Any]]]:
    """For a wrapper whose own ``state_dict()`` nests its inner
    optimizer's under ``inner_key`` (pytorch-optimizer's Lookahead,
    ScheduleFreeWrapper, Magma): that ``state_dict()``'s other top-level
    entries as a first step leaves them -- the wrapper's own per-parameter
    state (schedule-free's ``z``) from the parameters' real values.  One
    shadow step as in :func:`fallback_pristine` (zero gradients, ``lr`` 0,
    no process-wide hooks, nothing live touched); counters named ``step``
    at 0, tensors fresh copies.  With them, per live param group, the
    group keys that step adds (ScheduleFreeWrapper's ``weight_sum``).
    Raises what the step raises."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    stand = _StandIns(optimizer)
    return _tries(optimizer, stand, {id(p) for p in params}, 0.0, [(True, False, False)], own_key=inner_key)


def _shadow_step(
    optimizer: torch.optim.Optimizer,
    stand: _StandIns,
    wanted: set[int],
    zero_lr: bool,
    grad_value: float,
    mode: str,
    closure: bool,
    only: set[int] | None = None,
    own_key: Any = None,
    held: bool = False,
) -> tuple[Any, list[dict[str, Any]]]:
    order = stand.order
    sh = _Shadow(stand.by_id, held)
    shadow = sh.optimizer(optimizer)
    live_keys = [set(g) for g in optimizer.param_groups]
    if zero_lr:
        for group in shadow.param_groups:
            lr = group.get("lr")
            if isinstance(lr, torch.Tensor):
                group["lr"] = torch.zeros_like(lr)
            elif isinstance(lr, (int, float)) and not isinstance(lr, bool):
                group["lr"] = 0.0
    # its collectives only in lockstep with the other ranks' steps
    with torch.no_grad(), _no_global_step_hooks(), collectives_in_step(optimizer):
        if closure:

            def zero_loss() -> torch.Tensor:
                # the stand-ins' gradients set again (a sharpness-aware
                # step clears them before its second forward-backward)
                stand.set_grads(grad_value, mode, only)
                return torch.zeros(())

            # torch hints a closure as returning float; a loss tensor is
            # what training closures return.
            shadow.step(zero_loss)  # type: ignore[arg-type]
        else:
            shadow.step()
    keep = _Keep(stand.storages())
    new_keys = []
    for keys, group in zip(live_keys, shadow.param_groups):
        new_keys.append(_zero_steps(keep({k: v for k, v in group.items() if k not in keys})))
    if own_key is not None:
        own = shadow.state_dict()
        return {k: _zero_steps(keep(v)) for k, v in own.items() if not _left_out(k, own_key)}, new_keys
    states: dict[Any, Any] = {}
    for p, clone in order:
        if id(p) in wanted and clone in shadow.state:
            states[id(p)] = _zero_steps(keep(dict(shadow.state[clone])))
    # optimizer-wide entries the step created (str keys: MADGRAD's "k"),
    # under OPTIMIZER_WIDE beside the parameters' ids (D29)
    wide = {k: _zero_steps(keep(v)) for k, v in shadow.state.items() if isinstance(k, str)}
    if wide:
        states[OPTIMIZER_WIDE] = wide
    return states, new_keys


#: Key of fallback_pristine's result holding the optimizer-wide entries
#: (str keys of ``optimizer.state``) a first step creates.
OPTIMIZER_WIDE = ".optimizer-wide"  # a leading dot: no FQN


# --- upstream's method, undone ------------------------------------------------


def _snapshot_value(v: Any, params: set[int]) -> Any:
    """What restores ``v`` in place after a step: tensors copied (the
    optimizer's parameters excepted: restored on their own), the contents
    of lists and dicts kept, at any depth."""
    if isinstance(v, torch.Tensor):
        return v if id(v) in params else copy_tensor(v)
    if isinstance(v, dict):
        return {k: _snapshot_value(x, params) for k, x in v.items()}
    if type(v) is list:
        return [_snapshot_value(x, params) for x in v]
    return v


def _restore(live: Any, saved: Any) -> Any:
    """``live`` given back the contents ``saved`` recorded (see
    _snapshot_value): tensors copied into in place (their identity kept),
    dicts and lists refilled in place (their key order kept); returns the
    value to keep."""
    if live is saved:
        return live
    if isinstance(live, torch.Tensor) and isinstance(saved, torch.Tensor):
        if live.shape == saved.shape and live.dtype == saved.dtype and type(live) is type(saved):
            with torch.no_grad():
                live.copy_(saved)
            return live
        return saved
    if isinstance(live, dict) and isinstance(saved, dict):
        kept = {k: _restore(live[k], v) if k in live else v for k, v in saved.items()}
        live.clear()
        live.update(kept)
        return live
    if type(live) is list and type(saved) is list:
        live[:] = [_restore(a, b) for a, b in zip(live, saved)] + saved[len(live):]
        return live
    return saved


_MISSING = object()
_OWN_ATTRS = ("state", "param_groups")


def _optimizers_of(optimizer: Any) -> list[Any]:
    """``optimizer`` and the optimizers it holds as attributes (a
    wrapper's inner optimizer), at any depth, each once."""
    out: dict[int, Any] = {}
    todo = [optimizer]
    while todo:
        opt = todo.pop()
        if id(opt) in out:
            continue
        out[id(opt)] = opt
        todo.extend(v for v in getattr(opt, "__dict__", {}).values() if isinstance(v, torch.optim.Optimizer))
    return list(out.values())


class _Saved:
    """One optimizer's state, groups and attributes, as _undone restores
    them."""

    def __init__(self, opt: Any, params: set[int]):
        self.opt = opt
        self.state = opt.state
        self.held = {k: (e, _snapshot_value(e, params)) for k, e in self.state.items()}
        self.groups = [(g, list(g), _snapshot_value({k: v for k, v in g.items() if k != "params"}, params))
                       for g in opt.param_groups]
        self.attrs = {n: (v, _snapshot_value(v, params)) for n, v in vars(opt).items() if n not in _OWN_ATTRS}

    def restore(self) -> None:
        state = self.state
        for k in [k for k in state if k not in self.held]:
            del state[k]
        for k, (entry, saved) in self.held.items():
            state[k] = _restore(entry, saved)
        for group, order, saved in self.groups:
            restored = {k: (group["params"] if k == "params" else _restore(group.get(k, _MISSING), saved[k]))
                        for k in order}
            group.clear()
            group.update(restored)
        live = vars(self.opt)
        for name in [n for n in live if n not in self.attrs and n not in _OWN_ATTRS]:
            delattr(self.opt, name)
        for name, (value, saved) in self.attrs.items():
            kept = _restore(value, saved)
            if live.get(name, _MISSING) is not kept:
                setattr(self.opt, name, kept)


@contextlib.contextmanager
def _undone(optimizer: Any, params: list[torch.Tensor]):
    """Everything a step of ``optimizer`` changes, put back on exit:
    parameter values (one copy of the parameters, freed on exit), their
    ``.grad`` objects, and for the optimizer and every optimizer it holds
    (a wrapper's inner one): its ``state`` (entries the step creates are
    removed, entries it held get their values back, tensors in place), its
    param groups' values (keys a step adds are removed) and its other
    attributes (counters; lists and dicts refilled in place).  What a step
    changes outside the optimizers and parameters (an object reached
    through a closure, a step hook's own effects) is outside this."""
    unique = list({id(p): p for p in params}.values())
    ids = set(id(p) for p in unique)
    values = [p.detach().clone() for p in unique]
    grads = [p.grad for p in unique]
    saved = [_Saved(opt, ids) for opt in _optimizers_of(optimizer)]
    try:
        yield
    finally:
        with torch.no_grad():
            for p, v, g in zip(unique, values, grads):
                p.copy_(v)
                p.grad = g
        del values
        for s in saved:
            s.restore()


def _upstream_step(optimizer: Any, wanted: set[int], own_key: Any = None) -> tuple[Any, list[dict[str, Any]]]:
    """One step of the real ``optimizer`` as upstream's ``_init_optim_state``
    takes it -- zero gradients for the trainable parameters without state
    (``wanted``; the others get none, so that their held state is not
    advanced), every group's ``lr`` 0 -- without a closure, then with one
    returning a zero loss (and setting the gradients again); undone (see
    _undone).  The gradients are stride-0 views of one zero scalar, real
    zero tensors where the step raises on them or writes into them (see
    _StandIns).  Returns what ``_shadow_step`` returns."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    live_keys = [set(g) for g in optimizer.param_groups]
    failures: list[BaseException] = []
    for closure, mode in ((c, m) for c in (False, True) for m in ("expanded", "dense")):
        with _undone(optimizer, params), torch.no_grad(), _no_global_step_hooks(), collectives_in_step(optimizer):
            scalars: dict[tuple[Any, Any], torch.Tensor] = {}

            def set_grads() -> None:
                for p in params:
                    grad = None
                    if id(p) in wanted and p.requires_grad:
                        if mode == "expanded":
                            grad = _StandIns._expanded(p, 0.0, scalars)
                        if grad is None:
                            grad = torch.zeros_like(p)
                    p.grad = grad

            def zero_loss() -> torch.Tensor:
                set_grads()  # a sharpness-aware step clears them first
                return torch.zeros(())

            for group in optimizer.param_groups:
                lr = group.get("lr")
                if isinstance(lr, torch.Tensor):
                    group["lr"] = torch.zeros_like(lr)
                elif isinstance(lr, (int, float)) and not isinstance(lr, bool):
                    group["lr"] = 0.0
            try:
                set_grads()
                if closure:
                    optimizer.step(zero_loss)
                else:
                    optimizer.step()
                if any(bool(s.item()) for s in scalars.values()):
                    raise _GradientWritten("the step wrote into a gradient")
            except Exception as exc:  # noqa: BLE001 - retried, then re-raised
                # kept without its traceback: its frames hold that try's
                # copies of the parameters, which the next try must not meet
                failures.append(exc.with_traceback(None))
                continue
            # What the step created (the entries of parameters that had
            # none, the group keys it added) is removed from the optimizer
            # on exit: handed over without a copy unless it shares storage
            # with a parameter, a gradient or another entry.  A wrapper's
            # own state_dict() may hold live, restored tensors: copied.
            avoid = {s.untyped_storage().data_ptr() for s in scalars.values()}
            for p in params:
                for t in (p, p.grad):
                    ptr = None if t is None else _storage(t)
                    if ptr is not None:
                        avoid.add(ptr)
            keep = _Keep(avoid)
            new_keys = [
                _zero_steps(keep({k: v for k, v in group.items() if k not in keys and k != "lr"}))
                for keys, group in zip(live_keys, optimizer.param_groups)
            ]
            if own_key is not None:
                own = optimizer.state_dict()
                return {k: _zero_steps(_own(v)) for k, v in own.items() if not _left_out(k, own_key)}, new_keys
            state = optimizer.state
            states: dict[Any, Any] = {
                id(p): _zero_steps(keep(dict(state[p]))) for p in params if id(p) in wanted and state.get(p)
            }
            wide = {k: _zero_steps(keep(v)) for k, v in state.items() if isinstance(k, str)}
            if wide:
                states[OPTIMIZER_WIDE] = wide
            return states, new_keys
    _raise_last(failures)


def upstream_pristine(
    optimizer: Any, params: list[torch.Tensor]
) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]]]:
    """Pristine state of ``params`` (trainable, without state) by
    upstream's method on the real optimizer, undone; as
    :func:`fallback_pristine` returns it (a communicating proxy's inner
    optimizer stepped, as there).  Raises what the step raises."""
    return _upstream_step(step_target(optimizer), {id(p) for p in params})


def upstream_wrapper_entries(optimizer: Any, inner_key: Any) -> tuple[dict[Any, Any], list[dict[str, Any]]]:
    """:func:`fallback_wrapper_entries` by upstream's method on the real
    wrapper, undone.  Raises what the step raises."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    wanted = {id(p) for p in params if not optimizer.state.get(p)}
    inner_state = getattr(getattr(optimizer, "optimizer", None), "state", None)
    if isinstance(inner_state, dict):
        wanted = {id(p) for p in params if not inner_state.get(p)}
    return _upstream_step(optimizer, wanted, own_key=inner_key)
