"""Replay a recorded trace: prove, step by step, that vLLM computed exactly attention.

For every recorded (step, layer) that carries tensors, three checks run on the data
vLLM's attention backend really had:

attention
    The KV blocks the step's block table references (``kv_blocks``, captured after the
    step wrote its new tokens) are read from the recorded layout into the canonical
    ``[n, block_size, H_kv, D]`` K/V caches; the block table is remapped from physical
    ids onto that compact cache; the reference kernel reruns attention from the
    recorded ``query``, ``seq_lens`` and ``query_start_loc`` in fp64 and is compared
    with vLLM's ``output``. The tolerance is ``k * err(same math in the activation
    dtype) + eps`` (flash-attn ``hopper/test_flash_attn.py``), absolute and relative
    errors are both reported, per step and per head.
write path
    The ``key``/``value`` that ``do_kv_cache_update`` received are scattered through
    ``slot_mapping`` (``slot = block * block_size + offset``, -1 = padding, skipped)
    into the recorded layout; the captured blocks must hold exactly those bits.
legacy
    The same cache is rewritten in ``PagedAttention.split_kv_cache``'s layout (key
    ``[nb, H_kv, D/x, bs, x]``, value ``[nb, H_kv, D, bs]``), read back through the
    legacy reader, and attention rerun: the output is bitwise the same. The x-split is
    storage only.

The ``cpu`` layout name covers two packings that vLLM's CPU backend picks at runtime
(``cpu_attn._get_attn_isa``): ``vec``/``vec16`` store each (block, kv head) region as
K^T ``[D][bs]`` then V ``[bs][D]`` (``cpu``); ``amx`` (bf16, ``block_size % 32 == 0``,
a CPU with AMX tiles) packs both for its tile loads (``cpu_amx``). Trace format 1 does
not record the ISA, so :func:`resolve_layout` tells the two apart by where the recorded
``key``/``value`` rows occur in the captured blocks, and the report says which packing
it read.

Imports torch, :mod:`reference_impl` and ``tracer.format`` (the bottom layer) only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from reference_impl import compiled as _compiled
from reference_impl import kernel as _kernel
from reference_impl import layouts as _layouts
from tracer.format import (
    REPLAY,
    HeadResult,
    KVCacheSpec,
    LegacyCheck,
    ReplayReport,
    StepRecord,
    StepResult,
    Tolerance,
    Trace,
    TraceError,
    WriteCheck,
    layer_matches,
    step_in_range,
    write_side_file,
)

__all__ = [
    "KERNELS",
    "LAYOUT_CPU_AMX",
    "TOL_K",
    "TOL_EPS",
    "HeadResult",
    "StepResult",
    "WriteCheck",
    "LegacyCheck",
    "ReplayReport",
    "replay_trace",
    "replay_record",
    "check_write_path",
    "check_legacy_path",
    "resolve_layout",
    "read_cache",
    "compact_block_table",
    "StepInputs",
    "step_inputs",
    "reference_outputs",
    "kv_spec",
    "select_records",
    "save_report",
]

#: Kernel name -> reference function (all share one signature, see reference_impl.kernel).
KERNELS: dict[str, Callable[..., torch.Tensor]] = {
    "fast": _kernel.paged_attention_fast,
    "loop": _kernel.paged_attention_loop,
    "partitioned": _kernel.paged_attention_partitioned,
    "compiled": _compiled.paged_attention_compiled,
}

#: The CPU backend's ``amx`` packing (``reference_impl.layouts``). Trace format 1 writes
#: ``cpu`` for it too; :func:`resolve_layout` finds it behind that name.
LAYOUT_CPU_AMX = _layouts.LAYOUT_CPU_AMX

#: Tolerance: ``TOL_K * err(baseline) + TOL_EPS``; the baseline is the reference's own
#: math run in the activation dtype (bf16 for the tiny preset).
TOL_K = 2.0
TOL_EPS = 1e-5

#: Precision of the reference the output is judged against.
REFERENCE_DTYPE = torch.float64

#: The bar, as ``replay.json`` records it.
TOLERANCE = Tolerance(k=TOL_K, eps=TOL_EPS, reference_dtype=str(REFERENCE_DTYPE).removeprefix("torch."))


# --------------------------------------------------------------------------- layouts


def read_cache(kv_blocks: torch.Tensor, layout: str, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Captured ``kv_blocks`` ``[n, H_kv, bs, 2*D]`` -> canonical K, V ``[n, bs, H_kv, D]``.

    ``layout`` is one of ``reference_impl.layouts.LAYOUTS`` but ``legacy``. The captured
    tensor has the cache's logical shape, contiguous (``kv_cache.index_select``), so the
    flash layouts read by logical indexing and the CPU ones by their row-major memory.
    """
    try:
        return _layouts.read_kv(kv_blocks, layout, head_size)
    except ValueError as exc:
        raise TraceError(f"cannot read the KV blocks as layout {layout!r}: {exc}") from None


def _slot_positions(slot_mapping: torch.Tensor, block_ids: torch.Tensor, block_size: int):
    """Where each token's slot lies in the compact cache.

    Returns ``(written [T] bool, index [T] long, offset [T] long, captured [T] bool)``:
    ``written`` is ``slot != -1``; ``index`` the block's row in ``kv_blocks``;
    ``captured`` False when that block is not among the captured ones.
    """
    slots = slot_mapping.long()
    written = slots >= 0
    block = torch.where(written, slots // block_size, 0)
    offset = torch.where(written, slots % block_size, 0)
    index = torch.searchsorted(block_ids, block).clamp_max(max(len(block_ids) - 1, 0))
    captured = written & (block_ids[index] == block) if len(block_ids) else torch.zeros_like(written)
    return written, index, offset, captured


def _quantize_like_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """What the cache should hold for ``x``: itself, or fp8 e4m3 bytes of ``x / scale``."""
    if cache_dtype == torch.uint8 or cache_dtype == torch.float8_e4m3fn:
        q = (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)  # saturating, as vLLM
        return q.view(torch.uint8) if cache_dtype == torch.uint8 else q
    return x.to(cache_dtype)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` -> ``[..., D * element_size]`` raw bytes, for bitwise comparison."""
    x = x.contiguous()
    return x.view(torch.uint8).reshape(*x.shape[:-1], -1)


#: Layout name -> writer from canonical K, V ``[n, bs, H_kv, D]`` to the cache's logical tensor.
_WRITERS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    _layouts.LAYOUT_FLASH_NHD: lambda k, v: _layouts.kv_to_flash(k, v, _layouts.LAYOUT_FLASH_NHD),
    _layouts.LAYOUT_FLASH_HND: lambda k, v: _layouts.kv_to_flash(k, v, _layouts.LAYOUT_FLASH_HND),
    _layouts.LAYOUT_CPU: _layouts.kv_to_cpu,
    _layouts.LAYOUT_CPU_AMX: _layouts.kv_to_cpu_amx,
}

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: do the bits of ``a`` and ``b`` differ? (NaN-safe, -0 != +0.)"""
    as_int = _INT_OF_SIZE[a.element_size()]
    return a.view(as_int) != b.view(as_int)


def check_write_path(record: StepRecord, tensors: Mapping[str, torch.Tensor], spec: KVCacheSpec,
                     layout: str) -> WriteCheck | None:
    """Scatter the recorded ``key``/``value`` through ``slot_mapping`` into the layout; compare bits.

    The captured blocks are read into canonical K/V (exact), token ``t``'s K/V (in the
    cache dtype; fp8: e4m3 bytes of ``x / scale``) is written at block
    ``slot // block_size``, offset ``slot % block_size``, and the result is packed back
    into ``layout`` with the layout's writer (for ``cpu``: K^T ``[D][bs]``, then V). The
    captured blocks must equal it bit for bit; each differing element is traced back to
    the token whose slot holds it. A slot in a block the step did not capture counts as a
    mismatch: vLLM wrote outside the block table.

    Returns:
        The check, or None when the step has no ``key``/``value`` (a KV update the
        tracer did not see).
    """
    if "key" not in tensors or "value" not in tensors:
        return None
    writer = _WRITERS.get(layout)
    if writer is None:
        raise TraceError(f"no writer for KV layout {layout!r}")
    kv_blocks, block_ids = tensors["kv_blocks"], tensors["kv_block_ids"].long()
    key, value = tensors["key"], tensors["value"]
    num = min(len(record.slot_mapping), key.shape[0], value.shape[0])
    slot_mapping = torch.tensor(record.slot_mapping[:num], dtype=torch.long)
    written, index, offset, captured = _slot_positions(slot_mapping, block_ids, spec.block_size)
    rows = captured.nonzero().flatten()
    idx, off = index[rows], offset[rows]

    new_k = _quantize_like_cache(key[:num][rows], kv_blocks.dtype, spec.k_scale)  # [t, H_kv, D]
    new_v = _quantize_like_cache(value[:num][rows], kv_blocks.dtype, spec.v_scale)
    got_k, got_v = read_cache(kv_blocks, layout, spec.head_size)
    key_cache, value_cache = got_k.clone(), got_v.clone()
    key_cache[idx, off] = new_k
    value_cache[idx, off] = new_v
    expected = writer(key_cache, value_cache)  # [n, H_kv, bs, 2*D], the layout's memory order

    # Elements whose bits differ, read back through the layout to (block, offset, head, dim).
    diff = _differs(expected, kv_blocks).to(torch.uint8)
    diff_k, diff_v = read_cache(diff, layout, spec.head_size)
    token_bad = (diff_k[idx, off] | diff_v[idx, off]).flatten(1).any(1).bool()
    # Two tokens sent to one slot: the scatter keeps one of them, so also ask each
    # token's slot for that token's own bits.
    token_bad |= _differs(got_k[idx, off], new_k).flatten(1).any(1)
    token_bad |= _differs(got_v[idx, off], new_v).flatten(1).any(1)
    bad = written & ~captured
    bad[rows[token_bad]] = True
    mismatches = int(bad.sum())
    return WriteCheck(step=record.step, layer=record.layer, ok=mismatches == 0, tokens=int(written.sum()),
                      mismatches=mismatches, first_mismatch=int(bad.nonzero()[0]) if mismatches else None)


def _row_set(x: torch.Tensor) -> set[bytes]:
    """The distinct rows of ``x`` ``[N, ...]``, as bytes."""
    flat = _bits(x.reshape(x.shape[0], -1)).numpy()
    return {row.tobytes() for row in flat}


def _layout_score(tensors: Mapping[str, torch.Tensor], spec: KVCacheSpec, layout: str) -> float:
    """Fraction of the recorded new tokens whose K and V rows occur anywhere in the cache read as ``layout``.

    Uses neither ``slot_mapping`` nor the block table, so a bug there cannot steer
    the choice of layout: read in the wrong packing, the cache's token rows are
    scrambled and (almost) no recorded row occurs.
    """
    try:
        key_cache, value_cache = read_cache(tensors["kv_blocks"], layout, spec.head_size)
    except (TraceError, ValueError, RuntimeError):
        return 0.0
    key = _quantize_like_cache(tensors["key"], key_cache.dtype, spec.k_scale)
    value = _quantize_like_cache(tensors["value"], value_cache.dtype, spec.v_scale)
    if key.shape[0] == 0:
        return 0.0
    k_rows = _row_set(key_cache.reshape(-1, *key_cache.shape[2:]))
    v_rows = _row_set(value_cache.reshape(-1, *value_cache.shape[2:]))
    k_bits, v_bits = _bits(key.reshape(key.shape[0], -1)).numpy(), _bits(value.reshape(value.shape[0], -1)).numpy()
    hits = sum(k.tobytes() in k_rows and v.tobytes() in v_rows for k, v in zip(k_bits, v_bits))
    return hits / key.shape[0]


def resolve_layout(trace: Trace, records: Sequence[StepRecord] | None = None) -> str:
    """The layout to read the captured blocks in.

    The manifest's ``KVCacheSpec.layout``, except that ``cpu`` is refined to
    :data:`LAYOUT_CPU_AMX` when the first record with ``key``/``value`` shows the AMX
    packing: more of the recorded K/V rows occur in the cache read that way than read
    as K^T (see :func:`_layout_score`; slot_mapping is not consulted, so the write
    check stays an independent test). Without such a record, or when neither packing
    explains at least half of the rows, the manifest's layout stands.
    """
    spec = kv_spec(trace)
    if spec.layout != _layouts.LAYOUT_CPU:
        return spec.layout
    for record in records if records is not None else trace.records:
        if record.tensors is None or not {"key", "value"} <= set(record.tensor_names):
            continue
        tensors = trace.tensors(record)
        scores = {c: _layout_score(tensors, spec, c) for c in (_layouts.LAYOUT_CPU, LAYOUT_CPU_AMX)}
        best = max(scores, key=scores.get)
        if scores[best] >= 0.5 and scores[best] > min(scores.values()):
            return best
        break
    return spec.layout


# --------------------------------------------------------------------------- attention


def compact_block_table(
    block_table: Sequence[Sequence[int]], block_ids: torch.Tensor
) -> tuple[torch.Tensor, list[int]]:
    """Map physical block ids onto rows of the captured ``kv_blocks``.

    Args:
        block_table: per request, physical block ids (trimmed rows, as ``StepRecord``).
        block_ids: ``[n]`` sorted physical ids of the captured blocks.

    Returns:
        ``(table [B, max_blocks] long, missing)``: row indices into the compact cache,
        rows padded with 0 (never read: past ``ceil(seq_len / block_size)``);
        ``missing`` lists ids not captured, which map to row ``n`` (a zero block the
        caller appends).
    """
    num_reqs = len(block_table)
    width = max((len(r) for r in block_table), default=0)
    physical = torch.zeros(num_reqs, max(width, 1), dtype=torch.long)
    used = torch.zeros_like(physical, dtype=torch.bool)
    for b, row in enumerate(block_table):
        physical[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        used[b, : len(row)] = True
    ids = block_ids.long()
    index = torch.searchsorted(ids, physical).clamp_max(max(len(ids) - 1, 0))
    found = (ids[index] == physical) if len(ids) else torch.zeros_like(used)
    lost = used & ~found
    table = torch.where(found, index, 0)
    table[lost] = len(ids)
    return table, sorted({int(x) for x in physical[lost].tolist()})


def _kernel_kwargs(record: StepRecord, spec: KVCacheSpec) -> dict[str, Any]:
    window = tuple(record.sliding_window) if record.sliding_window is not None else (-1, -1)
    kwargs: dict[str, Any] = {
        "scale": record.scale,
        "causal": record.causal,
        "window": window,
        "softcap": record.logits_soft_cap,
        "k_scale": spec.k_scale,
        "v_scale": spec.v_scale,
    }
    # Only models that have them pass these, so kernels without the keywords still run.
    if record.alibi_slopes is not None:
        kwargs["alibi_slopes"] = torch.tensor(record.alibi_slopes, dtype=torch.float32)
    if record.sinks is not None:
        kwargs["sinks"] = torch.tensor(record.sinks, dtype=torch.float32)
    return kwargs


def _run_kernel(name: str, *args: torch.Tensor, block_size: int, **kwargs: Any) -> torch.Tensor:
    fn = KERNELS[name]
    if name == "partitioned":
        kwargs["partition_size"] = block_size * max(1, 512 // block_size)
    return fn(*args, **kwargs)


def _baseline_dtype(query: torch.Tensor) -> torch.dtype:
    """The low-precision baseline runs in the activation dtype (fp32 models: fp32)."""
    return query.dtype if query.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32


@dataclass(frozen=True, eq=False)
class StepInputs:
    """One (step, layer) as the kernels take it: the compact canonical cache and remapped table.

    Built by :func:`step_inputs`; :func:`replay_record` and ``reference_impl.testing``
    feed exactly these tensors to a kernel.
    """

    query: torch.Tensor  #: ``[T, H, D]`` as captured (rows past ``num_tokens`` are padding)
    key_cache: torch.Tensor  #: ``[n, bs, H_kv, D]``: the captured blocks (+1 zero block if ``missing``)
    value_cache: torch.Tensor  #: ``[n, bs, H_kv, D]``
    block_table: torch.Tensor  #: ``[B, max_blocks]`` long: rows of the compact cache, see :func:`compact_block_table`
    seq_lens: torch.Tensor  #: ``[B]`` long
    query_start_loc: torch.Tensor  #: ``[B + 1]`` long
    kwargs: dict[str, Any]  #: ``scale``, ``causal``, ``window``, ``softcap``, ``k_scale``, ``v_scale``
    num_tokens: int  #: query rows compared: ``min(query_start_loc[-1], query rows, output rows)``
    missing: tuple[int, ...] = ()  #: physical block ids the table names that were not captured
    note: str = ""  #: what is odd about the step (uncaptured blocks, query rows != query_start_loc[-1])

    @property
    def args(self) -> tuple[torch.Tensor, ...]:
        """The six positional kernel arguments, in the reference signature's order."""
        return (self.query, self.key_cache, self.value_cache, self.block_table, self.seq_lens,
                self.query_start_loc)


def step_inputs(record: StepRecord, tensors: Mapping[str, torch.Tensor], spec: KVCacheSpec,
                layout: str) -> StepInputs:
    """Read one (step, layer)'s captured tensors into kernel inputs.

    The captured ``kv_blocks`` are read from ``layout`` into canonical K/V caches and the
    block table is remapped from physical ids onto their rows. Blocks the table names
    but the tracer did not capture become one zero block (so a kernel fails loudly
    instead of indexing out of range) and are listed in ``missing``.

    Raises:
        TraceError: ``query``, ``output``, ``kv_blocks`` or ``kv_block_ids`` was not captured,
            or the blocks cannot be read as ``layout``.
    """
    missing_names = {"query", "output", "kv_blocks", "kv_block_ids"} - tensors.keys()
    if missing_names:
        raise TraceError(f"step {record.step} layer {record.layer}: tensors {sorted(missing_names)} not captured")
    query, output = tensors["query"], tensors["output"]
    key_cache, value_cache = read_cache(tensors["kv_blocks"], layout, spec.head_size)
    table, missing = compact_block_table(record.block_table, tensors["kv_block_ids"].long())
    if missing:
        zero = torch.zeros_like(key_cache[:1])
        key_cache, value_cache = torch.cat([key_cache, zero]), torch.cat([value_cache, zero])
    seq_lens = torch.tensor(record.seq_lens, dtype=torch.long)
    query_start_loc = torch.tensor(record.query_start_loc, dtype=torch.long)
    num = min(int(query_start_loc[-1]), query.shape[0], output.shape[0])
    notes = []
    if missing:
        notes.append(f"block table names blocks {missing} that were not captured")
    if query.shape[0] != int(query_start_loc[-1]):
        notes.append(f"query has {query.shape[0]} rows, query_start_loc ends at {int(query_start_loc[-1])}")
    return StepInputs(query=query, key_cache=key_cache, value_cache=value_cache, block_table=table,
                      seq_lens=seq_lens, query_start_loc=query_start_loc, kwargs=_kernel_kwargs(record, spec),
                      num_tokens=num, missing=tuple(missing), note="; ".join(notes))


def reference_outputs(inputs: StepInputs, kernel: str = "fast") -> tuple[torch.Tensor, torch.Tensor]:
    """The reference output (``REFERENCE_DTYPE``) and its low-precision baseline, ``[T, H, D]`` each.

    The baseline is the same math in the activation dtype (bf16 for bf16 models); the
    tolerance is ``TOL_K * max|baseline - reference| + TOL_EPS``.
    """
    block_size = inputs.key_cache.shape[1]
    expected = _run_kernel(kernel, *inputs.args, block_size=block_size, compute_dtype=REFERENCE_DTYPE,
                           **inputs.kwargs)
    baseline = _run_kernel(kernel, *inputs.args, block_size=block_size,
                           compute_dtype=_baseline_dtype(inputs.query), **inputs.kwargs)
    return expected, baseline


def replay_record(record: StepRecord, tensors: Mapping[str, torch.Tensor], spec: KVCacheSpec, layout: str,
                  *, kernel: str = "fast", check_legacy: bool = True) -> tuple[StepResult, LegacyCheck | None]:
    """Rerun one (step, layer)'s attention and judge vLLM's ``output``.

    Args:
        record: the step's metadata.
        tensors: ``Trace.tensors(record)``: ``query`` / ``output`` ``[T, H, D]``,
            ``kv_blocks`` ``[n, H_kv, bs, 2*D]``, ``kv_block_ids`` ``[n]``.
        spec: the trace's KV-cache spec (block size, scales).
        layout: how ``kv_blocks`` is packed (see :func:`read_cache`).
        kernel: a key of :data:`KERNELS`.
        check_legacy: also run the legacy-layout round trip.

    Returns:
        The step's result and, with ``check_legacy``, the legacy check (None when the
        head size is not a multiple of ``x``).
    """
    inputs = step_inputs(record, tensors, spec, layout)
    output, num = tensors["output"], inputs.num_tokens
    expected, baseline = reference_outputs(inputs, kernel)
    verdict = _kernel.compare(output[:num], expected[:num], baseline[:num], k=TOL_K, eps=TOL_EPS)
    # Per-head scale for the relative error: the largest |reference| value of that head.
    ref_scale = expected[:num].abs().amax(dim=(0, 2)) if num else torch.zeros(inputs.query.shape[1])
    heads = tuple(
        HeadResult(head=h, ok=bool(err <= verdict["tol"]), max_abs=err,
                   max_rel=err / float(s) if float(s) > 0 else (0.0 if err == 0 else math.inf))
        for h, (err, s) in enumerate(zip(verdict["per_head_max_abs"], ref_scale.tolist()))
    )
    result = StepResult(
        step=record.step, layer=record.layer, kind=record.kind, num_tokens=num, num_reqs=record.num_reqs,
        ok=bool(verdict["ok"]) and not inputs.missing, max_abs=verdict["max_abs"], max_rel=verdict["max_rel"],
        tol=verdict["tol"], baseline_max_abs=verdict["baseline_max_abs"], heads=heads, note=inputs.note,
    )
    legacy = None
    if check_legacy:
        legacy = check_legacy_path(record, inputs.key_cache, inputs.value_cache, inputs.block_table, expected,
                                   inputs.query, spec, kernel)
    return result, legacy


def check_legacy_path(record: StepRecord, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      table: torch.Tensor, expected: torch.Tensor, query: torch.Tensor, spec: KVCacheSpec,
                      kernel: str = "fast") -> LegacyCheck | None:
    """Rewrite the canonical caches in paged_attn.py's layout, read them back, rerun.

    Args:
        key_cache, value_cache: canonical ``[n, bs, H_kv, D]`` caches of the step.
        table: the compact block table used for ``expected``.
        expected: the direct reference output ``[T, H, D]`` (``REFERENCE_DTYPE``).

    Returns:
        The check, or None when ``D`` is not a multiple of ``x = 16 // element_size``
        (the legacy kernels do not support such heads).
    """
    x = _layouts.legacy_x(key_cache.dtype)
    if spec.head_size % x:
        return None
    key_legacy, value_legacy = _layouts.kv_to_legacy(key_cache, value_cache)  # [n,H,D/x,bs,x], [n,H,D,bs]
    key_back, value_back = _layouts.legacy_to_kv(key_legacy, value_legacy)
    out = _run_kernel(
        kernel, query, key_back, value_back, table,
        torch.tensor(record.seq_lens, dtype=torch.long), torch.tensor(record.query_start_loc, dtype=torch.long),
        block_size=spec.block_size, compute_dtype=REFERENCE_DTYPE, **_kernel_kwargs(record, spec),
    )
    diff = float((out - expected).abs().max()) if out.numel() else 0.0
    return LegacyCheck(step=record.step, layer=record.layer, ok=bool(torch.equal(out, expected)),
                       max_abs=diff, x=x)


# --------------------------------------------------------------------------- driver


def kv_spec(trace: Trace) -> KVCacheSpec:
    """The trace's KV-cache spec; ``TraceError`` when the manifest has none."""
    spec = trace.run.kv_cache
    if spec is None:
        raise TraceError(f"{trace.path}: the manifest has no KV-cache spec; nothing to replay")
    return spec


def _selected(record: StepRecord, steps: tuple[int | None, int | None] | None,
              layers: Iterable[str | int] | None) -> bool:
    if steps is not None and not step_in_range(record.step, steps):
        return False
    return layers is None or layer_matches(record.layer, set(layers))


def select_records(trace: Trace, *, steps: tuple[int | None, int | None] | None = None,
                   layers: Iterable[str | int] | None = None, kind: str | None = None) -> list[StepRecord]:
    """The records of ``trace`` in a half-open ``steps`` range, of the given ``layers`` and ``kind``.

    Args:
        steps: ``(start, stop)``, either end None = open; None = all.
        layers: layer names and/or indices (``model.layers.<i>...``); None = all.
        kind: a ``StepRecord.kind`` (``request`` ...); None = all.
    """
    layers = None if layers is None else tuple(layers)
    return [r for r in trace.records if (kind is None or r.kind == kind) and _selected(r, steps, layers)]


def replay_trace(
    trace: Trace,
    *,
    steps: tuple[int | None, int | None] | None = None,
    layers: Iterable[str | int] | None = None,
    kernel: str = "fast",
    check_write: bool = True,
    check_legacy: bool = True,
    layout: str | None = None,
    progress: Callable[[int, int, StepResult], None] | None = None,
) -> ReplayReport:
    """Replay every selected (step, layer) of ``trace`` that has tensors.

    Args:
        trace: an opened trace directory.
        steps: half-open ``(start, stop)`` range of step indices; None = all.
        layers: layer names and/or indices (``model.layers.<i>...``); None = all.
        kernel: ``fast`` (batched gather), ``loop`` (the block loop) or ``partitioned``.
        check_write: also check the write path (needs ``key``/``value``).
        check_legacy: also run the legacy-layout round trip.
        layout: read the blocks in this layout instead of the recorded one (for
            experiments; :func:`resolve_layout` picks the right one by default).
        progress: called as ``progress(done, total, result)`` after each step.

    Returns:
        The report; ``report.ok`` is the verdict.

    Raises:
        TraceError: nothing selected has tensors, a tensor file is missing or
            unreadable, the manifest has no KV-cache spec.
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; use one of {sorted(KERNELS)}")
    started = time.perf_counter()
    spec = kv_spec(trace)
    layers = None if layers is None else tuple(layers)
    selected = select_records(trace, steps=steps, layers=layers)
    if not selected:
        raise TraceError(f"{trace.path}: no recorded step matches the selection "
                         f"(steps {_fmt_range(steps)}, layers {','.join(map(str, layers or ())) or 'all'})")
    with_tensors = [r for r in selected if r.tensors is not None]
    if not with_tensors:
        raise TraceError(f"{trace.path}: no tensors captured for the {len(selected)} selected step(s); "
                         "replay needs a trace recorded with tensors on (`pagedtrace run` without --no-tensors)")
    skipped = tuple(f"step {r.step} {r.layer}: no tensors (tensor budget spent or not a request step)"
                    for r in selected if r.tensors is None)
    read_layout = layout if layout is not None else resolve_layout(trace, with_tensors)

    results: list[StepResult] = []
    writes: list[WriteCheck] = []
    legacies: list[LegacyCheck] = []
    for done, record in enumerate(with_tensors, 1):
        tensors = trace.tensors(record)
        result, legacy = replay_record(record, tensors, spec, read_layout, kernel=kernel,
                                       check_legacy=check_legacy)
        results.append(result)
        if legacy is not None:
            legacies.append(legacy)
        if check_write:
            write = check_write_path(record, tensors, spec, read_layout)
            if write is not None:
                writes.append(write)
        if progress is not None:
            progress(done, len(with_tensors), result)
    return ReplayReport(
        kernel=kernel, layout=read_layout, recorded_layout=spec.layout, steps=tuple(results),
        tolerance=TOLERANCE, write_path=tuple(writes), legacy=tuple(legacies), skipped=skipped,
        seconds=time.perf_counter() - started,
    )


def _fmt_range(steps: tuple[int | None, int | None] | None) -> str:
    if steps is None:
        return "all"
    start, stop = steps
    return f"{'' if start is None else start}:{'' if stop is None else stop}"


def save_report(trace: Trace, report: ReplayReport) -> None:
    """Write ``replay.json`` into the trace directory (the HTML report reads it)."""
    write_side_file(trace.path, REPLAY, report.to_json())

