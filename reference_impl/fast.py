"""Paged attention without a loop over blocks: the fast form, for replaying traces.

:func:`paged_attention_fast` computes what :func:`reference_impl.kernel.paged_attention_loop`
does (same arguments, same semantics, see :mod:`reference_impl.kernel`) by gathering whole
ranges of blocks through ``block_table`` and running one masked softmax per range:

* one-query (decode) rows need no mask: their keys are read unpadded, in chunks small
  enough to stay in cache (:func:`_attend_decode`);
* the other rows are cut into work items, (sequence, query chunk, key block range), that
  skip the blocks no query sees (:func:`_work_items`); short items of similar shape are
  padded into one batch (:func:`_group_items`), long contexts split into key ranges merged
  by log-sum-exp (:func:`reference_impl.kernel.combine_partitions`).

``tests/test_kernel.py`` holds it to the loop and the dense reference.

Imports torch only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from reference_impl.common import FP8_STORAGE, add_sinks, cdiv, check_args, take_blocks
from reference_impl.gathered import attend_gathered, gather_blocks, visibility
from reference_impl.kernel import combine_partitions

__all__ = ["paged_attention_fast"]


def _convert_into(dst: torch.Tensor, src: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`reference_impl.common.read_cache_as` into a reused buffer ``dst`` (same shape, compute dtype).

    A fresh tensor per gathered chunk costs page faults on every call; a buffer that
    stays warm in cache does not.
    """
    if src.dtype in FP8_STORAGE:
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
        num_blocks = cdiv(seq_len, block_size)
        for lo in range(first // block_size, num_blocks, chunk_blocks):
            hi = min(lo + chunk_blocks, num_blocks)
            start, end = max(first, lo * block_size), min(seq_len, hi * block_size)
            chunks.append((i, hi - lo, start - lo * block_size, end - start))
            blocks.extend(table[b][lo:hi])
    chunk_ids = torch.tensor(blocks, dtype=torch.long).split([c[1] for c in chunks])
    width = max(c[1] for c in chunks)
    raw = torch.empty((width, *key_cache.shape[1:]), dtype=key_cache.dtype)
    converted = torch.empty((width, *key_cache.shape[1:]), dtype=compute_dtype)
    views: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}

    def read(
        cache: torch.Tensor, ids: torch.Tensor, cache_scale: float, m: int, skip: int, n: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's ``[n, h, d]`` tokens, in the compute dtype, as ``[h, d, n]`` (for
        the logits) and ``[h, n, d]`` (for ``p @ v``) views of ``converted``."""
        if (m, skip, n) not in views:  # most chunks share one shape: build views once
            tokens = converted[:m].view(-1, num_kv_heads, head_size)[skip : skip + n]
            views[m, skip, n] = (raw[:m], converted[:m], tokens.permute(1, 2, 0), tokens.permute(1, 0, 2))
        raw_m, converted_m, by_dim, by_token = views[m, skip, n]
        take_blocks(cache, ids, out=raw_m)
        _convert_into(converted_m, raw_m, cache_scale)
        return by_dim, by_token

    rows = torch.tensor([row for _, row, _ in decode])
    q = query[rows].to(compute_dtype).view(len(decode), num_kv_heads, group, head_size).unbind()
    logits: list[list[torch.Tensor]] = [[] for _ in decode]
    for (i, m, skip, n), ids in zip(chunks, chunk_ids, strict=False):
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
    for (i, m, skip, n), ids, p in zip(chunks, chunk_ids, probs_in_order, strict=False):
        _, v = read(value_cache, ids, v_scale, m, skip, n)
        acc_rows[i].baddbmm_(p, v)  # "hgn,nhd->hgd"
    l = torch.stack(l_rows)  # [r, h, g, 1]
    out = (acc / l).view(len(decode), num_heads, head_size)
    return out, (torch.stack(m_rows) + torch.log(l)).view(len(decode), num_heads)


class _WorkItem:
    """Query rows ``row0 .. row0+num_q`` of sequence ``seq`` (positions from ``pos0``)
    against its logical blocks ``block_lo .. block_hi``; keys ``>= num_keys`` don't exist.
    ``split`` is True when those rows' keys are spread over several items."""

    __slots__ = ("block_hi", "block_lo", "num_keys", "num_q", "pos0", "row0", "seq", "split")

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
            block_hi = cdiv(key_hi, block_size)
            split = block_hi - block_lo > max_blocks
            for lo in range(block_lo, block_hi, max_blocks):
                hi = min(lo + max_blocks, block_hi)
                items.append(_WorkItem(b, starts[b] + i0, num_q, first_pos, lo, hi, seq_len, split))
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
        v_scale: see :mod:`reference_impl.kernel`.
        compute_dtype: fp32 (default) or fp64 (bf16/fp16 run, but the bar's baseline is
            :func:`reference_impl.emulation.emulate_flash_attention`).
        return_lse: also return the log-sum-exp of the softmax denominator.
        max_kv_elems: cap on the K elements one call gathers.
        max_score_elems: cap on the logits one call holds.

    Returns:
        ``out [T, H, D]`` in ``compute_dtype``, and with ``return_lse`` also
        ``lse [T, H]``: log of the whole denominator, the sink included; ``-inf`` where it
        is empty.
    """
    check_args(query, key_cache, value_cache, block_table, seq_lens, query_start_loc)
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
    decode = [(b, starts[b], s) for b, s in enumerate(lens) if starts[b + 1] - starts[b] == 1 and s > 0]
    if decode:
        o, part_lse = _attend_decode(
            query,
            key_cache,
            value_cache,
            block_table.tolist(),
            decode,
            left=window[0],
            scale=scale,
            softcap=softcap,
            alibi_slopes=alibi_slopes,
            k_scale=k_scale,
            v_scale=v_scale,
            compute_dtype=compute_dtype,
            chunk_blocks=max(
                1, min(max_kv_elems, _DECODE_CHUNK_ELEMS * torch.get_num_threads()) // (kv_row * block_size)
            ),
        )
        rows = torch.tensor([row for _, row, _ in decode])
        out[rows], lse[rows] = o, part_lse
        lens = [0 if starts[b + 1] - starts[b] == 1 else s for b, s in enumerate(lens)]
    items = _work_items(
        lens,
        starts,
        block_size,
        num_heads,
        kv_row,
        causal,
        window,
        max_kv_elems,
        max_score_elems,
    )
    for members in _group_items(items, block_size, num_heads, kv_row, max_kv_elems, max_score_elems):
        if len(members) == 1:
            # One item: slice instead of gather, and cut K/V at the last existing key.
            it = members[0]
            first, end = it.key_range(block_size)
            rows = query[it.row0 : it.row0 + it.num_q][None]  # [b=1, t, H, D]
            q_pos = torch.arange(it.pos0, it.pos0 + it.num_q)[None]  # [1, t]
            physical = block_rows[it.seq, it.block_lo : it.block_hi][None]  # [1, m]
            k = gather_blocks(key_cache, physical, k_scale, compute_dtype)[:, : end - first]
            v = gather_blocks(value_cache, physical, v_scale, compute_dtype)[:, : end - first]
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
            physical = torch.stack(
                [
                    torch.nn.functional.pad(block_rows[it.seq, it.block_lo : it.block_hi], (0, width - it.width))
                    for it in members
                ]
            )
            k = gather_blocks(key_cache, physical, k_scale, compute_dtype)  # [b, n, h, d]
            v = gather_blocks(value_cache, physical, v_scale, compute_dtype)
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
        all_seen = k_valid is None and all(it.sees_all(block_size, causal, window) for it in members)
        visible = None if all_seen else visibility(q_pos, k_pos, k_valid, causal, window)
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
        merged, merged_lse = combine_partitions(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
        out[row0 : row0 + num_q] = merged
        lse[row0 : row0 + num_q] = merged_lse

    if sinks is not None:
        out, lse = add_sinks(out, lse, sinks, int(query_start_loc[-1]))
    if return_lse:
        return out, lse
    return out
