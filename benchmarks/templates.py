"""Section 6 ("templates"): the template of a never-stepped optimizer.

``get_optimizer_state_dict`` of an optimizer that has not stepped, over a
model of about 100M parameters (``--tmpl-layers`` Linear(``--tmpl-dim``)
layers, fp32, one process), by each of dcp_optim's routes
(docs/differences.md, complete templates) against upstream's getter:

* ``schema``   -- ``torch.optim.AdamW``: the schema, applied natively;
* ``shadow``   -- an AdamW subclass with its own ``step`` (no schema): the
  shadow step over one copy of the parameters (two passes);
* ``upstream-style`` -- an AdamW subclass whose step refuses copies of its
  parameters: the shadow step raises, and one step of the real optimizer
  with zero gradients, undone, builds the template;
* ``upstream`` -- torch's getter on ``torch.optim.AdamW`` (its dummy step
  initialises the live optimizer).

Each (route, repetition) runs in a fresh child process: time of the call,
and its peak extra memory -- the process's peak RSS during the call
(``VmHWM``, reset through ``/proc/self/clear_refs`` just before it) less
the RSS before it.  The returned template itself is part of that peak
(for Adam: two parameter-sized tensors per parameter), so the cost of a
route beyond its result is ``peak - template``, reported too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

ROUTES = ("schema", "shadow", "upstream-style", "upstream")

_CHILD = r"""
import json, os, sys, time, warnings
warnings.simplefilter("ignore")
import torch, torch.nn as nn
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
route, layers, dim = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def rss_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0

class OwnStep(torch.optim.AdamW):
    # a class of its own with its own step: no schema, the shadow step
    def step(self, closure=None):
        return super().step(closure)

class RefusesCopies(torch.optim.AdamW):
    # the shadow step raises on copies: upstream's method, undone
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if not getattr(p, "_bench_live", False):
                    raise RuntimeError("not a live parameter")
        return super().step(closure)

torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)])
for p in model.parameters():
    p._bench_live = True
cls = {"schema": torch.optim.AdamW, "shadow": OwnStep, "upstream-style": RefusesCopies,
       "upstream": torch.optim.AdamW}[route]
opt = cls(model.parameters(), lr=1e-3)
if route == "upstream":
    import torch.distributed.checkpoint.state_dict as impl
else:
    import dcp_optim as impl
before = rss_kb("VmRSS")
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    reset = True
except OSError:
    reset = False
t0 = time.perf_counter()
sd = impl.get_optimizer_state_dict(model, opt)
dt = time.perf_counter() - t0
peak = rss_kb("VmHWM")
template = sum(v.numel() * v.element_size() for st in sd["state"].values() for v in st.values()
               if isinstance(v, torch.Tensor))
n = sum(p.numel() for p in model.parameters())
print(json.dumps({"s": dt, "peak_extra_mb": (peak - before) / 1024, "template_mb": template / 2**20,
                  "params_mb": n * 4 / 2**20, "n_params": n, "peak_reset": reset,
                  "entries": len(sd["state"])}))
"""


def _one(route: str, layers: int, dim: int) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", _CHILD, route, str(layers), str(dim)], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_templates(layers: int = 100, dim: int = 1000, reps: int = 2) -> dict[str, Any]:
    """{route: best-of-``reps`` time, peak extra memory (max over reps)}."""
    results: dict[str, Any] = {}
    for route in ROUTES:
        runs = [_one(route, layers, dim) for _ in range(reps)]
        ok = [r for r in runs if "error" not in r]
        if not ok:
            results[route] = runs[0]
            continue
        best = min(ok, key=lambda r: r["s"])
        best = dict(best, peak_extra_mb=max(r["peak_extra_mb"] for r in ok))
        best["beyond_template_mb"] = best["peak_extra_mb"] - best["template_mb"]
        results[route] = best
        print(f"  templates: {route}: {best['s']:.2f} s, peak +{best['peak_extra_mb']:.0f} MB "
              f"(template {best['template_mb']:.0f} MB)", flush=True)
    first: dict[str, Any] = next((r for r in results.values() if "n_params" in r), {})
    return {"config": {"layers": layers, "dim": dim, "reps": reps, "n_params": first.get("n_params"),
                       "params_mb": first.get("params_mb")}, "routes": results}


def table(s6: dict[str, Any]) -> str:
    rows = [f"{'route':<16}{'time s':>9}{'peak MB':>10}{'template MB':>13}{'beyond MB':>11}{'x params':>10}"]
    params_mb = s6["config"].get("params_mb") or 1.0
    for route in ROUTES:
        r = s6["routes"].get(route, {})
        if "error" in r:
            rows.append(f"{route:<16}  error: {r['error'][:80]}")
            continue
        rows.append(f"{route:<16}{r['s']:>9.2f}{r['peak_extra_mb']:>10.0f}{r['template_mb']:>13.0f}"
                    f"{r['beyond_template_mb']:>11.0f}{r['beyond_template_mb'] / params_mb:>10.2f}")
    return "\n".join(rows)
