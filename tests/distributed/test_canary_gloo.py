"""Gloo canaries on the installed torch (docs/testing.md, "What runs on CPU with gloo").

These tests check *torch*, not dcp_optim: which collectives work on CPU gloo,
whether FSDP2 averages gradients correctly, whether FSDP1 runs with
``device_id=cpu``, whether upstream's FSDP1 full + cpu_offload path crashes,
and whether FSDP2+TP on a 2x2 mesh saves with DCP at ws=4 and loads at ws=2.
The outcomes decide which dcp_optim cases are xfail or skipped; they are
written up in ``docs/torch-2.13-findings.md``.

Everything at ws=2 runs in ONE launch (``canary_ws2``) whose per-check results
are shared through a module-scoped fixture; the FSDP1 full + cpu_offload case
runs in its own launch because it can SIGSEGV.
"""

from __future__ import annotations

import re
import time

import pytest

from tests.distributed import dist_cases_canary as cases
from tests.support.harness import launch_times, preload_info, run_in_subprocess, run_ranks
from tests.support.oracle import SUPPORTED_TORCH

TIGHT = 1e-6  # parity tolerance for tiny fp32 models (observed: <= 3e-8)


# ---------------------------------------------------------------------------
# fixtures (kept here: tests/conftest.py belongs to someone else)


@pytest.fixture(scope="module")
def ws2():
    """Results of the single ws=2 canary launch, ordered by rank."""
    t0 = time.perf_counter()
    results = run_ranks(2, cases.canary_ws2, timeout=240)
    for r in results:
        r["launch_seconds"] = round(time.perf_counter() - t0, 3)
    return results


# Collectives older supported torches lack or gloo refuses there: name ->
# (the first release that runs it, the error the canary sees before it).
_MISSING_BEFORE = {
    "all_gather_single": ((2, 13), "has no attribute 'all_gather_single'"),
    "reduce_scatter_single_avg": ((2, 13), "has no attribute 'reduce_scatter_single'"),
    "all_to_all_list": ((2, 12), "Backend gloo does not support alltoall"),
}


def _torch_before(release: tuple[int, int]) -> bool:
    import torch

    return torch.torch_version.TorchVersion(torch.__version__) < release


def _check(results, name):
    """Per-rank entries of one sub-check; fail with the child's traceback."""
    entries = [r["checks"][name] for r in results]
    for rank, e in enumerate(entries):
        if "error" in e:
            pytest.fail(f"rank {rank}: {name} raised {e['error']}\n{e.get('traceback', '')}")
    return entries


def _outcome(results, name):
    """Per-rank entries without failing on recorded errors (record-only checks)."""
    return [r["checks"][name] for r in results]


# ---------------------------------------------------------------------------
# harness self-tests


@pytest.mark.dist
def test_harness_orders_results_and_sets_env():
    res = run_ranks(2, cases.echo, {"k": [1, 2]})
    assert [r["rank"] for r in res] == [0, 1]
    assert all(r["ws"] == 2 and r["payload"] == {"k": [1, 2]} for r in res)
    assert all(r["sum"] == 1.0 for r in res)  # all_reduce(0 + 1)
    assert res[0]["pid"] != res[1]["pid"]
    info = preload_info()
    for name in ("torch", "torch.distributed", "torch.distributed.fsdp", "dcp_optim"):
        assert name in info["preloaded"], info


@pytest.mark.dist
def test_harness_collects_every_failure():
    with pytest.raises(AssertionError) as excinfo:
        run_ranks(2, cases.fail_on_rank, 1, timeout=60)
    text = str(excinfo.value)
    assert "rank 1: raised" in text
    assert "ValueError: deliberate failure on rank 1" in text
    # rank 0 was blocked in a barrier: it either errored (peer gone) or was killed.
    assert "rank 0:" in text


@pytest.mark.dist
def test_harness_rejects_tensor_results_and_lambdas():
    with pytest.raises(AssertionError, match="never tensors"):
        run_ranks(1, cases.return_tensor)
    with pytest.raises(TypeError, match="module-level"):
        run_ranks(1, lambda rank, ws: None)


@pytest.mark.dist
def test_harness_deadline_kills_stragglers():
    with pytest.raises(AssertionError) as excinfo:
        run_ranks(2, cases.sleep_forever, timeout=3)
    text = str(excinfo.value)
    assert "timed out / killed: ranks [0, 1]" in text
    assert "no result within 3s" in text  # ended by the deadline, not by pytest's timeout
    assert "sleep_forever" in text  # the stack dumped at the deadline


@pytest.mark.dist
def test_harness_reports_crashes():
    with pytest.raises(AssertionError) as excinfo:
        run_ranks(2, cases.crash_on_rank, 0, timeout=60)
    text = str(excinfo.value)
    assert "rank 0: died without a result (killed by signal SIGSEGV" in text
    assert excinfo.value.exitcodes[0] == -11


def test_run_in_subprocess_isolated():
    info = run_in_subprocess(cases.sys_path_info)
    assert info["dcp_optim"].endswith("dcp_optim/__init__.py"), info
    assert info["tests"].endswith("tests/__init__.py"), info
    rss = run_in_subprocess(cases.peak_rss_mib, 64)
    assert rss["has_pg"] is False
    assert rss["after_mib"] - rss["before_mib"] >= 60, rss


@pytest.mark.dist
def test_launch_cost_is_amortised(record_property):
    """Launches are cheap because every rank is forked from one forkserver
    that imported torch and dcp_optim once: every launch's ranks have the
    same parent, and the preload holds torch.  (The launch times are
    recorded, not asserted: a preloaded ws=2 launch is ~0.2 s on 2 idle
    cores, and a loaded machine may take any time.)"""
    parents = set()
    for ws in (2, 4):
        samples = []
        for _ in range(3):
            t0 = time.perf_counter()
            res = run_ranks(ws, cases.echo, None)
            samples.append(time.perf_counter() - t0)
            parents.update(r["ppid"] for r in res)
            assert len({r["pid"] for r in res}) == ws
        record_property(f"launch_ws{ws}_s", [round(s, 3) for s in samples])
    assert len(parents) == 1, parents
    assert "torch" in preload_info()["preloaded"]
    assert len(launch_times()) >= 6


# ---------------------------------------------------------------------------
# the ws=2 canary launch


@pytest.mark.dist
def test_ws2_launch_environment(ws2):
    for rank, r in enumerate(ws2):
        assert r["rank"] == rank
        assert r["torch"].startswith(SUPPORTED_TORCH), r["torch"]
        assert r["backend"] == "gloo"
        assert r["num_threads"] == 1
        assert r["env"] == {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}


@pytest.mark.dist
@pytest.mark.parametrize(
    "name",
    [
        "all_reduce_avg",
        "reduce_scatter_tensor_avg",
        "reduce_scatter_tensor_sum",
        "reduce_scatter_list_avg",
        "reduce_scatter_single_avg",
        "all_gather_into_tensor",
        "all_gather_single",
        "broadcast",
        "broadcast_object_list",
        "all_gather_object",
        "broadcast_coalesced",
        "all_to_all_single",
        "all_to_all_list",
        "batch_isend_irecv",
        "coalescing_manager_all_reduce_avg",
        "coalescing_manager_reduce_scatter_avg",
    ],
)
def test_collective(ws2, name):
    if name in _MISSING_BEFORE and _torch_before(_MISSING_BEFORE[name][0]):
        # an older torch: the call does not exist or gloo refuses it, and
        # the canary checks that it still does (dcp_optim gathers with
        # all_gather_into_tensor there, and uses neither of the others)
        for rank, e in enumerate(_outcome(ws2, name)):
            assert re.search(_MISSING_BEFORE[name][1], e.get("error", "")), (rank, e)
        return
    for rank, e in enumerate(_check(ws2, name)):
        assert e["got"] == e["expected"], (rank, e)
        if "got_2d" in e:
            assert e["got_2d"] == e["expected_2d"], (rank, e)
        if "got_big" in e:
            assert e["got_big"] == e["expected_big"], (rank, e)


@pytest.mark.dist
def test_scatter_gather_object_and_send_recv(ws2):
    sg = _check(ws2, "scatter_gather_object")
    assert [e["scattered"] for e in sg] == ["item0", "item1"]
    assert sg[0]["gathered"] == [["r", 0], ["r", 1]]
    sr = _check(ws2, "send_recv")
    assert sr[1]["got"] == sr[1]["expected"] == [42.0, 43.0]


@pytest.mark.dist
def test_coalescing_manager_without_device(ws2):
    for e in _check(ws2, "coalescing_manager_all_gather_into_tensor"):
        assert e["got_async"] == e["expected"]
        assert e["got_sync"] == e["expected"]


@pytest.mark.dist
def test_coalescing_manager_with_device_is_recorded(ws2, record_property):
    """Record only: what ``_coalescing_manager(device=cpu)`` does on gloo."""
    entries = _outcome(ws2, "coalescing_manager_device_cpu")
    record_property("coalescing_manager_device_cpu", entries[0])
    for e in entries:
        assert "error" not in e, e  # the probe itself must not crash
        # After the explicit cleanup a plain all_reduce works again.
        assert e["probe_all_reduce_after_cleanup"] == 2.0, e


@pytest.mark.dist
@pytest.mark.parametrize(
    "name",
    ["all_reduce_avg_int", "all_gather_into_tensor_stacked", "premul_sum"],
)
def test_record_only_collective_gaps(ws2, name, record_property):
    """Record only: forms that may be unsupported on gloo (see FINDINGS)."""
    entries = _outcome(ws2, name)
    record_property(name, entries[0].get("error") or entries[0].get("got"))
    assert len({e.get("error") for e in entries}) == 1, entries  # same on every rank


# ---------------------------------------------------------------------------
# FSDP2


@pytest.mark.dist
@pytest.mark.parametrize("optim_name", ["adam", "sgd"])
def test_fsdp2_gloo_averages_gradients(ws2, optim_name):
    """FSDP2 on 2 ranks == one process on the global batch (settles AVG)."""
    for rank, e in enumerate(_check(ws2, f"fsdp2_parity_{optim_name}")):
        # A summed-not-averaged reduce-scatter would give ratio 2.0.
        assert all(abs(x - 1.0) < 1e-5 for x in e["grad_norm_ratios"]), (rank, e)
        assert e["grad_max_abs_diff"] < TIGHT, (rank, e)
        assert e["param_max_abs_diff"] < TIGHT, (rank, e)
        assert e["param_types"] == ["DTensor"]
        assert e["placements"] == ["(Shard(dim=0),)"]
        if optim_name == "adam":
            assert e["state_max_abs_diff"]["exp_avg"] < TIGHT, (rank, e)
            assert e["state_max_abs_diff"]["exp_avg_sq"] < TIGHT, (rank, e)
            assert e["state_types"] == ["DTensor"]
            assert e["step_types"] == ["Tensor:torch.float32:cpu:0d"]
    # Uneven dim 7 over 2 ranks: 4 + 3 rows.
    shapes = [e["local_shapes"]["2.weight"] for e in _check(ws2, f"fsdp2_parity_{optim_name}")]
    assert shapes == [[4, 16], [3, 16]]


@pytest.mark.dist
def test_fsdp2_upstream_full_cpu_offload_and_broadcast(ws2):
    gets = _check(ws2, "fsdp2_dsd_full_cpu_offload_get")
    assert gets[0]["model_len"] == 6 and gets[0]["optim_state_len"] == 6
    assert gets[0]["model_devices"] == ["cpu"]
    assert gets[1]["model_len"] == 0 and gets[1]["optim_state_len"] == 0  # rank 0 only
    for e in _check(ws2, "fsdp2_dsd_broadcast_from_rank0_set"):
        assert e["model_keys_equal"]
        assert e["model_max_abs_diff"] == 0.0
        assert e["optim_max_abs_diff"] == 0.0


# ---------------------------------------------------------------------------
# FSDP1


@pytest.mark.dist
def test_fsdp1_needs_device_id_cpu(ws2):
    for e in _check(ws2, "fsdp1_without_device_id"):
        assert e["raised"] == (
            "RuntimeError: FSDP needs a non-CPU accelerator device, "
            "but no accelerator device is detected."
        )


@pytest.mark.dist
def test_fsdp1_cpu_step_and_upstream_full_state_dict(ws2):
    _check(ws2, "fsdp1_train_step")
    for e in _check(ws2, "fsdp1_get_state_dict_full"):
        assert e["model_keys"] == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
        assert e["model_value_types"] == ["Tensor"]
        assert e["model_max_abs_diff"] < TIGHT, e
        assert e["optim_max_abs_diff"] < TIGHT, e
    for e in _check(ws2, "fsdp1_get_state_dict_sharded"):
        assert e["model_value_types"] == ["ShardedTensor"]


@pytest.mark.dist
def test_fsdp1_full_cpu_offload_upstream(record_property):
    """docs/testing.md, pitfall 2 (pytorch#188989, fix PR #188990): own launch.

    A canary: it xfails on the known crash only, and fails when upstream
    changes (no crash, or another failure).

    On 2.13.0 rank 0 SIGSEGVs in FSDP1's ``param_hook`` (``clone()`` of a
    parameter whose storage ``FlatParamHandle.to_cpu()`` just freed, because
    the "copy to CPU" of an already-CPU tensor is the same storage).
    """
    try:
        res = run_ranks(2, cases.fsdp1_full_cpu_offload, timeout=90)
    except AssertionError as exc:
        codes = getattr(exc, "exitcodes", None)
        if codes is None:  # not a rank failure reported by the harness
            raise
        record_property("fsdp1_full_cpu_offload_exitcodes", codes)
        # Only the known failure is expected: rank 0 killed by SIGSEGV, or
        # the same use-after-free caught by torch as a storage error.
        # Anything else (a timeout, a bug in the case) fails the canary.
        if codes.get(0) != -11 and not _FSDP1_OFFLOAD_ERROR.search(str(exc)):
            raise
        first = str(exc).splitlines()
        reason = next((line for line in first if line.startswith("--- rank")), first[0])
        pytest.xfail(
            "upstream FSDP1 full_state_dict+cpu_offload on CPU fails "
            f"(pytorch#188989, fix PR #188990 not in this wheel): {reason} exitcodes={codes}"
        )
    bad = [
        (rank, name, e)
        for rank, r in enumerate(res)
        for name, e in r["checks"].items()
        if "error" in e or e.get("model_max_abs_diff", 0) > TIGHT or e.get("optim_max_abs_diff", 0) > TIGHT
    ]
    # Upstream changed: it no longer crashes.  Fail so that someone looks:
    # with correct results, pytorch#188989 is fixed in this torch (update
    # docs/torch-2.13-findings.md and D23 in docs/differences.md); with wrong
    # ones, upstream fails in a new way.
    if bad:
        pytest.fail(f"upstream FSDP1 full_state_dict+cpu_offload no longer crashes but gives wrong results: {bad[0]}")
    pytest.fail(
        "upstream FSDP1 full_state_dict+cpu_offload no longer crashes and matches the reference: "
        "pytorch#188989 is fixed in this torch; update docs/torch-2.13-findings.md, D23 and this canary"
    )


_FSDP1_OFFLOAD_ERROR = re.compile(r"out of bounds for storage of size 0")


# ---------------------------------------------------------------------------
# 2-D: FSDP2 + TP on a (dp=2, tp=2) mesh, DCP save at ws=4, load at ws=2/1


@pytest.mark.dist
@pytest.mark.slow
def test_fsdp2_tp_2x2_dcp_save_ws4_load_ws2(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saved = run_ranks(4, cases.fsdp2_tp_save_ws4, ckpt, timeout=240)
    for r in saved:
        step = r["checks"]["fsdp2_tp_step"]
        assert "error" not in step, step.get("traceback")
        assert step["mesh"] == {"shape": [2, 2], "names": ["dp", "tp"]}
        assert step["param_max_abs_diff"] < TIGHT, step
        assert step["placements"]["in_proj.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
        assert step["placements"]["out_proj.weight"] == "(Shard(dim=0), Shard(dim=1))"
        save = r["checks"]["dcp_save_ws4"]
        assert "error" not in save, save.get("traceback")
        assert save["model_value_types"] == ["DTensor"]
    files = saved[0]["checks"]["dcp_save_ws4"]["files"]
    assert ".metadata" in files and len([f for f in files if f.endswith(".distcp")]) == 4
    expected = saved[0]["checks"]["dcp_save_ws4"]["full"]
    assert not _unknown_warnings(saved)[1]

    for ws, kind in ((2, "fsdp2"), (1, "plain")):
        loaded = run_ranks(ws, cases.dcp_load, ckpt, expected, kind, timeout=120)
        for r in loaded:
            e = r["checks"][f"dcp_load_{kind}_ws{ws}"]
            assert "error" not in e, e.get("traceback")
            assert e["model_keys_equal"] and e["optim_keys_equal"], e
            assert e["model_max_abs_diff"] == 0.0, e
            assert e["optim_max_abs_diff"] == 0.0, e
            assert e["model_value_types"] == (["DTensor"] if kind == "fsdp2" else ["Tensor"])
        assert not _unknown_warnings(loaded)[1]


# ---------------------------------------------------------------------------
# warnings torch emits in these scenarios (in the workers)

# Every warning the ws=2 canary may see on torch 2.13.0. A new torch warning
# fails this test: add it here AND decide whether the suite's
# ``filterwarnings = error`` list needs an ignore for in-process tests.
KNOWN_TORCH_WARNINGS = [
    ("FutureWarning", r"`torch\.distributed\.reduce_scatter_tensor` is deprecated\. "
     r"Please use `torch\.distributed\.reduce_scatter_single` instead\."),
    ("FutureWarning", r"`torch\.distributed\.all_gather_into_tensor` is deprecated\. "
     r"Please use `torch\.distributed\.all_gather_single` instead\."),
    ("UserWarning", r"`_get_pg_default_device` will be deprecated, it only stays for "
     r"backward-compatibility reason\."),
    ("UserWarning", r"Multiple backends are registered with this ProcessGroup\. We cannot "
     r"determine which one is the default\. Returning cpu\."),
    ("FutureWarning", r"Please use DTensor instead and we are deprecating ShardedTensor\."),
    # FSDP2 + TP (RowwiseParallel output is a view of the local tensor).
    ("UserWarning", r"FSDP2-wrapped module \(FSDPTPMLP\) returned a view tensor\."),
]


def _unknown_warnings(results):
    seen = {}
    for r in results:
        for name, e in r["checks"].items():
            for w in e["warnings"]:
                seen.setdefault((w["category"], w["message"]), set()).add(name)
    unknown = [
        (cat, msg, sorted(names))
        for (cat, msg), names in seen.items()
        if not any(cat == kc and re.match(kp, msg) for kc, kp in KNOWN_TORCH_WARNINGS)
    ]
    return seen, unknown


@pytest.mark.dist
def test_torch_warnings_are_known(ws2, record_property):
    seen, unknown = _unknown_warnings(ws2)
    record_property("torch_warnings", sorted((c, m[:80], sorted(n)) for (c, m), n in seen.items()))
    assert not unknown, unknown
