"""The file dependency graph of the C core (csrc/), and its cycles.

A file depends on another when it refers to a function or a global the
other defines (a call, or a method table the exec slot adds), or includes
it.  Definitions are found by the code style of csrc/ (docs/contributing.md):
a function's name starts its line, ``name(``, after its return type on the
line above; globals are ``PyMethodDef name[]`` / ``PyModuleDef name``.
``static inline`` functions of a header belong to that header.

One reference is not counted: ``dcp_moduledef``, the token by which a
method of a heap type finds its module's state (dcp_get_state_by_type, the
way CPython's own modules do with PyType_GetModuleByDef).  It is the
module's identity, not a call into module.c.

    python tools/c_layers.py          # prints the graph; exit 1 on a cycle
"""

from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
IDENTITY = {"dcp_moduledef"}

_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
_STRING = re.compile(r'"(?:\\.|[^"\\\n])*"')
_FUNC_DEF = re.compile(r"^([A-Za-z_]\w*)\(", re.M)
_INLINE_DEF = re.compile(r"^static inline [^\n]*\n([A-Za-z_]\w*)\(", re.M)
_DATA_DEF = re.compile(r"^(?:PyMethodDef|PyModuleDef)\s+([A-Za-z_]\w*)", re.M)
_INLINE_BODY = re.compile(r"^static inline [^\n]*\n[A-Za-z_]\w*\(.*?^\}", re.M | re.S)
_MACROS = {"PyDoc_STRVAR"}
_INCLUDE = re.compile(r'^#include\s+"([^"]+)"', re.M)
_IDENT = re.compile(r"\b[A-Za-z_]\w*\b")


def _code(path: pathlib.Path) -> tuple[str, list[str]]:
    """The code without comments and string literals, and its includes."""
    text = _COMMENT.sub(" ", path.read_text())
    return _STRING.sub('""', text), _INCLUDE.findall(text)


def graph(csrc: pathlib.Path = CSRC) -> dict[str, set[str]]:
    """file -> the files it depends on (other than itself)."""
    files = sorted(p for p in csrc.iterdir() if p.suffix in (".c", ".h"))
    parsed = {p.name: _code(p) for p in files}
    code = {name: text for name, (text, _) in parsed.items()}
    owner: dict[str, str] = {}
    for name, text in code.items():
        if name.endswith(".c"):
            found = _FUNC_DEF.findall(text) + _DATA_DEF.findall(text)
            # statics are file-local: only non-static definitions link across
            found = [f for f in found if not re.search(rf"^static [^\n]*\n{f}\(", text, re.M)]
        else:
            found = _INLINE_DEF.findall(text)
        for sym in found:
            if sym not in _MACROS:
                owner.setdefault(sym, name)
    deps: dict[str, set[str]] = {name: set() for name in code}
    for name, text in code.items():
        for inc in parsed[name][1]:
            if inc in code and inc != name:
                deps[name].add(inc)
        # a header's prototypes declare; only its inline bodies use
        body = text if name.endswith(".c") else "\n".join(_INLINE_BODY.findall(text))
        for ident in set(_IDENT.findall(body)):
            where = owner.get(ident)
            if where is not None and where != name and ident not in IDENTITY:
                deps[name].add(where)
    return deps


def cycles(deps: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one file."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(deps[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(deps):
        if v not in index:
            visit(v)
    return out


def main() -> int:
    deps = graph()
    for name in sorted(deps):
        print(f"{name}: {' '.join(sorted(deps[name]))}")
    found = cycles(deps)
    for comp in found:
        print("cycle:", " ".join(comp))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
