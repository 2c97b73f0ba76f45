"""``tour.html``: the reading checklist (layout, write path, block loop, online softmax, what runs).

Each stop links into the other pages; the block-loop and online-softmax stops show
the readable reference kernel (``reference_impl.kernel.paged_attention_loop``), read
as text and never imported, with the lines its ``# tour:`` comments mark highlighted.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from annotations.anchors import ATTENTION, BLOCK_TABLE, CPU_ATTN, FLASH_ATTN, PAGED_ATTN
from annotations.locate import LocatedSource
from reports.common import INDEX_PAGE, Link, Token, highlight, source_file_page, step_page
from tracer.format import Trace, TraceError
from tracer.format.walk import BlockLine, QueryWalk, read_tour_walk, tour_target

#: Spells a ``pagedtrace`` command line: ``command("step", TRACE, step=5, request="0-a", head=0)``,
#: options by their argparse ``dest`` (``True`` for a flag).
Command = Callable[..., str]


def plain_command(name: str, *positionals: str, **options: object) -> str:
    """A :data:`Command` without the CLI's parser: ``--dest-with-dashes VALUE`` per option.

    ``pagedtrace report`` passes ``pagedtrace.cli.command_line`` instead, which spells each
    option as the parser does and refuses a line it would not parse.
    """
    argv = ["pagedtrace", name, *positionals]
    for dest, value in options.items():
        flag = "--" + dest.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return shlex.join(argv)


@dataclass(frozen=True)
class CodeLine:
    """One line of a ``CodeBlock``."""

    number: int  #: 1-based line number in the original file
    tokens: tuple[Token, ...]
    marked: bool  #: highlighted as part of the stop's subject
    values: str = ""  #: the walked query's values on this line, one per block-loop iteration ("" none)


@dataclass(frozen=True)
class WalkRow:
    """One iteration of the block loop for the walked query."""

    j: str
    physical: str
    positions: str
    n_valid: str
    n_visible: str
    block_max: str
    m: str
    rescale: str
    l: str


@dataclass(frozen=True)
class WalkView:
    """Which real query the tour's loop values are for, and its iterations as a table."""

    caption: str
    rows: tuple[WalkRow, ...]
    rows_elided: int
    step_link: Link | None
    command: str = ""  #: the ``pagedtrace step`` line that walks this query (and, edited, any other)


@dataclass(frozen=True)
class CodeBlock:
    """A titled piece of source, highlighted."""

    title: str
    origin: str
    lines: tuple[CodeLine, ...]
    walk: WalkView | None = None  #: the trace's values, when a query was walked through the loop


#: A line of the reference kernel that a tour stop highlights ends with ``# tour: <mark>``: ...
TOUR_MARK = re.compile(r"#\s*tour:\s*(\w+)\s*$")
#: ... ``block`` at the block-loop stop, ``softmax`` at the online-softmax stop ...
BLOCK_MARK, SOFTMAX_MARK = "block", "softmax"
#: ... which shows the kernel from the line containing this text through its last softmax line.
SOFTMAX_FIRST = "Online-softmax"


def tour_marks(text: str) -> tuple[str, tuple[str, ...]]:
    """``text`` without its ``# tour:`` comments, and each line's mark (``""`` for an unmarked line).

    The marks live in the kernel's own lines, so the tour follows the code when it is
    edited; the page shows the code without them.
    """
    lines, marks = [], []
    for line in text.splitlines():
        found = TOUR_MARK.search(line)
        marks.append(found.group(1) if found else "")
        lines.append(line[: found.start()].rstrip() if found else line)
    return "\n".join(lines) + ("\n" if text.endswith("\n") else ""), tuple(marks)


#: Iterations shown per line and in the table; a longer walk shows the first and last few.
MAX_ITERATIONS = 12


def _num(x: float) -> str:
    return f"{x:.5g}" if math.isfinite(x) else ("-inf" if x < 0 else "inf")


def _shown(blocks: tuple[BlockLine, ...]) -> tuple[list[BlockLine], int]:
    if len(blocks) <= MAX_ITERATIONS:
        return list(blocks), 0
    half = MAX_ITERATIONS // 2
    return [*blocks[:half], *blocks[-half:]], len(blocks) - 2 * half


def _per_block(walk: QueryWalk, name: str, fmt) -> str:
    shown, elided = _shown(walk.blocks)
    parts = [f"j={b.logical}: {fmt(b)}" for b in shown]
    if elided:
        parts.insert(MAX_ITERATIONS // 2, f"… {elided} more")
    return f"{name}  " + ", ".join(parts)


#: What the walk shows beside a loop line, by the line's start (the kernel's own text, tour marks removed).
_LINE_VALUES = (
    ("for j in range", lambda w: f"j = 0 … {len(w.blocks) - 1}: {len(w.blocks)} blocks for seq_len {w.seq_len}"),
    ("physical = ", lambda w: _per_block(w, "physical", lambda b: str(b.physical))),
    ("n_valid = ", lambda w: _per_block(w, "n_valid", lambda b: str(b.n_valid))),
    ("k_pos = ", lambda w: _per_block(w, "keys", lambda b: f"{b.positions[0]}–{b.positions[1] - 1}")),
    ("m_new = ", lambda w: _per_block(w, "m", lambda b: _num(b.m))),
    ("rescale = ", lambda w: _per_block(w, "rescale", lambda b: _num(b.rescale))),
    ("l = ", lambda w: _per_block(w, "l", lambda b: _num(b.l))),
    ("acc = ", lambda w: _per_block(w, "||acc||", lambda b: _num(b.acc_norm))),
    ("o = ", lambda w: f"||o|| = {_num(w.output_norm)} (vLLM's row: {_num(w.vllm_norm)})"),
    ("return acc / l", lambda w: f"||o|| = {_num(w.output_norm)} (vLLM's row: {_num(w.vllm_norm)})"),
)


def line_values(text: str, walk: QueryWalk | None) -> str:
    """The walk's values for one line of the loop (its text without the tour mark); "" for other lines."""
    if walk is None or not walk.blocks:
        return ""
    stripped = text.strip()
    for start, fn in _LINE_VALUES:
        if stripped.startswith(start):
            return fn(walk)
    return ""


def walk_view(walk: QueryWalk, command: Command = plain_command, trace: str = "") -> WalkView:
    """The caption and iteration table of a walked query."""
    shown, elided = _shown(walk.blocks)
    rows = tuple(
        WalkRow(
            str(b.logical),
            str(b.physical),
            f"{b.positions[0]}–{b.positions[1] - 1}",
            str(b.n_valid),
            str(b.n_visible),
            _num(b.block_max),
            _num(b.m),
            _num(b.rescale),
            _num(b.l),
        )
        for b in shown
    )
    verdict = "within" if walk.ok else "OVER"
    caption = (
        f"The values beside the lines are this loop's, run on the trace: step {walk.step}, layer {walk.layer}, "
        f"request {walk.request_id} (block-table row {walk.row}), query {walk.token} at position {walk.position}, "
        f"head {walk.head} (KV head {walk.kv_head}), seq_len {walk.seq_len}, block size {walk.block_size}, "
        f"{walk.compute_dtype}. vLLM's output for that head differs by {_num(walk.max_abs)} "
        f"({verdict} replay's bar {_num(walk.tolerance)})."
    )
    line = command("step", trace or walk.trace, step=walk.step, request=walk.request_id, head=walk.head)
    return WalkView(caption, rows, elided, Link(step_page(walk.step), f"step {walk.step}"), line)


def stored_walk(trace: Trace, command: Command = plain_command) -> tuple[QueryWalk | None, str]:
    """The tour's walk that ``pagedtrace replay`` kept in the trace (``walk.json``), or None and why not."""
    if tour_target(trace) is None:
        return None, "No trace values beside the loop: no request step of this trace has tensors to run it on."
    try:
        walk = read_tour_walk(trace)
    except TraceError as exc:
        return None, f"No trace values beside the loop: {exc}."
    if walk is None:
        return None, (
            f"No trace values beside the loop yet: {command('replay', str(trace.path))} walks one captured query "
            "through it and keeps the values in the trace (walk.json) for the next report."
        )
    return walk, ""


def code_block(
    title: str,
    origin: str,
    text: str,
    start: int,
    marks: tuple[str, ...],
    mark: str,
    first: str | None = None,
    walk: QueryWalk | None = None,
    view: WalkView | None = None,
) -> CodeBlock | None:
    """Highlight ``text`` (its first line is line ``start``); mark the lines whose ``marks`` entry is ``mark``.

    ``marks`` has one entry per line (``tour_marks``). With ``first``, keep only the
    lines from the first containing ``first`` through the last marked one; None when
    either is not found. With ``walk``, the marked lines carry its values per iteration, and
    the block shows ``view`` (default: :func:`walk_view` of it).
    """
    raw = text.splitlines()
    lines = [
        CodeLine(number, tuple(tokens), line_mark == mark, line_values(line, walk) if line_mark == mark else "")
        for number, tokens, line_mark, line in zip(
            range(start, start + len(raw)), highlight(text), marks, raw, strict=True
        )
    ]
    if first is not None:
        lo = next((i for i, line in enumerate(raw) if first in line), None)
        hi = max((i for i, line_mark in enumerate(marks) if line_mark == mark), default=None)
        if lo is None or hi is None or hi < lo:
            return None
        lines = lines[lo : hi + 1]
    if view is None and walk is not None and walk.blocks:
        view = walk_view(walk)
    return CodeBlock(title, origin, tuple(lines), view)


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


def _without_step_link(code: CodeBlock | None) -> CodeBlock | None:
    """``code`` whose walk links no step page (its step has none)."""
    if code is None or code.walk is None:
        return code
    return replace(code, walk=replace(code.walk, step_link=None))


def _anchor_link(located: dict[str, LocatedSource], path: str, key: str, text: str) -> Link | None:
    loc = located.get(path)
    if loc is None or key not in loc.locations or not loc.locations[key].found:
        return None
    return Link(f"{source_file_page(path)}#line-{loc.locations[key].line}", text)


def tour_page(
    trace: Trace,
    located: dict[str, LocatedSource],
    paged: set[int],
    reference: tuple[str, str, int] | None,
    nav: tuple[Link, ...],
    walk: QueryWalk | None = None,
    walk_note: str = "",
    command: Command = plain_command,
) -> TourPage:
    """The guided tour following the reading checklist, linked into the other pages.

    ``walk``: one real query run through the reference loop (``pagedtrace replay`` keeps one
    in the trace, :func:`stored_walk`); its values go beside the loop's lines. ``walk_note``
    says why there is none (shown instead). ``command`` spells the command lines shown.
    """
    view = walk_view(walk, command, str(trace.path)) if walk is not None and walk.blocks else None
    run = trace.run
    spec = run.kv_cache
    on_cpu = "CPUAttention" in run.attention_backend
    backend_file = CPU_ATTN if on_cpu else FLASH_ATTN
    request_pages = sorted(s for s in paged if any(r.step == s and r.kind == "request" for r in trace.records))
    step_link = (
        (Link(step_page(request_pages[0]), f"step {request_pages[0]}: block table and slots"),) if request_pages else ()
    )

    def links(*items: tuple[str, str, str]) -> tuple[Link, ...]:
        out = []
        for path, key, text in items:
            link = _anchor_link(located, path, key, text)
            if link is not None:
                out.append(link)
        return tuple(out)

    layout_text = (
        f"This run's cache: {tuple(spec.shape)} with strides {tuple(spec.stride)}, layout {spec.layout}: "
        f"{spec.physical_order}."
        if spec
        else "This trace has no KV-cache spec."
    )
    loop_code = softmax_code = None
    if reference is not None:
        origin, src, start = reference
        shown, marks = tour_marks(src)
        loop_code = code_block(
            origin, "reference_impl/kernel.py", shown, start, marks, BLOCK_MARK, walk=walk, view=view
        )
        softmax_code = code_block(
            f"{origin}: the online-softmax lines",
            "reference_impl/kernel.py",
            shown,
            start,
            marks,
            SOFTMAX_MARK,
            SOFTMAX_FIRST,
            walk=walk,
            view=view,
        )
    if walk is not None and walk.step not in paged:
        loop_code = _without_step_link(loop_code)
        softmax_code = _without_step_link(softmax_code)
    stops = (
        TourStop(
            "layout",
            "1. Layout",
            (
                "Every attention layer owns one kv_cache tensor of logical shape (num_blocks, num_kv_heads, "
                "block_size, 2*head_size): K and V are packed into the last dimension. The backend's stride order "
                "decides the physical order; FlashAttention views it as key_cache/value_cache of shape "
                "(num_blocks, block_size, num_kv_heads, head_size) with transpose(1, 2).split(head_size, -1).",
                layout_text,
            ),
            (
                Link(f"{INDEX_PAGE}#layout", "the drawn layout"),
                *links(
                    (FLASH_ATTN, "flash_attn.get_kv_cache_shape", "FlashAttentionBackend.get_kv_cache_shape"),
                    (FLASH_ATTN, "flash_attn.get_kv_cache_stride_order", "get_kv_cache_stride_order"),
                    (FLASH_ATTN, "flash_attn.forward.split", "forward: transpose(1, 2).split(...)"),
                    (CPU_ATTN, "cpu_attn.forward.view", "CPU: view(nb, H, 2*bs, D)"),
                    (CPU_ATTN, "cpu_attn.forward.chunk", "CPU: chunk(2, dim=2)"),
                ),
            ),
        ),
        TourStop(
            "write",
            "2. Write path: slot_mapping and reshape_and_cache",
            (
                "Before attention reads anything, the new tokens' K and V are scattered into the cache. The worker "
                "computes one slot per new token: slot = block_table[req, pos // block_size] * block_size + "
                "pos % block_size. unified_kv_cache_update hands it to the backend's do_kv_cache_update, which calls "
                "reshape_and_cache_flash (CPU: cpu_attn_reshape_and_cache).",
            ),
            links(
                (BLOCK_TABLE, "block_table.compute_slot_mapping.launch", "BlockTable.compute_slot_mapping"),
                (BLOCK_TABLE, "block_table.kernel.slot_ids", "the slot formula in _compute_slot_mapping_kernel"),
                (ATTENTION, "attention.unified_kv_cache_update.call", "unified_kv_cache_update"),
                (
                    backend_file,
                    "flash_attn.do_kv_cache_update.reshape_and_cache_flash"
                    if not on_cpu
                    else "cpu_attn.do_kv_cache_update.reshape_and_cache",
                    "the backend's write",
                ),
            )
            + step_link,
        ),
        TourStop(
            "blocks",
            "3. Block loop",
            (
                "Reading is the same walk in reverse: for each request, key j lives in block block_table[req, j // "
                "block_size] at offset j % block_size. The reference kernel spells the loop out block by block; the "
                "real kernels do the same walk in tiles.",
            )
            + ((walk_note,) if walk is None and walk_note and loop_code is not None else ()),
            links(
                (FLASH_ATTN, "flash_attn.forward.block_table", "forward: block_table"),
                (FLASH_ATTN, "flash_attn.forward.seqused_k", "forward: seqused_k = seq_lens"),
            )
            + step_link,
            loop_code,
        ),
        TourStop(
            "softmax",
            "4. Online softmax",
            (
                "Scores are never held for the whole sequence: per block, the running maximum m and denominator l "
                "are updated and the accumulator is rescaled by exp(m_old - m_new) before the block's values are "
                "added; the output is acc / l at the end.",
            )
            + (
                ()
                if loop_code
                else (
                    "The reference kernel (reference_impl.kernel.paged_attention_loop) was not available when this "
                    "report was built.",
                )
            ),
            (),
            softmax_code,
        ),
        TourStop(
            "runs",
            "5. What actually runs",
            (
                (
                    f"This run: {run.attention_backend}, "
                    + (
                        f"FlashAttention {run.flash_attn_version} (flash_attn_varlen_func with block_table)."
                        if run.flash_attn_version
                        else "the CPU kernel cpu_attention_with_kv_cache."
                        if on_cpu
                        else "no FlashAttention."
                    )
                ),
                "vllm/v1/attention/ops/paged_attn.py's split_kv_cache is not on vLLM 0.26's FlashAttention or CPU "
                "path (ROCm / legacy only): on the 0.26 cache its kv_cache[0] is block 0, not all keys. Its page "
                "shows what each of its lines would give for this run's cache.",
            ),
            links(
                (FLASH_ATTN, "flash_attn.forward.flash_attn_varlen_func", "flash_attn_varlen_func call"),
                (CPU_ATTN, "cpu_attn.forward.attention", "cpu_attention_with_kv_cache call"),
                (PAGED_ATTN, "paged_attn.split_kv_cache", "PagedAttention.split_kv_cache (not called)"),
                (PAGED_ATTN, "paged_attn.split_kv_cache.key_index", "kv_cache[0] on the 0.26 cache"),
            ),
        ),
    )
    return TourPage(stops, nav)
