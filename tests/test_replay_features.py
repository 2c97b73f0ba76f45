"""Replay of recorded model features (attention sinks, ALiBi) on a small synthetic trace.

The trace is written with the real ``TraceWriter``; its output comes from the reference
kernel *with* the feature, so replay must pass only when it reads the feature back from
the record.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from reference_impl.fast import paged_attention_fast
from reference_impl.layouts import kv_to_flash
from reference_impl.replay import replay_trace
from tests.factories import run_info
from tracer.format import MANIFEST, STEPS, KVCacheSpec, StepRecord, Trace, TraceError, TraceWriter

NB, BS, H, HKV, D = 6, 16, 4, 2, 32
TABLE = (3, 1, 5)  # logical block j of the one request lives in physical block TABLE[j]
SEQ = 40


def _write_trace(path, *, sinks=None, alibi=None) -> None:
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(SEQ, HKV, D, generator=gen).bfloat16()
    v = torch.randn(SEQ, HKV, D, generator=gen).bfloat16()
    q = (2 * torch.randn(SEQ, H, D, generator=gen)).bfloat16()
    key_cache = torch.zeros(NB, BS, HKV, D, dtype=torch.bfloat16)
    value_cache = torch.zeros_like(key_cache)
    slots = [TABLE[p // BS] * BS + p % BS for p in range(SEQ)]
    key_cache.view(-1, HKV, D)[slots] = k
    value_cache.view(-1, HKV, D)[slots] = v
    kv_cache = kv_to_flash(key_cache, value_cache, "NHD")
    kwargs = dict(scale=D**-0.5, causal=True)
    if sinks is not None:
        kwargs["sinks"] = torch.tensor(sinks)
    if alibi is not None:
        kwargs["alibi_slopes"] = torch.tensor(alibi)
    out = paged_attention_fast(
        q,
        key_cache,
        value_cache,
        torch.tensor([TABLE]),
        torch.tensor([SEQ]),
        torch.tensor([0, SEQ]),
        compute_dtype=torch.float64,
        **kwargs,
    ).bfloat16()
    spec = KVCacheSpec(
        layer_names=("l0",),
        num_blocks=NB,
        block_size=BS,
        num_kv_heads=HKV,
        head_size=D,
        dtype="bfloat16",
        cache_dtype="auto",
        element_size=2,
        shape=tuple(kv_cache.shape),
        stride=tuple(kv_cache.stride()),
        layout="flash_nhd",
        physical_order="(blocks, tokens, heads, K|V)",
        k_scale=1.0,
        v_scale=1.0,
        backend_kv_cache_shape=tuple(kv_cache.shape),
        backend_stride_order=(0, 2, 1, 3),
    )
    run = run_info(
        pagedtrace_version="0",
        torch_version=torch.__version__,
        platform="synthetic",
        attention_backend="synthetic",
        kv_cache=spec,
    )
    rec = StepRecord(
        step=1,
        layer="l0",
        kind="request",
        request_ids=("0-x",),
        num_actual_tokens=SEQ,
        query_start_loc=(0, SEQ),
        seq_lens=(SEQ,),
        block_table=(TABLE,),
        slot_mapping=tuple(slots),
        max_query_len=SEQ,
        max_seq_len=SEQ,
        causal=True,
        sliding_window=(-1, -1),
        logits_soft_cap=0.0,
        scale=D**-0.5,
        use_cascade=False,
        num_splits=0,
        num_heads=H,
        num_kv_heads=HKV,
        head_size=D,
        sinks=tuple(sinks) if sinks is not None else None,
        alibi_slopes=tuple(alibi) if alibi is not None else None,
    )
    ids = sorted(TABLE)
    with TraceWriter(path) as w:
        w.write_manifest(run)
        w.append(
            rec,
            {
                "query": q,
                "output": out,
                "key": k,
                "value": v,
                "kv_blocks": kv_cache[ids].contiguous(),
                "kv_block_ids": torch.tensor(ids, dtype=torch.int32),
            },
        )


def _drop(path, field: str) -> None:
    lines = [json.loads(l) for l in (path / STEPS).read_text().splitlines()]
    for line in lines:
        line[field] = None
    (path / STEPS).write_text("".join(json.dumps(l) + "\n" for l in lines))


@pytest.mark.parametrize(
    "feature, value",
    [
        ("sinks", [2.0, -1.0, 3.0, 0.5]),
        ("alibi_slopes", [0.5, 0.25, 0.125, 0.0625]),
    ],
)
def test_replay_reads_the_recorded_feature(tmp_path, feature, value):
    path = tmp_path / "t"
    _write_trace(path, **{"sinks" if feature == "sinks" else "alibi": value})
    report = replay_trace(Trace.open(path))
    assert report.ok and len(report.steps) == 1
    assert all(w.ok and w.tokens == SEQ for w in report.write_path)
    _drop(path, feature)  # a tracer that forgot the feature: replay must notice
    bad = replay_trace(Trace.open(path), check_write=False, check_legacy=False)
    assert not bad.ok and bad.steps[0].max_abs > 5 * bad.steps[0].tol


def test_records_without_the_fields_still_load(tmp_path):
    """Traces written before these fields (the committed H200 fixtures) read as None."""
    path = tmp_path / "t"
    _write_trace(path)
    lines = [json.loads(l) for l in (path / STEPS).read_text().splitlines()]
    for line in lines:
        del line["sinks"], line["alibi_slopes"]
    (path / STEPS).write_text("".join(json.dumps(l) + "\n" for l in lines))
    with pytest.raises(TraceError, match=r"missing fields \['alibi_slopes', 'sinks'\]"):
        Trace.open(path)  # format 2 writes every field: a missing one is an error
    manifest = json.loads((path / MANIFEST).read_text())
    (path / MANIFEST).write_text(json.dumps({**manifest, "format_version": 1}))
    rec = Trace.open(path).records[0]
    assert rec.sinks is None and rec.alibi_slopes is None
    assert dataclasses.replace(rec, sinks=(1.0,)).sinks == (1.0,)
