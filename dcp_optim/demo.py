"""dcp_optim demo: train with FSDP2 on CPU processes, checkpoint with DCP
through dcp_optim, resume at other world sizes, and show the loss continues
exactly as if training had never stopped.

    python -m dcp_optim.demo [--steps 6] [--save-at 3] [--dir PATH]
    python -m dcp_optim.demo reshard   # FSDP2 -> TP in memory (docs/resharding.md)

Phases (each a fresh set of gloo processes on this machine):

  1. reference   FSDP2, 2 ranks: train `steps` steps, save a checkpoint
                 after step `save_at` (DCP + the Stateful AppState pattern,
                 state dicts from dcp_optim), keep training to the end.
  2. resume      fresh processes at world size 1 (plain model), 2 (FSDP2)
                 and 3 (FSDP2, uneven shards): a never-stepped optimizer
                 gives the load template, dcp.load fills it, dcp_optim
                 installs it, and training continues from `save_at`.

Under torchrun, the same two phases as separate launches:

    torchrun --standalone --nproc-per-node=2 -m dcp_optim.demo train --dir D
    torchrun --standalone --nproc-per-node=3 -m dcp_optim.demo resume --dir D

`train` records the losses next to the checkpoint; `resume` continues at
its own world size and compares (exit status 1 on a mismatch).

Every rank trains on the same batch, which makes the arithmetic of a step
independent of the world size (data-parallel gradient averaging of equal
values is exact), so the resumed losses must equal the reference bit for
bit -- any difference would be a state that was lost or changed.
"""

from __future__ import annotations

import sys

# The code lives in dcp_optim.tools.demo (why: see there).
from .tools.demo import main as _main

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["reshard"]:  # FSDP2 -> TP in memory (docs/resharding.md)
        from .tools.demo_reshard import main as reshard

        return reshard(args[1:])
    return _main(argv)

if __name__ == "__main__":
    sys.exit(main())
