"""``python -m dcp_optim`` / ``dcp-optim``: look into DCP checkpoints.

    inspect CKPT                   what the checkpoint holds (model, optimizers, other)
    convert CKPT OUT --to flat|nested
                                   rewrite the optimizer state in the other layout
    diff A B                       what differs between two checkpoints
    plan CKPT --entry MOD:FN       what loading CKPT into live objects would do

Exit codes: 0 success (``diff``: equal; ``plan``: no conflict), 1 ``diff``
found differences / ``plan`` found conflicts, 2 error (the message names
the file and key).

Only the checkpoint's metadata and its small non-tensor entries (param
group hyperparameters, ``params`` lists, other objects) are read, unless
``--values`` asks for tensor values (``inspect``, ``diff``); ``inspect
--metadata-only`` reads the metadata file alone.

Safe to point at any checkpoint: the metadata, the non-tensor entries and
the tensors are unpickled by a restricted unpickler
(``dcp_optim.tools._safe_unpickle``) that never calls or imports anything
outside an allowlist of what DCP checkpoints hold.  Outside it, the
metadata (or a tensor) is an error naming the class; a non-tensor entry
shows as ``<object of class X, not loaded>`` (``convert`` stops with an
error).  ``--trust`` unpickles everything as ``dcp.load`` does, which runs
any code a hostile checkpoint contains.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import importlib.util
import json
import math
import os
import sys
from typing import Any, cast

from .. import errors
from .checkpoint import (
    FLAT,
    NESTED,
    Checkpoint,
    CheckpointError,
    Item,
    NotLoaded,
    OptimizerSection,
    Progress,
    _one_line,
)

__all__ = ["main"]

EXIT_OK, EXIT_DIFFERENT, EXIT_ERROR = 0, 1, 2


class _UsageError(Exception):
    pass


# --- formatting helpers -----------------------------------------------------------------


def _shape(shape: Any) -> str:
    if shape is None:
        return "-"
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    if isinstance(value, NotLoaded):  # never shortened
        return text
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _jsonable(value: Any) -> Any:
    import torch

    if isinstance(value, str | int | bool) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return {"tensor": list(value.shape), "dtype": str(value.dtype).replace("torch.", "")}
    return repr(value)


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.ljust(w) for c, w in zip(r, widths)]
        out.append((indent + "  ".join(cells)).rstrip())
    return out


def _stats(tensor: Any) -> dict[str, Any]:
    import torch

    from .verify import tensor_checksum

    lo, hi = tensor_checksum(tensor)
    out: dict[str, Any] = {"checksum": f"{hi:08x}{lo:08x}"}
    if tensor.numel() and (tensor.is_floating_point() or not tensor.is_complex()):
        t = tensor.detach().to(torch.float64) if tensor.dtype != torch.bool else tensor.to(torch.float64)
        out.update(min=float(t.min()), max=float(t.max()), mean=float(t.mean()))
    return out


def _fmt_stats(s: dict[str, Any] | None) -> str:
    if not s:
        return ""
    if "min" in s:
        return f"min {s['min']:.4g}  max {s['max']:.4g}  mean {s['mean']:.4g}  #{s['checksum']}"
    return f"#{s['checksum']}"


# --- loading helpers --------------------------------------------------------------------------


def _object_keys(ck: Checkpoint) -> list[str]:
    """The non-tensor entries, and the param-group values saved as tensors
    (a tensor ``lr``), which ``logical_groups`` needs too."""
    group_keys = {it.key for sec in ck.optimizers for it in sec.group_items()}
    return [it.key for it in ck.items if not it.is_tensor or it.key in group_keys]


def _read_objects(ck: Checkpoint, quiet: bool) -> dict[str, Any]:
    return ck.read(_object_keys(ck), progress=None, show_progress=not quiet)


def _groups_of(sec: OptimizerSection, values: dict[str, Any]) -> list[dict[str, Any]]:
    return sec.logical_groups(values)


def _group_index(groups: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for i, g in enumerate(groups):
        for fqn in g.get("params", []):
            out.setdefault(fqn, i)
    return out


# --- inspect ---------------------------------------------------------------------------------------


def _inspect_report(ck: Checkpoint, args) -> dict[str, Any]:
    values: dict[str, Any] = {}
    if not args.metadata_only:
        values = _read_objects(ck, args.quiet)
    stats: dict[str, dict[str, Any]] = {}
    if args.values:
        keys = [it.key for it in ck.items if it.is_tensor and _wanted(it, ck, args.fqn)]
        bar = Progress("reading tensors", len(keys), sum(ck.by_key[k].nbytes for k in keys),
                       enabled=not args.quiet)
        for key, value in ck.iter_values(keys):
            stats[key] = _stats(value)
            bar.update(1, ck.by_key[key].nbytes)
        bar.done()

    def tensor_info(it: Item) -> dict[str, Any]:
        info: dict[str, Any] = {"key": it.key}
        if it.is_tensor:
            shape, _ = it.tensor_layout()
            info.update(shape=list(shape), dtype=it.dtype, chunks=len(it.chunks))
            if it.key in stats:
                info["stats"] = stats[it.key]
        else:
            info["type"] = "object"
            if it.key in values:
                info["value"] = values[it.key]
        return info

    files = {info.relative_path for info in (ck.metadata.storage_data or {}).values()}
    report: dict[str, Any] = {
        "checkpoint": ck.path,
        "files": len(files),
        "entries": len(ck.items),
        "tensor_bytes": sum(it.nbytes for it in ck.items),
        "models": [],
        "optimizers": [],
        "other": [],
    }
    for m in ck.models:
        report["models"].append({
            "name": m.name,
            "total": len(m.entries),
            "entries": {fqn: tensor_info(it) for fqn, it in m.entries.items() if _match(fqn, args.fqn)},
        })
    for sec in ck.optimizers:
        groups = None if args.metadata_only else _groups_of(sec, values)
        where = _group_index(groups) if groups is not None else {}
        state = {}
        for fqn, names in sec.state.items():
            if not _match(fqn, args.fqn):
                continue
            state[fqn] = {
                "group": where.get(fqn),
                "states": {name: tensor_info(it) for name, it in names.items()},
            }
        entry: dict[str, Any] = {
            "name": sec.name,
            "total": len(sec.state),
            "layout": sec.layout,
            "model": sec.model.name if sec.model else None,
            "fqns_from": sec.fqn_source,
            "state": state,
        }
        if groups is not None:
            entry["param_groups"] = [
                {
                    "index": i,
                    "params": list(g["params"]),
                    "hyperparameters": {k: v for k, v in g.items() if k != "params"},
                }
                for i, g in enumerate(groups)
            ]
            if sec.layout == FLAT:
                entry["param_groups_note"] = (
                    "flat layout: groups rebuilt from per-parameter hyperparameters "
                    "(consecutive parameters with equal values form one group)"
                )
        else:
            keys = sorted({k for g in sec.groups.values() for k in g}
                          | {k for g in sec.group_keys.values() for k in g})
            entry["param_group_keys"] = keys
        if sec.unparsed:
            entry["unparsed"] = [it.key for it in sec.unparsed]
        report["optimizers"].append(entry)
    report["other"] = [tensor_info(it) for it in ck.other]
    return report


def _match(fqn: str, pattern: str | None) -> bool:
    return pattern is None or fnmatch.fnmatchcase(fqn, pattern)


def _wanted(it: Item, ck: Checkpoint, pattern: str | None) -> bool:
    if pattern is None:
        return True
    for m in ck.models:
        for fqn, e in m.entries.items():
            if e is it:
                return _match(fqn, pattern)
    for sec in ck.optimizers:
        for fqn, names in sec.state.items():
            if any(e is it for e in names.values()):
                return _match(fqn, pattern)
    return True


def _render_inspect(report: dict[str, Any]) -> list[str]:
    mib = report["tensor_bytes"] / (1 << 20)
    lines = [
        f"checkpoint {report['checkpoint']}  ({report['files']} data file(s), "
        f"{report['entries']} entries, {mib:.2f} MiB of tensors)"
    ]
    for m in report["models"]:
        shown = len(m["entries"])
        count = f"{shown} entries" if shown == m["total"] else f"{shown} of {m['total']} entries"
        lines += ["", f"model '{m['name']}': {count}"]
        rows = [["FQN", "shape", "dtype", "values" if _any_stats(m["entries"].values()) else ""]]
        for fqn, info in m["entries"].items():
            rows.append([fqn, _shape(info.get("shape")), info.get("dtype", "object"),
                         _fmt_stats(info.get("stats"))])
        lines += _table(rows)
    for o in report["optimizers"]:
        groups = o.get("param_groups")
        ngroups = f"{len(groups)} param group(s)" if groups is not None else "param groups not read"
        shown = len(o["state"])
        count = f"{shown}" if shown == o["total"] else f"{shown} of {o['total']}"
        lines += ["", f"optimizer '{o['name']}': {o['layout']} layout, {ngroups}, "
                      f"{count} parameter(s) with state"]
        infos = [i for st in o["state"].values() for i in st["states"].values()]
        rows = [["FQN", "group", "state", "shape", "dtype", "values" if _any_stats(infos) else ""]]
        for fqn, st in o["state"].items():
            first = True
            group = "?" if st["group"] is None else str(st["group"])
            for name, info in st["states"].items():
                value = _fmt_stats(info.get("stats"))
                if "value" in info:
                    value = _short(info["value"])
                rows.append([fqn if first else "", group if first else "", name,
                             _shape(info.get("shape")), info.get("dtype", "object"), value])
                first = False
        lines += _table(rows)
        if groups is not None:
            lines.append("  param groups" + (" (rebuilt: flat layout)" if o["layout"] == FLAT else ""))
            for g in groups:
                params = g["params"]
                what = (f"{len(params)} param(s)" + (f" ({params[0]} ... {params[-1]})" if len(params) > 1
                                                     else f" ({params[0]})" if params else ""))
                lines.append(f"    {g['index']}: {what}")
                hyper = "  ".join(f"{k}={_short(v, 40)}" for k, v in g["hyperparameters"].items())
                lines.append(f"       {hyper}")
        else:
            lines.append("  param group keys (values not read): " + ", ".join(o["param_group_keys"]))
        if o.get("unparsed"):
            lines.append(f"  {len(o['unparsed'])} entries not attributed to an FQN: "
                         + ", ".join(o["unparsed"][:5]))
    if report["other"]:
        lines += ["", "other entries"]
        rows = []
        for info in report["other"]:
            if "shape" in info:
                rows.append([info["key"], _shape(info["shape"]), info["dtype"], _fmt_stats(info.get("stats"))])
            else:
                rows.append([info["key"], "object", "", _short(info["value"]) if "value" in info else ""])
        lines += _table(rows)
    return lines


def _any_stats(infos) -> bool:
    return any("stats" in i for i in infos)


def cmd_inspect(args) -> int:
    ck = Checkpoint(args.ckpt, trusted=args.trust)
    report = _inspect_report(ck, args)
    if args.json:
        print(json.dumps(_jsonable(report), indent=2))
    else:
        print("\n".join(_render_inspect(report)))
    return EXIT_OK


# --- convert ---------------------------------------------------------------------------------------


def cmd_convert(args) -> int:
    from .convert import convert_checkpoint, param_groups_of

    counts = None
    if args.group_counts:
        try:
            counts = [int(x) for x in args.group_counts.split(",")]
        except ValueError as exc:
            raise _UsageError(f"--group-counts must be comma-separated integers: {args.group_counts!r}") from exc
    groups = None
    if args.entry:
        model, optims = _load_entry(args.entry)
        if not optims:
            raise _UsageError(f"--entry {args.entry}: returned no optimizer")
        groups = param_groups_of(model, optims)
    report = convert_checkpoint(args.ckpt, args.out, to=args.to, group_counts=counts, groups=groups,
                                overwrite=args.force, progress=not args.quiet, trusted=args.trust)
    print(f"wrote {report['destination']}: optimizer(s) {', '.join(report['optimizers'])} "
          f"in the {report['to']} layout ({report['items']} source entries)")
    if report["groups_rebuilt"]:
        print("note: param groups were rebuilt from per-parameter hyperparameters; a DCP load "
              "of the nested layout needs the loading optimizers' group structure -- if it "
              "differs, convert with --entry MODULE:FUNCTION", file=sys.stderr)
    return EXIT_OK


# --- diff --------------------------------------------------------------------------------------------


def _logical(ck: Checkpoint, values: dict[str, Any], rename: dict[str, str]) -> dict[tuple, Any]:
    out: dict[tuple, Any] = {}
    for m in ck.models:
        name = rename.get(m.name, m.name)
        for fqn, it in m.entries.items():
            out[("model", name, fqn, "")] = it
    for sec in ck.optimizers:
        name = rename.get(sec.name, sec.name)
        for fqn, names in sec.state.items():
            for state_name, it in names.items():
                out[("state", name, fqn, state_name)] = it
        empty = 0
        for g in sec.logical_groups(values):
            hyper = {k: v for k, v in g.items() if k != "params"}
            if g["params"]:
                for fqn in g["params"]:
                    for k, v in hyper.items():
                        out[("group", name, fqn, k)] = v
                    if not hyper:
                        out[("group", name, fqn, "")] = "<no group keys>"
            else:
                for k, v in hyper.items():
                    out[("group", name, f"<empty group {empty}>", k)] = v
                empty += 1
        for it in sec.unparsed:
            out[("other", name, it.key, "")] = it
    in_sections = {it.key for m in ck.models for it in m.entries.values()}
    for it in ck.other:
        if it.key not in in_sections:
            out[("other", "", it.key, "")] = it
    return out


def _pair_names(a_names: list[str], b_names: list[str]) -> dict[str, str]:
    """B's section names renamed to A's when each side has exactly one."""
    if len(a_names) == 1 and len(b_names) == 1 and a_names != b_names:
        return {b_names[0]: a_names[0]}
    return {}


def _describe(value: Any) -> str:
    if isinstance(value, Item):
        return f"{_shape(value.shape)} {value.dtype}" if value.is_tensor else "object"
    return _short(value)


def _tensor_difference(x: Any, y: Any) -> str | None:
    import torch

    a, b = x.reshape(-1), y.reshape(-1)
    if a.numel() == 0:
        return None
    same_bits = a.contiguous().view(torch.uint8).reshape(a.numel(), -1) == b.contiguous().view(
        torch.uint8).reshape(b.numel(), -1)
    differing = int((~same_bits.all(dim=1)).sum())
    if not differing:
        return None
    text = f"values differ in {differing} of {a.numel()} elements"
    if a.is_floating_point():
        delta = (a.to(torch.float64) - b.to(torch.float64)).abs()
        finite = delta[torch.isfinite(delta)]
        if finite.numel():
            text += f" (max |a-b| {float(finite.max()):.3g})"
    return text


def cmd_diff(args) -> int:
    from .checkpoint import _same

    a, b = Checkpoint(args.a, trusted=args.trust), Checkpoint(args.b, trusted=args.trust)
    va, vb = _read_objects(a, args.quiet), _read_objects(b, args.quiet)
    rename = _pair_names([m.name for m in a.models], [m.name for m in b.models])
    rename.update(_pair_names([o.name for o in a.optimizers], [o.name for o in b.optimizers]))
    la, lb = _logical(a, va, {}), _logical(b, vb, rename)
    notes = []
    b_layouts = {rename.get(o.name, o.name): o.layout for o in b.optimizers}
    for o in a.optimizers:
        if o.name in b_layouts and b_layouts[o.name] != o.layout:
            notes.append(f"note: optimizer '{o.name}' is in the {o.layout} layout in A and the "
                         f"{b_layouts[o.name]} layout in B; compared per FQN")
    diffs: list[tuple[tuple, str]] = []
    tensor_pairs = []
    for key in sorted(set(la) | set(lb), key=lambda k: (k[0], k[1], k[2], k[3])):
        if key not in lb:
            diffs.append((key, f"only in A ({_describe(la[key])})"))
            continue
        if key not in la:
            diffs.append((key, f"only in B ({_describe(lb[key])})"))
            continue
        x, y = la[key], lb[key]
        if isinstance(x, Item) and isinstance(y, Item):
            if x.is_tensor != y.is_tensor:
                diffs.append((key, f"tensor vs object: {_describe(x)} vs {_describe(y)}"))
            elif x.is_tensor:
                if x.shape != y.shape:
                    diffs.append((key, f"shape {_shape(x.shape)} vs {_shape(y.shape)}"))
                elif x.dtype != y.dtype:
                    diffs.append((key, f"dtype {x.dtype} vs {y.dtype}"))
                elif args.values:
                    tensor_pairs.append((key, x, y))
            elif not _same(va[x.key], vb[y.key]):
                diffs.append((key, f"{_short(va[x.key])} vs {_short(vb[y.key])}"))
        elif isinstance(x, Item) or isinstance(y, Item):
            diffs.append((key, f"{_describe(x)} vs {_describe(y)}"))
        elif not _same(x, y):
            diffs.append((key, f"{_short(x)} vs {_short(y)}"))
    if tensor_pairs:
        total = sum(x.nbytes for _, x, _ in tensor_pairs)
        bar = Progress("comparing tensor values", len(tensor_pairs), total, enabled=not args.quiet)
        step = 128 << 20
        start = 0
        while start < len(tensor_pairs):  # batches of about 2 x 128 MiB
            batch: list[Any] = []
            size = 0
            while start < len(tensor_pairs) and (not batch or size < step):
                batch.append(tensor_pairs[start])
                size += tensor_pairs[start][1].nbytes
                start += 1
            xs = dict(a.iter_values([x.key for _, x, _ in batch], batch_bytes=step))
            ys = dict(b.iter_values([y.key for _, _, y in batch], batch_bytes=step))
            for key, x, y in batch:
                text = _tensor_difference(xs[x.key], ys[y.key])
                if text:
                    diffs.append((key, text))
            bar.update(len(batch), size)
            del xs, ys
        bar.done()
        diffs.sort(key=lambda d: d[0])
    if args.json:
        print(json.dumps({
            "a": a.path, "b": b.path, "equal": not diffs, "notes": notes,
            "differences": [
                {"kind": k[0], "section": k[1], "fqn": k[2], "name": k[3], "what": text}
                for k, text in diffs
            ],
        }, indent=2))
        return EXIT_DIFFERENT if diffs else EXIT_OK
    lines = [f"A: {a.path}", f"B: {b.path}"] + notes
    section = None
    titles = {"model": "model", "state": "optimizer", "group": "optimizer", "other": "other"}
    for key, text in diffs:
        kind, name, fqn, sub = key
        header = f"{titles[kind]} '{name}'" if name else titles[kind]
        if header != section:
            lines.append(header)
            section = header
        label = {
            "model": fqn,
            "state": f"state {fqn} [{sub}]",
            "group": f"param group of {fqn}: {sub}",
            "other": fqn,
        }[kind]
        lines.append(f"  {label}: {text}")
    lines.append(f"{len(diffs)} difference(s)" if diffs else "no differences"
                 + ("" if args.values else " (tensor values not compared; use --values)"))
    print("\n".join(lines))
    return EXIT_DIFFERENT if diffs else EXIT_OK


# --- plan ---------------------------------------------------------------------------------------------


def _load_entry(spec: str):
    """MODULE:FUNCTION (or path/to/file.py:FUNCTION) -> (model, optimizers)."""
    import torch
    import torch.nn as nn

    if ":" not in spec:
        raise _UsageError(f"--entry must be MODULE:FUNCTION, got {spec!r}")
    module_name, func_name = spec.rsplit(":", 1)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            loader = importlib.util.spec_from_file_location("_dcp_optim_entry", module_name)
            if loader is None or loader.loader is None:
                raise _UsageError(f"--entry {spec}: cannot load {module_name}")
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as exc:
        raise _UsageError(f"--entry {spec}: cannot import {module_name}: {exc}") from exc
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise _UsageError(f"--entry {spec}: {module_name} has no function {func_name!r}")
    result = fn()
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)):
        raise _UsageError(f"--entry {spec}: must return (model, optimizers), got {type(result).__name__}")
    model, optims = result
    if optims is None:
        optims = ()
    elif isinstance(optims, torch.optim.Optimizer):
        optims = (optims,)
    else:
        optims = tuple(optims)
    return model, optims


def _local_blocks(value: Any) -> list[tuple[tuple[int, ...], tuple[int, ...]]] | None:
    """(global offsets, sizes) of the part of ``value`` this process holds
    (None when it is not a single box)."""
    from torch.distributed.tensor import DTensor

    from .._engine.checksums import _encode_placements
    from .._engine.core import C

    if not isinstance(value, DTensor):
        return [((0,) * value.dim(), tuple(value.shape))]
    mesh = value.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return []
    encoded = _encode_placements(value.placements, max(value.dim(), 1), "")
    (_, blocks), = C.shard_layouts(list(value.shape), list(mesh.shape), encoded, [list(coord)])
    return [(tuple(g), tuple(n)) for _, g, n in blocks]


def _tensor_action(value: Any, it: Item | None, partial: bool) -> tuple[str, str]:
    import torch

    if it is None:
        if partial:
            return "fresh", "not in the checkpoint: keeps its current value"
        return "conflict", "missing in the checkpoint (a DCP load fails; --partial: initialise fresh)"
    if not isinstance(value, torch.Tensor):
        if it.is_tensor:
            return "conflict", f"type: checkpoint holds a tensor {_shape(it.shape)}, live value {_short(value)}"
        return "load", "object"
    if not it.is_tensor:
        return "conflict", f"type: checkpoint holds an object, live value is a tensor {_shape(tuple(value.shape))}"
    live_dtype = str(value.dtype).replace("torch.", "")
    if tuple(value.shape) != it.shape:
        return "conflict", f"shape: checkpoint {_shape(it.shape)}, live {_shape(tuple(value.shape))}"
    if live_dtype != it.dtype:
        return "conflict", f"dtype: checkpoint {it.dtype}, live {live_dtype} (DCP would cast)"
    blocks = _local_blocks(value)
    chunks = it.chunks
    desc = f"{_shape(it.shape)} {it.dtype}"
    if blocks and len(blocks) == 1 and blocks[0] in chunks:
        return "load", desc
    how = f"saved as {len(chunks)} chunk(s)"
    if blocks is not None and len(blocks) == 1 and blocks[0][1] != tuple(value.shape):
        how += f"; this process holds {_shape(blocks[0][1])} at {_shape(blocks[0][0])}"
    return "reshard", f"{desc}, {how}"


def _plan(ck: Checkpoint, model, optims, args) -> dict[str, Any]:
    from ..state_dict import get_model_state_dict, get_state_dict
    from .checkpoint import _same
    from .convert import _empty_identity

    osec = None
    if optims:
        candidates = ck.optimizers
        if args.section:
            candidates = [o for o in ck.optimizers if o.name == args.section]
        if not candidates:
            raise CheckpointError(f"{ck.path}: no optimizer section"
                                  + (f" '{args.section}'" if args.section else "")
                                  + f" (found: {', '.join(o.name for o in ck.optimizers) or 'none'})")
        osec = candidates[0]
    msec = osec.model if osec is not None and osec.model is not None else None
    if msec is None:
        wanted = [m for m in ck.models if not args.section or m.name != args.section]
        msec = wanted[0] if wanted else None
    # the nested layouts: {fqn: value} and {"state": {fqn: {...}}, "param_groups": [...]}
    msd: dict[str, Any]
    osd: dict[str, Any]
    if optims:
        msd, osd = get_state_dict(model, optims)
    else:
        msd, osd = get_model_state_dict(model), {}
    values = _read_objects(ck, True)
    partial = args.partial
    rows: list[dict[str, Any]] = []
    counts: dict[str, int] = {}

    def add(section: str, fqn: str, action: str, detail: str, name: str = "") -> None:
        rows.append({"section": section, "fqn": fqn, "name": name, "action": action, "detail": detail})
        counts[action] = counts.get(action, 0) + 1

    # model
    saved_model = msec.entries if msec is not None else {}
    for fqn, value in msd.items():
        action, detail = _tensor_action(value, saved_model.get(fqn), partial)
        add("model", fqn, action, detail)
    for fqn in saved_model:
        if fqn not in msd:
            add("model", fqn, "skip", "in the checkpoint only (not loaded)")
    # optimizer state
    groups_out: list[dict[str, Any]] = []
    if osec is not None:
        live_state = cast(dict[str, Any], osd.get("state", {}))
        for fqn, st in live_state.items():
            saved = osec.state.get(fqn, {})
            leaves = _leaves(st)
            for name, value in leaves:
                action, detail = _tensor_action(value, saved.get(name), partial)
                if saved.get(name) is None:
                    action, detail = (("fresh", "no saved state: keeps pristine state")
                                      if partial else
                                      ("conflict", "missing state (strict load fails; --partial: initialise fresh)"))
                add("optimizer", fqn, action, detail, name)
            for name in saved:
                if name not in dict(leaves):
                    add("optimizer", fqn, "skip", "saved state the live optimizer does not hold", name)
        for fqn in osec.state:
            if fqn not in live_state:
                add("optimizer", fqn, "skip", "state of a parameter no optimizer owns (not loaded)")
        groups_out = _plan_groups(osec, optims, osd, values, add, _same, _empty_identity)
    return {
        "checkpoint": ck.path,
        "model_section": msec.name if msec else None,
        "optimizer_section": osec.name if osec else None,
        "layout": osec.layout if osec else None,
        "rows": rows,
        "param_groups": groups_out,
        "summary": counts,
    }


def _leaves(state: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in state.items():
        if isinstance(v, dict):
            out += _leaves(v, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", v))
    return out


def _plan_groups(osec, optims, osd, values, add, same, empty_identity) -> list[dict[str, Any]]:
    """Per live group: which saved values it gets, and conflicts."""
    saved_groups = osec.logical_groups(values)
    live_groups = osd.get("param_groups", [])
    # where each FQN's saved values come from, in load order
    if osec.layout == NESTED:
        loaded = saved_groups[: len(live_groups)]  # a DCP template load is positional
        source: dict[str, Any] = {}
        for i, g in enumerate(loaded):
            for fqn in g["params"]:
                source.setdefault(fqn, []).append(i)
        empties = [i for i, g in enumerate(loaded) if not g["params"]]
    else:
        loaded = []
        source = {}
        for fqn, keys in osec.group_keys.items():
            source.setdefault(fqn, []).append(len(loaded))
            loaded.append({k: values[it.key] for k, it in keys.items()})
        empties_by_id = {ident: {k: values[it.key] for k, it in keys.items()}
                         for ident, keys in osec.empties.items()}
    out = []
    start = 0
    empty_k = 0
    for o, optim in enumerate(optims):
        n = len(optim.param_groups)
        fqn_lists = [list(g["params"]) for g in live_groups[start:start + n]]
        for g, fqns in enumerate(fqn_lists):
            live = live_groups[start + g]
            label = f"optimizer {o} group {g}"
            contributing: list[dict[str, Any]] = []
            if fqns:
                idx = sorted({i for f in fqns for i in source.get(f, [])})
                contributing = [loaded[i] for i in idx]
            elif osec.layout == NESTED:
                if empty_k < len(empties):
                    contributing = [loaded[empties[empty_k]]]
                empty_k += 1
            else:
                ident = empty_identity(fqn_lists, g, o)
                if ident in empties_by_id:
                    contributing = [empties_by_id[ident]]
            changes, conflicts, missing = [], [], []
            merged: dict[str, Any] = {}
            for src in contributing:
                for k, v in src.items():
                    if k == "params":
                        continue
                    if k in merged and not same(merged[k], v):
                        conflicts.append(f"{k}: saved groups disagree ({_short(merged[k], 30)} vs {_short(v, 30)}; the later wins)")
                    merged[k] = v
            for k, v in live.items():
                if k == "params":
                    continue
                if k not in merged:
                    missing.append(k)
                elif not same(merged[k], v):
                    changes.append(f"{k} {_short(v, 30)} -> {_short(merged[k], 30)}")
            added = [k for k in merged if k not in live]
            unloaded = [f for f in fqns if f not in source and osec.layout == NESTED
                        and any(f in sg["params"] for sg in saved_groups)]
            detail = []
            if not contributing:
                detail.append("no saved values (keeps its own)")
            if changes:
                detail.append("changes: " + ", ".join(changes))
            if added:
                detail.append("saved keys the live group lacks (not read): " + ", ".join(added))
            if missing and contributing:
                detail.append("not in the checkpoint: " + ", ".join(missing))
            if unloaded:
                detail.append(f"{len(unloaded)} param(s) from saved groups beyond the {len(live_groups)} "
                              "the load template holds (their saved hyperparameters are not read)")
            action = "conflict" if conflicts or (missing and contributing) or not contributing or unloaded else "load"
            if conflicts:
                detail = conflicts + detail
            add("param group", label, action, "; ".join(detail) or "unchanged")
            out.append({"optimizer": o, "group": g, "params": len(fqns), "action": action,
                        "changes": changes, "conflicts": conflicts, "missing": missing, "added": added})
        start += n
    return out


def cmd_plan(args) -> int:
    ck = Checkpoint(args.ckpt, trusted=args.trust)
    model, optims = _load_entry(args.entry)
    report = _plan(ck, model, optims, args)
    conflicts = report["summary"].get("conflict", 0)
    if args.json:
        print(json.dumps(_jsonable(report), indent=2))
        return EXIT_DIFFERENT if conflicts else EXIT_OK
    lines = [
        f"plan: load {ck.path} into {type(model).__name__}"
        + (f" + {len(optims)} optimizer(s) ({', '.join(type(o).__name__ for o in optims)})" if optims else ""),
        f"  model section '{report['model_section']}'"
        + (f", optimizer section '{report['optimizer_section']}' ({report['layout']} layout)"
           if report["optimizer_section"] else ""),
        "  nothing is loaded; sharded parameters are described for this process",
    ]
    for section in ("model", "optimizer", "param group"):
        rows = [r for r in report["rows"] if r["section"] == section]
        if not rows:
            continue
        lines += ["", section + (" state" if section == "optimizer" else "s" if section == "param group" else "")]
        if not args.verbose and section != "param group":
            rows = _collapse(rows)
        table = [["action", "FQN" if section != "param group" else "group", "state" if section == "optimizer" else "", "detail"]]
        for r in rows:
            table.append([r["action"], r["fqn"], r["name"], r["detail"]])
        lines += _table(table)
    summary = ", ".join(f"{n} {a}" for a, n in sorted(report["summary"].items()))
    lines += ["", f"summary: {summary}" + ("; conflicts found" if conflicts else "; no conflicts")]
    print("\n".join(lines))
    return EXIT_DIFFERENT if conflicts else EXIT_OK


def _collapse(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per FQN when all its state names load or reshard cleanly."""
    out: list[dict[str, Any]] = []
    by_fqn: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_fqn.setdefault(r["fqn"], []).append(r)
    for fqn, group in by_fqn.items():
        actions = {r["action"] for r in group}
        if len(group) > 1 and actions <= {"load", "reshard"}:
            reshard = [r for r in group if r["action"] == "reshard"]
            details = list(dict.fromkeys(
                r["detail"][r["detail"].find("saved as"):] for r in reshard if "saved as" in r["detail"]))
            out.append({"section": group[0]["section"], "fqn": fqn,
                        "action": "reshard" if reshard else "load",
                        "name": ", ".join(r["name"] for r in group),
                        "detail": "; ".join(details)})
        else:
            out.extend(group)
    return out


# --- entry point ---------------------------------------------------------------------------------------


def _add_trust(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trust", action="store_true",
                   help="unpickle the metadata and non-tensor entries without restriction, as "
                   "dcp.load does: a hostile checkpoint then runs arbitrary code on this machine "
                   "(default: a restricted unpickler that never runs code from the checkpoint)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dcp_optim",
        description="Look into torch.distributed.checkpoint (DCP) checkpoints: model and "
        "optimizer state per FQN, layout conversion, diffs and load plans.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="what a checkpoint holds (model, optimizers, other entries)")
    p.add_argument("ckpt", help="DCP checkpoint directory")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--values", action="store_true",
                   help="also read tensors: min / max / mean and the dcp_optim.verify checksum")
    p.add_argument("--metadata-only", action="store_true",
                   help="read the .metadata file only (no hyperparameter values, no group membership)")
    p.add_argument("--fqn", metavar="GLOB", help="only FQNs matching this glob pattern")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    _add_trust(p)
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("convert", help="rewrite a checkpoint's optimizer state in the other layout")
    p.add_argument("ckpt", help="source DCP checkpoint directory")
    p.add_argument("out", help="destination directory (new or empty)")
    p.add_argument("--to", required=True, choices=[FLAT, NESTED], help="target optimizer layout")
    p.add_argument("--group-counts", metavar="N,N,...",
                   help="to flat: param groups of each optimizer, when a nested checkpoint holds "
                   "several optimizers and empty groups")
    p.add_argument("--entry", metavar="MODULE:FUNCTION",
                   help="a function returning (model, optimizers) that will load the result: its "
                   "param-group structure is used (needed for nested targets whose groups cannot "
                   "be rebuilt from hyperparameters)")
    p.add_argument("--force", action="store_true", help="write into a non-empty destination")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    _add_trust(p)
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("diff", help="which FQNs, state names, shapes and hyperparameters differ")
    p.add_argument("a", help="first DCP checkpoint directory")
    p.add_argument("b", help="second DCP checkpoint directory")
    p.add_argument("--values", action="store_true", help="also compare tensor values (bit for bit)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    _add_trust(p)
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("plan", help="dry run: what loading a checkpoint into live objects would do")
    p.add_argument("ckpt", help="DCP checkpoint directory")
    p.add_argument("--entry", required=True, metavar="MODULE:FUNCTION",
                   help="a function returning (model, optimizers); MODULE may be a .py path")
    p.add_argument("--section", metavar="NAME", help="optimizer section to plan (default: the first)")
    p.add_argument("--partial", action="store_true",
                   help="plan a partial load (missing entries are initialised fresh, not conflicts)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("-v", "--verbose", action="store_true", help="one row per state name")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    _add_trust(p)
    p.set_defaults(func=cmd_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or usage errors (2)
        return int(exc.code or 0)
    try:
        return args.func(args)
    except (CheckpointError, _UsageError, errors.DcpOptimError) as exc:
        print(f"dcp-optim {args.command}: error: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:
        return EXIT_ERROR
    except Exception as exc:  # noqa: BLE001 (MemoryError, RecursionError too)
        # no traceback on any input: one line naming the checkpoint(s) and the cause
        where = ", ".join(str(getattr(args, a)) for a in ("ckpt", "a", "b") if getattr(args, a, None))
        print(f"dcp-optim {args.command}: error: {_one_line(where)}: unexpected "
              f"{type(exc).__name__}: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
