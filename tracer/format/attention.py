"""Attention weights of a captured step, as torch-free records: summaries per head, heat maps.

``reference_impl.attention_weights`` computes the softmax weights of each query row over its
context in fp64 (the replay reference's own gathered softmax); these records carry what the
CLI prints (:class:`HeadSummary`) and what the report draws (:class:`AttentionMap`), so that
``reports`` draws them without torch, as it draws the tour's walked query.

A long context is downsampled for drawing: key positions are cut into at most
:data:`MAX_MAP_COLS` equal bins, each cell the weight mass of its bin (a sum: the row still sums
to 1), and at most :data:`MAX_MAP_ROWS` evenly spaced query rows are kept (the last always).

Standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "FIRST_TOKENS",
    "MAX_MAP_COLS",
    "MAX_MAP_ROWS",
    "AttentionMap",
    "HeadSummary",
    "bin_edges",
    "kept_rows",
    "summarize_row",
]

#: "Mass on the first tokens": the weight a row puts on positions ``0 .. FIRST_TOKENS - 1``
#: (where attention sinks form).
FIRST_TOKENS = 4
#: Key-position bins of a drawn map at most; query rows of a drawn map at most.
MAX_MAP_COLS = 512
MAX_MAP_ROWS = 256


@dataclass(frozen=True)
class HeadSummary:
    """One query head's weights over one query row."""

    head: int  #: query head, 0-based
    top: tuple[tuple[int, float], ...]  #: ``(key position, weight)``, largest first
    first_mass: float  #: weight on positions ``< FIRST_TOKENS``
    entropy: float  #: ``-sum w log w``, nats (0: one key; ``log n``: uniform over ``n``)
    visible: int  #: keys with a non-zero weight
    sink: float | None = None  #: weight of the sink logit (no value), when the model has sinks


def summarize_row(head: int, weights: Sequence[float], top: int = 5, sink: float | None = None) -> HeadSummary:
    """The summary of one head's weights ``[n]`` over key positions ``0 .. n - 1``."""
    order = sorted(range(len(weights)), key=lambda i: -weights[i])[:top]
    entropy = -sum(w * math.log(w) for w in weights if w > 0)
    return HeadSummary(
        head=head,
        top=tuple((i, float(weights[i])) for i in order if weights[i] > 0),
        first_mass=float(sum(weights[:FIRST_TOKENS])),
        entropy=float(entropy),
        visible=sum(1 for w in weights if w > 0),
        sink=sink,
    )


def bin_edges(num_keys: int, max_cols: int = MAX_MAP_COLS) -> tuple[int, ...]:
    """Key-position bin edges ``0 = e0 < e1 < ... = num_keys``: one position a bin when it fits."""
    width = max(1, -(-num_keys // max_cols))
    return (*range(0, num_keys, width), num_keys) if num_keys else (0,)


def kept_rows(num_rows: int, max_rows: int = MAX_MAP_ROWS) -> tuple[int, ...]:
    """Indices of the query rows a map draws: all of them, or ``max_rows`` evenly spaced (the last kept)."""
    if num_rows <= max_rows:
        return tuple(range(num_rows))
    return tuple(sorted({round(i * (num_rows - 1) / (max_rows - 1)) for i in range(max_rows)}))


@dataclass(frozen=True)
class AttentionMap:
    """One request of one (step, layer): each head's weights, query rows by key positions, for drawing."""

    step: int
    layer: str
    request: int  #: block-table row in the step
    request_id: str
    seq_len: int  #: keys of the request (positions ``0 .. seq_len - 1``)
    block_size: int
    physical: tuple[int, ...]  #: the request's block-table row: logical block -> physical block id
    null_block: int | None  #: the null block's id (cells holding it are marked), None: unknown
    group: str  #: the KV-cache group the layer reads, in words ("" when unknown)
    causal: bool
    window: tuple[int, int] | None  #: ``(left, right)``, FlashAttention's convention
    positions: tuple[int, ...]  #: the query position of each drawn row
    rows_total: int  #: query rows of the request before downsampling
    col_edges: tuple[int, ...]  #: key-position bin edges (``len = columns + 1``)
    #: ``[head][row][column]``: weight mass of the column's positions (rows sum to 1, less a sink's share)
    heads: tuple[tuple[tuple[float, ...], ...], ...]
    summaries: tuple[HeadSummary, ...]  #: per head, of the request's last query row

    @property
    def downsampled(self) -> bool:
        """Whether columns were binned or rows left out."""
        return len(self.col_edges) - 1 < self.seq_len or len(self.positions) < self.rows_total

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``--json``)."""
        return asdict(self)
