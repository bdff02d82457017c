"""The metadata a broadcast load sends ahead of the data pickles its 0-dim
tensors (an optimizer's ``step``) as dtype and bytes: what arrives must be
what torch's own pickling gives, bit for bit, and anything the compact
form cannot carry (autograd, subclasses, other layouts) must keep torch's
reduction."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

from dcp_optim._engine.payload import MetadataPickler

SCALARS = [
    torch.tensor(3.0),
    torch.tensor(-0.0),
    torch.tensor(float("nan")),
    torch.tensor(7, dtype=torch.int64),
    torch.tensor(-3, dtype=torch.int8),
    torch.tensor(200, dtype=torch.uint8),
    torch.tensor(True),
    torch.tensor(2.5, dtype=torch.bfloat16),
    torch.tensor(1.5, dtype=torch.float16),
    torch.tensor(1e300, dtype=torch.float64),
    torch.tensor(1 + 2j, dtype=torch.complex64),
    torch.tensor(3 - 4j, dtype=torch.complex128),
    torch.arange(5.0)[3],  # a view into a larger storage
]


def _ours(obj):
    buf = io.BytesIO()
    MetadataPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return pickle.loads(buf.getvalue())


def _bytes(t: torch.Tensor) -> list[int]:
    return t.reshape(-1).view(torch.uint8).tolist()


@pytest.mark.parametrize("value", SCALARS, ids=lambda t: str(t.dtype))
def test_a_scalar_arrives_as_torch_unpickles_it(value):
    got = _ours({"state": {"step": value}})["state"]["step"]
    ref = pickle.loads(pickle.dumps(value))
    assert type(got) is torch.Tensor
    assert (got.dtype, got.shape, got.stride(), got.device) == (ref.dtype, ref.shape, ref.stride(), ref.device)
    assert got.requires_grad is False and got._base is None
    assert _bytes(got) == _bytes(ref) == _bytes(value)
    # a tensor of its own: writing to it leaves the source alone
    before = _bytes(value)
    got.zero_()
    assert _bytes(value) == before


def test_what_the_compact_form_cannot_carry_keeps_torch_pickling():
    grad = torch.tensor(2.0, requires_grad=True)
    param = torch.nn.Parameter(torch.tensor(1.0))
    vector = torch.arange(4.0)
    conj = torch.tensor(1 + 1j).conj()
    got_grad, got_param, got_vector, got_conj = _ours([grad, param, vector, conj])
    assert got_grad.requires_grad and got_grad.item() == 2.0
    assert type(got_param) is torch.nn.Parameter and got_param.item() == 1.0
    assert torch.equal(got_vector, vector)
    assert got_conj.is_conj() and got_conj.item() == conj.item()


def test_other_metadata_round_trips_unchanged():
    meta = ({"lr": 0.1, "betas": (0.9, 0.999), "params": ["a.weight"]}, [None, "x", 3], torch.float32)
    assert _ours(meta) == meta
