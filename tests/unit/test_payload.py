"""A broadcast load's payload (``_engine/payload.py``), encoded on the
source and decoded as a receiver gets it: the metadata exactly, and the
tensors of a small load inline, each rebuilt bit for bit in storage of
its own; loads too large, or with tensors that cannot travel as bytes,
keep their tensors out of it."""

from __future__ import annotations

import pickle

import pytest
import torch

from dcp_optim._engine import payload as P
from dcp_optim._engine.distribute import TensorMeta


class Scalar(torch.Tensor):
    """A tensor subclass (module level: picklable)."""


def _values():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=g)
    return [
        {
            "w": torch.randn(4, 3, generator=g),
            "strided": base.t()[1:4],  # non-contiguous view
            "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
            "flags": torch.tensor([True, False, True]),
            "cplx": torch.randn(3, dtype=torch.complex64, generator=g).conj(),  # conjugate bit
            "neg": torch.randn(3, dtype=torch.float64, generator=g)._neg_view(),  # negative bit
            "empty": torch.empty(0, 3),
            "step": torch.tensor(5.0),
            "param": torch.nn.Parameter(torch.randn(2, 2, generator=g)),
            "meta": "plain value",
        },
        None,
        {"p": {"exp_avg": torch.randn(3, generator=g), "step": torch.tensor(3, dtype=torch.int64)}},
    ]


def _metas(values):
    out = []
    for tree in values:
        if tree is None:
            out.append(None)
            continue
        out.append({k: TensorMeta(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) and v.dim() else v
                    for k, v in tree.items()})
    return tuple(out)


def _received(outgoing: P.OutgoingPayload):
    """What a receiver decodes: a copy of the bytes, as a broadcast gives."""
    data = outgoing.tensor.clone()
    assert P.payload_from_flags(P.payload_flags(outgoing)) == data.numel()
    metas, values = P.decode_payload(data)
    return (metas, values), values is not None


def _same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and type(b) is torch.Tensor
        assert a.dtype == b.dtype and a.shape == b.shape
        a = a.detach().resolve_conj().resolve_neg()
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        assert not b.is_conj() and not b.is_neg() and b.is_contiguous()
        return
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
        return
    assert a == b


def test_small_load_travels_inline_bit_for_bit():
    values = _values()
    metas = _metas(values)
    outgoing = P.encode_payload(metas, values)
    assert outgoing.inline
    (got_metas, got_values), inline = _received(outgoing)
    assert inline
    for want, got in zip(metas, got_metas, strict=True):
        _same(want, got)
    assert len(got_values) == len(values)
    for want, got in zip(values, got_values):
        _same(want, got)
    # every rebuilt tensor has a storage of its own (none aliases the payload)
    ptrs = [t.untyped_storage().data_ptr() for tree in got_values if tree for t in tree.values()
            if isinstance(t, torch.Tensor) and t.numel()]
    assert len(set(ptrs)) == len(ptrs)


def test_metadata_only_where_the_tensors_do_not_fit(monkeypatch):
    values = _values()
    metas = _metas(values)
    monkeypatch.setattr(P, "INLINE_BYTES", 256)
    outgoing = P.encode_payload(metas, values)
    assert not outgoing.inline
    (got_metas, got_values), inline = _received(outgoing)
    assert not inline and got_values is None
    for want, got in zip(metas, got_metas, strict=True):
        _same(want, got)


@pytest.mark.parametrize("odd", ["meta device", "subclass"])
def test_tensors_that_are_not_plain_cpu_bytes_keep_the_payload_to_metadata(odd):
    values = _values()
    if odd == "meta device":
        values[0]["odd"] = torch.empty(3, device="meta")
    else:
        class Sub(torch.Tensor):
            pass

        values[0]["odd"] = torch.zeros(3).as_subclass(Sub)
    outgoing = P.encode_payload(_metas(values), values)
    assert not outgoing.inline
    _, inline = _received(outgoing)
    assert not inline


def test_metadata_tensors_of_other_types_keep_their_own_pickling():
    """A tensor of another type in the metadata (here a subclass, 0-dim)
    is not made a plain tensor by the inline encoding: it arrives as
    ordinary pickling gives it, as without values."""
    odd = torch.tensor(2.5).as_subclass(Scalar)
    values = [{"w": torch.ones(3)}]
    metas = ({"w": TensorMeta((3,), torch.float32), "odd": odd},)
    outgoing = P.encode_payload(metas, values)
    assert outgoing.inline
    (got, got_values), _ = _received(outgoing)
    assert type(got[0]["odd"]) is Scalar and float(got[0]["odd"]) == 2.5
    _same(values[0], got_values[0])


def test_without_values_only_metadata_travels():
    metas = ({"a": TensorMeta((2,), torch.float32), "step": torch.tensor(1.0)},)
    outgoing = P.encode_payload(metas, None)
    assert not outgoing.inline
    (got, values), _ = _received(outgoing)
    assert values is None and list(got[0]) == ["a", "step"]
    assert got[0]["a"] == metas[0]["a"] and torch.equal(got[0]["step"], metas[0]["step"])


def test_flags_carry_the_size_and_mode():
    outgoing = P.encode_payload(({"x": 1},), [{"t": torch.ones(2)}])
    flags = P.payload_flags(outgoing)
    assert len(flags) == 4 and all(0 <= f <= 255 for f in flags)
    assert P.payload_from_flags(flags) == outgoing.size
    assert P.payload_flags(None) == (0, 0, 0, 0)


def test_a_payload_too_large_for_the_flags_goes_by_object_broadcast():
    class Huge:
        size = 1 << 33

    assert P.payload_from_flags(P.payload_flags(Huge())) is None  # type: ignore[arg-type]


def test_an_unpicklable_value_fails_on_the_source_before_anything_is_sent():
    values = [{"f": lambda: 0, "t": torch.ones(2)}]
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        P.encode_payload(({"f": values[0]["f"]},), values)
