"""Replay verdicts as records: what ``replay.json`` holds, written and read back typed.

``reference_impl.replay`` makes these records, ``reports`` and the CLI read them. Both
sides go through :meth:`ReplayReport.to_json` / :meth:`ReplayReport.from_json`, so the
report never re-parses loose JSON. The kernel checks of ``reference_impl.testing`` make
:class:`tracer.format.kernel_verdicts.CaseResult`, the same attention verdict with the extra
numbers a kernel author needs.

Errors that are not finite (NaN, inf) are written as JSON ``null`` (JSON has neither)
and read back as NaN. ``replay.json`` carries the trace format version it was written
with (:data:`tracer.format.version.FORMAT_VERSION`); a version-1 file (no version, and
``skipped`` a count) still reads.

Standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tracer.format.jsonfields import as_object, finite_or_none, get_field, get_float, get_list
from tracer.format.records import TraceError
from tracer.format.version import FORMAT_VERSION

__all__ = [
    "MAX_PROBLEMS",
    "AttentionVerdict",
    "HeadResult",
    "LegacyCheck",
    "MetadataCheck",
    "MetadataProblem",
    "ReplayReport",
    "StepResult",
    "Tolerance",
    "WriteCheck",
    "finite_or_none",
]


@dataclass(frozen=True)
class Tolerance:
    """How the bar was set: ``k * err(baseline) + floor`` against a reference in ``reference_dtype``.

    ``emulation`` names the baseline (e.g. ``flash-attention-rounding``) and ``floor`` says
    how the floor was derived. A ``replay.json`` written before they existed reads back with
    them empty: its bar was ``k * err(same math in the activation dtype) + eps``.
    """

    k: float  #: multiple of the low-precision baseline's error
    eps: float  #: absolute floor (0 when the floor is relative, see ``floor``)
    reference_dtype: str  #: precision of the reference, e.g. ``float64``
    emulation: str = ""  #: name of the low-precision baseline; "" = same math in the activation dtype
    emulation_description: str = ""  #: what the baseline rounds, in words
    floor: str = ""  #: the floor rule, in words; "" = the absolute ``eps``

    def to_json(self) -> dict[str, Any]:
        """``replay.json``'s ``tolerance`` object."""
        return {
            "k": self.k,
            "eps": self.eps,
            "reference_dtype": self.reference_dtype,
            "emulation": self.emulation,
            "emulation_description": self.emulation_description,
            "floor": self.floor,
        }

    @classmethod
    def from_json(cls, data: Any) -> Tolerance:
        """Read :meth:`to_json`'s output (older files lack the text fields); malformed is a ``TraceError``."""
        d, o = as_object(data, "tolerance"), "tolerance"
        text = {n: get_field(d, n, str, o) for n in ("emulation", "emulation_description", "floor") if n in d}
        return cls(
            k=get_float(d, "k", o),
            eps=get_float(d, "eps", o),
            reference_dtype=get_field(d, "reference_dtype", str, o),
            **text,
        )


@dataclass(frozen=True)
class HeadResult:
    """Attention error of one query head in one (step, layer)."""

    head: int  #: 0-based query head
    ok: bool  #: ``max_abs <= tol`` (this head's bar; older files: its step's)
    max_abs: float  #: max |vLLM - reference| over this head's tokens and dims
    max_rel: float  #: ``max_abs`` over max |reference| of this head
    tol: float | None = None  #: this head's bar; None in a ``replay.json`` from before per-head bars

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (non-finite errors as null)."""
        return {
            "head": self.head,
            "ok": self.ok,
            "max_abs": finite_or_none(self.max_abs),
            "max_rel": finite_or_none(self.max_rel),
            "tol": None if self.tol is None else finite_or_none(self.tol),
        }

    @classmethod
    def from_json(cls, data: Any) -> HeadResult:
        """Read :meth:`to_json`'s output (``tol`` may be absent: older files)."""
        d = as_object(data, "head result")
        return cls(
            head=get_field(d, "head", int, "head result"),
            ok=get_field(d, "ok", bool, "head result"),
            max_abs=get_float(d, "max_abs", "head result"),
            max_rel=get_float(d, "max_rel", "head result"),
            tol=get_float(d, "tol", "head result") if d.get("tol") is not None else None,
        )


@dataclass(frozen=True)
class AttentionVerdict:
    """The numbers every attention verdict has: where, how far off, and the bar it was held to."""

    step: int  #: 0-based forward-pass index, as ``StepRecord.step``
    layer: str
    kind: str  #: ``StepRecord.kind``
    num_reqs: int
    num_tokens: int  #: query tokens compared (``num_actual_tokens``)
    ok: bool
    max_abs: float  #: max |output - fp64 reference|
    max_rel: float  #: ``max_abs`` over max |reference|
    tol: float  #: allowed ``max_abs``: ``k * baseline_max_abs + eps``
    baseline_max_abs: float  #: max |reference in the activation dtype - fp64 reference|

    def _base_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "layer": self.layer,
            "kind": self.kind,
            "ok": self.ok,
            "max_abs": finite_or_none(self.max_abs),
            "max_rel": finite_or_none(self.max_rel),
            "tol": finite_or_none(self.tol),
            "baseline_max_abs": finite_or_none(self.baseline_max_abs),
            "num_tokens": self.num_tokens,
            "num_reqs": self.num_reqs,
        }

    @staticmethod
    def _base_fields(d: Mapping[str, Any], owner: str) -> dict[str, Any]:
        return {
            "step": get_field(d, "step", int, owner),
            "layer": get_field(d, "layer", str, owner),
            "kind": get_field(d, "kind", str, owner),
            "num_reqs": get_field(d, "num_reqs", int, owner),
            "num_tokens": get_field(d, "num_tokens", int, owner),
            "ok": get_field(d, "ok", bool, owner),
            "max_abs": get_float(d, "max_abs", owner),
            "max_rel": get_float(d, "max_rel", owner),
            "tol": get_float(d, "tol", owner),
            "baseline_max_abs": get_float(d, "baseline_max_abs", owner),
        }


@dataclass(frozen=True)
class StepResult(AttentionVerdict):
    """Attention replay of one (step, layer): vLLM's ``output`` against the reference."""

    heads: tuple[HeadResult, ...] = ()
    note: str = ""  #: why it failed beyond the numbers (e.g. a block the table names was not captured)

    @property
    def bad_heads(self) -> tuple[int, ...]:
        """Query heads outside the tolerance."""
        return tuple(h.head for h in self.heads if not h.ok)

    def to_json(self) -> dict[str, Any]:
        """One entry of ``replay.json``'s ``steps``."""
        return {**self._base_json(), "heads": [h.to_json() for h in self.heads], "note": self.note}

    @classmethod
    def from_json(cls, data: Any) -> StepResult:
        """Read :meth:`to_json`'s output."""
        d = as_object(data, "step result")
        return cls(
            **cls._base_fields(d, "step result"),
            heads=get_list(d, "heads", "step result", HeadResult.from_json),
            note=get_field(d, "note", str, "step result"),
        )


@dataclass(frozen=True)
class WriteCheck:
    """Write path of one (step, layer): do the captured blocks hold the new K/V bits?"""

    step: int
    layer: str
    ok: bool
    tokens: int  #: slots written (``slot_mapping`` entries other than -1)
    mismatches: int  #: of those, tokens whose K or V bits differ (or whose block was not captured)
    first_mismatch: int | None = None  #: 0-based token index of the first mismatch

    def to_json(self) -> dict[str, Any]:
        """One entry of ``replay.json``'s ``write_path``."""
        return {
            "step": self.step,
            "layer": self.layer,
            "ok": self.ok,
            "tokens": self.tokens,
            "mismatches": self.mismatches,
            "first_mismatch": self.first_mismatch,
        }

    @classmethod
    def from_json(cls, data: Any) -> WriteCheck:
        """Read :meth:`to_json`'s output."""
        d, o = as_object(data, "write check"), "write check"
        return cls(
            step=get_field(d, "step", int, o),
            layer=get_field(d, "layer", str, o),
            ok=get_field(d, "ok", bool, o),
            tokens=get_field(d, "tokens", int, o),
            mismatches=get_field(d, "mismatches", int, o),
            first_mismatch=get_field(d, "first_mismatch", (int, type(None)), o),
        )


@dataclass(frozen=True)
class LegacyCheck:
    """The legacy ``[nb, H_kv, D/x, bs, x]`` round trip of one (step, layer)."""

    step: int
    layer: str
    #: the caches come back from the legacy layout bit for bit, and attention over them agrees with
    #: the direct result to fp64 rounding (``reference_impl.checks.LEGACY_RERUN_RTOL``)
    ok: bool
    max_abs: float  #: max |legacy-path reference - direct reference|
    x: int  #: elements per 16-byte vector, ``16 // element_size``

    def to_json(self) -> dict[str, Any]:
        """One entry of ``replay.json``'s ``legacy``."""
        return {
            "step": self.step,
            "layer": self.layer,
            "ok": self.ok,
            "max_abs": finite_or_none(self.max_abs),
            "x": self.x,
        }

    @classmethod
    def from_json(cls, data: Any) -> LegacyCheck:
        """Read :meth:`to_json`'s output."""
        d, o = as_object(data, "legacy check"), "legacy check"
        return cls(
            step=get_field(d, "step", int, o),
            layer=get_field(d, "layer", str, o),
            ok=get_field(d, "ok", bool, o),
            max_abs=get_float(d, "max_abs", o),
            x=get_field(d, "x", int, o),
        )


#: Problems a :class:`MetadataCheck` keeps (its ``num_problems`` counts all of them).
MAX_PROBLEMS = 8


@dataclass(frozen=True)
class MetadataProblem:
    """One thing a metadata check found wrong: where (row, position, token) and what differed."""

    message: str  #: what differed, e.g. ``slot 113, expected 112 = block 7 * 16 + 0``
    row: int | None = None  #: 0-based block-table row (request), when the problem has one
    position: int | None = None  #: 0-based token position in that row's sequence
    token: int | None = None  #: 0-based index among the step's query tokens (``slot_mapping``)

    def to_json(self) -> dict[str, Any]:
        """One entry of a metadata check's ``problems``."""
        return {"message": self.message, "row": self.row, "position": self.position, "token": self.token}

    @classmethod
    def from_json(cls, data: Any) -> MetadataProblem:
        """Read :meth:`to_json`'s output."""
        d, o = as_object(data, "metadata problem"), "metadata problem"
        optional = (int, type(None))
        return cls(
            message=get_field(d, "message", str, o),
            row=get_field(d, "row", optional, o),
            position=get_field(d, "position", optional, o),
            token=get_field(d, "token", optional, o),
        )


@dataclass(frozen=True)
class MetadataCheck:
    """One metadata check of one (step, layer), made from the record alone (no tensors needed).

    ``check`` names what was compared (``tracer.format.metadata.METADATA_CHECKS``):
    ``lengths`` (seq_lens / query_start_loc), ``slots`` (slot_mapping against the block
    table), ``blocks`` (ids inside the pool), ``shared`` (a shared block holds the same
    tokens), ``flags`` (causal, window, soft-cap, heads against the model config).
    """

    step: int
    layer: str
    kind: str  #: ``StepRecord.kind``
    check: str  #: one of ``METADATA_CHECKS``
    ok: bool
    checked: int  #: items compared (tokens, rows, blocks, flags)
    num_problems: int = 0  #: every problem found; ``problems`` keeps the first :data:`MAX_PROBLEMS`
    problems: tuple[MetadataProblem, ...] = ()
    note: str = ""  #: what could not be compared and why (e.g. ``prompts unknown``)

    def to_json(self) -> dict[str, Any]:
        """One entry of ``replay.json``'s ``metadata``."""
        return {
            "step": self.step,
            "layer": self.layer,
            "kind": self.kind,
            "check": self.check,
            "ok": self.ok,
            "checked": self.checked,
            "num_problems": self.num_problems,
            "problems": [p.to_json() for p in self.problems],
            "note": self.note,
        }

    @classmethod
    def from_json(cls, data: Any) -> MetadataCheck:
        """Read :meth:`to_json`'s output."""
        d, o = as_object(data, "metadata check"), "metadata check"
        return cls(
            step=get_field(d, "step", int, o),
            layer=get_field(d, "layer", str, o),
            kind=get_field(d, "kind", str, o),
            check=get_field(d, "check", str, o),
            ok=get_field(d, "ok", bool, o),
            checked=get_field(d, "checked", int, o),
            num_problems=get_field(d, "num_problems", int, o),
            problems=get_list(d, "problems", o, MetadataProblem.from_json),
            note=get_field(d, "note", str, o),
        )


#: What a version-1 ``replay.json`` says of its skipped records (it kept only their count).
V1_SKIPPED = "reason not kept (replay.json of format version 1)"


@dataclass(frozen=True)
class ReplayReport:
    """Everything ``replay_trace`` found; ``ok`` only if every check passed."""

    kernel: str  #: the reference form, e.g. ``fast``
    layout: str  #: the layout the blocks were read in (``cpu_amx`` when found behind ``cpu``)
    recorded_layout: str  #: ``KVCacheSpec.layout`` as the manifest has it
    tolerance: Tolerance
    steps: tuple[StepResult, ...]
    write_path: tuple[WriteCheck, ...]
    legacy: tuple[LegacyCheck, ...]
    #: metadata checks of every selected record, tensors or not (absent from older files: empty)
    metadata: tuple[MetadataCheck, ...] = ()
    skipped: tuple[str, ...] = ()  #: selected records that could not be replayed, and why
    seconds: float = 0.0  #: wall time of the replay
    format_version: int = FORMAT_VERSION  #: trace format version this file was written with

    @property
    def ok(self) -> bool:
        """True when something was judged (a replayed step or a metadata check) and nothing failed.

        A metadata-only trace (no tensors captured) is judged on its metadata checks alone.
        """
        return bool(self.steps or self.metadata) and all(r.ok for r in self.checks())

    def checks(self) -> tuple[StepResult | WriteCheck | LegacyCheck | MetadataCheck, ...]:
        """Every check of every kind, steps first."""
        return (*self.steps, *self.write_path, *self.legacy, *self.metadata)

    def sections(self) -> tuple[tuple[str, tuple[Any, ...]], ...]:
        """``(name, checks)`` per kind of check, in ``replay.json``'s order."""
        return (
            ("steps", self.steps),
            ("write_path", self.write_path),
            ("legacy", self.legacy),
            ("metadata", self.metadata),
        )

    def metadata_by_step(self) -> dict[int, list[MetadataCheck]]:
        """Metadata checks grouped by step index (every check of every recorded layer)."""
        out: dict[int, list[MetadataCheck]] = {}
        for c in self.metadata:
            out.setdefault(c.step, []).append(c)
        return out

    def by_step(self) -> dict[int, list[StepResult]]:
        """Attention results grouped by step index (one per replayed layer)."""
        out: dict[int, list[StepResult]] = {}
        for r in self.steps:
            out.setdefault(r.step, []).append(r)
        return out

    def to_json(self) -> dict[str, Any]:
        """The ``replay.json`` object."""
        return {
            "format_version": self.format_version,
            "ok": self.ok,
            "kernel": self.kernel,
            "layout": self.layout,
            "recorded_layout": self.recorded_layout,
            "tolerance": self.tolerance.to_json(),
            "seconds": round(self.seconds, 3),
            "steps": [r.to_json() for r in self.steps],
            "write_path": [r.to_json() for r in self.write_path],
            "legacy": [r.to_json() for r in self.legacy],
            "metadata": [c.to_json() for c in self.metadata],
            "skipped": list(self.skipped),
        }

    @classmethod
    def from_json(cls, data: Any) -> ReplayReport:
        """Read ``replay.json`` (this version or version 1); a malformed file is a ``TraceError``.

        ``ok`` is not read back: it is derived from the checks.
        """
        d, o = as_object(data, "replay.json"), "replay.json"
        version = d.get("format_version", 1)
        if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
            raise TraceError(f"replay.json: format version {version!r}; this pagedtrace reads 1 to {FORMAT_VERSION}")
        raw_skipped = d.get("skipped", [])
        if version == 1 and isinstance(raw_skipped, int) and not isinstance(raw_skipped, bool):
            skipped = (V1_SKIPPED,) * raw_skipped  # version 1 wrote a count
        else:
            skipped = get_list(d, "skipped", o, lambda s: s if isinstance(s, str) else _bad_skip(s))
        return cls(
            kernel=get_field(d, "kernel", str, o),
            layout=get_field(d, "layout", str, o),
            recorded_layout=get_field(d, "recorded_layout", str, o),
            tolerance=Tolerance.from_json(d.get("tolerance")),
            steps=get_list(d, "steps", o, StepResult.from_json),
            write_path=get_list(d, "write_path", o, WriteCheck.from_json),
            legacy=get_list(d, "legacy", o, LegacyCheck.from_json),
            # Files written before metadata checks existed have no such section.
            metadata=get_list(d, "metadata", o, MetadataCheck.from_json) if "metadata" in d else (),
            skipped=skipped,
            seconds=get_float(d, "seconds", o),
            format_version=version,
        )


def _bad_skip(value: Any) -> str:
    raise TraceError(f"replay.json: a 'skipped' entry is {type(value).__name__}, expected str")
