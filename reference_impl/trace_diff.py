"""The tensor half of ``pagedtrace diff``: vLLM's outputs of two traces, head by head.

:func:`tracer.format.diff.diff_traces` pairs each request's steps across two traces from
the records alone; where both steps carry tensors, :func:`output_differences` compares
vLLM's ``output`` rows of the query positions both steps computed, per layer and query
head. The bar is each side's replay bar added (:func:`reference_impl.tolerances.head_bars`:
``k * err(FlashAttention's rounding, emulated) + a floor of the activation dtype's epsilon``,
per head) of A plus the same of B, so two engines that each compute attention to that
accuracy on the same inputs stay within it.

Imports torch, :mod:`reference_impl` and ``tracer.format`` only.
"""

from __future__ import annotations

import torch

from reference_impl.emulation import emulation_of
from reference_impl.inputs import StepInputs, reference_outputs, step_inputs
from reference_impl.resolve import kv_spec, resolve_layout
from reference_impl.tolerances import head_bars
from tracer.format import StepRecord, Trace
from tracer.format.diff import OutputDiff, TraceDiff

__all__ = ["output_differences"]


class _Outputs:
    """One trace's captured outputs and per-head bars, computed once per (step, layer)."""

    def __init__(self, trace: Trace):
        self.trace = trace
        self.spec = kv_spec(trace)
        self.by_key = {(r.step, r.layer): r for r in trace.records if r.tensors is not None}
        self.layout = resolve_layout(trace, list(self.by_key.values())) if self.by_key else ""
        self.cache: dict[tuple[int, str], tuple[StepRecord, StepInputs, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def bar(self, step: int, layer: str, rows: list[int]) -> torch.Tensor:
        """``[H]``: replay's per-head bar over ``rows`` of the step's output."""
        _, inputs, _, expected, baseline = self.get(step, layer)
        return head_bars(expected[rows], baseline[rows], dtype=inputs.out_dtype)[0]

    def get(self, step: int, layer: str):
        key = (step, layer)
        if key not in self.cache:
            record = self.by_key[key]
            tensors = self.trace.tensors(record)
            inputs = step_inputs(record, tensors, self.spec, self.layout, emulation=emulation_of(self.trace.run))
            expected, baseline = reference_outputs(inputs)
            self.cache[key] = (record, inputs, tensors["output"].double(), expected, baseline)
        return self.cache[key]


def _rows(record: StepRecord, request_id: str) -> tuple[int, int, int]:
    """(first query row, query length, seq_len) of ``request_id`` in ``record``."""
    row = record.request_ids.index(request_id)
    q = record.query_start_loc
    return q[row], q[row + 1] - q[row], record.seq_lens[row]


def _positions(inputs: StepInputs, start: int, length: int, seq: int) -> dict[int, int]:
    """Sequence position -> row of the captured ``output``, for the request's rows ``start .. start+length``.

    Every row when all were kept; with format 4's ``query_rows`` only the kept ones.
    """
    first = seq - length
    if inputs.kept is None:
        return {first + i: start + i for i in range(length)}
    return {first + r - start: i for i, r in enumerate(inputs.kept.rows) if start <= r < start + length}


def output_differences(a: Trace, b: Trace, diff: TraceDiff) -> TraceDiff:
    """``diff`` with :attr:`TraceDiff.outputs` filled where both sides captured tensors.

    Only layers recorded with tensors on both sides are compared; a note says when none were.
    """
    side_a, side_b = _Outputs(a), _Outputs(b)
    outputs = []
    for request in diff.requests:
        for pair in request.pairs:
            layers = [
                layer for (s, layer) in side_a.by_key if s == pair.step_a and (pair.step_b, layer) in side_b.by_key
            ]
            for layer in layers:
                rec_a, in_a, out_a, _, _ = side_a.get(pair.step_a, layer)
                rec_b, in_b, out_b, _, _ = side_b.get(pair.step_b, layer)
                start_a, len_a, seq = _rows(rec_a, request.id_a)
                start_b, len_b, seq_b = _rows(rec_b, request.id_b)
                # Positions both steps computed (the last min(len_a, len_b) of the sequence) and kept.
                at_a = _positions(in_a, start_a, len_a, seq)
                at_b = _positions(in_b, start_b, len_b, seq_b)
                both = sorted(at_a.keys() & at_b.keys())
                if not both:
                    continue
                rows_a, rows_b = [at_a[p] for p in both], [at_b[p] for p in both]
                max_abs = (out_a[rows_a] - out_b[rows_b]).abs().amax(dim=(0, 2))
                bar = side_a.bar(pair.step_a, layer, rows_a) + side_b.bar(pair.step_b, layer, rows_b)
                outputs.append(
                    OutputDiff(
                        label=request.label,
                        seq_len=seq,
                        step_a=pair.step_a,
                        step_b=pair.step_b,
                        layer=layer,
                        positions=(both[0], both[-1] + 1),
                        max_abs=tuple(float(x) for x in max_abs),
                        bar=tuple(float(x) for x in bar),
                    )
                )
    notes = () if outputs else ("no step has tensors on both sides: outputs not compared",)
    return diff.with_outputs(tuple(outputs), notes)
