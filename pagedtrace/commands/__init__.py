"""One module per ``pagedtrace`` subcommand: ``add_parser(subparsers)`` and ``run(args, console) -> int``.

Strings from a trace, a path or the user (layer names, model names, paths, messages) are
untrusted: rich would read ``[/x]`` in them as markup (a ``MarkupError``) and ``[link=...]``
as a terminal hyperlink. Commands print them through :func:`literal` (a ``Text``, which
rich never parses), and keep markup for their own fixed words only.
"""

from __future__ import annotations

import argparse
import os

from rich.text import Text

from tracer.format import Trace, layer_index


def short_layer(name: str) -> str:
    """``model.layers.7.self_attn.attn`` -> ``L7`` for narrow terminal tables; other names unchanged."""
    index = layer_index(name)
    return f"L{index}" if index is not None else name


def literal(value: object, style: str = "") -> Text:
    """``value`` as text printed exactly as written: no markup, no emoji codes."""
    return Text(str(value), style=style)


def add_lax(parser: argparse.ArgumentParser) -> None:
    """``--lax`` on a command that reads traces."""
    parser.add_argument(
        "--lax",
        action="store_true",
        help="read the valid part of a damaged trace (a cut or bad line in steps.jsonl) and say on stderr "
        "what was skipped; without it such a trace is an error (exit 2)",
    )


def open_trace(path: str | os.PathLike[str], args: argparse.Namespace) -> Trace:
    """``Trace.open(path)``, tolerant with ``--lax``: then each skipped part is one warning on stderr."""
    from pagedtrace.terminal import warn

    trace = Trace.open(path, strict=not getattr(args, "lax", False))
    for problem in trace.problems:
        warn(f"skipped: {problem}")
    return trace


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An argparse type: an integer of at least 0."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{value}: must be {'positive' if least else '0 or more'}")
    return value
