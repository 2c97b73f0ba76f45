"""Host memory shared with the record writer process (``tracer.shared_host``): the ring, deferred copies, fallback."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from tracer import record_process, shared_host
from tracer.shared_host import HEADER_BYTES, SharedHost, finished_counter


def test_a_stretch_is_taken_again_only_after_the_child_has_finished_the_message_that_named_it():
    """First in, first out: consecutive copies lie side by side (64-byte aligned), the ring wraps to
    its start once the oldest stretch there is free, and never overwrites one the child has not read."""
    host = SharedHost(ring_bytes=256, max_take=128)
    offsets = []
    for _ in range(3):
        offset, view, mirror = host.take(4, pin=False)
        assert view.numel() == 4 and view.dtype == torch.int32 and mirror is None
        offsets.append(offset)
    assert offsets == [HEADER_BYTES, HEADER_BYTES + 64, HEADER_BYTES + 128]
    assert host.take(5, pin=False)[0] == HEADER_BYTES + 192  # 20 bytes take 64: the ring's last
    assert host.take(4, pin=False) is None  # the ring is full, nothing sent yet
    for message, offset in enumerate([*offsets, HEADER_BYTES + 192], start=1):
        host.sent(offset, message)
    assert host.take(4, pin=False) is None  # sent in messages 1-4, none finished by the child
    counter = finished_counter(host._map)
    counter.value = 1
    assert host.take(4, pin=False) is None  # only the first 64 bytes are free: a stretch never fills the gap up
    counter.value = 2
    assert host.take(4, pin=False)[0] == HEADER_BYTES  # wrapped: the ring's start is free again
    assert host.take(4, pin=False) is None  # the next 64 bytes: message 3 is not finished
    counter.value = 3
    assert host.take(33, pin=False) is None  # 132 bytes are more than a copy may take, whatever the ring's state
    assert host.take(4, pin=False)[0] == HEADER_BYTES + 64
    assert (host.taken, host.declined) == (6, 5)
    host.close()
    assert host.take(4, pin=False) is None  # closed: nothing is taken


def test_a_forgotten_stretch_does_not_hold_the_ring_up():
    """A dropped step's stretch (never sent) is freed in its turn, as a finished one is."""
    host = SharedHost(ring_bytes=256, max_take=128)
    first = host.take(32, pin=False)[0]  # bytes 0-128
    second, third = host.take(4, pin=False)[0], host.take(4, pin=False)[0]  # 128-192, 192-256
    host.sent(second, 1)
    host.sent(third, 2)
    assert host.take(4, pin=False) is None  # the first, never sent, holds the ring's start
    host.forget(first)
    assert host.take(4, pin=False)[0] == HEADER_BYTES  # wrapped into what it held
    host.close()


def test_deferred_copies_reach_the_host_only_when_flushed_in_one_copy():
    """``device``: the copy is packed into the mirror; the host holds it after ``flush``, one copy for
    the stretches side by side. A wrap moves what lies at the ring's end first."""
    host = SharedHost(ring_bytes=256, max_take=128)
    device = torch.device("cpu")  # the mirror's device (CUDA in the engine; here host memory)
    taken = []
    for i in range(3):
        offset, view, mirror = host.take(3, pin=False, device=device)
        torch.cat([torch.tensor([i, i + 1], dtype=torch.int32), torch.tensor([-i], dtype=torch.int32)], out=mirror)
        taken.append((offset, view))
    assert all(view.tolist() == [0, 0, 0] for _, view in taken) and host.unflushed
    assert host.flush() and not host.unflushed and not host.flush()
    assert [view.tolist() for _, view in taken] == [[i, i + 1, -i] for i in range(3)]
    assert host.flushes == 1
    for message, (offset, _) in enumerate(taken, start=1):
        host.sent(offset, message)
    host.take(3, pin=False, device=device)[2].fill_(7)  # the last 64 bytes: dirty again
    finished_counter(host._map).value = 3
    offset, view, mirror = host.take(3, pin=False, device=device)  # wraps: the end is flushed first
    assert offset == HEADER_BYTES and host.flushes == 2
    assert host._view("h", 192, 3).tolist() == [7, 7, 7]
    mirror.fill_(9)
    assert view.tolist() != [9, 9, 9] and host.flush() and view.tolist() == [9, 9, 9]
    host.close()


def test_the_child_reads_what_a_copy_put_in_a_region():
    host = SharedHost(ring_bytes=128, max_take=64)
    offset, view, _ = host.take(3, pin=False)
    view.copy_(torch.tensor([7, -8, 2**31 - 1], dtype=torch.int32))
    code = (
        "import mmap, struct, sys; m = mmap.mmap(int(sys.argv[1]), int(sys.argv[2])); "
        "print(list(struct.unpack_from('<3i', m, int(sys.argv[3]))))"
    )
    argv = [sys.executable, "-c", code, str(host.fd), str(host.size), str(offset)]
    out = subprocess.run(argv, pass_fds=(host.fd,), capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == [7, -8, 2**31 - 1]
    host.close()


def _new_values(i: int, md) -> None:
    """The runner's buffers, written in place before step ``i``: other values every step."""
    md.seq_lens[:3] = torch.tensor([1 + i % 16, 16 - i % 16, 1 + (3 * i) % 16], dtype=torch.int32)
    md.max_seq_len = int(md.seq_lens.max())
    md.slot_mapping[:3] = torch.tensor([i, 1000 + i, 2000 + i])


def _no_memfd(*args, **kwargs):
    raise OSError("no memfd_create on this platform")


def test_steps_through_two_regions_write_every_step_as_the_pipe_does(tmp_path, monkeypatch):
    """Room for two steps' copies for 40 steps: most steps find none (the pipe holds messages back,
    the child is behind) and send their bytes; those that take a stretch are not overwritten before
    the child reads them. The records are those of a run whose shared memory cannot be made (every
    copy's bytes down the pipe), step for step."""
    from tests.test_install import _fake_step_engine
    from tests.test_record_process import _steps

    monkeypatch.setattr(shared_host, "RING_BYTES", 448)  # two steps' copies (192 bytes each)
    lines, used = {}, {}
    for host in ("shared", "pipe"):
        if host == "pipe":
            monkeypatch.setattr(record_process, "SharedHost", _no_memfd)
        t, runner, sched, md = _fake_step_engine(tmp_path / host)
        t._test_engine = (t, runner, sched, md)
        t._record_writer.start()
        memory = t._record_writer.shared_host()
        assert (memory is not None) == (host == "shared")
        _steps(t, 40, before=_new_values)
        t._handover.close()
        t._record_writer.finish()
        assert t.error is None
        used[host] = (memory.taken, memory.declined) if memory is not None else None
        lines[host] = (tmp_path / host / "trace" / "steps.jsonl").read_text().splitlines()
    assert len(lines["shared"]) == 40 and lines["shared"] == lines["pipe"]
    taken, declined = used["shared"]
    assert taken >= 2 and declined >= 1 and taken + declined == 40, used
    seq_lens = [json.loads(line)["seq_lens"] for line in lines["shared"]]
    assert seq_lens == [[1 + i % 16, 16 - i % 16, 1 + (3 * i) % 16] for i in range(40)]


def test_memory_that_cannot_be_page_locked_is_not_used_and_the_failure_is_cleared(monkeypatch):
    """``cudaHostRegister`` failing: no region is taken again (the slots' pinned buffers serve), and the
    runtime's last error is reset, since torch would read it after the engine's next kernel launch."""
    calls = []

    class Runtime:
        def cudaHostRegister(self, ptr, size, flags):  # the CUDA runtime's name
            calls.append(("register", size))
            return 2  # cudaErrorMemoryAllocation

    monkeypatch.setattr(torch.cuda, "cudart", Runtime)
    monkeypatch.setattr(shared_host, "_clear_last_cuda_error", lambda torch: calls.append("cleared"))
    host = SharedHost(ring_bytes=128, max_take=64)
    assert host.take(4, pin=True) is None
    assert calls == [("register", host.size), "cleared"] and host.disabled
    assert host.take(4, pin=True) is None and host.take(4, pin=False) is None  # tried once only
    assert calls == [("register", host.size), "cleared"]
    host.close()


def test_the_tracer_says_how_its_steps_copies_went(tmp_path, monkeypatch):
    """The sink's stats (``Tracer.stats`` after ``stop``): copies into shared memory and down the pipe
    (room for two steps' copies for 40 steps: both kinds)."""
    from tests.test_install import _fake_step_engine
    from tests.test_record_process import _steps

    monkeypatch.setattr(shared_host, "RING_BYTES", 448)  # two steps' copies (192 bytes each)
    t, runner, sched, md = _fake_step_engine(tmp_path)
    t._test_engine = (t, runner, sched, md)
    t._record_writer.start()
    _steps(t, 40)
    t._handover.close()  # what stop() does (this tracer was not started: no hooks to remove)
    t._record_writer.finish()
    stats = t._record_writer.stats
    assert stats["shared_copies"] + stats["pipe_copies"] == 40 and stats["shared_copies"] >= 2
