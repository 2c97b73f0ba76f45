"""The record writer process (``tracer.record_process``): a trace without tensors, written off the engine's GIL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_install import _fake_step_engine
from tracer.format import Trace
from tracer.handover import InlineWriter, WriterThread
from tracer.install import Tracer
from tracer.options import TracerOptions
from tracer.record_process import RecordProcess

ROOT = Path(__file__).resolve().parent.parent


def _steps(t, n: int, *, gap_at: int | None = None, before=None) -> None:
    """``n`` request steps of the fake engine (a padded full-graph replay each), a gap before step ``gap_at``.

    ``before(i, md)``: called before step ``i`` (a test that changes the runner's buffers in place).
    """
    _, runner, sched, md = t._test_engine
    for i in range(n):
        if before is not None:
            before(i, md)
        t._phase, t._depth = ["request"], 1
        t._begin_step()
        if i == gap_at:
            t._record_gap("request", "no-metadata: a gap between the steps", 0)
        t._v2_req_ids = ("a", "b", "c")
        t._dispatch = ("full", 4)
        t._end_request_step(runner, (sched,), {})
        t._submit_slot()


def _engine(tmp_path, monkeypatch, writer: str = "inline", **tracer_kwargs):
    """The fake engine's tracer (a metadata trace, its writer on the engine's thread).

    ``writer``: ``inline``, the records go to the record process; ``here``, the record process
    cannot start (``RecordWriter.start``'s fallback) and this process writes them.
    """
    assert writer in ("inline", "here"), writer
    t, runner, sched, md = _fake_step_engine(tmp_path, **tracer_kwargs)
    t._test_engine = (t, runner, sched, md)
    if writer == "here":

        def cannot_start() -> None:
            raise OSError("no processes today")

        t._record_writer.records_out.start = cannot_start
        t._record_writer.start()
        assert t._record_writer.records_out is None
    return t


@pytest.mark.parametrize("writer", ["inline", "here"])
def test_a_drained_step_is_on_disk(tmp_path, monkeypatch, writer):
    t = _engine(tmp_path, monkeypatch, writer)
    assert isinstance(t._record_writer.records_out, RecordProcess) == (writer == "inline")
    assert isinstance(t._handover, InlineWriter) and t._record_writer.inline
    _steps(t, 2)
    t.drain()
    assert len((tmp_path / "trace" / "steps.jsonl").read_text().splitlines()) == 2
    t._handover.close()
    t._record_writer.finish()
    assert t.error is None


def test_the_process_writes_what_this_process_writes(tmp_path, monkeypatch):
    """The record process's records (built from the messages) are those this process builds when it cannot start."""
    lines = {}
    for writer in ("here", "inline"):
        t = _engine(tmp_path / writer, monkeypatch, writer)
        _steps(t, 4, gap_at=2)
        t._handover.close()
        t._record_writer.finish()
        assert t.error is None and t._record_writer.stats["records"] == 4 and t._record_writer.stats["gaps"] == 1
        lines[writer] = (tmp_path / writer / "trace" / "steps.jsonl").read_text()
        trace = Trace.open(tmp_path / writer / "trace")
        assert len(trace.records) == 4 and len(trace.gaps) == 1 and trace.run.extra["finished"] is True
    assert lines["inline"] == lines["here"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the child's /proc/PID/fdinfo")
def test_the_child_reads_its_pipe_by_looking_and_answers_a_sync_once_it_has_written_everything(tmp_path, monkeypatch):
    t = _engine(tmp_path, monkeypatch)
    _steps(t, 3)
    t.drain()  # a sync: answered once the child has read everything before it
    assert len((tmp_path / "trace" / "steps.jsonl").read_text().splitlines()) == 3
    fdinfo = Path(f"/proc/{t._record_writer.records_out.pid}/fdinfo/0").read_text()
    flags = int(next(line.split()[1] for line in fdinfo.splitlines() if line.startswith("flags:")), 8)
    assert flags & os.O_NONBLOCK  # its stdin is looked at between sleeps (PolledInput), never waited on
    _steps(t, 2, gap_at=0)
    t._handover.close()
    t._record_writer.finish()
    assert t.error is None
    trace = Trace.open(tmp_path / "trace")
    assert [r.step for r in trace.records] == [0, 1, 2, 3, 4] and len(trace.gaps) == 1


def test_polled_input_gives_exact_messages_across_writes_and_none_at_the_end():
    """Bytes that come in pieces, with pauses, are read whole; a message cut by the end of input is None."""
    import threading
    import time

    from tracer.record_process import PolledInput

    read_fd, write_fd = os.pipe()
    reader = PolledInput(read_fd, poll_s=(0.001, 0.004))

    def write() -> None:
        for piece in (b"ab", b"cdef", b"g" * 70000, b"hi"):
            os.write(write_fd, piece)
            time.sleep(0.01)
        os.close(write_fd)

    writer = threading.Thread(target=write)
    writer.start()
    assert reader.read_exact(3) == b"abc"
    assert reader.read_exact(3) == b"def"
    assert reader.read_exact(70000) == b"g" * 70000
    assert reader.read_exact(5) is None  # "hi", then the end: cut short
    writer.join()
    os.close(read_fd)


def test_a_metadata_trace_hands_over_inline_and_a_tensor_trace_keeps_the_thread(tmp_path):
    t = Tracer(TracerOptions(str(tmp_path / "m")))
    assert isinstance(t._record_writer.records_out, RecordProcess) and t._record_writer.inline
    assert isinstance(t._writer_thread(), InlineWriter)
    t = Tracer(TracerOptions(str(tmp_path / "t"), tensors=True))
    assert t._record_writer.records_out is None and not t._record_writer.inline
    writer = t._writer_thread()
    assert isinstance(writer, WriterThread)
    writer.close()


def test_a_writer_process_that_dies_stops_the_trace_in_one_line(tmp_path, monkeypatch):
    t = _engine(tmp_path, monkeypatch)
    _steps(t, 1)
    t.drain()
    pid = t._record_writer.records_out.pid
    os.kill(pid, signal.SIGKILL)
    _wait_ended(pid)
    with pytest.warns(RuntimeWarning, match="record writer process"):
        _steps(t, 3)  # the engine runs on
        t.drain()
    t._handover.close()
    t._record_writer.finish()
    assert t.error is not None and "\n" not in t.error
    assert f"(pid {pid}) ended before its end of input (killed?); tracing stops" in t.error
    trace = Trace.open(tmp_path / "trace", strict=False)
    assert len(trace.records) == 1 and trace.run.extra["finished"] is False


#: The fake engine in a process of its own: 3 steps handed to the writer process, then SIGKILL.
KILLED = """
import os, signal, sys, types
sys.path.insert(0, sys.argv[2])
from tests import test_record_process as w
from tests.test_install import _fake_step_engine
from pathlib import Path
t, runner, sched, md = _fake_step_engine(Path(sys.argv[1]))
t._test_engine = (t, runner, sched, md)
w._steps(t, 3)
t._handover.drain()  # handed over (not necessarily written yet)
print(t._record_writer.records_out.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_an_engine_killed_loses_no_record_it_handed_over(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", KILLED, str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    child = int(proc.stdout.split()[-1])
    _wait_ended(child)  # it writes what it got, then ends
    trace = Trace.open(tmp_path / "trace", strict=False)
    assert trace.problems == [] and [r.step for r in trace.records] == [0, 1, 2]
    assert trace.run.extra["finished"] is False


def _wait_ended(pid: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (reaped by nobody until init does) has ended too
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def test_the_child_reads_the_buffers_as_host_lists_does_without_numpy():
    import msgspec
    import torch

    from tracer.format import TraceError
    from tracer.host_buffers import host_message
    from tracer.host_buffers import message_lists as _lists
    from tracer.layer_capture import host_lists
    from tracer.messages import Views

    host = {
        "query_start_loc": torch.tensor([0, 3, 4], dtype=torch.int32),
        "seq_lens": torch.tensor([7, 2**20], dtype=torch.int32),
        "block_table": torch.tensor([[5, 6, 0], [7, 8, 9]], dtype=torch.int32),
        "slot_mapping": torch.tensor([80, 81, 82, 2**40 + 3], dtype=torch.int64),
    }
    message = host_message(host)
    assert isinstance(message, Views)  # no packed copy: each view goes as its own bytes
    assert _lists(message) == host_lists(dict(host))
    message = msgspec.structs.replace(message, seq_lens=msgspec.structs.replace(message.seq_lens, dtype="<f4"))
    with pytest.raises(TraceError, match="cannot read a host buffer of dtype '<f4'"):
        _lists(message)


def test_the_child_imports_neither_numpy_nor_torch():
    code = (
        "import sys, tracer.record_process, tracer.messages, tracer.layer_capture, tracer.jsonline; "
        "print(sorted({'numpy', 'torch', 'vllm'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]


def test_a_tensor_parallel_rank_known_only_after_start_writes_its_own_directory(tmp_path, monkeypatch):
    import tracer.record_writer

    t = _engine(tmp_path, monkeypatch)
    monkeypatch.setattr(tracer.record_writer, "tp_rank", lambda: 1)  # vLLM's parallel state, once it is up
    _steps(t, 2)
    t._handover.close()
    t._record_writer.finish()
    assert t.error is None
    assert len(Trace.open(tmp_path / "trace" / "rank1").records) == 2
    assert not (tmp_path / "trace" / "steps.jsonl").exists()


def test_only_a_process_that_runs_the_model_starts_the_writer_process(tmp_path, monkeypatch):
    import types

    from tracer import wrappers

    t = Tracer(TracerOptions(str(tmp_path / "t"))).start()
    records_out = t._record_writer.records_out
    try:
        assert records_out._proc is None  # vLLM's front end and engine core stay so: no idle child
        step = wrappers.runner(t, "execute_model")(lambda runner, *args: None)
        step(types.SimpleNamespace(vllm_config=None))  # the runner's first call (the profile run in vLLM)
        import psutil  # vLLM's: how its shutdown finds the worker's descendants

        child = records_out.pid
        assert records_out._proc is not None and child is not None and _alive(child)
        assert child not in {p.pid for p in psutil.Process().children(recursive=True)}  # detached
    finally:
        t.stop()
    _wait_ended(child)
    assert records_out._proc is None and records_out.error is None  # stop() ended it, and it ended well


@pytest.mark.parametrize("calculate", [False, True])
def test_a_layers_fields_sent_once_then_its_scales_give_every_record_what_this_process_gives(
    tmp_path, monkeypatch, calculate
):
    """The record process is sent a layer's unchanging fields once, and again when they change: the
    scales read from the first record on (``calculate_kv_scales`` off), or each step's (on)."""
    import json

    lines = {}
    for writer in ("here", "inline"):
        t = _engine(tmp_path / writer, monkeypatch, writer)
        module = t._test_engine[0]._vllm_config.compilation_config.static_forward_context[
            "model.layers.0.self_attn.attn"
        ]
        module._q_scale_float, module._k_scale_float, module._v_scale_float = 1.0, 0.5, 0.25
        module.calculate_kv_scales = calculate
        _steps(t, 2)
        if calculate:
            module._k_scale_float = 0.75  # vLLM recomputed it: the next records say so
        _steps(t, 2)
        t._handover.close()
        t._record_writer.finish()
        assert t.error is None
        lines[writer] = (tmp_path / writer / "trace" / "steps.jsonl").read_text().splitlines()
    assert lines["inline"] == lines["here"]
    scales = [json.loads(line)["k_scale"] for line in lines["inline"]]
    assert scales == ([0.5, 0.5, 0.75, 0.75] if calculate else [0.5] * 4)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="F_SETPIPE_SZ is Linux's")
def test_the_pipe_to_the_process_holds_a_mebibyte(tmp_path, monkeypatch):
    """A send does not wait for the child to have read the previous message (64 KiB held one or two)."""
    import fcntl

    from tracer.record_process import PIPE_BYTES

    if int(Path("/proc/sys/fs/pipe-max-size").read_text()) < PIPE_BYTES:
        pytest.skip("this kernel lets a pipe hold less")
    t = _engine(tmp_path, monkeypatch)
    _steps(t, 1)
    t.drain()
    stdin = t._record_writer.records_out._proc.stdin
    assert fcntl.fcntl(stdin.fileno(), getattr(fcntl, "F_GETPIPE_SZ", 1032)) == PIPE_BYTES
    t._handover.close()
    t._record_writer.finish()
