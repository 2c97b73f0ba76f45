"""The qwen2.5-7b-instruct preset on an H200 (vLLM 0.26.0, FlashAttention 3) in three graph modes.

``h200-qwen2.5-7b-eager`` (tensors of the first layer), ``-piecewise`` and ``-default``
(FULL_AND_PIECEWISE; metadata only, format 1, where full-graph steps are gaps). Made by
``scripts/make_fixtures.py`` (docs/gpu.md). Replayed here on the CPU: FA3's layout, and FA3 on a
real H200 computing exactly attention.
"""

from __future__ import annotations

import pytest

from reference_impl.replay import replay_trace
from tests.conftest import fixture_path
from tracer.format import Trace


@pytest.fixture(scope="module", params=["eager", "piecewise", "default"])
def gpu_trace(request) -> Trace:
    return Trace.open(fixture_path(f"h200-qwen2.5-7b-{request.param}"))


@pytest.fixture(scope="module")
def eager() -> Trace:
    return Trace.open(fixture_path("h200-qwen2.5-7b-eager"))


def test_flash_attention_3_layout_on_h200(gpu_trace):
    run = gpu_trace.run
    assert run.device == "cuda" and run.device_name == "NVIDIA H200"
    assert run.attention_backend.endswith("flash_attn.FlashAttentionImpl") and run.flash_attn_version == 3
    kv = run.kv_cache
    # Logical (num_blocks, H_kv, block_size, 2*D); strides make it physically (blocks, tokens, heads, K|V).
    assert kv.shape == (kv.num_blocks, 4, 16, 256)
    assert kv.stride == (16 * 4 * 256, 256, 4 * 256, 1)
    assert kv.layout == "flash_nhd" and kv.backend_stride_order == (0, 2, 1, 3)
    assert len(kv.layer_names) in (1, 28)


def test_slots_follow_the_block_table(gpu_trace):
    for rec in gpu_trace.steps(kind="request"):
        bs = gpu_trace.run.kv_cache.block_size
        for row, (a, b) in enumerate(zip(rec.query_start_loc, rec.query_start_loc[1:], strict=False)):
            for i in range(b - a):
                pos = rec.seq_lens[row] - (b - a) + i
                assert rec.slot_mapping[a + i] == rec.block_table[row][pos // bs] * bs + pos % bs


def test_eager_replay_is_exactly_attention(eager):
    report = replay_trace(eager)
    assert report.ok and report.layout == "flash_nhd"
    assert len(report.steps) == 6  # prefill + 5 decode steps, tensors for layer 0
    assert all(s.max_abs <= s.tol for s in report.steps)
    assert all(w.ok and w.tokens for w in report.write_path)
    assert all(l.ok for l in report.legacy)


def test_piecewise_mode_reaches_forward_every_step():
    t = Trace.open(fixture_path("h200-qwen2.5-7b-piecewise"))
    assert t.run.cudagraph_mode == "PIECEWISE"
    requests = t.steps(kind="request")
    assert [r.num_actual_tokens for r in requests] == [111, 4, 4, 4, 4, 4]
    assert not [g for g in t.gaps if g.kind == "request"]


def test_default_graph_mode_reports_the_steps_it_could_not_see():
    t = Trace.open(fixture_path("h200-qwen2.5-7b-default"))
    assert t.run.cudagraph_mode == "FULL_AND_PIECEWISE"
    requests = t.steps(kind="request")
    assert len(requests) == 1 and requests[0].num_actual_tokens == 111  # the prefill runs eagerly
    replayed = [g for g in t.gaps if g.reason.startswith("cuda-graph-replay")]
    assert [g.num_tokens for g in replayed] == [4] * 5  # every decode step, 4 requests each
    captured = [g for g in t.gaps if g.reason.startswith("cuda-graph-capture")]
    assert sorted(g.num_tokens for g in captured) == [1, 2, 4, 8, 16, 32]


def test_prefix_blocks_are_shared_on_gpu(eager):
    first = eager.steps(kind="request")[0]
    assert len({row[:2] for row in first.block_table}) == 1  # 32 shared tokens = 2 blocks of 16


def test_kernel_options_come_from_the_step_and_the_spec(eager):
    """One record builds the keywords; per-head options join only when the step has them."""
    import dataclasses

    import torch

    from reference_impl.options import NEUTRAL, KernelOptions, changes_nothing

    record = next(r for r in eager.records if r.tensors is not None)
    options = KernelOptions.from_step(record, eager.run.kv_cache)
    assert options.kwargs() == {
        "scale": record.scale,
        "causal": record.causal,
        "window": (-1, -1),
        "softcap": record.logits_soft_cap,
        "k_scale": 1.0,
        "v_scale": 1.0,
    }
    with_heads = dataclasses.replace(record, alibi_slopes=[0.5] * 28, sinks=[1.0] * 28)
    kwargs = KernelOptions.from_step(with_heads, eager.run.kv_cache).kwargs()
    assert kwargs["alibi_slopes"].dtype == torch.float32 and kwargs["sinks"].shape == (28,)
    assert set(NEUTRAL) == {"causal", "window", "softcap", "k_scale", "v_scale"}
    assert changes_nothing("window", [-1, -1], fp8_cache=False)
    assert changes_nothing("k_scale", 0.5, fp8_cache=False) and not changes_nothing("k_scale", 0.5, fp8_cache=True)
    assert not changes_nothing("softcap", 30.0, fp8_cache=False)
