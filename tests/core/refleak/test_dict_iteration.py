"""Dicts that change while the C core iterates them.

The core iterates exact dicts with PyDict_Next.  Any allocation in the loop
body may start a cyclic collection, and a finalizer (``__del__`` of garbage
in a reference cycle) may then change the dict being iterated.  The shared
snapshot helper ``dcp_items_list`` (csrc/helpers.c) once assumed the dict
could not change: a finalizer that emptied it left NULL slots in the list,
and ``filter_prefixes`` (csrc/fqn.c) crashed reading them (a segfault,
reproduced on the code before the fix).  Every such loop now pins its entries
and checks the size (``dcp_dict_iter``), raising
``RuntimeError("dictionary changed size during iteration")`` as CPython
does.

The collection is made to start inside the loop by a low gen-0 threshold,
swept over a range so that one of them lands inside any loop.  CPython 3.12+
runs collections at the next bytecode boundary instead of inside the
allocation, so the finalizer cannot run in the middle of a C loop there; the
sweep still must not crash.  It runs in a child process, so a crash fails
this test instead of killing the run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent(
    """
    import gc
    from tests.core.refleak.fakes import load_core

    C = load_core()


    class Shrinker:
        '''Garbage in a reference cycle whose finalizer empties `target`.'''

        def __init__(self, target):
            self.target = target
            self.cycle = self

        def __del__(self):
            self.target.clear()


    prefixes = ["a."]
    raised = ok = 0
    for threshold in range(1, 80):
        sd = {f"a.k{i}": [i] for i in range(64)}
        expected = dict(sd)
        gc.collect()
        gc.set_threshold(threshold)
        Shrinker(sd)
        try:
            out = C.filter_prefixes(sd, prefixes, True)
        except RuntimeError as exc:
            assert str(exc) == "dictionary changed size during iteration", exc
            raised += 1
        else:
            # the whole dict, or (emptied before the call) nothing
            assert out == expected or out == {}, (threshold, len(out))
            ok += 1
        finally:
            gc.set_threshold(700, 10, 10)
    print("raised", raised, "ok", ok, flush=True)
    """
)


def test_finalizer_shrinking_the_dict_does_not_crash():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    words = proc.stdout.split()
    assert words[:1] == ["raised"], proc.stdout
    raised, ok = int(words[1]), int(words[3])
    assert raised + ok == 79
    if sys.version_info < (3, 12):
        # the collection ran inside the loop at least once: the case is real
        assert raised > 0, proc.stdout
