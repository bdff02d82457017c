"""values.same_value: the equality a resume needs for values kept beside
tensors' data (param-group hyperparameters, counters): bit for bit, NaN
equal to NaN, objects without an equality of their own by their pickles."""

from __future__ import annotations

import pytest
import torch

from dcp_optim._engine.values import same_value


class _Plain:
    """No __eq__: two copies (one unpickled per loaded group) differ by identity."""

    def __init__(self, v):
        self.v = v


class _Unpicklable:
    def __init__(self):
        self.fn = lambda: None

    def __eq__(self, other):
        raise RuntimeError("no equality")


NAN = float("nan")


@pytest.mark.parametrize("a, b, same", [
    (0.1, 0.1, True),
    (0.1, 0.2, False),
    (1, 1.0, True),  # the same number, trained on alike
    (True, 1, False),  # a flag is not a number
    (NAN, float("nan"), True),
    ((0.9, 0.999), (0.9, 0.999), True),
    ((0.9, 0.999), [0.9, 0.999], False),
    ((0.9, NAN), (0.9, float("nan")), True),
    ({"a": 1, "b": 2}, {"b": 2, "a": 1}, False),  # key order is part of a dict's value
    ("cosine", "cosine", True),
    (None, 0, False),
    (torch.tensor(0.01), torch.tensor(0.01), True),
    (torch.tensor(0.01), torch.tensor(0.01, dtype=torch.float64), False),
    (torch.tensor([1.0, NAN]), torch.tensor([1.0, NAN]), True),
    (torch.tensor(-0.0), torch.tensor(0.0), False),  # bits, not ==
    (torch.tensor(1.0), 1.0, False),
    (_Plain(3), _Plain(3), True),
    (_Plain(3), _Plain(4), False),
])
def test_same_value(a, b, same):
    assert same_value(a, b) is same
    assert same_value(b, a) is same


def test_values_neither_comparable_nor_picklable_differ():
    a, b = _Unpicklable(), _Unpicklable()
    assert same_value(a, a)
    assert not same_value(a, b)
