"""A tensor's bytes as one flat ``uint8`` tensor: what the streams send,
receive into and pack.

``t.reshape(-1).view(torch.uint8)`` is the obvious spelling, and it fails
in two cases, because a view as another element size needs the last
stride to be 1 and ``reshape`` returns a view wherever one exists, not a
contiguous tensor:

* a strided tensor that is one-dimensional already, or becomes so as a
  view (``x[::2]``; a column of a matrix, ``w[:, 0]``; a row of a
  transposed matrix): ``reshape(-1)`` returns it with its stride;
* a tensor of one element whose stride is not 1, which torch counts as
  contiguous whatever its strides (a row of a transposed column,
  ``torch.randn(1, 5).t()[2:3]``, has strides (1, 5)).
"""

from __future__ import annotations

import torch


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` in its logical order, flat: a view of ``t``
    where it is contiguous (what callers that write into it rely on), else
    a copy (``reshape``'s)."""
    flat = t.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()  # strided in one dimension: a copy
    elif flat.numel() <= 1 and flat.stride(0) != 1:
        # one element (or none): the same bytes under stride 1
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)
