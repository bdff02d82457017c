"""Model state dicts: get (canonical FQNs) and set (wrapper keys restored).

Per-key work -- canonicalising every key of ``model.state_dict()``,
dropping frozen parameters, re-keying for ``load_state_dict``, merging a
full state dict -- runs in the C core; this module sequences it.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from types import CodeType
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.module import _IncompatibleKeys

# torch/nn/parameter.pyi leaves out the mixin parameter.py defines and exports.
from torch.nn.parameter import UninitializedTensorMixin, is_lazy  # type: ignore[attr-defined]

from .. import errors
from .core import C, context
from .own_calls import is_patched, state_dict_fn
from .pipeline import Prepared
from .tree import maybe_full_or_cpu_state_dict

__all__ = ["ModelLoad", "get_model", "load_model", "unflatten_model_state_dict"]

@torch.no_grad()
def get_model(model: nn.Module, info: Any) -> dict[str, Any]:
    if not info.handle_model:
        return {}
    if info.fsdp_modules:
        # FSDP's own state dict communicates (full: it gathers every flat
        # parameter; sharded: its ShardedTensors): the ranks meet
        # (bounded) and agree first
        from .fsdp1 import check_before_fsdp, getter_options

        check_before_fsdp(model, info, "FSDP1 model state dict", getter_options(info))
        from .fsdp1 import resharded_on_failure

        with resharded_on_failure(info), info.fsdp_context():
            state_dict = state_dict_fn(model, "state_dict")()
        if not info.full_state_dict:
            from .fsdp1 import complete_chunks_of

            complete_chunks_of(state_dict)
    else:
        # torch's model.state_dict() built in C where that call would run
        # none of the model's own code (no hooks, no overridden save
        # methods: csrc/model_save.c); torch's call everywhere else
        state_dict = C.plain_state_dict(context(), model)
        if state_dict is None:
            with info.fsdp_context():
                state_dict = state_dict_fn(model, "state_dict")()
    if not _keys_are_canonical(info.index, state_dict):
        C.canonicalize_model_keys(context(), model, state_dict, info.dsd_fqn_modifiers)
    if info.submodule_prefixes:
        state_dict = C.filter_prefixes(
            state_dict, list(info.submodule_prefixes), info.keep_submodule_prefixes
        )
    if info.ignore_frozen_params:
        C.drop_frozen(info.index, state_dict)
    return maybe_full_or_cpu_state_dict(state_dict, info)


def _keys_are_canonical(index: Any, state_dict: Any) -> bool:
    """True when canonicalising ``state_dict`` would rename nothing: every
    key is a name the walk recorded as its own FQN, in a tree whose walk is
    replayable (``index.trace``: no modifier hooks, no FSDP1, no overridden
    ``named_*``/``get_extra_state``/attribute access -- csrc/walk.c).
    Resolving such a name (upstream's ``_get_fqns``) steps through
    registered, unwrapped modules only and returns it unchanged."""
    if index is None or index.trace is None or not isinstance(state_dict, dict):
        return False
    names = _canonical_names(index)
    return names is not None and state_dict.keys() <= names


#: The set of a walk trace's raw names, or None where one differs from its
#: FQN, per trace: every index built from one trace (its walk, its
#: replays) has the same names (csrc/walk_cache.c), so the set is built
#: once per trace instead of once per call (at 10k tensors, 2% of the
#: getter).  Keyed by the trace's id; the entry holds the trace (not the
#: model), so the id is not reused while it is cached.
_CANONICAL_NAMES: dict[int, tuple[Any, frozenset[str] | None]] = {}
_CANONICAL_NAMES_MAX = 8


def _canonical_names(index: Any) -> frozenset[str] | None:
    trace = index.trace
    entry = _CANONICAL_NAMES.get(id(trace))
    if entry is not None and entry[0] is trace:
        return entry[1]
    raw = index.raw_names
    # None: a wrapper level or a hidden child somewhere
    names = frozenset(raw) if raw == index.fqns else None
    if len(_CANONICAL_NAMES) >= _CANONICAL_NAMES_MAX:
        try:
            del _CANONICAL_NAMES[next(iter(_CANONICAL_NAMES))]
        except (KeyError, StopIteration, RuntimeError):  # another thread got there
            pass
    _CANONICAL_NAMES[id(trace)] = (trace, names)
    return names


def unflatten_model_state_dict(
    model: nn.Module, state_dict: dict[Any, Any]
) -> dict[str, Any]:
    """The deprecated ``{submodule: state_dict}`` form, flattened (W2, E25)."""
    if not isinstance(state_dict, dict):
        raise errors.StateDictTypeError(
            f"model state dict must be a dict, not {type(state_dict).__name__}"
        )
    if not state_dict:
        return {}
    if isinstance(next(iter(state_dict.keys())), nn.Module):
        warnings.warn(errors.W2_MODULE_KEYED, FutureWarning, stacklevel=3)
        ctx = context()
        new_state_dict: dict[str, Any] = {}
        for submodule, sub_state_dict in state_dict.items():
            for name, module in model.named_modules():
                if module != submodule:
                    continue
                fqns = C.get_fqns(ctx, model, name, "_fqn_modifiers", True, True)
                if len(fqns) != 1:
                    raise AssertionError(errors.E25_SUBMODULE_FQNS)
                prefix = f"{next(iter(fqns))}."
                new_state_dict.update(
                    {prefix + subfqn: value for subfqn, value in sub_state_dict.items()}
                )
        return new_state_dict
    return cast(dict[str, Any], state_dict)


def _load_device(
    info: Any, local: dict[str, Any], lazy: bool = False
) -> tuple[torch.device, bool]:
    """Upstream's device choice for full/broadcast loads: the one device of
    the local tensors with dim() > 0 (meta dropped, then ``assign=True``).
    Lazy parameters, which have no dim() yet, take no part (upstream
    raises on them; torch's load materializes them)."""
    values = [v for v in local.values() if not is_lazy(v)] if lazy else list(local.values())
    devices = C.tensor_devices(context(), values)
    assign = False
    meta = torch.device("meta")
    if meta in devices:
        devices.remove(meta)
        assign = True
    if not devices:
        devices.append(dist.distributed_c10d._get_pg_default_device())
    elif len(devices) > 1:
        raise ValueError(errors.E14_MULTIPLE_DEVICES)
    return devices[0], assign


@torch.no_grad()
def load_model(
    model: nn.Module, state_dict: dict[str, Any], info: Any
) -> _IncompatibleKeys:
    return prepare_model(model, state_dict, info)()


@torch.no_grad()
def prepare_model(model: nn.Module, state_dict: dict[str, Any], info: Any) -> Callable[[], Any]:
    """Everything of a model load that can fail or communicate; returns
    commit(), which runs model.load_state_dict on the validated dict.
    (Single-caller form of ``ModelLoad``, without agreement.)"""
    from .pipeline import run_alone

    return run_alone(ModelLoad(model, state_dict, info), info).install


def _noop_commit() -> _IncompatibleKeys:
    return _IncompatibleKeys({}, {})  # upstream's, dicts included


class ModelLoad:
    """A model load as a ``pipeline.LoadPart``: ``plan`` runs the local
    checks (and returns the source's metadata on broadcast loads),
    ``validate`` the validation of the whole load, ``move`` the data
    movement and the checks on the moved data, ``commit`` torch's
    ``load_state_dict`` (or its native equivalent).  Run under no_grad."""

    name = "model"

    def __init__(self, model: nn.Module, state_dict: dict[str, Any], info: Any):
        self.model = model
        self.state_dict = state_dict
        self.info = info
        self.noop = not info.handle_model or (not state_dict and not info.broadcast_from_rank0)
        self.full_load: Any = None  # distribute.ModelFullLoad of full/broadcast loads
        self.load_sd: dict[str, Any] = {}
        self.assign = False
        self.full_path = False
        self.native_checks = False
        self.rules: LoadPlan = _NATIVE_PLAN
        # torch's own load decides at commit (a module's load rules or
        # hooks): its commit can fail, on some ranks only
        self.can_fail = False
        self.snapshot: _Snapshot | None = None
        # FSDP1: an error of torch's load that did not come from a module's
        # own load code (FSDP's hooks, a peer that died in their gathers):
        # the ranks are not all where an agreement meets, it propagates
        self.fatal: list[BaseException] = []
        # FSDP1: its load hooks gather at commit (set in plan)
        self.collective_commit = False

    def plan(self) -> Any:
        if self.noop:
            return None
        from .distribute import ModelFullLoad, collective_device, route_for

        model, info = self.model, self.info
        rules = self.rules = load_plan(model, info)
        full_path = self.full_path = info.broadcast_from_rank0 or info.full_state_dict
        route = route_for(info.index, None) if info.broadcast_from_rank0 else None
        rename = route is None or route.is_source
        # A private, re-keyed view: the caller's dict is never mutated (D11).
        load_sd, local = C.rename_for_load(
            info.index, self.state_dict, info.strict, rename, full_path
        )
        self.load_sd = load_sd
        # Load rules only the modules' own code knows (rules.torch_path): no
        # up-front key check; torch's load decides at commit.
        native_checks = self.native_checks = not info.fsdp_modules and not rules.torch_path
        # FSDP1: FSDP's own load hooks alone send every model down torch's
        # path, and make their collectives on every rank alike; only the
        # modules' own load code can fail on some ranks only
        self.can_fail = rules.torch_path and (not info.fsdp_modules or _has_own_load_code(model))
        self.collective_commit = bool(info.fsdp_modules)
        if full_path:
            device, self.assign = _load_device(info, local, rules.lazy)
            # Where the model load's checks can run before any data moves, the
            # shards are written straight into the parameters (see
            # _distribute); FSDP1 and models whose modules decide their own
            # load rules keep the load-then-copy path.
            precheck = None
            if native_checks:
                def precheck(sd: dict[str, Any]) -> None:
                    check_load(model, sd, info, rules)
            else:
                info.validated_after_move = True
            if route is not None:
                route.device = collective_device(device, info.index)
            self.full_load = ModelFullLoad(
                load_sd, local, device, route=route, strict=info.strict,
                cpu_offload=info.cpu_offload, precheck=precheck, info=info,
            )
            return self.full_load.source_meta()
        if native_checks:
            check_load(model, load_sd, info, rules)
        return None

    def validate(self, meta: Any) -> None:
        if self.full_load is not None:
            self.full_load.validate(meta)

    def move(self) -> Prepared:
        if self.noop:
            return Prepared(_noop_commit)
        model, info, rules = self.model, self.info, self.rules
        load_sd = self.load_sd
        if self.full_load is not None:
            load_sd = self.full_load.move()
            if self.native_checks:
                check_load(model, load_sd, info, rules)
        # A sharded load of the views a getter returned (the DCP resume),
        # or a full / broadcast load whose move wrote the shards straight
        # into the parameters: torch's load would copy each one onto itself.
        if self.native_checks and not self.assign:
            aliased = aliased_commit(model, load_sd, info, rules)
            if aliased is not None:
                return Prepared(aliased)
        if self.can_fail:
            # torch's load decides, at commit: the setters commit the model
            # before the optimizer, and what it wrote is put back if it
            # raises here, or if it raised on another rank (rollback).
            return Prepared(functools.partial(self._staged_load, load_sd))
        return Prepared(functools.partial(_torch_load, model, load_sd, info, self.assign, self.fatal))

    def commit(self, prepared: Prepared) -> _IncompatibleKeys:
        return cast(_IncompatibleKeys, prepared.install())

    def stage(self) -> None:
        """Before a commit that another rank's failure can undo: snapshot
        what it changes (one copy of the model's tensors, held until the
        ranks agreed on the outcome)."""
        if self.snapshot is None and not self.noop:
            self.snapshot = _Snapshot(self.model)

    def _staged_load(self, load_sd: dict[str, Any]) -> _IncompatibleKeys:
        """torch's load with a snapshot of what it can change taken first
        (one copy of the model's tensors), kept until ``rollback`` or the
        end of the load: restored here if it raises."""
        if self.snapshot is None:
            self.snapshot = _Snapshot(self.model)
        try:
            return _torch_load(self.model, load_sd, self.info, self.assign, self.fatal)
        except BaseException:
            self.rollback()
            raise

    def stream_paths(self) -> int:
        """Which of a broadcast load's tensors are scattered (a digest,
        after ``validate``; 0 for other loads)."""
        return self.full_load.stream_paths() if self.full_load is not None else 0

    def broadcast_all(self) -> None:
        if self.full_load is not None:
            self.full_load.broadcast_all()

    def reserve(self) -> None:
        """Before the agreement ahead of a broadcast load's stream: what
        the stream allocates (``distribute.StreamPlan``)."""
        if self.full_load is not None:
            self.full_load.reserve()

    def inline_values(self) -> Any:
        """On a broadcast load's source: the dict whose tensors may travel
        inline (``payload``), else None."""
        return self.full_load.inline_values() if self.full_load is not None else None

    def take_inline(self, values: Any) -> None:
        """The source's dict arrived inline: ``move`` slices it locally."""
        if self.full_load is not None and values is not None:
            self.full_load.take_inline(values)

    def abort(self) -> None:
        """Put back what ``move`` wrote into live tensors (an in-place
        full or broadcast load) when the load fails after it."""
        if self.full_load is not None:
            self.full_load.abort()

    def rollback(self) -> None:
        """Put back what a committed load changed (the load failed on
        another rank, after this rank's commit)."""
        snapshot, self.snapshot = self.snapshot, None
        if snapshot is not None:
            snapshot.restore()


def _torch_load(
    model: nn.Module, load_sd: dict[str, Any], info: Any, assign: bool,
    fatal: list[BaseException] | None = None,
) -> _IncompatibleKeys:
    if info.fsdp_modules:  # FSDP's load hooks unshard (gather) its flat parameters
        from .fsdp1 import resharded_on_failure

        with resharded_on_failure(info), info.fsdp_context(), _holding_own_errors(model) as held:
            try:
                report = state_dict_fn(model, "load_state_dict")(
                    state_dict=load_sd, strict=info.strict, assign=assign
                )
            except BaseException as exc:
                if held.errors:
                    raise held.errors[0]  # noqa: B904 - the module's own error, as raised
                if not held.completed and fatal is not None:
                    fatal.append(exc)
                raise
            if held.errors:
                raise held.errors[0]
            return cast(_IncompatibleKeys, report)
    with info.fsdp_context():
        return cast(
            _IncompatibleKeys,
            state_dict_fn(model, "load_state_dict")(
                state_dict=load_sd, strict=info.strict, assign=assign
            ),
        )


class _Held:
    """What ``_holding_own_errors`` caught, and whether torch's recursion
    over the modules ran to its end (its strict check, which makes no
    collective, comes after)."""

    def __init__(self) -> None:
        self.errors: list[Exception] = []
        self.completed = False


_POST_HOOK_RETURNED = (
    "Hooks registered with ``register_load_state_dict_post_hook`` are not "
    "expected to return new values, if incompatible_keys need to be modified, "
    "it should be done inplace."
)


def _runs_own_load(module: nn.Module) -> bool:
    """Whether a module's ``_load_from_state_dict`` runs code of its own:
    an override, load pre-hooks (which it runs), set_extra_state."""
    tp = type(module)
    return (
        tp._load_from_state_dict is not _MODULE_LOAD
        or "_load_from_state_dict" in module.__dict__
        or bool(module._load_state_dict_pre_hooks)
        or tp.set_extra_state is not nn.Module.set_extra_state
    )


def _fsdp1_class() -> type:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel


def _has_own_load_code(model: nn.Module) -> bool:
    """FSDP1 models: whether a module other than FSDP's own instances
    decides its own load (load_plan's tests, FSDP's hooks left out): its
    commit can then fail on some ranks only."""
    fsdp = _fsdp1_class()
    for module in model.modules():
        if isinstance(module, fsdp):
            continue
        tp = type(module)
        if _has_own_hooks(module) or "_load_from_state_dict" in module.__dict__:
            return True
        if tp._load_from_state_dict not in (_MODULE_LOAD, _NORM_LOAD):
            return True
        if (tp.get_extra_state is not nn.Module.get_extra_state
                or tp.set_extra_state is not nn.Module.set_extra_state):
            return True
        if any(t is not None and is_lazy(t) for t in (*module._parameters.values(), *module._buffers.values())):
            return True
    return False


@contextlib.contextmanager
def _holding_own_errors(model: nn.Module) -> Iterator[_Held]:
    """Around torch's load of an FSDP1 model: what the modules' own load
    code raises -- a module's ``_load_from_state_dict`` (with its load
    pre-hooks) and its load post-hooks, FSDP instances left out -- is held
    (``_Held.errors``, in order) instead of leaving the recursion, so that
    every FSDP unit's hooks, and their gathers, run on every rank as on
    the others; the caller raises the first.  FSDP's own hooks are not
    wrapped: a peer that died in their gathers raises at once.  Temporary:
    instance attributes shadow the modules' ``_load_from_state_dict`` and
    the post-hook entries are wrapped until the load returns."""
    held = _Held()
    fsdp = _fsdp1_class()
    shadowed: list[tuple[nn.Module, Any]] = []
    wrapped: list[tuple[dict[Any, Any], Any, Any, Any]] = []

    def holding_load(load: Callable[..., Any]) -> Callable[..., None]:
        def call(*args: Any, **kwargs: Any) -> None:
            try:
                load(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - held, raised after the load
                held.errors.append(exc)
        return call

    def holding_post(hook: Any) -> Callable[[nn.Module, Any], None]:
        def call(module: nn.Module, incompatible_keys: Any) -> None:
            try:
                out = hook(module, incompatible_keys)
            except Exception as exc:  # noqa: BLE001 - held, raised after the load
                held.errors.append(exc)
                return
            if out is not None:
                held.errors.append(AssertionError(_POST_HOOK_RETURNED))
        return call

    def completed(module: nn.Module, incompatible_keys: Any) -> None:
        held.completed = True

    done = None
    try:
        for module in model.modules():
            if isinstance(module, fsdp):
                continue
            if _runs_own_load(module):
                own = module.__dict__.get("_load_from_state_dict", _ABSENT)
                load = module._load_from_state_dict
                shadowed.append((module, own))
                module.__dict__["_load_from_state_dict"] = holding_load(load)
            hooks = module._load_state_dict_post_hooks
            for key, hook in list(hooks.items()):
                wrapper = holding_post(hook)
                wrapped.append((hooks, key, hook, wrapper))
                hooks[key] = wrapper
        done = model.register_load_state_dict_post_hook(completed)  # the last to run
        yield held
    finally:
        if done is not None:
            done.remove()
        for hooks, key, hook, wrapper in wrapped:
            if hooks.get(key) is wrapper:
                hooks[key] = hook
        for module, own in shadowed:
            if own is _ABSENT:
                module.__dict__.pop("_load_from_state_dict", None)
            else:
                module.__dict__["_load_from_state_dict"] = own


_ABSENT = object()


def aliased_commit(
    model: nn.Module, load_sd: dict[str, Any], info: Any, rules: LoadPlan
) -> Callable[[], _IncompatibleKeys] | None:
    """The commit of a sharded load whose every value holds the same data
    as the tensor it loads into (C.aliased_load: the DCP resume, which
    loads into the views get_state_dict returned), or None.  There
    model.load_state_dict copies every tensor onto itself, a copy aten
    returns from early, after walking the module tree with a filter of
    the whole dict per child (quadratic in a module's children); what
    remains of it is run here: the load hooks of the modules (only
    FSDP2's, which reshard and re-register the sharded parameters) and
    the version counters copy_ bumps.  The keys are exactly the model's,
    so the report is empty, as torch's."""
    index = info.index
    if (
        rules is not _NATIVE_PLAN
        or nn.Module.load_state_dict is not _TORCH_LOAD
        or index is None
        or index.shared_modules
        or torch.__future__.get_swap_module_params_on_conversion()
        or _assigns(load_sd)
    ):
        return None
    fsdp2 = _fsdp2_hook_codes()
    pre_hooks: list[Any] = []
    post_hooks: list[tuple[nn.Module, Any, Any]] = []
    for module in index.load_modules:
        if type(module)._load_from_state_dict is not _MODULE_LOAD:
            return None
        for hook in module._load_state_dict_pre_hooks.values():
            if _hook_code(hook) not in fsdp2:
                return None
            pre_hooks.append(hook)
        for hook in module._load_state_dict_post_hooks.values():
            if _hook_code(hook) not in fsdp2:
                return None
            post_hooks.append((module, hook, _closure_self(hook)))
    targets = C.aliased_load(index, load_sd, _DTensor(), _PLAIN_TYPES, torch.strided)
    if targets is None:
        return None
    strict = info.strict

    def commit() -> _IncompatibleKeys:
        missing: list[str] = []
        unexpected: list[str] = []
        error_msgs: list[str] = []
        for hook in pre_hooks:
            hook({}, "", {}, strict, missing, unexpected, error_msgs)
        if targets:
            torch.autograd.graph.increment_version(targets)
        report = _IncompatibleKeys(missing, unexpected)
        for module, hook, fsdp_param in post_hooks:
            if fsdp_param is not None and _reset_is_noop(fsdp_param):
                continue
            if hook(module, report) is not None:
                raise AssertionError(
                    "Hooks registered with ``register_load_state_dict_post_hook`` are not "
                    "expected to return new values, if incompatible_keys need to be modified, "
                    "it should be done inplace."
                )
        return _IncompatibleKeys(missing, unexpected)

    return commit


_PLAIN_TYPES = (torch.Tensor, nn.Parameter)


def _closure_self(hook: Any) -> Any:
    """The FSDPParam an FSDP2 post-hook (``lambda: self.reset_sharded_param()``)
    closes over, or None."""
    fn = getattr(hook, "hook", hook)
    code = getattr(fn, "__code__", None)
    closure = getattr(fn, "__closure__", None)
    if code is None or not closure or "self" not in code.co_freevars:
        return None
    owner = closure[code.co_freevars.index("self")].cell_contents
    return owner if hasattr(owner, "reset_sharded_param") else None


def _reset_is_noop(fsdp_param: Any) -> bool:
    """True when FSDPParam.reset_sharded_param would change nothing: the
    module still holds the sharded parameter, whose local tensor (not
    meta) lives in the padded storage FSDP2 keeps (so nothing is re-padded
    nor re-registered), pinned where it must be, and the sharding spec is
    the parameter's own.  Mirrors torch 2.13's reset_sharded_param."""
    try:
        info = fsdp_param._module_info
        param = fsdp_param.sharded_param
        if getattr(info.module, info.param_name) is not param:
            return False
        local = param._local_tensor
        if local.is_meta:
            return True
        data = fsdp_param._sharded_param_data
        if type(data) is not torch.Tensor:
            return False
        ptr = data.untyped_storage().data_ptr()
        if ptr <= 0 or ptr != local.untyped_storage().data_ptr():
            return False
        if fsdp_param.pin_memory and not local.is_pinned():
            return False
        return fsdp_param._sharding_spec is param._spec
    except AttributeError:  # another torch's FSDPParam: its hook decides
        return False


def _DTensor() -> type:  # noqa: N802 - a class
    from torch.distributed.tensor import DTensor

    return DTensor


def _assigns(load_sd: Any) -> bool:
    """A ``_metadata`` entry asking load_state_dict to assign (replace the
    tensors) instead of copying."""
    metadata = getattr(load_sd, "_metadata", None)
    if not metadata:
        return False
    return any(isinstance(m, dict) and m.get("assign_to_params_buffers") for m in metadata.values())


def check_load(
    model: nn.Module, load_sd: dict[str, Any], info: Any, plan: LoadPlan | None = None
) -> None:
    """Raise what model.load_state_dict would raise, before it copies a
    single tensor: torch copies parameter by parameter and reports errors
    at the end, which leaves a half-loaded model behind.  Same text as
    torch's.  Only for models whose load rules the native checks reproduce
    (load_plan: a module's own key-editing rules send the model down
    torch's path instead)."""
    index = info.index
    fills = norm_fills(plan, index, load_sd) if plan is not None else None
    if fills:
        # What BatchNorm's _load_from_state_dict inserts before loading
        # (torch inserts the same values itself: the check only sees them).
        load_sd = dict(load_sd)
        load_sd.update(fills)
    # A module under several paths (``self.b = self.a``): the walk, like
    # upstream's, keeps the first path, but load_state_dict recurses into
    # every one and wants the keys under each; those come from torch's own
    # state_dict() (rare: one extra Python walk).
    missing, unexpected, errs = C.check_model_load(
        index, load_sd, info.strict, not index.shared_modules
    )
    if info.strict and index.shared_modules:
        expected = model.state_dict(keep_vars=True).keys()
        missing = [k for k in expected if k not in load_sd]
        unexpected = [k for k in load_sd if k not in expected]
    messages = list(errs)
    if unexpected:
        messages.insert(0, "Unexpected key(s) in state_dict: {}. ".format(
            ", ".join(f'"{k}"' for k in unexpected)))
    if missing:
        messages.insert(0, "Missing key(s) in state_dict: {}. ".format(
            ", ".join(f'"{k}"' for k in missing)))
    if messages:
        raise RuntimeError(
            "Error(s) in loading state_dict for {}:\n\t{}".format(
                type(model).__name__, "\n\t".join(messages)
            )
        )


# --- load rules of the modules' own ------------------------------------------
#
# torch's Module.load_state_dict lets every module decide how it loads:
# an overridden _load_from_state_dict, load_state_dict pre-hooks (which
# may rename or drop keys), post hooks (which may edit the report of
# missing/unexpected keys), lazy parameters (materialized from the loaded
# shapes).  The walk lists the modules that have any of these
# (index.load_modules); load_plan() decides which of them the native
# checks reproduce exactly -- BatchNorm's backward-compatible
# num_batches_tracked, torch's own FSDP2 and activation-checkpoint hooks,
# which edit no key -- and sends every other model down torch's own path:
# model.load_state_dict, with the tensors it could write snapshotted first
# and put back if it raises (load_restoring).

_MODULE_LOAD = nn.Module._load_from_state_dict
_TORCH_LOAD = nn.Module.load_state_dict
_NORM_LOAD = _NormBase._load_from_state_dict
_NBT = "num_batches_tracked"


class LoadPlan(NamedTuple):
    torch_path: bool
    # (BatchNorm module, its num_batches_tracked load key)
    norms: tuple[tuple[nn.Module, str], ...]
    lazy: bool = False  # uninitialized parameters or buffers


_NATIVE_PLAN = LoadPlan(False, ())
_TORCH_PLAN = LoadPlan(True, ())


def _nested_codes(func: Any, name: str) -> list[CodeType]:
    code = getattr(func, "__code__", None)
    if code is None:
        return []
    return [c for c in code.co_consts if isinstance(c, CodeType) and c.co_name == name]


@functools.cache
def _benign_hook_codes() -> frozenset[CodeType]:
    """Code of torch's own load hooks that edit no key: FSDP2's
    (resharding before a load, padding after it) and the activation
    checkpoint wrapper's (re-inserting its prefix, which the load keys
    already have)."""
    codes: list[CodeType] = []
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        codes += _nested_codes(FSDPParam.__init__, "<lambda>")
        codes += _nested_codes(FSDPParamGroup._register_state_dict_hooks, "to_sharded_hook")
    except (ImportError, AttributeError):  # pragma: no cover
        pass
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            ActivationWrapper,
        )

        codes.append(ActivationWrapper._pre_load_state_dict_hook.__code__)
    except (ImportError, AttributeError):  # pragma: no cover
        pass
    return frozenset(codes)


@functools.cache
def _fsdp2_hook_codes() -> frozenset[CodeType]:
    """Code of FSDP2's load hooks: the pre-hook that reshards a parameter
    group, the post-hook that re-registers (re-pads) a sharded parameter."""
    codes: list[CodeType] = []
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        codes += _nested_codes(FSDPParam.__init__, "<lambda>")
        codes += _nested_codes(FSDPParamGroup._register_state_dict_hooks, "to_sharded_hook")
    except (ImportError, AttributeError):  # pragma: no cover
        pass
    return frozenset(codes)


def _hook_code(hook: Any) -> Any:
    fn = getattr(hook, "hook", hook)  # torch's _WrappedHook
    fn = getattr(fn, "__func__", fn)
    return getattr(fn, "__code__", None)


def _has_own_hooks(module: nn.Module) -> bool:
    benign = _benign_hook_codes()
    for registry in (module._load_state_dict_pre_hooks, module._load_state_dict_post_hooks):
        for hook in registry.values():
            if _hook_code(hook) not in benign:
                return True
    return False


def load_plan(model: nn.Module, info: Any) -> LoadPlan:
    """Which load path a model takes (see the notes above)."""
    index = info.index
    if index is None:
        return _NATIVE_PLAN
    cls = type(model)
    own = model.__dict__.get("load_state_dict")
    if cls.load_state_dict is not nn.Module.load_state_dict or (
        own is not None and not is_patched(own)
    ):
        return _TORCH_PLAN
    if C.indices_of(index.tensors, UninitializedTensorMixin):
        return LoadPlan(True, (), True)  # lazy parameters: shapes come from the load
    norms: list[tuple[nn.Module, str]] = []
    for module in index.load_modules:
        if _has_own_hooks(module):
            return _TORCH_PLAN
        tp = type(module)
        if (tp.get_extra_state is nn.Module.get_extra_state) != (
            tp.set_extra_state is nn.Module.set_extra_state
        ):
            return _TORCH_PLAN  # torch's load wants other keys than state_dict() gives
        rule = tp._load_from_state_dict
        if rule is _MODULE_LOAD:
            continue
        if rule is not _NORM_LOAD:
            return _TORCH_PLAN
        nbt = module._buffers.get(_NBT)
        slot = None if nbt is None else index.slot_of(nbt)
        loads = None if slot is None else index.tensor_loads[slot]
        if module.track_running_stats and (loads is None or len(loads) != 1 or index.shared_modules):
            # torch would fill a buffer we do not list, or fill it under
            # several names: its own load decides.
            return _TORCH_PLAN
        if loads is not None:
            norms.append((module, loads[0]))
    return LoadPlan(False, tuple(norms)) if norms else _NATIVE_PLAN


def norm_fills(plan: LoadPlan, index: Any, load_sd: dict[str, Any]) -> dict[str, Any]:
    """The num_batches_tracked entries BatchNorm's _load_from_state_dict
    adds to a state dict of version < 2 (or without version) that lacks
    them: the live buffer, or a 0 for a meta one."""
    fills: dict[str, Any] = {}
    if not plan.norms:
        return fills
    metadata = getattr(load_sd, "_metadata", None)
    for module, key in plan.norms:
        if not module.track_running_stats or key in load_sd:
            continue
        prefix = key[: -len(_NBT)]
        local = {} if metadata is None else metadata.get(prefix[:-1], {})
        version = local.get("version", None)
        if version is not None and version >= 2:
            continue
        nbt = module.num_batches_tracked
        fills[key] = nbt if nbt.device.type != "meta" else torch.tensor(0, dtype=torch.long)
    return fills


class _Snapshot:
    """What a load can change in a module tree: each module's parameter and
    buffer entries (``assign=True`` replaces them), a copy of every
    tensor's values (``copy_``), lazy parameters' uninitialized state, and
    the extra state of modules that define both get_ and set_extra_state.
    Costs one copy of the model's tensors while the load runs."""

    def __init__(self, model: nn.Module):
        self.modules: list[tuple[nn.Module, dict, dict, Any]] = []
        self.tensors: list[tuple[torch.Tensor, Any, type]] = []
        seen: set[int] = set()
        for module in model.modules():
            params, buffers = dict(module._parameters), dict(module._buffers)
            tp = type(module)
            extra = _NO_EXTRA
            if (
                tp.set_extra_state is not nn.Module.set_extra_state
                and tp.get_extra_state is not nn.Module.get_extra_state
            ):
                extra = module.get_extra_state()
            self.modules.append((module, params, buffers, extra))
            for t in (*params.values(), *buffers.values()):
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                if is_lazy(t) or t.is_meta:
                    self.tensors.append((t, None, type(t)))
                else:
                    self.tensors.append((t, t.detach().clone(), type(t)))

    @torch.no_grad()
    def restore(self) -> None:
        for module, params, buffers, extra in self.modules:
            for live, saved in ((module._parameters, params), (module._buffers, buffers)):
                if live.keys() != saved.keys() or any(live[k] is not v for k, v in saved.items()):
                    live.clear()
                    live.update(saved)
            if extra is not _NO_EXTRA:
                module.set_extra_state(extra)
        for t, saved, cls in self.tensors:
            if saved is None:
                if issubclass(cls, UninitializedTensorMixin) and not is_lazy(t):
                    # materialize() gave it data and its final class
                    t.data = torch.empty(0, dtype=t.dtype, device=t.device)
                    t.__class__ = cls
            elif t.shape == saved.shape and t.dtype == saved.dtype:
                t.copy_(saved)
            else:
                t.data = saved


_NO_EXTRA = object()


def load_restoring(
    model: nn.Module, load_sd: dict[str, Any], info: Any, assign: bool
) -> _IncompatibleKeys:
    """model.load_state_dict(load_sd), all or nothing: if it raises, the
    parameters and buffers it wrote are put back before the error
    propagates (torch's own error, unchanged)."""
    snapshot = _Snapshot(model)
    try:
        with info.fsdp_context():
            return cast(
                _IncompatibleKeys,
                state_dict_fn(model, "load_state_dict")(
                    state_dict=load_sd, strict=info.strict, assign=assign
                ),
            )
    except BaseException:
        snapshot.restore()
        raise
