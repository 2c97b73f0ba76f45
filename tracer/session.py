"""An offline vLLM session under the tracer: what ``pagedtrace run`` does.

:func:`run_session` takes a checked :class:`~tracer.session_config.SessionConfig`, resolves
its model (:mod:`tracer.models`), makes the prompts (texts for a model with a tokenizer, else
seeded token ids, all starting with one shared prefix so that prefix caching shows in the
block table), starts a vLLM engine under the tracer, generates greedily and stops.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tracer import vllm_rules
from tracer.backends import check_backend
from tracer.format import STEPS, first_line, parse_layers
from tracer.models import resolve_model
from tracer.options import ENV_MODEL_NAME, ENV_WEIGHTS
from tracer.prompts import encode_prompts, load_tokenizer, token_texts
from tracer.session_config import SessionConfig, is_eager, make_prompts, max_model_len_of, validate_config

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
        if cfg.num_blocks is not None:
            kwargs["num_gpu_blocks_override"] = cfg.num_blocks
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
