"""The tracer: the only part of pagedtrace that imports vLLM (lazily).

Programmatic use, in the process that runs the engine::

    import tracer
    with tracer.start("trace-dir", tensors=True):
        llm = LLM(...); llm.generate(...)

``start`` also exports ``PAGEDTRACE_*`` so vLLM's child processes (engine core,
workers) trace the same way through the ``vllm.general_plugins`` entry point.
"""

from __future__ import annotations

from tracer.format import FORMAT_VERSION, GapRecord, KVCacheSpec, RunInfo, StepRecord, Trace, TraceError, TraceWriter

__all__ = [
    "FORMAT_VERSION",
    "GapRecord",
    "KVCacheSpec",
    "RunInfo",
    "StepRecord",
    "Trace",
    "TraceError",
    "TraceWriter",
    "start",
    "stop",
]


def start(
    directory,
    *,
    layers="first",
    steps=(None, None),
    tensors=False,
    budget_mb=256.0,
    kv_check_every=0,
    query_rows=0,
    attention_backend=None,
    export_env=True,
):
    """Install the tracer in this process (and, via env, in vLLM's child processes).

    ``kv_check_every``: with ``tensors``, every N-th tensor step of a layer also stores its
    blocks whole, to check the KV write log's rebuild against (0: never). ``query_rows``: with
    ``tensors``, store the query and output of at most this many rows a step (0: all), chosen by
    ``tracer.format.rows.sample_rows``; the KV write log stays whole, so replay judges each kept
    row over its full context. ``attention_backend``: the backend the engine is to run, vLLM's
    name (``FLASH_ATTN``, ``TRITON_ATTN``, ``FLEX_ATTENTION``, ``FLASHINFER``, ``CPU_ATTN``; pass
    the same to ``LLM(attention_backend=...)``): another name is a ``ValueError`` of one line
    listing these, and an engine that runs another backend is named in one line.
    """
    from tracer.install import Tracer
    from tracer.options import TracerOptions

    options = TracerOptions(
        directory=str(directory),
        layers=layers,
        steps=tuple(steps),
        tensors=tensors,
        budget_bytes=int(budget_mb * 2**20),
        kv_check_every=kv_check_every,
        query_rows=query_rows,
        attention_backend=attention_backend,
    )
    return Tracer(options).start(export_env=export_env)


def stop() -> None:
    """Stop the tracer active in this process, if any."""
    from tracer.install import active

    t = active()
    if t is not None:
        t.stop()
