"""The marks dcp_optim writes into optimizer state dicts, and so into
checkpoints: subclasses of ``str``, ``int`` and ``float`` that equal, hash
and print like the plain values, and say where a value came from.

* ``StepCreatedInt`` / ``StepCreatedFloat``: a number in a never-stepped
  optimizer's template that only its first step would create (a key of
  a dict among the optimizer's own ``state_dict()`` entries, D47; a key
  the first step adds to a param group, D48).  A load drops the values
  still marked.
* ``NeverSteppedName`` (nested format: a parameter's name in its group's
  ``params``) and ``NeverSteppedInt`` / ``NeverSteppedFloat`` (flattened
  format: the numbers among its ``param_groups.<fqn>.<key>`` entries): the
  parameter had no state when the dict was taken, and the state in the
  dict is a template's (D48).  A load leaves the parameter without state.

``dcp.save`` pickles them (``dcp.load`` unpickles with
``weights_only=False``, which imports this module), and they are allowed
by ``torch.load(weights_only=True)`` once dcp_optim is imported.  Their
pickled names are this module's: a checkpoint that holds marks needs
dcp_optim installed to load.  See docs/differences.md, D47 and D48.
"""

from __future__ import annotations

import torch

__all__ = [
    "NeverSteppedFloat",
    "NeverSteppedInt",
    "NeverSteppedName",
    "StepCreatedFloat",
    "StepCreatedInt",
]


class StepCreatedInt(int):
    """An int a first step would create, in a never-stepped template;
    dropped by a load that finds it."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"StepCreatedInt({int(self)})"


class StepCreatedFloat(float):
    """A float a first step would create, in a never-stepped template;
    dropped by a load that finds it."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"StepCreatedFloat({float(self)!r})"


class NeverSteppedName(str):
    """A parameter's name in a group's ``params``: the parameter had no
    state when the dict was taken."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"NeverSteppedName({str(self)!r})"


class NeverSteppedInt(int):
    """An int among a never-stepped parameter's flattened group entries."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"NeverSteppedInt({int(self)})"


class NeverSteppedFloat(float):
    """A float among a never-stepped parameter's flattened group entries."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"NeverSteppedFloat({float(self)!r})"


torch.serialization.add_safe_globals(
    [StepCreatedInt, StepCreatedFloat, NeverSteppedName, NeverSteppedInt, NeverSteppedFloat]
)
