"""Resharding live state in memory (docs/resharding.md).

:func:`reshard_state_dict` moves a sharded state dict -- a model's or an
optimizer's, nested or flattened, as the getters return it -- from its
layout (DTensors on mesh A, plain tensors on some ranks) into a template in
another layout (DTensors on mesh B over the same ranks or a subset), with
point-to-point transfers of exactly the bytes each rank needs: no disk and
no full gather.  Every rank ends with the shards that ``dcp.save``
followed by ``dcp.load`` into the same template would give it, bit for bit.

:func:`reshard_model_and_optimizer` is the convenience form: it moves a
model and its optimizer in layout A into a second model and optimizer in
layout B, ready to train.
"""

from __future__ import annotations

from typing import Any

from ._engine import reshard as _engine
from .options import StateDictOptions

__all__ = ["reshard_state_dict", "reshard_model_and_optimizer", "ReshardBuffers", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = _engine.DEFAULT_BUCKET_BYTES


class ReshardBuffers:
    """Buffers that :func:`reshard_state_dict` keeps from one call to the
    next, for a job that reshards at every step (weight sync from a
    training layout to an inference layout): the send and receive buckets
    and the undo log's host copy of the template shards the rank receives
    into.  A call without one allocates them and lets them go when it
    returns; with one, a repeated call writes into pages it already has
    instead of faulting in fresh ones, which costs about twice the copy
    itself.  They hold at most two buckets plus those template shards
    (:attr:`nbytes`) until :meth:`clear` or until the object is dropped."""

    def __init__(self) -> None:
        self._kept: dict = {}

    @property
    def nbytes(self) -> int:
        """The bytes held now."""
        return sum(buf.numel() for buf in self._kept.values())

    def clear(self) -> None:
        """Let the buffers go (the next call allocates them again)."""
        self._kept.clear()


def reshard_state_dict(
    source: dict[str, Any] | None,
    template: dict[str, Any] | None,
    *,
    process_group: Any = None,
    bucket_bytes: int | None = None,
    buffers: ReshardBuffers | None = None,
) -> dict[str, Any] | None:
    """Fill ``template`` with the values of ``source``, shard by shard.

    Collective: every rank of ``process_group`` (default: the world) calls
    it.  ``source`` is this rank's source state dict (``None`` or ``{}`` on a
    rank that holds none of it); ``template`` is this rank's destination
    state dict, ``None`` on a rank that leaves (a destination mesh over a
    subset of the ranks).  Dicts nest; any other value is a leaf.

    Each tensor of the template (a DTensor, or a plain tensor every
    template rank receives in full) is written in place, as ``dcp.load``
    writes its template; keys of the source missing from the template are
    ignored.  Returns a new dict of the template's structure holding the
    template's tensors and copies of the source's non-tensor values (for
    example ``param_groups``); the caller's dicts are not modified.

    Layouts are agreed first: a key missing from the source, a global
    shape that differs, a ``Partial`` placement, a local shard whose shape
    its placements do not imply raise the same
    :class:`~dcp_optim.errors.StateDictRuntimeError` on every rank, before
    any tensor is written.  Once data moves, a rank that fails (or finds
    a peer gone) puts its template back as it was before the call, from
    an undo log: a host copy of the template shards it receives into
    (``DCP_OPTIM_STREAM_UNDO=0`` turns the log off).  Peak extra memory:
    two buckets of ``bucket_bytes`` (default 32 MiB) per rank, plus that
    host copy.  ``buffers``: a :class:`ReshardBuffers` that keeps the
    buckets and the host copy for the next call.
    """
    kept = buffers._kept if buffers is not None else None
    return _engine.reshard(source, template, group=process_group, bucket_bytes=bucket_bytes, kept=kept)


def reshard_model_and_optimizer(
    src_model: Any,
    src_optimizer: Any,
    dst_model: Any,
    dst_optimizer: Any,
    *,
    options: StateDictOptions | None = None,
    process_group: Any = None,
    bucket_bytes: int | None = None,
    buffers: ReshardBuffers | None = None,
) -> None:
    """Move ``src_model`` (and ``src_optimizer``, or ``None``) in layout A
    into ``dst_model`` and ``dst_optimizer`` in layout B, ready to train:
    the state dicts are taken with :func:`dcp_optim.get_state_dict`,
    resharded with :func:`reshard_state_dict` and set with
    :func:`dcp_optim.set_state_dict`.  ``dst_model`` is ``None`` on ranks
    that leave; ``dst_optimizer`` may be a fresh, never-stepped optimizer.
    ``buffers``: as for :func:`reshard_state_dict`."""
    from .state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    opts = options if options is not None else StateDictOptions()
    source: dict[str, Any] = {}
    if src_model is not None:
        if src_optimizer is not None:
            source["model"], source["optim"] = get_state_dict(src_model, src_optimizer, options=opts)
        else:
            source["model"] = get_model_state_dict(src_model, options=opts)
    template: dict[str, Any] | None = None
    if dst_model is not None:
        template = {}
        if dst_optimizer is not None:
            template["model"], template["optim"] = get_state_dict(dst_model, dst_optimizer, options=opts)
        else:
            template["model"] = get_model_state_dict(dst_model, options=opts)
    out = reshard_state_dict(source, template, process_group=process_group, bucket_bytes=bucket_bytes,
                             buffers=buffers)
    if dst_model is None or out is None:
        return
    if dst_optimizer is not None:
        set_state_dict(
            dst_model, dst_optimizer, model_state_dict=out["model"], optim_state_dict=out["optim"], options=opts
        )
    else:
        set_model_state_dict(dst_model, out["model"], options=opts)
