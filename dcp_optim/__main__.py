"""``python -m dcp_optim`` (and the ``dcp-optim`` console script): see
:mod:`dcp_optim.tools.cli`."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``);
    returns the exit code."""
    from .tools.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
