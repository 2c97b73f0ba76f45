"""The ``Value`` an anchor shows, and what every value function writes it with.

Three kinds of value (``Value.kind``):

``captured``
    read straight from the trace (``num_actual_tokens = 7``);
``computed``
    derived by pagedtrace from captured numbers, e.g. the strides a line's
    ``transpose``/``split``/``view`` gives for the captured cache. Texts of code
    that vLLM 0.26 does not run start with ``computed:`` (:data:`COMPUTED_PREFIX`);
``static``
    an explanation that does not depend on the step.

``annotations.values`` (the code vLLM runs) and ``annotations.legacy_values`` (the
legacy ``split_kv_cache`` it does not) both build on this module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tracer.format import KVCacheSpec, RunInfo, StepRecord

__all__ = [
    "COMPUTED_PREFIX",
    "LIST_LIMIT",
    "VALUE_KINDS",
    "Value",
    "ValueFn",
    "fmt_list",
    "needs_spec",
    "needs_step",
]

#: Value kinds, see the module docstring.
VALUE_KINDS = ("captured", "computed", "static")

#: Longest list printed in full; longer lists show their head and a count.
LIST_LIMIT = 16

#: Prefix of values for code vLLM 0.26 does not run (paged_attn.py).
COMPUTED_PREFIX = "computed: what this line gives for the captured cache: "


@dataclass(frozen=True)
class Value:
    """One anchor's value at one step."""

    text: str
    kind: str = "captured"  #: one of ``VALUE_KINDS``


#: A value function: ``(record or None, run) -> Value or None`` (None: nothing to show without a step).
ValueFn = Callable[[StepRecord | None, RunInfo], "Value | None"]


def fmt_list(values: Sequence, limit: int = LIST_LIMIT) -> str:
    """``[1, 2, 3]``; longer than ``limit``: the first ``limit`` items and ``… +N more``."""
    items = [fmt_list(v, limit) if isinstance(v, (list, tuple)) else str(v) for v in values[:limit]]
    if len(values) > limit:
        items.append(f"… +{len(values) - limit} more")
    return "[" + ", ".join(items) + "]"


def needs_spec(fn: Callable[[StepRecord | None, RunInfo, KVCacheSpec], Value | None]) -> ValueFn:
    """A value function of the run's ``KVCacheSpec``; a static note when the trace has none."""

    def wrapped(rec: StepRecord | None, run: RunInfo) -> Value | None:
        if run.kv_cache is None:
            return Value("no KV-cache spec in this trace", "static")
        return fn(rec, run, run.kv_cache)

    wrapped.__name__ = fn.__name__
    wrapped.__doc__ = fn.__doc__
    return wrapped


def needs_step(fn: Callable[[StepRecord, RunInfo], Value | None]) -> ValueFn:
    """A value function of one step's record; None (nothing to show) without a step."""

    def wrapped(rec: StepRecord | None, run: RunInfo) -> Value | None:
        return None if rec is None else fn(rec, run)

    wrapped.__name__ = fn.__name__
    wrapped.__doc__ = fn.__doc__
    return wrapped
