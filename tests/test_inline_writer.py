"""The inline writer of a trace without tensors: the engine's own thread hands each slot to the record process.

``tracer.handover.InlineWriter`` has no thread: at each step's end it hands over, oldest first, every
slot whose CUDA event has fired, and leaves the rest for a later step. The event is stood in for
here (a CPU machine has none); the H200 probe runs the real one (``--variants metadata-inline``).
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.factories import RUN_ARGS, engine_env, run_engine
from tests.test_record_process import _engine, _steps
from tracer.format import Trace
from tracer.handover import InlineWriter, Slot, SlotPool


class _Event:
    """A CUDA event stand-in: fired or not, and what was asked of it."""

    def __init__(self, log: list, name: int):
        self.fired = False
        self.log, self.name = log, name

    def query(self) -> bool:
        self.log.append(("query", self.name))
        return self.fired

    def synchronize(self) -> None:
        self.log.append(("wait", self.name))
        self.fired = True


def _step(pool: SlotPool, writer: InlineWriter, log: list, i: int) -> Slot:
    """One step's slot with a recorded (not yet fired) event, handed to ``writer``."""
    if not pool.has_free():
        writer.make_room()
    slot = pool.acquire()
    slot.payload = i
    slot.event, slot.recorded = _Event(log, i), True
    writer.submit(slot)
    return slot


def test_a_slot_is_handed_over_once_its_event_fired_oldest_first_on_this_thread():
    pool, log, handled = SlotPool(8), [], []
    writer = InlineWriter(
        pool, lambda slot: handled.append((slot.payload, threading.get_ident())), log.append, idle_s=0, every=1
    )  # no idle thread: every hand-over here is a step's; each step hands over what it can
    first = _step(pool, writer, log, 0)
    assert handled == [] and log == [("query", 0)]  # its copies still run: nothing waited for
    second = _step(pool, writer, log, 1)
    assert handled == [] and log[-1] == ("query", 0)  # the oldest first: 1 is not asked before 0
    second.event.fired = True
    first.event.fired = True
    _step(pool, writer, log, 2)
    assert [p for p, _ in handled] == [0, 1]  # both fired: handed over in order; 2 waits
    assert {tid for _, tid in handled} == {threading.get_ident()}
    assert not any(call[0] == "wait" for call in log)  # no step waited for the device
    writer.drain()
    assert [p for p, _ in handled] == [0, 1, 2] and log[-1] == ("wait", 2)
    assert pool.has_free() and len(pool._free) == 8


def _every_three(pool: SlotPool, log: list, handled: list, **kw) -> InlineWriter:
    """A writer without an idle thread that hands over every 3 steps: each slot's payload, then "end"."""
    return InlineWriter(
        pool,
        lambda slot: handled.append(slot.payload),
        log.append,
        idle_s=0,
        every=3,
        end=lambda: handled.append("end"),
        **kw,
    )


def test_slots_are_handed_over_every_few_steps_in_one_message():
    """``every`` steps queue before a hand-over; the fired slots then go together, one ``end`` after them."""
    pool, log, handled = SlotPool(8), [], []
    writer = _every_three(pool, log, handled)
    slots = [_step(pool, writer, log, i) for i in range(2)]
    assert handled == [] and log == []  # fewer than 3 queued: not even asked
    for slot in slots:
        slot.event.fired = True
    _step(pool, writer, log, 2)  # the third: 0 and 1 fired, 2 still runs
    assert handled == [0, 1, "end"] and log == [("query", 0), ("query", 1), ("query", 2)]
    writer.close()
    assert handled == [0, 1, "end", 2, "end"] and log[-1] == ("wait", 2)


def test_a_step_that_finds_every_slot_in_flight_hands_them_over_and_loses_none():
    pool, log, handled = SlotPool(2), [], []
    writer = InlineWriter(pool, lambda slot: handled.append(slot.payload), log.append, idle_s=0)
    for i in range(7):  # no event ever fires by itself: every slot is freed by make_room
        _step(pool, writer, log, i)
    writer.close()
    assert handled == list(range(7))
    assert pool.waits == 3  # steps 2, 4 and 6 found both slots in flight and waited for their events
    assert [c for c in log if c[0] == "wait"] == [("wait", i) for i in range(7)]


def test_a_slow_disk_slows_the_step_and_loses_nothing(tmp_path, monkeypatch):
    """The ring's promise with the writer on the engine's thread: ``PAGEDTRACE_WRITER_THROTTLE_S``."""
    monkeypatch.setenv("PAGEDTRACE_WRITER_THROTTLE_S", "0.01")
    monkeypatch.setenv("PAGEDTRACE_RING_SLOTS", "2")
    t = _engine(tmp_path, monkeypatch, "inline")
    assert isinstance(t._handover, InlineWriter) and t._handover.throttle == 0.01
    _steps(t, 6)
    t._handover.close()
    t._record_writer.finish()
    assert t.error is None
    trace = Trace.open(tmp_path / "trace")
    assert [r.step for r in trace.records] == list(range(6))


def test_a_failing_hand_over_is_reported_once_and_frees_every_slot():
    pool, errors = SlotPool(2), []

    def handle(slot: Slot) -> None:
        raise OSError("pipe closed")

    writer = InlineWriter(pool, handle, errors.append, idle_s=0, every=1)
    for i in range(5):
        slot = pool.acquire()  # would never come back were failed slots kept
        slot.payload = i
        writer.submit(slot)  # no event (a CPU engine): handed over at once
    writer.close()
    assert len(errors) == 1 and "pipe closed" in str(errors[0])
    assert len(pool._free) == 2


@pytest.mark.parametrize("mode", ["inline"])
def test_stop_hands_over_the_last_steps(tmp_path, monkeypatch, mode):
    t = _engine(tmp_path, monkeypatch, mode)
    _steps(t, 3)
    t._handover.close()  # what stop() does: the slots still queued are handed over
    t._record_writer.finish()
    assert len(Trace.open(tmp_path / "trace").records) == 3


def test_the_last_steps_before_the_engine_idles_are_handed_over_without_another_step():
    pool, log, handled = SlotPool(8), [], []
    writer = InlineWriter(pool, lambda slot: handled.append(slot.payload), log.append, idle_s=0.02, idle="timer")
    slot = _step(pool, writer, log, 0)
    slot.event.fired = True  # the device finished; no step follows
    deadline = time.monotonic() + 5
    while not handled and time.monotonic() < deadline:
        time.sleep(0.01)
    assert handled == [0]
    writer.close()


def test_the_idle_thread_keeps_off_the_device_while_graphs_are_captured():
    pool, log, handled = SlotPool(8), [], []
    capturing = [True]
    writer = InlineWriter(
        pool,
        lambda slot: handled.append(slot.payload),
        log.append,
        idle_s=0.01,
        idle="timer",
        busy=lambda: capturing[0],
    )
    _step(pool, writer, log, 0)
    time.sleep(0.2)
    assert handled == [] and log == []  # no wait, no hand-over
    capturing[0] = False
    writer.close()
    assert handled == [0]


class _LookCounter:
    """``tracer.handover``'s ``time``, counting the idle thread's wakes (each asks the clock once)."""

    def __init__(self):
        self.looks = 0

    def monotonic(self) -> float:
        if threading.current_thread().name == "pagedtrace-idle":
            self.looks += 1
        return time.monotonic()


def _steady_steps(pool, writer, log, seconds: float) -> int:
    """Steps every 5 ms for ``seconds``, each one's event fired; how many."""
    start, i = time.monotonic(), 0
    while time.monotonic() - start < seconds:
        _step(pool, writer, log, i).event.fired = True
        i += 1
        time.sleep(0.005)
    return i


def test_with_the_timer_the_idle_thread_never_wakes_while_steps_run_and_hands_over_once_they_stop(monkeypatch):
    # Each wake takes the GIL from the engine's thread (on the CPU stand-in ~1 block a wake): each
    # step pushes the timer ahead, so it fires only after the last one.
    import tracer.handover as handover

    clock = _LookCounter()
    monkeypatch.setattr(handover, "time", clock)
    pool, log, handled = SlotPool(64), [], []
    writer = InlineWriter(
        pool, lambda slot: handled.append(slot.payload), log.append, idle_s=0.2, idle="timer", every=8
    )
    assert writer.idle == "timer" and writer._timer is not None
    n = _steady_steps(pool, writer, log, 0.6)
    assert clock.looks == 0 and writer.looks == 0
    deadline = time.monotonic() + 5
    while len(handled) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert handled == list(range(n)) and 1 <= writer.looks <= 3 and writer.idle_hand_overs >= 1
    writer.close()
    assert writer._timer is None  # its file descriptor closed


def test_looking_the_idle_thread_wakes_once_a_look_period_while_steps_run(monkeypatch):
    import tracer.handover as handover

    clock = _LookCounter()
    monkeypatch.setattr(handover, "time", clock)
    pool, log, handled = SlotPool(64), [], []
    writer = InlineWriter(
        pool, lambda slot: handled.append(slot.payload), log.append, idle_s=0.25, idle="look", look_s=0.3, every=1
    )
    n = _steady_steps(pool, writer, log, 0.9)
    writer.close()
    assert 2 <= writer.looks <= 4 and writer.looks == clock.looks  # counted, for the tracer's stats
    assert writer.idle_hand_overs == 0  # steps kept coming: no look found the engine idle
    assert handled == list(range(n))


@pytest.mark.parametrize("idle", ["timer", "look"])
def test_the_last_steps_reach_the_record_process_within_the_idle_time(idle):
    pool, log, handled = SlotPool(8), [], []
    writer = InlineWriter(
        pool, lambda slot: handled.append(slot.payload), log.append, idle_s=0.05, idle=idle, look_s=0.05
    )
    time.sleep(0.1)
    start = time.monotonic()
    _step(pool, writer, log, 0).event.fired = True
    while not handled and time.monotonic() - start < 5:
        time.sleep(0.005)
    took = time.monotonic() - start
    writer.close()
    assert handled == [0] and took < 0.05 + 0.05 + 0.2
    assert writer.idle_hand_overs >= 1


def test_idle_off_starts_no_idle_thread_and_stop_still_hands_over():
    pool, log, handled = SlotPool(8), [], []
    writer = InlineWriter(pool, lambda slot: handled.append(slot.payload), log.append, idle="off")
    assert writer._idle is None and writer._timer is None and writer.idle == "off"
    _step(pool, writer, log, 0).event.fired = True
    time.sleep(0.2)
    assert handled == []
    writer.close()
    assert handled == [0]


def test_the_idle_timer_fires_once_after_its_last_arming():
    from tracer.idle_timer import IdleTimer

    timer = IdleTimer()
    timer.arm(0.03)
    start = time.monotonic()
    assert timer.wait(2.0) and 0.02 < time.monotonic() - start < 1.0
    assert not timer.wait(0.05)  # one-shot: read once, then quiet
    timer.arm(0.15)
    time.sleep(0.08)
    timer.arm(0.15)  # pushed ahead: not at 0.15 s from the first arming
    assert not timer.wait(0.1)
    assert timer.wait(2.0)
    timer.close()


def test_the_tracer_hands_over_when_the_engine_idles_and_refuses_an_unknown_idle_mode(tmp_path):
    from tracer.install import Tracer
    from tracer.options import TracerOptions

    assert Tracer(TracerOptions(str(tmp_path / "t")))._idle_mode == "engine"
    with pytest.raises(ValueError, match=r"^idle 'sometimes': expected one of \('engine', 'timer', 'look', 'off'\)$"):
        Tracer(TracerOptions(str(tmp_path / "t")), idle="sometimes")


def test_stop_reports_the_idle_threads_wakes_in_the_tracers_stats(tmp_path, monkeypatch):
    from tracer import install

    t = _engine(tmp_path, monkeypatch, "inline", idle="timer")
    assert t._handover.idle == "timer"
    _steps(t, 2)
    time.sleep(0.4)  # the engine idle: the timer fires and the two steps are handed over
    monkeypatch.setattr(install, "_ACTIVE", t)  # as start() leaves it
    t.stop()
    assert t.stats["idle_looks"] >= 1 and t.stats["idle_hand_overs"] >= 1 and t.stats["records"] == 2
    assert t.stats["idle"] == "timer"


def test_the_tracer_gives_its_inline_writer_the_idle_setting(tmp_path, monkeypatch):
    t = _engine(tmp_path, monkeypatch, "inline", idle="off")
    assert isinstance(t._handover, InlineWriter) and t._handover._idle is None
    _steps(t, 2)
    t._handover.close()
    t._record_writer.finish()
    assert len(Trace.open(tmp_path / "trace").records) == 2


def test_a_step_that_finds_the_idle_thread_handing_over_leaves_its_slot_queued():
    pool, log, handled = SlotPool(8), [], []
    writer = InlineWriter(pool, lambda slot: handled.append(slot.payload), log.append, idle_s=0, every=1)
    with writer._lock:  # as while the idle thread hands over
        slot = _step(pool, writer, log, 0)
        slot.event.fired = True
    assert handled == [] and log == []  # not even asked: the lock was taken
    _step(pool, writer, log, 1)
    assert handled == [0]
    writer.close()
    assert handled == [0, 1]


@pytest.fixture(scope="module")
def inline_trace(tmp_path_factory):
    """The shared session, metadata only, handed over inline through a two-slot ring and a slow writer."""
    out = tmp_path_factory.mktemp("engine-inline") / "trace"
    env = engine_env(PAGEDTRACE_RING_SLOTS="2", PAGEDTRACE_WRITER_THROTTLE_S="0.02")
    run_engine(["-m", "pagedtrace", "run", "-o", str(out), *RUN_ARGS, "--no-tensors"], env=env)
    return out


@pytest.mark.engine
def test_a_real_engine_traced_inline_records_what_the_writer_thread_records(inline_trace, cpu_trace):
    inline, full = Trace.open(inline_trace), Trace.open(cpu_trace)
    got = {r.step: r for r in inline.steps(kind="request")}
    want = {r.step: r for r in full.steps(kind="request")}
    assert sorted(got) == sorted(want) and got
    for step, r in got.items():
        w = want[step]
        assert (r.block_table, r.slot_mapping, r.seq_lens, r.query_start_loc) == (
            w.block_table,
            w.slot_mapping,
            w.seq_lens,
            w.query_start_loc,
        )
        # vLLM numbers requests per run and adds a random suffix: the numbers must agree
        assert [i.split("-")[0] for i in r.request_ids] == [i.split("-")[0] for i in w.request_ids]
    assert inline.run.extra["finished"] is True and not inline.problems


#: The fake engine in a multiprocessing child, as vLLM's engine core runs under ``vllm serve``: it
#: ends through ``os._exit`` without ``stop()`` (no atexit handler runs there), its last steps
#: still queued on the engine's side (an idle hand-over that never comes).
ENGINE_CORE = """
import multiprocessing, sys
sys.path.insert(0, sys.argv[2])


def engine_core(directory):
    from pathlib import Path

    from tests import test_record_process as w
    from tests.test_install import _fake_step_engine

    t, runner, sched, md = _fake_step_engine(Path(directory))
    t._handover.close()
    t.start()  # in this process, as the plugin starts it
    t._handover._idle_s = 3600.0
    t._record_writer.start()  # as the runner's first call starts the record process
    t._test_engine = (t, runner, sched, md)
    w._steps(t, 3)
    assert len(t._handover._pending) == 3  # three steps, not yet handed over
    print(t._record_writer.records_out.pid, flush=True)


if __name__ == "__main__":
    child = multiprocessing.get_context("fork").Process(target=engine_core, args=(sys.argv[1],))
    child.start()
    child.join()
    print("exit", child.exitcode, flush=True)
"""


def test_an_engine_core_process_that_ends_without_stop_hands_its_held_steps_over(tmp_path):
    import subprocess
    import sys

    from tests.test_record_process import ROOT, _wait_ended

    script = tmp_path / "engine_core.py"
    script.write_text(ENGINE_CORE)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=180,
        env=engine_env(),
    )
    lines = proc.stdout.split()
    assert proc.returncode == 0 and lines[-2:] == ["exit", "0"], proc.stdout[-2000:] + proc.stderr[-3000:]
    _wait_ended(int(lines[-3]))  # the record process writes what it got, then ends
    trace = Trace.open(tmp_path / "trace", strict=False)
    assert trace.problems == [] and [r.step for r in trace.records] == [0, 1, 2]
    assert trace.run.extra["finished"] is True  # stop() ran: the multiprocessing finalizer


def test_deferred_steps_are_sealed_every_few_steps_with_one_move_and_one_event(monkeypatch):
    """Deferred slots (their copies packed into the device mirror) are not handed over before a seal:
    once ``every`` are queued, one move to the host and one event on the newest, which covers the
    others; a later step hands them over once that event has fired, in one message."""
    import tracer.handover as handover

    pool, log, handled, moves, recorded = SlotPool(16), [], [], [], []

    def record(slot, on_cuda, *, blocking=True, stream=None):
        slot.event, slot.recorded = _Event(log, slot.payload), True
        recorded.append((slot.payload, stream))

    monkeypatch.setattr(handover, "record_event", record)
    writer = _every_three(pool, log, handled, move=lambda: moves.append(len(moves)) or "stream", on_cuda=True)

    def deferred(i: int) -> Slot:
        slot = pool.acquire()
        slot.payload, slot.queued, slot.deferred = i, True, True
        writer.submit(slot)
        return slot

    slots = [deferred(i) for i in range(3)]
    assert moves == [0] and recorded == [(2, "stream")]  # one move and one event for the three
    assert [s.cover for s in slots] == [slots[2], slots[2], None] and not any(s.deferred for s in slots)
    assert handled == [] and log == [("query", 2)]  # its copies still run
    slots[2].event.fired = True
    deferred(3)
    assert handled == [0, 1, 2, "end"] and log[-1] == ("query", 2)  # asked once for the three
    assert moves == [0] and len(recorded) == 1  # step 3 waits for the next seal
    deferred(4)
    deferred(5)
    assert moves == [0, 1] and recorded[-1] == (5, "stream") and handled[-1] == "end"
    deferred(6)  # 3-5's event has not fired; 6 is not sealed
    writer.drain()  # seals 6 and waits for both events
    assert handled == [0, 1, 2, "end", 3, 4, 5, 6, "end"] and moves == [0, 1, 2]
    assert ("wait", 5) in log and ("wait", 6) in log
    assert len(pool._free) == 16


def _host_memory(monkeypatch, host: str) -> None:
    """``shared``: the record process's shared memory is made; ``pipe``: it cannot be made, and every
    copy's bytes go in the messages."""
    from tests.test_shared_host import _no_memfd
    from tracer import record_process

    if host == "pipe":
        monkeypatch.setattr(record_process, "SharedHost", _no_memfd)


def _deferred_run(tmp_path, monkeypatch, host: str, steps: int, *, decide_idle_at: int | None = None, **tracer_kwargs):
    """``steps`` steps of the fake engine through the inline writer, copies deferred through a host
    'mirror' (``host_copies.DEFER_ON_CPU``), in inference mode as vLLM's steps run; the tracer's first
    request step decision (``Tracer._decide_idle``, no vLLM loop here: the timer takes over) made
    inside step ``decide_idle_at``, between its copy and its hand-over, as ``_end_step`` makes it.
    Returns the records' lines, the shared memory (None: pipe) and the tracer."""
    import torch

    from tests.test_install import _fake_step_engine
    from tests.test_shared_host import _new_values
    from tracer import host_copies

    monkeypatch.setattr(host_copies, "DEFER_ON_CPU", True)
    _host_memory(monkeypatch, host)
    t, runner, sched, md = _fake_step_engine(tmp_path / host, **tracer_kwargs)
    t._record_writer.start()
    memory = t._record_writer.shared_host()
    with torch.inference_mode():
        for i in range(steps):
            _new_values(i, md)
            t._phase, t._depth = ["request"], 1
            t._begin_step()
            t._v2_req_ids = ("a", "b", "c")
            t._dispatch = ("full", 4)
            t._end_request_step(runner, (sched,), {})
            if i == decide_idle_at:
                t._decide_idle()
            t._submit_slot()
    t._handover.close()
    t._record_writer.finish()
    assert t.error is None
    return (tmp_path / host / "trace" / "steps.jsonl").read_text().splitlines(), memory, t


def test_deferred_steps_through_a_small_ring_and_few_slots_are_the_pipes(tmp_path, monkeypatch):
    """Room for 5 steps' copies and 3 ring slots: steps find the ring full (the child is behind)
    and take the slot's own buffer, or find no free slot and hand the queued ones over first
    (``make_room``, which seals them); the ring wraps, moving what lies at its end first. Deferred
    and undeferred slots queue side by side. Every step's values reach the records."""
    from tracer import shared_host

    monkeypatch.setattr(shared_host, "RING_BYTES", 5 * 192 + 64)
    shared, memory, t = _deferred_run(tmp_path, monkeypatch, "shared", 60, idle="off", ring_slots=3)
    pipe, _, _ = _deferred_run(tmp_path, monkeypatch, "pipe", 60, idle="off", ring_slots=3)
    assert len(shared) == 60 and shared == pipe
    assert t._pool.waits > 0 and memory.flushes > 0 and memory.taken + memory.declined == 60
    assert memory.taken >= 5 and t._handover.seals > 0


def test_a_writer_that_falls_back_to_its_timer_seals_what_it_holds_and_defers_no_more(tmp_path, monkeypatch):
    """No vLLM loop in the process: at the first request step's decision the steps deferred so far
    are moved (one seal), the step in hand records its own event, and later steps copy as before."""
    shared, memory, t = _deferred_run(tmp_path, monkeypatch, "shared", 20, decide_idle_at=5)
    pipe, _, _ = _deferred_run(tmp_path, monkeypatch, "pipe", 20, decide_idle_at=5)
    assert len(shared) == 20 and shared == pipe
    assert not t._defer and t._handover.idle == "timer"
    # one move: steps 0-4 sealed, and step 5's copy (in the mirror already) with them; step 5 then
    # records its own event, after that move
    assert t._handover.seals == 1 and memory.flushes == 1
    assert memory.taken == 20


def test_a_move_that_fails_is_reported_once_and_its_steps_are_freed_unread():
    """The seal's move to the host raises (as an inference tensor written
    outside inference mode): ``on_error`` once, nothing raises from the steps or from close, no slot
    is handed over as done, and every slot is free again."""
    pool, handled, errors = SlotPool(8), [], []

    def move():
        raise RuntimeError("cannot move")

    writer = InlineWriter(pool, lambda slot: handled.append(slot.payload), errors.append, idle_s=0, every=2)
    writer._move = move
    for i in range(5):
        slot = pool.acquire()
        slot.payload, slot.queued, slot.deferred = i, True, True
        writer.submit(slot)
    writer.close()
    assert handled == [] and [str(e) for e in errors] == ["cannot move"] and len(pool._free) == 8


@pytest.mark.parametrize("defer", ["on", "off"])
def test_deferred_copies_write_every_step_as_the_pipe_does(tmp_path, monkeypatch, defer):
    """A CPU stand-in whose copies go through a host 'mirror' (``host_copies.DEFER_ON_CPU``): every step's
    values reach the record process, moved every few steps in one copy; with ``defer=False``
    each step's copy goes straight in. The records are the pipe's, step for step. The steps run in
    inference mode, as vLLM's do, and the last move (at close) outside it, as the engine's idle call's."""
    import torch

    from tests.test_install import _fake_step_engine
    from tests.test_shared_host import _new_values
    from tracer import host_copies

    monkeypatch.setattr(host_copies, "DEFER_ON_CPU", True)
    lines, flushes = {}, {}
    for host in ("shared", "pipe"):
        _host_memory(monkeypatch, host)
        t, runner, sched, md = _fake_step_engine(tmp_path / host, idle="off", defer=defer == "on")
        t._test_engine = (t, runner, sched, md)
        t._record_writer.start()
        memory = t._record_writer.shared_host()
        with torch.inference_mode():  # as vLLM runs its steps; the hand-overs at close run outside it
            _steps(t, 43, before=_new_values)  # the last 3 are moved at close
        t._handover.close()
        if memory is not None:
            flushes[host] = (memory.flushes, memory.taken, t._handover.seals)
        t._record_writer.finish()
        assert t.error is None
        lines[host] = (tmp_path / host / "trace" / "steps.jsonl").read_text().splitlines()
    assert len(lines["shared"]) == 43 and lines["shared"] == lines["pipe"]
    moved, taken, seals = flushes["shared"]
    assert taken == 43
    if defer == "on":
        assert moved == 6 and seals == moved  # every 8 steps, and the last ones at close
    else:
        assert moved == 0 and seals == 0
