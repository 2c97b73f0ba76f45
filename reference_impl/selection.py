"""Which records a replay takes: the steps and layers asked for, an even sample of them, and the
records whose legacy round trip runs.

Imports :mod:`tracer.format` (the bottom layer) only.
"""

from __future__ import annotations

from collections.abc import Iterable

from tracer.format import StepRecord, Trace, layer_matches, step_in_range

__all__ = ["fmt_range", "legacy_sample", "sample_records", "select_records"]


def _selected(
    record: StepRecord, steps: tuple[int | None, int | None] | None, layers: Iterable[str | int] | None
) -> bool:
    if steps is not None and not step_in_range(record.step, steps):
        return False
    return layers is None or layer_matches(record.layer, set(layers))


def select_records(
    trace: Trace,
    *,
    steps: tuple[int | None, int | None] | None = None,
    layers: Iterable[str | int] | None = None,
    kind: str | None = None,
) -> list[StepRecord]:
    """The records of ``trace`` in a half-open ``steps`` range, of the given ``layers`` and ``kind``.

    Args:
        steps: ``(start, stop)``, either end None = open; None = all.
        layers: layer names and/or indices (``model.layers.<i>...``); None = all.
        kind: a ``StepRecord.kind`` (``request`` ...); None = all.
    """
    layers = None if layers is None else tuple(layers)
    return [r for r in trace.records if (kind is None or r.kind == kind) and _selected(r, steps, layers)]


def legacy_sample(count: int, every: int) -> frozenset[int]:
    """Indices of the records (of ``count``) whose legacy round trip runs: the first, the last, every ``every``-th."""
    if count <= 0:
        return frozenset()
    return frozenset(range(0, count, max(1, every))) | {count - 1}


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


def fmt_range(steps: tuple[int | None, int | None] | None) -> str:
    """``steps`` as the command line writes it: ``START:STOP``, either end blank when open; ``all``."""
    if steps is None:
        return "all"
    start, stop = steps
    return f"{'' if start is None else start}:{'' if stop is None else stop}"
