"""``python -m tpurec.bench <name> [options]``: run one benchmark, print JSON."""

from __future__ import annotations

import argparse
import json
import sys

BENCHMARKS = {"dlrm": "tpurec.bench.dlrm", "embeddings": "tpurec.bench.embeddings", "modes": "tpurec.bench.modes", "sparse": "tpurec.bench.sparse"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tpurec.bench", description=__doc__)
    parser.add_argument("name", choices=sorted(BENCHMARKS))
    args, rest = parser.parse_known_args(argv)
    import importlib

    module = importlib.import_module(BENCHMARKS[args.name])
    result = module.main(rest)
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
