"""One captured forward call, and how it becomes a ``StepRecord`` once the step is over.

The hook (``tracer.hooks.Tracer._on_forward``) fills a :class:`Pending` with device-side
clones and appends it; nothing here runs on the hot path. ``Pending.shape`` is called
when the model runner's step returns: it copies to the host (the only host syncs),
trims the block table to the blocks each request uses and builds the record. The layer's
q/k/v scales (what FlashAttention's fp8 path is given as ``{q,k,v}_descale``) travel the same
way: :func:`capture_scales` clones the device tensors in the hook, ``shape`` reads them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tracer.format import StepRecord

__all__ = ["Pending", "capture_scales", "dtype_name"]

#: The attention layer's fp8 scales as ``StepRecord`` fields -> the layer attributes holding them:
#: the device tensor FlashAttention is given as ``{q,k,v}_descale``, then the host float vLLM
#: keeps beside it (set together by vLLM's ``set_default_quant_scales`` / ``calc_kv_scales``).
SCALE_ATTRS = {
    "q_scale": ("_q_scale", "_q_scale_float"),
    "k_scale": ("_k_scale", "_k_scale_float"),
    "v_scale": ("_v_scale", "_v_scale_float"),
}


@dataclass
class Pending:
    """One captured forward call, tensors still on the device."""

    step: int  #: 0-based step index
    kind: str  #: one of ``STEP_KINDS``
    layer: str  #: vLLM's layer name, e.g. ``model.layers.0.self_attn.attn``
    impl: Any  #: the backend's ``AttentionImpl`` instance
    metadata: dict[str, Any]  #: ``StepRecord`` fields already read as Python numbers
    device_tensors: dict[str, Any]  #: clones on the device: metadata tensors, and the data when saved
    kv_cache: Any  #: the layer's cache tensor (not a copy)
    req_ids: tuple[str, ...]  #: one per request row; ``""`` where the runner gave none
    #: ``capture_scales(layer)``: per scale field, a device clone or a host float
    scales: dict[str, Any] = field(default_factory=dict)

    def shape(self) -> tuple[StepRecord, dict[str, Any] | None]:
        """Copy to the host; the record, and its tensors when this call saved them."""
        host = {k: v.to("cpu") for k, v in self.device_tensors.items()}
        scales = {k: _scale_value(v) for k, v in self.scales.items()}
        seq_lens = [int(s) for s in host["seq_lens"].tolist()]
        block_size = int(self.kv_cache.shape[2])
        rows = host["block_table"].tolist()
        block_table = tuple(
            tuple(int(b) for b in row[: math.ceil(s / block_size)]) for row, s in zip(rows, seq_lens, strict=False)
        )
        rec = StepRecord(
            alibi_slopes=_floats(getattr(self.impl, "alibi_slopes", None)),
            sinks=_floats(getattr(self.impl, "sinks", None)),
            step=self.step,
            layer=self.layer,
            kind=self.kind,
            request_ids=self.req_ids,
            query_start_loc=tuple(int(x) for x in host["query_start_loc"].tolist()),
            seq_lens=tuple(seq_lens),
            block_table=block_table,
            slot_mapping=tuple(int(x) for x in host["slot_mapping"].tolist()),
            q_scale=scales.get("q_scale"),
            k_scale=scales.get("k_scale"),
            v_scale=scales.get("v_scale"),
            **self.metadata,
        )
        tensors = None
        if "query" in host:
            tensors = self._tensor_payload(host, block_table)
        return rec, tensors

    def _tensor_payload(self, host: dict[str, Any], block_table) -> dict[str, Any]:
        import torch

        ids = sorted({b for row in block_table for b in row})
        index = torch.tensor(ids, dtype=torch.long, device=self.kv_cache.device)
        kv_blocks = self.kv_cache.index_select(0, index).to("cpu")
        n, h, d = self.metadata["num_actual_tokens"], self.metadata["num_heads"], self.metadata["head_size"]
        out = {
            "query": host["query"].reshape(n, h, d),
            "output": host["output"].reshape(n, h, d),
            "kv_blocks": kv_blocks,
            "kv_block_ids": torch.tensor(ids, dtype=torch.int32),
        }
        for k in ("key", "value"):
            if k in host:
                out[k] = host[k]
        return out


def _floats(tensor: Any) -> tuple[float, ...] | None:
    """A small per-head tensor (ALiBi slopes, sinks) as floats; read at flush, off the hot path."""
    if tensor is None:
        return None
    return tuple(float(x) for x in tensor.detach().float().cpu().tolist())


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


def dtype_name(tensor_or_dtype: Any) -> str:
    """``torch.float8_e4m3fn`` -> ``float8_e4m3fn``: a dtype, or a tensor's (no host sync)."""
    return str(getattr(tensor_or_dtype, "dtype", tensor_or_dtype)).removeprefix("torch.")


def _scale_value(value: Any) -> float | None:
    """A captured scale as one float, at flush: a scalar, or a per-head tensor whose heads all agree.

    Per-head scales that differ cannot be one ``StepRecord`` float: None (not recorded) then.
    """
    if value is None or isinstance(value, float):
        return value
    flat = value.detach().float().reshape(-1).cpu()
    if flat.numel() == 0 or not bool((flat == flat[0]).all()):
        return None
    return float(flat[0])
