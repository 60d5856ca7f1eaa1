"""``tpurec <command>``: ``plan`` (the TPU sharding planner) or ``bench`` (benchmarks)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"plan": "shard embedding tables over a TPU topology", "bench": "run a benchmark, print JSON"}
    if not argv or argv[0] not in commands:
        usage = "\n".join(f"  {name:<6} {text}" for name, text in commands.items())
        print(f"usage: tpurec <command> [options]\n\ncommands:\n{usage}", file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "plan":
        from tpurec.sparse.planner.__main__ import main as plan_main

        return plan_main(rest) or 0
    from tpurec.bench.__main__ import main as bench_main

    bench_main(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
