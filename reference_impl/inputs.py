"""One captured (step, layer) as kernel inputs, and the reference outputs it is judged by.

:func:`step_inputs` reads the step's captured ``kv_blocks`` into the canonical K/V caches
and remaps the block table onto them (:func:`compact_block_table`); :class:`KernelOptions`
carries the step's keywords; :func:`reference_outputs` runs a reference form in fp64 and
the FlashAttention rounding emulation (:mod:`reference_impl.emulation`, the low-precision
baseline of :mod:`reference_impl.tolerances`).

fp8 as vLLM does it: with an fp8 KV cache, FA3 gets the query already quantised to e4m3
by ``Attention.forward`` (``QuantFP8`` with ``layer._q_scale``) and descales Q, K, V by
``q_scale`` / ``k_scale`` / ``v_scale``. A captured fp8 query is used as it is; a captured
bf16 query of an FA3 step whose record carries ``q_scale`` is quantised the same way
(:func:`reference_impl.emulation.quantize_query`). The reference forms get the query
dequantised (``e4m3 * q_scale``, exact in fp64); the emulation gets the e4m3 bytes.

Imports torch, :mod:`reference_impl` and ``tracer.format`` (the bottom layer) only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from reference_impl import compiled as _compiled
from reference_impl import fast as _fast
from reference_impl import kernel as _kernel
from reference_impl.common import FP8_STORAGE
from reference_impl.emulation import (
    FLASH,
    FP8_QUERY_DTYPES,
    Emulation,
    dequantize_query,
    emulate_flash_attention,
    interval_midpoints,
    quantize_query,
)
from reference_impl.options import KernelOptions
from reference_impl.resolve import read_cache
from reference_impl.tolerances import REFERENCE_DTYPE, TOL_K, compare
from tracer.format import KVCacheSpec, StepRecord, TraceError
from tracer.format.rows import QUERY_ROWS, RowView, row_view

__all__ = [
    "KERNELS",
    "StepInputs",
    "activation_dtype",
    "compact_block_table",
    "emulated_output",
    "reference_outputs",
    "run_kernel",
    "step_inputs",
]

#: Kernel name -> reference function (all share one signature, see reference_impl.kernel).
KERNELS: dict[str, Callable[..., Any]] = {
    "fast": _fast.paged_attention_fast,
    "loop": _kernel.paged_attention_loop,
    "partitioned": _kernel.paged_attention_partitioned,
    "compiled": _compiled.paged_attention_compiled,
}


def compact_block_table(
    block_table: Sequence[Sequence[int]], block_ids: torch.Tensor
) -> tuple[torch.Tensor, list[int]]:
    """Map physical block ids onto rows of the captured ``kv_blocks``.

    Args:
        block_table: per request, physical block ids (trimmed rows, as ``StepRecord``).
        block_ids: ``[n]`` sorted physical ids of the captured blocks.

    Returns:
        ``(table [B, max_blocks] long, missing)``: row indices into the compact cache,
        rows padded with 0 (never read: past ``ceil(seq_len / block_size)``);
        ``missing`` lists ids not captured, which map to row ``n`` (a zero block the
        caller appends).
    """
    lengths = [len(r) for r in block_table]
    width = max(lengths, default=0)
    used = torch.arange(max(width, 1))[None, :] < torch.tensor(lengths, dtype=torch.long)[:, None]
    physical = torch.zeros(used.shape, dtype=torch.long)
    physical[used] = torch.tensor([block for row in block_table for block in row], dtype=torch.long)
    ids = block_ids.long()
    index = torch.searchsorted(ids, physical).clamp_max(max(len(ids) - 1, 0))
    found = (ids[index] == physical) if len(ids) else torch.zeros_like(used)
    lost = used & ~found
    table = torch.where(found, index, 0)
    table[lost] = len(ids)
    return table, sorted({int(x) for x in physical[lost].tolist()})


def run_kernel(name: str, *args: torch.Tensor, block_size: int, **kwargs: Any) -> torch.Tensor:
    fn = KERNELS[name]
    if name == "partitioned":
        kwargs["partition_size"] = block_size * max(1, 512 // block_size)
    return fn(*args, **kwargs)


def activation_dtype(output: torch.Tensor) -> torch.dtype:
    """The dtype the kernel's output is rounded to: vLLM's captured output's (bf16 if it is not a float)."""
    return output.dtype if output.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16


@dataclass(frozen=True, eq=False)
class StepInputs:
    """One (step, layer) as the kernels take it: the compact canonical cache and remapped table.

    Built by :func:`step_inputs`; :func:`replay_record` and ``reference_impl.testing``
    feed exactly these tensors to a kernel.
    """

    query: torch.Tensor  #: ``[T, H, D]`` as captured, or fp8 dequantised to fp64 (rows past ``num_tokens``: padding)
    key_cache: torch.Tensor  #: ``[n, bs, H_kv, D]``: the captured blocks (+1 zero block if ``missing``)
    value_cache: torch.Tensor  #: ``[n, bs, H_kv, D]``
    block_table: torch.Tensor  #: ``[B, max_blocks]`` long: rows of the compact cache, see :func:`compact_block_table`
    seq_lens: torch.Tensor  #: ``[B]`` long
    query_start_loc: torch.Tensor  #: ``[B + 1]`` long
    kwargs: dict[str, Any]  #: the step's keywords, ``KernelOptions.kwargs()``
    num_tokens: int  #: query rows compared: ``min(query_start_loc[-1], query rows, output rows)``
    missing: tuple[int, ...] = ()  #: physical block ids the table names that were not captured
    note: str = ""  #: what is odd about the step (uncaptured blocks, query rows != query_start_loc[-1], defaults used)
    fp8_query: torch.Tensor | None = None  #: ``[T, H, D]`` e4m3: the query FA3's fp8 path got, else None
    q_scale: float = 1.0  #: the query's descale (fp8 path); 1.0 otherwise
    out_dtype: torch.dtype = torch.bfloat16  #: the activation dtype the output is rounded to
    #: Format 4 (``query_rows``): the step's kept rows, each a one-token request of its own
    #: (``tracer.format.rows.row_view``); None: every row, batched as the step was.
    kept: RowView | None = None
    #: How the kernel that ran rounds (the baseline of the bar): the trace's, ``emulation_of(run)``.
    emulation: Emulation = FLASH

    @property
    def args(self) -> tuple[torch.Tensor, ...]:
        """The six positional kernel arguments, in the reference signature's order."""
        return (self.query, self.key_cache, self.value_cache, self.block_table, self.seq_lens, self.query_start_loc)


def step_inputs(
    record: StepRecord,
    tensors: Mapping[str, torch.Tensor],
    spec: KVCacheSpec,
    layout: str,
    *,
    flash_attn_version: int | None = None,
    emulation: Emulation = FLASH,
    device: torch.device | str | None = None,
) -> StepInputs:
    """Read one (step, layer)'s captured tensors into kernel inputs.

    The captured ``kv_blocks`` are read from ``layout`` into canonical K/V caches and the
    block table is remapped from physical ids onto their rows. Blocks the table names
    but the tracer did not capture become one zero block (so a kernel fails loudly
    instead of indexing out of range) and are listed in ``missing``. With an fp8 cache
    the query is what FA3's fp8 path got (see the module docstring; ``flash_attn_version``
    is the trace's ``RunInfo.flash_attn_version``). ``emulation``: how the trace's kernel
    rounds (``reference_impl.emulation.emulation_of(trace.run)``), for the bar's baseline.
    ``device``: where the query and the caches go (a GPU reads the layout there); the block
    table, lengths and starts stay on the CPU. None: where the tensors are.

    Raises:
        TraceError: ``query``, ``output``, ``kv_blocks`` or ``kv_block_ids`` was not captured,
            or the blocks cannot be read as ``layout``.
    """
    missing_names = {"query", "output", "kv_blocks", "kv_block_ids"} - tensors.keys()
    if missing_names:
        raise TraceError(f"step {record.step} layer {record.layer}: tensors {sorted(missing_names)} not captured")
    query, output, kv_blocks = tensors["query"], tensors["output"], tensors["kv_blocks"]
    if device is not None:
        query, kv_blocks = query.to(device), kv_blocks.to(device)
    key_cache, value_cache = read_cache(kv_blocks, layout, spec.head_size)
    notes = []
    block_table, lens, starts, kept = record.block_table, record.seq_lens, record.query_start_loc, None
    if QUERY_ROWS in tensors:  # format 4: some rows kept, each judged as a one-token request
        try:
            kept = row_view(starts, lens, block_table, tensors[QUERY_ROWS].tolist(), causal=record.causal)
        except ValueError as exc:
            raise TraceError(f"step {record.step} layer {record.layer}: {exc}") from None
        block_table, lens, starts = kept.block_table, kept.seq_lens, kept.query_start_loc
        notes.append(f"query rows kept: {len(kept.rows)} of {record.num_actual_tokens}, each over its own context")
    table, missing = compact_block_table(block_table, tensors["kv_block_ids"].long())
    if missing:
        zero = torch.zeros_like(key_cache[:1])
        key_cache, value_cache = torch.cat([key_cache, zero]), torch.cat([value_cache, zero])
    seq_lens = torch.tensor(lens, dtype=torch.long)
    query_start_loc = torch.tensor(starts, dtype=torch.long)
    num = min(int(query_start_loc[-1]), query.shape[0], output.shape[0])
    if missing:
        notes.append(f"block table names blocks {missing} that were not captured")
    if query.shape[0] != int(query_start_loc[-1]):
        notes.append(f"query has {query.shape[0]} rows, query_start_loc ends at {int(query_start_loc[-1])}")
    options = KernelOptions.from_step(record, spec)
    if record.logits_soft_cap is None:
        notes.append("logits_soft_cap is null: read as 0 (no soft-cap), as vLLM's FlashAttentionImpl does")
    fp8_query, q_scale = _fp8_query(record, query, key_cache, flash_attn_version, notes)
    if fp8_query is not None:
        query = dequantize_query(fp8_query, q_scale)
    return StepInputs(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=table,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        kwargs=options.kwargs(),
        num_tokens=num,
        missing=tuple(missing),
        note="; ".join(notes),
        fp8_query=fp8_query,
        q_scale=q_scale,
        out_dtype=activation_dtype(output),
        kept=kept,
        emulation=emulation,
    )


def _fp8_query(
    record: StepRecord,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    flash_attn_version: int | None,
    notes: list[str],
) -> tuple[torch.Tensor | None, float]:
    """The e4m3 query FA3's fp8 path got and its descale, or ``(None, 1.0)`` off that path.

    Appends to ``notes`` the defaults a record without format 2's scales is read with.
    """
    if key_cache.dtype not in FP8_STORAGE:
        return None, 1.0
    if record.k_scale is None or record.v_scale is None:
        notes.append("k/v scales not recorded (before trace format 2): the manifest's k_scale / v_scale used")
    captured_fp8 = query.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
    said_fp8 = record.query_dtype in FP8_QUERY_DTYPES
    quantised = captured_fp8 or said_fp8 or (record.q_scale is not None and flash_attn_version == 3)
    if not quantised:
        return None, 1.0
    q_scale = 1.0 if record.q_scale is None else float(record.q_scale)
    if record.q_scale is None:
        notes.append("q_scale not recorded (before trace format 2): 1.0 used, vLLM's default")
    if captured_fp8:
        return query.to(torch.float8_e4m3fn), q_scale
    return quantize_query(query, q_scale), q_scale


def reference_outputs(inputs: StepInputs, kernel: str = "fast") -> tuple[torch.Tensor, torch.Tensor]:
    """The reference output (``REFERENCE_DTYPE``) and its low-precision baseline, ``[T, H, D]`` each.

    The baseline is :func:`reference_impl.emulation.emulate_flash_attention` (FlashAttention's
    rounding, or the CPU kernel's: ``inputs.emulation``, in ``inputs.out_dtype``); it never
    depends on ``kernel``, the reference form that gives the fp64 answer. The bar is
    :func:`reference_impl.tolerances.compare`'s.
    """
    block_size = inputs.key_cache.shape[1]
    expected = run_kernel(kernel, *inputs.args, block_size=block_size, compute_dtype=REFERENCE_DTYPE, **inputs.kwargs)
    return expected, emulated_output(inputs)


def judge_output(
    inputs: StepInputs, output: torch.Tensor, expected: torch.Tensor, baseline: torch.Tensor
) -> dict[str, Any]:
    """:func:`reference_impl.tolerances.compare` of a step's recorded ``output`` (its first ``num_tokens`` rows).

    A truncating kernel's values, and its baseline's, are read at the middle of the interval
    each stands for (``interval_midpoints``: unbiased); the bar is ``TOL_K`` at ``inputs.out_dtype``.
    """
    num = inputs.num_tokens
    judged, base = (interval_midpoints(x[:num], inputs.emulation) for x in (output, baseline))
    return compare(judged, expected[:num], base, k=TOL_K, dtype=inputs.out_dtype)


def emulated_output(inputs: StepInputs) -> torch.Tensor:
    """``[T, H, D]``: the step rounded as its kernel rounds it (``inputs.emulation``), in ``inputs.out_dtype``."""
    query = inputs.fp8_query if inputs.fp8_query is not None else inputs.query
    return emulate_flash_attention(
        query,
        *inputs.args[1:],
        q_scale=inputs.q_scale,
        out_dtype=inputs.out_dtype,
        emulation=inputs.emulation,
        **inputs.kwargs,
    )
