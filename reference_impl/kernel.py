"""Reference paged attention, in three forms that are tested against each other.

All forms take FlashAttention's varlen batch (``flash_attn_varlen_func`` with a
``block_table``), as vLLM 0.26's backends receive it::

    query            [T, H, D]              T = query_start_loc[-1] (rows past it stay 0)
    key_cache        [nb, bs, H_kv, D]      canonical "NHD" cache, see reference_impl.layouts
    value_cache      [nb, bs, H_kv, D]
    block_table      [B, max_blocks] int    row b maps logical block j -> physical block
    seq_lens         [B] int                s_b: keys of sequence b, the new ones included
    query_start_loc  [B + 1] int            queries of sequence b: rows qsl[b]:qsl[b+1]
    -> out           [T, H, D]              compute dtype (fp32 unless asked otherwise)

Semantics (those of vLLM / FlashAttention):

* GQA: ``G = H // H_kv`` query heads share a kv head; query head ``h`` reads kv head
  ``h // G``. Inside the kernels the query heads are viewed as ``[H_kv, G]``.
* Query ``i`` of a sequence with ``q`` queries and ``s`` keys sits at position
  ``s - q + i`` (causal mask aligned bottom-right); with ``causal`` it sees keys
  ``j <= pos``.
* ``window = (left, right)``, FA's convention, -1 = unlimited: key ``j`` is visible iff
  ``pos - left <= j <= pos + right``, and with ``causal`` also ``j <= pos``.
* ``softcap > 0``: logits become ``softcap * tanh(scale * q.k / softcap)``.
* ALiBi: ``-slope[h] * |pos - j|`` is added to the logits (FA's ``attention_ref``); for
  the keys a causal query sees this is ``slope[h] * (j - pos)``.
* ``sinks[h]``: one more logit per head in the softmax denominator, with no value.
* fp8: a ``uint8`` (or ``float8_e4m3fn``) cache is read as e4m3 times ``k_scale`` /
  ``v_scale``; other caches ignore the scales, as vLLM does.
* Rows of sequences with ``q = 0`` are untouched; a query with no visible key outputs 0.

Einsum letters, the same in every form::

    b sequence    t query token    n key token    h kv head    g query head within its
    kv head       d head dim       p partition

The forms, each tested against the others and against :func:`dense_attention`
(``tests/test_kernel.py``):

:func:`paged_attention_loop`
    The kernel's shape: per sequence, per logical block, ``block_table`` gives the
    physical block, one block of K/V is read and folded into an online softmax. This is
    the function the HTML report shows next to vLLM's source.
:func:`paged_attention_partitioned`
    The v2 kernel's ``PARTITION_SIZE`` split: each partition yields ``(out, lse)`` and
    :func:`combine_partitions` merges them. The same merge is what cascade attention
    (common prefix + per-sequence suffix) and ``merge_attn_states`` do: a cascade batch
    equals plain attention over the full block table once its prefix pass (non-causal,
    shared blocks) and suffix pass (causal, own blocks) are merged this way
    (``tests/test_kernel.py::test_cascade_prefix_plus_suffix_equals_full``).
:func:`reference_impl.fast.paged_attention_fast`
    No loop over blocks: ranges of blocks gathered with one ``index_select``, a masked
    softmax over each; used to replay traces (:mod:`reference_impl.fast`).

:func:`dense_attention` is the plain, non-paged reference over logically ordered K/V;
:mod:`reference_impl.tolerances` judges a kernel's output against a reference (error
relative to FlashAttention's rounding, emulated by :mod:`reference_impl.emulation`, as
flash-attn's tests hold kernels to a low-precision reference).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from reference_impl.common import cdiv, check_args, read_cache_as
from reference_impl.gathered import attend_gathered, gather_blocks, visibility

__all__ = ["combine_partitions", "dense_attention", "paged_attention_loop", "paged_attention_partitioned"]


# --------------------------------------------------------------------------- loop


def paged_attention_loop(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    compute_dtype: torch.dtype = torch.float32,
    on_block: Callable[..., None] | None = None,
) -> torch.Tensor:
    """Paged attention as the kernel does it: a block loop with an online softmax.

    Args:
        query: ``[T, H, D]``.
        key_cache: ``[num_blocks, block_size, H_kv, D]`` (uint8 = fp8 e4m3).
        value_cache: ``[num_blocks, block_size, H_kv, D]``.
        block_table: ``[B, max_blocks]``; entries past ``ceil(s_b / block_size)`` are
            never read.
        seq_lens: ``[B]``.
        query_start_loc: ``[B + 1]``.
        scale, causal, window, softcap, alibi_slopes (``[H]``), sinks (``[H]``), k_scale,
        v_scale: see the module docstring.
        compute_dtype: fp32 or fp64 (bf16/fp16 only as a low-precision baseline).
        on_block: called after each block is folded in, with keywords ``seq`` (b), ``block``
            (j), ``physical``, ``n_valid``, ``logits`` ``[h, g, t, n]`` (masked = -inf) and
            the running ``m``, ``l`` ``[h, g, t]``, ``rescale`` ``[h, g, t]``, ``acc``
            ``[h, g, t, d]``: the values :mod:`reference_impl.stepper` shows. Read only.

    Returns:
        ``[T, H, D]`` in ``compute_dtype``.
    """
    check_args(query, key_cache, value_cache, block_table, seq_lens, query_start_loc)
    num_tokens, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads  # query heads per kv head (GQA)
    left, right = window
    out = torch.zeros(num_tokens, num_heads, head_size, dtype=compute_dtype)

    for b in range(seq_lens.shape[0]):
        q_start, q_end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        seq_len = int(seq_lens[b])
        q_len = q_end - q_start
        if q_len == 0:
            continue
        # [t, h, g, d]: query head h*G + g reads kv head h.
        q = query[q_start:q_end].to(compute_dtype).view(q_len, num_kv_heads, group, head_size)
        # New tokens are the last q_len of the sequence: bottom-right aligned positions.
        q_pos = torch.arange(seq_len - q_len, seq_len)  # [t]

        # Online-softmax state per (head, query): running max m, running sum l of
        # exp(logit - m), and acc = sum of exp(logit - m) * v. A sink starts the
        # softmax as one logit with no value: m = sink, l = exp(sink - m) = 1.
        if sinks is None:
            m = torch.full((num_kv_heads, group, q_len), -math.inf, dtype=compute_dtype)
            l = torch.zeros(num_kv_heads, group, q_len, dtype=compute_dtype)
        else:
            sink = sinks.to(compute_dtype).view(num_kv_heads, group, 1)
            m = sink.expand(num_kv_heads, group, q_len).clone()
            l = torch.ones(num_kv_heads, group, q_len, dtype=compute_dtype)
        acc = torch.zeros(num_kv_heads, group, q_len, head_size, dtype=compute_dtype)

        # j is the logical block index; block_table maps it to a physical block.
        for j in range(cdiv(seq_len, block_size)):  # tour: block
            physical = int(block_table[b, j])  # tour: block
            # Only the valid slots of the last block are read; vLLM's kernel zeroes the
            # V values past seq_len for the same reason (stale slots may hold NaN).
            n_valid = min(block_size, seq_len - j * block_size)  # tour: block
            # k, v: [n, h, d]; k_pos: [n].
            k = read_cache_as(key_cache[physical, :n_valid], k_scale, compute_dtype)  # tour: block
            v = read_cache_as(value_cache[physical, :n_valid], v_scale, compute_dtype)  # tour: block
            k_pos = j * block_size + torch.arange(n_valid)  # tour: block

            s = torch.einsum("thgd,nhd->hgtn", q, k) * scale  # logits [h, g, t, n]
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            distance = q_pos[:, None] - k_pos[None, :]  # [t, n], pos - j
            if alibi_slopes is not None:
                slopes = alibi_slopes.to(compute_dtype).view(num_kv_heads, group, 1, 1)
                s = s - slopes * distance.abs()
            visible = torch.ones_like(distance, dtype=torch.bool)  # [t, n]
            if causal:
                visible &= distance >= 0
            if left >= 0:
                visible &= distance <= left
            if right >= 0:
                visible &= distance >= -right
            s = s.masked_fill(~visible, -math.inf)

            # m_new, m_ref, rescale, l: [h, g, t]; p: [h, g, t, n]; acc: [h, g, t, d].
            m_new = torch.maximum(m, s.amax(dim=-1))  # tour: softmax
            # While every key so far is masked m_new is -inf; subtracting 0 instead keeps
            # exp() at 0 rather than exp(-inf + inf) = NaN.
            m_ref = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - m_ref[..., None])
            # exp(m_old - m_new) brings the old terms to the new max.
            rescale = torch.exp(m - m_ref)  # tour: softmax
            l = rescale * l + p.sum(dim=-1)  # tour: softmax
            acc = rescale[..., None] * acc + torch.einsum("hgtn,nhd->hgtd", p, v)  # tour: softmax
            m = m_new  # tour: softmax
            if on_block is not None:
                on_block(
                    seq=b, block=j, physical=physical, n_valid=n_valid, logits=s, m=m, l=l, rescale=rescale, acc=acc
                )

        # A query that saw no key (and no sink) has l = 0 and outputs 0.
        o = torch.where(l[..., None] > 0, acc / l.clamp_min(1e-38)[..., None], 0.0)  # tour: softmax
        out[q_start:q_end] = o.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_size)
    return out


# --------------------------------------------------------------------------- partitioned


def combine_partitions(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention computed over disjoint key sets, weighting by log-sum-exp.

    ``out = sum_p exp(lse_p - lse) * out_p`` with ``lse = log(sum_p exp(lse_p))``: the
    reduce step of vLLM's v2 kernel, of ``merge_attn_states`` and of cascade attention.

    Args:
        outs: ``[p, ..., d]`` per-partition outputs, each normalised by its own
            denominator (e.g. ``[p, t, H, D]``).
        lses: ``[p, ...]`` per-partition log denominators; ``-inf`` marks an empty one.

    Returns:
        ``(out [..., d], lse [...])``; ``out`` is 0 where every partition is empty.
    """
    lse_max = lses.amax(dim=0)
    lse_ref = torch.where(torch.isinf(lse_max), torch.zeros_like(lse_max), lse_max)
    weights = torch.exp(lses - lse_ref)  # [p, ...]; empty partitions weigh 0
    total = weights.sum(dim=0)
    out = (weights[..., None] * outs).sum(dim=0)
    out = torch.where(total[..., None] > 0, out / total.clamp_min(1e-38)[..., None], 0.0)
    return out, lse_ref + torch.log(total)


def paged_attention_partitioned(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    compute_dtype: torch.dtype = torch.float32,
    partition_size: int = 512,
    on_partition: Callable[..., None] | None = None,
) -> torch.Tensor:
    """Paged attention split over ``partition_size``-token key partitions (v2 kernel).

    Each sequence's keys ``[0, s)`` are cut into partitions ``[i*P, (i+1)*P)``; each
    partition gives its own normalised output and log-sum-exp, and
    :func:`combine_partitions` merges them. A sink joins as one more partition with
    ``lse = sinks[h]`` and zero output. The result equals the unpartitioned one.

    Args:
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale,
        causal, window, softcap, alibi_slopes, sinks, k_scale, v_scale, compute_dtype:
            as :func:`paged_attention_loop`.
        partition_size: tokens per partition, a multiple of ``block_size`` (as vLLM's
            ``PARTITION_SIZE`` is).
        on_partition: called per partition with keywords ``seq`` (b), ``first`` / ``last``
            (its logical blocks, half-open), ``out`` ``[h, g, t, d]`` and ``lse`` ``[h, g, t]``.

    Returns:
        ``[T, H, D]`` in ``compute_dtype``.
    """
    check_args(query, key_cache, value_cache, block_table, seq_lens, query_start_loc)
    num_tokens, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if partition_size <= 0 or partition_size % block_size:
        raise ValueError(f"partition_size {partition_size} must be a multiple of {block_size}")
    group = num_heads // num_kv_heads
    blocks_per_partition = partition_size // block_size
    out = torch.zeros(num_tokens, num_heads, head_size, dtype=compute_dtype)

    for b, (seq_len, q_start, q_end) in enumerate(
        zip(seq_lens.tolist(), query_start_loc[:-1].tolist(), query_start_loc[1:].tolist(), strict=False)
    ):
        q_len = q_end - q_start
        if q_len == 0 or seq_len == 0:
            continue
        q = query[q_start:q_end].to(compute_dtype).view(q_len, num_kv_heads, group, head_size)
        q = q.permute(1, 2, 0, 3)[:, None]  # [h, b=1, g, t, d]
        q_pos = torch.arange(seq_len - q_len, seq_len)[None]  # [1, t]
        part_outs, part_lses = [], []
        for first in range(0, cdiv(seq_len, block_size), blocks_per_partition):
            last = min(first + blocks_per_partition, cdiv(seq_len, block_size))
            physical = block_table[b, first:last].long()[None]  # [1, m]
            k = gather_blocks(key_cache, physical, k_scale, compute_dtype)
            v = gather_blocks(value_cache, physical, v_scale, compute_dtype)
            k_pos = torch.arange(first * block_size, last * block_size)[None]  # [1, n]
            k_valid = k_pos < seq_len
            # Slots past seq_len are stale (maybe NaN): zero their V, as vLLM's kernel does.
            v = v.masked_fill(~k_valid[:, :, None, None], 0.0)
            visible = visibility(q_pos, k_pos, k_valid, causal, window)
            o, part_lse = attend_gathered(
                q,
                q_pos,
                k,
                v,
                k_pos,
                visible,
                scale=scale,
                softcap=softcap,
                alibi_slopes=alibi_slopes,
            )
            part_outs.append(o[:, 0])  # [h, g, t, d]
            part_lses.append(part_lse[:, 0])  # [h, g, t]
            if on_partition is not None:
                on_partition(seq=b, first=first, last=last, out=o[:, 0], lse=part_lse[:, 0])
        if sinks is not None:
            sink = sinks.to(compute_dtype).view(num_kv_heads, group, 1).expand(-1, -1, q_len)
            part_outs.append(torch.zeros_like(part_outs[0]))
            part_lses.append(sink)
        o, _ = combine_partitions(torch.stack(part_outs), torch.stack(part_lses))
        out[q_start:q_end] = o.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_size)
    return out


# --------------------------------------------------------------------------- dense


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Plain attention of one sequence over logically ordered, already decoded K/V.

    Written independently of the paged forms (full bias matrix, the sink as an extra
    softmax column) so that tests compare two derivations, like flash-attn's
    ``attention_ref``.

    Args:
        q: ``[t, H, D]``, the last ``t`` positions of the sequence.
        k: ``[n, H_kv, D]``, keys at positions ``0..n-1`` (``n = s``).
        v: ``[n, H_kv, D]``.
        scale, causal, window, softcap, alibi_slopes (``[H]``), sinks (``[H]``): see the
        module docstring.

    Returns:
        ``[t, H, D]`` in ``compute_dtype``.
    """
    q_len, num_heads, _ = q.shape
    n_keys, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    q = q.to(compute_dtype)
    # Repeat each kv head for its G query heads: head index = kv_head * G + g.
    k_full = k.to(compute_dtype).repeat_interleave(group, dim=1)  # [n, H, d]
    v_full = v.to(compute_dtype).repeat_interleave(group, dim=1)
    logits = torch.einsum("thd,nhd->htn", q, k_full) * scale
    if softcap > 0:
        logits = softcap * torch.tanh(logits / softcap)
    row = torch.arange(q_len)[:, None] + (n_keys - q_len)  # absolute query position
    col = torch.arange(n_keys)[None, :]
    if alibi_slopes is not None:
        bias = -(row - col).abs().to(compute_dtype)
        logits = logits + alibi_slopes.to(compute_dtype)[:, None, None] * bias
    left, right = window
    hidden = torch.zeros(q_len, n_keys, dtype=torch.bool)
    if causal:
        hidden |= col > row
    if left >= 0:
        hidden |= col < row - left
    if right >= 0:
        hidden |= col > row + right
    logits = logits.masked_fill(hidden, -math.inf)
    if sinks is not None:
        sink_col = sinks.to(compute_dtype)[:, None, None].expand(num_heads, q_len, 1)
        logits = torch.cat([logits, sink_col], dim=-1)
    probs = torch.softmax(logits, dim=-1)
    # A fully hidden row softmaxes to NaN; FlashAttention outputs 0 there.
    probs = torch.nan_to_num(probs, nan=0.0)[..., :n_keys]
    return torch.einsum("htn,nhd->thd", probs, v_full)
