"""Tests for ``reports`` and the ``report`` / ``annotate`` commands, on a small synthetic trace.

Gold pages live in ``tests/gold/report/``; dates and the trace path are masked
before comparing. Regenerate them with ``PAGEDTRACE_UPDATE_GOLD=1 pytest tests/test_reports.py``.
"""

from __future__ import annotations

import difflib
import io
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import replace
from html import unescape
from pathlib import Path

import pytest
from rich.console import Console

import pagedtrace.cli as cli
from annotations import locate
from annotations.anchors import FLASH_ATTN, PAGED_ATTN
from reports.build import render_site, write_report
from reports.common import step_page
from reports.index_page import unrecorded_steps
from reports.layout_view import layout_view
from reports.step_pages import MAX_OTHER_PAGES, pages_for_steps, slot_runs, step_view
from reports.tour import BLOCK_MARK, SOFTMAX_MARK, load_reference_source, plain_command, tour_marks
from reports.verdicts import layer_verdicts, read_replay
from reports.viewmodel import build_site
from tests.conftest import FIXTURES
from tests.factories import (
    SITE,
    kv_spec,
    model_summary,
    needs_vllm_sources,
    run_info,
    scheduled_step,
    with_sources_of,
)
from tracer.format import (
    GapRecord,
    HeadResult,
    KVCacheSpec,
    ReplayReport,
    RunInfo,
    StepRecord,
    StepResult,
    Tolerance,
    Trace,
    TraceWriter,
    WriteCheck,
    read_sources,
    store_sources,
)
from tracer.format.layouts import element_offset
from tracer.format.prefix import explain_prefix_cache
from tracer.format.walk import BlockLine, QueryWalk

GOLD = Path(__file__).parent / "gold" / "report"
UPDATE_GOLD = os.environ.get("PAGEDTRACE_UPDATE_GOLD") == "1"
L0, L1 = "model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"
BS = 16

#: Stands in for reference_impl.kernel.paged_attention_loop in gold pages, so they do not
#: change whenever the reference kernel does. Its ``# tour:`` marks are the kernel's kind.
FAKE_REFERENCE = (
    "reference_impl.kernel.paged_attention_loop",
    "def paged_attention_loop(query, key_cache, value_cache, block_table, seq_lens):\n"
    "    # Online-softmax state per (head, query)\n"
    "    for j in range(num_blocks):  # tour: block\n"
    "        physical = int(block_table[b, j])  # tour: block\n"
    "        m_new = torch.maximum(m, s.amax(dim=-1))  # tour: softmax\n"
    "        rescale = torch.exp(m - m_new)  # tour: softmax\n"
    "        l = rescale * l + p.sum(dim=-1)  # tour: softmax\n"
    "        acc = rescale[..., None] * acc + p @ v  # tour: softmax\n"
    "        m = m_new  #tour:softmax\n"
    "    return acc / l  # tour: softmax\n",
    120,
)


def _spec(layout: str) -> KVCacheSpec:
    flash = layout != "cpu"
    return kv_spec(
        layer_names=(L0, L1),
        block_size=BS,
        shape=(64, 2, BS, 128),
        stride=(4096, 128, 256, 1) if flash else (4096, 2048, 128, 1),
        layout=layout,
        physical_order="(blocks, tokens, heads, K|V)"
        if flash
        else "(blocks, heads, [K^T (D, tokens) | V (tokens, D)])",
        backend_kv_cache_shape=(64, 2, BS, 128),
        backend_stride_order=(0, 2, 1, 3) if flash else None,
    )


def _record(step: int, kind: str, ids, query_lens, seq_lens, table, layer: str) -> StepRecord:
    return scheduled_step(step, query_lens, seq_lens, table, block_size=BS, request_ids=ids, kind=kind, layer=layer)


#: The synthetic run: (step, kind, request ids, query lens, seq lens, block table), or a gap.
def _steps(req_a: str, req_b: str):
    return [
        (0, "warmup", [""], [16], [16], [[5]]),
        GapRecord(step=1, kind="warmup", reason="cuda-graph-capture", num_tokens=0),
        (2, "request", [req_a], [20], [20], [[1, 2]]),
        # req-b shares req-a's first block (a 16-token common prefix) and prefills the rest.
        (3, "request", [req_a, req_b], [1, 8], [21, 24], [[1, 2], [1, 3]]),
        (4, "request", [req_a, req_b], [1, 1], [22, 25], [[1, 2], [1, 3]]),
        GapRecord(step=5, kind="request", reason="cuda-graph-replay", num_tokens=2),
        (6, "request", [req_a, req_b, "req-c"], [1, 1, 5], [23, 26, 5], [[1, 2], [1, 3], [4]]),
    ]


def step_result(
    step: int,
    layer: str,
    ok: bool,
    max_abs: float = 0.0,
    max_rel: float = 0.0,
    tol: float = 0.01,
    heads: tuple[HeadResult, ...] = (),
) -> StepResult:
    """A replay result of one (step, layer), with the numbers the pages show."""
    return StepResult(
        step=step,
        layer=layer,
        kind="request",
        num_reqs=1,
        num_tokens=1,
        ok=ok,
        max_abs=max_abs,
        max_rel=max_rel,
        tol=tol,
        baseline_max_abs=tol / 2,
        heads=heads,
    )


def replay_json(*steps: StepResult, write_path: tuple[WriteCheck, ...] = ()) -> dict:
    """``replay.json`` as ``pagedtrace replay`` writes it."""
    return ReplayReport(
        kernel="fast",
        layout="flash_nhd",
        recorded_layout="flash_nhd",
        tolerance=Tolerance(2.0, 1e-5, "float64"),
        steps=steps,
        write_path=write_path,
        legacy=(),
    ).to_json()


REPLAY = replay_json(
    step_result(2, L0, True, 0.0012, 0.003, heads=tuple(HeadResult(h, True, 0.001, 0.002) for h in range(4))),
    step_result(
        3, L0, False, 0.5, 0.2, heads=tuple(HeadResult(h, h != 2, 0.5 if h == 2 else 0.001, 0.1) for h in range(4))
    ),
    write_path=(WriteCheck(step=2, layer=L0, ok=True, tokens=20, mismatches=0),),
)


def make_trace(
    path: Path,
    *,
    model: str = "tiny-llama",
    req_a: str = "req-a",
    req_b: str = "req-b",
    layers=(L0, L1),
    layout: str = "flash_nhd",
    replay=REPLAY,
    sources: bool = True,
) -> Path:
    """Write the synthetic trace: real vLLM sources, 5 recorded steps over 2 layers, 2 gaps."""
    flash = layout != "cpu"
    with TraceWriter(path) as writer:
        stored = store_sources(writer, read_sources(SITE)) if sources and SITE else {}
        writer.write_manifest(
            run_info(
                "flash" if flash else "cpu",
                device_name="NVIDIA H200" if flash else "test CPU",
                cudagraph_mode="PIECEWISE" if flash else "NONE",
                enforce_eager=not flash,
                model=model_summary(name=model, num_layers=2),
                kv_cache=_spec(layout),
                options={"layers": "all"},
                created_at="2026-11-30T08:00:00+00:00",
                sources=stored,
            )
        )
        for item in _steps(req_a, req_b):
            if isinstance(item, GapRecord):
                writer.append(item)
                continue
            for layer in layers:
                writer.append(_record(*item, layer))
        if replay is not None:
            writer.write_json("replay.json", replay)
    return path


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory) -> Path:
    """The synthetic FlashAttention trace."""
    return make_trace(tmp_path_factory.mktemp("synthetic") / "trace")


@pytest.fixture(scope="module")
def report_dir(trace_dir, tmp_path_factory) -> Path:
    """The synthetic trace's report, built once."""
    out = tmp_path_factory.mktemp("report") / "site"
    write_report(trace_dir, out)
    return out


# --- what gets written --------------------------------------------------------------------


@needs_vllm_sources
def test_report_writes_every_page(report_dir):
    names = sorted(p.name for p in report_dir.iterdir())
    assert names == sorted(
        [
            ".pagedtrace-report",
            "index.html",
            "tour.html",
            "prefix.html",
            "style.css",
            "report.js",
            "src-attention.html",
            "src-flash_attn.html",
            "src-cpu_attn.html",
            "src-paged_attn.html",
            "src-block_table.html",
            "step-000000.html",
            "step-000002.html",
            "step-000003.html",
            "step-000004.html",
            "step-000006.html",
        ]
    )
    index = (report_dir / "index.html").read_text()
    # Relative links only: the site works from file:// and offline.
    for href in re.findall(r'(?:href|src)="([^"]+)"', index):
        assert not re.match(r"[a-z]+://", href), href
        target = href.split("#")[0]
        assert not target or (report_dir / target).is_file(), href


def test_step_pages_cap_keeps_request_steps_and_a_few_others():
    records = [_record(i, "warmup" if i < 10 else "request", [""], [1], [1], [[1]], L0) for i in range(20)]
    assert pages_for_steps(records) == set(range(MAX_OTHER_PAGES)) | set(range(10, 20))
    assert pages_for_steps(records, 4) == set(range(MAX_OTHER_PAGES)) | set(range(10, 14))


def test_index_says_when_steps_have_no_page(trace_dir, tmp_path):
    code, _out = run_cli(["report", str(trace_dir), "-o", str(tmp_path / "site"), "--max-step-pages", "1"])
    assert code == 0
    assert sorted(p.name for p in (tmp_path / "site").glob("step-*.html")) == ["step-000000.html", "step-000002.html"]
    assert "2 of 5 recorded steps have a page" in (tmp_path / "site" / "index.html").read_text()


def test_long_rows_are_elided():
    record = _record(7, "request", ["long"], [1], [40 * BS], [list(range(100, 140))], L0)
    page = step_view(record, layout_run(), (L0,), [], None, None, ())
    row = page.rows[0]
    assert len(row.cells) == 24 and row.elided == 16 and row.elide_at == 16
    assert row.cells[-1].block == 139 and row.cells[-1].written


# --- gold pages -------------------------------------------------------------------------


def mask(html: str, trace_dir: Path) -> str:
    """Mask what changes between runs: dates and the trace directory."""
    html = html.replace(str(trace_dir), "<TRACE>")
    return re.sub(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)?", "<DATE>", html)


def compare_gold(name: str, actual: str) -> None:
    """Compare with ``tests/gold/report/<name>``, or rewrite it when PAGEDTRACE_UPDATE_GOLD=1."""
    gold = GOLD / name
    if UPDATE_GOLD:
        gold.parent.mkdir(parents=True, exist_ok=True)
        gold.write_text(actual, encoding="utf-8")
        return
    assert gold.is_file(), f"no gold file {gold}; run with PAGEDTRACE_UPDATE_GOLD=1"
    expected = gold.read_text(encoding="utf-8")
    if actual != expected:
        diff = "".join(
            difflib.unified_diff(expected.splitlines(True), actual.splitlines(True), f"gold/{name}", "actual", n=2)
        )
        pytest.fail(f"{name} differs from gold (PAGEDTRACE_UPDATE_GOLD=1 to accept):\n{diff[:6000]}")


@needs_vllm_sources
@pytest.mark.parametrize("page", ["index.html", "tour.html", "step-000003.html", "src-paged_attn.html"])
def test_pages_match_gold(trace_dir, page):
    pages = render_site(build_site(Trace.open(trace_dir), reference=FAKE_REFERENCE))
    compare_gold(page, mask(pages[page], trace_dir))


# --- content ----------------------------------------------------------------------------


def test_step_view_marks_shared_and_written_blocks(trace_dir):
    trace = Trace.open(trace_dir)
    record = next(r for r in trace.records if r.step == 3)
    page = step_view(record, trace.run, (L0, L1), [], None, None, ())
    assert page.shared_blocks == "[1]"
    assert page.written_blocks == "[2, 3]"
    row_b = page.rows[1]
    assert (row_b.request_id, row_b.query_len, row_b.context_len, row_b.seq_len) == ("req-b", 8, 16, 24)
    first, second = row_b.cells
    assert first.block == 1 and first.shared and not first.written
    assert first.full and first.segments == ()
    assert second.block == 3 and second.written and [s.cls for s in second.segments] == ["new"]
    assert second.segments[0].width == "50"
    runs = [(r.request, r.block, r.offsets, r.slots) for r in slot_runs(record, BS)]
    assert runs == [(0, 2, "4", "36"), (1, 3, "0–7", "48–55")]


def layout_run(layout: str = "flash_nhd") -> RunInfo:
    """A RunInfo carrying only what step views and layouts read."""
    return run_info(
        "flash",
        device_name="test",
        attention_backend="FlashAttentionImpl",
        kv_cache=_spec(layout),
        created_at="2026-11-30T08:00:00+00:00",
    )


def test_layout_drawings():
    nhd = layout_view(_spec("flash_nhd"))
    assert [d.memory_rank for d in nhd.dims] == [0, 2, 1, 3]
    assert "K h0" in {b.label for b in nhd.boxes} and "token 0" in {b.label for b in nhd.boxes}
    cpu = layout_view(_spec("cpu"))
    assert {"K^T [64][16]", "V [16][64]"} <= {b.label for b in cpu.boxes}
    assert any("K^T[b, h][d][t]" in f for f in cpu.formulas)
    assert layout_view(None) is None


def _amx_spec() -> KVCacheSpec:
    return replace(
        _spec("cpu"),
        block_size=32,
        shape=(64, 2, 32, 128),
        stride=(8192, 4096, 128, 1),
        backend_kv_cache_shape=(64, 2, 32, 128),
        layout="cpu_amx",
        physical_order="(blocks, heads, [K | V] packed in AMX tiles)",
    )


def test_amx_layout_drawing_matches_the_reference_layout():
    view = layout_view(_amx_spec())
    labels = [b.label for b in view.boxes]
    assert {"K t0–15", "K t16–31", "V d0–15", "V d48–63", "head 0", "head 1"} <= set(labels)
    # In a tile: K pairs two dims of one token, V two tokens of one dim.
    k_zoom = labels[labels.index("in a tile") + 1 :][:6]
    assert k_zoom == ["t0 d0", "t0 d1", "t1 d0", "t1 d1", "t2 d0", "t2 d1"]
    assert "t0 d2" in labels and "t0 d15" in labels and "t2 d0" in labels
    # The printed formulas agree with the layout registry's element_offset.
    k_formula, v_formula = view.formulas
    assert k_formula.endswith("b*8192 + h*4096 + (t//16)*1024 + (d//2)*32 + (t%16)*2 + d%2")
    assert v_formula.endswith("b*8192 + h*4096 + 2048 + (d//16)*512 + (t//2)*32 + (d%16)*2 + t%2")
    for b, h, t, d in [(0, 0, 0, 1), (3, 1, 17, 5), (63, 1, 31, 63)]:
        for which, formula in (("k", k_formula), ("v", v_formula)):
            expr = formula.split(" at element ")[1]
            assert eval(expr, {"b": b, "h": h, "t": t, "d": d}) == element_offset(
                "cpu_amx", b, h, t, d, which, num_kv_heads=2, block_size=32, head_size=64
            )
    assert "no drawing" not in view.caption


def test_amx_layout_is_drawn_without_torch(monkeypatch):
    # The drawing reads the bottom layer's registry, never the torch-backed reference_impl.layouts.
    monkeypatch.setitem(sys.modules, "reference_impl.layouts", None)  # import raises ImportError
    view = layout_view(_amx_spec())
    assert view.boxes and len(view.formulas) == 2
    assert "[bs/16][D/2][16][2]" in view.caption and "no drawing" not in view.caption


def test_a_layout_the_registry_cannot_describe_is_not_drawn():
    # The AMX packing tiles by 16: a block size of 8 has no drawing, and the caption says why.
    spec = replace(_amx_spec(), block_size=8, shape=(64, 2, 8, 128), stride=(2048, 1024, 128, 1))
    view = layout_view(spec)
    assert view.boxes == () and "no drawing" in view.caption and "multiples of 16" in view.caption


def test_tour_highlights_the_lines_the_reference_kernel_marks(trace_dir):
    # The kernel carries the marks (``# tour: block`` / ``# tour: softmax``): losing them loses the tour.
    reference = load_reference_source()
    assert reference is not None
    _, text, start = reference
    shown, marks = tour_marks(text)
    assert {BLOCK_MARK, SOFTMAX_MARK} <= set(marks)
    assert "tour:" not in shown and len(shown.splitlines()) == len(text.splitlines())
    site = build_site(Trace.open(trace_dir), reference=reference)
    stops = {stop.id: stop.code for stop in site.tour.stops}
    for stop, mark in (("blocks", BLOCK_MARK), ("softmax", SOFTMAX_MARK)):
        wanted = {start + i for i, m in enumerate(marks) if m == mark}
        assert {line.number for line in stops[stop].lines if line.marked} == wanted, stop
    # The block loop is what the block stop marks, the running max/sum/accumulator what the softmax stop marks.
    marked = {
        m: [line.strip() for line, lm in zip(shown.splitlines(), marks, strict=True) if lm == m]
        for m in (BLOCK_MARK, SOFTMAX_MARK)
    }
    assert marked[BLOCK_MARK][0].startswith("for j in range") and any("block_table[" in x for x in marked[BLOCK_MARK])
    assert [x.split(" =")[0] for x in marked[SOFTMAX_MARK][:5]] == ["m_new", "rescale", "l", "acc", "m"]
    assert "acc / l" in marked[SOFTMAX_MARK][-1]


def test_replay_verdicts_are_read_tolerantly(trace_dir, tmp_path):
    replay = read_replay(Trace.open(trace_dir))
    assert replay.overall.status == "fail"
    assert sorted(replay.by_step) == [2, 3]
    assert [(r.label, r.value) for r in replay.checks] == [("write_path", "1 of 1 ok"), ("legacy", "none")]
    bad = make_trace(tmp_path / "bad", replay=None)
    (bad / "replay.json").write_text("{not json")
    unreadable = read_replay(Trace.open(bad))
    assert unreadable.overall.text == "not replayed" and "not valid JSON" in unreadable.problem
    missing = make_trace(tmp_path / "missing", replay=None, sources=False)
    assert read_replay(Trace.open(missing)).overall.text == "not replayed"
    # A file that parses but is not a replay report: not replayed, and the reason is listed.
    malformed = make_trace(
        tmp_path / "malformed", replay={**REPLAY, "steps": [*REPLAY["steps"], "not an entry"]}, sources=False
    )
    unusable = read_replay(Trace.open(malformed))
    assert unusable.overall.text == "not replayed" and "step result: expected an object" in unusable.problem
    # Non-finite errors come back as NaN and are shown as a dash.
    nan = make_trace(tmp_path / "nan", replay=replay_json(step_result(2, L0, False, math.nan, math.inf)), sources=False)
    (verdict,) = layer_verdicts(read_replay(Trace.open(nan)).by_step[2])
    assert (verdict.max_abs, verdict.max_rel, verdict.verdict.text) == ("–", "–", "FAIL (max abs –)")


def test_version_1_replay_json_still_reads(trace_dir, tmp_path):
    v1 = {k: v for k, v in REPLAY.items() if k != "format_version"} | {"skipped": 2}
    trace = make_trace(tmp_path / "v1", replay=v1, sources=False)
    replay = read_replay(Trace.open(trace))
    assert replay.present and replay.overall.status == "fail" and sorted(replay.by_step) == [2, 3]


@needs_vllm_sources
def test_step_page_shows_per_head_verdicts(report_dir):
    html = (report_dir / "step-000003.html").read_text()
    assert 'class="head verdict fail" title="max abs 0.5">head 2<' in html
    assert "not replayed" in (report_dir / "step-000004.html").read_text()


@needs_vllm_sources
def test_source_page_embeds_values_for_every_step(report_dir):
    html = (report_dir / "src-flash_attn.html").read_text()
    data = json.loads(re.search(r'<script type="application/json" id="pt-data">(.*?)</script>', html, re.S).group(1))
    assert data["steps"] == [0, 2, 3, 4, 6] and data["default"] == 2
    anchor = next(a for a in data["anchors"] if a["key"] == "flash_attn.forward.num_actual_tokens")
    assert [data["texts"][i][0] for i in anchor["steps"]] == [f"num_actual_tokens = {n}" for n in (16, 20, 9, 2, 7)]
    line = locate((SITE / FLASH_ATTN).read_text(), FLASH_ATTN).locations[anchor["key"]].line
    assert anchor["line"] == line
    assert f'id="line-{line}" class="l a"' in html


def test_report_without_sources_or_replay(tmp_path):
    trace = make_trace(tmp_path / "trace", replay=None, sources=False)
    write_report(trace, tmp_path / "site")
    index = (tmp_path / "site" / "index.html").read_text()
    assert "source not stored in this trace" in index
    assert "not replayed" in index
    assert not list((tmp_path / "site").glob("src-*.html"))


def test_report_of_a_truncated_trace_lists_the_problem(tmp_path):
    trace = make_trace(tmp_path / "trace", replay=None, sources=False)
    with open(trace / "steps.jsonl", "a") as f:
        f.write('{"type": "step", "step": 9')
    write_report(trace, tmp_path / "site")
    assert "truncated or malformed" in (tmp_path / "site" / "index.html").read_text()


@needs_vllm_sources
def test_cpu_trace_report(tmp_path):
    trace = make_trace(tmp_path / "trace", layout="cpu", replay=None)
    write_report(trace, tmp_path / "site")
    index = (tmp_path / "site" / "index.html").read_text()
    assert "K^T [64][16]" in index
    fa = (tmp_path / "site" / "src-flash_attn.html").read_text()
    assert "This trace ran CPUAttentionBackendImpl" in fa
    tour = (tmp_path / "site" / "tour.html").read_text()
    assert "cpu_attention_with_kv_cache" in tour


# --- the committed H200 traces ------------------------------------------------------------


@pytest.mark.parametrize("variant", ["eager", "piecewise", "default"])
def test_report_of_the_h200_fa3_traces(variant, tmp_path):
    """Real vLLM 0.26 FA3 traces from an H200: key facts reach the pages."""
    out = tmp_path / "site"
    trace = FIXTURES / f"h200-qwen2.5-7b-{variant}"
    if variant != "eager":  # only the eager fixture stores the (shared) vLLM sources
        trace = with_sources_of(trace, FIXTURES / "h200-qwen2.5-7b-eager", tmp_path / "trace")
    write_report(trace, out)
    index = (out / "index.html").read_text()
    assert "<th>FlashAttention version</th><td>FA3</td>" in index
    assert "<th>strides</th><td>(16384, 256, 1024, 1)</td>" in index
    assert "flash_nhd: (blocks, tokens, heads, K|V)" in index and "K h0" in index
    assert "no drawing" not in index
    # paged_attn.py is listed as off the 0.26 path; flash_attn.py as on it.
    files = dict(
        re.findall(r'<tr( class="offpath")?>\s*<td><a href="src-(\w+)\.html"', index)[i][::-1] for i in range(5)
    )
    assert files["paged_attn"] and files["cpu_attn"] and not files["flash_attn"]
    fa = (out / "src-flash_attn.html").read_text()
    assert "This trace ran" not in fa and "not this backend" not in fa
    paged = (out / "src-paged_attn.html").read_text()
    assert "Not called on vLLM 0.26" in paged and "x = 16 // 2 = 8" in paged
    assert "num_blocks = kv_cache.shape[1] = 4 (that is num_kv_heads" in paged
    assert "would fail in torch" in paged
    # The gaps: grouped by reason, consecutive runs on one row of the step list.
    gaps = index[index.index('<section id="gaps">') :]
    assert "<tr><td>1–12</td><td>12</td><td>warmup</td>" in gaps or variant == "eager"
    if variant == "default":
        assert "<tr><td>14, 16, 18, 20, 22, 24</td><td>6</td><td>warmup</td><td>[32, 16, 8, 4, 2, 1]</td>" in gaps
        assert "<tr><td>29–33</td><td>5</td><td>request</td><td>4 each</td>" in gaps
        assert "cudagraph_mode FULL_AND_PIECEWISE" in gaps and "cudagraph_mode PIECEWISE" in gaps
        assert '<tr class="gap"><td>29–33</td><td>request</td><td colspan="6">not recorded (5 steps)' in index
    else:
        assert "cuda-graph-replay" not in index
    # Without tensors there is nothing to replay; the pages say so instead of suggesting a replay.
    if variant != "eager":
        assert "not replayable: tensors not captured (recorded with --no-tensors)" in index
        step = next(out.glob("step-*.html")).read_text()
        assert "Not replayable: no tensors were captured" in step


@pytest.mark.parametrize("variant", ["piecewise", "default"])
def test_report_of_an_h200_trace_without_sources(variant, tmp_path):
    """The piecewise and default fixtures store no sources: the report says so, page by page."""
    trace = Trace.open(FIXTURES / f"h200-qwen2.5-7b-{variant}")
    assert trace.run.sources == {}
    out = tmp_path / "site"
    write_report(trace.path, out)
    index = (out / "index.html").read_text()
    assert "<th>FlashAttention version</th><td>FA3</td>" in index
    assert index.count("source not stored in this trace") == 5
    assert not list(out.glob("src-*.html"))


# --- escaping ---------------------------------------------------------------------------

EVIL_MODEL = '<script>alert("model")</script>'
EVIL_REQUEST = "<script>alert('request')</script>&\""
EVIL_LAYER = "layers.0</script><script>alert(1)</script>"


def test_untrusted_strings_render_inert(tmp_path):
    trace = make_trace(
        tmp_path / "trace",
        model=EVIL_MODEL,
        req_a=EVIL_REQUEST,
        layers=(EVIL_LAYER,),
        replay=replay_json(step_result(3, EVIL_LAYER, True)),
    )
    site = tmp_path / "site"
    write_report(trace, site)
    pages = {p.name: p.read_text() for p in site.glob("*.html")}
    for name, html in pages.items():
        assert "<script>alert" not in html, name
        # Only our own two script elements, ever.
        for tag in re.findall(r"<script[^>]*>", html):
            assert tag in ('<script type="application/json" id="pt-data">', '<script src="report.js">'), (name, tag)
    assert "&lt;script&gt;alert(&#34;model&#34;)&lt;/script&gt;" in pages["index.html"]
    assert "&lt;script&gt;alert(&#39;request&#39;)&lt;/script&gt;&amp;&#34;" in pages["step-000003.html"]
    if SITE is not None:
        html = pages["src-attention.html"]
        raw = re.search(r'<script type="application/json" id="pt-data">(.*?)</script>', html, re.S).group(1)
        data = json.loads(raw)
        assert any(EVIL_LAYER in text for text, _ in data["texts"])


# --- the commands -----------------------------------------------------------------------


def run_cli(argv: list[str]) -> tuple[int, str]:
    """Run ``pagedtrace`` in-process; return (exit code, printed text)."""
    console = Console(file=io.StringIO(), width=300, record=True, color_system=None)
    code = cli.main(argv, console=console, errors=console)
    return code, console.export_text()


def test_report_command(trace_dir, tmp_path):
    code, out = run_cli(["report", str(trace_dir), "-o", str(tmp_path / "site")])
    assert code == 0
    assert f"report written: {tmp_path / 'site' / 'index.html'}" in out
    assert (tmp_path / "site" / "index.html").is_file()


@pytest.mark.parametrize(
    "argv",
    [
        ["report", "{missing}", "-o", "{out}"],
        ["annotate", "flash_attn.py", "--trace", "{missing}"],
    ],
)
def test_bad_trace_path_is_a_one_line_error(tmp_path, argv):
    argv = [a.format(missing=tmp_path / "missing", out=tmp_path / "site") for a in argv]
    code, out = run_cli(argv)
    assert code == 2
    assert out.strip().count("\n") == 0 and out.startswith("error:") and "not a trace directory" in out


@needs_vllm_sources
def test_annotate_command_prints_values_beside_lines(trace_dir):
    code, out = run_cli(["annotate", "flash_attn.py", "--trace", str(trace_dir), "--step", "3", "--context", "0"])
    assert code == 0
    assert "vllm/v1/attention/backends/flash_attn.py  step 3" in out
    line = next(l for l in out.splitlines() if "num_actual_tokens = attn_metadata.num_actual_tokens" in l)
    assert "num_actual_tokens: num_actual_tokens = 9" in line
    code, out = run_cli(["annotate", "vllm/v1/attention/ops/paged_attn.py", "--trace", str(trace_dir)])
    assert code == 0 and "x = 16 // 2 = 8" in out


def test_annotate_command_rejects_unknown_files_and_steps(trace_dir):
    code, out = run_cli(["annotate", "nope.py", "--trace", str(trace_dir)])
    assert code == 2 and "valid names" in out and PAGED_ATTN in out
    if SITE is not None:
        code, out = run_cli(["annotate", "flash_attn.py", "--trace", str(trace_dir), "--step", "5"])
        assert code == 2 and "step 5 was not recorded" in out


# --- values on the line, three slot cases, links, the walked tour, -o, unrecorded steps ---


def _pt_data(html: str) -> dict:
    return json.loads(re.search(r'<script type="application/json" id="pt-data">(.*?)</script>', html, re.S).group(1))


@needs_vllm_sources
def test_source_lines_show_the_value_alone_and_the_panel_the_label(report_dir):
    html = (report_dir / "src-flash_attn.html").read_text()
    line = locate((SITE / FLASH_ATTN).read_text(), FLASH_ATTN).locations["flash_attn.forward.num_actual_tokens"].line
    row = re.search(rf'<div id="line-{line}" class="l a">.*?</div>', html).group(0)
    # The value itself, not "label: value" (the label is in the tooltip and the panel).
    assert '">num_actual_tokens = 20</span>' in row and 'title="num_actual_tokens: num_actual_tokens = 20"' in row
    paged = (report_dir / "src-paged_attn.html").read_text()
    assert "x: computed:" not in paged and "computed: what this line gives for the captured cache: x" not in paged
    assert '">x = 16 // 2 = 8 (element size 2 B, bfloat16)</span>' in paged
    x = next(a for a in _pt_data(paged)["anchors"] if a["label"] == "x")
    assert x["preamble"] == "computed: what this line gives for the captured cache"
    # Panel rows and notes name requests by id: a reordered batch does not read as a changed table.
    texts = [t for t, _ in _pt_data(html)["texts"]]
    assert "block_table (2 rows): req-a [1, 2]; req-b [1, 3]" in texts
    css = (report_dir / "style.css").read_text()
    rule = re.search(r"\.code \.v \{([^}]*)\}", css).group(1)
    assert "ellipsis" not in rule and "overflow: hidden" not in rule and "pre-wrap" in rule
    assert "scroll-margin-top" in re.search(r"\.code \.l \{([^}]*)\}", css).group(1)


def test_step_view_tells_the_three_slot_cases_apart():
    # req-a prefills block 1 in this step; req-b's first 16 tokens are that block (a prefix cached at
    # schedule time): in req-b's row they were written in this step, by another row, not cached before.
    record = _record(9, "request", ["req-a", "req-b"], [20, 4], [20, 20], [[1, 2], [1, 3]], L0)
    record = replace(record, slot_mapping=(*range(16, 36), *range(48, 52)))
    page = step_view(record, layout_run(), (L0,), [], None, None, ())
    row_a, row_b = page.rows
    assert [(s.cls, s.width) for s in row_a.cells[0].segments] == [("new", "100")]
    assert [(s.cls, s.width) for s in row_b.cells[0].segments] == [("other", "100")]
    assert "16 written in this step by row 0" in row_b.cells[0].title and not row_b.cells[0].full
    assert [(s.cls, s.width) for s in row_b.cells[1].segments] == [("new", "25")]
    # A block of the context nobody writes now stays "cached before this step".
    later = _record(10, "request", ["req-a", "req-b"], [1, 1], [21, 21], [[1, 2], [1, 3]], L0)
    cell = step_view(later, layout_run(), (L0,), [], None, None, ()).rows[1].cells[0]
    assert cell.full and "16 cached before this step" in cell.title


@needs_vllm_sources
def test_step_and_source_pages_link_each_other(report_dir):
    step = (report_dir / "step-000003.html").read_text()
    assert '<a href="src-flash_attn.html#step-3">flash_attn.py</a>' in step
    assert "written by another row in this step" in step
    source = (report_dir / "src-flash_attn.html").read_text()
    assert '<p id="pt-step-page"><a href="step-000002.html">step 2: block table, slots, verdicts</a></p>' in source
    assert _pt_data(source)["pages"] == [step_page(s) for s in (0, 2, 3, 4, 6)]


def _walk() -> QueryWalk:
    blocks = tuple(
        BlockLine(
            j, phys, (16 * j, 16 * j + n), n, n, block_max=1.0 + j, m=1.5 + j, l=2.0 + j, rescale=0.5, acc_norm=3.0
        )
        for j, (phys, n) in enumerate([(1, 16), (3, 5)])
    )
    return QueryWalk(
        "trace",
        3,
        L0,
        "req-b",
        1,
        7,
        20,
        0,
        0,
        21,
        BS,
        0.125,
        "float64",
        blocks,
        (),
        32,
        (),
        0.0,
        0.0,
        1.0,
        1.0,
        0.001,
        0.01,
        (),
        (),
    )


def test_tour_shows_the_walked_values_beside_the_loop(trace_dir):
    site = build_site(Trace.open(trace_dir), reference=FAKE_REFERENCE, walk=_walk())
    stops = {stop.id: stop for stop in site.tour.stops}
    lines = {"".join(t.text for t in line.tokens).strip(): line.values for line in stops["blocks"].code.lines}
    assert lines["physical = int(block_table[b, j])"] == "physical  j=0: 1, j=1: 3"
    assert lines["for j in range(num_blocks):"].startswith("j = 0 … 1: 2 blocks for seq_len 21")
    soft = {"".join(t.text for t in line.tokens).strip(): line.values for line in stops["softmax"].code.lines}
    assert soft["m_new = torch.maximum(m, s.amax(dim=-1))"] == "m  j=0: 1.5, j=1: 2.5"
    assert soft["l = rescale * l + p.sum(dim=-1)"] == "l  j=0: 2, j=1: 3"
    walk = stops["blocks"].code.walk
    assert "request req-b (block-table row 1), query 7 at position 20" in walk.caption
    assert [(r.j, r.physical, r.n_valid) for r in walk.rows] == [("0", "1", "16"), ("1", "3", "5")]
    html = render_site(site)["tour.html"]
    assert '<span class="note k-captured">physical  j=0: 1, j=1: 3</span>' in html
    assert "No trace values beside the loop" not in html


#: ``python -c`` that runs ``pagedtrace ARGV`` with torch and vLLM unimportable (a meta-path finder refuses them).
NO_TORCH = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "vllm"):
            raise ImportError(f"{name} is blocked in this test")
sys.meta_path.insert(0, Refuse())
from pagedtrace.cli import main
code = main(sys.argv[1:])
print("TORCH", "torch" in sys.modules)
sys.exit(code)
"""


def _tour_command(tour: str) -> list[str]:
    """The ``pagedtrace step`` line the tour shows, as argv (after ``pagedtrace``)."""
    found = re.search(r"<code>pagedtrace (step [^<]*)</code>", tour)
    assert found, "the tour shows no pagedtrace step command"
    return shlex.split(unescape(found.group(1)))


def test_report_builds_without_torch_and_shows_the_walk_replay_kept(tmp_path):
    trace = tmp_path / "trace"
    shutil.copytree(FIXTURES / "h200-qwen2.5-7b-eager", trace)
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-c", NO_TORCH, "report", str(trace), "-o", str(site)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("TORCH False")
    tour = (site / "tour.html").read_text()
    # Not replayed yet: the tour names the command that walks a query, and that command runs.
    found = re.search(r"No trace values beside the loop yet: pagedtrace (replay [^ ]+) walks", tour)
    assert found, tour
    code, out = run_cli(shlex.split(unescape(found.group(1))))
    assert code == 0, out
    assert (trace / "walk.json").is_file()
    proc = subprocess.run(
        [sys.executable, "-c", NO_TORCH, "report", str(trace), "-o", str(site)], capture_output=True, text=True
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("TORCH False"), proc.stderr
    tour = (site / "tour.html").read_text()
    # Step 4 is the prefill; its longest row is request 3-aa55e2f0 (56 tokens: 4 blocks).
    assert "step 4, layer model.layers.0.self_attn.attn, request 3-aa55e2f0" in tour
    assert re.search(r"physical  j=0: \d+, j=1: \d+, j=2: \d+, j=3: \d+<", tour)
    assert re.search(r"n_valid  j=0: 16, j=1: 16, j=2: 16, j=3: 8<", tour)
    assert "(within replay&#39;s bar" in tour
    argv = _tour_command(tour)
    assert argv == ["step", str(trace), "--step", "4", "--request", "3-aa55e2f0", "--head", "0"]
    code, out = run_cli(argv)  # the tour's command runs as printed
    assert code == 0 and "vLLM's output, head 0" in out, out


def test_the_tours_commands_are_spelled_by_the_cli_parser():
    from pagedtrace.cli import command_line

    assert (
        command_line("step", "t", step=4, request="3-a", head=0) == "pagedtrace step t --step 4 --request 3-a --head 0"
    )
    assert command_line("step", "t", step=4, request="3-a") == plain_command("step", "t", step=4, request="3-a")
    with pytest.raises(ValueError, match="no option"):
        command_line("step", "t", stepp=4)
    with pytest.raises(ValueError, match="refuses"):
        command_line("step", "t", head=0)  # --step and --request are required


def test_the_prefix_page_has_the_nav_bar_and_is_linked_from_the_index_and_steps_with_a_hit(tmp_path):
    out = tmp_path / "site"
    write_report(FIXTURES / "h200-qwen2.5-7b-eager", out)
    prefix = (out / "prefix.html").read_text()
    assert "<nav>" in prefix and '<a href="index.html">index</a>' in prefix and 'href="style.css"' in prefix
    assert '<a href="prefix.html">prefix cache</a>' in (out / "index.html").read_text()
    hits = {
        e.first_step
        for e in explain_prefix_cache(Trace.open(FIXTURES / "h200-qwen2.5-7b-eager"))
        if e.cached_tokens > 0
    }
    assert hits
    for page in sorted(out.glob("step-*.html")):
        step = int(page.stem.split("-")[1])
        linked = "the prefix-cache hits of this step" in page.read_text()
        assert linked == (step in hits), page.name


def test_report_refuses_a_foreign_directory_and_cleans_its_own(trace_dir, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("mine")
    code, out = run_cli(["report", str(trace_dir), "-o", str(foreign)])
    assert code == 2 and out.startswith("error:") and out.strip().count("\n") == 0
    assert "not a pagedtrace report" in out and "--force" in out
    assert sorted(p.name for p in foreign.iterdir()) == ["thesis.tex"]
    code, _ = run_cli(["report", str(trace_dir), "-o", str(foreign), "--force"])
    assert code == 0 and (foreign / "index.html").is_file() and (foreign / "thesis.tex").read_text() == "mine"
    # An earlier report: rebuilt in place, its stale step pages removed, other files left alone.
    site = tmp_path / "site"
    assert run_cli(["report", str(trace_dir), "-o", str(site)])[0] == 0
    (site / "notes.txt").write_text("keep")
    assert (site / "step-000006.html").is_file()
    assert run_cli(["report", str(trace_dir), "-o", str(site), "--max-step-pages", "1"])[0] == 0
    assert sorted(p.name for p in site.glob("step-*.html")) == ["step-000000.html", "step-000002.html"]
    assert (site / "notes.txt").read_text() == "keep"
    marker = json.loads((site / ".pagedtrace-report").read_text())
    assert "step-000006.html" not in marker["files"] and "index.html" in marker["files"]


def test_report_open_opens_the_index_in_a_browser(trace_dir, tmp_path, monkeypatch):
    opened = []
    monkeypatch.setattr("webbrowser.open", lambda url, *a, **k: opened.append(url) or True)
    code, _ = run_cli(["report", str(trace_dir), "-o", str(tmp_path / "site"), "--open"])
    assert code == 0 and opened == [(tmp_path / "site" / "index.html").resolve().as_uri()]


def test_report_replay_shows_verdicts_without_writing_into_the_trace(tmp_path):
    trace = tmp_path / "trace"
    shutil.copytree(FIXTURES / "h200-qwen2.5-7b-eager", trace)
    before = sorted(p.relative_to(trace) for p in trace.rglob("*"))
    code, out = run_cli(["report", str(trace), "-o", str(tmp_path / "site"), "--replay"])
    assert code == 0 and "replay (in memory, not saved): all replayed steps agree" in out
    assert sorted(p.relative_to(trace) for p in trace.rglob("*")) == before  # no replay.json
    index = (tmp_path / "site" / "index.html").read_text()
    assert "all replayed steps agree" in index and "(from a replay run by pagedtrace report --replay" in index
    assert 'class="verdict ok">ok' in (tmp_path / "site" / "step-000005.html").read_text()


def test_steps_with_no_record_and_no_gap_are_explained(tmp_path):
    out = tmp_path / "site"
    write_report(FIXTURES / "h200-qwen2.5-7b-eager", out)
    index = (out / "index.html").read_text()
    assert '<tr class="gap unrecorded"><td>3</td>' in index
    assert "step 3: after the warm-up batch of step 2: the V2 runner ends its warm-up" in index
    # Between request steps: the step that hands the worker the finished requests' ids.
    trace = tmp_path / "trace"
    with TraceWriter(trace) as writer:
        writer.write_manifest(layout_run())
        writer.append(_record(1, "request", ["a", "b"], [1, 1], [20, 30], [[1, 2], [3, 4]], L0))
        writer.append(_record(3, "request", ["b"], [1], [31], [[3, 4]], L0))
    (explained,) = unrecorded_steps(Trace.open(trace))
    assert explained.step == 2 and explained.why.startswith("request a finished in step 1: the scheduler's next step")


# --- in a real browser ------------------------------------------------------------------

CHROMIUM = Path("/usr/bin/chromium")


def chromium(args: list[str], profile: Path) -> subprocess.CompletedProcess:
    """Run headless chromium with a throwaway profile and nothing reaching out to the network."""
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={profile}",
    ]
    return subprocess.run([str(CHROMIUM), *flags, *args], capture_output=True, text=True, timeout=120)


def png_is_blank(path: Path) -> bool:
    """True when the screenshot has (almost) one colour."""
    try:
        from PIL import Image, ImageStat
    except ImportError:
        return path.stat().st_size < 20_000
    with Image.open(path) as image:
        return max(ImageStat.Stat(image.convert("L")).stddev) < 5


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium")
@needs_vllm_sources
def test_report_in_headless_chromium(report_dir, tmp_path):
    page = report_dir / "src-flash_attn.html"
    line = locate((SITE / FLASH_ATTN).read_text(), FLASH_ATTN).locations["flash_attn.forward.num_actual_tokens"].line
    url = f"{page.as_uri()}#line-{line},step-3"
    proc = chromium(["--enable-logging=stderr", "--v=0", "--dump-dom", url], tmp_path / "profile")
    console_lines = [l for l in proc.stderr.splitlines() if "CONSOLE" in l or "Uncaught" in l]
    assert console_lines == []
    dom = proc.stdout
    panel = re.search(r'<div id="pt-panel-body">(.*?)</div>\s*<h3>Anchors', dom, re.S).group(1)
    assert f"num_actual_tokens  (line {line})" in panel
    assert '<tr class="current"><th>step 3 (request)</th><td class="val k-captured">num_actual_tokens = 9' in panel
    selected = re.search(rf'<div id="line-{line}" class="l a sel">.*?</div>', dom, re.S).group(0)
    # The value itself is in the line's element (not only in the panel), for the hash's step.
    note = re.search(r'<span class="v">(.*?)</span></span>', selected, re.S).group(1)
    assert note.endswith(">num_actual_tokens = 9") and "num_actual_tokens: " not in note.split(">")[-1]
    assert '<p id="pt-step-page"><a href="step-000003.html">step 3: block table, slots, verdicts</a></p>' in dom

    # Screenshots of the source page (at step 3) and of a step page: not blank. (Headless
    # --screenshot paints a page scrolled to a #line fragment as blank, with or without our CSS.)
    shots = (("source", f"{page.as_uri()}#step-3"), ("step", (report_dir / "step-000003.html").as_uri()))
    for name, target in shots:
        shot = tmp_path / f"{name}.png"
        proc = chromium(["--window-size=1400,900", f"--screenshot={shot}", target], tmp_path / "profile")
        assert shot.is_file(), proc.stderr[-2000:]
        assert not png_is_blank(shot), name
    step_dom = chromium(["--dump-dom", (report_dir / "step-000003.html").as_uri()], tmp_path / "profile").stdout
    assert 'href="src-flash_attn.html#step-3"' in step_dom and 'class="seg new"' in step_dom

    shot = tmp_path / "index.png"
    proc = chromium(
        ["--window-size=1280,900", f"--screenshot={shot}", (report_dir / "index.html").as_uri()], tmp_path / "profile"
    )
    assert shot.is_file(), proc.stderr[-2000:]
    assert not png_is_blank(shot)


@pytest.mark.engine
def test_report_from_a_real_cpu_trace(cpu_trace, tmp_path):
    """The report of the shared real-engine trace: every anchor found, a page per request step."""
    trace = Trace.open(cpu_trace)
    out = tmp_path / "site"
    write_report(cpu_trace, out)
    index = (out / "index.html").read_text()
    assert "anchors found" in index and "source not stored" not in index
    for path in trace.run.sources:
        assert locate(trace.source(path), path).missing == []
    for record in trace.steps(kind="request"):
        assert (out / f"step-{record.step:06d}.html").is_file()
    # The drawing and the CPU file's role follow the recorded packing (cpu or cpu_amx).
    assert "no drawing" not in index
    layout = trace.run.kv_cache.layout
    cpu = (out / "src-cpu_attn.html").read_text()
    assert f"this trace: layout {layout}" in cpu
    assert ("K^T [" in cpu) == (layout == "cpu")
