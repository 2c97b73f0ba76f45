"""The CLI's terminal habits: results on stdout, diagnostics on stderr, plain lines when piped.

The output contract of every command (README "Output"): results go to stdout (the console a
command is given); errors, warnings, progress and logs go to stderr (:func:`make_console`
with ``stderr=True``, or :func:`warn`). A terminal gets rich's usual output at its own
width. Anything else (``| less``, ``> file``, a subprocess pipe) gets plain lines of their
natural width: no colours, no padding (:class:`PlainFile`), no time or source location on log
lines; rich lays out at :data:`PIPED_WIDTH` there, so tables keep every column whole instead
of falling to rich's 80-column default and cutting values to ``8…``.

Long tables are shortened to their first and last rows around one "… N more" row
(:func:`elide`), unless ``--verbose`` asks for all of them.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Generic, TypeVar

from rich.console import Console
from rich.table import Table
from rich.text import Text

#: Width rich lays out at when output does not go to a terminal: tables wrap their cells
#: within it. Lines are as long as their text (:class:`PlainFile` drops the padding).
PIPED_WIDTH = 200
#: The same with ``--verbose``: wide enough that no table wraps or shrinks a column.
WIDE_PIPED_WIDTH = 10_000

#: Rows a long table keeps without ``--verbose`` (the first ones and a few of the last).
MAX_TABLE_ROWS = 20
#: Of :data:`MAX_TABLE_ROWS`, the rows kept from the end.
TAIL_ROWS = 5

#: ``args.verbosity``: ``--quiet``, neither, ``--verbose``.
QUIET, NORMAL, VERBOSE = -1, 0, 1

T = TypeVar("T")


_TRAILING = re.compile(r"[ \t]+(?=\n)")


class PlainFile:
    """A text stream that drops the spaces rich pads table rows with before each newline.

    Off a terminal rich writes no escape codes, so the padding is all that ends a line with
    blanks; a file or a pager then holds the text as typed.
    """

    def __init__(self, stream: IO[str]):
        self.stream = stream

    def write(self, text: str) -> int:
        """Write ``text`` without trailing blanks on its lines."""
        return self.stream.write(_TRAILING.sub("", text))

    def flush(self) -> None:
        """Flush the stream."""
        self.stream.flush()

    def isatty(self) -> bool:
        """False: this wraps only streams that are not terminals."""
        return False

    @property
    def encoding(self) -> str:
        """The stream's encoding (rich asks, to choose box characters)."""
        return getattr(self.stream, "encoding", None) or "utf-8"


class _Console(Console):
    """rich's console, except that a closed pipe raises ``BrokenPipeError`` for ``main`` to answer.

    rich's own answer is ``SystemExit(1)``, the exit code of a mismatch.
    """

    def on_broken_pipe(self) -> None:
        """Stop writing, and let the caller decide (``pagedtrace.cli.EXIT_PIPE``)."""
        self.quiet = True
        raise BrokenPipeError


def make_console(*, stderr: bool = False, wide: bool = False) -> Console:
    """A console for stdout (or stderr): the terminal's width on a terminal, plain lines off one.

    Off a terminal: laid out :data:`PIPED_WIDTH` wide (``wide``, for ``--verbose``:
    :data:`WIDE_PIPED_WIDTH`, so that long tables keep every row on one line; ``COLUMNS`` is
    ignored on purpose), no colours, no trailing blanks (:class:`PlainFile`), and
    ``console.log`` lines without the time and the caller's file and line (rich pads a log
    line out to the width to right-align its location).
    """
    console = _Console(stderr=stderr)
    if console.is_terminal:
        return console
    plain = PlainFile(sys.stderr if stderr else sys.stdout)
    width = WIDE_PIPED_WIDTH if wide else PIPED_WIDTH
    # write/flush/isatty suffice for rich
    return _Console(file=plain, width=width, log_time=False, log_path=False)  # type: ignore[arg-type]


def warn(message: str | Text) -> None:
    """``warning: message`` on stderr, one line, the message printed literally (no markup)."""
    text = message if isinstance(message, Text) else Text(message)
    make_console(stderr=True).print(Text.assemble(("warning:", "yellow"), " ", text), soft_wrap=True, highlight=False)


def verbosity(args: argparse.Namespace) -> int:
    """:data:`QUIET`, :data:`NORMAL` or :data:`VERBOSE`, from ``--quiet`` / ``--verbose``."""
    if getattr(args, "quiet", False):
        return QUIET
    return VERBOSE if getattr(args, "verbose", False) else NORMAL


def row_limit(args: argparse.Namespace) -> int | None:
    """Rows a long table may print: None (all of them) with ``--verbose``."""
    return None if verbosity(args) == VERBOSE else MAX_TABLE_ROWS


@dataclass(frozen=True)
class Elided(Generic[T]):
    """Stands for ``count`` rows left out of a table, where they were."""

    count: int


def elide(rows: Sequence[T], limit: int | None, *, tail: int = TAIL_ROWS) -> list[T | Elided[T]]:
    """``rows`` if at most ``limit``, else the first ``limit - tail``, an :class:`Elided`, the last ``tail``.

    ``limit=None`` keeps every row. A table prints the marker as ``… N more <things>``.
    """
    if limit is None or len(rows) <= limit:
        return list(rows)
    tail = min(tail, max(limit - 1, 0))
    head = limit - tail
    return [*rows[:head], Elided(len(rows) - head - tail), *rows[len(rows) - tail :]]


def count_elided(table: Table, count: int) -> None:
    """Say under the table how many ok rows its "…" rows stand for (the columns do not wrap)."""
    before = int(table.caption.plain.split()[1]) if isinstance(table.caption, Text) else 0
    table.caption = Text(f"… {before + count} more (step, layer) rows, all ok (--verbose shows them)", style="dim")


def elide_passing(rows: list, limit: int | None, ok) -> list:
    """:func:`elide` that never hides a failing row (``ok(row)`` false): the ok rows between are counted."""
    if limit is None or len(rows) <= limit:
        return list(rows)
    shown = {id(x) for x in elide(rows, limit)}
    out: list = []
    for row in rows:
        if id(row) in shown or not ok(row):
            out.append(row)
        elif out and isinstance(out[-1], Elided):
            out[-1] = Elided(out[-1].count + 1)
        else:
            out.append(Elided(1))
    return out
