"""The compiled core and the torch objects it is handed.

The C extension ``dcp_optim._dcp_optim`` never imports torch; everything
torch-specific it needs (classes to recognise wrappers, base methods to
detect overrides, factories) arrives in a ``Context`` built here once.
"""

from __future__ import annotations

import collections
import copy
import io
import sys
from typing import Any

try:
    from .. import _dcp_optim as C
except ImportError as exc:  # pragma: no cover - exercised by hand only
    raise ImportError(
        "dcp_optim requires its compiled core dcp_optim._dcp_optim, which is "
        "not built. Build it with `make build` (or `pip install -e .`, or "
        "`python setup.py build_ext --inplace`) in the source tree."
    ) from exc

import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

__all__ = ["C", "context", "EXTRA_STATE"]


try:
    # Upstream's own marker class, so values compare and isinstance() as
    # they would with upstream (an omitted _extra_state reaches
    # set_extra_state as this marker on full loads, as upstream).
    from torch.distributed.checkpoint.state_dict import _EXTRA_STATE

    EXTRA_STATE: type = _EXTRA_STATE
except ImportError:  # pragma: no cover - torch without the private name

    class _ExtraState:
        """Marker standing for a module's ``_extra_state``."""

    EXTRA_STATE = _ExtraState


def _build(compiled_types: tuple[type, ...]) -> C.Context:
    return C.Context(
        module_type=nn.Module,
        tensor_type=torch.Tensor,
        dtensor_type=DTensor,
        ddp_types=(DDP,),
        compiled_types=compiled_types,
        fsdp1_types=(FSDP,),
        base_named_children=nn.Module.named_children,
        base_named_parameters=nn.Module.named_parameters,
        base_named_buffers=nn.Module.named_buffers,
        base_get_extra_state=nn.Module.get_extra_state,
        extra_state_marker=EXTRA_STATE,
        defaultdict_type=collections.defaultdict,
        dict_type=dict,
        float32=torch.float32,
        cpu_device=torch.device("cpu"),
        bytesio_type=io.BytesIO,
        deepcopy=copy.deepcopy,
        base_state_dict=_torch_own(nn.Module.state_dict),
        base_save_to_state_dict=_torch_own(nn.Module._save_to_state_dict),
        ordereddict_type=collections.OrderedDict,
    )


def _torch_own(method: Any) -> Any:
    """``method`` when it is torch's own ``nn.Module`` method, else None:
    a library that replaced it on the class before this import would
    otherwise count as torch's rules, and the native state dict
    (``C.plain_state_dict``) would skip it.  None turns that path off."""
    own = getattr(method, "__module__", None) == "torch.nn.modules.module"
    return method if own and getattr(method, "__qualname__", "").startswith("Module.") else None


_plain_context = _build(())
_compiled_context: C.Context | None = None


def context() -> C.Context:
    """The Context for this call.

    ``torch.compile``'s ``OptimizedModule`` lives in ``torch._dynamo``, which
    is expensive to import; a compiled module can only exist once it has been
    imported, so until then the plain Context (no compiled types) is exact.
    """
    global _compiled_context
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:
        return _plain_context
    if _compiled_context is None:
        _compiled_context = _build((eval_frame.OptimizedModule,))
    return _compiled_context
