"""Full CUDA graphs recorded, and the KV write log: format-3 traces made on an H200, replayed on the CPU.

Made by ``scripts/make_fixtures.py`` (docs/gpu.md) on the H200 (vLLM 0.26.0, FA3, V2 model
runner), 2026-12-01:

* ``h200-qwen2.5-7b-default-v3``: vLLM's default FULL_AND_PIECEWISE graphs, metadata for
  layers 0 and 27: the decode steps replay full CUDA graphs and are recorded all the same.
* ``h200-gemma2-default-v3``: the gemma-2-9b preset in the default mode, layers 0 (64-token
  window) and 1 (full attention): two KV-cache groups, each with its own block table.
* ``h200-llama3.1-8b-fp8-writelog``: PIECEWISE, fp8 KV cache, tensors of layer 0 as a KV write
  log with whole blocks every second step: the rebuild is checked against them bit for bit.
* ``h200-llama3.1-8b-fp8-default-tensors``: the same in vLLM's default mode: the decode steps'
  tensors come from copies the tracer captured into the full graphs.
"""

from __future__ import annotations

import itertools

import pytest

from reference_impl.replay import replay_trace
from tests.conftest import fixture_path
from tracer.format import Trace
from tracer.format.writelog import verify_write_log


def _open(name: str) -> Trace:
    return Trace.open(fixture_path(name))


def _request_steps(trace: Trace) -> list[int]:
    return sorted({r.step for r in trace.steps(kind="request")})


@pytest.mark.parametrize("name", ["h200-qwen2.5-7b-default-v3", "h200-gemma2-default-v3"])
def test_default_graph_mode_records_every_request_step(name):
    trace = _open(name)
    assert trace.run.format_version == 3 and trace.run.cudagraph_mode == "FULL_AND_PIECEWISE"
    steps = _request_steps(trace)
    # every step from the first request step on is a record, save the runner's one empty step
    empty = [g.step for g in trace.gaps if g.kind == "request"]
    assert all(g.reason.startswith("empty-step") for g in trace.gaps if g.kind == "request")
    assert steps == [s for s in range(steps[0], steps[-1] + 1) if s not in empty]
    session_tokens = trace.read_json("session.json")["config"]["max_tokens"]
    assert len(steps) == session_tokens  # one prefill step, then one step per further token
    by_graph = {}
    for r in trace.steps(kind="request", layer=trace.layers[0]):
        by_graph.setdefault(r.cudagraph, []).append(r)
    assert len(by_graph["full"]) == len(steps) - 1  # the decode steps ran as full CUDA graphs
    assert [r.num_reqs for r in by_graph["none"]] and all(r.max_query_len > 1 for r in by_graph["none"])
    for r in by_graph["full"]:
        assert r.padded_tokens >= r.num_actual_tokens == r.num_reqs  # one new token per request, padded
    assert len(trace.layers) == 2
    for layer in trace.layers:  # every traced layer in every step
        assert sorted(r.step for r in trace.steps(kind="request", layer=layer)) == steps


@pytest.mark.parametrize("name", ["h200-qwen2.5-7b-default-v3", "h200-gemma2-default-v3"])
def test_default_mode_metadata_is_consistent(name):
    report = replay_trace(_open(name))
    assert report.ok and not report.steps and report.metadata
    assert all(m.ok for m in report.metadata)


def test_decode_steps_carry_the_sequence_forward():
    trace = _open("h200-qwen2.5-7b-default-v3")
    records = trace.steps(kind="request", layer=trace.layers[0])
    for before, after in itertools.pairwise(records):
        grew = dict(zip(after.request_ids, after.seq_lens, strict=True))
        for rid, s in zip(before.request_ids, before.seq_lens, strict=True):
            assert grew[rid] == s + 1  # each full-graph step appends one token to every request


def test_gemma_keeps_two_kv_cache_groups_apart():
    trace = _open("h200-gemma2-default-v3")
    windowed, full = trace.layers
    assert {r.sliding_window for r in trace.steps(layer=windowed, kind="request")} == {(63, 0)}
    assert {r.sliding_window for r in trace.steps(layer=full, kind="request")} <= {None, (-1, -1)}
    pairs = zip(trace.steps(layer=windowed, kind="request"), trace.steps(layer=full, kind="request"), strict=True)
    assert any(a.block_table != b.block_table for a, b in pairs)  # each group has its own blocks


def test_the_fp8_write_log_rebuilds_bit_for_bit_and_replays():
    trace = _open("h200-llama3.1-8b-fp8-writelog")
    assert trace.run.kv_cache.cache_dtype.startswith("fp8")
    requests = [r for r in trace.steps(kind="request") if r.tensors]
    assert requests and all(r.kv_log_epoch == 0 for r in requests)
    checks = verify_write_log(trace)
    assert len(checks) >= 2 and all(c.ok for c in checks), [str(c) for c in checks]
    logged = [r for r in requests if "kv_blocks" not in r.tensor_names]
    assert logged  # steps whose blocks come from the log alone
    for r in logged:
        assert trace.tensors(r)["kv_new_blocks"].shape[0] == 0
    report = replay_trace(trace)
    assert report.ok and len(report.steps) == len(requests)
    assert all(w.ok for w in report.write_path)


def test_show_says_how_each_step_ran_and_that_tensors_are_a_write_log():
    from tracer.format.summary import summarize

    default = summarize(_open("h200-qwen2.5-7b-default-v3"))
    assert default.steps_by_graph == {"full": 15, "none": 1}
    assert default.write_log_records == 0
    fp8 = summarize(_open("h200-llama3.1-8b-fp8-writelog"))
    assert fp8.write_log_records == fp8.records_with_tensors > fp8.check_records == 3
    assert summarize(_open("h200-qwen2.5-7b-default")).steps_by_graph == {}  # format 1: not recorded


def test_the_report_says_which_steps_ran_as_full_graphs():
    from reports.build import render_site
    from reports.viewmodel import build_site

    index = render_site(build_site(_open("h200-qwen2.5-7b-default-v3")))["index.html"]
    assert "<th>CUDA graph</th>" in index
    # 15 decode steps as full graphs; eager: the prefill and the V2 runner's two warm-up passes
    assert index.count("<td>full graph</td>") == 15 and index.count("<td>eager</td>") == 3
    old = render_site(build_site(_open("h200-qwen2.5-7b-default")))["index.html"]
    assert "<th>CUDA graph</th>" not in old  # format 1 did not record it


def test_tensors_of_full_graph_steps_come_from_the_graphs_and_replay():
    """Default mode, fp8 KV cache: the decode steps replayed full CUDA graphs, and the copies the
    tracer captured into those graphs (tracer.graph_copies) gave each its query / output / key / value."""
    trace = _open("h200-llama3.1-8b-fp8-default-tensors")
    assert trace.run.cudagraph_mode == "FULL_AND_PIECEWISE" and trace.run.kv_cache.cache_dtype.startswith("fp8")
    requests = trace.steps(kind="request")
    full = [r for r in requests if r.cudagraph == "full"]
    assert len(full) == len(requests) - 1 >= 6  # every decode step ran as a full graph...
    assert all(r.tensors for r in requests)  # ...and has its tensors
    assert all(r.kv_log_epoch == 0 for r in requests)  # one epoch: no write went unlogged
    for r in full:
        got = trace.tensors(r)
        assert got["query"].shape[0] == got["output"].shape[0] == got["key"].shape[0] == r.num_actual_tokens
    checks = verify_write_log(trace)
    assert any(c.step in {r.step for r in full} for c in checks)  # a full-graph step checked whole
    assert len(checks) >= 3 and all(c.ok for c in checks), [str(c) for c in checks]
    report = replay_trace(trace)
    assert report.ok and len(report.steps) == len(requests)
    assert all(w.ok for w in report.write_path) and len(report.write_path) == len(requests)


def test_the_legacy_round_trip_fails_when_the_layout_loses_a_value(monkeypatch):
    from reference_impl import checks
    from reference_impl.inputs import reference_outputs, step_inputs

    trace = _open("h200-llama3.1-8b-fp8-default-tensors")
    record = trace.steps(kind="request")[1]
    inputs = step_inputs(record, trace.tensors(record), trace.run.kv_cache, "flash_nhd", flash_attn_version=3)
    expected, _ = reference_outputs(inputs)
    args = (
        record,
        inputs.key_cache,
        inputs.value_cache,
        inputs.block_table,
        expected,
        inputs.query,
        trace.run.kv_cache,
    )
    assert checks.check_legacy_path(*args).ok
    _lose_a_value_on_the_way_back(monkeypatch)
    assert not checks.check_legacy_path(*args).ok


def _lose_a_value_on_the_way_back(monkeypatch):
    """Make the legacy layout's way back swap two values of one head."""
    from reference_impl import checks
    from reference_impl import layouts as layout_module

    back = layout_module.legacy_to_kv

    def swapped(key, value):
        k, v = back(key, value)
        k = k.clone()
        k[0, 0, 0, [0, 1]] = k[0, 0, 0, [1, 0]]
        return k, v

    monkeypatch.setattr(checks._layouts, "legacy_to_kv", swapped)


def test_the_legacy_round_trip_reruns_through_the_given_pass(monkeypatch):
    # On a GPU replay hands the round trip its own pass (reference_impl.replay._rerun_on_gpu); the
    # CPU runs the same pass here, so the rerun gives `expected` again and the verdict rests on it.
    from reference_impl import checks
    from reference_impl.inputs import step_inputs
    from reference_impl.step_pass import step_kwargs, step_outputs

    trace = _open("h200-llama3.1-8b-fp8-default-tensors")
    record = trace.steps(kind="request")[1]
    inputs = step_inputs(record, trace.tensors(record), trace.run.kv_cache, "flash_nhd", flash_attn_version=3)

    def rerun(key, value):
        out, _ = step_outputs(inputs.query, key, value, *inputs.args[3:], **step_kwargs(inputs))
        return out

    expected = rerun(inputs.key_cache, inputs.value_cache)
    args = (record, inputs.key_cache, inputs.value_cache, inputs.block_table, expected, inputs.query)
    check = checks.check_legacy_path(*args, trace.run.kv_cache, rerun=rerun)
    assert check.ok and check.max_abs == 0.0
    assert not checks.check_legacy_path(*args, trace.run.kv_cache, rerun=lambda k, v: 1.01 * expected).ok
    _lose_a_value_on_the_way_back(monkeypatch)  # it changes what the pass reads
    assert not checks.check_legacy_path(*args, trace.run.kv_cache, rerun=rerun).ok
