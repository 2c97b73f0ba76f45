"""The writer thread's JSON encoder (``tracer.jsonline``): every line reads back as ``json.dumps``'s did."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import FIXTURES
from tests.factories import run_info, step_record
from tracer.format import Trace, TraceWriter
from tracer.jsonline import encode_line
from tracer.options import TracerOptions
from tracer.record_writer import RecordWriter


def _lines() -> list[str]:
    lines = []
    for path in sorted(FIXTURES.glob("*/steps.jsonl")):
        lines += path.read_text(encoding="utf-8").splitlines()
    return lines


def test_every_fixture_line_reads_back_the_same():
    lines = _lines()
    assert len(lines) > 100
    for line in lines:
        obj = json.loads(line)
        # Python's repr of each value (floats bit for bit) after a round trip through the encoder.
        assert json.dumps(json.loads(encode_line(obj))) == json.dumps(obj)


def _step_line() -> dict:
    return json.loads(next(x for x in _lines() if '"type":"step"' in x))


def test_anything_but_a_step_or_gap_line_is_written_by_json():
    for obj in ({"a": 1e-05, "b": [1.5, 2.25]}, {"type": "other", "scale": math.nan}):
        assert encode_line(obj) == json.dumps(obj, separators=(",", ":"))
    assert encode_line({**_step_line(), "scale": 1e-05}) != json.dumps({**_step_line(), "scale": 1e-05})


def test_a_lone_surrogate_falls_back_to_json():
    line = {**_step_line(), "layer": "model.\ud800.attn"}
    assert encode_line(line) == json.dumps(line, separators=(",", ":"))


def test_floats_and_big_ints_keep_their_values():
    values = {"scale": 1e-05, "logits_soft_cap": 0.1 + 0.2, "q_scale": -0.0, "k_scale": 5e-324, "step": 2**70}
    line = {**_step_line(), **values, "sinks": [1.5, 2.25]}
    back = json.loads(encode_line(line))
    assert back == line
    assert math.copysign(1.0, back["q_scale"]) == -1.0


def test_a_writer_with_the_encoder_writes_a_trace_that_opens(tmp_path):
    record = step_record(step=3, num_heads=2, num_kv_heads=1, head_size=4, scale=0.08838834764831845)
    with TraceWriter(tmp_path / "t", encode_line=encode_line) as writer:
        writer.write_manifest(run_info())
        writer.append(record)
    assert Trace.open(tmp_path / "t").records == [record]


def test_the_tracer_writes_with_it(tmp_path):
    sink = RecordWriter(TracerOptions(str(tmp_path / "t")), on_fail=print)
    assert sink.writer()._encode_line is encode_line


@pytest.mark.parametrize("key", ["scale", "q_scale", "sinks", "alibi_slopes", "logits_soft_cap"])
def test_a_non_finite_float_in_a_step_line_is_found_by_its_field(key):
    line = _step_line()
    line[key] = [0.25, math.inf] if key in ("sinks", "alibi_slopes") else math.nan
    assert encode_line(line) == json.dumps(line, separators=(",", ":"))


def test_to_json_is_every_field_in_order_and_reads_back():
    import dataclasses

    from tracer.format import RunInfo, record_from_json, record_to_json

    for path in sorted(FIXTURES.glob("*/manifest.json")):
        trace = Trace.open(path.parent)
        run = trace.run
        as_json = run.to_json()
        assert list(as_json) == [f.name for f in dataclasses.fields(RunInfo)]
        assert isinstance(as_json["kv_cache"], dict)  # the nested record, as its own object
        assert RunInfo.from_json(json.loads(json.dumps(as_json)), run.format_version) == run
        for record in [*trace.records, *trace.gaps][:50]:
            obj = record_to_json(record)
            assert list(obj)[1:] == [f.name for f in dataclasses.fields(record)]
            assert record_from_json(json.loads(encode_line(obj))) == record
