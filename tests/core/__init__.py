"""Tests of the C core: fuzzing, lint of csrc/, the walk-replay invariants, and (``refleak/``) the torch-free suite run on debug and other interpreters."""
