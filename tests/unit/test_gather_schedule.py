"""The collective schedule of a full gather toward one keeping rank
(``collectives._schedule``) and the buffer a rank that keeps nothing
probes before the gather check (``_cannot_take_part``): on a mesh of more
than one dimension a sending rank may first gather its row, so its probe
is that row's segments, not only its own."""

from __future__ import annotations

import types

import pytest
import torch

from dcp_optim._engine import collectives


class FakeMesh:
    """A device mesh as the schedule reads it: its ranks (row-major), this
    rank's coordinate, a group per dimension (None: never used here)."""

    device_type = "cpu"

    def __init__(self, ranks: list, me: int):
        self.mesh = torch.tensor(ranks)
        self.shape = tuple(self.mesh.shape)
        self.ndim = self.mesh.dim()
        self.me = me

    def get_coordinate(self) -> list[int]:
        return [int(i) for i in (self.mesh == self.me).nonzero()[0]]

    def get_group(self, dim: int) -> None:
        return None

    def size(self, dim: int | None = None) -> int:
        return self.mesh.numel() if dim is None else self.shape[dim]


@pytest.mark.parametrize(("ranks", "spans"), [
    ([0, 1, 2, 3], {1: 1, 2: 1, 3: 1}),
    # rank 0 first: the row of rank 2 gathers into it before going up
    ([[0, 1], [2, 3]], {1: 1, 2: 2, 3: 1}),
    # rank 0 elsewhere: the rank in its column of the other row gathers
    ([[2, 3], [0, 1]], {1: 1, 2: 2, 3: 1}),
    ([[0, 1, 2], [3, 4, 5]], {1: 1, 2: 1, 3: 3, 4: 1, 5: 1}),
    # rank 0 not on the mesh: nobody keeps, no data moves
    ([[4, 5], [6, 7]], {4: 1, 5: 1, 6: 1, 7: 1}),
])
def test_a_sending_rank_probes_the_block_it_holds(ranks, spans):
    for rank, span in spans.items():
        mesh = FakeMesh(ranks, rank)
        assert collectives._sending_span(mesh) == span, (ranks, rank)
        if 0 in mesh.mesh.flatten().tolist():
            _, (_, count), _ = collectives._schedule(mesh, mesh.mesh.flatten().tolist().index(0))
            assert count == span  # what _gather_mesh holds after a failure of its own


def test_the_probe_allocates_that_block(monkeypatch):
    asked = []
    stand_in = types.SimpleNamespace(
        uint8=torch.uint8, device=torch.device, empty=lambda n, **kw: asked.append(n) or torch.empty(0))
    monkeypatch.setattr(collectives, "torch", stand_in)
    plan = types.SimpleNamespace(buckets=1, max_segment=100)
    assert collectives._cannot_take_part(FakeMesh([[0, 1], [2, 3]], 2), plan, keep=False) is None
    assert collectives._cannot_take_part(FakeMesh([[0, 1], [2, 3]], 3), plan, keep=False) is None
    assert collectives._cannot_take_part(FakeMesh([[0, 1], [2, 3]], 0), plan, keep=True) is None
    assert asked == [200, 100, 400]
