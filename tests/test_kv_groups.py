"""KV-cache groups: recorded from vLLM's kv_cache_config (format 5), inferred for older traces, shown by
``show`` and the step pages, and held by the ``groups`` metadata check (a planted null block fails it)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

from pagedtrace.cli import main
from tests.conftest import FIXTURES
from tracer.format import FORMAT_VERSION, KVCacheGroup, Trace, TraceWriter
from tracer.format.groups import NULL_BLOCK_ID, trace_groups
from tracer.format.metadata import check_record, check_records
from tracer.format.prefix import explain_prefix_cache_by_group
from tracer.kv_groups import kv_cache_groups, layer_groups, null_block_id

GEMMA = FIXTURES / "h200-gemma2-default-v3"  # layer 0 in the 64-token window group, layer 1 in the full one
L0, L1 = "model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"


def _spec(cls, **extra):
    return cls(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16, **extra)


class _Runner:
    """What the tracer reads of vLLM's model runner: its ``kv_cache_config`` (vLLM's own classes)."""

    def __init__(self, groups):
        self.kv_cache_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def test_the_tracer_records_vllms_groups():
    runner = _Runner(
        [
            KVCacheGroupSpec([L0], _spec(SlidingWindowSpec, sliding_window=64)),
            KVCacheGroupSpec([L1], _spec(FullAttentionSpec)),
            KVCacheGroupSpec(["model.layers.2.attn"], _spec(ChunkedLocalAttentionSpec, attention_chunk_size=128)),
        ]
    )
    groups = kv_cache_groups(runner)
    assert [(g.group, g.kind, g.spec, g.layer_names) for g in groups] == [
        (0, "sliding_window", "SlidingWindowSpec", (L0,)),
        (1, "full", "FullAttentionSpec", (L1,)),
        (2, "chunked_local", "ChunkedLocalAttentionSpec", ("model.layers.2.attn",)),
    ]
    assert groups[0].sliding_window == 64 and groups[1].sliding_window is None
    assert groups[2].attention_chunk_size == 128 and groups[0].block_size == 16
    assert layer_groups(runner) == {L0: 0, L1: 1, "model.layers.2.attn": 2}
    assert kv_cache_groups(object()) is None and layer_groups(object()) == {}
    assert null_block_id() == NULL_BLOCK_ID == 0


def test_format_5_groups_round_trip_and_old_traces_still_open(tmp_path):
    old = Trace.open(GEMMA)
    assert old.run.format_version == 3 and old.run.kv_cache_groups is None and old.records[0].kv_cache_group is None
    groups = (
        KVCacheGroup(0, "sliding_window", "SlidingWindowSpec", (L0,), 16, 64, None),
        KVCacheGroup(1, "full", "FullAttentionSpec", (L1,), 16, None, None),
    )
    run = dataclasses.replace(old.run, format_version=FORMAT_VERSION, kv_cache_groups=groups, null_block=0)
    with TraceWriter(tmp_path / "t") as writer:
        writer.write_manifest(run)
        for r in old.records:
            writer.append(dataclasses.replace(r, kv_cache_group=0 if r.layer == L0 else 1))
    new = Trace.open(tmp_path / "t")
    assert new.run.kv_cache_groups == groups and new.run.null_block == 0
    recorded = trace_groups(new)
    assert recorded.recorded and recorded.of_record(new.records[1]).kind == "full"
    # A format-5 manifest without the new keys is malformed, not silently defaulted.
    data = json.loads((tmp_path / "t" / "manifest.json").read_text())
    del data["null_block"]
    (tmp_path / "t" / "manifest.json").write_text(json.dumps(data))
    assert main(["show", str(tmp_path / "t")]) == 2


def test_groups_of_an_older_trace_are_inferred():
    groups = trace_groups(Trace.open(GEMMA))
    assert not groups.recorded and "inferred" in groups.source
    window, full = groups.groups
    assert (window.kind, window.sliding_window, full.kind) == ("sliding_window", 64, "full")
    assert len(window.layer_names) == len(full.layer_names) == 21
    assert groups.of_layer(L0) is window and groups.of_layer(L1) is full
    assert "each group has its own block table" in groups.why_tables_differ(L0, L1)


def test_show_lists_the_groups_and_why_the_tables_differ(capsys):
    assert main(["show", str(GEMMA)]) == 0
    out = capsys.readouterr().out
    assert "KV-cache groups: inferred" in out and "0, 2, 4, 6" in out and "1, 3, 5, 7" in out
    assert "tables differ: layer 0 is in group 0 (sliding window 64 tokens" in out
    assert main(["show", str(GEMMA), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["kv_cache_groups"]
    assert [g["kind"] for g in data["groups"]] == ["sliding_window", "full"] and data["null_block"] == 0


# --------------------------------------------------------------------------- the groups check


def _window_record(table, seq_len=100, window=(63, 0)):
    """A decode row of the window layer at position ``seq_len - 1`` with block table row ``table``."""
    base = next(r for r in Trace.open(GEMMA).records if r.layer == L0 and r.kind == "request")
    last = table[(seq_len - 1) // 16]
    return dataclasses.replace(
        base,
        request_ids=("r",),
        num_actual_tokens=1,
        query_start_loc=(0, 1),
        seq_lens=(seq_len,),
        block_table=(tuple(table),),
        slot_mapping=(last * 16 + (seq_len - 1) % 16,),
        max_query_len=1,
        max_seq_len=seq_len,
        sliding_window=window,
    )


def _groups_check(record):
    trace = Trace.open(GEMMA)
    checks = check_record(record, trace.run.kv_cache, trace.run, None, trace_groups(trace))
    return {c.check: c for c in checks}


def test_null_blocks_before_the_window_pass():
    # Position 99 with a 64-token window reads from position 36: blocks 0 and 1 (0-31) were given back.
    checks = _groups_check(_window_record([0, 0, 5, 6, 7, 8, 9]))
    assert checks["groups"].ok and "2 block(s) before the window given back (null block 0)" in checks["groups"].note
    assert checks["blocks"].ok


def test_a_planted_null_block_at_a_live_position_fails():
    checks = _groups_check(_window_record([0, 0, 0, 6, 7, 8, 9]))  # block 2 (32-47) holds positions 36-47
    assert not checks["groups"].ok
    (problem,) = checks["groups"].problems
    assert problem.position == 36 and "is the null block 0" in problem.message and "from position 36" in problem.message


def test_a_window_layer_that_reads_outside_its_window_fails():
    checks = _groups_check(_window_record([0, 0, 5, 6, 7, 8, 9], window=(-1, -1)))
    assert not checks["groups"].ok and "reads further back than group 0 keeps" in checks["groups"].problems[0].message


def test_layers_of_one_group_must_read_one_table():
    trace = Trace.open(GEMMA)
    step = [r for r in trace.records if r.kind == "request"][:2]  # layers 0 and 1 of one step
    twin = dataclasses.replace(step[1], layer="model.layers.2.self_attn.attn")  # group 0, layer 1's table
    checks = [c for c in check_records(trace, [step[0], twin]) if c.check == "groups"]
    assert checks[0].ok and not checks[1].ok and "read different block tables" in checks[1].problems[0].message


@pytest.mark.engine
def test_a_cpu_trace_records_its_groups(cpu_trace):
    trace = Trace.open(cpu_trace)
    groups = trace.run.kv_cache_groups
    assert groups and trace.run.null_block == 0 and trace_groups(trace).recorded
    assert {r.kv_cache_group for r in trace.records} <= {g.group for g in groups}
    assert all(r.layer in groups[r.kv_cache_group].layer_names for r in trace.records)


# --------------------------------------------------------------------------- the hybrid fixture (recorded groups)

HYBRID = FIXTURES / "h100-gemma2-hybrid"  # format 5, default graph mode, tensors of layers 0 and 1


def test_the_hybrid_fixture_records_its_groups_and_each_record_names_one():
    trace = Trace.open(HYBRID)
    groups = trace_groups(trace)
    assert groups.recorded and groups.null_block == 0
    assert [(g.kind, g.sliding_window) for g in groups.groups][:2] == [("sliding_window", 64), ("full", None)]
    for record in trace.records:
        if record.kind == "request":
            assert record.kv_cache_group == (0 if record.layer == L0 else 1)
    by_step: dict[int, dict[str, object]] = {}
    for record in trace.records:
        if record.kind == "request":
            by_step.setdefault(record.step, {})[record.layer] = record.block_table
    assert all(len(tables) == 2 and len(set(tables.values())) == 2 for tables in by_step.values())


def test_show_on_the_hybrid_fixture_lists_the_recorded_groups(capsys):
    assert main(["show", str(HYBRID)]) == 0
    out = capsys.readouterr().out
    assert "KV-cache groups: recorded" in out and "SlidingWindowSpec" in out and "FullAttentionSpec" in out


def test_a_null_block_planted_at_a_live_position_of_the_hybrid_fixture_fails():
    trace = Trace.open(HYBRID)
    groups = trace_groups(trace)
    record = max((r for r in trace.records if r.kind == "request" and r.layer == L0), key=lambda r: r.step)
    row = max(range(len(record.seq_lens)), key=lambda i: record.seq_lens[i])
    first_visible = record.seq_lens[row] - 64  # a decode row sees its last 64 positions
    table = list(record.block_table[row])
    assert all(c.ok for c in check_record(record, trace.run.kv_cache, trace.run, None, groups) if c.check == "groups")
    table[first_visible // 16] = groups.null_block
    rows = tuple(tuple(table) if i == row else r for i, r in enumerate(record.block_table))
    checks = check_record(dataclasses.replace(record, block_table=rows), trace.run.kv_cache, trace.run, None, groups)
    (groups_check,) = [c for c in checks if c.check == "groups"]
    assert not groups_check.ok and "is the null block 0" in groups_check.problems[0].message


def test_the_prefix_cache_is_explained_per_group_on_the_hybrid_fixture(capsys):
    trace = Trace.open(HYBRID)
    by_group = explain_prefix_cache_by_group(trace)
    assert [(g.group, g.layer) for g in by_group] == [(0, L0), (1, L1)]
    assert "sliding window 64" in by_group[0].label and "full attention" in by_group[1].label
    window, full = by_group
    # vLLM serves the hit all groups share: the same requests, the same cached tokens ...
    assert [(e.request_id, e.cached_tokens) for e in window.explanations] == [
        (e.request_id, e.cached_tokens) for e in full.explanations
    ]
    # ... from each group's own physical blocks.
    blocks = [tuple(b.physical for b in e.blocks) for g in by_group for e in g.explanations if e.blocks]
    assert blocks and len(set(blocks)) == len(blocks)
    assert main(["show", str(HYBRID)]) == 0
    out = capsys.readouterr().out
    assert "prefix cache, per request (at its first scheduled step), KV-cache group 0: sliding window" in out
    assert "KV-cache group 1: full attention" in out
    assert main(["show", str(HYBRID), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [g["group"] for g in data["requests_by_group"]] == [0, 1]
    assert data["requests"] == data["requests_by_group"][0]["requests"]


def test_a_trace_of_one_group_gets_one_prefix_table(cpu_trace):
    (only,) = explain_prefix_cache_by_group(Trace.open(cpu_trace))
    assert only.group is None and only.label == ""
