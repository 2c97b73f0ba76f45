"""The bottom layer's one error type, and how any error is said in one line. Standard library only."""

from __future__ import annotations

#: Characters that would break a one-line message, as they are written instead.
_LINE_BREAKS = str.maketrans(
    {"\n": "\\n", "\r": "\\r", "\x0b": "\\v", "\x0c": "\\f", "\x85": "\\x85", "\u2028": "\\u2028", "\u2029": "\\u2029"}
)


class TraceError(Exception):
    """A trace cannot be written or read: bad version, truncated line, missing file, bad value.

    Its message is one line: a line break quoted from the trace (a tensor name holding a
    newline, say) is written as its escape, ``\\n``.
    """

    def __init__(self, message: object = "", *args: object) -> None:
        super().__init__(str(message).translate(_LINE_BREAKS), *args)


def first_line(exc: BaseException, limit: int | None = None) -> str:
    """The first line of ``exc``'s message (at most ``limit`` characters; "" when it has none).

    Errors from vLLM and torch often carry a traceback or a table below their first line; a
    one-line message quotes this.
    """
    line = (str(exc).strip().splitlines() or [""])[0]
    return line if limit is None else line[:limit]
