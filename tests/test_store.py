"""The trace store: write, read (format 2, and format 1 still), and fail clearly on damaged traces."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import pytest
import torch

from tests.conftest import fixture_path
from tests.factories import kv_spec, run_info, step_record
from tracer.format import (
    MANIFEST,
    STEP_KINDS,
    STEPS,
    STORED_LAYOUTS,
    GapRecord,
    RunInfo,
    StepRecord,
    Trace,
    TraceError,
    TraceWriter,
)


def _run() -> RunInfo:
    return run_info(pagedtrace_version="0", attention_backend="x.Impl", options={"layers": "first"})


def _step(step: int) -> StepRecord:
    return step_record(step=step, num_heads=2, num_kv_heads=1, head_size=4)


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
    assert t.records[0] == StepRecord(
        **{**_step(1).__dict__, "tensors": t.records[0].tensors, "tensor_names": ("output", "query")}
    )
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
    with pytest.raises(
        TraceError, match=r"line 4: truncated or malformed: not valid JSON \(.*\) \(3 valid records before it"
    ):
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
    with pytest.raises(TraceError, match=r"no manifest\.json"):
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
    rec = dataclasses.replace(
        _step(1), block_table=((1, 2, 7), (1, 2, 8), (1, 9)), seq_lens=(40, 40, 20), query_start_loc=(0, 1, 2, 3)
    )
    assert rec.shared_blocks == {1, 2}
    assert dataclasses.replace(rec, block_table=((3, 3), (4,))).shared_blocks == frozenset()


# -- format 2: checked vocabularies, required fields; format 1 still reads -----------------

#: A format-1 trace written by hand, as pagedtrace 0.1 wrote them: two request steps whose
#: lines lack ``alibi_slopes`` and ``sinks``, no tensors. Frozen: never regenerate it.
V1_MINIMAL = fixture_path("v1-minimal")


def _rewrite_lines(trace_dir, change) -> None:
    lines = [json.loads(line) for line in (trace_dir / STEPS).read_text().splitlines()]
    (trace_dir / STEPS).write_text("".join(json.dumps(change(d)) + "\n" for d in lines))


def _without_alibi_and_sinks(line: dict) -> dict:
    return {k: v for k, v in line.items() if k not in ("alibi_slopes", "sinks")}


def test_a_kind_outside_step_kinds_is_an_error(trace_dir):
    _rewrite_lines(trace_dir, lambda d: {**d, "kind": "decode"} if d["type"] == "step" else d)
    kinds = ", ".join(STEP_KINDS)
    with pytest.raises(TraceError, match=re.escape(f"line 2: StepRecord: kind 'decode' is not one of {kinds}")):
        Trace.open(trace_dir)


@pytest.mark.parametrize("layout", ["flash_xyz", "legacy"])  # unknown; registered but never stored
def test_a_layout_outside_the_registry_is_an_error(tmp_path, layout):
    with TraceWriter(tmp_path / "t") as w:
        w.write_manifest(run_info(kv_cache=kv_spec(layout=layout)))
    layouts = ", ".join(STORED_LAYOUTS)
    with pytest.raises(TraceError, match=re.escape(f"KVCacheSpec: layout '{layout}' is not one of {layouts}")):
        Trace.open(tmp_path / "t")


def test_a_v1_trace_whose_lines_lack_alibi_slopes_and_sinks_loads(trace_dir):
    data = json.loads((trace_dir / MANIFEST).read_text())
    (trace_dir / MANIFEST).write_text(json.dumps({**data, "format_version": 1}))
    _rewrite_lines(trace_dir, _without_alibi_and_sinks)
    t = Trace.open(trace_dir)
    assert t.run.format_version == 1 and [r.step for r in t.records] == [1, 2, 3]
    assert all(r.alibi_slopes is None and r.sinks is None for r in t.records)


def test_a_line_of_version_2_or_later_lacking_alibi_slopes_and_sinks_is_an_error(trace_dir):
    assert json.loads((trace_dir / MANIFEST).read_text())["format_version"] >= 2
    _rewrite_lines(trace_dir, _without_alibi_and_sinks)
    with pytest.raises(TraceError, match=re.escape("line 2: StepRecord: missing fields ['alibi_slopes', 'sinks']")):
        Trace.open(trace_dir)


def test_the_frozen_v1_trace_opens():
    lines = [json.loads(line) for line in (V1_MINIMAL / STEPS).read_text().splitlines()]
    assert not any("alibi_slopes" in d or "sinks" in d for d in lines)  # still shaped as format 1
    t = Trace.open(V1_MINIMAL)
    assert t.run.format_version == 1 and t.run.model.name == "tiny" and t.run.kv_cache.layout == "cpu"
    assert [(r.step, r.kind, r.num_actual_tokens, r.seq_lens) for r in t.records] == [
        (3, "request", 20, (20,)),
        (4, "request", 1, (21,)),
    ]
    assert t.records[0].slot_mapping == tuple(range(32, 52))  # block 1, offsets 0..19
    assert all(r.alibi_slopes is None and r.sinks is None and r.tensors is None for r in t.records)
    assert t.gaps == [] and t.problems == [] and t.run.sources == {}
