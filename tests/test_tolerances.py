"""The bar: FlashAttention's rounding emulated, a relative floor, per head, form-independent.

Synthetic traces shaped like real models' layers (Gemma-2, Llama, fp8) are written with the real ``TraceWriter``;
the "engine" output is :func:`emulate_flash_attention` itself (what FA computes, to its
rounding), so a correct step must pass and a planted bug (scale x1.02, soft-cap x1.1, K<->V,
a zeroed output, a wrong fp8 scale) must fail, whichever reference form gives the fp64 answer.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from reference_impl import tolerances as TOL
from reference_impl.emulation import (
    CPU_VEC_NEAREST,
    CPU_VEC_TOWARD_ZERO,
    FLASH,
    _truncate_to_bf16,
    emulate_flash_attention,
    emulation_of,
    interval_midpoints,
    quantize_query,
)
from reference_impl.kernel import paged_attention_loop
from reference_impl.layouts import kv_to_flash
from reference_impl.replay import replay_record, replay_trace
from reference_impl.resolve import quantize_like_cache
from tests.factories import make_batch, run_info
from tracer.format import (
    MANIFEST,
    STEPS,
    KVCacheSpec,
    ReplayReport,
    StepRecord,
    Tolerance,
    Trace,
    TraceError,
    TraceWriter,
)

BS = 16
#: Two requests: a chunk of prefill (24 new of 70) and a decode row (1 new of 50).
SEQ_LENS, Q_LENS = (70, 50), (24, 1)


@dataclasses.dataclass
class Shape:
    """One synthetic attention layer (defaults: Gemma-2-like)."""

    heads: int = 4
    kv_heads: int = 2
    head_size: int = 256
    softcap: float = 50.0
    window: tuple[int, int] = (31, 0)
    qk_std: float = 3.0  #: logits of tens, as Gemma-2's
    v_std: float = 4.0  #: outputs of ~13
    k_std: float | None = None  #: None: qk_std
    fp8: bool = False
    q_scale: float = 1.0
    k_scale: float = 1.0
    v_scale: float = 1.0


def _caches(shape: Shape, seed: int = 0):
    """Physical caches in the activation dtype, the block table and the new tokens' K/V."""
    gen = torch.Generator().manual_seed(seed)
    tables, start, slots, new_k, new_v = [], 1, [], [], []
    nb = 1 + sum(math.ceil(s / BS) for s in SEQ_LENS)
    k_std = shape.qk_std if shape.k_std is None else shape.k_std
    key = (k_std * torch.randn(nb, BS, shape.kv_heads, shape.head_size, generator=gen)).bfloat16()
    value = (shape.v_std * torch.randn(nb, BS, shape.kv_heads, shape.head_size, generator=gen)).bfloat16()
    for s, q in zip(SEQ_LENS, Q_LENS, strict=True):
        n = math.ceil(s / BS)
        row = list(range(start + n - 1, start - 1, -1))  # blocks in reverse physical order
        start += n
        tables.append(tuple(row))
        for p in range(s - q, s):
            slots.append(row[p // BS] * BS + p % BS)
    flat_k, flat_v = key.view(-1, shape.kv_heads, shape.head_size), value.view(-1, shape.kv_heads, shape.head_size)
    new_k, new_v = flat_k[slots].clone(), flat_v[slots].clone()
    query = (shape.qk_std * torch.randn(sum(Q_LENS), shape.heads, shape.head_size, generator=gen)).bfloat16()
    return query, key, value, tables, slots, new_k, new_v


def write_trace(
    path, shape: Shape, *, engine=None, record_overrides=None, capture_bf16_query=False, cpu_attention=None
) -> None:
    """A one-step trace of ``shape``; vLLM's ``output`` is ``engine(**args)`` (default: the emulation).

    With ``fp8`` the query is captured quantised (what reaches FA3), or as bf16 with
    ``capture_bf16_query``. ``cpu_attention``: the manifest's ``extra["cpu_attention"]`` (the
    CPU kernel and its bf16 conversion, ``tracer.manifest``).
    """
    query, key, value, tables, slots, new_k, new_v = _caches(shape)
    captured = query
    if shape.fp8:
        key = quantize_like_cache(key, torch.uint8, shape.k_scale)
        value = quantize_like_cache(value, torch.uint8, shape.v_scale)
        query = quantize_query(query, shape.q_scale)  # what reached attention, as vLLM quantised it
        captured = captured if capture_bf16_query else query
    width = max(len(r) for r in tables)
    table = torch.tensor([list(r) + [0] * (width - len(r)) for r in tables])
    qsl = torch.tensor([0, Q_LENS[0], sum(Q_LENS)])
    args = dict(
        query=query, key_cache=key, value_cache=value, block_table=table, seq_lens=torch.tensor(SEQ_LENS),
        query_start_loc=qsl, scale=shape.head_size**-0.5, causal=True, window=shape.window, softcap=shape.softcap,
        k_scale=shape.k_scale, v_scale=shape.v_scale, q_scale=shape.q_scale, out_dtype=torch.bfloat16,
    )  # fmt: skip
    output = (engine or emulate_flash_attention)(**args)
    kv_cache = kv_to_flash(key, value, "NHD")
    spec = KVCacheSpec(
        layer_names=("l0",), num_blocks=key.shape[0], block_size=BS, num_kv_heads=shape.kv_heads,
        head_size=shape.head_size, dtype="uint8" if shape.fp8 else "bfloat16",
        cache_dtype="fp8" if shape.fp8 else "auto", element_size=1 if shape.fp8 else 2,
        shape=tuple(kv_cache.shape), stride=tuple(kv_cache.stride()), layout="flash_nhd",
        physical_order="(blocks, tokens, heads, K|V)", k_scale=1.0, v_scale=1.0,
        backend_kv_cache_shape=tuple(kv_cache.shape), backend_stride_order=(0, 2, 1, 3),
    )  # fmt: skip
    fields = dict(
        step=1, layer="l0", kind="request", request_ids=("a", "b"), num_actual_tokens=sum(Q_LENS),
        query_start_loc=tuple(qsl.tolist()), seq_lens=SEQ_LENS, block_table=tuple(tables),
        slot_mapping=tuple(slots), max_query_len=max(Q_LENS), max_seq_len=max(SEQ_LENS), causal=True,
        sliding_window=shape.window, logits_soft_cap=shape.softcap, scale=shape.head_size**-0.5,
        use_cascade=False, num_splits=0, num_heads=shape.heads, num_kv_heads=shape.kv_heads,
        head_size=shape.head_size,
    )  # fmt: skip
    if shape.fp8:
        fields.update(q_scale=shape.q_scale, k_scale=shape.k_scale, v_scale=shape.v_scale, query_dtype="float8_e4m3fn")
    fields.update(record_overrides or {})
    ids = sorted({b for r in tables for b in r})
    with TraceWriter(path) as w:
        extra = {"cpu_attention": cpu_attention} if cpu_attention else {}
        w.write_manifest(run_info("flash", kv_cache=spec, torch_version=torch.__version__, extra=extra))
        w.append(
            StepRecord(**fields),
            {
                "query": captured,
                "output": output,
                "key": new_k,
                "value": new_v,
                "kv_blocks": kv_cache[ids].contiguous(),
                "kv_block_ids": torch.tensor(ids, dtype=torch.int32),
            },
        )


def _mutated(**changes):
    """An engine that computes attention with some arguments changed (a kernel bug)."""

    def engine(**args):
        for name, change in changes.items():
            args[name] = change(args[name])
        return emulate_flash_attention(**args)

    return engine


def _replay(path, kernel="fast") -> ReplayReport:
    return replay_trace(Trace.open(path), kernel=kernel, check_legacy=False)


GEMMA = Shape()


def test_gemma2_like_step_passes_with_a_sharp_bar(tmp_path):
    write_trace(tmp_path / "t", GEMMA)
    step = _replay(tmp_path / "t").steps[0]
    assert step.ok, step
    ref_scale = step.max_abs / step.max_rel
    assert 8 < ref_scale < 40  # outputs of Gemma-2's magnitude (~13, Shape.v_std)
    # The bar is a few bf16 ulps at the output's scale, not 11-18 % of it.
    assert step.tol < 0.02 * ref_scale
    assert all(h.tol is not None and h.max_abs <= h.tol for h in step.heads)


def test_an_exact_kernel_passes_too(tmp_path):
    """fp64 attention rounded once to bf16 (no P rounding) is within the bar: the bar is not the emulation."""

    def exact(**args):
        args.pop("q_scale"), args.pop("out_dtype")
        return paged_attention_loop(**args, compute_dtype=torch.float64).bfloat16()

    write_trace(tmp_path / "t", GEMMA, engine=exact)
    assert _replay(tmp_path / "t").ok


def test_a_null_soft_cap_is_a_clear_error_on_load_and_no_soft_cap_in_replay(tmp_path):
    """vLLM's FlashAttentionImpl turns ``logits_soft_cap=None`` into 0 (no soft-cap)."""
    write_trace(tmp_path / "t", dataclasses.replace(GEMMA, softcap=0.0), record_overrides={"logits_soft_cap": None})
    with pytest.raises(TraceError, match="logits_soft_cap"):
        Trace.open(tmp_path / "t")  # not a TypeError traceback: the loader names the field
    write_trace(tmp_path / "ok", dataclasses.replace(GEMMA, softcap=0.0))
    trace = Trace.open(tmp_path / "ok")
    record = dataclasses.replace(trace.records[0], logits_soft_cap=None)  # a record built in Python
    result, _ = replay_record(record, trace.tensors(record), trace.run.kv_cache, "flash_nhd", check_legacy=False)
    assert result.ok and "logits_soft_cap is null: read as 0" in result.note


@pytest.mark.parametrize(
    "bug",
    [
        {"scale": lambda s: s * 1.02},
        {"scale": lambda s: s * 1.05},
        {"softcap": lambda c: c * 1.1},
    ],
    ids=["scale x1.02", "scale x1.05", "softcap x1.1"],
)
def test_gemma2_like_bugs_fail(tmp_path, bug):
    write_trace(tmp_path / "t", GEMMA, engine=_mutated(**bug))
    step = _replay(tmp_path / "t").steps[0]
    assert not step.ok and step.bad_heads, step
    # Outputs move by about one bf16 ulp: the max error may stay under the bar, the mean does not.
    assert step.max_abs > step.tol or "systematic shift" in step.note


LLAMA = Shape(softcap=0.0, window=(-1, -1), head_size=128, qk_std=1.0, v_std=1.0)


def _cpu_vec(emulation, scale=1.0):
    """vLLM's CPU vec kernel as its emulation computes it, optionally with a wrong softmax scale."""

    def engine(**args):
        args["scale"] *= scale
        return emulate_flash_attention(**args, emulation=emulation)

    return engine


@pytest.mark.parametrize("emulation", [CPU_VEC_TOWARD_ZERO, CPU_VEC_NEAREST], ids=lambda e: e.output_rounding)
@pytest.mark.parametrize("shape", [GEMMA, LLAMA], ids=["gemma-like", "llama-like"])
def test_cpu_vec_kernel_is_judged_by_its_own_rounding_and_a_2_percent_scale_fails(tmp_path, shape, emulation):
    info = {"isa": "vec", "bf16_conversion": emulation.output_rounding, "extension": None}
    write_trace(tmp_path / "ok", shape, engine=_cpu_vec(emulation), cpu_attention=info)
    report = _replay(tmp_path / "ok")
    assert report.ok, report.steps[0]
    assert report.tolerance.emulation == emulation.name  # replay.json says which kernel's rounding set the bar
    write_trace(tmp_path / "bad", shape, engine=_cpu_vec(emulation, scale=1.02), cpu_attention=info)
    assert not _replay(tmp_path / "bad").steps[0].ok


def test_a_truncating_cpu_kernel_judged_as_flash_attention_fails_so_the_manifest_says_how_it_rounds(tmp_path):
    # What an AVX2 host's trace got before its manifest said so: a correct step called a systematic shift.
    write_trace(tmp_path / "t", GEMMA, engine=_cpu_vec(CPU_VEC_TOWARD_ZERO))
    step = _replay(tmp_path / "t").steps[0]
    assert not step.ok and "systematic shift" in step.note


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, FLASH),
        ({"cpu_attention": {"isa": "vec", "bf16_conversion": "toward_zero"}}, CPU_VEC_TOWARD_ZERO),
        ({"cpu_attention": {"isa": "vec16", "bf16_conversion": "nearest"}}, CPU_VEC_NEAREST),
        ({"cpu_attention": {"isa": "amx", "bf16_conversion": "nearest"}}, FLASH),  # bf16 tiles: P rounded
        ({"cpu_attention": {"isa": "vec", "bf16_conversion": "unknown"}}, FLASH),
        ({"cpu_attention": "garbage"}, FLASH),
    ],
)
def test_emulation_of_a_trace(extra, expected):
    assert emulation_of(run_info("cpu", extra=extra)) == expected
    assert emulation_of(None) == FLASH


def test_truncated_values_are_read_at_the_middle_of_their_interval():
    x = torch.randn(50000, generator=torch.Generator().manual_seed(0)) * 7
    truncated = _truncate_to_bf16(x)
    wide = truncated.float()
    away = (wide.abs().view(torch.int32) + 65536).view(torch.float32)  # the next bf16 away from zero
    assert bool(((wide.abs() <= x.abs()) & (x.abs() < away)).all())  # toward zero, within an ulp
    mid = interval_midpoints(truncated, CPU_VEC_TOWARD_ZERO)
    assert torch.equal(mid.abs() * 2, wide.abs() + away)  # exactly the middle, in fp32
    rounded = float((x.bfloat16().float() - x).abs().mean())
    assert float((wide - x).abs().mean()) > 1.8 * rounded  # truncation: twice the error ...
    assert float((mid - x).abs().mean()) < 1.05 * rounded  # ... read at the middle: a rounding kernel's
    zero = torch.zeros(3, dtype=torch.bfloat16)
    assert torch.equal(interval_midpoints(zero, CPU_VEC_TOWARD_ZERO), zero.float())
    assert interval_midpoints(truncated, CPU_VEC_NEAREST) is truncated


TINY = Shape(softcap=0.0, window=(-1, -1), head_size=64, qk_std=1.0, k_std=1e-6, v_std=1e-6)


def test_tiny_outputs_pass_and_their_bugs_fail(tmp_path):
    write_trace(tmp_path / "ok", TINY)
    good = _replay(tmp_path / "ok").steps[0]
    assert good.ok and good.max_abs / good.max_rel < 1e-5  # every output below 1e-5
    write_trace(tmp_path / "zero", TINY, engine=lambda **a: torch.zeros_like(emulate_flash_attention(**a)))
    assert not _replay(tmp_path / "zero").steps[0].ok

    def swapped(**args):
        args["key_cache"], args["value_cache"] = args["value_cache"], args["key_cache"]
        return emulate_flash_attention(**args)

    write_trace(tmp_path / "kv", TINY, engine=swapped)
    assert not _replay(tmp_path / "kv").steps[0].ok


@pytest.mark.parametrize("case", ["scale", "swap"])
def test_the_verdict_and_the_bar_do_not_depend_on_the_reference_form(tmp_path, case):
    if case == "scale":
        write_trace(tmp_path / "t", GEMMA, engine=_mutated(scale=lambda s: s * 1.02))
    else:
        write_trace(tmp_path / "t", TINY, engine=lambda **a: torch.zeros_like(emulate_flash_attention(**a)))
    reports = {kernel: _replay(tmp_path / "t", kernel) for kernel in ("fast", "loop", "partitioned")}
    verdicts = {k: (r.ok, tuple(h.ok for h in r.steps[0].heads)) for k, r in reports.items()}
    assert len(set(verdicts.values())) == 1 and not reports["fast"].ok, verdicts
    tols = [r.steps[0].tol for r in reports.values()]
    assert max(tols) - min(tols) <= 1e-9 * max(tols)


# --------------------------------------------------------------------------- fp8

FP8 = Shape(heads=8, kv_heads=2, head_size=128, softcap=0.0, window=(-1, -1), qk_std=2.0, v_std=1.0, fp8=True,
            q_scale=0.02, k_scale=0.015, v_scale=0.01)  # fmt: skip


def test_fp8_step_as_vllm_runs_it_passes(tmp_path):
    write_trace(tmp_path / "t", FP8)
    report = _replay(tmp_path / "t")
    step = report.steps[0]
    assert report.ok, step
    assert step.baseline_max_abs > 10 * 2**-8 * 0.01  # P in e4m3 really is coarse: the bar means something
    assert "not recorded" not in step.note


def test_fp8_bf16_query_of_an_fa3_step_is_quantised_as_vllm_does(tmp_path):
    """A captured bf16 query with q_scale recorded on FA3: replay quantises it itself."""
    write_trace(tmp_path / "t", FP8, record_overrides={"query_dtype": "bfloat16"}, capture_bf16_query=True)
    assert Trace.open(tmp_path / "t").tensors(Trace.open(tmp_path / "t").records[0])["query"].dtype == torch.bfloat16
    assert _replay(tmp_path / "t").ok
    # Unquantised, the same query is another attention: the quantisation is what makes it pass.
    write_trace(tmp_path / "u", FP8, record_overrides={"query_dtype": "bfloat16", "q_scale": None},
                capture_bf16_query=True)  # fmt: skip
    assert not _replay(tmp_path / "u").ok


def test_fp8_wrong_k_scale_fails(tmp_path):
    write_trace(tmp_path / "t", FP8, record_overrides={"k_scale": FP8.k_scale * 1.02})
    report = _replay(tmp_path / "t")
    step = report.steps[0]
    assert not step.ok and step.bad_heads, step
    assert not report.write_path[0].ok  # the cache bytes are not the key / 1.02 k_scale either


def test_fp8_record_without_scales_uses_defaults_and_says_so(tmp_path):
    shape = dataclasses.replace(FP8, q_scale=1.0, k_scale=1.0, v_scale=1.0)
    write_trace(tmp_path / "t", shape)
    lines = [json.loads(line) for line in (tmp_path / "t" / STEPS).read_text().splitlines()]
    for line in lines:
        for name in ("q_scale", "k_scale", "v_scale", "query_dtype"):
            del line[name]
    (tmp_path / "t" / STEPS).write_text("".join(json.dumps(line) + "\n" for line in lines))
    manifest = json.loads((tmp_path / "t" / MANIFEST).read_text())
    (tmp_path / "t" / MANIFEST).write_text(json.dumps({**manifest, "format_version": 1}))
    step = _replay(tmp_path / "t").steps[0]
    assert step.ok, step
    assert "k/v scales not recorded" in step.note and "q_scale not recorded" in step.note


# --------------------------------------------------------------------------- the bar itself


def test_compare_holds_each_head_to_its_own_scale():
    gen = torch.Generator().manual_seed(0)
    expected = torch.randn(5, 3, 8, generator=gen, dtype=torch.float64)
    expected[:, 1] *= 1e-6  # head 1 is tiny
    baseline = expected.bfloat16()
    verdict = TOL.compare(expected.clone(), expected, baseline)
    eps = torch.finfo(torch.bfloat16).eps
    for h in range(3):
        base = float((baseline[:, h].double() - expected[:, h]).abs().max())
        floor = eps * float(expected[:, h].abs().max())
        assert verdict["per_head_tol"][h] == pytest.approx(TOL.TOL_K * base + floor)
    assert verdict["ok"]
    assert verdict["tol"] == pytest.approx(TOL.tolerance(expected, baseline))
    # Head 1 zeroed: its error (~1e-6) would pass any step-wide bar, not its own.
    bad = expected.clone()
    bad[:, 1] = 0
    verdict = TOL.compare(bad, expected, baseline)
    assert not verdict["ok"] and verdict["per_head_ok"] == [True, False, True]
    assert verdict["max_abs"] <= verdict["tol"]
    nan = expected.clone()
    nan[0, 0, 0] = math.nan
    assert not TOL.compare(nan, expected, baseline)["ok"]


def test_emulation_is_attention_to_fp32_rounding():
    """Without low-precision inputs the emulation is the reference up to fp32 sums."""
    batch = make_batch([40, 33, 8], [1, 6, 8], block_size=16, window=(9, 2), sinks=True, alibi=True, pad_rows=0)
    expected = batch.dense()
    kwargs = dict(batch.kwargs)
    out = emulate_flash_attention(*batch.args, **kwargs, out_dtype=torch.float32)
    assert float((out.double() - expected).abs().max()) < 1e-5
    loop = paged_attention_loop(*batch.args, **kwargs, compute_dtype=torch.float64)
    assert float((loop - expected).abs().max()) < 1e-12


def test_tolerance_record_says_what_the_bar_is_made_of():
    data = TOL.TOLERANCE.to_json()
    assert data["emulation"] == "flash-attention-rounding" and "P rounded" in data["emulation_description"]
    assert "eps(activation dtype)" in data["floor"] and data["eps"] == 0.0
    assert Tolerance.from_json(data) == TOL.TOLERANCE
    old = Tolerance.from_json({"k": 2.0, "eps": 1e-5, "reference_dtype": "float64"})  # replay.json before
    assert old == Tolerance(2.0, 1e-5, "float64") and old.emulation == ""
