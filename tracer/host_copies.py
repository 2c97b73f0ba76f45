"""What one step queues on the hot path: host copies of the metadata, record fields, tensor clones.

Called by ``tracer.install`` at the end of a runner step (metadata) and in ``forward`` (tensors);
nothing here waits for the device. A KV-cache group's four metadata tensors (``slot_mapping``,
``query_start_loc``, ``seq_lens``, the block-table columns read) cost one device-to-host copy
a step: :func:`pack_host_copies` packs them on the device into one int32 tensor, which one
non-blocking copy moves into a pinned host buffer: a stretch of the memory the record writer
process maps (``tracer.shared_host``), so the message to it names the place, or else the ring
slot's own buffer (``tracer.handover.Slot``), whose bytes the message carries; a tensor trace's
writer thread cuts it into the four host views before it reads them. Every CUDA call and tensor operation here costs the
engine's thread microseconds (a copy ~35 µs on the H200 under vLLM), hence one copy, not
four, and a metadata step's tensors copied as the runner gave them when they are small (no
slicing on the engine's thread, no kernel to flatten a column slice; the writer keeps the
step's rows). A CPU engine takes the same path without pinning; a dtype other than
int32 / int64 is copied tensor by tensor (``Slot.host``). Tensor clones stay on the device
until the writer thread (``tracer.record_writer``) takes them. The fields of a layer that never change
(scale, soft-cap, heads, the backend's window) are read once into its ``LayerStatic``; the
fields of a step's metadata are read once for the layers that share it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tracer.handover import Slot
from tracer.layer_capture import LayerStatic
from tracer.manifest import kv_layout_of
from tracer.shared_host import SharedHost
from tracer.writelog import clone_read_blocks, columns_read, gather_written, geometry_of

__all__ = [
    "AS_GIVEN_MAX",
    "Packed",
    "PackedViews",
    "forget_plans",
    "layer_fields",
    "metadata_parts",
    "pack_host_copies",
    "queue_host_copies",
    "read_columns",
    "step_fields",
    "tensor_clones",
]

#: A metadata step copies its metadata tensors as the runner gave them (no slicing on the engine's
#: thread, no kernel to flatten a block-table column slice) while each holds at most this many
#: ids: 256 KiB of int32 at most, a few µs of the copy engine's time.
AS_GIVEN_MAX = 64 * 1024

#: Deferred copies on a CPU engine too (tests: the mirror is then host memory, moved by a plain
#: copy, so that a CPU run can show every deferred step reaches the record process). On CPU a
#: step's copy is otherwise packed straight into the shared memory (nothing to defer).
DEFER_ON_CPU = False


@dataclass
class Packed:
    """How one packed copy's host buffer is cut: its parts in buffer order, each ``width`` int32 wide."""

    host: Any  #: the int32 host tensor the copy fills (a view of the slot's buffer)
    order: tuple[str, ...]
    widths: tuple[int, ...]
    like: dict[str, tuple[Any, tuple[int, ...]]]  #: part -> (dtype, shape), in the caller's order
    trim: dict[str, int]  #: part -> leading rows its view keeps (all when absent)
    #: block-table columns the step reads, when the copy holds every column (``as_given``): the
    #: record process is sent these only (``tracer.record_process.host_message``)
    cols: int | None = None
    #: byte offset of ``host`` in the memory the record process maps (``tracer.shared_host``):
    #: the message names it instead of carrying the bytes; None: the slot's own buffer
    shared: int | None = None
    #: what the message makes of a copy cut this way, kept for the next step cut the same way
    #: (``tracer.record_process.host_message``); one per plan
    memo: dict[Any, Any] | None = None


class PackedViews(dict):
    """The host views of one packed copy: empty until the writer thread fills them (``Slot.make_views``).

    ``packed`` says how the buffer is cut, so that the writer can send the buffer to the record
    writer process as it is, without making any view (``tracer.record_process.host_message``).
    """

    packed: Packed

    def __call__(self) -> None:
        """Fill the views (``Slot.make_views`` calls it: one object a step, no ``functools.partial``)."""
        _fill_views(self)


def read_columns(md: Any, block_size: int) -> int:
    """Block-table columns the step of ``md`` reads (the same columns ``clone_read_blocks`` copies)."""
    return columns_read(md.block_table, int(md.max_seq_len), block_size)


def queue_host_copies(
    slot: Slot,
    md: Any,
    num_reqs: int,
    num_tokens: int,
    cols: int | None,
    *,
    as_given: bool = False,
    shared: SharedHost | None = None,
    block_size: int = 0,
    defer: bool = False,
) -> dict[str, Any]:
    """Copies of the step's metadata tensors into ``slot`` (non-blocking on CUDA); the host views they fill.

    One copy (:func:`pack_host_copies`: the writer thread makes the views, or sends the packed
    buffer as it is), on CUDA and CPU alike; one per tensor for an unexpected dtype (the views
    are made here). ``as_given``: copy the metadata's tensors as the runner gave them, when
    they are small (padded rows, every block-table column; see :func:`metadata_parts`), and
    leave the cutting to the step's rows to the writer: each slice is one more tensor operation
    on the engine's thread (~15 µs apiece on the H200 host under vLLM), the copy engine's few
    extra kilobytes cost it nothing. The views are the step's rows either way.

    ``shared``: the packed copy goes into a stretch of the memory the record writer process maps,
    when it has room (``SharedHost.take``); ``defer``: through its device mirror
    (:func:`pack_host_copies`). ``cols`` None: the block-table columns the step reads are worked
    out (``read_columns``, with ``block_size``) only where they are needed: to cut the table on
    the device, or to send fewer bytes from the slot's own buffer. A copy into shared memory
    needs them in neither way (the record process cuts every row to its blocks). A step whose
    four tensors are the memory, shapes and strides of an earlier step copied as given takes
    that step's plan at once (:data:`_STEADY`).
    """
    key = str(len(slot.payload["hosts"]))
    steady = None
    if as_given and shared is not None:
        # A decode step of a batch size seen before: the runner's tensors are views of the same
        # memory, shape and strides as an earlier step's, whose plan says the rest (they fit, how
        # they flatten). One flat key of a few attribute reads, no dicts, no slicing.
        bt, sm, sl, qs = md.block_table, md.slot_mapping, md.seq_lens, md.query_start_loc
        steady = (
            bt.data_ptr(), bt.shape, bt.stride(), bt.dtype,
            sm.data_ptr(), sm.shape, sm.stride(), sm.dtype,
            sl.data_ptr(), sl.shape, sl.stride(), sl.dtype,
            qs.data_ptr(), qs.shape, qs.stride(), qs.dtype,
        )  # fmt: skip
        plan = _STEADY.get(steady)
        if plan is not None:
            rows = {
                "query_start_loc": num_reqs + 1,
                "seq_lens": num_reqs,
                "block_table": num_reqs,
                "slot_mapping": num_tokens,
            }  # what metadata_parts says of tensors copied as given
            return _pack(slot, plan, plan.pin, rows, None, shared, defer, name=key)
    as_given = as_given and _fits_as_given(md)
    if cols is None and not (as_given and shared is not None):
        cols = read_columns(md, block_size)
    parts, trim = metadata_parts(md, num_reqs, num_tokens, cols or 0, as_given=as_given, checked=True)
    plan = _plan_of(parts)
    if plan is not None:
        if steady is not None and as_given and plan is _PLANS.get(plan.key):  # views of the runner's memory: kept
            if len(_STEADY) >= _PLANS_MAX:
                del _STEADY[next(iter(_STEADY))]
            _STEADY[steady] = plan
        return _pack(slot, plan, plan.pin, trim, cols if trim else None, shared, defer, name=key)
    views = {name: slot.host(key + name, src) for name, src in parts.items()}
    return {name: view[: trim[name]] for name, view in views.items()} if trim else views


def metadata_parts(
    md: Any, num_reqs: int, num_tokens: int, cols: int, *, as_given: bool = False, checked: bool = False
) -> tuple[dict[str, Any], dict[str, int] | None]:
    """``md``'s tensors to copy (device views), and the rows of each that are the step's.

    By default the step's rows themselves (no trim). ``as_given``: each tensor as ``md`` holds
    it (sized for the padded batch), every block-table column, with the number of leading rows
    that are the step's; a tensor larger than :data:`AS_GIVEN_MAX` elements is cut here as by
    default (``checked``: the caller has made sure none is).
    """
    wanted = {
        "query_start_loc": num_reqs + 1,
        "seq_lens": num_reqs,
        "block_table": num_reqs,
        "slot_mapping": num_tokens,
    }
    if as_given and (checked or _fits_as_given(md)):
        return {
            "query_start_loc": md.query_start_loc,
            "seq_lens": md.seq_lens,
            "block_table": md.block_table,
            "slot_mapping": md.slot_mapping,
        }, wanted
    return {
        "query_start_loc": md.query_start_loc[: num_reqs + 1],
        "seq_lens": md.seq_lens[:num_reqs],
        "block_table": md.block_table[:num_reqs, :cols],
        "slot_mapping": md.slot_mapping[:num_tokens],
    }, None


def _fits_as_given(md: Any) -> bool:
    """Every metadata tensor of ``md`` is small enough to copy as the runner gave it (:data:`AS_GIVEN_MAX`)."""
    return (
        md.block_table.numel() <= AS_GIVEN_MAX
        and md.slot_mapping.numel() <= AS_GIVEN_MAX
        and md.seq_lens.numel() <= AS_GIVEN_MAX
        and md.query_start_loc.numel() <= AS_GIVEN_MAX
    )


def pack_host_copies(
    slot: Slot,
    name: str,
    parts: dict[str, Any],
    *,
    pin: bool,
    trim: dict[str, int] | None = None,
    cols: int | None = None,
    shared: SharedHost | None = None,
    defer: bool = False,
) -> dict[str, Any] | None:
    """Queue ``parts`` (int32 / int64 tensors of one device) into ``slot`` with one copy.

    On their device one ``torch.cat`` packs the parts, flattened, into one int32 tensor (a
    non-contiguous part, a block-table slice, costs one more kernel to flatten). An int64 part
    travels as int32 pairs, so no value is narrowed; the int64 parts go first, so each starts at
    an even offset and its host view is a ``view(torch.int64)``. The packed tensor comes from the
    caching allocator: its memory is reused only by work queued after the copy out of it, on
    the same stream. One copy (non-blocking when ``pin``) moves it into the slot's host buffer
    ``name`` (pinned when ``pin``; reused, and grown when a step needs more).

    Returns a :class:`PackedViews` that :meth:`Slot.make_views` (the writer thread, before it
    reads them) fills with the host views, one per part, of its shape and dtype, in ``parts``'
    order; they hold the values once the slot's event has fired (at once without ``pin``).
    Making them is left to the writer because each tensor operation costs the engine's thread
    microseconds; the record writer process gets the buffer itself (``PackedViews.packed``).
    ``trim``: part -> how many leading rows the views keep (``metadata_parts``' ``as_given``);
    ``cols``: then, the block-table columns the step reads (``Packed.cols``). ``shared``: the host
    buffer is a stretch of the record process's memory when there is room (``Packed.shared``);
    ``defer`` (CUDA): packed into that memory's device mirror, the one device call of the step,
    and moved to the host with other steps' later (``SharedHost.flush``; ``slot.deferred`` says so).
    None, with nothing queued, when a part is neither int32 nor int64. The flattening is kept
    for the next step whose parts are the same memory (:data:`_PLANS`): then the step costs the
    engine's thread two tensor operations, the ``cat`` and the copy, or the ``cat`` alone
    (deferred, or on the host).
    """
    plan = _plan_of(parts)
    if plan is None:
        return None
    return _pack(slot, plan, pin, trim, cols, shared, defer, name=name)


def _pack(
    slot: Slot,
    plan: _Plan,
    pin: bool,
    trim: dict[str, int] | None,
    cols: int | None,
    shared: SharedHost | None,
    defer: bool,
    *,
    name: str,
) -> PackedViews:
    """:func:`pack_host_copies` once the plan is known: into the shared memory, or the slot's buffer ``name``."""
    region = None
    if shared is not None:
        region = shared.take(plan.total, pin=pin, device=plan.device if defer and (pin or DEFER_ON_CPU) else None)
    if region is None:
        offset = None
        host = slot.host_prefix(name, plan.total, plan.int32, pin=pin, sources=plan.flat)
        host.copy_(plan.cat(plan.flat), non_blocking=pin)
    else:
        offset, host, mirror = region
        if mirror is not None:  # packed into the ring's device mirror; moved to the host later (flush)
            plan.cat(plan.flat, out=mirror)
            slot.deferred = True
        elif pin:
            host.copy_(plan.cat(plan.flat), non_blocking=True)
        else:  # on the host already: packed where the child reads
            plan.cat(plan.flat, out=host)
    views = PackedViews()
    views.packed = Packed(host, plan.order, plan.widths, plan.like, trim or {}, cols, offset, plan.memo)
    slot.view_makers.append(views)
    return views


@dataclass
class _Plan:
    """How :func:`pack_host_copies` flattens one set of parts: kept for the next step with the same tensors."""

    flat: list[Any]  #: the parts as 1-d int32 views, in buffer order (they keep the memory alive)
    order: tuple[str, ...]
    widths: tuple[int, ...]
    like: dict[str, tuple[Any, tuple[int, ...]]]
    total: int
    cat: Any  #: ``torch.cat``
    int32: Any
    device: Any  #: the parts' device
    pin: bool = False  #: the parts are on a CUDA device (pinned, non-blocking copies)
    key: tuple[Any, ...] = ()  #: its key in :data:`_PLANS`
    memo: dict[Any, Any] = field(default_factory=dict)  #: ``Packed.memo`` of the copies made by this plan


#: The last few plans, by what the parts are: (name, address, shape, strides, dtype) each. The
#: runner's metadata is a new set of views of its persistent buffers every step, but of the same
#: memory, shape and strides for a batch size it has seen: the views made for an earlier step
#: read the same elements, and two tensor operations a step (``reshape``, ``view``) are saved.
#: A plan keeps its views' memory alive, so no other tensor can take their addresses.
_PLANS: dict[tuple[Any, ...], _Plan] = {}
_PLANS_MAX = 16


#: The same plans by :func:`queue_host_copies`' flat key of a metadata's four tensors (copied as given).
_STEADY: dict[tuple[Any, ...], _Plan] = {}


def forget_plans() -> None:
    """Let go of the kept plans and the runner's memory they hold (``Tracer.stop``)."""
    _PLANS.clear()
    _STEADY.clear()


def _plan_of(parts: dict[str, Any]) -> _Plan | None:
    """The plan for ``parts`` (made, or an earlier step's); None when a part is neither int32 nor int64."""
    key = tuple((k, t.data_ptr(), t.shape, t.stride(), t.dtype) for k, t in parts.items())
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
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
    widths = tuple(f.shape[0] for f in flat)
    like = {k: (t.dtype, tuple(t.shape)) for k, t in parts.items()}
    device = flat[0].device
    plan = _Plan(flat, tuple(order), widths, like, sum(widths), torch.cat, int32, device, device.type == "cuda", key)
    if all(f.data_ptr() == parts[k].data_ptr() for k, f in zip(order, flat, strict=True)):
        # views, not copies (a non-contiguous part's flat copy holds this step's values only)
        if len(_PLANS) >= _PLANS_MAX:
            del _PLANS[next(iter(_PLANS))]
        _PLANS[key] = plan
    return plan


def _fill_views(views: PackedViews) -> None:
    """``pack_host_copies``' host views, into ``views``: the buffer cut at its widths, as ``like`` says."""
    import torch

    p = views.packed
    pieces = dict(zip(p.order, p.host.split(p.widths), strict=True))
    for k, (dtype, shape) in p.like.items():
        view = pieces[k].view(torch.int64) if dtype == torch.int64 else pieces[k]
        view = view.view(shape) if len(shape) != 1 else view
        views[k] = view[: p.trim[k]] if k in p.trim else view


def layer_fields(static: LayerStatic) -> dict[str, Any]:
    """The layer's ``StepRecord`` fields that no step changes, read from its impl once (``static.fields``)."""
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


def step_fields(md: Any, num_tokens: int, cudagraph: str, padded: int | None) -> dict[str, Any]:
    """``StepRecord`` fields of one step's metadata, as Python numbers (no tensor is read).

    The same for every layer that shares ``md`` (one KV-cache group), so read once a step; a
    record is the layer's :func:`layer_fields` updated with these (the metadata's own sliding
    window, when it has one, wins over the impl's).
    """
    causal = getattr(md, "causal", True)
    fields = {
        "num_actual_tokens": num_tokens,
        "max_query_len": int(md.max_query_len),
        "max_seq_len": int(md.max_seq_len),
        "causal": bool(causal) if not hasattr(causal, "shape") else True,
        "use_cascade": bool(getattr(md, "use_cascade", False)),
        "num_splits": int(getattr(md, "max_num_splits", 0) or 0),
        "cudagraph": cudagraph,
        "padded_tokens": padded if padded is not None else num_tokens,
    }
    window = getattr(md, "sliding_window", None)
    if window is not None and not isinstance(window, int):  # Flex's metadata keeps the impl's int
        fields["sliding_window"] = tuple(int(w) for w in window)
    paged_kv = getattr(md, "paged_kv", None)  # FlashInfer's page table (``tracer.wrappers.flashinfer_build``)
    if paged_kv is not None:
        fields["paged_kv_indptr"] = paged_kv["paged_kv_indptr"]
        fields["paged_kv_last_page_len"] = paged_kv["paged_kv_last_page_len"]
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
    paged_kv = getattr(md, "paged_kv", None)
    if paged_kv is not None and "paged_kv_indices" in paged_kv:  # FlashInfer's pages: the record's field
        tensors["paged_kv_indices"] = paged_kv["paged_kv_indices"]
    return tensors
