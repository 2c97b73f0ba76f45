"""The records a trace is made of: frozen dataclasses, JSON in and out.

Names follow vLLM's own (``block_table``, ``slot_mapping``, ``seq_lens``,
``query_start_loc``, ``num_actual_tokens``) so a reader can hold a record next
to ``FlashAttentionMetadata`` and see the same fields.

This module imports only the standard library: reports and replay read traces
on machines without vLLM, torch or a GPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from collections.abc import Collection
from typing import Any

#: Version of the on-disk trace format.
#:
#: Changelog:
#:   1 (pagedtrace 0.1, 2026-11-30): first format: ``manifest.json``,
#:     ``steps.jsonl`` (``StepRecord`` and ``GapRecord`` lines), ``tensors/*.safetensors``.
FORMAT_VERSION = 1

#: Step kinds. ``profile``: vLLM's memory-profiling run before the KV cache
#: exists; ``warmup``: compile / CUDA-graph warm-up and capture runs; ``request``:
#: a step that serves scheduled requests.
STEP_KINDS = ("profile", "warmup", "request")

#: KV-cache layouts the tracer can name (same strings as ``reference_impl.layouts``).
#: ``flash_nhd`` / ``flash_hnd``: FlashAttention's packed ``(num_blocks, H_kv,
#: block_size, 2*D)`` with K in ``[..., :D]`` and V in ``[..., D:]``, physically
#: (blocks, tokens, heads, K|V) or (blocks, heads, tokens, K|V). ``cpu``: the
#: CPU backend's per-(block, head) ``K^T [D][bs]`` then ``V [bs][D]`` (its ``vec`` ISA);
#: ``cpu_amx``: the same regions packed for AMX tiles (ISA ``amx``, bf16, block_size % 32 == 0).
LAYOUTS = ("flash_nhd", "flash_hnd", "cpu", "cpu_amx")


# The vLLM source files pagedtrace reads, relative to site-packages.
PAGED_ATTN = "vllm/v1/attention/ops/paged_attn.py"
FLASH_ATTN = "vllm/v1/attention/backends/flash_attn.py"
CPU_ATTN = "vllm/v1/attention/backends/cpu_attn.py"
ATTENTION = "vllm/model_executor/layers/attention/attention.py"
BLOCK_TABLE = "vllm/v1/worker/block_table.py"
#: Stored in every trace, so that the annotator and reports work later without vLLM.
SOURCE_FILES = (PAGED_ATTN, FLASH_ATTN, CPU_ATTN, ATTENTION, BLOCK_TABLE)


class TraceError(Exception):
    """A trace cannot be written or read: bad version, truncated line, missing file."""


def _tuple(value: Any) -> Any:
    """Turn JSON lists (nested) back into tuples so records stay hashable and frozen."""
    if isinstance(value, list):
        return tuple(_tuple(v) for v in value)
    return value


class _JsonRecord:
    """Mixin: ``to_json`` / ``from_json`` for flat frozen dataclasses.

    ``from_json`` rejects unknown and missing keys instead of filling gaps, so a
    trace written by another format version never loads silently wrong.
    """

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-ready dict (tuples become lists)."""
        out = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, _JsonRecord):
                value = value.to_json()
            out[f.name] = value
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]):
        """Build the record from ``to_json``'s output; a wrong key set is a ``TraceError``."""
        if not isinstance(data, dict):
            raise TraceError(f"{cls.__name__}: expected an object, got {type(data).__name__}")
        names = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        required = {
            n
            for n, f in names.items()
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
        missing = required - data.keys()
        unknown = data.keys() - names.keys()
        if missing or unknown:
            raise TraceError(
                f"{cls.__name__}: missing fields {sorted(missing)}, unknown fields {sorted(unknown)}"
            )
        kwargs = {}
        for name, value in data.items():
            nested = _NESTED.get((cls.__name__, name))
            if nested is not None and value is not None:
                value = nested.from_json(value)
            elif name not in _KEEP_AS_IS:
                value = _tuple(value)
            kwargs[name] = value
        return cls(**kwargs)


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
    backend_stride_order: tuple[int, ...] | None  #: ``Backend.get_kv_cache_stride_order()``; None if the backend has none


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
    sources: dict[str, dict[str, str]] = field(default_factory=dict)  #: vLLM path (``vllm/...``) -> ``{"file": path under the trace, "sha256": hex}``
    extra: dict[str, Any] = field(default_factory=dict)  #: free-form notes (e.g. preset, prompts)


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
    block_table: tuple[tuple[int, ...], ...]  #: per request: physical block ids, trimmed to ``ceil(seq_len / block_size)``
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
    alibi_slopes: tuple[float, ...] | None = None  #: per query head, when the model uses ALiBi
    sinks: tuple[float, ...] | None = None  #: per query head attention-sink logits (e.g. gpt-oss), else None
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


#: Nested record types, by (owner class, field name).
_NESTED: dict[tuple[str, str], type[_JsonRecord]] = {
    ("RunInfo", "model"): ModelSummary,
    ("RunInfo", "kv_cache"): KVCacheSpec,
}
#: Fields holding free-form JSON: keep lists as lists.
_KEEP_AS_IS = {"options", "sources", "extra"}


def layer_index(name: str) -> int | None:
    """``model.layers.7.self_attn.attn`` -> 7 (the numbering ``--layers`` uses); None if no index."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def layer_matches(name: str, wanted: Collection[str | int]) -> bool:
    """``name`` is in ``wanted`` by full name or by its :func:`layer_index`."""
    index = layer_index(name)
    return name in wanted or (index is not None and index in wanted)


def step_in_range(step: int, steps: tuple[int | None, int | None]) -> bool:
    """``step`` lies in the half-open ``(start, stop)`` range; None leaves a side open."""
    start, stop = steps
    return (start is None or step >= start) and (stop is None or step < stop)


def record_from_json(data: dict[str, Any]) -> StepRecord | GapRecord:
    """Decode one line of ``steps.jsonl`` (``{"type": "step"|"gap", ...}``)."""
    if not isinstance(data, dict) or "type" not in data:
        raise TraceError("step line has no 'type'")
    body = {k: v for k, v in data.items() if k != "type"}
    if data["type"] == "step":
        return StepRecord.from_json(body)
    if data["type"] == "gap":
        return GapRecord.from_json(body)
    raise TraceError(f"unknown record type {data['type']!r}")


def record_to_json(record: StepRecord | GapRecord) -> dict[str, Any]:
    """Encode a record as one ``steps.jsonl`` object."""
    kind = "step" if isinstance(record, StepRecord) else "gap"
    return {"type": kind, **record.to_json()}
