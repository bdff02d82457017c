"""The C core's files form layers: no two files depend on each other.

``tools/c_layers.py`` builds the file graph of ``csrc/`` (calls, method
tables and includes; docs/architecture.md, "Layers of the C core") and
reports its cycles.  module.c sits on top (it calls every file's init),
helpers.c and context.c at the bottom.  The ``test_tool_*`` tests feed it
small trees, so a parser that silently stopped finding definitions or calls
would fail.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("c_layers", ROOT / "tools" / "c_layers.py")
assert _spec is not None and _spec.loader is not None
c_layers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(c_layers)


def test_csrc_has_no_cycle():
    deps = c_layers.graph()
    assert c_layers.cycles(deps) == []


def test_module_c_is_the_top_and_helpers_the_bottom():
    deps = c_layers.graph()
    # module.c adds every file's table and inits every type
    assert {"walk.c", "model_index.c", "walk_cache.c", "fqn.c"} <= deps["module.c"]
    assert not any("module.c" in d for d in deps.values())
    assert deps["helpers.c"] <= {"dcp.h", "compat.h", "ptrmap.h"}
    # walk_types.c sits below both the walk and its replay
    assert "walk_types.c" in deps["walk.c"] and "walk_types.c" in deps["walk_cache.c"]
    assert not deps["walk_types.c"] & {"walk.c", "walk_cache.c"}


def _tree(tmp_path, files):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return c_layers.graph(tmp_path)


def test_tool_finds_a_cycle_through_calls(tmp_path):
    deps = _tree(tmp_path, {
        "a.c": '#include "x.h"\nint\nfa(void)\n{\n    return fb(); /* fc() */\n}\n',
        "b.c": 'static int\nlocal(void)\n{\n    return 0;\n}\nint\nfb(void)\n{\n    return fa() + local();\n}\n',
        "c.c": 'int\nfc(void)\n{\n    return local();\n}\n',
        "x.h": "int fa(void);\n",
    })
    assert deps["a.c"] == {"b.c", "x.h"}  # the call in a comment does not count
    assert deps["c.c"] == set()  # b.c's static is not c.c's local
    assert c_layers.cycles(deps) == [["a.c", "b.c"]]


def test_tool_counts_method_tables_and_header_inlines(tmp_path):
    deps = _tree(tmp_path, {
        "m.c": "static PyMethodDef *t[] = {dcp_x_methods};\n",
        "x.c": "PyMethodDef dcp_x_methods[] = {{0}};\nint\nuse(void)\n{\n    return helper();\n}\n",
        "h.h": "static inline int\nhelper(void)\n{\n    return use();\n}\n",
    })
    assert deps["m.c"] == {"x.c"}
    assert deps["x.c"] == {"h.h"}
    assert c_layers.cycles(deps) == [["h.h", "x.c"]]
