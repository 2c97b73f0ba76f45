"""FlashAttention's rounding, emulated: the low-precision baseline the bar is made of.

:func:`emulate_flash_attention` computes attention the way FlashAttention 2/3 round it,
from the same varlen batch the reference forms take (:mod:`reference_impl.kernel`)::

    Q, K, V    the kernel's inputs: the activation dtype (bf16/fp16), or fp8 e4m3 bytes
               whose descale factors are applied to the fp32 scores / output (FA3's fp8 path)
    S = Q K^T  products exact, sums in fp32 (the tensor cores' fp32 accumulator)
    scale, soft-cap, ALiBi, mask
               fp32; the soft-cap's tanh rounded to 11 significant bits, the accuracy of
               ``tanh.approx.f32`` that FA's ``cutlass::fast_tanh`` compiles to (PTX ISA:
               max relative error ~2^-11)
    softmax    fp32; the row sum is taken over the unrounded fp32 P (FA's ``row_sum``)
    P          rounded to the P·V operand dtype before P·V: the activation dtype, or e4m3
               after scaling by 2^8 (FA3's ``Max_offset = 8`` for fp8, to use e4m3's range)
    P·V        fp32 accumulation; out = acc / row_sum (× v_descale for fp8)
    output     rounded to the activation dtype

The softmax is exact (the final row max), not online per key block as the kernel runs it.
FA's key-block size (``kBlockN``), its split-KV count and GQA packing depend on the head
size, the GPU and a runtime heuristic that the trace does not record, so an online
emulation would reproduce the tiling of *a* kernel, not of the one that ran. What the bar
needs is the size of the rounding, and that does not depend on the tiling: P is rounded
relative to whatever max it is measured from (bf16 / e4m3 relative error is the same at
every exponent), and the rescaling between blocks is fp32. The kernel's own realisation of
the same rounding differs element by element; ``reference_impl.tolerances.TOL_K`` covers that.

The emulation is its own form (:mod:`reference_impl.emulation_rows`: a sequence's blocks
gathered at once, its queries in chunks; a step's one-query rows batched by length, to the
bit what each gives alone): the bar does not depend on which reference form produced the
fp64 answer.

vLLM's CPU backend rounds differently, and :func:`emulation_of` picks the model of the kernel
a trace ran from its manifest (``RunInfo.extra["cpu_attention"]``, ``tracer.manifest``). Its
``vec`` / ``vec16`` kernels (``csrc/cpu/cpu_attn_vec.hpp``) keep Q x scale, the logits, P and
the partial outputs in fp32 (``q_buffer_t`` ... ``prob_buffer_t = float``), with ``tanhf``
for a soft-cap: P is not rounded before P·V, and the one rounding is the output's. That
conversion depends on the build vLLM loaded: with AVX512-BF16 it rounds to nearest even;
vLLM's ``_C_AVX2`` and ``_C_AVX512`` builds drop the fp32 value's low 16 bits, rounding toward
zero (``csrc/cpu/cpu_types_x86.hpp``). On an AVX2 host 99.9 % of a real trace's outputs equal
the fp64 answer truncated to bf16: a truncating kernel's mean error is twice a rounding one's,
which the FlashAttention baseline would call a systematic shift. :data:`CPU_VEC_NEAREST` and
:data:`CPU_VEC_TOWARD_ZERO` are those kernels; the AMX kernel (bf16 tiles: P rounded, output
to nearest) and every other backend keep :data:`FLASH`.

Imports torch only.
"""

from __future__ import annotations

from typing import Any

import torch

from reference_impl.common import FP8_STORAGE, cdiv, check_args, take_blocks
from reference_impl.emulation_rows import (
    FP8_MAX_OFFSET,
    Emulation,
    StepRounding,
    as_stored,
    emulate_decode,
    emulate_sequence,
)

__all__ = [
    "CPU_VEC_NEAREST",
    "CPU_VEC_TOWARD_ZERO",
    "EMULATION_DESCRIPTION",
    "EMULATION_NAME",
    "FLASH",
    "FLASHINFER",
    "FLEX",
    "FLEX_EAGER",
    "FP8_MAX_OFFSET",
    "FP8_QUERY_DTYPES",
    "TRITON",
    "Emulation",
    "dequantize_query",
    "emulate_flash_attention",
    "emulation_of",
    "interval_midpoints",
    "quantize_query",
    "round_output",
]

#: Name of the emulation, as ``replay.json``'s ``tolerance`` records it.
EMULATION_NAME = "flash-attention-rounding"

#: One line saying what it rounds, for ``replay.json`` and the report.
EMULATION_DESCRIPTION = (
    "FlashAttention's rounding: Q/K/V in the kernel's input dtype (fp8 with descales), "
    "S = QK^T, scale, soft-cap (tanh to 11 bits, as tanh.approx.f32), mask and softmax in fp32, "
    "P rounded to the P.V operand dtype (e4m3 x 2^8 for fp8) with the row sum in fp32, "
    "P.V accumulated in fp32, output rounded to the activation dtype"
)


#: FlashAttention 2/3 (and the kernels that round as it does): the module docstring.
FLASH = Emulation(EMULATION_NAME, EMULATION_DESCRIPTION)

_CPU_VEC = (
    "vLLM's CPU vec/vec16 kernel: Q x scale, S = QK^T, soft-cap (tanhf), mask, softmax, P and P.V in fp32, "
    "the output rounded to the activation dtype"
)
#: vLLM's CPU ``vec`` / ``vec16`` kernel of the ``_C`` build (AVX512-BF16: round to nearest even).
CPU_VEC_NEAREST = Emulation(
    "cpu-vec-rounding", _CPU_VEC + " (to nearest even)", fp32_probabilities=True, fast_tanh=False
)
#: The same kernel of the ``_C_AVX2`` / ``_C_AVX512`` builds: bf16 by dropping the fp32 value's low bits.
CPU_VEC_TOWARD_ZERO = Emulation(
    "cpu-vec-truncating",
    _CPU_VEC + " (bf16 by truncation, toward zero: vLLM's builds without AVX512-BF16)",
    fp32_probabilities=True,
    output_rounding="toward_zero",
    fast_tanh=False,
)

#: vLLM's Triton ``unified_attention`` (``vllm/v1/attention/ops/triton_unified_attention.py``):
#: ``S = scale * tl.dot(Q, K)`` in fp32, the online softmax in fp32 (``softmax_step``), then
#: ``tl.dot(P.to(V.dtype), V)``: P rounded to the cache's (activation) dtype before P·V, fp32
#: accumulation; a soft-cap as ``x * (e^s - e^-s) / (e^s + e^-s)`` in fp32 (``apply_softcap``): no
#: approximate tanh. The 3D (split-KV) form keeps its segments in fp32 and merges them there.
TRITON = Emulation(
    "triton-unified-rounding",
    "vLLM's Triton unified attention: S = QK^T and the online softmax in fp32, P rounded to the V "
    "dtype before P.V (tl.dot(P.to(V.dtype), V)), fp32 accumulation, a soft-cap in fp32 exp, "
    "output rounded to the activation dtype",
    fast_tanh=False,
)

#: ``torch.compile``'d ``flex_attention`` (inductor's Triton template, ``flex/templates/common.py.jinja``):
#: scores in fp32 (the scale a ``score_mod``), ``exp2`` of ``(s - m) * log2(e)`` in fp32, then
#: ``tl.dot(p.to(MATMUL_PRECISION), v)`` with ``MATMUL_PRECISION`` the query's dtype: P rounded to
#: bf16/fp16 before P·V, fp32 accumulation. vLLM's Flex backend takes no soft-cap.
FLEX = Emulation(
    "flex-attention-rounding",
    "torch.compile'd flex_attention (inductor's Triton template): scores, exp2 softmax and row sum in fp32, "
    "P rounded to the query dtype before P.V, fp32 accumulation, output rounded to the activation dtype",
)

#: ``flex_attention`` without ``torch.compile`` (vLLM's Flex backend where ``TORCH_COMPILE_DISABLE=1``, as
#: ``pagedtrace run --eager`` sets it; the manifest's ``extra["torch_compile"]``), PyTorch's
#: ``math_attention`` (``torch/_higher_order_ops/flex_attention.py``): Q and K taken to fp32,
#: ``S = Q @ K^T`` and the scale in fp32, ``torch._safe_softmax`` in fp32 (normalised), then
#: ``P.to(q.dtype) @ V``: the *normalised* P rounded to bf16, a bf16 matrix product (fp32
#: accumulation), its output in bf16. Measured on an H100 trace: this emulation gives the engine's
#: output to the bit on 99.97 % or more of the values of every step.
FLEX_EAGER = Emulation(
    "flex-attention-eager-rounding",
    "flex_attention without torch.compile (PyTorch's math_attention): S = QK^T and the softmax in fp32, "
    "the normalised P rounded to the query dtype, P.V a bf16/fp16 matrix product with fp32 accumulation",
    fast_tanh=False,
    normalized_probabilities=True,
)

#: FlashInfer's prefill / decode kernels (``include/flashinfer/attention/``): fp32 scores and online
#: softmax (``exp2`` with the scale folded in), P rounded to the bf16/fp16 operand dtype before P·V
#: (the tensor cores' MMA), fp32 accumulation; the soft-cap's tanh is ``tanh.approx.f32``.
FLASHINFER = Emulation(
    "flashinfer-rounding",
    "FlashInfer's paged kernels: S = QK^T and the online softmax in fp32, soft-cap tanh to 11 bits (tanh.approx.f32), "
    "P rounded to bf16/fp16 before P.V, fp32 accumulation, output rounded to the activation dtype",
)

#: The ``AttentionImpl`` class (``RunInfo.attention_backend``'s last part) -> its kernel's emulation,
#: for the CUDA backends that do not round as FlashAttention does in name.
_BY_IMPL = {"TritonAttentionImpl": TRITON, "FlexAttentionImpl": FLEX, "FlashInferImpl": FLASHINFER}


def emulation_of(run: Any) -> Emulation:
    """The baseline for a trace's kernel, from its ``RunInfo`` (None: :data:`FLASH`).

    vLLM's CPU backend with the ``vec`` / ``vec16`` kernel and a known bf16 conversion
    (``extra["cpu_attention"]``, recorded since pagedtrace 0.3's format 4) gets the CPU model;
    Triton's unified attention, Flex and FlashInfer (by ``run.attention_backend``) get their own
    (:data:`TRITON`, :data:`FLEX`, :data:`FLASHINFER`), Flex without ``torch.compile``
    :data:`FLEX_EAGER`; everything else, and traces that do not say, FlashAttention's.
    """
    impl = str(getattr(run, "attention_backend", "") or "").rsplit(".", 1)[-1]
    extra = getattr(run, "extra", None) or {}
    if impl == "FlexAttentionImpl":
        # ``extra["torch_compile"]``: whether torch.compile compiled in the engine's process; traces
        # without it came from ``pagedtrace run``, whose eager runs disable it.
        compiled = extra.get("torch_compile") if isinstance(extra, dict) else None
        if not isinstance(compiled, bool):
            compiled = not getattr(run, "enforce_eager", False)
        return FLEX if compiled else FLEX_EAGER
    if impl in _BY_IMPL:
        return _BY_IMPL[impl]
    info = extra.get("cpu_attention") if isinstance(extra, dict) else None
    if not isinstance(info, dict) or info.get("isa") not in ("vec", "vec16"):
        return FLASH
    return {"nearest": CPU_VEC_NEAREST, "toward_zero": CPU_VEC_TOWARD_ZERO}.get(str(info.get("bf16_conversion")), FLASH)


def interval_midpoints(x: torch.Tensor, emulation: Emulation) -> torch.Tensor:
    """``x`` as the verdict reads it: a truncating kernel's bf16 values at the middle of their intervals.

    A value rounded toward zero stands for every real in ``[x, x + ulp)`` away from zero, so
    its error against the exact answer is biased: half an ulp on average, twice a rounding
    kernel's. Read at the interval's middle (``x + sign(x) * ulp(x) / 2``, exact in fp32) it is
    an unbiased estimate again, whose error is a rounding kernel's. The mean bar then sees a
    scale 2 % off on soft-capped logits (outputs move by about an ulp, the way the truncation
    goes half the time and hides it). Zeros and non-finite values stay. Other emulations and
    dtypes: ``x`` unchanged.
    """
    if emulation.output_rounding != "toward_zero" or x.dtype != torch.bfloat16:
        return x
    wide = x.to(torch.float32)
    _, exponent = torch.frexp(wide)  # |mantissa| in [0.5, 1): ulp = 2^(exponent - 8) for bf16
    half_ulp = torch.ldexp(torch.ones_like(wide), (exponent - 9).to(torch.int32))
    mid = wide + torch.sign(wide) * half_ulp
    return torch.where(torch.isfinite(wide) & (wide != 0), mid, wide)


def _truncate_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 rounding toward zero: the low 16 bits of each value dropped (exact, then)."""
    bits = x.to(torch.float32).contiguous().view(torch.int32) & -65536
    return bits.view(torch.float32).to(torch.bfloat16)


#: Query dtypes (by name) that mean vLLM quantised the query for FA3's fp8 path.
FP8_QUERY_DTYPES = ("float8_e4m3fn", "float8_e4m3fnuz")


def quantize_query(query: torch.Tensor, q_scale: float) -> torch.Tensor:
    """The query as vLLM quantises it for FA3's fp8 path (``QuantFP8``, static per-tensor).

    ``clamp(query.float() * (1 / q_scale), -448, 448).to(float8_e4m3fn)``, as
    ``QuantFP8.forward_native`` does (``Attention.forward`` calls it with ``layer._q_scale``).
    """
    fp8 = torch.float8_e4m3fn
    limit = torch.finfo(fp8).max
    inverse = torch.tensor(q_scale, dtype=torch.float32).reciprocal()
    return (query.to(torch.float32) * inverse).clamp(-limit, limit).to(fp8)


def dequantize_query(query: torch.Tensor, q_scale: float) -> torch.Tensor:
    """An fp8 query as the values attention means: ``e4m3 * q_scale``, exact in fp64."""
    return query.to(torch.float64) * q_scale


def _read(cache: torch.Tensor, blocks: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Sequence's ``[s, H_kv, D]`` tokens as stored (fp8 bytes viewed as e4m3).

    ``index_select`` copies whole blocks at memory speed; advanced indexing (``cache[blocks]``)
    gives the same tensor several times slower.
    """
    return take_blocks(as_stored(cache), blocks).flatten(0, 1)[:seq_len]


def emulate_flash_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    q_scale: float = 1.0,
    out_dtype: torch.dtype = torch.bfloat16,
    emulation: Emulation = FLASH,
) -> torch.Tensor:
    """Attention rounded as FlashAttention rounds it (see the module docstring), or as ``emulation`` says.

    Args:
        query: ``[T, H, D]``: the activation dtype, or ``float8_e4m3fn`` (FA3's fp8 path;
            then the caches must be fp8 and ``q_scale`` is the query's descale).
        key_cache, value_cache: ``[nb, bs, H_kv, D]``: the activation dtype, or fp8
            (``uint8`` / ``float8_e4m3fn``) with ``k_scale`` / ``v_scale``. An fp8 cache
            read with a non-fp8 query is dequantised and rounded to the query's dtype (what
            the kernels that take it, e.g. vLLM's Triton attention, do).
        block_table, seq_lens, query_start_loc, scale, causal, window, softcap,
        alibi_slopes, sinks: as :func:`reference_impl.kernel.paged_attention_loop`.
        out_dtype: the activation dtype the output is rounded to.
        emulation: the kernel's rounding (:data:`FLASH`; :data:`CPU_VEC_NEAREST` and
            :data:`CPU_VEC_TOWARD_ZERO` keep P in fp32 and round only the output).

    Returns:
        ``[T, H, D]`` in ``out_dtype``; rows of sequences without queries are 0.

    Raises:
        ValueError: the batch is malformed (:func:`reference_impl.common.check_args`), or
            an fp8 query comes with a cache that is not fp8.
    """
    check_args(query, key_cache, value_cache, block_table, seq_lens, query_start_loc)
    fp8_query = query.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
    fp8_cache = key_cache.dtype in FP8_STORAGE
    if fp8_query and not fp8_cache:
        raise ValueError(f"an fp8 query needs an fp8 KV cache (FA3's fp8 path); the cache is {key_cache.dtype}")
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    rounding = StepRounding(
        num_kv_heads=num_kv_heads,
        group=num_heads // num_kv_heads,
        head_size=head_size,
        # FA folds the descales into the softmax scale (and the soft-cap) and applies v_descale last.
        score_scale=scale * (q_scale * k_scale if fp8_query else 1.0),
        causal=causal,
        window=window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        k_scale=k_scale,
        v_scale=v_scale,
        fp8_query=fp8_query,
        fp8_cache=fp8_cache,
        # The P.V operand dtype: e4m3 on the fp8 path, else the dtype Q/K/V enter the kernel in.
        element=query.dtype if query.dtype in (torch.bfloat16, torch.float16) else torch.float32,
        p_offset=float(2**FP8_MAX_OFFSET) if fp8_query else 1.0,
        emulation=emulation,
    )
    out = torch.zeros(num_tokens, num_heads, head_size, dtype=torch.float32)
    lens, starts = seq_lens.tolist(), query_start_loc.tolist()
    table = block_table.tolist()
    # One-query (decode) rows are batched by length; a sequence with more queries (or one key) runs alone.
    decode = [(b, starts[b], s) for b, s in enumerate(lens) if starts[b + 1] - starts[b] == 1 and s > 1]
    if decode:
        rows = torch.tensor([row for _, row, _ in decode])
        out[rows] = emulate_decode(query, key_cache, value_cache, table, decode, rounding)
    block_size = key_cache.shape[1]
    for b, seq_len in enumerate(lens):
        q_start, q_len = starts[b], starts[b + 1] - starts[b]
        if q_len == 0 or seq_len == 0 or (q_len == 1 and seq_len > 1):
            continue
        blocks = torch.tensor(table[b][: cdiv(seq_len, block_size)], dtype=torch.long)
        k, v = _read(key_cache, blocks, seq_len), _read(value_cache, blocks, seq_len)  # [n, h, d]
        out[q_start : q_start + q_len] = emulate_sequence(query, k, v, q_start, q_len, rounding)
    return round_output(out, out_dtype, emulation)


def round_output(out: torch.Tensor, out_dtype: torch.dtype, emulation: Emulation) -> torch.Tensor:
    """The kernel's fp32 output ``out`` rounded to the activation dtype as ``emulation`` rounds it."""
    if emulation.output_rounding == "toward_zero" and out_dtype == torch.bfloat16:
        return _truncate_to_bf16(out)
    return out.to(out_dtype)
