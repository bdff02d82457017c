"""Fixtures shared by the unit tests."""

from __future__ import annotations

import warnings

import pytest


@pytest.fixture
def quiet_warnings():
    """Warnings off for the test: third-party optimizers (heavyball,
    pytorch-optimizer) warn on construction and at every step."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
