"""``pagedtrace report TRACE -o DIR``: write the static HTML report of a trace."""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table
from rich.text import Text

from pagedtrace.cli import UsageError
from reports.build import BuildResult, write_report
from reports.step_pages import MAX_REQUEST_PAGES


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``report``."""
    parser = subparsers.add_parser(
        "report",
        help="write a static HTML report of a trace",
        description="Write a self-contained static site (index, guided tour, annotated sources, step pages).",
    )
    parser.add_argument("trace", help="trace directory")
    parser.add_argument("-o", "--output", required=True, metavar="DIR", help="directory to write the site into")
    parser.add_argument(
        "--max-step-pages",
        type=int,
        default=MAX_REQUEST_PAGES,
        metavar="N",
        help=f"write a page for at most N request steps (default {MAX_REQUEST_PAGES}); the index lists them all",
    )
    parser.set_defaults(func=run)
    return parser


def build_result_table(result: BuildResult, seconds: float) -> Table:
    """What was written, in a small table."""
    table = Table.grid(padding=(0, 2))
    table.add_column(style="dim")
    table.add_column()
    table.add_row("index", Text(str(result.index)))  # a path: Text, never markup
    table.add_row("pages", str(result.pages))
    name, size = result.largest_page
    table.add_row("largest page", Text(f"{name} ({size / 1024:.0f} KiB)"))
    table.add_row("time", f"{seconds:.2f} s")
    return table


def run(args: argparse.Namespace, console: Console) -> int:
    """Build the report and say where it is."""
    if args.max_step_pages < 0:
        raise UsageError("--max-step-pages must be 0 or more")
    start = time.perf_counter()
    try:
        with console.status("building report"):
            result = write_report(args.trace, args.output, max_step_pages=args.max_step_pages)
    except OSError as exc:
        raise UsageError(f"cannot write the report to {args.output}: {exc.strerror or exc}") from None
    console.print(Text.assemble(("report written:", "bold green"), " ", str(result.index)), highlight=False)
    console.print(build_result_table(result, time.perf_counter() - start))
    return 0
