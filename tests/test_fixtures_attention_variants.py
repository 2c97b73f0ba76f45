"""Attention variants on an H200: soft-cap and window, fp8 KV cache, chunked prefill, FlashAttention-2.

Format-2 traces (vLLM 0.26.0, weights from ``pagedtrace_random``), eager with tensors unless said:
Gemma-2-9B's shape with soft-cap 50 and a 64-token window on layer 0 only (layers 0, 1);
Llama-3.1-8B's shape with an fp8 KV cache; block size 32 with 32-token steps (chunked
prefill); FlashAttention-2 eager; FlashAttention-2 under PIECEWISE CUDA graphs. Made by
``scripts/make_fixtures.py`` (docs/gpu.md), without ``sources/`` (the eager qwen fixture keeps
the one copy). Opened and replayed here on the CPU.
"""

from __future__ import annotations

import pytest

from reference_impl.replay import replay_trace
from tests.conftest import fixture_path
from tracer.format import StepRecord, Trace

NAMES = (
    "gemma2-softcap-window",
    "llama3.1-8b-fp8",
    "qwen2.5-7b-bs32-chunked",
    "qwen2.5-7b-fa2",
    "qwen2.5-7b-fa2-piecewise",
)


def _open(name: str) -> Trace:
    return Trace.open(fixture_path(f"h200-{name}"))


@pytest.fixture(scope="module", params=NAMES)
def trace(request) -> Trace:
    return _open(request.param)


def _requests(t: Trace) -> list[StepRecord]:
    return t.steps(kind="request")


def test_made_on_an_h200_with_flash_attention(trace):
    run = trace.run
    assert run.device == "cuda" and run.device_name == "NVIDIA H200" and run.vllm_version == "0.26.0"
    assert run.attention_backend.endswith("flash_attn.FlashAttentionImpl")
    assert run.format_version == 2 and run.sources == {}
    assert run.kv_cache.layout == "flash_nhd" and run.kv_cache.backend_stride_order == (0, 2, 1, 3)
    assert _requests(trace) and all(r.tensors for r in _requests(trace))


def test_slots_follow_the_block_table(trace):
    bs = trace.run.kv_cache.block_size
    for rec in _requests(trace):
        n = rec.num_actual_tokens
        for row, (a, b) in enumerate(zip(rec.query_start_loc, rec.query_start_loc[1:], strict=False)):
            for i in range(b - a):
                pos = rec.seq_lens[row] - (b - a) + i
                assert rec.slot_mapping[a + i] == rec.block_table[row][pos // bs] * bs + pos % bs
        assert all(s == -1 for s in rec.slot_mapping[n:])  # CUDA-graph padding is never written


def test_replay_passes(trace):
    """Every step and every write-path check passes."""
    report = replay_trace(trace)
    assert report.ok, [(s.step, s.layer, s.max_abs, s.tol) for s in report.steps if not s.ok]
    assert all(w.ok and w.tokens for w in report.write_path)


def test_gemma2_window_bites_on_layer_0_only():
    t = _open("gemma2-softcap-window")
    assert t.run.flash_attn_version == 3 and t.run.model.head_size == 256
    by_layer: dict[int, list[StepRecord]] = {}
    for r in _requests(t):
        by_layer.setdefault(int(r.layer.split(".")[2]), []).append(r)
    assert sorted(by_layer) == [0, 1]
    assert {r.sliding_window for r in by_layer[0]} == {(63, 0)}  # 64 tokens: itself and 63 before
    assert {r.sliding_window for r in by_layer[1]} == {(-1, -1)}
    for r in _requests(t):
        assert r.logits_soft_cap == 50.0 and r.scale == pytest.approx(256**-0.5)
        assert max(r.seq_lens) > 64  # the window cuts the context off
    assert _requests(t)[0].shared_blocks  # a shared 16-token prefix block


def test_llama_fp8_records_what_attention_used():
    t = _open("llama3.1-8b-fp8")
    kv = t.run.kv_cache
    assert kv.cache_dtype == "fp8" and kv.dtype == "uint8" and kv.element_size == 1
    for r in _requests(t):
        # vLLM quantized the query for FA3's fp8 path; no checkpoint scales, so vLLM's 1.0.
        assert r.query_dtype == "float8_e4m3fn"
        assert (r.q_scale, r.k_scale, r.v_scale) == (1.0, 1.0, 1.0)
    first = _requests(t)[0]
    tensors = t.tensors(first)
    assert str(tensors["query"].dtype) == "torch.float8_e4m3fn"
    assert str(tensors["kv_blocks"].dtype) == "torch.uint8"


def test_bf16_runs_record_bf16_queries(trace):
    if trace.run.kv_cache.cache_dtype != "auto":
        pytest.skip("the fp8 fixture quantizes the query")
    assert {(r.query_dtype, r.q_scale, r.k_scale, r.v_scale) for r in _requests(trace)} == {("bfloat16", 1.0, 1.0, 1.0)}


def test_chunked_prefill_splits_a_prompt_over_steps():
    t = _open("qwen2.5-7b-bs32-chunked")
    assert t.run.kv_cache.block_size == 32
    steps = _requests(t)
    assert all(r.num_actual_tokens <= 32 for r in steps)
    # The first prompt's prefill takes several steps: its seq_len grows by more than one token a step.
    assert [r.seq_lens[0] for r in steps[:3]] == [32, 64, 68]
    # A step with a decode row beside a prefill chunk.
    assert any(1 in r.query_lens and max(r.query_lens) > 1 for r in steps)


def test_flash_attention_2_eager_and_piecewise():
    eager, piecewise = _open("qwen2.5-7b-fa2"), _open("qwen2.5-7b-fa2-piecewise")
    assert eager.run.flash_attn_version == 2 and eager.run.cudagraph_mode == "NONE"
    assert piecewise.run.flash_attn_version == 2 and piecewise.run.cudagraph_mode == "PIECEWISE"
    decode = _requests(piecewise)[1:]
    # Three decode rows run in the batch-4 graph: slot_mapping is padded, num_actual_tokens is not.
    assert {(r.num_actual_tokens, len(r.slot_mapping), r.slot_mapping[-1]) for r in decode} == {(3, 4, -1)}
    assert not [g for g in piecewise.gaps if g.kind == "request"]
