"""The ``pagedtrace`` command: parse arguments, call one subcommand, print errors once.

Each subcommand is a module in ``pagedtrace.commands`` with ``add_parser(subparsers)``
(which sets ``func``) and ``run(args, console) -> int``. :func:`main` is the one place
that turns an exception into an exit code (:data:`EXIT_CODES`): errors the user can fix
derive from ``tracer.format.TraceError`` or :class:`UsageError` and are printed as one
line, never a traceback; anything else is a bug, printed as one line with a hint to
rerun with ``--debug``, which prints the traceback.

Results go to stdout, errors and diagnostics to stderr (:mod:`pagedtrace.terminal`), with
``--json`` too: stdout then holds the JSON document and nothing else, and an error is one
``error: ...`` line on stderr. A reader that closes the pipe early (``| head -1``) ends the
command quietly with :data:`EXIT_PIPE`, as a shell reports a command killed by SIGPIPE.

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
import os
import sys
import traceback
import warnings
from collections.abc import Sequence
from typing import NoReturn

from rich.console import Console
from rich.text import Text

from pagedtrace.terminal import make_console

#: Subcommand modules, in the order ``--help`` lists them.
COMMANDS = (
    "run",
    "replay",
    "backends",
    "annotate",
    "report",
    "diff",
    "show",
    "step",
    "attention",
    "export",
    "preset",
)

#: The exit codes of every command (README "The commands" and ``--help`` show this table).
EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_PIPE = 0, 1, 2, 3, 130, 141
EXIT_CODES = {
    EXIT_OK: "ok",
    EXIT_MISMATCH: "a real mismatch (replay, or a --kernel check, found wrong output)",
    EXIT_USAGE: "bad input or usage: arguments, an unreadable trace, a file that cannot be written",
    EXIT_INTERNAL: "an internal error (a bug): one line; --debug prints the traceback",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
    EXIT_PIPE: "stdout was closed early (| head): nothing printed on stderr, as 128 + SIGPIPE",
}


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


#: The subcommands' ``--help`` epilog (their descriptions are wrapped, so one sentence).
SHORT_EPILOG = (
    "Exit codes: 0 ok, 1 a mismatch, 2 bad input or usage, 3 an internal error (rerun with --debug), "
    "130 interrupted, 141 stdout closed early."
)


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


def command_line(name: str, *positionals: str, **options: object) -> str:
    """``pagedtrace NAME POSITIONALS --option VALUE ...`` as a shell line, spelled by the parser itself.

    ``options`` are keyed by their ``dest`` (``step=5``; ``True`` for a flag); each is written
    with the command's own long option string, and the whole line must parse (a ``ValueError``
    if the parser would refuse it). The report's tour prints its commands through this.
    """
    import shlex

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    command = sub.choices[name]
    argv = [*positionals]
    for dest, value in options.items():
        action = next((a for a in command._actions if a.dest == dest and a.option_strings), None)
        if action is None:
            raise ValueError(f"pagedtrace {name} has no option for {dest!r}")
        flag = max(action.option_strings, key=len)
        argv += [flag] if value is True else [flag, str(value)]
    try:
        command.parse_args(argv)
    except SystemExit:
        raise ValueError(f"pagedtrace {name} refuses {argv}") from None
    return shlex.join(["pagedtrace", name, *argv])


def print_error(console: Console, message: str) -> None:
    """``error: message`` on one line, the message printed literally (no markup, no emoji)."""
    console.print(Text.assemble(("error:", "bold red"), " ", message), soft_wrap=True, highlight=False)


def main(argv: Sequence[str] | None = None, console: Console | None = None, errors: Console | None = None) -> int:
    """Entry point; returns the process exit code (:data:`EXIT_CODES`), never raises.

    ``console`` takes the results (default: stdout), ``errors`` the errors and the
    tracebacks of ``--debug`` (default: stderr).
    """
    from tracer.format import TraceError, first_line

    errors = errors or make_console(stderr=True)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: usage errors exit 2 (message on stderr), --help 0
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    console = console or make_console(wide=bool(getattr(args, "verbose", False)))
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    debug = bool(getattr(args, "debug", False))
    if getattr(args, "quiet", False):
        # --quiet: results and errors only; torch's and vLLM's Python warnings are neither
        # (PYTHONWARNINGS reaches the engine's child processes too).
        warnings.simplefilter("ignore")
        os.environ["PYTHONWARNINGS"] = "ignore"
    try:
        return int(args.func(args, console))
    except BrokenPipeError:
        return _closed_pipe()
    except (TraceError, UsageError, OSError) as exc:
        if debug:
            _print_traceback(errors, exc)
        print_error(errors, str(exc) or type(exc).__name__)
        return EXIT_USAGE
    except KeyboardInterrupt:
        errors.print(Text("interrupted", style="yellow"))
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - the one place a bug becomes an exit code
        if debug:
            _print_traceback(errors, exc)
        first = first_line(exc)
        hint = "" if debug else "; rerun with --debug for the traceback"
        print_error(errors, f"internal error: {type(exc).__name__}: {first} (a bug in pagedtrace{hint})")
        return EXIT_INTERNAL


def _closed_pipe() -> int:
    """The reader of stdout is gone: point stdout at /dev/null (the flush at exit would fail again)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout is no file (a test's buffer): nothing to flush
        pass
    return EXIT_PIPE


def _print_traceback(console: Console, exc: BaseException) -> None:
    # console.out: no markup, no emoji, no wrapping; the traceback quotes trace data too.
    console.out("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip(), highlight=False)


if __name__ == "__main__":
    sys.exit(main())
