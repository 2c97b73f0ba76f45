"""The emulation's arithmetic, row by row: one sequence, or a step's decode rows batched by length.

:func:`reference_impl.emulation.emulate_flash_attention` hands each sequence with several
queries to :func:`emulate_sequence` and all one-query (decode) rows to :func:`emulate_decode`.
Both run the same operations on every element (:func:`convert_kv`, :func:`probabilities`,
:func:`normalise`), so a row's result does not depend on which of them ran it, to the bit:

* the products are the same ``bmm`` calls per head as the per-sequence ``einsum`` makes
  (``Q [g, t, d] @ K^T [d, n]`` and ``P [g, t, n] @ V [n, d]`` with K/V read in place, token
  rows ``H_kv * D`` apart), batched over rows of one length, never padded: a padded
  contraction, or a row summed over padding, can round differently in MKL and in torch's
  reductions;
* everything else is elementwise or a reduction over one row's own keys.

Einsum letters as in :mod:`reference_impl.kernel`; ``r`` is a row of a batch.

Imports torch only.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from reference_impl.common import cdiv, take_blocks
from reference_impl.gathered import batched_bmm, visibility

__all__ = [
    "FP8_MAX_OFFSET",
    "Emulation",
    "StepRounding",
    "convert_kv",
    "emulate_decode",
    "emulate_sequence",
    "probabilities",
    "softmax_first",
]

#: FA3's fp8 softmax subtracts 8 from the log2 max: P lies in [0, 2^8] before it is rounded to e4m3.
FP8_MAX_OFFSET = 8

#: Significant bits of ``tanh.approx.f32`` (max relative error ~2^-11): the fp16 significand.
TANH_DTYPE = torch.float16

#: Logits held at once (fp32): the query chunk of a sequence is cut to stay under this.
MAX_SCORE_ELEMS = 1 << 24

#: Gathered K elements (one of K/V, as stored) of one batch of decode rows: rows are taken about
#: this many elements at a time, so that a batch's K/V, logits and probabilities stay within a few MB.
MAX_DECODE_ELEMS = 1 << 20


@dataclass(frozen=True)
class Emulation:
    """How the kernel a trace ran rounds: its bar's low-precision baseline (:mod:`reference_impl.emulation` names each).

    ``fp32_probabilities``: P·V takes P (and a soft-cap its tanh, an fp8 cache its scaled
    values) in fp32, unrounded; False: as FlashAttention, P rounded to the P·V operand dtype.
    ``output_rounding``: how the fp32 output becomes bf16, ``nearest`` (even) or
    ``toward_zero`` (the low 16 bits dropped). Other output dtypes round to nearest.
    ``fast_tanh``: a soft-cap's tanh to 11 significant bits (``tanh.approx.f32``); False: fp32.
    ``normalized_probabilities``: P is divided by its fp32 row sum *before* it is rounded to the
    P·V operand dtype, and P·V is the output (a softmax, then a matrix product); False: as
    FlashAttention, the unnormalised P is rounded and the fp32 accumulator divided by the row sum.
    """

    name: str  #: as ``replay.json``'s ``tolerance.emulation`` records it
    description: str  #: what it rounds, in one line
    fp32_probabilities: bool = False
    output_rounding: str = "nearest"
    fast_tanh: bool = True
    normalized_probabilities: bool = False

    def __post_init__(self) -> None:
        if self.output_rounding not in ("nearest", "toward_zero"):
            raise ValueError(f"output_rounding {self.output_rounding!r}: expected 'nearest' or 'toward_zero'")


@dataclass(frozen=True, eq=False)
class StepRounding:
    """One step's math as the emulation runs it, and how the kernel rounds (``emulate_flash_attention`` builds it)."""

    num_kv_heads: int
    group: int  #: query heads per KV head
    head_size: int
    score_scale: float  #: the softmax scale, with the fp8 descales folded in on FA3's fp8 path
    causal: bool
    window: tuple[int, int]
    softcap: float
    alibi_slopes: torch.Tensor | None  #: ``[H]``
    sinks: torch.Tensor | None  #: ``[H]``
    k_scale: float
    v_scale: float
    fp8_query: bool  #: FA3's fp8 path: Q, K, V as e4m3, descales applied to scores and output
    fp8_cache: bool
    element: torch.dtype  #: the P·V operand dtype the probabilities are rounded to
    p_offset: float  #: ``2 ** FP8_MAX_OFFSET`` on the fp8 path, else 1
    emulation: Emulation  #: how the kernel rounds P, a soft-cap's tanh and the softmax's division

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.group


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to ``dtype`` (round to nearest even) and brought back to fp32."""
    return x if dtype == torch.float32 else x.to(dtype).to(torch.float32)


def as_stored(cache: torch.Tensor) -> torch.Tensor:
    """A cache as its values are stored: fp8 bytes (``uint8``) viewed as e4m3."""
    return cache.view(torch.float8_e4m3fn) if cache.dtype == torch.uint8 else cache


def convert_kv(k: torch.Tensor, v: torch.Tensor, r: StepRounding) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored K/V (any shape) as the fp32 values the kernel multiplies."""
    if r.fp8_query:
        return k.to(torch.float32), v.to(torch.float32)  # raw e4m3 values; descales come later
    if r.fp8_cache and r.emulation.fp32_probabilities:  # the CPU kernel folds the scales into fp32
        return k.to(torch.float32) * r.k_scale, v.to(torch.float32) * r.v_scale
    if r.fp8_cache:
        return round_to(k.to(torch.float32) * r.k_scale, r.element), round_to(
            v.to(torch.float32) * r.v_scale, r.element
        )
    if k.dtype == r.element:  # already the operand dtype: exact in fp32, nothing to round
        return k.to(torch.float32), v.to(torch.float32)
    return round_to(k.to(torch.float32), r.element), round_to(v.to(torch.float32), r.element)


def probabilities(
    s: torch.Tensor, distance: torch.Tensor | None, visible: torch.Tensor | None, r: StepRounding
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``s [..., h, g, t, n]`` (fp32 sums) -> ``(P as P·V takes it, row sum [..., h, g, t])``.

    ``distance [t, n]``, ``|query position - key position|`` in fp32 (needed with ALiBi only),
    and the mask ``visible [t, n]`` (:func:`reference_impl.gathered.visibility`; None: every
    key) are the same for every leading index. The steps are :func:`scores`, :func:`biased`,
    the row max through :func:`row_max`, :func:`exponentials`, the row sum and
    :func:`operand`: :func:`emulate_decode` runs the same ones over many rows at once.
    """
    s = biased(scores(s, r), distance, visible, r)
    m = row_max(s.amax(dim=-1), r)  # [..., h, g, t]
    p = exponentials(s, m[..., None], r)
    return operand(p, p.sum(dim=-1), m, r)


def scores(s: torch.Tensor, r: StepRounding) -> torch.Tensor:
    """Elementwise: the fp32 sums ``q·k`` as the softmax takes them (scaled, or through the soft-cap's tanh)."""
    if r.softcap > 0:
        t = torch.tanh(s * (r.score_scale / r.softcap))
        return r.softcap * (round_to(t, TANH_DTYPE) if r.emulation.fast_tanh else t)
    return s * r.score_scale


def biased(
    s: torch.Tensor, distance: torch.Tensor | None, visible: torch.Tensor | None, r: StepRounding
) -> torch.Tensor:
    """``s [..., h, g, t, n]`` with ALiBi's bias taken off and the keys outside ``visible`` at -inf."""
    if r.alibi_slopes is not None:
        assert distance is not None
        s = s - r.alibi_slopes.to(torch.float32).view(r.num_kv_heads, r.group, 1, 1) * distance
    if visible is not None:
        s = s.masked_fill(~visible, -math.inf)
    return s


def row_max(m: torch.Tensor, r: StepRounding) -> torch.Tensor:
    """The softmax's max ``[..., h, g, t]`` from the logits' row max: with the sinks, 0 where nothing is visible."""
    if r.sinks is not None:
        m = torch.maximum(m, r.sinks.to(torch.float32).view(r.num_kv_heads, r.group, 1))
    return torch.where(torch.isinf(m), 0.0, m)


def exponentials(s: torch.Tensor, m: torch.Tensor, r: StepRounding) -> torch.Tensor:
    """Elementwise: ``exp(s - m)`` (``m`` broadcast to ``s``), times the fp8 path's offset."""
    p = torch.exp(s - m)
    return p * r.p_offset if r.p_offset != 1.0 else p  # x * 1 is x, to the bit


def operand(
    p: torch.Tensor,
    row_sum: torch.Tensor,
    m: torch.Tensor,
    r: StepRounding,
    spread: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P as P·V takes it, the row sum the output is divided by)`` from the exponentials and their row sum
    ``[..., h, g, t]`` (a sink's share added here); ``m``: :func:`row_max`'s, same shape as ``row_sum``.
    ``spread``: a row value broadcast to ``p`` (default ``x[..., None]``)."""
    if r.sinks is not None:
        row_sum = row_sum + torch.exp(r.sinks.to(torch.float32).view(r.num_kv_heads, r.group, 1) - m) * r.p_offset
    if r.fp8_query:
        return p.to(torch.float8_e4m3fn).to(torch.float32), row_sum
    if r.emulation.normalized_probabilities:
        p, row_sum = softmax_first(p, row_sum, spread)
    return (p if r.emulation.fp32_probabilities else round_to(p, r.element)), row_sum


def softmax_first(
    p: torch.Tensor, row_sum: torch.Tensor, spread: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P / row sum, 1)`` (0 where nothing is visible): a softmax before P.V, whose later division
    by the returned sum changes nothing (``x / 1`` is ``x``): ``Emulation.normalized_probabilities``.
    ``spread``: a row value broadcast to ``p`` (default ``x[..., None]``)."""
    spread = spread or _last_axis
    p = torch.where(spread(row_sum) > 0, p / spread(row_sum.clamp_min(1e-38)), 0.0)
    return p, (row_sum > 0).to(row_sum.dtype)


def _last_axis(x: torch.Tensor) -> torch.Tensor:
    return x[..., None]


def normalise(acc: torch.Tensor, row_sum: torch.Tensor, r: StepRounding) -> torch.Tensor:
    """``acc [..., d] / row_sum`` (0 where nothing is visible), times the V descale on the fp8 path."""
    o = torch.where(row_sum[..., None] > 0, acc / row_sum.clamp_min(1e-38)[..., None], 0.0)
    return o * r.v_scale if r.fp8_query else o


def emulate_sequence(
    query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, q_len: int, r: StepRounding
) -> torch.Tensor:
    """One sequence's ``q_len`` queries (rows from ``q_start``) over its stored keys ``k, v [n, h, d]``.

    Returns:
        ``[q_len, H, D]`` fp32, before the output's rounding.
    """
    seq_len = k.shape[0]
    k, v = convert_kv(k, v, r)
    k_pos = torch.arange(seq_len)
    out = torch.empty(q_len, r.num_heads, r.head_size, dtype=torch.float32)
    chunk = max(1, MAX_SCORE_ELEMS // (r.num_heads * seq_len))
    for t0 in range(0, q_len, chunk):
        t1 = min(q_len, t0 + chunk)
        q = query[q_start + t0 : q_start + t1].to(torch.float32).view(t1 - t0, r.num_kv_heads, r.group, r.head_size)
        q_pos = torch.arange(seq_len - q_len + t0, seq_len - q_len + t1)
        s = torch.einsum("thgd,nhd->hgtn", q, k)  # fp32 sums, [h, g, t, n]
        visible = visibility(q_pos[None], k_pos[None], None, r.causal, r.window)[0]  # [t, n]
        distance = (q_pos[:, None] - k_pos[None, :]).abs().to(torch.float32) if r.alibi_slopes is not None else None
        p_op, row_sum = probabilities(s, distance, visible, r)
        acc = torch.einsum("hgtn,nhd->hgtd", p_op, v)
        o = normalise(acc, row_sum, r)
        out[t0:t1] = o.permute(2, 0, 1, 3).reshape(t1 - t0, r.num_heads, r.head_size)
    return out


def emulate_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    table: list[list[int]],
    decode: list[tuple[int, int, int]],
    r: StepRounding,
) -> torch.Tensor:
    """The one-query rows of a step, batched by length: what :func:`emulate_sequence` gives each.

    Rows are sorted by length and taken in batches of about :data:`MAX_DECODE_ELEMS` gathered
    elements, lengths mixed (:func:`_decode_batch`).

    Args:
        query: ``[T, H, D]``.
        key_cache, value_cache: ``[nb, bs, H_kv, D]`` as stored.
        table: ``block_table`` as lists.
        decode: ``(b, row, s)`` per row: sequence, query row, keys of the sequence (``s > 1``:
            with one key the per-sequence ``einsum`` multiplies P and V elementwise).

    Returns:
        ``[len(decode), H, D]`` fp32 in ``decode``'s order, before the output's rounding.
    """
    block_size = key_cache.shape[1]
    key_cache, value_cache = as_stored(key_cache), as_stored(value_cache)
    h, g, d = r.num_kv_heads, r.group, r.head_size
    order = sorted(range(len(decode)), key=lambda i: decode[i][2])
    lens = [decode[i][2] for i in order]
    blocks = [table[decode[i][0]][: cdiv(decode[i][2], block_size)] for i in order]
    query = query.index_select(0, torch.tensor([decode[i][1] for i in order])).to(torch.float32)
    acc = torch.empty(len(order), h, g, 1, d, dtype=torch.float32)
    row_sum = torch.empty(len(order), h, g, 1, dtype=torch.float32)
    block_elems = block_size * h * d
    lo = 0
    while lo < len(order):
        hi, elems = lo + 1, len(blocks[lo]) * block_elems
        while hi < len(order) and elems + len(blocks[hi]) * block_elems <= MAX_DECODE_ELEMS:
            elems += len(blocks[hi]) * block_elems
            hi += 1
        ids = torch.tensor([b for row in blocks[lo:hi] for b in row], dtype=torch.long)
        groups = [(n, len(list(same))) for n, same in itertools.groupby(lens[lo:hi])]
        _decode_batch(
            query[lo:hi],
            take_blocks(key_cache, ids),
            take_blocks(value_cache, ids),
            groups,
            r,
            acc[lo:hi],
            row_sum[lo:hi],
        )
        lo = hi
    out = torch.empty(len(decode), r.num_heads, d, dtype=torch.float32)
    out[torch.tensor(order)] = normalise(acc, row_sum, r).view(len(order), r.num_heads, d)
    return out


def _decode_batch(
    query: torch.Tensor,
    k_raw: torch.Tensor,
    v_raw: torch.Tensor,
    groups: list[tuple[int, int]],
    r: StepRounding,
    acc: torch.Tensor,
    row_sum: torch.Tensor,
) -> None:
    """A batch of decode rows sorted by length: ``groups`` ``(keys, rows)`` in order, their blocks
    ``k_raw / v_raw [nb, bs, h, d]`` as stored, row after row; fills ``acc [r, h, g, 1, d]`` (P·V,
    fp32) and ``row_sum [r, h, g, 1]``.

    The two products run per length (:func:`reference_impl.gathered.batched_bmm`: each row's bits
    as its own call gives them), and so do the row max and the row sum (a reduction over a row's
    own keys, never over padding); everything between them is elementwise, so it runs once over
    the whole batch, each row's logits laid one after another in one flat buffer.
    """
    h, g, d = r.num_kv_heads, r.group, r.head_size
    block_size = k_raw.shape[1]
    left = r.window[0]
    spans = []  # per group: (first row, rows, keys, offset in the flat buffer)
    row = offset = 0
    for n, rows in groups:
        spans.append((row, rows, n, offset))
        row, offset = row + rows, offset + rows * h * g * n
    total_rows = row
    flat = torch.empty(offset, dtype=torch.float32)
    values = []
    block = 0
    for row, rows, n, at in spans:
        width = cdiv(n, block_size)
        k, v = (
            c[block : block + rows * width].view(rows, width * block_size, h, d)[:, :n] for c in (k_raw, v_raw)
        )  # [r, n, h, d]
        block += rows * width
        k, v = convert_kv(k, v, r)
        values.append(v)
        out = flat[at : at + rows * h * g * n].view(rows, h, g, n)
        batched_bmm(query[row : row + rows].view(rows, h, g, d), k, transpose=True, out=out)  # "rhgd,rnhd->rhgn"
    s = scores(flat, r)
    m = torch.empty(total_rows, h, g, 1, dtype=torch.float32)
    for row, rows, n, at in spans:
        s_g = s[at : at + rows * h * g * n].view(rows, h, g, 1, n)
        # A lone query at n - 1 sees every key but those left of a sliding window.
        k_pos = torch.arange(n) if r.alibi_slopes is not None or 0 <= left < n - 1 else None
        if k_pos is not None:
            visible = None if left < 0 else visibility(k_pos[-1:, None], k_pos[None], None, r.causal, r.window)[0]
            distance = None if r.alibi_slopes is None else (n - 1 - k_pos)[None].abs().to(torch.float32)
            s_g.copy_(biased(s_g, distance, visible, r))
        torch.amax(s_g, dim=-1, out=m[row : row + rows])
    m = row_max(m, r)
    counts = torch.tensor([n for _, rows, n, _ in spans for _ in range(rows * h * g)])

    def spread(x: torch.Tensor) -> torch.Tensor:  # [r, h, g, 1] -> each value once per key of its row
        return torch.repeat_interleave(x.reshape(-1), counts)

    p = exponentials(s, spread(m), r)
    for row, rows, n, at in spans:
        torch.sum(p[at : at + rows * h * g * n].view(rows, h, g, 1, n), dim=-1, out=row_sum[row : row + rows])
    p_op, sums = operand(p, row_sum, m, r, spread=spread)
    if sums is not row_sum:  # a sink's share or a softmax first: a new sum
        row_sum.copy_(sums)
    for (row, rows, n, at), v in zip(spans, values, strict=True):
        p_g = p_op[at : at + rows * h * g * n].view(rows, h, g, n)
        batched_bmm(p_g, v, transpose=False, out=acc[row : row + rows].view(rows, h, g, d))  # "rhgn,rnhd->rhgd"
