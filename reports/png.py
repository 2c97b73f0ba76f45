"""A heat map as a PNG, written with the standard library (``zlib``, ``struct``): no imaging dependency.

The report's attention maps are grids of a few hundred cells a side, one colour a cell: an 8-bit RGB
PNG of one pixel a cell, scaled up by the browser (``image-rendering: pixelated``), is a few KiB where
an SVG rectangle a cell would be megabytes for a 7B-shaped prefill, and it needs no matplotlib or
Pillow (neither is a dependency of the report). PNG: one ``IHDR``, one ``IDAT`` (rows with filter
byte 0, deflated), one ``IEND``, each chunk with its CRC (RFC 2083).
"""

from __future__ import annotations

import base64
import struct
import zlib
from collections.abc import Sequence

__all__ = ["heat_png", "png_bytes", "png_data_uri", "ramp"]

#: The colour ramp, low to high: white, light blue, dark blue (read well on the report's white page).
_RAMP = ((255, 255, 255), (158, 202, 225), (8, 48, 107))


def ramp(value: float) -> tuple[int, int, int]:
    """The ramp's colour at ``value`` in ``[0, 1]`` (clamped), linear between its stops."""
    x = min(1.0, max(0.0, value)) * (len(_RAMP) - 1)
    i = min(int(x), len(_RAMP) - 2)
    f = x - i
    lo, hi = _RAMP[i], _RAMP[i + 1]
    return (round(lo[0] + f * (hi[0] - lo[0])), round(lo[1] + f * (hi[1] - lo[1])), round(lo[2] + f * (hi[2] - lo[2])))


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_bytes(pixels: Sequence[Sequence[tuple[int, int, int]]]) -> bytes:
    """An 8-bit RGB PNG of ``pixels[row][column]`` (every row the same length, at least one pixel)."""
    height, width = len(pixels), len(pixels[0])
    raw = b"".join(b"\x00" + bytes(c for px in row for c in px) for row in pixels)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit, RGB, deflate, no filter, no interlace
    return (
        b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b"")
    )


def png_data_uri(data: bytes) -> str:
    """``data:image/png;base64,...``: the image inside the page (a report is self-contained)."""
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def heat_png(values: Sequence[Sequence[float]], top: float) -> bytes:
    """``values[row][column]`` coloured by ``value / top`` on :func:`ramp` (``top <= 0``: all white)."""
    scale = 1.0 / top if top > 0 else 0.0
    return png_bytes([[ramp(v * scale) for v in row] for row in values])
