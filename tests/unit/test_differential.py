"""Differential suite: upstream and dcp_optim on seeded twin models.

For every generated case (random module trees with buffers, non-persistent
buffers, extra state, tied and frozen parameters, activation-checkpoint and
torch.compile wrappers; every torch.optim optimizer, several param groups,
sometimes two optimizers), both implementations run the same calls on twin
objects and the outputs are compared exactly (tests/support/oracle.py): keys and
their order, nesting, container and value types, dtypes, devices, bits,
and which tensors alias live storage.  Loads are compared by the resulting
optimizer state and by one more training step.

Upstream is the oracle here; cases where it is deliberately not
(docs/differences.md) live in test_deviations.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint.state_dict as upstream

import dcp_optim

from ..support import models
from ..support.oracle import (
    SUPPORTED_TORCH,
    alias_pattern,
    assert_same_optimizers,
    assert_same_tree,
    live_state_objects,
    live_storage,
    params_snapshot,
)

CASES = models.generated_cases(220, base_seed=1)


def _drop_empty_state(optimizers) -> None:
    # Upstream's flat loader installs `{}` for stateless parameters
    # (pytorch/pytorch#192225); an empty entry and no entry are the same
    # optimizer state, so normalise before comparing.
    for o in optimizers:
        for p in [p for p, st in o.state.items() if not st]:
            del o.state[p]


def _fresh(case: models.Case):
    model = models.build_model(case.model)
    return model, models.build_optimizers(model, case.optim)


def _step_both(case, mu, ou, md, od):
    models.train(mu, ou, case.model.seed + 50)
    models.train(md, od, case.model.seed + 50)
    assert_same_tree(params_snapshot(mu), params_snapshot(md))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"seed{c.model.seed}")
def test_differential(case: models.Case) -> None:
    mu, ou = case.build()
    md, od = case.build()
    assert_same_tree(params_snapshot(mu), params_snapshot(md))

    # model, default options: the OrderedDict from state_dict(), aliasing
    # live storage, with canonical keys and upstream's _metadata
    a = upstream.get_model_state_dict(mu)
    b = dcp_optim.get_model_state_dict(md)
    assert_same_tree(a, b)
    assert a._metadata == b._metadata
    assert alias_pattern(a, live_storage(mu)) == alias_pattern(b, live_storage(md))

    # optimizer, nested: per-parameter dicts are the optimizer's own objects
    a = upstream.get_optimizer_state_dict(mu, ou)
    b = dcp_optim.get_optimizer_state_dict(md, od)
    assert_same_tree(a, b)
    assert alias_pattern(a, live_storage(mu, ou), live_state_objects(ou)) == alias_pattern(
        b, live_storage(md, od), live_state_objects(od)
    )
    for fqn in a["state"]:
        assert any(a["state"][fqn] is st for o in ou for st in o.state.values()) == any(
            b["state"][fqn] is st for o in od for st in o.state.values()
        )

    # flattened
    flat = upstream.StateDictOptions(flatten_optimizer_state_dict=True)
    fa = upstream.get_optimizer_state_dict(mu, ou, options=flat)
    fb = dcp_optim.get_optimizer_state_dict(md, od, options=flat)
    assert_same_tree(fa, fb)

    # full + cpu_offload without a process group: everyone gets new dicts
    full = upstream.StateDictOptions(full_state_dict=True, cpu_offload=True)
    assert_same_tree(
        upstream.get_state_dict(mu, ou, options=full),
        dcp_optim.get_state_dict(md, od, options=full),
    )
    if case.model.frozen_fraction:
        frozen = upstream.StateDictOptions(ignore_frozen_params=True)
        assert_same_tree(
            upstream.get_model_state_dict(mu, options=frozen),
            dcp_optim.get_model_state_dict(md, options=frozen),
        )

    # set: each implementation loads its own output into fresh twins; the
    # loaded optimizers and one more training step must agree
    msd_u, osd_u = upstream.get_state_dict(mu, ou)
    msd_d, osd_d = dcp_optim.get_state_dict(md, od)
    fu_model, fu_optim = _fresh(case)
    fd_model, fd_optim = _fresh(case)
    upstream.set_state_dict(fu_model, fu_optim, model_state_dict=msd_u, optim_state_dict=osd_u)
    dcp_optim.set_state_dict(fd_model, fd_optim, model_state_dict=msd_d, optim_state_dict=osd_d)
    # Upstream drops saved state of frozen parameters on load (D10 in docs/differences.md,
    # pytorch/pytorch#192202); dcp_optim keeps it -- checked just below.
    assert_same_optimizers(fu_optim, fd_optim, skip_frozen=True)
    _assert_frozen_state_kept(osd_d, fd_model, fd_optim)
    assert_same_tree(params_snapshot(fu_model), params_snapshot(fd_model))
    _step_both(case, fu_model, fu_optim, fd_model, fd_optim)

    # set from the flattened format, into fresh twins
    fu_model, fu_optim = _fresh(case)
    fd_model, fd_optim = _fresh(case)
    upstream.set_optimizer_state_dict(fu_model, fu_optim, fa)
    dcp_optim.set_optimizer_state_dict(fd_model, fd_optim, fb)
    _drop_empty_state(fu_optim)
    assert_same_optimizers(fu_optim, fd_optim, skip_frozen=True)
    _assert_frozen_state_kept(osd_d, fd_model, fd_optim)


def _assert_frozen_state_kept(saved, model, optimizers) -> None:
    """D10: saved state of a frozen parameter is loaded (presence decides)."""
    by_fqn = dict(model.named_parameters())
    for fqn, st in saved["state"].items():
        p = by_fqn.get(fqn)
        if p is None or p.requires_grad:
            continue
        live = next(o.state[p] for o in optimizers if any(q is p for g in o.param_groups for q in g["params"]))
        assert_same_tree(dict(sorted(st.items())), dict(sorted(live.items())))


@pytest.mark.parametrize("case", CASES[:40], ids=lambda c: f"seed{c.model.seed}")
def test_cross_load(case: models.Case) -> None:
    """Dicts written by one implementation load in the other."""
    mu, ou = case.build()
    flat = upstream.StateDictOptions(flatten_optimizer_state_dict=True)
    for options in (None, flat):
        theirs = upstream.get_optimizer_state_dict(mu, ou, options=options)
        ours = dcp_optim.get_optimizer_state_dict(mu, ou, options=options)
        a_model, a_optim = _fresh(case)
        b_model, b_optim = _fresh(case)
        dcp_optim.set_optimizer_state_dict(a_model, a_optim, theirs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            upstream.set_optimizer_state_dict(b_model, b_optim, ours)
        _drop_empty_state(b_optim)
        assert_same_optimizers(a_optim, b_optim, skip_frozen=True)


def test_case_count() -> None:
    """The suite covers the promised breadth."""
    assert len(CASES) >= 200
    kinds = {k for c in CASES for k in c.optim.kinds}
    assert kinds == set(models.OPTIMIZER_KINDS)
    assert any(c.model.tie for c in CASES)
    assert any(c.model.frozen_fraction for c in CASES)
    assert any(c.model.ckpt_wrap for c in CASES)
    assert any(c.model.compile_wrap for c in CASES)
    assert any(len(c.optim.kinds) > 1 for c in CASES)
    assert any(c.optim.groups_per_optimizer > 1 for c in CASES)
    # the oracle is the installed torch's upstream: one dcp_optim supports
    assert torch.__version__.startswith(SUPPORTED_TORCH), torch.__version__


class _SharedModules(torch.nn.Module):
    """One Linear under two paths (``self.alias = self.body.inner``), one
    of them nested: model.state_dict() and load_state_dict() visit both
    paths, upstream's walk (and ours) keeps the first."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.body = torch.nn.Sequential()
        self.body.add_module("inner", torch.nn.Linear(3, 3))
        self.alias = self.body.inner
        self.head = torch.nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.alias(self.body(x)))


def _shared_modules_pair():
    pairs = []
    for _ in range(2):
        m = _SharedModules()
        opt = torch.optim.Adam(m.parameters(), lr=0.1)
        m(torch.ones(2, 3)).sum().backward()
        opt.step()
        pairs.append((m, opt))
    return pairs


def _outcome(fn):
    try:
        return "ok", fn()
    except Exception as e:  # noqa: BLE001 - the outcome is compared
        return type(e), str(e)


def test_module_under_two_paths() -> None:
    """Model keys under every path, optimizer keys under the first; loads
    accept the dict the getter wrote, and the errors of a dict that lacks
    the alias's keys are torch's, raised before anything is copied."""
    (mu, ou), (md, od) = _shared_modules_pair()
    theirs = upstream.get_model_state_dict(mu)
    ours = dcp_optim.get_model_state_dict(md)
    assert_same_tree(theirs, ours)
    assert "alias.weight" in ours and "body.inner.weight" in ours
    flat = upstream.StateDictOptions(flatten_optimizer_state_dict=True)
    for options in (None, flat):
        assert_same_tree(
            upstream.get_optimizer_state_dict(mu, ou, options=options),
            dcp_optim.get_optimizer_state_dict(md, od, options=options),
        )
    # round trips, model and optimizer
    assert _outcome(lambda: upstream.set_model_state_dict(mu, theirs)) == _outcome(
        lambda: dcp_optim.set_model_state_dict(md, ours)
    )
    dcp_optim.set_optimizer_state_dict(md, od, dcp_optim.get_optimizer_state_dict(md, od))
    # a dict without the alias's keys: strict fails the same way, with
    # nothing copied by dcp_optim; non-strict reports the same keys
    partial = {k: torch.zeros_like(v) for k, v in ours.items() if not k.startswith("alias.")}
    before = params_snapshot(md)
    up = _outcome(lambda: upstream.set_model_state_dict(mu, dict(partial)))
    dc = _outcome(lambda: dcp_optim.set_model_state_dict(md, dict(partial)))
    assert up == dc and up[0] is RuntimeError and '"alias.weight"' in up[1]
    assert_same_tree(params_snapshot(md), before)
    loose = upstream.StateDictOptions(strict=False)
    up = upstream.set_model_state_dict(mu, dict(partial), options=loose)
    dc = dcp_optim.set_model_state_dict(md, dict(partial), options=loose)
    assert (sorted(up.missing_keys), up.unexpected_keys) == (sorted(dc.missing_keys), dc.unexpected_keys)
    assert_same_tree(params_snapshot(mu), params_snapshot(md))
    # an unexpected key next to the aliases
    extra = dict(ours, **{"alias.nope": torch.zeros(1)})
    assert _outcome(lambda: upstream.set_model_state_dict(mu, dict(extra))) == _outcome(
        lambda: dcp_optim.set_model_state_dict(md, dict(extra))
    )
