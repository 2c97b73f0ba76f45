"""``pagedtrace export TRACE --perfetto out.json``: the trace as a Perfetto / Chrome timeline."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.text import Text

from pagedtrace.commands import add_lax, open_trace
from tracer.format.timeline import timeline


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``export``."""
    p = sub.add_parser(
        "export",
        help="export a trace as a timeline (Chrome trace-event JSON, opens in Perfetto)",
        description="One track per request (prefill/decode slices, blocks allocated, shared, released), one "
        "slice per step and layer with its metadata as args, and the gaps. Time is the step index "
        "(1 ms per step): the trace records no clock.",
    )
    p.add_argument("trace", help="trace directory")
    p.add_argument("--perfetto", required=True, metavar="FILE", help="JSON file to write")
    add_lax(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    """Write the timeline and say how many events it has."""
    from pagedtrace.cli import UsageError

    data = timeline(open_trace(args.trace, args))
    try:
        Path(args.perfetto).write_text(json.dumps(data) + "\n", encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write {args.perfetto}: {exc.strerror or exc}") from None
    console.print(  # the path is the user's: Text, never markup
        Text.assemble(
            ("timeline written:", "bold green"),
            f" {args.perfetto} ({len(data['traceEvents'])} events; open it at ui.perfetto.dev)",
        ),
        soft_wrap=True,
        highlight=False,
    )
    return 0
