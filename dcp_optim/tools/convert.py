"""Rewrite optimizer state between the nested and the flattened layout.

The two layouts of an FQN-keyed optimizer state dict (what
``get_optimizer_state_dict`` returns with ``flatten_optimizer_state_dict``
False / True)::

    nested  {"state": {fqn: {name: value}},
             "param_groups": [{key: value, ..., "params": [fqn, ...]}, ...]}
    flat    {"state.<fqn>.<name>": value, ...,
             "param_groups.<fqn>.<key>": value, ...}

plus, in the flat layout, the reserved keys dcp_optim uses for empty
param groups (``param_groups.<anchor>.__empty_group_after_<n>__.<key>``,
``...__empty_group_before_<n>__...``, ``param_groups.__optimizer_<o>_empty_group_<g>__.<key>``;
see csrc/flat.c).  Upstream's flattened dicts (and torchtitan's) are the
same format without empty groups.

In memory: :func:`to_flat` and :func:`to_nested`.  On disk:
:func:`convert_checkpoint` rewrites a DCP checkpoint (every optimizer
section found in it, e.g. ``optim`` or the AppState pattern's
``app.optim``; everything else is copied unchanged).

Exactness: loading the converted state with the other layout gives the
optimizer bit-identical state and param groups to loading the original
with its own layout.  Two facts of the layouts matter:

* the flat layout does not record which parameters shared a param group,
  while a DCP load of the nested layout is positional
  (``optim.param_groups.<index>.<key>`` of the load template must exist in
  the checkpoint).  So ``to_nested`` takes the group structure of the
  optimizers that will load the result (``groups``; CLI ``--entry``):
  each group gets the saved values of its parameters, merged exactly as a
  flat load merges them.  Without it, the groups are rebuilt from the
  saved values: one group per run of consecutive parameters with equal
  keys and values (so neighbouring groups with identical
  hyperparameters merge).  That is exact for
  ``set_optimizer_state_dict`` on the in-memory dict (it matches groups by
  FQN) and for DCP loads into optimizers with that structure;
* empty groups are anchored per optimizer in the flat layout, so
  converting a nested dict that holds several optimizers' groups *and*
  empty groups needs the number of groups of each optimizer
  (``group_counts``; CLI ``--group-counts`` or ``--entry``), which the
  nested layout does not record.  Without it all groups count as one
  optimizer.  Without ``groups``, the empty groups of an optimizer that
  has no parameter at all are placed first (optimizer 0) or last.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch.nn as nn

from .. import errors
from .._engine.core import C, context
from .._engine.tree import insert_path
from .checkpoint import (
    FLAT,
    NESTED,
    Checkpoint,
    CheckpointError,
    Progress,
    group_runs,
    parse_flat_key,
    quiet_dcp,
)

__all__ = ["to_flat", "to_nested", "param_groups_of", "convert_checkpoint", "CheckpointError"]


def to_flat(osd: dict[str, Any], group_counts: Sequence[int] | None = None) -> dict[str, Any]:
    """The flattened layout of a nested FQN-keyed optimizer state dict --
    byte-identical keys to ``get_optimizer_state_dict(...,
    flatten_optimizer_state_dict=True)`` (the C core's ``flatten_optim``).

    ``group_counts``: the number of param groups of each optimizer, in
    order, when ``osd`` combines several optimizers and has empty groups
    (None: one optimizer).  Values are not copied.
    """
    if not isinstance(osd, dict) or "param_groups" not in osd:
        keys = list(osd)[:3] if isinstance(osd, dict) else type(osd).__name__
        raise errors.StateDictTypeError(
            "to_flat() needs a nested optimizer state dict with 'state' and "
            f"'param_groups' entries, got {keys}"
        )
    if "state" not in osd:  # DCP drops an empty 'state' dict
        osd = {"state": {}, **osd}
    counts = None if group_counts is None else [int(n) for n in group_counts]
    return C.flatten_optim(context(), osd, counts)


def _model_fqns(model: nn.Module) -> set[str]:
    index = C.walk_model(context(), model, "_fqn_modifiers")
    return {fqn for names in index.tensor_fqns for fqn in names}


def param_groups_of(model: nn.Module, optimizers: Any) -> list[list[list[str]]]:
    """The param-group structure of ``optimizers`` by FQN: per optimizer,
    per group, the FQNs of its parameters (``[]`` for an empty group) --
    the ``groups`` argument of :func:`to_nested`."""
    from .._engine.checks import _normalize_optimizers
    from ..state_dict import get_optimizer_state_dict

    optims = _normalize_optimizers(optimizers)
    osd = get_optimizer_state_dict(model, optims)
    # the nested layout (no flatten option): param_groups is a list of dicts
    groups = [list(g["params"]) for g in cast(list[dict[str, Any]], osd["param_groups"])]
    out, start = [], 0
    for optim in optims:
        n = len(optim.param_groups)
        out.append(groups[start:start + n])
        start += n
    return out


def _empty_identity(fqn_lists: list[list[str]], g: int, o: int) -> str:
    """csrc/split.c's identity of empty group ``g`` of optimizer ``o``."""
    for j in range(g - 1, -1, -1):
        if fqn_lists[j]:
            return f"{fqn_lists[j][0]}|after|{g - j}"
    for j in range(g + 1, len(fqn_lists)):
        if fqn_lists[j]:
            return f"{fqn_lists[j][0]}|before|{j - g}"
    return f"__optimizer_{o}_empty_group_{g}__"


def _groups_like(
    per_fqn: dict[str, dict[str, Any]],
    empties: dict[str, dict[str, Any]],
    groups: Sequence[Sequence[Sequence[str]]],
) -> list[dict[str, Any]]:
    order = {fqn: i for i, fqn in enumerate(per_fqn)}
    out = []
    for o, optim_groups in enumerate(groups):
        fqn_lists = [list(g) for g in optim_groups]
        for g, fqns in enumerate(fqn_lists):
            merged: dict[str, Any] = {}
            if fqns:
                # a flat load: the group takes its parameters' saved keys,
                # in saved order, later ones winning (csrc/split.c)
                for fqn in sorted((f for f in fqns if f in order), key=order.__getitem__):
                    merged.update(per_fqn[fqn])
            else:
                merged.update(empties.get(_empty_identity(fqn_lists, g, o), {}))
            merged["params"] = list(fqns)
            out.append(merged)
    return out


def to_nested(
    flat: dict[str, Any],
    fqns: Iterable[str] | nn.Module,
    *,
    groups: Sequence[Sequence[Sequence[str]]] | None = None,
) -> dict[str, Any]:
    """The nested layout of a flattened optimizer state dict.

    ``fqns``: the parameter FQNs (FQNs contain dots, so keys are split at
    the right-most dot whose left side is one of them), or the model.
    ``param_groups.<fqn>.<key>`` keys of FQNs not in ``fqns`` are split at
    their last dot.  Keys are parsed as ``set_optimizer_state_dict`` parses
    them (docs/architecture.md, "Flat keys").

    ``groups``: the param-group structure of the optimizers that will load
    the result (:func:`param_groups_of`); each group gets its parameters'
    saved values merged as a flat load merges them.  None: groups are
    rebuilt from the saved values (see the module docstring).  State keeps
    the flat dict's order.  Values are not copied.
    """
    if not isinstance(flat, dict):
        raise errors.StateDictTypeError(
            f"to_nested() needs a flattened optimizer state dict, not {type(flat).__name__}"
        )
    if "state" in flat and isinstance(flat.get("state"), dict) or "param_groups" in flat:
        raise errors.StateDictValueError(
            "to_nested() got a nested optimizer state dict (it has 'state' / "
            "'param_groups' entries); it is already in the nested layout"
        )
    known = _model_fqns(fqns) if isinstance(fqns, nn.Module) else {str(f) for f in fqns}
    per_fqn: dict[str, dict[str, Any]] = {}
    empties: dict[str, dict[str, Any]] = {}
    states: list[tuple[str, Any]] = []
    for key, value in flat.items():
        if not isinstance(key, str):
            raise errors.StateDictKeyError(f"flattened optimizer state dict keys must be str, got {key!r}")
        if key.startswith("state."):
            states.append((key, value))
            continue
        if not key.startswith("param_groups."):
            raise errors.StateDictKeyError(
                f"'{key}' is not a key of a flattened optimizer state dict (expected "
                "'state.<fqn>.<name>' or 'param_groups.<fqn>.<key>')"
            )
        parsed = parse_flat_key(key, known)
        if parsed is None:
            raise errors.StateDictKeyError(f"'{key}' names no parameter FQN and group key")
        kind, name, group_key = parsed
        target = empties if kind == "empty_group" else per_fqn
        target.setdefault(name, {})[group_key] = value
    names = known | set(per_fqn)
    state: dict[str, dict[str, Any]] = {}
    for key, value in states:
        parsed = parse_flat_key(key, names)
        if parsed is None:
            raise errors.StateDictKeyError(
                f"'{key}': no known parameter FQN is a prefix of it (pass the model's FQNs)"
            )
        insert_path(state.setdefault(parsed[1], {}), parsed[2], value, key, "state value")
    if groups is not None:
        return {"state": state, "param_groups": _groups_like(per_fqn, empties, groups)}
    return {"state": state, "param_groups": group_runs(per_fqn, empties)}


def _check_destination(src: str, dst: str, overwrite: bool) -> None:
    if os.path.realpath(src) == os.path.realpath(dst):
        raise CheckpointError(f"{dst}: the destination is the source checkpoint")
    if os.path.exists(dst):
        if not os.path.isdir(dst):
            raise CheckpointError(f"{dst}: exists and is not a directory")
        if os.listdir(dst) and not overwrite:
            raise CheckpointError(f"{dst}: directory is not empty (use overwrite=True / --force)")


def convert_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    to: str,
    group_counts: Sequence[int] | None = None,
    groups: Sequence[Sequence[Sequence[str]]] | None = None,
    overwrite: bool = False,
    progress: bool = False,
    trusted: bool = False,
) -> dict[str, Any]:
    """Write a copy of DCP checkpoint ``src`` to ``dst`` with every
    optimizer section in layout ``to`` ("flat" or "nested").

    ``groups`` (to "nested"): the param-group structure of the optimizers
    that will load the result (:func:`param_groups_of`; see
    :func:`to_nested`); to "flat" it gives ``group_counts``.
    ``group_counts`` (to "flat"): groups per optimizer (see
    :func:`to_flat`).

    Runs in one process (no process group needed) and holds the whole
    checkpoint in memory; tensors are written whole (a sharded checkpoint
    becomes one with one chunk per tensor, loadable at any world size).
    ``progress``: a progress line on stderr.  ``trusted``: unpickle the
    source's metadata and non-tensor entries without restriction (see
    ``dcp_optim.Checkpoint``; by default an entry the restricted unpickler
    refuses raises ``UnsafeCheckpointError``).  Returns a summary dict.
    Raises ``CheckpointError`` (naming the file and key) for unreadable or
    unexpected input.
    """
    if to not in (FLAT, NESTED):
        raise errors.StateDictValueError(f"to must be 'flat' or 'nested', not {to!r}")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._traverse import set_element

    src, dst = os.fspath(src), os.fspath(dst)
    ck = Checkpoint(src, trusted=trusted)
    if not ck.optimizers:
        raise CheckpointError(f"{src}: no optimizer state found in the checkpoint")
    targets = [s for s in ck.optimizers if s.layout != to]
    if not targets:
        names = ", ".join(f"'{s.name}'" for s in ck.optimizers)
        raise CheckpointError(f"{src}: optimizer {names} already uses the {to} layout")
    if groups is not None and to == FLAT and group_counts is None:
        group_counts = [len(g) for g in groups]
    if (group_counts is not None or groups is not None) and len(targets) > 1:
        raise errors.StateDictValueError(
            "group_counts / groups are ambiguous: the checkpoint has several optimizer sections "
            f"({', '.join(s.name for s in targets)})"
        )
    for sec in targets:
        if sec.unparsed:
            it = sec.unparsed[0]
            raise CheckpointError(
                f"{src}: cannot attribute '{it.key}' of optimizer '{sec.name}' to a "
                f"parameter FQN ({len(sec.unparsed)} such entries)"
            )
    _check_destination(src, dst, overwrite)
    values = ck.read([it.key for it in ck.items], progress="reading" if progress else None,
                     show_progress=progress, placeholders=False)
    converted = {it.key for sec in targets for it in sec.items}
    tree: dict[str, Any] = {}
    for it in ck.items:
        if it.key not in converted:
            set_element(tree, it.path, values[it.key])
    for sec in targets:
        sub: dict[str, Any] = {}
        for it in sec.items:
            set_element(sub, it.path[len(sec.root):], values[it.key])
        try:
            if to == FLAT:
                new = to_flat(sub, group_counts)
            else:
                new = to_nested(sub, ck.fqns_for(sec), groups=groups)
        except errors.DcpOptimError as exc:
            raise CheckpointError(f"{src}: optimizer '{sec.name}': {exc}") from exc
        except (NotImplementedError, KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{src}: optimizer '{sec.name}': {exc}") from exc
        if sec.root:
            set_element(tree, sec.root, new)
        else:
            tree.update(new)
    os.makedirs(dst, exist_ok=True)
    total = sum(it.nbytes for it in ck.items)
    bar = Progress(f"writing {dst}", len(ck.items), total, enabled=progress)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with quiet_dcp():
            dcp.save(tree, storage_writer=FileSystemWriter(dst), no_dist=True)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 (a BaseException)
        raise CheckpointError(f"{dst}: cannot write the converted checkpoint: {exc}") from exc
    bar.update(len(ck.items), total)
    bar.done()
    return {
        "source": src,
        "destination": dst,
        "to": to,
        "optimizers": [s.name for s in targets],
        "items": len(ck.items),
        "bytes": total,
        "groups_rebuilt": to == NESTED and groups is None,
    }
