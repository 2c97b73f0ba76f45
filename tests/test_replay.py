"""Replay a real vLLM 0.26 CPU trace: the untouched trace passes, planted bugs fail.

The bugs are the ones a paged kernel can really have: a wrong physical block in the
block table, K/V read in the wrong layout, a slot off by one, a sequence length off
by one. Each must turn the replay red, and the CLI must say so in its exit code.
"""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from rich.console import Console

from pagedtrace.cli import main
from reference_impl.layouts import cpu_layout_for
from reference_impl.replay import LAYOUT_CPU_AMX, LEGACY_EVERY, TOL_K, ReplayReport, legacy_sample, replay_trace
from tracer.format import StepRecord, Trace

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def trace(cpu_trace) -> Trace:
    return Trace.open(cpu_trace)


@pytest.fixture(scope="module")
def report(trace) -> ReplayReport:
    return replay_trace(trace)


def _with_records(trace: Trace, change) -> Trace:
    """The same trace with ``change(record)`` applied to every record that has tensors."""
    return dataclasses.replace(trace, records=[change(r) if r.tensors else r for r in trace.records])


def _cli(*argv: str) -> tuple[int, str]:
    """Run ``pagedtrace`` in-process; return (exit code, everything it printed)."""
    out = io.StringIO()
    console = Console(file=out, width=400, color_system=None)
    code = main(list(argv), console=console, errors=console)
    return code, out.getvalue()


def _copy(cpu_trace: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "trace"
    shutil.copytree(cpu_trace, dest, ignore=shutil.ignore_patterns("replay.json"))
    return dest


def _rewrite_steps(trace_dir: Path, change) -> None:
    """Apply ``change(dict)`` to every step line of ``steps.jsonl``."""
    path = trace_dir / "steps.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for line in lines:
        if line["type"] == "step":
            change(line)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


# --------------------------------------------------------------------------- the real trace


def test_untouched_trace_is_exactly_attention(trace, report):
    replayed = [r for r in trace.records if r.tensors]
    assert report.ok
    assert len(report.steps) == len(replayed) >= 10
    assert report.kernel == "fast" and report.recorded_layout == trace.run.kv_cache.layout
    for step in report.steps:
        assert step.ok and not step.note
        assert 0 < step.max_abs <= step.tol
        # The tolerance is derived, not chosen: k times the FA-rounding emulation's own error
        # plus one eps of the activation dtype at the step's largest reference value.
        floor = float(torch.finfo(getattr(torch, trace.run.model.dtype)).eps) * step.max_abs / step.max_rel
        assert step.tol == pytest.approx(TOL_K * step.baseline_max_abs + floor)
        assert step.max_rel < 0.01
        assert [h.head for h in step.heads] == list(range(trace.run.model.num_attention_heads))
        assert all(h.ok and h.max_abs <= step.max_abs for h in step.heads)
    # One prefill step (four prompts, a shared 64-token prefix) and decode steps.
    assert max(s.num_tokens for s in report.steps) > 100
    assert min(s.num_tokens for s in report.steps) == 4


def test_write_path_is_bit_exact(trace, report):
    replayed = [r for r in trace.records if r.tensors]
    assert len(report.write_path) == len(replayed)
    for check, record in zip(report.write_path, replayed, strict=False):
        assert (check.step, check.ok, check.mismatches) == (record.step, True, 0)
        assert check.tokens == sum(s >= 0 for s in record.slot_mapping)


def test_legacy_x_split_is_just_storage(trace, report):
    # By default on the first, the last and every LEGACY_EVERY-th step; legacy_every=1: on every step.
    steps = [r.step for r in report.steps]
    sampled = sorted(legacy_sample(len(steps), LEGACY_EVERY))
    assert [c.step for c in report.legacy] == [steps[i] for i in sampled]
    every = replay_trace(trace, legacy_every=1, check_write=False)
    assert [c.step for c in every.legacy] == steps
    for check in (*report.legacy, *every.legacy):
        assert check.ok and check.max_abs == 0.0
        assert check.x == 8  # bf16: 16 bytes / 2


def test_cpu_layout_is_the_packing_this_host_uses(trace, report):
    spec = trace.run.kv_cache
    expected = cpu_layout_for(torch.bfloat16, spec.block_size, spec.head_size, torch.cpu._is_amx_tile_supported())
    assert report.layout == expected


def test_the_manifest_says_how_this_hosts_cpu_kernel_rounds_and_replay_holds_it_to_that(trace, report):
    # vLLM loads _C (AVX512-BF16: round to nearest) or _C_AVX512 / _C_AVX2 (truncation) by the CPU
    info = trace.run.extra["cpu_attention"]
    avx512 = torch.cpu._is_avx512_supported()
    bf16 = avx512 and torch.cpu._is_avx512_bf16_supported()
    assert info["bf16_conversion"] == ("nearest" if bf16 else "toward_zero")
    assert info["extension"] == ("vllm._C" if bf16 else "vllm._C_AVX512" if avx512 else "vllm._C_AVX2")
    assert info["isa"] == ("amx" if report.layout == LAYOUT_CPU_AMX else "vec")  # block size 32, head size 64
    if info["isa"] == "vec":
        assert report.tolerance.emulation == ("cpu-vec-rounding" if bf16 else "cpu-vec-truncating")
    else:
        assert report.tolerance.emulation == "flash-attention-rounding"
    # The shared run is eager on the CPU, which disables torch.compile (what eager Flex's rounding needs).
    assert trace.run.extra["torch_compile"] is False


NEEDS_CXX = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler for the compiled kernel"
)


@pytest.mark.parametrize("kernel", ["loop", "partitioned", pytest.param("compiled", marks=NEEDS_CXX)])
def test_every_kernel_form_gives_the_same_verdict(trace, report, kernel):
    other = replay_trace(trace, kernel=kernel, steps=(0, 4), check_write=False, check_legacy=False)
    assert other.ok and other.kernel == kernel
    fast = {(s.step, s.layer): s for s in report.steps}
    for step in other.steps:
        assert step.max_abs == pytest.approx(fast[(step.step, step.layer)].max_abs, abs=1e-6)


def test_selection_by_steps_and_layers(trace):
    first = trace.records[0]
    part = replay_trace(trace, steps=(first.step, first.step + 2), layers=[0])
    assert [s.step for s in part.steps] == [r.step for r in trace.records if first.step <= r.step < first.step + 2]
    by_name = replay_trace(trace, steps=(first.step, first.step + 1), layers=[first.layer])
    assert [s.layer for s in by_name.steps] == [first.layer]


@pytest.mark.parametrize("layout", ["flash_nhd", "flash_hnd", "cpu", "cpu_amx"])
def test_the_same_cache_in_every_layout_replays(cpu_trace, report, tmp_path, layout):
    # Repack the captured blocks as another backend would hold them (logical shape,
    # contiguous, as the tracer's index_select stores them) and say so in the manifest.
    from safetensors.torch import load_file, save_file

    from reference_impl.layouts import kv_to_cpu, kv_to_cpu_amx, kv_to_flash, read_kv

    writers = {
        "flash_nhd": lambda k, v: kv_to_flash(k, v, "NHD"),
        "flash_hnd": lambda k, v: kv_to_flash(k, v, "HND"),
        "cpu": kv_to_cpu,
        "cpu_amx": kv_to_cpu_amx,
    }
    copy = _copy(cpu_trace, tmp_path)
    head_size = Trace.open(copy).run.kv_cache.head_size
    for file in (copy / "tensors").iterdir():
        tensors = load_file(str(file))
        # whole blocks: the write log's snapshots and its check steps' dumps (kv_written is [t, K|V, H, D]
        # in every layout)
        for name in ("kv_blocks", "kv_new_blocks"):
            if name in tensors and tensors[name].shape[0]:
                key_cache, value_cache = read_kv(tensors[name], report.layout, head_size)
                tensors[name] = writers[layout](key_cache, value_cache).contiguous()
        save_file(tensors, str(file))
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["kv_cache"]["layout"] = layout
    (copy / "manifest.json").write_text(json.dumps(manifest))

    again = replay_trace(Trace.open(copy))
    assert again.ok and again.layout == layout
    assert [s.max_abs for s in again.steps] == pytest.approx([s.max_abs for s in report.steps], abs=1e-9)
    assert all(w.ok and w.tokens for w in again.write_path)


# --------------------------------------------------------------------------- planted bugs


def _swap_first_private_block(record: StepRecord) -> StepRecord:
    """Give request 0 another request's first private block (a full block of 32 tokens).

    A full block carries enough attention mass to be seen in every step; a block holding
    one or two of a long sequence's tokens may not be (its weight can sit inside bf16's
    error), so the planted bug swaps a full one.
    """
    row0 = record.block_table[0]
    shared = 0
    while all(len(row) > shared and row[shared] == row0[shared] for row in record.block_table):
        shared += 1
    other = next(row[shared] for row in record.block_table[1:] if row[shared] not in row0)
    row0 = (*row0[:shared], other, *row0[shared + 1 :])
    return dataclasses.replace(record, block_table=(row0, *record.block_table[1:]))


def test_wrong_block_id_in_block_table_fails(trace):
    bad = replay_trace(_with_records(trace, _swap_first_private_block), check_legacy=False)
    assert not bad.ok
    assert all(not s.ok and s.max_abs > 5 * s.tol for s in bad.steps)
    # The write path does not read the block table: it still holds, so the failure
    # points at the table, not at the cache.
    assert all(w.ok for w in bad.write_path)


def test_block_missing_from_capture_is_named(trace):
    def unknown_block(r: StepRecord) -> StepRecord:
        return dataclasses.replace(r, block_table=((10**6, *r.block_table[0][1:]), *r.block_table[1:]))

    bad = replay_trace(_with_records(trace, unknown_block), steps=(0, 3), check_write=False, check_legacy=False)
    assert not bad.ok
    assert all(not s.ok and "1000000" in s.note for s in bad.steps)


@pytest.mark.parametrize("layout", ["flash_nhd", "flash_hnd", "other-cpu"])
def test_cache_read_in_the_wrong_layout_fails(trace, report, layout):
    if layout == "other-cpu":
        layout = "cpu" if report.layout == LAYOUT_CPU_AMX else LAYOUT_CPU_AMX
    bad = replay_trace(trace, layout=layout, check_legacy=False)
    assert not bad.ok and bad.layout == layout
    assert all(not s.ok and s.max_abs > 10 * s.tol for s in bad.steps)
    assert all(w.mismatches == w.tokens > 0 for w in bad.write_path)


def test_slot_mapping_off_by_one_fails_the_write_check(trace):
    shifted = _with_records(
        trace, lambda r: dataclasses.replace(r, slot_mapping=tuple(s + 1 if s >= 0 else s for s in r.slot_mapping))
    )
    bad = replay_trace(shifted, check_legacy=False)
    assert not bad.ok
    assert all(w.mismatches == w.tokens > 0 and w.first_mismatch == 0 for w in bad.write_path)
    # Attention reads through the block table, not the slots: it still matches, so
    # the verdict says exactly which path is wrong.
    assert all(s.ok for s in bad.steps)


def test_one_token_off_by_one_is_counted_alone(trace):
    one = _with_records(
        trace, lambda r: dataclasses.replace(r, slot_mapping=(r.slot_mapping[0] + 1, *r.slot_mapping[1:]))
    )
    bad = replay_trace(one, check_legacy=False)
    assert all(w.mismatches == 1 and w.first_mismatch == 0 for w in bad.write_path)


def test_seq_len_off_by_one_is_outside_tolerance(trace):
    # Request 0 sees one key too few. In the prefill step that is its last prompt token,
    # which its last query attends to strongly; in a decode step one key of a hundred
    # may carry less weight than bf16's error, so only the verdict as a whole and the
    # prefill step are asserted.
    def shorter(r: StepRecord) -> StepRecord:
        return dataclasses.replace(r, seq_lens=(r.seq_lens[0] - 1, *r.seq_lens[1:]))

    bad = replay_trace(_with_records(trace, shorter), check_write=False, check_legacy=False)
    assert not bad.ok
    prefill = bad.steps[0]
    assert prefill.num_tokens > prefill.num_reqs and not prefill.ok and prefill.max_abs > 5 * prefill.tol
    assert sum(not s.ok for s in bad.steps) >= 2


# --------------------------------------------------------------------------- the CLI


def test_cli_exit_0_and_table(cpu_trace):
    code, out = _cli("replay", str(cpu_trace), "--no-save")
    assert code == 0, out
    assert "replay (fast kernel" in out and "all" in out and "match" in out


def test_cli_json_is_the_only_stdout_and_parses(cpu_trace, trace):
    code, out = _cli("replay", str(cpu_trace), "--json", "--no-save", "--kernel", "loop", "--steps", "0:3")
    assert code == 0
    data = json.loads(out)
    assert data["ok"] is True and data["kernel"] == "loop"
    assert [s["step"] for s in data["steps"]] == [r.step for r in trace.records if r.step < 3 and r.tensors]
    step = data["steps"][0]
    assert {"step", "layer", "kind", "ok", "max_abs", "max_rel", "tol", "heads"} <= step.keys()
    assert {"head", "ok", "max_abs", "max_rel"} <= step["heads"][0].keys()
    assert {"step", "layer", "ok", "tokens", "mismatches"} <= data["write_path"][0].keys()
    assert {"step", "layer", "ok", "max_abs"} <= data["legacy"][0].keys()


def test_cli_saves_replay_json_by_default(cpu_trace, tmp_path):
    copy = _copy(cpu_trace, tmp_path)
    code, out = _cli("replay", str(copy), "--json")
    assert code == 0
    saved = Trace.open(copy).read_json("replay.json")
    assert saved == json.loads(out)


def test_cli_exit_1_on_a_mismatch(cpu_trace, tmp_path):
    copy = _copy(cpu_trace, tmp_path)

    def wrong_block(line: dict) -> None:
        if line["tensors"]:
            record = StepRecord.from_json({k: v for k, v in line.items() if k != "type"})
            line["block_table"][0] = list(_swap_first_private_block(record).block_table[0])

    _rewrite_steps(copy, wrong_block)
    code, out = _cli("replay", str(copy))
    assert code == 1
    assert "MISMATCH" in out and "FAIL" in out
    assert Trace.open(copy).read_json("replay.json")["ok"] is False


def test_cli_judges_a_trace_without_tensors_on_its_metadata(cpu_trace, tmp_path):
    copy = _copy(cpu_trace, tmp_path)
    shutil.rmtree(copy / "tensors")

    def drop_tensors(line: dict) -> None:
        line["tensors"], line["tensor_names"] = None, []

    _rewrite_steps(copy, drop_tensors)
    code, out = _cli("replay", str(copy))
    assert code == 0 and "Traceback" not in out
    assert "tensors were not captured" in out and "metadata consistent" in out


def test_cli_exit_2_on_a_missing_tensor_file(cpu_trace, tmp_path):
    copy = _copy(cpu_trace, tmp_path)
    victim = sorted((copy / "tensors").iterdir())[1]
    victim.unlink()
    code, out = _cli("replay", str(copy), "--no-save")
    assert code == 2
    assert out.strip().count("\n") == 0 and "Traceback" not in out
    assert "tensor file missing" in out and victim.name in out
    assert not (copy / "replay.json").exists()


def test_cli_exit_2_on_a_directory_that_is_no_trace(tmp_path):
    code, out = _cli("replay", str(tmp_path))
    assert code == 2 and out.startswith("error:") and "Traceback" not in out


def test_compiled_kernel_that_cannot_build_is_a_clear_error(cpu_trace, monkeypatch):
    from reference_impl import compiled

    monkeypatch.setattr(compiled, "_module", None)
    monkeypatch.setattr(
        compiled,
        "_error",
        "cannot build the compiled decode kernel (it needs a C++ compiler and ninja): no compiler here",
    )
    code, out = _cli("replay", str(cpu_trace), "--kernel", "compiled")
    assert code == 2
    assert "cannot build the compiled decode kernel" in out and "use --kernel fast" in out
    assert "Traceback" not in out
