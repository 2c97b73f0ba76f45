"""One captured (step, layer) as kernel inputs, and the reference outputs it is judged by.

:func:`step_inputs` reads the step's captured ``kv_blocks`` into the canonical K/V caches
and remaps the block table onto them (:func:`compact_block_table`); :class:`KernelOptions`
carries the step's keywords; :func:`reference_outputs` runs a reference form in fp64 and
in the activation dtype (the low-precision baseline of :mod:`reference_impl.tolerances`).

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
from reference_impl.options import KernelOptions
from reference_impl.resolve import read_cache
from reference_impl.tolerances import REFERENCE_DTYPE
from tracer.format import KVCacheSpec, StepRecord, TraceError

__all__ = ["KERNELS", "StepInputs", "compact_block_table", "reference_outputs", "run_kernel", "step_inputs"]

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
    num_reqs = len(block_table)
    width = max((len(r) for r in block_table), default=0)
    physical = torch.zeros(num_reqs, max(width, 1), dtype=torch.long)
    used = torch.zeros_like(physical, dtype=torch.bool)
    for b, row in enumerate(block_table):
        physical[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        used[b, : len(row)] = True
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


def baseline_dtype(query: torch.Tensor) -> torch.dtype:
    """The low-precision baseline runs in the activation dtype (fp32 models: fp32)."""
    return query.dtype if query.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32


@dataclass(frozen=True, eq=False)
class StepInputs:
    """One (step, layer) as the kernels take it: the compact canonical cache and remapped table.

    Built by :func:`step_inputs`; :func:`replay_record` and ``reference_impl.testing``
    feed exactly these tensors to a kernel.
    """

    query: torch.Tensor  #: ``[T, H, D]`` as captured (rows past ``num_tokens`` are padding)
    key_cache: torch.Tensor  #: ``[n, bs, H_kv, D]``: the captured blocks (+1 zero block if ``missing``)
    value_cache: torch.Tensor  #: ``[n, bs, H_kv, D]``
    block_table: torch.Tensor  #: ``[B, max_blocks]`` long: rows of the compact cache, see :func:`compact_block_table`
    seq_lens: torch.Tensor  #: ``[B]`` long
    query_start_loc: torch.Tensor  #: ``[B + 1]`` long
    kwargs: dict[str, Any]  #: the step's keywords, ``KernelOptions.kwargs()``
    num_tokens: int  #: query rows compared: ``min(query_start_loc[-1], query rows, output rows)``
    missing: tuple[int, ...] = ()  #: physical block ids the table names that were not captured
    note: str = ""  #: what is odd about the step (uncaptured blocks, query rows != query_start_loc[-1])

    @property
    def args(self) -> tuple[torch.Tensor, ...]:
        """The six positional kernel arguments, in the reference signature's order."""
        return (self.query, self.key_cache, self.value_cache, self.block_table, self.seq_lens, self.query_start_loc)


def step_inputs(record: StepRecord, tensors: Mapping[str, torch.Tensor], spec: KVCacheSpec, layout: str) -> StepInputs:
    """Read one (step, layer)'s captured tensors into kernel inputs.

    The captured ``kv_blocks`` are read from ``layout`` into canonical K/V caches and the
    block table is remapped from physical ids onto their rows. Blocks the table names
    but the tracer did not capture become one zero block (so a kernel fails loudly
    instead of indexing out of range) and are listed in ``missing``.

    Raises:
        TraceError: ``query``, ``output``, ``kv_blocks`` or ``kv_block_ids`` was not captured,
            or the blocks cannot be read as ``layout``.
    """
    missing_names = {"query", "output", "kv_blocks", "kv_block_ids"} - tensors.keys()
    if missing_names:
        raise TraceError(f"step {record.step} layer {record.layer}: tensors {sorted(missing_names)} not captured")
    query, output = tensors["query"], tensors["output"]
    key_cache, value_cache = read_cache(tensors["kv_blocks"], layout, spec.head_size)
    table, missing = compact_block_table(record.block_table, tensors["kv_block_ids"].long())
    if missing:
        zero = torch.zeros_like(key_cache[:1])
        key_cache, value_cache = torch.cat([key_cache, zero]), torch.cat([value_cache, zero])
    seq_lens = torch.tensor(record.seq_lens, dtype=torch.long)
    query_start_loc = torch.tensor(record.query_start_loc, dtype=torch.long)
    num = min(int(query_start_loc[-1]), query.shape[0], output.shape[0])
    notes = []
    if missing:
        notes.append(f"block table names blocks {missing} that were not captured")
    if query.shape[0] != int(query_start_loc[-1]):
        notes.append(f"query has {query.shape[0]} rows, query_start_loc ends at {int(query_start_loc[-1])}")
    options = KernelOptions.from_step(record, spec)
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
    )


def reference_outputs(inputs: StepInputs, kernel: str = "fast") -> tuple[torch.Tensor, torch.Tensor]:
    """The reference output (``REFERENCE_DTYPE``) and its low-precision baseline, ``[T, H, D]`` each.

    The baseline is the same math in the activation dtype (bf16 for bf16 models); the
    tolerance is ``TOL_K * max|baseline - reference| + TOL_EPS``.
    """
    block_size = inputs.key_cache.shape[1]
    expected = run_kernel(kernel, *inputs.args, block_size=block_size, compute_dtype=REFERENCE_DTYPE, **inputs.kwargs)
    baseline = run_kernel(
        kernel, *inputs.args, block_size=block_size, compute_dtype=baseline_dtype(inputs.query), **inputs.kwargs
    )
    return expected, baseline
