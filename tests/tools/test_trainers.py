"""Real trainers run unchanged on dcp_optim through ``dcp_optim.patch()``,
2 gloo ranks, each compared with upstream's run of the same code in the
same processes (tests/distributed/dist_cases_trainers.py):

* Lightning Fabric (``lightning==2.6.6``): ``ModelParallelStrategy`` (FSDP2
  through ``fully_shard``), which imports the state-dict functions inside
  its functions at call time; ``fabric.save`` / ``fabric.load`` in both
  checkpoint forms (sharded directory, full-state-dict file), resumed in
  fresh processes.
* torchtune (``torchtune==0.6.1`` with ``torchao==0.15.0``): its
  ``training._distributed`` helpers and ``_init_optim_state``, which it
  imports at the top of its module -- here first imported while patched.
* OLMo-core (``ai2-olmo-core==3.0.0``): ``save_model_and_optim_state`` /
  ``load_model_and_optim_state`` (sharded DCP directories, nested and
  flattened optimizer state) with its own optimizers, which create their
  state in ``step()``: ``SkipStepAdamW`` (fp32, and bf16 moments of fp32
  parameters) and ``SkipStepLion``.

The clients must be installed (the Makefile's environment pins them): the
tests fail, they are not skipped, without them.  One launch per client and
scenario: Fabric saves in one, resumes in another; torchtune runs in one.
"""

from __future__ import annotations

from importlib.metadata import version

import pytest

from dcp_optim.testing import launched_by_torchrun

from ..distributed import dist_cases_trainers as cases
from ..support.harness import run_ranks

if launched_by_torchrun():
    # Under torchrun the rank functions run in this process, inside the
    # test's timeout: the clients' heavy dependencies (torchao, datasets,
    # lightning: 6+ s on a loaded machine) are imported here, at
    # collection, outside every timed body (issue 24).  torchtune itself
    # is still first imported inside the rank function, while patched.
    import datasets  # noqa: F401
    import lightning  # noqa: F401
    import olmo_core.distributed.checkpoint  # noqa: F401
    import olmo_core.optim  # noqa: F401
    import torchao  # noqa: F401

STEPS = 2
N_PARAMS = 13  # Net: 2 blocks x (up, down, norm) x (weight, bias) + head.weight
TTD_NAMES = ["_init_optim_state", "get_optimizer_state_dict", "set_model_state_dict",
             "set_optimizer_state_dict"]


@pytest.mark.dist
def test_lightning_fabric_save_resume_runs_dcp_optim(tmp_path):
    # the client must be installed (no skip); imported in the ranks only
    installed = version("lightning")
    saves = run_ranks(2, cases.fabric_save, str(tmp_path), STEPS)
    resumes = run_ranks(2, cases.fabric_resume, str(tmp_path), STEPS)

    for save, resume in zip(saves, resumes, strict=True):
        assert save["lightning"] == installed
        for form in cases.FORMS:
            ours, up = save[f"dcp_optim/{form}"], save[f"upstream/{form}"]
            # Fabric made the same calls; while patched they all reached
            # dcp_optim and upstream's implementation never ran
            assert ours["client_calls"] == {"get_model_state_dict": 1, "get_optimizer_state_dict": 1}
            assert up["client_calls"] == ours["client_calls"]
            assert ours["upstream_internal_calls"] == {}
            assert up["upstream_internal_calls"] == {"_get_model_state_dict": 1, "_get_optim_state_dict": 1}
            assert ours["kind"] == up["kind"] == ("dir" if form == "sharded" else "file")
            assert ours["first"] == up["first"] and ours["reference"] == up["reference"]
            assert ours["saved"] == up["saved"]

        for impl in cases.IMPLS:
            for saved_by in cases.IMPLS:
                for form in cases.FORMS:
                    rec = resume[f"{impl}<-{saved_by}/{form}"]
                    origin = save[f"{saved_by}/{form}"]
                    assert rec["step"] == STEPS and rec["remainder"] == []
                    # the fresh processes hold exactly what was saved and
                    # continue bit-identically to the uninterrupted run
                    assert rec["loaded"] == origin["saved"], (impl, saved_by, form)
                    assert rec["resumed"] == origin["reference"], (impl, saved_by, form)
                    if form == "sharded":
                        calls = {"get_model_state_dict": 1, "get_optimizer_state_dict": 1,
                                 "set_optimizer_state_dict": 1}
                    else:  # one broadcast-from-rank-0 model load per parameter
                        calls = {"set_model_state_dict": N_PARAMS, "set_optimizer_state_dict": 1}
                    assert rec["client_calls"] == calls, (impl, saved_by, form)
                    if impl == "dcp_optim":
                        assert rec["upstream_internal_calls"] == {}
                    else:
                        assert rec["upstream_internal_calls"].get("_load_optim_state_dict") == 1
    # the full-state-dict files are identical (keys, order, bits)
    files = saves[0]["full_files"]
    assert files["dcp_optim"] == files["upstream"]
    assert [k for k, _ in files["dcp_optim"]] == ["model", "optimizer", "step"]


@pytest.mark.dist
def test_torchtune_distributed_helpers_run_dcp_optim():
    # the clients must be installed (no skip); not imported here, in the
    # test process, only in the ranks
    installed = version("torchtune"), version("torchao")
    results = run_ranks(2, cases.torchtune_helpers, STEPS)
    compared = ["model_load_result", "after_model_load", "first", "full_model", "full_optim",
                "saved", "reference", "loaded", "resumed", "fresh_train"]
    for rank, r in enumerate(results):
        assert (r["torchtune"].split("+")[0], r["torchao"]) == installed
        ours, up = r["dcp_optim"], r["upstream"]
        # imported after patch(): torchtune's top-level names are forwarders,
        # and unpatch() put upstream's functions back
        assert ours["bound_forwarders"] == TTD_NAMES and up["bound_forwarders"] == []
        assert ours["restored"] == up["restored"] == TTD_NAMES
        assert ours["client_calls"] == {"get_optimizer_state_dict": 2, "_init_optim_state": 4,
                                        "set_model_state_dict": 3, "set_optimizer_state_dict": 2}
        assert ours["upstream_internal_calls"] == {}
        assert up["upstream_internal_calls"] == {"_get_optim_state_dict": 4, "_load_model_state_dict": 3,
                                                 "_load_optim_state_dict": 2}
        for api in (False, True):
            a, b = ours[f"dsd_api={api}"], up[f"dsd_api={api}"]
            for key in compared:
                assert a[key] == b[key], (api, key)
            assert a["model_load_result"] == [[], []]
            assert a["loaded"] == a["saved"] and a["resumed"] == a["reference"]
            assert (a["full_optim"] == []) == (rank != 0)  # gathered on rank 0 only
            assert len(a["full_model"]) == (N_PARAMS if rank == 0 else 0)

            # _init_optim_state: upstream fake-steps the optimizer (step 1,
            # so training afterwards differs from a fresh optimizer's);
            # dcp_optim fills pristine state (step 0) and training matches
            steps_ours = [v for _, st in a["init_state"]["state"] for k, v in st if k == "step"]
            steps_up = [v for _, st in b["init_state"]["state"] for k, v in st if k == "step"]
            assert steps_ours == [("torch.float32", [], [0])] * N_PARAMS
            assert steps_up == [("torch.float32", [], [0x3F800000])] * N_PARAMS  # 1.0
            assert len(a["init_state"]["state"]) == len(b["init_state"]["state"]) == N_PARAMS
            assert a["init_state"]["params"] == b["init_state"]["params"]
            assert a["init_then_train"] == a["fresh_train"]
            assert b["init_then_train"] != b["fresh_train"]

            # the optimizer load right after a backward (gradients still
            # attached): dcp_optim loads it; upstream's _init_optim_state
            # returns early when any gradient exists (pytorch/pytorch#140898),
            # so torchtune's own code path loads nothing, silently, and
            # set_optimizer_state_dict fails
            assert a["loaded_with_grads"] == a["loaded"]
            if api:
                assert b["loaded_with_grads"] == ("raised", "AssertionError", "Expected device to be set")
            else:
                assert b["loaded_with_grads"]["state"] == []


@pytest.mark.dist
@pytest.mark.filterwarnings("ignore")  # OLMo-core's import-time notes (no transformer_engine)
def test_olmo_core_checkpoints_run_dcp_optim(tmp_path):
    """OLMo-core's checkpoint functions, each implementation saving and
    each loading what each saved into a model with another init and a
    never-stepped optimizer: the same checkpoints, and every resume
    through dcp_optim continues bit for bit.  Upstream's does too, except
    where the optimizer keeps bf16 moments of fp32 parameters: its load
    casts them to fp32 (D35) and the resumed run differs."""
    installed = version("ai2-olmo-core")
    results = run_ranks(2, cases.olmo_core_checkpoints, str(tmp_path), STEPS)
    for rank, r in enumerate(results):
        assert r["olmo_core"] == installed
        for name in cases.OLMO_OPTIMIZERS:
            for flat in (False, True):
                case = f"{name}/flat={flat}"
                ours, up = r[f"save dcp_optim/{case}"], r[f"save upstream/{case}"]
                assert ours["client_calls"] == up["client_calls"] == {"get_model_state_dict": 1,
                                                                      "get_optimizer_state_dict": 1}
                assert ours["upstream_internal_calls"] == {}
                # the same training, the same state saved (the checkpoints
                # are compared through the loads below: each reads both)
                assert ours["first"] == up["first"] and ours["reference"] == up["reference"], (rank, case)
                assert ours["saved"] == up["saved"], (rank, case)
                for impl in cases.IMPLS:
                    for saved_by in cases.IMPLS:
                        rec = r[f"load {impl}<-{saved_by}/{case}"]
                        origin = r[f"save {saved_by}/{case}"]
                        assert rec["client_calls"] == {"get_model_state_dict": 1, "get_optimizer_state_dict": 1,
                                                       "set_model_state_dict": 1, "set_optimizer_state_dict": 1}
                        exact = rec["loaded"] == origin["saved"] and rec["resumed"] == origin["reference"]
                        if impl == "dcp_optim":
                            assert rec["upstream_internal_calls"] == {}
                            assert exact, (rank, impl, saved_by, case)
                        else:
                            assert exact == (not name.endswith("/bf16")), (rank, impl, saved_by, case)
