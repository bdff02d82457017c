"""One functional collective at a time inside a wrapper subclass's gather.

A DTensor whose local tensor is a wrapper subclass that keeps its values
in no single byte buffer (torch's ``TwoTensor``, torchao's quantized
tensors) is gathered the way upstream gathers every DTensor: a
redistribute to ``Replicate``, whose functional collective the subclass's
``__torch_dispatch__`` runs once per inner tensor.  Each of those returns
before its transfer ends, so the subclass puts two or more all-gathers of
one process group in flight at once.  On gloo, torch (2.11 and 2.13)
corrupts the heap when two functional all-gathers of a group are in
flight together: the process aborts ("malloc(): unaligned tcache chunk
detected") or segfaults, at random, one call in a few hundred or a few
thousand -- with plain tensors too, once two are issued before the first
is waited for; ``dist.all_gather_into_tensor(async_op=True)`` does not.

So while dcp_optim gathers such a tensor, each functional collective
that the subclass issues on plain tensors is waited for before the next
one starts.  The values are the same (the same operations, in the same
order); what is lost is the overlap between a subclass's inner
transfers, on a path that only such subclasses take.

How: a ``TorchDispatchMode`` sees the collective first, with the
subclass as its argument.  Inside its handler the mode is off, so the
subclass's own dispatch -- called directly, as torch's dispatcher would
-- runs under a fresh instance of the mode, which then sees the inner
collectives on plain tensors and waits for each.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["one_collective_at_a_time"]

_NAMESPACE = "_c10d_functional"


class _OneAtATime(TorchDispatchMode):
    """Waits for every functional collective issued on plain tensors
    before the next one; runs a subclass's own dispatch of a collective
    under a fresh instance, so that its inner collectives are seen."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # as lockstep's mode: compiled frames run without it
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != _NAMESPACE:
            return func(*args, **kwargs)
        subclasses = {type(t) for t in tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor) and type(t) is not torch.Tensor}
        if len(subclasses) == 1:
            (cls,) = subclasses
            with _OneAtATime():
                out = cls.__torch_dispatch__(func, (cls,), args, kwargs)
            if out is not NotImplemented:
                return out
            return func(*args, **kwargs)  # the dispatcher's own error
        out = func(*args, **kwargs)
        if func is not _wait_tensor() and not subclasses:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    _wait_tensor()(t)
        return out


def _wait_tensor() -> Any:
    return torch.ops._c10d_functional.wait_tensor.default


def one_collective_at_a_time() -> TorchDispatchMode:
    """The context in which dcp_optim runs torch's gather of a DTensor over
    a wrapper subclass (see the module's docstring)."""
    return _OneAtATime()
