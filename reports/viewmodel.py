"""Pure functions from a ``Trace`` to view-model dataclasses, one per page.

Templates only loop and branch over what is built here: every number is
formatted, every link computed, every drawing laid out (SVG boxes with
coordinates) before a template sees it. Nothing here writes files or builds
HTML; ``reports.build`` renders and writes.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import io
import keyword
import re
import tokenize
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from annotations.anchors import ANNOTATED_FILES
from annotations.annotate import file_notes, file_role, on_path
from annotations.locate import LocatedSource, locate
from annotations.values import fmt_list, value_for
from tracer.format import KVCacheSpec, RunInfo, StepRecord, TraceError
from tracer.format import REPLAY, Trace

#: Step pages are written for the first this-many request steps (``build_report``'s
#: ``max_step_pages`` overrides it) ...
MAX_REQUEST_PAGES = 200
#: ... plus the first this-many steps of other kinds (profile, warm-up).
MAX_OTHER_PAGES = 3
#: A block-table row shows at most this many cells: the first ``HEAD_CELLS`` and the last ones.
MAX_ROW_CELLS = 24
HEAD_CELLS = 16
#: A step page shows at most this many block-table rows.
MAX_ROWS = 64
#: Token -> slot runs listed on a step page.
MAX_SLOT_RUNS = 200
#: Page names.
INDEX_PAGE = "index.html"
TOUR_PAGE = "tour.html"


# --- shared pieces ---------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """A hyperlink: relative ``href`` and its text."""

    href: str
    text: str


@dataclass(frozen=True)
class Row:
    """A label/value row of a summary table."""

    label: str
    value: str


@dataclass(frozen=True)
class Verdict:
    """A replay verdict, ready to print."""

    status: str  #: ``ok`` / ``fail`` / ``none`` (not replayed)
    text: str  #: short human text, e.g. ``ok (max abs 1.2e-03)``


@dataclass(frozen=True)
class Token:
    """A highlighted piece of a source line."""

    cls: str  #: CSS class: ``kw`` keyword, ``st`` string, ``cm`` comment, ``nu`` number, ``fn`` def name, ``bi`` builtin-ish, ``""`` plain
    text: str


def source_file_page(vllm_path: str) -> str:
    """Page name of an annotated source: ``src-flash_attn.html``."""
    return "src-" + vllm_path.rsplit("/", 1)[-1].removesuffix(".py") + ".html"


def step_page(step: int) -> str:
    """Page name of a step: ``step-000012.html``."""
    return f"step-{step:06d}.html"


# --- syntax highlighting ---------------------------------------------------------

_TOKEN_CLASS = {tokenize.COMMENT: "cm", tokenize.STRING: "st", tokenize.NUMBER: "nu"}
for _name in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END"):
    if hasattr(tokenize, _name):
        _TOKEN_CLASS[getattr(tokenize, _name)] = "st"
_BUILTINS = frozenset({"self", "cls", "None", "True", "False", "torch", "tl", "triton"})


def highlight(text: str) -> list[list[Token]]:
    """Split ``text`` into lines of ``Token``s with Python's own tokenizer.

    A text that does not tokenize comes back as plain lines.
    """
    lines = text.splitlines()
    marks: list[list[tuple[int, int, str]]] = [[] for _ in lines]
    try:
        previous = ""
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            cls = _TOKEN_CLASS.get(tok.type, "")
            if tok.type == tokenize.NAME:
                if keyword.iskeyword(tok.string) or keyword.issoftkeyword(tok.string):
                    cls = "kw"
                elif previous in ("def", "class"):
                    cls = "fn"
                elif tok.string in _BUILTINS:
                    cls = "bi"
            if tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
                previous = tok.string
            if not cls:
                continue
            (srow, scol), (erow, ecol) = tok.start, tok.end
            for row in range(srow, erow + 1):
                if row - 1 >= len(lines):
                    break
                start = scol if row == srow else 0
                end = ecol if row == erow else len(lines[row - 1])
                marks[row - 1].append((start, end, cls))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return [[Token("", line)] for line in lines]
    out = []
    for line, spans in zip(lines, marks):
        tokens, col = [], 0
        for start, end, cls in sorted(spans):
            if start < col:
                continue
            if start > col:
                tokens.append(Token("", line[col:start]))
            tokens.append(Token(cls, line[start:end]))
            col = end
        if col < len(line):
            tokens.append(Token("", line[col:]))
        out.append(tokens)
    return out


# --- replay verdicts -------------------------------------------------------------


@dataclass(frozen=True)
class HeadVerdict:
    """One head's replay result."""

    head: int
    status: str  #: ``ok`` / ``fail`` / ``none``
    max_abs: str


@dataclass(frozen=True)
class LayerVerdict:
    """One (step, layer)'s replay result."""

    layer: str
    verdict: Verdict
    max_abs: str
    max_rel: str
    tol: str
    heads: tuple[HeadVerdict, ...]


@dataclass(frozen=True)
class ReplayData:
    """``replay.json``, read tolerantly."""

    present: bool
    overall: Verdict
    by_step: dict[int, list[dict[str, Any]]]  #: step -> its entries (dicts with at least ``step``)
    checks: tuple[Row, ...]  #: one row per extra section (``write_path``, ``legacy`` ...)
    problem: str = ""  #: why the file could not be used, if it could not


def _num(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "–"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _status(ok: Any) -> str:
    return "ok" if ok is True else "fail" if ok is False else "none"


def read_replay(trace: Trace) -> ReplayData:
    """Read ``replay.json`` if present; a missing or malformed file means "not replayed"."""
    none = Verdict("none", "not replayed")
    try:
        data = trace.read_json(REPLAY)
    except TraceError as exc:
        return ReplayData(False, none, {}, (), str(exc))
    if data is None:
        return ReplayData(False, none, {}, ())
    if not isinstance(data, dict):
        return ReplayData(False, none, {}, (), f"{REPLAY}: expected an object")
    by_step: dict[int, list[dict[str, Any]]] = {}
    steps = data.get("steps")
    for entry in steps if isinstance(steps, list) else []:
        if isinstance(entry, dict) and isinstance(entry.get("step"), int):
            by_step.setdefault(entry["step"], []).append(entry)
    checks = []
    for name, value in data.items():
        if name in ("ok", "steps") or not isinstance(value, list):
            continue
        oks = [e.get("ok") for e in value if isinstance(e, dict)]
        if not value:
            checks.append(Row(name, "none"))
        else:
            checks.append(Row(name, f"{sum(o is True for o in oks)} of {len(value)} ok"))
    ok = data.get("ok")
    overall = Verdict(_status(ok), {"ok": "all replayed steps agree", "fail": "some steps disagree"}.get(
        _status(ok), "no overall verdict"))
    return ReplayData(True, overall, by_step, tuple(checks))


def step_verdict(entries: list[dict[str, Any]]) -> Verdict:
    """Aggregate the (layer) entries of one step into one verdict."""
    if not entries:
        return Verdict("none", "not replayed")
    statuses = [_status(e.get("ok")) for e in entries]
    worst = max(entries, key=lambda e: e.get("max_abs") if isinstance(e.get("max_abs"), (int, float)) else -1)
    detail = f"max abs {_num(worst.get('max_abs'))}"
    if "fail" in statuses:
        bad_heads = sorted(
            {h.get("head") for e in entries for h in (e.get("heads") or []) if isinstance(h, dict) and h.get("ok") is False}
            - {None}
        )
        heads = f", heads {fmt_list(bad_heads, 8)}" if bad_heads else ""
        return Verdict("fail", f"FAIL ({detail}{heads})")
    if all(s == "ok" for s in statuses):
        return Verdict("ok", f"ok ({detail})")
    return Verdict("none", "no verdict")


def layer_verdicts(entries: list[dict[str, Any]]) -> tuple[LayerVerdict, ...]:
    """Per layer: verdict and per-head results, for a step page."""
    out = []
    for e in entries:
        heads = tuple(
            HeadVerdict(h["head"] if isinstance(h.get("head"), int) else i, _status(h.get("ok")), _num(h.get("max_abs")))
            for i, h in enumerate(e.get("heads") or [])
            if isinstance(h, dict)
        )
        out.append(
            LayerVerdict(
                str(e.get("layer", "")), step_verdict([e]), _num(e.get("max_abs")), _num(e.get("max_rel")),
                _num(e.get("tol")), heads,
            )
        )
    return tuple(out)


# --- KV-cache layout drawing -----------------------------------------------------


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
    return list(range(head)) + [None, n - 1]


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

    def block_rows(self, y: int, row_h: int, blocks: list[int | None],
                   groups_of: Callable[[int], list[tuple[str, list[tuple[str, str, int, str]]]]]) -> int:
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
        DimRow(i, _DIM_NAMES[i] if dims_n == 4 else f"dim {i}", spec.shape[i], spec.stride[i],
               spec.stride[i] * spec.element_size, ranks[i])
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
    if spec.layout in ("flash_nhd", "flash_hnd"):
        formulas = (
            f"K[b, t, h, :] = kv_cache[b, h, t, 0:{d}] at element b*{s0} + h*{s1} + t*{s2} + d*{s3}",
            f"V[b, t, h, :] = kv_cache[b, h, t, {d}:{2 * d}] at the same offset + {d * s3}",
        )
        nhd = spec.layout == "flash_nhd"
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
                    items.append((f"K {short}", "k", _BOX_W, f"K of block {b}, token {t}, head {hh}: elements {off}..{off + d * s3 - 1}"))
                    items.append((f"V {short}", "v", _BOX_W, f"V of block {b}, token {t}, head {hh}: elements {off + d * s3}..{off + 2 * d * s3 - 1}"))
                groups.append((f"{outer_name} {o}", items))
            return groups

        y = strip.block_rows(y, row_h, blocks, flash_groups)
        caption = (
            f"One row per block in memory order; within a block: {spec.physical_order}. "
            f"Each K or V box is {d} contiguous elements."
        )
    elif spec.layout == "cpu":
        formulas = (
            f"K^T[b, h][d][t] at element b*{s0} + h*{s1} + d*{bs} + t",
            f"V[b, h][t][d] at element b*{s0} + h*{s1} + {bs * d} + t*{d} + d",
        )

        def cpu_groups(b: int) -> list:
            groups = []
            for hh in _pick(h):
                if hh is None:
                    groups.append(("", [_gap("more heads")]))
                    continue
                off = b * s0 + hh * s1
                groups.append((f"head {hh}", [
                    (f"K^T [{d}][{bs}]", "k", 3 * _BOX_W, f"K transposed of block {b}, head {hh}: elements {off}..{off + bs * d - 1}"),
                    (f"V [{bs}][{d}]", "v", 3 * _BOX_W, f"V of block {b}, head {hh}: elements {off + bs * d}..{off + 2 * bs * d - 1}"),
                ]))
            return groups

        y = strip.block_rows(y, row_h, blocks, cpu_groups)
        caption = "One row per block; per (block, head) the CPU kernel stores K transposed, then V."
    elif spec.layout == "cpu_amx":
        formulas = _amx_formulas(spec)
        described = describe_amx(spec)
        if described is None:
            return LayoutView(spec.layout, spec.physical_order, summary, dims, formulas, (), 0, 0, (
                f"Per (block, head) region of {2 * bs * d} elements: K packed as [bs/16][D/2][16][2] = "
                f"[{bs // 16}][{d // 2}][16][2] (token tile, dim pair, token, dim in pair), then V as "
                f"[D/16][bs/2][16][2] = [{d // 16}][{bs // 2}][16][2] (dim tile, token pair, dim, token in pair): "
                "pairs of bf16 side by side for the AMX tile loads. (No drawing: reference_impl.layouts, which "
                "needs torch, could not be imported when this report was built.)"))
        y = _amx_rows(strip, spec, described, blocks, y, row_h)
        caption = (
            f"One row per block; per (block, head) the AMX kernel packs K in {bs // 16} token tile(s) of 16 tokens "
            f"x {d} dims, then V in {d // 16} dim tile(s) of 16 dims x {bs} tokens. Inside a tile, elements go in "
            "pairs (two dims of one token for K, two tokens of one dim for V), 16 pairs per row: the last row "
            "shows the first elements of block 0, head 0 in memory order. Offsets from "
            "reference_impl.layouts.describe_layout / element_offset."
        )
    else:
        return LayoutView(spec.layout, spec.physical_order, summary, dims, (), (), 0, 0, f"no drawing for layout {spec.layout!r}")
    return LayoutView(spec.layout, spec.physical_order, summary, dims, formulas, tuple(strip.boxes),
                      strip.width + 4, y, caption)


def _amx_formulas(spec: KVCacheSpec) -> tuple[str, ...]:
    """Element offsets of K[b, t, h, d] and V[b, t, h, d] in the AMX packing (plain arithmetic, no torch)."""
    s0, s1 = spec.stride[0], spec.stride[1]
    bs, d = spec.block_size, spec.head_size
    return (
        f"K[b, t, h, d] at element b*{s0} + h*{s1} + (t//16)*{16 * d} + (d//2)*32 + (t%16)*2 + d%2",
        f"V[b, t, h, d] at element b*{s0} + h*{s1} + {bs * d} + (d//16)*{16 * bs} + (t//2)*32 + (d%16)*2 + t%2",
    )


def describe_amx(spec: KVCacheSpec) -> tuple[Any, Any] | None:
    """``(reference_impl.layouts, its describe_layout(...) for spec)``, or None without torch.

    The reference layouts module imports torch; a report must build without it, so the
    import happens here, at build time, and only for the layout that needs it.
    """
    try:
        layouts = importlib.import_module("reference_impl.layouts")
    except ImportError:
        return None
    try:
        desc = layouts.describe_layout(spec.layout, spec.num_blocks, spec.num_kv_heads, spec.block_size,
                                       spec.head_size, spec.element_size)
    except ValueError:
        return None
    return layouts, desc


def _unravel(offset: int, view: Any) -> dict[str, int]:
    """``token`` / ``dim`` at ``offset`` elements into one (block, head) region half of ``view``.

    The view's inner dims (after block and head) are contiguous in memory order and
    named ``token // 16``, ``dim % 2`` ...; unravelling ``offset`` and summing the parts
    gives the logical token and dim.
    """
    out = {"token": 0, "dim": 0}
    rest = offset
    sizes = view.shape[2:]
    for name, size in zip(reversed(view.dims[2:]), reversed(sizes)):
        rest, i = divmod(rest, size)
        var, _, tail = name.partition(" ")
        if tail.startswith("//"):
            out[var] += i * int(tail.split()[-1])
        else:
            out[var] += i
    return out


def _amx_rows(strip: _Strip, spec: KVCacheSpec, described: Any, blocks: list[int | None], y: int, row_h: int) -> int:
    """Draw the AMX packing: tiles per (block, head), then block 0 / head 0's first elements."""
    layouts, desc = described
    bs, d, h = spec.block_size, spec.head_size, spec.num_kv_heads
    k_view, v_view = desc.k_view, desc.v_view

    def offset(b: int, hh: int, t: int, dim: int, which: str) -> int:
        return layouts.element_offset(spec.layout, b, hh, t, dim, which, num_kv_heads=h, block_size=bs,
                                      head_size=d, element_size=spec.element_size)

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
                items.append((f"K t{16 * tile}–{16 * tile + 15}", "k", 2 * _BOX_W,
                              f"K of block {b}, head {hh}, tokens {16 * tile}–{16 * tile + 15}: [{d // 2}][16][2] "
                              f"(dim pair, token, dim in pair), elements {first}..{first + 16 * d - 1}"))
            for tile in _pick(d // 16):
                if tile is None:
                    items.append(_gap("more dim tiles"))
                    continue
                first = offset(b, hh, 0, 16 * tile, "v")
                items.append((f"V d{16 * tile}–{16 * tile + 15}", "v", 2 * _BOX_W,
                              f"V of block {b}, head {hh}, dims {16 * tile}–{16 * tile + 15}: [{bs // 2}][16][2] "
                              f"(token pair, dim, token in pair), elements {first}..{first + 16 * bs - 1}"))
            groups.append((f"head {hh}", items))
        return groups

    y = strip.block_rows(y, row_h, blocks, amx_groups)
    # The packing inside a tile: the first 6 and the 33rd..36th elements of each half, in memory order.
    zoom = []
    for which, view, cls, name in (("k", k_view, "k", "K"), ("v", v_view, "v", "V")):
        items = []
        for local in [0, 1, 2, 3, 4, 5, None, 30, 31, 32, 33]:
            if local is None:
                items.append(_gap("…"))
                continue
            pos = _unravel(local, view)
            at = offset(0, 0, pos["token"], pos["dim"], which)
            items.append((f"t{pos['token']} d{pos['dim']}", cls, _BOX_W + 8,
                          f"{name}[token {pos['token']}, dim {pos['dim']}] of block 0, head 0 at element {at}"))
        zoom.append((f"{name} half of block 0, head 0: first elements in memory", items))
    strip.row(y, "in a tile", zoom)
    return y + row_h


# --- index page ------------------------------------------------------------------


@dataclass(frozen=True)
class StepRow:
    """One line of the index's step list: a recorded step or a gap."""

    step: int
    kind: str
    recorded: bool  #: False for a gap
    layers: int
    num_reqs: str
    num_tokens: str
    query_lens: str
    seq_lens: str
    verdict: Verdict
    href: str  #: step page, "" when none was written
    label: str  #: the step number, or a range of consecutive gap steps with one reason (``1–12``)
    count: int = 1  #: steps the row stands for (more than 1 for a run of gaps)


@dataclass(frozen=True)
class GapGroup:
    """Steps the tracer knows about but could not record, for one (kind, reason)."""

    kind: str
    reason: str
    steps: str  #: e.g. ``1–12`` or ``14, 16, 18``
    count: int
    tokens: str  #: tokens per step: ``4 each`` or a list
    explanation: str  #: why such steps are not recorded, and what would record them ("" if unknown)


#: Why gaps happen, by the part of the tracer's reason before the first colon.
GAP_EXPLANATIONS = {
    "profile run": "vLLM's memory-profiling and warm-up forward passes run without attention metadata "
    "(attn_metadata is None): attention is skipped, so there is nothing to record.",
    "cuda-graph-capture": "vLLM was capturing CUDA graphs for these batch sizes, and the hook copies nothing "
    "while a graph is being captured. These are warm-up batches, not requests.",
    "cuda-graph-replay": "These steps replayed a captured CUDA graph (cudagraph_mode {mode}): attention ran "
    "inside the graph on the device and the Python forward() that the hook wraps was never called. {advice}",
}
#: How to record replayed steps: with FULL graphs, PIECEWISE keeps attention outside the graphs.
_REPLAY_ADVICE = {
    True: "Trace with enforce_eager, or cudagraph_mode PIECEWISE (attention stays outside the graphs), to record them.",
    False: "Trace with enforce_eager to record them.",
}


def steps_text(steps: list[int]) -> str:
    """Sorted step numbers as ranges: ``[1, 2, 3, 5]`` -> ``1–3, 5``."""
    parts: list[str] = []
    start = prev = None
    for s in steps:
        if prev is not None and s == prev + 1:
            prev = s
            continue
        if start is not None:
            parts.append(_range_text(start, prev))
        start = prev = s
    if start is not None:
        parts.append(_range_text(start, prev))
    return ", ".join(parts)


def _tokens_text(tokens: list[int]) -> str:
    if not any(tokens):
        return "–"
    if len(set(tokens)) == 1:
        return f"{tokens[0]}" if len(tokens) == 1 else f"{tokens[0]} each"
    return fmt_list(tokens, 16)


def gap_groups(gaps: list[Any], cudagraph_mode: str) -> tuple[GapGroup, ...]:
    """Group ``GapRecord``s by (kind, reason), in order of their first step."""
    groups: dict[tuple[str, str], list[Any]] = {}
    for g in sorted(gaps, key=lambda g: g.step):
        groups.setdefault((g.kind, g.reason), []).append(g)
    out = []
    for (kind, reason), members in groups.items():
        explanation = GAP_EXPLANATIONS.get(reason.split(":", 1)[0].strip(), "")
        out.append(GapGroup(kind, reason, steps_text([g.step for g in members]), len(members),
                            _tokens_text([g.num_tokens for g in members]),
                            explanation.format(mode=cudagraph_mode, advice=_REPLAY_ADVICE["FULL" in cudagraph_mode])))
    return tuple(out)


def _gap_rows(gaps: list[Any]) -> list[StepRow]:
    """Step-list rows for gaps: consecutive steps with the same kind and reason share one row."""
    runs: list[list[Any]] = []
    for g in sorted(gaps, key=lambda g: g.step):
        last = runs[-1][-1] if runs else None
        if last is not None and g.step == last.step + 1 and (g.kind, g.reason) == (last.kind, last.reason):
            runs[-1].append(g)
        else:
            runs.append([g])
    rows = []
    for run in runs:
        tokens = [g.num_tokens for g in run]
        text = "" if not any(tokens) else _tokens_text(tokens)
        label = _range_text(run[0].step, run[-1].step)
        rows.append(StepRow(run[0].step, run[0].kind, False, 0, "", text, "", "",
                            Verdict("none", run[0].reason), "", label, len(run)))
    return rows


@dataclass(frozen=True)
class FileRow:
    """One annotated source file on the index."""

    name: str
    vllm_path: str
    href: str  #: "" when the trace has no copy of the file
    role: str
    anchors: str  #: ``12 of 12 anchors found``
    on_path: bool  #: the traced run executed this file's code


@dataclass(frozen=True)
class IndexPage:
    """``index.html``."""

    title: str
    summary: tuple[Row, ...]
    kv_rows: tuple[Row, ...]
    layout: LayoutView | None
    steps: tuple[StepRow, ...]
    gaps: tuple[GapGroup, ...]
    files: tuple[FileRow, ...]
    replay: Verdict
    replay_checks: tuple[Row, ...]
    problems: tuple[str, ...]
    pages_note: str  #: how many steps got a page, when not all did


def _short(values: tuple[int, ...], limit: int = 6) -> str:
    return fmt_list(values, limit)


def _summary_rows(trace: Trace) -> tuple[Row, ...]:
    run = trace.run
    rows = []
    if run.model is not None:
        m = run.model
        rows += [
            Row("model", m.name),
            Row("architecture", ", ".join(m.architectures)),
            Row("shape", f"{m.num_layers} layers, {m.num_attention_heads} query heads, {m.num_kv_heads} KV heads, "
                         f"head size {m.head_size}, hidden {m.hidden_size}"),
            Row("dtype / weights", f"{m.dtype} / {m.weights}"),
        ]
    rows += [
        Row("device", f"{run.device} ({run.device_name}), {run.platform}"),
        Row("attention backend", run.attention_backend),
        Row("FlashAttention version", f"FA{run.flash_attn_version}" if run.flash_attn_version else "none"),
        Row("CUDA graphs", f"{run.cudagraph_mode}{' (enforce_eager)' if run.enforce_eager else ''}"),
        Row("versions", f"vLLM {run.vllm_version}, torch {run.torch_version}, pagedtrace {run.pagedtrace_version}"),
        Row("layers traced", f"{len(trace.layers)}: {', '.join(trace.layers[:4])}{' …' if len(trace.layers) > 4 else ''}"),
        Row("recorded", f"{len({r.step for r in trace.records})} steps ({len(trace.records)} layer records), "
                        f"{len(trace.gaps)} gap{'' if len(trace.gaps) == 1 else 's'}"),
        Row("created", run.created_at),
        Row("trace", str(trace.path)),
    ]
    return tuple(rows)


def _kv_rows(spec: KVCacheSpec | None) -> tuple[Row, ...]:
    if spec is None:
        return (Row("KV cache", "not in this trace"),)
    return (
        Row("blocks x block size", f"{spec.num_blocks} x {spec.block_size} tokens"),
        Row("KV heads x head size", f"{spec.num_kv_heads} x {spec.head_size}"),
        Row("dtype", f"{spec.dtype} ({spec.element_size} B), kv_cache_dtype={spec.cache_dtype}, "
                     f"k_scale={spec.k_scale:g}, v_scale={spec.v_scale:g}"),
        Row("logical shape", str(tuple(spec.shape))),
        Row("strides", str(tuple(spec.stride))),
        Row("backend shape / stride order", f"{tuple(spec.backend_kv_cache_shape)} / "
                                            f"{tuple(spec.backend_stride_order) if spec.backend_stride_order else 'none'}"),
        Row("layout", f"{spec.layout}: {spec.physical_order}"),
        Row("layers sharing it", str(len(spec.layer_names))),
    )


def pages_for_steps(records: list[StepRecord], max_request_pages: int = MAX_REQUEST_PAGES) -> set[int]:
    """Which steps get a page: the first ``max_request_pages`` request steps, then the first few others."""
    steps: dict[int, str] = {}
    for r in records:
        steps.setdefault(r.step, r.kind)
    request = [s for s, k in sorted(steps.items()) if k == "request"][:max_request_pages]
    other = [s for s, k in sorted(steps.items()) if k != "request"][:MAX_OTHER_PAGES]
    return set(request) | set(other)


def first_records(trace: Trace) -> list[StepRecord]:
    """One record per step (the first layer's, else whatever layer recorded it), by step."""
    by_step: dict[int, StepRecord] = {}
    primary = trace.layers[0] if trace.layers else None
    for r in trace.records:
        if r.step not in by_step or (r.layer == primary and by_step[r.step].layer != primary):
            by_step[r.step] = r
    return [by_step[s] for s in sorted(by_step)]


def index_page(trace: Trace, replay: ReplayData, located: dict[str, LocatedSource], paged: set[int]) -> IndexPage:
    """The index: run summary, KV layout, steps and gaps, files."""
    run = trace.run
    layers_per_step: dict[int, int] = {}
    for r in trace.records:
        layers_per_step[r.step] = layers_per_step.get(r.step, 0) + 1
    rows: list[StepRow] = []
    for r in first_records(trace):
        rows.append(StepRow(
            r.step, r.kind, True, layers_per_step[r.step], str(r.num_reqs), str(r.num_actual_tokens),
            _short(r.query_lens), _short(r.seq_lens), step_verdict(replay.by_step.get(r.step, [])),
            step_page(r.step) if r.step in paged else "", str(r.step),
        ))
    rows += _gap_rows(list(trace.gaps))
    rows.sort(key=lambda row: (row.step, not row.recorded))
    files = []
    for path in ANNOTATED_FILES:
        loc = located.get(path)
        name = path.rsplit("/", 1)[-1]
        if loc is None:
            files.append(FileRow(name, path, "", file_role(path, run), "source not stored in this trace",
                                 on_path(path, run)))
            continue
        found = sum(1 for x in loc.locations.values() if x.found)
        files.append(FileRow(name, path, source_file_page(path), file_role(path, run),
                             f"{found} of {len(loc.locations)} anchors found", on_path(path, run)))
    model = run.model.name if run.model else "unknown model"
    overall = replay.overall
    if not replay.present and not any(r.tensors for r in trace.records):
        overall = Verdict("none", "not replayable: recorded without tensors")
    problems = tuple(trace.problems) + ((replay.problem,) if replay.problem else ())
    recorded = [row for row in rows if row.recorded]
    without = sum(1 for row in recorded if not row.href)
    pages_note = (
        f"{len(recorded) - without} of {len(recorded)} recorded steps have a page (the first request steps, "
        "and the first few others); `pagedtrace report --max-step-pages N` writes more." if without else ""
    )
    return IndexPage(
        title=f"pagedtrace: {model}",
        summary=_summary_rows(trace),
        kv_rows=_kv_rows(run.kv_cache),
        layout=layout_view(run.kv_cache),
        steps=tuple(rows),
        gaps=gap_groups(list(trace.gaps), run.cudagraph_mode),
        files=tuple(files),
        replay=overall,
        replay_checks=replay.checks,
        problems=problems,
        pages_note=pages_note,
    )


# --- source pages ----------------------------------------------------------------


@dataclass(frozen=True)
class LineNote:
    """A value shown beside a line (for the page's default step; ``text`` is "" when there is none)."""

    key: str
    label: str
    text: str
    kind: str


@dataclass(frozen=True)
class SourceLine:
    """One line of an annotated source page."""

    number: int
    tokens: tuple[Token, ...]
    notes: tuple[LineNote, ...]


@dataclass(frozen=True)
class StepOption:
    """One entry of the step selector."""

    step: int
    label: str
    selected: bool


@dataclass(frozen=True)
class SourcePage:
    """``src-<name>.html``: a coverage-style annotated source."""

    name: str
    vllm_path: str
    file_notes: tuple[str, ...]
    layer: str
    other_layers: int
    lines: tuple[SourceLine, ...]
    anchors: tuple[Link, ...]  #: jump list, ``#line-N`` links
    missing: tuple[Row, ...]  #: anchors not found: label, reason
    options: tuple[StepOption, ...]
    data: dict[str, Any]  #: embedded as JSON for the step selector and line panel
    nav: tuple[Link, ...]


def source_page(trace: Trace, vllm_path: str, text: str, located: LocatedSource, records: list[StepRecord],
                default: StepRecord | None, nav: tuple[Link, ...]) -> SourcePage:
    """One annotated source, with every anchor's value at every recorded step."""
    run = trace.run
    texts: dict[tuple[str, str], int] = {}

    def intern(value) -> int:
        if value is None:
            return -1
        return texts.setdefault((value.text, value.kind), len(texts))

    anchors_data = []
    default_notes: dict[int, list[LineNote]] = {}
    for key, loc in located.locations.items():
        if not loc.found:
            continue
        anchor = loc.anchor
        static = value_for(anchor, None, run)
        entry: dict[str, Any] = {"key": key, "label": anchor.label, "line": loc.line}
        if static is not None:
            entry["value"] = intern(static)
            shown = static
        else:
            entry["steps"] = [intern(value_for(anchor, r, run)) for r in records]
            shown = value_for(anchor, default, run) if default is not None else None
        anchors_data.append(entry)
        note = LineNote(key, anchor.label, shown.text, shown.kind) if shown else LineNote(key, anchor.label, "", "static")
        default_notes.setdefault(loc.line, []).append(note)
    lines = tuple(
        SourceLine(i, tuple(tokens), tuple(default_notes.get(i, ())))
        for i, tokens in enumerate(highlight(text), 1)
    )
    anchors = tuple(
        Link(f"#line-{loc.line}", f"{loc.line}: {loc.anchor.label}")
        for loc in sorted(located.locations.values(), key=lambda x: x.line or 0)
        if loc.found
    )
    missing = tuple(Row(loc.anchor.label, loc.reason) for loc in located.missing)
    options = tuple(
        StepOption(r.step, f"step {r.step} ({r.kind}, {r.num_reqs} req, {r.num_actual_tokens} tok)",
                   default is not None and r.step == default.step)
        for r in records
    )
    data = {
        "steps": [r.step for r in records],
        "kinds": [r.kind for r in records],
        "default": default.step if default is not None else None,
        "texts": [[t, k] for (t, k) in texts],
        "anchors": anchors_data,
    }
    layer = records[0].layer if records else ""
    return SourcePage(
        name=vllm_path.rsplit("/", 1)[-1],
        vllm_path=vllm_path,
        file_notes=file_notes(vllm_path, run, located.sha256),
        layer=layer,
        other_layers=max(0, len(trace.layers) - 1),
        lines=lines,
        anchors=anchors,
        missing=missing,
        options=options,
        data=data,
        nav=nav,
    )


# --- step pages ------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """Part of a block's slot bar: ``old`` (cached before this step) or ``new`` (written now)."""

    cls: str
    left: str  #: percent, formatted
    width: str


@dataclass(frozen=True)
class BlockCell:
    """One block-table cell: a physical block in one request's row."""

    block: int  #: physical block id
    index: int  #: logical block index in the row
    shared: bool  #: the block id appears in more than one row
    written: bool  #: slot_mapping writes into it this step
    full: bool  #: every slot was cached before this step (drawn without segments)
    segments: tuple[Segment, ...]  #: the slot bar, when not ``full``
    title: str


@dataclass(frozen=True)
class RequestRow:
    """One block-table row."""

    index: int
    request_id: str
    query_len: int
    seq_len: int
    context_len: int
    cells: tuple[BlockCell, ...]
    elided: int  #: cells left out in the middle of a long row
    elide_at: int  #: index into ``cells`` where the elision mark goes (-1: none)


@dataclass(frozen=True)
class SlotRun:
    """Consecutive tokens of one request written to consecutive offsets of one block."""

    request: int
    tokens: str  #: token indices in the step, e.g. ``0–15``
    positions: str
    block: int
    offsets: str
    slots: str


@dataclass(frozen=True)
class StepPage:
    """``step-NNNNNN.html``."""

    step: int
    kind: str
    layers: tuple[str, ...]
    facts: tuple[Row, ...]
    block_size: int
    rows: tuple[RequestRow, ...]
    rows_elided: int  #: block-table rows left out (more than ``MAX_ROWS``)
    shared_blocks: str
    written_blocks: str
    slot_runs: tuple[SlotRun, ...]
    slot_runs_elided: int
    padding: int  #: slot_mapping entries equal to -1
    verdict: Verdict
    verdicts: tuple[LayerVerdict, ...]
    prev: Link | None
    next: Link | None
    nav: tuple[Link, ...]
    replay_note: str = ""  #: shown when there are no verdicts: how to get them, or why there can be none


def _range_text(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}–{hi}"


def slot_runs(record: StepRecord, block_size: int) -> list[SlotRun]:
    """Group the step's slot_mapping into runs of one request, one block, consecutive offsets."""
    runs: list[SlotRun] = []
    positions = [p for s, q in zip(record.seq_lens, record.query_lens) for p in range(s - q, s)]
    owner = [i for i, q in enumerate(record.query_lens) for _ in range(q)]
    current: list[int] = []

    def flush() -> None:
        if not current:
            return
        first, last = current[0], current[-1]
        slot0, slot1 = record.slot_mapping[first], record.slot_mapping[last]
        runs.append(SlotRun(
            owner[first] if first < len(owner) else -1,
            _range_text(first, last),
            _range_text(positions[first], positions[last]) if last < len(positions) else "?",
            slot0 // block_size,
            _range_text(slot0 % block_size, slot1 % block_size),
            _range_text(slot0, slot1),
        ))
        current.clear()

    for t, slot in enumerate(record.slot_mapping):
        if slot < 0:
            flush()
            continue
        if current:
            prev = record.slot_mapping[current[-1]]
            same_owner = t < len(owner) and current[-1] < len(owner) and owner[t] == owner[current[-1]]
            if not (slot == prev + 1 and slot // block_size == prev // block_size and same_owner):
                flush()
        current.append(t)
    flush()
    return runs


def _pct(value: float) -> str:
    return f"{value:.2f}".rstrip("0").rstrip(".")


_NO_OFFSETS: frozenset[int] = frozenset()


def _cell(block: int, index: int, bs: int, shared: bool, written_offsets: dict[int, set[int]],
          seq_len: int, context_len: int) -> BlockCell:
    before = max(0, min(bs, context_len - index * bs))
    after = max(0, min(bs, seq_len - index * bs))
    offsets = written_offsets.get(block, _NO_OFFSETS)
    title = f"block {block}, logical block {index}: {after}/{bs} slots used"
    if shared:
        title += ", shared"
    if offsets:
        title += f", offsets {_range_text(min(offsets), max(offsets))} written this step"
    if before == bs and not offsets:
        return BlockCell(block, index, shared, False, True, (), title)
    segments = []
    if before:
        segments.append(Segment("old", "0", _pct(100 * before / bs)))
    if after > before:
        segments.append(Segment("new", _pct(100 * before / bs), _pct(100 * (after - before) / bs)))
    return BlockCell(block, index, shared, bool(offsets), False, tuple(segments), title)


def step_view(record: StepRecord, run: RunInfo, layers: tuple[str, ...], replay_entries: list[dict[str, Any]],
              prev: int | None, next_: int | None, nav: tuple[Link, ...]) -> StepPage:
    """One step: block-table grid, slot mapping drawn onto blocks, lengths, replay verdicts."""
    bs = run.kv_cache.block_size if run.kv_cache else 16
    shared_set = record.shared_blocks
    written_offsets: dict[int, set[int]] = {}
    for slot in record.slot_mapping:
        if slot >= 0:
            written_offsets.setdefault(slot // bs, set()).add(slot % bs)
    rows = []
    query_lens = record.query_lens
    for i, table_row in enumerate(record.block_table[:MAX_ROWS]):
        seq_len = record.seq_lens[i] if i < len(record.seq_lens) else 0
        q = query_lens[i] if i < len(query_lens) else 0
        indices = list(range(len(table_row)))
        elided = 0
        if len(indices) > MAX_ROW_CELLS:
            tail = MAX_ROW_CELLS - HEAD_CELLS
            elided = len(indices) - MAX_ROW_CELLS
            indices = indices[:HEAD_CELLS] + indices[-tail:]
        cells = tuple(
            _cell(table_row[j], j, bs, table_row[j] in shared_set, written_offsets, seq_len, seq_len - q)
            for j in indices
        )
        rid = record.request_ids[i] if i < len(record.request_ids) else ""
        rows.append(RequestRow(i, rid, q, seq_len, seq_len - q, cells, elided, HEAD_CELLS if elided else -1))
    runs = slot_runs(record, bs)
    shared = sorted(shared_set)
    facts = (
        Row("layer records", f"{len(layers)}: {', '.join(layers[:3])}{' …' if len(layers) > 3 else ''}"),
        Row("num_actual_tokens", str(record.num_actual_tokens)),
        Row("query_start_loc", fmt_list(record.query_start_loc, 32)),
        Row("query lens", fmt_list(record.query_lens, 32)),
        Row("seq_lens", fmt_list(record.seq_lens, 32)),
        Row("max_query_len / max_seq_len", f"{record.max_query_len} / {record.max_seq_len}"),
        Row("causal / window / softcap", f"{record.causal} / {record.sliding_window} / {record.logits_soft_cap:g}"),
        Row("scale / num_splits / cascade", f"{record.scale:.6g} / {record.num_splits} / {record.use_cascade}"),
        Row("heads (q / kv) x D", f"{record.num_heads} / {record.num_kv_heads} x {record.head_size}"),
    )
    return StepPage(
        step=record.step,
        kind=record.kind,
        layers=layers,
        facts=facts,
        block_size=bs,
        rows=tuple(rows),
        rows_elided=max(0, len(record.block_table) - MAX_ROWS),
        shared_blocks=fmt_list(shared, 32) if shared else "none",
        written_blocks=fmt_list(sorted(written_offsets), 32) if written_offsets else "none",
        slot_runs=tuple(runs[:MAX_SLOT_RUNS]),
        slot_runs_elided=max(0, len(runs) - MAX_SLOT_RUNS),
        padding=sum(1 for s in record.slot_mapping if s < 0),
        verdict=step_verdict(replay_entries),
        verdicts=layer_verdicts(replay_entries),
        prev=Link(step_page(prev), f"step {prev}") if prev is not None else None,
        next=Link(step_page(next_), f"step {next_}") if next_ is not None else None,
        nav=nav,
        replay_note=NO_TENSORS_NOTE if record.tensors is None else "Not replayed (run pagedtrace replay on the trace).",
    )


#: Why a step without captured tensors has no replay verdict.
NO_TENSORS_NOTE = (
    "Not replayable: no tensors were captured for this step (the trace was recorded with --no-tensors, "
    "or the tensor budget was used up), so there is nothing to recompute attention from."
)


# --- guided tour -----------------------------------------------------------------


@dataclass(frozen=True)
class CodeLine:
    """One line of a ``CodeBlock``."""

    number: int  #: 1-based line number in the original file
    tokens: tuple[Token, ...]
    marked: bool  #: highlighted as part of the stop's subject


@dataclass(frozen=True)
class CodeBlock:
    """A titled piece of source, highlighted."""

    title: str
    origin: str
    lines: tuple[CodeLine, ...]


#: Lines of the reference kernel marked at the block-loop stop (regular expressions) ...
BLOCK_LOOP_MARKS = (r"^\s*for j in range", r"block_table\[", r"\bn_valid =", r"\bk_pos =", r"(key|value)_cache\[")
#: ... and at the online-softmax stop, which shows the lines from ``SOFTMAX_FIRST`` to ``SOFTMAX_LAST``.
SOFTMAX_MARKS = (r"^\s*m_new =", r"^\s*rescale =", r"^\s*l = ", r"^\s*acc = ", r"^\s*m = ", r"acc / l")
SOFTMAX_FIRST, SOFTMAX_LAST = "Online-softmax", "acc / l"


def code_block(title: str, origin: str, text: str, start: int, marks: tuple[str, ...],
               first: str | None = None, last: str | None = None) -> CodeBlock | None:
    """Highlight ``text`` (starting at line ``start``); mark lines matching any regex in ``marks``.

    With ``first``/``last``, keep only the lines from the first containing ``first``
    through the next containing ``last``; None when they are not found.
    """
    lines = list(enumerate(highlight(text), start))
    raw = text.splitlines()
    if first is not None and last is not None:
        lo = next((i for i, line in enumerate(raw) if first in line), None)
        hi = next((i for i, line in enumerate(raw) if last in line and lo is not None and i >= lo), None)
        if lo is None or hi is None:
            return None
        lines, raw = lines[lo : hi + 1], raw[lo : hi + 1]
    return CodeBlock(title, origin, tuple(
        CodeLine(number, tuple(tokens), any(re.search(m, line) for m in marks)) for (number, tokens), line in zip(lines, raw)
    ))


@dataclass(frozen=True)
class TourStop:
    """One stop of the reading checklist."""

    id: str
    title: str
    paragraphs: tuple[str, ...]
    links: tuple[Link, ...]
    code: CodeBlock | None = None


@dataclass(frozen=True)
class TourPage:
    """``tour.html``: layout -> write path -> block loop -> online softmax -> what runs."""

    stops: tuple[TourStop, ...]
    nav: tuple[Link, ...]


#: Module and function of the readable reference kernel (another package; read as text, never imported).
REFERENCE_MODULE = "reference_impl.kernel"
REFERENCE_FUNCTION = "paged_attention_loop"


def load_reference_source() -> tuple[str, str, int] | None:
    """``(origin, function source, first line)`` of the reference block-loop kernel, or None.

    The module is located, not imported: it imports torch, and a report must
    build without torch.
    """
    package, _, module = REFERENCE_MODULE.partition(".")
    try:
        # find_spec of a top-level name does not run the package (which imports torch).
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    file = Path(next(iter(spec.submodule_search_locations))) / f"{module}.py"
    if not file.is_file():
        return None
    text = file.read_text(encoding="utf-8")
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == REFERENCE_FUNCTION:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            lines = text.splitlines()[start - 1 : node.end_lineno]
            return f"{REFERENCE_MODULE}.{REFERENCE_FUNCTION}", "\n".join(lines), start
    return None


def _anchor_link(located: dict[str, LocatedSource], path: str, key: str, text: str) -> Link | None:
    loc = located.get(path)
    if loc is None or key not in loc.locations or not loc.locations[key].found:
        return None
    return Link(f"{source_file_page(path)}#line-{loc.locations[key].line}", text)


def tour_page(trace: Trace, located: dict[str, LocatedSource], paged: set[int],
              reference: tuple[str, str, int] | None, nav: tuple[Link, ...]) -> TourPage:
    """The guided tour following the reading checklist, linked into the other pages."""
    from annotations.anchors import ATTENTION, BLOCK_TABLE, CPU_ATTN, FLASH_ATTN, PAGED_ATTN

    run = trace.run
    spec = run.kv_cache
    on_cpu = "CPUAttention" in run.attention_backend
    backend_file = CPU_ATTN if on_cpu else FLASH_ATTN
    request_pages = sorted(s for s in paged if any(r.step == s and r.kind == "request" for r in trace.records))
    step_link = (Link(step_page(request_pages[0]), f"step {request_pages[0]}: block table and slots"),) if request_pages else ()

    def links(*items: tuple[str, str, str]) -> tuple[Link, ...]:
        out = []
        for path, key, text in items:
            link = _anchor_link(located, path, key, text)
            if link is not None:
                out.append(link)
        return tuple(out)

    layout_text = (
        f"This run's cache: {tuple(spec.shape)} with strides {tuple(spec.stride)}, layout {spec.layout}: "
        f"{spec.physical_order}." if spec else "This trace has no KV-cache spec."
    )
    loop_code = softmax_code = None
    if reference is not None:
        origin, src, start = reference
        loop_code = code_block(origin, "reference_impl/kernel.py", src, start, BLOCK_LOOP_MARKS)
        softmax_code = code_block(f"{origin}: the online-softmax lines", "reference_impl/kernel.py", src, start,
                                  SOFTMAX_MARKS, SOFTMAX_FIRST, SOFTMAX_LAST)
    stops = (
        TourStop("layout", "1. Layout", (
            "Every attention layer owns one kv_cache tensor of logical shape (num_blocks, num_kv_heads, "
            "block_size, 2*head_size): K and V are packed into the last dimension. The backend's stride order "
            "decides the physical order; FlashAttention views it as key_cache/value_cache of shape "
            "(num_blocks, block_size, num_kv_heads, head_size) with transpose(1, 2).split(head_size, -1).",
            layout_text,
        ), (Link(f"{INDEX_PAGE}#layout", "the drawn layout"),) + links(
            (FLASH_ATTN, "flash_attn.get_kv_cache_shape", "FlashAttentionBackend.get_kv_cache_shape"),
            (FLASH_ATTN, "flash_attn.get_kv_cache_stride_order", "get_kv_cache_stride_order"),
            (FLASH_ATTN, "flash_attn.forward.split", "forward: transpose(1, 2).split(...)"),
            (CPU_ATTN, "cpu_attn.forward.view", "CPU: view(nb, H, 2*bs, D)"),
            (CPU_ATTN, "cpu_attn.forward.chunk", "CPU: chunk(2, dim=2)"),
        )),
        TourStop("write", "2. Write path: slot_mapping and reshape_and_cache", (
            "Before attention reads anything, the new tokens' K and V are scattered into the cache. The worker "
            "computes one slot per new token: slot = block_table[req, pos // block_size] * block_size + "
            "pos % block_size. unified_kv_cache_update hands it to the backend's do_kv_cache_update, which calls "
            "reshape_and_cache_flash (CPU: cpu_attn_reshape_and_cache).",
        ), links(
            (BLOCK_TABLE, "block_table.compute_slot_mapping.launch", "BlockTable.compute_slot_mapping"),
            (BLOCK_TABLE, "block_table.kernel.slot_ids", "the slot formula in _compute_slot_mapping_kernel"),
            (ATTENTION, "attention.unified_kv_cache_update.call", "unified_kv_cache_update"),
            (backend_file, "flash_attn.do_kv_cache_update.reshape_and_cache_flash" if not on_cpu
             else "cpu_attn.do_kv_cache_update.reshape_and_cache", "the backend's write"),
        ) + step_link),
        TourStop("blocks", "3. Block loop", (
            "Reading is the same walk in reverse: for each request, key j lives in block block_table[req, j // "
            "block_size] at offset j % block_size. The reference kernel spells the loop out block by block; the "
            "real kernels do the same walk in tiles.",
        ), links(
            (FLASH_ATTN, "flash_attn.forward.block_table", "forward: block_table"),
            (FLASH_ATTN, "flash_attn.forward.seqused_k", "forward: seqused_k = seq_lens"),
        ) + step_link, loop_code),
        TourStop("softmax", "4. Online softmax", (
            "Scores are never held for the whole sequence: per block, the running maximum m and denominator l "
            "are updated and the accumulator is rescaled by exp(m_old - m_new) before the block's values are "
            "added; the output is acc / l at the end.",
        ) + (() if loop_code else
             ("The reference kernel (reference_impl.kernel.paged_attention_loop) was not available when this "
              "report was built.",)), (), softmax_code),
        TourStop("runs", "5. What actually runs", (
            (f"This run: {run.attention_backend}, "
             + (f"FlashAttention {run.flash_attn_version} (flash_attn_varlen_func with block_table)."
                if run.flash_attn_version else "the CPU kernel cpu_attention_with_kv_cache." if on_cpu
                else "no FlashAttention.")),
            "vllm/v1/attention/ops/paged_attn.py's split_kv_cache is not on vLLM 0.26's FlashAttention or CPU "
            "path (ROCm / legacy only): on the 0.26 cache its kv_cache[0] is block 0, not all keys. Its page "
            "shows what each of its lines would give for this run's cache.",
        ), links(
            (FLASH_ATTN, "flash_attn.forward.flash_attn_varlen_func", "flash_attn_varlen_func call"),
            (CPU_ATTN, "cpu_attn.forward.attention", "cpu_attention_with_kv_cache call"),
            (PAGED_ATTN, "paged_attn.split_kv_cache", "PagedAttention.split_kv_cache (not called)"),
            (PAGED_ATTN, "paged_attn.split_kv_cache.key_index", "kv_cache[0] on the 0.26 cache"),
        )),
    )
    return TourPage(stops, nav)


# --- the whole site --------------------------------------------------------------


@dataclass(frozen=True)
class Site:
    """Every page of a report."""

    index: IndexPage
    sources: dict[str, SourcePage]  #: page name -> page
    steps: dict[str, StepPage]  #: page name -> page
    tour: TourPage


def navigation(located: dict[str, LocatedSource]) -> tuple[Link, ...]:
    """The top bar: index, tour, one link per stored source."""
    return (Link(INDEX_PAGE, "index"), Link(TOUR_PAGE, "tour")) + tuple(
        Link(source_file_page(p), p.rsplit("/", 1)[-1]) for p in ANNOTATED_FILES if p in located
    )


def build_site(trace: Trace, reference: tuple[str, str, int] | None = None,
               max_step_pages: int = MAX_REQUEST_PAGES) -> Site:
    """All view models of a report for ``trace``.

    ``reference`` is the tour's kernel source (``load_reference_source()``), if any;
    ``max_step_pages`` caps the request steps that get a page.
    """
    replay = read_replay(trace)
    texts = {p: t for p in ANNOTATED_FILES if (t := trace.source(p)) is not None}
    located = {p: locate(t, p) for p, t in texts.items()}
    nav = navigation(located)
    records = first_records(trace)
    paged = pages_for_steps(trace.records, max_step_pages)
    default = next((r for r in records if r.kind == "request"), records[0] if records else None)
    sources = {
        source_file_page(p): source_page(trace, p, t, located[p], records, default, nav) for p, t in texts.items()
    }
    layers_by_step: dict[int, list[str]] = {}
    for r in trace.records:
        layers_by_step.setdefault(r.step, []).append(r.layer)
    paged_records = [r for r in records if r.step in paged]
    steps = {}
    for i, r in enumerate(paged_records):
        prev = paged_records[i - 1].step if i > 0 else None
        nxt = paged_records[i + 1].step if i + 1 < len(paged_records) else None
        steps[step_page(r.step)] = step_view(
            r, trace.run, tuple(layers_by_step[r.step]), replay.by_step.get(r.step, []), prev, nxt, nav
        )
    return Site(
        index=index_page(trace, replay, located, paged),
        sources=sources,
        steps=steps,
        tour=tour_page(trace, located, paged, reference, nav),
    )
