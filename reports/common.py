"""Pieces every page family shares: links, rows, verdicts, page names, syntax highlighting.

Pure data and pure functions; the page families (``reports.index_page``,
``reports.source_pages``, ``reports.step_pages``, ``reports.tour``) build on them
and ``reports.viewmodel`` assembles the site.
"""

from __future__ import annotations

import io
import keyword
import tokenize
from dataclasses import dataclass

from tracer.format import StepRecord, Trace

#: Page names.
INDEX_PAGE = "index.html"
TOUR_PAGE = "tour.html"


@dataclass(frozen=True)
class Link:
    """A hyperlink: relative ``href`` and its text."""

    href: str
    text: str


@dataclass(frozen=True)
class Row:
    """A label/value row of a summary table."""

    label: str
    value: str


@dataclass(frozen=True)
class Verdict:
    """A replay verdict, ready to print."""

    status: str  #: ``ok`` / ``fail`` / ``none`` (not replayed)
    text: str  #: short human text, e.g. ``ok (max abs 1.2e-03)``


@dataclass(frozen=True)
class Token:
    """A highlighted piece of a source line."""

    #: CSS class: ``kw`` keyword, ``st`` string, ``cm`` comment, ``nu`` number, ``fn`` def name,
    #: ``bi`` builtin-ish, ``""`` plain
    cls: str
    text: str


def source_file_page(vllm_path: str) -> str:
    """Page name of an annotated source: ``src-flash_attn.html``."""
    return "src-" + vllm_path.rsplit("/", 1)[-1].removesuffix(".py") + ".html"


def step_page(step: int) -> str:
    """Page name of a step: ``step-000012.html``."""
    return f"step-{step:06d}.html"


# --- syntax highlighting ---------------------------------------------------------

_TOKEN_CLASS = {tokenize.COMMENT: "cm", tokenize.STRING: "st", tokenize.NUMBER: "nu"}
for _name in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END"):
    if hasattr(tokenize, _name):
        _TOKEN_CLASS[getattr(tokenize, _name)] = "st"
_BUILTINS = frozenset({"self", "cls", "None", "True", "False", "torch", "tl", "triton"})


def highlight(text: str) -> list[list[Token]]:
    """Split ``text`` into lines of ``Token``s with Python's own tokenizer.

    A text that does not tokenize comes back as plain lines.
    """
    lines = text.splitlines()
    marks: list[list[tuple[int, int, str]]] = [[] for _ in lines]
    try:
        previous = ""
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            cls = _TOKEN_CLASS.get(tok.type, "")
            if tok.type == tokenize.NAME:
                if keyword.iskeyword(tok.string) or keyword.issoftkeyword(tok.string):
                    cls = "kw"
                elif previous in ("def", "class"):
                    cls = "fn"
                elif tok.string in _BUILTINS:
                    cls = "bi"
            if tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
                previous = tok.string
            if not cls:
                continue
            (srow, scol), (erow, ecol) = tok.start, tok.end
            for row in range(srow, erow + 1):
                if row - 1 >= len(lines):
                    break
                start = scol if row == srow else 0
                end = ecol if row == erow else len(lines[row - 1])
                marks[row - 1].append((start, end, cls))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return [[Token("", line)] for line in lines]
    out = []
    for line, spans in zip(lines, marks, strict=True):
        tokens, col = [], 0
        for start, end, cls in sorted(spans):
            if start < col:
                continue
            if start > col:
                tokens.append(Token("", line[col:start]))
            tokens.append(Token(cls, line[start:end]))
            col = end
        if col < len(line):
            tokens.append(Token("", line[col:]))
        out.append(tokens)
    return out


def range_text(lo: int, hi: int) -> str:
    """``lo`` alone, or ``lo–hi``."""
    return str(lo) if lo == hi else f"{lo}–{hi}"


def first_records(trace: Trace) -> list[StepRecord]:
    """One record per step (the first layer's, else whatever layer recorded it), by step."""
    by_step: dict[int, StepRecord] = {}
    primary = trace.layers[0] if trace.layers else None
    for r in trace.records:
        if r.step not in by_step or (r.layer == primary and by_step[r.step].layer != primary):
            by_step[r.step] = r
    return [by_step[s] for s in sorted(by_step)]
