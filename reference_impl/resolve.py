"""Reading the captured KV blocks: the trace's cache spec, which layout, the read itself.

The ``cpu`` layout name covers two packings that vLLM's CPU backend picks at runtime
(``cpu_attn._get_attn_isa``): ``vec``/``vec16`` store each (block, kv head) region as
K^T ``[D][bs]`` then V ``[bs][D]`` (``cpu``); ``amx`` (bf16, ``block_size % 32 == 0``,
a CPU with AMX tiles) packs both for its tile loads (``cpu_amx``). Format 2 always
writes ``cpu_amx`` for the AMX packing; early format-1 traces may write ``cpu`` for
both, so :func:`resolve_layout` tells the two apart by where the recorded
``key``/``value`` rows occur in the captured blocks, and the report says which packing
it read.

Imports torch, :mod:`reference_impl` and ``tracer.format`` (the bottom layer) only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from reference_impl import layouts as _layouts
from tracer.format import KVCacheSpec, StepRecord, Trace, TraceError
from tracer.format.layouts import LAYOUT_CPU, LAYOUT_CPU_AMX

__all__ = ["bits", "kv_spec", "quantize_like_cache", "read_cache", "resolve_layout"]


def kv_spec(trace: Trace) -> KVCacheSpec:
    """The trace's KV-cache spec; ``TraceError`` when the manifest has none."""
    spec = trace.run.kv_cache
    if spec is None:
        raise TraceError(f"{trace.path}: the manifest has no KV-cache spec; nothing to replay")
    return spec


def read_cache(kv_blocks: torch.Tensor, layout: str, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Captured ``kv_blocks`` ``[n, H_kv, bs, 2*D]`` -> canonical K, V ``[n, bs, H_kv, D]``.

    ``layout`` is one of ``reference_impl.layouts.LAYOUTS`` but ``legacy``. The captured
    tensor has the cache's logical shape, contiguous (``kv_cache.index_select``), so the
    flash layouts read by logical indexing and the CPU ones by their row-major memory.
    """
    try:
        return _layouts.read_kv(kv_blocks, layout, head_size)
    except ValueError as exc:
        raise TraceError(f"cannot read the KV blocks as layout {layout!r}: {exc}") from None


def quantize_like_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """What the cache should hold for ``x``: itself, or fp8 e4m3 bytes of ``x / scale``."""
    if cache_dtype == torch.uint8 or cache_dtype == torch.float8_e4m3fn:
        q = (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)  # saturating, as vLLM
        return q.view(torch.uint8) if cache_dtype == torch.uint8 else q
    return x.to(cache_dtype)


def bits(x: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` -> ``[..., D * element_size]`` raw bytes, for bitwise comparison."""
    x = x.contiguous()
    return x.view(torch.uint8).reshape(*x.shape[:-1], -1)


def _row_set(x: torch.Tensor) -> set[bytes]:
    """The distinct rows of ``x`` ``[N, ...]``, as bytes."""
    flat = bits(x.reshape(x.shape[0], -1)).numpy()
    return {row.tobytes() for row in flat}


def _layout_score(tensors: Mapping[str, torch.Tensor], spec: KVCacheSpec, layout: str) -> float:
    """Fraction of the recorded new tokens whose K and V rows occur anywhere in the cache read as ``layout``.

    Uses neither ``slot_mapping`` nor the block table, so a bug there cannot steer
    the choice of layout: read in the wrong packing, the cache's token rows are
    scrambled and (almost) no recorded row occurs.
    """
    try:
        key_cache, value_cache = read_cache(tensors["kv_blocks"], layout, spec.head_size)
    except (TraceError, ValueError, RuntimeError):
        return 0.0
    key = quantize_like_cache(tensors["key"], key_cache.dtype, spec.k_scale)
    value = quantize_like_cache(tensors["value"], value_cache.dtype, spec.v_scale)
    if key.shape[0] == 0:
        return 0.0
    k_rows = _row_set(key_cache.reshape(-1, *key_cache.shape[2:]))
    v_rows = _row_set(value_cache.reshape(-1, *value_cache.shape[2:]))
    k_bits, v_bits = bits(key.reshape(key.shape[0], -1)).numpy(), bits(value.reshape(value.shape[0], -1)).numpy()
    hits = sum(k.tobytes() in k_rows and v.tobytes() in v_rows for k, v in zip(k_bits, v_bits, strict=False))
    return hits / key.shape[0]


def resolve_layout(trace: Trace, records: Sequence[StepRecord] | None = None) -> str:
    """The layout to read the captured blocks in.

    The manifest's ``KVCacheSpec.layout``, except that ``cpu`` is refined to
    :data:`LAYOUT_CPU_AMX` when the first record with ``key``/``value`` shows the AMX
    packing: more of the recorded K/V rows occur in the cache read that way than read
    as K^T (see :func:`_layout_score`; slot_mapping is not consulted, so the write
    check stays an independent test). Without such a record, or when neither packing
    explains at least half of the rows, the manifest's layout stands.
    """
    spec = kv_spec(trace)
    if spec.layout != LAYOUT_CPU:
        return spec.layout
    for record in records if records is not None else trace.records:
        if record.tensors is None or not {"key", "value"} <= set(record.tensor_names):
            continue
        tensors = trace.tensors(record)
        scores = {c: _layout_score(tensors, spec, c) for c in (LAYOUT_CPU, LAYOUT_CPU_AMX)}
        best = max(scores, key=scores.__getitem__)
        if scores[best] >= 0.5 and scores[best] > min(scores.values()):
            return best
        break
    return spec.layout
