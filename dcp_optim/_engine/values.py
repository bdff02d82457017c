"""The values an optimizer keeps beside its tensors' data (param-group
hyperparameters, counters, 0-dim state, containers of tensors): their
equality as a resume needs it -- bit for bit, NaN equal to NaN -- and
whether one holds tensors no load can cut into shards.

``==`` alone says too little or too much for this: tensors compare element
by element (and ``bool()`` of the result raises for more than one), NaN
differs from itself, and two copies of an object without an equality of
its own (a value unpickled from each of two loaded groups) differ by
identity."""

from __future__ import annotations

import pickle
from typing import Any

import torch


def same_value(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` hold the same value: tensors of the same
    dtype and shape with the same bytes, ints and floats equal (NaN
    equals NaN),
    lists, tuples and dicts item by item, other objects by their equality
    or, where their class has none of its own, by their pickles."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        a = a.detach().to("cpu").contiguous().reshape(-1)
        b = b.detach().to("cpu").contiguous().reshape(-1)
        if a.is_complex():
            a, b = torch.view_as_real(a), torch.view_as_real(b)
        return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))
    numbers = (int, float)
    if type(a) in numbers and type(b) in numbers:  # 1 and 1.0 train alike; bools apart
        return a == b or (a != a and b != b)
    if type(a) is not type(b):
        return False
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_value(a[k], b[k]) for k in a)
    try:
        equal = a == b
    except Exception:  # noqa: BLE001 - no usable equality: the pickles decide
        equal = None
    if isinstance(equal, bool) and (equal or type(a).__eq__ is not object.__eq__):
        return equal
    try:
        return pickle.dumps(a, protocol=4) == pickle.dumps(b, protocol=4)
    except Exception:  # noqa: BLE001 - neither comparable nor picklable
        return False


def plain_tensor_in(value: Any) -> bool:
    """Whether ``value`` holds, at any depth of dicts, lists and tuples, a
    tensor with a dimension that is not a DTensor (or its metadata: a
    broadcast load's receivers see the source's tensors as
    ``TensorMeta``)."""
    from torch.distributed.tensor import DTensor

    from .distribute import TensorMeta

    if isinstance(value, DTensor):
        return False
    if isinstance(value, torch.Tensor | TensorMeta):
        return len(value.shape) > 0
    if isinstance(value, dict):
        return any(plain_tensor_in(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(plain_tensor_in(v) for v in value)
    return False
