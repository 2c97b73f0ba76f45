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
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from pagedtrace.commands import short_layer

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


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``replay``."""
    p = sub.add_parser(
        "replay",
        help="replay a trace against the reference kernel: did vLLM compute exactly attention?",
        description="Rerun each recorded step's attention from its captured query, KV blocks, block table, "
        "seq_lens and query_start_loc; compare with vLLM's output (tolerance relative to the same "
        "math in bf16), check the KV write path bit for bit and the legacy x-split layout. "
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
        "request step instead of vLLM (replay.json is not written)",
    )
    p.add_argument(
        "--device",
        default=None,
        metavar="DEVICE",
        help="with a MODULE:FUNCTION kernel: move its inputs to DEVICE (e.g. cuda) first",
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    """Replay with a progress bar, print the table (or JSON), save ``replay.json``; 0 if all ok."""
    from pagedtrace.cli import UsageError
    from reference_impl.compiled import CompiledKernelError
    from reference_impl.replay import replay_trace, save_report
    from tracer.format import Trace

    if args.kernel not in KERNEL_CHOICES:
        if ":" not in args.kernel:
            raise UsageError(
                f"unknown kernel {args.kernel!r}: use one of {', '.join(KERNEL_CHOICES)} or MODULE:FUNCTION"
            )
        return run_user_kernel(args, console)
    if args.device is not None:
        raise UsageError("--device applies to a MODULE:FUNCTION kernel only (the reference runs on the CPU)")
    trace = Trace.open(args.trace)
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=args.json or not console.is_terminal,
    ) as progress:
        task = progress.add_task(f"replaying {trace.path.name} ({args.kernel})", total=None)

        def on_step(done: int, total: int, result) -> None:
            progress.update(task, total=total, completed=done)
            if not result.ok:
                progress.console.log(
                    f"[red]mismatch[/] step {result.step} {result.layer}: "
                    f"max abs {result.max_abs:.3g} > tol {result.tol:.3g}"
                    + (f" ({result.note})" if result.note else "")
                )

        try:
            report = replay_trace(trace, steps=args.steps, layers=args.layers, kernel=args.kernel, progress=on_step)
        except CompiledKernelError as exc:
            raise UsageError(f"{exc}; use --kernel fast") from exc
    if args.save:
        save_report(trace, report)
    if args.json:
        console.out(json.dumps(report.to_json(), indent=2), highlight=False)
        return 0 if report.ok else 1
    console.print(build_replay_table(report))
    if report.layout != report.recorded_layout:
        console.print(
            f"[dim]KV blocks read as [bold]{report.layout}[/] (the manifest says "
            f"{report.recorded_layout}; the recorded K/V rows are found in this packing)[/]"
        )
    for line in report.skipped:
        console.print(f"[dim]skipped: {line}[/]")
    console.print(_summary(report))
    if args.save:
        console.print(f"[dim]verdicts written to {trace.path / 'replay.json'}[/]")
    return 0 if report.ok else 1


def _num(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def _mark(ok: bool | None) -> str:
    if ok is None:
        return "[dim]-[/]"
    return "[green]ok[/]" if ok else "[bold red]FAIL[/]"


def build_replay_table(report) -> Table:
    """One row per replayed (step, layer): errors, tolerance, heads, write path, legacy path."""
    table = Table(
        title=f"replay ({report.kernel} kernel, KV layout {report.layout})",
        box=box.SIMPLE_HEAD,
        padding=(0, 0),
        collapse_padding=True,
    )
    # Short headers: the table must stay readable in an 80-column terminal.
    for col in ("step", "layer", "reqs", "tok", "max abs", "max rel", "tol", "heads", "write", "legacy", "ok"):
        table.add_column(
            col,
            justify="right" if col in ("step", "reqs", "tok", "max abs", "max rel", "tol") else "left",
            no_wrap=True,
        )
    writes = {(w.step, w.layer): w for w in report.write_path}
    legacies = {(c.step, c.layer): c for c in report.legacy}
    for r in report.steps:
        write = writes.get((r.step, r.layer))
        legacy = legacies.get((r.step, r.layer))
        heads_ok = sum(h.ok for h in r.heads)
        write_cell = (
            "[dim]-[/]"
            if write is None
            else (f"[green]{write.tokens}✓[/]" if write.ok else f"[bold red]{write.mismatches}/{write.tokens} bad[/]")
        )
        verdict = r.ok and (write is None or write.ok) and (legacy is None or legacy.ok)
        table.add_row(
            str(r.step),
            short_layer(r.layer),
            str(r.num_reqs),
            str(r.num_tokens),
            _num(r.max_abs),
            _num(r.max_rel),
            _num(r.tol),
            f"{heads_ok}/{len(r.heads)}" if heads_ok == len(r.heads) else f"[red]{heads_ok}/{len(r.heads)}[/]",
            write_cell,
            _mark(None if legacy is None else legacy.ok),
            _mark(verdict),
        )
    return table


def _summary(report) -> str:
    n = len(report.steps)
    worst = max(report.steps, key=lambda r: r.max_abs / r.tol if r.tol > 0 else math.inf)
    if report.ok:
        return (
            f"[bold green]all {n} step(s) match[/]: vLLM's output is attention within tolerance "
            f"(worst: step {worst.step}, max abs {_num(worst.max_abs)} vs tol {_num(worst.tol)}, "
            f"max rel {_num(worst.max_rel)}); {len(report.write_path)} write path(s) bit-exact, "
            f"legacy x-split layout gives identical output; {report.seconds:.2f} s"
        )
    bad_steps = sum(not r.ok for r in report.steps)
    bad_writes = sum(not w.ok for w in report.write_path)
    bad_legacy = sum(not c.ok for c in report.legacy)
    return (
        f"[bold red]MISMATCH[/]: {bad_steps}/{n} step(s) outside tolerance, "
        f"{bad_writes}/{len(report.write_path)} write path(s) wrong, "
        f"{bad_legacy}/{len(report.legacy)} legacy round trip(s) differ; {report.seconds:.2f} s"
    )


# --------------------------------------------------------------------------- a user's kernel


def run_user_kernel(args: argparse.Namespace, console: Console) -> int:
    """Check ``--kernel MODULE:FUNCTION`` on every captured request step; 0 if all match, 1 if not."""
    from pagedtrace.cli import UsageError
    from reference_impl.testing import check_trace, load_kernel
    from tracer.format import Trace

    # As ``python -m`` does: a kernel module in the current directory imports.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        fn = load_kernel(args.kernel)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    trace = Trace.open(args.trace)
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=args.json or not console.is_terminal,
    ) as progress:
        task = progress.add_task(f"checking {args.kernel} on {trace.path.name}", total=None)

        def on_case(done: int, total: int, result) -> None:
            progress.update(task, total=total, completed=done)
            if not result.ok and not args.json:
                progress.console.log(
                    f"[red]mismatch[/] step {result.step} {result.layer}: "
                    f"max abs {_num(result.max_abs)} > tol {_num(result.tol)}"
                    + (f" ({result.note})" if result.note else "")
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


def build_kernel_table(report) -> Table:
    """One row per checked (step, layer): the kernel's error against the reference and vLLM's output."""
    table = Table(title=f"{report.kernel} on {report.trace} (KV layout {report.layout})")
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
        # (token, head, dim, request) -> "head 2 tok 185 req 1"
        worst = "[dim]-[/]" if r.worst is None else f"head {r.worst[1]} tok {r.worst[0]} req {r.worst[3]}"
        table.add_row(
            str(r.step),
            r.layer,
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


def _kernel_summary(report) -> str:
    n = len(report.results)
    if report.ok:
        worst = max(report.results, key=lambda r: r.max_abs / r.tol if r.tol > 0 else math.inf)
        return (
            f"[bold green]{report.kernel} matches vLLM on all {n} step(s)[/] "
            f"(worst: step {worst.step}, max abs {_num(worst.max_abs)} vs tol {_num(worst.tol)}, "
            f"max rel {_num(worst.max_rel)}); {report.seconds:.2f} s"
        )
    bad = [r for r in report.results if not r.ok]
    return (
        f"[bold red]MISMATCH[/]: {len(bad)}/{n} step(s) outside tolerance; {report.seconds:.2f} s\n"
        f"first: {bad[0].message()}"
    )
