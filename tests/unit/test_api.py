"""The drop-in surface: names, signatures, options, and the C backend."""

from __future__ import annotations

import dataclasses
import importlib
import inspect

import pytest
import torch.distributed.checkpoint.state_dict as upstream

import dcp_optim
import dcp_optim.state_dict as ours

PUBLIC = [
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
    "_patch_model_state_dict",
    "_patch_optimizer_state_dict",
]


@pytest.mark.parametrize("name", PUBLIC)
def test_signatures_equal_upstream(name):
    theirs = inspect.signature(getattr(upstream, name))
    mine = inspect.signature(getattr(dcp_optim, name))
    assert [(p.name, p.kind, p.default) for p in mine.parameters.values()] == [
        (p.name, p.kind, p.default) for p in theirs.parameters.values()
    ]


def test_signature_check_from_the_readme():
    # the one-liner the issue asks for, as a test
    assert all(
        inspect.signature(getattr(dcp_optim, n)).parameters.keys()
        == inspect.signature(getattr(upstream, n)).parameters.keys()
        for n in PUBLIC
    )


def test_options_fields_order_defaults():
    mine = [(f.name, f.default) for f in dataclasses.fields(dcp_optim.StateDictOptions)]
    theirs = [(f.name, f.default) for f in dataclasses.fields(upstream.StateDictOptions)]
    # torch's eight fields first, same order and defaults; ours after them
    assert len(theirs) == 8
    assert mine[: len(theirs)] == theirs
    assert mine[len(theirs):] == [("verify_checksums", None)]
    assert dcp_optim.StateDictOptions(True, True) == dcp_optim.StateDictOptions(
        full_state_dict=True, cpu_offload=True
    )


def test_module_all_matches_upstream():
    assert ours.__all__ == upstream.__all__
    # the package itself: every name of upstream's, so that switching the
    # module of any import (a type alias too) is the whole change
    for name in upstream.__all__:
        assert name in dcp_optim.__all__ and getattr(dcp_optim, name) is getattr(ours, name), name
    for name in ("_PG", "_STATE", "_PARAMS", "_FLAT_PARAM"):
        assert getattr(ours, name) == getattr(upstream, name)
    for name in ("_get_fqns", "_init_optim_state", "_StateDictInfo", "_verify_options",
                 "_iterate_valid_model_state", "_EXTRA_STATE"):
        assert hasattr(ours, name)
    assert ours._EXTRA_STATE is upstream._EXTRA_STATE


def test_compiled_backend_is_in_use():
    core = importlib.import_module("dcp_optim._dcp_optim")
    assert core.__file__.endswith((".so", ".pyd"))
    assert dcp_optim.BACKEND == core.BACKEND == "c"
    assert dcp_optim._C is core
    # the public functions reach the compiled walker
    import torch.nn as nn

    calls = []
    real = core.walk_model

    class Spy:
        def __getattr__(self, name):
            return getattr(core, name)

        def walk_model(self, *args):
            calls.append(args[1])
            return real(*args)

    import dcp_optim._engine.checks as verify

    saved = verify.C
    verify.C = Spy()
    try:
        dcp_optim.get_model_state_dict(nn.Linear(2, 2))
    finally:
        verify.C = saved
    assert len(calls) == 1 and isinstance(calls[0], nn.Linear)


def test_accepts_upstream_options_objects():
    import torch.nn as nn

    m = nn.Linear(2, 2)
    sd = dcp_optim.get_model_state_dict(
        m, options=upstream.StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    assert type(sd) is dict and set(sd) == {"weight", "bias"}


def test_import_error_names_build_command(tmp_path):
    """Without the compiled core the package refuses to import, naming the
    build command."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    pkg = Path(dcp_optim.__file__).parent
    shutil.copytree(pkg, tmp_path / "dcp_optim", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    # -S: no site-packages, so neither an editable install of the real
    # package nor torch is visible -- only the copy without its core
    proc = subprocess.run(
        [sys.executable, "-S", "-c", "import dcp_optim"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr
    assert "make build" in proc.stderr
