"""``pagedtrace report TRACE -o DIR``: write the static HTML report of a trace.

A report builds from the trace directory alone: neither this command nor the site builder
(``reports``) imports torch. The tour's walk of one real query through the reference loop
(``tracer.format.walk.QueryWalk``) is the one ``pagedtrace replay`` kept in the trace
(``walk.json``); without it the tour says how to get one. ``--replay`` replays the trace in
memory (that one loads torch) and walks the query too, writing nothing into the trace (the
committed fixtures live in the repository). ``--attention`` computes the attention pages'
weights (``reference_impl.attention_weights``, torch) and hands them to the builder as
``tracer.format.attention.AttentionMap`` records; without it the index says how to get them.
"""

from __future__ import annotations

import argparse
import time
import webbrowser
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table
from rich.text import Text

from pagedtrace.cli import UsageError, command_line
from pagedtrace.commands import add_lax, open_trace
from pagedtrace.terminal import make_console, warn
from tracer.format import ReplayReport, Trace, TraceError
from tracer.format.attention import AttentionMap
from tracer.format.walk import QueryWalk

if TYPE_CHECKING:  # jinja2 and libcst load when a report is written, not when the CLI parses
    from reports.build import BuildResult

#: Requests of one step drawn on its attention page at most.
MAX_MAP_REQUESTS = 8

#: ``reports.step_pages.MAX_REQUEST_PAGES``, repeated so that building the parser imports no
#: jinja2 or libcst (``tests/test_terminal.py`` checks that the two agree).
MAX_REQUEST_PAGES = 200


def write_report(*args, **kwargs):
    """``reports.build.write_report``, imported when a report is written."""
    from reports.build import write_report as write

    return write(*args, **kwargs)


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
    parser.add_argument(
        "--force", action="store_true", help="write into a non-empty directory that is not a pagedtrace report"
    )
    parser.add_argument("--open", action="store_true", help="open index.html in a web browser when done")
    parser.add_argument(
        "--replay",
        action="store_true",
        help="replay the trace in memory and show the verdicts (replay.json is not written into the trace)",
    )
    parser.add_argument(
        "--attention",
        action="store_true",
        help="add an attention page per captured (step, layer): softmax weights per head over the blocks (loads torch)",
    )
    add_lax(parser)
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


def replay_in_memory(trace: Trace) -> tuple[ReplayReport, QueryWalk | None, str]:
    """Replay every step with tensors and walk the tour's query, as ``pagedtrace replay`` does; nothing saved."""
    from reference_impl.replay import replay_trace
    from reference_impl.stepper import walk_for_tour

    return (replay_trace(trace), *walk_for_tour(trace))


def attention_maps(trace: Trace) -> tuple[list[AttentionMap], str]:
    """The attention weights of the first captured (step, layer)s with tensors, for the attention pages."""
    try:
        from reference_impl.attention_weights import attention_map, step_weights
        from reports.attention_pages import MAX_ATTENTION_PAGES
    except ImportError as exc:
        return [], f"no attention pages: the reference kernel could not be imported here ({exc})"
    maps: list[AttentionMap] = []
    done = 0
    for record in trace.records:
        if record.tensors is None or done >= MAX_ATTENTION_PAGES:
            continue
        try:
            weights = step_weights(trace, record.step, layer=record.layer)
        except (TraceError, RuntimeError, ValueError) as exc:
            return maps, f"attention pages stop at step {record.step} {record.layer}: {exc}"
        maps.extend(attention_map(trace, weights, seq) for seq in weights.sequences[:MAX_MAP_REQUESTS])
        done += 1
    return maps, ""


def run(args: argparse.Namespace, console: Console) -> int:
    """Build the report and say where it is."""
    from reports.build import OutputDirError, check_output_dir

    if args.max_step_pages < 0:
        raise UsageError("--max-step-pages must be 0 or more")
    start = time.perf_counter()
    trace = open_trace(args.trace, args)  # a damaged trace is exit 2 unless --lax
    try:
        check_output_dir(args.output, args.force)  # before any replay: a refused -o fails fast
        with make_console(stderr=True).status("building report"):
            replay, walk, walk_note = replay_in_memory(trace) if args.replay else (None, None, "")
            maps, maps_note = attention_maps(trace) if args.attention else ([], "")
            result = write_report(
                args.trace,
                args.output,
                max_step_pages=args.max_step_pages,
                walk=walk,
                walk_note=walk_note,
                replay=replay,
                force=args.force,
                command=command_line,
                attention=maps,
            )
    except OutputDirError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"cannot write the report to {args.output}: {exc.strerror or exc}") from None
    console.print(Text.assemble(("report written:", "bold green"), " ", str(result.index)), highlight=False)
    console.print(build_result_table(result, time.perf_counter() - start))
    if maps_note:
        warn(maps_note)
    if replay is not None:
        verdict = "all replayed steps agree" if replay.ok else "some steps disagree"
        console.print(Text(f"replay (in memory, not saved): {verdict}"), highlight=False)
    if args.open:
        webbrowser.open(result.index.resolve().as_uri())
    return 0
