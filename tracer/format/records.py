"""The records a trace is made of: frozen dataclasses, JSON in and out.

Names follow vLLM's own (``block_table``, ``slot_mapping``, ``seq_lens``,
``query_start_loc``, ``num_actual_tokens``) so a reader can hold a record next
to ``FlashAttentionMetadata`` and see the same fields.

This module imports only the standard library: reports and replay read traces
on machines without vLLM, torch or a GPU.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from tracer.format import schema
from tracer.format.decode import decode
from tracer.format.errors import TraceError
from tracer.format.layouts import STORED_LAYOUTS
from tracer.format.version import FORMAT_VERSION

#: Step kinds. ``profile``: vLLM's memory-profiling run before the KV cache
#: exists; ``warmup``: compile / CUDA-graph warm-up and capture runs; ``request``:
#: a step that serves scheduled requests.
STEP_KINDS = ("profile", "warmup", "request")

#: ``StepRecord.cudagraph``: eager, attention between piecewise graphs, or one full graph.
CUDAGRAPH_MODES = ("none", "piecewise", "full")

#: ``KVCacheGroup.kind``: what a KV-cache group's block table keeps, by vLLM's spec class
#: (``FullAttentionSpec``, ``SlidingWindowSpec``, ``ChunkedLocalAttentionSpec``, ``MambaSpec``; any other).
GROUP_KINDS = ("full", "sliding_window", "chunked_local", "mamba", "other")

#: KV-cache layouts a trace may name: the layout registry's stored layouts
#: (:mod:`tracer.format.layouts` describes each).
LAYOUTS = STORED_LAYOUTS


__all__ = [
    "CUDAGRAPH_MODES",
    "GROUP_KINDS",
    "LAYOUTS",
    "SINCE",
    "STEP_KINDS",
    "GapRecord",
    "KVCacheGroup",
    "KVCacheSpec",
    "ModelSummary",
    "RunInfo",
    "StepRecord",
    "TensorParallel",
    "TraceError",
    "record_from_json",
    "record_to_json",
]


#: Field metadata key: the format version that introduced a field. Reading an older
#: version, a missing field of a later version gets its default; every other field is
#: required.
SINCE = "since"

#: Fields whose values come from a fixed vocabulary, checked on load: (class, field) -> allowed.
_VOCABULARY: dict[tuple[str, str], tuple[str, ...]] = {}


class _JsonRecord:
    """Mixin: ``to_json`` / ``from_json`` for flat frozen dataclasses.

    ``from_json`` rejects unknown keys and missing keys instead of filling gaps, so a
    trace written by another format version never loads silently wrong. The one
    exception is spelled out per field: a field introduced in format version N
    (``metadata={SINCE: N}``) may be absent from a record of an older version, and then
    takes its default. Every value is checked against its field's annotation
    (:func:`tracer.format.decode.decode`: types, ranges, lengths, valid Unicode), fields
    with a vocabulary (``kind``, ``layout``) against it, and the record as a whole by its
    class's checker in ``_CHECKS`` (:func:`tracer.format.schema.check_step`).
    """

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-ready dict, fields in their order; a nested record (or a tuple of them) becomes dicts.

        Tuples stay tuples (``json`` writes them as lists). The tracer's writer thread calls this
        for every record, so the field names come from a per-class cache.
        """
        names, nested = _json_names(type(self))
        values = self.__dict__
        out = {name: values[name] for name in names}
        for name in nested:
            value = out[name]
            if isinstance(value, _JsonRecord):
                out[name] = value.to_json()
            elif isinstance(value, tuple):  # a tuple of records (``RunInfo.kv_cache_groups``)
                out[name] = [v.to_json() if isinstance(v, _JsonRecord) else v for v in value]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any], version: int = FORMAT_VERSION):
        """Build the record from ``to_json``'s output, written by format ``version``.

        A wrong key set, a value of the wrong type or range, a value outside its vocabulary
        or an inconsistent record is a ``TraceError`` naming the field.
        """
        if not isinstance(data, dict):
            raise TraceError(f"{cls.__name__}: expected an object, got {type(data).__name__}")
        names = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        required = {n for n, f in names.items() if f.metadata.get(SINCE, 1) <= version}
        missing = required - data.keys()
        unknown = data.keys() - names.keys()
        if missing or unknown:
            unknown_names = [name[:40] for name in sorted(unknown)[:8]] + (["..."] if len(unknown) > 8 else [])
            raise TraceError(f"{cls.__name__}: missing fields {sorted(missing)}, unknown fields {unknown_names}")
        owner = cls.__name__
        hints = _hints(cls)
        kwargs = {}
        for name, value in data.items():
            value = decode(hints[name], value, f"{owner}.{name}", owner, name, version)
            allowed = _VOCABULARY.get((owner, name))
            if allowed is not None and value is not None and value not in allowed:
                raise TraceError(f"{owner}: {name} {str(value)[:40]!r} is not one of {', '.join(allowed)}")
            kwargs[name] = value
        record = cls(**kwargs)
        check = _CHECKS.get(owner)
        if check is not None:
            check(record)
        return record


_HINTS: dict[str, dict[str, Any]] = {}
_JSON_NAMES: dict[type, tuple[tuple[str, ...], tuple[str, ...]]] = {}


def _json_names(cls: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A record class's field names, and those whose annotation can hold a nested record."""
    names = _JSON_NAMES.get(cls)
    if names is None:
        fields = dataclasses.fields(cls)
        hints = _hints(cls)
        nested = tuple(f.name for f in fields if _mentions_record(hints[f.name]))
        names = _JSON_NAMES[cls] = (tuple(f.name for f in fields), nested)
    return names


def _mentions_record(hint: Any) -> bool:
    if isinstance(hint, type) and issubclass(hint, _JsonRecord):
        return True
    return any(_mentions_record(arg) for arg in typing.get_args(hint))


def _hints(cls: type) -> dict[str, Any]:
    """A record class's field annotations, resolved once (this module uses postponed annotations)."""
    hints = _HINTS.get(cls.__name__)
    if hints is None:
        hints = _HINTS[cls.__name__] = typing.get_type_hints(cls)
    return hints


@dataclass(frozen=True)
class KVCacheSpec(_JsonRecord):
    """The paged KV cache of the traced attention layers, as vLLM allocated it."""

    layer_names: tuple[str, ...]  #: attention layers sharing this spec, e.g. ``model.layers.0.self_attn.attn``
    num_blocks: int  #: physical blocks in the cache (block 0 is vLLM's null block)
    block_size: int  #: tokens per block (the kernel block size, ``kv_cache.shape[2]``)
    num_kv_heads: int
    head_size: int  #: D, elements per head
    dtype: str  #: torch dtype of the cache tensor, e.g. ``bfloat16`` (``uint8`` for fp8)
    cache_dtype: str  #: vLLM's ``kv_cache_dtype`` setting, e.g. ``auto`` or ``fp8_e4m3``
    element_size: int  #: bytes per element of the cache tensor
    shape: tuple[int, ...]  #: logical shape of one layer's ``kv_cache`` tensor
    stride: tuple[int, ...]  #: its strides, in elements
    layout: str  #: one of ``LAYOUTS``
    physical_order: str  #: dims in memory order, e.g. ``(blocks, tokens, heads, K|V)``
    k_scale: float  #: ``layer._k_scale`` (1.0 unless fp8)
    v_scale: float
    backend_kv_cache_shape: tuple[int, ...]  #: ``Backend.get_kv_cache_shape(...)`` for these numbers
    backend_stride_order: (
        tuple[int, ...] | None
    )  #: ``Backend.get_kv_cache_stride_order()``; None if the backend has none


@dataclass(frozen=True)
class KVCacheGroup(_JsonRecord):
    """One of vLLM's KV-cache groups (``kv_cache_config.kv_cache_groups[group]``): layers that share one block table.

    A model that mixes attention types (Gemma-2's window and full layers) gets one group per type;
    each group has its own block table and slot mapping, and the groups draw their block ids from
    one pool, so the same request's rows differ between layers of different groups.
    """

    group: int  #: 0-based index in ``kv_cache_config.kv_cache_groups`` (``StepRecord.kv_cache_group``)
    kind: str  #: one of ``GROUP_KINDS``
    spec: str  #: vLLM's spec class, e.g. ``SlidingWindowSpec``
    layer_names: tuple[str, ...]  #: the attention layers that read this group's block table
    block_size: int  #: tokens per block of this group's table
    #: ``SlidingWindowSpec.sliding_window`` (or a full spec's): tokens a query sees, itself included
    sliding_window: int | None
    attention_chunk_size: int | None  #: ``ChunkedLocalAttentionSpec.attention_chunk_size``, in tokens


@dataclass(frozen=True)
class ModelSummary(_JsonRecord):
    """What the model looks like to attention."""

    name: str  #: model path / HF id / preset name
    architectures: tuple[str, ...]
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_size: int
    hidden_size: int
    vocab_size: int
    dtype: str  #: activation dtype, e.g. ``bfloat16``
    max_model_len: int
    weights: str  #: how weights were made: ``checkpoint``, ``dummy``, ``dummy+pagedtrace-init``


@dataclass(frozen=True)
class TensorParallel(_JsonRecord):
    """Which part of the model one tensor-parallel rank ran (vLLM's ``QKVParallelLinear`` split).

    Rank ``r`` of ``world_size`` holds query heads ``head_start .. head_start + num_heads - 1``
    and KV heads ``kv_head_start ..``, global 0-based numbers. With more ranks than KV heads
    vLLM replicates each KV head on ``world_size / total KV heads`` ranks: then ranks share a
    ``kv_head_start``.
    """

    rank: int  #: 0-based tensor-parallel rank
    world_size: int  #: tensor-parallel ranks in the engine
    head_start: int  #: first global query head of this rank
    num_heads: int  #: query heads this rank holds (``StepRecord.num_heads``)
    kv_head_start: int  #: first global KV head of this rank
    num_kv_heads: int  #: KV heads this rank holds (``KVCacheSpec.num_kv_heads``)

    @property
    def heads(self) -> range:
        """This rank's global query heads."""
        return range(self.head_start, self.head_start + self.num_heads)

    @property
    def kv_heads(self) -> range:
        """This rank's global KV heads."""
        return range(self.kv_head_start, self.kv_head_start + self.num_kv_heads)


@dataclass(frozen=True)
class RunInfo(_JsonRecord):
    """The manifest: one per trace directory."""

    format_version: int
    pagedtrace_version: str
    vllm_version: str
    torch_version: str
    platform: str  #: vLLM platform class, e.g. ``CudaPlatform`` / ``CpuPlatform``
    device: str  #: ``cuda`` / ``cpu``
    device_name: str  #: e.g. ``NVIDIA H200`` or the CPU model
    attention_backend: str  #: qualified name of the AttentionImpl class
    flash_attn_version: int | None  #: 2, 3, 4 or None off the FlashAttention backend
    cudagraph_mode: str  #: ``CompilationConfig.cudagraph_mode`` as text, e.g. ``NONE``, ``PIECEWISE``
    enforce_eager: bool
    model: ModelSummary | None
    kv_cache: KVCacheSpec | None
    options: dict[str, Any]  #: tracer options (layers, steps, tensors, budget)
    created_at: str  #: ISO 8601, UTC
    sources: dict[str, dict[str, str]] = field(
        default_factory=dict
    )  #: vLLM path (``vllm/...``) -> ``{"file": path under the trace, "sha256": hex}``
    extra: dict[str, Any] = field(default_factory=dict)  #: free-form notes (e.g. preset, prompts)
    #: vLLM's KV-cache groups, in ``kv_cache_config.kv_cache_groups`` order; None: not recorded
    #: (a trace before format 5, or an engine that had no KV-cache config).
    kv_cache_groups: tuple[KVCacheGroup, ...] | None = field(default=None, metadata={SINCE: 5})
    #: ``BlockPool.null_block.block_id``: the id a table holds where a group keeps no block (0 in
    #: vLLM 0.26); None: not recorded.
    null_block: int | None = field(default=None, metadata={SINCE: 5})
    #: This rank of a tensor-parallel engine (``rank<N>/`` holds rank N > 0, :mod:`tracer.format.ranks`);
    #: None where vLLM's parallel state was not up (a trace made outside vLLM's workers).
    tensor_parallel: TensorParallel | None = field(default=None, metadata={SINCE: 5})


@dataclass(frozen=True)
class StepRecord(_JsonRecord):
    """What one attention layer received in one engine step.

    Index bases: token positions and slots are 0-based; ``step`` counts the
    worker's forward passes from 0 (profile and warm-up runs included, so the
    numbering matches what the engine did).
    """

    step: int  #: 0-based forward-pass index in this worker
    layer: str  #: attention layer name
    kind: str  #: one of ``STEP_KINDS``
    request_ids: tuple[str, ...]  #: request id for each block-table row ("" when unknown / dummy)
    num_actual_tokens: int  #: query tokens in this step, without padding
    query_start_loc: tuple[int, ...]  #: cumulative query lengths, ``num_reqs + 1`` entries
    seq_lens: tuple[int, ...]  #: per request: tokens in the KV cache after this step (context + query)
    block_table: tuple[
        tuple[int, ...], ...
    ]  #: per request: physical block ids, trimmed to ``ceil(seq_len / block_size)``
    slot_mapping: tuple[int, ...]  #: per new token: ``block * block_size + offset`` (-1: padding, not written)
    max_query_len: int
    max_seq_len: int
    causal: bool
    sliding_window: tuple[int, int] | None  #: FlashAttention ``(left, right)``; ``(-1, -1)`` = unlimited
    logits_soft_cap: float  #: 0 = none
    scale: float  #: softmax scale
    use_cascade: bool
    num_splits: int  #: ``max_num_splits`` (0 = let the kernel choose)
    num_heads: int
    num_kv_heads: int
    head_size: int
    alibi_slopes: tuple[float, ...] | None = field(
        default=None, metadata={SINCE: 2}
    )  #: per query head, when the model uses ALiBi
    sinks: tuple[float, ...] | None = field(
        default=None, metadata={SINCE: 2}
    )  #: per query head attention-sink logits (e.g. gpt-oss), else None
    #: fp8 attention (``kv_cache_dtype="fp8"``): the layer's ``_q_scale`` / ``_k_scale`` / ``_v_scale``
    #: as the engine used them this step; None when not recorded (then ``KVCacheSpec``'s scales, or 1.0).
    q_scale: float | None = field(default=None, metadata={SINCE: 2})
    k_scale: float | None = field(default=None, metadata={SINCE: 2})
    v_scale: float | None = field(default=None, metadata={SINCE: 2})
    #: torch dtype of the query as it reached attention, e.g. ``bfloat16`` (``float8_e4m3fn`` when vLLM
    #: quantized it for FA3's fp8 path); None when not recorded.
    query_dtype: str | None = field(default=None, metadata={SINCE: 2})
    #: How the model ran this step: ``none`` (eager), ``piecewise`` (attention outside the graphs)
    #: or ``full`` (a full CUDA graph replayed; Python ``forward`` was not called). None: not recorded.
    cudagraph: str | None = field(default=None, metadata={SINCE: 3})
    #: Tokens after padding: the batch size of the graph that ran (``num_actual_tokens`` when eager).
    padded_tokens: int | None = field(default=None, metadata={SINCE: 3})
    #: Write-log tensors (``kv_written`` ...): which run of consecutive logged steps of this layer
    #: the record belongs to; its blocks are rebuilt from the records of that run. None otherwise.
    kv_log_epoch: int | None = field(default=None, metadata={SINCE: 3})
    #: The KV-cache group whose block table and slot mapping this layer reads (``RunInfo.kv_cache_groups``
    #: index); None: not recorded.
    kv_cache_group: int | None = field(default=None, metadata={SINCE: 5})
    #: FlashInfer's page table of the step, where its metadata builder made one (its native prefill and
    #: decode wrappers; None on the TRT-LLM paths and other backends): per request, where its pages start
    #: in ``paged_kv_indices`` (``num_reqs + 1`` entries, from 0) ...
    paged_kv_indptr: tuple[int, ...] | None = field(default=None, metadata={SINCE: 5})
    #: ... the physical block ids, request after request (tensor traces only: read on the device) ...
    paged_kv_indices: tuple[int, ...] | None = field(default=None, metadata={SINCE: 5})
    #: ... and the tokens each request's last page holds (1 to ``block_size``).
    paged_kv_last_page_len: tuple[int, ...] | None = field(default=None, metadata={SINCE: 5})
    tensors: str | None = None  #: safetensors file under ``tensors/``, or None when not captured
    tensor_names: tuple[str, ...] = ()  #: tensors in that file

    @property
    def num_reqs(self) -> int:
        """Number of requests (block-table rows) in this step."""
        return len(self.seq_lens)

    @property
    def shared_blocks(self) -> frozenset[int]:
        """Physical blocks in more than one block-table row (prefix caching at work)."""
        seen: set[int] = set()
        shared: set[int] = set()
        for row in self.block_table:
            for block in set(row):
                (shared if block in seen else seen).add(block)
        return frozenset(shared)

    @property
    def query_lens(self) -> tuple[int, ...]:
        """Per request: query tokens in this step."""
        q = self.query_start_loc
        return tuple(q[i + 1] - q[i] for i in range(len(q) - 1))


@dataclass(frozen=True)
class GapRecord(_JsonRecord):
    """Steps the tracer knows happened but could not record."""

    step: int  #: 0-based forward-pass index, as in ``StepRecord.step``
    kind: str
    reason: str  #: e.g. ``cuda-graph-replay`` or ``cuda-graph-capture``
    num_tokens: int  #: scheduled tokens in that step (0 when unknown)


_VOCABULARY.update(
    {
        ("StepRecord", "kind"): STEP_KINDS,
        ("GapRecord", "kind"): STEP_KINDS,
        ("KVCacheSpec", "layout"): LAYOUTS,
        ("StepRecord", "cudagraph"): CUDAGRAPH_MODES,
        ("KVCacheGroup", "kind"): GROUP_KINDS,
    }
)
#: Whole-record checks run after a record is decoded, by class name (field types are checked first).
_CHECKS: dict[str, Any] = {
    "StepRecord": schema.check_step,
    "RunInfo": schema.check_run,
    "TensorParallel": schema.check_tensor_parallel,
}


def record_from_json(data: dict[str, Any], version: int = FORMAT_VERSION) -> StepRecord | GapRecord:
    """Decode one line of ``steps.jsonl`` (``{"type": "step"|"gap", ...}``) of format ``version``."""
    if not isinstance(data, dict) or "type" not in data:
        raise TraceError("step line is not an object with a 'type'")
    body = {k: v for k, v in data.items() if k != "type"}
    if data["type"] == "step":
        return StepRecord.from_json(body, version)
    if data["type"] == "gap":
        return GapRecord.from_json(body, version)
    raise TraceError(f"unknown record type {str(data['type'])[:40]!r}")


def record_to_json(record: StepRecord | GapRecord) -> dict[str, Any]:
    """Encode a record as one ``steps.jsonl`` object."""
    kind = "step" if isinstance(record, StepRecord) else "gap"
    return {"type": kind, **record.to_json()}
