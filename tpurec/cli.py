"""Shared pieces of tpurec's command lines (``tpurec``, ``python -m tpurec.bench``, the planner).

A command with subcommands hands ``argv[1:]`` to the subcommand's own ``main(argv, prog=...)``, so
that ``<command> <sub> --help`` shows the subcommand's flags; only ``--help`` and a missing or
unknown subcommand reach the command's own parser. Bad input ends in argparse's way, a
``<prog>: error: ...`` line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Sequence


@dataclass(frozen=True)
class Subcommand:
    """A subcommand: the module whose ``main(argv, prog=...)`` runs it, and a one-line help."""

    module: str
    help: str


def run_subcommand(
    prog: str,
    description: str,
    commands: Mapping[str, Subcommand],
    argv: Sequence[str],
    version: str | None = None,
) -> Any:
    """Runs ``argv[0]``'s subcommand with the rest of ``argv``; returns what its ``main`` returns.

    Args:
        prog: the command as the user types it (``"tpurec"``), shown in help and errors.
        description: the command's help text.
        commands: subcommand name -> where it lives.
        argv: the arguments after ``prog``.
        version: if given, ``--version`` prints it.

    Raises:
        SystemExit: 0 after ``--help`` or ``--version``; 2 for a missing or unknown subcommand (one error line).
    """
    argv = list(argv)
    if argv and argv[0] in commands:
        # Dispatch before any parsing here: a --help after the name belongs to the subcommand.
        module = importlib.import_module(commands[argv[0]].module)
        return module.main(argv[1:], prog=f"{prog} {argv[0]}")
    parser = argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter)
    if version is not None:
        parser.add_argument("--version", action="version", version=f"%(prog)s {version}")
    sub = parser.add_subparsers(title="commands", dest="command", metavar="<command>", required=True)
    for name, command in commands.items():
        sub.add_parser(name, help=command.help, add_help=False)
    args, rest = parser.parse_known_args(argv)  # exits unless argv names a command (after "--", say)
    module = importlib.import_module(commands[args.command].module)
    return module.main(rest, prog=f"{prog} {args.command}")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help`` of tpurec's commands: each flag's default after its help, the description's line breaks kept."""


def add_batch_size(parser: argparse.ArgumentParser, help: str, **kwargs: Any) -> None:
    """Adds ``--batch-size`` (into ``args.batch``), the one spelling of a batch size in tpurec's commands.

    ``--batch``, the earlier spelling of the benchmarks, stays accepted and is left out of ``--help``.

    Args:
        parser: the command's parser.
        help: what the batch size is (per step, per device...).
        kwargs: ``type``, ``nargs``, ``default`` as for ``add_argument``.
    """
    add_flag(parser, "--batch-size", "--batch", dest="batch", help=help, **kwargs)


def add_flag(parser: argparse.ArgumentParser, flag: str, *old: str, dest: str, help: str, **kwargs: Any) -> None:
    """Adds ``flag``, and earlier spellings of it that stay accepted without showing in ``--help``.

    One concept has one spelling across tpurec's commands (``--batch-size``, ``--ids-per-bag``); a
    command that spelled it otherwise keeps taking its old spelling into the same ``dest``.

    Args:
        parser: the command's parser.
        flag: the spelling ``--help`` shows.
        old: earlier spellings, read into ``dest`` too.
        dest: the attribute of the parsed arguments.
        help: the flag's help text.
        kwargs: ``type``, ``nargs``, ``default``, ``metavar`` as for ``add_argument``.
    """
    parser.add_argument(flag, dest=dest, help=help, **kwargs)
    alias = {k: v for k, v in kwargs.items() if k in ("type", "nargs", "metavar")}
    for spelling in old:
        parser.add_argument(spelling, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **alias)


def error(prog: str, message: str) -> int:
    """Reports bad input as argparse does, ``<prog>: error: <message>`` on stderr; returns 2.

    Args:
        prog: the command as typed (``"tpurec plan"``).
        message: what was wrong and what to do (its lines are joined, so the error stays one line).

    Returns:
        2, the exit status for bad input.
    """
    line = " ".join(part.strip() for part in str(message).splitlines() if part.strip()) or "invalid input"
    print(f"{prog}: error: {line}", file=sys.stderr)
    return 2


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer >= 1.

    Args:
        text: the flag's value as typed.

    Raises:
        argparse.ArgumentTypeError: not an integer, or below 1.
    """
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An argparse ``type``: an integer >= 0.

    Args:
        text: the flag's value as typed.

    Raises:
        argparse.ArgumentTypeError: not an integer, or negative.
    """
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
