"""``pagedtrace step TRACE --step N --request R --head H``: one query through the block loop."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table
from rich.text import Text

from pagedtrace.commands import add_lax, literal, open_trace, positive_int
from tracer.format.walk import QueryWalk
from tracer.format.words import snippet

#: Characters of a block's words in the walk's table.
WALK_SNIPPET_CHARS = 24


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``step``."""
    p = sub.add_parser(
        "step",
        help="walk one real query through the reference block loop (online softmax)",
        description="Run paged_attention_loop on a captured step for one request and head and print, per "
        "logical block, the physical id, valid tokens, block max, running m and l, the rescale "
        "exp(m_old - m_new) and ||acc||; then the partitioned form's (m, l) per partition and the "
        "log-sum-exp merge; then vLLM's own output for that head, with the error.",
    )
    p.add_argument("trace", help="trace directory (with tensors)")
    p.add_argument("--step", type=int, required=True, help="step index")
    p.add_argument("--request", required=True, help="request id, its frontend id (0) or #N")
    p.add_argument("--head", type=int, default=0, help="query head (default 0)")
    p.add_argument("--layer", default=None, help="layer name (default: the first recorded)")
    p.add_argument("--token", type=int, default=None, help="query row within the request (default: its last)")
    p.add_argument(
        "--partition-size",
        type=positive_int,
        default=None,
        metavar="N",
        help="v2 partition, tokens: a multiple of the block size, as vLLM's (default: 2 blocks)",
    )
    p.add_argument("--json", action="store_true", help="print the walk as JSON")
    p.add_argument("--html", metavar="FILE", help="also write the walk as a static HTML page")
    add_lax(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    """Walk, print, optionally write the page."""
    from pagedtrace.cli import UsageError
    from reference_impl.stepper import walk_query

    trace = open_trace(args.trace, args)
    block_size = trace.run.kv_cache.block_size if trace.run.kv_cache else None
    if args.partition_size is not None and block_size and args.partition_size % block_size:
        raise UsageError(
            f"--partition-size {args.partition_size}: a partition holds whole blocks: use a multiple of the "
            f"block size ({block_size})"
        )
    walk = walk_query(
        trace,
        args.step,
        args.request,
        args.head,
        layer=args.layer,
        token=args.token,
        partition_size=args.partition_size,
    )
    if args.html:
        from reports.explain_pages import write_stepper_page

        write_stepper_page(walk, args.html)
    if args.json:
        sys.stdout.write(json.dumps(walk.to_json(), indent=2) + "\n")
        return 0
    for table in build_walk_tables(walk):
        console.print(table)
    verdict = Text("within", "green") if walk.ok else Text("OVER", "red")
    console.print(
        Text.assemble(
            f"vLLM's output, head {walk.head}: ||out|| {walk.vllm_norm:.6g} (reference {walk.output_norm:.6g}); "
            f"max |vLLM - reference| {walk.max_abs:.3g}, bar {walk.tolerance:.3g}: ",
            verdict,
        )
    )
    return 0


def build_walk_tables(walk: QueryWalk) -> list[Table]:
    """The block loop's running values, the kernel lines, the partitions and their merge.

    The title names the trace's layer and request id: a ``Text``, never markup.
    """
    word = f" {walk.query_text!r}" if walk.query_text is not None else ""
    title = (
        f"step {walk.step} {walk.layer}: request {walk.request_id}, query {walk.token}{word} (position "
        f"{walk.position}), head {walk.head} (KV head {walk.kv_head}); {walk.compute_dtype}"
    )
    loop = Table(title=literal(title))
    texts = any(b.text is not None for b in walk.blocks)
    columns = ("j", "physical", "positions", "valid", "visible", "block max", "m", "rescale", "l", "||acc||")
    for col in columns + (("text",) if texts else ()):
        loop.add_column(col, justify="left" if col == "text" else "right")
    for b in walk.blocks:
        words = (literal(snippet(b.text or "", WALK_SNIPPET_CHARS), "dim"),) if texts else ()
        loop.add_row(
            str(b.logical),
            str(b.physical),
            f"{b.positions[0]}-{b.positions[1] - 1}",
            str(b.n_valid),
            str(b.n_visible),
            f"{b.block_max:.6g}",
            f"{b.m:.6g}",
            f"{b.rescale:.6g}",
            f"{b.l:.6g}",
            f"{b.acc_norm:.6g}",
            *words,
        )
    lines = Table(title="paged_attention_loop (reference_impl/kernel.py)")
    lines.add_column("value")
    lines.add_column("line", justify="right")
    lines.add_column("code")
    for k in walk.kernel_lines:
        lines.add_row(literal(k.value), str(k.line), literal(k.text))
    parts = Table(title=f"partitioned (v2) form, {walk.partition_size}-token partitions, merged by log-sum-exp")
    for col in ("blocks", "m", "l", "lse = m + log l", "weight exp(lse_p - lse)"):
        parts.add_column(col, justify="right")
    for p in walk.partitions:
        parts.add_row(f"{p.blocks[0]}-{p.blocks[1] - 1}", f"{p.m:.6g}", f"{p.l:.6g}", f"{p.lse:.6g}", f"{p.weight:.6g}")
    parts.add_row("merged", "", "", f"{walk.lse:.6g}", f"|loop - partitioned| {walk.loop_vs_partitioned:.2g}")
    return [loop, lines, parts]
