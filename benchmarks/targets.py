"""Every speed target of issues 26 and 27 in one table, from one run.

``python -m benchmarks --sections targets`` (``make bench-targets``) runs
the sections that measure a target, each narrowed to the cases the
targets name (``SECTIONS``, ``apply_defaults``), and ends with
``table(out)``: one row per measured case -- the issue and requirement,
the case, the measured ratio, the target, met or MISSED.  Each section
also prints its own tables (with their profiles where a target is
missed).  ``table`` works on whatever sections a run holds, so any run
that includes one of them ends with the rows it can fill.

Where each figure comes from:

* 26.1, transport limit (section 8, ``benchmarks/transport.py``):
  dcp_optim / the raw collective moving the same bytes, <= 1.2;
* 26.2, flat in the world size (section 5, ``benchmarks/scale.py``,
  torch's fake process group): each operation's per-rank CPU time at the
  largest world / at the smallest (8), <= 1.25, per simulated rank;
* 26.3, bookkeeping at torch's cost (section 1): dcp_optim / floor at
  10k and 200k tensors, and the per-tensor growth from 10k to 200k;
* 26.4, real flows (section 9): first call and fixed cost on a tiny model
  (<= 1.0), Fabric's and torchtune's save and load (tiny <= 1.0, 50 MB
  < 1.0);
* 27.5, live resharding (section 7): at 4 ranks, DCP through tmpfs /
  reshard >= 5 and gather + slice / reshard >= 2; on the fake process
  group the repeated call's CPU time at the largest world / at 8, <= 1.25
  (the issue asks for "flat" without a number: issue 26's bound), and the
  bytes a rank receives plus those it copies locally equal its shards.
"""

from __future__ import annotations

import argparse
from typing import Any

from .report import _grid, bookkeeping_targets, growth_targets

#: the sections a targets run includes
SECTIONS = ("1", "3", "5", "7", "8", "9")
#: section 1: the sizes and operations of issue 26 requirement 3
BOOKKEEPING_SIZES = "10000,200000"
BOOKKEEPING_OPS = "get_model,get_optimizer_state_dict"
#: section 5: the smallest and largest simulated worlds, the model whose
#: bytes are the same at every world, and every operation of requirement 2
SCALE_WORLDS = "8,16384"
SCALE_MODELS = "rows"
SCALE_LAYOUTS = "fsdp"
SCALE_OPS = (
    "full_get_model,full_get_optim,offload_get_model,offload_get_optim,"
    "sharded_get_model,sharded_get_optim,sharded_set_model,sharded_set_optim,"
    "bcast_set_model,bcast_set_optim,resume_plan"
)
#: section 5 measures dcp_optim alone here: flatness is its own ratio
#: between worlds, and upstream's calls at 16384 ranks take minutes
SCALE_IMPLS = "dcp_optim"
FLAT_LIMIT = 1.25
RESHARD_VS_DCP = 5.0
RESHARD_VS_GATHER = 2.0
RESHARD_AT = 4


def apply_defaults(args: argparse.Namespace) -> None:
    """Narrow a ``--sections targets`` run to the targets' cases, where the
    command line did not choose otherwise."""
    args.sizes = args.sizes or BOOKKEEPING_SIZES
    args.ops = args.ops or BOOKKEEPING_OPS
    args.scale_worlds = args.scale_worlds or SCALE_WORLDS
    if args.scale_models == "rows,tiles":  # the section's own default
        args.scale_models = SCALE_MODELS
    args.scale_layouts = args.scale_layouts or SCALE_LAYOUTS
    args.scale_ops = args.scale_ops or SCALE_OPS
    args.scale_impls = args.scale_impls or SCALE_IMPLS


def _row(issue: str, case: str, measured: float | None, target: str, met: bool | None) -> list[str]:
    verdict = "not measured" if measured is None or met is None else ("met" if met else "MISSED")
    return [issue, case, "-" if measured is None else f"{measured:.2f}", target, verdict]


def _bookkeeping(s1: dict[str, Any]) -> list[list[str]]:
    rows = []
    for t in bookkeeping_targets(s1):
        rows.append(_row("26.3", f"{t['op']} {t['n']:,} tensors: dcp_optim / floor (CPU)", t["ratio"],
                         f"<= {t['limit']:.2f}", t["met"] if t["ratio"] is not None else None))
    for g in growth_targets(s1):
        ours, base = g["ours"], g["floor"]
        floor_note = f" (floor's own: {base[2]:.2f})" if base else ""
        rows.append(_row("26.3", f"{g['op']} per-tensor growth {g['lo']:,} -> {g['hi']:,}{floor_note}",
                         None if ours is None else ours[2], f"<= {g['limit']:.2f}",
                         None if ours is None else g["met"]))
    return rows


def _against_smallest(by_world: dict[int, Any]) -> list[tuple[int, Any, int, Any]]:
    """(the smallest world, its entry, a larger world, its entry) for each
    larger world of ``by_world``."""
    worlds = sorted(by_world)
    return [(worlds[0], by_world[worlds[0]], w, by_world[w]) for w in worlds[1:]]


def _scale(s5: dict[str, Any]) -> list[list[str]]:
    """Per (model, layout, rank, operation): dcp_optim's CPU time at each
    larger world over its time at the smallest one."""
    series: dict[tuple, dict[int, float]] = {}
    for r in s5.get("runs", []):
        for op, per in (r.get("ops") or {}).items():
            ms = (per.get("dcp_optim") or {}).get("cpu_ms")
            if ms:
                series.setdefault((r["model"], r["layout"], r["rank"], op), {})[r["world"]] = ms
    rows = []
    for (model, layout, rank, op), by_world in series.items():
        for w0, lo, w, hi in _against_smallest(by_world):
            ratio = hi / lo
            rows.append(_row("26.2", f"{op} rank {rank} ({model}/{layout}): CPU at W={w} / W={w0} "
                             f"({hi:.1f} / {lo:.1f} ms)", ratio, f"<= {FLAT_LIMIT:.2f}", ratio <= FLAT_LIMIT))
    return rows


def _transport(s8: dict[str, Any]) -> list[list[str]]:
    limit = s8.get("target", 1.2)
    return [_row("26.1", f"{r['op']} {r['model']} ({r['mb']:.0f} MiB), {r['world']} ranks: dcp_optim / raw",
                 r["ratio"], f"<= {limit:.1f}", r["ratio"] <= limit) for r in s8.get("rows", [])]


def _flows(s9: dict[str, Any]) -> list[list[str]]:
    rows = []
    for r in s9.get("first_call", []):
        if r.get("impl") != "dcp_optim":
            continue
        for kind in ("first", "steady"):
            for op, ratio in r[f"{kind}_ratio"].items():
                rows.append(_row("26.4", f"{kind} {op}, {r['form']} (tiny): dcp_optim / upstream", ratio,
                                 "<= 1.0", ratio <= 1.0))
    for r in s9.get("trainers", []):
        form = "" if r["form"] == "-" else f" {r['form']}"
        rows.append(_row("26.4", f"{r['client']}{form} {r['size']} {r['op']}: dcp_optim / upstream", r["ratio"],
                         r["target"], r["met"]))
    return rows


def _reshard(s7: dict[str, Any]) -> list[list[str]]:
    rows = []
    for g in s7.get("gloo", []):
        if g["world"] != RESHARD_AT:
            continue
        m = g["median_s"]
        for name, key, limit in (("DCP through tmpfs", "dcp_shm", RESHARD_VS_DCP),
                                 ("gather + slice", "gather", RESHARD_VS_GATHER)):
            speedup = m[key] / m["reshard"]
            rows.append(_row("27.5", f"reshard at {g['world']} ranks: {name} / reshard "
                             f"(bit-identical: {g['identical']})", speedup, f">= {limit:.1f}", speedup >= limit))
    series: dict[str, dict[int, dict]] = {}
    for s in s7.get("fake_scaling", []):
        series.setdefault(s["pair"], {})[s["world"]] = s
    for pair, by_world in series.items():
        for w0, lo, w, s in _against_smallest(by_world):
            ratio = s["repeat_cpu_s"] / lo["repeat_cpu_s"] if lo["repeat_cpu_s"] else None
            exact = s["recv_bytes"] + s["local_bytes"] == s["dst_shard_bytes"]
            rows.append(_row("27.5", f"reshard {pair} (fake group): repeat CPU at W={w} / W={w0}; "
                             f"bytes received + copied = shard: {exact}", ratio, f"<= {FLAT_LIMIT:.2f}",
                             None if ratio is None else ratio <= FLAT_LIMIT and exact))
    return rows


def rows(out: dict[str, Any]) -> list[list[str]]:
    """The targets the sections in ``out`` (the run's JSON) measured."""
    found: list[list[str]] = []
    if out.get("transport"):
        found += _transport(out["transport"])
    if out.get("scale"):
        found += _scale(out["scale"])
    if out.get("bookkeeping"):
        found += _bookkeeping(out["bookkeeping"])
    if out.get("flows"):
        found += _flows(out["flows"])
    if out.get("reshard"):
        found += _reshard(out["reshard"])
    return found


def table(out: dict[str, Any]) -> str:
    """The targets table of a run, or "" when it measured none."""
    found = rows(out)
    if not found:
        return ""
    met = sum(r[-1] == "met" for r in found)
    missed = sum(r[-1] == "MISSED" for r in found)
    return (_grid(["req", "case", "measured", "target", "verdict"], found, align="llrll")
            + f"\n{met} met, {missed} missed, {len(found) - met - missed} not measured")
