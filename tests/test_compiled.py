"""The compiled decode path equals the plain-torch fast reference, and fails cleanly."""

from __future__ import annotations

import dataclasses
import math
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference_impl import compiled
from reference_impl.fast import paged_attention_fast
from tests.factories import make_batch

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None,
    reason="no C++ compiler: the compiled decode kernel cannot be built here",
)

H, H_KV, D, BS, NUM_BLOCKS = 8, 2, 64, 16, 40


def _batch(seed: int, q_lens: list[int], seq_lens: list[int]):
    gen = torch.Generator().manual_seed(seed)
    key_cache = torch.randn(NUM_BLOCKS, BS, H_KV, D, generator=gen).bfloat16()
    value_cache = torch.randn(NUM_BLOCKS, BS, H_KV, D, generator=gen).bfloat16()
    width = max(math.ceil(s / BS) for s in seq_lens) + 2
    # Distinct random blocks per row; the tail past each row's blocks is garbage.
    perm = torch.randperm(NUM_BLOCKS, generator=gen)
    table = torch.full((len(seq_lens), width), 10_000, dtype=torch.int32)
    used = 0
    for b, s in enumerate(seq_lens):
        n = math.ceil(s / BS)
        table[b, :n] = perm[used : used + n]
        used += n
    qsl = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    query = torch.randn(int(qsl[-1]) + 3, H, D, generator=gen).bfloat16()  # 3 padding rows
    return query, key_cache, value_cache, table, torch.tensor(seq_lens, dtype=torch.int32), qsl


CASES = [
    # (q_lens, seq_lens, kwargs)
    ([1, 1, 1], [1, 17, 300], {}),
    ([1, 5, 1, 1], [40, 33, 256, 129], {}),  # a prefill chunk among decode rows
    ([1, 1], [200, 90], {"window": (31, 0)}),
    ([1, 3, 1], [77, 64, 5], {"sinks": torch.linspace(-1.0, 2.0, H)}),
]


@pytest.mark.parametrize("q_lens, seq_lens, kwargs", CASES)
def test_compiled_equals_fast(q_lens, seq_lens, kwargs):
    args = _batch(len(seq_lens), q_lens, seq_lens)
    want, want_lse = paged_attention_fast(*args, scale=D**-0.5, return_lse=True, **kwargs)
    got, got_lse = compiled.paged_attention_compiled(*args, scale=D**-0.5, return_lse=True, **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-5, atol=2e-6)
    assert not got[int(args[-1][-1]) :].any(), "rows past query_start_loc[-1] stay 0"


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_compiled_matches_dense(data):
    """Random decode-heavy batches (several 256-key partitions per row, windows, sinks,
    NaN in every slot no sequence owns) against dense attention in fp64."""
    num_seqs = data.draw(st.integers(1, 4))
    seq_lens = [data.draw(st.integers(1, 700)) for _ in range(num_seqs)]
    q_lens = [data.draw(st.sampled_from([0, 1, 1, min(s, 3)])) for s in seq_lens]
    batch = make_batch(
        seq_lens,
        q_lens,
        num_kv_heads=data.draw(st.integers(1, 2)),
        group=data.draw(st.integers(1, 5)),
        head_size=data.draw(st.sampled_from([32, 64])),
        block_size=data.draw(st.sampled_from([1, 16, 32])),
        window=(data.draw(st.sampled_from([-1, 0, 7, 300])), -1),
        sinks=data.draw(st.booleans()),
        seed=data.draw(st.integers(0, 2**16)),
    )
    batch = dataclasses.replace(
        batch,
        query=batch.query.bfloat16(),
        key_cache=batch.key_cache.bfloat16(),
        value_cache=batch.value_cache.bfloat16(),
    )
    out = compiled.paged_attention_compiled(*batch.args, **batch.kwargs)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), batch.dense(), atol=1e-4, rtol=0)


def test_fp64_matches_dense_to_rounding():
    """With fp64 sums (what ``pagedtrace replay`` asks for) the kernel is exact attention."""
    batch = make_batch(
        [300, 5, 640], [1, 1, 1], num_kv_heads=2, group=4, head_size=64, block_size=16, sinks=True, seed=11
    )
    batch = dataclasses.replace(batch, key_cache=batch.key_cache.bfloat16(), value_cache=batch.value_cache.bfloat16())
    out = compiled.paged_attention_compiled(*batch.args, **batch.kwargs, compute_dtype=torch.float64)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, batch.dense(), atol=1e-12, rtol=0)


def test_decode_rows_take_the_compiled_path(monkeypatch):
    """An all-decode batch never reaches the torch path, and still gives its answer."""
    args = _batch(7, [1, 1], [100, 250])
    want = paged_attention_fast(*args, scale=D**-0.5)
    calls = []
    monkeypatch.setattr(compiled, "paged_attention_fast", lambda *a, **k: calls.append(a))
    got = compiled.paged_attention_compiled(*args, scale=D**-0.5)
    assert calls == []
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


def test_uncovered_batches_fall_back_unchanged():
    query, key_cache, value_cache, table, lens, qsl = _batch(3, [1, 1], [50, 120])
    slopes = torch.linspace(0.1, 0.8, H)
    for kwargs, caches in [
        ({"alibi_slopes": slopes}, (key_cache, value_cache)),
        ({"softcap": 5.0}, (key_cache, value_cache)),
        ({}, (key_cache.half(), value_cache.half())),
        ({"compute_dtype": torch.bfloat16}, (key_cache, value_cache)),
    ]:
        want = paged_attention_fast(query, *caches, table, lens, qsl, scale=0.1, **kwargs)
        got = compiled.paged_attention_compiled(query, *caches, table, lens, qsl, scale=0.1, **kwargs)
        assert torch.equal(got, want)


def test_head_size_not_compiled_falls_back():
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(4, 16, 1, 48, generator=gen).bfloat16()
    args = (
        torch.randn(1, 2, 48, generator=gen),
        cache,
        cache.clone(),
        torch.tensor([[2, 0]]),
        torch.tensor([20]),
        torch.tensor([0, 1]),
    )
    assert 48 not in compiled.HEAD_SIZES
    assert torch.equal(compiled.paged_attention_compiled(*args, scale=0.2), paged_attention_fast(*args, scale=0.2))


def test_bad_block_id_is_an_error_not_a_crash():
    query, key_cache, value_cache, table, lens, qsl = _batch(5, [1, 1], [40, 70])
    table[1, 2] = NUM_BLOCKS + 5  # inside row 1's used blocks (70 keys = 5 blocks)
    with pytest.raises(ValueError, match=r"block_table\[1\]\[2\] is 45: sequence 1 \(70 keys\) reads logical block 2"):
        compiled.paged_attention_compiled(query, key_cache, value_cache, table, lens, qsl, scale=0.1)
