"""Sampled query rows (format 4): which rows a step keeps, and the step as those rows see it.

A tensor step of a long prefill holds one query and one output row per token: 14 KB a token
for a 7B model's layer, most of a trace's bytes. ``tracer.start(query_rows=K)`` keeps K of
them a step (:func:`sample_rows`) and stores their indices as the tensor ``query_rows``;
the KV write log stays whole, so every row that was kept can still be replayed over its
full causal context.

Attention of one query row depends only on that row, the keys and values at positions up to
its own, and the step's options (scale, window, soft-cap, sinks, ALiBi). So a kept row ``r``
of request ``b`` is replayed as a one-token request of its own (:func:`row_view`): the same
block-table row, and ``seq_len = position + 1`` where ``position`` is the row's place in the
sequence (``seq_lens[b] - query_len[b] + r - query_start_loc[b]``). Keys the step wrote
after that position are in the rebuilt blocks but past the row's ``seq_len``: never read,
exactly as the causal mask hides them in the batched step.

Standard library only.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["QUERY_ROWS", "RowView", "row_view", "sample_rows"]

#: The tensor that lists a step's kept rows (int64, strictly increasing, within ``num_actual_tokens``).
QUERY_ROWS = "query_rows"

#: The offset of step ``s``'s evenly spaced rows within their stride is ``frac(s * phi)``: successive
#: steps land at well spread places, so over a run every part of a prefill is sampled.
_GOLDEN = 0.6180339887498949


def sample_rows(query_start_loc: Sequence[int], k: int, step: int) -> tuple[int, ...]:
    """The query rows a step keeps: all of them when ``k <= 0`` or there are at most ``k``, else ``k``.

    Half of them (rounded up) are requests' last rows, the rows that choose the next token: a
    step keeps the last row of ``ceil(k / 2)`` requests, starting at a request that moves on by
    that many each step, so every request of a long batch is seen in turn. The rest are spread
    evenly over all the step's rows (prefill rows included), at an offset that moves each step.
    Deterministic: the same step gives the same rows.
    """
    qsl = [int(x) for x in query_start_loc]
    n = qsl[-1] if qsl else 0
    if k <= 0 or n <= k:
        return tuple(range(n))
    lasts = [qsl[i + 1] - 1 for i in range(len(qsl) - 1) if qsl[i + 1] > qsl[i]]
    chosen: set[int] = set()
    if lasts:
        count = min(len(lasts), (k + 1) // 2)
        start = (step * count) % len(lasts)
        chosen.update(lasts[(start + j) % len(lasts)] for j in range(count))
    spread = k - len(chosen)
    if spread > 0:
        stride = n / spread
        offset = ((step * _GOLDEN) % 1.0) * stride
        for j in range(spread):
            row = min(n - 1, int(offset + j * stride))
            while row in chosen:  # a last row already kept: the next free row (n > k, so one exists)
                row = (row + 1) % n
            chosen.add(row)
    return tuple(sorted(chosen))


@dataclass(frozen=True)
class RowView:
    """Kept query rows as one-token requests: the kernel's inputs for them (see the module docstring)."""

    rows: tuple[int, ...]  #: the step's token rows, as ``query_rows`` lists them
    requests: tuple[int, ...]  #: per row: its request (block-table row) in the step
    seq_lens: tuple[int, ...]  #: per row: its position + 1
    query_start_loc: tuple[int, ...]  #: ``0, 1, ..., len(rows)``
    block_table: tuple[tuple[int, ...], ...]  #: per row: its request's block-table row

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens, default=0)


def row_view(
    query_start_loc: Sequence[int],
    seq_lens: Sequence[int],
    block_table: Sequence[Sequence[int]],
    rows: Sequence[int],
    *,
    causal: bool = True,
) -> RowView:
    """The step of ``query_start_loc`` / ``seq_lens`` / ``block_table`` seen from its ``rows``.

    ``causal=False`` (an encoder step: every row reads the whole sequence): each row keeps its
    request's ``seq_len``.

    Raises:
        ValueError: a row outside ``0 .. query_start_loc[-1] - 1``.
    """
    qsl = [int(x) for x in query_start_loc]
    n = qsl[-1] if qsl else 0
    requests, lens = [], []
    for r in rows:
        r = int(r)
        if not 0 <= r < n:
            raise ValueError(f"query row {r} is outside the step's {n} rows")
        b = bisect.bisect_right(qsl, r) - 1  # the request whose rows [qsl[b], qsl[b+1]) hold r
        query_len = qsl[b + 1] - qsl[b]
        requests.append(b)
        lens.append(int(seq_lens[b]) - query_len + (r - qsl[b]) + 1 if causal else int(seq_lens[b]))
    return RowView(
        rows=tuple(int(r) for r in rows),
        requests=tuple(requests),
        seq_lens=tuple(lens),
        query_start_loc=tuple(range(len(requests) + 1)),
        block_table=tuple(tuple(int(x) for x in block_table[b]) for b in requests),
    )
