"""Torch readers and writers for the KV-cache layouts of :mod:`tracer.format.layouts`.

Every kernel in :mod:`reference_impl.kernel` reads one canonical form::

    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size]   ("NHD")

which is what ``FlashAttentionImpl.forward`` gets from
``kv_cache.transpose(1, 2).split(head_size, dim=-1)``. What each layout keeps where is
declared once, in the bottom layer's registry (``tracer.format.layouts.REGISTRY``, with
its :func:`describe_layout` / :func:`element_offset` geometry); this module registers one
reader (layout -> canonical K, V) in :data:`READERS` and one writer (canonical K, V ->
layout) in :data:`WRITERS` per registry name, and :func:`read_kv` dispatches through
them. :func:`cpu_layout_for` picks between the two CPU layouts the way vLLM does.

All conversions copy and are exact (they only move elements); a uint8 fp8 cache moves as
bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tracer.format.layouts import (
    FLASH_STRIDE_ORDER,
    LAYOUT_CPU,
    LAYOUT_CPU_AMX,
    LAYOUT_FLASH_HND,
    LAYOUT_FLASH_NHD,
    LAYOUT_LEGACY,
    LAYOUTS,
    ComponentView,
    LayoutDescription,
    StoredTensor,
    check_amx_shape,
    describe_layout,
    element_offset,
    flash_layout_name,
    flash_strides,
)

__all__ = [
    "LAYOUTS",
    "LAYOUT_CPU",
    "LAYOUT_CPU_AMX",
    "LAYOUT_FLASH_HND",
    "LAYOUT_FLASH_NHD",
    "LAYOUT_LEGACY",
    "READERS",
    "WRITERS",
    "ComponentView",
    "LayoutDescription",
    "StoredTensor",
    "cpu_amx_to_kv",
    "cpu_layout_for",
    "cpu_to_kv",
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
    "read_kv",
]


def _packed(t: torch.Tensor) -> torch.Tensor:
    """A freshly allocated row-major copy of ``t``.

    ``.contiguous()`` may keep a view whose size-1 dims carry other strides; a cache
    vLLM allocates always has the plain row-major ones.
    """
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _check_kv_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be [num_blocks, block_size, H_kv, D]; "
            f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if key_cache.dtype != value_cache.dtype:
        raise ValueError(f"key/value dtypes differ: {key_cache.dtype} vs {value_cache.dtype}")


# --------------------------------------------------------------------------- flash


def flash_to_kv(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a FlashAttention packed cache into the canonical K and V caches.

    Args:
        kv_cache: ``[num_blocks, H_kv, block_size, 2*D]``, any strides (NHD or HND
            physical order); read through logical indexing only.
        head_size: ``D``.

    Returns:
        ``(key_cache, value_cache)``, each ``[num_blocks, block_size, H_kv, D]``, contiguous
        copies in ``kv_cache.dtype``.
    """
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise ValueError(f"expected [num_blocks, H_kv, block_size, 2*{head_size}], got {tuple(kv_cache.shape)}")
    # Same view FlashAttentionImpl.forward takes: transpose(1, 2).split(D, -1).
    key_view, value_view = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return key_view.contiguous(), value_view.contiguous()


def kv_to_flash(key_cache: torch.Tensor, value_cache: torch.Tensor, layout: str = "NHD") -> torch.Tensor:
    """Pack canonical K and V caches into FlashAttention's cache with real vLLM strides.

    Args:
        key_cache: ``[num_blocks, block_size, H_kv, D]``.
        value_cache: ``[num_blocks, block_size, H_kv, D]``.
        layout: ``"NHD"``/``"flash_nhd"`` or ``"HND"``/``"flash_hnd"``.

    Returns:
        ``[num_blocks, H_kv, block_size, 2*D]`` whose strides equal
        :func:`flash_strides` for ``layout`` (allocated in physical order, then permuted to
        the logical shape, as vLLM's ``_reshape_kv_cache_tensors`` does).
    """
    _check_kv_pair(key_cache, value_cache)
    order = FLASH_STRIDE_ORDER[flash_layout_name(layout)]
    # logical: [nb, H, bs, 2D]
    logical_values = torch.cat([key_cache, value_cache], dim=-1).transpose(1, 2)
    physical = _packed(logical_values.permute(*order))
    inverse = [order.index(axis) for axis in range(4)]
    return physical.permute(*inverse)


# --------------------------------------------------------------------------- cpu


def cpu_to_kv(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Read the ``CPU_ATTN`` backend's cache into the canonical K and V caches.

    Args:
        kv_cache: ``[num_blocks, H_kv, block_size, 2*D]``; its elements are taken in
            row-major order (the backend's tensor is contiguous): per (block, kv head),
            ``D*block_size`` elements of K^T ``[D][bs]`` then ``block_size*D`` of V
            ``[bs][D]``.
        head_size: ``D``.

    Returns:
        ``(key_cache, value_cache)``, each ``[num_blocks, block_size, H_kv, D]``,
        contiguous, in ``kv_cache.dtype``.
    """
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise ValueError(f"expected [num_blocks, H_kv, block_size, 2*{head_size}], got {tuple(kv_cache.shape)}")
    num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    region = kv_cache.reshape(num_blocks, num_kv_heads, 2 * block_size * head_size)
    half = block_size * head_size
    key_t = region[..., :half].reshape(num_blocks, num_kv_heads, head_size, block_size)
    value = region[..., half:].reshape(num_blocks, num_kv_heads, block_size, head_size)
    key_cache = key_t.permute(0, 3, 1, 2).contiguous()
    value_cache = value.permute(0, 2, 1, 3).contiguous()
    return key_cache, value_cache


def kv_to_cpu(key_cache: torch.Tensor, value_cache: torch.Tensor) -> torch.Tensor:
    """Write canonical K and V caches in the ``CPU_ATTN`` backend's layout.

    Args:
        key_cache: ``[num_blocks, block_size, H_kv, D]``.
        value_cache: ``[num_blocks, block_size, H_kv, D]``.

    Returns:
        Contiguous ``[num_blocks, H_kv, block_size, 2*D]`` holding, per (block, kv head),
        K^T ``[D][bs]`` then V ``[bs][D]``.
    """
    _check_kv_pair(key_cache, value_cache)
    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    key_t = key_cache.permute(0, 2, 3, 1).reshape(num_blocks, num_kv_heads, -1)  # [nb,H,D*bs]
    value = value_cache.permute(0, 2, 1, 3).reshape(num_blocks, num_kv_heads, -1)  # [nb,H,bs*D]
    region = torch.cat([key_t, value], dim=-1)
    return _packed(region.reshape(num_blocks, num_kv_heads, block_size, 2 * head_size))


#: Element size -> the integer dtype of two elements (AMX keeps K's dims in pairs).
_PAIR_OF_SIZE = {1: torch.int16, 2: torch.int32, 4: torch.int64}


def cpu_amx_to_kv(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Read the ``CPU_ATTN`` backend's AMX-packed cache into the canonical K and V caches.

    Args:
        kv_cache: ``[num_blocks, H_kv, block_size, 2*D]`` taken in row-major order: per
            (block, kv head), K as ``[bs/16][D/2][16][2]`` then V as ``[D/16][bs/2][16][2]``.
        head_size: ``D``.

    Returns:
        ``(key_cache, value_cache)``, each ``[num_blocks, block_size, H_kv, D]``, contiguous.
    """
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise ValueError(f"expected [num_blocks, H_kv, block_size, 2*{head_size}], got {tuple(kv_cache.shape)}")
    num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    check_amx_shape(block_size, head_size)
    nb, nh, bs, d = num_blocks, num_kv_heads, block_size, head_size
    region = kv_cache.reshape(nb, nh, 2 * bs * d)
    # K: (block, head, token tile, dim pair, token in tile, dim in pair). A dim pair stays
    # together, so it moves as one integer of twice the element's width: half the elements.
    pair = _PAIR_OF_SIZE.get(kv_cache.element_size())
    key = region[..., : bs * d]
    if pair is not None:
        pairs = key.view(pair).reshape(nb, nh, bs // 16, d // 2, 16)
        key_cache = pairs.permute(0, 2, 4, 1, 3).contiguous().view(kv_cache.dtype).reshape(nb, bs, nh, d)
    else:
        key_cache = key.reshape(nb, nh, bs // 16, d // 2, 16, 2).permute(0, 2, 4, 1, 3, 5).reshape(nb, bs, nh, d)
    # V: (block, head, dim tile, token pair, dim in tile, token in pair)
    value = region[..., bs * d :].reshape(nb, nh, d // 16, bs // 2, 16, 2)
    value_cache = value.permute(0, 3, 5, 1, 2, 4).reshape(nb, bs, nh, d)
    return key_cache.contiguous(), value_cache.contiguous()


def kv_to_cpu_amx(key_cache: torch.Tensor, value_cache: torch.Tensor) -> torch.Tensor:
    """Write canonical K and V caches in the ``CPU_ATTN`` backend's AMX packing.

    Args:
        key_cache: ``[num_blocks, block_size, H_kv, D]``.
        value_cache: ``[num_blocks, block_size, H_kv, D]``.

    Returns:
        Contiguous ``[num_blocks, H_kv, block_size, 2*D]``: per (block, kv head), K as
        ``[bs/16][D/2][16][2]`` then V as ``[D/16][bs/2][16][2]``.
    """
    _check_kv_pair(key_cache, value_cache)
    nb, bs, nh, d = key_cache.shape
    check_amx_shape(bs, d)
    region = torch.empty(nb, nh, 2 * bs * d, dtype=key_cache.dtype, device=key_cache.device)
    # Each half is written in place; K's dim pairs move as one integer each (see cpu_amx_to_kv).
    pair = _PAIR_OF_SIZE.get(key_cache.element_size())
    if pair is not None:
        key = key_cache.contiguous().view(pair).reshape(nb, bs // 16, 16, nh, d // 2).permute(0, 3, 1, 4, 2)
        region[..., : bs * d].view(pair).view(nb, nh, bs // 16, d // 2, 16).copy_(key)
    else:
        key = key_cache.reshape(nb, bs // 16, 16, nh, d // 2, 2).permute(0, 3, 1, 4, 2, 5)
        region[..., : bs * d].view(nb, nh, bs // 16, d // 2, 16, 2).copy_(key)
    value = value_cache.reshape(nb, bs // 2, 2, nh, d // 16, 16).permute(0, 3, 4, 1, 5, 2)
    region[..., bs * d :].view(nb, nh, d // 16, bs // 2, 16, 2).copy_(value)
    return region.view(nb, nh, bs, 2 * d)


def cpu_layout_for(dtype: torch.dtype, block_size: int, head_size: int, amx_supported: bool) -> str:
    """Which CPU layout vLLM 0.26's ``_get_attn_isa`` leads to on an x86 host.

    ``amx_supported`` is ``torch.cpu._is_amx_tile_supported()`` on the traced host. A head
    size that is a multiple of 16 but not 32 takes ``vec16``; bf16 with AMX and
    ``block_size % 32 == 0`` takes ``amx``; everything else ``vec``. Only ``amx`` packs
    differently.
    """
    if head_size % 32 != 0 and head_size % 16 == 0:
        return LAYOUT_CPU
    if amx_supported and dtype == torch.bfloat16 and block_size % 32 == 0:
        return LAYOUT_CPU_AMX
    return LAYOUT_CPU


# --------------------------------------------------------------------------- legacy


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def legacy_x(dtype: torch.dtype) -> int:
    """``x = 16 // element_size``: elements per 16-byte vector in the legacy key cache."""
    return 16 // _element_size(dtype)


def kv_to_legacy(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write canonical caches in ``PagedAttention.split_kv_cache``'s layout.

    Args:
        key_cache: ``[num_blocks, block_size, H_kv, D]``; ``D`` divisible by
            ``x = legacy_x(dtype)``.
        value_cache: ``[num_blocks, block_size, H_kv, D]``.

    Returns:
        ``(key_legacy, value_legacy)``: contiguous ``[num_blocks, H_kv, D/x, block_size, x]``
        and ``[num_blocks, H_kv, D, block_size]``.
    """
    _check_kv_pair(key_cache, value_cache)
    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    x = legacy_x(key_cache.dtype)
    if head_size % x:
        raise ValueError(f"head_size {head_size} is not a multiple of x={x}")
    key_legacy = _packed(
        key_cache.reshape(num_blocks, block_size, num_kv_heads, head_size // x, x).permute(0, 2, 3, 1, 4)
    )
    value_legacy = _packed(value_cache.permute(0, 2, 3, 1))
    return key_legacy, value_legacy


def legacy_to_kv(key_legacy: torch.Tensor, value_legacy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Read ``PagedAttention.split_kv_cache``'s caches into the canonical form.

    Args:
        key_legacy: ``[num_blocks, H_kv, D/x, block_size, x]``.
        value_legacy: ``[num_blocks, H_kv, D, block_size]``.

    Returns:
        ``(key_cache, value_cache)``, each ``[num_blocks, block_size, H_kv, D]``, contiguous.
    """
    if key_legacy.dim() != 5 or value_legacy.dim() != 4:
        raise ValueError(
            "expected key [nb, H_kv, D/x, bs, x] and value [nb, H_kv, D, bs]; got "
            f"{tuple(key_legacy.shape)} and {tuple(value_legacy.shape)}"
        )
    num_blocks, num_kv_heads, d_over_x, block_size, x = key_legacy.shape
    if x != legacy_x(key_legacy.dtype):
        raise ValueError(f"last key dim is {x}, expected x={legacy_x(key_legacy.dtype)}")
    key_cache = key_legacy.permute(0, 3, 1, 2, 4).reshape(num_blocks, block_size, num_kv_heads, d_over_x * x)
    value_cache = value_legacy.permute(0, 3, 1, 2).contiguous()
    return key_cache.contiguous(), value_cache


def _split_legacy_stacked(
    kv_cache: torch.Tensor, num_kv_heads: int, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    # Mirrors PagedAttention.split_kv_cache on a (2, num_blocks, ...) tensor.
    x = legacy_x(kv_cache.dtype)
    num_blocks = kv_cache.shape[1]
    key_legacy = kv_cache[0].reshape(num_blocks, num_kv_heads, head_size // x, -1, x)
    value_legacy = kv_cache[1].reshape(num_blocks, num_kv_heads, head_size, -1)
    return key_legacy, value_legacy


# --------------------------------------------------------------------------- fp8 + dispatch


def dequant_fp8(cache_uint8: torch.Tensor, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Read fp8 (e4m3fn) bytes and scale them to fp32.

    Args:
        cache_uint8: any shape, dtype ``uint8`` (vLLM's storage for ``kv_cache_dtype="fp8"``)
            or ``float8_e4m3fn``.
        scale: the layer's ``k_scale`` / ``v_scale``; a float or a tensor broadcastable to
            the cache.

    Returns:
        Same shape as ``cache_uint8``, fp32: ``e4m3(byte) * scale``.
    """
    if cache_uint8.dtype == torch.uint8:
        values = cache_uint8.view(torch.float8_e4m3fn)
    elif cache_uint8.dtype == torch.float8_e4m3fn:
        values = cache_uint8
    else:
        raise TypeError(f"expected uint8 or float8_e4m3fn storage, got {cache_uint8.dtype}")
    return values.to(torch.float32) * torch.as_tensor(scale, dtype=torch.float32)


def read_kv(
    kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    layout: str,
    head_size: int,
    num_kv_heads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read any recorded layout into canonical ``[num_blocks, block_size, H_kv, D]`` K, V.

    Args:
        kv_cache: for ``flash_nhd``/``flash_hnd``/``cpu``/``cpu_amx``, the layer's
            ``[num_blocks, H_kv, block_size, 2*D]`` tensor; for ``legacy``, either
            ``(key_legacy, value_legacy)`` or the stacked ``(2, num_blocks, ...)`` tensor
            ``split_kv_cache`` receives (then ``num_kv_heads`` is required).
        layout: one of :data:`LAYOUTS`. Both flash names read by logical indexing, so the
            name only documents the physical order.
        head_size: ``D``.
        num_kv_heads: only for a stacked legacy tensor.

    Returns:
        ``(key_cache, value_cache)`` in the stored dtype (uint8 fp8 stays uint8).
    """
    reader = READERS.get(layout)
    if reader is None:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    if layout == LAYOUT_LEGACY and isinstance(kv_cache, torch.Tensor):
        if num_kv_heads is None:
            raise ValueError("a stacked legacy cache needs num_kv_heads")
        kv_cache = _split_legacy_stacked(kv_cache, num_kv_heads, head_size)
    return reader(kv_cache, head_size)


# --------------------------------------------------------------------------- registration

#: A reader: ``(stored cache, head_size) -> (key_cache, value_cache)``, canonical
#: ``[num_blocks, block_size, H_kv, D]`` each. The stored cache is the layer's
#: ``[num_blocks, H_kv, block_size, 2*D]`` tensor, or ``(key_legacy, value_legacy)``.
Reader = Callable[..., tuple[torch.Tensor, torch.Tensor]]
#: A writer: ``(key_cache, value_cache) -> stored cache``, the inverse of the reader.
Writer = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]

#: Registry layout name -> reader (``tests/test_layouts.py`` checks every name has one).
READERS: dict[str, Reader] = {
    LAYOUT_FLASH_NHD: flash_to_kv,
    LAYOUT_FLASH_HND: flash_to_kv,  # logical indexing: the name only documents the order
    LAYOUT_CPU: cpu_to_kv,
    LAYOUT_CPU_AMX: cpu_amx_to_kv,
    LAYOUT_LEGACY: lambda kv, head_size: legacy_to_kv(*kv),
}

#: Registry layout name -> writer, with the strides vLLM allocates.
WRITERS: dict[str, Writer] = {
    LAYOUT_FLASH_NHD: lambda k, v: kv_to_flash(k, v, LAYOUT_FLASH_NHD),
    LAYOUT_FLASH_HND: lambda k, v: kv_to_flash(k, v, LAYOUT_FLASH_HND),
    LAYOUT_CPU: kv_to_cpu,
    LAYOUT_CPU_AMX: kv_to_cpu_amx,
    LAYOUT_LEGACY: kv_to_legacy,
}
