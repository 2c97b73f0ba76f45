"""``attention-NNNNNN-<layer>.html``: where each query of a step looked, head by head, block by block.

One page per captured (step, layer) with tensors (the first :data:`MAX_ATTENTION_PAGES`). For each
request a heat map per head: query rows down, key positions across, each cell the weight of that
key (its mass, when a long context is binned: ``tracer.format.attention``), drawn as a PNG
(:mod:`reports.png`) under an SVG that marks what the kernel saw: the block boundaries with each
block's physical id from the request's block-table row (the null block's cells hatched), the
causal edge and the sliding window's left edge. The weights are computed by the CLI
(``reference_impl.attention_weights``) and arrive here as torch-free ``AttentionMap`` records.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from reports.common import Link, Row, step_page
from reports.png import heat_png, png_data_uri
from tracer.format.attention import FIRST_TOKENS, AttentionMap
from tracer.format.selection import layer_index

__all__ = ["MAX_ATTENTION_PAGES", "AttentionPage", "attention_page", "attention_page_name"]

#: Attention pages a report writes at most (the first captured steps with tensors).
MAX_ATTENTION_PAGES = 24
#: Drawn width of a map at most, in CSS pixels; a row's drawn height, at most and at least.
_MAX_WIDTH = 720
_ROW_MAX, _ROW_MIN = 10, 1
_MAP_MIN_HEIGHT = 14
#: Height of the strip above a map that labels the blocks.
_LABEL_STRIP = 16


def attention_page_name(step: int, layer: str) -> str:
    """``attention-000004-L0.html``."""
    index = layer_index(layer)
    tag = f"L{index}" if index is not None else "".join(c if c.isalnum() else "_" for c in layer)
    return f"attention-{step:06d}-{tag}.html"


@dataclass(frozen=True)
class BlockMark:
    """One logical block above a map: where it starts, its physical id, and whether it is the null block."""

    x: float
    width: float
    label: str
    null: bool
    title: str


@dataclass(frozen=True)
class HeadMap:
    """One head's heat map and the lines drawn over it."""

    head: int
    image: str  #: ``data:image/png;base64,...``
    top: str  #: the head's top keys, as text
    entropy: str
    first_mass: str
    causal_edge: str  #: SVG polyline points ("" when not causal)
    window_edge: str  #: SVG polyline points ("" without a window)


@dataclass(frozen=True)
class RequestMaps:
    """One request's maps on a page."""

    title: str
    facts: tuple[Row, ...]
    width: int  #: drawn map width, px
    height: int  #: drawn map height, px
    strip: int  #: label strip height, px
    blocks: tuple[BlockMark, ...]
    heads: tuple[HeadMap, ...]
    note: str  #: downsampling, said plainly ("" when every row and position is drawn)


@dataclass(frozen=True)
class AttentionPage:
    """``attention-NNNNNN-<layer>.html``."""

    step: int
    layer: str
    group: str
    step_link: Link
    requests: tuple[RequestMaps, ...]
    nav: tuple[Link, ...]
    first_tokens: int = FIRST_TOKENS  #: the summaries' "mass on the first tokens" counts these positions


def _x(edges: Sequence[int], position: float, cell: float) -> float:
    """Horizontal pixel of key ``position`` (a boundary between positions) on a map with column ``edges``."""
    if position <= edges[0]:
        return 0.0
    if position >= edges[-1]:
        return (len(edges) - 1) * cell
    c = bisect.bisect_right(edges, position) - 1
    return (c + (position - edges[c]) / (edges[c + 1] - edges[c])) * cell


def _request_maps(m: AttentionMap) -> RequestMaps:
    cols, rows = len(m.col_edges) - 1, len(m.positions)
    cell = max(1.0, min(12.0, _MAX_WIDTH / max(cols, 1)))
    row_h = max(_ROW_MIN, min(_ROW_MAX, 240 // max(rows, 1)))
    width, height = round(cols * cell), max(_MAP_MIN_HEIGHT, rows * row_h)
    row_h_f = height / max(rows, 1)
    bs = m.block_size
    num_blocks = -(-m.seq_len // bs)
    every = max(1, -(-num_blocks * 28 // max(width, 1)))  # label every k-th block so labels do not collide
    blocks = []
    for j in range(num_blocks):
        x0, x1 = _x(m.col_edges, j * bs, cell), _x(m.col_edges, min(m.seq_len, (j + 1) * bs), cell)
        physical = m.physical[j] if j < len(m.physical) else -1
        null = m.null_block is not None and physical == m.null_block
        title = f"logical block {j} (positions {j * bs}-{min(m.seq_len, (j + 1) * bs) - 1}): physical block {physical}"
        if null:
            title += " = the null block: the window group gave it back, no query reads it"
        blocks.append(BlockMark(round(x0, 2), round(x1 - x0, 2), str(physical) if j % every == 0 else "", null, title))
    left = m.window[0] if m.window is not None else -1
    heads = []
    for h, values in enumerate(m.heads):
        top = max((v for row in values for v in row), default=0.0)
        causal, window = [], []
        for i, pos in enumerate(m.positions):
            y0, y1 = round(i * row_h_f, 2), round((i + 1) * row_h_f, 2)
            if m.causal:
                x = round(_x(m.col_edges, pos + 1, cell), 2)
                causal += [f"{x},{y0}", f"{x},{y1}"]
            if left >= 0 and pos - left > 0:  # the window hides keys of this row
                x = round(_x(m.col_edges, pos - left, cell), 2)
                window += [f"{x},{y0}", f"{x},{y1}"]
        s = m.summaries[h]
        heads.append(
            HeadMap(
                head=h,
                image=png_data_uri(heat_png(values, top)),
                top=", ".join(f"{p} ({w:.2f})" for p, w in s.top[:3]),
                entropy=f"{s.entropy:.2f}",
                first_mass=f"{s.first_mass:.2f}",
                causal_edge=" ".join(causal),
                window_edge=" ".join(window),
            )
        )
    notes = []
    if cols < m.seq_len:
        notes.append(f"{m.seq_len} key positions binned into {cols} columns of {m.col_edges[1]} (each cell their sum)")
    if rows < m.rows_total:
        notes.append(f"{rows} of {m.rows_total} query rows drawn, evenly spaced (the last kept)")
    first, last = (m.positions[0], m.positions[-1]) if m.positions else (0, 0)
    facts = (
        Row("query rows", f"{m.rows_total} (positions {first}-{last})"),
        Row("keys", f"{m.seq_len} in {num_blocks} blocks of {bs}"),
        Row("block table row", " ".join(map(str, m.physical))),
        Row("window / causal", f"{m.window} / {m.causal}"),
    )
    return RequestMaps(
        title=f"request {m.request_id or m.request} (row {m.request})",
        facts=facts,
        width=width,
        height=height,
        strip=_LABEL_STRIP,
        blocks=tuple(blocks),
        heads=tuple(heads),
        note="; ".join(notes) + ("." if notes else ""),
    )


def attention_page(maps: Sequence[AttentionMap], nav: tuple[Link, ...]) -> AttentionPage:
    """The page of one (step, layer): ``maps``, one per request, all of that step and layer."""
    first = maps[0]
    return AttentionPage(
        step=first.step,
        layer=first.layer,
        group=first.group or "KV-cache group unknown",
        step_link=Link(step_page(first.step), f"step {first.step}"),
        requests=tuple(_request_maps(m) for m in maps),
        nav=nav,
    )
