"""What one step queues on the hot path: host copies of the metadata, record fields, tensor clones.

Called by ``tracer.hooks`` at the end of a runner step (metadata) and in ``forward`` (tensors);
nothing here waits for the device. A KV-cache group's four metadata tensors (``slot_mapping``,
``query_start_loc``, ``seq_lens``, the block-table columns read) cost one device-to-host copy
a step: :func:`pack_host_copies` packs them on the device into one int32 tensor, which one
non-blocking copy moves into a ring slot's pinned buffer (``tracer.ring.Slot``); the writer
thread cuts that buffer into the four host views before it reads them. Every CUDA call and
tensor operation here costs the engine's thread microseconds (a copy ~35 µs on the H200 under
vLLM), hence one copy, not four. On CPU (and for a dtype other than int32 / int64) each
tensor is copied on its own (``Slot.host``). Tensor clones stay on the device until the
writer thread (``tracer.sink``) takes them. The fields of a layer that never change (scale,
soft-cap, heads, the backend's window) are read once into its ``LayerStatic``.
"""

from __future__ import annotations

import functools
from typing import Any

from tracer.manifest import kv_layout_of
from tracer.pending import LayerStatic
from tracer.ring import Slot
from tracer.writelog import clone_read_blocks, columns_read, gather_written, geometry_of

__all__ = ["metadata_parts", "pack_host_copies", "queue_host_copies", "read_columns", "step_fields", "tensor_clones"]


def read_columns(md: Any, block_size: int) -> int:
    """Block-table columns the step of ``md`` reads (the same columns ``clone_read_blocks`` copies)."""
    return columns_read(md.block_table, int(md.max_seq_len), block_size)


def queue_host_copies(slot: Slot, md: Any, num_reqs: int, num_tokens: int, cols: int) -> dict[str, Any]:
    """Non-blocking copies of the step's metadata tensors into ``slot``; the host views they fill.

    One copy on CUDA (:func:`pack_host_copies`: the writer thread makes the views), one per
    tensor on CPU or for an unexpected dtype (the views are made here).
    """
    key = str(len(slot.payload["hosts"]))
    parts = metadata_parts(md, num_reqs, num_tokens, cols)
    if all(t.is_cuda for t in parts.values()):
        host = pack_host_copies(slot, key, parts, pin=True)
        if host is not None:
            return host
    return {name: slot.host(key + name, src) for name, src in parts.items()}


def metadata_parts(md: Any, num_reqs: int, num_tokens: int, cols: int) -> dict[str, Any]:
    """The step's rows of ``md``'s tensors (device views): what :func:`queue_host_copies` copies."""
    return {
        "query_start_loc": md.query_start_loc[: num_reqs + 1],
        "seq_lens": md.seq_lens[:num_reqs],
        "block_table": md.block_table[:num_reqs, :cols],
        "slot_mapping": md.slot_mapping[:num_tokens],
    }


def pack_host_copies(slot: Slot, name: str, parts: dict[str, Any], *, pin: bool) -> dict[str, Any] | None:
    """Queue ``parts`` (int32 / int64 tensors of one device) into ``slot`` with one copy.

    On their device one ``torch.cat`` packs the parts, flattened, into one int32 tensor (a
    non-contiguous part, a block-table slice, costs one more kernel to flatten). An int64 part
    travels as int32 pairs, so no value is narrowed; the int64 parts go first, so each starts at
    an even offset and its host view is a ``view(torch.int64)``. The packed tensor comes from the
    caching allocator: its memory is reused only by work queued after the copy out of it, on
    the same stream. One copy (non-blocking when ``pin``) moves it into the slot's host buffer
    ``name`` (pinned when ``pin``; reused, and grown when a step needs more).

    Returns a dict that :meth:`Slot.make_views` (the writer thread, before it reads them) fills
    with the host views, one per part, of its shape and dtype, in ``parts``' order; they hold
    the values once the slot's event has fired (at once without ``pin``). Making them is left
    to the writer because each tensor operation costs the engine's thread microseconds. None,
    with nothing queued, when a part is neither int32 nor int64.
    """
    import torch

    int32, int64 = torch.int32, torch.int64
    if any(t.dtype != int32 and t.dtype != int64 for t in parts.values()):
        return None
    order = sorted(parts, key=lambda k: parts[k].dtype != int64)  # stable: int64 first
    flat = []
    for k in order:
        src = parts[k]
        if src.dim() != 1:
            src = src.reshape(-1)  # a copy only when not contiguous (a block-table slice)
        if src.dtype == int64:  # as int32 pairs (torch.cat takes strided int32 parts as they are)
            src = (src if src.is_contiguous() else src.contiguous()).view(int32)
        flat.append(src)
    widths = [f.shape[0] for f in flat]
    total = sum(widths)
    host = slot.host_buffer(name, total, int32, pin=pin, sources=parts.values())[:total]
    host.copy_(torch.cat(flat), non_blocking=pin)
    views: dict[str, Any] = {}
    like = {k: (t.dtype, t.shape) for k, t in parts.items()}
    slot.view_makers.append(functools.partial(_fill_views, views, host, order, widths, like))
    return views


def _fill_views(views: dict[str, Any], host: Any, order: list[str], widths: list[int], like: dict) -> None:
    """``pack_host_copies``' host views, into ``views``: ``host`` cut at ``widths``, as ``like`` says."""
    import torch

    pieces = dict(zip(order, host.split(widths), strict=True))
    for k, (dtype, shape) in like.items():
        view = pieces[k].view(torch.int64) if dtype == torch.int64 else pieces[k]
        views[k] = view.view(shape) if len(shape) != 1 else view


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
