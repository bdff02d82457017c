"""The source's inputs of a scattered tensor's step (dcp_optim/_engine/
scatter_load.py): built in a number of torch calls that does not grow with
the world, they must hold, rank by rank, exactly the bytes the per-rank
construction (``_source_rows``) gives -- for every step of every chunking,
uneven last chunks, ranks without rows, and values that are views,
non-contiguous or offset into their storage.  No process group needed."""

from __future__ import annotations

import pytest
import torch

from dcp_optim._engine import scatter_load as S


def _pieces(value: torch.Tensor, world: int, k: int):
    """The one-piece steps ``_units`` cuts ``value`` into: ``k`` rows of
    every rank's chunk at a time."""
    n = value.shape[0]
    row_bytes = value.dtype.itemsize * (value.numel() // n if n else 0)
    chunk = -(-n // world)
    for start in range(0, chunk, k):
        yield S._Piece(value, None, n, chunk, start, min(k, chunk - start), row_bytes, 0)


def _values():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 7, generator=g)
    yield "contiguous", base
    yield "1-d", torch.randn(37, generator=g)
    yield "transposed", torch.randn(7, 64, generator=g).t()
    # rows of one element whose stride is not 1 (counted contiguous by torch)
    yield "transposed column", torch.randn(1, 37, generator=g).t()
    yield "strided 1-d", torch.randn(74, generator=g)[::2]
    # memory that holds other values than the tensor reads as
    yield "conjugate", torch.randn(64, 3, dtype=torch.complex64, generator=g).conj()
    yield "negative", torch.randn(64, 3, dtype=torch.complex64, generator=g).conj().imag
    yield "offset view", torch.randn(70, 7, generator=g)[5:69]
    yield "row-strided", torch.randn(128, 7, generator=g)[::2]
    yield "int16", torch.arange(64 * 3, dtype=torch.int16).view(64, 3)


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8, 63, 64, 100])
@pytest.mark.parametrize("k", [1, 2, 5, 1000])
def test_inputs_match_the_per_rank_construction(world, k):
    device = torch.device("cpu")
    for label, value in _values():
        for piece in _pieces(value, world, k):
            inputs, nbytes = S._source_inputs(piece, world, device)
            assert len(inputs) == world, label
            step = piece.rows * piece.row_bytes
            expected_copies = 0
            for rank, got in enumerate(inputs):
                want, copied = S._source_rows(piece, rank, device)
                assert got.dtype == torch.uint8 and got.shape == (step,) and got.is_contiguous(), (label, rank)
                real = piece.real_rows(rank) * piece.row_bytes
                # what the rank keeps: its real rows, byte for byte; the
                # padding past them is never read
                assert torch.equal(got[:real], want[:real]), (label, world, k, piece.start, rank)
                expected_copies += copied
            # a contiguous value: nothing copied where the per-rank
            # construction viewed, at most one step beyond its copies (the
            # shared idle buffer); any value: at most a step per rank and
            # the idle one (what the unit's memory accounting allows)
            own = value.is_contiguous() and not value.is_conj() and not value.is_neg()
            if own:
                assert nbytes <= expected_copies + step, (label, nbytes, expected_copies)
            assert nbytes <= (world + 1) * step, (label, nbytes)
            if own and S._whole_ranks(piece, world) == world:
                assert nbytes == 0, label


def test_whole_ranks_counts_the_ranks_holding_every_row():
    value = torch.zeros(10, 2)
    for world in (1, 2, 3, 4, 7, 10, 11, 40):
        for k in (1, 3):
            for piece in _pieces(value, world, k):
                whole = S._whole_ranks(piece, world)
                assert all(piece.real_rows(r) == piece.rows for r in range(whole))
                assert all(piece.real_rows(r) < piece.rows for r in range(whole, world))


def test_idle_ranks_share_one_buffer_and_views_alias_the_value():
    """Ranks past the last row send one shared, never-read buffer; a
    contiguous value is sent from its own memory."""
    value = torch.arange(6 * 4, dtype=torch.float32).view(6, 4)
    piece = next(_pieces(value, 8, 1))  # chunk 1: ranks 6 and 7 hold no row
    inputs, nbytes = S._source_inputs(piece, 8, torch.device("cpu"))
    assert inputs[6].data_ptr() == inputs[7].data_ptr()
    assert nbytes == piece.rows * piece.row_bytes
    for rank in range(6):
        assert inputs[rank].data_ptr() == value.data_ptr() + rank * 16


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8, 64])
@pytest.mark.parametrize("k", [1, 2, 1000])
def test_messages_send_each_rank_its_rows(world, k):
    """What the source sends a rank point to point (``_rows_to_send``) is
    that rank's real rows of the piece, byte for byte, viewed from the
    value where they are contiguous."""
    device = torch.device("cpu")
    for label, value in _values():
        for piece in _pieces(value, world, k):
            for rank in range(world):
                real = piece.real_rows(rank)
                if not real:
                    continue
                got, copied = S._rows_to_send(piece, rank, real, device)
                first = rank * piece.chunk + piece.start
                rows = value[first : first + real]
                want = rows.resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format)
                want = want.view(-1).view(torch.uint8)
                assert got.dtype == torch.uint8 and torch.equal(got, want), (label, world, k, rank)
                own = rows.is_contiguous() and not rows.is_conj() and not rows.is_neg()
                assert copied == (0 if own else real * piece.row_bytes), (label, rank)


def test_flat_bytes_of_one_element_with_any_stride():
    """A tensor of one element counts as contiguous whatever its strides:
    its bytes come back as a view, the value's own."""
    from dcp_optim._engine.tensor_bytes import flat_bytes

    column = torch.arange(5, dtype=torch.float32).view(1, 5).t()  # strides (1, 5)
    one = column[3:4]
    assert one.is_contiguous() and one.stride() == (1, 5)
    got = flat_bytes(one)
    assert torch.equal(got, torch.tensor([3.0]).view(torch.uint8))
    got.view(torch.float32).fill_(7.0)  # a view: writes reach the value
    assert column[3, 0].item() == 7.0
    empty = torch.zeros(0, 5).t()[:, :0]
    assert flat_bytes(empty).numel() == 0
    assert torch.equal(flat_bytes(column.t()), column.t().contiguous().view(-1).view(torch.uint8))


def test_flat_bytes_of_strided_views_that_reshape_keeps():
    """``reshape(-1)`` returns a strided tensor as it is where a view
    exists (one-dimensional with a stride, or a row of a transposed
    matrix): its bytes are copied, in logical order."""
    from dcp_optim._engine.tensor_bytes import flat_bytes

    matrix = torch.arange(12, dtype=torch.float32).view(3, 4)
    for view in (matrix[:, 1], torch.arange(10.0)[::2], matrix.t()[1:2], matrix.t()[1]):
        assert view.reshape(-1).stride() != (1,)  # what reshape alone would send
        got = flat_bytes(view)
        assert torch.equal(got, view.clone(memory_format=torch.contiguous_format).view(-1).view(torch.uint8))


def test_bytes_view_is_the_tensors_own_memory_or_an_error():
    """What a receiver writes into is the shard's own memory: a view, or
    an error where none exists (callers check ``own_bytes`` first and go
    through a scratch buffer)."""
    from dcp_optim._engine.tensor_bytes import bytes_view, flat_bytes, own_bytes

    shard = torch.zeros(4, 3)
    bytes_view(shard[1:3]).view(torch.float32).fill_(2.0)
    assert shard[1:3].eq(2.0).all() and shard[0].eq(0.0).all() and shard[3].eq(0.0).all()
    z = torch.randn(5, dtype=torch.complex64)
    for view in (shard.t(), z.conj(), z.conj().imag):
        assert not own_bytes(view)
        with pytest.raises(ValueError):
            bytes_view(view)
    # read through the conjugate: its values, not its memory
    assert torch.equal(flat_bytes(z.conj()), z.conj().resolve_conj().view(torch.uint8))
