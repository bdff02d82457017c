"""Test configuration: environment for gloo workers, shared fixtures."""

from __future__ import annotations

import os

# Before torch is imported anywhere (TESTING.md section 3.2).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture
def world1(tmp_path):
    """A world-size-1 gloo process group in this process (DDP of one rank,
    trivial full/broadcast paths); destroyed after the test."""
    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def pytest_terminal_summary(terminalreporter):
    """The optimizer corpus' count of what ran (tests/test_optim_corpus.py)."""
    import sys

    corpus = sys.modules.get("tests.test_optim_corpus")
    for line in corpus.corpus_summary() if corpus else []:
        terminalreporter.write_line(line)
