"""``pagedtrace export --perfetto``: the timeline, checked against the Trace Event Format."""

from __future__ import annotations

import json

import pytest

from pagedtrace.cli import main
from tests.conftest import FIXTURES
from tracer.format import Trace
from tracer.format.timeline import STEP_US, timeline


def validate(data: dict) -> list[dict]:
    """Check the JSON Object Format of Google's Trace Event Format; return the events.

    Every event: string ``name``, a known ``ph``, integer ``pid`` / ``tid``; ``X`` has
    numeric ``ts`` and ``dur`` >= 0; ``i`` a scope ``s`` of g/p/t; ``M`` a known metadata
    name with ``args.name``; ``args`` an object. Complete slices on one thread nest (Perfetto
    drops slices that partly overlap).
    """
    assert isinstance(data, dict) and isinstance(data["traceEvents"], list)
    assert data.get("displayTimeUnit", "ms") in ("ms", "ns")
    slices: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for e in data["traceEvents"]:
        assert isinstance(e["name"], str) and e["ph"] in {"X", "i", "M"}, e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        assert isinstance(e.get("args", {}), dict)
        if e["ph"] == "M":
            assert e["name"] in {"process_name", "thread_name"} and isinstance(e["args"]["name"], str)
            continue
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
            slices.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
        else:
            assert e["s"] in {"g", "p", "t"}
    for spans in slices.values():
        stack: list[float] = []
        for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1], f"slice [{start}, {end}) overlaps its parent partly"
            stack.append(end)
    json.dumps(data, allow_nan=False)  # strict JSON: no NaN / Infinity
    return data["traceEvents"]


def test_h200_default_timeline_shows_the_graph_replays():
    events = validate(timeline(Trace.open(FIXTURES / "h200-qwen2.5-7b-default")))
    gaps = [e for e in events if e.get("cat") == "gap"]
    assert sum(e["name"] == "cuda-graph-replay" for e in gaps) == 5
    assert any(e["name"] == "thread_name" and e["args"]["name"] == "gaps (not recorded)" for e in events)


def test_eager_timeline_tracks_requests_and_layers():
    trace = Trace.open(FIXTURES / "h200-qwen2.5-7b-eager")
    events = validate(timeline(trace))
    tracks = [e["args"]["name"] for e in events if e["name"] == "thread_name" and e["pid"] == 2]
    assert len(tracks) == 4 and tracks[0].startswith("#")
    layers = [e for e in events if e.get("cat") == "layer"]
    assert len(layers) == len(trace.records)
    step4 = next(e for e in layers if e["ts"] // STEP_US == 4)
    assert step4["args"]["seq_lens"] == [47, 50, 56, 54] and step4["args"]["shared_blocks"] == [1, 2]
    req = [e for e in events if e["pid"] == 2 and e["ph"] == "X"]
    assert sum(e["name"] == "prefill" for e in req) == 4 and sum(e["name"] == "decode" for e in req) == 20
    shares = [e for e in events if e["name"].startswith("shares")]
    assert len(shares) == 4 * 6 and all(e["args"]["blocks"] == [1, 2] for e in shares)
    assert sum(e["name"].startswith("released") for e in events) == 4


def test_export_command(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert main(["export", str(FIXTURES / "h200-qwen2.5-7b-eager"), "--perfetto", str(out)]) == 0
    validate(json.loads(out.read_text()))
    assert main(["export", str(tmp_path), "--perfetto", str(out)]) == 2
    assert main(["export", str(FIXTURES / "h200-qwen2.5-7b-eager"), "--perfetto", str(tmp_path / "no" / "x")]) == 2


@pytest.mark.engine
def test_timeline_of_a_real_cpu_trace(cpu_trace):
    events = validate(timeline(Trace.open(cpu_trace)))
    assert any(e.get("cat") == "layer" for e in events)
