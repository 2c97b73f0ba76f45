"""Static HTML reports of a trace: view models, then templates.

jinja2 only (plus ``annotations`` and ``tracer.format`` (the bottom layer));
a report builds from a trace directory alone.

* ``viewmodel``: ``build_site(trace) -> Site``, assembled from one module per page family
  (``common``, ``verdicts``, ``layout_view``, ``index_page``, ``source_pages``,
  ``step_pages``, ``tour``): pure functions from a ``Trace`` to page dataclasses;
* ``build``: ``build_report(trace_dir, out_dir) -> Path`` renders and writes them.
"""

from reports.build import BuildResult, build_report, render_site, write_report
from reports.viewmodel import Site, build_site

__all__ = ["BuildResult", "Site", "build_report", "build_site", "render_site", "write_report"]
