"""``PAGEDTRACE_EVENT_ON=writer``: the writer thread, not the engine's, records each step's event.

The engine's thread leaves the stream its copies were queued on in the slot; the writer records
the event there before it waits for it, and before it reads the slot. CUDA's part (the stream,
the event) is stood in for here: a CPU machine has neither; the H200 probe runs the real one
(``scripts/h200_overhead_probe.py --variants metadata-writerevent``).
"""

from __future__ import annotations

import threading

import pytest
import torch

import tracer.hooks
from tracer.hooks import Tracer, TracerOptions
from tracer.ring import Slot, SlotPool, WriterThread, events_on_writer


class _Log:
    def __init__(self):
        self.calls: list[tuple] = []
        self.lock = threading.Lock()

    def add(self, *call):
        with self.lock:
            self.calls.append(call)


@pytest.fixture
def fake_cuda(monkeypatch):
    log = _Log()

    class Stream:
        def __init__(self, ptr, device=None):
            self.ptr, self.device = ptr, device
            log.add("stream", ptr, device)

    class Event:
        def __init__(self, blocking=False):
            self.blocking = blocking

        def record(self, stream=None):
            log.add("record", stream.ptr, self.blocking)

        def synchronize(self):
            log.add("synchronize")

    monkeypatch.setattr(torch.cuda, "ExternalStream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    return log


def test_the_setting_is_read_and_a_bad_one_is_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("PAGEDTRACE_EVENT_ON", raising=False)
    assert events_on_writer() is False
    monkeypatch.setenv("PAGEDTRACE_EVENT_ON", " Writer ")
    assert events_on_writer() is True
    monkeypatch.setenv("PAGEDTRACE_EVENT_ON", "gpu")
    with pytest.raises(ValueError, match=r"^PAGEDTRACE_EVENT_ON='gpu': expected 'engine' or 'writer'$"):
        Tracer(TracerOptions(str(tmp_path / "t")))


def test_the_writer_records_on_the_left_stream_before_it_waits_and_reads(fake_cuda):
    pool = SlotPool(4)

    def handle(slot: Slot) -> None:
        fake_cuda.add("handle", slot.index)

    writer = WriterThread(pool, handle, lambda exc: fake_cuda.add("error", repr(exc)), blocking=False)
    for stream in (0xA0, 0xA0, 0xB0):
        slot = pool.acquire()
        slot.payload = {}
        slot.stream, slot.device = stream, 3
        writer.submit(slot)
    gaps_only = pool.acquire()  # a slot of gaps alone: nothing recorded, nothing waited for
    gaps_only.payload = {}
    writer.submit(gaps_only)
    writer.close()
    calls = fake_cuda.calls
    assert ("error",) not in {c[:1] for c in calls}
    # one stream object per (stream, device), made once
    assert [c for c in calls if c[0] == "stream"] == [("stream", 0xA0, 3), ("stream", 0xB0, 3)]
    steps = [c for c in calls if c[0] != "stream"]
    handled = [c[1] for c in steps if c[0] == "handle"]
    assert len(handled) == 4
    expected = []
    for stream, index in zip((0xA0, 0xA0, 0xB0), handled[:3], strict=True):
        expected += [("record", stream, False), ("synchronize",), ("handle", index)]
    assert steps == [*expected, ("handle", handled[3])]
    # released slots forget their stream: a later use records nothing unless the step leaves one
    assert all(s.stream == 0 for s in pool._free)


def test_the_engine_thread_leaves_the_event_and_records_none(tmp_path, monkeypatch, fake_cuda):
    monkeypatch.setenv("PAGEDTRACE_EVENT_ON", "writer")
    monkeypatch.setenv("PAGEDTRACE_WRITER", "process")  # the event is left to a writer thread: inline has none
    t = Tracer(TracerOptions(str(tmp_path / "t")))
    recorded = []
    monkeypatch.setattr(tracer.hooks, "record_event", lambda *a, **k: recorded.append(a))
    monkeypatch.setattr(tracer.hooks, "cuda_available", lambda: True)
    monkeypatch.setattr(tracer.hooks, "capturing", lambda: False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0x5000 + device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    submitted = []
    t._thread = type("Writer", (), {"submit": lambda self, slot: submitted.append((slot.stream, slot.device))})()
    slot = t._step_slot()
    slot.queued = True
    t._submit_slot()
    assert recorded == [] and submitted == [(0x5002, 2)]
    gaps = t._step_slot()  # nothing queued: nothing to record, by either thread
    assert gaps.stream == 0
    t._submit_slot()
    assert submitted[-1] == (0, 0)
