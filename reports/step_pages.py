"""``step-NNNNNN.html``: one step's block table, its slot mapping drawn onto blocks, its replay verdicts.

Also which steps get a page at all (``pages_for_steps``): a long trace lists every
step on the index but writes pages for the first few hundred only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from annotations.values import fmt_list
from reports.common import Link, Row, Verdict, range_text, step_page
from reports.verdicts import (
    NOT_CHECKED,
    LayerVerdict,
    MetadataRow,
    layer_verdicts,
    metadata_rows,
    metadata_verdict,
    step_verdict,
)
from tracer.format import MetadataCheck, RunInfo, StepRecord, StepResult
from tracer.format.groups import TraceGroups, group_label
from tracer.format.summary import tensors_absent
from tracer.format.words import Words, snippet, visible

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


@dataclass(frozen=True)
class Segment:
    """Part of a block's slot bar: ``old``, ``new`` or ``other`` (see :data:`SLOT_CLASSES`)."""

    cls: str
    left: str  #: percent, formatted
    width: str


@dataclass(frozen=True)
class BlockCell:
    """One block-table cell: a physical block in one request's row."""

    block: int  #: physical block id
    index: int  #: logical block index in the row
    shared: bool  #: the block id appears in more than one row
    written: bool  #: slot_mapping writes into it this step (any row)
    full: bool  #: every slot was cached before this step (drawn without segments)
    segments: tuple[Segment, ...]  #: the slot bar, when not ``full``
    title: str
    null: bool = False  #: the null block: the row's group keeps no block here (before a sliding window)
    words: str = ""  #: a snippet of the text it holds ("" without token text; the title has it whole)


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
class GroupGrid:
    """The block table of one KV-cache group at this step (one grid per group the step's records read)."""

    label: str  #: ``group 0: sliding window 64 tokens, ...`` ("" when the groups are not known)
    layers: str  #: the step's recorded layers that read this table
    explain: str  #: why this table differs from the first grid's ("" for the first)
    rows: tuple[RequestRow, ...]
    rows_elided: int
    nulls: int  #: null-block cells in the rows drawn


@dataclass(frozen=True)
class SlotRun:
    """Consecutive tokens of one request written to consecutive offsets of one block."""

    request: int
    tokens: str  #: token indices in the step, e.g. ``0–15``
    positions: str
    block: int
    offsets: str
    slots: str
    words: str = ""  #: the text of the run's tokens ("" without token text)


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
    metadata: tuple[MetadataRow, ...] = ()  #: metadata checks, every layer of the step
    metadata_verdict: Verdict = NOT_CHECKED
    metadata_source: str = ""  #: where the metadata checks come from (``replay.json`` or computed now)
    sources: tuple[Link, ...] = ()  #: the annotated sources with their values at this step
    prefix: Link | None = None  #: the prefix-cache page, when a request first scheduled here had a hit
    grids: tuple[GroupGrid, ...] = ()  #: the block table of each KV-cache group (``rows`` is the first's)
    groups_source: str = ""  #: where the groups come from (recorded, inferred, not recorded)
    attention: tuple[Link, ...] = ()  #: this step's attention pages (one per layer with tensors)
    has_words: bool = False  #: the trace records token text: cells and slot runs show words


def pages_for_steps(records: list[StepRecord], max_request_pages: int = MAX_REQUEST_PAGES) -> set[int]:
    """Which steps get a page: the first ``max_request_pages`` request steps, then the first few others."""
    steps: dict[int, str] = {}
    for r in records:
        steps.setdefault(r.step, r.kind)
    request = [s for s, k in sorted(steps.items()) if k == "request"][:max_request_pages]
    other = [s for s, k in sorted(steps.items()) if k != "request"][:MAX_OTHER_PAGES]
    return set(request) | set(other)


def slot_runs(record: StepRecord, block_size: int, words: Words | None = None) -> list[SlotRun]:
    """Group the step's slot_mapping into runs of one request, one block, consecutive offsets.

    With ``words`` (the trace's token text) each run also says the text of the tokens it writes.
    """
    runs: list[SlotRun] = []
    positions = [p for s, q in zip(record.seq_lens, record.query_lens, strict=False) for p in range(s - q, s)]
    owner = [i for i, q in enumerate(record.query_lens) for _ in range(q)]
    current: list[int] = []

    def flush() -> None:
        if not current:
            return
        first, last = current[0], current[-1]
        slot0, slot1 = record.slot_mapping[first], record.slot_mapping[last]
        text = ""
        row = owner[first] if first < len(owner) else -1
        if words and 0 <= row < len(record.request_ids) and last < len(positions):
            tokens = words.request_tokens(record.request_ids[row])
            text = visible(words.text(tokens[positions[first] : positions[last] + 1])) if tokens is not None else ""
        runs.append(
            SlotRun(
                owner[first] if first < len(owner) else -1,
                range_text(first, last),
                range_text(positions[first], positions[last]) if last < len(positions) else "?",
                slot0 // block_size,
                range_text(slot0 % block_size, slot1 % block_size),
                range_text(slot0, slot1),
                text,
            )
        )
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


#: What a slot of a row's block holds, as drawn: ...
OLD = "old"  #: ... cached before this step (part of the row's context, not written now)
NEW = "new"  #: ... written by this row in this step
OTHER = "other"  #: ... in the row's context, but written in this step by another row (a prefix shared in-step)
SLOT_CLASSES = (OLD, NEW, OTHER)


def slot_writers(record: StepRecord, block_size: int) -> dict[tuple[int, int], int]:
    """``(block, offset) -> row`` for every slot the step's slot_mapping writes (padding skipped)."""
    owner = [i for i, q in enumerate(record.query_lens) for _ in range(q)]
    out: dict[tuple[int, int], int] = {}
    for t, slot in enumerate(record.slot_mapping):
        if slot >= 0 and t < len(owner):
            out[(slot // block_size, slot % block_size)] = owner[t]
    return out


def _cell(
    block: int,
    index: int,
    bs: int,
    shared: bool,
    writers: dict[tuple[int, int], int],
    row: int,
    seq_len: int,
    context_len: int,
    text: str | None = None,
    null_block: int | None = None,
) -> BlockCell:
    if null_block is not None and block == null_block:
        title = (
            f"block {block}, logical block {index}: the null block. This row's KV-cache group keeps no block here "
            "(a sliding window gave it back: no query of the row reads these positions)"
        )
        return BlockCell(block, index, False, False, False, (), title, null=True)
    before = max(0, min(bs, context_len - index * bs))
    after = max(0, min(bs, seq_len - index * bs))
    # Each used slot's class; a context slot that another row writes now was not cached before this step.
    classes = [(OTHER if writers.get((block, o), row) != row else OLD) if o < before else NEW for o in range(after)]
    written = [o for o in range(bs) if (block, o) in writers]
    counts = {c: classes.count(c) for c in SLOT_CLASSES}
    title = f"block {block}, logical block {index}: {after}/{bs} slots used"
    if shared:
        title += ", shared"
    if counts[NEW]:
        title += f"; {counts[NEW]} written by this row in this step"
    if counts[OTHER]:
        others = sorted({writers[(block, o)] for o in range(before) if writers.get((block, o), row) != row})
        title += f"; {counts[OTHER]} written in this step by row {', '.join(map(str, others))}"
    if counts[OLD]:
        title += f"; {counts[OLD]} cached before this step"
    words = ""
    if text is not None:
        title += f"\n{text}"
        words = snippet(text)
    if after == bs and classes.count(OLD) == bs:
        return BlockCell(block, index, shared, bool(written), True, (), title, words=words)
    segments = []
    start = 0
    for o in range(1, after + 1):
        if o == after or classes[o] != classes[start]:
            segments.append(Segment(classes[start], _pct(100 * start / bs), _pct(100 * (o - start) / bs)))
            start = o
    return BlockCell(block, index, shared, bool(written), False, tuple(segments), title, words=words)


def _table_rows(
    record: StepRecord, bs: int, writers: dict[tuple[int, int], int], null: int | None, words: Words | None
) -> tuple[RequestRow, ...]:
    """The block-table grid's rows of ``record`` (at most ``MAX_ROWS``), null-block cells marked, words in cells."""
    shared_set = record.shared_blocks - ({null} if null is not None else set())
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
        rid = record.request_ids[i] if i < len(record.request_ids) else ""
        texts = words.row_texts(rid, len(table_row), bs, seq_len) if words else None
        cells = tuple(
            _cell(
                table_row[j],
                j,
                bs,
                table_row[j] in shared_set,
                writers,
                i,
                seq_len,
                seq_len - q,
                texts[j] if texts is not None and j * bs < seq_len else None,
                null,
            )
            for j in indices
        )
        rows.append(RequestRow(i, rid, q, seq_len, seq_len - q, cells, elided, HEAD_CELLS if elided else -1))
    return tuple(rows)


def _grid(
    record: StepRecord,
    layers: tuple[str, ...],
    bs: int,
    groups: TraceGroups | None,
    null: int | None,
    rows: tuple[RequestRow, ...],
    first: StepRecord | None,
) -> GroupGrid:
    """One group's grid; ``first``: the first grid's record, whose table this one is explained against."""
    group = groups.of_record(record) if groups is not None else None
    mine = [name for name in layers if groups is not None and groups.of_layer(name) is group] if group else []
    explain = ""
    if first is not None and groups is not None:
        explain = groups.why_tables_differ(first.layer, record.layer)
    return GroupGrid(
        label="" if group is None else f"KV-cache group {group.group}: {group_label(group)}",
        layers=", ".join(mine or [record.layer]),
        explain=explain,
        rows=rows,
        rows_elided=max(0, len(record.block_table) - MAX_ROWS),
        nulls=sum(c.null for row in rows for c in row.cells),
    )


def step_view(
    record: StepRecord,
    run: RunInfo,
    layers: tuple[str, ...],
    replay_entries: Sequence[StepResult],
    prev: int | None,
    next_: int | None,
    nav: tuple[Link, ...],
    metadata: Sequence[MetadataCheck] = (),
    metadata_source: str = "",
    sources: Sequence[Link] = (),
    *,
    groups: TraceGroups | None = None,
    group_records: Sequence[StepRecord] = (),
    attention: Sequence[Link] = (),
    prefix: Link | None = None,
    words: Words | None = None,
) -> StepPage:
    """One step: block-table grids, slot mapping drawn onto blocks, lengths, replay and metadata verdicts.

    ``sources`` are the annotated source pages (``src-<name>.html``): the page links each
    at this step (``#step-N`` selects it there). ``groups``: the trace's KV-cache groups;
    ``group_records``: one record of each other group at this step (each gets its own grid,
    explained against ``record``'s). ``attention``: the step's attention pages; ``prefix``: the
    prefix-cache page, when a request first scheduled here had a hit. ``words`` (the trace's
    token text) puts the text each block holds in its cell and each slot run's text in the slot table.
    """
    bs = run.kv_cache.block_size if run.kv_cache else 16
    shared_set = record.shared_blocks
    writers = slot_writers(record, bs)
    written_blocks = sorted({block for block, _ in writers})
    null = groups.null_block if groups is not None else None
    rows = _table_rows(record, bs, writers, null, words)
    grids = [_grid(record, layers, bs, groups, null, rows, None)]
    for other in group_records:
        grids.append(
            _grid(other, layers, bs, groups, null, _table_rows(other, bs, slot_writers(other, bs), null, words), record)
        )
    runs = slot_runs(record, bs, words)
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
        written_blocks=fmt_list(written_blocks, 32) if written_blocks else "none",
        slot_runs=tuple(runs[:MAX_SLOT_RUNS]),
        slot_runs_elided=max(0, len(runs) - MAX_SLOT_RUNS),
        padding=sum(1 for s in record.slot_mapping if s < 0),
        verdict=step_verdict(replay_entries),
        verdicts=layer_verdicts(replay_entries),
        prev=Link(step_page(prev), f"step {prev}") if prev is not None else None,
        next=Link(step_page(next_), f"step {next_}") if next_ is not None else None,
        nav=nav,
        replay_note=no_tensors_note(run, record.kind)
        if record.tensors is None
        else "Not replayed (run pagedtrace replay on the trace).",
        metadata=metadata_rows(metadata),
        metadata_verdict=metadata_verdict(metadata),
        metadata_source=metadata_source,
        sources=tuple(Link(f"{link.href}#step-{record.step}", link.text) for link in sources),
        prefix=prefix,
        grids=tuple(grids),
        groups_source=groups.source if groups is not None else "",
        attention=tuple(attention),
        has_words=words is not None,
    )


def no_tensors_note(run: RunInfo, kind: str) -> str:
    """Why a step without captured tensors has no replay verdict (``tracer.format.summary.tensors_absent``)."""
    return (
        f"Not replayable: no tensors were captured for this step ({tensors_absent(run, kind)}), "
        "so there is nothing to recompute attention from."
    )
