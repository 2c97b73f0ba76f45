"""The ``pagedtrace`` command: parse arguments, call one subcommand, print errors once.

Each subcommand is a module in ``pagedtrace.commands`` with ``add_parser(subparsers)``
(which sets ``func``) and ``run(args, console) -> int``. Errors the user can fix
derive from ``tracer.format.TraceError`` or ``pagedtrace.cli.UsageError`` and are
printed as one line, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from rich.console import Console

#: Subcommand modules, in the order ``--help`` lists them.
COMMANDS = ("run", "replay", "annotate", "report")


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser, one subparser per command module."""
    from pagedtrace import __version__

    parser = argparse.ArgumentParser(
        prog="pagedtrace",
        description="Trace vLLM's PagedAttention, replay it against a reference kernel, annotate and report.",
    )
    parser.add_argument("--version", action="version", version=f"pagedtrace {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"pagedtrace.commands.{name}")
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None, console: Console | None = None) -> int:
    """Entry point; returns the process exit code."""
    from tracer.format import TraceError

    console = console or Console()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args, console))
    except (TraceError, UsageError) as exc:
        console.print(f"[bold red]error:[/] {exc}", highlight=False)
        return 2
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130


if __name__ == "__main__":
    sys.exit(main())
