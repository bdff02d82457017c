"""Benchmarks: dcp_optim against upstream ``torch.distributed.checkpoint.state_dict``.

Run ``python -m benchmarks`` (everything, < 10 min on 2 cores) or
``python -m benchmarks --quick``; see ``benchmarks/README.md``.

Sections: 1 bookkeeping (``bookkeeping``), 2 distributed (``distributed``),
3 scaling (derived from 1).  Every figure is measured in the same run,
upstream and dcp_optim interleaved on the same objects.
"""
