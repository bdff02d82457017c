"""Shared test support: the multi-process harness (``run_ranks``), models, the upstream oracle (``assert_same_tree``) and module cases."""
