"""Step and layer selection: the ``--steps`` / ``--layers`` syntax, parsed once for every room.

``START:STOP`` step ranges are half-open and 0-based, as ``StepRecord.step``; layers are
named in full (``model.layers.7.self_attn.attn``), by their index (``7``) or as the CLI's
tables print them (``L7``). The tracer
(``PAGEDTRACE_STEPS`` / ``PAGEDTRACE_LAYERS``), replay, the kernel checks and the CLI
all read selections through these functions.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tracer.format.records import StepRecord
    from tracer.format.store import Trace

__all__ = [
    "StepRange",
    "check_steps",
    "format_steps",
    "layer_index",
    "layer_matches",
    "parse_layer",
    "parse_layers",
    "parse_steps",
    "sample_records",
    "select_records",
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
    return tuple(parse_layer(t) for t in items)


def parse_layer(text: str) -> str | int:
    """One layer: ``7`` or ``L7`` (as the tables print it) -> 7; a name stays a string."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    if text[:1] in ("L", "l") and text[1:].isdigit():
        return int(text[1:])
    return text


def parse_steps(text: str) -> StepRange:
    """``'3:10'`` -> (3, 10); ``''`` or ``':'`` -> unbounded; ``'5'`` -> (5, 6).

    A ``ValueError`` for anything else, and for a range that selects nothing (``5:2``, ``3:3``)
    or a negative index: such a selection is always a typo, never a wish for an empty trace.
    """
    text = text.strip()
    if not text or text == ":":
        return (None, None)
    start: int | None
    stop: int | None
    try:
        if ":" not in text:
            start, stop = int(text), int(text) + 1
        else:
            a, b = text.split(":", 1)
            start, stop = (int(a) if a else None, int(b) if b else None)
    except ValueError:
        raise ValueError(f"bad step range {text!r}: use START:STOP (e.g. 0:100)") from None
    check_steps((start, stop), text)
    return (start, stop)


def check_steps(steps: StepRange, text: str | None = None) -> None:
    """A ``ValueError`` unless ``steps`` is a non-empty range of non-negative step indices."""
    start, stop = steps
    shown = text if text is not None else format_steps(steps)
    if (start is not None and start < 0) or (stop is not None and stop < 0):
        raise ValueError(f"bad step range {shown!r}: step indices start at 0")
    if start is not None and stop is not None and stop <= start:
        raise ValueError(f"bad step range {shown!r}: STOP ({stop}) must be greater than START ({start}) (half-open)")


def format_steps(steps: StepRange) -> str:
    """``steps`` as ``--steps`` writes it (:func:`parse_steps`' inverse): ``START:STOP``, an open end blank."""
    start, stop = steps
    return f"{'' if start is None else start}:{'' if stop is None else stop}"


def select_records(
    trace: Trace,
    *,
    steps: StepRange | None = None,
    layers: Iterable[str | int] | None = None,
    kind: str | None = None,
) -> list[StepRecord]:
    """The records of ``trace`` in a half-open ``steps`` range, of the given ``layers`` and ``kind``.

    Args:
        steps: ``(start, stop)``, either end None = open; None = all.
        layers: layer names and/or indices (``model.layers.<i>...``); None = all.
        kind: a ``StepRecord.kind`` (``request`` ...); None = all.
    """
    wanted = None if layers is None else set(layers)
    return [
        r
        for r in trace.records
        if (kind is None or r.kind == kind)
        and (steps is None or step_in_range(r.step, steps))
        and (wanted is None or layer_matches(r.layer, wanted))
    ]


def sample_records(records: list[StepRecord], count: int) -> list[StepRecord]:
    """``count`` of ``records`` spread evenly over them, the first and the last included; all if fewer.

    Reproducible: the same records for the same inputs (no randomness).
    """
    if count <= 0:
        raise ValueError(f"sample {count}: expected a positive number of steps")
    if count >= len(records):
        return list(records)
    if count == 1:
        return [records[0]]
    picks = sorted({round(i * (len(records) - 1) / (count - 1)) for i in range(count)})
    return [records[i] for i in picks]
