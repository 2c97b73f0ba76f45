"""Replay verdicts as records: what ``replay.json`` holds, written and read back typed.

``reference_impl.replay`` makes these records, ``reports`` and the CLI read them. Both
sides go through :meth:`ReplayReport.to_json` / :meth:`ReplayReport.from_json`, so the
report never re-parses loose JSON. The kernel checks of ``reference_impl.testing`` make
:class:`CaseResult`, the same attention verdict with the extra numbers a kernel author
needs.

Errors that are not finite (NaN, inf) are written as JSON ``null`` (JSON has neither)
and read back as NaN. ``replay.json`` carries the trace format version it was written
with (:data:`tracer.format.version.FORMAT_VERSION`); a version-1 file (no version, and
``skipped`` a count) still reads.

Standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from tracer.format.records import TraceError
from tracer.format.selection import layer_index
from tracer.format.version import FORMAT_VERSION

__all__ = [
    "AttentionVerdict",
    "CaseResult",
    "HeadResult",
    "LegacyCheck",
    "MetadataCheck",
    "MetadataProblem",
    "ReplayReport",
    "StepResult",
    "Tolerance",
    "WorstValue",
    "WriteCheck",
    "finite_or_none",
]

T = TypeVar("T")


def finite_or_none(x: float) -> float | None:
    """JSON has no NaN/Infinity: a non-finite number is written as null."""
    return x if math.isfinite(x) else None


def _field(data: Mapping[str, Any], name: str, kind: type | tuple[type, ...], owner: str) -> Any:
    """``data[name]``, checked to be of ``kind``; a ``TraceError`` naming ``owner`` otherwise."""
    if name not in data:
        raise TraceError(f"{owner}: missing field {name!r}")
    value = data[name]
    # bool is an int subclass: a count or index must not be True/False.
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise TraceError(f"{owner}: field {name!r} is {value!r}, expected {_kind_name(kind)}")
    if not isinstance(value, kind):
        raise TraceError(f"{owner}: field {name!r} is {type(value).__name__}, expected {_kind_name(kind)}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("null" if k is type(None) else k.__name__ for k in kinds)


def _float(data: Mapping[str, Any], name: str, owner: str) -> float:
    """A number written by :func:`finite_or_none`: null reads back as NaN."""
    value = _field(data, name, (int, float, type(None)), owner)
    return math.nan if value is None else float(value)


def _list(data: Mapping[str, Any], name: str, owner: str, item: Callable[[Any], T]) -> tuple[T, ...]:
    return tuple(item(v) for v in _field(data, name, list, owner))


def _object(value: Any, owner: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise TraceError(f"{owner}: expected an object, got {type(value).__name__}")
    return value


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
        d, o = _object(data, "tolerance"), "tolerance"
        text = {n: _field(d, n, str, o) for n in ("emulation", "emulation_description", "floor") if n in d}
        return cls(
            k=_float(d, "k", o),
            eps=_float(d, "eps", o),
            reference_dtype=_field(d, "reference_dtype", str, o),
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
        d = _object(data, "head result")
        return cls(
            head=_field(d, "head", int, "head result"),
            ok=_field(d, "ok", bool, "head result"),
            max_abs=_float(d, "max_abs", "head result"),
            max_rel=_float(d, "max_rel", "head result"),
            tol=_float(d, "tol", "head result") if d.get("tol") is not None else None,
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
            "step": _field(d, "step", int, owner),
            "layer": _field(d, "layer", str, owner),
            "kind": _field(d, "kind", str, owner),
            "num_reqs": _field(d, "num_reqs", int, owner),
            "num_tokens": _field(d, "num_tokens", int, owner),
            "ok": _field(d, "ok", bool, owner),
            "max_abs": _float(d, "max_abs", owner),
            "max_rel": _float(d, "max_rel", owner),
            "tol": _float(d, "tol", owner),
            "baseline_max_abs": _float(d, "baseline_max_abs", owner),
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
        d = _object(data, "step result")
        return cls(
            **cls._base_fields(d, "step result"),
            heads=_list(d, "heads", "step result", HeadResult.from_json),
            note=_field(d, "note", str, "step result"),
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
        d, o = _object(data, "write check"), "write check"
        return cls(
            step=_field(d, "step", int, o),
            layer=_field(d, "layer", str, o),
            ok=_field(d, "ok", bool, o),
            tokens=_field(d, "tokens", int, o),
            mismatches=_field(d, "mismatches", int, o),
            first_mismatch=_field(d, "first_mismatch", (int, type(None)), o),
        )


@dataclass(frozen=True)
class LegacyCheck:
    """The legacy ``[nb, H_kv, D/x, bs, x]`` round trip of one (step, layer)."""

    step: int
    layer: str
    ok: bool  #: attention through the legacy layout is bitwise the direct result
    max_abs: float  #: max |legacy-path reference - direct reference| (0 when ok)
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
        d, o = _object(data, "legacy check"), "legacy check"
        return cls(
            step=_field(d, "step", int, o),
            layer=_field(d, "layer", str, o),
            ok=_field(d, "ok", bool, o),
            max_abs=_float(d, "max_abs", o),
            x=_field(d, "x", int, o),
        )


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
        d, o = _object(data, "metadata problem"), "metadata problem"
        optional = (int, type(None))
        return cls(
            message=_field(d, "message", str, o),
            row=_field(d, "row", optional, o),
            position=_field(d, "position", optional, o),
            token=_field(d, "token", optional, o),
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
    num_problems: int = 0  #: every problem found; ``problems`` keeps the first few
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
        d, o = _object(data, "metadata check"), "metadata check"
        return cls(
            step=_field(d, "step", int, o),
            layer=_field(d, "layer", str, o),
            kind=_field(d, "kind", str, o),
            check=_field(d, "check", str, o),
            ok=_field(d, "ok", bool, o),
            checked=_field(d, "checked", int, o),
            num_problems=_field(d, "num_problems", int, o),
            problems=_list(d, "problems", o, MetadataProblem.from_json),
            note=_field(d, "note", str, o),
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
        d, o = _object(data, "replay.json"), "replay.json"
        version = d.get("format_version", 1)
        if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
            raise TraceError(f"replay.json: format version {version!r}; this pagedtrace reads 1 to {FORMAT_VERSION}")
        raw_skipped = d.get("skipped", [])
        if version == 1 and isinstance(raw_skipped, int) and not isinstance(raw_skipped, bool):
            skipped = (V1_SKIPPED,) * raw_skipped  # version 1 wrote a count
        else:
            skipped = _list(d, "skipped", o, lambda s: s if isinstance(s, str) else _bad_skip(s))
        return cls(
            kernel=_field(d, "kernel", str, o),
            layout=_field(d, "layout", str, o),
            recorded_layout=_field(d, "recorded_layout", str, o),
            tolerance=Tolerance.from_json(d.get("tolerance")),
            steps=_list(d, "steps", o, StepResult.from_json),
            write_path=_list(d, "write_path", o, WriteCheck.from_json),
            legacy=_list(d, "legacy", o, LegacyCheck.from_json),
            # Files written before metadata checks existed have no such section.
            metadata=_list(d, "metadata", o, MetadataCheck.from_json) if "metadata" in d else (),
            skipped=skipped,
            seconds=_float(d, "seconds", o),
            format_version=version,
        )


def _bad_skip(value: Any) -> str:
    raise TraceError(f"replay.json: a 'skipped' entry is {type(value).__name__}, expected str")


@dataclass(frozen=True)
class WorstValue:
    """Where a kernel's output is furthest from the reference, in the step's and vLLM's terms."""

    token: int  #: 0-based row of the step's query (the batch row, ``query_start_loc`` indexes it)
    head: int  #: 0-based query head
    dim: int  #: 0-based element of the head
    request: int  #: 0-based block-table row of the request the token belongs to
    request_id: str | None = None  #: vLLM's request id of that row (None: not recorded)
    position: int | None = None  #: 0-based position of the token in its sequence
    block: int | None = None  #: vLLM's physical id of the KV block holding ``position``

    def describe(self) -> str:
        """``request 'cmpl-1' (row 1), position 57, block 7 (physical), query row 58``."""
        who = f"request {self.request_id!r} (row {self.request})" if self.request_id else f"request row {self.request}"
        parts = [who]
        if self.position is not None:
            parts.append(f"position {self.position}")
        if self.block is not None:
            parts.append(f"block {self.block} (physical)")
        return ", ".join(parts) + f", query row {self.token}"

    def to_json(self) -> dict[str, Any]:
        """A case result's ``worst`` object."""
        return {
            "token": self.token,
            "head": self.head,
            "dim": self.dim,
            "request": self.request,
            "request_id": self.request_id,
            "position": self.position,
            "block": self.block,
        }

    @classmethod
    def from_json(cls, data: Any) -> WorstValue:
        """Read :meth:`to_json`'s output."""
        d, o = _object(data, "worst value"), "worst value"
        optional = (int, type(None))
        return cls(
            token=_field(d, "token", int, o),
            head=_field(d, "head", int, o),
            dim=_field(d, "dim", int, o),
            request=_field(d, "request", int, o),
            request_id=_field(d, "request_id", (str, type(None)), o),
            position=_field(d, "position", optional, o),
            block=_field(d, "block", optional, o),
        )


@dataclass(frozen=True, kw_only=True)
class CaseResult(StepResult):
    """How one user kernel did on one captured case. ``str(result)`` / :meth:`message` explain it.

    A :class:`StepResult` (the kernel's output in place of vLLM's, per-head objects in
    ``heads``), so ``replay --kernel`` writes ``replay --json``'s schema; the fields below
    are the extras a kernel author needs.
    """

    id: str  #: the case's id
    kernel: str  #: what the user called the kernel (``--kernel``'s spec), or ``module:qualname``
    vllm_max_abs: float  #: max |out - vLLM's captured output|
    vllm_ref_max_abs: float  #: max |vLLM's output - fp64 reference|, for scale
    worst: WorstValue | None = None  #: where the largest error is (NaN ranks first)
    nonfinite: int = 0  #: NaN / inf values among the compared outputs
    tol_k: float = 2.0
    tol_eps: float = 1e-5
    note: str = ""  #: why it failed beyond the numbers (shape, an exception), or the case's note

    @property
    def worst_head(self) -> int | None:
        """The query head with the largest error (None when nothing was compared)."""
        return None if self.worst is None else self.worst.head

    def headline(self) -> str:
        """The verdict in one line: ``kernel K does NOT match vLLM on step 4 layer 0: max abs A > tol B``."""
        verdict = "matches" if self.ok else "does NOT match"
        index = layer_index(self.layer)
        layer = f"layer {index}" if index is not None else f"layer {self.layer}"
        line = f"kernel {self.kernel} {verdict} vLLM on step {self.step} {layer}"
        if math.isfinite(self.max_abs) or self.heads:
            cmp = "<=" if self.max_abs <= self.tol else ">"
            return f"{line}: max abs {_num(self.max_abs)} {cmp} tol {_num(self.tol)}"
        return f"{line}: {self.note}" if self.note else line

    def message(self) -> str:
        """A readable verdict: :meth:`headline` first (pytest's short summary shows it), then where and why."""
        lines = [
            self.headline(),
            f"  case {self.id} ({self.kind} step: {self.num_reqs} request(s), {self.num_tokens} query token(s); "
            f"layer {self.layer})",
        ]
        if math.isfinite(self.max_abs) or self.heads:
            lines.append(
                f"  tolerance {_num(self.tol)} = {_num(self.tol_k)} x {_num(self.baseline_max_abs)} (the error of "
                f"FlashAttention's rounding, emulated) + a floor of {_num(self.tol_eps)}; max rel {_num(self.max_rel)}"
            )
        if self.nonfinite:
            lines.append(f"  {self.nonfinite} NaN/inf value(s) in the output")
        if self.worst is not None and self.heads:
            w, bad = self.worst, self.bad_heads
            lines.append(
                f"  worst: head {w.head} (max abs {_num(self.heads[w.head].max_abs)}), {w.describe()}, dim {w.dim}; "
                f"{len(bad)}/{len(self.heads)} head(s) outside tolerance" + (f": {_head_list(bad)}" if bad else "")
            )
            lines.append(
                f"  vs vLLM's captured output: max abs {_num(self.vllm_max_abs)} "
                f"(vLLM itself is {_num(self.vllm_ref_max_abs)} from the fp64 reference)"
            )
        if self.note and not self.headline().endswith(self.note):
            lines.append(f"  note: {self.note}")
        return "\n".join(lines)

    __str__ = message

    def to_json(self) -> dict[str, Any]:
        """:meth:`StepResult.to_json` (``replay.json``'s ``steps`` entry) plus the kernel's extras."""
        f = finite_or_none
        return {
            "id": self.id,
            "kernel": self.kernel,
            **super().to_json(),
            "vllm_max_abs": f(self.vllm_max_abs),
            "vllm_ref_max_abs": f(self.vllm_ref_max_abs),
            "bad_heads": list(self.bad_heads),
            "worst": None if self.worst is None else self.worst.to_json(),
            "nonfinite": self.nonfinite,
            "tol_k": self.tol_k,
            "tol_eps": self.tol_eps,
        }

    @classmethod
    def from_json(cls, data: Any) -> CaseResult:
        """Read :meth:`to_json`'s output (``bad_heads`` is derived, not read)."""
        d, o = _object(data, "case result"), "case result"
        worst = _field(d, "worst", (dict, type(None)), o)
        return cls(
            **cls._base_fields(d, o),
            heads=_list(d, "heads", o, HeadResult.from_json),
            note=_field(d, "note", str, o),
            id=_field(d, "id", str, o),
            kernel=_field(d, "kernel", str, o),
            vllm_max_abs=_float(d, "vllm_max_abs", o),
            vllm_ref_max_abs=_float(d, "vllm_ref_max_abs", o),
            worst=None if worst is None else WorstValue.from_json(worst),
            nonfinite=_field(d, "nonfinite", int, o),
            tol_k=_float(d, "tol_k", o),
            tol_eps=_float(d, "tol_eps", o),
        )


def _num(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def _head_list(heads: tuple[int, ...], limit: int = 8) -> str:
    shown = ", ".join(map(str, heads[:limit]))
    return shown + (f" ... (+{len(heads) - limit})" if len(heads) > limit else "")
