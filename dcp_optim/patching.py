"""Switch existing code over to dcp_optim with one line.

::

    import dcp_optim
    dcp_optim.patch()          # or: with dcp_optim.patch(): ...

After ``patch()``, the functions of ``torch.distributed.checkpoint.state_dict``
-- the six public ones (``get_model_state_dict``, ``get_optimizer_state_dict``,
``get_state_dict``, ``set_model_state_dict``, ``set_optimizer_state_dict``,
``set_state_dict``) and the private helpers third parties import
(``_patch_model_state_dict``, ``_patch_optimizer_state_dict``, and
``_init_optim_state``, which torchtune imports; it takes only an optimizer)
-- run dcp_optim's implementation:

* the attributes of the upstream module are replaced, so code that imports
  them later gets dcp_optim's: imports inside a function at call time
  (HuggingFace Accelerate's FSDP helpers, Lightning Fabric's
  ``ModelParallelStrategy``), modules first imported after ``patch()``
  (``from torch.distributed.checkpoint.state_dict import ...`` at the top
  binds the forwarders), and module aliases (``from
  torch.distributed.checkpoint import state_dict as dsd``:
  ``dsd.get_model_state_dict`` is the module's attribute);
* every module already in ``sys.modules`` that holds one of upstream's
  function objects as a module attribute (``from ... import get_state_dict``
  at the top of a file, under any alias, or ``import *``) has that
  attribute replaced too.

(Upstream's own private functions look ``_init_optim_state`` up in their
module too, so code that calls them directly while patched --
``_get_optim_state_dict(model, optims, info)`` -- gets dcp_optim's
pristine state instead of a fake ``step()``.)

What is installed is a thin forwarding function per name (``__wrapped__`` is
dcp_optim's function; ``is_patched_function(fn)`` recognises it), which
looks dcp_optim's implementation up at call time.  Forwarders rather than
dcp_optim's own function objects are what lets ``unpatch()`` restore
exactly what was there: it puts the original objects back wherever
``patch()`` replaced them, and also reverts forwarders that modules imported
while the patch was active -- without touching names that code imported from
``dcp_optim`` on purpose.

Not replaced:

* ``StateDictOptions``: dcp_optim's functions accept upstream's options
  objects (same fields), so the class stays upstream's and existing
  ``isinstance`` checks and ``dataclasses.replace`` calls keep working;
* private helpers other than the three above (``_get_fqns``,
  ``_verify_options``, ...): their callers pass and expect upstream's
  internal objects; the compatible versions live in ``dcp_optim.state_dict``;
* references to upstream's functions held anywhere but as a module
  attribute (a class attribute, a closure, a ``functools.partial``, a dict
  of callbacks) -- call ``patch()`` before such references are taken, e.g.
  first thing in the program.  The other way round, a forwarder that such
  a place took while patched stays there after ``unpatch()`` but runs
  upstream's function again.

``patch()`` is idempotent (a second call only rescans ``sys.modules`` for
references taken meanwhile), ``patch()``/``unpatch()`` are serialised by a
lock, and a name someone rebound after ``patch()`` is left alone by
``unpatch()``.
"""

from __future__ import annotations

import functools
import importlib
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["patch", "unpatch", "patched", "is_patched", "is_patched_function", "PATCHED_NAMES"]

_UPSTREAM = "torch.distributed.checkpoint.state_dict"

#: The names of ``torch.distributed.checkpoint.state_dict`` that patch() replaces.
PATCHED_NAMES = (
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
    "_patch_model_state_dict",
    "_patch_optimizer_state_dict",
    "_init_optim_state",
)

_MARK = "__dcp_optim_forwarder__"

_lock = threading.RLock()
# name -> upstream's original function; forwarder objects; replacements made
# (module dict, attribute, original) -- None while not patched.
_originals: dict[str, Callable] | None = None
_forwarders: dict[str, Callable] = {}
_records: list[tuple[dict[str, Any], str, Callable]] = []
# upstream's functions as of the last patch(): what a forwarder runs once
# unpatched
_upstream: dict[str, Callable] = {}


def _make_forwarder(name: str) -> Callable:
    from . import state_dict as ours

    target = getattr(ours, name)

    @functools.wraps(target)
    def forwarder(*args, **kwargs):
        if _originals is None:
            # unpatched, but this forwarder was kept somewhere unpatch()
            # cannot see (a class attribute, a closure, a callback list):
            # upstream's function, as if it had never been patched
            return _upstream[name](*args, **kwargs)
        # looked up per call: dcp_optim.state_dict.<name> may be wrapped
        # (profilers, spies) after patch()
        return getattr(ours, name)(*args, **kwargs)

    setattr(forwarder, _MARK, name)
    return forwarder


def is_patched_function(obj: Any) -> bool:
    """True for the forwarding functions ``patch()`` installs."""
    return callable(obj) and isinstance(getattr(obj, _MARK, None), str)


def is_patched() -> bool:
    """Whether ``patch()`` is in effect."""
    return _originals is not None


def _module_dicts() -> list[dict[str, Any]]:
    out = []
    for module in list(sys.modules.values()):
        if not isinstance(module, ModuleType):
            continue
        try:
            namespace = module.__dict__
        except Exception:  # noqa: BLE001 - exotic module objects
            continue
        if isinstance(namespace, dict):
            out.append(namespace)
    return out


def _replace_everywhere(originals: dict[str, Callable]) -> None:
    by_id = {id(fn): name for name, fn in originals.items()}
    for namespace in _module_dicts():
        for attr, value in list(namespace.items()):
            name = by_id.get(id(value))
            if name is None or value is not originals[name]:
                continue
            namespace[attr] = _forwarders[name]
            _records.append((namespace, attr, value))


class _PatchHandle:
    """Returned by ``patch()``; as a context manager it undoes the patch on
    exit if this ``patch()`` call was the one that applied it."""

    def __init__(self, applied: bool):
        self.applied = applied

    def __enter__(self) -> _PatchHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.applied:
            unpatch()

    def __repr__(self) -> str:
        return f"<dcp_optim patch ({'applied here' if self.applied else 'already active'})>"


def patch() -> _PatchHandle:
    """Make ``torch.distributed.checkpoint.state_dict``'s functions, and the
    names modules already imported from it, run dcp_optim's implementation.

    Idempotent and thread-safe.  Returns a handle that also works as a
    context manager: ``with dcp_optim.patch(): ...`` undoes the patch on
    exit (unless it was already active before).
    """
    global _originals
    with _lock:
        upstream = importlib.import_module(_UPSTREAM)
        originals = _originals
        applied = originals is None
        if originals is None:
            originals = {}
            for name in PATCHED_NAMES:
                fn = getattr(upstream, name)
                if is_patched_function(fn):
                    raise RuntimeError(
                        f"{_UPSTREAM}.{name} is already a dcp_optim forwarder, but "
                        "dcp_optim.patching has no record of patching it (was "
                        "dcp_optim.patching reloaded?)"
                    )
                originals[name] = fn
            if not _forwarders:
                for name in PATCHED_NAMES:
                    _forwarders[name] = _make_forwarder(name)
            _records.clear()
            _upstream.update(originals)
            _originals = originals
        _replace_everywhere(originals)
        return _PatchHandle(applied)


def unpatch() -> bool:
    """Undo ``patch()``: every replaced attribute gets its original object
    back (unless it was rebound since), and forwarders that modules imported
    while patched are reverted to upstream's functions.  Returns whether a
    patch was active."""
    global _originals
    with _lock:
        if _originals is None:
            return False
        originals = _originals
        forwarder_ids = {id(f): name for name, f in _forwarders.items()}
        for namespace, attr, original in reversed(_records):
            if id(namespace.get(attr)) in forwarder_ids:
                namespace[attr] = original
        # forwarders imported while patched (from the upstream module)
        for namespace in _module_dicts():
            for attr, value in list(namespace.items()):
                name = forwarder_ids.get(id(value))
                if name is not None and value is _forwarders[name]:
                    namespace[attr] = originals[name]
        _records.clear()
        _originals = None
        return True


def patched():
    """Context manager form: ``with dcp_optim.patched(): ...`` -- patched
    inside the block, restored after it (unless patched before)."""
    return patch()
