"""reference_impl.kernel: the loop, fast and partitioned forms against a dense reference."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference_impl import fast as F
from reference_impl import kernel as K
from reference_impl import layouts as L
from reference_impl import tolerances as TOL
from reference_impl.compiled import paged_attention_compiled
from reference_impl.emulation import emulate_flash_attention
from reference_impl.options import KernelOptions
from tests.factories import make_batch


@st.composite
def batches(draw):
    num_seqs = draw(st.integers(1, 4))
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    seq_lens = [draw(st.integers(1, 40)) for _ in range(num_seqs)]
    # Prefill (q = s), chunked prefill (q < s), decode (q = 1) and idle rows (q = 0).
    q_lens = [draw(st.one_of(st.just(0), st.just(1), st.just(s), st.integers(0, s))) for s in seq_lens]
    return make_batch(
        seq_lens,
        q_lens,
        num_kv_heads=draw(st.integers(1, 2)),
        group=draw(st.integers(1, 3)),
        head_size=draw(st.sampled_from([8, 16])),
        block_size=block_size,
        causal=draw(st.booleans()),
        window=(draw(st.sampled_from([-1, 0, 1, 5, 17])), draw(st.sampled_from([-1, 0, 3]))),
        softcap=draw(st.sampled_from([0.0, 3.0])),
        alibi=draw(st.booleans()),
        sinks=draw(st.booleans()),
        fp8=draw(st.booleans()),
        spare_blocks=draw(st.integers(0, 3)),
        pad_rows=draw(st.integers(0, 2)),
        seed=draw(st.integers(0, 2**16)),
    )


ATOL_FP32 = 1e-4  # fp32 kernels against the fp64 reference, outputs of size ~1


@settings(max_examples=60, deadline=None)
@given(batch=batches(), partition_blocks=st.integers(1, 3), tiny_budget=st.booleans())
def test_all_forms_match_dense(batch, partition_blocks, tiny_budget):
    expected = batch.dense()
    block_size = batch.key_cache.shape[1]
    kv_row = batch.key_cache.shape[2] * batch.key_cache.shape[3]
    # A tiny budget forces one block per call, key ranges merged by lse and query chunks.
    budget = dict(max_kv_elems=kv_row * block_size, max_score_elems=1) if tiny_budget else {}
    outs = {
        "loop": K.paged_attention_loop(*batch.args, **batch.kwargs),
        "fast": F.paged_attention_fast(*batch.args, **batch.kwargs, **budget),
        "partitioned": K.paged_attention_partitioned(
            *batch.args, **batch.kwargs, partition_size=partition_blocks * block_size
        ),
    }
    for name, out in outs.items():
        assert out.dtype == torch.float32 and out.shape == batch.query.shape, name
        assert torch.isfinite(out).all(), name
        torch.testing.assert_close(out.double(), expected, atol=ATOL_FP32, rtol=0, msg=name)
        # Rows past query_start_loc[-1] are not queries: untouched zeros.
        assert not out[int(batch.query_start_loc[-1]) :].any(), name


@settings(max_examples=15, deadline=None)
@given(batch=batches())
def test_fp64_forms_agree_to_rounding(batch):
    expected = batch.dense()
    for fn in (K.paged_attention_loop, F.paged_attention_fast, K.paged_attention_partitioned):
        out = fn(*batch.args, **batch.kwargs, compute_dtype=torch.float64)
        assert out.dtype == torch.float64
        torch.testing.assert_close(out, expected, atol=1e-10, rtol=0, msg=fn.__name__)


def test_decode_and_chunked_prefill_mix():
    batch = make_batch([37, 1, 50, 16, 9], [1, 1, 0, 16, 4], block_size=16, num_kv_heads=2, group=4)
    expected = batch.dense()
    for fn in (K.paged_attention_loop, F.paged_attention_fast, K.paged_attention_partitioned):
        torch.testing.assert_close(fn(*batch.args, **batch.kwargs).double(), expected, atol=ATOL_FP32, rtol=0)


@pytest.mark.parametrize("q_len", [1, 2, 3, 6])
@pytest.mark.parametrize("window", [(-1, -1), (2, -1), (0, 0), (3, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_one_sequence_chunk_edges(q_len, window, causal):
    # A lone sequence takes fast's unpadded path, where the mask is skipped when every
    # query provably sees every key: the edges of that proof.
    batch = make_batch([6], [q_len], block_size=4, window=window, causal=causal, pad_rows=0)
    expected = batch.dense()
    for fn in (K.paged_attention_loop, F.paged_attention_fast, K.paged_attention_partitioned):
        torch.testing.assert_close(
            fn(*batch.args, **batch.kwargs).double(), expected, atol=ATOL_FP32, rtol=0, msg=fn.__name__
        )


def test_fast_lse_is_the_log_denominator():
    batch = make_batch([20, 7], [3, 7], block_size=4, sinks=True, alibi=True)
    _out, lse = F.paged_attention_fast(*batch.args, **batch.kwargs, return_lse=True)
    q0, q1 = int(batch.query_start_loc[1]), int(batch.query_start_loc[2])
    k, _ = batch.logical_kv(1)
    # Rebuild the logits of sequence 1 (prefill, causal, no window) by hand.
    q = batch.query[q0:q1].double()
    kk = k.double().repeat_interleave(2, dim=1)
    logits = torch.einsum("thd,nhd->htn", q, kk) * batch.kwargs["scale"]
    pos = torch.arange(7)[:, None]
    col = torch.arange(7)[None, :]
    logits = logits - batch.kwargs["alibi_slopes"].double()[:, None, None] * (pos - col).abs()
    logits = logits.masked_fill(col > pos, -math.inf)
    full = torch.cat([logits, batch.kwargs["sinks"].double()[:, None, None].expand(-1, 7, 1)], dim=-1)
    torch.testing.assert_close(lse[q0:q1].double(), torch.logsumexp(full, dim=-1).T, atol=1e-5, rtol=0)
    assert torch.isinf(lse[q1:]).all()


# --------------------------------------------------------------------------- paging


def test_shuffled_blocks_give_the_same_output():
    batch = make_batch([23, 40, 5], [4, 1, 5], block_size=4, spare_blocks=3, window=(9, -1), sinks=True)
    num_blocks = batch.key_cache.shape[0]
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(7))
    # Physical block i moves to perm[i]; the table follows it.
    key, value = torch.empty_like(batch.key_cache), torch.empty_like(batch.value_cache)
    key[perm], value[perm] = batch.key_cache, batch.value_cache
    table = batch.block_table.clone()
    for b, blocks in enumerate(batch.used_blocks):
        table[b, : len(blocks)] = perm[torch.tensor(blocks)].to(table.dtype)
    shuffled = dataclasses.replace(batch, key_cache=key, value_cache=value, block_table=table)
    for fn in (K.paged_attention_loop, F.paged_attention_fast, K.paged_attention_partitioned):
        assert torch.equal(fn(*batch.args, **batch.kwargs), fn(*shuffled.args, **shuffled.kwargs)), fn.__name__


def test_a_wrong_block_id_changes_the_output():
    batch = make_batch([12, 12], [12, 3], block_size=4, spare_blocks=1)
    spare = next(i for i in range(batch.key_cache.shape[0]) if all(i not in u for u in batch.used_blocks))
    gen = torch.Generator().manual_seed(3)
    batch.key_cache[spare] = torch.randn(batch.key_cache[spare].shape, generator=gen)
    batch.value_cache[spare] = torch.randn(batch.value_cache[spare].shape, generator=gen)
    wrong = batch.block_table.clone()
    wrong[1, 1] = spare  # sequence 1's second block now points at someone else's data
    broken = dataclasses.replace(batch, block_table=wrong)
    rows0 = slice(0, 12)
    rows1 = slice(12, 15)
    for fn in (K.paged_attention_loop, F.paged_attention_fast, K.paged_attention_partitioned):
        good, bad = fn(*batch.args, **batch.kwargs), fn(*broken.args, **broken.kwargs)
        assert torch.equal(good[rows0], bad[rows0]), fn.__name__
        assert (good[rows1] - bad[rows1]).abs().max() > 1e-2, fn.__name__


def test_reading_a_cpu_cache_as_flash_gives_another_answer():
    batch = make_batch([30, 17], [30, 1], block_size=16, spare_blocks=0, num_kv_heads=2, group=1)
    batch.key_cache.nan_to_num_(0.0)
    batch.value_cache.nan_to_num_(0.0)
    cpu = L.kv_to_cpu(batch.key_cache, batch.value_cache)
    right = dataclasses.replace(
        batch, key_cache=L.read_kv(cpu, L.LAYOUT_CPU, 16)[0], value_cache=L.read_kv(cpu, L.LAYOUT_CPU, 16)[1]
    )
    wrong_k, wrong_v = L.read_kv(cpu, L.LAYOUT_FLASH_NHD, 16)
    wrong = dataclasses.replace(batch, key_cache=wrong_k, value_cache=wrong_v)
    expected = F.paged_attention_fast(*batch.args, **batch.kwargs)
    assert torch.equal(F.paged_attention_fast(*right.args, **right.kwargs), expected)
    assert (F.paged_attention_fast(*wrong.args, **wrong.kwargs) - expected).abs().max() > 1e-2


def test_fp8_bytes_are_not_integers():
    batch = make_batch([9], [9], fp8=True)
    as_ints = dataclasses.replace(
        batch, key_cache=batch.key_cache.float().nan_to_num(0.0), value_cache=batch.value_cache.float().nan_to_num(0.0)
    )
    good = F.paged_attention_fast(*batch.args, **batch.kwargs)
    torch.testing.assert_close(good.double(), batch.dense(), atol=ATOL_FP32, rtol=0)
    assert (F.paged_attention_fast(*as_ints.args, **as_ints.kwargs) - good).abs().max() > 1e-2


# --------------------------------------------------------------------------- lse merges


@settings(max_examples=30, deadline=None)
@given(
    seq_len=st.integers(1, 30),
    q_len=st.integers(1, 5),
    cuts=st.lists(st.integers(0, 30), max_size=4),
    seed=st.integers(0, 2**16),
)
def test_combine_partitions_equals_unsplit(seq_len, q_len, cuts, seed):
    q_len = min(q_len, seq_len)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(q_len, 4, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(seq_len, 2, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(seq_len, 2, 8, generator=gen, dtype=torch.float64)
    full = K.dense_attention(q, k, v, scale=0.3)
    edges = sorted({0, seq_len, *[c % (seq_len + 1) for c in cuts]})
    outs, lses = [], []
    for lo, hi in itertools.pairwise(edges):
        # Keys [lo, hi) seen from the queries' real positions: pad with hidden keys.
        logits = torch.einsum("thd,nhd->htn", q, k.repeat_interleave(2, dim=1)) * 0.3
        pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        col = torch.arange(seq_len)[None, :]
        keep = (col <= pos) & (col >= lo) & (col < hi)
        logits = logits.masked_fill(~keep, -math.inf)
        lse = torch.logsumexp(logits, dim=-1)  # [h, t]
        probs = torch.nan_to_num(torch.softmax(logits, dim=-1))
        outs.append(torch.einsum("htn,nhd->thd", probs, v.repeat_interleave(2, dim=1)))
        lses.append(lse.T)
    # An empty partition (-inf lse, zero out) changes nothing.
    outs.append(torch.zeros_like(full))
    lses.append(torch.full((q_len, 4), -math.inf, dtype=torch.float64))
    merged, merged_lse = K.combine_partitions(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(merged, full, atol=1e-12, rtol=0)
    assert torch.isfinite(merged_lse).all()


def test_combine_partitions_all_empty_is_zero():
    out, lse = K.combine_partitions(torch.zeros(3, 2, 4, 8), torch.full((3, 2, 4), -math.inf))
    assert not out.any() and torch.isinf(lse).all()


def test_cascade_prefix_plus_suffix_equals_full():
    """vLLM's cascade attention: one non-causal pass over the shared prefix blocks for all
    queries, one causal pass over each sequence's own suffix, merged by lse."""
    prefix_blocks, block_size = 3, 4
    seq_lens, q_lens = [19, 14, 25], [1, 2, 5]
    batch = make_batch(seq_lens, q_lens, block_size=block_size, spare_blocks=0, pad_rows=0, softcap=3.0)
    # Make every sequence share its first three physical blocks with sequence 0.
    shared = batch.block_table[0, :prefix_blocks].clone()
    batch.block_table[:, :prefix_blocks] = shared
    for b in range(3):
        batch.used_blocks[b][:prefix_blocks] = shared.tolist()
    prefix_len = prefix_blocks * block_size
    assert all(s - q >= prefix_len for s, q in zip(seq_lens, q_lens, strict=False))  # no query inside the prefix
    opts = dict(batch.kwargs)
    prefix_out, prefix_lse = F.paged_attention_fast(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_table[:, :prefix_blocks],
        torch.full((3,), prefix_len),
        batch.query_start_loc,
        **{**opts, "causal": False},
        return_lse=True,
    )
    suffix_out, suffix_lse = F.paged_attention_fast(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_table[:, prefix_blocks:],
        batch.seq_lens - prefix_len,
        batch.query_start_loc,
        **opts,
        return_lse=True,
    )
    merged, _ = K.combine_partitions(torch.stack([prefix_out, suffix_out]), torch.stack([prefix_lse, suffix_lse]))
    full = F.paged_attention_fast(*batch.args, **opts)
    torch.testing.assert_close(merged, full, atol=1e-5, rtol=0)
    torch.testing.assert_close(full.double(), batch.dense(), atol=ATOL_FP32, rtol=0)
    # The suffix alone is not the answer: the prefix carries weight.
    assert (suffix_out - full).abs().max() > 1e-2


# --------------------------------------------------------------------------- options


def test_every_form_declares_the_options_with_their_defaults():
    """Each kernel's keywords are KernelOptions' fields, with the same defaults."""
    for fn in (K.paged_attention_loop, K.paged_attention_partitioned, F.paged_attention_fast, paged_attention_compiled):
        params = inspect.signature(fn).parameters
        for field in dataclasses.fields(KernelOptions):
            param = params[field.name]
            assert param.kind is inspect.Parameter.KEYWORD_ONLY, (fn.__name__, field.name)
            default = inspect.Parameter.empty if field.default is dataclasses.MISSING else field.default
            assert param.default == default, (fn.__name__, field.name)


# --------------------------------------------------------------------------- tolerances


def test_compare_against_an_emulated_baseline():
    batch = make_batch([40, 33, 8], [1, 6, 8], block_size=16, num_kv_heads=2, group=2, pad_rows=0)
    expected = batch.dense()
    baseline = emulate_flash_attention(batch.query.bfloat16(), *batch.args[1:], **batch.kwargs)
    assert baseline.dtype == torch.bfloat16
    actual = K.paged_attention_loop(*batch.args, **batch.kwargs)
    verdict = TOL.compare(actual, expected, baseline)
    base_err = float((baseline.double() - expected).abs().max())
    assert base_err > 1e-4  # bf16 rounding really is coarser: the tolerance means something
    assert verdict["ok"] and verdict["max_abs"] < ATOL_FP32
    assert verdict["tol"] == pytest.approx(TOL.tolerance(expected, baseline))
    floor = float(torch.finfo(torch.bfloat16).eps) * float(expected.abs().max())
    assert verdict["tol"] == pytest.approx(TOL.TOL_K * base_err + floor)
    assert len(verdict["per_head_max_abs"]) == 4
    assert verdict["max_rel"] == pytest.approx(verdict["max_abs"] / float(expected.abs().max()))
    # An output off by 3x the baseline's own error in one head fails, and says which head.
    bad = actual.clone().double()
    bad[2, 3, 0] += 3 * base_err + floor
    verdict = TOL.compare(bad, expected, baseline)
    assert not verdict["ok"] and verdict["per_head_ok"] == [True, True, True, False]


def test_compare_without_baseline_uses_the_relative_floor():
    x = torch.ones(2, 3, 4)
    assert TOL.compare(x, x)["ok"]
    assert not TOL.compare(x + 1e-3, x)["ok"]  # fp32: eps 1.2e-7 at 1.0
    assert TOL.compare(x.bfloat16() + 2**-8, x, dtype=torch.bfloat16)["ok"]  # within one bf16 eps
    with pytest.raises(ValueError):
        TOL.compare(x, x[:1])


@pytest.mark.parametrize(
    "form", ["paged_attention_loop", "paged_attention_fast", "paged_attention_partitioned", "emulate_flash_attention"]
)
@pytest.mark.parametrize("entry", [-1, 99])
def test_a_bad_block_inside_a_sequence_is_the_same_clear_error_in_every_form(form, entry):
    """-1 (or past the pool) among a sequence's used blocks: one ValueError naming row and position."""
    batch = make_batch([20, 40], [3, 1], block_size=16, pad_rows=0)
    table = batch.block_table.clone()
    table[1, 2] = entry  # sequence 1 reads blocks 0..2
    fns = {"paged_attention_fast": F.paged_attention_fast, "emulate_flash_attention": emulate_flash_attention}
    fn = fns.get(form) or getattr(K, form)
    kwargs = {k: v for k, v in batch.kwargs.items() if v is not None}
    with pytest.raises(
        ValueError, match=rf"block_table\[1\]\[2\] is {entry}: sequence 1 \(40 keys\) reads logical block 2"
    ):
        fn(*batch.args[:3], table, *batch.args[4:], **kwargs)
    table[1, 3] = -1  # past its blocks: never read, no error
    table[1, 2] = batch.block_table[1, 2]
    fn(*batch.args[:3], table, *batch.args[4:], **kwargs)


@pytest.mark.parametrize("form", ["paged_attention_loop", "paged_attention_fast", "paged_attention_partitioned"])
def test_block_table_too_narrow_is_a_clear_error(form):
    cache = torch.randn(4, 16, 1, 8)
    args = (torch.randn(1, 1, 8), cache, cache, torch.tensor([[0, 1]]), torch.tensor([40]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"block_table has 2 columns of 16 slots; sequence 0 has 40 keys"):
        getattr(F if form == "paged_attention_fast" else K, form)(*args, scale=0.1)
