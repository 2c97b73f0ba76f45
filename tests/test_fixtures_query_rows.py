"""Kept query rows and key/value stored once: format-4 traces made on an H200, replayed on the CPU.

Made by ``scripts/make_fixtures.py`` (docs/gpu.md) on the H200 (vLLM 0.26.0, FA3, V2 model
runner), 2026-12-01, and replayed there too (both ok, the same worst errors as here):

* ``h200-qwen2.5-7b-default-rows``: vLLM's default FULL_AND_PIECEWISE graphs, tensors of layer 0
  inside the full graphs, 8 query rows a step, whole blocks every third step. (Traced with layers
  0 and 27; the maker leaves layer 27's records and files out, halving the fixture.)
* ``h200-llama3.1-8b-fp8-rows``: the same mode with an fp8 KV cache, 4 query rows a step: the
  bf16 key/value differ from the e4m3 cache, so they are stored and the write path is checked.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from reference_impl.replay import replay_record, replay_trace
from reference_impl.resolve import resolve_layout
from tests.conftest import fixture_path
from tracer.format import Trace
from tracer.format.rows import QUERY_ROWS
from tracer.format.schema import KV_INPUTS_WRITTEN
from tracer.format.writelog import verify_write_log

QWEN, FP8 = "h200-qwen2.5-7b-default-rows", "h200-llama3.1-8b-fp8-rows"


def _open(name: str) -> Trace:
    return Trace.open(fixture_path(name))


@pytest.mark.parametrize(("name", "kept"), [(QWEN, 8), (FP8, 4)])
def test_prefills_keep_rows_and_every_record_replays(name, kept):
    trace = _open(name)
    assert trace.run.format_version == 4 and trace.run.cudagraph_mode == "FULL_AND_PIECEWISE"
    records = [r for r in trace.records if r.tensors]
    with_rows = [r for r in records if QUERY_ROWS in r.tensor_names]
    assert with_rows and all(r.num_actual_tokens > kept for r in with_rows)
    assert all(QUERY_ROWS not in r.tensor_names for r in records if r.num_actual_tokens <= kept)
    assert {r.cudagraph for r in records} == {"full", "none"}  # decode steps inside full graphs
    report = replay_trace(trace)
    assert report.ok and len(report.steps) == len(records)
    assert all(s.num_tokens == kept for s in report.steps if "query rows kept" in s.note)
    checks = verify_write_log(trace)
    assert checks and all(c.ok for c in checks)


def test_bf16_key_value_stored_once_fp8_kept():
    qwen, fp8 = _open(QWEN), _open(FP8)
    assert all(KV_INPUTS_WRITTEN in r.tensor_names and "key" not in r.tensor_names for r in qwen.records if r.tensors)
    assert all("key" in r.tensor_names and KV_INPUTS_WRITTEN not in r.tensor_names for r in fp8.records if r.tensors)
    report = replay_trace(fp8)
    assert report.write_path and all(w.ok and w.tokens for w in report.write_path)  # bf16 -> e4m3, checked


@pytest.mark.parametrize("name", [QWEN, FP8])
def test_a_wrong_scale_fails_on_the_kept_rows(name):
    trace = _open(name)
    record = next(r for r in trace.records if r.tensors and QUERY_ROWS in r.tensor_names)
    tensors, layout = trace.tensors(record), resolve_layout(trace, [record])
    assert replay_record(record, tensors, trace.run.kv_cache, layout)[0].ok
    wrong = replace(record, scale=record.scale * 1.05)
    assert not replay_record(wrong, tensors, trace.run.kv_cache, layout)[0].ok


def test_kept_rows_include_last_rows():
    trace = _open(QWEN)
    for record in (r for r in trace.records if r.tensors and QUERY_ROWS in r.tensor_names):
        rows = set(trace.tensors(record)[QUERY_ROWS].tolist())
        lasts = {q - 1 for q in record.query_start_loc[1:]}
        assert len(rows & lasts) >= min(len(lasts), 4)
        assert torch.tensor(sorted(rows)).max() < record.num_actual_tokens


def test_report_says_which_rows_were_kept(tmp_path):
    from reports.build import write_report

    trace = _open(QWEN)
    report = replay_trace(trace)
    write_report(trace.path, tmp_path / "site", replay=report)
    kept = next(r.step for r in trace.records if r.tensors and QUERY_ROWS in r.tensor_names)
    page = (tmp_path / "site" / f"step-{kept:06d}.html").read_text()
    assert "note: query rows kept: 8 of" in page
