"""Tests of the tools: the command line, the converter, checksums and verification, hostile checkpoints, ``dcp_optim.patch()`` in real trainers, tools/gpu-check.sh."""
