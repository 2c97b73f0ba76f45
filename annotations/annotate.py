"""Annotated sources: a vLLM file's lines with the traced values beside them.

``annotate_file`` builds the one annotated-file model, ``AnnotatedFile``: every
anchor with its value at every given step. ``pagedtrace annotate`` prints one step
of it (``annotate`` = ``annotate_file(...).at(step)``); the report's source pages
render it whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from annotations.anchors import CPU_ATTN, FILE_ROLES, FLASH_ATTN, OFF_PATH_FILES, PAGED_ATTN
from annotations.locate import LocatedSource, locate
from annotations.value_text import COMPUTED_PREFIX
from annotations.values import CPU_LAYOUTS, Value, cpu_region_text, split_kv_cache_summary, value_for
from tracer.format import RunInfo, StepRecord, TraceError

if TYPE_CHECKING:
    from tracer.format import Trace


class StepNotFound(TraceError):
    """The step (or layer) asked for is not among the trace's records."""


#: Fixed openings some value texts carry (what the value is, not the value): said once, beside
#: the value's label, so that the line itself shows the value.
PREAMBLES = (COMPUTED_PREFIX,)


def split_preamble(text: str) -> tuple[str, str]:
    """``(preamble, value)``: a text's fixed opening (``""`` when none) and the value after it."""
    for preamble in PREAMBLES:
        if text.startswith(preamble):
            return preamble.rstrip(": "), text[len(preamble) :]
    return "", text


@dataclass(frozen=True)
class Note:
    """One anchor's annotation in one annotated source."""

    anchor: str  #: anchor key
    label: str  #: short name of the value
    line: int | None  #: 1-based line, None when the anchor was not found
    text: str  #: the value, or why the anchor is missing
    kind: str  #: ``captured`` / ``computed`` / ``static`` (see ``annotations.values``) or ``missing``
    tour: str = ""  #: reading-checklist stop

    @property
    def value_text(self) -> str:
        """The value alone, for beside the line: ``text`` without its preamble (the label goes elsewhere)."""
        return split_preamble(self.text)[1]

    @property
    def preamble(self) -> str:
        """What kind of value ``text`` is, when it says so in a fixed opening (``""`` otherwise)."""
        return split_preamble(self.text)[0]


@dataclass(frozen=True)
class AnnotatedLine:
    """One source line and the notes anchored on it."""

    number: int  #: 1-based
    text: str  #: the line, without its newline
    notes: tuple[Note, ...] = ()


@dataclass(frozen=True)
class AnnotatedSource:
    """A source file annotated with one step's values."""

    vllm_path: str
    step: int | None  #: the step the values are for (None: no step records in the trace)
    layer: str | None
    lines: tuple[AnnotatedLine, ...]
    notes: tuple[Note, ...]  #: every anchor of the file, in table order, missing ones included
    file_notes: tuple[str, ...]  #: file-level remarks (its role, off-path, source mismatch)
    sha256: str  #: of the annotated text

    @property
    def missing(self) -> tuple[Note, ...]:
        """Notes of anchors that were not found."""
        return tuple(n for n in self.notes if n.kind == "missing")


def select_record(trace: Trace, step: int | None = None, layer: str | None = None) -> StepRecord | None:
    """The record to annotate with.

    ``step=None`` picks the first ``request`` step (else the first record);
    ``layer=None`` the first captured layer. Returns None when the trace has no
    step records; raises ``StepNotFound`` for a step or layer it does not have.
    """
    layers = trace.layers
    if not layers:
        if step is not None:
            raise StepNotFound(f"step {step}: the trace has no step records")
        return None
    if layer is None:
        layer = layers[0]
    elif layer not in layers:
        raise StepNotFound(f"layer {layer!r} not in trace (layers: {', '.join(layers)})")
    records = trace.steps(layer=layer)
    if step is None:
        requests = [r for r in records if r.kind == "request"]
        return (requests or records)[0]
    for rec in records:
        if rec.step == step:
            return rec
    gap = next((g for g in trace.gaps if g.step == step), None)
    if gap is not None:
        raise StepNotFound(f"step {step} was not recorded ({gap.kind}: {gap.reason})")
    steps = sorted({r.step for r in records})
    shown = ", ".join(str(s) for s in steps[:20]) + (" …" if len(steps) > 20 else "")
    raise StepNotFound(f"step {step} not in trace (recorded steps: {shown})")


def anchor_values(located: LocatedSource, record: StepRecord | None, run: RunInfo) -> dict[str, Value | None]:
    """Anchor key -> value at ``record`` for every anchor ``located`` found."""
    return {key: value_for(loc.anchor, record, run) for key, loc in located.locations.items() if loc.found}


#: Backend-specific files, by the class-name prefix of the backend that runs them.
_BACKEND_FILES = {FLASH_ATTN: "FlashAttention", CPU_ATTN: "CPUAttention"}


def on_path(vllm_path: str, run: RunInfo) -> bool:
    """Whether the traced run executed code in ``vllm_path`` (legacy files and other backends did not)."""
    if vllm_path in OFF_PATH_FILES:
        return False
    prefix = _BACKEND_FILES.get(vllm_path)
    return prefix is None or prefix in run.attention_backend.rsplit(".", 1)[-1]


def file_role(vllm_path: str, run: RunInfo) -> str:
    """What ``vllm_path`` is, in one line; the CPU backend's line names the packing this trace recorded."""
    spec = run.kv_cache
    if vllm_path == CPU_ATTN and spec is not None and spec.layout in CPU_LAYOUTS:
        return (
            f"The CPU backend (this trace: layout {spec.layout}): per (block, head) region "
            f"{cpu_region_text(spec.layout, spec.block_size, spec.head_size)}; cpu_attn_reshape_and_cache "
            "writes, cpu_attention_with_kv_cache reads."
        )
    return FILE_ROLES.get(vllm_path, "")


def file_notes(vllm_path: str, run: RunInfo, sha256: str | None = None) -> tuple[str, ...]:
    """File-level remarks: the file's role, whether this run executes it, source mismatches."""
    notes = []
    role = file_role(vllm_path, run)
    if role:
        notes.append(role)
    backend = run.attention_backend.rsplit(".", 1)[-1]
    if vllm_path in OFF_PATH_FILES:
        if vllm_path == PAGED_ATTN and run.kv_cache is not None:
            notes.append(split_kv_cache_summary(run.kv_cache))
        elif not role:
            notes.append("vLLM 0.26 does not run this file on the FlashAttention or CPU path.")
    elif not on_path(vllm_path, run):
        notes.append(
            f"This trace ran {backend}, not this backend: the values show what this code "
            "would receive for the same step."
        )
    stored = run.sources.get(vllm_path, {}).get("sha256")
    if sha256 and stored and stored != sha256:
        notes.append("This text differs from the source stored with the trace (sha256 mismatch).")
    return tuple(notes)


#: A note's text when its value needs a step and the trace recorded none.
NO_STEP = "(no step recorded)"


@dataclass(frozen=True)
class AnchorValues:
    """One anchor of an annotated file, with its value at every step of the file's records."""

    key: str  #: anchor key
    label: str  #: short name of the value
    line: int | None  #: 1-based line, None when the anchor was not found
    reason: str  #: why the anchor was not found ("" when it was)
    tour: str  #: reading-checklist stop
    static: Value | None  #: the value when it is the same at every step (depends on the run only)
    per_step: tuple[Value | None, ...]  #: otherwise one per record of the file (None: nothing to show)

    @property
    def found(self) -> bool:
        """Whether the anchor resolved to a line."""
        return self.line is not None

    def at(self, index: int | None) -> Value | None:
        """The value at the file's ``index``-th record (None: no record, or nothing to show)."""
        if self.static is not None:
            return self.static
        return None if index is None or not self.per_step else self.per_step[index]

    @property
    def preamble(self) -> str:
        """The fixed opening every value of this anchor shares (``""`` when they do not all share one)."""
        values = [v for v in ((self.static,) if self.static is not None else self.per_step) if v is not None]
        preambles = {split_preamble(v.text)[0] for v in values}
        return preambles.pop() if len(preambles) == 1 else ""


@dataclass(frozen=True)
class AnnotatedFile:
    """A source file with every anchor's values at every given step: the one annotated-file model.

    ``pagedtrace annotate`` prints one step of it (:meth:`at`); the report's source
    page shows the default step and embeds every other one for its step selector.
    """

    vllm_path: str
    text: str  #: the annotated source
    records: tuple[StepRecord, ...]  #: the steps the values are for, in order
    anchors: tuple[AnchorValues, ...]  #: every anchor of the file in table order, missing ones included
    file_notes: tuple[str, ...]  #: file-level remarks (its role, off-path, source mismatch)
    sha256: str  #: of the annotated text

    @property
    def found(self) -> tuple[AnchorValues, ...]:
        """Anchors that resolved to a line, in table order."""
        return tuple(a for a in self.anchors if a.found)

    @property
    def missing(self) -> tuple[AnchorValues, ...]:
        """Anchors that were not found, in table order."""
        return tuple(a for a in self.anchors if not a.found)

    def by_line(self) -> dict[int, tuple[AnchorValues, ...]]:
        """1-based line -> the found anchors on it, in table order."""
        out: dict[int, list[AnchorValues]] = {}
        for anchor in self.anchors:
            if anchor.line is not None:
                out.setdefault(anchor.line, []).append(anchor)
        return {line: tuple(anchors) for line, anchors in out.items()}

    def at(self, index: int | None) -> AnnotatedSource:
        """The file annotated with the ``index``-th record's values (None: no record)."""
        record = self.records[index] if index is not None else None
        notes = []
        for a in self.anchors:
            if not a.found:
                notes.append(Note(a.key, a.label, None, a.reason, "missing", a.tour))
                continue
            value = a.at(index)
            text, kind = (value.text, value.kind) if value is not None else (NO_STEP, "static")
            notes.append(Note(a.key, a.label, a.line, text, kind, a.tour))
        by_line: dict[int, list[Note]] = {}
        for note in notes:
            if note.line is not None:
                by_line.setdefault(note.line, []).append(note)
        lines = tuple(
            AnnotatedLine(i, text, tuple(by_line.get(i, ()))) for i, text in enumerate(self.text.splitlines(), 1)
        )
        return AnnotatedSource(
            vllm_path=self.vllm_path,
            step=record.step if record else None,
            layer=record.layer if record else None,
            lines=lines,
            notes=tuple(notes),
            file_notes=self.file_notes,
            sha256=self.sha256,
        )


def annotate_file(
    source_text: str,
    vllm_path: str,
    run: RunInfo,
    records: Sequence[StepRecord] = (),
    located: LocatedSource | None = None,
) -> AnnotatedFile:
    """Annotate ``source_text`` (the file ``vllm_path``) with ``run``'s values at each of ``records``.

    ``located`` is ``locate(source_text, vllm_path)`` when the caller has it already.
    Anchors that cannot be found are kept with their reason, never an exception.
    """
    located = located if located is not None else locate(source_text, vllm_path)
    anchors = []
    for key, loc in located.locations.items():
        anchor = loc.anchor
        if not loc.found:
            anchors.append(AnchorValues(key, anchor.label, None, loc.reason, anchor.tour, None, ()))
            continue
        static = value_for(anchor, None, run)
        # A value that needs no step is the same at every step (value functions ignore the record then).
        per_step = () if static is not None else tuple(value_for(anchor, r, run) for r in records)
        anchors.append(AnchorValues(key, anchor.label, loc.line, "", anchor.tour, static, per_step))
    return AnnotatedFile(
        vllm_path=vllm_path,
        text=source_text,
        records=tuple(records),
        anchors=tuple(anchors),
        file_notes=file_notes(vllm_path, run, located.sha256),
        sha256=located.sha256,
    )


def annotate(
    source_text: str,
    vllm_path: str,
    trace: Trace,
    step: int | None = None,
    layer: str | None = None,
) -> AnnotatedSource:
    """Annotate ``source_text`` (the file ``vllm_path``) with ``trace``'s values at ``step``.

    ``annotate_file`` for the one record ``select_record`` picks, at that record.
    Anchors that cannot be found give ``missing`` notes, never an exception; a
    step or layer the trace lacks raises ``StepNotFound``.
    """
    record = select_record(trace, step, layer)
    records = (record,) if record is not None else ()
    return annotate_file(source_text, vllm_path, trace.run, records).at(0 if records else None)
