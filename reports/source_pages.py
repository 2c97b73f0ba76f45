"""``src-<name>.html``: a coverage-style annotated vLLM source.

The page renders ``annotations.annotate.AnnotatedFile``, the same model
``pagedtrace annotate`` prints: the lines carry the default step's values, and
every step's values are embedded for the page's step selector (``report.js``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from annotations.annotate import AnnotatedFile, split_preamble
from annotations.values import Value
from reports.common import Link, Row, Token, highlight, step_page


@dataclass(frozen=True)
class LineNote:
    """A value shown beside a line (for the page's default step; ``text`` is "" when there is none).

    ``text`` is the value alone: its label and any fixed preamble are said once, in the
    line's panel and in the note's tooltip, so that the line has room for the value.
    """

    key: str
    label: str
    text: str
    kind: str
    title: str  #: tooltip: label, preamble and value


@dataclass(frozen=True)
class SourceLine:
    """One line of an annotated source page."""

    number: int
    tokens: tuple[Token, ...]
    notes: tuple[LineNote, ...]


@dataclass(frozen=True)
class StepOption:
    """One entry of the step selector."""

    step: int
    label: str
    selected: bool


@dataclass(frozen=True)
class SourcePage:
    """``src-<name>.html``: a coverage-style annotated source."""

    name: str
    vllm_path: str
    file_notes: tuple[str, ...]
    layer: str
    other_layers: int
    lines: tuple[SourceLine, ...]
    anchors: tuple[Link, ...]  #: jump list, ``#line-N`` links
    missing: tuple[Row, ...]  #: anchors not found: label, reason
    options: tuple[StepOption, ...]
    data: dict[str, Any]  #: embedded as JSON for the step selector and line panel
    nav: tuple[Link, ...]
    step_link: Link | None = None  #: the default step's page ("" href: it has none)


def _title(label: str, preamble: str, text: str) -> str:
    return f"{label} ({preamble}): {text}" if preamble else f"{label}: {text}"


def source_page(
    annotated: AnnotatedFile,
    default: int | None,
    traced_layers: int,
    nav: tuple[Link, ...],
    paged: frozenset[int] | set[int] = frozenset(),
) -> SourcePage:
    """One annotated source, with every anchor's value at every step of ``annotated``.

    The lines show the values at ``annotated.records[default]`` (None: no step); the
    embedded data carries the others for the step selector. ``traced_layers`` is how
    many layers the trace recorded (the values are the first one's). ``paged``: the
    steps that have a step page, linked from the selector's step.
    """
    records = annotated.records
    texts: dict[tuple[str, str], int] = {}

    def intern(value: Value | None) -> int:
        if value is None:
            return -1
        return texts.setdefault((split_preamble(value.text)[1], value.kind), len(texts))

    anchors_data = []
    for anchor in annotated.found:
        entry: dict[str, Any] = {"key": anchor.key, "label": anchor.label, "line": anchor.line}
        if anchor.preamble:
            entry["preamble"] = anchor.preamble
        if anchor.static is not None:
            entry["value"] = intern(anchor.static)
        else:
            entry["steps"] = [intern(value) for value in anchor.per_step]
        anchors_data.append(entry)
    lines = []
    on_line = annotated.by_line()
    for number, tokens in enumerate(highlight(annotated.text), 1):
        notes = []
        for anchor in on_line.get(number, ()):
            shown = anchor.at(default)
            # No value at the default step: the script fills the note in when a step is picked.
            text, kind = (shown.text, shown.kind) if shown is not None else ("", "static")
            preamble, value = split_preamble(text)
            notes.append(LineNote(anchor.key, anchor.label, value, kind, _title(anchor.label, preamble, value)))
        lines.append(SourceLine(number, tuple(tokens), tuple(notes)))
    anchors = tuple(
        Link(f"#line-{a.line}", f"{a.line}: {a.label}") for a in sorted(annotated.found, key=lambda a: a.line or 0)
    )
    missing = tuple(Row(a.label, a.reason) for a in annotated.missing)
    options = tuple(
        StepOption(r.step, f"step {r.step} ({r.kind}, {r.num_reqs} req, {r.num_actual_tokens} tok)", i == default)
        for i, r in enumerate(records)
    )
    data = {
        "steps": [r.step for r in records],
        "kinds": [r.kind for r in records],
        "default": records[default].step if default is not None else None,
        "texts": [[t, k] for (t, k) in texts],
        "anchors": anchors_data,
        "pages": [step_page(r.step) if r.step in paged else "" for r in records],
    }
    step_link = None
    if default is not None:
        step = records[default].step
        step_link = Link(step_page(step) if step in paged else "", f"step {step}")
    return SourcePage(
        name=annotated.vllm_path.rsplit("/", 1)[-1],
        vllm_path=annotated.vllm_path,
        file_notes=annotated.file_notes,
        layer=records[0].layer if records else "",
        other_layers=max(0, traced_layers - 1),
        lines=tuple(lines),
        anchors=anchors,
        missing=missing,
        options=options,
        data=data,
        nav=nav,
        step_link=step_link,
    )
