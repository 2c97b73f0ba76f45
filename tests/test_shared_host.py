"""Host memory shared with the record writer process (``tracer.shared_host``): regions, reuse, fallback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tracer import shared_host
from tracer.shared_host import HEADER_BYTES, SharedHost, finished_counter


def test_a_region_is_taken_again_only_after_the_child_has_finished_the_message_that_named_it():
    host = SharedHost(regions=3, region_bytes=64)
    offsets = []
    for _ in range(3):
        offset, view = host.take(4, pin=False)
        assert view.numel() == 4 and view.dtype == torch.int32
        offsets.append(offset)
    assert offsets == [HEADER_BYTES, HEADER_BYTES + 64, HEADER_BYTES + 128]
    assert host.take(4, pin=False) is None  # every region in flight, none sent yet
    for message, offset in enumerate(offsets, start=1):
        host.sent(offset, message)
    assert host.take(4, pin=False) is None  # sent in messages 1-3, none finished by the child
    counter = finished_counter(host._map)
    counter.value = 2
    assert host.take(4, pin=False)[0] == offsets[1]  # 1 and 2 are free: the one freed last first
    assert host.take(4, pin=False)[0] == offsets[0]
    assert host.take(4, pin=False) is None  # region 2: message 3 is not finished
    counter.value = 3
    assert host.take(17, pin=False) is None  # 68 bytes do not fit a 64-byte region, whatever its state
    assert host.take(4, pin=False)[0] == offsets[2]
    assert (host.taken, host.declined) == (6, 4)
    host.close()
    assert host.take(4, pin=False) is None  # closed: nothing is taken


def test_the_child_reads_what_a_copy_put_in_a_region():
    host = SharedHost(regions=2, region_bytes=64)
    offset, view = host.take(3, pin=False)
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


@pytest.mark.parametrize("mode", ["inline", "process"])
def test_steps_through_two_regions_write_every_step_as_the_pipe_does(tmp_path, monkeypatch, mode):
    """Two regions for 40 steps: most steps find none free (the pipe holds messages back, the child
    is behind) and send their bytes; those that take one are not overwritten before the child reads
    them. The records are the pipe's, step for step."""
    from tests.test_hooks import _fake_step_engine
    from tests.test_writer_process import _steps

    monkeypatch.setenv("PAGEDTRACE_WRITER", mode)
    monkeypatch.setattr(shared_host, "REGIONS", 2)
    lines, used = {}, {}
    for host in ("shared", "pipe"):
        monkeypatch.setenv("PAGEDTRACE_HOST", host)
        t, runner, sched, md = _fake_step_engine(tmp_path / host)
        t._test_engine = (t, runner, sched, md)
        t._sink.start()
        memory = t._sink.shared_host()
        assert (memory is not None) == (host == "shared")
        _steps(t, 40, before=_new_values)
        t._thread.close()
        t._sink.finish()
        assert t.error is None
        used[host] = (memory.taken, memory.declined) if memory is not None else None
        lines[host] = (tmp_path / host / "trace" / "steps.jsonl").read_text().splitlines()
    assert len(lines["shared"]) == 40 and lines["shared"] == lines["pipe"]
    taken, declined = used["shared"]
    assert taken >= 2 and declined >= 1 and taken + declined == 40, used
    seq_lens = [json.loads(line)["seq_lens"] for line in lines["shared"]]
    assert seq_lens == [[1 + i % 16, 16 - i % 16, 1 + (3 * i) % 16] for i in range(40)]


def test_a_bad_host_setting_is_a_one_line_error(tmp_path, monkeypatch):
    from tracer.writer_process import shared_memory

    monkeypatch.setenv("PAGEDTRACE_HOST", "disk")
    with pytest.raises(ValueError, match="PAGEDTRACE_HOST='disk': expected 'shared' or 'pipe'"):
        shared_memory()


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
    host = SharedHost(regions=2, region_bytes=64)
    assert host.take(4, pin=True) is None
    assert calls == [("register", host.size), "cleared"] and host.disabled
    assert host.take(4, pin=True) is None and host.take(4, pin=False) is None  # tried once only
    assert calls == [("register", host.size), "cleared"]
    host.close()


def test_the_tracer_says_how_its_steps_copies_went(tmp_path, monkeypatch):
    """The sink's stats (``Tracer.stats`` after ``stop``): copies into shared memory and down the pipe
    (two regions for 40 steps: both kinds)."""
    from tests.test_hooks import _fake_step_engine
    from tests.test_writer_process import _steps

    monkeypatch.setenv("PAGEDTRACE_WRITER", "inline")
    monkeypatch.setattr(shared_host, "REGIONS", 2)
    t, runner, sched, md = _fake_step_engine(tmp_path)
    t._test_engine = (t, runner, sched, md)
    t._sink.start()
    _steps(t, 40)
    t._thread.close()  # what stop() does (this tracer was not started: no hooks to remove)
    t._sink.finish()
    stats = t._sink.stats
    assert stats["shared_copies"] + stats["pipe_copies"] == 40 and stats["shared_copies"] >= 2
