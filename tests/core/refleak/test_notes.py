"""The core's location notes ("while walking module 'x'", "at key ...")
reach the exception on every CPython the package supports.

``dcp_add_note`` (csrc/compat.h) calls ``BaseException.add_note`` on 3.11+;
3.10 has no add_note, and the note was once dropped there silently.  It now
appends to ``__notes__`` itself, as add_note would.  ``make
test-pyversions`` runs this file on 3.10, 3.12 and 3.13.
"""

from __future__ import annotations

import pytest

from .fakes import FakeModule, load_core, make_context

C = load_core()


class _Broken(FakeModule):
    def named_children(self):
        raise ValueError("boom")


def test_walk_error_carries_the_module_note():
    root = FakeModule()
    root.add("x", _Broken())
    with pytest.raises(ValueError, match="boom") as info:
        C.walk_model(make_context(C), root, "_fqn_modifiers")
    notes = getattr(info.value, "__notes__", None)
    assert notes is not None and len(notes) == 1, notes
    assert notes[0].startswith("while walking module 'x") and notes[0].endswith("(_Broken)")


def test_notes_append_to_existing_ones():
    class Noted(FakeModule):
        def named_children(self):
            exc = ValueError("boom")
            exc.__notes__ = ["first"]
            raise exc

    root = FakeModule()
    root.add("y", Noted())
    with pytest.raises(ValueError) as info:
        C.walk_model(make_context(C), root, "_fqn_modifiers")
    notes = info.value.__notes__
    assert len(notes) == 2 and notes[0] == "first", notes
    assert notes[1].startswith("while walking module 'y") and notes[1].endswith("(Noted)")
