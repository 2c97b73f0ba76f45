"""Values for the legacy ``PagedAttention.split_kv_cache`` (``vllm/v1/attention/ops/paged_attn.py``).

vLLM 0.26's FlashAttention and CPU backends never call this code: it expects the legacy
``(2, num_blocks, ...)`` cache (the registry's ``legacy`` layout, ``tracer.format.layouts``).
Each value says what the line *would* give for the captured cache (``COMPUTED_PREFIX``),
worked out with ``annotations.views``: block 0 and block 1 where "all keys" and "all values"
are meant, views torch would refuse.
"""

from __future__ import annotations

from annotations.value_text import COMPUTED_PREFIX, Value, ValueFn, fmt_list, needs_spec, needs_step
from annotations.views import ViewError, cache_view, fmt_tuple
from tracer.format import KVCacheSpec, StepRecord

__all__ = ["LEGACY_VALUE_FUNCTIONS", "split_kv_cache_summary"]


def _split_not_called(rec, run) -> Value:
    return Value(
        "not called by vLLM 0.26's FlashAttention or CPU backend (ROCm / legacy only); it expects the "
        "legacy (2, num_blocks, ...) cache. The values below are computed for the captured cache.",
        "static",
    )


@needs_spec
def _split_x(rec, run, spec: KVCacheSpec) -> Value:
    es = spec.element_size
    return Value(f"{COMPUTED_PREFIX}x = 16 // {es} = {16 // es} (element size {es} B, {spec.dtype})", "computed")


@needs_spec
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


@needs_spec
def _split_key_index(rec, run, spec: KVCacheSpec) -> Value:
    return Value(_index_text(spec, 0, '"all keys"'), "computed")


@needs_spec
def _split_value_index(rec, run, spec: KVCacheSpec) -> Value:
    return Value(_index_text(spec, 1, '"all values"'), "computed")


def _legacy_view(spec: KVCacheSpec, index: int, shape: tuple[int, ...], shown: str, meant: str) -> Value:
    try:
        view = cache_view(spec).select(0, index).view(*shape)
    except ViewError as exc:
        return Value(
            f"{COMPUTED_PREFIX}{shown} would fail in torch (RuntimeError: {exc}): block {index}'s "
            f"(H, bs, 2D) strides {fmt_tuple(cache_view(spec).stride[1:])} cannot be viewed as {meant}, so the "
            "legacy split does not even run on this cache",
            "computed",
        )
    return Value(
        f"{COMPUTED_PREFIX}{shown} gives {view.describe()}: only block {index}'s "
        f"{view.numel} elements relabelled as {meant}; dim 0 (meant as num_blocks) walks block {index}'s "
        f"{spec.shape[1]} heads: nonsense, not the cache",
        "computed",
    )


@needs_spec
def _split_key_view(rec, run, spec: KVCacheSpec) -> Value:
    x = 16 // spec.element_size
    shape = (spec.shape[1], spec.num_kv_heads, spec.head_size // x, -1, x)
    return _legacy_view(spec, 0, shape, f"view{fmt_tuple(shape)}", f"(num_blocks, H, D/{x}, bs, {x}) keys")


@needs_spec
def _split_value_view(rec, run, spec: KVCacheSpec) -> Value:
    shape = (spec.shape[1], spec.num_kv_heads, spec.head_size, -1)
    return _legacy_view(spec, 1, shape, f"view{fmt_tuple(shape)}", "(num_blocks, H, D, bs) values")


def split_kv_cache_summary(spec: KVCacheSpec) -> str:
    """One plain sentence: what ``PagedAttention.split_kv_cache`` would make of the captured cache."""
    x = 16 // spec.element_size
    views = []
    for index, shape in (
        (0, (spec.shape[1], spec.num_kv_heads, spec.head_size // x, -1, x)),
        (1, (spec.shape[1], spec.num_kv_heads, spec.head_size, -1)),
    ):
        try:
            cache_view(spec).select(0, index).view(*shape)
        except ViewError:
            views.append(f"view{fmt_tuple(shape)} would fail in torch")
        else:
            views.append(f"view{fmt_tuple(shape)} would relabel block {index} alone")
    return (
        f"Had it been called on this run's cache {fmt_tuple(spec.shape)} {spec.dtype}: x = 16 // {spec.element_size} = "
        f"{x}; num_blocks = kv_cache.shape[1] = {spec.shape[1]} (that is num_kv_heads, not the {spec.num_blocks} "
        f"blocks); kv_cache[0] is block 0 and kv_cache[1] block 1, not all keys and all values; "
        f"{views[0]} and {views[1]}. The result would be nonsense: this code expects the legacy "
        "(2, num_blocks, ...) cache, which vLLM 0.26 no longer allocates."
    )


@needs_step
def _legacy_write(rec: StepRecord, run) -> Value:
    return Value(
        "not called on 0.26; the 0.26 write path received slot_mapping = " + fmt_list(rec.slot_mapping),
        "captured",
    )


#: value key (``Anchor.value``) -> function, for the ``paged_attn.py`` anchors.
LEGACY_VALUE_FUNCTIONS: dict[str, ValueFn] = {
    "split_not_called": _split_not_called,
    "split_x": _split_x,
    "split_num_blocks": _split_num_blocks,
    "split_key_index": _split_key_index,
    "split_key_view": _split_key_view,
    "split_value_index": _split_value_index,
    "split_value_view": _split_value_view,
    "legacy_write": _legacy_write,
}
