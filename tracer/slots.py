"""Steps in flight: pinned host ring slots and the one CUDA event of each step.

The hot path (the model runner's step, ``tracer.steps``) never waits for the device. It takes
a :class:`Slot`, queues non-blocking device-to-host copies of the step's metadata into the
slot's pinned buffers (one copy per KV-cache group, ``tracer.host_copies``) and keeps the
step's device-side tensor clones; when the step is over it records the slot's one CUDA event,
after all of them (:func:`record_event`), and hands the slot over (``tracer.handover``). Whoever
reads the slot waits for that event first; only then is the slot free again.

A metadata step on CUDA whose copy is deferred (``Slot.deferred``, ``tracer.shared_host``)
records no event of its own: the hand-over seals several queued steps with one copy to the
host and one event (``tracer.handover.InlineWriter.seal``).

When every slot is in flight the step waits for the oldest: a slow disk slows the engine
down rather than losing a step (``SlotPool.waits`` counts how often). Device memory held by
in-flight tensor clones is bounded the same way (``max_device_bytes``). On a CPU engine the
same code runs without pinning or events: copies are plain copies.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MAX_BUFFER_ELEMENTS", "Slot", "SlotPool", "record_event"]

#: A slot buffer's first size is at most this many elements (unless the step needs more).
MAX_BUFFER_ELEMENTS = 4 * 2**20


@dataclass
class Slot:
    """One step in flight: host buffers (reused), the event, and what the writer needs."""

    index: int
    buffers: dict[str, Any] = field(default_factory=dict)  #: name -> pinned host tensor (grown, reused)
    event: Any = None  #: ``torch.cuda.Event`` recorded after the step's copies; None on CPU
    #: device work (copies, clones) was queued for this use of the slot: its event is recorded when
    #: the step hands it over (``tracer.steps``); a slot of gaps alone queues none
    queued: bool = False
    recorded: bool = False  #: the event was recorded for this use of the slot (gaps alone record none)
    #: the step's metadata went into the shared memory's device mirror, not yet moved to the host
    #: (``tracer.shared_host``): no event of its own until the writer seals the queued steps
    #: (``tracer.handover.InlineWriter.seal``)
    deferred: bool = False
    #: sealed with later steps: the slot whose event, recorded after the one copy that moved them
    #: all, says this one's copies have landed (handed over no later than it: FIFO)
    cover: Slot | None = None
    payload: Any = None  #: what the writer turns into records
    device_bytes: int = 0  #: bytes of device tensors the payload holds
    #: what makes the host views of packed copies (``tracer.capture.pack_host_copies``): left by
    #: the step to the writer thread, which runs them (:meth:`make_views`) before it reads any view
    view_makers: list[Callable[[], None]] = field(default_factory=list)
    _prefixes: dict[tuple[str, int], Any] = field(default_factory=dict)  #: ``host_prefix``'s views

    def host_buffer(self, name: str, n: int, dtype: Any, *, pin: bool, sources: Iterable[Any]) -> Any:
        """This slot's host buffer ``name``: at least ``n`` elements of ``dtype``, made or grown here.

        ``sources``: the tensors it is filled from (views of the runner's persistent buffers).
        """
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            import torch

            # Pinned allocations are slow (page locking, on the step's thread): size the buffer once,
            # for the persistent runner buffers it is filled from (at most 4 Mi elements), then
            # double it should a step ever need more.
            if buf is None:
                whole = sum(s.untyped_storage().nbytes() for s in sources) // dtype.itemsize
                size = max(n, min(whole, MAX_BUFFER_ELEMENTS), 64)
            else:
                size = 2 * n
            buf = torch.empty(size, dtype=dtype, pin_memory=pin)
            self.buffers[name] = buf
            self._prefixes.clear()  # views of the old buffer
        return buf

    def host_prefix(self, name: str, n: int, dtype: Any, *, pin: bool, sources: Iterable[Any]) -> Any:
        """``host_buffer(...)[:n]``, the view kept for the next step of the same size (a slice is one
        more tensor operation on the engine's thread)."""
        buf = self.host_buffer(name, n, dtype, pin=pin, sources=sources)
        key = (name, n)
        view = self._prefixes.get(key)
        if view is None:
            if len(self._prefixes) > 64:
                self._prefixes.clear()
            view = self._prefixes[key] = buf[:n]
        return view

    def landed_event(self) -> Any:
        """The event that fires once this slot's copies have landed: its own, its cover's, or None (none queued)."""
        if self.recorded:
            return self.event
        cover = self.cover
        return cover.event if cover is not None and cover.recorded else None

    def make_views(self) -> None:
        """Fill the host views the step left to the writer thread (packed copies: ``tracer.capture``)."""
        for make in self.view_makers:
            make()
        self.view_makers.clear()

    def host(self, name: str, src: Any) -> Any:
        """Queue ``src`` (a device tensor) into this slot's host buffer ``name``; return the host view.

        The view holds the values once the slot's event has fired (at once on CPU).
        """
        n = src.numel()
        buf = self.host_buffer(name, n, src.dtype, pin=src.is_cuda, sources=(src,))
        view = buf[:n].view(src.shape)
        view.copy_(src, non_blocking=src.is_cuda)
        return view


class SlotPool:
    """``capacity`` slots; ``acquire`` blocks while all are in flight (or device bytes exceed the cap)."""

    def __init__(self, capacity: int = 8, *, max_device_bytes: int = 2 * 2**30):
        self.capacity = capacity
        self.max_device_bytes = max_device_bytes
        self._free = [Slot(i) for i in range(capacity)]
        self._device_bytes = 0
        self._cond = threading.Condition()
        self._waiting = 0  #: threads in :meth:`acquire`'s wait (``release`` notifies only then)
        self.waits = 0  #: how often a step waited for the writer

    def acquire(self) -> Slot:
        """A free slot; waits while none is (or device bytes exceed the cap).

        Without device bytes held (a metadata trace) a free slot is taken without the lock: the
        writer thread takes it to release each slot, and a step that found it taken would wait
        for the writer's turn with the GIL. ``list.pop`` is atomic under the GIL.
        """
        if not self._device_bytes:
            try:
                return self._free.pop()
            except IndexError:
                pass
        with self._cond:
            if not self._free or self._device_bytes > self.max_device_bytes:
                self.waits += 1
            while not self._free or (self._device_bytes > self.max_device_bytes and len(self._free) < self.capacity):
                # A timeout: a release without the lock (no device bytes) may come between the test
                # above and the wait, and notify nobody; the next look finds its slot.
                self._waiting += 1
                try:
                    self._cond.wait(0.01)
                finally:
                    self._waiting -= 1
            return self._free.pop()

    def has_free(self) -> bool:
        """A slot is free now (``acquire`` would not wait for one)."""
        return bool(self._free)

    def hold(self, slot: Slot, nbytes: int) -> None:
        """Count ``nbytes`` of device memory against the pool until ``slot`` is released."""
        with self._cond:
            slot.device_bytes += nbytes
            self._device_bytes += nbytes

    def release(self, slot: Slot) -> None:
        """Free ``slot``. Without device bytes and nobody waiting, no lock: ``list.append`` is atomic."""
        slot.payload = None
        slot.queued = slot.recorded = slot.deferred = False
        slot.cover = None
        if slot.view_makers:
            slot.view_makers.clear()
        if not slot.device_bytes and not self._waiting:
            self._free.append(slot)
            return
        with self._cond:
            self._device_bytes -= slot.device_bytes
            slot.device_bytes = 0
            self._free.append(slot)
            self._cond.notify_all()


def record_event(slot: Slot, on_cuda: bool, *, stream: Any = None) -> None:
    """Record the slot's event on ``stream`` (None: the current one), after everything queued for the step.

    Once per step, where the slot is handed over (``tracer.steps``), not once per captured
    layer: a record costs the engine's thread up to ~0.1 ms under vLLM on an H200. Deferred
    steps record one for several (``tracer.handover.InlineWriter.seal``). The event blocks its
    waiter (it sleeps in the driver rather than spinning a core).
    """
    if not on_cuda:
        slot.event = None
        return
    import torch

    if slot.event is None:
        slot.event = torch.cuda.Event(blocking=True)
    slot.event.record(stream)
    slot.recorded = True
