"""One metadata check's findings on one record, collected into a :class:`MetadataCheck`.

The metadata checks (:mod:`tracer.format.metadata`) and the tensor-parallel ranks check
(:mod:`tracer.format.ranks`) each fill a :class:`Findings` and end with :meth:`Findings.done`.
Standard library only.
"""

from __future__ import annotations

from tracer.format.records import StepRecord
from tracer.format.verdicts import MAX_PROBLEMS, MetadataCheck, MetadataProblem

__all__ = ["Findings"]


class Findings:
    """Collects one check's problems on one record; :meth:`done` makes its :class:`MetadataCheck`.

    ``count`` counts every problem, ``problems`` keeps the first :data:`MAX_PROBLEMS`;
    ``checked`` is what the check adds up as it compares (tokens, rows, blocks, flags).
    """

    def __init__(self, record: StepRecord, check: str):
        self.record, self.check = record, check
        self.problems: list[MetadataProblem] = []
        self.count = 0
        self.checked = 0

    def add(self, message: str, row: int | None = None, position: int | None = None, token: int | None = None):
        """One problem: what differed, and where (block-table row, token position, query token)."""
        self.count += 1
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(MetadataProblem(message, row, position, token))

    def done(self, note: str = "") -> MetadataCheck:
        """The check's record: ok when no problem was added; ``note``: what could not be compared."""
        r = self.record
        return MetadataCheck(
            step=r.step,
            layer=r.layer,
            kind=r.kind,
            check=self.check,
            ok=self.count == 0,
            checked=self.checked,
            num_problems=self.count,
            problems=tuple(self.problems),
            note=note,
        )
