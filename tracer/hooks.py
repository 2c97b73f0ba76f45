"""The tracer: installs the hooks, keeps the step state, queues each step's records off the step.

Request steps are recorded where the model runner prepares them, so every step has a
record whatever the CUDA-graph mode: a full graph replays without calling Python
``forward``, but the runner still builds that step's attention metadata. At the end of
``execute_model`` the tracer reads it (the V1 runner passes it to ``set_forward_context``;
the V2 runner keeps it in ``execute_model_state``, and ``dispatch_cg_and_sync_dp`` says
which graph ran) and queues one non-blocking copy of its tensors per KV-cache group into a
pinned ring slot (``tracer.capture``). When the step is over (``_submit_slot``) it records
the slot's one CUDA event, after every copy and clone of the step, wherever they were made,
and hands the slot to the writer thread (``tracer.ring``, ``tracer.sink``), which waits for
that event before it reads any of them. Nothing on the step waits for the device.

``forward`` / ``do_kv_cache_update`` add what only they see: the query's dtype, and for
tensor steps device-side clones of query / output / key / value plus the KV write log's
gathers (``tracer.writelog``). Warm-up and profile passes are recorded from ``forward``.
While the runner captures CUDA graphs no host copy is made and the writer stays off the
device: vLLM captures in global mode, where any thread's sync aborts the capture.

Tensors of full-graph steps: while vLLM captures a full graph, ``forward`` and
``do_kv_cache_update`` of a traced layer add device-to-device copies of query / output /
key / value into staging buffers the tracer owns (``tracer.staging``). The copies become
part of the graph, so every replay leaves its step's tensors there; the end of the runner's
step (outside the graph, on the same stream, before the next replay) clones the real rows
like any other tensor step. A graph captured before the tracer started has no such copies:
its steps carry metadata only, and the tracer says so once (``FULL_GRAPH_TENSORS``).

Patched (when importable), with the wrappers of ``tracer.wrappers``:

* ``vllm.v1.attention.backends.flash_attn.FlashAttentionImpl.forward`` / ``.do_kv_cache_update``
* ``vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward`` / ``.do_kv_cache_update``
  (``do_kv_cache_update`` only for a tensor trace)
* the V1 and V2 ``GPUModelRunner`` (``CPUModelRunner`` inherits V1): ``execute_model``,
  ``_dummy_run``, ``profile_run``, ``capture_model``, ``prepare_inputs`` to number steps and
  tell profile / warm-up / request steps apart; the runner modules' ``set_forward_context``
  and the V2 runner's ``dispatch_cg_and_sync_dp`` to see each step's metadata and graph.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import multiprocessing.util
import os
import sys
import threading
import types
from typing import Any

from tracer import wrappers
from tracer.capture import forget_plans, layer_fields, queue_host_copies, step_fields, tensor_clones
from tracer.format import GapRecord, first_line, layer_index, layer_matches, step_in_range
from tracer.manifest import import_attr
from tracer.options import TracerOptions
from tracer.pending import LayerCapture, LayerStatic, capture_scales, dtype_name
from tracer.ring import (
    InlineWriter,
    Slot,
    SlotPool,
    WriterThread,
    defer_copies,
    event_blocking,
    events_on_writer,
    idle_mode,
    leave_event,
    record_event,
)
from tracer.runtime import capturing, cuda_available, is_warmup_batch
from tracer.sink import TraceSink
from tracer.staging import SHARED as GRAPH_STAGING

__all__ = [
    "BACKEND_TARGETS",
    "ENGINE_IDLE_TARGETS",
    "MODULE_TARGETS",
    "RUNNER_METHODS",
    "RUNNER_TARGETS",
    "Tracer",
    "TracerOptions",
    "active",
]

logger = logging.getLogger("pagedtrace")

BACKEND_TARGETS = (
    ("vllm.v1.attention.backends.flash_attn", "FlashAttentionImpl"),
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl"),
)
RUNNER_TARGETS = (
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"),
)
RUNNER_METHODS = ("execute_model", "_dummy_run", "profile_run", "capture_model", "prepare_inputs")
#: Module-level functions the runners call by name: (module, function).
MODULE_TARGETS = (
    ("vllm.v1.worker.gpu_model_runner", "set_forward_context"),
    ("vllm.v1.worker.gpu.model_runner", "set_forward_context"),
    ("vllm.v1.worker.gpu.model_runner", "dispatch_cg_and_sync_dp"),
)

#: Where vLLM's loop runs out of work, on the engine's thread: (module, class, method). The engine
#: core's busy loop calls the first just before it waits for requests; ``LLM`` runs the engine in
#: its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) in the second. With ``PAGEDTRACE_IDLE=engine``
#: (the default) the tracer hands over the steps it holds there (``tracer.ring.InlineWriter.engine_idle``).
ENGINE_IDLE_TARGETS = (
    ("vllm.v1.engine.core", "EngineCoreProc", "_notify_idle_state_callbacks"),
    ("vllm.entrypoints.offline_utils", "OfflineInferenceMixin", "_run_engine"),
)

#: The one line said when tensors are asked for but a full CUDA graph was captured without the tracer's copies.
FULL_GRAPH_TENSORS = (
    "pagedtrace: steps replayed as full CUDA graphs captured before the tracer started carry metadata only; "
    "start the tracer before the engine (or use cudagraph_mode PIECEWISE) for tensors of every step"
)

#: Steps in flight before a step waits for the writer. Metadata slots are small (a few pinned
#: buffers sized for the runner's); a tensor step's device clones count against the pool's
#: device-byte cap instead. Enough slots that the decode steps after a large prefill (whose
#: tensors take the writer ~0.1 s to store) do not wait for it.
RING_SLOTS = 64

#: Testing knobs (read when a ``Tracer`` is made): ring size and a writer-thread delay per step.
ENV_RING_SLOTS = "PAGEDTRACE_RING_SLOTS"
ENV_THROTTLE = "PAGEDTRACE_WRITER_THROTTLE_S"

#: ``Tracer.untraced_now`` outside request steps: no layer is passed by (never changed, only read)
_NOT_NOW: dict[str, bool] = {}

_ACTIVE: Tracer | None = None
_LOCK = threading.Lock()


def active() -> Tracer | None:
    """The tracer installed in this process, if any."""
    return _ACTIVE


def _scheduled(args: tuple, kwargs: dict) -> tuple[Any, int]:
    """A runner call's ``scheduler_output`` and its ``total_num_scheduled_tokens`` (0 where it has none)."""
    sched = args[0] if args else kwargs.get("scheduler_output")
    return sched, int(getattr(sched, "total_num_scheduled_tokens", 0) or 0)


class Tracer:
    """Installs the hooks in this process and writes one trace directory.

    ``start()`` / ``stop()`` are symmetric; a second ``start()`` (of this or any
    tracer) raises; a start that fails half-way unpatches what it patched.
    ``ring_slots``: steps in flight before a step waits for the writer (default
    ``PAGEDTRACE_RING_SLOTS`` or :data:`RING_SLOTS`); ``throttle``: seconds the writer thread sleeps per step
    (default ``PAGEDTRACE_WRITER_THROTTLE_S`` or 0; tests use it as a slow disk).
    """

    def __init__(self, options: TracerOptions, *, ring_slots: int | None = None, throttle: float | None = None):
        if ring_slots is None:
            ring_slots = max(1, int(os.environ.get(ENV_RING_SLOTS, str(RING_SLOTS)) or RING_SLOTS))
        if throttle is None:
            throttle = float(os.environ.get(ENV_THROTTLE, "0") or 0)
        self.options = options
        self._patched: list[tuple[Any, str, Any]] = []
        self._env_backup: dict[str, str | None] = {}
        self._sink = TraceSink(options, self._fail)
        #: Why the trace is incomplete (the first write or recording failure), or None.
        self.error: str | None = None
        self._warned: set[str] = set()
        self._layer_locked: str | None = None
        self._runner: Any = None
        self._vllm_config: Any = None
        self._static: dict[str, LayerStatic] = {}
        self._layer_wanted: dict[str, bool] = {}  # layer name -> in ``options.layers``
        self._kv_inputs: dict[str, dict[str, Any]] = {}
        self._pool = SlotPool(ring_slots)
        self._blocking_events = self._sink.blocking_events = event_blocking()
        #: ``PAGEDTRACE_EVENT_ON=writer``: (``torch._C._cuda_getCurrentRawStream``, device) once the
        #: first step is handed over on CUDA; None: the engine's thread records each step's event
        self._event_stream: tuple[Any, int] | None = None
        self._events_on_writer = events_on_writer()
        self._idle_mode = idle_mode()  # how the inline writer hands over once the engine idles (``PAGEDTRACE_IDLE``)
        #: vLLM's loop runs in this process and says when it idles (``ENGINE_IDLE_TARGETS``)
        self._engine_loop = False
        self._idle_decided = False  # the first request step has asked whether it does
        #: metadata copies go into the shared ring's device mirror, moved to the host every few
        #: steps (``tracer.shared_host``; ``PAGEDTRACE_DEFER``): set with the inline writer
        self._defer = False
        self._ring_slots = ring_slots
        self._throttle = throttle
        self._thread: WriterThread | InlineWriter | None = None
        self._slot: Slot | None = None  # the step being filled
        self._log_valid: dict[str, bool] = {}  # layer -> every write since its last tensor step is logged
        self._logged_now: set[str] = set()
        self._model_ran = False
        self._in_capture = 0  # inside the runner's capture_model: no device copies at all
        # step bookkeeping
        self.step = -1
        self._in_range = step_in_range(self.step, options.steps)  #: ``step`` lies in ``options.steps``
        self._depth = 0
        self._phase: list[str] = []
        self._seen_in_step = False
        self._seen_layers: set[str] = set()
        self._gap_noted_step = -1
        self._v2_req_ids: tuple[str, ...] | None = None
        #: the last step's request ids as the runner gave them, and as :meth:`_req_ids` made them
        self._ids_made: tuple[Any, tuple[str, ...]] | None = None
        self._warmup_asked: tuple[tuple[str, ...], bool] | None = None  #: ``is_warmup_batch``'s last answer
        self._finalizer: multiprocessing.util.Finalize | None = None  #: ``stop`` when a multiprocessing child ends
        self._fc: tuple[Any, str, int | None] | None = None  # set_forward_context's metadata, mode, padded size
        self._dispatch: tuple[str, int | None] | None = None  # the V2 runner's graph choice
        self._fwd_md: dict[str, Any] = {}  # request steps: the metadata forward() saw, per layer
        self._names_cache: tuple[Any, list[str]] | None = None  # ``_wanted_of``'s last answer
        #: layers no request step traces (``options.layers`` rules them out, for good)
        self.never_traced: dict[str, bool] = {}
        self._to_bypass: list[Any] = []  # impls of never-traced layers, not yet given their own forward
        self._bypassed: list[Any] = []  # impls given vLLM's own forward (``_bypass_untraced``)
        #: the forward wrapper's fast path: layers it passes by at once. ``never_traced`` while a
        #: request step runs (``tracer.wrappers.runner`` sets it), empty otherwise
        self.untraced_now: dict[str, bool] = _NOT_NOW
        self._step_tensors: dict[str, dict[str, Any]] = {}
        self._staging = GRAPH_STAGING  # tensors the captured full graphs copy out on every replay
        self.stats: dict[str, Any] = {"records": 0, "gaps": 0, "tensor_files": 0, "ring_waits": 0}

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
            self._thread = self._writer_thread()
            _ACTIVE = self
            if export_env:
                env = self.options.to_env()
                self._env_backup = {k: os.environ.get(k) for k in env}
                os.environ.update(env)
        atexit.register(self._atexit)
        # A multiprocessing child (vLLM's engine core under ``vllm serve``) ends through
        # ``os._exit``: no atexit handler runs there, only multiprocessing's finalizers (after
        # vLLM's SIGTERM handler raised SystemExit). The steps the engine's thread had not yet
        # handed over (``PAGEDTRACE_WRITER=inline``) go to the record process then.
        self._finalizer = multiprocessing.util.Finalize(None, self._atexit, exitpriority=100)
        return self

    def _writer_thread(self) -> WriterThread | InlineWriter:
        """The writer thread; it also sends a metadata trace's records to their process (``TraceSink.send_records``).

        ``PAGEDTRACE_WRITER=inline`` (a trace without tensors): no thread, the engine's own hands
        the slots over at each step's end (``tracer.ring.InlineWriter``).
        """
        args = (self._pool, self._sink.handle_slot, self._on_writer_error)
        if self._sink.inline:
            busy = lambda: self._in_capture > 0 or capturing()  # noqa: E731 - the idle thread's question
            # Deferred copies only where every hand-over runs on the engine's thread (no idle thread)
            self._defer = defer_copies() and self._idle_mode in ("engine", "off")
            return InlineWriter(
                *args,
                throttle=self._throttle,
                end=self._sink.send_records,
                busy=busy,
                flush=self._sink.flush_records,
                idle=self._idle_mode,
                move=self._move_deferred,
                on_cuda=cuda_available(),
                blocking=self._blocking_events,
            )
        return WriterThread(*args, throttle=self._throttle, end=self._sink.send_records, blocking=self._blocking_events)

    def _move_deferred(self) -> Any:
        """The inline writer's seal: the deferred copies to the host (``SharedHost.flush``); their stream."""
        out = self._sink.records_out
        host = out.shared_host if out is not None else None
        if host is None:
            return None
        host.flush()
        return host.stream

    def stop(self) -> None:
        """Write what is in flight, unpatch, close the trace. Safe to call twice."""
        global _ACTIVE
        with _LOCK:
            if _ACTIVE is not self:
                return
            try:
                try:
                    self._submit_slot()
                except Exception as exc:  # noqa: BLE001 - the session's tokens matter more
                    self._fail(f"pagedtrace: recording failed ({exc!r}); the last step is not in the trace")
                looks: dict[str, Any] = {}
                if self._thread is not None:
                    self._thread.close()
                    if isinstance(self._thread, InlineWriter):  # how often its idle thread took the GIL
                        looks = {
                            "idle": self._thread.idle,
                            "idle_looks": self._thread.looks,
                            "idle_hand_overs": self._thread.idle_hand_overs,
                            "deferred_seals": self._thread.seals,  # one copy and one event each
                        }
                    self._thread = None
                looks["ring_waits"] = self._pool.waits
                self._sink.finish(looks)
                self.stats.update(self._sink.stats, **looks)
            finally:
                self._restore_bypassed()
                self._uninstall()
                forget_plans()
                for k, v in self._env_backup.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
                self._env_backup = {}
                _ACTIVE = None
                atexit.unregister(self._atexit)
                if self._finalizer is not None:
                    self._finalizer.cancel()
                    self._finalizer = None

    def drain(self) -> None:
        """Wait until every step so far is on disk (tests, and readers of a live trace)."""
        self._submit_slot()
        if self._thread is not None:
            self._thread.drain()
            self._sink.sync()

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
            self._patch(cls, "forward", functools.partial(wrappers.forward, self))
            if self.options.tensors:  # only tensor traces need what the cache write sees
                self._patch(cls, "do_kv_cache_update", functools.partial(wrappers.kv_update, self))
        for module_name, cls_name in RUNNER_TARGETS:
            cls = import_attr(module_name, cls_name)
            if cls is None:
                continue
            for method in RUNNER_METHODS:
                if method in vars(cls):
                    self._patch(cls, method, wrappers.runner(self, method))
        for module_name, func in MODULE_TARGETS:
            if import_attr(module_name, func) is None:
                continue
            make = wrappers.forward_context if func == "set_forward_context" else wrappers.dispatch
            self._patch(sys.modules[module_name], func, functools.partial(make, self))
        if self._idle_mode == "engine" and self._sink.inline:
            for module_name, cls_name, method in ENGINE_IDLE_TARGETS:
                cls = import_attr(module_name, cls_name)
                if cls is not None:
                    make = wrappers.run_engine if method == "_run_engine" else wrappers.engine_idle
                    self._patch(cls, method, functools.partial(make, self))

    def _patch(self, owner: Any, name: str, make_wrapper: Any) -> None:
        original = vars(owner).get(name)
        if original is None:
            return
        wrapper = make_wrapper(original)
        wrapper.__pagedtrace_original__ = original
        setattr(owner, name, wrapper)
        self._patched.append((owner, name, original))

    def _uninstall(self) -> None:
        while self._patched:
            owner, name, original = self._patched.pop()
            setattr(owner, name, original)

    # -- wrappers -----------------------------------------------------------

    # -- what to record ------------------------------------------------------

    def _kind(self) -> str:
        return self._phase[-1] if self._phase else "request"

    def _wants(self, layer_name: str) -> bool:
        if self._sink.failed or not self._in_range:
            return False
        # the layer ``"first"`` locked on is selected: the steady case, asked before ``_selected``
        return layer_name == self._layer_locked or self._selected(layer_name)

    def _selected(self, layer_name: str) -> bool:
        """``layer_name`` is one of ``options.layers`` (whatever the step)."""
        sel = self.options.layers
        if sel == "all":
            return True
        if sel == "first":
            if self._layer_locked is None:
                return True  # decided when a layer is first recorded
            return layer_name == self._layer_locked
        wanted = self._layer_wanted.get(layer_name)
        if wanted is None:  # asked for every layer of every step: match each name once
            wanted = self._layer_wanted[layer_name] = layer_matches(layer_name, sel)
        return wanted

    def stages(self, layer_name: str) -> bool:
        """Inside a full-graph capture: the graph should copy out this layer's tensors."""
        return self.options.tensors and not self._sink.failed and self._selected(layer_name) and capturing()

    def capture_capacity(self) -> int:
        """The largest batch vLLM captures a graph for (0 when its config does not say)."""
        cc = getattr(self._vllm_config, "compilation_config", None)
        size = getattr(cc, "max_cudagraph_capture_size", None) or max(
            getattr(cc, "cudagraph_capture_sizes", None) or [0]
        )
        return int(size or 0)

    def _wants_tensors(self) -> bool:
        if not (self.options.tensors and self._kind() == "request"):
            return False
        if self._sink.budget_exhausted:
            return False
        return not is_warmup_batch(self._v2_req_ids)

    def _static_of(self, name: str, impl: Any = None, module: Any = None, kv_cache: Any = None) -> LayerStatic | None:
        """The layer's static facts; learned from ``forward``, else from vLLM's forward context."""
        static = self._static.get(name)
        if static is None:
            if impl is None:
                ctx = getattr(getattr(self._vllm_config, "compilation_config", None), "static_forward_context", {})
                module = ctx.get(name)
                impl = getattr(module, "impl", None)
                caches = getattr(module, "kv_cache", None)
                kv_cache = caches[0] if isinstance(caches, (list, tuple)) and caches else caches
                if impl is None or kv_cache is None or not hasattr(kv_cache, "shape") or kv_cache.dim() != 4:
                    return None
            static = self._static[name] = LayerStatic(name, impl, module, kv_cache)
        elif kv_cache is not None and static.kv_cache is not kv_cache:
            static.set_cache(kv_cache)
        return static

    # -- steps ---------------------------------------------------------------

    def _begin_step(self) -> None:
        if self._slot is not None:
            self._submit_slot()
        self.step += 1
        self._in_range = step_in_range(self.step, self.options.steps)
        self._seen_in_step = False
        if self._seen_layers:
            self._seen_layers.clear()
        self._v2_req_ids = None
        self._fc = None
        self._dispatch = None
        self._fwd_md = {}
        self.untraced_now = _NOT_NOW
        if self._step_tensors:
            self._step_tensors = {}
        if self._kv_inputs:
            self._kv_inputs.clear()
        if self._logged_now:
            self._logged_now = set()
        self._model_ran = False

    def _on_forward(self, impl, layer, query, kv_cache, attn_metadata, output) -> None:
        name = getattr(layer, "layer_name", "") or f"layer{id(layer)}"
        if self._depth == 1 and self._phase[-1] == "request" and attn_metadata is not None:
            # A request step, recorded when the runner's step ends; forward adds the query's dtype
            # and the tensors. Every layer passes here each step: layers not traced return at once.
            self._model_ran = True
            if not self._wants(name):
                if not self._selected(name):
                    # Every later request step too: from now on the wrapper returns at once (each
                    # layer's forward runs once a step, so a per-step mark would never be read),
                    # and once a traced layer has run, vLLM calls the layer's own forward.
                    self.never_traced[name] = True
                    if impl is not None:
                        self._to_bypass.append(impl)
                return
            if self._layer_locked is None and self.options.layers == "first":
                self._layer_locked = name
            static = self._static.get(name)
            if static is None or static.kv_cache is not kv_cache:
                static = self._static_of(name, impl, layer, kv_cache)
                assert static is not None
            static.query_dtype = dtype_name(query.dtype)
            self._fwd_md[name] = attn_metadata
            if self.options.tensors and self._wants_tensors():
                self._capture_tensors(static, query, attn_metadata, output)
            return
        static = self._static_of(name, impl, layer, kv_cache)
        if static is not None:
            static.query_dtype = dtype_name(query)
        if name in self._seen_layers:
            # The same layer again without a runner step around it: a new forward pass
            # (the V2 runner's CUDA-graph warm-up and capture loop calls the model directly).
            self._end_pass()
            self._begin_step()
        self._seen_layers.add(name)
        self._model_ran = True
        if attn_metadata is None:
            # Profile runs build no attention metadata: vLLM skips attention itself.
            if self._gap_noted_step != self.step:
                self._gap_noted_step = self.step
                kind = self._kind()
                why = "profile run" if kind == "profile" else "warm-up pass"
                self._record_gap(kind, f"attn_metadata is None: vLLM skips attention in this {why}", 0)
            self._seen_in_step = True
            return
        if self.stages(name):  # a full graph being captured: its replays copy query / output out
            self._staging.stage(name, {"query": query, "output": output}, kv_cache, self.capture_capacity())
        if not self._wants(name):
            return
        if self.options.layers == "first" and self._layer_locked is None:
            self._layer_locked = name
        self._seen_in_step = True
        if self._in_capture or capturing():
            if self._gap_noted_step != self.step:
                self._gap_noted_step = self.step
                why = (
                    "cuda-graph-capture: no copies allowed while capturing"
                    if capturing()
                    else "cuda-graph-capture: a warm-up pass of capture_model (the tracer stays off the device "
                    "while graphs are captured)"
                )
                self._record_gap(self._kind(), why, int(attn_metadata.num_actual_tokens))
            return
        assert static is not None
        md = attn_metadata
        num_reqs = int(md.seq_lens.shape[0])
        self._capture(static, md, num_reqs, int(md.num_actual_tokens), self._req_ids(num_reqs), "none", None)

    def _capture_tensors(self, static: LayerStatic, query, md, output) -> None:
        """Device-side clones for a tensor step (queued on the stream: no host sync)."""
        kv_in = self._kv_inputs.pop(static.name, None) or {}
        n = int(md.num_actual_tokens)
        self._step_tensors[static.name] = tensor_clones(static, query, md, output, kv_in, n, int(md.seq_lens.shape[0]))

    def _capture(
        self,
        static: LayerStatic,
        md: Any,
        num_reqs: int,
        num_tokens: int,
        req_ids: tuple[str, ...],
        cudagraph: str,
        padded: int | None,
        *,
        kind: str | None = None,
        tensors: dict[str, Any] | None = None,
    ) -> None:
        """Queue one layer's record of this step into the slot (host copies, no sync)."""
        slot = self._slot or self._step_slot()
        payload = slot.payload
        hosts = payload["hosts"]
        shared = hosts.get(id(md))  # the layers of one KV-cache group share their metadata
        if shared is None:
            # A metadata trace copies the runner's tensors as given when small (the writer cuts the
            # step's rows; the records cut each row to the blocks it uses), into memory the record
            # process reads when it can. A tensor trace's table is as wide as its clone of the blocks read.
            host = queue_host_copies(
                slot,
                md,
                num_reqs,
                num_tokens,
                tensors["cols"] if tensors else None,
                as_given=not self.options.tensors,
                shared=self._sink.shared_host(),
                block_size=static.block_size,
                defer=self._defer,
            )
            shared = hosts[id(md)] = (host, step_fields(md, num_tokens, cudagraph, padded))
        host, metadata = shared
        if static.fields is None:
            layer_fields(static)
        scales = None
        if static.scales is None or getattr(static.module, "calculate_kv_scales", False):
            scales = capture_scales(static.module)
        capture_kind = kind or (self._phase[-1] if self._phase else "request")
        if capture_kind == "request":
            asked = self._warmup_asked  # ``is_warmup_batch``, asked once for the same tuple (a decode step's)
            if asked is None or asked[0] is not req_ids:
                asked = self._warmup_asked = (req_ids, is_warmup_batch(req_ids))
            if asked[1]:
                capture_kind = "warmup"  # the V2 runner warms up through execute_model with fake requests
        reset = False
        if tensors is not None:
            reset = not self._log_valid.get(static.name, False)
            self._log_valid[static.name] = True
            self._logged_now.add(static.name)
            for value in tensors.values():
                if hasattr(value, "element_size"):
                    self._pool.hold(slot, value.numel() * value.element_size())
        slot.queued = True  # the step's event, recorded when the slot is handed over, comes after these
        payload["captures"].append(
            LayerCapture(self.step, capture_kind, static, metadata, host, req_ids, scales, tensors, reset)
        )

    def _req_ids(self, num_reqs: int) -> tuple[str, ...]:
        ids: Any = self._v2_req_ids
        if ids is None and (not self._phase or self._phase[-1] == "request"):  # ``_kind()``
            batch = getattr(self._runner, "input_batch", None)
            ids = getattr(batch, "req_ids", None)
        if ids is None:
            return ("",) * num_reqs
        given = tuple(ids)
        made = self._ids_made
        if made is not None and len(made[1]) == num_reqs and made[0] == given:
            return made[1]  # a decode step's batch is the last step's (the same strings: compared by identity)
        out = tuple(map(str, given[:num_reqs]))
        out += ("",) * (num_reqs - len(out))
        self._ids_made = (given, out)
        return out

    def _end_step(
        self, method: str, kind: str, runner: Any, args: tuple, kwargs: dict, raised: BaseException | None = None
    ) -> None:
        self.untraced_now = _NOT_NOW  # the fast path holds inside request steps only
        if raised is not None:
            self._end_raised_step(method, kind, args, kwargs, raised)
            return
        try:
            if self._to_bypass and self._fwd_md:
                self._bypass_untraced()
            if method == "execute_model" and kind == "request":
                self._end_request_step(runner, args, kwargs)
                if not self._idle_decided:
                    self._decide_idle()
            elif not self._seen_in_step and kind == "profile" and self._in_range:
                self._record_gap(kind, "profile run: vLLM skips attention", 0)
            if self._log_valid or self._logged_now:  # a tensor trace's write logs (else nothing to end)
                self._end_pass()
            if self._slot is not None:
                self._submit_slot()
        except Exception as exc:  # noqa: BLE001
            self._fail(f"pagedtrace: recording failed ({exc!r}); tracing stops, the engine runs on")
            self._drop_slot()

    def _end_raised_step(self, method: str, kind: str, args: tuple, kwargs: dict, raised: BaseException) -> None:
        """vLLM's step raised (its error goes on to the caller): a gap says so, in place of the step's records.

        What the step captured before the error is dropped: its layers ran only in part. Some may
        have written the cache meanwhile, so every layer's write log starts again (its next tensor
        step stores the blocks it reads whole).
        """
        self._drop_slot()
        self._step_tensors = {}  # the layers' clones, freed now rather than at the next step
        for name in self._log_valid:
            self._log_valid[name] = False
        if kind not in ("request", "profile") or not self._in_range:
            return
        _, num_tokens = _scheduled(args, kwargs)
        message = first_line(raised, 200)
        reason = f"step-raised: vLLM's {method} raised {type(raised).__name__}" + (f": {message}" if message else "")
        try:
            self._record_gap(kind, reason, num_tokens)
            self._submit_slot()
        except Exception as exc:  # noqa: BLE001 - vLLM's error is the one the caller must see
            self._fail(f"pagedtrace: recording failed ({exc!r}); tracing stops, the engine runs on")
            self._drop_slot()

    def _decide_idle(self) -> None:
        """The first request step: without vLLM's loop in this process, the inline writer falls back to its timer."""
        self._idle_decided = True
        writer = self._thread
        if isinstance(writer, InlineWriter) and writer.idle == "engine" and not self._engine_loop:
            self._defer = False  # the timer thread will hand over: no deferred copies from now on
            writer.fall_back()

    def engine_loop_here(self) -> None:
        """vLLM's loop runs in this process (``LLM._run_engine``): :meth:`engine_idle` will come."""
        self._engine_loop = True

    def engine_idle(self) -> None:
        """vLLM's loop ran out of work (``ENGINE_IDLE_TARGETS``): hand over the steps held, on this thread."""
        self._engine_loop = True
        writer = self._thread
        if isinstance(writer, InlineWriter) and writer.idle == "engine":
            try:
                writer.engine_idle()
            except Exception as exc:  # noqa: BLE001 - the engine must run on
                self._fail(f"pagedtrace: recording failed ({exc!r}); tracing stops, the engine runs on")

    def _bypass_untraced(self) -> None:
        """Give the layers no step traces vLLM's own ``forward`` back, on their impl objects.

        Called at the end of a request step in which a traced layer's ``forward`` ran: that layer
        keeps the wrapper, which is all that later passes need (their steps, warm-up passes and
        gaps are seen through it). Each wrapper call of an untraced layer cost the engine's thread
        about a microsecond a step; with the impl's own attribute, vLLM's
        ``self.impl.forward(...)`` finds the original first. ``stop`` removes the attributes.
        """
        impls, self._to_bypass = self._to_bypass, []
        for impl in impls:
            wrapper = getattr(type(impl), "forward", None)
            original = getattr(wrapper, "__pagedtrace_original__", None)
            own = getattr(impl, "__dict__", None)  # None: no instance attributes (__slots__), the wrapper stays
            if original is None or own is None or "forward" in own:
                continue
            try:
                impl.forward = types.MethodType(original, impl)
            except (AttributeError, TypeError):  # a read-only attribute: the wrapper stays
                continue
            self._bypassed.append(impl)

    def _restore_bypassed(self) -> None:
        while self._bypassed:
            impl = self._bypassed.pop()
            with contextlib.suppress(AttributeError):
                del impl.forward

    def _end_pass(self) -> None:
        """A forward pass is over: a layer whose cache was written without a log entry loses its log."""
        if self._model_ran and self._log_valid:
            for name, valid in self._log_valid.items():
                if valid and name not in self._logged_now:
                    self._log_valid[name] = False
        if self._logged_now:
            self._logged_now = set()

    def _end_request_step(self, runner: Any, args: tuple, kwargs: dict) -> None:
        sched, num_tokens = _scheduled(args, kwargs)
        if not self._in_range:
            self._model_ran = self._model_ran or num_tokens > 0
            return
        if num_tokens == 0:
            if sched is not None and hasattr(sched, "total_num_scheduled_tokens"):
                # Counted as a step, but the runner returned before the model ran: the
                # scheduler only passed finished request ids (after requests finish; the
                # V2 runner's warm-up cleanup). Without a gap its number would be unexplained.
                finished = tuple(sorted(str(r) for r in getattr(sched, "finished_req_ids", ()) or ()))
                self._record_gap(
                    "warmup" if is_warmup_batch(finished) else "request",
                    f"empty-step: no tokens scheduled; execute_model returned without running the model "
                    f"({len(finished)} finished request(s) freed)",
                    0,
                )
            return
        self._model_ran = True
        num_reqs = len(getattr(sched, "num_scheduled_tokens", None) or ())
        md_by_layer, cudagraph, padded = self._step_metadata(runner)
        if not md_by_layer:
            self._record_gap("request", "no-metadata: the runner kept no attention metadata for this step", num_tokens)
            return
        req_ids = self._req_ids(num_reqs)
        names = self._wanted_of(md_by_layer)
        full_tensors = False
        known = self._static
        for name in names:
            static = known.get(name) or self._static_of(name)
            if static is None:
                continue
            md = md_by_layer[name]
            tensors = self._step_tensors.pop(name, None) if self._step_tensors else None
            if (
                tensors is None
                and self.options.tensors
                and name not in self._fwd_md
                and cudagraph != "none"
                and self._wants_tensors()
            ):
                # forward() did not run for this layer: its attention replayed inside a graph (a full
                # one, or a breakable PIECEWISE one that captures attention too)
                staged = self._staging.get(name, padded, static.kv_cache)
                if staged is None:
                    full_tensors = True
                else:  # the graph's copies of this replay: clone the real rows, as forward() does
                    kv_in = {"slot_mapping": md.slot_mapping[:num_tokens]}
                    kv_in.update({k: staged[k][:num_tokens].clone() for k in ("key", "value") if k in staged})
                    tensors = tensor_clones(static, staged["query"], md, staged["output"], kv_in, num_tokens, num_reqs)
            self._capture(static, md, num_reqs, num_tokens, req_ids, cudagraph, padded, tensors=tensors)
        if full_tensors:
            self._warn_once(FULL_GRAPH_TENSORS)

    def _wanted_of(self, md_by_layer: dict[str, Any]) -> list[str]:
        """The layers of a request step's metadata to record (the step is in range), in its order.

        The same every step for the same layers: kept, with the layer ``"first"`` locked on.
        """
        if self._sink.failed:
            return []
        key = (tuple(md_by_layer), self._layer_locked)
        if self._names_cache is not None and self._names_cache[0] == key:
            return self._names_cache[1]
        names = [n for n in key[0] if self._selected(n)]
        if self.options.layers == "first" and self._layer_locked is None and names:
            self._layer_locked = min(names, key=lambda n: (layer_index(n) is None, layer_index(n) or 0, n))
            names = [self._layer_locked]
            key = (key[0], self._layer_locked)
        self._names_cache = (key, names)
        return names

    def _step_metadata(self, runner: Any) -> tuple[dict[str, Any], str, int | None]:
        """This step's attention metadata per layer, how it ran, and its padded size."""
        md: Any = None
        cudagraph, padded = "none", None
        if self._fc is not None:
            md, cudagraph, padded = self._fc
        if md is None:  # the V2 runner replays full graphs without set_forward_context
            state = getattr(runner, "execute_model_state", None)
            md = getattr(state, "attn_metadata", None)
            if self._dispatch is not None:
                cudagraph, padded = self._dispatch
        if isinstance(md, list):  # micro-batched (DBO): not recorded from the runner
            md = None
        if not md:
            md = self._fwd_md
        # read only: the runner's own dict for this step (a new one each step), or forward's
        return md if type(md) is dict else dict(md), cudagraph, padded

    def _submit_slot(self) -> None:
        """Hand the step's slot to the writer, its event recorded after everything the step queued.

        The one event of the step, not one per captured layer (a record cost the engine's thread
        up to ~0.1 ms under vLLM on the H200): the tensor clones ``forward`` took and the host
        copies of the runner's step end were all queued before it, on this thread's stream. A
        slot of gaps alone records none.
        """
        slot, self._slot = self._slot, None
        if slot is None:
            return
        if self._thread is None:
            self._pool.release(slot)
            return
        # A deferred slot records nothing now (its seal, at a hand-over, does: never inside a capture,
        # which runs only inside capture_model, drained before it): no question to the device either.
        if slot.queued and not (slot.deferred and self._defer):
            if capturing():  # not reached: copies stop, and slots are handed over, before graphs are captured
                self._pool.release(slot)  # an event recorded now would be a graph node: drop the step, say so
                self._fail(
                    "pagedtrace: a step's copies reached the writer while a CUDA graph was captured; "
                    "tracing stops, the engine runs on"
                )
                return
            if self._events_on_writer and not self._sink.inline and cuda_available():
                if self._event_stream is None:
                    import torch

                    self._event_stream = (torch._C._cuda_getCurrentRawStream, torch.cuda.current_device())
                current_stream, device = self._event_stream
                leave_event(slot, current_stream(device), device)
            elif slot.deferred and not self._defer:  # deferring stopped after its copy: move it now
                stream = self._move_deferred()
                slot.deferred = False
                record_event(slot, cuda_available(), blocking=self._blocking_events, stream=stream)
            else:
                record_event(slot, cuda_available(), blocking=self._blocking_events)
        self._thread.submit(slot)

    def _drop_slot(self) -> None:
        slot, self._slot = self._slot, None
        if slot is None:
            return
        host = self._sink.shared_host()
        if host is not None and slot.payload is not None:  # its stretches of the shared ring are freed in turn
            for views in slot.payload["hosts"].values():
                offset = getattr(getattr(views[0], "packed", None), "shared", None)
                if offset is not None:
                    host.forget(offset)
        self._pool.release(slot)

    def _step_slot(self) -> Slot:
        """This step's ring slot, taken on its first record (waits while every slot is in flight)."""
        if self._slot is None:
            if self._thread is not None and not self._pool.has_free():
                self._thread.make_room()  # inline: hand the oldest over (a thread frees slots itself)
            self._slot = self._pool.acquire()
            self._slot.payload = {"captures": [], "hosts": {}}
        return self._slot

    def _record_gap(self, kind: str, reason: str, num_tokens: int) -> None:
        slot = self._step_slot()
        slot.payload["captures"].append(GapRecord(step=self.step, kind=kind, reason=reason, num_tokens=num_tokens))

    def _on_writer_error(self, exc: BaseException) -> None:
        self._fail(f"pagedtrace: recording failed ({exc!r}); tracing stops, the engine runs on")

    def _fail(self, message: str) -> None:
        """Stop tracing (the engine runs on); keep the first reason in ``error`` and say it once."""
        self._sink.failed = True
        if self.error is None:
            self.error = message
            self._warn_once(message)

    def _warn_once(self, message: str) -> None:
        if message in self._warned:
            return
        self._warned.add(message)
        logger.warning(message)
        import warnings

        warnings.warn(message, RuntimeWarning, stacklevel=3)
