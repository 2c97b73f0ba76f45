"""``pagedtrace diff A B``: did two engines run the same attention on the same blocks?"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table
from rich.text import Text

from pagedtrace.commands import literal
from tracer.format import Trace
from tracer.format.diff import TraceDiff, diff_traces
from tracer.format.words import snippet


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``diff``."""
    p = sub.add_parser(
        "diff",
        help="compare two traces request by request and step by step",
        description="Align two traces by request (prompt tokens, else ids) and by each request's seq_len; "
        "show what differs: lengths, prefix-cache hits, blocks by content and sharing, slots, layout, "
        "verdicts, and (tensors on both sides) vLLM's outputs per layer and head against the bf16 bar. "
        "Exit code 0: nothing differs; 1: something does; 2: a trace cannot be read.",
    )
    p.add_argument("a", help="first trace directory")
    p.add_argument("b", help="second trace directory")
    p.add_argument("--json", action="store_true", help="print the diff as JSON")
    p.add_argument("--html", metavar="FILE", help="also write the diff as a static HTML page")
    p.add_argument("--no-tensors", dest="tensors", action="store_false", help="compare records only")
    p.set_defaults(func=run)


def compute(a: Trace, b: Trace, tensors: bool = True) -> TraceDiff:
    """The records' diff, with the outputs compared where both traces have tensors."""
    diff = diff_traces(a, b)
    if tensors and any(r.tensors for r in a.records) and any(r.tensors for r in b.records):
        from reference_impl.trace_diff import output_differences

        diff = output_differences(a, b, diff)
    return diff


def run(args: argparse.Namespace, console: Console) -> int:
    """Diff, print (table or JSON), optionally write the page."""
    a, b = Trace.open(args.a), Trace.open(args.b)
    diff = compute(a, b, args.tensors)
    if args.html:
        from reports.explain_pages import write_diff_page

        write_diff_page(diff, args.html)
    if args.json:
        sys.stdout.write(json.dumps(diff.to_json(), indent=2) + "\n")
    else:
        for table in build_diff_tables(diff):
            console.print(table)
        for note in diff.notes:
            console.print(literal(f"note: {note}", "dim"), soft_wrap=True, highlight=False)
        console.print(Text("same", "bold green") if diff.same else Text("differs", "bold yellow"))
    return 0 if diff.same else 1


def build_diff_tables(diff: TraceDiff) -> list[Table]:
    """The run's differences, each request's differing steps, and the output comparison.

    Every cell and title that quotes the traces (paths, request labels, layers, values) is a
    ``Text``: rich never reads it as markup.
    """
    run = Table(title=literal(f"A = {diff.a}   B = {diff.b}   (requests matched by {diff.matched_by})"))
    for col in ("run", "A", "B"):
        run.add_column(col)
    for d in diff.run:
        run.add_row(literal(d.name), literal(d.a), literal(d.b))
    if not diff.run:
        run.add_row("(same engine settings)", "", "")
    steps = Table(title="per request and seq_len: what differs")
    for col in ("request", "seq_len", "step A/B", "field", "A", "B"):
        steps.add_column(col, justify="right" if col == "seq_len" else "left")
    for r in diff.requests:
        label = literal(r.label) if r.text is None else Text.assemble(r.label, (f' "{snippet(r.text)}"', "dim"))
        for p in r.pairs:
            for i, d in enumerate(p.differences):
                head = (label, str(p.seq_len), f"{p.step_a}/{p.step_b}") if i == 0 else ("", "", "")
                steps.add_row(*head, literal(d.name), literal(d.a), literal(d.b))
        if r.only_a or r.only_b:
            steps.add_row(label, "", "", "seq_lens on one side only", literal(list(r.only_a)), literal(list(r.only_b)))
    tables = [run, steps]
    if diff.outputs:
        out = Table(title="vLLM's outputs, A vs B (common query positions), per layer")
        for col in ("request", "step A/B", "positions", "layer", "worst head", "max |A-B|", "bar", "verdict"):
            out.add_column(col)
        for o in diff.outputs:
            worst = max(range(len(o.max_abs)), key=lambda h: o.max_abs[h] - o.bar[h])
            out.add_row(
                literal(o.label),
                f"{o.step_a}/{o.step_b}",
                f"{o.positions[0]}-{o.positions[1] - 1}",
                literal(o.layer),
                str(worst),
                f"{o.max_abs[worst]:.3g}",
                f"{o.bar[worst]:.3g}",
                Text("within", "green") if o.ok else Text("OVER", "red"),
            )
        tables.append(out)
    return tables
