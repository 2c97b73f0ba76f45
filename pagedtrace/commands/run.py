"""``pagedtrace run``: an offline vLLM session under the tracer, then a summary."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from pagedtrace.commands import literal, short_layer
from pagedtrace.terminal import QUIET, VERBOSE, Elided, elide, make_console, row_limit, verbosity, warn
from tracer.format import Trace, TraceError, parse_steps
from tracer.vllm_rules import (
    BLOCK_SIZE_MULTIPLE,
    CUDAGRAPH_MODES,
    DEFAULT_CUDAGRAPH_MODE,
    FLASH_ATTN_VERSIONS,
    KV_CACHE_DTYPES,
)

if TYPE_CHECKING:
    from tracer.session_config import SessionConfig

#: vLLM's log level per ``--quiet`` / (neither) / ``--verbose``; the lines go to stderr.
VLLM_LOG_LEVELS = {QUIET: "ERROR", 0: "WARNING", VERBOSE: "INFO"}


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        a = int(lo)
        b = int(hi) if hi else a
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected N or LO:HI") from None
    if a < 1 or b < a:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= LO <= HI")
    return (a, b)


def _steps(text: str) -> tuple[int | None, int | None]:
    """``--steps``: ``tracer.format.parse_steps``, its message as argparse's."""
    try:
        return parse_steps(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``run``."""
    from tracer.models import PRESETS

    presets = ", ".join(f"{k} ({v['about']})" for k, v in PRESETS.items())
    p = sub.add_parser(
        "run",
        help="run a traced offline vLLM session and summarise it",
        description=f"Run a vLLM session under the tracer. Presets: {presets}.",
    )
    p.add_argument("-o", "--out", default="pagedtrace-trace", help="trace directory to create (default: %(default)s)")
    p.add_argument("--model", default="tiny", help="preset name, local model dir or HF id (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=4, help="number of prompts (default: %(default)s)")
    p.add_argument(
        "--prompt-len",
        type=_range,
        default=(20, 90),
        metavar="LO:HI",
        help="suffix length range per prompt, tokens (default: 20:90)",
    )
    p.add_argument(
        "--shared-prefix",
        type=int,
        default=64,
        metavar="N",
        help="tokens every prompt starts with, to show prefix caching (default: %(default)s)",
    )
    p.add_argument(
        "--prompt",
        action="append",
        default=[],
        metavar="TEXT",
        help="a text prompt (repeatable; needs a model with a tokenizer, e.g. smollm2-135m); replaces the "
        "token-id prompts of --prompts/--prompt-len/--shared-prefix",
    )
    p.add_argument(
        "--prompts-file",
        metavar="FILE",
        default=None,
        help='text prompts, one a line, or JSON lines: "TEXT", {"prompt": TEXT} or {"messages": [...]} (a chat)',
    )
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to each text prompt")
    p.add_argument("--max-tokens", type=int, default=12, help="tokens to generate per prompt (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help=f"KV block size, a multiple of {BLOCK_SIZE_MULTIPLE} (default: 32 on CPU, vLLM's on GPU)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        metavar="N",
        help="vLLM's max_model_len; at least the longest prompt plus --max-tokens (default: the preset's, else 2048)",
    )
    p.add_argument("--layers", default="first", help="'first', 'all' or indices/names, comma-separated")
    p.add_argument(
        "--steps",
        type=_steps,
        default=(None, None),
        metavar="START:STOP",
        help="record only these step indices (half-open)",
    )
    p.add_argument("--no-tensors", dest="tensors", action="store_false", help="record metadata only")
    p.add_argument("--budget-mb", type=float, default=256.0, help="tensor budget in MiB (default: %(default)s)")
    p.add_argument(
        "--kv-check-every",
        type=int,
        default=0,
        metavar="N",
        help="every N-th tensor step also stores whole KV blocks, to check the write log against (0: never)",
    )
    p.add_argument(
        "--query-rows",
        type=int,
        default=0,
        metavar="K",
        help="store the query and output of at most K rows a step (0: every row); the KV write log stays whole",
    )
    graphs = p.add_mutually_exclusive_group()
    graphs.add_argument(
        "--cudagraph-mode",
        default=None,
        metavar="MODE",
        help=f"CUDA graph mode, one of {', '.join(CUDAGRAPH_MODES)} (tensors are recorded in every mode, full "
        f"graphs included); default: vLLM's, {DEFAULT_CUDAGRAPH_MODE}, on a GPU; eager on the CPU",
    )
    graphs.add_argument(
        "--eager", action="store_true", help="run vLLM eager (enforce_eager): no CUDA graphs, no torch.compile"
    )
    p.add_argument("--multiprocess", action="store_true", help="run vLLM's engine core in its own process")
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="vLLM's tensor_parallel_size: N workers (vLLM's multiprocess executor), each tracing its heads "
        "into one trace (default: %(default)s)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        metavar="DTYPE",
        help=f"vLLM's kv_cache_dtype, one of {', '.join(KV_CACHE_DTYPES)} (default: %(default)s)",
    )
    p.add_argument(
        "--flash-attn-version",
        type=int,
        choices=FLASH_ATTN_VERSIONS,
        default=None,
        help="FlashAttention version on CUDA (attention_config); default: vLLM's choice (FA3 on Hopper)",
    )
    p.add_argument(
        "--attention-backend",
        default=None,
        metavar="NAME",
        help="vLLM's attention backend: FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION, FLASHINFER (CUDA) or CPU_ATTN; "
        "default: vLLM's choice",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        metavar="N",
        help="tokens the scheduler puts in one step; below the prompt length it splits prefills (chunked prefill)",
    )
    p.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        metavar="N",
        help="KV-cache blocks the engine allocates (vLLM's num_gpu_blocks_override); default: as many as memory "
        "allows. A small cache shows evictions and preemptions in a short run",
    )
    p.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="turn vLLM's prefix caching off (to diff against a run with it on)",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.set_defaults(func=run)


def session_config(args: argparse.Namespace, out: Path) -> SessionConfig:
    """The ``tracer.session_config.SessionConfig`` that ``run``'s arguments ask for, tracing into ``out``."""
    from tracer.prompts import read_prompts_file
    from tracer.session_config import SessionConfig

    texts = [*args.prompt, *(read_prompts_file(args.prompts_file) if args.prompts_file else [])]
    return SessionConfig(
        trace_dir=str(out),
        model=args.model,
        num_prompts=args.prompts,
        prompt_len=args.prompt_len,
        shared_prefix=args.shared_prefix,
        max_tokens=args.max_tokens,
        seed=args.seed,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        enforce_eager=True if args.eager else (False if args.cudagraph_mode else None),
        cudagraph_mode=args.cudagraph_mode,
        layers=args.layers,
        steps=args.steps,
        tensors=args.tensors,
        budget_mb=args.budget_mb,
        kv_check_every=args.kv_check_every,
        query_rows=args.query_rows,
        multiprocess=args.multiprocess,
        gpu_memory_utilization=args.gpu_memory_utilization,
        prefix_caching=args.prefix_caching,
        kv_cache_dtype=args.kv_cache_dtype,
        flash_attn_version=args.flash_attn_version,
        attention_backend=args.attention_backend,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_blocks=args.num_blocks,
        texts=tuple(texts),
        chat=args.chat,
        tensor_parallel_size=args.tensor_parallel_size,
    )


def run(args: argparse.Namespace, console: Console) -> int:
    """Check the arguments, run the session with progress bars (stderr), then print the summary (stdout).

    Every argument is checked before the engine starts (``tracer.session_config.validate_config``):
    a wrong one is one line and exit 2, with no directory created.
    """
    from pagedtrace.cli import EXIT_INTERRUPTED, UsageError
    from tracer.session import SessionError, run_session
    from tracer.session_config import validate_config

    out = Path(args.out)
    try:
        cfg = session_config(args, out)
        validate_config(cfg)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    level = verbosity(args)
    # The user's VLLM_LOGGING_LEVEL stands unless --quiet or --verbose says otherwise.
    log_level = None if level == 0 and "VLLM_LOGGING_LEVEL" in os.environ else VLLM_LOG_LEVELS[level]
    # Progress and vLLM's logs on stderr, results on stdout: `pagedtrace run > summary.txt` works.
    err = make_console(stderr=True)
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}", markup=False),  # the model name is the user's text
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=False,
        disable=level == QUIET,
    ) as progress:
        tasks: dict[str, TaskID] = {}

        def on_event(event: str, what: str, value) -> None:
            if event == "phase" and what == "engine":
                tasks["engine"] = progress.add_task(f"starting vLLM engine ({args.model})", total=None)
            elif event == "phase" and what == "generate":
                progress.update(tasks["engine"], total=1, completed=1)
            elif event == "start":
                tasks[what] = progress.add_task(what or "generating", total=value)
            elif event == "advance" and what in tasks:
                progress.advance(tasks[what], value)

        try:
            result = run_session(cfg, on_event, log_level=log_level)
        except (ValueError, FileExistsError, SessionError) as exc:
            raise UsageError(str(exc)) from None
        except KeyboardInterrupt:
            progress.stop()
            err.print(literal(f"interrupted: {kept_after_interrupt(out)}", "yellow"), soft_wrap=True)
            return EXIT_INTERRUPTED
    trace = None
    problem = result.trace_error
    try:
        trace = Trace.open(out, strict=problem is None)
    except TraceError as exc:
        problem = problem or str(exc)
    if level != QUIET:
        mode = f" ({graph_mode_words(trace.run)})" if trace is not None else ""
        timing = f"engine start {result.engine_start_s:.1f} s{mode}, generation {result.generate_s:.1f} s"
        err.print(literal(timing, "dim"), soft_wrap=True)
    # The tokens first: they are the session's result even when the trace could not be saved.
    console.print(build_tokens_table(result))
    for warning in result.warnings:
        warn(warning)
    if trace is not None:
        console.print(build_summary_table(trace, limit=row_limit(args)))
        console.print(build_kv_table(trace))
    if problem:
        kept = f"; what was written reads with --lax ({len(trace.records)} records)" if trace else ""
        warn(f"the trace is incomplete: {problem.removeprefix('pagedtrace: ')}{kept}")
        return 2  # the -o directory or its disk: the user's to fix (EXIT_CODES); the tokens are above
    console.print(
        Text.assemble(
            "trace written to ",
            (str(out), "bold"),
            f"  (next: pagedtrace replay {out}; pagedtrace report {out} -o report)",
        )
    )
    return 0


def kept_after_interrupt(out: Path) -> str:
    """What an interrupted run leaves in ``out``, in words: the records kept and how to read them."""
    try:
        trace = Trace.open(out, strict=False)
    except TraceError:
        return f"stopped before the first request step; nothing kept in {out}"
    steps = sorted({r.step for r in trace.records})
    where = f"steps {steps[0]}-{steps[-1]}" if steps else "no steps"
    return (
        f"kept {len(trace.records)} records ({where}) in {out}, without session.json; "
        f"`pagedtrace show {out}` and `pagedtrace replay {out}` read them"
    )


def graph_mode_words(run) -> str:
    """``graph mode FULL_AND_PIECEWISE`` or ``eager``: which mode the engine ran, from the manifest."""
    return "eager" if run.enforce_eager or run.cudagraph_mode == "NONE" else f"graph mode {run.cudagraph_mode}"


#: Output token ids shown per request; the rest are counted.
MAX_SHOWN_TOKENS = 16


def build_tokens_table(result) -> Table:
    """The generated token ids per prompt (``SessionResult.outputs``), or their text where the model has a tokenizer."""
    table = Table(title="generated tokens (greedy)", show_lines=False)
    table.add_column("prompt", justify="right")
    table.add_column("prompt tokens", justify="right")
    table.add_column("output" if result.output_texts else "output token ids")
    for i, (prompt, output) in enumerate(zip(result.prompts, result.outputs, strict=True)):
        if result.output_texts:
            table.add_row(str(i), str(len(prompt)), literal(repr(result.output_texts[i])))
            continue
        shown = " ".join(map(str, output[:MAX_SHOWN_TOKENS]))
        more = f" … (+{len(output) - MAX_SHOWN_TOKENS})" if len(output) > MAX_SHOWN_TOKENS else ""
        table.add_row(str(i), str(len(prompt)), shown + more)
    return table


def build_summary_table(trace: Trace, limit: int | None = None) -> Table:
    """Steps by kind, requests, blocks in use and shared blocks.

    More than ``limit`` steps: the first and last ones, and a row counting the rest.
    """
    table = Table(title=literal(f"trace {trace.path}"), show_lines=False)
    for col in ("step", "kind", "layer", "reqs", "tokens", "seq_lens", "blocks in use", "shared", "tensors"):
        table.add_column(
            col,
            justify="right" if col in ("step", "reqs", "tokens", "blocks in use") else "left",
            # A narrow terminal wraps seq_lens, never cuts a kind to "profi…".
            no_wrap=col in ("step", "kind", "layer"),
            min_width=7 if col == "kind" else None,
        )
    rows: list[tuple[int, list[str | Text]]] = []
    for r in trace.records:
        used = {b for row in r.block_table for b in row}
        seq = ",".join(map(str, r.seq_lens[:6])) + ("…" if len(r.seq_lens) > 6 else "")
        shared = r.shared_blocks
        rows.append(
            (
                r.step,
                [
                    str(r.step),
                    literal(r.kind),
                    literal(short_layer(r.layer)),
                    str(r.num_reqs),
                    str(r.num_actual_tokens),
                    seq,
                    str(len(used)),
                    ",".join(map(str, sorted(shared))) or "-",
                    "yes" if r.tensors else "-",
                ],
            )
        )
    for g in trace.gaps:
        rows.append(
            (
                g.step,
                [
                    str(g.step),
                    literal(g.kind),
                    "[dim](not seen)[/]",
                    "-",
                    str(g.num_tokens or "-"),
                    literal(g.reason, "dim"),
                    "-",
                    "-",
                    "-",
                ],
            )
        )
    by_step: dict[int, list[list[str | Text]]] = {}
    for step, cells in sorted(rows, key=lambda x: x[0]):
        by_step.setdefault(step, []).append(cells)
    for group in elide(list(by_step.values()), limit):
        if isinstance(group, Elided):
            # In seq_lens, the one column that wraps: the others keep their width.
            more = literal(f"… {group.count} more steps (--verbose shows them)", "dim")
            table.add_row("…", "", "", "", "", more, "", "", "")
            continue
        for cells in group:
            table.add_row(*cells)
    return table


def build_kv_table(trace: Trace) -> Table:
    """The run and its KV-cache layout."""
    run = trace.run
    table = Table(title="engine and KV cache", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    # Every value comes from the manifest: literal, never markup.
    table.add_row("vLLM / torch", literal(f"{run.vllm_version} / {run.torch_version}"))
    table.add_row("device", literal(f"{run.device} ({run.device_name})"))
    table.add_row(
        "attention",
        literal(run.attention_backend + (f" (FA{run.flash_attn_version})" if run.flash_attn_version else "")),
    )
    table.add_row("cudagraph mode", literal(run.cudagraph_mode + (" (enforce_eager)" if run.enforce_eager else "")))
    if run.model:
        m = run.model
        table.add_row(
            "model",
            literal(
                f"{m.name}: {m.num_layers} layers, {m.num_attention_heads} heads / "
                f"{m.num_kv_heads} KV heads, D={m.head_size}, {m.dtype}; weights: {m.weights}"
            ),
        )
    kv = run.kv_cache
    if kv:
        table.add_row("kv_cache shape", literal(f"{kv.shape} {kv.dtype}, strides {kv.stride}"))
        table.add_row("layout", literal(f"{kv.layout}: physically {kv.physical_order}"))
        table.add_row("blocks", literal(f"{kv.num_blocks} × {kv.block_size} tokens"))
    return table
