"""The command lines as users run them: ``tpurec ...`` and ``python -m tpurec.bench ...``.

The entry points users type run in their own process (the checkout first on ``PYTHONPATH``,
with a timeout); the other cases call the same ``main`` functions in this process, since each
new process spends seconds in ``import tpurec``. Every command and subcommand answers
``--help`` with its own flags and exit status 0; bad input ends in an ``error:`` line (one line
alone for the checks after argparse's) and exit status 2, never a traceback.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from tpurec.sparse.planner.__main__ import main as plan_main

ROOT = Path(__file__).resolve().parents[1]
TABLES = ROOT / "examples" / "planner" / "mlperf_dlrm_dcnv2.json"
TIMEOUT = 300  # seconds: `import tpurec` alone takes several on a loaded 2-core machine


def run(*command: str) -> subprocess.CompletedProcess:
    """Runs ``command`` in its own process with the checkout's tpurec; output as text."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        list(command), capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT, env=env, check=False
    )


def tpurec_script() -> str:
    """The ``tpurec`` console script of this interpreter's environment."""
    script = Path(sys.executable).parent / "tpurec"
    assert script.exists(), f"{script} is missing: `pip install -e .` (make) installs it"
    return str(script)


def assert_one_error_line(proc: subprocess.CompletedProcess, prog: str, *words: str) -> None:
    """Exit status 2, nothing on stdout, a single ``<prog>: error: ...`` line naming ``words``."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), proc.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])


def test_console_script_is_tpurec_main():
    (entry,) = [e for e in metadata.entry_points(group="console_scripts") if e.name == "tpurec"]
    assert entry.value == "tpurec.__main__:main"


def test_tpurec_help_lists_the_commands():
    proc = run(tpurec_script(), "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: tpurec "), proc.stdout
    assert "plan" in proc.stdout and "bench" in proc.stdout, proc.stdout


def test_tpurec_plan_help_shows_the_planners_flags():
    proc = run(tpurec_script(), "plan", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: tpurec plan "), proc.stdout[:500]
    assert "--topology" in proc.stdout and "--batch-size" in proc.stdout, proc.stdout


def test_bench_subcommand_help_is_the_benchmarks_own():
    proc = run(sys.executable, "-m", "tpurec.bench", "dlrm", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m tpurec.bench dlrm "), proc.stdout[:500]
    assert "--breakdown" in proc.stdout and "--ids-per-bag" in proc.stdout, proc.stdout


def test_unknown_topology_is_one_error_line():
    proc = run(tpurec_script(), "plan", "--topology", "nosuch", "--tables", str(TABLES), "--batch-size", "8")
    assert_one_error_line(proc, "tpurec plan", "nosuch", "v5p-128")


def test_bad_bench_flag_value_exits_2_before_running():
    proc = run(sys.executable, "-m", "tpurec.bench", "sparse", "--iters", "0")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and not proc.stdout, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "python -m tpurec.bench sparse: error: argument --iters: must be a positive integer, got '0'"
    )


# The same entry points called in this process (each new process costs seconds of `import tpurec`).
def call(main, argv: list[str], capsys) -> tuple[int, str, str]:
    """``main(argv)``'s exit status (its return value or SystemExit code), stdout and stderr."""
    try:
        status = main(argv)
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err


def test_tpurec_version(capsys):
    import tpurec
    from tpurec.__main__ import main

    assert call(main, ["--version"], capsys)[:2] == (0, f"tpurec {tpurec.__version__}\n")


@pytest.mark.parametrize(
    "argv, usage, own_flags",
    [
        (["bench"], "usage: tpurec bench ", ["dlrm", "embeddings", "modes", "sparse"]),
        (["bench", "dlrm"], "usage: tpurec bench dlrm ", ["--breakdown", "--no-pipeline"]),
        (["bench", "embeddings"], "usage: tpurec bench embeddings ", ["--ids-per-bag", "--dims"]),
        (["bench", "modes"], "usage: tpurec bench modes ", ["--round-steps", "cpu_pytorch"]),
        (["bench", "sparse"], "usage: tpurec bench sparse ", ["--small", "--partitions"]),
        (["plan"], "usage: tpurec plan ", ["--topology", "--sharding-types"]),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else None,
)
def test_each_subcommand_has_its_own_help(argv, usage, own_flags, capsys):
    from tpurec.__main__ import main

    status, out, err = call(main, [*argv, "--help"], capsys)
    assert status == 0, err
    assert out.startswith(usage), out[:500]
    for flag in own_flags:
        assert flag in out, (flag, out)


@pytest.mark.parametrize("module", ["tpurec.bench.__main__", "tpurec.sparse.planner.__main__"])
def test_python_dash_m_names_itself_in_help(module, capsys):
    import importlib

    status, out, _ = call(importlib.import_module(module).main, ["--help"], capsys)
    assert status == 0 and out.startswith(f"usage: python -m {module.removesuffix('.__main__')} "), out[:300]


@pytest.mark.parametrize(
    "argv, prog, message",
    [
        ([], "tpurec", "the following arguments are required: <command>"),
        (["nosuch"], "tpurec", "invalid choice: 'nosuch'"),
        (["bench"], "tpurec bench", "the following arguments are required: <command>"),
        (["bench", "nosuch"], "tpurec bench", "invalid choice: 'nosuch'"),
        (
            ["bench", "dlrm", "--batch-size", "0"],
            "tpurec bench dlrm",
            "argument --batch-size: must be a positive integer",
        ),
        # --batch, the benchmarks' earlier spelling, is still read (and checked).
        (["bench", "dlrm", "--batch", "0"], "tpurec bench dlrm", "argument --batch: must be a positive integer"),
        (["bench", "embeddings", "--dims", "x"], "tpurec bench embeddings", "argument --dims: not an integer: 'x'"),
    ],
)
def test_bad_command_line_exits_2_with_an_error_line(argv, prog, message, capsys):
    from tpurec.__main__ import main

    status, out, err = call(main, argv, capsys)
    assert status == 2 and not out, (status, out)
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"{prog}: error: ") and message in last, err


# The planner's own checks, in this process (cheap): one error line, exit status 2, nothing planned.
@pytest.mark.parametrize(
    "args, words",
    [
        (["--tables", "missing.json"], ["--tables missing.json", "FileNotFoundError"]),
        (["--tables", "README.md"], ["--tables README.md", "JSONDecodeError"]),
        (["--sharding-types", "table_wise,nosuch"], ["--sharding-types", "'nosuch'", "choose from"]),
        (["--slice-shape", "4x4x4"], ["--topology v5p-16", "slice_shape"]),
    ],
)
def test_planner_rejects_bad_input_with_one_line(args, words, capsys, tmp_path):
    argv = ["--topology", "v5p-16", "--tables", str(TABLES), "--batch-size", "64", "--json", str(tmp_path / "p.json")]
    for i in range(0, len(args), 2):  # replace or add each flag
        if args[i] in argv:
            argv[argv.index(args[i]) + 1] = args[i + 1]
        else:
            argv += args[i : i + 2]
    cwd = os.getcwd()
    os.chdir(ROOT)  # relative --tables paths as a user in the checkout types them
    try:
        rc = plan_main(argv, prog="tpurec plan")
    finally:
        os.chdir(cwd)
    out, err = capsys.readouterr()
    assert rc == 2 and not out, (rc, out)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tpurec plan: error: "), err
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize(
    "topology, batch_size, words",
    [
        ("v5p-128", "32", ["--batch-size 32 is smaller than the 64 devices of v5p-128", "at least 64"]),
        ("v5p-128", "100", ["--batch-size 100 does not split evenly over the 64 devices", "e.g. 64 or 128"]),
    ],
)
def test_planner_refuses_a_batch_the_devices_cannot_share(topology, batch_size, words, capsys):
    rc = plan_main(["--topology", topology, "--tables", str(TABLES), "--batch-size", batch_size], prog="tpurec plan")
    out, err = capsys.readouterr()
    assert rc == 2 and not out, (rc, out)
    (line,) = err.strip().splitlines()
    assert line.startswith("tpurec plan: error: "), line
    for word in words:
        assert word in line, (word, line)


BENCH_BATCH_DEFAULTS = {"dlrm": "2048", "embeddings": "2048", "modes": "[512, 4096]", "text": "4", "transformer": "8"}


@pytest.mark.parametrize("bench", sorted(BENCH_BATCH_DEFAULTS))
def test_benchmarks_spell_batch_size_as_the_planner_and_show_defaults(bench, capsys):
    from tpurec.bench.__main__ import main

    status, out, err = call(main, [bench, "--help"], capsys)
    assert status == 0, err
    assert "--batch-size" in out and "--batch " not in out and "--batch\n" not in out, out
    text = " ".join(out.split())  # help lines wrap at the terminal width
    assert f"(default: {BENCH_BATCH_DEFAULTS[bench]})" in text, text


# A concept several of tpurec's commands take: its one spelling, and the earlier spellings they still read.
SPELLINGS = {"--batch-size": ("--batch",), "--ids-per-bag": ("--pooling",)}


def _bench_names() -> list[str]:
    from tpurec.bench.__main__ import BENCHMARKS

    return sorted(BENCHMARKS)


@pytest.mark.parametrize("bench", _bench_names())
def test_benchmarks_show_one_spelling_per_concept(bench, capsys):
    from tpurec.bench.__main__ import main

    status, out, err = call(main, [bench, "--help"], capsys)
    assert status == 0, err
    shown = set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", out))
    for flag, old in SPELLINGS.items():
        assert not shown & set(old), (bench, flag, shown & set(old))


def test_ids_per_bag_is_one_spelling_in_dlrm_and_embeddings(capsys):
    from tpurec.bench.__main__ import main

    for bench in ("dlrm", "embeddings"):
        status, out, err = call(main, [bench, "--help"], capsys)
        assert status == 0 and "--ids-per-bag" in out, (bench, err)


def test_an_earlier_spelling_reads_into_the_same_value():
    import argparse

    from tpurec.cli import HelpFormatter, add_flag, positive_int

    parser = argparse.ArgumentParser(formatter_class=HelpFormatter)
    add_flag(parser, "--ids-per-bag", "--pooling", dest="ids_per_bag", help="ids per bag", type=positive_int,
             nargs="+", default=[1, 4])  # fmt: skip
    assert parser.parse_args([]).ids_per_bag == [1, 4]
    assert parser.parse_args(["--ids-per-bag", "2", "3"]).ids_per_bag == [2, 3]
    assert parser.parse_args(["--pooling", "2", "3"]).ids_per_bag == [2, 3]
    assert "--pooling" not in parser.format_help() and "(default: [1, 4])" in parser.format_help()


def test_plan_help_shows_defaults(capsys):
    status, out, _ = call(lambda argv: plan_main(argv, prog="tpurec plan"), ["--help"], capsys)
    text = " ".join(out.split())
    assert status == 0 and "(default: adagrad)" in text and "(default: 45)" in text, text


def test_batch_and_batch_size_read_the_same_value():
    import argparse

    from tpurec.cli import HelpFormatter, add_batch_size, positive_int

    parser = argparse.ArgumentParser(formatter_class=HelpFormatter)
    add_batch_size(parser, "samples per step", type=positive_int, default=2048)
    assert parser.parse_args([]).batch == 2048
    assert parser.parse_args(["--batch-size", "64"]).batch == 64
    assert parser.parse_args(["--batch", "64"]).batch == 64
    assert "--batch " not in parser.format_help() and "(default: 2048)" in parser.format_help()


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--batch-size", "0", "argument --batch-size: must be a positive integer, got '0'"),
        ("--slice-shape", "4xa", "argument --slice-shape: expected chips per axis joined by 'x'"),
        ("--reserved-hbm", "1.5", "argument --reserved-hbm: must be in [0, 1), got '1.5'"),
    ],
)
def test_planner_flag_values_are_checked_by_argparse(flag, value, message, capsys):
    argv = ["--topology", "v5p-16", "--tables", str(TABLES), "--batch-size", "64"]
    argv = argv[: argv.index(flag)] + argv[argv.index(flag) + 2 :] if flag in argv else argv
    with pytest.raises(SystemExit) as exit_info:
        plan_main([*argv, flag, value], prog="tpurec plan")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"tpurec plan: error: {message}")
