"""Step and layer selection: the ``--steps`` / ``--layers`` syntax, parsed once for every room.

``START:STOP`` step ranges are half-open and 0-based, as ``StepRecord.step``; layers are
named in full (``model.layers.7.self_attn.attn``) or by their index (``7``). The tracer
(``PAGEDTRACE_STEPS`` / ``PAGEDTRACE_LAYERS``), replay, the kernel checks and the CLI
all read selections through these functions.
"""

from __future__ import annotations

from collections.abc import Collection

__all__ = [
    "StepRange",
    "layer_index",
    "layer_matches",
    "parse_layers",
    "parse_steps",
    "step_in_range",
]

#: A half-open ``(start, stop)`` range of 0-based step indices; None leaves a side open.
StepRange = tuple[int | None, int | None]


def layer_index(name: str) -> int | None:
    """``model.layers.7.self_attn.attn`` -> 7 (the numbering ``--layers`` uses); None if no index."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def layer_matches(name: str, wanted: Collection[str | int]) -> bool:
    """``name`` is in ``wanted`` by full name or by its :func:`layer_index`."""
    index = layer_index(name)
    return name in wanted or (index is not None and index in wanted)


def step_in_range(step: int, steps: StepRange) -> bool:
    """``step`` lies in the half-open ``(start, stop)`` range; None leaves a side open."""
    start, stop = steps
    return (start is None or step >= start) and (stop is None or step < stop)


def parse_layers(text: str) -> str | tuple[str | int, ...]:
    """``first`` / ``all`` / ``0,3,model.layers.5.self_attn.attn`` -> the tracer's ``layers`` option.

    Indices become ints, names stay strings; a ``ValueError`` for an empty selection.
    """
    text = text.strip()
    if text in ("first", "all"):
        return text
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"bad layer selection {text!r}: use 'first', 'all' or indices/names")
    return tuple(int(t) if t.isdigit() else t for t in items)


def parse_steps(text: str) -> StepRange:
    """``'3:10'`` -> (3, 10); ``''`` or ``':'`` -> unbounded; ``'5'`` -> (5, 6).

    A ``ValueError`` for anything else.
    """
    text = text.strip()
    if not text or text == ":":
        return (None, None)
    try:
        if ":" not in text:
            return (int(text), int(text) + 1)
        a, b = text.split(":", 1)
        return (int(a) if a else None, int(b) if b else None)
    except ValueError:
        raise ValueError(f"bad step range {text!r}: use START:STOP (e.g. 0:100)") from None
