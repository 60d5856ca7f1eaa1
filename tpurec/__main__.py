"""``tpurec <command>``: ``plan`` (the TPU sharding planner) or ``bench`` (benchmarks).

``tpurec <command> --help`` lists the command's own flags.
"""

from __future__ import annotations

import sys

import tpurec
from tpurec.cli import Subcommand, run_subcommand

COMMANDS = {
    "plan": Subcommand("tpurec.sparse.planner.__main__", "shard embedding tables over a TPU topology"),
    "bench": Subcommand("tpurec.bench.__main__", "run a benchmark, print JSON"),
}


def main(argv: list[str] | None = None) -> int:
    """Runs ``tpurec`` with ``argv`` (default: the process's arguments); returns the exit status.

    Args:
        argv: the arguments after ``tpurec``.
    """
    return (
        run_subcommand(
            "tpurec",
            "Recommendation models on TPUs from plain PyTorch.",
            COMMANDS,
            sys.argv[1:] if argv is None else argv,
            version=tpurec.__version__,
        )
        or 0
    )


if __name__ == "__main__":
    sys.exit(main())
