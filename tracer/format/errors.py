"""The bottom layer's one error type, and how any error is said in one line. Standard library only."""

from __future__ import annotations


class TraceError(Exception):
    """A trace cannot be written or read: bad version, truncated line, missing file, bad value."""


def first_line(exc: BaseException, limit: int | None = None) -> str:
    """The first line of ``exc``'s message (at most ``limit`` characters; "" when it has none).

    Errors from vLLM and torch often carry a traceback or a table below their first line; a
    one-line message quotes this.
    """
    line = (str(exc).strip().splitlines() or [""])[0]
    return line if limit is None else line[:limit]
