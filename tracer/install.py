"""Install and uninstall the tracer's hooks: :class:`Tracer`, symmetric ``start`` / ``stop``.

``start`` patches, when importable, with the wrappers of ``tracer.wrappers``:

* the ``AttentionImpl`` of every backend of ``tracer.backends`` (FlashAttention, Triton, Flex,
  FlashInfer, CPU): ``forward`` / ``do_kv_cache_update`` (``do_kv_cache_update`` only for a
  tensor trace)
* ``FlashInferMetadataBuilder.build``, whose metadata then keeps the step's block table, sequence
  lengths and query starts beside FlashInfer's own ``paged_kv_*`` (``tracer.wrappers.flashinfer_build``)
* the V1 and V2 ``GPUModelRunner`` (``CPUModelRunner`` inherits V1): ``execute_model``,
  ``_dummy_run``, ``profile_run``, ``capture_model``, ``prepare_inputs`` to number steps and
  tell profile / warm-up / request steps apart; the runner modules' ``set_forward_context``
  and the V2 runner's ``dispatch_cg_and_sync_dp`` to see each step's metadata and graph
* for a trace without tensors, where vLLM's loop runs out of work (:data:`ENGINE_IDLE_TARGETS`),
  so the steps held on the engine's thread are handed over there

A second ``start`` (of this or any tracer) raises; a start that fails half-way unpatches what
it patched; ``stop`` writes what is in flight, unpatches and closes the trace. What a step
records is :class:`tracer.capture.Capture`'s, on the per-step state of :class:`tracer.steps.Steps`.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import multiprocessing.util
import os
import sys
import threading
from typing import Any

from tracer import wrappers
from tracer.backends import BACKEND_IMPLS, FLASHINFER_BUILDER
from tracer.capture import Capture
from tracer.engine_state import capturing, cuda_available
from tracer.handover import InlineWriter, WriterThread
from tracer.host_copies import forget_plans
from tracer.manifest import import_attr
from tracer.options import TracerOptions

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

#: Every backend of ``tracer.backends.BACKEND_IMPLS``: (module, ``AttentionImpl`` class).
BACKEND_TARGETS = tuple(BACKEND_IMPLS.values())
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
#: its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) in the second. A trace without tensors
#: hands over the steps it holds there (``tracer.handover.InlineWriter.engine_idle``).
ENGINE_IDLE_TARGETS = (
    ("vllm.v1.engine.core", "EngineCoreProc", "_notify_idle_state_callbacks"),
    ("vllm.entrypoints.offline_utils", "OfflineInferenceMixin", "_run_engine"),
)

_ACTIVE: Tracer | None = None
_LOCK = threading.Lock()


def active() -> Tracer | None:
    """The tracer installed in this process, if any."""
    return _ACTIVE


class Tracer(Capture):
    """Installs the hooks in this process and writes one trace directory.

    ``start()`` / ``stop()`` are symmetric; a second ``start()`` (of this or any tracer) raises;
    a start that fails half-way unpatches what it patched. The keyword arguments are
    :class:`tracer.steps.Steps`'.
    """

    def __init__(self, options: TracerOptions, **kwargs: Any):
        super().__init__(options, **kwargs)
        self._patched: list[tuple[Any, str, Any]] = []
        self._env_backup: dict[str, str | None] = {}
        self._finalizer: multiprocessing.util.Finalize | None = None  #: ``stop`` when a multiprocessing child ends

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
            self._handover = self._writer_thread()
            _ACTIVE = self
            if export_env:
                env = self.options.to_env()
                self._env_backup = {k: os.environ.get(k) for k in env}
                os.environ.update(env)
        atexit.register(self._atexit)
        # A multiprocessing child (vLLM's engine core under ``vllm serve``) ends through
        # ``os._exit``: no atexit handler runs there, only multiprocessing's finalizers (after
        # vLLM's SIGTERM handler raised SystemExit). The steps the engine's thread had not yet
        # handed over go to the record process then.
        self._finalizer = multiprocessing.util.Finalize(None, self._atexit, exitpriority=100)
        return self

    def _writer_thread(self) -> WriterThread | InlineWriter:
        """The writer: for a trace without tensors the engine's own thread hands the slots to the
        record process (``tracer.handover.InlineWriter``); for a tensor trace, a writer thread."""
        args = (self._pool, self._record_writer.handle_slot, self._on_writer_error)
        if self._record_writer.inline:
            busy = lambda: self._in_capture > 0 or capturing()  # noqa: E731 - the idle thread's question
            # Deferred copies only where every hand-over runs on the engine's thread (no idle thread)
            self._defer = self._defer_wanted and self._idle_mode in ("engine", "off")
            return InlineWriter(
                *args,
                throttle=self._throttle,
                end=self._record_writer.send_records,
                busy=busy,
                flush=self._record_writer.flush_records,
                idle=self._idle_mode,
                move=self._move_deferred,
                on_cuda=cuda_available(),
            )
        return WriterThread(*args, throttle=self._throttle)

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
                if self._handover is not None:
                    self._handover.close()
                    if isinstance(self._handover, InlineWriter):  # how often its idle thread took the GIL
                        looks = {
                            "idle": self._handover.idle,
                            "idle_looks": self._handover.looks,
                            "idle_hand_overs": self._handover.idle_hand_overs,
                            "deferred_seals": self._handover.seals,  # one copy and one event each
                        }
                    self._handover = None
                looks["ring_waits"] = self._pool.waits
                if self.tensors_absent is not None:
                    looks["tensors_absent"] = self.tensors_absent
                self._record_writer.finish(looks)
                self.stats.update(self._record_writer.stats, **looks)
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
        builder = import_attr(*FLASHINFER_BUILDER)
        if builder is not None:
            self._patch(builder, "build", functools.partial(wrappers.flashinfer_build, self))
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
        if self._idle_mode == "engine" and self._record_writer.inline:
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

    def _restore_bypassed(self) -> None:
        while self._bypassed:
            impl = self._bypassed.pop()
            with contextlib.suppress(AttributeError):
                del impl.forward
