"""The anchor table: where in vLLM 0.26's source a traced value belongs.

An anchor names a place by *qualified name + expression*, never by line
number, so the table survives lines moving between releases (``locate`` finds
the line each time). Each anchor also names the value to show there; the value
functions live in ``annotations.values`` under the same key.

Match modes (``Anchor.match``):

``def``
    the ``def`` line of the function ``qualname`` itself (``pattern`` unused).
``assign``
    the first assignment in ``qualname`` whose target code is ``pattern``,
    e.g. ``num_actual_tokens`` or ``key_cache, value_cache``.
``call``
    the first call in ``qualname`` whose callee code is ``pattern``
    (a subscripted callee such as a Triton launch ``kernel[grid](...)`` matches
    its name ``kernel``).
``expr``
    the first expression in ``qualname`` whose code is ``pattern``.

Code is compared with whitespace, trailing commas and one pair of enclosing
parentheses removed, so reformatting does not lose an anchor.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracer.format import ATTENTION, BLOCK_TABLE, CPU_ATTN, FLASH_ATTN, PAGED_ATTN

#: Match modes an ``Anchor`` can use (see the module docstring).
MATCH_MODES = ("def", "assign", "call", "expr")

#: All annotated files (the ones the tracer copies into a trace, ``SOURCE_FILES``), in
#: reading order.
ANNOTATED_FILES: tuple[str, ...] = (ATTENTION, FLASH_ATTN, CPU_ATTN, PAGED_ATTN, BLOCK_TABLE)

#: One line per file: what it is and whether vLLM 0.26 runs it.
FILE_ROLES: dict[str, str] = {
    ATTENTION: "The custom ops torch.compile sees: unified_kv_cache_update (write path) "
    "and unified_attention_with_output (read path) look up the layer's KV cache and call the backend.",
    FLASH_ATTN: "The FlashAttention backend (CUDA): do_kv_cache_update scatters new K/V with "
    "reshape_and_cache_flash; forward calls flash_attn_varlen_func on the paged cache.",
    # The CPU packing depends on the ISA; ``annotations.annotate.file_role`` names the traced one.
    CPU_ATTN: "The CPU backend: per (block, head) region the key half, then the value half (K^T [D][bs] "
    "then V [bs][D] for the vec/vec16 ISAs; AMX-packed K [bs/16][D/2][16][2] then V [D/16][bs/2][16][2] "
    "for bf16 with block_size % 32 == 0); cpu_attn_reshape_and_cache writes, cpu_attention_with_kv_cache reads.",
    PAGED_ATTN: "The legacy PagedAttention helper (ROCm / older layouts). Not called on vLLM 0.26's "
    "FlashAttention or CPU path; values here are computed for the captured cache.",
    BLOCK_TABLE: "The worker's block table: compute_slot_mapping launches a Triton kernel that turns "
    "(request, position) into slot = block_table[req, pos // block_size] * block_size + pos % block_size.",
}

#: Files whose code vLLM 0.26 does not run on the FlashAttention / CPU path.
OFF_PATH_FILES = frozenset({PAGED_ATTN})


@dataclass(frozen=True)
class Anchor:
    """One annotated place in one vLLM source file."""

    key: str  #: stable id, ``<file stem>.<function>.<what>``; also the ``values`` function key
    file: str  #: vLLM path, e.g. ``vllm/v1/attention/backends/flash_attn.py``
    qualname: str  #: qualified name of the enclosing function, e.g. ``FlashAttentionImpl.forward``
    match: str  #: one of ``MATCH_MODES``
    pattern: str  #: code to match (see the module docstring); empty for ``def``
    label: str  #: short name for the value, shown beside the line
    value: str  #: key into ``annotations.values.VALUE_FUNCTIONS``
    tour: str = ""  #: reading-checklist stop this anchor belongs to (``layout``, ``write``, ``read`` ...)


def _a(
    key: str, file: str, qualname: str, match: str, pattern: str, label: str, value: str = "", tour: str = ""
) -> Anchor:
    return Anchor(key, file, qualname, match, pattern, label, value or key, tour)


_FA_FWD = "FlashAttentionImpl.forward"
_FA_UPD = "FlashAttentionImpl.do_kv_cache_update"
_CPU_FWD = "CPUAttentionBackendImpl.forward"
_CPU_UPD = "CPUAttentionBackendImpl.do_kv_cache_update"
_PA_SPLIT = "PagedAttention.split_kv_cache"
_BT_KERNEL = "_compute_slot_mapping_kernel"

#: Every anchor, grouped by file in ``ANNOTATED_FILES`` order.
ANCHORS: tuple[Anchor, ...] = (
    # --- attention.py: the custom ops ---------------------------------------------
    _a(
        "attention.get_attention_context.slot_mapping",
        ATTENTION,
        "get_attention_context",
        "expr",
        "slot_mapping.get(layer_name)",
        "layer_slot_mapping",
        "layer_slot_mapping",
        "write",
    ),
    _a(
        "attention.unified_kv_cache_update.context",
        ATTENTION,
        "unified_kv_cache_update",
        "assign",
        "_, attn_layer, kv_cache, layer_slot_mapping",
        "layer",
        "layer_and_slots",
        "write",
    ),
    _a(
        "attention.unified_kv_cache_update.call",
        ATTENTION,
        "unified_kv_cache_update",
        "call",
        "attn_layer.impl.do_kv_cache_update",
        "do_kv_cache_update",
        "kv_update_call",
        "write",
    ),
    _a(
        "attention.unified_attention_with_output.context",
        ATTENTION,
        "unified_attention_with_output",
        "assign",
        "attn_metadata, self, kv_cache, _",
        "layer",
        "layer_name",
        "read",
    ),
    _a(
        "attention.unified_attention_with_output.call",
        ATTENTION,
        "unified_attention_with_output",
        "call",
        "self.impl.forward",
        "impl.forward",
        "forward_call",
        "read",
    ),
    # --- flash_attn.py: layout ----------------------------------------------------
    _a(
        "flash_attn.get_kv_cache_shape",
        FLASH_ATTN,
        "FlashAttentionBackend.get_kv_cache_shape",
        "expr",
        "(num_blocks, num_kv_heads, block_size, 2 * head_size)",
        "kv_cache shape",
        "kv_cache_shape",
        "layout",
    ),
    _a(
        "flash_attn.get_kv_cache_stride_order",
        FLASH_ATTN,
        "FlashAttentionBackend.get_kv_cache_stride_order",
        "def",
        "",
        "stride order",
        "stride_order",
        "layout",
    ),
    # --- flash_attn.py: write path --------------------------------------------------
    _a(
        "flash_attn.do_kv_cache_update.split",
        FLASH_ATTN,
        _FA_UPD,
        "assign",
        "key_cache, value_cache",
        "key_cache / value_cache",
        "flash_split",
        "write",
    ),
    _a(
        "flash_attn.do_kv_cache_update.reshape_and_cache_flash",
        FLASH_ATTN,
        _FA_UPD,
        "call",
        "reshape_and_cache_flash",
        "slot_mapping",
        "slot_mapping_write",
        "write",
    ),
    # --- flash_attn.py: forward ---------------------------------------------------
    _a(
        "flash_attn.forward.num_actual_tokens",
        FLASH_ATTN,
        _FA_FWD,
        "assign",
        "num_actual_tokens",
        "num_actual_tokens",
        "num_actual_tokens",
        "read",
    ),
    _a(
        "flash_attn.forward.split",
        FLASH_ATTN,
        _FA_FWD,
        "assign",
        "key_cache, value_cache",
        "key_cache / value_cache",
        "flash_split",
        "layout",
    ),
    _a(
        "flash_attn.forward.use_cascade",
        FLASH_ATTN,
        _FA_FWD,
        "expr",
        "attn_metadata.use_cascade",
        "use_cascade",
        "use_cascade",
        "read",
    ),
    _a(
        "flash_attn.forward.cu_seqlens_q",
        FLASH_ATTN,
        _FA_FWD,
        "assign",
        "cu_seqlens_q",
        "cu_seqlens_q",
        "query_start_loc",
        "read",
    ),
    _a("flash_attn.forward.seqused_k", FLASH_ATTN, _FA_FWD, "assign", "seqused_k", "seqused_k", "seq_lens", "read"),
    _a(
        "flash_attn.forward.max_seqlen_q",
        FLASH_ATTN,
        _FA_FWD,
        "assign",
        "max_seqlen_q",
        "max_seqlen_q",
        "max_query_len",
        "read",
    ),
    _a(
        "flash_attn.forward.max_seqlen_k",
        FLASH_ATTN,
        _FA_FWD,
        "assign",
        "max_seqlen_k",
        "max_seqlen_k",
        "max_seq_len",
        "read",
    ),
    _a(
        "flash_attn.forward.block_table",
        FLASH_ATTN,
        _FA_FWD,
        "assign",
        "block_table",
        "block_table",
        "block_table",
        "blocks",
    ),
    _a("flash_attn.forward.window", FLASH_ATTN, _FA_FWD, "assign", "window", "window", "sliding_window", "read"),
    _a("flash_attn.forward.causal", FLASH_ATTN, _FA_FWD, "assign", "causal", "causal", "causal", "read"),
    _a(
        "flash_attn.forward.flash_attn_varlen_func",
        FLASH_ATTN,
        _FA_FWD,
        "call",
        "flash_attn_varlen_func",
        "kernel call",
        "fa_call",
        "runs",
    ),
    # --- cpu_attn.py --------------------------------------------------------------
    _a(
        "cpu_attn.get_kv_cache_shape",
        CPU_ATTN,
        "CPUAttentionBackend.get_kv_cache_shape",
        "expr",
        "num_blocks, num_kv_heads, block_size, 2 * head_size",
        "kv_cache shape",
        "kv_cache_shape",
        "layout",
    ),
    _a(
        "cpu_attn.forward.num_actual_tokens",
        CPU_ATTN,
        _CPU_FWD,
        "assign",
        "num_actual_tokens",
        "num_actual_tokens",
        "num_actual_tokens",
        "read",
    ),
    _a(
        "cpu_attn.forward.view",
        CPU_ATTN,
        _CPU_FWD,
        "expr",
        "kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1))",
        "kv_cache.view",
        "cpu_view",
        "layout",
    ),
    _a(
        "cpu_attn.forward.chunk",
        CPU_ATTN,
        _CPU_FWD,
        "assign",
        "key_cache, value_cache",
        "key_cache / value_cache",
        "cpu_chunk",
        "layout",
    ),
    _a(
        "cpu_attn.forward.reshape_and_cache",
        CPU_ATTN,
        _CPU_FWD,
        "call",
        "ops.cpu_attn_reshape_and_cache",
        "slot_mapping",
        "cpu_forward_write",
        "write",
    ),
    _a(
        "cpu_attn.forward.attention",
        CPU_ATTN,
        _CPU_FWD,
        "call",
        "ops.cpu_attention_with_kv_cache",
        "kernel call",
        "cpu_call",
        "runs",
    ),
    _a(
        "cpu_attn.do_kv_cache_update.chunk",
        CPU_ATTN,
        _CPU_UPD,
        "assign",
        "key_cache, value_cache",
        "key_cache / value_cache",
        "cpu_chunk",
        "write",
    ),
    _a(
        "cpu_attn.do_kv_cache_update.reshape_and_cache",
        CPU_ATTN,
        _CPU_UPD,
        "call",
        "ops.cpu_attn_reshape_and_cache",
        "slot_mapping",
        "slot_mapping_write",
        "write",
    ),
    # --- paged_attn.py: legacy, not on the 0.26 path ---------------------------------
    _a("paged_attn.split_kv_cache", PAGED_ATTN, _PA_SPLIT, "def", "", "split_kv_cache", "split_not_called", "runs"),
    _a("paged_attn.split_kv_cache.x", PAGED_ATTN, _PA_SPLIT, "assign", "x", "x", "split_x", "layout"),
    _a(
        "paged_attn.split_kv_cache.num_blocks",
        PAGED_ATTN,
        _PA_SPLIT,
        "assign",
        "num_blocks",
        "num_blocks",
        "split_num_blocks",
        "layout",
    ),
    _a(
        "paged_attn.split_kv_cache.key_index",
        PAGED_ATTN,
        _PA_SPLIT,
        "expr",
        "kv_cache[0]",
        "kv_cache[0]",
        "split_key_index",
        "layout",
    ),
    _a(
        "paged_attn.split_kv_cache.key_view",
        PAGED_ATTN,
        _PA_SPLIT,
        "expr",
        "key_cache.view(num_blocks, num_kv_heads, head_size // x, -1, x)",
        "key_cache.view",
        "split_key_view",
        "layout",
    ),
    _a(
        "paged_attn.split_kv_cache.value_index",
        PAGED_ATTN,
        _PA_SPLIT,
        "expr",
        "kv_cache[1]",
        "kv_cache[1]",
        "split_value_index",
        "layout",
    ),
    _a(
        "paged_attn.split_kv_cache.value_view",
        PAGED_ATTN,
        _PA_SPLIT,
        "expr",
        "value_cache.view(num_blocks, num_kv_heads, head_size, -1)",
        "value_cache.view",
        "split_value_view",
        "layout",
    ),
    _a(
        "paged_attn.write_to_paged_cache",
        PAGED_ATTN,
        "PagedAttention.write_to_paged_cache",
        "call",
        "ops.reshape_and_cache",
        "slot_mapping",
        "legacy_write",
        "write",
    ),
    # --- block_table.py: slot mapping ------------------------------------------------
    _a(
        "block_table.compute_slot_mapping.launch",
        BLOCK_TABLE,
        "BlockTable.compute_slot_mapping",
        "call",
        "_compute_slot_mapping_kernel",
        "launch",
        "slot_kernel_launch",
        "write",
    ),
    _a(
        "block_table.kernel.block_indices",
        BLOCK_TABLE,
        _BT_KERNEL,
        "assign",
        "block_indices",
        "block index",
        "slot_block_indices",
        "write",
    ),
    _a(
        "block_table.kernel.block_numbers",
        BLOCK_TABLE,
        _BT_KERNEL,
        "assign",
        "block_numbers",
        "block number",
        "slot_block_numbers",
        "write",
    ),
    _a(
        "block_table.kernel.slot_offsets",
        BLOCK_TABLE,
        _BT_KERNEL,
        "assign",
        "slot_offsets",
        "offset",
        "slot_offsets",
        "write",
    ),
    _a("block_table.kernel.slot_ids", BLOCK_TABLE, _BT_KERNEL, "assign", "slot_ids", "slot", "slot_ids", "write"),
)


def anchors_for(vllm_path: str) -> tuple[Anchor, ...]:
    """The anchors of one annotated file, in table order (empty for other files)."""
    return tuple(a for a in ANCHORS if a.file == vllm_path)


def resolve_file(name: str) -> str | None:
    """Map a user's file name to an annotated vLLM path, or None.

    Accepts the full vLLM path (``vllm/v1/attention/backends/flash_attn.py``), a
    trailing part of it (``backends/flash_attn.py``), the base name
    (``flash_attn.py``) or the stem (``flash_attn``).
    """
    name = name.strip().replace("\\", "/")
    for path in ANNOTATED_FILES:
        base = path.rsplit("/", 1)[-1]
        if name in (path, base, base[:-3]) or path.endswith("/" + name.lstrip("/")):
            return path
    return None
