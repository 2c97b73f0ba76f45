"""The ``pagedtrace`` command: parse arguments, call one subcommand, print errors once.

Each subcommand is a module in ``pagedtrace.commands`` with ``add_parser(subparsers)``
(which sets ``func``) and ``run(args, console) -> int``. :func:`main` is the one place
that turns an exception into an exit code (:data:`EXIT_CODES`): errors the user can fix
derive from ``tracer.format.TraceError`` or :class:`UsageError` and are printed as one
line, never a traceback; anything else is a bug, printed as one line with a hint to
rerun with ``--debug``, which prints the traceback.

Everything printed here is a ``rich.text.Text``, never markup: an error message quotes
paths and trace strings, and ``[/x]`` or ``[link=...]`` in them must print as written.

Building the parser imports every command module, so those modules import only argparse,
rich and the torch-free bottom layer at their top; torch, libcst, jinja2 and vLLM are
imported inside ``run`` (``pagedtrace replay /no/such`` answers before torch loads).
``--quiet`` / ``--verbose`` and ``--debug`` are taken before or after the command; output
that is not a terminal is plain and full width (:mod:`pagedtrace.terminal`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from rich.console import Console
from rich.text import Text

from pagedtrace.terminal import make_console

#: Subcommand modules, in the order ``--help`` lists them.
COMMANDS = ("run", "replay", "backends", "annotate", "report", "diff", "show", "step", "export", "preset")

#: The exit codes of every command (README "The commands" and ``--help`` show this table).
EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXIT_CODES = {
    EXIT_OK: "ok",
    EXIT_MISMATCH: "a real mismatch (replay, or a --kernel check, found wrong output)",
    EXIT_USAGE: "bad input or usage: arguments, an unreadable trace, a file that cannot be written",
    EXIT_INTERNAL: "an internal error (a bug): one line; --debug prints the traceback",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


#: The subcommands' ``--help`` epilog (their descriptions are wrapped, so one sentence).
SHORT_EPILOG = "Exit codes: 0 ok, 1 a mismatch, 2 bad input or usage, 3 an internal error (rerun with --debug)."


def _epilog() -> str:
    rows = "\n".join(f"  {code:<4} {meaning}" for code, meaning in EXIT_CODES.items())
    return f"exit codes:\n{rows}"


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error: the usage of ``run`` alone is a dozen lines."""

    def error(self, message: str) -> NoReturn:
        """Print ``prog: error: message (usage: prog --help)`` to stderr and exit 2."""
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (usage: {self.prog} --help)\n")


def _add_common(parser: argparse.ArgumentParser, *, default: object) -> None:
    """``--debug``, ``--quiet``, ``--verbose``: on the top parser and again on every command."""
    parser.add_argument(
        "--debug", action="store_true", default=default, help="print the traceback of an error (for bug reports)"
    )
    loudness = parser.add_mutually_exclusive_group()
    loudness.add_argument(
        "-q", "--quiet", action="store_true", default=default, help="results and errors only (no progress, no logs)"
    )
    loudness.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=default,
        help="print more: every row of long tables, vLLM's INFO logs (on stderr)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser, one subparser per command module (no torch, libcst or vLLM imported)."""
    from pagedtrace import __version__

    parser = ArgumentParser(
        prog="pagedtrace",
        description="Trace vLLM's PagedAttention, replay it against a reference kernel, annotate and report.",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"pagedtrace {__version__}")
    _add_common(parser, default=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"pagedtrace.commands.{name}")
        module.add_parser(sub)
    for command in sub.choices.values():
        # Also after the command (`pagedtrace replay T --debug`); SUPPRESS keeps a flag
        # given before the command from being reset to False here.
        _add_common(command, default=argparse.SUPPRESS)
        if command.epilog is None:
            command.epilog = SHORT_EPILOG
    return parser


def print_error(console: Console, message: str) -> None:
    """``error: message`` on one line, the message printed literally (no markup, no emoji)."""
    console.print(Text.assemble(("error:", "bold red"), " ", message), soft_wrap=True, highlight=False)


def main(argv: Sequence[str] | None = None, console: Console | None = None) -> int:
    """Entry point; returns the process exit code (:data:`EXIT_CODES`), never raises."""
    from tracer.format import TraceError, first_line

    console = console or make_console()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: usage errors exit 2 (message on stderr), --help 0
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    debug = bool(getattr(args, "debug", False))
    try:
        return int(args.func(args, console))
    except (TraceError, UsageError, OSError) as exc:
        if debug:
            _print_traceback(console, exc)
        print_error(console, str(exc) or type(exc).__name__)
        return EXIT_USAGE
    except KeyboardInterrupt:
        console.print(Text("interrupted", style="yellow"))
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - the one place a bug becomes an exit code
        if debug:
            _print_traceback(console, exc)
        first = first_line(exc)
        hint = "" if debug else "; rerun with --debug for the traceback"
        print_error(console, f"internal error: {type(exc).__name__}: {first} (a bug in pagedtrace{hint})")
        return EXIT_INTERNAL


def _print_traceback(console: Console, exc: BaseException) -> None:
    # console.out: no markup, no emoji, no wrapping; the traceback quotes trace data too.
    console.out("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip(), highlight=False)


if __name__ == "__main__":
    sys.exit(main())
