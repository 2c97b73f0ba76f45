"""Render a trace's view models to a static site and write it.

``build_report(trace_dir, out_dir)`` reads the trace directory alone (no vLLM,
no torch, no GPU), builds the view models (``reports.viewmodel`` and its page modules), renders them
with jinja2 (autoescaping on, undefined names an error) and writes::

    index.html              run summary, KV-cache layout, steps, gaps, files
    tour.html               the reading checklist, linked into the pages
    src-<name>.html         one annotated source per stored vLLM file
    step-NNNNNN.html        one page per request step (the first 200 by default) and a few others
    style.css, report.js    shared assets (package data)

The site needs no server and no network: open ``index.html``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import jinja2

from reports.common import INDEX_PAGE, TOUR_PAGE
from reports.step_pages import MAX_REQUEST_PAGES
from reports.tour import load_reference_source
from reports.viewmodel import Site, build_site
from tracer.format import Trace

#: Files copied verbatim from ``reports/templates`` into every report.
ASSETS = ("style.css", "report.js")


@dataclass(frozen=True)
class BuildResult:
    """What ``write_site`` wrote."""

    index: Path
    pages: int  #: HTML pages written
    largest_page: tuple[str, int]  #: (name, bytes) of the largest HTML page


def make_environment() -> jinja2.Environment:
    """The jinja2 environment: package templates, autoescape on, undefined is an error."""
    return jinja2.Environment(
        loader=jinja2.PackageLoader("reports", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def render_site(site: Site, env: jinja2.Environment | None = None) -> dict[str, str]:
    """Page name -> HTML for every page of ``site``."""
    env = env or make_environment()
    index = env.get_template("index.html")
    source = env.get_template("source.html")
    step = env.get_template("step.html")
    tour = env.get_template("tour.html")
    nav = site.tour.nav
    pages = {INDEX_PAGE: index.render(page=site.index, nav=nav), TOUR_PAGE: tour.render(page=site.tour, nav=nav)}
    for name, source_page in site.sources.items():
        pages[name] = source.render(page=source_page, nav=source_page.nav)
    for name, step_page in site.steps.items():
        pages[name] = step.render(page=step_page, nav=step_page.nav)
    return pages


def write_site(pages: dict[str, str], out_dir: str | os.PathLike[str]) -> BuildResult:
    """Write rendered pages and the assets into ``out_dir`` (created if needed)."""
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
    return BuildResult(out / INDEX_PAGE, len(pages), largest)


def write_report(
    trace_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    max_step_pages: int = MAX_REQUEST_PAGES,
) -> BuildResult:
    """Build the report of ``trace_dir`` into ``out_dir``; return what was written.

    ``max_step_pages`` caps the request steps that get a page of their own (the
    index lists every step either way).

    The trace is opened tolerantly (``strict=False``): a truncated last line is
    listed on the index page instead of failing the build. A directory that is
    not a trace raises ``tracer.format.TraceError``.
    """
    trace = Trace.open(trace_dir, strict=False)
    site = build_site(trace, reference=load_reference_source(), max_step_pages=max_step_pages)
    pages = render_site(site)
    if trace.run.kv_cache is not None and any(r.kind == "request" for r in trace.records):
        from reports.explain_pages import PREFIX_PAGE, render_prefix_page
        from tracer.format.prefix import explain_prefix_cache

        pages[PREFIX_PAGE] = render_prefix_page(explain_prefix_cache(trace), str(trace.path))
    return write_site(pages, out_dir)


def build_report(
    trace_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    max_step_pages: int = MAX_REQUEST_PAGES,
) -> Path:
    """Build the static HTML report of ``trace_dir`` into ``out_dir``; return the path of ``index.html``."""
    return write_report(trace_dir, out_dir, max_step_pages=max_step_pages).index
