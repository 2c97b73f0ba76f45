"""The jinja2 environment every page is rendered with: package templates, autoescape, strict names.

One factory for the site (``reports.build``) and the self-contained pages
(``reports.explain_pages``), so that both render under the same rules.
"""

from __future__ import annotations

import jinja2

__all__ = ["make_environment"]


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
