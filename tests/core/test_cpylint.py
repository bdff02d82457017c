"""Cheap lint tests: string scans of the C sources (docs/contributing.md, lint).

In the spirit of msgspec's ``tests/unit/test_cpylint.py``: each rule is a
few lines of text matching over ``csrc/*.c`` (comments and string literals
blanked out first), cheap enough to run in the normal suite and in
``make lint``.

* guards come in pairs within each function: Py_EnterRecursiveCall /
  Py_LeaveRecursiveCall, Py_ReprEnter / Py_ReprLeave,
  Py_BEGIN_CRITICAL_SECTION / Py_END_CRITICAL_SECTION;
* banned calls: PyModule_AddObject( (steals only on success),
  PyDict_GetItem( and PyDict_GetItemString( (swallow errors),
  PyObject_GetAttrString( outside module initialisation (use interned
  names from the module state), private _PyArg_* parsers;
* no file-scope ``static PyObject *`` (state lives in the module state);
* every heap-type dealloc releases its type (``Py_DECREF(tp)``) and every
  traverse visits it (``Py_VISIT(Py_TYPE(self))``);
* multi-phase initialisation only.

A line carrying ``/* cpylint-ignore: <reason> */`` is exempt from the
banned-call rules.  The ``test_linter_*`` tests feed the scanner bad
snippets, so a rule that silently stopped matching would fail.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "csrc"
SOURCES = sorted(CSRC.glob("*.c"))
IGNORE = "cpylint-ignore"

PAIRS = [
    ("Py_EnterRecursiveCall", "Py_LeaveRecursiveCall"),
    ("Py_ReprEnter", "Py_ReprLeave"),
    ("Py_BEGIN_CRITICAL_SECTION", "Py_END_CRITICAL_SECTION"),
]
BANNED = {
    r"\bPyModule_AddObject\s*\(": "PyModule_AddObject steals only on success: use PyModule_AddObjectRef",
    r"\bPyDict_GetItem\s*\(": "PyDict_GetItem swallows errors: use dcp_dict_get_ref",
    r"\bPyDict_GetItemString\s*\(": "PyDict_GetItemString swallows errors",
    r"\b_PyArg_\w+": "private _PyArg_* API",
    r"\bPyModule_Create\w*\s*\(": "single-phase init: use PyModuleDef_Init + Py_mod_exec",
    r"\bPyState_FindModule\s*\(": "single-phase init helper",
}
# Functions where attribute lookups by C string are fine (run once).
INIT_FUNCTIONS = re.compile(r"(_exec|_init_type|^PyInit_\w+)$")


def code_only(text: str) -> list[str]:
    """The source lines with comments and string/char literals blanked
    (same line count), so rules never match prose or messages."""
    out = []
    in_comment = False
    for line in text.splitlines():
        buf = []
        i = 0
        while i < len(line):
            if in_comment:
                end = line.find("*/", i)
                if end < 0:
                    i = len(line)
                    continue
                in_comment = False
                i = end + 2
                continue
            two = line[i:i + 2]
            if two == "/*":
                in_comment = True
                i += 2
                continue
            if two == "//":
                break
            ch = line[i]
            if ch in "\"'":
                j = i + 1
                while j < len(line) and line[j] != ch:
                    j += 2 if line[j] == "\\" else 1
                buf.append(ch + ch)
                i = j + 1
                continue
            buf.append(ch)
            i += 1
        out.append("".join(buf))
    return out


@dataclass
class Function:
    name: str
    path: Path
    start: int  # 0-based line of the opening brace
    raw: list[str]
    code: list[str]

    @property
    def body(self) -> str:
        return "\n".join(self.code)


_DEF = re.compile(r"^([A-Za-z_]\w*)\s*\(")


def functions(path: Path, text: str | None = None) -> list[Function]:
    """Function definitions in PEP 7 layout: the name at column 0, the
    opening and closing braces alone at column 0."""
    text = path.read_text() if text is None else text
    raw = text.splitlines()
    code = code_only(text)
    found = []
    i = 0
    while i < len(code):
        m = _DEF.match(code[i])
        if not m:
            i += 1
            continue
        j = i
        while j < len(code) and not code[j].rstrip().endswith((")", ";", "{")):
            j += 1
        if j >= len(code) or code[j].rstrip().endswith(";"):
            i = j + 1
            continue
        brace = j + 1 if code[j].rstrip().endswith(")") else j
        if brace >= len(code) or not code[brace].startswith("{"):
            i += 1
            continue
        end = brace + 1
        while end < len(code) and not code[end].startswith("}"):
            end += 1
        found.append(Function(m.group(1), path, brace, raw[brace:end + 1], code[brace:end + 1]))
        i = end + 1
    return found


def all_functions() -> list[Function]:
    return [f for p in SOURCES for f in functions(p)]


def check_pairs(fn: Function) -> list[str]:
    problems = []
    for enter, leave in PAIRS:
        n_enter = len(re.findall(rf"\b{enter}\s*\(", fn.body))
        n_leave = len(re.findall(rf"\b{leave}\s*\(", fn.body))
        if n_enter and not n_leave:
            problems.append(f"{fn.name}: {enter} without {leave}")
        if n_leave and not n_enter:
            problems.append(f"{fn.name}: {leave} without {enter}")
        if n_enter > 1:
            problems.append(f"{fn.name}: {enter} {n_enter} times (one guard per function)")
    return problems


def _ignored(raw: list[str], code: list[str], n: int) -> bool:
    """Whether an ignore comment covers line ``n``: one on that line or
    anywhere up to the end of its statement (the first ``;`` in code), since
    clang-format moves a trailing comment to the last line of a call it
    wraps."""
    for m in range(n, len(code)):
        if IGNORE in raw[m]:
            return True
        if ";" in code[m] or m - n > 8:
            return False
    return False


def check_banned(path: Path, text: str | None = None) -> list[str]:
    text = path.read_text() if text is None else text
    raw = text.splitlines()
    code = code_only(text)
    problems = []
    init_lines: set[int] = set()
    for fn in functions(path, text):
        if INIT_FUNCTIONS.search(fn.name):
            init_lines.update(range(fn.start, fn.start + len(fn.code)))
    for n, line in enumerate(code):
        if _ignored(raw, code, n):
            continue
        for pattern, why in BANNED.items():
            if re.search(pattern, line):
                problems.append(f"{path.name}:{n + 1}: {why}: {raw[n].strip()}")
        if re.search(r"\bPyObject_GetAttrString\s*\(", line) and n not in init_lines:
            problems.append(
                f"{path.name}:{n + 1}: PyObject_GetAttrString outside init "
                f"(use an interned name, or add /* {IGNORE}: reason */): {raw[n].strip()}"
            )
        if re.match(r"static\s+(const\s+)?Py\w*Object\s*\*\s*\w+\s*(=|;|\[)", line):
            problems.append(f"{path.name}:{n + 1}: file-scope static object pointer: {raw[n].strip()}")
    return problems


def slot_functions(text: str, slot: str) -> set[str]:
    return set(re.findall(rf"\{{\s*{slot}\s*,\s*(?:\([^)]*\)\s*)?(\w+)\s*\}}", text))


def check_type_slots(path: Path, text: str | None = None) -> list[str]:
    text = path.read_text() if text is None else text
    defs = {f.name: f for f in functions(path, text)}
    problems = []
    deallocs = slot_functions(text, "Py_tp_dealloc") | {n for n in defs if n.endswith("_dealloc")}
    for name in sorted(deallocs):
        fn = defs.get(name)
        if fn is None:
            problems.append(f"{path.name}: dealloc {name} not defined in this file")
        elif not re.search(r"\bPy_DECREF\s*\(\s*tp\s*\)", fn.body):
            problems.append(f"{path.name}: {name} does not Py_DECREF(tp)")
        elif not re.search(r"PyObject_GC_UnTrack\s*\(", fn.body):
            problems.append(f"{path.name}: {name} does not PyObject_GC_UnTrack")
    traverses = slot_functions(text, "Py_tp_traverse")
    traverses |= {n for n in defs if n.endswith("_traverse") and "module" not in n}
    for name in sorted(traverses):
        fn = defs.get(name)
        if fn is None:
            problems.append(f"{path.name}: traverse {name} not defined in this file")
        elif not re.search(r"Py_VISIT\s*\(\s*Py_TYPE\s*\(", fn.body):
            problems.append(f"{path.name}: {name} does not Py_VISIT(Py_TYPE(self))")
    return problems


# --- the rules on csrc/ --------------------------------------------------------


def test_sources_found():
    assert SOURCES, CSRC
    assert len(all_functions()) > 50


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_guards_paired(path):
    problems = [p for fn in functions(path) for p in check_pairs(fn)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_no_banned_calls(path):
    problems = check_banned(path)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_heap_type_slots(path):
    problems = check_type_slots(path)
    assert not problems, "\n".join(problems)


def test_multi_phase_init():
    text = "\n".join(p.read_text() for p in SOURCES)
    init = re.search(r"PyInit__dcp_optim\(void\)\n\{(.*?)\n\}", text, re.S)
    assert init, "PyInit__dcp_optim definition not found"
    assert re.fullmatch(r"\s*return PyModuleDef_Init\(&\w+\);\s*", init.group(1))
    assert "Py_mod_exec" in text


def test_ignore_comments_give_a_reason():
    for path in SOURCES:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if IGNORE in line:
                assert re.search(rf"{IGNORE}:\s*\S", line), f"{path.name}:{n}: {IGNORE} without a reason"


# --- the linter on bad snippets ----------------------------------------------------------

BAD = '''
static PyObject *cache = NULL;

static int
unpaired(PyObject *x)
{
    if (Py_EnterRecursiveCall(" here")) {
        return -1;
    }
    PyObject *v = PyDict_GetItem(x, x);
    return 0;
}

static PyObject *
lookup(PyObject *x)
{
    /* PyDict_GetItem( in a comment is fine */
    PyErr_SetString(PyExc_TypeError, "PyModule_AddObject( in a string is fine");
    PyObject *a = PyObject_GetAttrString(x, "a");
    PyObject *b = PyObject_GetAttrString(x, "b"); /* cpylint-ignore: test */
    PyObject *c = PyObject_GetAttrString(
        x, "c"); /* cpylint-ignore: wrapped by clang-format */
    PyObject *d = PyObject_GetAttrString(
        x, "d");
    Py_XDECREF(c); /* cpylint-ignore: covers only its own statement */
    return PyModule_AddObject(x, "a", a) ? NULL : b;
}

static void
Thing_dealloc(PyObject *self)
{
    PyObject_GC_UnTrack(self);
    Py_TYPE(self)->tp_free(self);
}

static int
Thing_traverse(PyObject *self, visitproc visit, void *arg)
{
    return 0;
}

static int
dcp_module_exec(PyObject *m)
{
    PyObject *ok = PyObject_GetAttrString(m, "fine_in_init");
    return 0;
}
'''


def test_linter_finds_functions():
    names = [f.name for f in functions(Path("bad.c"), BAD)]
    assert names == ["unpaired", "lookup", "Thing_dealloc", "Thing_traverse", "dcp_module_exec"]


def test_linter_flags_unpaired_guard():
    (fn,) = [f for f in functions(Path("bad.c"), BAD) if f.name == "unpaired"]
    assert check_pairs(fn) == ["unpaired: Py_EnterRecursiveCall without Py_LeaveRecursiveCall"]


def test_linter_flags_banned_calls():
    problems = check_banned(Path("bad.c"), BAD)
    joined = "\n".join(problems)
    assert "file-scope static" in joined
    assert sum("PyDict_GetItem swallows" in p for p in problems) == 1
    assert sum("PyModule_AddObject steals" in p for p in problems) == 1
    getattr_lines = [p for p in problems if "GetAttrString outside init" in p]
    assert len(getattr_lines) == 2
    assert '"a"' in getattr_lines[0] and "GetAttrString(" in getattr_lines[1]


def test_linter_flags_type_slots():
    problems = check_type_slots(Path("bad.c"), BAD)
    assert problems == [
        "bad.c: Thing_dealloc does not Py_DECREF(tp)",
        "bad.c: Thing_traverse does not Py_VISIT(Py_TYPE(self))",
    ]
