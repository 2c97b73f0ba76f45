"""The KV-cache layout registry: every layout's name, memory order and geometry, declared once.

A layout is how one attention backend keeps a layer's paged K/V cache in memory. Each
is declared here once, as a :class:`Layout`: the name a trace stores
(``KVCacheSpec.layout``), a title, its memory order outermost to innermost, and a
description; :func:`describe_layout` and :func:`element_offset` give its exact geometry
(tensors, strides, where element ``K[block, token, head, dim]`` lives) in plain
arithmetic. Every room reads layouts through this module: the tracer names the layout
it saw, ``reference_impl.layouts`` registers its torch readers and writers against these
names (a test checks both lists agree), the annotator and the HTML report describe and
draw them, all without torch.

Layouts in vLLM 0.26:

``flash_nhd`` / ``flash_hnd``
    FlashAttention's packed cache, logical shape ``(num_blocks, H_kv, block_size, 2*D)``
    with K in ``[..., :D]`` and V in ``[..., D:]``; ``forward`` splits it with
    ``kv_cache.transpose(1, 2).split(D, -1)``. ``get_kv_cache_stride_order`` picks the
    physical order: NHD ``(0, 2, 1, 3)`` keeps memory as (blocks, tokens, heads, K|V),
    HND ``(0, 1, 2, 3)`` as (blocks, heads, tokens, K|V).
``cpu``
    The ``CPU_ATTN`` backend (``vec``/``vec16`` ISAs): the same logical shape, contiguous,
    each (block, kv head) region of ``2*block_size*D`` elements holding K transposed
    ``[D][bs]`` then V ``[bs][D]``.
``cpu_amx``
    The same backend with the ``amx`` ISA (bf16, ``block_size % 32 == 0``, a CPU with AMX
    tiles): the same regions, VNNI-packed in pairs for the tile loads: K as
    ``[bs/16][D/2][16][2]``, V as ``[D/16][bs/2][16][2]``.
``legacy``
    ``PagedAttention.split_kv_cache`` (``vllm/v1/attention/ops/paged_attn.py``): key
    ``[num_blocks, H_kv, D/x, block_size, x]`` with ``x = 16 // element_size``, value
    ``[num_blocks, H_kv, D, block_size]``. In vLLM 0.26 only the ROCm backends call it;
    the FlashAttention and CPU backends never do. A trace never stores it; replay
    converts to it to show the x split is storage only.

A backend still to come adds one :class:`Layout` to :data:`REGISTRY` and one branch to
:func:`describe_layout`; the readers/writers register in ``reference_impl.layouts``.

Standard library only.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

__all__ = [
    "LAYOUTS",
    "LAYOUT_CPU",
    "LAYOUT_CPU_AMX",
    "LAYOUT_FLASH_HND",
    "LAYOUT_FLASH_NHD",
    "LAYOUT_LEGACY",
    "REGISTRY",
    "STORED_LAYOUTS",
    "ComponentView",
    "Layout",
    "LayoutDescription",
    "StoredTensor",
    "check_amx_shape",
    "describe_layout",
    "element_offset",
    "flash_strides",
    "layout_info",
    "token_elements",
]

LAYOUT_FLASH_NHD = "flash_nhd"
LAYOUT_FLASH_HND = "flash_hnd"
LAYOUT_CPU = "cpu"
LAYOUT_CPU_AMX = "cpu_amx"
LAYOUT_LEGACY = "legacy"


@dataclasses.dataclass(frozen=True)
class Layout:
    """One KV-cache layout as a backend keeps it in memory."""

    name: str  #: the name traces and replay use, e.g. ``flash_nhd``
    title: str  #: a short human name, e.g. ``FlashAttention, NHD``
    backend: str  #: who allocates it, e.g. ``FlashAttentionBackend``
    memory_order: str  #: dims outermost to innermost; ``{x}`` stands for the legacy vector width
    description: str  #: one sentence: what is where
    stored: bool = True  #: a trace may record it (``legacy`` is only converted to)


#: Every layout, in the order reports list them.
REGISTRY: dict[str, Layout] = {
    layout.name: layout
    for layout in (
        Layout(
            LAYOUT_FLASH_NHD,
            "FlashAttention, NHD",
            "FlashAttentionBackend",
            "(blocks, tokens, heads, K|V)",
            "logical (num_blocks, H_kv, block_size, 2*D) with K in [..., :D] and V in [..., D:]; "
            "stride order (0, 2, 1, 3): a token's heads lie side by side",
        ),
        Layout(
            LAYOUT_FLASH_HND,
            "FlashAttention, HND",
            "FlashAttentionBackend",
            "(blocks, heads, tokens, K|V)",
            "logical (num_blocks, H_kv, block_size, 2*D) with K in [..., :D] and V in [..., D:]; "
            "stride order (0, 1, 2, 3): a head's tokens lie side by side",
        ),
        Layout(
            LAYOUT_CPU,
            "CPU backend (vec ISA)",
            "CPUAttentionBackend",
            "(blocks, heads, [K^T (dim, tokens) | V (tokens, dim)])",
            "per (block, kv head) region of 2*block_size*D elements: K transposed [D][bs], then V [bs][D]",
        ),
        Layout(
            LAYOUT_CPU_AMX,
            "CPU backend (AMX ISA)",
            "CPUAttentionBackend",
            "(blocks, heads, [K (tokens/16, dim/2, 16 tokens, 2 dims) | V (dim/16, tokens/2, 16 dims, 2 tokens)])",
            "per (block, kv head) region: K as [bs/16][D/2][16][2] (token tile, dim pair, token, dim "
            "within pair), V as [D/16][bs/2][16][2] (dim tile, token pair, dim, token within pair), "
            "pairs side by side for the AMX tile loads",
        ),
        Layout(
            LAYOUT_LEGACY,
            "PagedAttention x-split (ROCm)",
            "PagedAttention.split_kv_cache",
            "key: (blocks, heads, dim/{x}, tokens, {x}); value: (blocks, heads, dim, tokens)",
            "key [num_blocks, H_kv, D/x, block_size, x] with x = 16 // element_size (16-byte vectors), "
            "value [num_blocks, H_kv, D, block_size]; only ROCm backends call split_kv_cache in vLLM 0.26",
            stored=False,
        ),
    )
}

#: Every layout name, in the order reports list them.
LAYOUTS = tuple(REGISTRY)
#: The names a trace's ``KVCacheSpec.layout`` may hold.
STORED_LAYOUTS = tuple(name for name, layout in REGISTRY.items() if layout.stored)

# vLLM's get_kv_cache_stride_order: the permutation from the logical shape
# (num_blocks, H_kv, block_size, 2*D) to the physical (allocation) order.
FLASH_STRIDE_ORDER = {
    LAYOUT_FLASH_NHD: (0, 2, 1, 3),
    LAYOUT_FLASH_HND: (0, 1, 2, 3),
}
_FLASH_NAMES = {"NHD": LAYOUT_FLASH_NHD, "HND": LAYOUT_FLASH_HND}


def layout_info(name: str) -> Layout:
    """The registry entry for ``name``; a ``ValueError`` naming the known layouts otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown layout {name!r}; expected one of {LAYOUTS}") from None


def flash_layout_name(layout: str) -> str:
    """``NHD``/``HND`` (vLLM's spelling) or a registry name -> the registry name."""
    name = _FLASH_NAMES.get(layout, layout)
    if name not in FLASH_STRIDE_ORDER:
        raise ValueError(f"unknown FlashAttention layout {layout!r}; use 'NHD' or 'HND'")
    return name


def check_amx_shape(block_size: int, head_size: int) -> None:
    """The AMX packing tiles by 16: a ``ValueError`` for sizes it cannot hold."""
    if block_size % 16 or head_size % 16:
        raise ValueError(
            f"the AMX layout tiles by 16: block_size {block_size} and head_size {head_size} must be multiples of 16"
        )


def flash_strides(
    num_blocks: int, num_kv_heads: int, block_size: int, head_size: int, layout: str = "NHD"
) -> tuple[int, int, int, int]:
    """Element strides of FlashAttention's logical ``(nb, H_kv, bs, 2*D)`` cache.

    ``layout`` is ``"NHD"``/``"flash_nhd"`` or ``"HND"``/``"flash_hnd"``. The strides are
    those of the tensor vLLM hands the backend: allocated contiguous in the physical order,
    then permuted back to the logical shape.
    """
    order = FLASH_STRIDE_ORDER[flash_layout_name(layout)]
    logical = (num_blocks, num_kv_heads, block_size, 2 * head_size)
    physical = [logical[i] for i in order]
    physical_strides = [0] * 4
    step = 1
    for axis in range(3, -1, -1):
        physical_strides[axis] = step
        step *= physical[axis]
    strides = [0] * 4
    for physical_axis, logical_axis in enumerate(order):
        strides[logical_axis] = physical_strides[physical_axis]
    return tuple(strides)  # type: ignore[return-value]


# --------------------------------------------------------------------------- description


@dataclasses.dataclass(frozen=True)
class ComponentView:
    """Where K (or V) of one layout lives, as a strided view of a stored tensor's memory.

    ``offset(idx) = storage_offset + sum(i * s for i, s in zip(idx, strides))`` in elements
    of the stored tensor, with ``idx`` named by ``dims``.
    """

    component: str  #: "k" or "v"
    tensor: str  #: name of the stored tensor it lives in: "kv_cache", "key_cache", "value_cache"
    dims: tuple[str, ...]  #: index names, e.g. ("block", "head", "dim", "token")
    shape: tuple[int, ...]
    strides: tuple[int, ...]  #: elements
    storage_offset: int  #: elements


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """One tensor a backend allocates for a layer's cache."""

    name: str  #: "kv_cache", "key_cache" or "value_cache"
    logical_shape: tuple[int, ...]  #: shape as the backend indexes it
    strides: tuple[int, ...]  #: elements, of that logical shape
    numel: int


@dataclasses.dataclass(frozen=True)
class LayoutDescription:
    """What a report needs to draw one layout: tensors, strides and memory order."""

    layout: str  #: one of LAYOUTS
    num_blocks: int
    num_kv_heads: int
    block_size: int  #: tokens per block
    head_size: int  #: D
    element_size: int  #: bytes per element
    memory_order: str  #: outermost to innermost, e.g. "(blocks, tokens, heads, K|V)"
    tensors: tuple[StoredTensor, ...]
    k_view: ComponentView
    v_view: ComponentView

    @property
    def bytes_per_block(self) -> int:
        """K and V bytes of one physical block over all kv heads."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.element_size

    @property
    def total_bytes(self) -> int:
        """Bytes of all stored tensors together."""
        return sum(t.numel for t in self.tensors) * self.element_size


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def describe_layout(
    layout: str,
    num_blocks: int,
    num_kv_heads: int,
    block_size: int,
    head_size: int,
    element_size: int = 2,
) -> LayoutDescription:
    """Describe ``layout`` for ``(num_blocks, H_kv, block_size, D)`` and an element size.

    ``element_size`` (bytes) matters only for ``legacy``, where it sets
    ``x = 16 // element_size``.
    """
    nb, nh, bs, d = num_blocks, num_kv_heads, block_size, head_size
    if layout in FLASH_STRIDE_ORDER:
        shape = (nb, nh, bs, 2 * d)
        strides = flash_strides(nb, nh, bs, d, layout)
        tensors: tuple[StoredTensor, ...] = (StoredTensor("kv_cache", shape, strides, nb * nh * bs * 2 * d),)
        dims = ("block", "head", "token", "dim")
        view_strides = strides
        k_view = ComponentView("k", "kv_cache", dims, (nb, nh, bs, d), view_strides, 0)
        v_view = ComponentView("v", "kv_cache", dims, (nb, nh, bs, d), view_strides, d)
        memory_order = REGISTRY[layout].memory_order
    elif layout == LAYOUT_CPU:
        shape = (nb, nh, bs, 2 * d)
        tensors = (StoredTensor("kv_cache", shape, _contiguous_strides(shape), nb * nh * bs * 2 * d),)
        region = 2 * bs * d
        k_view = ComponentView(
            "k",
            "kv_cache",
            ("block", "head", "dim", "token"),
            (nb, nh, d, bs),
            (nh * region, region, bs, 1),
            0,
        )
        v_view = ComponentView(
            "v",
            "kv_cache",
            ("block", "head", "token", "dim"),
            (nb, nh, bs, d),
            (nh * region, region, d, 1),
            bs * d,
        )
        memory_order = REGISTRY[layout].memory_order
    elif layout == LAYOUT_CPU_AMX:
        check_amx_shape(bs, d)
        shape = (nb, nh, bs, 2 * d)
        tensors = (StoredTensor("kv_cache", shape, _contiguous_strides(shape), nb * nh * bs * 2 * d),)
        region = 2 * bs * d
        k_view = ComponentView(
            "k",
            "kv_cache",
            ("block", "head", "token // 16", "dim // 2", "token % 16", "dim % 2"),
            (nb, nh, bs // 16, d // 2, 16, 2),
            (nh * region, region, 16 * d, 32, 2, 1),
            0,
        )
        v_view = ComponentView(
            "v",
            "kv_cache",
            ("block", "head", "dim // 16", "token // 2", "dim % 16", "token % 2"),
            (nb, nh, d // 16, bs // 2, 16, 2),
            (nh * region, region, 16 * bs, 32, 2, 1),
            bs * d,
        )
        memory_order = REGISTRY[layout].memory_order
    elif layout == LAYOUT_LEGACY:
        x = 16 // element_size
        if d % x:
            raise ValueError(f"head_size {d} is not a multiple of x={x}")
        key_shape = (nb, nh, d // x, bs, x)
        value_shape = (nb, nh, d, bs)
        key_strides = _contiguous_strides(key_shape)
        value_strides = _contiguous_strides(value_shape)
        tensors = (
            StoredTensor("key_cache", key_shape, key_strides, nb * nh * d * bs),
            StoredTensor("value_cache", value_shape, value_strides, nb * nh * d * bs),
        )
        k_view = ComponentView(
            "k",
            "key_cache",
            ("block", "head", "dim // x", "token", "dim % x"),
            key_shape,
            key_strides,
            0,
        )
        v_view = ComponentView("v", "value_cache", ("block", "head", "dim", "token"), value_shape, value_strides, 0)
        memory_order = REGISTRY[layout].memory_order.format(x=x)
    else:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    return LayoutDescription(
        layout=layout,
        num_blocks=nb,
        num_kv_heads=nh,
        block_size=bs,
        head_size=d,
        element_size=element_size,
        memory_order=memory_order,
        tensors=tensors,
        k_view=k_view,
        v_view=v_view,
    )


def element_offset(
    layout: str,
    block: int,
    head: int,
    token: int,
    dim: int,
    which: str = "k",
    *,
    num_kv_heads: int,
    block_size: int,
    head_size: int,
    element_size: int = 2,
) -> int:
    """Flat element offset of ``K[block, token, head, dim]`` (or V) in ``layout``'s memory.

    The offset counts elements from the start of the stored tensor named by
    ``describe_layout(...).k_view.tensor`` (``kv_cache`` for flash and cpu; ``key_cache``
    or ``value_cache`` for legacy). Multiply by ``element_size`` for bytes.
    """
    if which not in ("k", "v"):
        raise ValueError(f"which must be 'k' or 'v', got {which!r}")
    # num_blocks does not enter any offset, so describe a single block's worth.
    desc = describe_layout(layout, block + 1, num_kv_heads, block_size, head_size, element_size)
    view = desc.k_view if which == "k" else desc.v_view
    x = 16 // element_size
    named = {
        "block": block,
        "head": head,
        "token": token,
        "dim": dim,
        "dim // x": dim // x,
        "dim % x": dim % x,
        "token // 16": token // 16,
        "token % 16": token % 16,
        "dim // 2": dim // 2,
        "dim % 2": dim % 2,
        "dim // 16": dim // 16,
        "dim % 16": dim % 16,
        "token // 2": token // 2,
        "token % 2": token % 2,
    }
    if not (0 <= token < block_size and 0 <= dim < head_size and 0 <= head < num_kv_heads):
        raise IndexError(
            f"token {token}, dim {dim}, head {head} outside block_size {block_size}, "
            f"head_size {head_size}, num_kv_heads {num_kv_heads}"
        )
    index = [named[name] for name in view.dims]
    for i, size in zip(index, view.shape, strict=False):
        if not 0 <= i < size:
            raise IndexError(f"index {dict(zip(view.dims, index, strict=False))} outside {view.shape}")
    return view.storage_offset + sum(i * s for i, s in zip(index, view.strides, strict=False))


@functools.lru_cache(maxsize=16)
def token_elements(layout: str, num_kv_heads: int, block_size: int, head_size: int) -> tuple[tuple[int, ...], ...]:
    """Where each token of one block keeps its K and V, in the block's logical elements.

    A block is ``kv_cache[b]``, logical shape ``(H_kv, block_size, 2*D)`` for every stored
    layout, counted contiguously (``kv_cache[b].reshape(-1)`` of a contiguous copy, the way
    ``kv_blocks`` and ``kv_new_blocks`` are stored). Row ``t`` of the answer lists the
    ``2 * H_kv * D`` positions of token ``t``'s entries in the order ``(K|V, head, dim)``:
    the order of a write-log ``kv_written`` row ``[2, H_kv, D]``. Standard library only;
    the tracer and the write-log reader turn it into an index tensor once per layer.
    """
    info = layout_info(layout)
    if not info.stored:
        raise ValueError(f"layout {layout!r} is never stored in a trace")
    h, bs, d = num_kv_heads, block_size, head_size
    if layout in FLASH_STRIDE_ORDER:
        # logical (H_kv, bs, 2*D): K in [..., :D], V in [..., D:]
        return tuple(
            tuple(
                head * bs * 2 * d + t * 2 * d + kv * d + dim for kv in (0, 1) for head in range(h) for dim in range(d)
            )
            for t in range(bs)
        )
    # cpu / cpu_amx: the logical tensor is contiguous, so its memory offsets are the positions.
    return tuple(
        tuple(
            element_offset(layout, 0, head, t, dim, which, num_kv_heads=h, block_size=bs, head_size=d)
            for which in ("k", "v")
            for head in range(h)
            for dim in range(d)
        )
        for t in range(bs)
    )
