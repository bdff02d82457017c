"""Configuration of the CUDA suite.

``make test`` runs these tests on the CPU (``DCP_OPTIM_GPU`` unset): the
same bodies, so the suite's code cannot rot on machines without a GPU.
``make test-gpu`` and ``tools/gpu-check.sh`` set ``DCP_OPTIM_GPU=1``: every
test then runs on ``cuda:0`` and, without a usable CUDA device, the
suite is skipped with the reason.
"""

from __future__ import annotations

import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from .cases import GPU_MODE, suite_device
from .env import cuda_unavailable_reason

_HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    if not GPU_MODE:
        return
    reason = cuda_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"CUDA suite skipped: {reason}")
    for item in items:
        if str(item.fspath).startswith(_HERE):
            item.add_marker(skip)


@pytest.fixture
def dev() -> torch.device:
    """cuda:0 under DCP_OPTIM_GPU=1, else the CPU."""
    return suite_device()


@pytest.fixture(scope="module")
def pg1():
    """A 1-rank process group in this process for the module's tests:
    NCCL on the GPU (``init_process_group("nccl")``, world size 1), gloo
    on the CPU."""
    assert not dist.is_initialized()
    backend = "nccl" if GPU_MODE else "gloo"
    if GPU_MODE:
        torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group(
            backend, store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=120)
        )
        try:
            yield backend
        finally:
            dist.destroy_process_group()
