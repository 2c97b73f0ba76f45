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

Einsum letters, the same everywhere in this file::

    b sequence    t query token    n key token    h kv head    g query head within its
    kv head       d head dim       p partition

The forms:

:func:`paged_attention_loop`
    The kernel's shape: per sequence, per logical block, ``block_table`` gives the
    physical block, one block of K/V is read and folded into an online softmax. This is
    the function the HTML report shows next to vLLM's source.
:func:`paged_attention_fast`
    No loop over blocks: a range of blocks is gathered with one ``index_select`` and a
    masked softmax runs over it; short sequences are padded into one batch, long
    contexts are cut into key ranges merged by log-sum-exp. One-query (decode) rows need
    no mask: their keys are read unpadded, in chunks small enough to stay in cache.
    Used to replay traces.
:func:`paged_attention_partitioned`
    The v2 kernel's ``PARTITION_SIZE`` split: each partition yields ``(out, lse)`` and
    :func:`combine_partitions` merges them. The same merge is what cascade attention
    (common prefix + per-sequence suffix) and ``merge_attn_states`` do: a cascade batch
    equals plain attention over the full block table once its prefix pass (non-causal,
    shared blocks) and suffix pass (causal, own blocks) are merged this way
    (``tests/test_kernel.py::test_cascade_prefix_plus_suffix_equals_full``).

:func:`dense_attention` is the plain, non-paged reference over logically ordered K/V,
and :func:`compare` / :func:`tolerance` judge a kernel's output against it (error
relative to the same math in low precision, as flash-attn's tests do).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "paged_attention_loop",
    "paged_attention_fast",
    "paged_attention_partitioned",
    "combine_partitions",
    "dense_attention",
    "tolerance",
    "compare",
]

_FP8_STORAGE = (torch.uint8, torch.float8_e4m3fn)


def _read_cache(cache: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``cache`` as ``dtype``; fp8 bytes are decoded as e4m3 and multiplied by ``scale``."""
    if cache.dtype in _FP8_STORAGE:
        if cache.dtype == torch.uint8:
            cache = cache.view(torch.float8_e4m3fn)
        return cache.to(dtype) * scale
    return cache.to(dtype)


def _check_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    if query.dim() != 3 or key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "expected query [T, H, D] and caches [nb, bs, H_kv, D]; got "
            f"{tuple(query.shape)}, {tuple(key_cache.shape)}, {tuple(value_cache.shape)}"
        )
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_size or num_heads % num_kv_heads:
        raise ValueError(
            f"query heads {num_heads} x {head_size} do not fit kv heads "
            f"{num_kv_heads} x {key_cache.shape[3]}"
        )
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_table.shape[0] < num_seqs:
        raise ValueError(
            f"seq_lens [{num_seqs}] needs query_start_loc [{num_seqs + 1}] and "
            f"block_table [>= {num_seqs}, ...]; got {tuple(query_start_loc.shape)}, "
            f"{tuple(block_table.shape)}"
        )
    if num_seqs and block_table.shape[1] * key_cache.shape[1] < int(seq_lens.max()):
        longest = int(seq_lens.argmax())
        raise ValueError(
            f"block_table has {block_table.shape[1]} columns of {key_cache.shape[1]} slots; "
            f"sequence {longest} has {int(seq_lens[longest])} keys"
        )


def _add_sinks(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, num_queries: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add the sink logits ``[H]`` to the softmax of rows ``< num_queries``.

    The sink joins every query's denominator once: ``out [T, H, D]`` is scaled by the share
    the keys keep, ``lse [T, H]`` becomes the log of the whole denominator.
    """
    is_query = (torch.arange(out.shape[0]) < num_queries)[:, None]
    with_sink = torch.where(is_query, torch.logaddexp(lse, sinks.to(lse.dtype)[None, :]), lse)
    return out * torch.exp(lse - with_sink).nan_to_num(0.0)[..., None], with_sink


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


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

    Returns:
        ``[T, H, D]`` in ``compute_dtype``.
    """
    _check_args(query, key_cache, value_cache, block_table, seq_lens, query_start_loc)
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

        for j in range(_cdiv(seq_len, block_size)):  # logical block index
            physical = int(block_table[b, j])  # the paging: logical -> physical block
            # Only the valid slots of the last block are read; vLLM's kernel zeroes the
            # V values past seq_len for the same reason (stale slots may hold NaN).
            n_valid = min(block_size, seq_len - j * block_size)
            k = _read_cache(key_cache[physical, :n_valid], k_scale, compute_dtype)  # [n, h, d]
            v = _read_cache(value_cache[physical, :n_valid], v_scale, compute_dtype)  # [n, h, d]
            k_pos = j * block_size + torch.arange(n_valid)  # [n]

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

            m_new = torch.maximum(m, s.amax(dim=-1))  # [h, g, t]
            # While every key so far is masked m_new is -inf; subtracting 0 instead keeps
            # exp() at 0 rather than exp(-inf + inf) = NaN.
            m_ref = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - m_ref[..., None])  # [h, g, t, n]
            rescale = torch.exp(m - m_ref)  # exp(m_old - m_new): old terms to the new max
            l = rescale * l + p.sum(dim=-1)
            acc = rescale[..., None] * acc + torch.einsum("hgtn,nhd->hgtd", p, v)
            m = m_new

        # A query that saw no key (and no sink) has l = 0 and outputs 0.
        o = torch.where(l[..., None] > 0, acc / l.clamp_min(1e-38)[..., None], 0.0)
        out[q_start:q_end] = o.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_size)
    return out


# --------------------------------------------------------------------------- shared core


def _strided_bmm(x: torch.Tensor, y: torch.Tensor, transpose_y: bool) -> torch.Tensor:
    """``x[h, b] @ y[b, :, h, :]`` (or its transpose) for every (h, b), reading ``y`` in place.

    Args:
        x: ``[h, b, r, c]``.
        y: ``[b, n, h, e]``, the cache's own token-major order.
        transpose_y: ``"hbrd,bnhd->hbrn"`` (logits, ``c = e = d``) when True, else
            ``"hbrn,bnhd->hbrd"`` (``c = n``).

    A transposing copy of all of K/V costs more than the products, so each per-head
    slice of ``y`` is a strided matrix that bmm reads directly; one bmm batches the
    longer of the two loops.
    """
    num_heads, num_seqs = x.shape[0], x.shape[1]
    if num_seqs <= num_heads:
        parts = [
            torch.bmm(x[:, i], y[i].permute(1, 2, 0) if transpose_y else y[i].permute(1, 0, 2))
            for i in range(num_seqs)
        ]
        return parts[0].unsqueeze(1) if num_seqs == 1 else torch.stack(parts, dim=1)
    parts = [
        torch.bmm(x[j], y[:, :, j].transpose(1, 2) if transpose_y else y[:, :, j])
        for j in range(num_heads)
    ]
    return torch.stack(parts)


def _visibility(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    k_valid: torch.Tensor | None,
    causal: bool,
    window: tuple[int, int],
) -> torch.Tensor:
    """``[b, t, n]``: query ``t`` of row ``b`` may attend key ``n`` (see module docstring).

    Args:
        q_pos: ``[b, t]`` absolute query positions.
        k_pos: ``[b, n]`` absolute key positions.
        k_valid: ``[b, n]`` the key exists, or None when all do.
    """
    left, right = window
    distance = q_pos[:, :, None] - k_pos[:, None, :]  # pos - j
    visible = torch.ones_like(distance, dtype=torch.bool)
    if k_valid is not None:
        visible &= k_valid[:, None, :]
    if causal:
        visible &= distance >= 0
    if left >= 0:
        visible &= distance <= left
    if right >= 0:
        visible &= distance >= -right
    return visible


def _attend_gathered(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pos: torch.Tensor,
    visible: torch.Tensor | None,
    *,
    scale: float,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention over already gathered K/V (no sink).

    Args:
        q: ``[h, b, g, t, d]``.
        q_pos: ``[b, t]`` absolute positions of the queries.
        k: ``[b, n, h, d]`` (the cache's own token-major order).
        v: ``[b, n, h, d]``; finite wherever ``visible`` holds for some query, zero
            elsewhere (a stale NaN times a zero weight would still be NaN).
        k_pos: ``[b, n]`` absolute positions of the keys.
        visible: ``[b, t, n]`` from :func:`_visibility`, or None when every query sees
            every key.

    Returns:
        ``(out [h, b, g, t, d], lse [h, b, g, t])``; ``lse`` is the log of the softmax
        denominator, ``-inf`` (and ``out`` 0) where no key is visible.
    """
    num_kv_heads, num_seqs, group, num_q, head_size = q.shape
    num_keys = k.shape[1]
    q_rows = q.reshape(num_kv_heads, num_seqs, group * num_q, head_size)
    s = _strided_bmm(q_rows, k, transpose_y=True)  # "hbgtd,bnhd->hbgtn"
    # The logits are the largest tensor here: every step below works on them in place
    # (a fresh tensor per step costs page faults and cache misses, not arithmetic).
    s = s.view(num_kv_heads, num_seqs, group, num_q, num_keys).mul_(scale)
    if softcap > 0:
        s.div_(softcap).tanh_().mul_(softcap)
    if alibi_slopes is not None:
        distance = (q_pos[:, :, None] - k_pos[:, None, :]).abs()  # [b, t, n], |pos - j|
        slopes = alibi_slopes.to(s.dtype).view(num_kv_heads, 1, group, 1, 1)
        s.sub_(slopes * distance[None, :, None])
    if visible is not None:
        s.masked_fill_(~visible[None, :, None], -math.inf)

    m = s.amax(dim=-1)  # [h, b, g, t]
    # Rows with nothing visible have m = -inf: subtract 0 there, keeping exp() at 0.
    m_ref = m if visible is None else torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = s.sub_(m_ref[..., None]).exp_()
    l = p.sum(dim=-1)
    p_rows = p.view(num_kv_heads, num_seqs, group * num_q, num_keys)
    o = _strided_bmm(p_rows, v, transpose_y=False)  # "hbgtn,bnhd->hbgtd"
    o = o.view(num_kv_heads, num_seqs, group, num_q, head_size)
    if visible is None:
        o = o / l[..., None]
    else:
        o = torch.where(l[..., None] > 0, o / l.clamp_min(1e-38)[..., None], 0.0)
    return o, m_ref + torch.log(l)


def _gather_blocks(
    cache: torch.Tensor, blocks: torch.Tensor, scale: float, dtype: torch.dtype
) -> torch.Tensor:
    """Gather whole blocks in the compute dtype.

    Args:
        cache: ``[num_blocks, block_size, H_kv, D]``, contiguous.
        blocks: ``[b, m]`` physical block ids (all valid indices).

    Returns:
        ``[b, m * block_size, h, d]``, contiguous, in ``dtype`` (fp8 decoded and scaled).
    """
    num_seqs, width = blocks.shape
    _, block_size, num_kv_heads, head_size = cache.shape
    # index_select along the contiguous block dim copies whole blocks; then one plain
    # conversion pass (a permuting one is several times slower on CPU).
    gathered = cache.index_select(0, blocks.reshape(-1))
    gathered = gathered.view(num_seqs, width * block_size, num_kv_heads, head_size)
    return _read_cache(gathered, scale, dtype)


# --------------------------------------------------------------------------- fast


def _convert_into(
    dst: torch.Tensor, src: torch.Tensor, scale: float
) -> torch.Tensor:
    """:func:`_read_cache` into a reused buffer ``dst`` (same shape, compute dtype).

    A fresh tensor per gathered chunk costs page faults on every call; a buffer that
    stays warm in cache does not.
    """
    if src.dtype in _FP8_STORAGE:
        if src.dtype == torch.uint8:
            src = src.view(torch.float8_e4m3fn)
        return dst.copy_(src).mul_(scale)
    return dst.copy_(src)


#: K elements per thread in one decode chunk: the chunk in the cache dtype, in the compute
#: dtype and the cache lines it was read from must stay in a core's L2 (about 1 MB used
#: here); larger chunks cost more in cache misses than they save in calls.
_DECODE_CHUNK_ELEMS = 1 << 17


def _attend_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    table: list[list[int]],
    decode: list[tuple[int, int, int]],
    *,
    left: int,
    scale: float,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    k_scale: float,
    v_scale: float,
    compute_dtype: torch.dtype,
    chunk_blocks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the one-query rows (decode): no mask, no padding, no merges.

    A lone query at position ``s - 1`` sees keys ``[first, s)``: causality and the right
    window cut nothing, the left window only moves ``first``. Each row's keys are read in
    chunks of at most ``chunk_blocks`` blocks, gathered into the same two buffers (cache
    dtype, then compute dtype) so that they stay in cache: a first pass gives each row's
    logits ``[h, g, n]``, a plain softmax follows, a second pass sums ``p @ v``.

    Args:
        query: ``[T, H, D]``.
        key_cache, value_cache: ``[num_blocks, block_size, H_kv, D]``, contiguous.
        table: ``block_table`` as lists (row ``b`` maps logical block -> physical block).
        decode: ``(b, row, s)`` per row: sequence, query row, keys of the sequence.

    Returns:
        ``(out [r, H, D], lse [r, H])`` for the rows of ``decode``, in its order.
    """
    _, block_size, num_kv_heads, head_size = key_cache.shape
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads

    chunks: list[tuple[int, int, int, int]] = []  # (row i, blocks m, first slot, keys n)
    blocks: list[int] = []
    first_keys = []
    for i, (b, _, seq_len) in enumerate(decode):
        first = max(0, seq_len - 1 - left) if left >= 0 else 0
        first_keys.append(first)
        num_blocks = _cdiv(seq_len, block_size)
        for lo in range(first // block_size, num_blocks, chunk_blocks):
            hi = min(lo + chunk_blocks, num_blocks)
            start, end = max(first, lo * block_size), min(seq_len, hi * block_size)
            chunks.append((i, hi - lo, start - lo * block_size, end - start))
            blocks.extend(table[b][lo:hi])
    chunk_ids = torch.tensor(blocks, dtype=torch.long).split([c[1] for c in chunks])
    width = max(c[1] for c in chunks)
    raw = torch.empty((width,) + key_cache.shape[1:], dtype=key_cache.dtype)
    converted = torch.empty((width,) + key_cache.shape[1:], dtype=compute_dtype)
    views: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}

    def read(cache: torch.Tensor, ids: torch.Tensor, cache_scale: float, m: int, skip: int,
             n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's ``[n, h, d]`` tokens, in the compute dtype, as ``[h, d, n]`` (for
        the logits) and ``[h, n, d]`` (for ``p @ v``) views of ``converted``."""
        if (m, skip, n) not in views:  # most chunks share one shape: build views once
            tokens = converted[:m].view(-1, num_kv_heads, head_size)[skip : skip + n]
            views[m, skip, n] = (
                raw[:m], converted[:m], tokens.permute(1, 2, 0), tokens.permute(1, 0, 2)
            )
        raw_m, converted_m, by_dim, by_token = views[m, skip, n]
        torch.index_select(cache, 0, ids, out=raw_m)
        _convert_into(converted_m, raw_m, cache_scale)
        return by_dim, by_token

    rows = torch.tensor([row for _, row, _ in decode])
    q = query[rows].to(compute_dtype).view(len(decode), num_kv_heads, group, head_size).unbind()
    logits: list[list[torch.Tensor]] = [[] for _ in decode]
    for (i, m, skip, n), ids in zip(chunks, chunk_ids):
        k_t, _ = read(key_cache, ids, k_scale, m, skip, n)
        logits[i].append(torch.bmm(q[i], k_t))  # "hgd,nhd->hgn"

    probs, m_rows, l_rows = [], [], []
    for i, parts in enumerate(logits):
        s = (torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]).mul_(scale)  # [h, g, n]
        if softcap > 0:
            s.div_(softcap).tanh_().mul_(softcap)
        if alibi_slopes is not None:
            seq_len = decode[i][2]
            distance = (seq_len - 1) - torch.arange(first_keys[i], seq_len)  # pos - j
            s.sub_(alibi_slopes.to(compute_dtype).view(num_kv_heads, group, 1) * distance)
        row_max = s.amax(dim=-1, keepdim=True)  # finite: a row sees at least its own key
        p = s.sub_(row_max).exp_()
        m_rows.append(row_max)
        l_rows.append(p.sum(dim=-1, keepdim=True))
        probs.append(p.split([n for j, _, _, n in chunks if j == i], dim=-1))

    acc = torch.zeros(len(decode), num_kv_heads, group, head_size, dtype=compute_dtype)
    acc_rows = acc.unbind()
    probs_in_order = [p for parts in probs for p in parts]  # chunks are in row order
    for (i, m, skip, n), ids, p in zip(chunks, chunk_ids, probs_in_order):
        _, v = read(value_cache, ids, v_scale, m, skip, n)
        acc_rows[i].baddbmm_(p, v)  # "hgn,nhd->hgd"
    l = torch.stack(l_rows)  # [r, h, g, 1]
    out = (acc / l).view(len(decode), num_heads, head_size)
    return out, (torch.stack(m_rows) + torch.log(l)).view(len(decode), num_heads)


class _WorkItem:
    """Query rows ``row0 .. row0+num_q`` of sequence ``seq`` (positions from ``pos0``)
    against its logical blocks ``block_lo .. block_hi``; keys ``>= num_keys`` don't exist.
    ``split`` is True when those rows' keys are spread over several items."""

    __slots__ = ("seq", "row0", "num_q", "pos0", "block_lo", "block_hi", "num_keys", "split")

    def __init__(self, seq, row0, num_q, pos0, block_lo, block_hi, num_keys, split):
        self.seq, self.row0, self.num_q, self.pos0 = seq, row0, num_q, pos0
        self.block_lo, self.block_hi, self.num_keys = block_lo, block_hi, num_keys
        self.split = split

    @property
    def width(self) -> int:
        return self.block_hi - self.block_lo

    def key_range(self, block_size: int) -> tuple[int, int]:
        """Absolute positions ``[first, end)`` of the keys that exist in the item."""
        return self.block_lo * block_size, min(self.num_keys, self.block_hi * block_size)

    def sees_all(self, block_size: int, causal: bool, window: tuple[int, int]) -> bool:
        """Every query sees every existing key: no mask is needed."""
        first, end = self.key_range(block_size)
        last_pos = self.pos0 + self.num_q - 1
        left, right = window
        return (
            (not causal or end - 1 <= self.pos0)
            and (left < 0 or first >= last_pos - left)
            and (right < 0 or end - 1 <= self.pos0 + right)
        )


def _work_items(
    seq_lens: Sequence[int],
    starts: Sequence[int],
    block_size: int,
    num_heads: int,
    kv_row: int,
    causal: bool,
    window: tuple[int, int],
    max_kv_elems: int,
    max_score_elems: int,
) -> list[_WorkItem]:
    """Split the batch into (sequence, query chunk, key block range) items.

    Blocks no query of a chunk can see (before the sliding window, after the causal edge)
    are left out. Key ranges hold at most ``max_kv_elems`` gathered K elements and query
    chunks keep the logits under ``max_score_elems``; the key ranges of one query chunk
    are merged afterwards by log-sum-exp (vLLM's partitions, flash-decoding's splits).
    """
    left, right = window
    max_blocks = max(1, max_kv_elems // (kv_row * block_size))
    items = []
    for b, seq_len in enumerate(seq_lens):
        q_len = starts[b + 1] - starts[b]
        if q_len == 0 or seq_len == 0:
            continue
        keys_per_item = min(seq_len, max_blocks * block_size)
        chunk = max(1, min(q_len, max_score_elems // (num_heads * keys_per_item)))
        for i0 in range(0, q_len, chunk):
            num_q = min(chunk, q_len - i0)
            first_pos = seq_len - q_len + i0
            last_pos = first_pos + num_q - 1
            key_hi = seq_len
            if causal:
                key_hi = min(key_hi, last_pos + 1)
            if right >= 0:
                key_hi = min(key_hi, last_pos + right + 1)
            key_lo = max(0, first_pos - left) if left >= 0 else 0
            block_lo = key_lo // block_size
            block_hi = _cdiv(key_hi, block_size)
            split = block_hi - block_lo > max_blocks
            for lo in range(block_lo, block_hi, max_blocks):
                hi = min(lo + max_blocks, block_hi)
                items.append(
                    _WorkItem(b, starts[b] + i0, num_q, first_pos, lo, hi, seq_len, split)
                )
    return items


def _group_items(
    items: list[_WorkItem],
    block_size: int,
    num_heads: int,
    kv_row: int,
    max_kv_elems: int,
    max_score_elems: int,
) -> list[list[_WorkItem]]:
    """Batch unsplit items of similar shape, within the same budgets, to save calls.

    Items sorted by (queries, blocks) join the current group while padding the group
    costs less than a call of its own would (a fixed overhead plus its K/V and logits).
    """
    overhead = 1 << 15  # ~ the cost of one batched call, in touched elements

    def cost(n: int, num_q: int, width: int) -> int:
        keys = width * block_size
        return overhead + n * keys * kv_row * 4 + n * num_q * keys * num_heads * 8

    groups: list[list[_WorkItem]] = []
    current: list[_WorkItem] = []
    max_q = max_w = 0
    for item in sorted(items, key=lambda it: (it.split, it.num_q, it.width)):
        if current and not item.split:
            new_q, new_w = max(max_q, item.num_q), max(max_w, item.width)
            n = len(current) + 1
            keys = new_w * block_size
            fits = n * keys * kv_row <= max_kv_elems
            fits = fits and n * new_q * keys * num_heads <= max_score_elems
            merged = cost(n, new_q, new_w)
            if fits and merged <= cost(n - 1, max_q, max_w) + cost(1, item.num_q, item.width):
                current.append(item)
                max_q, max_w = new_q, new_w
                continue
        if current:
            groups.append(current)
        current, max_q, max_w = [item], item.num_q, item.width
    if current:
        groups.append(current)
    return groups


def paged_attention_fast(
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
    return_lse: bool = False,
    max_kv_elems: int = 1 << 19,
    max_score_elems: int = 1 << 22,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Paged attention by gathering blocks through ``block_table``; for replaying traces.

    No Python loop over blocks: each call gathers a whole range of blocks with one
    ``index_select`` and runs a masked softmax in ``compute_dtype``. Short sequences of
    similar shape are padded into one batch; a long context is cut into key ranges of
    at most ``max_kv_elems`` gathered elements (small enough to stay in the CPU's L2
    cache: past that, memory passes dominate) whose results are merged by log-sum-exp.
    Rows with one query (decode) skip all that: a plain softmax over each row's own keys,
    read in chunks of at most ``min(max_kv_elems, 2**17 * threads)`` K elements (the
    chunking, hence the last bits of the sums, depends on ``torch.get_num_threads()``).

    Args:
        query: ``[T, H, D]``.
        key_cache: ``[num_blocks, block_size, H_kv, D]`` (uint8 = fp8 e4m3).
        value_cache: ``[num_blocks, block_size, H_kv, D]``.
        block_table: ``[B, max_blocks]``; entries past ``ceil(s_b / block_size)`` may be
            garbage, they are never used as indices.
        seq_lens: ``[B]``.
        query_start_loc: ``[B + 1]``.
        scale, causal, window, softcap, alibi_slopes (``[H]``), sinks (``[H]``), k_scale,
        v_scale: see the module docstring.
        compute_dtype: fp32 (default) or fp64; bf16/fp16 give the low-precision baseline
            that :func:`compare` measures against.
        return_lse: also return the log-sum-exp of the softmax denominator.
        max_kv_elems: cap on the K elements one call gathers.
        max_score_elems: cap on the logits one call holds.

    Returns:
        ``out [T, H, D]`` in ``compute_dtype``, and with ``return_lse`` also
        ``lse [T, H]``: log of the whole denominator, the sink included; ``-inf`` where it
        is empty.
    """
    _check_args(query, key_cache, value_cache, block_table, seq_lens, query_start_loc)
    num_tokens, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    kv_row = num_kv_heads * head_size
    key_cache, value_cache = key_cache.contiguous(), value_cache.contiguous()
    block_rows = block_table.long()
    out = torch.zeros(num_tokens, num_heads, head_size, dtype=compute_dtype)
    lse = torch.full((num_tokens, num_heads), -math.inf, dtype=compute_dtype)
    # Key ranges of split rows, merged at the end: (row0, num_q) -> [(out, lse), ...]
    partials: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    lens, starts = seq_lens.tolist(), query_start_loc.tolist()
    # One-query rows (decode) take the flat path; the others are batched work items.
    decode = [
        (b, starts[b], s) for b, s in enumerate(lens) if starts[b + 1] - starts[b] == 1 and s > 0
    ]
    if decode:
        o, part_lse = _attend_decode(
            query, key_cache, value_cache, block_table.tolist(), decode,
            left=window[0], scale=scale, softcap=softcap, alibi_slopes=alibi_slopes,
            k_scale=k_scale, v_scale=v_scale, compute_dtype=compute_dtype,
            chunk_blocks=max(1, min(max_kv_elems, _DECODE_CHUNK_ELEMS * torch.get_num_threads())
                             // (kv_row * block_size)),
        )
        rows = torch.tensor([row for _, row, _ in decode])
        out[rows], lse[rows] = o, part_lse
        lens = [0 if starts[b + 1] - starts[b] == 1 else s for b, s in enumerate(lens)]
    items = _work_items(
        lens, starts, block_size, num_heads, kv_row, causal, window, max_kv_elems,
        max_score_elems,
    )
    for members in _group_items(
        items, block_size, num_heads, kv_row, max_kv_elems, max_score_elems
    ):
        if len(members) == 1:
            # One item: slice instead of gather, and cut K/V at the last existing key.
            it = members[0]
            first, end = it.key_range(block_size)
            rows = query[it.row0 : it.row0 + it.num_q][None]  # [b=1, t, H, D]
            q_pos = torch.arange(it.pos0, it.pos0 + it.num_q)[None]  # [1, t]
            physical = block_rows[it.seq, it.block_lo : it.block_hi][None]  # [1, m]
            k = _gather_blocks(key_cache, physical, k_scale, compute_dtype)[:, : end - first]
            v = _gather_blocks(value_cache, physical, v_scale, compute_dtype)[:, : end - first]
            k_pos = torch.arange(first, end)[None]  # [1, n]
            k_valid = None
        else:
            max_q = max(it.num_q for it in members)
            width = max(it.width for it in members)
            # Padding query rows repeat row 0; their results are dropped below.
            row_ids = [[it.row0 + min(i, it.num_q - 1) for i in range(max_q)] for it in members]
            rows = query[torch.tensor(row_ids).reshape(-1)].view(len(members), max_q, -1, head_size)
            q_pos = torch.tensor([[it.pos0 + i for i in range(max_q)] for it in members])
            # Padding block columns read block 0 (never what the table holds there, which
            # may be garbage); their keys are masked.
            physical = torch.stack([
                torch.nn.functional.pad(
                    block_rows[it.seq, it.block_lo : it.block_hi], (0, width - it.width)
                )
                for it in members
            ])
            k = _gather_blocks(key_cache, physical, k_scale, compute_dtype)  # [b, n, h, d]
            v = _gather_blocks(value_cache, physical, v_scale, compute_dtype)
            first_key = torch.tensor([it.block_lo * block_size for it in members])
            k_pos = first_key[:, None] + torch.arange(width * block_size)  # [b, n]
            key_end = torch.tensor([it.key_range(block_size)[1] for it in members])
            k_valid = k_pos < key_end[:, None]
            # Slots past seq_len and padding are stale (maybe NaN): zero their V.
            for i, it in enumerate(members):
                first, end = it.key_range(block_size)
                v[i, end - first :] = 0.0

        q = rows.view(rows.shape[0], rows.shape[1], num_kv_heads, group, head_size)
        q = q.permute(2, 0, 3, 1, 4).to(compute_dtype)  # [h, b, g, t, d]
        all_seen = k_valid is None and all(
            it.sees_all(block_size, causal, window) for it in members
        )
        visible = None if all_seen else _visibility(q_pos, k_pos, k_valid, causal, window)
        o, part_lse = _attend_gathered(
            q, q_pos, k, v, k_pos, visible,
            scale=scale, softcap=softcap, alibi_slopes=alibi_slopes,
        )
        # [h, b, g, t, d] -> [b, t, H, D]
        o = o.permute(1, 3, 0, 2, 4).reshape(len(members), -1, num_heads, head_size)
        part_lse = part_lse.permute(1, 3, 0, 2).reshape(len(members), -1, num_heads)
        for i, it in enumerate(members):
            o_i, lse_i = o[i, : it.num_q], part_lse[i, : it.num_q]
            if it.split:
                partials.setdefault((it.row0, it.num_q), []).append((o_i, lse_i))
            else:
                out[it.row0 : it.row0 + it.num_q] = o_i
                lse[it.row0 : it.row0 + it.num_q] = lse_i

    for (row0, num_q), parts in partials.items():
        merged, merged_lse = combine_partitions(
            torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
        )
        out[row0 : row0 + num_q] = merged
        lse[row0 : row0 + num_q] = merged_lse

    if sinks is not None:
        out, lse = _add_sinks(out, lse, sinks, int(query_start_loc[-1]))
    if return_lse:
        return out, lse
    return out


# --------------------------------------------------------------------------- partitioned


def combine_partitions(
    outs: torch.Tensor, lses: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
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
) -> torch.Tensor:
    """Paged attention split over ``partition_size``-token key partitions (v2 kernel).

    Each sequence's keys ``[0, s)`` are cut into partitions ``[i*P, (i+1)*P)``; each
    partition gives its own normalised output and log-sum-exp, and
    :func:`combine_partitions` merges them. A sink joins as one more partition with
    ``lse = sinks[h]`` and zero output. The result equals the unpartitioned one.

    Args:
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale,
        causal, window, softcap, alibi_slopes, sinks, k_scale, v_scale, compute_dtype:
            as :func:`paged_attention_fast`.
        partition_size: tokens per partition, a multiple of ``block_size`` (as vLLM's
            ``PARTITION_SIZE`` is).

    Returns:
        ``[T, H, D]`` in ``compute_dtype``.
    """
    _check_args(query, key_cache, value_cache, block_table, seq_lens, query_start_loc)
    num_tokens, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if partition_size <= 0 or partition_size % block_size:
        raise ValueError(f"partition_size {partition_size} must be a multiple of {block_size}")
    group = num_heads // num_kv_heads
    blocks_per_partition = partition_size // block_size
    out = torch.zeros(num_tokens, num_heads, head_size, dtype=compute_dtype)

    for b, (seq_len, q_start, q_end) in enumerate(
        zip(seq_lens.tolist(), query_start_loc[:-1].tolist(), query_start_loc[1:].tolist())
    ):
        q_len = q_end - q_start
        if q_len == 0 or seq_len == 0:
            continue
        q = query[q_start:q_end].to(compute_dtype).view(q_len, num_kv_heads, group, head_size)
        q = q.permute(1, 2, 0, 3)[:, None]  # [h, b=1, g, t, d]
        q_pos = torch.arange(seq_len - q_len, seq_len)[None]  # [1, t]
        part_outs, part_lses = [], []
        for first in range(0, _cdiv(seq_len, block_size), blocks_per_partition):
            last = min(first + blocks_per_partition, _cdiv(seq_len, block_size))
            physical = block_table[b, first:last].long()[None]  # [1, m]
            k = _gather_blocks(key_cache, physical, k_scale, compute_dtype)
            v = _gather_blocks(value_cache, physical, v_scale, compute_dtype)
            k_pos = torch.arange(first * block_size, last * block_size)[None]  # [1, n]
            k_valid = k_pos < seq_len
            # Slots past seq_len are stale (maybe NaN): zero their V, as vLLM's kernel does.
            v = v.masked_fill(~k_valid[:, :, None, None], 0.0)
            visible = _visibility(q_pos, k_pos, k_valid, causal, window)
            o, part_lse = _attend_gathered(
                q, q_pos, k, v, k_pos, visible,
                scale=scale, softcap=softcap, alibi_slopes=alibi_slopes,
            )
            part_outs.append(o[:, 0])  # [h, g, t, d]
            part_lses.append(part_lse[:, 0])  # [h, g, t]
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


# --------------------------------------------------------------------------- tolerances


def tolerance(
    expected: torch.Tensor, baseline: torch.Tensor, k: float = 2.0, eps: float = 1e-5
) -> float:
    """Allowed max-abs error: ``k * max|baseline - expected| + eps``.

    ``baseline`` is the same math run in low precision (bf16/fp16), ``expected`` the
    fp32/fp64 reference: a kernel may be at most ``k`` times as wrong as naive
    low-precision math (flash-attn ``hopper/test_flash_attn.py``).
    """
    return k * float((baseline.double() - expected.double()).abs().max()) + eps


def compare(
    actual: torch.Tensor,
    expected: torch.Tensor,
    baseline: torch.Tensor | None = None,
    *,
    k: float = 2.0,
    eps: float = 1e-5,
) -> dict:
    """Judge ``actual`` against ``expected``, relative to a low-precision ``baseline``.

    Args:
        actual: ``[T, H, D]``, e.g. the output vLLM recorded.
        expected: ``[T, H, D]``, the fp32/fp64 reference.
        baseline: ``[T, H, D]``, the reference's math in bf16/fp16; without it the
            tolerance is ``eps`` alone.
        k, eps: see :func:`tolerance`.

    Returns:
        A JSON-ready dict: ``max_abs``; ``max_rel`` (``max_abs`` over ``max|expected|``);
        ``per_head_max_abs`` (list of ``H`` floats); ``baseline_max_abs``; ``tol``; ``ok``.
    """
    if actual.shape != expected.shape:
        raise ValueError(f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    err = (actual.double() - expected.double()).abs()
    max_abs = float(err.max()) if err.numel() else 0.0
    scale = float(expected.double().abs().max()) if expected.numel() else 0.0
    per_head = err.amax(dim=tuple(i for i in range(err.dim()) if i != err.dim() - 2))
    if baseline is None:
        baseline_err = 0.0
        tol = eps
    else:
        baseline_err = float((baseline.double() - expected.double()).abs().max())
        tol = tolerance(expected, baseline, k=k, eps=eps)
    return {
        "max_abs": max_abs,
        "max_rel": max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf),
        "per_head_max_abs": [float(x) for x in per_head],
        "baseline_max_abs": baseline_err,
        "tol": tol,
        "ok": bool(max_abs <= tol),
    }
