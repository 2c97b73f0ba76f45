"""Metadata verdicts (tracer.format.metadata): real traces pass, each planted fault is named.

Also the CLI side: a trace without tensors is judged on its metadata (exit 0/1, not 2), and
``replay --json`` keeps stdout pure JSON when a step fails.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from rich.console import Console

from pagedtrace.cli import main
from tests.conftest import FIXTURES
from tests.factories import kv_spec, model_summary, run_info, scheduled_step, step_record
from tracer.format import SESSION, MetadataCheck, MetadataProblem, ReplayReport, Trace
from tracer.format.metadata import METADATA_CHECKS, check_record, check_records, expected_attention
from tracer.format.requests import known_tokens

EAGER = FIXTURES / "h200-qwen2.5-7b-eager"
PIECEWISE = FIXTURES / "h200-qwen2.5-7b-piecewise"
SPEC = kv_spec()
RUN = run_info(model=model_summary(), kv_cache=SPEC)


def _by_check(checks: tuple[MetadataCheck, ...]) -> dict[str, MetadataCheck]:
    assert tuple(c.check for c in checks) == METADATA_CHECKS
    return {c.check: c for c in checks}


def _failing(checks: tuple[MetadataCheck, ...]) -> set[str]:
    return {c.check for c in checks if not c.ok}


# --------------------------------------------------------------------------- real traces


@pytest.mark.parametrize("fixture", sorted(p.name for p in FIXTURES.iterdir() if (p / "manifest.json").is_file()))
def test_every_committed_fixture_passes_every_check(fixture):
    trace = Trace.open(FIXTURES / fixture)
    checks = check_records(trace, trace.records)
    assert len(checks) == len(METADATA_CHECKS) * len(trace.records)
    assert [(c.step, c.check, c.problems) for c in checks if not c.ok] == []


def test_the_eager_fixture_compares_shared_prefixes_from_its_session():
    trace = Trace.open(EAGER)
    shared = [c for c in check_records(trace, trace.steps(kind="request")) if c.check == "shared"]
    # blocks 1 and 2 (the 32-token shared prefix) are in every row of every request step
    assert shared and all(c.ok and c.checked == 2 and "prompts unknown" not in c.note for c in shared)


def test_null_block_of_dummy_runs_is_allowed():
    # FULL_AND_PIECEWISE capture dummies point every row at block 0 and write nothing (-1 slots).
    trace = Trace.open(FIXTURES / "h200-qwen2.5-7b-default")
    dummy = next(r for r in trace.records if r.kind == "warmup" and r.block_table[0] == (0,))
    checks = _by_check(check_record(dummy, trace.run.kv_cache, trace.run))
    assert all(c.ok for c in checks.values())
    assert "null-block" in checks["blocks"].note and "padding slot" in checks["slots"].note


# --------------------------------------------------------------------------- planted faults


def test_a_correct_schedule_passes():
    record = scheduled_step(3, query_lens=[1, 8], seq_lens=[21, 24], block_table=[[1, 2], [1, 3]])
    assert _failing(check_record(record, SPEC, RUN)) == set()


def test_slot_off_by_one_names_row_position_token_and_expected_slot():
    good = scheduled_step(3, query_lens=[1, 8], seq_lens=[21, 24], block_table=[[1, 2], [1, 3]])
    slots = list(good.slot_mapping)
    slots[4] += 1  # token 4 is row 1's 4th new token: position 16 + 3 = 19, block 3 offset 3
    checks = _by_check(check_record(dataclasses.replace(good, slot_mapping=tuple(slots)), SPEC, RUN))
    assert _failing(tuple(checks.values())) == {"slots"}
    wrong, collision = checks["slots"].problems
    assert (wrong.row, wrong.position, wrong.token) == (1, 19, 4)
    assert wrong.message == "slot 52 (block 3, offset 4), expected 51 = block_table[1][1] 3 * 16 + 3"
    # token 5 rightly has slot 52 too: two tokens would be written to one slot
    assert (collision.token, collision.message) == (5, "slot 52 is also written by query token 4")


def test_seq_len_one_short_moves_every_slot_of_the_row():
    good = scheduled_step(3, query_lens=[1, 8], seq_lens=[21, 24], block_table=[[1, 2], [1, 3]])
    checks = _by_check(check_record(dataclasses.replace(good, seq_lens=(21, 23)), SPEC, RUN))
    assert checks["slots"].num_problems == 8 and {p.row for p in checks["slots"].problems} == {1}


def test_lengths_disagreeing_with_query_start_loc():
    good = scheduled_step(3, query_lens=[1, 8], seq_lens=[21, 24], block_table=[[1, 2], [1, 3]])
    checks = _by_check(check_record(dataclasses.replace(good, seq_lens=(21, 7)), SPEC, RUN))
    assert "query length 8 > seq_len 7" in checks["lengths"].problems[0].message
    ends_wrong = _by_check(check_record(dataclasses.replace(good, num_actual_tokens=10), SPEC, RUN))
    assert any("ends at 9, num_actual_tokens is 10" in p.message for p in ends_wrong["lengths"].problems)


def test_block_ids_outside_the_pool_and_minus_one():
    outside = step_record(block_table=((3, 64),), slot_mapping=(64 * 16,))
    checks = _by_check(check_record(outside, SPEC, RUN))
    assert checks["blocks"].problems[0].message == "block id 64 at logical block 1 is outside the pool 1..63"
    minus = _by_check(check_record(step_record(block_table=((-1, 5),)), SPEC, RUN))
    assert (minus["blocks"].problems[0].row, minus["blocks"].problems[0].position) == (0, 0)
    short = _by_check(check_record(step_record(block_table=((3,),)), SPEC, RUN))
    assert "1 block(s) for seq_len 17: needs 2" in short["blocks"].problems[0].message


def test_null_block_in_a_request_step_fails_unless_the_window_dropped_it():
    # token 40 of a 41-token row; block 0 stands for the first 16 positions
    record = step_record(seq_lens=(41,), block_table=((0, 4, 5),), slot_mapping=(5 * 16 + 8,), max_seq_len=41)
    checks = _by_check(check_record(record, SPEC, RUN))
    assert "null block" in checks["blocks"].problems[0].message
    # a 16-token window: position 40 reads keys 24..40, never block 0 (vLLM frees it)
    windowed = dataclasses.replace(record, sliding_window=(15, 0))
    assert _by_check(check_record(windowed, SPEC, RUN))["blocks"].ok


def test_shared_block_with_different_tokens_fails_when_prompts_are_known():
    record = scheduled_step(
        3, query_lens=[1, 1], seq_lens=[20, 18], block_table=[[1, 2], [1, 3]], request_ids=["0-ab", "1-cd"]
    )
    same = {"0": tuple(range(30)), "1": (*range(16), 99, 98, 97)}
    assert _by_check(check_record(record, SPEC, RUN, same))["shared"].ok
    differ = {"0": tuple(range(30)), "1": (0, 1, 2, 7, *range(4, 20))}
    checks = _by_check(check_record(record, SPEC, RUN, differ))
    (problem,) = checks["shared"].problems
    assert (problem.row, problem.position) == (1, 3) and "differ at position 3 (3 vs 7)" in problem.message
    unknown = _by_check(check_record(record, SPEC, RUN))["shared"]
    assert unknown.ok and unknown.note.startswith("prompts unknown (no session.json)")


def test_shared_block_at_different_logical_indices_fails():
    record = scheduled_step(3, query_lens=[1, 1], seq_lens=[40, 40], block_table=[[1, 2, 4], [2, 1, 5]])
    problems = _by_check(check_record(record, SPEC, RUN))["shared"].problems
    assert problems and "is logical block 0 of row 0 but 1 of row 1" in problems[0].message


def test_flags_against_the_model_config():
    assert (
        "causal is False" in _by_check(check_record(step_record(causal=False), SPEC, RUN))["flags"].problems[0].message
    )
    gemma = dataclasses.replace(
        RUN,
        extra={
            "model_attention": {
                "sliding_window": 4,
                "cache_sliding_window": 4,
                "layer_types": ["sliding_attention", "full_attention"],
                "attn_logit_softcapping": 50.0,
            }
        },
    )
    assert expected_attention(gemma, "model.layers.0.self_attn.attn") == ((3, 0), 50.0)
    assert expected_attention(gemma, "model.layers.1.self_attn.attn") == ((-1, -1), 50.0)
    good = step_record(sliding_window=(3, 0), logits_soft_cap=50.0)
    assert _by_check(check_record(good, SPEC, gemma))["flags"].ok
    bad = _by_check(check_record(step_record(sliding_window=(2, 0), logits_soft_cap=45.0), SPEC, gemma))["flags"]
    assert [p.message for p in bad.problems] == [
        "sliding_window (2, 0), the model config says (3, 0)",
        "logits_soft_cap 45, the model config says 50",
    ]
    old = _by_check(check_record(step_record(), SPEC, RUN))["flags"]
    assert old.ok and "does not record the model's window" in old.note


def test_known_tokens_reads_session_json():
    session = json.loads((EAGER / SESSION).read_text())
    tokens = known_tokens(session)
    assert tokens is not None and set(tokens) == {"0", "1", "2", "3"}
    assert len(tokens["0"]) == len(session["prompts"][0]) + len(session["outputs"][0])
    assert known_tokens({"prompts": "no"}) is None and known_tokens(None) is None


# --------------------------------------------------------------------------- replay.json


def test_metadata_checks_round_trip_and_old_files_read():
    check = MetadataCheck(
        step=4, layer="L", kind="request", check="slots", ok=False, checked=3, num_problems=1,
        problems=(MetadataProblem("slot 5, expected 4", row=1, position=2, token=0),), note="",
    )  # fmt: skip
    data = {
        "kernel": "fast", "layout": "cpu", "recorded_layout": "cpu",
        "tolerance": {"k": 2.0, "eps": 0.0, "reference_dtype": "float64"},
        "seconds": 0.0, "steps": [], "write_path": [], "legacy": [], "skipped": [], "format_version": 2,
    }  # fmt: skip
    old = ReplayReport.from_json(data)
    assert old.metadata == () and not old.ok  # nothing judged
    report = ReplayReport.from_json({**data, "metadata": [check.to_json()]})
    assert report.metadata == (check,) and not report.ok
    assert ReplayReport.from_json(report.to_json()).metadata == (check,)
    assert ("metadata", (check,)) in report.sections()


# --------------------------------------------------------------------------- the CLI


def _copy(src: Path, tmp_path: Path) -> Path:
    dest = tmp_path / src.name
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("replay.json"))
    return dest


def _edit_step(trace_dir: Path, step: int, **changes) -> None:
    path = trace_dir / "steps.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for line in lines:
        if line.get("step") == step and line["type"] == "step":
            line.update(changes)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_replay_judges_a_metadata_only_trace(tmp_path, capsys):
    trace = _copy(PIECEWISE, tmp_path)
    assert main(["replay", str(trace)], console=Console(width=400)) == 0
    out = capsys.readouterr().out
    assert "tensors were not captured" in out and "metadata consistent on 8 record(s)" in out
    saved = ReplayReport.from_json(json.loads((trace / "replay.json").read_text()))
    assert saved.steps == () and len(saved.metadata) == len(METADATA_CHECKS) * 8 and saved.ok

    first = json.loads((trace / "steps.jsonl").read_text().splitlines()[-1])
    slots = list(first["slot_mapping"])
    slots[2] += 1
    _edit_step(trace, first["step"], slot_mapping=slots)
    assert main(["replay", str(trace), "--no-save"], console=Console(width=400)) == 1
    out = capsys.readouterr().out
    assert f"metadata FAIL step {first['step']} L0 slots row 2" in out and "MISMATCH" in out


def test_replay_json_keeps_stdout_pure_json_when_a_step_fails(tmp_path, capsys):
    trace = _copy(EAGER, tmp_path)
    lines = [json.loads(t) for t in (trace / "steps.jsonl").read_text().splitlines()]
    line = next(t for t in lines if t.get("tensors"))
    _edit_step(trace, line["step"], scale=line["scale"] * 1.5)
    code = main(["replay", str(trace), "--json", "--no-save"])
    captured = capsys.readouterr()
    assert code == 1
    report = ReplayReport.from_json(json.loads(captured.out))  # the whole of stdout is the JSON
    assert [r.step for r in report.steps if not r.ok] == [line["step"]]
    assert "mismatch" in captured.err and f"step {line['step']}" in captured.err
