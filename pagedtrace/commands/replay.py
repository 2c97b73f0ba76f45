"""``pagedtrace replay``: rerun every recorded step's attention and judge vLLM's output.

With ``--kernel MODULE:FUNCTION`` the roles turn: the user's kernel runs on every
captured step and is judged by the same bar (:mod:`pagedtrace.commands.replay_kernel`).
What is printed is built in :mod:`pagedtrace.commands.replay_output`.
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.text import Text

from pagedtrace.commands import add_lax, literal, open_trace
from pagedtrace.commands.replay_kernel import is_user_kernel, run_user_kernel
from pagedtrace.commands.replay_output import (
    build_metadata_table,
    build_replay_table,
    heads_on_ranks,
    metadata_problems,
    rank_lines,
    replay_progress,
    sampled_note,
    verdict_summary,
)
from pagedtrace.terminal import QUIET, make_console, row_limit, verbosity, warn


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
    """``--sample``, ``--workers``: a positive whole number."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value}: expected a positive whole number")
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
        "--workers",
        type=_positive,
        default=None,
        metavar="N",
        help="replay in N processes (default: one per CPU core with at least 32 steps each; on a GPU "
        "one per 128 steps, at most 8, since each opens its own CUDA context); the verdicts are the "
        "same, to the bit, whatever N",
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

    if is_user_kernel(args.kernel):
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
    with replay_progress(bar_console, disable=quiet or not bar_console.is_terminal) as progress:
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
                workers=args.workers,
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

    console.print(verdict_summary(report, tensors_absent(trace.run), sampled_note(report, args, trace, LEGACY_EVERY)))
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


def announce_compiled_build(console: Console) -> None:
    """One line before the compiled kernel's first build (~30 s, then cached by torch): not a silent minute."""
    from reference_impl.compiled import is_built

    if not is_built():
        console.print(literal("building the compiled kernel (first use, ~30 s)…", "dim"), soft_wrap=True)
