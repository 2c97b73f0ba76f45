"""What one step queues on the hot path: host copies of the metadata, record fields, tensor clones.

Called by ``tracer.hooks`` at the end of a runner step (metadata) and in ``forward`` (tensors);
nothing here waits for the device. Copies go into a ring slot's pinned buffers
(``tracer.ring.Slot.host``); tensor clones stay on the device until the writer thread
(``tracer.sink``) takes them. The fields of a layer that never change (scale, soft-cap, heads,
the backend's window) are read once into its ``LayerStatic``.
"""

from __future__ import annotations

from typing import Any

from tracer.manifest import kv_layout_of
from tracer.pending import LayerStatic
from tracer.ring import Slot
from tracer.writelog import clone_read_blocks, columns_read, gather_written, geometry_of

__all__ = ["queue_host_copies", "read_columns", "step_fields", "tensor_clones"]


def read_columns(md: Any, block_size: int) -> int:
    """Block-table columns the step of ``md`` reads (the same columns ``clone_read_blocks`` copies)."""
    return columns_read(md.block_table, int(md.max_seq_len), block_size)


def queue_host_copies(slot: Slot, md: Any, num_reqs: int, num_tokens: int, cols: int) -> dict[str, Any]:
    """Non-blocking copies of the step's metadata tensors into ``slot``; the host views they fill."""
    key = str(len(slot.payload["hosts"]))
    return {
        "query_start_loc": slot.host(key + "qsl", md.query_start_loc[: num_reqs + 1]),
        "seq_lens": slot.host(key + "sl", md.seq_lens[:num_reqs]),
        "block_table": slot.host(key + "bt", md.block_table[:num_reqs, :cols]),
        "slot_mapping": slot.host(key + "sm", md.slot_mapping[:num_tokens]),
    }


def _static_fields(static: LayerStatic) -> dict[str, Any]:
    """The layer's fields that no step changes, read from its impl once."""
    fields = static.fields
    if fields is None:
        impl = static.impl
        window = getattr(impl, "sliding_window", None)
        if isinstance(window, int):  # the CPU backend keeps one int, -1 = none
            window = (-1, -1) if window < 0 else (window - 1, 0)
        fields = static.fields = {
            "sliding_window": tuple(int(w) for w in window) if window is not None else None,
            "logits_soft_cap": float(getattr(impl, "logits_soft_cap", 0) or 0),
            "scale": float(impl.scale),
            "num_heads": int(impl.num_heads),
            "num_kv_heads": int(impl.num_kv_heads),
            "head_size": int(impl.head_size),
        }
    return fields


def step_fields(static: LayerStatic, md: Any, num_tokens: int, cudagraph: str, padded: int | None) -> dict[str, Any]:
    """``StepRecord`` fields of one layer's step, as Python numbers (no tensor is read)."""
    fields = dict(_static_fields(static))
    window = getattr(md, "sliding_window", None)
    if window is not None:  # the metadata's own window wins over the impl's
        fields["sliding_window"] = tuple(int(w) for w in window)
    causal = getattr(md, "causal", True)
    fields.update(
        num_actual_tokens=num_tokens,
        max_query_len=int(md.max_query_len),
        max_seq_len=int(md.max_seq_len),
        causal=bool(causal) if not hasattr(causal, "shape") else True,
        use_cascade=bool(getattr(md, "use_cascade", False)),
        num_splits=int(getattr(md, "max_num_splits", 0) or 0),
        cudagraph=cudagraph,
        padded_tokens=padded if padded is not None else num_tokens,
    )
    return fields


def tensor_clones(
    static: LayerStatic, query: Any, md: Any, output: Any, kv_in: dict[str, Any], n: int, num_reqs: int
) -> dict[str, Any]:
    """Device-side clones for a tensor step, taken after the cache write (no host sync).

    ``kv_in``: what ``do_kv_cache_update`` saw (its ``slot_mapping``, and ``key``/``value`` clones);
    ``n`` / ``num_reqs``: the step's real tokens and requests (a full graph's metadata counts its padding).
    """
    slot_mapping = kv_in.get("slot_mapping")
    if slot_mapping is None:
        slot_mapping = md.slot_mapping[:n]
    if static.geometry is None:
        static.layout = static.layout or kv_layout_of(static.impl, static.kv_cache)
        static.geometry = geometry_of(static.kv_cache, static.layout)
    blocks, cols = clone_read_blocks(static.kv_cache, md.block_table, num_reqs, int(md.max_seq_len))
    tensors = {
        "query": query[:n].detach().clone(),
        "output": output[:n].detach().clone(),
        "written": gather_written(static.geometry, slot_mapping[:n], static.kv_cache.dtype),
        "read_blocks": blocks,
        "cols": cols,
    }
    for k in ("key", "value"):
        if k in kv_in:
            tensors[k] = kv_in[k]
    return tensors
