"""The bottom layer's one error type. Standard library only."""

from __future__ import annotations


class TraceError(Exception):
    """A trace cannot be written or read: bad version, truncated line, missing file, bad value."""
