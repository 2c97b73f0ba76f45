"""``pagedtrace diff A B``: did two engines run the same attention on the same blocks?"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table
from rich.text import Text

from pagedtrace.commands import add_lax, literal, open_trace
from tracer.format import Trace
from tracer.format.diff import CACHED_FACT, TraceDiff, diff_traces
from tracer.format.words import snippet


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``diff``."""
    p = sub.add_parser(
        "diff",
        help="compare two traces request by request and step by step",
        description="Align two traces by request (prompt tokens, else ids) and by each request's seq_len; "
        "show what differs: lengths, prefix-cache hits, blocks by content and sharing, slots, layout, "
        "verdicts (when both were replayed), and (tensors on both sides) vLLM's outputs per layer and head "
        "against replay's bar. The answer comes first (one line when nothing differs), then only what differs. "
        "Exit code 0: nothing differs; 1: something does; 2: a trace cannot be read.",
    )
    p.add_argument("a", help="first trace directory")
    p.add_argument("b", help="second trace directory")
    p.add_argument("--json", action="store_true", help="print the diff as JSON")
    p.add_argument("--html", metavar="FILE", help="also write the diff as a static HTML page")
    p.add_argument("--no-tensors", dest="tensors", action="store_false", help="compare records only")
    add_lax(p)
    p.set_defaults(func=run)


def compute(a: Trace, b: Trace, tensors: bool = True) -> TraceDiff:
    """The records' diff, with the outputs compared where both traces have tensors."""
    diff = diff_traces(a, b)
    if tensors and any(r.tensors for r in a.records) and any(r.tensors for r in b.records):
        from reference_impl.trace_diff import output_differences

        diff = output_differences(a, b, diff)
    return diff


def run(args: argparse.Namespace, console: Console) -> int:
    """Diff, print (the answer first, then only what differs; or JSON), optionally write the page."""
    a, b = open_trace(args.a, args), open_trace(args.b, args)
    diff = compute(a, b, args.tensors)
    if args.html:
        from reports.explain_pages import write_diff_page

        write_diff_page(diff, args.html)
    if args.json:
        sys.stdout.write(json.dumps(diff.to_json(), indent=2) + "\n")
        return 0 if diff.same else 1
    for line in summary_lines(diff):
        console.print(line, soft_wrap=True, highlight=False)
    if not diff.same:
        for table in build_diff_tables(diff):
            console.print(table)
        for note in diff.notes:
            console.print(literal(f"note: {note}", "dim"), soft_wrap=True, highlight=False)
    return 0 if diff.same else 1


def _pairs_compared(diff: TraceDiff) -> int:
    return sum(len(r.pairs) for r in diff.requests)


def summary_lines(diff: TraceDiff) -> list[Text]:
    """The answer: one line when nothing differs, else what differs, one line per kind of difference.

    Run settings, requests matched, prefix-cache hits (tokens cached at a request's first step),
    blocks and slots (aligned steps that differ), outputs beyond the bar.
    """
    matched = f"{len(diff.requests)} requests matched by {diff.matched_by}"
    compared = f"{_pairs_compared(diff)} aligned steps"
    outputs = f", {len(diff.outputs)} outputs within the bar" if diff.outputs else ""
    if diff.same:
        return [Text.assemble(("same", "bold green"), f": {matched}, {compared}, nothing differs{outputs}")]
    lines = [Text.assemble(("differs", "bold yellow"), literal(f": A = {diff.a}, B = {diff.b}"))]
    if diff.run:
        settings = "; ".join(f"{d.name} {d.a} vs {d.b}" for d in diff.run)
        lines.append(literal(f"  run settings: {settings}"))
    unmatched = ""
    if diff.unmatched_a or diff.unmatched_b:
        unmatched = (
            f"; only in A: {', '.join(diff.unmatched_a) or '-'}; only in B: {', '.join(diff.unmatched_b) or '-'}"
        )
    lines.append(literal(f"  requests: {matched}{unmatched}"))
    hits = []
    for r in diff.requests:
        first = r.pairs[0] if r.pairs else None
        cached = next((d for d in first.differences if d.name == CACHED_FACT), None) if first else None
        if cached is not None:
            hits.append(f"{r.label} {cached.a} vs {cached.b} tokens")
    if hits:
        lines.append(literal(f"  prefix-cache hits at a request's first step: {', '.join(hits)}"))
    differing = [(r, p) for r in diff.requests for p in r.pairs if p.differences]
    if differing or any(r.only_a or r.only_b for r in diff.requests):
        requests = len({r.label for r, _ in differing})
        lines.append(
            literal(
                f"  blocks, slots and lengths: {len(differing)} of {_pairs_compared(diff)} aligned steps differ "
                f"({requests} requests)"
            )
        )
    if diff.outputs:
        over = sum(not o.ok for o in diff.outputs)
        text = f"{over} of {len(diff.outputs)} beyond the bar" if over else f"all {len(diff.outputs)} within the bar"
        lines.append(literal(f"  vLLM's outputs (common query positions, per layer): {text}"))
    return lines


def _runs(request) -> list[tuple[str, int, int, str, str, str, str]]:
    """Each field's differences, consecutive aligned steps with the same values folded into one row.

    Rows: (field, first seq_len, last seq_len, steps A, steps B, A, B).
    """
    rows: list[tuple[str, int, int, str, str, str, str]] = []
    open_rows: dict[str, int] = {}  # field -> index in rows of its run, while the run goes on
    for p in request.pairs:
        seen = set()
        for d in p.differences:
            a, b = str(d.a), str(d.b)
            seen.add(d.name)
            i = open_rows.get(d.name)
            if i is not None and rows[i][5:] == (a, b):
                name, lo, _, sa, sb, _, _ = rows[i]
                rows[i] = (
                    name,
                    lo,
                    p.seq_len,
                    f"{sa.split('-')[0]}-{p.step_a}",
                    f"{sb.split('-')[0]}-{p.step_b}",
                    a,
                    b,
                )
            else:
                open_rows[d.name] = len(rows)
                rows.append((d.name, p.seq_len, p.seq_len, str(p.step_a), str(p.step_b), a, b))
        for name in set(open_rows) - seen:
            del open_rows[name]
    return rows


def build_diff_tables(diff: TraceDiff) -> list[Table]:
    """What differs and nothing else: each request's differing fields, and the outputs beyond the bar.

    Every cell and title that quotes the traces (paths, request labels, layers, values) is a
    ``Text``: rich never reads it as markup.
    """
    tables = []
    steps = Table(title="per request: what differs (equal values over consecutive steps in one row)")
    for col in ("request", "seq_len", "steps A", "steps B", "field", "A", "B"):
        steps.add_column(col, justify="right" if col == "seq_len" else "left")
    for r in diff.requests:
        label = literal(r.label) if r.text is None else Text.assemble(r.label, (f' "{snippet(r.text)}"', "dim"))
        for i, (name, lo, hi, sa, sb, a, b) in enumerate(_runs(r)):
            seq = str(lo) if lo == hi else f"{lo}-{hi}"
            steps.add_row(label if i == 0 else "", seq, sa, sb, literal(name), literal(a), literal(b))
        if r.only_a or r.only_b:
            steps.add_row(
                label,
                "",
                "",
                "",
                "seq_lens on one side only",
                literal(list(r.only_a)),
                literal(list(r.only_b)),
            )
    if steps.row_count:
        tables.append(steps)
    over = [o for o in diff.outputs if not o.ok]
    if over:
        out = Table(title="vLLM's outputs beyond the bar, A vs B (common query positions), per layer")
        for col in ("request", "step A/B", "positions", "layer", "worst head", "max |A-B|", "bar"):
            out.add_column(col)
        for o in over:
            worst = max(range(len(o.max_abs)), key=lambda h: o.max_abs[h] - o.bar[h])
            out.add_row(
                literal(o.label),
                f"{o.step_a}/{o.step_b}",
                f"{o.positions[0]}-{o.positions[1] - 1}",
                literal(o.layer),
                str(worst),
                f"{o.max_abs[worst]:.3g}",
                f"{o.bar[worst]:.3g}",
            )
        tables.append(out)
    return tables
