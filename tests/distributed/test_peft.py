"""PEFT adapters (Hugging Face ``peft``) on a tiny Llama, the base frozen
and the optimizer over the adapters only, under FSDP2 and FSDP1
(tests/distributed/dist_cases_peft.py): gets equal upstream's, a resume
through DCP -- whole, or the adapters alone -- continues with the losses
of the run that never stopped, and a full state dict broadcast from rank
0 lands on every rank."""

from __future__ import annotations

import pytest

from ..support.harness import run_ranks
from . import dist_cases_peft as cases

pytestmark = pytest.mark.dist

pytest.importorskip("peft", reason="peft is a test dependency (Makefile)")


def test_fsdp2_adapters(tmp_path):
    kinds = ["lora", "dora", "lora+modules_to_save", "ia3"]
    results = run_ranks(2, cases.peft_case, str(tmp_path), kinds, timeout=600)
    steps = ["gets", "resume whole", "resume adapters", "broadcast"]
    assert all(r == [f"{k}: {s}" for k in kinds for s in steps] for r in results), results


def test_fsdp1_adapters_after_an_initialising_step(tmp_path):
    """The ``step`` of an adapter comes from the ranks holding its
    elements: after upstream's initialising step gave rank 1's empty
    pieces ``step`` 1 and training went on, dcp_optim's gets used to
    save that 1 (the last rank's) instead of the trained step."""
    kinds = ["lora", "dora", "ia3"]  # IA3's (1, n) vectors: D40
    results = run_ranks(2, cases.peft_fsdp1_case, str(tmp_path), kinds, timeout=600)
    steps = ["gets", "resume []", "resume ['ignore_frozen_params', 'strict']"]
    assert all(r == [f"{k}: {s}" for k in kinds for s in steps] for r in results), results


def test_fsdp1_ranks_disagreeing_on_a_step():
    results = run_ranks(2, cases.disagreeing_step_case, timeout=300)
    assert all(r == ["upstream: AssertionError: True", "dcp_optim: 0.weight.step [0, 1]"] for r in results), results
