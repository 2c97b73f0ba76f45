"""Reading a trace's files as untrusted input: regular files only, bounded sizes, clear errors.

Every file of a trace is read through :func:`open_regular`: a symbolic link, a FIFO, a
device or a directory where a file should be is a ``TraceError``, checked with ``lstat``
before opening (opening a FIFO would block forever) and again on the open descriptor
(``O_NOFOLLOW | O_NONBLOCK``), so nothing swapped in between is read either. What is read
is bounded (:data:`MAX_MANIFEST_BYTES` and the rest); undecodable bytes, deep nesting and
numbers past Python's digit limit are ``TraceError`` too.

Standard library only.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

from tracer.format.decode import check_json_text
from tracer.format.errors import TraceError

__all__ = [
    "MAX_LINE_BYTES",
    "MAX_MANIFEST_BYTES",
    "MAX_SIDE_FILE_BYTES",
    "MAX_SOURCE_BYTES",
    "is_present",
    "open_regular",
    "parse_json",
    "read_bytes",
    "read_json_file",
]

#: ``manifest.json``: a real one is a few KiB.
MAX_MANIFEST_BYTES = 16 << 20
#: One line of ``steps.jsonl`` (a step of 65,536 requests with long block tables fits).
MAX_LINE_BYTES = 32 << 20
#: One stored vLLM source file (vLLM's largest are ~200 KiB).
MAX_SOURCE_BYTES = 16 << 20
#: A side file (``session.json``, ``replay.json``).
MAX_SIDE_FILE_BYTES = 256 << 20

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symbolic link"),
)


def _not_regular(path: Path, mode: int) -> TraceError:
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    if stat.S_ISLNK(mode):
        return TraceError(f"{path}: a symbolic link inside the trace; refusing to follow it")
    return TraceError(f"{path}: {kind}, not a regular file; a trace holds only regular files")


def is_present(path: Path) -> bool:
    """True if ``path`` is a regular file; False if nothing is there; ``TraceError`` for anything else."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        raise _not_regular(path, mode)
    return True


def open_regular(path: Path) -> BinaryIO | None:
    """Open a trace file for binary reading; None if it does not exist.

    Raises:
        TraceError: ``path`` is a link, FIFO, device, directory or socket, or cannot be read.
    """
    if not is_present(path):
        return None
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise TraceError(f"{path}: cannot open: {exc.strerror or exc}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # swapped after the lstat
        os.close(fd)
        raise _not_regular(path, mode)
    return os.fdopen(fd, "rb")


def read_bytes(path: Path, limit: int, what: str) -> bytes | None:
    """At most ``limit`` bytes of a regular file (more is a ``TraceError``); None if absent."""
    f = open_regular(path)
    if f is None:
        return None
    with f:
        try:
            data = f.read(limit + 1)
        except OSError as exc:
            raise TraceError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise TraceError(f"{path}: larger than {limit:,} bytes, the limit for {what}")
    return data


def parse_json(data: bytes | str, where: str = "") -> Any:
    """Parse JSON text; every way it can fail is a one-line ``TraceError`` naming ``where`` (if given)."""
    at = f"{where}: " if where else ""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as exc:
        raise TraceError(f"{at}not UTF-8 text (byte {exc.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        detail = f"{exc.msg} at line {exc.lineno} column {exc.colno}"
        raise TraceError(f"{at}truncated or malformed: not valid JSON ({detail})") from None
    except ValueError as exc:  # ints past sys.get_int_max_str_digits()
        raise TraceError(f"{at}a number too long to read ({str(exc).split(';')[0]})") from None
    except RecursionError:
        raise TraceError(f"{at}JSON nested too deeply") from None


def read_json_file(path: Path, limit: int, what: str) -> Any | None:
    """A whole JSON file (regular, at most ``limit`` bytes, valid Unicode strings); None if absent."""
    data = read_bytes(path, limit, what)
    if data is None:
        return None
    value = parse_json(data, str(path))
    check_json_text(value, str(path))
    return value
