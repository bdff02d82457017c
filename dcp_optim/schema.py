"""Optimizer state schemas: what a never-stepped parameter's state is.

``get_optimizer_state_dict`` never steps an optimizer (D1 in docs/differences.md).  A
parameter the optimizer has not created state for yet is returned with the
state the optimizer itself would create on its first step, before updating
anything -- its *pristine* state -- built from a per-class schema and never
installed into the live optimizer (D2).  DCP's load flow needs those
entries: the template a fresh optimizer produces must name every state
tensor a trained one saved.

A schema is a function ``(optimizer, group) -> list[StateSpec] | None``
returning the specs for the parameters of one param group, or ``None``
when that group keeps no per-parameter state (plain SGD).  Specs are
applied natively to every parameter lacking state, so building a
template for a large model runs no Python code per parameter.

The ``torch.optim`` optimizers are registered below.  Other optimizers can
declare theirs with :func:`register_optimizer_schema`.  An optimizer
without a schema gets its pristine state from a shadow step (see
:func:`fallback_pristine`): a copy of the optimizer object, built without
its constructor, over copies of the real parameters, takes the step a
real first step would, and its counters named ``step`` are reset to zero.
The live optimizer, its hooks and its parameters are never touched.  A
warning names such classes once.

Two schemas keep first-step semantics where zero state would not
reproduce them:

* Rprop's ``step_size`` starts at the group's ``lr`` (not 0);
* SGD with momentum and ``dampening != 0`` takes the gradient itself as
  its first momentum buffer, while a zero buffer would give
  ``(1 - dampening) * grad``.  Its pristine buffer is therefore stored as
  negative zeros (``-0.0``), a value training cannot produce for a whole
  buffer in practice, and loading treats an all-negative-zero buffer as
  "no buffer yet" (see ``_engine.optim.drop_sgd_placeholders``).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.optim.optimizer import _get_scalar_dtype, _to_scalar

__all__ = [
    "PARAM",
    "PARAM_DEVICE",
    "StateSpec",
    "full_like",
    "register_optimizer_schema",
    "scalar",
    "schema_for",
    "zeros_like",
]


class _Placeholder:
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


#: Stands for the parameter in a spec's arguments.
PARAM = _Placeholder("PARAM")
#: Stands for ``param.device`` in a spec's arguments.
PARAM_DEVICE = _Placeholder("PARAM_DEVICE")


class StateSpec(NamedTuple):
    """One state entry: ``factory(*args, **kwargs)`` with ``PARAM`` and
    ``PARAM_DEVICE`` substituted.  ``complex_args`` replaces ``args`` for
    complex parameters; ``dims`` = ``(lo, hi)`` restricts the entry to
    parameters with ``lo <= param.dim() <= hi``."""

    name: str
    factory: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any] | None = None
    complex_args: tuple[Any, ...] | None = None
    dims: tuple[int, int] | None = None


_PRESERVE = {"memory_format": torch.preserve_format}


def zeros_like(name: str, *, dims: tuple[int, int] | None = None) -> StateSpec:
    """``torch.zeros_like(param)`` (a DTensor for a DTensor parameter)."""
    return StateSpec(name, torch.zeros_like, (PARAM,), _PRESERVE, None, dims)


def full_like(name: str, value: Any, *, complex_value: Any = None) -> StateSpec:
    """``torch.full_like(param, value)``; ``complex_value`` for complex
    parameters."""
    return StateSpec(
        name,
        torch.full_like,
        (PARAM, value),
        _PRESERVE,
        None if complex_value is None else (PARAM, complex_value),
        None,
    )


def scalar(
    name: str, value: float, *, dtype: torch.dtype, on_param_device: bool
) -> StateSpec:
    """A 0-dim tensor: on the parameter's device, or on the CPU (torch's
    policy for ``step`` unless ``capturable``/``fused``)."""
    device = PARAM_DEVICE if on_param_device else "cpu"
    return StateSpec(
        name, torch.full, ((), value), {"dtype": dtype, "device": device}, None, None
    )


SchemaFn = Callable[[torch.optim.Optimizer, dict[str, Any]], "list[StateSpec] | None"]

_registry: dict[type, SchemaFn] = {}
_registry_lock = threading.Lock()


def register_optimizer_schema(cls: type, fn: SchemaFn | None = None):
    """Declare the pristine state of optimizer class ``cls``.

    ``fn(optimizer, group)`` returns the :class:`StateSpec` list for the
    parameters of ``group`` (``None`` or ``[]``: the group keeps no state).
    Usable as a decorator: ``@register_optimizer_schema(MyOptimizer)``.
    """

    def register(f: SchemaFn) -> SchemaFn:
        with _registry_lock:
            _registry[cls] = f
        return f

    return register(fn) if fn is not None else register


def _same_step(cls: type, base: type) -> bool:
    """Whether ``cls`` initialises state exactly like ``base`` does."""
    for attr in ("step", "_init_group"):
        if getattr(cls, attr, None) is not getattr(base, attr, None):
            return False
    return True


def schema_for(optimizer: torch.optim.Optimizer) -> SchemaFn | None:
    """The registered schema of the optimizer's class, or of a registered
    base class the optimizer shares its step with; ``None`` if none."""
    cls = type(optimizer)
    fn = _registry.get(cls)
    if fn is not None:
        return fn
    for base in cls.__mro__[1:]:
        fn = _registry.get(base)
        if fn is not None and _same_step(cls, base):
            return fn
    return None


# --- torch.optim -------------------------------------------------------------


def _step_spec(group: dict[str, Any], *, fused_key: bool = True) -> StateSpec:
    fused = bool(group.get("fused")) if fused_key else False
    if group.get("capturable") or fused:
        return scalar(
            "step", 0.0, dtype=_get_scalar_dtype(is_fused=fused), on_param_device=True
        )
    return scalar("step", 0.0, dtype=_get_scalar_dtype(), on_param_device=False)


@register_optimizer_schema(torch.optim.Adam)
def _adam(optimizer, group):
    specs = [_step_spec(group), zeros_like("exp_avg"), zeros_like("exp_avg_sq")]
    if group.get("amsgrad"):
        specs.append(zeros_like("max_exp_avg_sq"))
    return specs


@register_optimizer_schema(torch.optim.AdamW)
def _adamw(optimizer, group):
    return _adam(optimizer, group)


@register_optimizer_schema(torch.optim.SGD)
def _sgd(optimizer, group):
    if not group.get("momentum"):
        return None
    if group.get("dampening"):
        return [full_like("momentum_buffer", -0.0)]
    return [zeros_like("momentum_buffer")]


@register_optimizer_schema(torch.optim.Adagrad)
def _adagrad(optimizer, group):
    v = group.get("initial_accumulator_value", 0.0)
    return [
        _step_spec({"fused": group.get("fused")}),
        full_like("sum", v, complex_value=complex(v, v)),
    ]


@register_optimizer_schema(torch.optim.Adadelta)
def _adadelta(optimizer, group):
    return [
        _step_spec(group, fused_key=False),
        zeros_like("square_avg"),
        zeros_like("acc_delta"),
    ]


@register_optimizer_schema(torch.optim.Adamax)
def _adamax(optimizer, group):
    return [
        _step_spec(group, fused_key=False),
        zeros_like("exp_avg"),
        zeros_like("exp_inf"),
    ]


@register_optimizer_schema(torch.optim.ASGD)
def _asgd(optimizer, group):
    dtype = _get_scalar_dtype()
    return [
        scalar("step", 0.0, dtype=dtype, on_param_device=True),
        scalar("eta", _to_scalar(group["lr"]), dtype=dtype, on_param_device=True),
        scalar("mu", 1.0, dtype=dtype, on_param_device=True),
        zeros_like("ax"),
    ]


@register_optimizer_schema(torch.optim.NAdam)
def _nadam(optimizer, group):
    on_device = bool(group.get("capturable"))
    dtype = _get_scalar_dtype()
    return [
        scalar("step", 0.0, dtype=dtype, on_param_device=on_device),
        scalar("mu_product", 1.0, dtype=dtype, on_param_device=on_device),
        zeros_like("exp_avg"),
        zeros_like("exp_avg_sq"),
    ]


@register_optimizer_schema(torch.optim.RAdam)
def _radam(optimizer, group):
    return [
        _step_spec(group, fused_key=False),
        zeros_like("exp_avg"),
        zeros_like("exp_avg_sq"),
    ]


@register_optimizer_schema(torch.optim.RMSprop)
def _rmsprop(optimizer, group):
    specs = [_step_spec(group, fused_key=False), zeros_like("square_avg")]
    if group.get("momentum", 0) > 0:
        specs.append(zeros_like("momentum_buffer"))
    if group.get("centered"):
        specs.append(zeros_like("grad_avg"))
    return specs


@register_optimizer_schema(torch.optim.Rprop)
def _rprop(optimizer, group):
    lr = _to_scalar(group["lr"])
    return [
        _step_spec(group, fused_key=False),
        zeros_like("prev"),
        full_like("step_size", lr, complex_value=complex(lr, lr)),
    ]


@register_optimizer_schema(torch.optim.SparseAdam)
def _sparse_adam(optimizer, group):
    return [
        StateSpec("step", int, (0,)),
        zeros_like("exp_avg"),
        zeros_like("exp_avg_sq"),
    ]


@register_optimizer_schema(torch.optim.LBFGS)
def _lbfgs(optimizer, group):
    # LBFGS keeps one global state under its first parameter, created by
    # its first step(); absent state is exactly its pristine state.
    return None


if hasattr(torch.optim, "Muon"):

    @register_optimizer_schema(torch.optim.Muon)
    def _muon(optimizer, group):
        return [zeros_like("momentum_buffer")]


def _factored_shape(p: torch.Tensor, last: bool) -> torch.Tensor:
    shape = list(p.shape)
    shape[-1 if last else -2] = 1
    return p.new_zeros(shape)


if hasattr(torch.optim, "Adafactor"):

    @register_optimizer_schema(torch.optim.Adafactor)
    def _adafactor(optimizer, group):
        return [
            scalar("step", 0.0, dtype=_get_scalar_dtype(), on_param_device=False),
            StateSpec("row_var", _factored_shape, (PARAM, True), None, None, (2, 1 << 30)),
            StateSpec("col_var", _factored_shape, (PARAM, False), None, None, (2, 1 << 30)),
            zeros_like("variance", dims=(0, 1)),
        ]


# --- optimizers without a schema ---------------------------------------------

_warned: set[type] = set()

_CONTAINERS = (list, tuple, dict, set)


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

    def __init__(self, params: dict[int, torch.Tensor]):
        self.memo: dict[int, Any] = {}
        self.params = params  # id(real param) -> its stand-in
        self.keep: list[Any] = []  # originals, so their ids stay unique

    def value(self, v: Any) -> Any:
        key = id(v)
        if key in self.memo:
            return self.memo[key]
        out: Any
        if isinstance(v, torch.Tensor):
            out = self.params.get(key)
            if out is None:
                out = v.detach().clone()
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
        """Per-parameter state starts empty; entries under other keys
        (SPAM's ``state['current_step']``) are copied.  One per original
        (a wrapper sharing its inner optimizer's state keeps sharing)."""
        if id(v) in self.memo:
            return self.memo[id(v)]
        fresh: Any = defaultdict(dict)
        self.memo[id(v)] = fresh
        self.keep.append(v)
        for k, x in v.items():
            if not isinstance(k, torch.Tensor):
                fresh[k] = self.value(x)
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
    saved = [dict(t) for t in tables]
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
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _own(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_own(v) for v in value)
    return value


def fallback_pristine(
    optimizer: torch.optim.Optimizer, params: list[torch.Tensor]
) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]]]:
    """Pristine state of ``params`` (trainable parameters of ``optimizer``
    without state) for an optimizer class with no schema: what a real first
    step creates, from the parameters' real values, keyed by ``id(param)``;
    with it, per live param group, the group keys that step adds
    (pytorch-optimizer's ``group['step']``, Prodigy's running sums).

    A shadow of the optimizer (see :class:`_Shadow`: its constructor never
    runs) holding a detached clone of every parameter and empty state takes
    one step of its class under ``torch.no_grad``: every parameter gets a
    zero gradient and every group ``lr`` 0, as in upstream's initialising
    step (the real ``lr`` where that step raises), so that state derived
    from the parameters (schedule-free's ``z``, Prodigy's ``p0``, an EMA of
    the weights) starts from their real values.  A second shadow step with
    unit gradients and the real ``lr`` adds the keys some optimizers create
    only for a nonzero update (D-Adapt SGD, Prodigy's ``d`` sums), with that
    step's values.  A step that raises is retried on a fresh shadow with a
    closure returning a zero loss, then with gradients carrying a graph
    (Hessian-vector products); the last failure is re-raised.  The
    optimizer's own step hooks run with the shadow as
    their optimizer (an EMA kept by ``register_step_post_hook`` is state a
    real step creates); the process-wide ones do not (see
    :func:`_no_global_step_hooks`).  Counters named ``step`` are reset to
    0, every tensor is a fresh copy (no two share storage).  The live
    optimizer, its groups, parameters, gradients and hooks are untouched;
    a hook or step that reaches the live objects through a closure rather
    than its ``optimizer`` argument is outside this guarantee.  Cost: two
    steps over a copy of the parameters, freed on return -- only for
    optimizers without a schema, only while some parameter lacks state.
    """
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
    # Pass 1, zero gradients and lr 0: the values.  Pass 2, unit gradients
    # and the group's lr: the keys that some optimizers create only for a
    # nonzero update (D-Adapt SGD's state, Prodigy's d sums), added with
    # pass 2's values where pass 1 lacks them.
    states: dict[int, dict[str, Any]] = {}
    group_keys: list[dict[str, Any]] | None = None
    for grad_value in (0.0, 1.0):
        failures: list[BaseException] = []
        # lr 0 first (pass 1); without a closure, then with one returning
        # a zero loss (LBFGS-like and AliG-like steps): a fresh shadow each
        # last, gradients with a graph (AdaHessian and SophiaH take
        # Hessian-vector products of them: here the Hessian is 0)
        lrs = (True, False) if grad_value == 0.0 else (False,)
        tries = [(z, c, False) for z in lrs for c in (False, True)] + [(z, False, True) for z in lrs]
        for zero_lr, closure, graph in tries:
            try:
                got, keys = _shadow_step(optimizer, wanted, zero_lr, grad_value, closure, graph)
                break
            except Exception as exc:  # noqa: BLE001 - retried, then re-raised
                failures.append(exc)
        else:
            if grad_value:  # pass 1 succeeded: keep what it gave
                break
            raise failures[-1]
        for pid, st in got.items():
            merged = states.setdefault(pid, st)
            if merged is not st:
                for k, v in st.items():
                    merged.setdefault(k, v)
        if group_keys is None:
            group_keys = keys
        else:
            for mine, theirs in zip(group_keys, keys):
                for k, v in theirs.items():
                    mine.setdefault(k, v)
    return states, group_keys or []


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
    return _shadow_step(optimizer, {id(p) for p in params}, True, 0.0, False, own_key=inner_key)


def _shadow_step(
    optimizer: torch.optim.Optimizer,
    wanted: set[int],
    zero_lr: bool,
    grad_value: float,
    closure: bool,
    graph: bool = False,
    own_key: Any = None,
) -> tuple[Any, list[dict[str, Any]]]:
    stand_ins: dict[int, torch.Tensor] = {}
    order: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) in stand_ins:
                    continue
                clone = p.detach().clone()
                if p.requires_grad:
                    clone.requires_grad_(True)
                    if graph:
                        with torch.enable_grad():
                            clone.grad = clone * 0.0 + grad_value
                    else:
                        clone.grad = torch.full_like(clone, grad_value)
                stand_ins[id(p)] = clone
                order.append((p, clone))
    sh = _Shadow(stand_ins)
    shadow = sh.optimizer(optimizer)
    live_keys = [set(g) for g in optimizer.param_groups]
    if zero_lr:
        for group in shadow.param_groups:
            lr = group.get("lr")
            if isinstance(lr, torch.Tensor):
                group["lr"] = torch.zeros_like(lr)
            elif isinstance(lr, (int, float)) and not isinstance(lr, bool):
                group["lr"] = 0.0
    with torch.no_grad(), _no_global_step_hooks():
        if closure:
            # torch hints a closure as returning float; a loss tensor is
            # what training closures return.
            shadow.step(lambda: torch.zeros(()))  # type: ignore[arg-type,return-value]
        else:
            shadow.step()
    new_keys = []
    for keys, group in zip(live_keys, shadow.param_groups):
        new_keys.append(_zero_steps(_own({k: v for k, v in group.items() if k not in keys})))
    if own_key is not None:
        own = shadow.state_dict()
        return {k: _zero_steps(_own(v)) for k, v in own.items() if k != own_key}, new_keys
    states: dict[Any, Any] = {}
    for p, clone in order:
        if id(p) in wanted and clone in shadow.state:
            states[id(p)] = _zero_steps(_own(dict(shadow.state[clone])))
    # optimizer-wide entries the step created (str keys: MADGRAD's "k"),
    # under OPTIMIZER_WIDE beside the parameters' ids (D29)
    wide = {k: _zero_steps(_own(v)) for k, v in shadow.state.items() if isinstance(k, str)}
    if wide:
        states[OPTIMIZER_WIDE] = wide
    return states, new_keys


#: Key of fallback_pristine's result holding the optimizer-wide entries
#: (str keys of ``optimizer.state``) a first step creates.
OPTIMIZER_WIDE = ".optimizer-wide"  # a leading dot: no FQN
