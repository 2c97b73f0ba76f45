"""The keyword options of one captured step, declared once.

Every kernel takes the varlen batch positionally and the step's math as keywords::

    fn(query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
       *, scale, causal, window, softcap, alibi_slopes, sinks, k_scale, v_scale)

:class:`KernelOptions` holds those keywords, with the defaults the kernels declare: it is
built once per step from the trace (:meth:`KernelOptions.from_step`), and
:meth:`KernelOptions.kwargs` gives the keywords to call a kernel with. Options that are
not the step's but the call's (``compute_dtype``) or one form's tuning (``return_lse``,
``max_kv_elems``, ``max_score_elems``, ``partition_size``) are passed beside them.

Imports torch and ``tracer.format`` (the bottom layer) only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from tracer.format import KVCacheSpec, StepRecord

__all__ = ["NEUTRAL", "KernelOptions", "changes_nothing"]


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """The step's math, as the kernels' keyword arguments (see :mod:`reference_impl.kernel`)."""

    scale: float  #: logit scale, usually ``1 / sqrt(D)``
    causal: bool = True  #: mask keys after the query's position (aligned bottom-right)
    window: tuple[int, int] = (-1, -1)  #: ``(left, right)`` sliding window in tokens, -1 = unlimited
    softcap: float = 0.0  #: logits become ``softcap * tanh(logit / softcap)``; 0 = off
    alibi_slopes: tuple[float, ...] | None = None  #: ``[H]`` ALiBi slope per query head
    sinks: tuple[float, ...] | None = None  #: ``[H]`` sink logit per query head
    k_scale: float = 1.0  #: fp8 caches: K = e4m3(byte) * k_scale; other caches ignore it
    v_scale: float = 1.0  #: fp8 caches: V = e4m3(byte) * v_scale; other caches ignore it

    @classmethod
    def from_step(cls, record: StepRecord, spec: KVCacheSpec) -> KernelOptions:
        """The options vLLM ran ``record`` with.

        The scales are the record's (format 2: what the engine used that step), else the
        trace's ``spec``'s. A ``logits_soft_cap`` of None (JSON null) is 0: vLLM's
        ``FlashAttentionImpl`` turns None into 0, "no soft-cap" to flash-attn.
        """
        return cls(
            scale=record.scale,
            causal=record.causal,
            window=(-1, -1) if record.sliding_window is None else (record.sliding_window[0], record.sliding_window[1]),
            softcap=float(record.logits_soft_cap or 0.0),
            alibi_slopes=None if record.alibi_slopes is None else tuple(record.alibi_slopes),
            sinks=None if record.sinks is None else tuple(record.sinks),
            k_scale=spec.k_scale if record.k_scale is None else float(record.k_scale),
            v_scale=spec.v_scale if record.v_scale is None else float(record.v_scale),
        )

    def kwargs(self) -> dict[str, Any]:
        """The keywords a kernel is called with; ``alibi_slopes`` / ``sinks`` as fp32 ``[H]``.

        Those two are left out when unset (only models that have them pass them), so
        kernels that do not declare them still run.
        """
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in _PER_HEAD:
                if value is not None:
                    out[field.name] = torch.tensor(value, dtype=torch.float32)
            else:
                out[field.name] = value
        return out


#: The per-head options, passed as tensors and only when set.
_PER_HEAD = ("alibi_slopes", "sinks")

#: Keyword values that change nothing (the declared defaults): a kernel that does not
#: declare such a keyword can still be called (``reference_impl.testing.kernel_kwargs``).
NEUTRAL: dict[str, Any] = {
    field.name: field.default
    for field in dataclasses.fields(KernelOptions)
    if field.default is not dataclasses.MISSING and field.name not in _PER_HEAD
}


def changes_nothing(name: str, value: Any, *, fp8_cache: bool) -> bool:
    """Whether keyword ``name=value`` may be left out for a kernel that does not declare it.

    True for a neutral value (:data:`NEUTRAL`) and for the scales of a non-fp8 cache
    (vLLM ignores them there; so does the reference).
    """
    if name in ("k_scale", "v_scale") and not fp8_cache:
        return True
    neutral = NEUTRAL.get(name, _NO_DEFAULT)
    if isinstance(neutral, tuple):
        return isinstance(value, (tuple, list)) and tuple(value) == neutral
    return value == neutral


_NO_DEFAULT = object()
