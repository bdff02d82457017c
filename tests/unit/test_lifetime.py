"""Object lifetime and thread safety of the public API.

* Nothing keeps a model or an optimizer alive once the caller drops it: no
  module-level cache of walks (``ModelIndex`` holds the model strongly, so
  it must never outlive the call), no registry of patched models (upstream
  keeps every patched model in ``_patched_state_dict``), no Context holding
  instances.  Each test builds the objects inside a helper, runs the API
  paths, keeps only weak references, and checks they are dead after
  ``gc.collect()`` (patching installs closures that point back at the model:
  a reference cycle, which the collector must be able to free).
* Calls from several threads at once on different models give the results
  each call gives alone.  The C core keeps no mutable global state (all of
  it is per-call or in the immutable Context); ``_gc_context`` toggles the
  collector around calls and must leave it enabled.
"""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
import torch.nn as nn

import dcp_optim
from dcp_optim import StateDictOptions
from dcp_optim.state_dict import _patch_model_state_dict, _patch_optimizer_state_dict


class Net(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 2)
        self.register_buffer("running", torch.arange(2.0) + seed)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def make(seed: int = 0, optim_cls=torch.optim.Adam):
    model = Net(seed)
    optim = optim_cls(model.parameters(), lr=0.01)
    return model, optim


def train(model, optim, steps: int = 1, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optim.zero_grad()
        model(torch.randn(5, 4, generator=g)).sum().backward()
        optim.step()


def assert_freed(refs):
    gc.collect()
    alive = [r() for r in refs if r() is not None]
    assert not alive, f"still alive: {[type(o).__name__ for o in alive]}: " + "; ".join(
        f"{type(o).__name__} referred to by {[type(x).__name__ for x in gc.get_referrers(o)]}"
        for o in alive
    )


# --- nothing keeps models or optimizers alive ---------------------------------------------


def _get_set_round_trip(options):
    model, optim = make()
    train(model, optim)
    msd, osd = dcp_optim.get_state_dict(model, optim, options=options)
    dcp_optim.set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd,
                             options=options)
    dcp_optim.get_model_state_dict(model, options=options)
    dcp_optim.get_optimizer_state_dict(model, optim, options=options)
    dcp_optim.set_model_state_dict(model, msd, options=options)
    dcp_optim.set_optimizer_state_dict(model, optim, osd, options=options)
    dcp_optim.state_dict._get_fqns(model, "a.weight")
    list(dcp_optim.state_dict._iterate_valid_model_state(model))
    return [weakref.ref(model), weakref.ref(optim)] + [
        weakref.ref(p) for p in model.parameters()
    ]


@pytest.mark.parametrize(
    "options",
    [
        None,
        StateDictOptions(flatten_optimizer_state_dict=True),
        StateDictOptions(ignore_frozen_params=True, strict=False),
        StateDictOptions(cpu_offload=True),
    ],
    ids=["default", "flat", "frozen", "offload"],
)
def test_get_set_keep_nothing_alive(options):
    refs = _get_set_round_trip(options)
    assert_freed(refs)


def test_never_stepped_optimizer_kept_nothing_alive():
    def run():
        model, optim = make(optim_cls=torch.optim.SGD)
        dcp_optim.get_optimizer_state_dict(model, optim)
        dcp_optim.state_dict._init_optim_state(optim)
        return [weakref.ref(model), weakref.ref(optim)]

    assert_freed(run())


def test_failed_calls_keep_nothing_alive():
    """Error paths: the exception's traceback must not pin the objects
    once the caller drops it."""

    def run():
        model, optim = make()
        train(model, optim)
        for call in (
            lambda: dcp_optim.set_model_state_dict(model, {"nope": torch.zeros(1)}),
            lambda: dcp_optim.set_optimizer_state_dict(model, optim, {"state": 5}),
            lambda: dcp_optim.get_optimizer_state_dict(model, torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=1)),
        ):
            with pytest.raises((RuntimeError, TypeError, ValueError, KeyError)):
                call()
        return [weakref.ref(model), weakref.ref(optim)]

    assert_freed(run())


def test_patched_model_and_optimizer_are_freed():
    def run():
        model, optim = make()
        train(model, optim)
        _patch_model_state_dict(model)
        _patch_optimizer_state_dict(model, optimizers=(optim,))
        msd = model.state_dict()
        osd = optim.state_dict()
        model.load_state_dict(msd)
        optim.load_state_dict(osd)
        return [weakref.ref(model), weakref.ref(optim)]

    refs = run()
    assert_freed(refs)


def test_full_state_dict_paths_keep_nothing_alive(world1):
    def run():
        model, optim = make()
        train(model, optim)
        for options in (
            StateDictOptions(full_state_dict=True),
            StateDictOptions(full_state_dict=True, cpu_offload=True),
            StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        ):
            msd, osd = dcp_optim.get_state_dict(model, optim, options=options)
            dcp_optim.set_state_dict(model, optim, model_state_dict=msd,
                                     optim_state_dict=osd, options=options)
        return [weakref.ref(model), weakref.ref(optim)]

    refs = run()
    assert_freed(refs)


def test_state_dicts_do_not_pin_the_model():
    """The returned dicts alias parameters (as upstream) but never the
    model or the optimizer themselves."""

    def run():
        model, optim = make()
        train(model, optim)
        msd, osd = dcp_optim.get_state_dict(model, optim)
        return msd, osd, [weakref.ref(model), weakref.ref(optim)]

    msd, osd, refs = run()
    assert_freed(refs)
    assert set(msd) >= {"a.weight", "b.weight", "running"}
    assert "a.weight" in osd["state"]


def test_refcounts_of_touched_objects_unchanged():
    """Inline refcount check (docs/testing.md, "The torch-free suite"): a get/set round trip
    leaves the refcounts of the parameters, the param groups and the
    optimizer state dicts where they were."""
    model, optim = make()
    train(model, optim)
    dcp_optim.get_state_dict(model, optim)  # warm caches
    watched = [*model.parameters(), *optim.param_groups, *optim.state.values(), model, optim]
    gc.collect()
    before = [__import__("sys").getrefcount(o) for o in watched]
    for _ in range(5):
        msd, osd = dcp_optim.get_state_dict(model, optim)
        del msd, osd
    gc.collect()
    after = [__import__("sys").getrefcount(o) for o in watched]
    assert after == before


# --- threads ---------------------------------------------------------------------------------


def _snapshot(msd, osd):
    def conv(v):
        if isinstance(v, torch.Tensor):
            return ("tensor", tuple(v.shape), v.detach().clone())
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(conv(x) for x in v)
        return v

    return conv(msd), conv(osd)


def _equal(a, b):
    if isinstance(a, tuple) and len(a) == 3 and a[0] == "tensor":
        return isinstance(b, tuple) and a[1] == b[1] and torch.equal(a[2], b[2])
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


def _prepared(seed):
    # Built in the calling thread: module init draws from torch's global
    # RNG, which threads building models at once would interleave.
    model, optim = make(seed)
    train(model, optim, steps=2, seed=seed)
    return model, optim


def _work(seed, flat, iterations, results, errors, prepared):
    try:
        model, optim = prepared
        options = StateDictOptions(flatten_optimizer_state_dict=flat)
        out = []
        for _ in range(iterations):
            msd, osd = dcp_optim.get_state_dict(model, optim, options=options)
            dcp_optim.set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd,
                                     options=options)
            out.append(_snapshot(*dcp_optim.get_state_dict(model, optim, options=options)))
        results[seed] = out
    except BaseException as exc:  # pragma: no cover - reported below
        errors.append((seed, exc))


def test_threads_on_different_models_match_single_threaded():
    seeds = [0, 1, 2, 3]
    iterations = 15
    expected: dict = {}
    for seed in seeds:
        _work(seed, seed % 2 == 1, 1, expected, [], _prepared(seed))
    results: dict = {}
    errors: list = []
    threads = [
        threading.Thread(
            target=_work,
            args=(seed, seed % 2 == 1, iterations, results, errors, _prepared(seed)),
        )
        for seed in seeds
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors
    assert gc.isenabled(), "_gc_context left the collector disabled"
    for seed in seeds:
        assert len(results[seed]) == iterations
        for got in results[seed]:
            assert _equal(got, expected[seed][0]), f"seed {seed} differs from its single-threaded run"
