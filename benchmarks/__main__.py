"""``python -m benchmarks [--quick] [--sizes 1000,10000] [--json PATH] ...``"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="dcp_optim vs torch.distributed.checkpoint.state_dict: "
        "bookkeeping (1), distributed FSDP2 (2), scaling (3), distributed FSDP1 (4), "
        "scale simulation on the fake process group (5), never-stepped templates (6 or 'templates').",
    )
    p.add_argument("--quick", action="store_true",
                   help="1k and 10k tensors, shorter budgets, fewer distributed passes (~2 min)")
    p.add_argument("--sizes", help="comma-separated numbers of parameter tensors (default 1000,10000,50000,200000)")
    p.add_argument("--sections", default="1,2,3,4,5,6",
                   help="which sections to run: 1 bookkeeping, 2 distributed (FSDP2), 3 scaling (from 1), "
                   "4 distributed FSDP1 (flat parameters), 5 scale simulation (fake process group), "
                   "6 (or 'templates') the template of a never-stepped optimizer by route, "
                   "7 (opt-in, or 'reshard') in-memory resharding against gather+slice and DCP save+load, "
                   "8 (opt-in, or 'transport') full gets and broadcast loads against the raw collective "
                   "moving the same bytes, 9 (opt-in, or 'flows') real flows: the first call and the fixed "
                   "cost per call, Lightning Fabric's and torchtune's save and load at 2 ranks; "
                   "'targets': every speed target of issues 26 and 27 in one run (sections 1, 3, 5, 7, 8, 9 "
                   "narrowed to the targets' cases; ends with one table of them, benchmarks/targets.py)")
    p.add_argument("--tmpl-layers", type=int, default=100,
                   help="section 6: Linear(dim, dim) layers (default 100: 100M parameters at dim 1000)")
    p.add_argument("--tmpl-dim", type=int, default=1000, help="section 6: layer width (default 1000)")
    p.add_argument("--tmpl-reps", type=int, default=None, help="section 6: fresh processes per route (default 2, quick 1)")
    p.add_argument("--scale-worlds", help="section 5: simulated world sizes (default 8,64,512,4096; "
                   "quick 8,64,512)")
    p.add_argument("--scale-big", action="store_true", help="section 5: add 16384 and 65536 (memory permitting)")
    p.add_argument("--scale-ranks", default="0,1", help="section 5: simulated ranks (rank 0 always runs first)")
    p.add_argument("--scale-layouts", default=None, help="section 5: fsdp,dp_tp (quick: fsdp)")
    p.add_argument("--scale-models", default="rows,tiles", help="section 5: rows,tiles")
    p.add_argument("--scale-ops", default=None, help="section 5: operations (default all)")
    p.add_argument("--scale-impls", default=None, help="section 5: upstream,dcp_optim (default both)")
    p.add_argument("--scale-reps", type=int, default=None, help="section 5: timed calls, best of (default 3, quick 1)")
    p.add_argument("--ops", help="section 1 operations to run: comma-separated ids or prefixes, e.g. set_,get_model")
    p.add_argument("--layout", choices=("tree", "flat"), default="tree",
                   help="section 1 model layout (flat: torch's Module.load_state_dict is quadratic)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds of measuring per (op, implementation, size); default 2 (quick: 0.75)")
    p.add_argument("--min-reps", type=int, default=3)
    p.add_argument("--max-reps", type=int, default=25)
    p.add_argument("--max-call-s", type=float, default=30.0,
                   help="skip an upstream or floor call whose extrapolated time exceeds this (default 30; "
                        "dcp_optim always runs)")
    p.add_argument("--call-timeout", type=float, default=90.0,
                   help="hard limit per call in section 1 (0 = none; default 90)")
    p.add_argument("--dist-layers", type=int, default=128, help="section 2: Linear layers (2 tensors each)")
    p.add_argument("--dist-dim", type=int, default=256, help="section 2: layer width")
    p.add_argument("--fsdp1-layers", type=int, default=64,
                   help="section 4: Linear layers, one FSDP1 FlatParameter each (default 64)")
    p.add_argument("--dist-reps", type=int, default=None, help="section 2: timed reps after a warm-up (default 5, quick 2)")
    p.add_argument("--dist-mem-isolation", choices=("op", "impl", "shared"), default=None,
                   help="section 2 memory pass: fresh process pair per (op, impl), per impl (default), "
                   "or one shared pair (quick)")
    p.add_argument("--reshard-mb", type=float, default=100.0, help="section 7 (opt-in): MB of weights resharded")
    p.add_argument("--json", dest="json_path", help="where to write the JSON (default bench-out/bench-<time>.json)")
    p.add_argument("--plot", dest="plot_path", help="where to write the PNG (default: next to the JSON)")
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    from . import report, targets
    from .bookkeeping import run_bookkeeping, scaling, select_ops
    from .common import environment

    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    if "targets" in sections:
        sections.update(targets.SECTIONS)
        targets.apply_defaults(args)
    if "templates" in sections:
        sections.add("6")
    if "reshard" in sections:
        sections.add("7")
    if "transport" in sections:
        sections.add("8")
    if "flows" in sections:
        sections.add("9")
    if args.sizes:
        sizes = [int(float(x)) for x in args.sizes.split(",") if x.strip()]
    else:
        sizes = [1000, 10000] if args.quick else [1000, 10000, 50000, 200000]
    budget = args.budget if args.budget is not None else (0.75 if args.quick else 2.0)
    dist_reps = args.dist_reps if args.dist_reps is not None else (2 if args.quick else 5)
    mem_iso = args.dist_mem_isolation or ("shared" if args.quick else "impl")

    env = environment()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    json_path = args.json_path or os.path.join("bench-out", f"bench-{stamp}.json")
    plot_path = args.plot_path or os.path.splitext(json_path)[0] + ".png"
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    print(report.header(env), flush=True)
    print(f"command: python -m benchmarks {' '.join(sys.argv[1:] if argv is None else argv)}", flush=True)

    t0 = time.perf_counter()
    out: dict = {"environment": env, "argv": sys.argv[1:] if argv is None else argv}
    s1 = s2 = None
    if "1" in sections or "3" in sections:
        s1 = run_bookkeeping(
            sizes,
            layout=args.layout,
            budget_s=budget,
            min_reps=args.min_reps,
            max_reps=args.max_reps,
            max_call_s=args.max_call_s,
            call_timeout_s=args.call_timeout or None,
            ops=select_ops(args.ops),
        )
        out["bookkeeping"] = s1
        if "3" in sections:
            out["scaling"] = scaling(s1)
            s1["_scaling"] = out["scaling"]
    if "2" in sections:
        from .distributed import run_distributed

        s2 = run_distributed(
            layers=args.dist_layers,
            dim=args.dist_dim,
            reps=dist_reps,
            mem_isolation=mem_iso,
        )
        out["distributed"] = s2
    s4 = None
    if "4" in sections:
        from .distributed import OPS, run_distributed

        s4 = run_distributed(
            layers=args.fsdp1_layers,
            dim=args.dist_dim,
            reps=dist_reps,
            mem_isolation=mem_iso,
            framework="fsdp1",
            # upstream's FSDP1 model offload raises on a CPU device (and
            # leaves the ranks out of step): not measured
            ops=[op for op in OPS if op != "full_get_model_offload"],
        )
        out["distributed_fsdp1"] = s4
    s5 = None
    if "5" in sections:
        from . import scale

        ns = argparse.Namespace(
            worlds=args.scale_worlds, big=args.scale_big, quick=args.quick, ranks=args.scale_ranks,
            layouts=args.scale_layouts or ("fsdp" if args.quick else "fsdp,dp_tp"),
            models=args.scale_models, ops=args.scale_ops, reps=args.scale_reps, impls=args.scale_impls,
            saved_world=scale.SAVED_WORLD,
        )
        s5 = scale.run_from_args(ns, out_dir=os.path.dirname(os.path.abspath(json_path)))
        out["scale"] = s5
    s6 = None
    if "6" in sections:
        from .templates import run_templates

        s6 = run_templates(layers=args.tmpl_layers, dim=args.tmpl_dim,
                           reps=args.tmpl_reps if args.tmpl_reps is not None else (1 if args.quick else 2))
        out["templates"] = s6
    if "7" in sections:  # in-memory resharding (benchmarks/reshard.py); prints its own tables
        from .reshard import run_section

        out["reshard"] = run_section(mb=args.reshard_mb, worlds=(2, 4), reps=2 if args.quick else 3)
    if "8" in sections:  # transport limit (benchmarks/transport.py); prints its own table
        from .transport import run_section as run_transport

        out["transport"] = run_transport(reps=2 if args.quick else 5)
    if "9" in sections:  # real flows (benchmarks/flows.py); prints its own tables
        from .flows import run_section as run_flows

        out["flows"] = run_flows(first_reps=5 if args.quick else 20,
                                 reps={"tiny": 3, "50mb": 2} if args.quick else None)
    out["findings"] = report.findings(s1, s2)
    out["wall_s"] = time.perf_counter() - t0

    print()
    print(report.header(env))
    if s1:
        print(f"\n== 1. Bookkeeping, one process ({s1['config']['layout']} layout, Linear(4,4) + Adam); "
              "median per call ==")
        print("   * = a single (cold) call: its warm-up exceeded the budget;  skip(~t) = not run, "
              "extrapolated time t > --max-call-s")
        print(report.table_section1(s1))
        print(report.floor_legend(s1))
        print("\n-- ratios: up/dcp = upstream / dcp_optim (higher is better), "
              "dcp/floor = dcp_optim / torch's own call (lower is better) --")
        print(report.table_ratios(s1))
        print("\n-- targets (issue 26: bookkeeping at torch's cost); ratio = dcp_optim / floor of "
              "median CPU times of the calling thread, this run (wall ratio beside it) --")
        print(report.table_targets(s1))
    if "scaling" in out:
        print("\n== 3. Scaling: microseconds per parameter tensor; exp = d log t / d log n "
              "(1 linear, 2 quadratic) ==")
        print(report.table_scaling(out["scaling"]))
    if s2:
        c = s2["config"]
        print(f"\n== 2. Distributed: gloo, {c['world_size']} processes, FSDP2, {c['n_tensors']} tensors "
              f"({c['param_mb']:.0f} MB params), Adam; median of {c['reps']} (max over ranks) ==")
        print(f"   colls = collectives reaching the c10d dispatcher per rank; peak = extra RSS at "
              f"the call's peak per rank ({c['peak_method']}, isolation: {c['mem_isolation']})")
        print(report.table_distributed(s2))
    if s4:
        c = s4["config"]
        print(f"\n== 4. Distributed FSDP1: gloo, {c['world_size']} processes, {c['layers_flat']} FlatParameters, "
              f"{c['n_tensors']} original tensors ({c['param_mb']:.0f} MB params), Adam; median of {c['reps']} ==")
        print("   full_get_model_offload is left out: upstream's FSDP1 model offload fails on a CPU device (torch 2.13)")
        print(report.table_distributed(s4))
    if s5:
        c = s5["config"]
        print(f"\n== 5. Scale simulation: one process per (world, rank) on the fake process group; "
              f"best of {c['reps']} after a warm-up (CPU time of the process) ==")
        print("   peak = extra RSS at the call's peak (receive buffers written); colls / recv = collectives "
              "and bytes received per rank; model = alpha-beta time of those "
              f"(alpha {c['alpha_s'] * 1e6:.0f} us x ceil(log2 n) per collective, {c['bandwidth_Bps'] / 1e9:.0f} GB/s)")
        from . import scale

        print(scale.tables(s5))
    if s6:
        from .templates import table as templates_table

        c = s6["config"]
        print(f"\n== 6. Templates: get_optimizer_state_dict of a never-stepped optimizer, {c['n_params']} "
              f"parameters ({c['layers']} x Linear({c['dim']}, {c['dim']}), {c['params_mb']:.0f} MB), one process; "
              f"best time of {c['reps']} fresh processes ==")
        print("   peak = extra RSS at the call's peak (VmHWM); beyond = peak less the returned template; "
              "x params = beyond / the parameters' size")
        print(templates_table(s6))
    if out["findings"]:
        print("\n== Findings (dcp_optim) ==")
        for f in out["findings"]:
            print(" - " + f)
    s1_clean = {k: v for k, v in (s1 or {}).items() if k != "_scaling"}
    if s1:
        out["bookkeeping"] = s1_clean
    with open(json_path, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"\nJSON: {os.path.abspath(json_path)}")
    if s1 and not args.no_plot:
        err = report.plot(s1_clean, env, plot_path)
        print(err if err else f"plot: {os.path.abspath(plot_path)}")
    if s5 and not args.no_plot:
        from . import scale

        scale_plot = os.path.splitext(plot_path)[0] + "-scale.png"
        err = scale.plot(s5, scale_plot)
        print(err if err else f"scale plot: {os.path.abspath(scale_plot)}")
    # last, from the JSON written above: the run's targets in one table
    summary = targets.table(out)
    if summary:
        print("\n== Targets of issues 26 and 27, this run (measured beside the target) ==")
        print(summary)
    print(f"total wall time: {out['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
