"""Terminal tables, the list of findings, and the PNG plot."""

from __future__ import annotations

import math
from typing import Any

from .bookkeeping import PER_TENSOR_GROWTH_LIMIT, TARGET_SIZES, TARGETS, fmt_time

#: dcp_optim/floor above this is flagged.
FLOOR_RATIO_LIMIT = 1.5
#: local exponent above this is called superlinear.
SUPERLINEAR = 1.2


def _grid(headers: list[str], rows: list[list[str]], align: str | None = None) -> str:
    widths = [len(h) for h in headers]
    for r in rows:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))
    align = align or ("l" + "r" * (len(headers) - 1))

    def line(cells):
        return "  ".join(
            c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(cells, widths, align)
        ).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def header(env: dict[str, Any]) -> str:
    return (
        f"dcp_optim benchmarks  {env['date']}\n"
        f"torch {env['torch']}  dcp_optim {env['dcp_optim']} ({env['dcp_optim_backend']})"
        f"  commit {env.get('git_commit') or '?'}  python {env['python']}\n"
        f"CPU: {env['cpu_model']}  cores: {env['cpu_cores']}  torch threads: {env['torch_threads']}"
    )


# --- section 1 ------------------------------------------------------------------


def _index(s1: dict[str, Any]) -> dict[tuple[int, str, str], dict[str, Any]]:
    return {(r["n_tensors"], r["op"], r["impl"]): r for r in s1["results"]}


def _cell(r: dict[str, Any] | None) -> str:
    if r is None:
        return "-"
    if r.get("error"):
        return "TIMEOUT" if r.get("timed_out") else "ERROR"
    if r.get("skipped"):
        return f"skip(~{fmt_time(r['predicted_s'])})" if r.get("predicted_s") else "skip"
    if r.get("median_s") is None:
        return "-"
    return fmt_time(r["median_s"]) + ("*" if r.get("cold") else "")


def _ratio(num: dict | None, den: dict | None) -> str:
    """num/den; with a skipped numerator the prediction gives an estimate (~)."""
    if not num or not den or den.get("median_s") in (None, 0):
        return "-"
    if num.get("median_s") is not None:
        return f"{num['median_s'] / den['median_s']:.2f}"
    if num.get("predicted_s"):
        return f"~{num['predicted_s'] / den['median_s']:.0f}"
    if num.get("timed_out"):
        limit = num.get("error", "").split("over ")[-1].split(" s")[0]
        try:
            return f">{float(limit) / den['median_s']:.0f}"
        except ValueError:
            return "-"
    return "-"


def _ops_and_sizes(s1):
    ops, sizes = [], []
    for r in s1["results"]:
        if r["op"] not in ops:
            ops.append(r["op"])
        if r["n_tensors"] not in sizes:
            sizes.append(r["n_tensors"])
    return ops, sorted(sizes)


def table_section1(s1: dict[str, Any]) -> str:
    idx = _index(s1)
    ops, sizes = _ops_and_sizes(s1)
    rows = []
    for op in ops:
        for n in sizes:
            up, dc, fl = (idx.get((n, op, i)) for i in ("upstream", "dcp_optim", "floor"))
            if up is None and dc is None:
                continue
            rows.append(
                [
                    op,
                    f"{n:,}",
                    _cell(up),
                    _cell(dc),
                    _cell(fl),
                    _ratio(up, dc),
                    _ratio(dc, fl),
                    f"{(up or {}).get('reps', 0)}/{(dc or {}).get('reps', 0)}/{(fl or {}).get('reps', 0)}",
                ]
            )
    out = _grid(
        ["operation", "tensors", "upstream", "dcp_optim", "floor", "up/dcp", "dcp/floor", "reps u/d/f"],
        rows,
    )
    rss = s1.get("peak_rss_mb") or {}
    if rss:
        out += "\npeak RSS of the process after each size (both implementations, model, inputs): " + ", ".join(
            f"{int(n):,}: {mb:.0f} MB" for n, mb in rss.items()
        )
    return out


def _cpu(r: dict | None) -> float | None:
    if not r or r.get("error") or r.get("skipped"):
        return None
    return r.get("cpu_median_s")


def bookkeeping_targets(s1: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 26 requirement 3, as data: per (operation, size) of
    ``TARGETS`` x ``TARGET_SIZES``, dcp_optim's and the floor's CPU-time
    medians (the calling thread's, ``time.thread_time``: what the calls
    consumed, not how long other processes held the CPU), their ratio
    (None where either is missing) and whether it is within the limit."""
    idx = _index(s1)
    out = []
    for op, limit in TARGETS:
        for n in TARGET_SIZES:
            dc, fl = idx.get((n, op, "dcp_optim")), idx.get((n, op, "floor"))
            cd, cf = _cpu(dc), _cpu(fl)
            ratio = cd / cf if cd is not None and cf else None
            out.append({"op": op, "n": n, "limit": limit, "dcp": dc, "floor": fl, "cpu_dcp": cd,
                        "cpu_floor": cf, "ratio": ratio, "met": ratio is not None and ratio <= limit})
    return out


def growth_targets(s1: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 26 requirement 3's per-tensor cost, as data: per operation of
    ``TARGETS``, microseconds per tensor at the smallest and the largest
    of ``TARGET_SIZES`` for dcp_optim and the floor, and their growth
    (None where not measured)."""
    idx = _index(s1)
    lo, hi = TARGET_SIZES[0], TARGET_SIZES[-1]
    out = []
    for op, _ in TARGETS:
        cells: dict[str, tuple[float, float, float] | None] = {}
        for impl in ("dcp_optim", "floor"):
            a, b = _cpu(idx.get((lo, op, impl))), _cpu(idx.get((hi, op, impl)))
            cells[impl] = (a / lo * 1e6, b / hi * 1e6, (b / hi) / (a / lo)) if a and b else None
        ours = cells["dcp_optim"]
        out.append({"op": op, "lo": lo, "hi": hi, "ours": ours, "floor": cells["floor"],
                    "limit": PER_TENSOR_GROWTH_LIMIT,
                    "met": ours is not None and ours[2] <= PER_TENSOR_GROWTH_LIMIT})
    return out


def table_targets(s1: dict[str, Any]) -> str:
    """Issue 26 requirement 3: each target's measured dcp_optim/floor ratio
    beside the target at 10k and 200k tensors, then dcp_optim's per-tensor
    cost from the smallest to the largest of those sizes (the floor's
    beside it).  Every figure comes from this run.  The verdict is on the
    ratio of CPU-time medians (``bookkeeping_targets``); the wall-time
    ratio is shown beside it."""
    rows = []
    for t in bookkeeping_targets(s1):
        dc, fl, cd, cf = t["dcp"], t["floor"], t["cpu_dcp"], t["cpu_floor"]
        if t["ratio"] is None:
            ratio, verdict = "-", "not measured"
        else:
            ratio, verdict = f"{t['ratio']:.2f}", "met" if t["met"] else "NOT MET"
        rows.append(
            [
                t["op"],
                f"{t['n']:,}",
                "-" if cd is None else fmt_time(cd),
                "-" if cf is None else fmt_time(cf),
                ratio,
                f"<= {t['limit']:.2f}",
                verdict,
                _ratio(dc, fl),
                f"{(dc or {}).get('reps', 0)}/{(fl or {}).get('reps', 0)}",
            ]
        )
    out = _grid(
        [
            "target: dcp_optim / floor",
            "tensors",
            "dcp_optim cpu",
            "floor cpu",
            "ratio",
            "target",
            "",
            "wall ratio",
            "reps d/f",
        ],
        rows,
    )
    lo, hi = TARGET_SIZES[0], TARGET_SIZES[-1]
    rows = []
    for g in growth_targets(s1):
        ours, base = g["ours"], g["floor"]
        if ours is None:
            rows.append([g["op"], "-", "-", "-", f"<= {g['limit']:.2f}", "not measured", "-"])
            continue
        rows.append(
            [
                g["op"],
                f"{ours[0]:.2f}",
                f"{ours[1]:.2f}",
                f"{ours[2]:.2f}",
                f"<= {g['limit']:.2f}",
                "met" if g["met"] else "NOT MET",
                f"{base[2]:.2f}" if base else "-",
            ]
        )
    out += "\n\n" + _grid(
        [
            "target: per-tensor cost flat",
            f"cpu us/tensor {_k(lo)}",
            f"cpu us/tensor {_k(hi)}",
            "growth",
            "target",
            "",
            "floor's growth",
        ],
        rows,
    )
    floors: dict[str, Any] = {}
    idx = _index(s1)
    for op, _ in TARGETS:
        for n in TARGET_SIZES:
            fl = idx.get((n, op, "floor"))
            if fl and fl.get("floor_op"):
                floors.setdefault(op, fl["floor_op"])
    out += "\nfloors: " + ("; ".join(f"{k}: {v}" for k, v in floors.items()) or "-")
    return out


def table_ratios(s1: dict[str, Any]) -> str:
    idx = _index(s1)
    ops, sizes = _ops_and_sizes(s1)
    headers = ["operation"] + [f"up/dcp {_k(n)}" for n in sizes] + [
        f"dcp/floor {_k(n)}" for n in sizes
    ]
    rows = []
    for op in ops:
        row = [op]
        for n in sizes:
            row.append(_ratio(idx.get((n, op, "upstream")), idx.get((n, op, "dcp_optim"))))
        for n in sizes:
            row.append(_ratio(idx.get((n, op, "dcp_optim")), idx.get((n, op, "floor"))))
        rows.append(row)
    return _grid(headers, rows)


def floor_legend(s1: dict[str, Any]) -> str:
    seen: dict[str, Any] = {}
    for r in s1["results"]:
        if r["impl"] == "floor" and r.get("floor_op"):
            base = r["op"].split("/")[0]
            # an op whose floor differs from its twin's (the flattened
            # getter's dict(zip(...))) is listed by its full id
            key = base if seen.get(base, r["floor_op"]) == r["floor_op"] else r["op"]
            seen.setdefault(key, r["floor_op"])
    return "floor = " + "; ".join(f"{k}: {v}" for k, v in seen.items())


# --- section 3 ------------------------------------------------------------------


def table_scaling(s3: dict[str, Any]) -> str:
    series = s3["series"]
    sizes = sorted({int(n) for s in series for n in s["us_per_tensor"]})
    pairs = sorted({p for s in series for p in s["exponent"]}, key=lambda p: int(p.split("->")[0]))
    headers = ["operation", "impl"] + [f"us/tensor {_k(n)}" for n in sizes] + [
        "exp " + "->".join(_k(int(x)) for x in p.split("->")) for p in pairs
    ] + ["shape"]
    rows = []
    for s in sorted(series, key=lambda s: (s["op"], ("upstream", "dcp_optim", "floor").index(s["impl"]))):
        exps = [s["exponent"].get(p) for p in pairs]
        known = [e for e in exps if e is not None]
        shape = ""
        if known:
            shape = "superlinear" if max(known) > SUPERLINEAR else "linear"
        rows.append(
            [s["op"], s["impl"]]
            + [
                f"{s['us_per_tensor'][str(n)]:.2f}" if str(n) in s["us_per_tensor"] else "-"
                for n in sizes
            ]
            + [f"{e:.2f}" if e is not None else "-" for e in exps]
            + [shape]
        )
    return _grid(headers, rows, "ll" + "r" * (len(headers) - 3) + "l")


# --- section 2 ------------------------------------------------------------------


def _k(n: int) -> str:
    return f"{n // 1000}k" if n % 1000 == 0 else str(n)


def _mb(x):
    return "-" if x is None else f"{x:.1f}"


def table_distributed(s2: dict[str, Any]) -> str:
    by = {(r["op"], r["impl"]): r for r in s2["results"]}
    ops = []
    for r in s2["results"]:
        if r["op"] not in ops:
            ops.append(r["op"])
    rows = []
    for op in ops:
        up, dc = by.get((op, "upstream")), by.get((op, "dcp_optim"))

        def t(r):
            if r is None:
                return "-"
            if r.get("error"):
                return "ERROR"
            return fmt_time(r["median_s"]) if r.get("median_s") is not None else "-"

        def coll(r):
            if r is None or r.get("error"):
                return "-"
            c = r.get("collectives_per_rank") or []
            vals = [x.get("wire_total") if x and "error" not in x else None for x in c]
            return "/".join("?" if v is None else str(v) for v in vals) or "-"

        def mem(r):
            if r is None:
                return "-"
            m = r.get("memory_per_rank") or []
            if not m or any(x.get("error") for x in m):
                return "ERROR" if m else "-"
            return "/".join(_mb(x.get("peak_mb")) for x in m)

        rows.append(
            [op, t(up), t(dc), _ratio(up, dc), coll(up), coll(dc), mem(up), mem(dc)]
        )
    return _grid(
        [
            "operation",
            "upstream",
            "dcp_optim",
            "up/dcp",
            "colls up r0/r1",
            "colls dcp r0/r1",
            "peak MB up r0/r1",
            "peak MB dcp r0/r1",
        ],
        rows,
    )


# --- findings ---------------------------------------------------------------------


def findings(s1: dict[str, Any] | None, s2: dict[str, Any] | None) -> list[str]:
    """Things the dcp_optim developers should look at."""
    out: list[str] = []
    if s1:
        idx = _index(s1)
        ops, sizes = _ops_and_sizes(s1)
        for op in ops:
            for n in sizes:
                up, dc, fl = (idx.get((n, op, i)) for i in ("upstream", "dcp_optim", "floor"))
                if dc and dc.get("error"):
                    out.append(f"{op} @ {n}: dcp_optim raised: {dc['error']}")
                    continue
                if not dc or dc.get("median_s") is None:
                    continue
                if up and up.get("median_s") and dc["median_s"] > up["median_s"]:
                    out.append(
                        f"{op} @ {n}: dcp_optim slower than upstream "
                        f"({fmt_time(dc['median_s'])} vs {fmt_time(up['median_s'])})"
                    )
                if fl and fl.get("median_s") and dc["median_s"] > FLOOR_RATIO_LIMIT * fl["median_s"]:
                    out.append(
                        f"{op} @ {n}: dcp_optim is {dc['median_s'] / fl['median_s']:.2f}x the floor "
                        f"({fmt_time(dc['median_s'])} vs {fl['floor_op']} {fmt_time(fl['median_s'])})"
                    )
        s3 = s1.get("_scaling")
        if s3:
            floor_exp = {s["op"]: s["exponent"] for s in s3["series"] if s["impl"] == "floor"}
            for s in s3["series"]:
                if s["impl"] != "dcp_optim":
                    continue
                for pair, e in s["exponent"].items():
                    fe = floor_exp.get(s["op"], {}).get(pair)
                    # superlinear, and not merely inheriting torch's own curve
                    if e > SUPERLINEAR and (fe is None or e > fe + 0.15):
                        extra = f" (floor: n^{fe:.2f})" if fe is not None else ""
                        out.append(f"{s['op']}: dcp_optim scales as n^{e:.2f} over {pair} tensors{extra}")
        for n, checks in s1.get("equivalence", {}).items():
            for what, diffs in checks.items():
                for d in diffs:
                    out.append(f"result differs from upstream, {what} @ {n}: {d}")
    if s2:
        for r in s2["results"]:
            if r["impl"] != "dcp_optim":
                continue
            if r.get("error"):
                out.append(f"distributed {r['op']}: dcp_optim raised: {r['error']}")
                continue
            up = next((x for x in s2["results"] if x["op"] == r["op"] and x["impl"] == "upstream"), None)
            if up and up.get("median_s") and r.get("median_s") and r["median_s"] > up["median_s"]:
                out.append(
                    f"distributed {r['op']}: dcp_optim slower than upstream "
                    f"({fmt_time(r['median_s'])} vs {fmt_time(up['median_s'])})"
                )
            if up:
                cu = [c.get("wire_total") for c in up.get("collectives_per_rank") or [] if c and "error" not in c]
                cd = [c.get("wire_total") for c in r.get("collectives_per_rank") or [] if c and "error" not in c]
                if cu and cd and max(cd) > max(cu):
                    out.append(f"distributed {r['op']}: dcp_optim issues more collectives ({cd} vs {cu})")
                mu = [m.get("peak_mb") for m in up.get("memory_per_rank") or [] if m.get("peak_mb") is not None]
                md = [m.get("peak_mb") for m in r.get("memory_per_rank") or [] if m.get("peak_mb") is not None]
                if mu and md and max(md) > 1.25 * max(mu) + 1.0:
                    out.append(
                        f"distributed {r['op']}: dcp_optim peak memory higher "
                        f"({', '.join(f'{x:.1f}' for x in md)} MB vs {', '.join(f'{x:.1f}' for x in mu)} MB)"
                    )
            for m in r.get("memory_per_rank") or []:
                if m.get("error"):
                    out.append(f"distributed {r['op']} (memory pass): dcp_optim raised: {m['error']}")
                    break
        for p in s2.get("problems", []):
            out.append(f"distributed run problem: {p.strip().splitlines()[-1][:300]}")
    return out


# --- plot -------------------------------------------------------------------------

COLORS = {"upstream": "tab:red", "dcp_optim": "tab:blue", "floor": "tab:gray"}
STYLES = {"upstream": "-", "dcp_optim": "-", "floor": "--"}


def plot(s1: dict[str, Any], env: dict[str, Any], path: str) -> str | None:
    """Log-log time per call vs number of parameter tensors: one panel per
    operation, one line per implementation (floor dashed).  Skipped points
    are drawn hollow at their predicted time.  Returns an error string, or
    None on success."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: {exc} (pip install matplotlib)"
    ops, sizes = _ops_and_sizes(s1)
    if len(sizes) < 1:
        return "no plot: no data"
    idx = _index(s1)
    ncols = min(4, len(ops))
    nrows = math.ceil(len(ops) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.6 * nrows), squeeze=False)
    for ax, op in zip(axes.flat, ops):
        for impl in ("upstream", "dcp_optim", "floor"):
            xs, ys, px, py = [], [], [], []
            for n in sizes:
                r = idx.get((n, op, impl))
                if not r:
                    continue
                if r.get("median_s") is not None:
                    xs.append(n)
                    ys.append(r["median_s"])
                elif r.get("predicted_s"):
                    px.append(n)
                    py.append(r["predicted_s"])
            label = impl if impl != "floor" else "floor (torch)"
            if xs:
                ax.plot(xs, ys, STYLES[impl], marker="o", color=COLORS[impl], label=label)
            if px:
                ax.plot(px, py, "o", mfc="none", color=COLORS[impl], label=f"{impl} (skipped, predicted)")
                if xs:
                    ax.plot([xs[-1], px[0]], [ys[-1], py[0]], ":", color=COLORS[impl])
        # linear reference through dcp_optim's first point
        r0 = idx.get((sizes[0], op, "dcp_optim"))
        if r0 and r0.get("median_s") and len(sizes) > 1:
            ax.plot(
                [sizes[0], sizes[-1]],
                [r0["median_s"], r0["median_s"] * sizes[-1] / sizes[0]],
                color="black",
                alpha=0.25,
                lw=1,
                label="O(n) reference",
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(op, fontsize=9)
        ax.set_xlabel("parameter tensors")
        ax.set_ylabel("seconds per call")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(ops):]:
        ax.axis("off")
    fig.suptitle(
        f"state_dict bookkeeping, upstream vs dcp_optim (torch {env['torch']}, "
        f"{env['cpu_model']}, {env['cpu_cores']} cores, {env['date'][:10]})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
