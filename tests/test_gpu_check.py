"""tools/gpu-check.sh on a machine without CUDA: it runs the CPU-side
checks, prints their summary and why the CUDA suite did not run, and exits
0.  (``make test-gpu`` is this script with the project's virtualenv.)
One run of the script (two imports of torch): the dominant cost."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from .harness import REPO_ROOT

SCRIPT = os.path.join(REPO_ROOT, "tools", "gpu-check.sh")
# one cheap CPU-side check (it runs a 1-rank gloo group)
NODE = "tests/test_device_rules.py::test_load_device_drops_meta_and_rejects_mixed_devices"


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

