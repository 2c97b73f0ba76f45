"""The write path and the legacy layout, checked on each captured step.

write path
    The ``key``/``value`` that ``do_kv_cache_update`` received are scattered through
    ``slot_mapping`` (``slot = block * block_size + offset``, -1 = padding, skipped)
    into the recorded layout; the captured blocks must hold exactly those bits
    (:func:`check_write_path`).
legacy
    The same cache is rewritten in ``PagedAttention.split_kv_cache``'s layout (key
    ``[nb, H_kv, D/x, bs, x]``, value ``[nb, H_kv, D, bs]``), read back through the
    legacy reader, and attention rerun: the output is bitwise the same. The x-split is
    storage only (:func:`check_legacy_path`).

Imports torch, :mod:`reference_impl` and ``tracer.format`` (the bottom layer) only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from reference_impl import layouts as _layouts
from reference_impl.inputs import run_kernel
from reference_impl.options import KernelOptions
from reference_impl.resolve import quantize_like_cache, read_cache
from reference_impl.tolerances import REFERENCE_DTYPE
from tracer.format import STORED_LAYOUTS, KVCacheSpec, LegacyCheck, StepRecord, TraceError, WriteCheck

__all__ = ["check_legacy_path", "check_write_path"]


def _slot_positions(slot_mapping: torch.Tensor, block_ids: torch.Tensor, block_size: int):
    """Where each token's slot lies in the compact cache.

    Returns ``(written [T] bool, index [T] long, offset [T] long, captured [T] bool)``:
    ``written`` is ``slot != -1``; ``index`` the block's row in ``kv_blocks``;
    ``captured`` False when that block is not among the captured ones.
    """
    slots = slot_mapping.long()
    written = slots >= 0
    block = torch.where(written, slots // block_size, 0)
    offset = torch.where(written, slots % block_size, 0)
    index = torch.searchsorted(block_ids, block).clamp_max(max(len(block_ids) - 1, 0))
    captured = written & (block_ids[index] == block) if len(block_ids) else torch.zeros_like(written)
    return written, index, offset, captured


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: do the bits of ``a`` and ``b`` differ? (NaN-safe, -0 != +0.)"""
    as_int = _INT_OF_SIZE[a.element_size()]
    return a.view(as_int) != b.view(as_int)


def check_write_path(
    record: StepRecord, tensors: Mapping[str, torch.Tensor], spec: KVCacheSpec, layout: str
) -> WriteCheck | None:
    """Scatter the recorded ``key``/``value`` through ``slot_mapping`` into the layout; compare bits.

    The captured blocks are read into canonical K/V (exact), token ``t``'s K/V (in the
    cache dtype; fp8: e4m3 bytes of ``x / scale``) is written at block
    ``slot // block_size``, offset ``slot % block_size``, and the result is packed back
    into ``layout`` with the layout's writer (for ``cpu``: K^T ``[D][bs]``, then V). The
    captured blocks must equal it bit for bit; each differing element is traced back to
    the token whose slot holds it. A slot in a block the step did not capture counts as a
    mismatch: vLLM wrote outside the block table.

    Returns:
        The check, or None when the step has no ``key``/``value`` (a KV update the
        tracer did not see).
    """
    if "key" not in tensors or "value" not in tensors:
        return None
    # legacy is only converted to, never stored: there are no captured bits to compare.
    writer = _layouts.WRITERS.get(layout) if layout in STORED_LAYOUTS else None
    if writer is None:
        raise TraceError(f"no writer for KV layout {layout!r}")
    kv_blocks = tensors["kv_blocks"]
    at = kv_blocks.device  # the bits are compared where the blocks are; the token indices, on the CPU
    block_ids = tensors["kv_block_ids"].to("cpu", torch.long)
    key, value = tensors["key"].to(at), tensors["value"].to(at)
    num = min(len(record.slot_mapping), key.shape[0], value.shape[0])
    slot_mapping = torch.tensor(record.slot_mapping[:num], dtype=torch.long)
    written, index, offset, captured = _slot_positions(slot_mapping, block_ids, spec.block_size)
    rows = captured.nonzero().flatten()
    # Only the blocks the step wrote into are compared (a difference elsewhere is never read
    # back below): repacking the whole cache each step would cost more than the attention.
    touched, inverse = torch.unique(index[rows], return_inverse=True)
    sizes = (len(rows), len(rows), len(rows), len(touched))
    rows_at, idx, off, touched = torch.cat([rows, inverse, offset[rows], touched]).to(at).split(sizes)

    # The scales the engine used that step (format 2), else the manifest's.
    k_scale = spec.k_scale if record.k_scale is None else record.k_scale
    v_scale = spec.v_scale if record.v_scale is None else record.v_scale
    new_k = quantize_like_cache(key[:num][rows_at], kv_blocks.dtype, k_scale)  # [t, H_kv, D]
    new_v = quantize_like_cache(value[:num][rows_at], kv_blocks.dtype, v_scale)
    kv_blocks = kv_blocks.index_select(0, touched)
    got_k, got_v = read_cache(kv_blocks, layout, spec.head_size)
    key_cache, value_cache = got_k.clone(), got_v.clone()
    key_cache[idx, off] = new_k
    value_cache[idx, off] = new_v
    expected = writer(key_cache, value_cache)  # [n, H_kv, bs, 2*D], the layout's memory order
    assert isinstance(expected, torch.Tensor)  # only legacy writes two tensors, and it is refused above

    # Elements whose bits differ, read back through the layout to (block, offset, head, dim).
    diff = _differs(expected, kv_blocks).to(torch.uint8)
    diff_k, diff_v = read_cache(diff, layout, spec.head_size)
    token_bad = (diff_k[idx, off] | diff_v[idx, off]).flatten(1).any(1).bool()
    # Two tokens sent to one slot: the scatter keeps one of them, so also ask each
    # token's slot for that token's own bits.
    token_bad |= _differs(got_k[idx, off], new_k).flatten(1).any(1)
    token_bad |= _differs(got_v[idx, off], new_v).flatten(1).any(1)
    bad = written & ~captured
    bad[rows[token_bad.cpu()]] = True  # the one transfer back
    mismatches = int(bad.sum())
    return WriteCheck(
        step=record.step,
        layer=record.layer,
        ok=mismatches == 0,
        tokens=int(written.sum()),
        mismatches=mismatches,
        first_mismatch=int(bad.nonzero()[0]) if mismatches else None,
    )


#: How far the rerun over the round-tripped caches may drift from the direct fp64 result, relative
#: to the largest |output|: the caches are equal bit for bit, but a CPU BLAS may sum in another order
#: for buffers at other addresses. A layout bug moves values by O(1), not by 1e-9.
LEGACY_RERUN_RTOL = 1e-6


def check_legacy_path(
    record: StepRecord,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    table: torch.Tensor,
    expected: torch.Tensor,
    query: torch.Tensor,
    spec: KVCacheSpec,
    kernel: str = "fast",
    *,
    seq_lens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    rerun: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> LegacyCheck | None:
    """Rewrite the canonical caches in paged_attn.py's layout, read them back, rerun.

    Args:
        key_cache, value_cache: canonical ``[n, bs, H_kv, D]`` caches of the step.
        table: the compact block table used for ``expected``.
        expected: the direct reference output ``[T, H, D]`` (``REFERENCE_DTYPE``).
        seq_lens, query_start_loc: those ``expected`` was computed with (``StepInputs``'); None:
            the record's (they differ when only some query rows were kept).
        rerun: ``rerun(key_back, value_back)`` gives the reference output over the round-tripped
            caches as ``expected`` was computed (a GPU pass reruns there); None: ``kernel`` runs it.

    Returns:
        The check, or None when ``D`` is not a multiple of ``x = 16 // element_size``
        (the legacy kernels do not support such heads).
    """
    x = _layouts.legacy_x(key_cache.dtype)
    if spec.head_size % x:
        return None
    key_legacy, value_legacy = _layouts.kv_to_legacy(key_cache, value_cache)  # [n,H,D/x,bs,x], [n,H,D,bs]
    key_back, value_back = _layouts.legacy_to_kv(key_legacy, value_legacy)
    if rerun is not None:
        out = rerun(key_back, value_back)
        return _legacy_verdict(record, x, out, expected, (key_back, value_back), (key_cache, value_cache))
    out = run_kernel(
        kernel,
        query,
        key_back,
        value_back,
        table,
        torch.tensor(record.seq_lens, dtype=torch.long) if seq_lens is None else seq_lens,
        torch.tensor(record.query_start_loc, dtype=torch.long) if query_start_loc is None else query_start_loc,
        block_size=spec.block_size,
        compute_dtype=REFERENCE_DTYPE,
        **KernelOptions.from_step(record, spec).kwargs(),
    )
    return _legacy_verdict(record, x, out, expected, (key_back, value_back), (key_cache, value_cache))


def _legacy_verdict(
    record: StepRecord,
    x: int,
    out: torch.Tensor,
    expected: torch.Tensor,
    back: tuple[torch.Tensor, torch.Tensor],
    caches: tuple[torch.Tensor, torch.Tensor],
) -> LegacyCheck:
    """The round trip holds: the caches came back bit for bit, and the rerun gives ``expected``."""
    diff = float((out - expected).abs().max()) if out.numel() else 0.0
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    exact = all(torch.equal(a, b) for a, b in zip(back, caches, strict=True))
    ok = exact and diff <= LEGACY_RERUN_RTOL * max(scale, 1.0)
    return LegacyCheck(step=record.step, layer=record.layer, ok=ok, max_abs=diff, x=x)
