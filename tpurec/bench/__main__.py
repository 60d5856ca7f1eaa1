"""``python -m tpurec.bench <name> [options]`` (or ``tpurec bench``): run one benchmark, print JSON.

Besides the benchmark's own figures, the JSON's ``compile`` says where the run's compile seconds
went (``tpurec.bench.compile_report``: by phase and by kind of program, the slowest first), and
one line of it goes to stderr.

``python -m tpurec.bench <name> --help`` lists that benchmark's flags.
"""

from __future__ import annotations

import json
import sys

from tpurec.cli import Subcommand, run_subcommand

BENCHMARKS = {
    "collectives": Subcommand(
        "tpurec.bench.collectives", "torch.distributed collectives on tpu vs gloo on CPU tensors"
    ),
    "device_time": Subcommand(
        "tpurec.bench.device_time", "a step's one XLA program exported for TPU, timed there (needs only JAX)"
    ),
    "dispatch": Subcommand("tpurec.bench.dispatch", "the host cost of one cached op: eager and fused vs PyTorch CPU"),
    "dlrm": Subcommand("tpurec.bench.dlrm", "a DLRM training step: tpurec on tpu vs TorchRec on CPU"),
    "embeddings": Subcommand("tpurec.bench.embeddings", "embedding lookups over dims and bag sizes vs FBGEMM"),
    "modes": Subcommand("tpurec.bench.modes", "a dense step in eager, fused and compiled mode vs PyTorch CPU"),
    "text": Subcommand("tpurec.bench.text", "a text model over random lengths: compilations with and without buckets"),
    "transformer": Subcommand(
        "tpurec.bench.transformer", "a tiny transformer's step compiled on tpu vs single-thread PyTorch CPU"
    ),
    "sparse": Subcommand("tpurec.bench.sparse", "KJT preprocessing, lookups and the fused update vs FBGEMM"),
}


def main(argv: list[str] | None = None, prog: str = "python -m tpurec.bench") -> int:
    """Runs the benchmark ``argv[0]`` with the rest of ``argv`` and prints its result as JSON.

    Args:
        argv: the arguments after ``prog`` (default: the process's arguments).
        prog: the command as the user typed it, for help and errors.

    Returns:
        The exit status, 0.
    """
    import tpurec
    from tpurec.bench.compile_report import compile_since, summary_line

    before = tpurec.stats()
    result = run_subcommand(
        prog, "Run one benchmark, print its result as JSON.", BENCHMARKS, sys.argv[1:] if argv is None else argv
    )
    if isinstance(result, dict):
        # Where the run's compile seconds went: on stderr for the reader, in the JSON for the record.
        report = compile_since(before)
        print(f"{prog}: {summary_line(report)}", file=sys.stderr)
        result.setdefault("compile", report)
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
