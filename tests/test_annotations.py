"""Tests for ``annotations``: anchors on the real vLLM 0.26 sources, values, annotate, source storage."""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
from pathlib import Path

import pytest

from annotations import (
    ANCHORS,
    ANNOTATED_FILES,
    StepNotFound,
    anchors_for,
    annotate,
    locate,
    resolve_file,
)
from annotations.anchors import BLOCK_TABLE, CPU_ATTN, FLASH_ATTN, MATCH_MODES, PAGED_ATTN, Anchor
from annotations.annotate import file_role
from annotations.locate import keep_definitions, normalize_code
from annotations.values import (
    COMPUTED_PREFIX,
    VALUE_FUNCTIONS,
    TensorView,
    ViewError,
    split_kv_cache_summary,
    value_for,
)
from tests.conftest import fixture_path
from tests.factories import SITE, kv_spec, model_summary, needs_vllm_sources, run_info, scheduled_step
from tracer.format import (
    SOURCE_FILES,
    GapRecord,
    KVCacheSpec,
    RunInfo,
    StepRecord,
    Trace,
    TraceWriter,
    read_sources,
    sha256_text,
    store_sources,
)

LAYER = "model.layers.0.self_attn.attn"


def vllm_source(path: str) -> str:
    """Text of one installed vLLM file (read, never imported)."""
    return (SITE / path).read_text(encoding="utf-8")


def make_spec(layout: str = "flash_nhd", dtype: str = "bfloat16", element_size: int = 2) -> KVCacheSpec:
    """64 blocks x 16 tokens x 2 KV heads x D=64, as FlashAttention (NHD) or the CPU backend allocates it."""
    stride = {"flash_nhd": (4096, 128, 256, 1), "flash_hnd": (4096, 2048, 128, 1), "cpu": (4096, 2048, 128, 1)}[layout]
    return kv_spec(
        dtype=dtype,
        cache_dtype="auto" if element_size == 2 else "fp8_e4m3",
        element_size=element_size,
        stride=stride,
        layout=layout,
        physical_order="(blocks, tokens, heads, K|V)" if layout == "flash_nhd" else "(blocks, heads, K^T|V)",
        backend_stride_order=(0, 2, 1, 3) if layout == "flash_nhd" else None,
    )


def make_run(spec: KVCacheSpec | None = None, sources: dict | None = None, backend: str = "flash") -> RunInfo:
    """A RunInfo for a small FlashAttention (or CPU) run."""
    return run_info(
        backend,
        model=model_summary(),
        kv_cache=spec if spec is not None else make_spec(),
        created_at="2026-01-01T00:00:00Z",
        sources=sources or {},
    )


def make_record(
    step: int, query_lens, seq_lens, block_table, kind: str = "request", layer: str = LAYER, block_size: int = 16
) -> StepRecord:
    """A record whose slot_mapping follows the block table, as vLLM computes it."""
    return scheduled_step(step, query_lens, seq_lens, block_table, block_size=block_size, kind=kind, layer=layer)


@pytest.fixture
def small_trace(tmp_path) -> Trace:
    """A two-step trace with the real vLLM sources stored, and a gap at step 1."""
    with TraceWriter(tmp_path / "trace") as writer:
        sources = store_sources(writer, read_sources(SITE)) if SITE else {}
        writer.write_manifest(make_run(sources=sources))
        writer.append(make_record(0, [20, 8], [20, 24], [[1, 2], [1, 3]]))
        writer.append(GapRecord(step=1, kind="request", reason="cuda-graph-replay", num_tokens=2))
        writer.append(make_record(2, [1, 1], [22, 26], [[1, 2], [1, 3]]))
    return Trace.open(tmp_path / "trace")


# --- the anchor table ----------------------------------------------------------------


def test_annotated_files_are_the_files_the_tracer_stores():
    assert set(ANNOTATED_FILES) == set(SOURCE_FILES)


def test_anchor_table_is_well_formed():
    keys = [a.key for a in ANCHORS]
    assert len(keys) == len(set(keys))
    for anchor in ANCHORS:
        assert anchor.file in ANNOTATED_FILES
        assert anchor.match in MATCH_MODES
        assert anchor.value in VALUE_FUNCTIONS, anchor.key
        assert (anchor.pattern == "") == (anchor.match == "def"), anchor.key
    assert all(anchors_for(path) for path in ANNOTATED_FILES)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("flash_attn.py", FLASH_ATTN),
        ("flash_attn", FLASH_ATTN),
        (FLASH_ATTN, FLASH_ATTN),
        ("backends/cpu_attn.py", CPU_ATTN),
        ("paged_attn.py", PAGED_ATTN),
        ("nope.py", None),
        ("attn.py", None),
    ],
)
def test_resolve_file(name, expected):
    assert resolve_file(name) == expected


@pytest.mark.parametrize(
    "code, normal",
    [
        ("(num_blocks, num_kv_heads,\n block_size, 2 * head_size)", "num_blocks,num_kv_heads,block_size,2*head_size"),
        ("f(a, b,)", "f(a,b)"),
        ("(a)(b)", "(a)(b)"),
    ],
)
def test_normalize_code(code, normal):
    assert normalize_code(code) == normal


# --- locating anchors in the real vLLM 0.26 sources ---------------------------------


@needs_vllm_sources
@pytest.mark.parametrize("path", ANNOTATED_FILES)
def test_every_anchor_resolves_on_vllm_026(path):
    text = vllm_source(path)
    located = locate(text, path)
    assert located.error == ""
    assert [loc.anchor.key for loc in located.missing] == []
    lines = text.splitlines()
    for loc in located.locations.values():
        anchor = loc.anchor
        line = lines[loc.line - 1]
        if anchor.match == "def":
            assert f"def {anchor.qualname.rsplit('.', 1)[-1]}" in line
        elif anchor.match in ("assign", "call"):
            assert normalize_code(anchor.pattern.split(",")[0]) in normalize_code(line), (anchor.key, line)
    # Anchors sit inside their own function.
    for loc in located.locations.values():
        span = located.functions[loc.anchor.qualname]
        assert span.def_line <= loc.line <= span.end_line


@needs_vllm_sources
def test_known_lines_in_vllm_026():
    """Spot checks against lines read by hand in vLLM 0.26.0."""
    fa = locate(vllm_source(FLASH_ATTN), FLASH_ATTN).locations
    assert (
        "num_actual_tokens = attn_metadata.num_actual_tokens"
        in vllm_source(FLASH_ATTN).splitlines()[fa["flash_attn.forward.num_actual_tokens"].line - 1]
    )
    # The forward split and the do_kv_cache_update split are the same expression in two functions.
    assert fa["flash_attn.forward.split"].line != fa["flash_attn.do_kv_cache_update.split"].line
    pa = locate(vllm_source(PAGED_ATTN), PAGED_ATTN).locations
    assert pa["paged_attn.split_kv_cache.x"].line == pa["paged_attn.split_kv_cache"].line + 5


@needs_vllm_sources
@pytest.mark.parametrize("path", ANNOTATED_FILES)
def test_shifted_source_still_finds_anchors(path):
    text = vllm_source(path)
    before = locate(text, path).locations
    after = locate("\n" * 10 + text, path).locations
    assert {k: loc.line + 10 for k, loc in before.items()} == {k: loc.line for k, loc in after.items()}


@needs_vllm_sources
def test_renamed_function_gives_a_not_found_note(small_trace):
    text = vllm_source(PAGED_ATTN).replace("def split_kv_cache(", "def split_kv_cache_v2(")
    annotated = annotate(text, PAGED_ATTN, small_trace)
    missing = {n.anchor: n.text for n in annotated.missing}
    assert "paged_attn.split_kv_cache.x" in missing
    assert missing["paged_attn.split_kv_cache.x"] == "function PagedAttention.split_kv_cache not found"
    assert "paged_attn.write_to_paged_cache" not in missing
    assert len(annotated.lines) == len(text.splitlines())


@needs_vllm_sources
def test_edited_expression_gives_a_not_found_note(small_trace):
    text = vllm_source(PAGED_ATTN).replace("x = 16 // kv_cache.element_size()", "xx = 16 // kv_cache.element_size()")
    annotated = annotate(text, PAGED_ATTN, small_trace)
    missing = {n.anchor: n.text for n in annotated.missing}
    assert list(missing) == ["paged_attn.split_kv_cache.x"]
    assert "not found in PagedAttention.split_kv_cache" in missing["paged_attn.split_kv_cache.x"]


def test_keep_definitions_blanks_other_statements_line_for_line():
    text = "import os\n\n@deco(\n  1)\ndef f():\n    return 1\n\nX = 2\nclass C:\n    pass\n"
    kept = keep_definitions(text, {"f"})
    assert kept.split("\n") == ["", "", "@deco(", "  1)", "def f():", "    return 1", "", "", "", "", ""]
    assert keep_definitions("def broken(:\n", {"broken"}) == "def broken(:\n"


def test_unparsable_source_marks_every_anchor_missing():
    located = locate("def broken(:\n", PAGED_ATTN)
    assert located.error.startswith("source does not parse")
    assert len(located.missing) == len(anchors_for(PAGED_ATTN))


def test_same_expression_in_a_nested_function_does_not_match():
    text = (
        "class PagedAttention:\n"
        "    def split_kv_cache(kv_cache):\n"
        "        def helper():\n"
        "            x = 1\n"
        "        x = 16 // kv_cache.element_size()\n"
    )
    anchor = Anchor("k", PAGED_ATTN, "PagedAttention.split_kv_cache", "assign", "x", "x", "split_x")
    assert locate(text, PAGED_ATTN, [anchor]).locations["k"].line == 5


# --- values ---------------------------------------------------------------------------


def _anchor(key: str) -> Anchor:
    return next(a for a in ANCHORS if a.key == key)


def test_split_kv_cache_x_is_8_for_bf16_and_16_for_fp8():
    rec = make_record(0, [3], [3], [[1]])
    bf16 = value_for(_anchor("paged_attn.split_kv_cache.x"), rec, make_run())
    assert bf16.kind == "computed"
    assert bf16.text.startswith(COMPUTED_PREFIX)
    assert "x = 16 // 2 = 8" in bf16.text
    fp8 = make_run(make_spec(dtype="uint8", element_size=1))
    assert "x = 16 // 1 = 16" in value_for(_anchor("paged_attn.split_kv_cache.x"), rec, fp8).text


def test_split_kv_cache_on_the_026_cache_reads_block_0():
    run = make_run()
    num_blocks = value_for(_anchor("paged_attn.split_kv_cache.num_blocks"), None, run).text
    assert "kv_cache.shape[1] = 2" in num_blocks and "num_kv_heads" in num_blocks
    key = value_for(_anchor("paged_attn.split_kv_cache.key_index"), None, run).text
    assert "block 0" in key and "shape (2, 16, 128) strides (128, 256, 1)" in key
    value = value_for(_anchor("paged_attn.split_kv_cache.value_index"), None, run).text
    assert "block 1" in value and "offset +4096" in value
    # On the NHD cache block 1 is not contiguous: the value view fails, as torch's would.
    assert "would fail" in value_for(_anchor("paged_attn.split_kv_cache.value_view"), None, run).text
    not_called = value_for(_anchor("paged_attn.split_kv_cache"), None, run)
    assert not_called.kind == "static" and "not called" in not_called.text and "ROCm" in not_called.text


def test_flash_split_strides_for_nhd():
    text = value_for(_anchor("flash_attn.forward.split"), None, make_run()).text
    assert "key_cache shape (64, 16, 2, 64) strides (4096, 256, 128, 1)" in text
    assert "value_cache shape (64, 16, 2, 64) strides (4096, 256, 128, 1) offset +64" in text


def test_cpu_chunk_for_the_cpu_layout():
    run = make_run(make_spec("cpu"), backend="cpu")
    text = value_for(_anchor("cpu_attn.forward.chunk"), None, run).text
    assert "key_cache shape (64, 2, 16, 64) strides (4096, 2048, 64, 1)" in text
    assert "value_cache shape (64, 2, 16, 64) strides (4096, 2048, 64, 1) offset +1024" in text
    assert "K^T [64][16]" in text


def amx_spec() -> KVCacheSpec:
    """The CPU cache of ``make_spec("cpu")`` as the AMX ISA packs it (block size 32)."""
    return dataclasses.replace(
        make_spec("cpu"),
        block_size=32,
        shape=(64, 2, 32, 128),
        stride=(8192, 4096, 128, 1),
        backend_kv_cache_shape=(64, 2, 32, 128),
        layout="cpu_amx",
        physical_order="(blocks, heads, [K | V] packed in AMX tiles)",
    )


def test_cpu_chunk_follows_the_recorded_layout():
    run = make_run(amx_spec(), backend="cpu")
    text = value_for(_anchor("cpu_attn.forward.chunk"), None, run).text
    assert "key_cache shape (64, 2, 32, 64) strides (8192, 4096, 64, 1)" in text
    assert "K as [bs/16][D/2][16][2] = [2][32][16][2]" in text and "V as [D/16][bs/2][16][2] = [4][16][16][2]" in text
    assert "K^T" not in text and "(cpu_amx)" in text


def test_cpu_file_role_follows_the_recorded_layout():
    vec = file_role(CPU_ATTN, make_run(make_spec("cpu"), backend="cpu"))
    assert "layout cpu" in vec and "K^T [64][16] in the key half, then V [16][64]" in vec
    amx = file_role(CPU_ATTN, make_run(amx_spec(), backend="cpu"))
    assert "layout cpu_amx" in amx and "[2][32][16][2]" in amx and "K^T" not in amx
    # On a FlashAttention trace the CPU file's role names both packings, neither as this trace's.
    flash = file_role(CPU_ATTN, make_run())
    assert "vec/vec16" in flash and "AMX" in flash and "this trace" not in flash
    assert file_role(FLASH_ATTN, make_run()).startswith("The FlashAttention backend")


def test_split_kv_cache_on_the_h200_fa3_cache():
    """The committed H200 FA3 cache: (num_blocks, 4, 16, 256) bf16, NHD strides."""
    spec = Trace.open(fixture_path("h200-qwen2.5-7b-eager")).run.kv_cache
    assert spec.shape[1:] == (4, 16, 256) and spec.stride == (16384, 256, 1024, 1)
    run = make_run(spec)
    assert "x = 16 // 2 = 8" in value_for(_anchor("paged_attn.split_kv_cache.x"), None, run).text
    num_blocks = value_for(_anchor("paged_attn.split_kv_cache.num_blocks"), None, run).text
    assert (
        f"num_blocks = kv_cache.shape[1] = 4: on the 0.26 cache dim 1 is num_kv_heads, not the {spec.num_blocks}"
        in num_blocks
    )
    key = value_for(_anchor("paged_attn.split_kv_cache.key_index"), None, run).text
    assert "kv_cache[0] is block 0" in key and "shape (4, 16, 256) strides (256, 1024, 1)" in key
    for k in ("key_view", "value_view"):
        assert (
            "would fail in torch (RuntimeError: view size is not compatible"
            in value_for(_anchor(f"paged_attn.split_kv_cache.{k}"), None, run).text
        )
    summary = split_kv_cache_summary(spec)
    assert "kv_cache.shape[1] = 4 (that is num_kv_heads" in summary and "view(4, 4, 16, -1, 8) would fail" in summary


def test_forward_values():
    rec = make_record(4, [20, 8], [20, 24], [[1, 2], [1, 3]])
    run = make_run()
    assert value_for(_anchor("flash_attn.forward.num_actual_tokens"), rec, run).text == "num_actual_tokens = 28"
    assert "[0, 20, 28]" in value_for(_anchor("flash_attn.forward.cu_seqlens_q"), rec, run).text
    assert value_for(_anchor("flash_attn.forward.seqused_k"), rec, run).text == "seq_lens = [20, 24]"
    assert "req-1 [1, 3]" in value_for(_anchor("flash_attn.forward.block_table"), rec, run).text
    assert "FA3" in value_for(_anchor("flash_attn.forward.flash_attn_varlen_func"), rec, run).text
    assert "(no window)" in value_for(_anchor("flash_attn.forward.window"), rec, run).text
    write = value_for(_anchor("flash_attn.do_kv_cache_update.reshape_and_cache_flash"), rec, run).text
    assert "-> blocks [1, 2, 3]" in write and "28 tokens written" in write
    # Values that need a step give nothing without one.
    assert value_for(_anchor("flash_attn.forward.num_actual_tokens"), None, run) is None


def test_block_table_slot_formula_checks_the_captured_slot_mapping():
    rec = make_record(4, [2, 1], [18, 25], [[1, 2], [1, 3]])
    run = make_run()
    text = value_for(_anchor("block_table.kernel.slot_ids"), rec, run).text
    assert "req-0: [32, 33]; req-1: [56]" in text and "matches the captured slot_mapping" in text
    broken = StepRecord(**{**rec.to_json(), "slot_mapping": (32, 34, 56)})
    assert (
        "differs from the captured slot_mapping at token 1"
        in value_for(_anchor("block_table.kernel.slot_ids"), broken, run).text
    )


def test_long_lists_are_cut():
    rec = make_record(0, [100], [100], [list(range(1, 8))])
    text = value_for(_anchor("attention.get_attention_context.slot_mapping"), rec, make_run()).text
    assert "… +84 more" in text


def test_tensor_view_matches_torch():
    torch = pytest.importorskip("torch")
    rng = random.Random(0)
    for _ in range(500):
        shape = [rng.choice([1, 2, 3, 4]) for _ in range(rng.randint(1, 4))]
        tensor = torch.empty(*shape).permute(*rng.sample(range(len(shape)), len(shape)))
        numel, new = tensor.numel(), []
        while numel > 1 and len(new) < 3:
            d = rng.choice([x for x in range(1, numel + 1) if numel % x == 0])
            new.append(d)
            numel //= d
        new.append(numel)
        view = TensorView(tuple(tensor.shape), tuple(tensor.stride()))
        try:
            expected = tuple(tensor.view(*new).stride())
        except RuntimeError:
            expected = None
        try:
            got = view.view(*new).stride
        except ViewError:
            got = None
        if expected is None or got is None:
            assert expected == got, (shape, new)
        else:  # strides of size-1 dims are arbitrary
            assert all(a == b or n == 1 for a, b, n in zip(expected, got, new, strict=False)), (shape, new)


# --- annotate -------------------------------------------------------------------------


@needs_vllm_sources
def test_annotate_puts_values_on_the_right_lines(small_trace):
    text = small_trace.source(FLASH_ATTN)
    annotated = annotate(text, FLASH_ATTN, small_trace)
    assert annotated.step == 0 and annotated.layer == LAYER
    assert annotated.missing == ()
    assert len(annotated.lines) == len(text.splitlines())
    by_label = {n.anchor: n for n in annotated.notes}
    line = annotated.lines[by_label["flash_attn.forward.num_actual_tokens"].line - 1]
    assert "num_actual_tokens = attn_metadata.num_actual_tokens" in line.text
    assert [n.text for n in line.notes] == ["num_actual_tokens = 28"]
    later = annotate(text, FLASH_ATTN, small_trace, step=2)
    assert {n.anchor: n.text for n in later.notes}["flash_attn.forward.num_actual_tokens"] == "num_actual_tokens = 2"


@needs_vllm_sources
def test_annotate_notes_that_the_cpu_file_is_off_this_runs_path(small_trace):
    annotated = annotate(small_trace.source(CPU_ATTN), CPU_ATTN, small_trace)
    assert any("FlashAttentionImpl" in note for note in annotated.file_notes)
    paged = annotate(small_trace.source(PAGED_ATTN), PAGED_ATTN, small_trace).file_notes
    assert any("Not called on vLLM 0.26" in note for note in paged)
    # ... and says plainly what split_kv_cache would make of this run's cache.
    summary = next(note for note in paged if note.startswith("Had it been called"))
    assert "x = 16 // 2 = 8" in summary and "kv_cache.shape[1] = 2 (that is num_kv_heads" in summary
    assert "nonsense" in summary


@needs_vllm_sources
def test_annotate_flags_a_source_that_differs_from_the_stored_one(small_trace):
    annotated = annotate(small_trace.source(BLOCK_TABLE) + "\n# edited\n", BLOCK_TABLE, small_trace)
    assert any("sha256 mismatch" in note for note in annotated.file_notes)


def test_annotate_unknown_steps_and_layers(small_trace):
    text = "x = 1\n"
    with pytest.raises(StepNotFound, match=r"not recorded .*cuda-graph-replay"):
        annotate(text, PAGED_ATTN, small_trace, step=1)
    with pytest.raises(StepNotFound, match="recorded steps: 0, 2"):
        annotate(text, PAGED_ATTN, small_trace, step=7)
    with pytest.raises(StepNotFound, match="layer 'nope'"):
        annotate(text, PAGED_ATTN, small_trace, layer="nope")


# --- storing sources (for the tracer) ---------------------------------------------------


def test_store_sources_keeps_only_annotated_files(tmp_path):
    texts = {PAGED_ATTN: "a = 1\n", "vllm/other.py": "b = 2\n"}
    with TraceWriter(tmp_path) as writer:
        entries = store_sources(writer, texts)
    assert entries == {PAGED_ATTN: {"file": f"sources/{PAGED_ATTN}", "sha256": sha256_text("a = 1\n")}}
    assert (tmp_path / entries[PAGED_ATTN]["file"]).read_text() == "a = 1\n"


@needs_vllm_sources
def test_read_sources_reads_every_annotated_file():
    assert set(read_sources(SITE)) == set(ANNOTATED_FILES)
    assert read_sources(SITE / "nowhere") == {}


def test_annotations_and_reports_import_neither_torch_nor_vllm():
    code = (
        "import sys, annotations, reports, reports.build, pagedtrace.commands.annotate, pagedtrace.commands.report\n"
        "bad = sorted(m for m in ('torch', 'vllm') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)


def test_cpu_packing_texts_agree_with_the_layout_registry():
    from annotations.anchors import FILE_ROLES
    from annotations.values import CPU_LAYOUTS, cpu_region_text
    from tracer.format import REGISTRY, describe_layout
    from tracer.format.layouts import LAYOUT_CPU, LAYOUT_CPU_AMX

    assert CPU_LAYOUTS == (LAYOUT_CPU, LAYOUT_CPU_AMX)
    assert cpu_region_text("flash_nhd", 32, 64) is None
    symbols = {LAYOUT_CPU: ("[D][bs]", "[bs][D]"), LAYOUT_CPU_AMX: ("[bs/16][D/2][16][2]", "[D/16][bs/2][16][2]")}
    for layout, (k_symbol, v_symbol) in symbols.items():
        assert k_symbol in REGISTRY[layout].description and v_symbol in REGISTRY[layout].description
        assert k_symbol in FILE_ROLES[CPU_ATTN] and v_symbol in FILE_ROLES[CPU_ATTN]
        for bs, d in ((32, 64), (64, 128), (16, 32)):
            text = cpu_region_text(layout, bs, d)
            desc = describe_layout(layout, 1, 1, bs, d)
            # K and V of one (block, head) region: the views' shapes without the block and head dims.
            k_dims, v_dims = ("".join(f"[{n}]" for n in view.shape[2:]) for view in (desc.k_view, desc.v_view))
            assert text.index(k_dims) < text.index("in the key half") < text.index(v_dims), (layout, text)
            if layout == LAYOUT_CPU_AMX:
                assert f"{k_symbol} = {k_dims}" in text and f"{v_symbol} = {v_dims}" in text
