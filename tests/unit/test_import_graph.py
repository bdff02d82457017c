"""The package's import graph, read from the sources with ``ast``: no
import cycles among dcp_optim's modules (neither at module level nor
through the imports inside functions), a bounded depth, and the layering
of docs/architecture.md ("The package"): the pipeline (``dcp_optim._engine``)
never reaches up into the drop-in API or the tools, and the API never
imports a tool.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "dcp_optim"

# Longest chain of module-level imports among the package's modules (1: a
# module importing nothing of the package).  Today: dcp_optim (__init__)
# -> tools.verify -> state_dict -> _engine.optim -> _engine.model ->
# _engine.tree -> _engine.core -> errors.
MAX_DEPTH = 8

# What the pipeline may import from outside _engine: the leaf modules of
# the public surface (the marks it writes into state dicts among them) and
# the compiled core.
ENGINE_MAY_IMPORT = {"dcp_optim.errors", "dcp_optim.options", "dcp_optim.schema", "dcp_optim.marks",
                     "dcp_optim._dcp_optim"}
API_MODULES = ("dcp_optim.state_dict", "dcp_optim.options", "dcp_optim.errors",
               "dcp_optim.schema", "dcp_optim.patching")


def _module_name(path: Path) -> str:
    parts = ["dcp_optim", *path.relative_to(PKG).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    mods = {_module_name(p): p for p in PKG.rglob("*.py")}
    # The compiled core (its stub is in the sources, the .so may not be built).
    mods["dcp_optim._dcp_optim"] = PKG / "_dcp_optim.pyi"
    return mods


MODULES = _modules()


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The package modules an import statement loads (not the parent
    packages Python initialises on the way: those are implied)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            is_pkg = MODULES[module].name == "__init__.py"
            base = module.split(".") if is_pkg else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        # ``from pkg import sub`` loads pkg.sub; ``from mod import name`` loads mod
        names = [f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names]
    out = []
    for name in names:
        while name and name not in MODULES:  # ``import a.b.c`` of a non-module attribute
            name = name.rpartition(".")[0]
        if name and name != module:
            out.append(name)
    return out


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module-level imports, imports inside functions) per module.
    Imports under ``if TYPE_CHECKING:`` are ignored (never executed)."""
    top: dict[str, set[str]] = {m: set() for m in MODULES}
    inner: dict[str, set[str]] = {m: set() for m in MODULES}

    def visit(module: str, node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.dump(child.test):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                (inner if in_function else top)[module].update(_targets(module, child))
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(module, child, nested)

    for module, path in MODULES.items():
        if path.suffix == ".py":
            visit(module, ast.parse(path.read_text(), str(path)), False)
    return top, inner


TOP, INNER = _graph()


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_the_graph_sees_the_package():
    # the reader finds the modules and the edges the layering below relies on
    assert {"dcp_optim.state_dict", "dcp_optim._engine.core", "dcp_optim.tools.verify"} <= set(MODULES)
    assert "dcp_optim._engine.core" in TOP["dcp_optim.state_dict"]
    assert "dcp_optim._dcp_optim" in TOP["dcp_optim._engine.core"]
    assert "dcp_optim.tools.cli" in INNER["dcp_optim.__main__"]
    # a made-up cycle is found
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles_at_module_level():
    assert _cycles(TOP) == []


def test_no_import_cycles_through_function_level_imports():
    """An import inside a function defers a cycle to the call; none may
    exist (the package's own __init__ aside: modules imported by it may
    import ``dcp_optim`` lazily, e.g. testing and the demo)."""
    both = {m: (TOP[m] | INNER[m]) - {"dcp_optim"} for m in MODULES}
    assert _cycles(both) == []


def test_import_depth():
    @cache
    def depth(module: str) -> int:
        return 1 + max((depth(t) for t in TOP[module]), default=0)

    deepest = max(MODULES, key=depth)
    assert depth(deepest) <= MAX_DEPTH, (deepest, depth(deepest))


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("dcp_optim._engine")))
def test_the_engine_imports_no_api_or_tool(module):
    outside = {t for t in TOP[module] | INNER[module] if not t.startswith("dcp_optim._engine")}
    assert outside <= ENGINE_MAY_IMPORT, sorted(outside - ENGINE_MAY_IMPORT)


@pytest.mark.parametrize("module", API_MODULES)
def test_the_api_imports_no_tool(module):
    tools = {t for t in TOP[module] | INNER[module] if t.startswith("dcp_optim.tools")}
    assert not tools, sorted(tools)
