"""dcp_optim: a faster, corrected drop-in for
``torch.distributed.checkpoint.state_dict``.

Switch by changing one import::

    from dcp_optim import get_state_dict, set_state_dict, StateDictOptions

The functions have upstream's exact signatures and accept upstream's
``StateDictOptions`` objects too.  The per-parameter work runs in the
compiled core ``dcp_optim._dcp_optim``, which is required.
"""

# The compiled core first: without it this raises an ImportError that
# names the build command, before anything else is imported.
from ._engine.core import C as _C  # isort: skip
from . import errors, schema
from .options import StateDictOptions
from .schema import register_optimizer_schema
from .state_dict import (  # the _patch_* helpers: importable as torch's are
    FQNS_T,
    DictValueType,
    ListDictValueType,
    OptimizerStateType,
    PrimitiveType,
    ValueType,
    _patch_model_state_dict,  # noqa: F401
    _patch_optimizer_state_dict,  # noqa: F401
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

__version__ = "0.1.0"

#: "c" -- the compiled core is the only backend (there is no fallback).
BACKEND = _C.BACKEND

__all__ = [
    # upstream's __all__, type aliases included: a one-line import switch
    # of any of its names works
    "FQNS_T",
    "PrimitiveType",
    "ValueType",
    "DictValueType",
    "ListDictValueType",
    "OptimizerStateType",
    "StateDictOptions",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
    "register_optimizer_schema",
    "errors",
    "schema",
]

# Adoption tools (docs/adoption.md): one-line switch-over, converter, verification.
from . import patching  # noqa: E402
from .patching import is_patched, patch, patched, unpatch  # noqa: E402
from .tools import convert, verify  # noqa: E402

__all__ += ["patch", "unpatch", "patched", "is_patched", "patching", "convert", "verify"]

# DCP load planner tolerating empty-group keys across layouts (pipelines)
# and reporting (or loading) the checkpoint entries a load leaves behind.
from .tools.planner import LoadPlanner, UnrequestedEntriesError, unrequested_entries  # noqa: E402

__all__ += ["LoadPlanner", "UnrequestedEntriesError", "unrequested_entries"]

# Reading checkpoints safely (the command line's reader): a restricted
# unpickler for the metadata and non-tensor entries unless trusted=True.
from .tools.checkpoint import (  # noqa: E402
    Checkpoint,
    CheckpointError,
    MalformedCheckpointError,
    NotLoaded,
    UnsafeCheckpointError,
)

__all__ += ["Checkpoint", "CheckpointError", "MalformedCheckpointError", "NotLoaded", "UnsafeCheckpointError"]

# Resharding live state in memory (docs/resharding.md).
from .reshard import ReshardBuffers, reshard_model_and_optimizer, reshard_state_dict  # noqa: E402

__all__ += ["reshard_state_dict", "reshard_model_and_optimizer", "ReshardBuffers"]
