"""``steps.jsonl`` lines for the writer thread: msgspec's JSON encoder where it writes the same values.

The writer thread holds the GIL while it encodes a record, and in a CPU-bound graph mode
(PIECEWISE) that time comes out of the engine's step. ``msgspec`` (a dependency of vLLM, so
present wherever the tracer runs) encodes a 32-request decode record in about 9 µs where
``json.dumps`` takes about 110 µs. Its text differs only in spelling (``1e-05`` is ``0.00001``,
no spaces); every value reads back the same. Two things it writes differently, so those records
go through ``json`` as before: a non-finite float (msgspec writes ``null``, json ``NaN``) and a
string that is not valid Unicode (msgspec refuses it).
"""

from __future__ import annotations

import json
import math
import typing
from typing import Any

from tracer.format import StepRecord

__all__ = ["encode_line"]

try:
    import msgspec

    _ENCODER: Any = msgspec.json.Encoder()
except ImportError:  # pragma: no cover - vLLM requires msgspec
    _ENCODER = None


def encode_line(obj: dict[str, Any]) -> str:
    """One ``steps.jsonl`` line (no newline), as ``json.dumps(obj, separators=(",", ":"))`` reads back.

    ``obj``: ``record_to_json`` of a step or gap record; anything else goes through ``json``.
    """
    if _ENCODER is not None and obj.get("type") in ("step", "gap") and _finite(obj):
        try:
            return _ENCODER.encode(obj).decode("utf-8")
        except (UnicodeEncodeError, OverflowError, TypeError):
            pass
    return json.dumps(obj, separators=(",", ":"))


#: The keys of a ``StepRecord``'s JSON that can hold a float (a float, or a tuple of them);
#: every other value of a step or gap line is an int, a string, a bool, None or a tuple of those.
FLOAT_KEYS = tuple(sorted(name for name, hint in typing.get_type_hints(StepRecord).items() if "float" in str(hint)))


def _finite(line: dict[str, Any]) -> bool:
    """No float of a step or gap line (its :data:`FLOAT_KEYS`) is NaN or infinite."""
    for key in FLOAT_KEYS:
        value = line.get(key)
        if isinstance(value, float):
            if not math.isfinite(value):
                return False
        elif isinstance(value, (tuple, list)) and not all(math.isfinite(x) for x in value if isinstance(x, float)):
            return False
    return True
