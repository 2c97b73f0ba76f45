"""Trace format v1: write, read, and fail clearly on damaged traces."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from tracer.format import FORMAT_VERSION, GapRecord, RunInfo, StepRecord, TraceError
from tracer.format import MANIFEST, STEPS, Trace, TraceWriter


def _run() -> RunInfo:
    return RunInfo(format_version=FORMAT_VERSION, pagedtrace_version="0", vllm_version="0.26.0",
                   torch_version="2.11.0", platform="CpuPlatform", device="cpu", device_name="cpu",
                   attention_backend="x.Impl", flash_attn_version=None, cudagraph_mode="NONE",
                   enforce_eager=True, model=None, kv_cache=None, options={"layers": "first"},
                   created_at="2026-11-30T00:00:00+00:00")


def _step(step: int) -> StepRecord:
    return StepRecord(step=step, layer="model.layers.0.self_attn.attn", kind="request", request_ids=("0-a",),
                      num_actual_tokens=1, query_start_loc=(0, 1), seq_lens=(17,), block_table=((3, 5),),
                      slot_mapping=(5 * 16 + 0,), max_query_len=1, max_seq_len=17, causal=True,
                      sliding_window=(-1, -1), logits_soft_cap=0.0, scale=0.125, use_cascade=False,
                      num_splits=0, num_heads=2, num_kv_heads=1, head_size=4)


@pytest.fixture
def trace_dir(tmp_path):
    path = tmp_path / "t"
    with TraceWriter(path) as w:
        w.write_manifest(_run())
        w.append(GapRecord(step=0, kind="profile", reason="profile run", num_tokens=0))
        for i in range(1, 4):
            w.append(_step(i), {"query": torch.full((1, 2, 4), float(i)), "output": torch.zeros(1, 2, 4)})
    return path


def test_round_trip(trace_dir):
    t = Trace.open(trace_dir)
    assert t.run == _run()
    assert [r.step for r in t.records] == [1, 2, 3] and t.gaps[0].kind == "profile"
    assert t.records[0] == StepRecord(**{**_step(1).__dict__, "tensors": t.records[0].tensors,
                                         "tensor_names": ("output", "query")})
    assert t.tensors(t.records[2])["query"].eq(3.0).all()
    assert t.records[0].query_lens == (1,) and t.records[0].num_reqs == 1


def test_unknown_version_is_a_clear_error(trace_dir):
    data = json.loads((trace_dir / MANIFEST).read_text())
    data["format_version"] = 99
    (trace_dir / MANIFEST).write_text(json.dumps(data))
    with pytest.raises(TraceError, match="version 99; this pagedtrace reads versions 1, 2"):
        Trace.open(trace_dir)


def test_truncated_line_is_an_error_and_the_valid_part_stays_readable(trace_dir):
    text = (trace_dir / STEPS).read_text()
    (trace_dir / STEPS).write_text(text[: len(text) - 40])  # a writer killed mid-line
    with pytest.raises(TraceError, match=r"line 4: truncated or malformed \(3 valid records before it"):
        Trace.open(trace_dir)
    t = Trace.open(trace_dir, strict=False)
    assert [r.step for r in t.records] == [1, 2] and len(t.problems) == 1


def test_unknown_fields_are_not_silently_dropped(trace_dir):
    lines = (trace_dir / STEPS).read_text().splitlines()
    bad = json.loads(lines[1])
    bad["surprise"] = 1
    (trace_dir / STEPS).write_text("\n".join([lines[0], json.dumps(bad), *lines[2:]]) + "\n")
    with pytest.raises(TraceError, match="unknown fields \\['surprise'\\]"):
        Trace.open(trace_dir)


def test_missing_tensor_file_is_a_clear_error(trace_dir):
    t = Trace.open(trace_dir)
    shutil.rmtree(trace_dir / "tensors")
    with pytest.raises(TraceError, match="tensor file missing"):
        t.tensors(t.records[0])


def test_corrupt_tensor_file_is_a_clear_error(trace_dir):
    t = Trace.open(trace_dir)
    (trace_dir / "tensors" / t.records[0].tensors).write_bytes(b"\x00" * 10)
    with pytest.raises(TraceError, match="cannot read tensors"):
        t.tensors(t.records[0])


def test_not_a_trace(tmp_path):
    with pytest.raises(TraceError, match="not a trace directory"):
        Trace.open(tmp_path / "nope")
    with pytest.raises(TraceError, match="no manifest.json"):
        Trace.open(tmp_path)


def test_tensor_budget_stops_tensors_not_records(tmp_path):
    with TraceWriter(tmp_path / "b", tensor_budget_bytes=100) as w:
        w.write_manifest(_run())
        stored = [w.append(_step(i), {"query": torch.zeros(4, 4)}) for i in range(3)]  # 64 bytes each
    assert [s.tensors is not None for s in stored] == [True, False, False]
    assert w.budget_exhausted and len(Trace.open(tmp_path / "b").records) == 3


def test_no_pickle_in_a_trace(trace_dir):
    for f in trace_dir.rglob("*"):
        if f.is_file():
            assert not f.read_bytes().startswith(b"\x80"), f  # pickle protocol 2+ header


def test_shared_blocks_are_blocks_in_more_than_one_row():
    rec = dataclasses.replace(_step(1), block_table=((1, 2, 7), (1, 2, 8), (1, 9)), seq_lens=(40, 40, 20),
                              query_start_loc=(0, 1, 2, 3))
    assert rec.shared_blocks == {1, 2}
    assert dataclasses.replace(rec, block_table=((3, 3), (4,))).shared_blocks == frozenset()
