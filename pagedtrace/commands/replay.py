"""``pagedtrace replay``: rerun every recorded step's attention and judge vLLM's output.

With ``--kernel MODULE:FUNCTION`` the roles turn: the user's kernel runs on every
captured step and is judged by the same bar (``reference_impl.testing.check_trace``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from pagedtrace.commands import add_lax, literal, open_trace, short_layer
from pagedtrace.terminal import QUIET, Elided, count_elided, elide_passing, make_console, row_limit, verbosity, warn

#: ``--kernel`` choices, as ``reference_impl.replay.KERNELS`` names them.
KERNEL_CHOICES = ("fast", "loop", "partitioned", "compiled")


def _steps(text: str) -> tuple[int | None, int | None]:
    """``--steps``: ``tracer.format.parse_steps``, its message as argparse's."""
    from tracer.format import parse_steps

    try:
        return parse_steps(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _layers(text: str) -> tuple[str | int, ...] | None:
    """``--layers``: ``tracer.format.parse_layers``; ``all`` -> None (every recorded layer).

    Replay has no "first layer": ``first`` is a layer name here, as any other word.
    """
    from tracer.format import parse_layers

    try:
        selection = parse_layers(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad layer selection {text!r}: use 'all' or indices/names") from None
    if selection in ("all", ("all",)):
        return None
    return (selection,) if isinstance(selection, str) else selection


def _positive(text: str) -> int:
    """``--sample``: a positive whole number."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value}: expected a positive number of steps")
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``replay``."""
    p = sub.add_parser(
        "replay",
        help="replay a trace against the reference kernel: did vLLM compute exactly attention?",
        description="Rerun each recorded step's attention from its captured query, KV blocks, block table, "
        "seq_lens and query_start_loc; compare with vLLM's output head by head (the bar: twice the "
        "error of the same attention rounded as FlashAttention rounds it, plus a floor of one ulp "
        "of the output; docs/kernels.md); check the KV write path bit for bit and the legacy x-split layout. "
        "Every record, tensors or not, also gets metadata checks (slots, lengths, block ids, shared "
        "prefixes, flags); a trace without tensors is judged on those alone. "
        "Exit code 0: all match; 1: a mismatch; 2: the trace cannot be replayed.",
    )
    p.add_argument("trace", metavar="TRACE", help="trace directory (from `pagedtrace run`, tensors on)")
    p.add_argument(
        "--kernel",
        default="fast",
        metavar="KERNEL",
        help="reference form: fast (batched gather), loop (the kernel's block loop), "
        "partitioned (v2 split + log-sum-exp merge), compiled (fast with decode rows in a C++ "
        "kernel built on first use; needs g++ and ninja) (default: %(default)s); or "
        "MODULE:FUNCTION (e.g. mypkg.attn:paged_attention, ./attn.py:paged_attention): "
        "check your own kernel, signature as reference_impl.kernel, on every captured "
        "request step instead of vLLM (replay.json is not written); or vllm:BACKEND (vllm:FLASH_ATTN, "
        "vllm:TRITON_ATTN, vllm:FLEX_ATTENTION, vllm:FLASHINFER, vllm:CPU_ATTN): vLLM's own kernel of that backend",
    )
    p.add_argument(
        "--device",
        default=None,
        metavar="DEVICE",
        help="where the reference runs: cpu or cuda (default: cuda when a GPU is present, else cpu; "
        "fp64 reference, fp32 emulation of the kernel's rounding); with a MODULE:FUNCTION kernel: "
        "move its inputs to DEVICE (e.g. cuda) first",
    )
    p.add_argument(
        "--sample",
        type=_positive,
        default=None,
        metavar="N",
        help="replay only N of the selected steps, spread evenly over them (the first and last "
        "included, the same ones every time): a quick look at a long trace",
    )
    p.add_argument(
        "--steps",
        type=_steps,
        default=None,
        metavar="START:STOP",
        help="replay only these step indices (half-open, e.g. 0:10)",
    )
    p.add_argument(
        "--layers",
        type=_layers,
        default=None,
        metavar="LAYERS",
        help="'all' or layer indices/names, comma-separated (default: all recorded)",
    )
    p.add_argument("--json", action="store_true", help="print the replay.json object to stdout, nothing else")
    p.add_argument(
        "--no-save", dest="save", action="store_false", help="do not write replay.json into the trace directory"
    )
    add_lax(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    """Replay with a progress bar, print the table (or JSON), save ``replay.json``; 0 if all ok."""
    from pagedtrace.cli import UsageError

    if args.kernel not in KERNEL_CHOICES:
        if ":" not in args.kernel:
            raise UsageError(
                f"unknown kernel {args.kernel!r}: use one of {', '.join(KERNEL_CHOICES)} or MODULE:FUNCTION"
            )
        return run_user_kernel(args, console)
    trace = open_trace(args.trace, args)  # a wrong path is answered before torch loads (seconds)
    from reference_impl.compiled import CompiledKernelError
    from reference_impl.replay import LEGACY_EVERY, replay_trace, save_report
    from reference_impl.step_pass import select_device

    try:
        device = select_device(args.device)
    except ValueError as exc:
        raise UsageError(str(exc)) from None

    # With --json stdout holds the JSON and nothing else: progress and log lines go to stderr.
    log_console = make_console(stderr=True) if args.json else console
    quiet = verbosity(args) == QUIET
    if args.kernel == "compiled" and not quiet:
        announce_compiled_build(log_console)
    # The bar (steps/s, time left) goes to stderr, and only when stderr is a terminal: piped, nothing.
    bar_console = make_console(stderr=True)
    with _progress(bar_console, disable=quiet or not bar_console.is_terminal) as progress:
        where = "" if device.type == "cpu" else f" on {device.type}"
        task = progress.add_task(f"replaying {trace.path.name} ({args.kernel}{where})", total=None, rate="")

        def on_step(done: int, total: int, result) -> None:
            progress.update(task, total=total, completed=done)
            speed = progress.tasks[0].speed
            progress.update(task, rate="" if speed is None else f"{speed:.1f} steps/s")
            if not result.ok:
                log_console.log(
                    Text.assemble(
                        ("mismatch", "red"),
                        f" step {result.step} {result.layer}: max abs {result.max_abs:.3g} > tol {result.tol:.3g}"
                        + (f" ({result.note})" if result.note else "")
                        + (f"; {heads_on_ranks(trace, result.bad_heads)}" if trace.ranks and result.bad_heads else ""),
                    )
                )

        try:
            report = replay_trace(
                trace,
                steps=args.steps,
                layers=args.layers,
                kernel=args.kernel,
                progress=on_step,
                sample=args.sample,
                device=device,
            )
        except CompiledKernelError as exc:
            raise UsageError(f"{exc}; use --kernel fast") from exc
    saved = False
    if args.save:
        try:
            save_report(trace, report)
            save_tour_walk(trace)
            saved = True
        except OSError as exc:  # a read-only trace: the verdict stands, only the side file is lost
            warn(f"replay.json not written: {exc}")
    if args.json:
        console.out(json.dumps(report.to_json(), indent=2), highlight=False)
        return 0 if report.ok else 1
    limit = row_limit(args)
    if report.steps:
        console.print(build_replay_table(report, limit=limit))
    else:
        console.print(build_metadata_table(report, limit=limit))
    for line in metadata_problems(report):
        console.print(line)
    if report.steps and report.layout != report.recorded_layout:
        console.print(
            Text.assemble(
                "KV blocks read as ",
                (str(report.layout), "bold"),
                f" (the manifest says {report.recorded_layout}; the recorded K/V rows are found in this packing)",
                style="dim",
            )
        )
    for line in rank_lines(trace, report):
        console.print(line)
    # A metadata-only trace skips every record: the summary says so once.
    for skipped in report.skipped if report.steps else ():
        console.print(literal(f"skipped: {skipped}", "dim"))
    from tracer.format.summary import tensors_absent

    console.print(_summary(report, tensors_absent(trace.run), _sampled(report, args, trace, LEGACY_EVERY)))
    if saved:
        console.print(literal(f"verdicts written to {trace.path / 'replay.json'}", "dim"))
    return 0 if report.ok else 1


def save_tour_walk(trace) -> None:
    """Walk the report tour's query through the reference loop and keep it in the trace (``walk.json``).

    ``pagedtrace report`` shows it without importing torch; a trace with no such query keeps none.
    """
    from reference_impl.stepper import walk_for_tour
    from tracer.format import write_side_file
    from tracer.format.walk import TOUR_WALK

    walk, _ = walk_for_tour(trace)
    if walk is not None:
        write_side_file(trace.path, TOUR_WALK, walk.to_json())


def heads_on_ranks(trace, heads) -> str:
    """``heads 2, 3 (rank 1)``: global query heads, each with the tensor-parallel rank that ran it."""
    from tracer.format.ranks import rank_of_head

    infos = [part.run.tensor_parallel for part in trace.ranks]
    by_rank: dict[int | None, list[int]] = {}
    for h in heads:
        by_rank.setdefault(rank_of_head(infos, h), []).append(h)
    return ", ".join(
        f"head{'s' if len(hs) > 1 else ''} {', '.join(map(str, hs))} (rank {'?' if r is None else r})"
        for r, hs in by_rank.items()
    )


def rank_lines(trace, report) -> list[Text]:
    """For a tensor-parallel trace: its ranks' heads, then each step whose heads failed, naming their ranks."""
    if not trace.ranks:
        return []
    spans = ", ".join(
        f"rank {tp.rank}: {tp.head_start}-{tp.head_start + tp.num_heads - 1}"
        for tp in (part.run.tensor_parallel for part in trace.ranks)
    )
    lines = [literal(f"{len(trace.ranks)} tensor-parallel ranks, every global query head judged ({spans})", "dim")]
    for r in report.steps:
        if r.bad_heads:
            lines.append(
                Text.assemble(
                    ("FAIL", "bold red"),
                    f" step {r.step} {short_layer(r.layer)}: {heads_on_ranks(trace, r.bad_heads)} outside tolerance",
                )
            )
    return lines


def _num(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def _mark(ok: bool | None) -> str:
    if ok is None:
        return "[dim]-[/]"
    return "[green]ok[/]" if ok else "[bold red]FAIL[/]"


def build_replay_table(report, limit: int | None = None) -> Table:
    """One row per replayed (step, layer): errors, tolerance, heads, write path, legacy path.

    More than ``limit`` rows: the failing ones and the first and last, the rest counted in one row.
    """
    table = Table(
        title=literal(f"replay ({report.kernel} kernel, KV layout {report.layout})"),
        box=box.SIMPLE_HEAD,
        padding=(0, 0),
        collapse_padding=True,
    )
    # Short headers: the table must stay readable in an 80-column terminal.
    for col in ("step", "layer", "reqs", "tok", "max abs", "max rel", "tol", "heads", "write", "legacy", "meta", "ok"):
        table.add_column(
            col,
            justify="right" if col in ("step", "reqs", "tok", "max abs", "max rel", "tol") else "left",
            no_wrap=True,
        )
    writes = {(w.step, w.layer): w for w in report.write_path}
    legacies = {(c.step, c.layer): c for c in report.legacy}
    metadata = _metadata_by_record(report)
    for r in elide_passing(report.steps, limit, lambda r: _record_ok(r, writes, legacies, metadata)):
        if isinstance(r, Elided):
            table.add_row("…", *[""] * 11)
            count_elided(table, r.count)
            continue
        write = writes.get((r.step, r.layer))
        legacy = legacies.get((r.step, r.layer))
        heads_ok = sum(h.ok for h in r.heads)
        write_cell = (
            "[dim]-[/]"
            if write is None
            else (f"[green]{write.tokens}✓[/]" if write.ok else f"[bold red]{write.mismatches}/{write.tokens} bad[/]")
        )
        meta = metadata.get((r.step, r.layer), [])
        meta_ok = None if not meta else all(c.ok for c in meta)
        verdict = _record_ok(r, writes, legacies, metadata)
        table.add_row(
            str(r.step),
            literal(short_layer(r.layer)),
            str(r.num_reqs),
            str(r.num_tokens),
            _num(r.max_abs),
            _num(r.max_rel),
            _num(r.tol),
            f"{heads_ok}/{len(r.heads)}" if heads_ok == len(r.heads) else f"[red]{heads_ok}/{len(r.heads)}[/]",
            write_cell,
            _mark(None if legacy is None else legacy.ok),
            _mark(meta_ok),
            _mark(verdict),
        )
    return table


def _record_ok(r, writes: dict, legacies: dict, metadata: dict) -> bool:
    """A replayed record's whole verdict: attention, write path, legacy path and metadata."""
    write, legacy = writes.get((r.step, r.layer)), legacies.get((r.step, r.layer))
    meta = metadata.get((r.step, r.layer), [])
    return bool(r.ok and (write is None or write.ok) and (legacy is None or legacy.ok) and all(c.ok for c in meta))


def _sampled(report, args: argparse.Namespace, trace, legacy_every: int) -> str:
    """What the verdict line stands on when not every step or round trip ran ("" otherwise)."""
    from reference_impl.replay import select_records

    parts = []
    if args.sample is not None and report.steps:
        total = sum(r.tensors is not None for r in select_records(trace, steps=args.steps, layers=args.layers))
        if len(report.steps) < total:
            parts.append(f"--sample {args.sample}: {len(report.steps)} of {total} steps replayed, spread evenly")
    if len(report.legacy) < len(report.steps):
        parts.append(
            f"legacy round trip on {len(report.legacy)} of {len(report.steps)} steps "
            f"(the first, the last, every {legacy_every}th)"
        )
    return f" ({'; '.join(parts)})" if parts else ""


def _progress(console: Console, *, disable: bool) -> Progress:
    """The replay progress bar: one task per trace, transient; steps/s and the time left."""
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}", markup=False),  # names a path
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}", markup=False),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=disable,
    )


def announce_compiled_build(console: Console) -> None:
    """One line before the compiled kernel's first build (~30 s, then cached by torch): not a silent minute."""
    from reference_impl.compiled import is_built

    if not is_built():
        console.print(literal("building the compiled kernel (first use, ~30 s)…", "dim"), soft_wrap=True)


def _metadata_by_record(report) -> dict[tuple[int, str], list]:
    out: dict[tuple[int, str], list] = {}
    for c in report.metadata:
        out.setdefault((c.step, c.layer), []).append(c)
    return out


def build_metadata_table(report, limit: int | None = None) -> Table:
    """One row per (step, layer), one column per metadata check: for a trace without tensors."""
    from tracer.format.metadata import METADATA_CHECKS

    table = Table(
        title="metadata checks (tensors were not captured)", box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True
    )
    for col in ("step", "layer", "kind", *METADATA_CHECKS):
        table.add_column(col, justify="right" if col == "step" else "left", no_wrap=True)
    groups = list(_metadata_by_record(report).items())
    for item in elide_passing(groups, limit, lambda g: all(c.ok for c in g[1])):
        if isinstance(item, Elided):
            table.add_row("…", *[""] * (len(table.columns) - 1))
            count_elided(table, item.count)
            continue
        (step, layer), checks = item
        by_name = {c.check: c for c in checks}
        cells = [
            _mark(None)
            if name not in by_name
            else ("[green]ok[/]" if by_name[name].ok else f"[bold red]{by_name[name].num_problems} bad[/]")
            for name in METADATA_CHECKS
        ]
        table.add_row(str(step), literal(short_layer(layer)), literal(checks[0].kind), *cells)
    return table


#: Metadata problems listed under the table, at most this many.
MAX_METADATA_LINES = 20


def metadata_problems(report) -> list[Text]:
    """One line per metadata problem (step, layer, check, row, position: what differed), capped."""
    lines = []
    for c in report.metadata:
        for p in c.problems:
            where = "".join(
                f" {name} {value}"
                for name, value in (("row", p.row), ("pos", p.position), ("token", p.token))
                if value is not None
            )
            lines.append(
                Text.assemble(
                    ("metadata FAIL", "bold red"),
                    f" step {c.step} {short_layer(c.layer)} {c.check}{where}: {p.message}",
                )
            )
    if len(lines) > MAX_METADATA_LINES:
        lines = [*lines[:MAX_METADATA_LINES], literal(f"… {len(lines) - MAX_METADATA_LINES} more (see --json)", "dim")]
    return lines


def _metadata_summary(report) -> str:
    records = len(_metadata_by_record(report))
    bad = sum(not c.ok for c in report.metadata)
    if bad:
        return f"{bad}/{len(report.metadata)} metadata check(s) failed"
    return f"metadata consistent on {records} record(s) ({len(report.metadata)} checks)"


def _records_text(records) -> str:
    """``12 steps × 2 layers`` (or ``6 step(s)`` for one layer; ``24 records: 12 steps, 2 layers`` when ragged)."""
    steps = len({r.step for r in records})
    layers = len({r.layer for r in records})
    if layers <= 1:
        return f"{len(records)} step(s)"
    if steps * layers == len(records):
        return f"{steps} step{'s' if steps > 1 else ''} × {layers} layers"
    return f"{len(records)} records: {steps} steps, {layers} layers"


def _summary(report, why: str = "", sampled: str = "") -> str:
    """The verdict, its line last; ``why``: why tensors are absent; ``sampled``: what it stands on."""
    n = len(report.steps)
    if not n:
        state = "[bold green]metadata ok[/]" if report.ok else "[bold red]MISMATCH[/]"
        because = f" ({escape(why)})" if why else ""
        return (
            f"{state}: tensors were not captured{because}, so attention was not replayed; "
            f"{_metadata_summary(report)}; {report.seconds:.2f} s"
        )
    worst = max(report.steps, key=lambda r: r.max_abs / r.tol if r.tol > 0 else math.inf)
    if report.ok:
        # Two lines, the verdict last: a piped line stays under 200 characters.
        return (
            f"{len(report.write_path)} write path(s) bit-exact, legacy x-split layout gives identical output; "
            f"{_metadata_summary(report)}\n"
            + (f"replayed:{sampled[1:]}\n" if sampled else "")
            + f"[bold green]all {_records_text(report.steps)} match[/]: vLLM's output is attention within tolerance "
            f"(worst by error/tolerance: step {worst.step} {escape(short_layer(worst.layer))}, "
            f"max abs {_num(worst.max_abs)} vs tol {_num(worst.tol)}, "
            f"max rel {_num(worst.max_rel)}); {report.seconds:.2f} s"
        )
    bad_steps = sum(not r.ok for r in report.steps)
    bad_writes = sum(not w.ok for w in report.write_path)
    bad_legacy = sum(not c.ok for c in report.legacy)
    return (
        f"[bold red]MISMATCH[/]: {bad_steps} of {_records_text(report.steps)} outside tolerance, "
        f"{bad_writes}/{len(report.write_path)} write path(s) wrong, "
        f"{bad_legacy}/{len(report.legacy)} legacy round trip(s) differ; {_metadata_summary(report)}{sampled}; "
        f"{report.seconds:.2f} s"
    )


# --------------------------------------------------------------------------- a user's kernel


def run_user_kernel(args: argparse.Namespace, console: Console) -> int:
    """Check ``--kernel MODULE:FUNCTION`` on every captured request step; 0 if all match, 1 if not."""
    from pagedtrace.cli import UsageError

    trace = open_trace(args.trace, args)  # before torch and the user's module load
    from reference_impl.testing import check_trace, load_kernel

    # As ``python -m`` does: a kernel module in the current directory imports.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        fn = vllm_kernel(args.kernel) if args.kernel.startswith(VLLM_PREFIX) else load_kernel(args.kernel)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    with _progress(console, disable=args.json or not console.is_terminal) as progress:
        task = progress.add_task(f"checking {args.kernel} on {trace.path.name}", total=None, rate="")

        def on_case(done: int, total: int, result) -> None:
            progress.update(task, total=total, completed=done)
            if not result.ok and not args.json:
                progress.console.log(
                    Text.assemble(
                        ("mismatch", "red"),
                        f" step {result.step} {result.layer}: max abs {_num(result.max_abs)} > tol {_num(result.tol)}"
                        + (f" ({result.note})" if result.note else ""),
                    )
                )

        report = check_trace(
            fn, trace, steps=args.steps, layers=args.layers, device=args.device, name=args.kernel, progress=on_case
        )
    if args.json:
        console.out(json.dumps(report.to_json(), indent=2), highlight=False)
        return 0 if report.ok else 1
    console.print(build_kernel_table(report))
    console.print(_kernel_summary(report))
    return 0 if report.ok else 1


#: ``--kernel vllm:NAME``: vLLM's own kernel of backend NAME (``tracer.vllm_kernels``).
VLLM_PREFIX = "vllm:"


def vllm_kernel(spec: str):
    """The kernel ``vllm:NAME`` names (``tracer.vllm_kernels.kernel``); ``ValueError`` for an unknown NAME."""
    from tracer.vllm_kernels import kernel

    return kernel(spec.removeprefix(VLLM_PREFIX))


def build_kernel_table(report) -> Table:
    """One row per checked (step, layer): the kernel's error against the reference and vLLM's output."""
    table = Table(title=literal(f"{report.kernel} on {report.trace} (KV layout {report.layout})"))
    for col in (
        "step",
        "layer",
        "reqs",
        "tokens",
        "max abs",
        "max rel",
        "tol",
        "vs vLLM",
        "heads ok",
        "worst",
        "verdict",
    ):
        table.add_column(
            col,
            justify="right" if col in ("step", "reqs", "tokens", "max abs", "max rel", "tol", "vs vLLM") else "left",
            no_wrap=col in ("layer", "worst"),
        )
    for r in report.results:
        heads_ok = len(r.heads) - len(r.bad_heads)
        heads = (
            f"{heads_ok}/{len(r.heads)}"
            if r.heads and heads_ok == len(r.heads)
            else (f"[red]{heads_ok}/{len(r.heads)}[/]" if r.heads else "[dim]-[/]")
        )
        # -> "head 2 req 1 pos 57 blk 7": the row's request, the token's position, its physical block
        w = r.worst
        worst = "[dim]-[/]" if w is None else f"head {w.head} req {w.request} pos {w.position} blk {w.block}"
        table.add_row(
            str(r.step),
            literal(r.layer),
            str(r.num_reqs),
            str(r.num_tokens),
            _num(r.max_abs),
            _num(r.max_rel),
            _num(r.tol),
            _num(r.vllm_max_abs),
            heads,
            worst,
            _mark(r.ok),
        )
    return table


def _kernel_summary(report) -> Text:
    # Text, not markup: the kernel's name and the failure message are the user's and the trace's.
    n = len(report.results)
    if report.ok:
        worst = max(report.results, key=lambda r: r.max_abs / r.tol if r.tol > 0 else math.inf)
        return Text.assemble(
            (f"{report.kernel} matches vLLM on all {n} step(s)", "bold green"),
            f" (worst by error/tolerance: step {worst.step}, max abs {_num(worst.max_abs)} vs tol {_num(worst.tol)}, "
            f"max rel {_num(worst.max_rel)}); {report.seconds:.2f} s",
        )
    bad = [r for r in report.results if not r.ok]
    return Text.assemble(
        ("MISMATCH", "bold red"),
        f": {len(bad)}/{n} step(s) outside tolerance; {report.seconds:.2f} s\nfirst: {bad[0].message()}",
    )
