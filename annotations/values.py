"""Value texts for anchors: pure functions of a ``StepRecord`` and ``RunInfo``.

Each anchor (``annotations.anchors``) names its value function by key in
:data:`VALUE_FUNCTIONS`; :func:`value_for` calls it. A value is ``captured``,
``computed`` or ``static`` (``annotations.value_text``). The functions for code vLLM
0.26 runs live here; those for the legacy ``split_kv_cache`` it does not run are in
``annotations.legacy_values``; the view arithmetic they share (``TensorView``) is
``annotations.views``. Layouts are named and described by the registry
(``tracer.format.layouts``). Nothing here imports torch: it works on a machine that has
only the trace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from annotations.anchors import Anchor
from annotations.legacy_values import LEGACY_VALUE_FUNCTIONS, split_kv_cache_summary
from annotations.value_text import (
    COMPUTED_PREFIX,
    LIST_LIMIT,
    VALUE_KINDS,
    Value,
    ValueFn,
    fmt_list,
    needs_spec,
    needs_step,
)
from annotations.views import TensorView, ViewError, cache_view, fmt_tuple
from tracer.format import REGISTRY, KVCacheSpec, RunInfo, StepRecord
from tracer.format.layouts import LAYOUT_CPU, LAYOUT_CPU_AMX

__all__ = [
    "COMPUTED_PREFIX",
    "CPU_LAYOUTS",
    "LIST_LIMIT",
    "VALUE_FUNCTIONS",
    "VALUE_KINDS",
    "TensorView",
    "Value",
    "ViewError",
    "computed_slots",
    "cpu_region_text",
    "fmt_list",
    "split_kv_cache_summary",
    "step_independent",
    "token_positions",
    "value_for",
]


# --- step arithmetic -----------------------------------------------------------


def token_positions(record: StepRecord) -> list[list[int]]:
    """Per request: the positions of this step's query tokens (context ... seq_len - 1)."""
    return [list(range(s - q, s)) for s, q in zip(record.seq_lens, record.query_lens, strict=False)]


def computed_slots(record: StepRecord, block_size: int) -> list[list[int]]:
    """Per request: ``block_table[req, pos // bs] * bs + pos % bs`` for this step's tokens."""
    out = []
    for row, positions in zip(record.block_table, token_positions(record), strict=False):
        slots = []
        for pos in positions:
            index = pos // block_size
            slots.append(row[index] * block_size + pos % block_size if index < len(row) else -1)
        out.append(slots)
    return out


def request_label(rec: StepRecord, row: int) -> str:
    """A block-table row by its request id (``r<row>`` when the trace has none): ids survive reordering."""
    rid = rec.request_ids[row] if row < len(rec.request_ids) else ""
    return rid or f"r{row}"


def _per_request(lists: Sequence[Sequence[int | str]], rec: StepRecord, limit: int = 4) -> str:
    parts = []
    for i, values in enumerate(lists[:limit]):
        parts.append(f"{request_label(rec, i)}: {fmt_list(values, 8)}")
    if len(lists) > limit:
        parts.append(f"… +{len(lists) - limit} requests")
    return "; ".join(parts) if parts else "(no requests)"


def _blocks_written(record: StepRecord, block_size: int) -> list[int]:
    return sorted({s // block_size for s in record.slot_mapping if s >= 0})


# --- value functions -----------------------------------------------------------


@needs_spec
def _kv_cache_shape(rec, run, spec: KVCacheSpec) -> Value:
    shape = spec.backend_kv_cache_shape or spec.shape
    return Value(
        f"(num_blocks, num_kv_heads, block_size, 2*head_size) = {fmt_tuple(shape)}; "
        f"K is [..., :{spec.head_size}], V is [..., {spec.head_size}:]"
    )


@needs_spec
def _stride_order(rec, run, spec: KVCacheSpec) -> Value:
    if spec.backend_stride_order is None:
        order = "no stride order (backend keeps the logical order)"
    else:
        order = f"stride order {fmt_tuple(spec.backend_stride_order)}"
    return Value(f"{order} -> physical {spec.physical_order}; strides {fmt_tuple(spec.stride)} ({spec.layout})")


@needs_spec
def _flash_split(rec, run, spec: KVCacheSpec) -> Value:
    key, value = cache_view(spec).transpose(1, 2).split(spec.head_size, -1)[:2]
    return Value(
        f"(nb, bs, H, D): key_cache {key.describe()}; value_cache {value.describe()}",
        "computed",
    )


@needs_spec
def _cpu_view(rec, run, spec: KVCacheSpec) -> Value:
    nb, h, bs, _ = spec.shape
    try:
        v = cache_view(spec).view(nb, h, bs * 2, -1)
    except ViewError as exc:
        return Value(f"would fail: {exc}", "computed")
    return Value(f"(nb, H, 2*bs, D) {v.describe()}", "computed")


#: The CPU backend's packings, as the layout registry lists them: ``cpu`` (vec/vec16 ISAs)
#: and ``cpu_amx`` (AMX tiles).
CPU_LAYOUTS = tuple(name for name, layout in REGISTRY.items() if layout.backend == "CPUAttentionBackend")


def cpu_region_text(layout: str, block_size: int, head_size: int) -> str | None:
    """How the CPU kernel packs one (block, kv head) region in ``layout``; None for a non-CPU layout.

    The registry's geometry (``tracer.format.describe_layout``) with this run's sizes:
    ``cpu``: K transposed then V; ``cpu_amx``: both halves VNNI-packed in pairs of bf16
    for the AMX tile loads (``reference_impl.layouts.cpu_amx_to_kv``).
    """
    bs, d = block_size, head_size
    if layout == LAYOUT_CPU:
        return f"K^T [{d}][{bs}] in the key half, then V [{bs}][{d}] in the value half"
    if layout == LAYOUT_CPU_AMX:
        return (
            f"AMX-packed: K as [bs/16][D/2][16][2] = [{bs // 16}][{d // 2}][16][2] (token tile, dim pair, "
            f"token, dim in pair) in the key half, then V as [D/16][bs/2][16][2] = [{d // 16}][{bs // 2}][16][2] "
            "(dim tile, token pair, dim, token in pair) in the value half"
        )
    return None


@needs_spec
def _cpu_chunk(rec, run, spec: KVCacheSpec) -> Value:
    nb, h, bs, _ = spec.shape
    try:
        key, value = cache_view(spec).view(nb, h, bs * 2, -1).chunk(2, 2)
    except ViewError as exc:
        return Value(f"would fail: {exc}", "computed")
    text = f"key_cache {key.describe()}; value_cache {value.describe()}"
    region = cpu_region_text(spec.layout, bs, spec.head_size)
    if region is not None:
        # The views are only the halves; the element order inside them is the kernel's (the layout).
        text += f"; per (block, head) the kernel stores {region} ({spec.layout})"
    return Value(text, "computed")


@needs_step
def _num_actual_tokens(rec: StepRecord, run) -> Value:
    return Value(f"num_actual_tokens = {rec.num_actual_tokens}")


@needs_step
def _query_start_loc(rec: StepRecord, run) -> Value:
    return Value(f"query_start_loc = {fmt_list(rec.query_start_loc)} (query lens {fmt_list(rec.query_lens)})")


@needs_step
def _seq_lens(rec: StepRecord, run) -> Value:
    return Value(f"seq_lens = {fmt_list(rec.seq_lens)}")


@needs_step
def _max_query_len(rec: StepRecord, run) -> Value:
    return Value(f"max_query_len = {rec.max_query_len}")


@needs_step
def _max_seq_len(rec: StepRecord, run) -> Value:
    return Value(f"max_seq_len = {rec.max_seq_len}")


@needs_step
def _block_table(rec: StepRecord, run) -> Value:
    rows = [f"{request_label(rec, i)} {fmt_list(row, 8)}" for i, row in enumerate(rec.block_table[:4])]
    if len(rec.block_table) > 4:
        rows.append(f"… +{len(rec.block_table) - 4} rows")
    return Value(f"block_table ({rec.num_reqs} rows): " + "; ".join(rows))


@needs_step
def _sliding_window(rec: StepRecord, run) -> Value:
    window = rec.sliding_window
    if window is None:
        return Value("sliding_window = None -> self.sliding_window")
    note = " (no window)" if tuple(window) == (-1, -1) else ""
    return Value(f"window = {fmt_tuple(window)}{note}")


@needs_step
def _causal(rec: StepRecord, run) -> Value:
    return Value(f"causal = {rec.causal}")


@needs_step
def _use_cascade(rec: StepRecord, run) -> Value:
    return Value(f"use_cascade = {rec.use_cascade}")


@needs_step
def _fa_call(rec: StepRecord, run: RunInfo) -> Value:
    version = f"FA{run.flash_attn_version}" if run.flash_attn_version else "no FlashAttention in this run"
    return Value(
        f"{version}: q[:{rec.num_actual_tokens}] ({rec.num_heads} heads, {rec.num_kv_heads} KV heads, "
        f"D={rec.head_size}), "
        f"softmax_scale={rec.scale:.6g}, softcap={rec.logits_soft_cap:g}, num_splits={rec.num_splits}"
    )


@needs_step
def _cpu_call(rec: StepRecord, run: RunInfo) -> Value:
    return Value(
        f"query[:{rec.num_actual_tokens}], query_start_loc={fmt_list(rec.query_start_loc)}, "
        f"seq_lens={fmt_list(rec.seq_lens)}, causal={rec.causal}, scale={rec.scale:.6g}, "
        f"softcap={rec.logits_soft_cap:g}"
    )


def _write_text(rec: StepRecord, run: RunInfo) -> str:
    bs = run.kv_cache.block_size if run.kv_cache else 0
    blocks = f" -> blocks {fmt_list(_blocks_written(rec, bs))}" if bs else ""
    written = sum(1 for s in rec.slot_mapping if s >= 0)
    return (
        f"slot_mapping = {fmt_list(rec.slot_mapping)}{blocks}; key/value ({rec.num_actual_tokens}+, "
        f"{rec.num_kv_heads}, {rec.head_size}), {written} tokens written"
    )


@needs_step
def _slot_mapping_write(rec: StepRecord, run: RunInfo) -> Value:
    return Value(_write_text(rec, run))


@needs_step
def _cpu_forward_write(rec: StepRecord, run: RunInfo) -> Value:
    return Value(
        f"{_write_text(rec, run)}. The same slots were already written by do_kv_cache_update: the CPU backend "
        "sets forward_includes_kv_cache_update = False, and forward still gets key/value."
    )


@needs_step
def _layer_slot_mapping(rec: StepRecord, run: RunInfo) -> Value:
    return Value(f"slot_mapping[{rec.layer!r}] = {fmt_list(rec.slot_mapping)}")


@needs_step
def _layer_name(rec: StepRecord, run: RunInfo) -> Value:
    return Value(f"layer_name = {rec.layer!r}")


@needs_step
def _layer_and_slots(rec: StepRecord, run: RunInfo) -> Value:
    return Value(f"layer_name = {rec.layer!r}; {len(rec.slot_mapping)} slots")


@needs_step
def _kv_update_call(rec: StepRecord, run: RunInfo) -> Value:
    return Value(f"{run.attention_backend.rsplit('.', 1)[-1]}.do_kv_cache_update: {_write_text(rec, run)}")


@needs_step
def _forward_call(rec: StepRecord, run: RunInfo) -> Value:
    return Value(
        f"{run.attention_backend.rsplit('.', 1)[-1]}.forward: {rec.num_actual_tokens} tokens, "
        f"{rec.num_reqs} requests ({rec.kind} step)"
    )


@needs_step
def _slot_kernel_launch(rec: StepRecord, run: RunInfo) -> Value:
    bs = run.kv_cache.block_size if run.kv_cache else "?"
    return Value(
        f"grid = (num_reqs + 1,) = ({rec.num_reqs + 1},): one program per request, the last pads; block_size = {bs}"
    )


def _with_bs(fn: Callable[[StepRecord, int], Value]) -> ValueFn:
    @needs_step
    def wrapped(rec: StepRecord, run: RunInfo) -> Value | None:
        if run.kv_cache is None:
            return Value("no KV-cache spec in this trace", "static")
        return fn(rec, run.kv_cache.block_size)

    wrapped.__name__ = fn.__name__
    wrapped.__doc__ = fn.__doc__
    return wrapped


@_with_bs
def _slot_block_indices(rec: StepRecord, bs: int) -> Value:
    lists = [[p // bs for p in positions] for positions in token_positions(rec)]
    return Value(f"pos // {bs}: {_per_request(lists, rec)}", "computed")


@_with_bs
def _slot_block_numbers(rec: StepRecord, bs: int) -> Value:
    lists = []
    for row, positions in zip(rec.block_table, token_positions(rec), strict=False):
        lists.append([row[p // bs] if p // bs < len(row) else "?" for p in positions])
    return Value(f"block_table[req, pos // {bs}]: {_per_request(lists, rec)}", "computed")


@_with_bs
def _slot_offsets(rec: StepRecord, bs: int) -> Value:
    lists = [[p % bs for p in positions] for positions in token_positions(rec)]
    return Value(f"pos % {bs}: {_per_request(lists, rec)}", "computed")


@_with_bs
def _slot_ids(rec: StepRecord, bs: int) -> Value:
    per_req = computed_slots(rec, bs)
    flat = [s for slots in per_req for s in slots]
    captured = list(rec.slot_mapping[: len(flat)])
    if flat == captured:
        check = "matches the captured slot_mapping"
    else:
        first = next(
            (i for i, (a, b) in enumerate(zip(flat, captured, strict=False)) if a != b), min(len(flat), len(captured))
        )
        check = f"differs from the captured slot_mapping at token {first}"
    return Value(f"slot = block * {bs} + offset: {_per_request(per_req, rec)} ({check})", "computed")


#: value key (``Anchor.value``) -> function ``(record or None, run) -> Value or None``.
VALUE_FUNCTIONS: dict[str, ValueFn] = {
    "kv_cache_shape": _kv_cache_shape,
    "stride_order": _stride_order,
    "flash_split": _flash_split,
    "cpu_view": _cpu_view,
    "cpu_chunk": _cpu_chunk,
    **LEGACY_VALUE_FUNCTIONS,
    "num_actual_tokens": _num_actual_tokens,
    "query_start_loc": _query_start_loc,
    "seq_lens": _seq_lens,
    "max_query_len": _max_query_len,
    "max_seq_len": _max_seq_len,
    "block_table": _block_table,
    "sliding_window": _sliding_window,
    "causal": _causal,
    "use_cascade": _use_cascade,
    "fa_call": _fa_call,
    "cpu_call": _cpu_call,
    "slot_mapping_write": _slot_mapping_write,
    "cpu_forward_write": _cpu_forward_write,
    "layer_slot_mapping": _layer_slot_mapping,
    "layer_name": _layer_name,
    "layer_and_slots": _layer_and_slots,
    "kv_update_call": _kv_update_call,
    "forward_call": _forward_call,
    "slot_kernel_launch": _slot_kernel_launch,
    "slot_block_indices": _slot_block_indices,
    "slot_block_numbers": _slot_block_numbers,
    "slot_offsets": _slot_offsets,
    "slot_ids": _slot_ids,
}


def value_for(anchor: Anchor, record: StepRecord | None, run: RunInfo) -> Value | None:
    """The value to show at ``anchor`` for ``record`` (None: nothing to show without a step)."""
    fn = VALUE_FUNCTIONS.get(anchor.value)
    if fn is None:
        return Value(f"no value function {anchor.value!r}", "static")
    return fn(record, run)


def step_independent(anchor: Anchor, run: RunInfo) -> bool:
    """Whether the anchor's value is the same at every step (depends on the run only)."""
    fn = VALUE_FUNCTIONS.get(anchor.value)
    return fn is not None and fn(None, run) is not None
