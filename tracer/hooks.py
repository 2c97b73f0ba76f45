"""Wrap vLLM's attention backends and model runners; record what attention receives.

The hooks only record: in ``forward`` / ``do_kv_cache_update`` they clone the few
tensors they need *on the device* (no host sync) and append a ``tracer.pending.Pending``.
When the model runner's step returns, ``Tracer._flush`` has each one copy itself to the
host and shape its record, then writes them. The manifest (``tracer.manifest.write_manifest``)
goes to disk before the first line of ``steps.jsonl`` and is completed by the first record and
by ``stop()``, so a trace killed at any point after that opens. Nothing is copied while a
CUDA graph is being captured: that would abort the capture and crash the engine.

Patched (when importable):

* ``vllm.v1.attention.backends.flash_attn.FlashAttentionImpl.forward`` / ``.do_kv_cache_update``
* ``vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward`` / ``.do_kv_cache_update``
* the V1 and V2 ``GPUModelRunner`` (``CPUModelRunner`` inherits V1):
  ``execute_model``, ``_dummy_run``, ``profile_run``, ``capture_model`` to number steps,
  tell profile / warm-up / request steps apart and notice steps attention never saw.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

from tracer.format import GapRecord, RunInfo, TraceWriter, layer_matches, step_in_range
from tracer.manifest import import_attr, tp_rank, write_manifest
from tracer.options import TracerOptions
from tracer.pending import Pending, capture_scales, dtype_name
from tracer.runtime import capturing, is_warmup_batch

__all__ = ["BACKEND_TARGETS", "RUNNER_METHODS", "RUNNER_TARGETS", "Tracer", "TracerOptions", "active"]

logger = logging.getLogger("pagedtrace")

#: (module, class, methods) patched when the module imports.
BACKEND_TARGETS = (
    ("vllm.v1.attention.backends.flash_attn", "FlashAttentionImpl"),
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl"),
)
RUNNER_TARGETS = (
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"),
)
#: vLLM's V2 runner warms up with fake requests named ``_warmup_<i>_``.
RUNNER_METHODS = ("execute_model", "_dummy_run", "profile_run", "capture_model", "prepare_inputs")


_ACTIVE: Tracer | None = None
_LOCK = threading.Lock()


def active() -> Tracer | None:
    """The tracer installed in this process, if any."""
    return _ACTIVE


class Tracer:
    """Installs the hooks in this process and writes one trace directory.

    ``start()`` / ``stop()`` are symmetric; a second ``start()`` (of this or any
    tracer) raises; a start that fails half-way unpatches what it patched.
    """

    def __init__(self, options: TracerOptions):
        self.options = options
        self._patched: list[tuple[type, str, Any]] = []
        self._env_backup: dict[str, str | None] = {}
        self._writer: TraceWriter | None = None
        self._write_failed = False
        #: Why the trace is incomplete (the first write or recording failure), or None.
        self.error: str | None = None
        self._warned = False
        self._manifest_written = False  # with the first record's backend and KV cache
        self._run_info: RunInfo | None = None  # the manifest on disk, once written
        self._layer_locked: str | None = None
        self._runner: Any = None
        self._vllm_config: Any = None
        self._pending: list[Pending] = []
        self._kv_inputs: dict[str, dict[str, Any]] = {}
        # step bookkeeping
        self.step = -1
        self._depth = 0
        self._phase: list[str] = []
        self._seen_in_step = False
        self._seen_layers: set[str] = set()
        self._gap_noted_step = -1
        self._v2_req_ids: tuple[str, ...] | None = None
        self.stats = {"records": 0, "gaps": 0, "tensor_files": 0}

    # -- install / uninstall -------------------------------------------------

    def start(self, *, export_env: bool = False) -> Tracer:
        """Patch vLLM's classes in this process; raises if a tracer is already active.

        ``export_env`` also sets ``PAGEDTRACE_*`` (restored by ``stop``) so vLLM's
        child processes trace through the plugin.
        """
        global _ACTIVE
        with _LOCK:
            if _ACTIVE is not None:
                raise RuntimeError("a pagedtrace tracer is already active in this process; stop() it first")
            try:
                self._install()
            except BaseException:
                self._uninstall()
                raise
            if not any(name == "forward" for _, name, _ in self._patched):
                self._uninstall()
                raise RuntimeError("no vLLM attention backend found to trace (is vLLM 0.26 installed?)")
            _ACTIVE = self
            if export_env:
                env = self.options.to_env()
                self._env_backup = {k: os.environ.get(k) for k in env}
                os.environ.update(env)
        atexit.register(self._atexit)
        return self

    def stop(self) -> None:
        """Flush what is pending, unpatch, close the trace. Safe to call twice."""
        global _ACTIVE
        with _LOCK:
            if _ACTIVE is not self:
                return
            try:
                try:
                    self._flush()
                except Exception as exc:  # noqa: BLE001 - the session's tokens matter more
                    self._fail(f"pagedtrace: recording failed ({exc!r}); the last step is not in the trace")
                self._finish()
            finally:
                self._uninstall()
                for k, v in self._env_backup.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
                self._env_backup = {}
                _ACTIVE = None
                atexit.unregister(self._atexit)

    def __enter__(self) -> Tracer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _atexit(self) -> None:
        # Worker processes end without calling stop(): keep what was recorded.
        with contextlib.suppress(Exception):  # never fail interpreter shutdown
            self.stop()

    def _install(self) -> None:
        for module_name, cls_name in BACKEND_TARGETS:
            cls = import_attr(module_name, cls_name)
            if cls is None:
                continue
            self._patch(cls, "forward", self._wrap_forward)
            self._patch(cls, "do_kv_cache_update", self._wrap_kv_update)
        for module_name, cls_name in RUNNER_TARGETS:
            cls = import_attr(module_name, cls_name)
            if cls is None:
                continue
            for method in RUNNER_METHODS:
                if method in vars(cls):
                    self._patch(cls, method, self._wrap_runner(method))

    def _patch(self, cls: type, name: str, make_wrapper: Any) -> None:
        original = vars(cls).get(name)
        if original is None:
            return
        wrapper = make_wrapper(original)
        wrapper.__pagedtrace_original__ = original
        setattr(cls, name, wrapper)
        self._patched.append((cls, name, original))

    def _uninstall(self) -> None:
        while self._patched:
            cls, name, original = self._patched.pop()
            setattr(cls, name, original)

    # -- wrappers -----------------------------------------------------------

    def _wrap_runner(self, method: str):
        """Return a wrapper factory for one model-runner method."""
        tracer = self
        phase: str | None = {
            "execute_model": "request",
            "profile_run": "profile",
            "capture_model": "warmup",
            "_dummy_run": "warmup",
            "prepare_inputs": None,
        }[method]
        counts_step = method in ("execute_model", "_dummy_run")

        def make(original):
            if method == "prepare_inputs":
                # V2 runner: rows are sorted here, so take the request ids from its batch.
                @functools.wraps(original)
                def prepare_inputs(runner, *args, **kwargs):
                    batch = original(runner, *args, **kwargs)
                    ids = getattr(batch, "req_ids", None)
                    if ids is not None:
                        tracer._v2_req_ids = tuple(ids)
                    return batch

                return prepare_inputs

            @functools.wraps(original)
            def wrapper(runner, *args, **kwargs):
                tracer._runner = runner
                tracer._vllm_config = getattr(runner, "vllm_config", tracer._vllm_config)
                outer = tracer._phase[-1] if tracer._phase else None
                # Nested calls belong to the outer step: the V2 runner's _dummy_run calls
                # execute_model, profile_run and capture_model call _dummy_run, and the V1
                # runner pads data-parallel steps with a _dummy_run inside execute_model.
                nested = outer is not None and (tracer._depth > 0 or method == "_dummy_run")
                effective = outer if nested else phase
                assert effective is not None  # prepare_inputs has its own wrapper above
                new_step = counts_step and tracer._depth == 0
                if new_step:
                    tracer.step += 1
                    tracer._seen_in_step = False
                    tracer._seen_layers.clear()
                    tracer._v2_req_ids = None
                tracer._phase.append(effective)
                tracer._depth += counts_step
                try:
                    return original(runner, *args, **kwargs)
                finally:
                    tracer._depth -= counts_step
                    tracer._phase.pop()
                    if new_step:
                        tracer._end_step(method, effective, args, kwargs)

            return wrapper

        return make

    def _wrap_kv_update(self, original):
        tracer = self

        @functools.wraps(original)
        def do_kv_cache_update(impl, layer, key, value, kv_cache, slot_mapping, *args, **kwargs):
            result = original(impl, layer, key, value, kv_cache, slot_mapping, *args, **kwargs)
            name = getattr(layer, "layer_name", "")
            if tracer._wants(name) and not capturing():
                n = slot_mapping.shape[0]
                entry = {"slot_mapping": slot_mapping.detach().clone()}
                if tracer._wants_tensors():
                    entry["key"] = key[:n].detach().clone()
                    entry["value"] = value[:n].detach().clone()
                tracer._kv_inputs[name] = entry
            return result

        return do_kv_cache_update

    def _wrap_forward(self, original):
        tracer = self

        @functools.wraps(original)
        def forward(impl, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
            result = original(impl, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
            try:
                tracer._on_forward(impl, layer, query, kv_cache, attn_metadata, output)
            except Exception as exc:  # noqa: BLE001 - the engine must run on
                tracer._fail(f"pagedtrace: recording failed ({exc!r}); tracing stops, the engine runs on")
            return result

        return forward

    # -- recording ----------------------------------------------------------

    def _kind(self) -> str:
        return self._phase[-1] if self._phase else "request"

    def _wants(self, layer_name: str) -> bool:
        if self._write_failed or not step_in_range(self.step, self.options.steps):
            return False
        sel = self.options.layers
        if sel == "all":
            return True
        if sel == "first":
            if self._layer_locked is None:
                return True  # decided in _on_forward
            return layer_name == self._layer_locked
        return layer_matches(layer_name, sel)

    def _wants_tensors(self) -> bool:
        if not (self.options.tensors and self._kind() == "request"):
            return False
        return not is_warmup_batch(self._v2_req_ids)

    def _on_forward(self, impl, layer, query, kv_cache, attn_metadata, output) -> None:
        name = getattr(layer, "layer_name", "") or f"layer{id(layer)}"
        if name in self._seen_layers:
            # The same layer again without a runner step around it: a new forward pass
            # (the V2 runner's CUDA-graph warm-up and capture loop calls the model directly).
            self.step += 1
            self._seen_layers.clear()
        self._seen_layers.add(name)
        if attn_metadata is None:
            # Profile runs build no attention metadata: vLLM skips attention itself.
            if self._gap_noted_step != self.step:
                self._gap_noted_step = self.step
                kind = self._kind()
                why = "profile run" if kind == "profile" else "warm-up pass"
                self._record_gap(kind, f"attn_metadata is None: vLLM skips attention in this {why}", 0)
            self._seen_in_step = True
            return
        if not self._wants(name):
            return
        if self.options.layers == "first" and self._layer_locked is None:
            self._layer_locked = name
        self._seen_in_step = True
        if capturing():
            if self._gap_noted_step != self.step:
                self._gap_noted_step = self.step
                self._record_gap(
                    self._kind(),
                    "cuda-graph-capture: no copies allowed while capturing",
                    int(attn_metadata.num_actual_tokens),
                )
            return
        md = attn_metadata
        n = int(md.num_actual_tokens)
        window = getattr(md, "sliding_window", None)
        if window is None:
            window = getattr(impl, "sliding_window", None)
        if isinstance(window, int):  # the CPU backend keeps one int, -1 = none
            window = (-1, -1) if window < 0 else (window - 1, 0)
        causal = getattr(md, "causal", True)
        metadata = {
            "num_actual_tokens": n,
            "max_query_len": int(md.max_query_len),
            "max_seq_len": int(md.max_seq_len),
            "causal": bool(causal) if not hasattr(causal, "shape") else True,
            "sliding_window": tuple(int(w) for w in window) if window is not None else None,
            "logits_soft_cap": float(getattr(impl, "logits_soft_cap", 0) or 0),
            "scale": float(impl.scale),
            "use_cascade": bool(getattr(md, "use_cascade", False)),
            "num_splits": int(getattr(md, "max_num_splits", 0) or 0),
            "num_heads": int(impl.num_heads),
            "num_kv_heads": int(impl.num_kv_heads),
            "head_size": int(impl.head_size),
            # float8_e4m3fn when the layer quantized the query for FA3's fp8 path (a dtype: no sync)
            "query_dtype": dtype_name(query),
        }
        num_reqs = int(md.seq_lens.shape[0])
        dev = {
            "query_start_loc": md.query_start_loc[: num_reqs + 1].detach().clone(),
            "seq_lens": md.seq_lens.detach().clone(),
            "block_table": md.block_table[:num_reqs].detach().clone(),
        }
        kv_in = self._kv_inputs.pop(name, None) or {}
        dev["slot_mapping"] = kv_in.pop("slot_mapping", None)
        if dev["slot_mapping"] is None:
            dev["slot_mapping"] = md.slot_mapping[:n].detach().clone()
        if self._wants_tensors():
            dev["query"] = query[:n].detach().clone()
            dev["output"] = output[:n].detach().clone()
            dev.update(kv_in)
        req_ids = self._req_ids(num_reqs)
        kind = self._kind()
        if kind == "request" and is_warmup_batch(req_ids):
            kind = "warmup"  # the V2 runner warms up through execute_model with fake requests
        pending = Pending(self.step, kind, name, impl, metadata, dev, kv_cache, req_ids, capture_scales(layer))
        self._pending.append(pending)

    def _req_ids(self, num_reqs: int) -> tuple[str, ...]:
        ids: Any = self._v2_req_ids
        if ids is None and self._kind() == "request":
            batch = getattr(self._runner, "input_batch", None)
            ids = getattr(batch, "req_ids", None)
        if ids is None:
            return ("",) * num_reqs
        ids = tuple(str(i) for i in list(ids)[:num_reqs])
        return ids + ("",) * (num_reqs - len(ids))

    def _end_step(self, method: str, kind: str, args: tuple, kwargs: dict) -> None:
        try:
            if not self._seen_in_step and step_in_range(self.step, self.options.steps):
                if method == "execute_model":
                    sched = args[0] if args else kwargs.get("scheduler_output")
                    num = int(getattr(sched, "total_num_scheduled_tokens", 0) or 0)
                    if num > 0:
                        self._record_gap(
                            kind,
                            "cuda-graph-replay: attention ran inside a CUDA graph, Python forward() was not called",
                            num,
                        )
                    elif sched is not None and hasattr(sched, "total_num_scheduled_tokens"):
                        # Counted as a step, but the runner returned before the model ran: the
                        # scheduler only passed finished request ids (after requests finish; the
                        # V2 runner's warm-up cleanup). Without a gap its number would be unexplained.
                        finished = tuple(sorted(str(r) for r in getattr(sched, "finished_req_ids", ()) or ()))
                        self._record_gap(
                            "warmup" if is_warmup_batch(finished) else kind,
                            f"empty-step: no tokens scheduled; execute_model returned without running the model "
                            f"({len(finished)} finished request(s) freed)",
                            0,
                        )
                elif kind == "profile":
                    self._record_gap(kind, "profile run: vLLM skips attention", 0)
            self._flush()
        except Exception as exc:  # noqa: BLE001
            self._fail(f"pagedtrace: recording failed ({exc!r}); tracing stops, the engine runs on")
            self._pending.clear()

    def _record_gap(self, kind: str, reason: str, num_tokens: int) -> None:
        self._write(GapRecord(step=self.step, kind=kind, reason=reason, num_tokens=num_tokens), None)
        self.stats["gaps"] += 1

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        self._kv_inputs.clear()
        for p in pending:
            rec, tensors = p.shape()
            self._write(rec, tensors, p)
            self.stats["records"] += 1

    def _write(self, record, tensors, first: Pending | None = None) -> None:
        """Append one record; the manifest goes to disk before the first line of ``steps.jsonl``.

        ``first``: the record's pending forward, whose backend and cache complete the manifest.
        """
        if self._write_failed:
            return
        try:
            writer = self._writer_or_new()
            if not self._manifest_written and (first is not None or self._run_info is None):
                # A gap (the profile run) can come first: write what is known now, so a trace
                # killed from here on opens; the first record's backend and cache complete it.
                self._run_info = write_manifest(
                    writer,
                    self.options,
                    self._vllm_config,
                    impl=first.impl if first else None,
                    kv_cache=first.kv_cache if first else None,
                    layer=first.layer if first else "",
                )
                self._manifest_written = first is not None
            stored = writer.append(record, tensors)
            if getattr(stored, "tensors", None):
                self.stats["tensor_files"] += 1
        except OSError as exc:
            self._fail(
                f"pagedtrace: cannot write trace to {self.options.directory}: {exc}; tracing stops, the engine runs on"
            )

    def _writer_or_new(self) -> TraceWriter:
        if self._writer is None:
            directory = Path(self.options.directory)
            rank = tp_rank()
            if rank:  # tensor-parallel workers other than rank 0 write a trace of their own
                directory = directory / f"rank{rank}"
            self._writer = TraceWriter(directory, tensor_budget_bytes=self.options.budget_bytes)
        return self._writer

    def _fail(self, message: str) -> None:
        """Stop tracing (the engine runs on); keep the first reason in ``error``, warn once."""
        self._write_failed = True
        if self.error is None:
            self.error = message
        self._warn_once(message)

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            logger.warning(message)
            import warnings

            warnings.warn(message, RuntimeWarning, stacklevel=3)

    # -- closing -------------------------------------------------------------

    def _finish(self) -> None:
        if self._writer is not None:
            if self._manifest_written and self._writer.budget_exhausted:
                logger.warning(
                    "pagedtrace: tensor budget of %d bytes used up; later steps have no tensors",
                    self.options.budget_bytes,
                )
            self._writer.close()
            if self._run_info is not None and not self._write_failed:
                finished = replace(self._run_info, extra={**self._run_info.extra, "finished": True})
                try:
                    self._writer.write_manifest(finished)
                except OSError as exc:
                    self._fail(f"pagedtrace: cannot finish the trace's manifest in {self.options.directory}: {exc}")
            self._writer = None
