"""Metadata verdicts: is a step's attention metadata self-consistent and true to the model?

These checks need no tensors, so every record gets them, a ``--no-tensors`` trace
included. Each compares what vLLM handed attention with what it must be:

``lengths``
    ``query_start_loc`` starts at 0, never decreases and ends at ``num_actual_tokens``
    (padded rows of a CUDA-graph batch repeat the last entry: query length 0, seq_len 0);
    each row's query length is at most its ``seq_len``; ``slot_mapping`` covers the
    actual tokens and is -1 past them; ``max_query_len`` / ``max_seq_len`` bound the rows.
``slots``
    Every new token's slot is ``block_table[row][pos // block_size] * block_size +
    pos % block_size`` with ``pos = seq_len - query_len + i`` (vLLM's
    ``BlockTable.compute_slot_mapping``); -1 slots are padding and skipped; no two tokens
    share a slot.
``blocks``
    Every block id a row uses (its first ``ceil(seq_len / block_size)`` entries) lies in
    the pool, ``0 < id < num_blocks``. Block 0 is vLLM's null block: it holds no KV, and
    may appear only in dummy runs (warm-up, profile) or where a sliding window has
    dropped the block (no query of the row reads it). Where the record holds FlashInfer's page
    table (``paged_kv_indptr`` / ``paged_kv_indices`` / ``paged_kv_last_page_len``, made by
    ``FlashInferMetadataBuilder`` from the block table), it must be that table: row ``b``'s pages
    are its ``ceil(seq_len / block_size)`` blocks, in order, and its last page holds
    ``seq_len - (pages - 1) * block_size`` tokens (a cascade step's pages leave out the shared
    prefix's: not compared).
``shared``
    A block in two rows sits at the same logical index in both, is full in both, and
    (when ``session.json`` records the prompts) both requests hold the same tokens up to
    its end: prefix caching shares a block only for an identical prefix.
``flags``
    ``causal``, the sliding window and the soft-cap agree with the model config the
    manifest records (``RunInfo.extra["model_attention"]``); the head counts with the
    KV-cache spec and the model.
``groups``
    The record's KV-cache group (:mod:`tracer.format.groups`: recorded, or inferred for an
    older trace) lists its layer, and layers of one group read one block table in a step. A
    sliding-window group's layer reads no further back than its group keeps blocks (the
    record's window is at most the group's, so it never reads outside its window), and its
    table points no position inside the group's window of any query of the row at the null
    block (vLLM's ``SlidingWindowManager`` gives back only blocks wholly before it).
``ranks`` (:data:`tracer.format.ranks.RANKS_CHECK`, a tensor-parallel trace only)
    Every rank recorded the same metadata as rank 0 for the step (``Trace.disagreements``,
    :mod:`tracer.format.ranks`); a record or gap only some ranks have is a problem too.

Standard library only: runs where neither torch nor vLLM is installed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tracer.format.findings import Findings
from tracer.format.groups import TraceGroups, trace_groups
from tracer.format.ranks import rank_checks
from tracer.format.records import KVCacheSpec, RunInfo, StepRecord
from tracer.format.requests import Tokens, known_tokens, session_id_of
from tracer.format.selection import layer_index
from tracer.format.store import SESSION, Trace
from tracer.format.verdicts import MetadataCheck

__all__ = [
    "METADATA_CHECKS",
    "check_record",
    "check_records",
    "expected_attention",
]

#: The checks, in the order they are reported.
METADATA_CHECKS = ("lengths", "slots", "blocks", "shared", "flags", "groups")
#: vLLM's null block: the placeholder id for "no block here".
NULL_BLOCK = 0
#: Architecture suffixes of decoder-only models: their attention is causal.
_DECODER_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _rows(record: StepRecord) -> list[tuple[int, int, int, int]]:
    """``(row, first query token, query_len, seq_len)`` for rows whose lengths are usable."""
    qsl, lens = record.query_start_loc, record.seq_lens
    return [
        (r, qsl[r], qsl[r + 1] - qsl[r], lens[r])
        for r in range(min(len(lens), len(qsl) - 1))
        if 0 <= qsl[r + 1] - qsl[r] <= lens[r]
    ]


def _check_lengths(record: StepRecord, model_len: int | None) -> MetadataCheck:
    f = Findings(record, "lengths")
    qsl, lens, n = record.query_start_loc, record.seq_lens, record.num_actual_tokens
    f.checked = len(lens)
    if len(qsl) != len(lens) + 1:
        f.add(f"query_start_loc has {len(qsl)} entries for {len(lens)} seq_lens (expected {len(lens) + 1})")
    if len(record.block_table) != len(lens):
        f.add(f"block_table has {len(record.block_table)} rows for {len(lens)} seq_lens")
    if qsl and qsl[0] != 0:
        f.add(f"query_start_loc[0] is {qsl[0]}, expected 0")
    for r in range(min(len(lens), len(qsl) - 1)):
        q = qsl[r + 1] - qsl[r]
        if q < 0:
            f.add(f"query_start_loc decreases: {qsl[r]} then {qsl[r + 1]}", row=r)
        elif q > lens[r]:
            f.add(f"query length {q} > seq_len {lens[r]}: the row computes more tokens than it holds", row=r)
        if model_len and lens[r] > model_len:
            f.add(f"seq_len {lens[r]} > max_model_len {model_len}", row=r)
    if qsl and qsl[-1] != n:
        f.add(f"query_start_loc ends at {qsl[-1]}, num_actual_tokens is {n}")
    if len(record.slot_mapping) < n:
        f.add(f"slot_mapping has {len(record.slot_mapping)} entries for {n} actual tokens")
    tail = [t for t in range(n, len(record.slot_mapping)) if record.slot_mapping[t] != -1]
    if tail:
        f.add(f"{len(tail)} slot(s) past num_actual_tokens are not -1 (padding must not be written)", token=tail[0])
    query_lens = [qsl[r + 1] - qsl[r] for r in range(len(qsl) - 1)]
    if query_lens and record.max_query_len < max(query_lens):
        f.add(f"max_query_len {record.max_query_len} < the longest query, {max(query_lens)}")
    if lens and record.max_seq_len < max(lens):
        f.add(f"max_seq_len {record.max_seq_len} < the longest seq_len, {max(lens)}")
    return f.done()


def _check_slots(record: StepRecord, bs: int) -> MetadataCheck:
    f = Findings(record, "slots")
    sm, padding = record.slot_mapping, 0
    owner: dict[int, int] = {}
    for r, first, q, seq_len in _rows(record):
        row = record.block_table[r] if r < len(record.block_table) else ()
        for i in range(q):
            t = first + i
            if t >= len(sm):
                break  # reported by ``lengths``
            slot, pos = sm[t], seq_len - q + i
            if slot == -1:
                padding += 1
                continue
            f.checked += 1
            j = pos // bs
            if j >= len(row):
                f.add(f"position {pos} needs logical block {j}; the row has {len(row)} block(s)", r, pos, t)
                continue
            expected = row[j] * bs + pos % bs
            if slot != expected:
                f.add(
                    f"slot {slot} (block {slot // bs}, offset {slot % bs}), expected {expected} = "
                    f"block_table[{r}][{j}] {row[j]} * {bs} + {pos % bs}",
                    r,
                    pos,
                    t,
                )
            if slot in owner:
                f.add(f"slot {slot} is also written by query token {owner[slot]}", r, pos, t)
            owner.setdefault(slot, t)
    return f.done(f"{padding} padding slot(s) (-1) skipped" if padding else "")


def _first_read_position(record: StepRecord, q: int, seq_len: int) -> int:
    """The lowest key position any query of the row reads (0 without a window)."""
    window = record.sliding_window
    left = window[0] if window else -1
    return 0 if left < 0 else max(0, seq_len - q - left)


def _check_blocks(record: StepRecord, spec: KVCacheSpec) -> MetadataCheck:
    f = Findings(record, "blocks")
    bs, nb = spec.block_size, spec.num_blocks
    nulls = 0
    for r, _first, q, seq_len in _rows(record):
        row = record.block_table[r] if r < len(record.block_table) else ()
        needed = _ceil_div(seq_len, bs)
        if len(row) < needed:
            f.add(f"{len(row)} block(s) for seq_len {seq_len}: needs {needed}", row=r, position=len(row) * bs)
        first_read = _first_read_position(record, q, seq_len)
        seen: dict[int, int] = {}
        for j, block in enumerate(row[:needed]):
            f.checked += 1
            if not 0 <= block < nb:
                f.add(f"block id {block} at logical block {j} is outside the pool 1..{nb - 1}", r, j * bs)
            elif block == NULL_BLOCK:
                nulls += 1
                unread = (j + 1) * bs <= first_read
                if record.kind == "request" and not unread:
                    f.add(
                        f"block 0 (vLLM's null block, no KV stored) at logical block {j}, which attention reads",
                        r,
                        j * bs,
                    )
            elif block in seen:
                f.add(f"block {block} at logical blocks {seen[block]} and {j} of one row", r, j * bs)
            else:
                seen[block] = j
    where = "outside the window: unread" if record.kind == "request" else "a dummy run"
    notes = [f"{nulls} null-block entr{'y' if nulls == 1 else 'ies'} ({where})"] if nulls else []
    if record.paged_kv_indptr is not None:
        notes.append(_check_pages(record, bs, f))
    return f.done("; ".join(n for n in notes if n))


def _check_pages(record: StepRecord, bs: int, f: Findings) -> str:
    """FlashInfer's page table against the block table (see the module docstring); a note."""
    if record.use_cascade:
        return "FlashInfer's pages not compared: a cascade step's leave out the shared prefix"
    indptr, last, indices = record.paged_kv_indptr or (), record.paged_kv_last_page_len, record.paged_kv_indices
    if indptr[:1] != (0,):
        f.add(f"paged_kv_indptr starts at {indptr[:1]}, not 0")
    for r, _first, _q, seq_len in _rows(record):
        if r + 1 >= len(indptr):
            break
        pages = _ceil_div(seq_len, bs)
        f.checked += 1
        start, stop = indptr[r], indptr[r + 1]
        if stop - start != pages:
            f.add(f"FlashInfer gives {stop - start} page(s) for seq_len {seq_len}: the block table needs {pages}", r)
            continue
        if last is not None and pages and last[r] != seq_len - (pages - 1) * bs:
            f.add(f"paged_kv_last_page_len {last[r]} for seq_len {seq_len}: expected {seq_len - (pages - 1) * bs}", r)
        if indices is not None:
            row = tuple(record.block_table[r][:pages]) if r < len(record.block_table) else ()
            got = tuple(indices[start:stop])
            if got != row:
                j = next((i for i, (a, b) in enumerate(zip(got, row, strict=False)) if a != b), min(len(got), len(row)))
                f.add(
                    f"paged_kv_indices[{start + j}] = {got[j] if j < len(got) else None}: the block table has "
                    f"{row[j] if j < len(row) else None} at logical block {j}",
                    r,
                    j * bs,
                )
    return "FlashInfer's page table checked" + ("" if indices is not None else " (indptr and last pages; no indices)")


def _request_tokens(request_id: str, tokens: Tokens | None) -> Sequence[int] | None:
    """The tokens of a record's request id (vLLM 0.26 appends ``-<hex>`` to the user's id)."""
    if tokens is None or not request_id:
        return None
    matched = session_id_of(request_id, tokens.keys())
    return None if matched is None else tokens[matched]


def _check_shared(record: StepRecord, bs: int, tokens: Tokens | None) -> MetadataCheck:
    f = Findings(record, "shared")
    where: dict[int, list[tuple[int, int, int]]] = {}  # block -> (row, logical index, seq_len)
    for r, _first, _q, seq_len in _rows(record):
        row = record.block_table[r] if r < len(record.block_table) else ()
        for j, block in enumerate(row[: _ceil_div(seq_len, bs)]):
            if block > NULL_BLOCK:
                where.setdefault(block, []).append((r, j, seq_len))
    unknown: set[int] = set()
    prompts: dict[int, Sequence[int] | None] = {}  # row -> its request's tokens, looked up once

    def tokens_of(row: int) -> Sequence[int] | None:
        if row not in prompts:
            prompts[row] = _request_tokens(_rid(record, row), tokens)
        return prompts[row]

    for block, places in sorted(where.items()):
        if len(places) < 2 or len({r for r, _, _ in places}) < 2:
            continue
        f.checked += 1
        r0, j0, _ = places[0]
        seq0 = tokens_of(r0)
        for r, j, seq_len in places:
            if j != j0:
                f.add(f"block {block} is logical block {j0} of row {r0} but {j} of row {r}", r, j * bs)
                continue
            if (j + 1) * bs > seq_len:
                f.add(f"shared block {block} is not full (seq_len {seq_len}, block ends at {(j + 1) * bs})", r, j * bs)
            if r == r0:
                continue
            seq = tokens_of(r)
            end = (j + 1) * bs
            if seq0 is None or seq is None or len(seq0) < end or len(seq) < end:
                unknown.update(x for x, s in ((r0, seq0), (r, seq)) if s is None or len(s) < end)
                continue
            if list(seq0[:end]) == list(seq[:end]):  # one comparison in C; the loop below only to say where
                continue
            diff = next((p for p in range(end) if seq0[p] != seq[p]), None)
            if diff is not None:
                f.add(
                    f"block {block} shared by rows {r0} and {r}, whose tokens differ at position {diff} "
                    f"({seq0[diff]} vs {seq[diff]}): prefix caching shares identical prefixes only",
                    r,
                    diff,
                )
    note = ""
    if unknown:
        why = "no session.json" if tokens is None else "not in session.json"
        note = f"prompts unknown ({why}) for row(s) {_short(sorted(unknown))}: token prefixes not compared"
    return f.done(note)


def _rid(record: StepRecord, row: int) -> str:
    return record.request_ids[row] if row < len(record.request_ids) else ""


def _short(values: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, values[:limit]))
    return shown + (f" … (+{len(values) - limit})" if len(values) > limit else "")


def expected_attention(run: RunInfo | None, layer: str) -> tuple[tuple[int, int] | None, float | None]:
    """What the model config says ``layer``'s window and soft-cap are: ``(window, softcap)``.

    The window is FlashAttention's ``(left, right)``: ``(w - 1, 0)`` for a sliding window of
    ``w`` tokens, ``(-1, -1)`` for none (vLLM's ``FlashAttentionImpl``); a model with
    ``layer_types`` gets its window on the ``sliding_attention`` layers only (Gemma-2,
    Llama's ``per_layer_sliding_window``). Either is None when the manifest does not record
    the model's attention config (traces made before it did).
    """
    cfg = run.extra.get("model_attention") if run is not None else None
    if not isinstance(cfg, dict) or not cfg:
        return None, None
    layer_types, idx = cfg.get("layer_types"), layer_index(layer)
    if isinstance(layer_types, list) and idx is not None and idx < len(layer_types):
        window = cfg.get("sliding_window") if layer_types[idx] == "sliding_attention" else None
    else:
        window = cfg.get("cache_sliding_window")
    softcap = cfg.get("attn_logit_softcapping")
    return ((-1, -1) if not window else (int(window) - 1, 0)), float(softcap or 0.0)


def _check_flags(record: StepRecord, spec: KVCacheSpec, run: RunInfo | None) -> MetadataCheck:
    f = Findings(record, "flags")
    model = run.model if run is not None else None
    notes: list[str] = []
    if model is not None and any(a.endswith(_DECODER_SUFFIXES) for a in model.architectures):
        f.checked += 1
        if not record.causal:
            f.add(f"causal is False, but {'/'.join(model.architectures)} is a decoder: attention must be causal")
    f.checked += 2
    if record.num_kv_heads != spec.num_kv_heads:
        f.add(f"num_kv_heads {record.num_kv_heads}, the KV cache holds {spec.num_kv_heads}")
    if record.head_size != spec.head_size:
        f.add(f"head_size {record.head_size}, the KV cache holds {spec.head_size}")
    if record.num_kv_heads > 0 and model is not None and model.num_kv_heads > 0:
        f.checked += 1
        group, model_group = record.num_heads / record.num_kv_heads, model.num_attention_heads / model.num_kv_heads
        if group != model_group:
            f.add(f"{group:g} query heads per KV head, the model has {model_group:g}")
    window = tuple(record.sliding_window) if record.sliding_window is not None else None
    expected_window, expected_softcap = expected_attention(run, record.layer)
    if expected_window is None:
        notes.append("the manifest does not record the model's window/soft-cap: window checked for form only")
        f.checked += 1
        if window is not None and window != (-1, -1) and not (window[0] >= 0 and window[1] in (0, -1)):
            f.add(f"sliding_window {window} is neither (-1, -1) nor (left, 0) of a causal window")
    else:
        f.checked += 2
        if window is None:
            notes.append("sliding_window not recorded")
        elif window != expected_window:
            f.add(f"sliding_window {window}, the model config says {expected_window}")
        softcap = record.logits_soft_cap or 0.0
        if softcap != expected_softcap:
            f.add(f"logits_soft_cap {softcap:g}, the model config says {expected_softcap:g}")
    return f.done("; ".join(notes))


def _check_groups(
    record: StepRecord, spec: KVCacheSpec, groups: TraceGroups | None, group_table: StepRecord | None
) -> MetadataCheck:
    f = Findings(record, "groups")
    group = groups.of_record(record) if groups is not None else None
    if groups is None or group is None:
        why = groups.source if groups is not None else "not recorded"
        return f.done(f"KV-cache group unknown ({why})")
    f.checked += 1
    if record.layer not in group.layer_names:
        f.add(f"the record names group {group.group}, whose layers do not include {record.layer}")
    if group_table is not None and group_table.block_table != record.block_table:
        f.checked += 1
        f.add(f"{record.layer} and {group_table.layer} are both in group {group.group} but read different block tables")
    notes = [f"group {group.group} ({group.kind}, {'recorded' if groups.recorded else 'inferred'})"]
    if group.kind != "sliding_window" or group.sliding_window is None:
        return f.done("; ".join(notes))
    keep = group.sliding_window - 1  # keys before position - keep are outside every window
    window = record.sliding_window
    f.checked += 1
    if window is None or window[0] < 0 or window[0] > keep:
        f.add(
            f"sliding_window {window}: reads further back than group {group.group} keeps blocks "
            f"({group.sliding_window} tokens, left {keep}): it would read outside its window"
        )
    bs, null = spec.block_size, groups.null_block
    dropped = 0
    for r, _first, q, seq_len in _rows(record):
        row = record.block_table[r] if r < len(record.block_table) else ()
        live_from = max(0, seq_len - q - keep)  # the first key any query of the row sees
        for j, block in enumerate(row[: _ceil_div(seq_len, bs)]):
            if block != null:
                continue
            if (j + 1) * bs <= live_from:
                dropped += 1
            elif record.kind == "request":
                f.checked += 1
                f.add(
                    f"logical block {j} (positions {j * bs}-{(j + 1) * bs - 1}) is the null block {null}, but the "
                    f"group's {group.sliding_window}-token window of this row's queries reads from "
                    f"position {live_from}",
                    r,
                    max(j * bs, live_from),
                )
    if dropped:
        notes.append(f"{dropped} block(s) before the window given back (null block {null})")
    return f.done("; ".join(notes))


def check_record(
    record: StepRecord,
    spec: KVCacheSpec,
    run: RunInfo | None = None,
    tokens: Tokens | None = None,
    groups: TraceGroups | None = None,
    group_table: StepRecord | None = None,
) -> tuple[MetadataCheck, ...]:
    """Every metadata check of one (step, layer), in :data:`METADATA_CHECKS` order.

    Args:
        record: the step's metadata (tensors are not read).
        spec: the trace's KV-cache spec (block size, pool size, heads).
        run: the manifest, for the model config; None checks what needs no model.
        tokens: request id -> tokens (:func:`tracer.format.requests.known_tokens`); None: prompts unknown.
        groups: the trace's KV-cache groups (:func:`tracer.format.groups.trace_groups`); None: unknown.
        group_table: another record of the same step and group, whose table this one must equal.
    """
    model_len = run.model.max_model_len if run is not None and run.model is not None else None
    return (
        _check_lengths(record, model_len),
        _check_slots(record, spec.block_size),
        _check_blocks(record, spec),
        _check_shared(record, spec.block_size, tokens),
        _check_flags(record, spec, run),
        _check_groups(record, spec, groups, group_table),
    )


def check_records(trace: Trace, records: Iterable[StepRecord]) -> tuple[MetadataCheck, ...]:
    """:func:`check_record` for each of ``records`` of ``trace``, prompts from its ``session.json``.

    A trace without a KV-cache spec in its manifest gets no metadata checks (nothing to
    hold the block ids against): the result is empty.

    A tensor-parallel trace adds a ``ranks`` check per record, and one per disagreement
    at a (step, layer) that has no joined record (a gap, a record rank 0 lacks) in a step of
    ``records``.
    """
    spec = trace.run.kv_cache
    if spec is None:
        return ()
    tokens = known_tokens(trace.read_json(SESSION))
    groups = trace_groups(trace)
    first: dict[tuple[int, int], StepRecord] = {}  # (step, group) -> the first record of that group
    records = list(records)
    out: list[MetadataCheck] = []
    for r in records:
        group = groups.of_record(r)
        key = (r.step, group.group) if group is not None else None
        other = first.setdefault(key, r) if key is not None else None
        out.extend(check_record(r, spec, trace.run, tokens, groups, other if other is not r else None))
    if trace.ranks:
        out.extend(rank_checks(trace, records))
    return tuple(out)
