"""Replay verdicts, ready to print: ``replay.json`` read through the bottom layer's records.

``ReplayReport.from_json`` does the parsing and the checking; this module only
turns its typed results into short texts and statuses for the pages. A missing
``replay.json`` means "not replayed"; a malformed one too, with the error text
listed among the index's problems.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from annotations.values import fmt_list
from reports.common import Row, Verdict
from tracer.format import REPLAY, ReplayReport, StepResult, Trace, TraceError


@dataclass(frozen=True)
class HeadVerdict:
    """One head's replay result."""

    head: int
    status: str  #: ``ok`` / ``fail`` / ``none``
    max_abs: str


@dataclass(frozen=True)
class LayerVerdict:
    """One (step, layer)'s replay result."""

    layer: str
    verdict: Verdict
    max_abs: str
    max_rel: str
    tol: str
    heads: tuple[HeadVerdict, ...]


@dataclass(frozen=True)
class ReplayData:
    """``replay.json`` as the pages show it."""

    present: bool
    overall: Verdict
    by_step: dict[int, list[StepResult]]  #: step -> its results, one per replayed layer
    checks: tuple[Row, ...]  #: one row per section besides ``steps`` (``write_path``, ``legacy``)
    problem: str = ""  #: why the file could not be used, if it could not


#: The verdict of a trace without a (usable) ``replay.json``.
NOT_REPLAYED = Verdict("none", "not replayed")


def _num(value: float) -> str:
    # Non-finite errors were written as null and read back as NaN: shown as a dash.
    return f"{value:.3g}" if math.isfinite(value) else "–"


def _status(ok: bool) -> str:
    return "ok" if ok else "fail"


def read_replay(trace: Trace) -> ReplayData:
    """Read ``replay.json`` if present; a missing or malformed file means "not replayed"."""
    try:
        data = trace.read_json(REPLAY)
        report = None if data is None else ReplayReport.from_json(data)
    except TraceError as exc:
        return ReplayData(False, NOT_REPLAYED, {}, (), str(exc))
    if report is None:
        return ReplayData(False, NOT_REPLAYED, {}, ())
    checks = tuple(
        Row(name, f"{sum(c.ok for c in results)} of {len(results)} ok" if results else "none")
        for name, results in report.sections()
        if name != "steps"
    )
    overall = Verdict("ok", "all replayed steps agree") if report.ok else Verdict("fail", "some steps disagree")
    return ReplayData(True, overall, report.by_step(), checks)


def step_verdict(results: Sequence[StepResult]) -> Verdict:
    """Aggregate the (layer) results of one step into one verdict."""
    if not results:
        return NOT_REPLAYED
    # A NaN error (non-finite in the file) never counts as the worst: it has no number to show.
    worst = max(results, key=lambda r: r.max_abs if math.isfinite(r.max_abs) else -1)
    detail = f"max abs {_num(worst.max_abs)}"
    if all(r.ok for r in results):
        return Verdict("ok", f"ok ({detail})")
    bad_heads = sorted({h for r in results for h in r.bad_heads})
    heads = f", heads {fmt_list(bad_heads, 8)}" if bad_heads else ""
    return Verdict("fail", f"FAIL ({detail}{heads})")


def layer_verdicts(results: Sequence[StepResult]) -> tuple[LayerVerdict, ...]:
    """Per layer: verdict and per-head results, for a step page."""
    return tuple(
        LayerVerdict(
            r.layer,
            step_verdict([r]),
            _num(r.max_abs),
            _num(r.max_rel),
            _num(r.tol),
            tuple(HeadVerdict(h.head, _status(h.ok), _num(h.max_abs)) for h in r.heads),
        )
        for r in results
    )
