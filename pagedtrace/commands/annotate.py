"""``pagedtrace annotate FILE --trace TRACE [--step N]``: a vLLM source with traced values beside its lines."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from pagedtrace.cli import UsageError
from pagedtrace.commands import add_lax, non_negative_int, open_trace, short_layer
from tracer.format import Trace, layer_matches, parse_layer

if TYPE_CHECKING:  # libcst, through annotations: imported when a file is annotated, not for --help
    from annotations import AnnotatedSource

#: Rich style per value kind (see ``annotations.values``).
KIND_STYLES = {"captured": "green", "computed": "yellow", "static": "dim italic", "missing": "red"}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``annotate``."""
    parser = subparsers.add_parser(
        "annotate",
        help="print a vLLM source file with the trace's values beside the lines",
        description="Print an annotated vLLM source: each anchored line shows what it received at one step.",
    )
    parser.add_argument(
        "file",
        help="a vLLM path (vllm/v1/attention/backends/flash_attn.py) or short name (flash_attn.py, "
        "paged_attn.py, cpu_attn.py, ...; a name that is not one lists them all)",
    )
    parser.add_argument("--trace", required=True, help="trace directory")
    parser.add_argument("--step", type=int, default=None, help="step to show (default: the first request step)")
    parser.add_argument(
        "--layer",
        default=None,
        help="attention layer: its index (1), as the tables print it (L1), or its full name "
        "(default: the first traced layer)",
    )
    parser.add_argument(
        "--context",
        type=non_negative_int,
        default=None,
        metavar="N",
        help="show only N lines around each annotated line (default: the whole file)",
    )
    add_lax(parser)
    parser.set_defaults(func=run)
    return parser


def visible_lines(annotated: AnnotatedSource, context: int | None) -> list[int | None]:
    """Line numbers to print, in order; None marks an elision. ``context=None``: every line."""
    count = len(annotated.lines)
    if context is None:
        return list(range(1, count + 1))
    keep: set[int] = set()
    for line in annotated.lines:
        if line.notes:
            keep.update(range(max(1, line.number - context), min(count, line.number + context) + 1))
    out: list[int | None] = []
    previous = 0
    for number in sorted(keep):
        if number != previous + 1 and out:
            out.append(None)
        out.append(number)
        previous = number
    return out


def build_header(annotated: AnnotatedSource) -> Group:
    """File, step, layer and file-level notes."""
    title = Text.assemble(
        (annotated.vllm_path, "bold"),
        "  step ",
        (str(annotated.step) if annotated.step is not None else "-", "bold cyan"),
        "  layer ",
        (annotated.layer or "-", "cyan"),
    )
    notes = [Text(f"  {note}", style="dim") for note in annotated.file_notes]
    legend = Text.assemble(
        "  ",
        ("captured", KIND_STYLES["captured"]),
        " / ",
        ("computed", KIND_STYLES["computed"]),
        " / ",
        ("explanation", KIND_STYLES["static"]),
    )
    return Group(title, *notes, legend)


def build_annotated_table(annotated: AnnotatedSource, context: int | None = None) -> Table:
    """Line numbers, highlighted code and the values beside anchored lines."""
    from rich.syntax import Syntax

    text = "\n".join(line.text for line in annotated.lines)
    highlighted = Syntax(text, "python", theme="ansi_dark").highlight(text).split("\n", allow_blank=True)
    table = Table.grid(padding=(0, 1))
    # The line numbers' width is fixed: a narrow terminal crops code, never a number to "8…".
    digits = len(str(len(annotated.lines)))
    table.add_column(justify="right", style="dim", no_wrap=True, min_width=digits)
    table.add_column(no_wrap=True, overflow="crop")
    table.add_column(overflow="fold")
    for number in visible_lines(annotated, context):
        if number is None:
            table.add_row("", Text("…", style="dim"), "")
            continue
        line = annotated.lines[number - 1]
        code = highlighted[number - 1] if number - 1 < len(highlighted) else Text(line.text)
        values = Text()
        for i, note in enumerate(line.notes):
            if i:
                values.append("\n")
            values.append(f"{note.label}: ", style="bold")
            values.append(note.text, style=KIND_STYLES.get(note.kind, ""))
        marker = Text(str(number), style="bold blue" if line.notes else "dim")
        table.add_row(marker, code, values)
    return table


def build_missing_table(annotated: AnnotatedSource) -> Table:
    """Anchors that were not found in this source, with the reason."""
    table = Table(title="anchors not found", title_style="red", show_lines=False)
    table.add_column("anchor")
    table.add_column("reason", style="red")
    for note in annotated.missing:
        table.add_row(Text(note.label), Text(note.text))  # Text: never read as markup
    return table


def run(args: argparse.Namespace, console: Console) -> int:
    """Print the annotated source."""
    from annotations import ANNOTATED_FILES, annotate, resolve_file

    path = resolve_file(args.file)
    if path is None:
        names = ", ".join(ANNOTATED_FILES)
        raise UsageError(f"{args.file!r} is not an annotated file; valid names: {names} (or their base names)")
    trace = open_trace(args.trace, args)
    text = trace.source(path)
    if text is None:
        stored = ", ".join(sorted(trace.run.sources)) or "none"
        raise UsageError(f"the trace has no copy of {path} (stored sources: {stored})")
    annotated = annotate(text, path, trace, step=args.step, layer=resolve_layer(trace, args.layer))
    console.print(build_header(annotated))
    console.print(build_annotated_table(annotated, context=args.context))
    if annotated.missing:
        console.print(build_missing_table(annotated))
    return 0


def resolve_layer(trace: Trace, text: str | None) -> str | None:
    """``--layer`` as a recorded layer's full name: ``1``, ``L1`` or the name itself; None: the default."""
    if text is None:
        return None
    wanted = parse_layer(text)
    for name in trace.layers:
        if layer_matches(name, {wanted}):
            return name
    known = ", ".join(f"{short_layer(n)} ({n})" if short_layer(n) != n else n for n in trace.layers) or "none"
    raise UsageError(f"layer {text!r} is not in the trace (recorded layers: {known})")
