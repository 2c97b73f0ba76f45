"""``pagedtrace replay --kernel MODULE:FUNCTION`` or ``vllm:BACKEND``: a kernel other than the reference's.

:func:`is_user_kernel` tells a reference form (:data:`KERNEL_CHOICES`) from a kernel to
load; :func:`run_user_kernel` loads it (the user's module, or vLLM's own kernel through
``tracer.vllm_kernels``), checks it on every captured request step
(``reference_impl.testing.check_trace``) and prints one row per step. vLLM's kernels are held to a
bar from their own rounding (:func:`vllm_emulation`), as the engine's output is to its kernel's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from types import SimpleNamespace
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from pagedtrace.commands import literal, open_trace
from pagedtrace.commands.replay_output import number_text, replay_progress, verdict_mark

#: ``--kernel`` choices, as ``reference_impl.replay.KERNELS`` names them.
KERNEL_CHOICES = ("fast", "loop", "partitioned", "compiled")


def is_user_kernel(name: str) -> bool:
    """Whether ``--kernel NAME`` names a kernel to load (``MODULE:FUNCTION``, ``vllm:BACKEND``), not a
    reference form; a ``UsageError`` for neither."""
    from pagedtrace.cli import UsageError

    if name in KERNEL_CHOICES:
        return False
    if ":" not in name:
        raise UsageError(f"unknown kernel {name!r}: use one of {', '.join(KERNEL_CHOICES)} or MODULE:FUNCTION")
    return True


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
    with replay_progress(console, disable=args.json or not console.is_terminal) as progress:
        task = progress.add_task(f"checking {args.kernel} on {trace.path.name}", total=None, rate="")

        def on_case(done: int, total: int, result) -> None:
            progress.update(task, total=total, completed=done)
            if not result.ok and not args.json:
                progress.console.log(
                    Text.assemble(
                        ("mismatch", "red"),
                        f" step {result.step} {result.layer}: max abs {number_text(result.max_abs)} "
                        f"> tol {number_text(result.tol)}" + (f" ({result.note})" if result.note else ""),
                    )
                )

        report = check_trace(
            fn,
            trace,
            steps=args.steps,
            layers=args.layers,
            device=args.device,
            name=args.kernel,
            progress=on_case,
            emulation=vllm_emulation(args.kernel, trace) if args.kernel.startswith(VLLM_PREFIX) else None,
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


def vllm_emulation(spec: str, trace) -> Any:
    """How vLLM's kernel ``vllm:NAME`` rounds here (``reference_impl.emulation.emulation_of`` of
    ``tracer.vllm_kernels.run_info``), for its bar; None when the trace has no KV-cache spec."""
    from reference_impl.emulation import emulation_of
    from tracer.vllm_kernels import run_info

    kv = trace.run.kv_cache
    if kv is None:
        return None
    info = run_info(spec.removeprefix(VLLM_PREFIX), dtype=kv.dtype, block_size=kv.block_size, head_size=kv.head_size)
    return emulation_of(SimpleNamespace(**info))


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
            number_text(r.max_abs),
            number_text(r.max_rel),
            number_text(r.tol),
            number_text(r.vllm_max_abs),
            heads,
            worst,
            verdict_mark(r.ok),
        )
    return table


def _kernel_summary(report) -> Text:
    # Text, not markup: the kernel's name and the failure message are the user's and the trace's.
    n = len(report.results)
    if report.ok:
        worst = max(report.results, key=lambda r: r.max_abs / r.tol if r.tol > 0 else math.inf)
        return Text.assemble(
            (f"{report.kernel} matches vLLM on all {n} step(s)", "bold green"),
            f" (worst by error/tolerance: step {worst.step}, max abs {number_text(worst.max_abs)} "
            f"vs tol {number_text(worst.tol)}, "
            f"max rel {number_text(worst.max_rel)}); {report.seconds:.2f} s",
        )
    bad = [r for r in report.results if not r.ok]
    return Text.assemble(
        ("MISMATCH", "bold red"),
        f": {len(bad)}/{n} step(s) outside tolerance; {report.seconds:.2f} s\nfirst: {bad[0].message()}",
    )
