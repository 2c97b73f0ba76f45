"""What ``pagedtrace replay`` prints: its progress bar, the result tables and the verdict line.

Built from a replay's report (``tracer.format.verdicts.ReplayReport``): one table row per
replayed (step, layer), or one per record of a trace without tensors; one line per metadata
problem; a tensor-parallel trace's ranks; and the verdict, its line last. The progress bar and
the cells (:func:`number_text`, :func:`verdict_mark`) serve ``--kernel``'s table too
(:mod:`pagedtrace.commands.replay_kernel`).
"""

from __future__ import annotations

import argparse
import math

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

from pagedtrace.commands import literal, short_layer
from pagedtrace.terminal import Elided, count_elided, elide_passing
from tracer.format.selection import select_records


def replay_progress(console: Console, *, disable: bool) -> Progress:
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


def number_text(x: float) -> str:
    """``x`` in three significant digits (``inf`` and ``nan`` as Python writes them)."""
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def verdict_mark(ok: bool | None) -> str:
    """A table cell for a verdict: ``ok``, ``FAIL``, or ``-`` where there is none (``None``)."""
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
            number_text(r.max_abs),
            number_text(r.max_rel),
            number_text(r.tol),
            f"{heads_ok}/{len(r.heads)}" if heads_ok == len(r.heads) else f"[red]{heads_ok}/{len(r.heads)}[/]",
            write_cell,
            verdict_mark(None if legacy is None else legacy.ok),
            verdict_mark(meta_ok),
            verdict_mark(verdict),
        )
    return table


def _record_ok(r, writes: dict, legacies: dict, metadata: dict) -> bool:
    """A replayed record's whole verdict: attention, write path, legacy path and metadata."""
    write, legacy = writes.get((r.step, r.layer)), legacies.get((r.step, r.layer))
    meta = metadata.get((r.step, r.layer), [])
    return bool(r.ok and (write is None or write.ok) and (legacy is None or legacy.ok) and all(c.ok for c in meta))


def sampled_note(report, args: argparse.Namespace, trace, legacy_every: int) -> str:
    """What the verdict line stands on when not every step or round trip ran ("" otherwise)."""
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
            verdict_mark(None)
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


def verdict_summary(report, why: str = "", sampled: str = "") -> str:
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
            f"max abs {number_text(worst.max_abs)} vs tol {number_text(worst.tol)}, "
            f"max rel {number_text(worst.max_rel)}); {report.seconds:.2f} s"
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
