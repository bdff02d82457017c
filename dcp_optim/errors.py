"""Exception types and the message texts dcp_optim shares with upstream.

Every error dcp_optim raises on its own is one of the classes below: each
subclasses both :class:`DcpOptimError` and the built-in exception a caller
of upstream's API would already catch (``KeyError`` for a key that is not
there, ``ValueError`` for a bad value, ``TypeError`` for a wrong type,
``RuntimeError`` for an inconsistent state dict), so drop-in code keeps
working and new code can catch ``DcpOptimError``.

Texts that must equal upstream's (tests match them verbatim) are the
``E*``/``W*`` constants; the ids follow docs/architecture.md, "Errors and warnings".
"""

from __future__ import annotations

__all__ = [
    "DcpOptimError",
    "StateDictKeyError",
    "StateDictValueError",
    "StateDictTypeError",
    "OptimizerDictTypeError",
    "NotAnOptimizerError",
    "ModuleNameTypeError",
    "StateDictRuntimeError",
    "MissingOptimizerStateError",
    "IncompleteTemplateError",
    "StepCollectiveError",
    "HeldOptimizerStateError",
    "StaleOptimizerStateError",
    "RankLocalStateError",
    "ParamGroupConflictError",
]


class DcpOptimError(Exception):
    """Base class of the errors dcp_optim raises itself."""


class StateDictKeyError(DcpOptimError, KeyError):
    """A key (FQN, state name, parameter) is missing or unknown."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class StateDictValueError(DcpOptimError, ValueError):
    """A value in a state dict or an option is not acceptable."""


class StateDictTypeError(DcpOptimError, TypeError):
    """A value has the wrong type."""


class OptimizerDictTypeError(StateDictTypeError, AttributeError):
    """An optimizer state dict that is not a dict (upstream fails with
    ``TypeError`` or ``AttributeError``, depending on the type)."""


class NotAnOptimizerError(StateDictTypeError, AttributeError):
    """An object passed as an optimizer has no ``param_groups`` or
    ``state`` (upstream fails with ``AttributeError`` reading them)."""


class ModuleNameTypeError(StateDictTypeError, AttributeError):
    """A module names a child, parameter or buffer with something other
    than a str (torch's ``state_dict`` fails with ``TypeError`` joining the
    name, upstream's FQN lookup with ``AttributeError``)."""


class StateDictRuntimeError(DcpOptimError, RuntimeError):
    """A state dict does not fit the model or optimizer it is loaded into."""


class MissingOptimizerStateError(StateDictRuntimeError):
    """``strict=True`` and trainable parameters have no saved state (E18)."""

    def __init__(self, message: str, missing: list[str]):
        super().__init__(message)
        self.missing = missing

    def __reduce__(self):  # picklable (errors travel between ranks)
        return (type(self), (str(self.args[0]) if self.args else "", self.missing))


class IncompleteTemplateError(StateDictRuntimeError):
    """The getter cannot build the complete state template of a
    never-stepped optimizer (no schema, and neither a shadow step nor one
    zero-gradient step of the optimizer itself yields it): raised rather
    than returning a template ``dcp.load`` would silently leave state
    behind with."""


class StepCollectiveError(StateDictRuntimeError):
    """A collective that an optimizer's own step issues while dcp_optim
    steps that optimizer to build a template, and that the other ranks of
    its group do not make at the same point (they take no such step: the
    ranks' parameters without state differ).  Raised before the collective
    runs, instead of waiting in it until the process group's timeout; the
    template is then refused as any other that cannot be built (the
    getter's ``IncompleteTemplateError``, caused by this one)."""


class HeldOptimizerStateError(StateDictRuntimeError):
    """An optimizer holds another optimizer (an attribute, such as the
    ``base_optimizer`` of pytorch-optimizer's FriendlySAM, LookSAM, WSAM,
    GSAM) whose state it keeps apart from its own ``state`` and that is
    neither a proxy nor a wrapper of a recognised layout: its
    ``state_dict()`` omits that state or nests it where it cannot be keyed
    by parameter FQN, so a resume through DCP would silently lose it
    (upstream's getter drops it).  ``owner`` and ``attribute`` name it."""

    def __init__(self, message: str, owner: str, attribute: str):
        super().__init__(message)
        self.owner = owner
        self.attribute = attribute

    def __reduce__(self):  # picklable (errors travel between ranks)
        return (type(self), (str(self.args[0]) if self.args else "", self.owner, self.attribute))


class StaleOptimizerStateError(StateDictRuntimeError):
    """An optimizer's ``state_dict()`` returns a copy of its state taken
    earlier, and the state it holds has changed since (a
    ``ZeroRedundancyOptimizer`` stepped after ``consolidate_state_dict``):
    saving the copy would pair the current parameters with older optimizer
    state.  ``position`` is the optimizer's index in the call."""

    def __init__(self, message: str, position: int):
        super().__init__(message)
        self.position = position

    def __reduce__(self):  # picklable (errors travel between ranks)
        return (type(self), (str(self.args[0]) if self.args else "", self.position))


class RankLocalStateError(StateDictRuntimeError):
    """A sharded or full get (FSDP2/TP, FSDP1) found an optimizer value that
    is not a DTensor and differs between the ranks of a mesh (a group sum
    such as Prodigy's ``d``, a projector object built from local shards).
    DCP stores such a value once, and a full dict holds rank 0's, so a
    resume would silently give every rank one rank's value (D30).  ``key`` names the entry, ``ranks`` the ranks
    per distinct value."""

    def __init__(self, message: str, key: str, ranks: list[list[int]]):
        super().__init__(message)
        self.key = key
        self.ranks = ranks

    def __reduce__(self):  # picklable (errors travel between ranks)
        return (type(self), (str(self.args[0]) if self.args else "", self.key, self.ranks))


class ParamGroupConflictError(StateDictValueError):
    """An optimizer load whose live param group holds parameters that the
    loaded dict puts in param groups with different values of one key
    (the checkpoint was saved with another grouping): one group cannot
    hold both, and upstream's load would keep one silently.  ``optimizer``
    and ``group`` locate the live group, ``key`` names the key, ``fqns``
    a parameter from each of the two loaded groups."""

    def __init__(self, message: str, optimizer: int = -1, group: int = -1, key: object = None,
                 fqns: list[str] | None = None):
        super().__init__(message)
        self.optimizer = optimizer
        self.group = group
        self.key = key
        self.fqns = list(fqns or [])

    def __reduce__(self):  # picklable (errors travel between ranks)
        return (type(self), (str(self.args[0]) if self.args else "", self.optimizer, self.group,
                             self.key, self.fqns))


class InconsistentOptimizerStateError(StateDictRuntimeError, AssertionError):
    """FSDP1 with ``use_orig_params``: the ranks that hold a piece of an
    original parameter disagree on one of its non-tensor states (its
    ``step``), so no single value could be saved.  An ``AssertionError``
    too, as FSDP's own gather raises.  ``key`` names the entry, ``ranks``
    the ranks whose values differ."""

    def __init__(self, message: str, key: str, ranks: list[int]):
        super().__init__(message)
        self.key = key
        self.ranks = ranks

    def __reduce__(self):  # picklable (errors travel between ranks)
        return (type(self), (str(self.args[0]) if self.args else "", self.key, self.ranks))


# --- upstream texts (docs/architecture.md, "Errors and warnings") ----------

E4_NO_OPTIMIZERS = "Optimizers are not passed in but optim_only is set to True."
E5_SUBMODULE_FQN = "Submodule FQN should only have 1 instance"
E6_BROADCAST_NEEDS_FULL = (
    "full_state_dict must be True when broadcast_from_rank0 is True."
)
E7_FSDP_STATE = "Expected a fsdp_state with a fsdp module."
E8_EMPTY_MODEL = (
    "The option indicates that model state_dict is required to save "
    "or load, but model state_dict is empty."
)
# D14: upstream blames the model dict; the text keeps upstream's fragments
# ("state_dict is required", "optim state_dict is empty").
E9_EMPTY_OPTIM = (
    "The option indicates that optimizer state_dict is required to save "
    "or load, but optim state_dict is empty. {osd}"
)
E10_FLAT_PARAM = (
    "{key} contains _flat_param. This can happen if the model is not the "
    "root module."
)
E18_MISSING_OPTIM_STATE = (
    "Missing optimizer state for parameter '{fqn}' in checkpoint. The "
    "parameter requires gradients but has no saved optimizer state. To load "
    "anyway, use StateDictOptions(strict=False)."
)
E22_DEVICE_MISMATCH = "Device mismatch"
E14_MULTIPLE_DEVICES = "Multiple devices found"
E25_SUBMODULE_FQNS = "FQNs for a submodule should only have 1 element"

W1_SUBMODULES = (
    "Getting submodules only model/optim state_dict is deprecated and "
    "will be removed in 2.5. This feature can be achieved by manually "
    "filtering out the state_dict returned from get_state_dict."
)
W2_MODULE_KEYED = (
    "Passing model_state_dict as a ``Dict[nn.Module, Dict[str, Any]]``"
    "is deprecated and will be removed in 2.5. If you need this "
    "feature, please preprocess the model_state_dict to achieve the "
    "same functionality."
)
