"""Versions: pagedtrace's own, and the trace format's with its history.

Standard library only; every room (and the CLI) reads the version from here.
"""

from __future__ import annotations

#: pagedtrace's release (also in pyproject.toml; the manifest records it).
__version__ = "0.3.0"

#: Version of the on-disk trace format (``manifest.json``, ``steps.jsonl``,
#: ``tensors/``, ``sources/``, ``replay.json``). Readers open every version in
#: :data:`READABLE_VERSIONS`; anything else is a clear ``TraceError``.
#:
#: History:
#:
#: 1 (pagedtrace 0.1, 2026-11-30)
#:   First format: ``manifest.json`` (``RunInfo``), ``steps.jsonl`` (``StepRecord`` and
#:   ``GapRecord`` lines), ``tensors/*.safetensors``, ``sources/`` with sha256 per file.
#:   Late in 0.1 ``StepRecord`` gained ``alibi_slopes`` and ``sinks`` without a bump: a
#:   version-1 line may lack them (read as None). Early version-1 traces name the CPU
#:   backend's AMX packing ``cpu`` (``reference_impl.replay.resolve_layout`` finds it).
#:   ``replay.json`` had no version and wrote ``skipped`` as a count.
#: 2 (pagedtrace 0.2, 2026-12-01)
#:   ``StepRecord`` gains ``q_scale`` / ``k_scale`` / ``v_scale`` and ``query_dtype`` (what fp8
#:   attention really used). Every record field is written and required (``alibi_slopes`` /
#:   ``sinks`` included);
#:   ``kind`` (``STEP_KINDS``) and ``layout`` (the layout registry's stored names) are
#:   checked on load; ``replay.json`` carries ``format_version`` and lists ``skipped``
#:   records with their reasons.
#: 3 (pagedtrace 0.3, 2026-12-01)
#:   Records come from the model runner, so every request step has one whatever the
#:   CUDA-graph mode: ``StepRecord`` gains ``cudagraph`` (``none`` / ``piecewise`` / ``full``:
#:   how the step ran) and ``padded_tokens`` (the batch size the graph was captured for).
#:   Tensors are a KV *write log*: instead of every block the step reads (``kv_blocks``), a
#:   record stores the cache entries its step wrote (``kv_slots``, ``kv_written``) and the blocks
#:   the trace had not seen yet (``kv_new_block_ids``, ``kv_new_blocks``); ``kv_log_epoch``
#:   numbers the runs of consecutive logged steps a layer's blocks are rebuilt over
#:   (``tracer.format.kvlog``). ``kv_blocks`` / ``kv_block_ids`` remain for check steps (the
#:   whole blocks, to prove the rebuild) and in version-1/2 traces.
#: 4 (pagedtrace 0.3, 2026-12-01, a later change of the same release)
#:   Two optional tensors of a tensor file, no record change. ``query_rows`` (int64, strictly
#:   increasing): the step kept only these query rows (``tracer.start(query_rows=K)``), and
#:   ``query`` / ``output`` hold just them; replay judges each as a one-token request over its
#:   causal context (``tracer.format.rows``). ``kv_inputs_written`` (a one-element marker): the
#:   tracer found the ``key`` / ``value`` ``do_kv_cache_update`` received equal, bit for bit, to
#:   ``kv_written`` and did not store them again; readers give them back from ``kv_written``
#:   (``Trace.tensors``). A version-3 reader would misread both, hence the bump.
#:   Later in 0.3, without a bump: a CPU trace's manifest gains ``extra["cpu_attention"]``
#:   (the kernel's ``isa`` and its ``bf16_conversion``, ``tracer.manifest``), which replay's
#:   bar follows (``reference_impl.emulation.emulation_of``); a trace without it is judged as
#:   before, by FlashAttention's rounding. Later still (session 14): a finished manifest's
#:   ``extra["tracer"]`` says how the trace was recorded (records, gaps, ring waits; for a
#:   metadata trace the inline writer's ``idle`` hand-over: ``engine``, ``timer``, ``look`` or
#:   ``off``, and its ``idle_hand_overs``); readers need none of it.
FORMAT_VERSION = 4

#: Format versions this pagedtrace reads.
READABLE_VERSIONS = (1, 2, 3, 4)
