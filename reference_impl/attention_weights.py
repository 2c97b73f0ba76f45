"""The attention weights of a captured step: ``pagedtrace attention`` and the report's attention pages.

vLLM's fused kernels never materialise the softmax; a tensor trace has what defines it: each
step's query and, rebuilt from the write log, the paged keys bit for bit, with the step's
scale, soft-cap, window, sinks and ALiBi. :func:`sequence_weights` computes each kept query
row's weights over its context in fp64 with the reference's own gathered softmax
(:func:`reference_impl.gathered.gathered_weights`, the core of the partitioned form, on the
inputs replay builds, :func:`reference_impl.inputs.step_inputs`): the request's blocks are
gathered through its block table, masked by causality and the window, soft-capped, ALiBi
biased, and a sink joins the denominator as one more logit with no value. Rows sum to 1 (less
the sink's share) to fp64 rounding, and ``weights @ V`` is the reference output
(``tests/test_attention_weights.py`` holds it to the step's recorded output with replay's bar).

Einsum letters as in :mod:`reference_impl.kernel`. Imports torch, :mod:`reference_impl` and
``tracer.format`` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from reference_impl.common import cdiv
from reference_impl.emulation import emulation_of
from reference_impl.gathered import gather_blocks, gathered_weights, visibility
from reference_impl.inputs import StepInputs, step_inputs
from reference_impl.resolve import kv_spec, resolve_layout
from reference_impl.tolerances import REFERENCE_DTYPE
from tracer.format import StepRecord, Trace, TraceError
from tracer.format.attention import AttentionMap, bin_edges, kept_rows, summarize_row
from tracer.format.groups import group_label, trace_groups

__all__ = [
    "SequenceWeights",
    "StepWeights",
    "attention_map",
    "sequence_weights",
    "step_weights",
    "weighted_values",
]


@dataclass(frozen=True, eq=False)
class SequenceWeights:
    """The weights of one request's kept query rows of a step."""

    request: int  #: block-table row in the step
    request_id: str
    rows: tuple[int, ...]  #: the step's token rows (rows of ``query`` / ``output``)
    positions: tuple[int, ...]  #: each row's position in the sequence
    seq_len: int  #: keys the request holds (positions ``0 .. seq_len - 1``)
    weights: torch.Tensor  #: ``[H, t, seq_len]`` fp64
    sink: torch.Tensor | None  #: ``[H, t]`` fp64: the sink's share, when the step has sinks


@dataclass(frozen=True, eq=False)
class StepWeights:
    """One (step, layer)'s weights: its inputs (as replay builds them) and each request's rows."""

    record: StepRecord
    inputs: StepInputs
    sequences: tuple[SequenceWeights, ...]


def sequence_weights(inputs: StepInputs, b: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The softmax weights of sequence ``b`` of ``inputs`` (a request, or one kept row).

    Returns:
        ``(weights [H, t, s], sink [H, t] or None)`` in ``REFERENCE_DTYPE``: ``t`` the
        sequence's query rows, ``s`` its keys; a row with no visible key is all 0.
    """
    kw = inputs.kwargs
    dtype = REFERENCE_DTYPE
    q_start, q_end = int(inputs.query_start_loc[b]), int(inputs.query_start_loc[b + 1])
    seq_len, q_len = int(inputs.seq_lens[b]), q_end - q_start
    num_heads, head_size = inputs.query.shape[1:]
    _, block_size, num_kv_heads, _ = inputs.key_cache.shape
    group = num_heads // num_kv_heads
    physical = inputs.block_table[b, : cdiv(seq_len, block_size)].long()[None]  # [1, m]
    k = gather_blocks(inputs.key_cache, physical, kw.get("k_scale", 1.0), dtype)  # [1, n, h, d]
    k_pos = torch.arange(physical.shape[1] * block_size)[None]  # [1, n]
    q = inputs.query[q_start:q_end].to(dtype).view(q_len, num_kv_heads, group, head_size)
    q = q.permute(1, 2, 0, 3)[:, None]  # [h, b=1, g, t, d]
    q_pos = torch.arange(seq_len - q_len, seq_len)[None]  # [1, t]
    visible = visibility(q_pos, k_pos, k_pos < seq_len, kw.get("causal", True), kw.get("window", (-1, -1)))
    alibi = kw.get("alibi_slopes")
    p, l, m = gathered_weights(
        q, q_pos, k, k_pos, visible, scale=kw["scale"], softcap=kw.get("softcap", 0.0), alibi_slopes=alibi
    )
    lse = m + torch.log(l)  # [h, 1, g, t]; -inf where nothing is visible
    sinks = kw.get("sinks")
    sink = None
    if sinks is not None:
        sink_logit = sinks.to(dtype).view(num_kv_heads, 1, group, 1)
        total = torch.logaddexp(lse, sink_logit)
        sink = torch.exp(sink_logit - total)
        lse = total
    weights = torch.where(l[..., None] > 0, p * torch.exp(m - lse)[..., None], 0.0)
    weights = weights[:, 0].reshape(num_heads, q_len, -1)[..., :seq_len]  # query head h*G + g
    return weights, None if sink is None else sink[:, 0].reshape(num_heads, q_len)


def weighted_values(inputs: StepInputs, b: int, weights: torch.Tensor) -> torch.Tensor:
    """``weights @ V`` of sequence ``b``: ``[t, H, D]`` in ``REFERENCE_DTYPE`` (the reference output)."""
    seq_len = int(inputs.seq_lens[b])
    _, block_size, num_kv_heads, _ = inputs.value_cache.shape
    physical = inputs.block_table[b, : cdiv(seq_len, block_size)].long()[None]
    v = gather_blocks(inputs.value_cache, physical, inputs.kwargs.get("v_scale", 1.0), REFERENCE_DTYPE)[0, :seq_len]
    group = weights.shape[0] // num_kv_heads
    v_full = v.repeat_interleave(group, dim=1)  # [n, H, d]: query head h*G + g reads kv head h
    return torch.einsum("htn,nhd->thd", weights, v_full)


def _record(trace: Trace, step: int, layer: str | None) -> StepRecord:
    records = [r for r in trace.records if r.step == step and (layer is None or r.layer == layer)]
    with_tensors = [r for r in records if r.tensors is not None]
    if not with_tensors:
        steps = sorted({r.step for r in trace.records if r.tensors is not None})
        what = "not recorded" if not records else "recorded without tensors"
        raise TraceError(f"{trace.path}: step {step} (layer {layer or 'any'}) {what}; steps with tensors: {steps}")
    return with_tensors[0]


def step_weights(
    trace: Trace, step: int, *, layer: str | None = None, requests: Sequence[int] | None = None
) -> StepWeights:
    """The weights of ``step`` (``layer``: default the first recorded with tensors) for ``requests`` (rows; None: all).

    Raises:
        TraceError: the step or layer has no tensors, or a request row is not in the step.
    """
    record = _record(trace, step, layer)
    inputs = step_inputs(
        record,
        trace.tensors(record),
        kv_spec(trace),
        resolve_layout(trace, [record]),
        flash_attn_version=trace.run.flash_attn_version,
        emulation=emulation_of(trace.run),
    )
    wanted = range(record.num_reqs) if requests is None else requests
    for b in wanted:
        if not 0 <= b < record.num_reqs:
            raise TraceError(f"step {step}: no request row {b}; the step has rows 0..{record.num_reqs - 1}")
    # Per sequence of the inputs: its request (block-table row) and step token rows.
    qsl = [int(x) for x in inputs.query_start_loc]
    owners: list[tuple[int, tuple[int, ...]]]
    if inputs.kept is not None:
        owners = [(inputs.kept.requests[i], (inputs.kept.rows[i],)) for i in range(len(inputs.kept.rows))]
    else:
        owners = [(b, tuple(range(qsl[b], qsl[b + 1]))) for b in range(len(qsl) - 1)]
    parts: dict[int, list[tuple[tuple[int, ...], torch.Tensor, torch.Tensor | None, int]]] = {}
    for i, (request, rows) in enumerate(owners):
        if request in wanted and rows:
            w, sink = sequence_weights(inputs, i)
            parts.setdefault(request, []).append((rows, w, sink, int(inputs.seq_lens[i])))
    sequences = []
    for request, pieces in sorted(parts.items()):
        seq_len = record.seq_lens[request]
        step_rows = tuple(r for p in pieces for r in p[0])
        # Kept rows are one-token sequences of their own, each over its causal prefix: pad to seq_len.
        weights = torch.cat([torch.nn.functional.pad(w, (0, seq_len - w.shape[-1])) for _, w, _, _ in pieces], dim=1)
        sinks = [s for _, _, s, _ in pieces]
        sink = None if sinks[0] is None else torch.cat([s for s in sinks if s is not None], dim=1)
        first = seq_len - record.query_lens[request] - record.query_start_loc[request]
        sequences.append(
            SequenceWeights(
                request=request,
                request_id=record.request_ids[request] if request < len(record.request_ids) else "",
                rows=step_rows,
                positions=tuple(first + r for r in step_rows),
                seq_len=seq_len,
                weights=weights,
                sink=sink,
            )
        )
    return StepWeights(record=record, inputs=inputs, sequences=tuple(sequences))


def attention_map(trace: Trace, weights: StepWeights, seq: SequenceWeights) -> AttentionMap:
    """One request's weights downsampled for drawing (``tracer.format.attention``), with its summaries."""
    record = weights.record
    groups = trace_groups(trace)
    group = groups.of_record(record)
    edges = bin_edges(seq.seq_len)
    rows = kept_rows(len(seq.positions))
    w = seq.weights
    # Column bins: the mass of each bin's positions (cumulative sums, differenced at the edges).
    cumulative = torch.nn.functional.pad(w[:, list(rows)].cumsum(dim=-1), (1, 0))
    binned = cumulative[..., list(edges[1:])] - cumulative[..., list(edges[:-1])]
    last = w[:, -1]
    summaries = tuple(
        summarize_row(h, last[h].tolist(), sink=None if seq.sink is None else float(seq.sink[h, -1]))
        for h in range(w.shape[0])
    )
    spec = trace.run.kv_cache
    return AttentionMap(
        step=record.step,
        layer=record.layer,
        request=seq.request,
        request_id=seq.request_id,
        seq_len=seq.seq_len,
        block_size=spec.block_size if spec is not None else 16,
        physical=record.block_table[seq.request],
        null_block=groups.null_block,
        group="" if group is None else f"group {group.group}: {group_label(group)}",
        causal=record.causal,
        window=record.sliding_window,
        positions=tuple(seq.positions[i] for i in rows),
        rows_total=len(seq.positions),
        col_edges=edges,
        heads=tuple(tuple(tuple(float(x) for x in row) for row in head.tolist()) for head in binned),
        summaries=summaries,
    )
