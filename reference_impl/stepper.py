"""Walk one real query through the reference kernel, block by block: ``pagedtrace step``.

The walk runs :func:`reference_impl.kernel.paged_attention_loop` itself, on the captured
step's data (``reference_impl.inputs.step_inputs``: the same inputs replay uses), cut to the
one request, and reads the running values through the loop's ``on_block`` hook: for each
logical block its physical id, valid and visible keys, the block's max score, the running
max ``m``, sum ``l``, the rescale ``exp(m_old - m_new)`` and the accumulator's norm. No
second copy of the math exists. Then :func:`~reference_impl.kernel.paged_attention_partitioned`
(through ``on_partition``) gives each partition's log-sum-exp, from which its ``(m, l)`` and
its weight in the merge follow, and the walk ends at vLLM's own output for that head, with
the error and replay's bar.

Imports torch, :mod:`reference_impl` and ``tracer.format`` only.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch

from reference_impl import kernel as _kernel
from reference_impl.emulation import emulation_of, interval_midpoints
from reference_impl.inputs import judge_output, reference_outputs, step_inputs
from reference_impl.resolve import kv_spec, resolve_layout
from reference_impl.tolerances import REFERENCE_DTYPE
from tracer.format import StepRecord, Trace, TraceError
from tracer.format.walk import BlockLine, KernelLine, PartitionLine, QueryWalk
from tracer.format.words import Words

__all__ = ["KERNEL_LINES", "find_request", "kernel_lines", "walk_query"]

#: The values the walk shows -> the text of the ``paged_attention_loop`` line that computes each.
KERNEL_LINES = (
    ("physical", "physical = int(block_table[b, j])"),
    ("n_valid", "n_valid = min(block_size, seq_len - j * block_size)"),
    ("block max, m", "m_new = torch.maximum(m, s.amax(dim=-1))"),
    ("rescale", "rescale = torch.exp(m - m_ref)"),
    ("l", "l = rescale * l + p.sum(dim=-1)"),
    ("acc", 'acc = rescale[..., None] * acc + torch.einsum("hgtn,nhd->hgtd", p, v)'),
    ("output", "o = torch.where(l[..., None] > 0, acc / l.clamp_min(1e-38)[..., None], 0.0)"),
)


def kernel_lines() -> tuple[KernelLine, ...]:
    """Where :data:`KERNEL_LINES` stand in ``reference_impl/kernel.py`` now (1-based lines).

    Raises:
        RuntimeError: a line is gone (the kernel was edited without updating the walk).
    """
    lines = inspect.getsource(_kernel).splitlines()
    found = []
    for value, text in KERNEL_LINES:
        hits = [i for i, line in enumerate(lines, 1) if line.strip().startswith(text)]
        if not hits:
            raise RuntimeError(f"reference_impl/kernel.py has no line {text!r} any more")
        found.append(KernelLine(value=value, line=hits[0], text=lines[hits[0] - 1].strip()))
    return tuple(found)


def find_request(record: StepRecord, request: str) -> int:
    """The block-table row of ``request``: an engine id, its frontend prefix (``0`` for ``0-a0c640ce``) or ``#N``."""
    ids = list(record.request_ids)
    if request in ids:
        return ids.index(request)
    wanted = request.removeprefix("#")
    heads = [i for i, rid in enumerate(ids) if rid.rsplit("-", 1)[0] == wanted]
    if len(heads) == 1:
        return heads[0]
    raise TraceError(f"step {record.step}: no request {request!r}; this step has {', '.join(ids)}")


def _record(trace: Trace, step: int, layer: str | None) -> StepRecord:
    records = [r for r in trace.records if r.step == step and (layer is None or r.layer == layer)]
    if not records:
        steps = sorted({r.step for r in trace.records if r.tensors is not None})
        raise TraceError(
            f"{trace.path}: step {step} (layer {layer or 'any'}) not recorded; steps with tensors: {steps}"
        )
    with_tensors = [r for r in records if r.tensors is not None]
    if not with_tensors:
        raise TraceError(f"{trace.path}: step {step} has no tensors (trace with tensors on)")
    return with_tensors[0]


def _f(x: torch.Tensor) -> float:
    return float(x.item())


def walk_query(
    trace: Trace,
    step: int,
    request: str,
    head: int,
    *,
    layer: str | None = None,
    token: int | None = None,
    partition_size: int | None = None,
) -> QueryWalk:
    """Walk query ``token`` (default: the request's last) of ``head`` in ``step`` through the block loop.

    Args:
        trace: an opened trace with tensors.
        step: the step index.
        request: see :func:`find_request`.
        head: query head, 0-based.
        layer: layer name (default: the first recorded at that step).
        token: 0-based index among the request's query rows this step.
        partition_size: tokens per partition of the v2 form (a multiple of the block size;
            default two blocks, so that a short sequence shows a merge; vLLM's v2 uses 512).

    Raises:
        TraceError: the step, layer, request, head or token is not in the trace, or has no tensors.
    """
    record = _record(trace, step, layer)
    spec = kv_spec(trace)
    tensors = trace.tensors(record)
    inputs = step_inputs(record, tensors, spec, resolve_layout(trace, [record]), emulation=emulation_of(trace.run))
    b = find_request(record, request)
    q0, q1 = int(record.query_start_loc[b]), int(record.query_start_loc[b + 1])
    q_len, seq_len = q1 - q0, int(record.seq_lens[b])
    if q_len == 0:
        raise TraceError(f"step {step}: request {request!r} has no query tokens in this step")
    t = q_len - 1 if token is None else token
    if not 0 <= t < q_len:
        raise TraceError(f"step {step}: request {request!r} has query rows 0..{q_len - 1}, not {t}")
    # The walked row's place in the inputs: the request's rows batched, or (format 4, some rows
    # kept) the kept row alone, a one-token request of its own.
    row, q_first, local = b, q0, t
    if inputs.kept is not None:
        if q0 + t not in inputs.kept.rows:
            kept = [r - q0 for r in inputs.kept.rows if q0 <= r < q1]
            if kept:
                raise TraceError(
                    f"step {step}: the trace kept query rows {kept} of request {request!r}, not {t} "
                    f"(traced with --query-rows): pass --token {kept[-1]}"
                )
            qsl = record.query_start_loc
            others = [
                record.request_ids[i]
                for i in range(record.num_reqs)
                if any(qsl[i] <= r < qsl[i + 1] for r in inputs.kept.rows)
            ]
            raise TraceError(
                f"step {step}: no query row of request {request!r} was kept (traced with --query-rows); "
                f"requests with kept rows in this step: {', '.join(others) or 'none'}"
            )
        row = q_first = inputs.kept.rows.index(q0 + t)
        local = 0
    num_heads = inputs.query.shape[1]
    if not 0 <= head < num_heads:
        raise TraceError(f"head {head} out of range: the model has {num_heads} query heads")
    num_kv_heads, block_size = inputs.key_cache.shape[2], inputs.key_cache.shape[1]
    group = num_heads // num_kv_heads
    h, g = divmod(head, group)
    partition = partition_size or 2 * block_size
    if partition <= 0 or partition % block_size:
        raise TraceError(f"partition size {partition} must be a positive multiple of the block size {block_size}")

    rows_walked = q_len if inputs.kept is None else 1
    args = (
        inputs.query[q_first : q_first + rows_walked],
        inputs.key_cache,
        inputs.value_cache,
        inputs.block_table[row : row + 1],
        inputs.seq_lens[row : row + 1],
        torch.tensor([0, rows_walked]),
    )
    blocks: list[BlockLine] = []
    words = Words.of(trace)
    tokens = words.request_tokens(record.request_ids[b]) if words else None

    def on_block(*, block: int, n_valid: int, logits, m, l, rescale, acc, **_: Any) -> None:
        scores = logits[h, g, local]
        visible = torch.isfinite(scores)
        blocks.append(
            BlockLine(
                logical=block,
                physical=record.block_table[b][block],
                positions=(block * block_size, block * block_size + n_valid),
                n_valid=n_valid,
                n_visible=int(visible.sum()),
                block_max=_f(scores.max()) if bool(visible.any()) else -math.inf,
                m=_f(m[h, g, local]),
                l=_f(l[h, g, local]),
                rescale=_f(rescale[h, g, local]),
                acc_norm=_f(acc[h, g, local].norm()),
                text=None if words is None or tokens is None else words.text(tokens[block * block_size :][:n_valid]),
            )
        )

    loop = _kernel.paged_attention_loop(*args, compute_dtype=REFERENCE_DTYPE, on_block=on_block, **inputs.kwargs)
    lses: list[tuple[int, int, float]] = []

    def on_partition(*, first: int, last: int, lse, **_: Any) -> None:
        lses.append((first, last, _f(lse[h, g, local])))

    parted = _kernel.paged_attention_partitioned(
        *args, compute_dtype=REFERENCE_DTYPE, partition_size=partition, on_partition=on_partition, **inputs.kwargs
    )
    finite = [x for _, _, x in lses if math.isfinite(x)]
    top = max(finite, default=0.0)
    lse = top + math.log(sum(math.exp(x - top) for x in finite)) if finite else -math.inf
    partitions = []
    for first, last, part_lse in lses:
        maxima = [bl.block_max for bl in blocks[first:last]]
        m_p = max(maxima)
        l_p = math.exp(part_lse - m_p) if math.isfinite(part_lse) else 0.0
        weight = math.exp(part_lse - lse) if math.isfinite(part_lse) else 0.0
        partitions.append(PartitionLine(blocks=(first, last), m=m_p, l=l_p, lse=part_lse, weight=weight))

    # Replay's bar for the walked head (judge_output: its per-head bar, the kernel's rounding read
    # as replay reads it), and vLLM's own output row, its error read the same way.
    expected, baseline = reference_outputs(inputs)
    bar = judge_output(inputs, tensors["output"], expected, baseline)["per_head_tol"][head]
    ours, written = loop[local, head], tensors["output"][q_first + local, head]
    vllm, judged = written.to(REFERENCE_DTYPE), interval_midpoints(written, inputs.emulation).to(REFERENCE_DTYPE)
    return QueryWalk(
        trace=str(trace.path),
        step=record.step,
        layer=record.layer,
        request_id=record.request_ids[b],
        row=b,
        token=t,
        position=seq_len - q_len + t,
        head=head,
        kv_head=h,
        seq_len=seq_len,
        block_size=block_size,
        scale=float(inputs.kwargs["scale"]),
        compute_dtype=str(REFERENCE_DTYPE).removeprefix("torch."),
        blocks=tuple(blocks),
        kernel_lines=kernel_lines(),
        partition_size=partition,
        partitions=tuple(partitions),
        lse=lse,
        loop_vs_partitioned=_f((loop[local, head] - parted[local, head]).abs().max()),
        output_norm=_f(ours.norm()),
        vllm_norm=_f(vllm.norm()),
        max_abs=_f((ours - judged).abs().max()),
        tolerance=bar,
        output_head=tuple(float(x) for x in ours[:8]),
        vllm_head=tuple(float(x) for x in vllm[:8]),
        query_text=None if words is None or tokens is None else words.text(tokens[seq_len - q_len + t :][:1]),
    )


def walk_for_tour(trace: Trace) -> tuple[QueryWalk | None, str]:
    """The report tour's walk: ``tracer.format.walk.tour_target``'s query, head 0; or None and why not."""
    from tracer.format.walk import tour_target

    target = tour_target(trace)
    if target is None:
        return None, "No trace values beside the loop: no request step of this trace has tensors to run it on."
    step, request, layer = target
    try:
        return walk_query(trace, step, request, 0, layer=layer), ""
    except (TraceError, RuntimeError, ValueError) as exc:
        return None, f"No trace values beside the loop: walking step {step} failed ({exc})."
