"""The hand-over to the host: slots whose copies have landed become records, off the step.

Two writers share one interface (``submit``, ``make_room``, ``drain``, ``close``):

* :class:`InlineWriter`, for a trace without tensors: no thread of the tracer's runs while
  steps run. The engine's own thread queues each step's slot and, every
  :data:`HAND_OVER_EVERY` steps, hands the queued slots whose events have fired to the record
  process in one message (``tracer.record_writer``, ``tracer.record_process``). What is still
  queued when vLLM's loop runs out of work is handed over there, on the engine's thread
  (``tracer.install.ENGINE_IDLE_TARGETS``); where that loop runs in another process the writer
  falls back to an idle thread that sleeps on a one-shot timer
  (:class:`~tracer.idle_timer.IdleTimer`) each step pushes :data:`IDLE_S` ahead, so it wakes
  only once steps stop. Why no writer thread: two threads hand the GIL to each other several
  times a step, and each time the engine's thread sleeps until the other lets go; here it pays
  the hand-over itself (tens of µs every few steps) and never sleeps for it.
* :class:`WriterThread`, for a tensor trace: a thread waits for each slot's event (without the
  GIL), then turns it into records and copies its tensors to the host on a stream of its own.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from tracer.idle_timer import IdleTimer
from tracer.slots import Slot, SlotPool, record_event

__all__ = ["HAND_OVER_EVERY", "IDLE_MODES", "IDLE_S", "InlineWriter", "WriterThread", "idle_mode"]

logger = logging.getLogger("pagedtrace")


class _HandOver:
    """What both writers do with a slot: wait for its event, ``handle`` it, ``end``, free it.

    An exception in ``handle`` or ``end`` is passed to ``on_error`` once; later slots are only
    freed. ``throttle`` (tests): seconds to sleep before each slot, a slow disk.
    """

    def __init__(
        self,
        pool: SlotPool,
        handle: Callable[[Slot], None],
        on_error: Callable[[BaseException], None],
        *,
        throttle: float = 0.0,
        end: Callable[[], None] | None = None,
    ):
        self.pool = pool
        self._handle = handle
        self._end = end
        self._on_error = on_error
        self._failed = False
        self.throttle = throttle

    def _finish(self, slot: Slot, *, fired: bool = False) -> None:
        """Hand ``slot`` over (``fired``: its event is known to have fired), then free it."""
        if self.throttle:
            time.sleep(self.throttle)
        self._guarded(self._hand_over, slot, fired)
        self.pool.release(slot)

    def _hand_over(self, slot: Slot, fired: bool) -> None:
        event = None if fired else slot.landed_event()
        if event is not None:
            event.synchronize()
        self._handle(slot)
        if self._end is not None:
            self._end()

    def _finish_all(self, slots: list[Slot], *, fired: bool = False) -> None:
        """:meth:`_finish` for several slots, oldest first, with one ``end`` after the last: one message."""
        if self.throttle:
            time.sleep(self.throttle * len(slots))
        self._guarded(self._hand_over_all, slots, fired)
        for slot in slots:
            self.pool.release(slot)

    def _hand_over_all(self, slots: list[Slot], fired: bool) -> None:
        for slot in slots:
            event = None if fired else slot.landed_event()
            if event is not None:
                event.synchronize()
            self._handle(slot)
        if self._end is not None:
            self._end()

    def _guarded(self, call: Callable[..., None], *args: Any) -> None:
        """``call(*args)`` unless a hand-over failed before; its exception goes to ``on_error``, once."""
        if self._failed:
            return
        try:
            call(*args)
        except BaseException as exc:  # noqa: BLE001 - the engine must run on
            self._failed = True
            self._on_error(exc)


#: ``InlineWriter``: after this many seconds without a step, its idle thread hands over what is queued.
IDLE_S = 0.1
#: How ``InlineWriter`` hands over the steps it holds once the engine goes idle. ``engine`` (the
#: tracer's choice): on the engine's own thread, when vLLM's loop runs out of work (the engine
#: core's busy loop about to wait for requests, ``EngineCoreProc._notify_idle_state_callbacks``, or
#: the end of ``LLM``'s in-process ``_run_engine``). Where no such loop runs in the process that
#: steps the model (a worker of its own under tensor parallelism, a hand-driven ``LLMEngine``) the
#: tracer falls back to ``timer`` at the first request step (:meth:`InlineWriter.fall_back`).
#: ``timer``: an idle thread sleeps in the kernel on a one-shot timer each step pushes
#: :data:`IDLE_S` ahead (:class:`IdleTimer`), so it wakes only once no step has come for that long;
#: ``look``: where no ``timerfd`` can be made, it wakes :data:`LOOK_S` apart to look; ``off``:
#: nothing (later steps and ``stop`` hand over). A wake of an idle thread takes the GIL, which the
#: engine's thread holds while steps run: the timer wakes once after each batch, a look ten times a
#: second.
IDLE_MODES = ("engine", "timer", "look", "off")
#: ``idle="look"``: seconds between looks.
LOOK_S = 0.1


def idle_mode(idle: str) -> str:
    """``idle`` if it is one of :data:`IDLE_MODES`; a one-line ``ValueError`` otherwise."""
    if idle not in IDLE_MODES:
        raise ValueError(f"idle {idle!r}: expected one of {IDLE_MODES}")
    return idle


#: ``InlineWriter``: steps queued before the engine's thread hands them over, together, in one
#: message to the record process. Each hand-over costs the thread a fixed part (the message's
#: encoding, its write, the child's wake-up) besides each step's own.
HAND_OVER_EVERY = 8


class InlineWriter(_HandOver):
    """The writer's work on the engine's own thread, at each step's end: no writer thread.

    For a trace without tensors: the records are built and written by the record process
    (``tracer.record_process``). The engine's thread pays the hand-over itself (``handle`` and
    ``end``: the message to the record process, tens of µs) and never sleeps on the GIL for a
    thread of the tracer's.

    :meth:`submit` queues the step's slot; once ``every`` slots are queued it hands over, oldest
    first, every queued slot whose event has fired (``Event.query``: no wait), ``handle`` for each
    and one ``end`` after them (one message); a slot whose copies are still running waits for a
    later step. :meth:`make_room` (a step found no free slot), :meth:`drain` and :meth:`close`
    hand over every queued slot and wait for the events. A slot's records therefore reach the
    record process up to ``every`` steps late.
    So that the last steps before the engine goes idle are not held until the next request, what
    is queued is handed over once the engine goes idle (``idle``: see :data:`IDLE_MODES`). With
    ``idle="engine"`` the tracer calls :meth:`engine_idle` on the engine's thread when vLLM's loop
    runs out of work, and no thread is started; :meth:`fall_back` starts the ``timer`` thread
    instead where no such call will come. With ``"timer"`` an idle thread hands over once no step
    has come for ``idle_s``: it sleeps on an :class:`IdleTimer` that each :meth:`submit` pushes
    ``idle_s`` ahead, so while steps run it never wakes and never takes the GIL; with ``"look"`` it
    wakes every ``look_s`` to look; ``"off"``: neither (``stop`` and later steps hand over).
    ``looks`` counts the thread's wakes, ``idle_hand_overs`` the idle hand-overs. An idle hand-over
    keeps off the device while ``busy()`` says so (the runner captures CUDA graphs). One lock keeps
    a step and an idle hand-over from handing over at once; a step that finds it taken leaves its
    slot queued. Same interface as :class:`WriterThread`; ``throttle`` (tests) sleeps on the thread
    that hands over.
    """

    def __init__(
        self,
        pool: SlotPool,
        handle: Callable[[Slot], None],
        on_error: Callable[[BaseException], None],
        *,
        throttle: float = 0.0,
        end: Callable[[], None] | None = None,
        idle_s: float = IDLE_S,
        idle: str = "engine",
        look_s: float = LOOK_S,
        busy: Callable[[], bool] = lambda: False,
        flush: Callable[[], None] | None = None,
        every: int = HAND_OVER_EVERY,
        move: Callable[[], Any] | None = None,
        on_cuda: bool = False,
    ):
        super().__init__(pool, handle, on_error, throttle=throttle, end=end)
        self.every = max(1, every)  #: steps queued before a hand-over (:data:`HAND_OVER_EVERY`)
        #: moves the deferred steps' copies to the host (``SharedHost.flush``) and says on which
        #: stream (None: the current one), for :meth:`seal`
        self._move = move
        self._on_cuda = on_cuda  #: events are CUDA events (else copies are done when queued)
        self._unsealed = 0  #: queued deferred slots not yet sealed
        self.seals = 0  #: how often :meth:`seal` recorded an event for deferred steps
        self._flush = flush  #: sends what ``end`` held back (the record process's batched writes)
        self._pending: deque[Slot] = deque()  # append / popleft are atomic: no lock to queue a slot
        self._lock = threading.Lock()  # held while slots are handed over
        self._last = time.monotonic()  # the last step's submit
        self._idle_s = idle_s
        self._look_s = look_s
        self._busy = busy
        self._closed = threading.Event()
        self._idle: threading.Thread | None = None
        self._timer: IdleTimer | None = None
        self.looks = 0  #: the idle thread's wakes so far (each took the GIL)
        self.idle_hand_overs = 0  #: of them, those that found the engine idle and handed something over
        self._idle_mark = self._last  # ``_last`` at the last engine-idle hand-over
        idle = idle_mode(idle)
        if idle_s <= 0:
            idle = "off"
        #: how what is held reaches the record process once the engine idles: ``engine``, ``timer``,
        #: ``look`` or ``off`` (``timer`` falls back to ``look`` where there is no ``timerfd``)
        self.idle = idle
        if idle in ("timer", "look"):
            self._start_idle_thread(idle)

    def _start_idle_thread(self, idle: str) -> None:
        if idle == "timer":
            try:
                self._timer = IdleTimer()
            except OSError:  # not Linux: look instead
                idle = "look"
        if idle == "look" and self._look_s <= 0:
            idle = "off"
        self.idle = idle
        if idle != "off":
            self._idle = threading.Thread(target=self._hand_over_when_idle, name="pagedtrace-idle", daemon=True)
            self._idle.start()

    def fall_back(self) -> None:
        """No :meth:`engine_idle` will come (the engine's loop runs in another process): start the timer thread.

        The timer thread hands over on a thread of its own: the steps deferred so far are sealed
        first (the caller stops deferring: ``tracer.steps``), so that it never moves copies.
        """
        if self.idle == "engine" and not self._closed.is_set():
            with self._lock:
                self.seal()
            self._start_idle_thread("timer")

    def seal(self) -> None:
        """The queued deferred steps' copies go to the host in one copy, with one event after it.

        Called with the lock held before any hand-over (the caller's thread queued the packs, or
        the engine is idle). The newest deferred slot records the event; the older ones are
        covered by it (``Slot.cover``): their copies are done once it has fired. A move or record
        that raises goes to ``on_error`` once, like a failed hand-over: the slots stay unsealed, and
        are only freed, never read.
        """
        if not self._unsealed:
            return
        self._unsealed = 0
        pending = [slot for slot in self._pending if slot.deferred]
        if not pending or self._failed:
            return
        newest = pending[-1]
        try:
            stream = self._move() if self._move is not None else None
            record_event(newest, self._on_cuda, stream=stream)
        except Exception as exc:  # noqa: BLE001 - the engine must run on
            self._failed = True
            self._on_error(exc)
            return
        for slot in pending:
            slot.deferred = False
            if slot is not newest:
                slot.cover = newest
        self.seals += 1

    def engine_idle(self) -> None:
        """The engine's loop has run out of work: hand over what is queued and held, on the calling thread.

        Steps do not run meanwhile (the caller is the thread that runs them), so the queued slots'
        events have fired or are about to. Does nothing while graphs are captured, or while a step
        hands over on another thread (it takes what is queued).
        """
        if self._last == self._idle_mark or self._busy() or not self._lock.acquire(blocking=False):
            return  # no step since the last time, or the device is not to be touched now
        try:
            self._idle_mark = self._last
            self.idle_hand_overs += 1
            if self._pending:
                self._finish_all(self._take_all())
            self._send_held()
        finally:
            self._lock.release()

    def submit(self, slot: Slot) -> None:
        """Queue the step's slot; hand over the oldest queued ones whose copies have landed, ``every`` steps.

        Deferred slots (``Slot.deferred``) are sealed once ``every`` of them are queued: one copy
        and one event for them all, handed over by a later step once that event has fired.
        """
        pending = self._pending
        pending.append(slot)
        if slot.deferred:
            self._unsealed += 1
        self._last = time.monotonic()
        if self._timer is not None:
            self._timer.arm(self._idle_s)  # the idle thread wakes only if no step follows in time
        if len(pending) < self.every:
            return
        if not self._lock.acquire(blocking=False):
            return  # the idle thread is handing over: a later step (or it) takes this one
        try:
            if self._unsealed >= self.every:
                self.seal()
            fired = []
            landed = None  # the last event seen to have fired (sealed slots share one)
            while pending:
                first = pending[0]
                if first.deferred and not self._failed:
                    break  # not sealed yet: its copies have not been queued to the host (failed: only freed)
                event = first.landed_event()
                if event is not None and event is not landed:
                    if not event.query():
                        break  # its copies are still running: a later step hands it over
                    landed = event
                fired.append(pending.popleft())
            if fired:
                self._finish_all(fired, fired=True)
        finally:
            self._lock.release()

    def make_room(self) -> None:
        """Hand over every queued slot, waiting for their events: a step found every slot in flight."""
        with self._lock:
            if self._pending:
                self.pool.waits += 1
                self._finish_all(self._take_all())

    def _take_all(self) -> list[Slot]:
        """Every queued slot, oldest first, the deferred ones sealed (the lock is held)."""
        self.seal()
        pending = self._pending
        return [pending.popleft() for _ in range(len(pending))]

    def drain(self) -> None:
        """Hand over every queued slot (waits for their events), and send what ``end`` held back."""
        with self._lock:
            if self._pending:
                self._finish_all(self._take_all())
            self._send_held()

    def _send_held(self) -> None:
        if self._flush is not None:
            self._guarded(self._flush)

    def close(self) -> None:
        """End the idle thread, then hand over what is queued."""
        self._closed.set()
        if self._timer is not None:
            self._timer.arm(0)  # wakes the idle thread at once
        if self._idle is not None and self._idle is not threading.current_thread():
            self._idle.join()
            if self._timer is not None:
                self._timer.close()
                self._timer = None
        self.drain()

    def _wake(self) -> bool:
        """Sleep until the next look (``look``) or until the timer fires (``timer``); False: closed."""
        timer = self._timer
        if timer is None:
            return not self._closed.wait(self._look_s)
        while not timer.wait(None):  # a spurious wake-up: sleep again
            pass
        return not self._closed.is_set()

    def _hand_over_when_idle(self) -> None:
        held = False  # ``end`` may hold messages back since the last idle hand-over
        timer = self._timer
        while self._wake():
            self.looks += 1
            if timer is not None:
                held = True  # the timer fires only after a step
            since = time.monotonic() - self._last
            if since < self._idle_s:
                held = True  # steps ran: something may be held
                if timer is not None:  # a step came after the timer was set: wake when it is idle_s old
                    timer.arm(self._idle_s - since)
                continue
            if (not self._pending and not held) or self._busy():
                if timer is not None and held:  # graphs are being captured: look again later
                    timer.arm(self._idle_s)
                continue
            if self._lock.acquire(blocking=False):  # else a step is handing over right now
                try:
                    self.idle_hand_overs += 1
                    if self._pending and not self._busy():
                        self._finish_all(self._take_all())
                    if not self._pending:
                        self._send_held()
                        held = False
                finally:
                    self._lock.release()
            if timer is not None and (held or self._pending):  # something is left: look again
                timer.arm(self._idle_s)


class WriterThread(_HandOver):
    """Drains slots in order: waits for each one's event, then ``handle(slot)``, then frees it.

    ``handle`` runs on this thread (records, JSON, files; it makes the slot's host views,
    ``Slot.make_views``), then ``end`` (sends what ``handle`` queued, if anything); errors and
    ``throttle`` as :class:`_HandOver` says.
    """

    def __init__(
        self,
        pool: SlotPool,
        handle: Callable[[Slot], None],
        on_error: Callable[[BaseException], None],
        *,
        throttle: float = 0.0,
        end: Callable[[], None] | None = None,
    ):
        super().__init__(pool, handle, on_error, throttle=throttle, end=end)
        # A SimpleQueue: ``put`` is one C call on the engine's thread (a ``queue.Queue`` takes its
        # lock and notifies in Python). ``drain`` queues a marker and waits for the thread to reach it.
        self._queue: queue.SimpleQueue[Slot | threading.Event | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="pagedtrace-writer", daemon=True)
        self._thread.start()

    def make_room(self) -> None:
        """Nothing: this thread frees the slots (a step that found none free waits in ``SlotPool.acquire``)."""

    def submit(self, slot: Slot) -> None:
        self._queue.put(slot)

    def drain(self) -> None:
        """Block until every submitted slot is handled."""
        if not self._thread.is_alive():
            return
        done = threading.Event()
        self._queue.put(done)
        while not done.wait(1.0):
            if not self._thread.is_alive():  # not reached: the thread ends only at ``close``
                return

    def close(self) -> None:
        """Handle what is queued, then end the thread."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _run(self) -> None:
        while True:
            slot = self._queue.get()
            if slot is None:
                return
            if isinstance(slot, threading.Event):  # ``drain``: every slot before it is handled
                slot.set()
                continue
            self._finish(slot)
