"""Summary table of a pytest JUnit XML report (``tools/gpu-check.sh``).

    python -m tests.gpu.summary [--brief] REPORT.xml [TITLE]

One row per test: outcome, seconds, and notes (the skip reason, the first
line of a failure, or the properties a test recorded, such as peak CUDA
memory), then the totals.  ``--brief``: only failures by name, skips and
xfails counted per reason.  Exit status 0 (the table is informative; the
script's status is pytest's).  Expects ``-o junit_family=xunit1`` (test
properties).
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def rows(path: str) -> list[tuple[str, str, float, str]]:
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "?")
        module = (case.get("classname") or "").rsplit(".", 1)[-1]
        outcome, note = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[tag]
                if tag == "skipped" and node.get("type") == "pytest.xfail":
                    outcome = "xfail"
                note = (node.get("message") or node.text or "").strip().splitlines()[0:1]
                note = note[0] if note else ""
                break
        props = case.find("properties")
        if props is not None:
            extra = "; ".join(f"{p.get('name')}={p.get('value')}" for p in props.iter("property"))
            note = f"{note}; {extra}" if note else extra
        out.append((f"{module}::{name}", outcome, float(case.get("time") or 0.0), note))
    return out


def table(path: str, title: str = "", brief: bool = False) -> str:
    data = rows(path)
    if brief:
        # failures and errors by name; skips and xfails counted per reason
        grouped: dict[tuple[str, str], int] = {}
        kept = []
        for name, outcome, secs, note in data:
            if outcome in ("FAILED", "ERROR"):
                kept.append((name, outcome, secs, note))
            elif outcome != "passed":
                grouped[(outcome, note)] = grouped.get((outcome, note), 0) + 1
        kept += [(f"({n} tests)", outcome, 0.0, note) for (outcome, note), n in grouped.items()]
        data, shown = kept, data
    else:
        shown = data
    width = max([len(r[0]) for r in data] + [4])
    lines = []
    if title:
        lines.append(title)
    lines.append(f"{'test':<{width}}  {'outcome':<8} {'secs':>6}  notes")
    lines.append("-" * (width + 30))
    for name, outcome, secs, note in data:
        lines.append(f"{name:<{width}}  {outcome:<8} {secs:6.1f}  {note[:160]}")
    counts: dict[str, int] = {}
    for _, outcome, _, _ in shown:
        counts[outcome] = counts.get(outcome, 0) + 1
    total = sum(r[2] for r in shown)
    lines.append("-" * (width + 30))
    lines.append(", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + f"  ({total:.0f} s in tests)")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    brief = "--brief" in argv
    argv = [a for a in argv if a != "--brief"]
    if len(argv) < 2:
        print(__doc__)
        return 2
    print(table(argv[1], " ".join(argv[2:]), brief=brief))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
