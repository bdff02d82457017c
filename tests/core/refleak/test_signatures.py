"""The C core's signatures: what each function advertises
(``__text_signature__``, which ``help()`` and ``inspect`` show), what it
accepts, and what the shipped stubs (``dcp_optim/_dcp_optim.pyi``) say
must all agree.  Two advertised signatures were once wrong
(``prepare_install`` and ``extract_rows`` each took one argument more).
"""

from __future__ import annotations

import ast
import inspect
import os
import re

import pytest

from .fakes import load_core

C = load_core()
# The stub shipped beside the core (an installed wheel: make test-wheel), or
# the source tree's.
STUB = os.path.join(os.path.dirname(os.path.abspath(C.__file__)), "_dcp_optim.pyi")
if not os.path.exists(STUB):
    STUB = os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))),
        "dcp_optim", "_dcp_optim.pyi",
    )
# How the core words a wrong argument count (dcp_check_nargs and the
# functions with optional trailing arguments).
ARITY = re.compile(r"takes (exactly )?\d+( (or|to) \d+)? arguments? \(\d+ given\)")


def _functions() -> dict[str, object]:
    return {
        name: obj for name in dir(C)
        if not name.startswith("_") and callable(obj := getattr(C, name))
        and not isinstance(obj, type)
    }


def _bounds(sig: inspect.Signature) -> tuple[int, int]:
    params = list(sig.parameters.values())
    assert all(p.kind is inspect.Parameter.POSITIONAL_ONLY for p in params), sig
    required = sum(1 for p in params if p.default is inspect.Parameter.empty)
    return required, len(params)


@pytest.mark.parametrize("name", sorted(_functions()))
def test_advertised_signature_is_what_it_accepts(name):
    fn = _functions()[name]
    low, high = _bounds(inspect.signature(fn))
    for count in range(high + 3):
        try:
            fn(*([object()] * count))
            arity_error = None
        except TypeError as exc:
            arity_error = str(exc) if ARITY.search(str(exc)) else None
        except Exception:  # a wrong value, past the argument count
            arity_error = None
        if low <= count <= high:
            assert arity_error is None, f"{name}{inspect.signature(fn)} refuses {count} arguments"
        else:
            assert arity_error is not None, f"{name}{inspect.signature(fn)} accepts {count} arguments"


def _stub_functions() -> dict[str, ast.FunctionDef]:
    with open(STUB, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}


def test_stub_names_every_function():
    assert set(_stub_functions()) == set(_functions())


@pytest.mark.parametrize("name", sorted(_functions()))
def test_stub_matches_signature(name):
    node = _stub_functions()[name]
    args = node.args
    assert not args.args and not args.kwonlyargs and args.vararg is None, name
    stub = [(a.arg, None) for a in args.posonlyargs]
    for i, default in enumerate(args.defaults, len(stub) - len(args.defaults)):
        stub[i] = (stub[i][0], ast.literal_eval(default))
    real = [
        (p.name, None if p.default is inspect.Parameter.empty else p.default)
        for p in inspect.signature(_functions()[name]).parameters.values()
    ]
    assert stub == real, name


def test_stub_names_the_types_and_their_attributes():
    with open(STUB, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    assert set(classes) == {name for name in dir(C) if isinstance(getattr(C, name), type)}
    for name in set(classes) - {"Context"}:  # Context's fields come from its constructor
        declared = {n.name for n in classes[name].body if isinstance(n, ast.FunctionDef)}
        public = {n for n in dir(getattr(C, name)) if not n.startswith("_")}
        assert declared == public, name
