"""Section 1 (bookkeeping, one process) and section 3 (scaling).

The model is N small parameter tensors (``nn.Linear(4, 4)`` layers, two
tensors each) trained by ``torch.optim.Adam`` for one real step, so every
parameter has ``step``/``exp_avg``/``exp_avg_sq`` state.  With tensors
this small, the data movement is negligible and what is timed is the
per-parameter bookkeeping: FQN resolution, dict building, id mapping,
flattening, validation.

Layouts (``--layout``):

``tree`` (default)
    ``Sequential`` of stages of 20 blocks of 25 ``Linear`` layers (1000
    tensors per stage), FQNs like ``3.12.7.weight``: the hierarchy of a
    real network.
``flat``
    one ``Sequential`` of N/2 ``Linear`` layers.  torch's own
    ``Module.load_state_dict`` filters the whole remaining dict once per
    child (``{k: v for k in local_state_dict if k.startswith(prefix)}``), so
    with thousands of children in one container it is quadratic -- 18 s at
    10k tensors on a 2-core box, minutes at 50k -- and every
    ``set_model_state_dict`` (upstream's and dcp_optim's, which both end in
    ``load_state_dict``) inherits that.  Useful for 1k/10k only.

Every operation is timed for upstream, dcp_optim and, where one exists, the
"floor" (torch's own non-distributed call, the least work that can be done)
interleaved, on the same model and optimizer objects (see ``common``).
"""

from __future__ import annotations

import gc
import math
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint.state_dict as upstream
import torch.nn as nn

import dcp_optim

from .common import Candidate, Timing, copy_containers, measure_interleaved

IMPL_MODULES = {"upstream": upstream, "dcp_optim": dcp_optim}

#: The floor of the flattened getter: a dict of the same keys and values
#: built in one go (the least a flattened dict can cost to produce).
FLAT_FLOOR = "dict(zip(keys, values))"

#: Issue 26 requirement 3, "bookkeeping at torch's cost": (op id, the
#: largest dcp_optim/floor ratio allowed), checked at TARGET_SIZES.
TARGETS: list[tuple[str, float]] = [
    ("get_model_state_dict", 1.1),
    ("get_optimizer_state_dict/nested", 1.3),
    ("get_optimizer_state_dict/flat", 1.5),
]
TARGET_SIZES = (10_000, 200_000)
#: "Per-tensor cost flat": dcp_optim's microseconds per tensor at the
#: largest target size over those at the smallest, at most this.
PER_TENSOR_GROWTH_LIMIT = 1.2
#: Target ops and their floors get at least this many timed calls (medians
#: on a loaded machine).
TARGET_MIN_REPS = 7

#: (op id, public function, optimizer format or None, floor id)
OPS: list[tuple[str, str, str | None, str]] = [
    ("get_optimizer_state_dict/nested", "get_optimizer_state_dict", "nested", "optim.state_dict()"),
    ("get_optimizer_state_dict/flat", "get_optimizer_state_dict", "flat", FLAT_FLOOR),
    ("set_optimizer_state_dict/nested", "set_optimizer_state_dict", "nested", "optim.load_state_dict()"),
    ("set_optimizer_state_dict/flat", "set_optimizer_state_dict", "flat", "optim.load_state_dict()"),
    ("get_model_state_dict", "get_model_state_dict", None, "model.state_dict()"),
    ("set_model_state_dict", "set_model_state_dict", None, "model.load_state_dict()"),
    ("get_state_dict/nested", "get_state_dict", "nested", "model.state_dict()+optim.state_dict()"),
    ("get_state_dict/flat", "get_state_dict", "flat", "model.state_dict()+optim.state_dict()"),
]

STAGE_BLOCKS = 20
BLOCK_LAYERS = 25


def build(n_tensors: int, layout: str = "tree", width: int = 4) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model with exactly ``n_tensors`` parameters and an Adam optimizer
    after one real step (every parameter got a gradient)."""
    if n_tensors % 2:
        raise ValueError("n_tensors must be even (each Linear has weight and bias)")
    torch.manual_seed(0)
    n_layers = n_tensors // 2
    layers = [nn.Linear(width, width) for _ in range(n_layers)]
    if layout == "flat":
        model: nn.Module = nn.Sequential(*layers)
    elif layout == "tree":
        blocks = [
            nn.Sequential(*layers[i : i + BLOCK_LAYERS]) for i in range(0, n_layers, BLOCK_LAYERS)
        ]
        stages = [
            nn.Sequential(*blocks[i : i + STAGE_BLOCKS]) for i in range(0, len(blocks), STAGE_BLOCKS)
        ]
        model = nn.Sequential(*stages)
    else:
        raise ValueError(f"unknown layout {layout!r}")
    params = list(model.parameters())
    assert len(params) == n_tensors, (len(params), n_tensors)
    optim = torch.optim.Adam(params, lr=1e-3)
    # One real step: a forward/backward on one sample per layer gives every
    # parameter a gradient without a 25k-deep chain of activations.
    x = torch.randn(1, width)
    loss = sum(layer(x).sum() for layer in layers)
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return model, optim


# --- result comparison (upstream vs dcp_optim, once per size) -----------------


def compare(a: Any, b: Any, path: str = "", out: list[str] | None = None, limit: int = 5) -> list[str]:
    """Differences between two state dicts (values, not identity)."""
    out = [] if out is None else out
    if len(out) >= limit:
        return out
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            out.append(f"{path}: {type(a).__name__} vs {type(b).__name__}")
        elif a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
            out.append(f"{path}: tensor {tuple(a.shape)}/{a.dtype} vs {tuple(b.shape)}/{b.dtype}")
        return out
    if isinstance(a, dict) and isinstance(b, dict):
        ka, kb = set(a), set(b)
        if ka != kb:
            only_a = sorted(map(str, ka - kb))[:3]
            only_b = sorted(map(str, kb - ka))[:3]
            out.append(f"{path}: keys only upstream {only_a}, only dcp_optim {only_b}")
        for k in a:
            if k in b:
                compare(a[k], b[k], f"{path}/{k}", out, limit)
                if len(out) >= limit:
                    break
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            out.append(f"{path}: length {len(a)} vs {len(b)}")
            return out
        for i, (x, y) in enumerate(zip(a, b)):
            compare(x, y, f"{path}[{i}]", out, limit)
            if len(out) >= limit:
                break
        return out
    if type(a) is not type(b) or a != b:
        out.append(f"{path}: {a!r:.60} vs {b!r:.60}")
    return out


# --- section 1 ------------------------------------------------------------------


def _options(impl: str, fmt: str | None):
    return IMPL_MODULES[impl].StateDictOptions(flatten_optimizer_state_dict=(fmt == "flat"))


def _call_for(impl: str, func: str, fmt: str | None, model, optim, inputs: dict) -> Candidate:
    mod = IMPL_MODULES[impl]
    opts = _options(impl, fmt)
    f = getattr(mod, func)
    if func == "get_optimizer_state_dict":
        return Candidate(impl, lambda: f(model, optim, options=opts))
    if func == "get_state_dict":
        return Candidate(impl, lambda: f(model, optim, options=opts))
    if func == "get_model_state_dict":
        return Candidate(impl, lambda: f(model, options=opts))
    if func == "set_optimizer_state_dict":
        sd = inputs[(impl, "optim", fmt)]
        return Candidate(impl, lambda d: f(model, optim, d, options=opts), lambda: (copy_containers(sd),))
    if func == "set_model_state_dict":
        sd = inputs[(impl, "model", None)]
        return Candidate(impl, lambda d: f(model, d, options=opts), lambda: (copy_containers(sd),))
    raise AssertionError(func)


def _floor_for(floor: str, model, optim, inputs: dict) -> Candidate:
    if floor == "optim.state_dict()":
        return Candidate("floor", optim.state_dict)
    if floor == "optim.load_state_dict()":
        sd = inputs[("floor", "optim", None)]
        return Candidate("floor", optim.load_state_dict, lambda: (copy_containers(sd),))
    if floor == "model.state_dict()":
        return Candidate("floor", model.state_dict)
    if floor == FLAT_FLOOR:
        keys, values = inputs[("floor", "flat", None)]
        return Candidate("floor", lambda: dict(zip(keys, values)))
    if floor == "model.load_state_dict()":
        sd = inputs[("floor", "model", None)]
        return Candidate("floor", model.load_state_dict, lambda: (copy_containers(sd),))
    if floor == "model.state_dict()+optim.state_dict()":
        return Candidate("floor", lambda: (model.state_dict(), optim.state_dict()))
    raise AssertionError(floor)


def _predict(history: dict[int, float], n: int) -> float | None:
    """Extrapolated time at ``n`` tensors from earlier sizes: the local
    exponent of the last two sizes (at least 1, and 2 when only one size is
    known -- the pessimistic guess for upstream's loads)."""
    if not history:
        return None
    sizes = sorted(history)
    n1 = sizes[-1]
    t1 = history[n1]
    if len(sizes) >= 2:
        n0 = sizes[-2]
        e = math.log(max(t1, 1e-9) / max(history[n0], 1e-9)) / math.log(n1 / n0)
        e = min(max(e, 1.0), 2.5)
    else:
        e = 2.0
    return t1 * (n / n1) ** e


def _prepare_size(n: int, layout: str):
    """Model, optimizer and the inputs of the load operations: each
    implementation loads what it produced itself (same options)."""
    model, optim = build(n, layout)
    inputs: dict[tuple, Any] = {}
    errors: dict[tuple, str] = {}
    for impl, mod in IMPL_MODULES.items():
        for fmt in ("nested", "flat"):
            try:
                inputs[(impl, "optim", fmt)] = mod.get_optimizer_state_dict(
                    model, optim, options=_options(impl, fmt)
                )
            except Exception as exc:  # noqa: BLE001
                errors[(impl, "optim", fmt)] = f"{type(exc).__name__}: {exc}"
        try:
            inputs[(impl, "model", None)] = mod.get_model_state_dict(model)
        except Exception as exc:  # noqa: BLE001
            errors[(impl, "model", None)] = f"{type(exc).__name__}: {exc}"
    inputs[("floor", "optim", None)] = optim.state_dict()
    inputs[("floor", "model", None)] = model.state_dict()
    # the flat floor's keys and values: those of dcp_optim's flattened dict
    # (upstream's when dcp_optim's failed; the two are compared below)
    flat = inputs.get(("dcp_optim", "optim", "flat"), inputs.get(("upstream", "optim", "flat")))
    if flat is not None:
        inputs[("floor", "flat", None)] = (list(flat.keys()), list(flat.values()))
    # Everything alive now (torch, the model, the inputs) is moved out of
    # the collector's reach: the gc.collect() before every timed call then
    # costs microseconds instead of ~0.4 s, and no automatic full
    # collection over 250k+ long-lived objects lands inside a timed call.
    gc.collect()
    gc.freeze()
    return model, optim, inputs, errors


def _equivalence(inputs: dict, errors: dict) -> dict[str, list[str]]:
    out = {}
    for key in (("optim", "nested"), ("optim", "flat"), ("model", None)):
        a = inputs.get(("upstream", *key))
        b = inputs.get(("dcp_optim", *key))
        name = key[0] + (f"/{key[1]}" if key[1] else "")
        if a is None or b is None:
            tried = [(i, *key) for i in IMPL_MODULES]
            why = "; ".join(errors[k][:200] for k in tried if k in errors)
            out[name] = ["not compared: " + why]
        else:
            out[name] = compare(a, b)
    return out


def select_ops(spec: str | None) -> list[tuple[str, str, str | None, str]]:
    """``--ops``: comma-separated op ids or prefixes (``set_``, ``get_state_dict``)."""
    if not spec:
        return list(OPS)
    wanted = [w.strip() for w in spec.split(",") if w.strip()]
    ops = [o for o in OPS if any(o[0] == w or o[0].startswith(w) for w in wanted)]
    if not ops:
        raise SystemExit(f"--ops {spec!r} matches none of: {', '.join(o[0] for o in OPS)}")
    return ops


def run_bookkeeping(
    sizes: list[int],
    *,
    layout: str = "tree",
    budget_s: float = 2.0,
    min_reps: int = 3,
    max_reps: int = 25,
    max_call_s: float = 30.0,
    call_timeout_s: float | None = 90.0,
    ops: list[tuple[str, str, str | None, str]] | None = None,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
) -> dict[str, Any]:
    """Section 1.  Returns ``{"config": ..., "results": [...], "equivalence": ...}``;
    each result row is one (size, op, candidate)."""
    ops = list(ops or OPS)
    rows: list[dict[str, Any]] = []
    checks: dict[str, Any] = {}
    peak_rss_mb: dict[str, float] = {}
    history: dict[tuple[str, str], dict[int, float]] = {}
    t_section = time.perf_counter()
    for n in sorted(sizes):
        t_size = time.perf_counter()
        model, optim, inputs, errors = _prepare_size(n, layout)
        checks[str(n)] = _equivalence(inputs, errors)
        log(f"[bookkeeping] {n} tensors: model built, inputs made ({time.perf_counter() - t_size:.1f}s)")

        def skip_if_slow(key: tuple[str, str]) -> Timing | None:
            pred = _predict(history.get(key, {}), n)
            if pred is not None and pred > max_call_s:
                return Timing(
                    skipped=f"predicted {pred:.0f} s per call > --max-call-s {max_call_s:g}",
                    predicted_s=pred,
                )
            return None

        floors: dict[str, Timing] = {}
        for op_id, func, fmt, floor in ops:
            cands: list[Candidate] = []
            results: dict[str, Timing] = {}
            for impl in IMPL_MODULES:
                need = None
                if func == "set_optimizer_state_dict":
                    need = (impl, "optim", fmt)
                elif func == "set_model_state_dict":
                    need = (impl, "model", None)
                if need is not None and need not in inputs:
                    results[impl] = Timing(error="no input (its get failed): " + errors[need][:200])
                    continue
                # dcp_optim is what is measured: never skipped (the hard
                # --call-timeout still guards it); upstream's slow calls are
                skip = skip_if_slow((op_id, impl)) if impl != "dcp_optim" else None
                if skip is not None:
                    results[impl] = skip
                    continue
                cands.append(_call_for(impl, func, fmt, model, optim, inputs))
            # the floor (torch's own call) is never skipped: every ratio
            # against it is measured, at every size (only the hard
            # --call-timeout guards it)
            floor_reused = floor in floors
            if not floor_reused:
                if floor == FLAT_FLOOR and ("floor", "flat", None) not in inputs:
                    floors[floor] = Timing(error="no input (both flattened gets failed)")
                else:
                    cands.append(_floor_for(floor, model, optim, inputs))
            targeted = any(op_id == t[0] for t in TARGETS)
            t_op = time.perf_counter()
            results.update(
                measure_interleaved(
                    cands,
                    budget_s=budget_s,
                    min_reps=max(min_reps, TARGET_MIN_REPS) if targeted else min_reps,
                    max_reps=max(max_reps, TARGET_MIN_REPS) if targeted else max_reps,
                    call_timeout_s=call_timeout_s,
                    # a target's ratio is a ratio of medians at every size
                    always_repeat=frozenset({"dcp_optim", "floor"}) if targeted else frozenset(),
                )
            )
            if "floor" in results:
                floors[floor] = results.pop("floor")
                floor_median = floors[floor].median
                if floor_median is not None:
                    history.setdefault((floor, "floor"), {})[n] = floor_median
            results["floor"] = floors[floor]
            for impl, t in results.items():
                if impl != "floor" and t.median is not None:
                    history.setdefault((op_id, impl), {})[n] = t.median
                rows.append(
                    {
                        "n_tensors": n,
                        "op": op_id,
                        "impl": impl,
                        "floor_op": floor if impl == "floor" else None,
                        "floor_reused": impl == "floor" and floor_reused,
                        **t.to_json(),
                    }
                )
            log(
                f"[bookkeeping] {n:>6} {op_id:<32} "
                + "  ".join(f"{k}={_fmt_s(v)}" for k, v in results.items())
                + f"  ({time.perf_counter() - t_op:.1f}s)"
            )
            if any(t.timed_out for t in results.values()):
                log("[bookkeeping] a call timed out: rebuilding model, optimizer and inputs")
                del model, optim, inputs
                gc.unfreeze()
                model, optim, inputs, errors = _prepare_size(n, layout)
        del model, optim, inputs
        gc.unfreeze()
        gc.collect()
        # the process's high-water mark so far: sizes run in increasing
        # order, so at the largest size this is that size's peak
        peak_rss_mb[str(n)] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        log(
            f"[bookkeeping] {n} tensors done in {time.perf_counter() - t_size:.1f}s, "
            f"peak RSS so far {peak_rss_mb[str(n)]:.0f} MB"
        )
    return {
        "config": {
            "sizes": sorted(sizes),
            "layout": layout,
            "layer": "nn.Linear(4, 4)",
            "optimizer": "torch.optim.Adam(lr=1e-3), one step",
            "ops": [o[0] for o in ops],
            "budget_s": budget_s,
            "min_reps": min_reps,
            "max_reps": max_reps,
            "max_call_s": max_call_s,
            "call_timeout_s": call_timeout_s,
            "targets": {op: limit for op, limit in TARGETS},
            "target_sizes": list(TARGET_SIZES),
            "per_tensor_growth_limit": PER_TENSOR_GROWTH_LIMIT,
            "target_min_reps": TARGET_MIN_REPS,
        },
        "results": rows,
        "equivalence": checks,
        "peak_rss_mb": peak_rss_mb,
        "wall_s": time.perf_counter() - t_section,
    }


def _fmt_s(t: Timing) -> str:
    if t.error:
        return "ERROR"
    if t.skipped:
        return f"skipped(~{t.predicted_s:.0f}s)" if t.predicted_s else "skipped"
    if t.median is None:
        return "-"
    return fmt_time(t.median) + ("(1x)" if t.cold else "")


def fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.2f}s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f}ms"
    return f"{s * 1e6:.0f}us"


# --- section 3 ------------------------------------------------------------------


def scaling(section1: dict[str, Any]) -> dict[str, Any]:
    """Time per parameter tensor and the local exponent between consecutive
    sizes (1.0 = linear, 2.0 = quadratic), from section 1's medians."""
    series: dict[tuple[str, str], dict[int, float]] = {}
    for r in section1["results"]:
        if r["median_s"] is not None:
            series.setdefault((r["op"], r["impl"]), {})[r["n_tensors"]] = r["median_s"]
    out = []
    for (op, impl), pts in series.items():
        sizes = sorted(pts)
        per = {str(n): pts[n] / n * 1e6 for n in sizes}
        exps = {}
        for a, b in zip(sizes, sizes[1:]):
            exps[f"{a}->{b}"] = math.log(pts[b] / pts[a]) / math.log(b / a)
        out.append({"op": op, "impl": impl, "us_per_tensor": per, "exponent": exps})
    return {"series": out}
