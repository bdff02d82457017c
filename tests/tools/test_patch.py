"""dcp_optim.patch(): upstream's functions, and the names other modules
imported from them, run dcp_optim's implementation; unpatch() restores
exactly what was there.

The client test drives HuggingFace Accelerate's own FSDP2 checkpoint
helpers (``accelerate.utils.fsdp_utils.save_fsdp_model`` /
``save_fsdp_optimizer`` / ``load_fsdp_model`` / ``load_fsdp_optimizer``,
which import ``get_model_state_dict`` & co. from
``torch.distributed.checkpoint.state_dict`` inside the functions) on 2 gloo
ranks.  Tested with accelerate==1.15.0 on torch==2.13.0 (CPU).  The
client must be installed: the test fails (it is not skipped) without it.
"""

from __future__ import annotations

import sys
import threading
import types

import pytest
import torch
import torch.distributed.checkpoint.state_dict as upstream
import torch.nn as nn

import dcp_optim
import dcp_optim.state_dict as ours
from dcp_optim import patching

from ..distributed import dist_cases_adoption
from ..support.harness import run_ranks

ORIGINALS = {name: getattr(upstream, name) for name in patching.PATCHED_NAMES}
OURS = {name: getattr(ours, name) for name in patching.PATCHED_NAMES}


@pytest.fixture(autouse=True)
def _always_unpatched():
    assert not patching.is_patched()
    yield
    patching.unpatch()
    for name, fn in ORIGINALS.items():
        assert getattr(upstream, name) is fn, name


@pytest.fixture
def client_module():
    """A loaded module that imported upstream's functions at the top, one
    under an alias, plus an unrelated callable."""
    mod = types.ModuleType("fake_dsd_client")
    mod.get_state_dict = upstream.get_state_dict
    mod.dsd_set = upstream.set_optimizer_state_dict
    mod._patch_model_state_dict = upstream._patch_model_state_dict
    mod.StateDictOptions = upstream.StateDictOptions
    mod.unrelated = len
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]


def _fresh():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def test_patch_replaces_module_attributes_and_imported_names(client_module):
    handle = dcp_optim.patch()
    assert handle.applied and patching.is_patched()
    for name in patching.PATCHED_NAMES:
        fn = getattr(upstream, name)
        assert patching.is_patched_function(fn), name
        assert fn is not ORIGINALS[name]
        assert fn.__name__ == name and fn.__wrapped__ is getattr(ours, name)
    assert client_module.get_state_dict is upstream.get_state_dict
    assert client_module.dsd_set is upstream.set_optimizer_state_dict
    assert client_module._patch_model_state_dict is upstream._patch_model_state_dict
    # not replaced: the options class (dcp_optim accepts upstream's) and others
    assert upstream.StateDictOptions is client_module.StateDictOptions
    assert client_module.StateDictOptions.__module__ == upstream.__name__
    assert client_module.unrelated is len
    # dcp_optim's own names are untouched
    assert dcp_optim.get_state_dict is ours.get_state_dict
    assert not patching.is_patched_function(dcp_optim.get_state_dict)


def test_patched_functions_run_dcp_optim(client_module):
    model, optim = _fresh()
    with dcp_optim.patch():
        # upstream steps a never-stepped optimizer to build its state (it
        # would fill optim.state); dcp_optim never modifies the optimizer
        osd = client_module.get_state_dict(model, optim)[1]
        assert len(optim.state) == 0
        assert set(osd["state"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}
        # upstream's options objects are accepted
        flat = upstream.get_optimizer_state_dict(
            model, optim, options=upstream.StateDictOptions(flatten_optimizer_state_dict=True)
        )
        assert "param_groups.0.weight.lr" in flat
        result = client_module.dsd_set(model, optim, osd)
        assert result.missing_keys == [] and result.unexpected_keys == []  # upstream returns None
    calls = []
    original = ours.get_model_state_dict
    ours.get_model_state_dict = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        with dcp_optim.patched():
            upstream.get_model_state_dict(model)
    finally:
        ours.get_model_state_dict = original
    assert calls == [1]  # looked up per call: spies and profilers see it


def test_unpatch_restores_exactly(client_module):
    before = dict(vars(client_module))
    dcp_optim.patch()
    late = types.ModuleType("late_dsd_client")  # imported while patched
    late.fn = upstream.get_model_state_dict
    late.ours = dcp_optim.get_model_state_dict  # imported from dcp_optim on purpose
    sys.modules[late.__name__] = late
    try:
        assert dcp_optim.unpatch() is True
        assert dcp_optim.unpatch() is False
        assert dict(vars(client_module)) == before
        for name in ("get_state_dict", "dsd_set", "_patch_model_state_dict"):
            assert getattr(client_module, name) is before[name]
        assert late.fn is ORIGINALS["get_model_state_dict"]
        assert late.ours is ours.get_model_state_dict
    finally:
        del sys.modules[late.__name__]


def test_unpatch_leaves_names_rebound_meanwhile(client_module):
    dcp_optim.patch()

    def mine(*args, **kwargs):
        return "mine"

    client_module.get_state_dict = mine
    dcp_optim.unpatch()
    assert client_module.get_state_dict is mine
    assert client_module.dsd_set is ORIGINALS["set_optimizer_state_dict"]


def test_patch_is_idempotent_and_context_managers_nest(client_module):
    first = dcp_optim.patch()
    forwarder = upstream.get_state_dict
    second = dcp_optim.patch()
    assert first.applied and not second.applied
    assert upstream.get_state_dict is forwarder
    with dcp_optim.patched() as inner:  # already patched: leaves it patched
        assert not inner.applied
    assert patching.is_patched()
    # a module that took upstream's original meanwhile (from a saved
    # reference) is picked up by the second patch()
    other = types.ModuleType("other_dsd_client")
    other.f = ORIGINALS["get_state_dict"]
    sys.modules[other.__name__] = other
    try:
        dcp_optim.patch()
        assert other.f is forwarder
        dcp_optim.unpatch()
        assert other.f is ORIGINALS["get_state_dict"]
        assert client_module.get_state_dict is ORIGINALS["get_state_dict"]
    finally:
        del sys.modules[other.__name__]
    with dcp_optim.patched() as handle:
        assert handle.applied and patching.is_patched()
    assert not patching.is_patched()


def test_patch_is_thread_safe(client_module):
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def worker(i):
        try:
            barrier.wait()
            for j in range(4):
                if (i + j) % 2:
                    dcp_optim.patch()
                else:
                    dcp_optim.unpatch()
                fn = upstream.get_state_dict
                assert fn is ORIGINALS["get_state_dict"] or patching.is_patched_function(fn)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    dcp_optim.patch()
    assert client_module.get_state_dict is upstream.get_state_dict
    dcp_optim.unpatch()
    assert client_module.get_state_dict is ORIGINALS["get_state_dict"]
    assert client_module.dsd_set is ORIGINALS["set_optimizer_state_dict"]


@pytest.mark.dist
def test_accelerate_fsdp2_save_resume_runs_dcp_optim(tmp_path):
    """Accelerate 1.15.0's FSDP2 helpers, 2 ranks: save, resume into a
    fresh model and never-stepped optimizer; the resumed state is
    bit-identical and training continues exactly; every state-dict call
    the client made went to dcp_optim (spies), none to upstream's
    implementation."""
    import accelerate  # the client must be installed (no skip)

    results = run_ranks(2, dist_cases_adoption.accelerate_fsdp2_resume, str(tmp_path / "ckpt"))
    for r in results:
        assert r["accelerate"] == accelerate.__version__
        assert r["client_calls"] == {
            "get_model_state_dict": 2,      # save + the load template
            "get_optimizer_state_dict": 2,  # save + the load template
            "set_model_state_dict": 1,
            "set_optimizer_state_dict": 1,
        }
        assert r["upstream_internal_calls"] == {}
        assert r["state_equal"] and r["state_entries"] == 13
        assert r["resumed"] == r["reference"]
        assert r["files"] == ["optimizer_0", "pytorch_model_fsdp_0"]


_CLIENT_SOURCE = '''
from torch.distributed.checkpoint import state_dict as dsd
import torch.distributed.checkpoint.state_dict as dsd_full
from torch.distributed.checkpoint.state_dict import get_model_state_dict as gmsd
from torch.distributed.checkpoint.state_dict import _init_optim_state
from torch.distributed.checkpoint.state_dict import *  # noqa: F403


def call_time():
    # Lightning's pattern: imported inside the function, at call time
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_optimizer_state_dict,
    )

    return get_model_state_dict, set_optimizer_state_dict, StateDictOptions
'''


def _import_client(tmp_path, name):
    (tmp_path / f"{name}.py").write_text(_CLIENT_SOURCE)
    return __import__(name)


@pytest.fixture
def client_files(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("early_dsd_client", "late_dsd_client"):
        sys.modules.pop(name, None)


def _names_of(mod):
    """Every way the client module reaches the patched functions."""
    get_now, set_now, options = mod.call_time()
    return {
        "dsd.get_model_state_dict": mod.dsd.get_model_state_dict,
        "dsd.set_state_dict": mod.dsd.set_state_dict,
        "dsd_full.get_optimizer_state_dict": mod.dsd_full.get_optimizer_state_dict,
        "gmsd": mod.gmsd,
        "_init_optim_state": mod._init_optim_state,
        "star get_state_dict": mod.get_state_dict,
        "star set_model_state_dict": mod.set_model_state_dict,
        "call-time get_model_state_dict": get_now,
        "call-time set_optimizer_state_dict": set_now,
    }, options


def test_patch_covers_call_time_imports_late_modules_and_module_aliases(client_files):
    """Modules loaded before and after patch(), reaching the functions
    through a module alias (``from torch.distributed.checkpoint import
    state_dict as dsd``), ``from ... import`` (renamed, ``*``) and imports
    inside a function at call time: all get dcp_optim's while patched --
    calls reach dcp_optim's implementation -- and upstream's after
    unpatch()."""
    early = _import_client(client_files, "early_dsd_client")
    before, _ = _names_of(early)
    for what, fn in before.items():
        assert fn is ORIGINALS[fn.__name__], what

    dcp_optim.patch()
    late = _import_client(client_files, "late_dsd_client")  # first imported while patched
    calls = []
    original = ours.get_model_state_dict
    ours.get_model_state_dict = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        for mod in (early, late):
            names, options = _names_of(mod)
            assert options is upstream.StateDictOptions
            for what, fn in names.items():
                assert patching.is_patched_function(fn), (mod.__name__, what)
                assert fn.__wrapped__ is OURS[fn.__name__], (mod.__name__, what)
            model, _ = _fresh()
            for fn in (names["dsd.get_model_state_dict"], names["gmsd"],
                       names["call-time get_model_state_dict"]):
                assert set(fn(model)) == {"0.weight", "0.bias", "1.weight", "1.bias"}
        assert len(calls) == 6
    finally:
        ours.get_model_state_dict = original

    dcp_optim.unpatch()
    for mod in (early, late):
        names, options = _names_of(mod)
        assert options is upstream.StateDictOptions
        for what, fn in names.items():
            assert fn is ORIGINALS[fn.__name__], (mod.__name__, what)
    assert _names_of(early)[0] == before


def test_patched_init_optim_state_fills_pristine_state():
    """torchtune imports _init_optim_state: patched, it is dcp_optim's (no
    fake step: the parameters and their gradients stay untouched)."""
    model, optim = _fresh()
    before = [p.detach().clone() for p in model.parameters()]
    with dcp_optim.patch():
        upstream._init_optim_state(optim)
    assert [float(optim.state[p]["step"]) for p in model.parameters()] == [0.0] * 4
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(p.grad is None for p in model.parameters())
    _, optim_up = _fresh()
    upstream._init_optim_state(optim_up)  # unpatched: upstream's fake step
    assert [float(s["step"]) for s in optim_up.state.values()] == [1.0] * 4


def test_forwarder_kept_past_unpatch_runs_upstream():
    """A reference taken while patched where unpatch() cannot see it (a
    class attribute, a callback list) runs dcp_optim's function while
    patched and upstream's after unpatch()."""
    model, optim = _fresh()

    class Trainer:
        pass

    with dcp_optim.patch():
        Trainer.get_osd = staticmethod(upstream.get_optimizer_state_dict)
        callbacks = [upstream.get_optimizer_state_dict]
        Trainer.get_osd(model, optim)
        assert len(optim.state) == 0  # dcp_optim's: no fake step
    for fn in (Trainer.get_osd, callbacks[0]):
        assert patching.is_patched_function(fn)
        fn(model, optim)  # upstream's: fake-steps the never-stepped optimizer
        assert [float(s["step"]) for s in optim.state.values()] == [1.0] * 4
        optim.state.clear()
    with dcp_optim.patch():
        callbacks[0](model, optim)
        assert len(optim.state) == 0
