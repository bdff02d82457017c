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
declare theirs with :func:`register_optimizer_schema`.  A proxy that holds
another optimizer and adds no state (accelerate's ``AcceleratedOptimizer``)
uses the schema of the optimizer it wraps unless
its own class has one.  An optimizer without a schema gets its pristine
state from a shadow step (``dcp_optim._engine.shadow``): a copy of the
optimizer object, built without its constructor, over copies of the real
parameters, takes the step a real first step would, and its counters named
``step`` are reset to zero; where that gives no complete template, one step
of the real optimizer with zero gradients, every side effect undone
(upstream's method); where that fails too, the getter raises
:class:`dcp_optim.errors.IncompleteTemplateError`.  A warning names the
classes that take the shadow step once.

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

import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.optim.optimizer import _get_scalar_dtype, _to_scalar

__all__ = [
    "PARAM",
    "PARAM_DEVICE",
    "StateSpec",
    "full_like",
    "lbfgs_pristine",
    "proxied",
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


def _class_schema(cls: type) -> SchemaFn | None:
    fn = _registry.get(cls)
    if fn is not None:
        return fn
    for base in cls.__mro__[1:]:
        fn = _registry.get(base)
        if fn is not None and _same_step(cls, base):
            return fn
    return None


# Classes known to be pure proxies, with the attribute holding the
# optimizer every call goes to: accelerate's ``AcceleratedOptimizer`` adds
# only gradient scaling and device placement, torch's
# ``PostLocalSGDOptimizer`` only the averaging of the parameters after each
# step (and the averager's counter, a top-level entry of its own
# state_dict()), no per-parameter state.  A wrapper that shares its inner
# optimizer's ``param_groups`` and ``state`` but adds state of its own
# (pytorch-optimizer's TRAC adds ``group['step']``) is no proxy: it keeps
# the shadow step.
_PROXIES = {
    ("accelerate.optimizer", "AcceleratedOptimizer"): "optimizer",
    ("torch.distributed.optim.post_localSGD_optimizer", "PostLocalSGDOptimizer"): "optim",
}
# Proxies whose own step communicates (PostLocalSGDOptimizer all-reduces
# the parameters): a shadow step, or upstream's step undone, would wait on
# a rank that calls alone.  They step their inner optimizer (step_target).
_COMMUNICATING = {("torch.distributed.optim.post_localSGD_optimizer", "PostLocalSGDOptimizer")}


def _proxy_attribute(optimizer: Any) -> str | None:
    cls = type(optimizer)
    try:
        return _PROXY_ATTRIBUTES[cls]
    except KeyError:
        pass
    attr = next((a for c in cls.__mro__ if (a := _PROXIES.get((c.__module__, c.__qualname__)))), None)
    _PROXY_ATTRIBUTES[cls] = attr
    return attr


# class -> its proxy attribute (None: no proxy); weak, as classes come and go
_PROXY_ATTRIBUTES: weakref.WeakKeyDictionary[type, str | None] = weakref.WeakKeyDictionary()


def proxied(optimizer: Any) -> Any:
    """The optimizer a proxy wraps, at any depth: for a known proxy class
    (accelerate's ``AcceleratedOptimizer``: ``.optimizer``; torch's
    ``PostLocalSGDOptimizer``: ``.optim``), the optimizer it holds when that
    shares the proxy's ``param_groups`` and ``state``; ``optimizer``
    itself otherwise."""
    seen = {id(optimizer)}
    while (attr := _proxy_attribute(optimizer)) is not None:
        inner = getattr(optimizer, attr, None)
        if (
            not isinstance(inner, torch.optim.Optimizer)
            or id(inner) in seen
            or getattr(inner, "param_groups", None) is not getattr(optimizer, "param_groups", None)
            or getattr(inner, "state", None) is not getattr(optimizer, "state", None)
        ):
            return optimizer
        optimizer = inner
        seen.add(id(optimizer))
    return optimizer


def step_target(optimizer: Any) -> Any:
    """What a shadow step (or upstream's step, undone) of ``optimizer``
    steps: the optimizer a communicating proxy wraps (its own step adds
    collectives, no state), ``optimizer`` itself otherwise."""
    if any((c.__module__, c.__qualname__) in _COMMUNICATING for c in type(optimizer).__mro__):
        inner = proxied(optimizer)
        if inner is not optimizer:
            return inner
    return optimizer


def schema_for(optimizer: torch.optim.Optimizer) -> SchemaFn | None:
    """The registered schema of the optimizer's class, or of a registered
    base class the optimizer shares its step with; for a proxy without
    one (see :func:`proxied`), the schema of the optimizer it wraps;
    ``None`` if none."""
    fn = _class_schema(type(optimizer))
    if fn is not None:
        return fn
    inner = proxied(optimizer)
    return None if inner is optimizer else _class_schema(type(inner))


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
    # LBFGS keeps no per-parameter state: one optimizer-wide entry under
    # its first parameter (see lbfgs_pristine), which the getter adds.
    return None


def lbfgs_pristine(optimizer: torch.optim.LBFGS) -> dict[str, Any] | None:
    """The entry torch's LBFGS keeps under its first parameter, with the
    keys one real (single-iteration) step creates -- ``func_evals``,
    ``n_iter``, the flat direction ``d``, ``t``, the history lists
    ``old_dirs``/``old_stps``/``ro``, ``H_diag``, ``prev_flat_grad`` and
    ``prev_loss`` -- holding values the next step treats exactly as no
    state (``n_iter`` 0: that step starts the history afresh; it overwrites
    ``prev_flat_grad`` in place).  The history lists are empty: a trained
    LBFGS's are not, and DCP cannot load lists of another length into
    them (``dcp.load`` raises on the missing keys rather than dropping the
    history).  ``None`` for an LBFGS without parameters."""
    params = getattr(optimizer, "_params", None)
    if not params:
        return None
    first = params[0]
    numel = sum(p.numel() for p in params)
    flat = dict(dtype=first.dtype, device=first.device)
    return {
        "func_evals": 0,
        "n_iter": 0,
        "d": torch.zeros(numel, **flat),
        "t": 0.0,
        "old_dirs": [],
        "old_stps": [],
        "ro": [],
        "H_diag": 1,
        "prev_flat_grad": torch.zeros(numel, **flat),
        "prev_loss": 0.0,
    }


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
