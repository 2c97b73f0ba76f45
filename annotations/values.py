"""Value texts for anchors: pure functions of a ``StepRecord`` and ``RunInfo``.

Three kinds of value (``Value.kind``):

``captured``
    read straight from the trace (``num_actual_tokens = 7``);
``computed``
    derived by pagedtrace from captured numbers, e.g. the strides a line's
    ``transpose``/``split``/``view`` gives for the captured cache. Texts of code
    that vLLM 0.26 does not run start with ``computed:``;
``static``
    an explanation that does not depend on the step.

The layout math below (``TensorView``) is torch's view arithmetic on
(shape, strides, offset) tuples in plain Python, so this module imports no
torch and works on a machine that has only the trace.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from annotations.anchors import Anchor
from tracer.format import KVCacheSpec, RunInfo, StepRecord

#: Value kinds, see the module docstring.
VALUE_KINDS = ("captured", "computed", "static")

#: Longest list printed in full; longer lists show their head and a count.
LIST_LIMIT = 16

#: Prefix of values for code vLLM 0.26 does not run (paged_attn.py).
COMPUTED_PREFIX = "computed: what this line gives for the captured cache: "


@dataclass(frozen=True)
class Value:
    """One anchor's value at one step."""

    text: str
    kind: str = "captured"  #: one of ``VALUE_KINDS``


# --- view arithmetic -----------------------------------------------------------


@dataclass(frozen=True)
class TensorView:
    """A strided view: shape, strides and storage offset, all in elements."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int = 0

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    def transpose(self, a: int, b: int) -> TensorView:
        """``tensor.transpose(a, b)``."""
        shape, stride = list(self.shape), list(self.stride)
        shape[a], shape[b] = shape[b], shape[a]
        stride[a], stride[b] = stride[b], stride[a]
        return TensorView(tuple(shape), tuple(stride), self.offset)

    def split(self, size: int, dim: int = -1) -> list[TensorView]:
        """``tensor.split(size, dim)``: equal pieces along ``dim``, last may be short."""
        dim %= len(self.shape)
        out = []
        for start in range(0, self.shape[dim], size):
            shape = list(self.shape)
            shape[dim] = min(size, self.shape[dim] - start)
            out.append(TensorView(tuple(shape), self.stride, self.offset + start * self.stride[dim]))
        return out

    def chunk(self, chunks: int, dim: int) -> list[TensorView]:
        """``tensor.chunk(chunks, dim)``."""
        dim %= len(self.shape)
        return self.split(-(-self.shape[dim] // chunks), dim)

    def select(self, dim: int, index: int) -> TensorView:
        """``tensor[index]`` along ``dim`` (drops the dimension)."""
        return TensorView(
            self.shape[:dim] + self.shape[dim + 1 :],
            self.stride[:dim] + self.stride[dim + 1 :],
            self.offset + index * self.stride[dim],
        )

    def view(self, *shape: int) -> TensorView:
        """``tensor.view(*shape)``; raises ``ViewError`` with torch's message when torch would."""
        new = list(shape)
        if new.count(-1) > 1:
            raise ViewError("only one dimension can be inferred")
        if -1 in new:
            known = math.prod(s for s in new if s != -1)
            if known == 0 or self.numel % known:
                raise ViewError(f"shape '{list(shape)}' is invalid for input of size {self.numel}")
            new[new.index(-1)] = self.numel // known
        if math.prod(new) != self.numel:
            raise ViewError(f"shape '{list(shape)}' is invalid for input of size {self.numel}")
        stride = _view_strides(self.shape, self.stride, tuple(new))
        if stride is None:
            raise ViewError(
                "view size is not compatible with input tensor's size and stride "
                "(at least one dimension spans across two contiguous subspaces)"
            )
        return TensorView(tuple(new), stride, self.offset)

    def describe(self) -> str:
        """``shape (a, b) strides (c, d)``, plus the offset when it is not 0."""
        text = f"shape {_tup(self.shape)} strides {_tup(self.stride)}"
        return text + (f" offset +{self.offset}" if self.offset else "")


class ViewError(ValueError):
    """``TensorView.view`` would fail in torch; the message is torch's."""


def _view_strides(old_shape: tuple[int, ...], old_stride: tuple[int, ...], new_shape: tuple[int, ...]):
    """Strides of ``view(new_shape)`` or None if not expressible (ATen ``computeStride``)."""
    if math.prod(old_shape) == 0:
        return None
    new_stride = [0] * len(new_shape)
    view_d = len(new_shape) - 1
    chunk_base_stride = old_stride[-1] if old_stride else 1
    tensor_numel = 1
    view_numel = 1
    for tensor_d in range(len(old_shape) - 1, -1, -1):
        tensor_numel *= old_shape[tensor_d]
        if tensor_d == 0 or (
            old_shape[tensor_d - 1] != 1 and old_stride[tensor_d - 1] != tensor_numel * chunk_base_stride
        ):
            while view_d >= 0 and (view_numel < tensor_numel or new_shape[view_d] == 1):
                new_stride[view_d] = view_numel * chunk_base_stride
                view_numel *= new_shape[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if tensor_d > 0:
                chunk_base_stride = old_stride[tensor_d - 1]
                tensor_numel = 1
                view_numel = 1
    if view_d != -1:
        return None
    return tuple(new_stride)


def cache_view(spec: KVCacheSpec) -> TensorView:
    """One layer's captured ``kv_cache`` tensor as a ``TensorView``."""
    return TensorView(tuple(spec.shape), tuple(spec.stride))


# --- formatting ----------------------------------------------------------------


def _tup(values: Sequence[int]) -> str:
    return "(" + ", ".join(str(v) for v in values) + ("," if len(values) == 1 else "") + ")"


def fmt_list(values: Sequence, limit: int = LIST_LIMIT) -> str:
    """``[1, 2, 3]``; longer than ``limit``: the first ``limit`` items and ``… +N more``."""
    items = [fmt_list(v, limit) if isinstance(v, (list, tuple)) else str(v) for v in values[:limit]]
    if len(values) > limit:
        items.append(f"… +{len(values) - limit} more")
    return "[" + ", ".join(items) + "]"


def token_positions(record: StepRecord) -> list[list[int]]:
    """Per request: the positions of this step's query tokens (context ... seq_len - 1)."""
    return [list(range(s - q, s)) for s, q in zip(record.seq_lens, record.query_lens)]


def computed_slots(record: StepRecord, block_size: int) -> list[list[int]]:
    """Per request: ``block_table[req, pos // bs] * bs + pos % bs`` for this step's tokens."""
    out = []
    for row, positions in zip(record.block_table, token_positions(record)):
        slots = []
        for pos in positions:
            index = pos // block_size
            slots.append(row[index] * block_size + pos % block_size if index < len(row) else -1)
        out.append(slots)
    return out


def _per_request(lists: Sequence[Sequence[int]], limit: int = 4) -> str:
    parts = []
    for i, values in enumerate(lists[:limit]):
        parts.append(f"r{i}: {fmt_list(values, 8)}")
    if len(lists) > limit:
        parts.append(f"… +{len(lists) - limit} requests")
    return "; ".join(parts) if parts else "(no requests)"


def _blocks_written(record: StepRecord, block_size: int) -> list[int]:
    return sorted({s // block_size for s in record.slot_mapping if s >= 0})


# --- value functions -----------------------------------------------------------

_Fn = Callable[[StepRecord | None, RunInfo], "Value | None"]


def _needs_spec(fn: Callable[[StepRecord | None, RunInfo, KVCacheSpec], Value | None]) -> _Fn:
    def wrapped(rec: StepRecord | None, run: RunInfo) -> Value | None:
        if run.kv_cache is None:
            return Value("no KV-cache spec in this trace", "static")
        return fn(rec, run, run.kv_cache)

    wrapped.__name__ = fn.__name__
    wrapped.__doc__ = fn.__doc__
    return wrapped


def _needs_step(fn: Callable[[StepRecord, RunInfo], Value | None]) -> _Fn:
    def wrapped(rec: StepRecord | None, run: RunInfo) -> Value | None:
        return None if rec is None else fn(rec, run)

    wrapped.__name__ = fn.__name__
    wrapped.__doc__ = fn.__doc__
    return wrapped


@_needs_spec
def _kv_cache_shape(rec, run, spec: KVCacheSpec) -> Value:
    shape = spec.backend_kv_cache_shape or spec.shape
    return Value(
        f"(num_blocks, num_kv_heads, block_size, 2*head_size) = {_tup(shape)}; "
        f"K is [..., :{spec.head_size}], V is [..., {spec.head_size}:]"
    )


@_needs_spec
def _stride_order(rec, run, spec: KVCacheSpec) -> Value:
    if spec.backend_stride_order is None:
        order = "no stride order (backend keeps the logical order)"
    else:
        order = f"stride order {_tup(spec.backend_stride_order)}"
    return Value(f"{order} -> physical {spec.physical_order}; strides {_tup(spec.stride)} ({spec.layout})")


@_needs_spec
def _flash_split(rec, run, spec: KVCacheSpec) -> Value:
    key, value = cache_view(spec).transpose(1, 2).split(spec.head_size, -1)[:2]
    return Value(
        f"(nb, bs, H, D): key_cache {key.describe()}; value_cache {value.describe()}",
        "computed",
    )


@_needs_spec
def _cpu_view(rec, run, spec: KVCacheSpec) -> Value:
    nb, h, bs, _ = spec.shape
    try:
        v = cache_view(spec).view(nb, h, bs * 2, -1)
    except ViewError as exc:
        return Value(f"would fail: {exc}", "computed")
    return Value(f"(nb, H, 2*bs, D) {v.describe()}", "computed")


#: The CPU backend's two packings (``tracer.format.layouts``): vec/vec16 ISAs, and AMX tiles.
CPU_LAYOUTS = ("cpu", "cpu_amx")


def cpu_region_text(layout: str, block_size: int, head_size: int) -> str | None:
    """How the CPU kernel packs one (block, kv head) region in ``layout``; None for a non-CPU layout.

    ``cpu``: K transposed then V; ``cpu_amx``: both halves VNNI-packed in pairs of bf16
    for the AMX tile loads (``reference_impl.layouts.cpu_amx_to_kv``).
    """
    bs, d = block_size, head_size
    if layout == "cpu":
        return f"K^T [{d}][{bs}] in the key half, then V [{bs}][{d}] in the value half"
    if layout == "cpu_amx":
        return (
            f"AMX-packed: K as [bs/16][D/2][16][2] = [{bs // 16}][{d // 2}][16][2] (token tile, dim pair, "
            f"token, dim in pair) in the key half, then V as [D/16][bs/2][16][2] = [{d // 16}][{bs // 2}][16][2] "
            "(dim tile, token pair, dim, token in pair) in the value half"
        )
    return None


@_needs_spec
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


def _split_not_called(rec, run) -> Value:
    return Value(
        "not called by vLLM 0.26's FlashAttention or CPU backend (ROCm / legacy only); it expects the "
        "legacy (2, num_blocks, ...) cache. The values below are computed for the captured cache.",
        "static",
    )


@_needs_spec
def _split_x(rec, run, spec: KVCacheSpec) -> Value:
    es = spec.element_size
    return Value(f"{COMPUTED_PREFIX}x = 16 // {es} = {16 // es} (element size {es} B, {spec.dtype})", "computed")


@_needs_spec
def _split_num_blocks(rec, run, spec: KVCacheSpec) -> Value:
    return Value(
        f"{COMPUTED_PREFIX}num_blocks = kv_cache.shape[1] = {spec.shape[1]}: on the 0.26 cache dim 1 is "
        f"num_kv_heads, not the {spec.num_blocks} blocks",
        "computed",
    )


def _index_text(spec: KVCacheSpec, index: int, what: str) -> str:
    view = cache_view(spec).select(0, index)
    return (
        f"{COMPUTED_PREFIX}kv_cache[{index}] is block {index}"
        f"{' (the null block)' if index == 0 else ''}, not {what}: (H, bs, 2D) {view.describe()}"
    )


@_needs_spec
def _split_key_index(rec, run, spec: KVCacheSpec) -> Value:
    return Value(_index_text(spec, 0, '"all keys"'), "computed")


@_needs_spec
def _split_value_index(rec, run, spec: KVCacheSpec) -> Value:
    return Value(_index_text(spec, 1, '"all values"'), "computed")


def _legacy_view(spec: KVCacheSpec, index: int, shape: tuple[int, ...], shown: str, meant: str) -> Value:
    try:
        view = cache_view(spec).select(0, index).view(*shape)
    except ViewError as exc:
        return Value(
            f"{COMPUTED_PREFIX}{shown} would fail in torch (RuntimeError: {exc}): block {index}'s "
            f"(H, bs, 2D) strides {_tup(cache_view(spec).stride[1:])} cannot be viewed as {meant}, so the "
            "legacy split does not even run on this cache",
            "computed",
        )
    return Value(
        f"{COMPUTED_PREFIX}{shown} gives {view.describe()}: only block {index}'s "
        f"{view.numel} elements relabelled as {meant}; dim 0 (meant as num_blocks) walks block {index}'s "
        f"{spec.shape[1]} heads: nonsense, not the cache",
        "computed",
    )


@_needs_spec
def _split_key_view(rec, run, spec: KVCacheSpec) -> Value:
    x = 16 // spec.element_size
    shape = (spec.shape[1], spec.num_kv_heads, spec.head_size // x, -1, x)
    return _legacy_view(spec, 0, shape, f"view{_tup(shape)}", f"(num_blocks, H, D/{x}, bs, {x}) keys")


@_needs_spec
def _split_value_view(rec, run, spec: KVCacheSpec) -> Value:
    shape = (spec.shape[1], spec.num_kv_heads, spec.head_size, -1)
    return _legacy_view(spec, 1, shape, f"view{_tup(shape)}", "(num_blocks, H, D, bs) values")


def split_kv_cache_summary(spec: KVCacheSpec) -> str:
    """One plain sentence: what ``PagedAttention.split_kv_cache`` would make of the captured cache."""
    x = 16 // spec.element_size
    views = []
    for index, shape in ((0, (spec.shape[1], spec.num_kv_heads, spec.head_size // x, -1, x)),
                         (1, (spec.shape[1], spec.num_kv_heads, spec.head_size, -1))):
        try:
            cache_view(spec).select(0, index).view(*shape)
        except ViewError:
            views.append(f"view{_tup(shape)} would fail in torch")
        else:
            views.append(f"view{_tup(shape)} would relabel block {index} alone")
    return (
        f"Had it been called on this run's cache {_tup(spec.shape)} {spec.dtype}: x = 16 // {spec.element_size} = "
        f"{x}; num_blocks = kv_cache.shape[1] = {spec.shape[1]} (that is num_kv_heads, not the {spec.num_blocks} "
        f"blocks); kv_cache[0] is block 0 and kv_cache[1] block 1, not all keys and all values; "
        f"{views[0]} and {views[1]}. The result would be nonsense: this code expects the legacy "
        "(2, num_blocks, ...) cache, which vLLM 0.26 no longer allocates."
    )


@_needs_step
def _legacy_write(rec: StepRecord, run) -> Value:
    return Value(
        "not called on 0.26; the 0.26 write path received slot_mapping = " + fmt_list(rec.slot_mapping),
        "captured",
    )


@_needs_step
def _num_actual_tokens(rec: StepRecord, run) -> Value:
    return Value(f"num_actual_tokens = {rec.num_actual_tokens}")


@_needs_step
def _query_start_loc(rec: StepRecord, run) -> Value:
    return Value(f"query_start_loc = {fmt_list(rec.query_start_loc)} (query lens {fmt_list(rec.query_lens)})")


@_needs_step
def _seq_lens(rec: StepRecord, run) -> Value:
    return Value(f"seq_lens = {fmt_list(rec.seq_lens)}")


@_needs_step
def _max_query_len(rec: StepRecord, run) -> Value:
    return Value(f"max_query_len = {rec.max_query_len}")


@_needs_step
def _max_seq_len(rec: StepRecord, run) -> Value:
    return Value(f"max_seq_len = {rec.max_seq_len}")


@_needs_step
def _block_table(rec: StepRecord, run) -> Value:
    rows = [f"r{i} {fmt_list(row, 8)}" for i, row in enumerate(rec.block_table[:4])]
    if len(rec.block_table) > 4:
        rows.append(f"… +{len(rec.block_table) - 4} rows")
    return Value(f"block_table ({rec.num_reqs} rows): " + "; ".join(rows))


@_needs_step
def _sliding_window(rec: StepRecord, run) -> Value:
    window = rec.sliding_window
    if window is None:
        return Value("sliding_window = None -> self.sliding_window")
    note = " (no window)" if tuple(window) == (-1, -1) else ""
    return Value(f"window = {_tup(window)}{note}")


@_needs_step
def _causal(rec: StepRecord, run) -> Value:
    return Value(f"causal = {rec.causal}")


@_needs_step
def _use_cascade(rec: StepRecord, run) -> Value:
    return Value(f"use_cascade = {rec.use_cascade}")


@_needs_step
def _fa_call(rec: StepRecord, run: RunInfo) -> Value:
    version = f"FA{run.flash_attn_version}" if run.flash_attn_version else "no FlashAttention in this run"
    return Value(
        f"{version}: q[:{rec.num_actual_tokens}] ({rec.num_heads} heads, {rec.num_kv_heads} KV heads, D={rec.head_size}), "
        f"softmax_scale={rec.scale:.6g}, softcap={rec.logits_soft_cap:g}, num_splits={rec.num_splits}"
    )


@_needs_step
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


@_needs_step
def _slot_mapping_write(rec: StepRecord, run: RunInfo) -> Value:
    return Value(_write_text(rec, run))


@_needs_step
def _cpu_forward_write(rec: StepRecord, run: RunInfo) -> Value:
    return Value(
        f"{_write_text(rec, run)}. The same slots were already written by do_kv_cache_update: the CPU backend "
        "sets forward_includes_kv_cache_update = False, and forward still gets key/value."
    )


@_needs_step
def _layer_slot_mapping(rec: StepRecord, run: RunInfo) -> Value:
    return Value(f"slot_mapping[{rec.layer!r}] = {fmt_list(rec.slot_mapping)}")


@_needs_step
def _layer_name(rec: StepRecord, run: RunInfo) -> Value:
    return Value(f"layer_name = {rec.layer!r}")


@_needs_step
def _layer_and_slots(rec: StepRecord, run: RunInfo) -> Value:
    return Value(f"layer_name = {rec.layer!r}; {len(rec.slot_mapping)} slots")


@_needs_step
def _kv_update_call(rec: StepRecord, run: RunInfo) -> Value:
    return Value(f"{run.attention_backend.rsplit('.', 1)[-1]}.do_kv_cache_update: {_write_text(rec, run)}")


@_needs_step
def _forward_call(rec: StepRecord, run: RunInfo) -> Value:
    return Value(
        f"{run.attention_backend.rsplit('.', 1)[-1]}.forward: {rec.num_actual_tokens} tokens, "
        f"{rec.num_reqs} requests ({rec.kind} step)"
    )


@_needs_step
def _slot_kernel_launch(rec: StepRecord, run: RunInfo) -> Value:
    bs = run.kv_cache.block_size if run.kv_cache else "?"
    return Value(
        f"grid = (num_reqs + 1,) = ({rec.num_reqs + 1},): one program per request, the last pads; "
        f"block_size = {bs}"
    )


def _with_bs(fn: Callable[[StepRecord, int], Value]) -> _Fn:
    @_needs_step
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
    return Value(f"pos // {bs}: {_per_request(lists)}", "computed")


@_with_bs
def _slot_block_numbers(rec: StepRecord, bs: int) -> Value:
    lists = []
    for row, positions in zip(rec.block_table, token_positions(rec)):
        lists.append([row[p // bs] if p // bs < len(row) else "?" for p in positions])
    return Value(f"block_table[req, pos // {bs}]: {_per_request(lists)}", "computed")


@_with_bs
def _slot_offsets(rec: StepRecord, bs: int) -> Value:
    lists = [[p % bs for p in positions] for positions in token_positions(rec)]
    return Value(f"pos % {bs}: {_per_request(lists)}", "computed")


@_with_bs
def _slot_ids(rec: StepRecord, bs: int) -> Value:
    per_req = computed_slots(rec, bs)
    flat = [s for slots in per_req for s in slots]
    captured = list(rec.slot_mapping[: len(flat)])
    if flat == captured:
        check = "matches the captured slot_mapping"
    else:
        first = next((i for i, (a, b) in enumerate(zip(flat, captured)) if a != b), min(len(flat), len(captured)))
        check = f"differs from the captured slot_mapping at token {first}"
    return Value(f"slot = block * {bs} + offset: {_per_request(per_req)} ({check})", "computed")


#: value key (``Anchor.value``) -> function ``(record or None, run) -> Value or None``.
VALUE_FUNCTIONS: dict[str, _Fn] = {
    "kv_cache_shape": _kv_cache_shape,
    "stride_order": _stride_order,
    "flash_split": _flash_split,
    "cpu_view": _cpu_view,
    "cpu_chunk": _cpu_chunk,
    "split_not_called": _split_not_called,
    "split_x": _split_x,
    "split_num_blocks": _split_num_blocks,
    "split_key_index": _split_key_index,
    "split_key_view": _split_key_view,
    "split_value_index": _split_value_index,
    "split_value_view": _split_value_view,
    "legacy_write": _legacy_write,
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
