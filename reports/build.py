"""Render a trace's view models to a static site and write it.

``build_report(trace_dir, out_dir)`` reads the trace directory alone (no vLLM,
no torch, no GPU), builds the view models (``reports.viewmodel`` and its page modules), renders them
with jinja2 (autoescaping on, undefined names an error) and writes::

    index.html              run summary, KV-cache layout, steps, gaps, files
    tour.html               the reading checklist, linked into the pages
    src-<name>.html         one annotated source per stored vLLM file
    step-NNNNNN.html        one page per request step (the first 200 by default) and a few others
    attention-NNNNNN-Lk.html  attention weights of a captured (step, layer), when the caller computed them
    style.css, report.js    shared assets (package data)
    .pagedtrace-report      the marker: what was written (JSON), so that a rebuild removes stale pages

``write_site`` refuses a non-empty directory without the marker (``OutputDirError``) unless
``force``; into an earlier report it writes the new pages and removes the ones the marker
lists that the new report does not have (a step page of another trace, say). It never
removes a file the marker does not list.

The site needs no server and no network: open ``index.html``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import jinja2

from reports.common import INDEX_PAGE, TOUR_PAGE
from reports.environment import make_environment
from reports.explain_pages import PREFIX_PAGE, render_prefix_page
from reports.step_pages import MAX_REQUEST_PAGES
from reports.tour import Command, load_reference_source, plain_command
from reports.viewmodel import Site, build_site
from tracer.format import ReplayReport, Trace
from tracer.format.attention import AttentionMap
from tracer.format.walk import QueryWalk

#: Files copied verbatim from ``reports/templates`` into every report.
ASSETS = ("style.css", "report.js")
#: The file that marks a directory as a pagedtrace report; it lists the files written.
MARKER = ".pagedtrace-report"


class OutputDirError(Exception):
    """The output directory cannot take a report (not empty and not a pagedtrace report, or not a directory)."""


def _marked_files(out: Path) -> list[str] | None:
    """The files an earlier report wrote into ``out`` (None: ``out`` is not a pagedtrace report)."""
    try:
        data = json.loads((out / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, list):
        return None
    # Plain names only: the marker is read back from disk, and must not name files elsewhere.
    return [f for f in files if isinstance(f, str) and f and "/" not in f and "\\" not in f and f not in (".", "..")]


def check_output_dir(out_dir: str | os.PathLike[str], force: bool = False) -> list[str]:
    """Whether a report may be written into ``out_dir``; return the files an earlier report there wrote.

    Raises ``OutputDirError`` for a path that is not a directory, and for a non-empty
    directory that is not a pagedtrace report (no marker) unless ``force``.
    """
    out = Path(out_dir)
    if not out.exists():
        return []
    if not out.is_dir():
        raise OutputDirError(f"{out} exists and is not a directory")
    previous = _marked_files(out)
    if previous is not None:
        return previous
    if any(out.iterdir()) and not force:
        raise OutputDirError(
            f"{out} is not empty and is not a pagedtrace report (no {MARKER}); choose another -o, or --force to "
            "write into it anyway"
        )
    return []


@dataclass(frozen=True)
class BuildResult:
    """What ``write_site`` wrote."""

    index: Path
    pages: int  #: HTML pages written
    largest_page: tuple[str, int]  #: (name, bytes) of the largest HTML page


def render_site(site: Site, env: jinja2.Environment | None = None) -> dict[str, str]:
    """Page name -> HTML for every page of ``site``."""
    env = env or make_environment()
    index = env.get_template("index.html")
    source = env.get_template("source.html")
    step = env.get_template("step.html")
    tour = env.get_template("tour.html")
    attention = env.get_template("attention.html")
    nav = site.tour.nav
    pages = {INDEX_PAGE: index.render(page=site.index, nav=nav), TOUR_PAGE: tour.render(page=site.tour, nav=nav)}
    for name, source_page in site.sources.items():
        pages[name] = source.render(page=source_page, nav=source_page.nav)
    for name, step_page in site.steps.items():
        pages[name] = step.render(page=step_page, nav=step_page.nav)
    if site.prefix is not None:
        pages[PREFIX_PAGE] = render_prefix_page(site.prefix)
    for name, attention_page in site.attention.items():
        pages[name] = attention.render(page=attention_page, nav=attention_page.nav)
    return pages


def write_site(pages: dict[str, str], out_dir: str | os.PathLike[str], *, force: bool = False) -> BuildResult:
    """Write rendered pages and the assets into ``out_dir`` (created if needed), and the marker.

    An earlier report's pages that this one does not have are removed; a non-empty directory
    that is not a report is refused (``OutputDirError``) unless ``force``.
    """
    previous = check_output_dir(out_dir, force)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    templates = resources.files("reports") / "templates"
    for asset in ASSETS:
        (out / asset).write_text(templates.joinpath(asset).read_text(encoding="utf-8"), encoding="utf-8")
    largest = ("", 0)
    for name, html in pages.items():
        data = html.encode("utf-8")
        (out / name).write_bytes(data)
        if len(data) > largest[1]:
            largest = (name, len(data))
    written = [*ASSETS, *pages]
    for stale in sorted(set(previous) - set(written)):
        path = out / stale
        if path.is_file() and not path.is_symlink():
            path.unlink()
    (out / MARKER).write_text(
        json.dumps({"generator": "pagedtrace", "files": sorted(written)}) + "\n", encoding="utf-8"
    )
    return BuildResult(out / INDEX_PAGE, len(pages), largest)


def write_report(
    trace_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    max_step_pages: int = MAX_REQUEST_PAGES,
    walk: QueryWalk | None = None,
    walk_note: str = "",
    replay: ReplayReport | None = None,
    force: bool = False,
    command: Command = plain_command,
    attention: Sequence[AttentionMap] = (),
) -> BuildResult:
    """Build the report of ``trace_dir`` into ``out_dir``; return what was written.

    ``max_step_pages`` caps the request steps that get a page of their own (the
    index lists every step either way). ``walk`` is one query run through the reference
    loop (the tour shows its values; ``walk_note`` says why there is none; neither: the
    walk ``pagedtrace replay`` kept in the trace), ``replay`` verdicts computed in memory
    (shown instead of ``replay.json``): both come from the caller, which may import torch;
    this module never does. ``force``: write into a non-empty directory that is not a
    report. ``command`` spells the command lines the pages suggest. ``attention``: attention
    weights of captured steps (``tracer.format.attention.AttentionMap``, computed by the
    caller): an attention page per (step, layer), linked from the step pages.

    The trace is opened tolerantly (``strict=False``): a truncated last line is
    listed on the index page instead of failing the build. A directory that is
    not a trace raises ``tracer.format.TraceError``.
    """
    check_output_dir(out_dir, force)  # before the work: a refused directory fails fast
    trace = Trace.open(trace_dir, strict=False)
    site = build_site(
        trace,
        reference=load_reference_source(),
        max_step_pages=max_step_pages,
        walk=walk,
        walk_note=walk_note,
        replay=replay,
        command=command,
        attention=attention,
    )
    return write_site(render_site(site), out_dir, force=force)


def build_report(
    trace_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    max_step_pages: int = MAX_REQUEST_PAGES,
) -> Path:
    """Build the static HTML report of ``trace_dir`` into ``out_dir``; return the path of ``index.html``."""
    return write_report(trace_dir, out_dir, max_step_pages=max_step_pages).index
