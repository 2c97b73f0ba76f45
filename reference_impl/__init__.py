"""Torch-only reference for vLLM 0.26's PagedAttention, to replay recorded traces.

Nothing here imports vllm; everything but the pytest plugin imports only torch, the
standard library and ``tracer.format`` (the bottom layer) (to read traces).

:mod:`reference_impl.kernel`
    The readable reference: paged attention as a block loop with online softmax and
    split into partitions merged by log-sum-exp; a dense reference. Shapes and
    semantics of every form are in its docstring.
:mod:`reference_impl.fast`
    The same attention as a fast batched gather (on the core in
    :mod:`reference_impl.gathered`), to replay traces.
:mod:`reference_impl.compiled`
    :func:`paged_attention_fast` with its decode rows in a small C++ kernel built on first
    use (opt-in, for replaying long traces; needs a C++ compiler and ninja).
:mod:`reference_impl.tolerances`, :mod:`reference_impl.emulation`
    The bar every kernel is held to: a small multiple of FlashAttention's own rounding
    (emulated: fp32 scores and softmax, P rounded before P·V, fp8 as FA3 runs it), per head.
:mod:`reference_impl.options`
    :class:`~reference_impl.options.KernelOptions`: a step's kernel keywords, declared once.
:mod:`reference_impl.layouts`
    Torch readers and writers for the KV-cache layouts of the bottom layer's registry
    (FlashAttention NHD/HND, the CPU backend's K^T|V regions and their AMX packing, the
    legacy ``[.., D/x, bs, x]`` split, fp8 bytes), to and from the canonical
    ``[num_blocks, block_size, H_kv, D]`` K and V caches.
:mod:`reference_impl.replay`
    Reruns each captured step from a trace and compares with vLLM's output; checks the
    KV write path and the legacy layout (``pagedtrace replay``), with
    :mod:`~reference_impl.resolve`, :mod:`~reference_impl.inputs` and
    :mod:`~reference_impl.checks`.
:mod:`reference_impl.testing`, :mod:`reference_impl.pytest_plugin`, :mod:`reference_impl.kernel_check`
    Check any user's kernel against real vLLM steps, from Python or pytest
    (``pytest -p reference_impl.pytest_plugin``; the plugin imports pytest).
"""

from reference_impl.compiled import paged_attention_compiled
from reference_impl.fast import paged_attention_fast
from reference_impl.kernel import (
    combine_partitions,
    dense_attention,
    paged_attention_loop,
    paged_attention_partitioned,
)
from reference_impl.layouts import (
    LAYOUT_CPU,
    LAYOUT_CPU_AMX,
    LAYOUT_FLASH_HND,
    LAYOUT_FLASH_NHD,
    LAYOUT_LEGACY,
    LAYOUTS,
    ComponentView,
    LayoutDescription,
    StoredTensor,
    cpu_amx_to_kv,
    cpu_layout_for,
    cpu_to_kv,
    dequant_fp8,
    describe_layout,
    element_offset,
    flash_strides,
    flash_to_kv,
    kv_to_cpu,
    kv_to_cpu_amx,
    kv_to_flash,
    kv_to_legacy,
    legacy_to_kv,
    legacy_x,
    read_kv,
)
from reference_impl.tolerances import compare, tolerance

__all__ = [
    "LAYOUTS",
    "LAYOUT_CPU",
    "LAYOUT_CPU_AMX",
    "LAYOUT_FLASH_HND",
    "LAYOUT_FLASH_NHD",
    "LAYOUT_LEGACY",
    "ComponentView",
    "LayoutDescription",
    "StoredTensor",
    "combine_partitions",
    "compare",
    "cpu_amx_to_kv",
    "cpu_layout_for",
    "cpu_to_kv",
    "dense_attention",
    "dequant_fp8",
    "describe_layout",
    "element_offset",
    "flash_strides",
    "flash_to_kv",
    "kv_to_cpu",
    "kv_to_cpu_amx",
    "kv_to_flash",
    "kv_to_legacy",
    "legacy_to_kv",
    "legacy_x",
    "paged_attention_compiled",
    "paged_attention_fast",
    "paged_attention_loop",
    "paged_attention_partitioned",
    "read_kv",
    "tolerance",
]
