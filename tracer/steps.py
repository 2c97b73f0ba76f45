"""Per-step state and layer selection: which step this is, what kind, which layers it records.

:class:`Steps` holds what the tracer knows between the wrappers' calls (``tracer.wrappers``):
the step number and whether it lies in ``options.steps``; the phase stack that tells request
steps from warm-up and profile passes; the layer ``"first"`` locked on and every layer's
selection, asked once; each traced layer's static facts (``tracer.layer_capture.LayerStatic``); and
the step's ring slot (``tracer.slots``), handed over when the step ends with its one CUDA event
recorded after everything the step queued. :class:`tracer.capture.Capture` adds what a step
records on top of it, and :class:`tracer.install.Tracer` installs both into vLLM.

Nothing here waits for the device: a slot is handed to the writer (``tracer.handover``) and
the step goes on.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from tracer.backends import backend_name
from tracer.engine_state import capturing, cuda_available, is_warmup_batch
from tracer.format import GapRecord, layer_matches, step_in_range
from tracer.graph_copies import SHARED as GRAPH_COPIES
from tracer.handover import InlineWriter, WriterThread, idle_mode
from tracer.layer_capture import LayerStatic
from tracer.options import TracerOptions
from tracer.record_writer import RecordWriter
from tracer.slots import Slot, SlotPool, record_event

__all__ = ["ENV_RING_SLOTS", "ENV_THROTTLE", "NOT_NOW", "RING_SLOTS", "Steps"]

logger = logging.getLogger("pagedtrace")

#: Steps in flight before a step waits for the writer. Metadata slots are small (a few pinned
#: buffers sized for the runner's); a tensor step's device clones count against the pool's
#: device-byte cap instead. Enough slots that the decode steps after a large prefill (whose
#: tensors take the writer ~0.1 s to store) do not wait for it.
RING_SLOTS = 64

#: Testing knobs, read when a tracer is made (the plugin makes it in vLLM's processes): the ring's
#: size and a writer delay per step (a slow disk).
ENV_RING_SLOTS = "PAGEDTRACE_RING_SLOTS"
ENV_THROTTLE = "PAGEDTRACE_WRITER_THROTTLE_S"

#: ``Steps.untraced_now`` outside request steps: no layer is passed by (never changed, only read)
NOT_NOW: dict[str, bool] = {}


class Steps:
    """The tracer's state between vLLM's calls, and what decides each step's records.

    ``ring_slots``: steps in flight before a step waits for the writer (default
    ``PAGEDTRACE_RING_SLOTS`` or :data:`RING_SLOTS`); ``throttle``: seconds the writer sleeps per
    step (default ``PAGEDTRACE_WRITER_THROTTLE_S`` or 0; tests use it as a slow disk). ``idle``
    (tests and probes): how a trace without tensors hands over once the engine idles, one of
    ``tracer.handover.IDLE_MODES``; the tracer's own is ``"engine"``. ``defer`` (tests): whether
    a metadata step's copy on CUDA is deferred to the hand-over (``tracer.shared_host``).
    """

    def __init__(
        self,
        options: TracerOptions,
        *,
        ring_slots: int | None = None,
        throttle: float | None = None,
        idle: str = "engine",
        defer: bool = True,
    ):
        if ring_slots is None:
            ring_slots = max(1, int(os.environ.get(ENV_RING_SLOTS, str(RING_SLOTS)) or RING_SLOTS))
        if throttle is None:
            throttle = float(os.environ.get(ENV_THROTTLE, "0") or 0)
        self.options = options
        self._record_writer = RecordWriter(options, self._fail)
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
        #: how the inline writer hands over once the engine idles (``tracer.handover.IDLE_MODES``)
        self._idle_mode = idle_mode(idle)
        #: vLLM's loop runs in this process and says when it idles (``ENGINE_IDLE_TARGETS``)
        self._engine_loop = False
        self._idle_decided = False  # the first request step has asked whether it does
        #: metadata copies go into the shared ring's device mirror, moved to the host every few
        #: steps (``tracer.shared_host``): set with the inline writer where the engine's thread hands over
        self._defer = False
        self._defer_wanted = defer
        self._ring_slots = ring_slots
        self._throttle = throttle
        self._handover: WriterThread | InlineWriter | None = None
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
        self.untraced_now: dict[str, bool] = NOT_NOW
        self._step_tensors: dict[str, dict[str, Any]] = {}
        self._graph_copies = GRAPH_COPIES  # tensors the captured full graphs copy out on every replay
        self.stats: dict[str, Any] = {"records": 0, "gaps": 0, "tensor_files": 0, "ring_waits": 0}
        #: why request steps of a tensor trace carry no tensors (the manifest's ``extra.tracer``), once known
        self.tensors_absent: str | None = None

    def drain(self) -> None:
        """Wait until every step so far is on disk (tests, and readers of a live trace)."""
        self._submit_slot()
        if self._handover is not None:
            self._handover.drain()
            self._record_writer.sync()

    def _kind(self) -> str:
        return self._phase[-1] if self._phase else "request"

    def _wants(self, layer_name: str) -> bool:
        if self._record_writer.failed or not self._in_range:
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
        return self.options.tensors and not self._record_writer.failed and self._selected(layer_name) and capturing()

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
        if self._record_writer.budget_exhausted:
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
            self._check_backend(impl)
        elif kv_cache is not None and static.kv_cache is not kv_cache:
            static.set_cache(kv_cache)
        return static

    def _check_backend(self, impl: Any) -> None:
        """Say once when the engine runs another backend than ``options.attention_backend``."""
        wanted = self.options.attention_backend
        cls = type(impl)
        running = backend_name(cls.__qualname__)
        if wanted is not None and running != wanted:
            self._warn_once(
                f"pagedtrace: attention_backend {wanted} was asked for, but the engine runs "
                f"{running or cls.__qualname__} (give vLLM attention_backend={wanted!r} too)"
            )

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
        self.untraced_now = NOT_NOW
        if self._step_tensors:
            self._step_tensors = {}
        if self._kv_inputs:
            self._kv_inputs.clear()
        if self._logged_now:
            self._logged_now = set()
        self._model_ran = False

    def _end_pass(self) -> None:
        """A forward pass is over: a layer whose cache was written without a log entry loses its log."""
        if self._model_ran and self._log_valid:
            for name, valid in self._log_valid.items():
                if valid and name not in self._logged_now:
                    self._log_valid[name] = False
        if self._logged_now:
            self._logged_now = set()

    def _decide_idle(self) -> None:
        """The first request step: without vLLM's loop in this process, the inline writer falls back to its timer."""
        self._idle_decided = True
        writer = self._handover
        if isinstance(writer, InlineWriter) and writer.idle == "engine" and not self._engine_loop:
            self._defer = False  # the timer thread will hand over: no deferred copies from now on
            writer.fall_back()

    def engine_loop_here(self) -> None:
        """vLLM's loop runs in this process (``LLM._run_engine``): :meth:`engine_idle` will come."""
        self._engine_loop = True

    def engine_idle(self) -> None:
        """vLLM's loop ran out of work (``ENGINE_IDLE_TARGETS``): hand over the steps held, on this thread."""
        self._engine_loop = True
        writer = self._handover
        if isinstance(writer, InlineWriter) and writer.idle == "engine":
            try:
                writer.engine_idle()
            except Exception as exc:  # noqa: BLE001 - the engine must run on
                self._fail(f"pagedtrace: recording failed ({exc!r}); tracing stops, the engine runs on")

    def _move_deferred(self) -> Any:
        """The inline writer's seal: the deferred copies to the host (``SharedHost.flush``); their stream."""
        out = self._record_writer.records_out
        host = out.shared_host if out is not None else None
        if host is None:
            return None
        host.flush()
        return host.stream

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
        if self._handover is None:
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
            if slot.deferred and not self._defer:  # deferring stopped after its copy: move it now
                stream = self._move_deferred()
                slot.deferred = False
                record_event(slot, cuda_available(), stream=stream)
            else:
                record_event(slot, cuda_available())
        self._handover.submit(slot)

    def _drop_slot(self) -> None:
        slot, self._slot = self._slot, None
        if slot is None:
            return
        host = self._record_writer.shared_host()
        if host is not None and slot.payload is not None:  # its stretches of the shared ring are freed in turn
            for views in slot.payload["hosts"].values():
                offset = getattr(getattr(views[0], "packed", None), "shared", None)
                if offset is not None:
                    host.forget(offset)
        self._pool.release(slot)

    def _step_slot(self) -> Slot:
        """This step's ring slot, taken on its first record (waits while every slot is in flight)."""
        if self._slot is None:
            if self._handover is not None and not self._pool.has_free():
                self._handover.make_room()  # inline: hand the oldest over (a thread frees slots itself)
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
        self._record_writer.failed = True
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
