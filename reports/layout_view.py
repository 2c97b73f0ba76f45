"""The KV-cache layout section of the index page: dimensions, offset formulas and an SVG drawing.

Every layout is drawn from ``tracer.format.layouts`` (the registry's geometry, plain
arithmetic): no torch, so a report draws the AMX packing on any machine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tracer.format import REGISTRY, KVCacheSpec, describe_layout, element_offset
from tracer.format.layouts import (
    LAYOUT_CPU,
    LAYOUT_CPU_AMX,
    LAYOUT_FLASH_HND,
    LAYOUT_FLASH_NHD,
    ComponentView,
    LayoutDescription,
)


@dataclass(frozen=True)
class Box:
    """One rectangle (or, with ``cls`` ``label``, one text) of an SVG drawing, in px."""

    x: int
    y: int
    w: int
    h: int
    label: str
    cls: str  #: ``k`` / ``v`` / ``gap`` / ``group`` / ``rowlabel``
    title: str = ""  #: tooltip


@dataclass(frozen=True)
class DimRow:
    """One logical dimension of the cache tensor."""

    index: int
    name: str
    size: int
    stride: int  #: in elements
    stride_bytes: int
    memory_rank: int  #: 0 = outermost in memory


@dataclass(frozen=True)
class LayoutView:
    """The KV-cache layout section of the index page."""

    layout: str
    physical_order: str
    summary: str
    dims: tuple[DimRow, ...]
    formulas: tuple[str, ...]
    boxes: tuple[Box, ...]
    width: int
    height: int
    caption: str


_DIM_NAMES = ("num_blocks", "num_kv_heads", "block_size", "2*head_size")
_BOX_W, _BOX_H, _ROW_GAP, _LEFT, _GROUP_H = 46, 26, 22, 96, 16


def _pick(n: int, head: int = 2) -> list[int | None]:
    """Indices to draw out of ``n``: the first ``head``, an ellipsis (None), the last."""
    if n <= head + 1:
        return list(range(n))
    return [*range(head), None, n - 1]


class _Strip:
    """Lays out boxes left to right, one row per block."""

    def __init__(self) -> None:
        self.boxes: list[Box] = []
        self.width = 0

    def row(self, y: int, label: str, groups: list[tuple[str, list[tuple[str, str, int, str]]]]) -> None:
        """Add one block's row at height ``y``: ``groups`` of (text, class, width, tooltip) boxes."""
        self.boxes.append(Box(4, y + _GROUP_H + _BOX_H // 2 + 4, _LEFT - 8, 0, label, "rowlabel"))
        x = _LEFT
        for group_label, items in groups:
            start = x
            for text, cls, width, title in items:
                self.boxes.append(Box(x, y + _GROUP_H, width, _BOX_H, text, cls, title))
                x += width + (2 if cls != "gap" else 4)
            if group_label:
                self.boxes.append(Box(start, y, x - start - 2, _GROUP_H - 3, group_label, "group"))
            x += 8
        self.width = max(self.width, x)

    def block_rows(
        self,
        y: int,
        row_h: int,
        blocks: list[int | None],
        groups_of: Callable[[int], list[tuple[str, list[tuple[str, str, int, str]]]]],
    ) -> int:
        """One row per block of ``blocks`` (``groups_of(b)`` draws it) from height ``y``; an
        elided block (None) is a gap box. Returns the height below the last row."""
        for b in blocks:
            if b is None:
                self.boxes.append(Box(_LEFT, y, 30, _BOX_H, "…", "gap", "more blocks"))
                y += _BOX_H + 4
                continue
            self.row(y, f"block {b}", groups_of(b))
            y += row_h
        return y


def _gap(title: str = "") -> tuple[str, str, int, str]:
    return ("…", "gap", 18, title)


def layout_view(spec: KVCacheSpec | None) -> LayoutView | None:
    """The drawn layout: logical shape vs physical strides, and how K and V are packed."""
    if spec is None:
        return None
    dims_n = len(spec.shape)
    ranks = {d: r for r, d in enumerate(sorted(range(dims_n), key=lambda d: -spec.stride[d]))}
    dims = tuple(
        DimRow(
            i,
            _DIM_NAMES[i] if dims_n == 4 else f"dim {i}",
            spec.shape[i],
            spec.stride[i],
            spec.stride[i] * spec.element_size,
            ranks[i],
        )
        for i in range(dims_n)
    )
    d, bs, h = spec.head_size, spec.block_size, spec.num_kv_heads
    summary = (
        f"kv_cache {tuple(spec.shape)} {spec.dtype}: {spec.num_blocks} blocks x {bs} tokens x {h} KV heads x "
        f"(K|V) {d} each; physically {spec.physical_order}"
    )
    strip = _Strip()
    if dims_n != 4:
        return LayoutView(spec.layout, spec.physical_order, summary, dims, (), (), 0, 0, "no drawing for this shape")
    s0, s1, s2, s3 = spec.stride
    row_h = _GROUP_H + _BOX_H + _ROW_GAP
    blocks = _pick(spec.num_blocks)
    y = 4
    if spec.layout in (LAYOUT_FLASH_NHD, LAYOUT_FLASH_HND):
        formulas = (
            f"K[b, t, h, :] = kv_cache[b, h, t, 0:{d}] at element b*{s0} + h*{s1} + t*{s2} + d*{s3}",
            f"V[b, t, h, :] = kv_cache[b, h, t, {d}:{2 * d}] at the same offset + {d * s3}",
        )
        nhd = spec.layout == LAYOUT_FLASH_NHD
        outer, inner = (_pick(bs), _pick(h)) if nhd else (_pick(h), _pick(bs))
        outer_name, inner_name = ("token", "head") if nhd else ("head", "token")

        def flash_groups(b: int) -> list:
            groups = []
            for o in outer:
                if o is None:
                    groups.append(("", [_gap(f"more {outer_name}s")]))
                    continue
                items = []
                for i in inner:
                    if i is None:
                        items.append(_gap(f"more {inner_name}s"))
                        continue
                    t, hh = (o, i) if nhd else (i, o)
                    off = b * s0 + hh * s1 + t * s2
                    short = f"h{hh}" if nhd else f"t{t}"
                    where = f"of block {b}, token {t}, head {hh}: elements"
                    items.append((f"K {short}", "k", _BOX_W, f"K {where} {off}..{off + d * s3 - 1}"))
                    items.append((f"V {short}", "v", _BOX_W, f"V {where} {off + d * s3}..{off + 2 * d * s3 - 1}"))
                groups.append((f"{outer_name} {o}", items))
            return groups

        y = strip.block_rows(y, row_h, blocks, flash_groups)
        caption = (
            f"One row per block in memory order; within a block: {spec.physical_order}. "
            f"Each K or V box is {d} contiguous elements."
        )
    elif spec.layout == LAYOUT_CPU:
        desc = _describe(spec)
        if isinstance(desc, str):
            return LayoutView(spec.layout, spec.physical_order, summary, dims, (), (), 0, 0, desc)
        formulas = (
            f"K^T[b, h][d][t] at element {offset_formula(desc.k_view)}",
            f"V[b, h][t][d] at element {offset_formula(desc.v_view)}",
        )

        def cpu_groups(b: int) -> list:
            groups = []
            for hh in _pick(h):
                if hh is None:
                    groups.append(("", [_gap("more heads")]))
                    continue
                off = b * s0 + hh * s1
                groups.append(
                    (
                        f"head {hh}",
                        [
                            (
                                f"K^T [{d}][{bs}]",
                                "k",
                                3 * _BOX_W,
                                f"K transposed of block {b}, head {hh}: elements {off}..{off + bs * d - 1}",
                            ),
                            (
                                f"V [{bs}][{d}]",
                                "v",
                                3 * _BOX_W,
                                f"V of block {b}, head {hh}: elements {off + bs * d}..{off + 2 * bs * d - 1}",
                            ),
                        ],
                    )
                )
            return groups

        y = strip.block_rows(y, row_h, blocks, cpu_groups)
        caption = f"One row per block; {REGISTRY[LAYOUT_CPU].description}."
    elif spec.layout == LAYOUT_CPU_AMX:
        desc = _describe(spec)
        if isinstance(desc, str):
            return LayoutView(spec.layout, spec.physical_order, summary, dims, (), (), 0, 0, desc)
        formulas = (
            f"K[b, t, h, d] at element {offset_formula(desc.k_view)}",
            f"V[b, t, h, d] at element {offset_formula(desc.v_view)}",
        )
        y = _amx_rows(strip, spec, desc, blocks, y, row_h)
        caption = (
            f"One row per block; {REGISTRY[LAYOUT_CPU_AMX].description}. Here K is {bs // 16} token tile(s) of "
            f"16 tokens x {d} dims and V {d // 16} dim tile(s) of 16 dims x {bs} tokens, 16 pairs per row: the "
            "last row shows the first elements of block 0, head 0 in memory order. Offsets from "
            "tracer.format.layouts.element_offset."
        )
    else:
        return LayoutView(
            spec.layout, spec.physical_order, summary, dims, (), (), 0, 0, f"no drawing for layout {spec.layout!r}"
        )
    return LayoutView(
        spec.layout, spec.physical_order, summary, dims, formulas, tuple(strip.boxes), strip.width + 4, y, caption
    )


def _describe(spec: KVCacheSpec) -> LayoutDescription | str:
    """The registry's geometry of ``spec``'s layout, or why it has none (e.g. sizes AMX cannot tile)."""
    try:
        return describe_layout(
            spec.layout, spec.num_blocks, spec.num_kv_heads, spec.block_size, spec.head_size, spec.element_size
        )
    except ValueError as exc:
        return f"no drawing: {exc}"


#: Index names of ``ComponentView.dims`` -> the letters the formulas use.
_LETTERS = {"block": "b", "head": "h", "token": "t", "dim": "d"}


def offset_formula(view: ComponentView) -> str:
    """``view``'s element offset as arithmetic: ``b*8192 + h*4096 + (t//16)*1024 + ... + d%2``.

    The storage offset (where V starts) follows the (block, head) terms.
    """
    terms = []
    for i, (name, stride) in enumerate(zip(view.dims, view.strides, strict=True)):
        if i == 2 and view.storage_offset:
            terms.append(str(view.storage_offset))
        var, *rest = name.split()
        expr = _LETTERS[var] + "".join(rest)
        if stride == 1:
            terms.append(expr)
        else:
            terms.append(f"({expr})*{stride}" if rest else f"{expr}*{stride}")
    return " + ".join(terms)


def _unravel(offset: int, view: ComponentView) -> dict[str, int]:
    """``token`` / ``dim`` at ``offset`` elements into one (block, head) region half of ``view``.

    The view's inner dims (after block and head) are contiguous in memory order and
    named ``token // 16``, ``dim % 2`` ...; unravelling ``offset`` and summing the parts
    gives the logical token and dim.
    """
    out = {"token": 0, "dim": 0}
    rest = offset
    sizes = view.shape[2:]
    for name, size in zip(reversed(view.dims[2:]), reversed(sizes), strict=True):
        rest, i = divmod(rest, size)
        var, _, tail = name.partition(" ")
        if tail.startswith("//"):
            out[var] += i * int(tail.split()[-1])
        else:
            out[var] += i
    return out


def _amx_rows(
    strip: _Strip, spec: KVCacheSpec, desc: LayoutDescription, blocks: list[int | None], y: int, row_h: int
) -> int:
    """Draw the AMX packing: tiles per (block, head), then block 0 / head 0's first elements."""
    bs, d, h = spec.block_size, spec.head_size, spec.num_kv_heads

    def offset(b: int, hh: int, t: int, dim: int, which: str) -> int:
        return element_offset(
            spec.layout,
            b,
            hh,
            t,
            dim,
            which,
            num_kv_heads=h,
            block_size=bs,
            head_size=d,
            element_size=spec.element_size,
        )

    def amx_groups(b: int) -> list:
        groups = []
        for hh in _pick(h):
            if hh is None:
                groups.append(("", [_gap("more heads")]))
                continue
            items = []
            for tile in _pick(bs // 16):
                if tile is None:
                    items.append(_gap("more token tiles"))
                    continue
                first = offset(b, hh, 16 * tile, 0, "k")
                items.append(
                    (
                        f"K t{16 * tile}–{16 * tile + 15}",
                        "k",
                        2 * _BOX_W,
                        f"K of block {b}, head {hh}, tokens {16 * tile}–{16 * tile + 15}: [{d // 2}][16][2] "
                        f"(dim pair, token, dim in pair), elements {first}..{first + 16 * d - 1}",
                    )
                )
            for tile in _pick(d // 16):
                if tile is None:
                    items.append(_gap("more dim tiles"))
                    continue
                first = offset(b, hh, 0, 16 * tile, "v")
                items.append(
                    (
                        f"V d{16 * tile}–{16 * tile + 15}",
                        "v",
                        2 * _BOX_W,
                        f"V of block {b}, head {hh}, dims {16 * tile}–{16 * tile + 15}: [{bs // 2}][16][2] "
                        f"(token pair, dim, token in pair), elements {first}..{first + 16 * bs - 1}",
                    )
                )
            groups.append((f"head {hh}", items))
        return groups

    y = strip.block_rows(y, row_h, blocks, amx_groups)
    # The packing inside a tile: the first 6 and the 33rd..36th elements of each half, in memory order.
    zoom = []
    for which, view, cls, name in (("k", desc.k_view, "k", "K"), ("v", desc.v_view, "v", "V")):
        items = []
        for local in [0, 1, 2, 3, 4, 5, None, 30, 31, 32, 33]:
            if local is None:
                items.append(_gap("…"))
                continue
            pos = _unravel(local, view)
            at = offset(0, 0, pos["token"], pos["dim"], which)
            items.append(
                (
                    f"t{pos['token']} d{pos['dim']}",
                    cls,
                    _BOX_W + 8,
                    f"{name}[token {pos['token']}, dim {pos['dim']}] of block 0, head 0 at element {at}",
                )
            )
        zoom.append((f"{name} half of block 0, head 0: first elements in memory", items))
    strip.row(y, "in a tile", zoom)
    return y + row_h
