"""tools/gpu-check.sh on a machine without CUDA: it runs the CPU-side
checks, prints their summary and why the CUDA suite did not run, and exits
0.  (``make test-gpu`` is this script with the project's virtualenv.)
Its time budget: the CUDA suite's limit is what is left of 8 minutes.
Two runs of the script (three imports of torch): the dominant cost."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from ..support.harness import REPO_ROOT

SCRIPT = os.path.join(REPO_ROOT, "tools", "gpu-check.sh")
# one cheap CPU-side check (it runs a 1-rank gloo group)
NODE = "tests/unit/test_device_rules.py::test_load_device_drops_meta_and_rejects_mixed_devices"
# a cheaper one (no process group)
FAST_NODE = "tests/unit/test_device_rules.py::test_optimizer_broadcast_buffers_follow_the_parameters"


def _run(tmp_path, tests: str) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        GPU_CHECK_PYTHON=sys.executable,
        GPU_CHECK_SKIP_BUILD="1",
        GPU_CHECK_OUT=str(tmp_path / "out"),
        GPU_CHECK_CPU_TESTS=tests,
        CUDA_VISIBLE_DEVICES="",  # no CUDA device, even on a GPU machine
    )
    env.pop("DCP_OPTIM_GPU", None)
    return subprocess.run(
        ["bash", SCRIPT], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240
    )


@pytest.mark.dist
def test_no_cuda_path(tmp_path):
    proc = _run(tmp_path / "ok", NODE)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "CUDA suite skipped: torch" in out
    assert "CPU-side checks passed" in out
    assert "1 passed" in out  # the summary table of the CPU-side checks
    assert (tmp_path / "ok" / "out" / "cpu.xml").exists()
    assert not (tmp_path / "ok" / "out" / "gpu.xml").exists()
    # the CPU-side checks are bounded by what is left of the 480 s budget
    # (less the 20 s margin) after a few seconds of start-up
    limit = re.search(r"CPU-side checks: .* \(limit (\d+)s\)", out)
    assert limit and 400 <= int(limit.group(1)) <= 459, out


@pytest.mark.parametrize("elapsed", [0, 100, 150, 300, 429, 470, 600])
def test_suite_timeout_is_what_is_left_of_the_budget(elapsed):
    """The CUDA suite's limit: min(360, 480 - elapsed - 20), never negative."""
    proc = subprocess.run(
        ["bash", SCRIPT, "--suite-timeout", str(elapsed)],
        env={k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")},
        capture_output=True, text=True, timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) == max(0, min(360, 480 - elapsed - 20))


def test_no_time_left_for_the_cuda_suite(tmp_path):
    """On a (stand-in) CUDA interpreter, a suite limit under 30 s -- here
    GPU_CHECK_TIMEOUT=20 -- is printed and the suite is not started: exit
    3, no JUnit report of the suite.  The stand-in answers the script's two
    CUDA questions (torch version with no reason to skip; the device) and
    hands everything else to this interpreter."""
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = -m ] && [ "$2" = tests.gpu.env ]; then printf "2.13.0+cu130\\t\\n"; exit 0; fi\n'
        'case "$2" in *get_device_properties*) echo "Stand-in GPU, 1 GiB"; exit 0;; esac\n'
        f'exec "{sys.executable}" "$@"\n'
    )
    fake.chmod(0o755)
    env = dict(
        os.environ,
        GPU_CHECK_PYTHON=str(fake),
        GPU_CHECK_SKIP_BUILD="1",
        GPU_CHECK_OUT=str(tmp_path / "out"),
        GPU_CHECK_CPU_TESTS=FAST_NODE,
        GPU_CHECK_TIMEOUT="20",
    )
    proc = subprocess.run(
        ["bash", SCRIPT], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out
    assert re.search(r"CUDA suite on Stand-in GPU, 1 GiB: limit 20s = min\(20, 480 budget - \d+ elapsed - 20 margin\)", out), out
    assert "CUDA suite NOT run" in out
    assert "1 passed" in out  # the CPU-side checks ran
    assert not (tmp_path / "out" / "gpu.xml").exists()


@pytest.mark.parametrize(
    "cuda,index", [("13.0", "cu130"), ("12.9", "cu128"), ("12.6", "cu126"), ("12.4", None)]
)
def test_wheel_index_follows_the_driver(tmp_path, cuda, index):
    """The CUDA wheel index chosen from nvidia-smi's "CUDA Version" (a
    stand-in nvidia-smi prints the real tool's header line)."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        f"echo '| NVIDIA-SMI 580.65.06   Driver Version: 580.65.06   CUDA Version: {cuda}     |'\n"
    )
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(
        ["bash", SCRIPT, "--cuda-index"], env=env, capture_output=True, text=True, timeout=30
    )
    if index is None:
        assert proc.returncode != 0 and proc.stdout == "", proc.stdout
        assert "12.6 or newer" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == f"https://download.pytorch.org/whl/{index}"

