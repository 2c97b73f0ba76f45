"""``pagedtrace show TRACE``: each request's prefix-cache hits and why the rest missed."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table
from rich.text import Text

from pagedtrace.commands import literal
from tracer.format import Trace
from tracer.format.prefix import WHAT_THE_TRACE_CANNOT_SHOW, PrefixExplanation, explain_prefix_cache
from tracer.format.words import snippet


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``show``."""
    p = sub.add_parser(
        "show",
        help="summarise a trace, and explain each request's prefix-cache hits and misses",
        description="A summary of any trace (versions, device, backend, model, KV cache, steps, layers, "
        "gaps, tensors, the replay verdict), then, from the trace alone (block tables, slot mappings and "
        "the prompts `run` records): the tokens each request was served from the prefix cache, the blocks "
        "and the request that wrote them, and why the next block missed.",
    )
    p.add_argument("trace", help="trace directory")
    p.add_argument("--json", action="store_true", help='print {"summary": ..., "requests": [explanations]} as JSON')
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    """Explain and print."""
    from pagedtrace.summary import build_trace_summary_table
    from tracer.format.summary import summarize

    trace = Trace.open(args.trace)
    summary = summarize(trace)
    # No KV-cache spec: no step reached attention's forward (vLLM failed first, say); the summary
    # and its gaps are all there is to show.
    explanations = explain_prefix_cache(trace) if trace.run.kv_cache is not None else None
    if args.json:
        requests = [e.to_json() for e in explanations or ()]
        sys.stdout.write(json.dumps({"summary": summary.to_json(), "requests": requests}, indent=2) + "\n")
        return 0
    console.print(build_trace_summary_table(summary))
    if explanations is None:
        console.print(literal("no prefix-cache table: no step of this trace reached attention (see its gaps)", "dim"))
        return 0
    console.print(build_prefix_table(explanations))
    for line in WHAT_THE_TRACE_CANNOT_SHOW:
        console.print(literal(f"cannot know: {line}", "dim"), soft_wrap=True, highlight=False)
    return 0


def build_prefix_table(explanations: list[PrefixExplanation]) -> Table:
    """One row per request: hits, their blocks and writers, the miss.

    Request ids, labels and the miss's sentence come from the trace: cells are ``Text``, never markup.
    """
    table = Table(title="prefix cache, per request (at its first scheduled step)")
    for col in ("request", "step", "prompt", "cached", "blocks (physical <- writer@step)", "first miss"):
        table.add_column(col, justify="right" if col in ("step", "prompt", "cached") else "left")
    for e in explanations:
        blocks = Text()
        for i, b in enumerate(e.blocks):
            step = b.writer_step if b.writer_step is not None else "?"
            blocks.append(f"{', ' if i else ''}{b.physical}<-{b.writer or '?'}@{step}")
            if b.text is not None:
                blocks.append(f' "{snippet(b.text)}"', "dim")
            if b.same_tokens not in (True, None):
                blocks.append(" (tokens differ!)", "red")
        table.add_row(
            literal(f"{e.label} ({e.request_id})"),
            str(e.first_step),
            "?" if e.prompt_len is None else str(e.prompt_len),
            str(e.cached_tokens),
            blocks or Text("-"),
            Text.assemble((e.miss.kind, "bold"), f": {e.miss.text}"),
        )
    return table
