"""Distributed tests on CPU gloo: the rank functions (``dist_cases*.py``, imported by name in worker processes) and the tests that launch them."""
