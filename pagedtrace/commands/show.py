"""``pagedtrace show TRACE``: each request's prefix-cache hits and why the rest missed."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table
from rich.text import Text

from pagedtrace.commands import add_lax, literal, open_trace
from pagedtrace.terminal import Elided, elide, row_limit
from tracer.format import layer_index
from tracer.format.groups import TraceGroups, trace_groups
from tracer.format.prefix import WHAT_THE_TRACE_CANNOT_SHOW, PrefixExplanation, explain_prefix_cache_by_group
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
    add_lax(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    """Explain and print."""
    from pagedtrace.summary import build_trace_summary_table
    from tracer.format.summary import summarize

    trace = open_trace(args.trace, args)
    summary = summarize(trace)
    # No KV-cache spec: no step reached attention's forward (vLLM failed first, say); the summary
    # and its gaps are all there is to show.
    groups = trace_groups(trace)
    by_group = explain_prefix_cache_by_group(trace, groups) if trace.run.kv_cache is not None else None
    if args.json:
        requests = [e.to_json() for e in by_group[0].explanations] if by_group else []
        kv_groups = {
            "source": groups.source,
            "recorded": groups.recorded,
            "null_block": groups.null_block,
            "groups": [g.to_json() for g in groups.groups],
        }
        out = {
            "summary": summary.to_json(),
            "kv_cache_groups": kv_groups,
            "requests": requests,
            "requests_by_group": [g.to_json() for g in by_group or ()],
        }
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
        return 0
    console.print(build_trace_summary_table(summary))
    console.print(build_groups_table(groups, trace.layers))
    for line in group_differences(groups, trace.layers):
        console.print(literal(line), soft_wrap=True, highlight=False)
    if by_group is None:
        console.print(literal("no prefix-cache table: no step of this trace reached attention (see its gaps)", "dim"))
        return 0
    for group in by_group:
        console.print(build_prefix_table(list(group.explanations), limit=row_limit(args), group=group.label))
    for line in WHAT_THE_TRACE_CANNOT_SHOW:
        console.print(literal(f"cannot know: {line}", "dim"), soft_wrap=True, highlight=False)
    return 0


def build_prefix_table(explanations: list[PrefixExplanation], limit: int | None = None, group: str = "") -> Table:
    """One row per request: hits, their blocks and writers, the miss; ``group`` names the KV-cache group read.

    More than ``limit`` requests: the first and last ones, and a row counting the rest.

    Request ids, labels and the miss's sentence come from the trace: cells are ``Text``, never markup.
    """
    title = "prefix cache, per request (at its first scheduled step)"
    table = Table(title=literal(f"{title}, {group}" if group else title))
    for col in ("request", "step", "prompt", "cached", "blocks (physical <- writer@step)", "first miss"):
        table.add_column(col, justify="right" if col in ("step", "prompt", "cached") else "left")
    for e in elide(explanations, limit):
        if isinstance(e, Elided):
            table.add_row(literal(f"… {e.count} more requests (--verbose shows them)", "dim"), "", "", "", "", "")
            continue
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


def _layers_text(names: tuple[str, ...], limit: int = 8) -> str:
    """``0, 2, 4, ... 40 (21 layers)``: layer indices where the names have them."""
    shown = [str(i) if (i := layer_index(n)) is not None else n for n in names]
    text = ", ".join(shown[:limit]) + (f", ... {shown[-1]}" if len(shown) > limit else "")
    return f"{text} ({len(names)} layer{'s' if len(names) != 1 else ''})"


def build_groups_table(groups: TraceGroups, captured: list[str]) -> Table:
    """One row per KV-cache group: its spec, window, block size, layers and the layers the trace captured."""
    table = Table(title=literal(f"KV-cache groups: {groups.source}; null block {groups.null_block}"))
    for col in ("group", "kind", "spec", "window", "block size", "layers", "captured"):
        table.add_column(col, justify="right" if col in ("group", "block size") else "left")
    for g in groups.groups:
        window = "-" if g.sliding_window is None else f"{g.sliding_window} tokens"
        if g.attention_chunk_size is not None:
            window = f"chunks of {g.attention_chunk_size}"
        mine = tuple(n for n in captured if n in g.layer_names)
        table.add_row(
            str(g.group),
            g.kind,
            literal(g.spec),
            window,
            str(g.block_size),
            literal(_layers_text(g.layer_names)),
            literal(_layers_text(mine) if mine else "-"),
        )
    return table


def group_differences(groups: TraceGroups, captured: list[str]) -> list[str]:
    """Why the captured layers of different groups read different block tables: one line per pair of groups."""
    firsts: dict[int, str] = {}
    for name in captured:
        g = groups.of_layer(name)
        if g is not None:
            firsts.setdefault(g.group, name)
    names = list(firsts.values())
    return [f"tables differ: {groups.why_tables_differ(names[0], other)}" for other in names[1:]]
