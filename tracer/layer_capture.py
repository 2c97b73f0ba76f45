"""One layer of one step in flight, and how it becomes a ``StepRecord`` on the writer thread.

The hooks (``tracer.install``) fill a :class:`LayerCapture`: Python numbers read from the
attention metadata, host views of its tensors filling in a pinned ring slot
(``tracer.handover``), and, for tensor steps, device-side clones. :meth:`LayerCapture.record`
runs on the writer thread once the slot's CUDA event has fired: it trims the block table
to the blocks each request uses and builds the record. The layer's q/k/v scales (what
FlashAttention's fp8 path is given as ``{q,k,v}_descale``) travel the same way:
:func:`capture_scales` clones the device tensors on the step, the writer reads them; a
layer whose scales vLLM does not recompute (``calculate_kv_scales`` off) is read once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tracer.format import StepRecord

__all__ = [
    "LayerCapture",
    "LayerStatic",
    "capture_scales",
    "dtype_name",
    "host_lists",
    "make_record",
    "read_static_floats",
    "trimmed_table",
]

#: The attention layer's fp8 scales as ``StepRecord`` fields -> the layer attributes holding them:
#: the device tensor FlashAttention is given as ``{q,k,v}_descale``, then the host float vLLM
#: keeps beside it (set together by vLLM's ``set_default_quant_scales`` / ``calc_kv_scales``).
SCALE_ATTRS = {
    "q_scale": ("_q_scale", "_q_scale_float"),
    "k_scale": ("_k_scale", "_k_scale_float"),
    "v_scale": ("_v_scale", "_v_scale_float"),
}


@dataclass
class LayerStatic:
    """What one attention layer is, learned once: its impl, module, cache and the query's dtype."""

    name: str
    impl: Any  #: the backend's ``AttentionImpl``
    module: Any  #: the ``Attention`` layer (its fp8 scales live there)
    kv_cache: Any  #: the layer's cache tensor (not a copy)
    query_dtype: str | None = None  #: as the query last reached ``forward`` (fp8 when vLLM quantized it)
    layout: str | None = None  #: the cache's layout name, once the manifest knows it
    geometry: Any = None  #: ``tracer.writelog.LayerGeometry``, made on first tensor capture
    #: The layer's scales once read (the writer fills it); None: clone them every step.
    scales: dict[str, float | None] | None = None
    alibi_slopes: tuple[float, ...] | None = None
    sinks: tuple[float, ...] | None = None
    floats_read: bool = False
    fields: dict[str, Any] | None = None  #: the record fields no step changes (``tracer.capture``)
    #: tokens a block holds, read from ``kv_cache`` (:meth:`set_cache` keeps it so): every step asks.
    #: 0 for a cache that has no blocks yet (the profile run's empty placeholder)
    block_size: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.block_size = _block_size(self.kv_cache)

    def set_cache(self, kv_cache: Any) -> None:
        """The layer's cache was replaced (vLLM reallocated it): what was learned of the old one goes."""
        self.kv_cache, self.geometry = kv_cache, None
        self.block_size = _block_size(kv_cache)


def _block_size(kv_cache: Any) -> int:
    """``(num_blocks, H_kv, block_size, 2*D)`` -> ``block_size``; 0 for a cache of fewer dimensions."""
    shape: Any = getattr(kv_cache, "shape", ())
    return int(shape[2]) if len(shape) > 2 else 0


@dataclass
class LayerCapture:
    """One layer of one step in flight: host views filling in a ring slot, device tensor clones."""

    step: int  #: 0-based step index
    kind: str  #: one of ``STEP_KINDS``
    static: LayerStatic
    #: the step's ``StepRecord`` fields read from its metadata (``tracer.capture.step_fields``; shared by
    #: the layers of one KV-cache group: not to be changed); the layer's own are in ``static.fields``
    metadata: dict[str, Any]
    host: dict[str, Any]  #: ``query_start_loc``, ``seq_lens``, ``block_table`` (``cols`` wide), ``slot_mapping``
    req_ids: tuple[str, ...]  #: one per request row; ``""`` where the runner gave none
    #: ``capture_scales(layer)`` (device clones or floats), or None when ``static.scales`` holds them
    scales: dict[str, Any] | None = None
    #: device clones: ``query``, ``output``, ``key``, ``value``, ``written``, ``read_blocks``; None: metadata only
    tensors: dict[str, Any] | None = None
    reset: bool = False  #: a write to this layer's cache went unlogged since its last tensor step

    @property
    def layer(self) -> str:
        return self.static.name

    def record_fields(self) -> dict[str, Any]:
        """The record's fields that are not read from the host views: Python numbers and strings.

        :meth:`layer_fields` updated with :meth:`step_fields`. With :func:`make_record` and the
        host views' lists (:func:`host_lists`, once the slot's event has fired) they make the
        record; the record writer process (``tracer.record_process``) is sent the two parts
        apart, the layer's once.
        """
        return {**self.layer_fields(), **self.step_fields()}

    def layer_fields(self) -> dict[str, Any]:
        """The fields this layer keeps from step to step: its impl's constants (``static.fields``),
        ALiBi slopes, sinks, the query's dtype, and its scales once read (``static.scales``)."""
        scales = self.static.scales or {}
        return {
            **(self.static.fields or {}),
            "layer": self.layer,
            "alibi_slopes": self.static.alibi_slopes,
            "sinks": self.static.sinks,
            "query_dtype": self.static.query_dtype,
            "q_scale": scales.get("q_scale"),
            "k_scale": scales.get("k_scale"),
            "v_scale": scales.get("v_scale"),
        }

    def layer_key(self) -> tuple[Any, ...]:
        """Changes whenever :meth:`layer_fields` may have (the writer resends them then)."""
        s = self.static
        scales = s.scales
        return (id(s.fields), s.query_dtype, s.floats_read, None if scales is None else tuple(scales.items()))

    def step_fields(self, *, with_ids: bool = True) -> dict[str, Any]:
        """This step's fields: number, kind, request ids, the metadata's, and the scales captured with it.

        ``with_ids`` False: without ``request_ids`` (the record process is sent them when they change).
        """
        fields = {"step": self.step, "kind": self.kind}
        if with_ids:
            fields["request_ids"] = self.req_ids
        fields.update(self.metadata)
        if self.scales is not None:
            fields.update((k, _scale_value(v)) for k, v in self.scales.items())
        return fields


def make_record(fields: dict[str, Any], lists: dict[str, Any], block_size: int) -> StepRecord:
    """A ``StepRecord`` from :meth:`LayerCapture.record_fields` and :func:`host_lists`."""
    return StepRecord(
        query_start_loc=lists["query_start_loc"],
        seq_lens=lists["seq_lens"],
        block_table=trimmed_table(lists, block_size),
        slot_mapping=lists["slot_mapping"],
        **fields,
    )


def host_lists(host: dict[str, Any]) -> dict[str, Any]:
    """The host views as tuples of ints, converted once per slot (layers of one KV group share them)."""
    lists = host.get("_lists")
    if lists is None:
        lists = {
            "query_start_loc": tuple(host["query_start_loc"].tolist()),
            "seq_lens": tuple(host["seq_lens"].tolist()),
            "block_table": host["block_table"].tolist(),  # rows as lists, trimmed by trimmed_table
            "slot_mapping": tuple(host["slot_mapping"].tolist()),
        }
        host["_lists"] = lists
    return lists


def trimmed_table(lists: dict[str, Any], block_size: int) -> tuple[tuple[int, ...], ...]:
    """``StepRecord.block_table``: each row cut to the ``ceil(seq_len / block_size)`` blocks it uses.

    Made once per slot and block size (the layers of one KV-cache group share it).
    """
    key = f"_table{block_size}"
    table = lists.get(key)
    if table is None:
        table = lists[key] = tuple(
            tuple(row[: -(-s // block_size)]) for row, s in zip(lists["block_table"], lists["seq_lens"], strict=False)
        )
    return table


def read_static_floats(static: LayerStatic) -> None:
    """ALiBi slopes and sinks (small per-head tensors), read once, on the writer thread."""
    if not static.floats_read:
        static.alibi_slopes = _floats(getattr(static.impl, "alibi_slopes", None))
        static.sinks = _floats(getattr(static.impl, "sinks", None))
        static.floats_read = True


def _floats(tensor: Any) -> tuple[float, ...] | None:
    """A small per-head tensor (ALiBi slopes, sinks) as floats; read at flush, off the hot path."""
    if tensor is None:
        return None
    return tuple(float(x) for x in _on_host(tensor).tolist())


#: device -> a CUDA stream of the tracer's own for :func:`_on_host` (made on first use)
_SIDE_STREAMS: dict[Any, Any] = {}


def _on_host(tensor: Any) -> Any:
    """``tensor`` as float32 on the host; from a CUDA device, through a stream of the tracer's own.

    The read waits for that stream only, never for the step's: whoever hands a slot over (the
    writer thread, or the engine's own for a trace without tensors) reads a scale cloned
    before the slot's event, which has fired, or a tensor vLLM made at start-up. On the current
    stream, ``.cpu()`` would wait for every kernel the engine has queued there so far.
    """
    value = tensor.detach()
    if not getattr(value, "is_cuda", False):
        return value.float().cpu()
    import torch

    stream = _SIDE_STREAMS.get(value.device)
    if stream is None:
        stream = _SIDE_STREAMS[value.device] = torch.cuda.Stream(device=value.device)
    with torch.cuda.stream(stream):
        return value.float().cpu()


def capture_scales(layer: Any) -> dict[str, Any]:
    """The layer's q/k/v scales, for the hook: device tensors cloned (no host sync), floats as they are.

    FlashAttention reads the device tensors (``layer._q_scale.expand(...)`` as ``q_descale``), so
    those are what the record should hold; vLLM may update them on the device (``calc_kv_scales``),
    hence a clone per step rather than a read at start-up. A layer without a scale gives None.
    """
    out: dict[str, Any] = {}
    for name, (tensor_attr, float_attr) in SCALE_ATTRS.items():
        value: Any = getattr(layer, tensor_attr, None)
        if hasattr(value, "detach"):
            out[name] = value.detach().clone()
        else:
            value = getattr(layer, float_attr, None)
            out[name] = float(value) if isinstance(value, (int, float)) else None
    return out


#: dtype -> its name (``dtype_name``, asked for every request step's query: a dict look-up, not a ``str``)
_DTYPE_NAMES: dict[Any, str] = {}


def dtype_name(tensor_or_dtype: Any) -> str:
    """``torch.float8_e4m3fn`` -> ``float8_e4m3fn``: a dtype, or a tensor's (no host sync)."""
    dtype = getattr(tensor_or_dtype, "dtype", tensor_or_dtype)
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = str(dtype).removeprefix("torch.")
        if len(_DTYPE_NAMES) < 64:
            _DTYPE_NAMES[dtype] = name
    return name


def _scale_value(value: Any) -> float | None:
    """A captured scale as one float, at flush: a scalar, or a per-head tensor whose heads all agree.

    Per-head scales that differ cannot be one ``StepRecord`` float: None (not recorded) then.
    """
    if value is None or isinstance(value, float):
        return value
    flat = _on_host(value).reshape(-1)
    if flat.numel() == 0 or not bool((flat == flat[0]).all()):
        return None
    return float(flat[0])
