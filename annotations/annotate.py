"""Annotated sources: a vLLM file's lines with the traced values beside them.

``annotate`` is the public entry point; ``anchor_values`` is the per-step part a
report calls once per step after locating the anchors once.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from annotations.anchors import ANNOTATED_FILES, CPU_ATTN, FILE_ROLES, FLASH_ATTN, OFF_PATH_FILES, PAGED_ATTN
from annotations.locate import LocatedSource, locate
from annotations.values import CPU_LAYOUTS, Value, cpu_region_text, split_kv_cache_summary, value_for
from tracer.format import RunInfo, StepRecord, TraceError

if TYPE_CHECKING:
    from tracer.format import Trace


class StepNotFound(TraceError):
    """The step (or layer) asked for is not among the trace's records."""


@dataclass(frozen=True)
class Note:
    """One anchor's annotation in one annotated source."""

    anchor: str  #: anchor key
    label: str  #: short name of the value
    line: int | None  #: 1-based line, None when the anchor was not found
    text: str  #: the value, or why the anchor is missing
    kind: str  #: ``captured`` / ``computed`` / ``static`` (see ``annotations.values``) or ``missing``
    tour: str = ""  #: reading-checklist stop


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
    return {
        key: value_for(loc.anchor, record, run) for key, loc in located.locations.items() if loc.found
    }


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


def annotate(
    source_text: str,
    vllm_path: str,
    trace: Trace,
    step: int | None = None,
    layer: str | None = None,
) -> AnnotatedSource:
    """Annotate ``source_text`` (the file ``vllm_path``) with ``trace``'s values at ``step``.

    Anchors that cannot be found give ``missing`` notes, never an exception; a
    step or layer the trace lacks raises ``StepNotFound``.
    """
    record = select_record(trace, step, layer)
    located = locate(source_text, vllm_path)
    values = anchor_values(located, record, trace.run)
    notes = []
    by_line: dict[int, list[Note]] = {}
    for key, loc in located.locations.items():
        anchor = loc.anchor
        if not loc.found:
            notes.append(Note(key, anchor.label, None, loc.reason, "missing", anchor.tour))
            continue
        value = values.get(key)
        if value is None:
            note = Note(key, anchor.label, loc.line, "(no step recorded)", "static", anchor.tour)
        else:
            note = Note(key, anchor.label, loc.line, value.text, value.kind, anchor.tour)
        notes.append(note)
        by_line.setdefault(note.line, []).append(note)
    lines = tuple(
        AnnotatedLine(i, text, tuple(by_line.get(i, ())))
        for i, text in enumerate(source_text.splitlines(), 1)
    )
    return AnnotatedSource(
        vllm_path=vllm_path,
        step=record.step if record else None,
        layer=record.layer if record else None,
        lines=lines,
        notes=tuple(notes),
        file_notes=file_notes(vllm_path, trace.run, located.sha256),
        sha256=located.sha256,
    )
