"""``pagedtrace attention TRACE --step S``: the softmax weights of a captured step, per request and head."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from pagedtrace.cli import UsageError
from pagedtrace.commands import literal
from tracer.format import Trace
from tracer.format.attention import FIRST_TOKENS, AttentionMap

if TYPE_CHECKING:
    from reference_impl.attention_weights import StepWeights


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``attention``."""
    p = sub.add_parser(
        "attention",
        help="the attention weights of a captured step, per request and head",
        description="Compute, in fp64, the softmax weights of each kept query row of a step over its context, from "
        "the captured query and the rebuilt paged keys with the step's scale, soft-cap, window, sinks and ALiBi "
        "(the replay reference's own softmax), and print per request and head the top key positions and their "
        f"weights, the mass on the first {FIRST_TOKENS} tokens and the entropy, for the request's last query row.",
    )
    p.add_argument("trace", help="trace directory (with tensors)")
    p.add_argument("--step", type=int, required=True, help="step index")
    p.add_argument("--layer", default=None, help="layer name or index (default: the first recorded with tensors)")
    p.add_argument("--request", default=None, help="request id, its frontend id (0) or #N (default: every request)")
    p.add_argument("--head", type=int, default=None, help="query head (default: every head)")
    p.add_argument("--json", action="store_true", help="print the summaries and the binned weights as JSON")
    p.add_argument(
        "--save",
        metavar="FILE.safetensors",
        help="write the weights: per request, weights.R [H, t, seq_len] fp64, rows.R, positions.R (and sink.R)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Console) -> int:
    """Compute the weights, print the summaries, optionally save them."""
    from reference_impl.attention_weights import attention_map, step_weights
    from reference_impl.stepper import find_request

    if args.save is not None and not args.save.endswith(".safetensors"):
        raise UsageError(f"--save {args.save}: the file name must end in .safetensors")
    trace = Trace.open(args.trace)
    layer = _layer_name(trace, args.layer)
    requests = None
    if args.request is not None:
        records = [r for r in trace.records if r.step == args.step and r.tensors is not None]
        if records:
            requests = [find_request(records[0], args.request)]
    weights = step_weights(trace, args.step, layer=layer, requests=requests)
    heads = weights.record.num_heads
    if args.head is not None and not 0 <= args.head < heads:
        raise UsageError(f"--head {args.head}: the layer has heads 0..{heads - 1}")
    if args.save:
        _save(weights, args.save, args.head)
    maps = [attention_map(trace, weights, seq) for seq in weights.sequences]
    if args.json:
        out = [_only_head(m.to_json(), args.head) for m in maps]
        sys.stdout.write(json.dumps(out, indent=1) + "\n")
        return 0
    for m in maps:
        console.print(build_attention_table(m, args.head))
    if args.save:
        console.print(literal(f"weights written to {args.save}"))
    return 0


def _layer_name(trace: Trace, layer: str | None) -> str | None:
    """``--layer`` as a recorded layer name (a name, an index, ``L7``)."""
    if layer is None:
        return None
    from tracer.format import layer_index, parse_layer

    wanted = parse_layer(layer)
    for name in trace.layers:
        if name == wanted or layer_index(name) == wanted:
            return name
    raise UsageError(f"--layer {layer}: not recorded; layers: {', '.join(trace.layers)}")


def _only_head(data: dict, head: int | None) -> dict:
    if head is not None:
        data["heads"] = [data["heads"][head]]
        data["summaries"] = [data["summaries"][head]]
    return data


def _save(weights: StepWeights, path: str, head: int | None) -> None:
    import torch
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for seq in weights.sequences:
        w = seq.weights if head is None else seq.weights[head : head + 1]
        tensors[f"weights.{seq.request}"] = w.contiguous()
        tensors[f"rows.{seq.request}"] = torch.tensor(seq.rows, dtype=torch.int64)
        tensors[f"positions.{seq.request}"] = torch.tensor(seq.positions, dtype=torch.int64)
        if seq.sink is not None:
            tensors[f"sink.{seq.request}"] = (seq.sink if head is None else seq.sink[head : head + 1]).contiguous()
    record = weights.record
    meta = {
        "step": str(record.step),
        "layer": record.layer,
        "heads": "all" if head is None else str(head),
        "request_ids": json.dumps({str(s.request): s.request_id for s in weights.sequences}),
    }
    save_file(tensors, path, metadata=meta)


def build_attention_table(m: AttentionMap, head: int | None = None) -> Table:
    """One request's per-head summary: top positions (with their physical block), first-token mass, entropy."""
    last = m.positions[-1] if m.positions else m.seq_len - 1
    title = (
        f"step {m.step} {m.layer}: request {m.request_id or m.request} (row {m.request}), query position {last} "
        f"of {m.seq_len} keys; {m.group or 'KV-cache group unknown'}"
    )
    table = Table(title=literal(title))
    for col in ("head", "top positions (weight) [physical block]", f"first {FIRST_TOKENS}", "entropy", "keys"):
        table.add_column(literal(col), justify="left" if col.startswith("top") else "right")
    if any(s.sink is not None for s in m.summaries):
        table.add_column("sink", justify="right")
    for s in m.summaries:
        if head is not None and s.head != head:
            continue
        top = ", ".join(f"{p} ({w:.3f}) [{_physical(m, p)}]" for p, w in s.top)
        row = [str(s.head), top, f"{s.first_mass:.3f}", f"{s.entropy:.3f}", str(s.visible)]
        if s.sink is not None:
            row.append(f"{s.sink:.3f}")
        table.add_row(*row)
    return table


def _physical(m: AttentionMap, position: int) -> str:
    j = position // m.block_size
    return str(m.physical[j]) if j < len(m.physical) else "?"
