"""Pages that explain what the engine did: the trace diff, one query's walk, the prefix cache.

Each is one self-contained static HTML file (inline CSS, no script): a pure function builds
its view model from the bottom layer's records (:class:`~tracer.format.diff.TraceDiff`,
:class:`~tracer.format.walk.QueryWalk`, :class:`~tracer.format.prefix.PrefixExplanation`),
and a template only loops over it. ``pagedtrace diff --html``, ``pagedtrace step --html``
and the report's ``prefix.html`` write them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from reports.common import Link
from reports.environment import make_environment
from tracer.format.diff import TraceDiff
from tracer.format.prefix import WHAT_THE_TRACE_CANNOT_SHOW, GroupPrefix, PrefixExplanation
from tracer.format.walk import QueryWalk
from tracer.format.words import snippet

__all__ = [
    "PREFIX_PAGE",
    "build_diff_view",
    "build_prefix_view",
    "build_stepper_view",
    "render_prefix_page",
    "write_diff_page",
    "write_stepper_page",
]

#: Characters of a cached block's words shown on the prefix-cache page (the tooltip has them all).
PREFIX_SNIPPET_CHARS = 24
#: The prefix-cache page's name inside a report.
PREFIX_PAGE = "prefix.html"


def _g(x: float) -> str:
    return f"{x:.6g}"


@dataclass(frozen=True)
class BlockRow:
    """One row of the block-loop table; ``*_exact`` carry full precision for checks."""

    j: int
    cells: tuple[str, ...]
    m_exact: str
    l_exact: str
    rescale_exact: str
    words: str = ""  #: a snippet of the words the block's keys are ("" without token text)
    text: str = ""  #: all of them, for the tooltip


@dataclass(frozen=True)
class StepperView:
    """The walk page."""

    title: str
    subtitle: str
    block_header: tuple[str, ...]
    block_rows: tuple[BlockRow, ...]
    kernel_lines: tuple
    partition_size: int
    partition_rows: tuple[tuple[str, ...], ...]
    lse: str
    loop_vs_partitioned: str
    head: int
    dims: tuple[int, ...]
    ours: tuple[str, ...]
    vllm: tuple[str, ...]
    output_norm: str
    vllm_norm: str
    max_abs: str
    tolerance: str
    ok: bool
    has_words: bool = False  #: the trace records token text: the block rows show words


def build_stepper_view(walk: QueryWalk) -> StepperView:
    """The walk as strings for the template."""
    rows = tuple(
        BlockRow(
            j=b.logical,
            cells=(
                str(b.logical),
                str(b.physical),
                f"{b.positions[0]}–{b.positions[1] - 1}",
                str(b.n_valid),
                str(b.n_visible),
                _g(b.block_max),
                _g(b.m),
                _g(b.rescale),
                _g(b.l),
                _g(b.acc_norm),
            ),
            m_exact=repr(b.m),
            l_exact=repr(b.l),
            rescale_exact=repr(b.rescale),
            words=snippet(b.text, PREFIX_SNIPPET_CHARS) if b.text else "",
            text=b.text or "",
        )
        for b in walk.blocks
    )
    return StepperView(
        title=f"Step {walk.step}, request {walk.request_id}, head {walk.head}: the online softmax block by block",
        subtitle=(
            f"{walk.layer}; query {walk.token} of the request"
            + (f" ({walk.query_text!r})" if walk.query_text is not None else "")
            + f" (position {walk.position}, seq_len {walk.seq_len}); "
            f"query head {walk.head} reads KV head {walk.kv_head}; block size {walk.block_size}; "
            f"scale {_g(walk.scale)}; computed in {walk.compute_dtype} from the captured tensors of {walk.trace}"
        ),
        block_header=("j", "physical", "positions", "valid", "visible", "block max", "m", "rescale", "l", "‖acc‖"),
        block_rows=rows,
        kernel_lines=walk.kernel_lines,
        partition_size=walk.partition_size,
        partition_rows=tuple(
            (f"{p.blocks[0]}–{p.blocks[1] - 1}", _g(p.m), _g(p.l), _g(p.lse), _g(p.weight)) for p in walk.partitions
        ),
        lse=_g(walk.lse),
        loop_vs_partitioned=f"{walk.loop_vs_partitioned:.2g}",
        head=walk.head,
        dims=tuple(range(len(walk.output_head))),
        ours=tuple(f"{x:.5f}" for x in walk.output_head),
        vllm=tuple(f"{x:.5f}" for x in walk.vllm_head),
        output_norm=_g(walk.output_norm),
        vllm_norm=_g(walk.vllm_norm),
        max_abs=f"{walk.max_abs:.3g}",
        tolerance=f"{walk.tolerance:.3g}",
        ok=walk.ok,
        has_words=any(b.text is not None for b in walk.blocks),
    )


def write_stepper_page(walk: QueryWalk, path: str | os.PathLike[str]) -> Path:
    """Render the walk into one HTML file."""
    html = make_environment().get_template("stepper.html").render(page=build_stepper_view(walk))
    out = Path(path)
    out.write_text(html, encoding="utf-8")
    return out


@dataclass(frozen=True)
class DiffRow:
    """One row of the per-request table."""

    cells: tuple[str, ...]
    changed: bool


@dataclass(frozen=True)
class DiffView:
    """The diff page."""

    title: str
    a: str
    b: str
    matched_by: str
    same: bool
    notes: tuple[str, ...]
    run: tuple[tuple[str, str, str], ...]
    rows: tuple[DiffRow, ...]
    outputs: tuple[tuple[str, ...], ...]


def build_diff_view(diff: TraceDiff) -> DiffView:
    """The diff as strings for the template."""
    rows = []
    for r in diff.requests:
        label = r.label if r.text is None else f'{r.label} "{snippet(r.text)}"'
        for p in r.pairs:
            if not p.differences:
                rows.append(DiffRow((label, str(p.seq_len), f"{p.step_a}/{p.step_b}", "(nothing)", "", ""), False))
            for i, d in enumerate(p.differences):
                head = (label, str(p.seq_len), f"{p.step_a}/{p.step_b}") if i == 0 else ("", "", "")
                rows.append(DiffRow((*head, d.name, str(d.a), str(d.b)), True))
        if r.only_a or r.only_b:
            rows.append(DiffRow((label, "", "", "seq_lens on one side only", str(r.only_a), str(r.only_b)), True))
    outputs = []
    for o in diff.outputs:
        worst = max(range(len(o.max_abs)), key=lambda h: o.max_abs[h] - o.bar[h])
        outputs.append(
            (
                o.label,
                f"{o.step_a}/{o.step_b}",
                f"{o.positions[0]}–{o.positions[1] - 1}",
                o.layer,
                str(worst),
                f"{o.max_abs[worst]:.3g}",
                f"{o.bar[worst]:.3g}",
                "within" if o.ok else "OVER",
            )
        )
    return DiffView(
        title="pagedtrace diff",
        a=diff.a,
        b=diff.b,
        matched_by=diff.matched_by,
        same=diff.same,
        notes=diff.notes,
        run=tuple((d.name, str(d.a), str(d.b)) for d in diff.run),
        rows=tuple(rows),
        outputs=tuple(outputs),
    )


def write_diff_page(diff: TraceDiff, path: str | os.PathLike[str]) -> Path:
    """Render the diff into one HTML file."""
    html = make_environment().get_template("diff.html").render(page=build_diff_view(diff))
    out = Path(path)
    out.write_text(html, encoding="utf-8")
    return out


@dataclass(frozen=True)
class PrefixBlock:
    """One cached block of a request: ``physical ← writer @ step``, a snippet of its words, its whole text."""

    text: str
    words: str  #: a snippet of the words it holds ("" without token text)
    title: str  #: the tooltip: the block's whole text


@dataclass(frozen=True)
class PrefixRow:
    """One request of the prefix-cache table."""

    request: str
    step: int
    prompt: str
    cached: int
    blocks: tuple[PrefixBlock, ...]
    kind: str
    text: str


@dataclass(frozen=True)
class PrefixSection:
    """One KV-cache group's prefix-cache table."""

    label: str  #: the group ("" when the trace has one)
    layer: str  #: the layer whose block table was read
    rows: tuple[PrefixRow, ...]


@dataclass(frozen=True)
class PrefixView:
    """The prefix-cache page: a table per KV-cache group."""

    title: str
    sections: tuple[PrefixSection, ...]
    cannot_know: tuple[str, ...]
    nav: tuple[Link, ...] = ()  #: the report's top bar


def build_prefix_view(groups: list[GroupPrefix], trace_name: str, nav: tuple[Link, ...] = ()) -> PrefixView:
    """The explanations of each group as strings for the template."""
    sections = tuple(PrefixSection(g.label, g.layer, _prefix_rows(g.explanations)) for g in groups)
    return PrefixView(f"Prefix cache: {trace_name}", sections, WHAT_THE_TRACE_CANNOT_SHOW, nav)


def _prefix_rows(explanations: tuple[PrefixExplanation, ...]) -> tuple[PrefixRow, ...]:
    return tuple(
        PrefixRow(
            request=f"{e.label} ({e.request_id})",
            step=e.first_step,
            prompt="?" if e.prompt_len is None else str(e.prompt_len),
            cached=e.cached_tokens,
            blocks=tuple(
                PrefixBlock(
                    f"{b.physical} ← {b.writer or '?'} @ {'?' if b.writer_step is None else b.writer_step}"
                    + (" (tokens differ!)" if b.same_tokens is False else ""),
                    snippet(b.text, PREFIX_SNIPPET_CHARS) if b.text else "",
                    b.text or "",
                )
                for b in e.blocks
            ),
            kind=e.miss.kind,
            text=e.miss.text,
        )
        for e in explanations
    )


def render_prefix_page(page: PrefixView) -> str:
    """The prefix-cache page's HTML, with the report's top bar."""
    return make_environment().get_template("prefix.html").render(page=page, nav=page.nav)
