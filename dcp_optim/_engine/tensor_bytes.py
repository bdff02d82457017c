"""A tensor's bytes as one flat ``uint8`` tensor: what the streams send,
receive into and pack.

``t.reshape(-1).view(torch.uint8)`` is the obvious spelling, and it fails
in three cases, because a view as another element size needs the last
stride to be 1 and ``reshape`` returns a view wherever one exists, not a
contiguous tensor:

* a strided tensor that is one-dimensional already, or becomes so as a
  view (``x[::2]``; a column of a matrix, ``w[:, 0]``; a row of a
  transposed matrix): ``reshape(-1)`` returns it with its stride;
* a tensor of one element whose stride is not 1, which torch counts as
  contiguous whatever its strides (a row of a transposed column,
  ``torch.randn(1, 5).t()[2:3]``, has strides (1, 5));
* a conjugate or negative view (``z.conj()`` of a complex tensor): its
  memory holds other values than it reads as, and torch refuses the view.

What is read (sent, packed) may be a copy; what is written into (a
receiver's shard) must be the tensor's own memory.

A wrapper subclass (its class overrides ``__torch_dispatch__``) has
bytes of its own only through its inner tensors.  Where it keeps its
values in exactly one plain inner tensor of its own shape, dtype and
device (``values_tensor``: torchao's float8 training weights), that
tensor's bytes are its values; any other one (two inner tensors, as
torch's ``TwoTensor``; quantized data and scales, as torchao's
``NF4Tensor``) is moved by torch's own operations or not at all.
"""

from __future__ import annotations

import torch


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s values in logical order, flat, to read: a view
    of ``t`` where its memory holds them so, else a copy."""
    if not own_bytes(t):
        # a copy that holds the values in logical order (a tensor of one
        # element with another stride stays as it is: _as_bytes takes it)
        t = t.resolve_conj().resolve_neg().contiguous()
    return _as_bytes(t.reshape(-1))


def bytes_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` as a flat view of its own memory, to write into
    (what lands there lands in ``t``).  ``t`` must be contiguous, and
    neither a conjugate nor a negative view (callers check: elsewhere a
    view would read other values than it holds)."""
    if not own_bytes(t):
        raise ValueError(
            f"no view of the bytes of a tensor of shape {tuple(t.shape)} and strides {t.stride()}: "
            "it is not contiguous, or a conjugate or negative view"
        )
    return _as_bytes(t.reshape(-1))


def _as_bytes(flat: torch.Tensor) -> torch.Tensor:
    """A contiguous one-dimensional tensor's bytes, as a view."""
    if flat.stride(0) != 1 and flat.numel() <= 1:
        # one element (or none): the same bytes under stride 1
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)


def own_bytes(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory holds its values in logical order: contiguous,
    neither a conjugate nor a negative view (``bytes_view`` takes it)."""
    return t.is_contiguous() and not t.is_conj() and not t.is_neg()


def is_wrapper(t: torch.Tensor) -> bool:
    """Whether ``t``'s class overrides ``__torch_dispatch__`` (a wrapper
    subclass: its storage, if any, is not its values)."""
    return type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__


def values_tensor(t: torch.Tensor) -> torch.Tensor | None:
    """The one inner tensor of a wrapper subclass that keeps its values in
    exactly one plain tensor of its own shape, dtype and device (its
    ``__tensor_flatten__``), else None."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None:
        return None
    names, _ = flatten()
    if len(names) != 1:
        return None
    inner = getattr(t, names[0], None)
    if not isinstance(inner, torch.Tensor) or is_wrapper(inner):
        return None
    if inner.shape != t.shape or inner.dtype != t.dtype or inner.device != t.device:
        return None
    return inner


def opaque(t: torch.Tensor) -> bool:
    """Whether ``t`` is a wrapper subclass whose values no byte view
    reaches (``values_tensor`` finds none): torch's own operations move
    it."""
    return is_wrapper(t) and values_tensor(t) is None
