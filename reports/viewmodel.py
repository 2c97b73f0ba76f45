"""Pure functions from a ``Trace`` to view-model dataclasses: the whole site, assembled.

Templates only loop and branch over what is built here: every number is
formatted, every link computed, every drawing laid out (SVG boxes with
coordinates) before a template sees it. Nothing here writes files or builds
HTML; ``reports.build`` renders and writes.

One module per page family builds its pages; this one puts them together:

* ``reports.common``: links, rows, verdicts, page names, syntax highlighting;
* ``reports.verdicts``: ``replay.json``, read through ``tracer.format.ReplayReport``;
* ``reports.layout_view``: the KV-cache layout drawing;
* ``reports.index_page``, ``reports.source_pages``, ``reports.step_pages``, ``reports.tour``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from annotations.anchors import ANNOTATED_FILES
from annotations.annotate import annotate_file
from annotations.locate import LocatedSource, locate
from reports.attention_pages import MAX_ATTENTION_PAGES, AttentionPage, attention_page, attention_page_name
from reports.common import INDEX_PAGE, TOUR_PAGE, Link, first_records, source_file_page, step_page
from reports.explain_pages import PREFIX_PAGE, PrefixView, build_prefix_view
from reports.index_page import IndexPage, index_page
from reports.source_pages import SourcePage, source_page
from reports.step_pages import MAX_REQUEST_PAGES, StepPage, pages_for_steps, step_view
from reports.tour import Command, TourPage, plain_command, stored_walk, tour_page
from reports.verdicts import IN_MEMORY, ReplayData, read_replay, replay_data
from tracer.format import MetadataCheck, ReplayReport, StepRecord, Trace
from tracer.format.attention import AttentionMap
from tracer.format.groups import TraceGroups, trace_groups
from tracer.format.metadata import check_records
from tracer.format.prefix import explain_prefix_cache_by_group
from tracer.format.walk import QueryWalk
from tracer.format.words import Words

__all__ = ["Site", "build_site", "navigation"]


@dataclass(frozen=True)
class Site:
    """Every page of a report."""

    index: IndexPage
    sources: dict[str, SourcePage]  #: page name -> page
    steps: dict[str, StepPage]  #: page name -> page
    tour: TourPage
    prefix: PrefixView | None = None  #: ``prefix.html``: the trace's prefix-cache hits and misses
    attention: dict[str, AttentionPage] = field(default_factory=dict)  #: page name -> page


def navigation(located: dict[str, LocatedSource], prefix: bool = False) -> tuple[Link, ...]:
    """The top bar: index, tour, the prefix-cache page (``prefix``), one link per stored source."""
    return (
        Link(INDEX_PAGE, "index"),
        Link(TOUR_PAGE, "tour"),
        *((Link(PREFIX_PAGE, "prefix cache"),) if prefix else ()),
        *(Link(source_file_page(p), p.rsplit("/", 1)[-1]) for p in ANNOTATED_FILES if p in located),
    )


def build_site(
    trace: Trace,
    reference: tuple[str, str, int] | None = None,
    max_step_pages: int = MAX_REQUEST_PAGES,
    *,
    walk: QueryWalk | None = None,
    walk_note: str = "",
    replay: ReplayReport | None = None,
    command: Command = plain_command,
    attention: Sequence[AttentionMap] = (),
) -> Site:
    """All view models of a report for ``trace``.

    ``reference`` is the tour's kernel source (``load_reference_source()``), if any;
    ``max_step_pages`` caps the request steps that get a page. ``walk``: one query run
    through the reference loop, for the tour (``walk_note``: why there is none). ``replay``:
    verdicts computed in memory, shown instead of the trace's ``replay.json``. ``command``
    spells the ``pagedtrace`` command lines the pages suggest (the CLI passes its parser's).
    ``attention``: the weights of captured steps (``reference_impl.attention_weights``, from the
    CLI), one page per (step, layer), the first ``MAX_ATTENTION_PAGES``, each linked from its
    step's page.
    """
    verdicts = read_replay(trace) if replay is None else replay_data(replay, IN_MEMORY)
    if walk is None and not walk_note:
        walk, walk_note = stored_walk(trace, command)
    texts = {p: t for p in ANNOTATED_FILES if (t := trace.source(p)) is not None}
    located = {p: locate(t, p) for p, t in texts.items()}
    groups = trace_groups(trace)
    explained = (
        explain_prefix_cache_by_group(trace, groups)
        if trace.run.kv_cache is not None and any(r.kind == "request" for r in trace.records)
        else None
    )
    hits = {e.first_step for e in (explained[0].explanations if explained else ()) if e.cached_tokens > 0}
    nav = navigation(located, prefix=explained is not None)
    records = first_records(trace)
    paged = pages_for_steps(trace.records, max_step_pages)
    default = next((i for i, r in enumerate(records) if r.kind == "request"), 0 if records else None)
    sources = {
        source_file_page(p): source_page(
            annotate_file(t, p, trace.run, records, located[p]), default, len(trace.layers), nav, paged
        )
        for p, t in texts.items()
    }
    layers_by_step: dict[int, list[str]] = {}
    for r in trace.records:
        layers_by_step.setdefault(r.step, []).append(r.layer)
    by_step = verdicts.by_step
    paged_records = [r for r in records if r.step in paged]
    source_links = tuple(link for link in nav if link.href.startswith("src-"))
    metadata = _step_metadata(trace, verdicts, {r.step for r in paged_records})
    attention_pages = _attention_pages(attention, nav)
    attention_links: dict[int, list[Link]] = {}
    for name, page in attention_pages.items():
        attention_links.setdefault(page.step, []).append(Link(name, page.layer))
    words = Words.of(trace)
    steps = {}
    for i, r in enumerate(paged_records):
        prev = paged_records[i - 1].step if i > 0 else None
        nxt = paged_records[i + 1].step if i + 1 < len(paged_records) else None
        steps[step_page(r.step)] = step_view(
            r,
            trace.run,
            tuple(layers_by_step[r.step]),
            by_step.get(r.step, []),
            prev,
            nxt,
            nav,
            *metadata[r.step],
            sources=source_links,
            prefix=Link(PREFIX_PAGE, "the prefix-cache hits of this step's requests") if r.step in hits else None,
            groups=groups,
            group_records=_other_groups(trace, r, groups),
            attention=attention_links.get(r.step, ()),
            words=words,
        )
    return Site(
        index=index_page(trace, verdicts, located, paged),
        sources=sources,
        steps=steps,
        tour=tour_page(trace, located, paged, reference, nav, walk, walk_note, command),
        prefix=None if explained is None else build_prefix_view(explained, str(trace.path), nav),
        attention=attention_pages,
    )


def _other_groups(trace: Trace, record: StepRecord, groups: TraceGroups) -> list[StepRecord]:
    """One record of each KV-cache group other than ``record``'s at its step (each gets a grid)."""
    seen = {getattr(groups.of_record(record), "group", None)}
    out = []
    for r in trace.records:
        if r.step == record.step and r is not record:
            group = groups.of_record(r)
            if group is not None and group.group not in seen:
                seen.add(group.group)
                out.append(r)
    return out


def _attention_pages(maps: Sequence[AttentionMap], nav: tuple[Link, ...]) -> dict[str, AttentionPage]:
    """One page per (step, layer) of ``maps``, the first ``MAX_ATTENTION_PAGES``."""
    by_page: dict[str, list[AttentionMap]] = {}
    for m in maps:
        name = attention_page_name(m.step, m.layer)
        if name in by_page or len(by_page) < MAX_ATTENTION_PAGES:
            by_page.setdefault(name, []).append(m)
    return {name: attention_page(ms, nav) for name, ms in by_page.items()}


def _step_metadata(trace: Trace, replay: ReplayData, steps: set[int]) -> dict[int, tuple[list[MetadataCheck], str]]:
    """Per paged step: its metadata checks and where they come from.

    From ``replay.json`` when it has them; else computed now (they need no tensors, nor torch).
    """
    out: dict[int, tuple[list[MetadataCheck], str]] = {}
    for step in steps:
        saved = replay.metadata_by_step.get(step)
        if saved:
            out[step] = (saved, f"from {replay.origin}")
    todo = [r for r in trace.records if r.step in steps and r.step not in out]
    for check in check_records(trace, todo):
        out.setdefault(check.step, ([], "computed now: replay.json has none"))[0].append(check)
    for step in steps:
        out.setdefault(step, ([], ""))
    return out
