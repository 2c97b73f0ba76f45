"""A record's JSON fields decoded against their annotations: types, ranges, lengths, valid Unicode.

A trace is untrusted input: people send each other traces and open them in CI. So
``from_json`` decodes every field against its annotation (:func:`decode`): an ``int`` is a
JSON integer (not ``true``, not ``"1"``, not ``1.0``) inside :data:`INT_RANGES`, a ``float``
a finite number, a ``str`` valid Unicode (no lone surrogates), a list no longer than
:data:`MAX_LENGTHS` allows. Free-form JSON (``options``, ``extra``, side files) passes
:func:`check_json_text`. Every failure is a ``TraceError`` naming the field; the whole-record
checks that follow are :mod:`tracer.format.schema`'s.

Standard library only.
"""

from __future__ import annotations

import math
import types
from typing import Any, Union, get_args, get_origin

from tracer.format.errors import TraceError

__all__ = [
    "INT64_MAX",
    "INT_RANGES",
    "MAX_DEPTH",
    "MAX_LENGTHS",
    "MAX_LIST",
    "MAX_REQS",
    "MAX_STR",
    "MAX_TOKENS",
    "NONNEGATIVE_FLOATS",
    "check_json_text",
    "decode",
]

#: Ints without a range of their own fit in int64.
INT64_MAX = 2**63 - 1
#: Query tokens (and slots) in one step: vLLM schedules far fewer (``max_num_batched_tokens``).
MAX_TOKENS = 1 << 21
#: Requests in one step.
MAX_REQS = 1 << 16
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
    ("RunInfo", "null_block"): (0, 2**31 - 1),
    ("StepRecord", "kv_cache_group"): (0, 1 << 16),
    ("KVCacheGroup", "group"): (0, 1 << 16),
    ("KVCacheGroup", "block_size"): _HEADS,
    ("KVCacheGroup", "sliding_window"): (1, INT64_MAX),
    ("KVCacheGroup", "attention_chunk_size"): (1, INT64_MAX),
    ("RunInfo", "flash_attn_version"): (0, 1000),
    ("TensorParallel", "rank"): (0, _HEADS[1] - 1),
    ("TensorParallel", "world_size"): _HEADS,
    ("TensorParallel", "head_start"): (0, _HEADS[1] - 1),
    ("TensorParallel", "num_heads"): _HEADS,
    ("TensorParallel", "kv_head_start"): (0, _HEADS[1] - 1),
    ("TensorParallel", "num_kv_heads"): _HEADS,
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
