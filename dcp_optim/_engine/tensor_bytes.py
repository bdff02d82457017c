"""A tensor's bytes as one flat ``uint8`` tensor: what the streams send,
receive into and pack.

``t.reshape(-1).view(torch.uint8)`` is the obvious spelling, and it fails
on a tensor of one element whose stride is not 1: torch counts such a
tensor as contiguous whatever its strides (a row of a transposed column,
``torch.randn(1, 5).t()[2:3]``, has strides (1, 5)), ``reshape`` keeps the
stride, and a view as another element size needs the last stride to be 1.
"""

from __future__ import annotations

import torch


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` in its logical order, flat: a view of ``t``
    where it is contiguous (what callers that write into it rely on), else
    a copy (``reshape``'s)."""
    flat = t.reshape(-1)
    if flat.numel() <= 1 and flat.stride(0) != 1:
        # one element (or none): the same bytes under stride 1
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)
