"""The cross-layout resume matrix (tests/distributed/test_cross_layout.py).

What dcp_optim is for: optimizer state saved at one layout and loaded at
another.  For every case of the resume matrix's catalogue
(resume_cases.py), in both DCP formats (and, on request, a full dict
loaded by broadcast), between pairs of layouts -- ``w1`` (one process,
plain tensors), ``fsdp2`` (FSDP2 at world 2), ``fsdp1`` and
``fsdp1-flat`` (FSDP1 at world 2, ``use_orig_params`` True and False):

1. **save** (layout A): train ``STEPS`` steps, ``get_optimizer_state_dict``,
   ``dcp.save``; and A's *truth* (``truth``): the optimizer's own
   ``state_dict()`` with every parameter's entry keyed by FQN and full
   tensors, read without dcp_optim (DTensors made full; under FSDP1 the
   ranks' pieces put together from FSDP's flat-parameter metadata);
2. **load** (layout B): a fresh model and never-stepped optimizer,
   template, ``dcp.load``, ``set_optimizer_state_dict``; B's truth must
   equal A's (every entry and group key, values, dtypes and types), and
   ``RESUMED`` steps must run.

Verdicts: ``moved`` (truths equal, training goes on); ``raised`` (the
load raised: the reason is kept); ``requantized``, ``layout-dependent``
and ``not run`` (``_explain``: what no checkpoint carries across the
change, or a destination the optimizer cannot train at); ``no source``
(A could not train or save: the same-layout matrix judges that); ``no
oracle`` (A's ranks hold different values, which its checkpoint holds
one of: a full dict of rank-local values); and ``diverged`` (the state
installed is not the state saved, or the load said it succeeded and the
next step raised): the failure this matrix exists to catch.

The model is uneven at world 2 (5 inputs, 3 hidden units: FSDP2's shards
of 2 and 1 rows, FSDP1's padded flat parameters), so shard offsets differ
between every pair of layouts.
"""

from __future__ import annotations

import os
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import dcp_optim

from . import resume_cases as rc

LAYOUTS_W2 = ("fsdp2", "fsdp1", "fsdp1-flat")
LAYOUTS = ("w1",) + LAYOUTS_W2
# the DCP formats, and with DCP_OPTIM_CROSS_FORMATS=all "full": rank 0's
# file of a full dict (cpu_offload), loaded with broadcast_from_rank0 at
# world 2 (it doubles the matrix's time: left out of make test's run)
FORMATS = tuple(rc.FORMATS) + (("full",) if os.environ.get("DCP_OPTIM_CROSS_FORMATS") == "all" else ())


def _case(case: dict[str, Any]) -> dict[str, Any]:
    """The case on an uneven model (torchao's keep their wide one: its
    quantized blocks need >= 4096 elements)."""
    if "width" in case:
        return case
    return dict(case, width=5, hidden=3)


def _path(root: str, name: str, layout: str, fmt: str | None = None) -> str:
    stem = os.path.join(root, name.replace("/", "_").replace(" ", "_"), layout)
    return stem + (f"-{fmt}" if fmt else ".truth")


# --- the truth ----------------------------------------------------------------


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A tensor subclass of quantized state (torchao's) as the values it
    stands for; plain tensors cloned."""
    if type(t) is not torch.Tensor and hasattr(t, "dequantize"):
        return t.dequantize().detach().clone()
    return t.detach().clone()


def _full(value: Any) -> Any:
    """DTensors made full (a collective: every rank walks the same tree in
    the same order), tensors cloned, containers copied."""
    if hasattr(value, "full_tensor"):
        from torch.distributed.tensor import DTensor

        local = value.to_local()
        if type(local) is not torch.Tensor:  # a quantized piece: its values, made full
            value = DTensor.from_local(_plain(local), value.device_mesh, value.placements,
                                       shape=value.shape, stride=value.stride())
        return value.full_tensor().detach().clone()
    if isinstance(value, torch.Tensor):
        return _plain(value)
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_full(v) for v in value)
    return value


class _Pieces:
    """An FSDP1 rank's pieces of one full state tensor (merged across ranks)."""

    def __init__(self, numel: int, shape: tuple, pieces: list[tuple[int, torch.Tensor]]):
        self.numel, self.shape, self.pieces = numel, shape, pieces


class _Absent:
    """No value on this rank (its piece of the parameter is empty)."""


class _Value:
    """A value one rank holds for a whole parameter (must agree across ranks)."""

    def __init__(self, value: Any):
        self.value = value


def truth(model, opt, world: int, layout: str) -> dict[str, Any]:
    """The optimizer's ``state_dict()`` with every parameter's entry keyed by
    its FQN and full tensors, read without dcp_optim: a dict under "state"
    keyed by a parameter's index, or under a wrapper's own key by
    (group, index) (pytorch-optimizer's Lookahead, ScheduleFreeWrapper,
    Magma), and "param_groups"' parameter lists.  Under FSDP2 DTensors
    are made full; under FSDP1 each rank's pieces (FSDP's flat-parameter
    metadata: not FSDP's own ``optim_state_dict``, whose full dicts on CPU
    under ``use_orig_params`` alias every state of a parameter to the
    last one gathered) are put together, the values of ranks whose piece
    is empty left out, as FSDP does."""
    fsdp1 = world > 1 and layout.startswith("fsdp1")
    rows = _fsdp1_rows(model) if fsdp1 else {
        id(p): [(n, p.numel(), tuple(p.shape), 0, 0, p.numel())] for n, p in model.named_parameters()}
    params = [p for group in opt.param_groups for p in group["params"]]
    by_pair = {(g, i): p for g, group in enumerate(opt.param_groups) for i, p in enumerate(group["params"])}

    def entry(param: Any, value: Any) -> dict[str, Any]:
        """{fqn: {name: value}} of one parameter's entry."""
        out: dict[str, Any] = {}
        for fqn, numel, shape, start, at, length in rows[id(param)]:
            if not fsdp1:
                out[fqn] = _full(value)
                continue
            if not isinstance(value, dict):
                out[fqn] = _Value(_full(value)) if length else _Absent()
                continue
            mine: dict[str, Any] = {}
            for name, v in value.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == param.numel():
                    mine[name] = _Pieces(numel, shape, [(start, _plain(v).flatten()[at:at + length])] if length else [])
                elif length:  # FSDP's rule: a rank without a piece has no say
                    mine[name] = _Value(_full(v))
            out[fqn] = mine
        return out

    def walk(node: Any, parent: Any, depth: int) -> Any:
        # the optimizer's own parameter indices: in its dict and in a
        # wrapper's base optimizer's one level down (Lookahead's); not in
        # deeper copies of other optimizers' dicts (SPAM's warmup keeps a
        # scheduler's optimizer over a parameter of its own)
        if isinstance(node, dict):
            out: dict[Any, Any] = {}
            for k, v in node.items():
                param = None
                if parent == "state" and depth <= 2 and isinstance(k, int) and 0 <= k < len(params):
                    param = params[k]
                elif depth <= 1 and isinstance(k, tuple) and k in by_pair:
                    param = by_pair[k]
                if param is not None and id(param) in rows:
                    out.update(entry(param, v))
                elif k == "param_groups" and isinstance(v, list) and depth <= 1:
                    out[k] = _groups(v, params, rows)
                elif k == "params" and isinstance(v, list):
                    continue  # another optimizer's parameter list: the layout's, not state
                else:
                    out[k] = walk(v, k, depth + 1)
            return out
        if isinstance(node, (list, tuple)) and type(node) in (list, tuple):
            return type(node)(walk(v, None, depth + 1) for v in node)
        return _Value(_full(node)) if fsdp1 else _full(node)

    out = walk(opt.state_dict(), None, 0)
    if fsdp1:
        every: list[Any] = [None] * world
        dist.all_gather_object(every, out)
        merged = every[0]
        for other in every[1:]:
            merged = _merge(merged, other, "")
        out = _finish(merged)
    out = _drop_empty(out)
    if world > 1:
        # every rank's plain values must be one value: a checkpoint holds one
        every = [None] * world
        dist.all_gather_object(every, out)
        for rank, other in enumerate(every):
            diff = difference(out, other)
            if diff is not None:
                raise AssertionError(f"ranks 0 and {rank} hold different state: {diff}")
    return out


def _groups(groups: list[Any], params: list[Any], rows: dict[int, list]) -> list[Any]:
    """param_groups with their parameters' FQNs (FSDP1: a flat
    parameter's originals), other values made full."""
    out = []
    for group in groups:
        group = dict(group)
        ids = group.pop("params")
        group = {k: _full(v) for k, v in group.items()}
        group["params"] = [fqn for i in ids for fqn, *_ in rows.get(id(params[i]), [(i,)])]
        out.append(group)
    return out


def _merge(a: Any, b: Any, where: str) -> Any:
    """Two ranks' truths put together (FSDP1)."""
    if a is None or isinstance(a, _Absent):
        return b
    if b is None or isinstance(b, _Absent):
        return a
    if isinstance(a, _Pieces) and isinstance(b, _Pieces):
        return _Pieces(a.numel, a.shape, a.pieces + b.pieces)
    if isinstance(a, _Value) and isinstance(b, _Value):
        if difference(a.value, b.value) is not None:
            raise AssertionError(f"{where}: ranks hold different values")
        return a
    if isinstance(a, dict) and isinstance(b, dict):
        out = dict(a)
        for k, v in b.items():
            out[k] = _merge(out.get(k), v, f"{where}.{k}")
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return type(a)(_merge(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b)))
    if difference(a, b) is not None:
        raise AssertionError(f"{where}: ranks hold different values")
    return a


def _finish(node: Any) -> Any:
    if isinstance(node, _Pieces):
        dtype = node.pieces[0][1].dtype if node.pieces else torch.float32
        full = torch.full((node.numel,), float("nan"), dtype=dtype)
        for start, data in node.pieces:
            full[start:start + data.numel()] = data
        return full.view(node.shape)
    if isinstance(node, _Value):
        return node.value
    if isinstance(node, dict):
        return {k: _finish(v) for k, v in node.items() if not isinstance(v, _Absent)}
    if isinstance(node, (list, tuple)):
        return type(node)(_finish(v) for v in node)
    return node


def _drop_empty(node: Any) -> Any:
    """A parameter's empty entry (an optimizer that keeps no state for it:
    Fromage; PID without momentum) is its absence: torch's optimizers
    initialise either alike."""
    if isinstance(node, dict):
        out = {k: _drop_empty(v) for k, v in node.items()}
        return {k: v for k, v in out.items() if not (isinstance(v, dict) and not v)}
    return node


def _fsdp1_rows(model) -> dict[int, list[tuple[str, int, tuple, int, int, int]]]:
    """The optimizer's parameter (an original parameter under
    ``use_orig_params``, else the flat parameter) -> [(fqn, numel, full
    shape, start in the parameter, start in the optimizer's tensor,
    length on this rank)]."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    def clean(name: str) -> str:
        return name.replace("_fsdp_wrapped_module.", "").replace("_fsdp_wrapped_module", "").strip(".")

    rows: dict[int, list[tuple[str, int, tuple, int, int, int]]] = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, FSDP) or module._handle is None:
            continue
        flat = module._handle.flat_param
        for i, (fqn, info, shape) in enumerate(zip(flat._fqns, flat._shard_param_infos, flat._shapes)):
            fqn = clean(f"{prefix}.{fqn}")
            numel = int(torch.Size(shape).numel())
            if flat._params is not None:  # use_orig_params: the original parameter's own piece
                key, at = id(flat._params[i]), 0
            else:
                key, at = id(flat), info.offset_in_shard if info.in_shard else 0
            length = info.numel_in_shard if info.in_shard else 0
            start = info.intra_param_start_idx if info.in_shard else 0
            rows.setdefault(key, []).append((fqn, numel, tuple(shape), start, at, length))
    return rows


def difference(a: Any, b: Any, where: str = "", tolerance: float | None = None) -> str | None:
    """The first place two truths differ, or None.  ``tolerance``: float
    tensors may differ by that much of the first one's largest magnitude."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{where}: {type(a).__name__} vs {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        if tolerance is not None and a.is_floating_point() and a.numel():
            bound = tolerance * float(a.abs().max())
            return None if float((a - b).abs().max()) <= bound else f"{where}: values differ beyond {tolerance}"
        if not torch.equal(a, b) and not (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                          and torch.equal(a.nan_to_num(), b.nan_to_num())):
            return f"{where}: values differ ({a.flatten()[:4].tolist()} vs {b.flatten()[:4].tolist()})"
        return None
    if type(a) is not type(b):
        return f"{where}: {type(a).__name__} {a!r:.60} vs {type(b).__name__} {b!r:.60}"
    if isinstance(a, dict):
        if list(a) != list(b) and set(a) != set(b):
            return f"{where}: keys {sorted(map(str, set(a) ^ set(b)))} in one only"
        for k in a:
            diff = difference(a[k], b[k], f"{where}.{k}" if where else str(k), tolerance)
            if diff is not None:
                return diff
        return None
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            diff = difference(x, y, f"{where}[{i}]", tolerance)
            if diff is not None:
                return diff
        return None
    if a != b and not (a != a and b != b):  # NaN equals NaN here
        return f"{where}: {a!r:.60} vs {b!r:.60}"
    return None


# --- the two phases ------------------------------------------------------------


def _attempt(world: int, label: str, fn) -> tuple[Any, str | None]:
    """fn()'s result, or the failure every rank agrees on."""
    result, failure = None, None
    try:
        result = fn()
    except rc._ERRORS as exc:  # noqa: BLE001 - a verdict
        failure = f"{label}: {rc._reason(exc)}"
        rc._trace(traceback.format_exc())
    return result, rc._agree(world, failure)


def save_case(name: str, case: dict[str, Any], world: int, layout: str, root: str) -> str | None:
    """Phase 1 at ``layout``: both formats' checkpoints and the truth file;
    None, or why there is no source."""
    mesh = rc._case_mesh(world)
    built, failure = _attempt(world, "build", lambda: rc._build(case, world, mesh=mesh))
    if failure is None:
        failure = rc._train(*built, range(rc.STEPS), case["mode"], world)
    if failure is not None:
        rc._GROUP.pop("mesh", None)
        return failure
    model, opt = built
    saved_any = False
    for fmt in FORMATS:
        def save(fmt=fmt):
            if fmt == "full":
                # torchtune's and Lightning's full checkpoints: rank 0's file
                state = dcp_optim.get_optimizer_state_dict(model, opt, options=dcp_optim.StateDictOptions(
                    full_state_dict=True, cpu_offload=True))
                os.makedirs(_path(root, name, layout, fmt), exist_ok=True)
                if world == 1 or dist.get_rank() == 0:
                    torch.save(state, os.path.join(_path(root, name, layout, fmt), "optim.pt"))
                return
            state = dcp_optim.get_optimizer_state_dict(model, opt, options=rc.FORMATS[fmt])
            dcp.save({"model": dcp_optim.get_model_state_dict(model), "optim": state},
                     checkpoint_id=_path(root, name, layout, fmt))
        _, failure = _attempt(world, "save", save)
        if failure is not None:
            rc._GROUP.pop("mesh", None)
            mesh = rc._case_mesh(world)
        saved_any = saved_any or failure is None
    if not saved_any:
        return failure
    # the truth (after the saves: a getter must not change it)
    result, failure = _attempt(world, "truth", lambda: truth(model, opt, world, layout))
    if failure is not None:
        rc._GROUP.pop("mesh", None)
        return "no oracle: " + failure
    if world == 1 or dist.get_rank() == 0:
        torch.save(result, _path(root, name, layout))
    if world > 1:
        dist.barrier()
    return None


def load_case(name: str, case: dict[str, Any], world: int, layout: str, source: str, fmt: str,
              root: str) -> tuple[str, str]:
    """Phase 2: (verdict, reason) of loading ``source``'s checkpoint at ``layout``."""
    path = _path(root, name, source, fmt)
    truth_file = _path(root, name, source)
    if not os.path.exists(os.path.join(path, "optim.pt" if fmt == "full" else ".metadata")):
        return "no source", "the source did not save"
    if not os.path.exists(truth_file):
        return "no oracle", "no truth for the source"
    expected = torch.load(truth_file, weights_only=False)
    mesh = rc._case_mesh(world)
    options = rc.FORMATS.get(fmt)

    def load():
        model, opt = rc._build(case, world, seed=1, mesh=mesh)
        if fmt == "full":
            # rank 0 reads the file, the others receive (broadcast_from_rank0)
            rank0 = world == 1 or dist.get_rank() == 0
            full = torch.load(os.path.join(path, "optim.pt"), weights_only=False) if rank0 else {}
            dcp_optim.set_optimizer_state_dict(model, opt, full, options=dcp_optim.StateDictOptions(
                full_state_dict=True, broadcast_from_rank0=world > 1))
            return model, opt
        state = {"model": dcp_optim.get_model_state_dict(model),
                 "optim": dcp_optim.get_optimizer_state_dict(model, opt, options=options)}
        dcp.load(state, checkpoint_id=path)
        dcp_optim.set_model_state_dict(model, state["model"])
        dcp_optim.set_optimizer_state_dict(model, opt, state["optim"], options=options)
        return model, opt

    built, failure = _attempt(world, "load", load)
    if failure is not None:
        rc._GROUP.pop("mesh", None)
        return "raised", failure
    model, opt = built
    got, failure = _attempt(world, "truth", lambda: truth(model, opt, world, layout))
    if failure is not None:
        rc._GROUP.pop("mesh", None)
        return "no oracle", failure
    diff = difference(expected, got)
    failure = None if diff is None else f"the state installed differs from the state saved: {diff}"
    if failure is not None:
        explained = _explain(case, world, layout, expected, got)
        if explained is not None:
            return explained
    if failure is None:
        failure = rc._train(model, opt, range(rc.STEPS, rc.STEPS + rc.RESUMED), case["mode"], world)
        if failure is not None:
            rc._GROUP.pop("mesh", None)
            if not _trains(case, world):
                return "not run", f"the optimizer cannot train at {layout}: {failure}"
            failure = "the resumed step raised: " + failure
    failure = rc._agree(world, failure)
    if failure is not None:
        rc._GROUP.pop("mesh", None)
        return "diverged", failure
    return "moved", ""


def _names(t: dict[str, Any]) -> dict[Any, list[str]]:
    return {fqn: sorted(map(str, entry)) for fqn, entry in _states(t).items() if isinstance(entry, dict)}


def _states(t: dict[str, Any]) -> dict[str, Any]:
    """The per-parameter entries of a truth (a wrapper's base optimizer's)."""
    if "state" in t:
        return t["state"]
    inner = next((v for v in t.values() if isinstance(v, dict) and "state" in v), None)
    return inner["state"] if inner is not None else {}


def _explain(case: dict[str, Any], world: int, layout: str, expected: dict[str, Any],
             got: dict[str, Any]) -> tuple[str, str] | None:
    """A difference no checkpoint could avoid, or None (diverged):

    * "requantized": torchao's quantized states are quantized in blocks
      from the start of each tensor a rank holds; where the layouts cut
      the parameter elsewhere (FSDP1's flat pieces), the values saved are
      quantized again in the destination's blocks (the same values
      within the quantization's error; the same in upstream, DCP copies
      the saved values into the template's quantized tensors);
    * "layout-dependent": the optimizer keeps other state names at the
      destination (SPlus keeps eigenbases of 2-D parameters only, and
      FSDP1 gives it 1-D pieces): a fresh run there holds exactly the
      names installed;
    * "not run": the optimizer cannot train at the destination."""
    rc._GROUP.pop("mesh", None)
    if getattr(case["factory"], "__qualname__", "").startswith("_torchao") and \
            difference(expected, got, tolerance=0.25) is None:
        return "requantized", "torchao's states quantized again in the destination's blocks"
    mesh = rc._case_mesh(world)
    built, failure = _attempt(world, "build", lambda: rc._build(case, world, mesh=mesh))
    failure = failure or rc._train(*built, range(rc.STEPS), case["mode"], world)
    native = None
    if failure is None:
        native, failure = _attempt(world, "truth", lambda: truth(*built, world, layout))
    rc._GROUP.pop("mesh", None)
    if failure is not None:
        return "not run", f"the optimizer cannot train at {layout}: {failure}"
    if _names(native) == _names(got) != _names(expected):
        return "layout-dependent", "the optimizer keeps other state here: " + str(
            {k: v for k, v in _names(got).items() if v != _names(expected).get(k)})[:200]
    return None


def _trains(case: dict[str, Any], world: int) -> bool:
    """Whether a fresh run of the case trains at this layout at all."""
    mesh = rc._case_mesh(world)
    built, failure = _attempt(world, "build", lambda: rc._build(case, world, mesh=mesh))
    failure = failure or rc._train(*built, range(rc.STEPS + rc.RESUMED), case["mode"], world)
    if failure is not None:
        rc._GROUP.pop("mesh", None)
    return failure is None


def run_phase(rank: int, world: int, phase: str, names: list[str], root: str,
              pairs: list[tuple[str, str]]) -> list[tuple[str, str, str, str, str]]:
    """``phase`` "save": every case at this world's layouts of ``pairs``'
    sources; "load": at their destinations.  Returns [(name, source,
    destination, format, verdict, reason)] (load) or [(name, source, "",
    "", "no source", reason)] for the sources that could not save."""
    warnings.simplefilter("ignore")
    here = ("w1",) if world == 1 else LAYOUTS_W2
    cases = rc.catalogue()
    out = []
    for name in names:
        case = _case(cases[name])
        if case["skip"]:
            continue
        if phase == "save":
            for layout in dict.fromkeys(src for src, _ in pairs if src in here):
                rc._LAYOUT["name"] = layout
                if world > 1 and layout != "fsdp2" and name in rc.FSDP1_NOT_RUN:
                    continue
                why = save_case(name, case, world, layout, root)
                if why is not None:
                    out.append((name, layout, "", "", "no source", why))
        else:
            for source, layout in pairs:
                if layout not in here:
                    continue
                rc._LAYOUT["name"] = layout
                for fmt in FORMATS:
                    if world > 1 and layout != "fsdp2" and name in rc.FSDP1_NOT_RUN:
                        out.append((name, source, layout, fmt, "no source", rc.FSDP1_NOT_RUN[name]))
                        continue
                    try:
                        verdict, reason = load_case(name, case, world, layout, source, fmt, root)
                    except Exception as exc:  # noqa: BLE001 - the harness broke: a failure
                        verdict, reason = "diverged", "matrix error: " + rc._reason(exc) + traceback.format_exc()[-300:]
                    out.append((name, source, layout, fmt, verdict, reason))
        if world > 1:
            dist.barrier()
    return out


def run_world2(rank: int, world: int, names: list[str], root: str,
               pairs: list[tuple[str, str]]) -> list[tuple[str, str, str, str, str, str]]:
    """The world-2 launch: its sources' saves, then its destinations' loads."""
    return (run_phase(rank, world, "save", names, root, pairs)
            + run_phase(rank, world, "load", names, root, pairs))
