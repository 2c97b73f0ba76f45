"""The README and ``docs/``: every relative link resolves, and the README stays a front door.

A link is ``[text](target)`` or ``![alt](target)`` outside code. A relative target must name an
existing file or directory (relative to the page that links it); a ``#fragment`` on a Markdown
target must be one of that page's headings, as GitHub makes anchors of them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]

#: The README is a front door (coverage.py's is 7 KB): the manual lives in ``docs/``.
README_MAX_BYTES = 12_500

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
EXTERNAL = ("http://", "https://", "mailto:", "ftp://")


def _without_code(text: str) -> str:
    """``text`` with fenced blocks and inline code removed (their brackets are not links)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def links(page: Path) -> list[str]:
    """The link targets of a Markdown page, in order."""
    return LINK.findall(_without_code(page.read_text(encoding="utf-8")))


def anchors(page: Path) -> set[str]:
    """The anchors GitHub makes of ``page``'s headings: lower case, punctuation dropped, spaces to hyphens."""
    found: set[str] = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in found:
            n += 1
            anchor = f"{slug}-{n}"
        found.add(anchor)
    return found


def _shown(path: Path) -> Path:
    """``path`` relative to the repository when it lies inside it."""
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def broken_links(page: Path) -> list[str]:
    """``page``'s relative links whose file, directory or heading does not exist, each with why."""
    broken = []
    for target in links(page):
        if target.startswith(EXTERNAL):
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file {_shown(dest)}")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no heading #{fragment} in {_shown(dest)}")
    return broken


def test_there_are_docs():
    assert README.is_file() and len(PAGES) > 5, PAGES


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_readme_is_a_front_door():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; move detail into docs/"


def test_readme_links_every_docs_page():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in links(README) if not t.startswith(EXTERNAL)}
    assert [p.name for p in DOCS.glob("*.md") if p.resolve() not in linked] == []


def test_the_checker_sees_a_broken_link(tmp_path):
    (tmp_path / "there.md").write_text("# A heading, with `code`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md) [ok](there.md#a-heading-with-code) [ok](https://example.com/x)\n"
        "`[not a link](nowhere.md)`\n```\n[not a link](nowhere.md)\n```\n"
        "[gone](gone.md) [bad anchor](there.md#nope) ![img](img.png)\n"
    )
    assert [b.split(":")[0] for b in broken_links(page)] == ["gone.md", "there.md#nope", "img.png"]
