"""Replay verdicts, ready to print: ``replay.json`` read through the bottom layer's records.

``ReplayReport.from_json`` does the parsing and the checking; this module only
turns its typed results into short texts and statuses for the pages. A missing
``replay.json`` means "not replayed"; a malformed one too, with the error text
listed among the index's problems.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from annotations.values import fmt_list
from reports.common import Row, Verdict
from tracer.format import REPLAY, MetadataCheck, ReplayReport, StepResult, Trace, TraceError


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
    note: str = ""  #: replay's note on the step (e.g. ``query rows kept: 8 of 9800, ...``), or ""


@dataclass(frozen=True)
class ReplayData:
    """``replay.json`` as the pages show it."""

    present: bool
    overall: Verdict
    by_step: dict[int, list[StepResult]]  #: step -> its results, one per replayed layer
    checks: tuple[Row, ...]  #: one row per section besides ``steps`` (``write_path``, ``legacy``)
    problem: str = ""  #: why the file could not be used, if it could not
    #: step -> its metadata checks (every layer), from ``replay.json``'s ``metadata`` section
    metadata_by_step: dict[int, list[MetadataCheck]] = field(default_factory=dict)
    origin: str = "replay.json"  #: where the verdicts come from, as the pages name it


#: The verdict of a trace without a (usable) ``replay.json``.
NOT_REPLAYED = Verdict("none", "not replayed")
#: The metadata verdict of a step nothing checked (no KV-cache spec in the manifest).
NOT_CHECKED = Verdict("none", "not checked")


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
    return replay_data(report)


#: ``ReplayData.origin`` of verdicts ``pagedtrace report --replay`` computed (nothing written into the trace).
IN_MEMORY = "a replay run by pagedtrace report --replay (not saved in the trace)"


def replay_data(report: ReplayReport, origin: str = "replay.json") -> ReplayData:
    """The pages' view of a replay result: ``replay.json``'s, or one computed in memory (``origin``)."""
    checks = tuple(
        Row(name, f"{sum(c.ok for c in results)} of {len(results)} ok" if results else "none")
        for name, results in report.sections()
        # a replay.json from before metadata checks has none: no row rather than "none"
        if name != "steps" and (results or name != "metadata")
    )
    if not report.steps:  # a metadata-only trace: judged on its metadata checks alone
        overall = (
            Verdict("ok", "metadata consistent (tensors not captured)")
            if report.ok
            else Verdict("fail", "metadata checks fail (tensors not captured)")
        )
    else:
        overall = Verdict("ok", "all replayed steps agree") if report.ok else Verdict("fail", "some steps disagree")
    return ReplayData(
        True, overall, report.by_step(), checks, metadata_by_step=report.metadata_by_step(), origin=origin
    )


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
            r.note,
        )
        for r in results
    )


@dataclass(frozen=True)
class MetadataRow:
    """One metadata check of one (step, layer), for a step page."""

    layer: str
    check: str  #: ``tracer.format.metadata.METADATA_CHECKS``
    status: str  #: ``ok`` / ``fail``
    text: str  #: e.g. ``ok (111 checked)`` or ``FAIL (3 problems of 111)``
    note: str  #: what could not be compared (e.g. prompts unknown), or ""
    problems: tuple[str, ...]  #: ``row 1, position 17, token 20: slot ...``, the first few


def metadata_rows(checks: Sequence[MetadataCheck]) -> tuple[MetadataRow, ...]:
    """The metadata checks of one step, ready to show: one row per (layer, check)."""
    rows = []
    for c in checks:
        problems = tuple(
            ", ".join(
                f"{name} {value}"
                for name, value in (("row", p.row), ("position", p.position), ("token", p.token))
                if value is not None
            )
            + (": " if p.row is not None or p.position is not None or p.token is not None else "")
            + p.message
            for p in c.problems
        )
        more = c.num_problems - len(c.problems)
        if more > 0:
            problems += (f"… and {more} more",)
        text = f"ok ({c.checked} checked)" if c.ok else f"FAIL ({c.num_problems} problem(s) of {c.checked})"
        rows.append(MetadataRow(c.layer, c.check, _status(c.ok), text, c.note, problems))
    return tuple(rows)


def metadata_verdict(checks: Sequence[MetadataCheck]) -> Verdict:
    """One verdict for a step's metadata checks (every layer)."""
    if not checks:
        return NOT_CHECKED
    bad = [c for c in checks if not c.ok]
    if not bad:
        return Verdict("ok", f"metadata ok ({len(checks)} checks)")
    return Verdict("fail", f"metadata FAIL ({', '.join(sorted({c.check for c in bad}))})")
