"""Reading JSON objects field by field, typed: the helpers every ``from_json`` here uses.

A wrong type or a missing field is a ``TraceError`` naming the object and the field; numbers
written by :func:`finite_or_none` (JSON has no NaN or Infinity) read back as NaN.

Standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from tracer.format.records import TraceError

__all__ = ["as_object", "finite_or_none", "get_field", "get_float", "get_list", "kind_name"]

T = TypeVar("T")


def finite_or_none(x: float) -> float | None:
    """JSON has no NaN/Infinity: a non-finite number is written as null."""
    return x if math.isfinite(x) else None


def get_field(data: Mapping[str, Any], name: str, kind: type | tuple[type, ...], owner: str) -> Any:
    """``data[name]``, checked to be of ``kind``; a ``TraceError`` naming ``owner`` otherwise."""
    if name not in data:
        raise TraceError(f"{owner}: missing field {name!r}")
    value = data[name]
    # bool is an int subclass: a count or index must not be True/False.
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise TraceError(f"{owner}: field {name!r} is {value!r}, expected {kind_name(kind)}")
    if not isinstance(value, kind):
        raise TraceError(f"{owner}: field {name!r} is {type(value).__name__}, expected {kind_name(kind)}")
    return value


def kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("null" if k is type(None) else k.__name__ for k in kinds)


def get_float(data: Mapping[str, Any], name: str, owner: str) -> float:
    """A number written by :func:`finite_or_none`: null reads back as NaN."""
    value = get_field(data, name, (int, float, type(None)), owner)
    return math.nan if value is None else float(value)


def get_list(data: Mapping[str, Any], name: str, owner: str, item: Callable[[Any], T]) -> tuple[T, ...]:
    return tuple(item(v) for v in get_field(data, name, list, owner))


def as_object(value: Any, owner: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise TraceError(f"{owner}: expected an object, got {type(value).__name__}")
    return value
