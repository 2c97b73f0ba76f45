"""The gathered-attention core the partitioned and fast forms share.

A range of blocks is gathered with one ``index_select`` (:func:`gather_blocks`), the
visibility mask built from positions (:func:`visibility`), and one masked softmax runs
over the gathered keys (:func:`gathered_weights`, the weights; :func:`attend_gathered`, the
weights times V), returning each row's log-sum-exp so
that results over disjoint key ranges merge with
:func:`reference_impl.kernel.combine_partitions`. Einsum letters as in
:mod:`reference_impl.kernel`.

Imports torch only.
"""

from __future__ import annotations

import math

import torch

from reference_impl.common import read_cache_as, take_blocks

__all__ = ["attend_gathered", "batched_bmm", "gather_blocks", "gathered_weights", "strided_bmm", "visibility"]


def strided_bmm(x: torch.Tensor, y: torch.Tensor, transpose_y: bool) -> torch.Tensor:
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
            torch.bmm(x[:, i], y[i].permute(1, 2, 0) if transpose_y else y[i].permute(1, 0, 2)) for i in range(num_seqs)
        ]
        return parts[0].unsqueeze(1) if num_seqs == 1 else torch.stack(parts, dim=1)
    parts = [torch.bmm(x[j], y[:, :, j].transpose(1, 2) if transpose_y else y[:, :, j]) for j in range(num_heads)]
    return torch.stack(parts)


def batched_bmm(x: torch.Tensor, y: torch.Tensor, transpose: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x[r, h] @ y[r, :, h, :]`` (or its transpose) for every (r, h): one row's products as one call gives them.

    Args:
        x: ``[r, h, g, c]``, its last dim contiguous.
        y: ``[r, n, h, e]``, the cache's token-major order with token rows ``h * e`` apart
            (the last dim contiguous); with ``transpose`` the logits (``"rhgd,rnhd->rhgn"``,
            ``c = e = d``), else ``p @ v`` (``"rhgn,rnhd->rhgd"``, ``c = n``).

    Returns:
        ``[r, h, g, n]`` or ``[r, h, g, d]``: ``out`` when given (contiguous, that shape).

    Every matrix is read in place, with the strides one row's ``torch.bmm(x[i], y[i] viewed
    [h, e, n])`` (or an ``einsum`` over one row) reads it with, so each element is the bits that
    call gives. One batched call per KV head covers the rows, except where that call would not
    be a batch as the one-row call is (one KV head: MKL's single-matrix product; one row: a batch
    of heads): MKL's batched and single products may round differently.
    """
    rows, heads = x.shape[0], x.shape[1]
    if heads == 1 or rows == 1:
        per_row = (y[i].permute(1, 2, 0) if transpose else y[i].permute(1, 0, 2) for i in range(rows))
        return torch.stack([torch.bmm(x[i], yi) for i, yi in enumerate(per_row)], out=out)
    per_head = (y[:, :, j].transpose(1, 2) if transpose else y[:, :, j] for j in range(heads))
    return torch.stack([torch.bmm(x[:, j], yj) for j, yj in enumerate(per_head)], dim=1, out=out)


def visibility(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    k_valid: torch.Tensor | None,
    causal: bool,
    window: tuple[int, int],
) -> torch.Tensor:
    """``[b, t, n]``: query ``t`` of row ``b`` may attend key ``n`` (see :mod:`reference_impl.kernel`).

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


def gathered_weights(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    k_pos: torch.Tensor,
    visible: torch.Tensor | None,
    *,
    scale: float,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The softmax of gathered keys, unnormalised: what :func:`attend_gathered` multiplies V by.

    Args:
        q, q_pos, k, k_pos, visible, scale, softcap, alibi_slopes: as :func:`attend_gathered`.

    Returns:
        ``(p [h, b, g, t, n], l [h, b, g, t], m [h, b, g, t])``: ``p = exp(logit - m)`` (0 where
        hidden), ``l`` its sum over the keys, ``m`` the row's largest logit (0 where no key is
        visible). The attention weights are ``p / l``; ``m + log(l)`` is the row's log-sum-exp.
    """
    num_kv_heads, num_seqs, group, num_q, head_size = q.shape
    num_keys = k.shape[1]
    q_rows = q.reshape(num_kv_heads, num_seqs, group * num_q, head_size)
    s = strided_bmm(q_rows, k, transpose_y=True)  # "hbgtd,bnhd->hbgtn"
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
    return p, p.sum(dim=-1), m_ref


def attend_gathered(
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
        visible: ``[b, t, n]`` from :func:`visibility`, or None when every query sees
            every key.

    Returns:
        ``(out [h, b, g, t, d], lse [h, b, g, t])``; ``lse`` is the log of the softmax
        denominator, ``-inf`` (and ``out`` 0) where no key is visible.
    """
    num_kv_heads, num_seqs, group, num_q, head_size = q.shape
    num_keys = k.shape[1]
    p, l, m_ref = gathered_weights(q, q_pos, k, k_pos, visible, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes)
    p_rows = p.view(num_kv_heads, num_seqs, group * num_q, num_keys)
    o = strided_bmm(p_rows, v, transpose_y=False)  # "hbgtn,bnhd->hbgtd"
    o = o.view(num_kv_heads, num_seqs, group, num_q, head_size)
    if visible is None:
        o = o / l[..., None]
    else:
        o = torch.where(l[..., None] > 0, o / l.clamp_min(1e-38)[..., None], 0.0)
    return o, m_ref + torch.log(l)


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
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
    gathered = take_blocks(cache, blocks.reshape(-1))
    gathered = gathered.view(num_seqs, width * block_size, num_kv_heads, head_size)
    return read_cache_as(gathered, scale, dtype)
