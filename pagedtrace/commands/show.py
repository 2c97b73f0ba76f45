"""``pagedtrace show TRACE``: each request's prefix-cache hits and why the rest missed."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from tracer.format import Trace
from tracer.format.prefix import WHAT_THE_TRACE_CANNOT_SHOW, PrefixExplanation, explain_prefix_cache


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``show``."""
    p = sub.add_parser(
        "show",
        help="explain each request's prefix-cache hits and misses",
        description="From the trace alone (block tables, slot mappings and the prompts `run` records): the "
        "tokens each request was served from the prefix cache, the blocks and the request that wrote "
        "them, and why the next block missed.",
    )
    p.add_argument("trace", help="trace directory")
    p.add_argument("--json", action="store_true", help="print the explanations as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    """Explain and print."""
    explanations = explain_prefix_cache(Trace.open(args.trace))
    if args.json:
        sys.stdout.write(json.dumps([e.to_json() for e in explanations], indent=2) + "\n")
        return 0
    console.print(build_prefix_table(explanations))
    for line in WHAT_THE_TRACE_CANNOT_SHOW:
        console.print(f"[dim]cannot know: {line}[/]")
    return 0


def build_prefix_table(explanations: list[PrefixExplanation]) -> Table:
    """One row per request: hits, their blocks and writers, the miss."""
    table = Table(title="prefix cache, per request (at its first scheduled step)")
    for col in ("request", "step", "prompt", "cached", "blocks (physical <- writer@step)", "first miss"):
        table.add_column(col, justify="right" if col in ("step", "prompt", "cached") else "left")
    for e in explanations:
        blocks = ", ".join(
            f"{b.physical}<-{b.writer or '?'}@{b.writer_step if b.writer_step is not None else '?'}"
            + ("" if b.same_tokens in (True, None) else " [red](tokens differ!)[/]")
            for b in e.blocks
        )
        table.add_row(
            f"{e.label} ({e.request_id})",
            str(e.first_step),
            "?" if e.prompt_len is None else str(e.prompt_len),
            str(e.cached_tokens),
            blocks or "-",
            f"[bold]{e.miss.kind}[/]: {e.miss.text}",
        )
    return table
